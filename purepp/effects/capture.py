"""CUDA-graph capture of a plan: a steady batch replays with one graph launch.

What is captured. A plan's batch splits into a *prefix*, a *device segment* and a
*suffix*. The segment runs from the first to the last effect that queues graph work
(Allocate, Broadcast, PadColumns, StackRows, GatherRows, ScatterRows, Pack), extended
back over the CopyHostToDevice effects right before it (their copies are staged into
static buffers); it may also hold CopyHostToDevice, Unpack and effects that only change
names (Release, Alias, RecordStream). A plan is captured only if:
- all its device work is on one stream S, and every broadcast runs over an NCCL group;
- no stream ordering (WaitStream, WaitEvent, RecordEvent, ForgetEvent) and no host
  work (AllReduce, WaitWork, NoteDecision, CheckHeader, Synchronize) sits inside the
  segment: they run, as eager runs them, before or after the whole segment (so a receive
  never makes main wait for its broadcast: the consume's WaitEvent, ring_depth steps
  later, does).
The relay's receive, send and draft-scatter batches have this shape (a consume's
CopyHostToDevice before its WaitEvent runs in the prefix). Anything else runs as a plan.

How a replay runs (all on S, with no host sync):
1. the prefix is performed as eager would (waits on other streams, host copies);
2. an instance is picked (below), captured first if none fits and fewer than `copies`
   exist; if none can be had, the rest of the batch runs as the plan;
3. inputs the segment only reads are copied into the instance's static buffers (one
   `_foreach_copy_` per dtype: one launch for several inputs); the host arrays of
   CopyHostToDevice go through fresh pinned staging with a non-blocking copy into
   their static device buffers (both outside the graph);
4. the graph is launched on S (a graph that captured no node, such as a one-rank
   NCCL broadcast in place, is not launched);
5. the names are bound as eager would bind them, to the instance's static outputs
   (views included), released names are dropped, and an input's RecordStream runs by
   eager's handler;
6. the suffix is performed as eager would (record events on S, after the replay); an
   Unpack of a wire the segment made binds views made once per instance.
Inputs the segment writes in place (a ScatterRows target, a broadcast's receive
buffer), directly or through an Unpack's view of them, are baked into the graph: a run
replays only if that input is the very tensor captured. So are inputs only read whose
tensor stays (the one the plan was lowered with, or another instance's static output,
such as the drafts a consume scatters): held weakly, so baking never keeps another
instance busy. A copied input read after the graph writes a baked one is a copy taken
before that write: a run where the two share memory runs as the plan. A name the
segment binds anew over a slot still in use (an input it read, then released) gets a
slot of its own; an Alias reads and writes its source's.

Static memory is rewritten on S by a later replay of the same instance, once no name
holds it, so every stream that uses it must be ordered before that replay. Eager
declares a use on another stream by RecordStream, after which the allocator frees the
buffer only once that stream is past it; a replay keeps that promise only if S waits for
the stream first. So a plan is captured only if every stream its batch records static
memory on is S or one its prefix makes S wait for (WaitStream), as the relay's batches
do: each receive and send begins with WaitStream(relay, main), so a receive's outputs
read on main at consume are read before the relay stream writes them again. Those
RecordStreams are skipped (the allocator never reuses static memory). Any later
RecordStream of static memory (or a view of it), by eager's handler or inside another
graph's segment, on any other stream stops that plan's replays: it runs eager's
handlers, with fresh memory, from then on (`Planner.recorded`).

Outputs outlive the step. The relay keeps what it receives for `ring_depth` steps, so
a replay must not overwrite outputs that are still in use. Each plan keeps up to
`copies` graph instances (pass ring_depth + 1), each with its own static outputs, and
a run uses an instance none of whose outputs (or static views) is referenced outside
it any more: their Python reference counts and storage use counts are back to what
they were right after capture. If all are still in use, the run falls back to the
plan, so outputs are never overwritten while held; a too-small `copies` costs speed,
not correctness. (A caller that keeps a view it made itself of an output, past that
output's release, is not seen: release views with their buffers.)

Capture happens the first time an instance is needed: the plan's first (eager) run
was the warm-up (NCCL communicators and kernels initialised); `torch.cuda.graph`
synchronises the device while it captures, so steady steps are the ones after the
`copies` captures. NCCL collectives are captured with capture_error_mode
"thread_local", so the NCCL watchdog thread's queries do not invalidate the capture.
Recording the graph is `_record`; tests on CPU emulate it to check everything around it.
"""

from __future__ import annotations

import sys
import typing
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias

import attrs
import torch
import torch.distributed as dist

from purepp.effects.plan import Name, Plan
from purepp.effects.torch_kernels import (
    pack,
    pad_columns,
    scatter_rows,
    section_view,
    torch_dtype,
)
from purepp.effects.vocabulary import (
    Alias,
    Allocate,
    AllReduce,
    Broadcast,
    BufferRef,
    CheckHeader,
    CopyHostToDevice,
    Effect,
    ForgetEvent,
    GatherRows,
    NoteDecision,
    Pack,
    PadColumns,
    RecordEvent,
    RecordStream,
    Release,
    ScatterRows,
    Section,
    StackRows,
    Stream,
    Synchronize,
    Unpack,
    WaitEvent,
    WaitStream,
    WaitWork,
)

if TYPE_CHECKING:
    from purepp.effects.torch_interpreter import TorchInterpreter

__all__ = ["Kernel", "Slots", "replay"]

Slots: TypeAlias = dict[int, torch.Tensor]  # position -> tensor, while capturing
Kernel: TypeAlias = Callable[[Slots], None]


@attrs.frozen
class _Bind:
    """After a replay: bind position `out` to the static output in slot `source`."""

    out: int
    source: int


@attrs.frozen
class _Alias:
    """After a replay: bind position `out` to what position `source` is bound to."""

    out: int
    source: int


@attrs.frozen
class _Drop:
    """After a replay: unbind position `position` (a Release in the segment)."""

    position: int


@attrs.frozen
class _Eager:
    """After a replay: the effect at `index` by eager's handler, no device work (an
    Unpack's views; a RecordStream of an input, which may be another graph's static
    output: the handler tells the planner, `Planner.recorded`)."""

    index: int


_NameOp: TypeAlias = _Bind | _Alias | _Drop | _Eager

# The name ops as (tag, a, b) int triples, for the replay's loop (`_compiled`).
_BIND_SLOT, _BIND_NAME, _DROP, _EAGER = range(4)


def _compiled(ops: tuple[_NameOp, ...]) -> tuple[tuple[Any, ...], ...]:
    """`ops` as tagged triples: bind out from a slot or from a name, drop, eager's handler."""
    out: list[tuple[Any, ...]] = []
    for op in ops:
        match op:
            case _Bind():
                out.append((_BIND_SLOT, op.out, op.source))
            case _Alias():
                out.append((_BIND_NAME, op.out, op.source))
            case _Drop():
                out.append((_DROP, op.position, 0))
            case _Eager():
                out.append((_EAGER, op.index, 0))
            case _:
                typing.assert_never(op)
    return tuple(out)


@attrs.define
class _Instance:
    """One captured graph and its static buffers."""

    launch: Callable[[], None]  # replays the graph on the current stream (or nothing if empty)
    slots: Slots  # every position's tensor at the end of the capture (inputs included)
    # output position -> (Python refcount, storage use count) right after capture: more
    # means a name, a caller or a view still holds it
    baseline: dict[int, tuple[int, int]]
    steady: dict[int, weakref.ref[torch.Tensor]]  # the steady inputs it was captured with


@attrs.define
class _Capturable:
    """A plan's analysis for capture, and its graph instances."""

    stream: Stream  # S: the stream of all device work
    first: int  # index of the first effect of the segment
    last: int  # index of its last effect
    kernels: list[Kernel]  # the segment's device work over slots, in order
    copied: tuple[int, ...]  # input positions only read: copied into static buffers
    # copied inputs read after the graph wrote a baked input: a run where one shares
    # memory with a baked input runs as the plan (the copy would miss that write)
    late: tuple[int, ...]
    baked: tuple[int, ...]  # input positions written in place or viewed: must be identical
    # inputs only read but baked all the same (see `_steady`); an instance holds them
    # weakly, so baking another graph's output does not hold that graph's instance
    steady: tuple[int, ...]
    # (effect index, position, shape) of each CopyHostToDevice: copied in before the replay
    host: tuple[tuple[int, int, tuple[int, ...]], ...]
    made: tuple[int, ...]  # slots the segment binds to its own tensors (`_Segment.key`)
    name_ops: tuple[_NameOp, ...]  # the segment's changes to names, replayed after the graph
    compiled: tuple[tuple[Any, ...], ...]  # the same as tagged triples (`_compiled`)
    cuda_stream: torch.cuda.Stream | None  # S itself (None on CPU, in tests)
    # copied inputs the batch itself records on S (RecordStream): no second record
    recorded: frozenset[int]
    # Unpacks after the segment of a source it made (the received wire): views of static
    # memory, made once per instance and bound after each replay. Effect index -> the
    # source position and each section's position.
    static_views: dict[int, tuple[int, tuple[tuple[int, Section], ...]]]
    # RecordStreams after the segment of static memory (its outputs and their views),
    # which the allocator never reuses: nothing to record
    skipped: frozenset[int]
    plan: Plan  # the plan it was analysed from
    # S and the streams the prefix makes S wait for (WaitStream): a static output used
    # on one of these (RecordStream) is read before the next replay rewrites it
    ordered: frozenset[Stream]
    instances: list[_Instance] = attrs.Factory(list)
    turn: int = 0  # the instance tried first next time
    # `copied` by dtype, from the first staging (a prefix may bind some of them)
    copy_groups: tuple[tuple[int, ...], ...] | None = None


def replay(
    interp: TorchInterpreter,
    plan: Plan,
    effects: tuple[Effect, ...],
    names: list[Name],
    *,
    copies: int,
) -> bool | None:
    """Perform this batch by replaying a CUDA graph of `plan` (True), or run as the plan
    when every instance is still held (False); None: the plan cannot be captured, and
    nothing was performed."""
    capturable = plan.capture
    if capturable is None:
        capturable = _analyse(interp, plan, names)
        if capturable is None:
            plan.uncapturable = True
            return None
        plan.capture = capturable
    stream = capturable.cuda_stream  # None only on CPU, in tests, with `_record` emulated
    handlers = plan.handlers
    try:
        # The prefix first: it may bind what the segment reads (a CopyHostToDevice).
        for index in range(capturable.first):
            handlers[index](effects[index])
        late = capturable.late
        instance = (
            None
            if late and _shares_baked(interp.env.buffers, capturable, names)
            else _free_instance(interp, capturable, names, copies)
        )
        if instance is None:
            for index in range(capturable.first, len(effects)):
                handlers[index](effects[index])
            return False
        interp.on_stream(capturable.stream)
        slots = instance.slots
        _stage(interp, capturable, slots, effects=effects, names=names, stream=stream)
        instance.launch()
        _rebind(interp, capturable, slots, plan=plan, effects=effects, names=names)
        static_views, skipped = capturable.static_views, capturable.skipped
        for index in range(capturable.last + 1, len(effects)):
            if index in skipped:
                continue
            if index not in static_views or not _bind_views(
                interp, slots, static_views[index][1], names
            ):
                handlers[index](effects[index])
    finally:
        interp.restore_stream()
    return True


def _bind_views(
    interp: TorchInterpreter,
    slots: Slots,
    sections: tuple[tuple[int, Section], ...],
    names: list[Name],
) -> bool:
    """Bind an Unpack's names to the instance's views; False: a name is taken, so the
    eager handler runs (and raises what eager raises)."""
    env = interp.env
    buffers, pending = env.buffers, env.pending_results
    refs = [typing.cast(BufferRef, names[q]) for q, _ in sections]
    if any(ref in buffers or ref in pending for ref in refs):
        return False
    for ref, (q, _) in zip(refs, sections, strict=True):
        buffers[ref] = slots[q]
    return True


def _stage(
    interp: TorchInterpreter,
    capturable: _Capturable,
    slots: Slots,
    *,
    effects: tuple[Effect, ...],
    names: list[Name],
    stream: torch.cuda.Stream | None,
) -> None:
    """Before a replay, on S: the read inputs and the host arrays into the static buffers."""
    buffers = interp.env.buffers
    cuda = stream is not None
    recorded = capturable.recorded
    groups = capturable.copy_groups
    if groups is None:
        # Every later run binds the same dtypes there: the plan's guard holds its inputs'
        # layouts, and the batch's own effects fix the dtypes of what it binds itself.
        by_dtype: dict[torch.dtype, list[int]] = {}
        for position in capturable.copied:
            dtype = buffers[typing.cast(BufferRef, names[position])].dtype
            by_dtype.setdefault(dtype, []).append(position)
        groups = capturable.copy_groups = tuple(tuple(group) for group in by_dtype.values())
    for group in groups:
        tensors = [buffers[typing.cast(BufferRef, names[p])] for p in group]
        if len(group) == 1:
            slots[group[0]].copy_(tensors[0], non_blocking=True)
        else:
            # One launch for inputs of one dtype, where a copy_ each is a launch each
            # (three copies on the H200 host: 22-24 µs by copy_, 7.5 µs by one call).
            torch._foreach_copy_([slots[p] for p in group], tensors, non_blocking=True)
        if stream is not None:
            for position, tensor in zip(group, tensors, strict=True):
                if position not in recorded:
                    tensor.record_stream(stream)  # read on S: keep it until S is past it
    for index, position, _ in capturable.host:
        source = typing.cast(CopyHostToDevice, effects[index]).source
        if cuda:
            # Pinned staging: the copy does not block the host (the caching host
            # allocator keeps the staging memory until the copy on S has run).
            staging = torch.empty(source.shape, dtype=torch.int32, pin_memory=True)
            staging.numpy()[...] = source
            slots[position].copy_(staging, non_blocking=True)
        else:
            slots[position].copy_(torch.from_numpy(source.copy()))


def _rebind(
    interp: TorchInterpreter,
    capturable: _Capturable,
    slots: Slots,
    *,
    plan: Plan,
    effects: tuple[Effect, ...],
    names: list[Name],
) -> None:
    """After a replay: the segment's changes to names, as eager would make them."""
    buffers: dict[Any, torch.Tensor] = interp.env.buffers
    for tag, first, second in capturable.compiled:
        if tag == _BIND_SLOT:
            buffers[names[first]] = slots[second]
        elif tag == _BIND_NAME:
            buffers[names[first]] = buffers[names[second]]
        elif tag == _DROP:
            del buffers[names[first]]
        else:  # _EAGER
            plan.handlers[first](effects[first])


def _shares_baked(
    buffers: dict[Any, torch.Tensor], capturable: _Capturable, names: list[Name]
) -> bool:
    """Whether a late read input of this run shares memory with a baked input."""
    baked = {buffers[names[p]].untyped_storage()._cdata for p in capturable.baked}
    return any(buffers[names[p]].untyped_storage()._cdata in baked for p in capturable.late)


def _free_instance(
    interp: TorchInterpreter, capturable: _Capturable, names: list[Name], copies: int
) -> _Instance | None:
    """An instance whose outputs nobody holds and whose baked inputs are this run's."""
    buffers: dict[Any, torch.Tensor] = interp.env.buffers
    count = len(capturable.instances)
    for offset in range(count):
        index = (capturable.turn + offset) % count
        instance = capturable.instances[index]
        if _fits(instance, capturable, buffers, names):
            capturable.turn = (index + 1) % max(count, 1)
            return instance
    if count >= copies:
        return None
    if capturable.steady:
        # Capture only over inputs that stay: an instance baked on a passing tensor would
        # never replay again, and hold one of the few places.
        plan, static = capturable.plan, _static_outputs(interp)
        if not all(
            _steady(plan, static, p, buffers.get(typing.cast(BufferRef, names[p])))
            for p in capturable.steady
        ):
            return None
    instance = _capture(interp, capturable, names)
    capturable.instances.append(instance)
    capturable.turn = 0
    return instance


def _fits(
    instance: _Instance,
    capturable: _Capturable,
    buffers: dict[Any, torch.Tensor],
    names: list[Name],
) -> bool:
    """Whether this run may replay `instance`: its baked inputs are this run's tensors,
    and nothing holds its outputs any more."""
    slots = instance.slots
    for p in capturable.baked:
        if buffers.get(names[p]) is not slots[p]:
            return False
    steady = instance.steady
    for p in capturable.steady:
        if buffers.get(names[p]) is not steady[p]():
            return False
    return all(_unheld(slots, p, held) for p, held in instance.baseline.items())


def _capture(interp: TorchInterpreter, capturable: _Capturable, names: list[Name]) -> _Instance:
    buffers = interp.env.buffers
    slots: Slots = {}
    for position in (*capturable.baked, *capturable.steady):
        slots[position] = buffers[typing.cast(BufferRef, names[position])]
    for position in capturable.copied:
        like = buffers[typing.cast(BufferRef, names[position])]
        slots[position] = torch.empty(tuple(like.shape), dtype=like.dtype, device=like.device)
    for _, position, shape in capturable.host:
        slots[position] = torch.empty(shape, dtype=torch.int32, device=interp.device)
    launch = _record(capturable.kernels, slots)
    steady = {p: weakref.ref(slots.pop(p)) for p in capturable.steady}
    views = []
    for p, sections in capturable.static_views.values():
        for q, section in sections:
            slots[q] = section_view(slots[p], section)
            views.append(q)
    static = _static_outputs(interp)
    planner = interp.planner
    for p in (*capturable.made, *views):
        # No local holds an output past this line: the baselines below count references.
        static[id(slots[p])] = weakref.ref(slots[p])
        if planner is not None:
            storage: Any = slots[p].untyped_storage()  # the narrow stubs lack data_ptr
            if storage.nbytes():  # every empty storage is at address 0, and holds nothing
                planner.static_plans[storage.data_ptr()] = capturable.plan
                planner.unordered.update(set(Stream) - capturable.ordered)
    # Baselines: what holds each output now (the slots dict, views made while capturing).
    # The static views are bound to names themselves, so their own references tell too
    # (their storage is their source's, whose use count covers every view of it).
    baseline = {p: _holders(slots, p) for p in capturable.made}
    baseline |= {q: (_holders(slots, q)[0], _ANY) for q in views}
    return _Instance(launch=launch, slots=slots, baseline=baseline, steady=steady)


def _steady(
    plan: Plan,
    static: dict[int, weakref.ref[torch.Tensor]],
    position: int,
    tensor: torch.Tensor | None,
) -> bool:
    """Whether an input only read may be baked: its tensor is the one the plan was
    lowered with, or a static output of a graph instance."""
    if tensor is None:
        return False
    first_seen = plan.identities.get(position)
    if first_seen is not None and first_seen() is tensor:
        return True
    origin = static.get(id(tensor))
    return origin is not None and origin() is tensor


def _static_outputs(interp: TorchInterpreter) -> dict[int, weakref.ref[torch.Tensor]]:
    """Every graph instance's static outputs on `interp`, by id (a dict, not a WeakSet:
    tensors compare elementwise); none without a planner (an analysis alone)."""
    planner = interp.planner
    return {} if planner is None else planner.static_outputs


def _nothing() -> None:
    pass


def _record(kernels: list[Kernel], slots: Slots) -> Callable[[], None]:
    """Capture `kernels` over `slots` into a CUDA graph; what replays it on the current
    stream. (Tests on CPU replace this with an emulation, to check what surrounds it.)"""
    graph = torch.cuda.CUDAGraph()
    # The graph's own capture stream is current inside: kernels queue there, not on S.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for kernel in kernels:
                kernel(slots)
    for w in caught:
        if "Graph is empty" not in str(w.message):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    # A segment of allocations and collectives that queue nothing (a one-rank NCCL
    # broadcast in place) captures no node: such a graph is not worth a launch.
    if any("Graph is empty" in str(w.message) for w in caught):
        return _nothing
    replay: Callable[[], None] = graph.replay  # the bound method keeps the graph alive
    return replay


def _unheld(slots: Slots, position: int, baseline: tuple[int, int]) -> bool:
    """Whether nothing holds the output at `position` beyond its baseline (`_holders`);
    the references first: they tell a held output without building a storage object."""
    tensor = slots[position]
    if sys.getrefcount(tensor) > baseline[0]:
        return False
    return baseline[1] == _ANY or _storage_uses(tensor) <= baseline[1]


_ANY = -1  # a baseline storage count that is not checked (a view: its source's is)


def _holders(slots: Slots, position: int) -> tuple[int, int]:
    """Who holds the output at `position`: Python references to it (names bound to it,
    a caller's), and tensors on its storage (views of it, such as an Unpack's). Counted
    in frames shaped like `_unheld`'s (a local and the argument), so that a baseline and
    a check count the frames' own references alike.
    """
    tensor = slots[position]
    return sys.getrefcount(tensor), _storage_uses(tensor)


def _storage_uses(tensor: torch.Tensor) -> int:
    return int(torch._C._storage_Use_Count(tensor.untyped_storage()._cdata))


# -- analysis: which plans can be captured, and their kernels over slots ------------------

# Unpack queues no work (views), so it is not device work: it may sit anywhere.
_DEVICE = (
    Allocate,
    CopyHostToDevice,
    Broadcast,
    PadColumns,
    StackRows,
    GatherRows,
    ScatterRows,
    Pack,
)
_GRAPH = tuple(kind for kind in _DEVICE if kind is not CopyHostToDevice)  # kernels in a graph
_ORDER = (WaitStream, WaitEvent, RecordEvent, ForgetEvent)
_HOST = (AllReduce, WaitWork, NoteDecision, CheckHeader, Synchronize)


class _Segment:
    """What the walk over a segment learns: kernels, name changes, inputs and outputs.

    Kernels address slots by key: a name's position, or a new negative key when the
    segment binds the name anew while its position's slot still holds something (an
    input it read and released, a view, a tensor an Alias names), since a slot holds
    one tensor. An Alias has no slot: its name's key is its source's. Inputs are keyed
    by their positions, so staging and baking find them.
    """

    def __init__(self) -> None:
        self.kernels: list[Kernel] = []
        self.name_ops: list[_NameOp] = []
        self.made: list[int] = []  # keys of the buffers it makes
        self.reads: set[int] = set()  # inputs only read
        self.baked: set[int] = set()  # inputs written in place (or through a view)
        self.host: list[tuple[int, int, tuple[int, ...]]] = []
        self.refused = False  # something in it cannot be captured
        self.late: set[int] = set()  # inputs read after an input was written in place
        self.views: dict[int, int] = {}  # key of each view an Unpack binds -> its source's
        self.keys: dict[int, int] = {}  # position -> its slot key, where not the position
        self.shared: set[int] = set()  # keys an Alias binds a second name to
        self.static_uses: set[Stream] = set()  # streams a RecordStream of static memory names
        self._fresh = 0

    def key(self, position: int) -> int:
        """The slot the name at `position` is bound to now."""
        return self.keys.get(position, position)

    def used(self) -> set[int]:
        """Every slot that holds something: inputs, outputs, views, aliased tensors."""
        return self.reads | self.baked | set(self.made) | set(self.views) | self.shared

    def _bind(self, position: int) -> int:
        """The slot of a new binding of `position`: its own, unless that one is in use."""
        if position in self.used():
            self._fresh -= 1
            self.keys[position] = self._fresh
            return self._fresh
        self.keys.pop(position, None)
        return position

    def release(self, position: int) -> None:
        self._fresh -= 1
        self.keys[position] = self._fresh  # an empty slot: the name holds nothing now
        self.name_ops.append(_Drop(position))

    def make(self, position: int) -> int:
        if position in self.made:
            self.refused = True  # made twice: one static slot cannot hold both
        key = self._bind(position)
        self.made.append(key)
        self.name_ops.append(_Bind(position, key))
        return key

    def view(self, position: int, source: int) -> int:
        """The slot of a view of slot `source` bound to `position`."""
        key = self._bind(position)
        self.views[key] = self.views.get(source, source)  # a view of a view: the buffer
        return key

    def alias(self, out: int, source: int) -> None:
        key = self.key(source)
        self.keys[out] = key
        self.shared.add(key)
        self.name_ops.append(_Bind(out, key) if key in self.made else _Alias(out, source))

    def read(self, key: int) -> None:
        if key not in self.made and key not in self.views:
            self.reads.add(key)
            if self.baked:
                self.late.add(key)

    def write(self, key: int) -> None:
        key = self.views.get(key, key)  # a write through a view writes its buffer
        if key not in self.made:
            self.baked.add(key)


def _analyse(
    interp: TorchInterpreter, plan: Plan, names: list[Name] | None = None
) -> _Capturable | None:
    """The plan's capture layout, or None when it cannot be captured (see the module).
    `names`: the bindings of the run about to replay (default: the plan's own)."""
    names = plan.names if names is None else names
    effects = plan.effects
    on_device = interp.device.type == "cuda"
    if any(on_cuda is not on_device for *_, on_cuda in plan.inputs.values()):
        return None  # a host input: its ops run on the host, which a graph does not replay
    at = {name: position for position, name in enumerate(plan.names)}
    # The segment is bounded by graph work: a CopyHostToDevice is host staging, so one
    # before the first kernel (or after the last) runs as eager runs it, with the
    # ordering around it, and one inside is staged into its static buffer.
    device = [i for i, effect in enumerate(effects) if isinstance(effect, _GRAPH)]
    if not device:
        return None
    first, last = device[0], device[-1]
    while first and isinstance(effects[first - 1], CopyHostToDevice):
        first -= 1  # staged straight into its static buffer
    segment = _Segment()
    streams: set[Stream] = set()
    for index in range(first, last + 1):
        effect = effects[index]
        if isinstance(effect, _ORDER + _HOST):
            return None  # ordering or host work between captured kernels
        stream = _lower(interp, effect, index, at, segment)
        if stream is not None:
            streams.add(stream)
    if len(streams) != 1 or segment.refused:
        return None
    stream = streams.pop()
    # An input only read whose tensor is the one the plan was lowered with (a table that
    # lives as long as the relay), or a static output of another graph (a received wire,
    # one of that graph's few instances), is baked, not copied in every replay: a run
    # with another tensor there picks an instance captured with it, or runs as the plan.
    buffers = interp.env.buffers
    static = _static_outputs(interp)
    steady = {
        p
        for p in segment.reads
        if _steady(plan, static, p, buffers.get(typing.cast(BufferRef, names[p])))
    }
    baked = segment.baked
    steady -= baked
    recorded = frozenset(
        at[effect.buffer]
        for effect in effects
        if isinstance(effect, RecordStream) and effect.stream is stream
    )
    made = set(segment.made)
    # After the segment: views of a made wire, made once per instance in slots of their
    # positions (not where a slot of the segment is: the eager handler binds those), and
    # RecordStreams of static memory, skipped; both only while the name still holds what
    # the segment bound (a name released there may be bound anew).
    static_views: dict[int, tuple[int, tuple[tuple[int, Section], ...]]] = {}
    viewed: set[int] = set()
    skipped: set[int] = set()
    used = segment.used()
    released: set[Name] = set()
    for index in range(last + 1, len(effects)):
        effect = effects[index]
        if isinstance(effect, Release):
            released.add(effect.buffer)
        elif isinstance(effect, Unpack) and effect.source not in released:
            p = segment.key(at[effect.source])
            sections = tuple((at[s.buffer], s) for s in effect.sections)
            if p in made and not any(q in used for q, _ in sections):
                static_views[index] = (p, sections)
                used.update(q for q, _ in sections)
                viewed.update(q for q, _ in sections)
        elif isinstance(effect, RecordStream) and effect.buffer not in released:
            p = at[effect.buffer]
            if p in viewed or segment.key(p) in made:
                skipped.add(index)
                segment.static_uses.add(effect.stream)
    # The next replay of an instance rewrites its static memory on S; eager would reuse
    # that memory only once the streams it was recorded on are past their uses. So
    # capture only when every such stream is S or one the prefix makes S wait for (the
    # relay's batches begin with WaitStream(relay, main)); else the plan runs eager's
    # handlers, whose fresh buffers the allocator frees stream-safely.
    ordered = frozenset(
        {stream}
        | {
            effect.waits_for
            for effect in effects[:first]
            if isinstance(effect, WaitStream) and effect.stream is stream
        }
    )
    if not segment.static_uses <= ordered:
        return None
    return _Capturable(
        stream=stream,
        first=first,
        last=last,
        kernels=segment.kernels,
        copied=tuple(sorted(segment.reads - baked - steady)),
        late=tuple(sorted(segment.late - baked - steady)),
        baked=tuple(sorted(baked)),
        steady=tuple(sorted(steady)),
        host=tuple(segment.host),
        made=tuple(segment.made),
        name_ops=tuple(segment.name_ops),
        compiled=_compiled(tuple(segment.name_ops)),
        cuda_stream=interp.cuda_stream(stream) if interp.device.type == "cuda" else None,
        recorded=recorded,
        static_views=static_views,
        skipped=frozenset(skipped),
        plan=plan,
        ordered=ordered,
    )


def _lower(
    interp: TorchInterpreter,
    effect: Effect,
    index: int,
    at: dict[Name, int],
    segment: _Segment,
) -> Stream | None:
    """Add `effect`'s kernel and name changes to `segment`; its stream if it queues work."""
    match effect:
        case Allocate() | CopyHostToDevice() | Broadcast() | Pack():
            return _lower_wire(interp, effect, index, at, segment)
        case Unpack():
            # Views while capturing, for the kernels after it; at replay the eager handler
            # binds views of whatever the source is bound to (no device work either way).
            p = segment.key(at[effect.source])
            segment.read(p)
            views = [(segment.view(at[s.buffer], p), s) for s in effect.sections]

            def unpack(slots: Slots) -> None:
                for q, section in views:
                    slots[q] = section_view(slots[p], section)

            segment.kernels.append(unpack)
            segment.name_ops.append(_Eager(index))
            return None
        case PadColumns() | StackRows() | GatherRows() | ScatterRows():
            return _lower_rows(effect, at, segment)
        case Release():
            segment.release(at[effect.buffer])
            return None
        case Alias():
            segment.alias(at[effect.out], at[effect.source])
            return None
        case RecordStream():
            p = at[effect.buffer]
            key = segment.key(p)
            if segment.views.get(key, key) in segment.made:
                # Static memory: no record (the allocator never reuses it), but a use
                # the next replay must be ordered after (`_analyse`).
                segment.static_uses.add(effect.stream)
            else:
                segment.name_ops.append(_Eager(index))  # an input's: eager records it
            return None
        case (
            WaitStream()
            | RecordEvent()
            | WaitEvent()
            | ForgetEvent()
            | CheckHeader()
            | AllReduce()
            | WaitWork()
            | NoteDecision()
            | Synchronize()
        ):
            raise AssertionError(f"{type(effect).__name__} is never inside a captured segment")
        case _:
            typing.assert_never(effect)


def _lower_wire(
    interp: TorchInterpreter,
    effect: Allocate | CopyHostToDevice | Broadcast | Pack,
    index: int,
    at: dict[Name, int],
    segment: _Segment,
) -> Stream:
    """New buffers, the wire and its packing."""
    kernels = segment.kernels
    device = interp.device
    match effect:
        case Allocate():
            p = segment.make(at[effect.buffer])
            shape, dtype = effect.shape, torch_dtype(effect.dtype)

            def allocate(slots: Slots) -> None:
                slots[p] = torch.empty(shape, dtype=dtype, device=device)

            kernels.append(allocate)
            return effect.stream
        case CopyHostToDevice():
            # Its static buffer is made with the instance and filled before each replay.
            p = segment.make(at[effect.buffer])
            segment.host.append((index, p, effect.source.shape))
            return effect.stream
        case Broadcast():
            p = segment.key(at[effect.buffer])
            group = interp.group(effect, effect.comm)
            if dist.get_backend(group) != "nccl":
                segment.refused = True  # only NCCL collectives can be captured
            options = interp.broadcast_options(effect)
            if effect.src == interp.rank:
                segment.read(p)
            else:
                segment.write(p)

            def broadcast(slots: Slots) -> None:
                work = group.broadcast([slots[p]], options)
                if work is not None:
                    work.wait()

            kernels.append(broadcast)
            return effect.stream
        case Pack():
            sections = [(segment.key(at[s.buffer]), s) for s in effect.sections]
            for p, _ in sections:
                segment.read(p)
            q, words = segment.make(at[effect.out]), effect.nbytes // 8

            def pack_sections(slots: Slots) -> None:
                out = torch.zeros(words, dtype=torch.int64, device=device)
                pack(out, ((section, slots[p]) for p, section in sections))
                slots[q] = out

            kernels.append(pack_sections)
            return effect.stream
        case _:
            typing.assert_never(effect)


def _lower_rows(
    effect: PadColumns | StackRows | GatherRows | ScatterRows,
    at: dict[Name, int],
    segment: _Segment,
) -> Stream:
    """The row moves."""
    kernels = segment.kernels
    match effect:
        case PadColumns():
            p, width, fill = segment.key(at[effect.source]), effect.width, effect.fill
            segment.read(p)
            q = segment.make(at[effect.out])

            def pad(slots: Slots) -> None:
                slots[q] = pad_columns(slots[p], width, fill)

            kernels.append(pad)
            return effect.stream
        case StackRows():
            ps = [segment.key(at[ref]) for ref in effect.sources]
            for p in ps:
                segment.read(p)
            q = segment.make(at[effect.out])

            def stack(slots: Slots) -> None:
                slots[q] = torch.stack([slots[p] for p in ps], dim=0)

            kernels.append(stack)
            return effect.stream
        case GatherRows():
            p, i = segment.key(at[effect.source]), segment.key(at[effect.index])
            segment.read(p)
            segment.read(i)
            q = segment.make(at[effect.out])

            def gather(slots: Slots) -> None:
                slots[q] = torch.index_select(slots[p], 0, slots[i])

            kernels.append(gather)
            return effect.stream
        case ScatterRows():
            key = segment.key
            p, i, t = key(at[effect.source]), key(at[effect.index]), key(at[effect.target])
            segment.read(p)
            segment.read(i)
            segment.write(t)

            skips = effect.skips

            def scatter(slots: Slots) -> None:
                scatter_rows(slots[p], slots[i], slots[t], skips=skips)

            kernels.append(scatter)
            return effect.stream
        case _:
            typing.assert_never(effect)
