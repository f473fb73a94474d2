"""Step plans: a batch of effects lowered once, then run with new bindings.

A batch (the tuple `perform` receives) with its names abstracted to positions is a
*structure*: the kinds, shapes, dtypes, streams, communicators, sources, widths and
section layouts of its effects, and where each name recurs. `relay.step7.tokens` and
`relay.step8.tokens` occupy the same position, so steps differ only in their
*bindings*: the names, the step number and the host data (copied arrays, expected
headers, all-reduce contributions; their shapes are structure).

Finding the structure. A batch a pure step built carries its structure key
(`purepp.effects.keyed.KeyedEffects`: the relay's steps key theirs by configuration, rows
and branch), so its plans are one dict lookup away and its names are read by straight-
line code generated once per structure (`name_reader`). A plain tuple (any batch a
caller assembled or edited) is abstracted effect by effect (`abstract`), as before.

The first time `Planner` meets a structure it performs the batch eagerly, which
validates it and raises what eager raises, and then lowers it into a `Plan`:

- every position gets a role from its first use: an *input* (a buffer, event or work
  bound before the batch) or *made* by the batch;
- the layouts of the input buffers are recorded, and later runs are guarded on them
  (with the roles) before anything changes: a batch whose bindings differ (an input
  unbound or of another shape, a made name already bound) falls back to eager, which
  performs it or raises exactly what eager raises;
- each effect keeps the interpreter's fast handler (streams, groups, broadcast options
  and dtypes are resolved once by the interpreter itself).

In fast mode a plan that is not captured runs exactly eager's handlers, so it needs
no guard; checked mode (which skips the per-effect validation for a plan) and capture
(which relies on input layouts and names) check the guards first.

A plan changes the environment effect by effect, as eager does, so a collective that
fails half-way leaves the same environment behind. Streams are switched through the
interpreter (once per run of effects on a stream). Buffers come from the caching
allocator, which frees them stream-safely after each `Release`; `capture=True` (CUDA,
purepp.effects.capture) makes them static graph memory instead.

A structure has up to `_VARIANTS` plans, one per layout of its inputs; past that, new
layouts run eagerly.
"""

from __future__ import annotations

import typing
import weakref
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import torch

from purepp.effects._environment import Environment, itemsize
from purepp.effects.keyed import KeyedEffects
from purepp.effects.vocabulary import (
    Alias,
    Allocate,
    AllReduce,
    Broadcast,
    BufferRef,
    CheckHeader,
    CopyHostToDevice,
    Effect,
    EventRef,
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
    WorkRef,
)

if TYPE_CHECKING:
    from purepp.effects.torch_interpreter import TorchInterpreter

__all__ = [
    "Layout",
    "Name",
    "Plan",
    "Planner",
    "Role",
    "Structure",
    "abstract",
    "layout",
    "name_reader",
    "roles",
]

Name: TypeAlias = BufferRef | EventRef | WorkRef
Structure: TypeAlias = tuple[Hashable, ...]

# Most input layouts planned per structure.
_VARIANTS = 8


class Role:
    """How a position is first used in its batch (what a guard checks before a run)."""

    READ = 0  # a buffer bound before the batch (read, written in place, or released)
    MAKE = 1  # a buffer the batch binds first: must be unbound
    EVENT_IN = 2  # an event recorded before the batch
    EVENT_MAKE = 3  # an event the batch records
    WORK_IN = 4  # work in flight before the batch
    WORK_MAKE = 5  # work the batch starts


def abstract(effects: tuple[Effect, ...]) -> tuple[Structure, list[Name]]:
    """The batch's structure, and its names by position (the bindings of this run).

    Runs on every batch, so it is written for speed: one function per kind from a dict,
    each name's position by one `setdefault` (its first use numbers it), enums by value.
    """
    positions: dict[Name, int] = {}
    at, size, parts = positions.setdefault, positions.__len__, _PARTS
    structure = tuple([parts[type(effect)](effect, at, size) for effect in effects])
    return structure, list(positions)


At: TypeAlias = Callable[[Name, int], int]  # dict.setdefault of the positions
Size: TypeAlias = Callable[[], int]  # their count: the next position


def _release(e: Release, at: At, n: Size) -> Hashable:
    return (11, at(e.buffer, n()))


def _broadcast(e: Broadcast, at: At, n: Size) -> Hashable:
    wire = (e.shape, e.dtype._value_, e.src, e.comm._value_, e.stream._value_)
    return (6, at(e.buffer, n()), wire)


def _allocate(e: Allocate, at: At, n: Size) -> Hashable:
    return (4, at(e.buffer, n()), e.shape, e.dtype._value_, e.stream._value_)


def _record_stream(e: RecordStream, at: At, n: Size) -> Hashable:
    return (10, at(e.buffer, n()), e.stream._value_)


def _wait_stream(e: WaitStream, at: At, n: Size) -> Hashable:
    return (0, e.stream._value_, e.waits_for._value_)


def _record_event(e: RecordEvent, at: At, n: Size) -> Hashable:
    return (1, e.stream._value_, at(e.event, n()))


def _wait_event(e: WaitEvent, at: At, n: Size) -> Hashable:
    return (2, e.stream._value_, at(e.event, n()))


def _forget_event(e: ForgetEvent, at: At, n: Size) -> Hashable:
    return (3, at(e.event, n()))


def _copy_host_to_device(e: CopyHostToDevice, at: At, n: Size) -> Hashable:
    # The host values are a binding; their shape is structure.
    return (5, e.source.shape, at(e.buffer, n()), e.stream._value_)


def _check_header(e: CheckHeader, at: At, n: Size) -> Hashable:
    return (7, at(e.buffer, n()), e.expected.shape, e.stream._value_)


def _all_reduce(e: AllReduce, at: At, n: Size) -> Hashable:
    result = at(e.result, n())
    work = None if e.work is None else at(e.work, n())
    return (8, e.contribution.shape, result, e.comm._value_, work)


def _wait_work(e: WaitWork, at: At, n: Size) -> Hashable:
    return (9, at(e.work, n()))


def _note_decision(e: NoteDecision, at: At, n: Size) -> Hashable:
    return (20, at(e.table, n()))  # the decision's values are a note: no structure


def _alias(e: Alias, at: At, n: Size) -> Hashable:
    return (12, at(e.source, n()), at(e.out, n()))


def _pad_columns(e: PadColumns, at: At, n: Size) -> Hashable:
    return (13, at(e.source, n()), at(e.out, n()), e.width, e.fill, e.stream._value_)


def _stack_rows(e: StackRows, at: At, n: Size) -> Hashable:
    sources = tuple([at(ref, n()) for ref in e.sources])
    return (14, sources, at(e.out, n()), e.stream._value_)


def _gather_rows(e: GatherRows, at: At, n: Size) -> Hashable:
    source, index, out = at(e.source, n()), at(e.index, n()), at(e.out, n())
    return (15, source, index, out, e.stream._value_, e.index_rows)


def _scatter_rows(e: ScatterRows, at: At, n: Size) -> Hashable:
    # Positions are numbered in order of first use: source, index, target.
    source, index, target = at(e.source, n()), at(e.index, n()), at(e.target, n())
    return (16, source, index, target, e.stream._value_, e.skips, e.target_rows)


def _synchronize(e: Synchronize, at: At, n: Size) -> Hashable:
    return (17, e.stream._value_)


def _sections(sections: tuple[Section, ...], at: At, n: Size) -> Hashable:
    # The declared source rows too: a replay checks no effect field, only input layouts.
    return tuple(
        [(at(s.buffer, n()), s.offset, s.shape, s.dtype._value_, s.source_rows) for s in sections]
    )


def _pack(e: Pack, at: At, n: Size) -> Hashable:
    sections = _sections(e.sections, at, n)
    return (18, sections, at(e.out, n()), e.nbytes, e.stream._value_)


def _unpack(e: Unpack, at: At, n: Size) -> Hashable:
    return (19, at(e.source, n()), _sections(e.sections, at, n), e.stream._value_)


# One entry per kind of the closed Effect union (checked below, at import).
_PARTS: dict[type, Callable[[Any, At, Size], Hashable]] = {
    Release: _release,
    Broadcast: _broadcast,
    Allocate: _allocate,
    RecordStream: _record_stream,
    WaitStream: _wait_stream,
    RecordEvent: _record_event,
    WaitEvent: _wait_event,
    ForgetEvent: _forget_event,
    CopyHostToDevice: _copy_host_to_device,
    CheckHeader: _check_header,
    AllReduce: _all_reduce,
    WaitWork: _wait_work,
    NoteDecision: _note_decision,
    Alias: _alias,
    PadColumns: _pad_columns,
    StackRows: _stack_rows,
    GatherRows: _gather_rows,
    ScatterRows: _scatter_rows,
    Synchronize: _synchronize,
    Pack: _pack,
    Unpack: _unpack,
}
if set(_PARTS) != set(typing.get_args(Effect)):  # a new effect kind needs its structure
    raise AssertionError(f"plan.abstract misses {set(typing.get_args(Effect)) - set(_PARTS)}")


def _uses(effect: Effect) -> tuple[tuple[Name, int], ...]:
    """The names `effect` uses, in order, each with the role it would have if first."""
    read, make = Role.READ, Role.MAKE
    match effect:
        case WaitStream() | Synchronize():
            return ()
        case RecordEvent():
            return ((effect.event, Role.EVENT_MAKE),)
        case WaitEvent() | ForgetEvent():
            return ((effect.event, Role.EVENT_IN),)
        case Allocate() | CopyHostToDevice():
            return ((effect.buffer, make),)
        case Broadcast() | CheckHeader() | RecordStream() | Release():
            return ((effect.buffer, read),)
        case AllReduce():
            work = () if effect.work is None else ((effect.work, Role.WORK_MAKE),)
            return ((effect.result, make), *work)
        case WaitWork():
            return ((effect.work, Role.WORK_IN),)
        case NoteDecision():
            return ((effect.table, read),)
        case Alias() | PadColumns():
            return ((effect.source, read), (effect.out, make))
        case StackRows():
            return (*((ref, read) for ref in effect.sources), (effect.out, make))
        case GatherRows():
            return ((effect.source, read), (effect.index, read), (effect.out, make))
        case ScatterRows():
            return ((effect.source, read), (effect.index, read), (effect.target, read))
        case Pack():
            return (*((s.buffer, read) for s in effect.sections), (effect.out, make))
        case Unpack():
            return ((effect.source, read), *((s.buffer, make) for s in effect.sections))
        case _:
            typing.assert_never(effect)


def _waited_first(effects: tuple[Effect, ...], names: list[Name]) -> dict[int, tuple[int, ...]]:
    """For each position, the work positions whose WaitWork comes before its first use
    (only positions with some; empty when the batch waits on no work)."""
    if not any(type(effect) is WaitWork for effect in effects):
        return {}
    at = {name: position for position, name in enumerate(names)}
    first: dict[int, int] = {}
    waits: list[tuple[int, int]] = []  # (effect index, work position)
    for index, effect in enumerate(effects):
        for name, _ in _uses(effect):
            first.setdefault(at[name], index)
        if type(effect) is WaitWork:
            waits.append((index, at[effect.work]))
    waited = {p: tuple(w for i, w in waits if i < used) for p, used in first.items()}
    return {p: works for p, works in waited.items() if works}


def roles(effects: tuple[Effect, ...], names: list[Name]) -> list[int]:
    """Each position's role: how its name is first used in the batch."""
    found: dict[Name, int] = {}
    for effect in effects:
        for name, role in _uses(effect):
            found.setdefault(name, role)
    return [found[name] for name in names]


# shape, dtype, contiguous, on a CUDA device
Layout: TypeAlias = tuple[tuple[int, ...], torch.dtype, bool, bool]


def layout(tensor: torch.Tensor) -> Layout:
    """What a plan assumes of an input buffer: shape, dtype, contiguity, and whether it is
    on a CUDA device (a graph reads device memory only; eager runs a host tensor's ops on
    the host)."""
    return tuple(tensor.shape), tensor.dtype, tensor.is_contiguous(), tensor.is_cuda


class Plan:
    """A lowered batch: the guards on its bindings, and its effects' handlers, resolved."""

    def __init__(
        self,
        effects: tuple[Effect, ...],
        names: list[Name],
        positions: list[int],
        inputs: dict[int, Layout],
        handlers: list[Callable[[Any], None]],
        *,
        contiguity: bool,
        device: bool,
    ) -> None:
        self.effects = effects  # the batch it was lowered from (capture reads its layout)
        self.names = names  # that batch's names by position
        self.roles = positions  # each position's role
        self.inputs = inputs  # the layouts of the READ positions
        self.handlers = handlers  # one per effect: the interpreter's, without validation
        # The guards, by role. Contiguity and the device are guarded where they matter
        # (`contiguity`, `device`: a graph reads device memory only). Contiguity: checked
        # mode checks it, and a graph reads a contiguous copy where eager may refuse a view.
        self._reads = [
            (p, shape, dtype, contiguous if contiguity else None, on_cuda if device else None)
            for p, (shape, dtype, contiguous, on_cuda) in sorted(inputs.items())
        ]
        # A captured Unpack of an input stages it whole and views the copy, so the guard
        # also holds that the input starts aligned for its widest section, as eager needs.
        read_at = {names[p]: p for p in inputs} if device else {}
        self._aligned = [
            (read_at[e.source], max(itemsize(s.dtype) for s in e.sections))
            for e in effects
            if type(e) is Unpack and e.source in read_at and e.sections
        ]
        # Each READ position's works that the batch waits on before its first use: such a
        # table may still be in flight when the batch starts (it waits, then reads).
        self._waited_first = _waited_first(effects, names)
        by_role: dict[int, list[int]] = {role: [] for role in range(6)}
        for p, role in enumerate(positions):
            by_role[role].append(p)
        self._makes = by_role[Role.MAKE]
        self._events_in, self._events_made = by_role[Role.EVENT_IN], by_role[Role.EVENT_MAKE]
        self._works_in, self._works_made = by_role[Role.WORK_IN], by_role[Role.WORK_MAKE]
        self._ordering = any(by_role[role] for role in range(Role.EVENT_IN, Role.WORK_MAKE + 1))
        # The tensors of the READ positions at lowering (capture=True): an input still bound
        # to the same tensor at capture is baked into the graph instead of copied in.
        self.identities: dict[int, weakref.ref[torch.Tensor]] = {}
        # CUDA graphs of this plan (purepp.effects.capture), made on its first replay.
        self.capture: Any = None
        # Set once capture found the plan cannot be captured (`capture` stays None), or a
        # use of its static memory on another stream stopped its replays (`recorded`).
        self.uncapturable = False

    def admits(self, env: Environment[torch.Tensor, Any, Any], names: list[Name]) -> bool:
        """Whether this run's bindings fit: every position's role, every input's layout."""
        buffers, pending = env.buffers, env.pending_results
        for position, shape, dtype, contiguous, on_cuda in self._reads:
            # A READ position always holds a BufferRef; a cast here would cost a call per read.
            tensor = buffers.get(names[position])  # type: ignore[arg-type]
            if (
                tensor is None
                or tensor.shape != shape
                or tensor.dtype is not dtype
                or (on_cuda is not None and tensor.is_cuda is not on_cuda)
                or (contiguous is not None and tensor.is_contiguous() is not contiguous)
            ):
                return False
        for position, widest in self._aligned:
            tensor = buffers[names[position]]  # type: ignore[index]
            if tensor.storage_offset() * tensor.dtype.itemsize % widest:
                return False  # eager's typed error
        if pending:  # rare: tables of an all-reduce in flight
            for position, *_ in self._reads:
                work = pending.get(typing.cast(BufferRef, names[position]))
                if work is not None and all(
                    names[w] != work for w in self._waited_first.get(position, ())
                ):
                    return False  # read before its work is waited on: eager's error
            for position in self._makes:
                if names[position] in pending:
                    return False
        for position in self._makes:
            if names[position] in buffers:
                return False
        if self._ordering:
            events, works = env.events, env.works
            for position in self._events_in:
                if names[position] not in events:
                    return False
            for position in self._events_made:
                if names[position] in events:
                    return False
            for position in self._works_in:
                if names[position] not in works:
                    return False
            for position in self._works_made:
                if names[position] in works:
                    return False
        return True


def _fields(effect: Effect) -> list[str]:
    """The attribute paths of `effect`'s names, in the order `abstract` numbers them."""
    match effect:
        case WaitStream() | Synchronize():
            return []
        case RecordEvent() | WaitEvent() | ForgetEvent():
            return ["event"]
        case (
            Release() | Broadcast() | Allocate() | RecordStream() | CopyHostToDevice()
            | CheckHeader()
        ):  # fmt: skip
            return ["buffer"]
        case AllReduce():
            return ["result"] if effect.work is None else ["result", "work"]
        case WaitWork():
            return ["work"]
        case NoteDecision():
            return ["table"]
        case Alias() | PadColumns():
            return ["source", "out"]
        case StackRows():
            return [*(f"sources[{i}]" for i in range(len(effect.sources))), "out"]
        case GatherRows():
            return ["source", "index", "out"]
        case ScatterRows():
            return ["source", "index", "target"]
        case Pack():
            return [*(f"sections[{i}].buffer" for i in range(len(effect.sections))), "out"]
        case Unpack():
            return ["source", *(f"sections[{i}].buffer" for i in range(len(effect.sections)))]
        case _:
            typing.assert_never(effect)


def name_reader(effects: tuple[Effect, ...]) -> Callable[[tuple[Effect, ...]], list[Name]]:
    """A function reading the names by position from any batch of `effects`' structure.

    Straight-line code generated once per structure (`e[3].buffer, e[5].event, ...`):
    equal structures put each position's first use at the same effect and field.
    """
    seen: set[Name] = set()
    paths: list[str] = []
    for index, effect in enumerate(effects):
        for field in _fields(effect):
            name = eval(f"e.{field}", {"e": effect})  # our own field paths
            if name not in seen:
                seen.add(name)
                paths.append(f"e[{index}].{field}")
    source = f"def read(e):\n    return [{', '.join(paths)}]\n"
    scope: dict[str, Any] = {}
    exec(compile(source, "<purepp.plan names>", "exec"), scope)  # generated above
    reader: Callable[[tuple[Effect, ...]], list[Name]] = scope["read"]
    return reader


class _Family:
    """The plans of one structure (one per input layout) and how to read its names."""

    __slots__ = ("names", "plans")

    def __init__(self, names: Callable[[tuple[Effect, ...]], list[Name]]) -> None:
        self.names = names
        self.plans: list[Plan] = []


class Replay(Protocol):
    """How a captured plan is performed (`purepp.effects.capture.replay`, handed down by
    the interpreter so that this module needs no import of capture, which builds on it):
    True when a graph replayed, False when it ran as the plan, None when not captured."""

    def __call__(
        self,
        interp: TorchInterpreter,
        plan: Plan,
        effects: tuple[Effect, ...],
        names: list[Name],
        *,
        copies: int,
    ) -> bool | None: ...


class Planner:
    """The plan cache of one `TorchInterpreter`: structure -> plans, one per input layout.

    A batch that carries its structure key (`KeyedEffects`, built by the pure step) finds
    its plans by that key with one dict lookup; a plain tuple is abstracted (`abstract`).
    In fast mode a plan that is not captured runs the eager handlers themselves, so it
    needs no guard: it does exactly what eager does. Checked mode and captures guard
    the bindings first (`Plan.admits`), since they skip validation or rely on layouts.
    """

    def __init__(
        self, interp: TorchInterpreter, *, capture: bool, copies: int, replay: Replay
    ) -> None:
        self._interp = interp
        self._plans: dict[Structure, _Family] = {}
        self._keyed: dict[Hashable, _Family] = {}
        self._capture = capture
        self._copies = copies
        self._replay = replay  # purepp.effects.capture.replay, handed down by the interpreter
        self._guarded = capture or interp.checked  # plans that need their guards
        # Static outputs of every captured graph instance, by id (purepp.effects.capture).
        self.static_outputs: dict[int, weakref.ref[torch.Tensor]] = {}
        # The plan whose instances own each static output's memory, by its address: a
        # RecordStream of any view of it finds the plan (`recorded`). Only one on a stream
        # some such plan's replays are not ordered after can stop one, so only those look
        # (the relay's plans are ordered after both streams: its records look nothing up).
        self.static_plans: dict[int, Plan] = {}
        self.unordered: set[Stream] = set()
        self.lowered = 0  # plans made
        self.planned = 0  # batches run by a plan (not replayed)
        self.eager = 0  # batches run eagerly: first meetings, bindings that did not fit
        self.replayed = 0  # batches run by a CUDA-graph replay

    def perform(self, effects: tuple[Effect, ...]) -> bool:
        """Perform `effects` by a plan, lowering one if new; False: the caller runs eager."""
        interp = self._interp
        family: _Family | None = None
        names: list[Name] | None = None
        keyed = type(effects) is KeyedEffects
        if keyed:
            family = self._keyed.get(typing.cast(KeyedEffects, effects).structure)
        if family is None:
            structure, names = abstract(effects)
            family = self._plans.get(structure)
            if family is None:
                family = self._plans[structure] = _Family(name_reader(effects))
            if keyed:
                self._keyed[typing.cast(KeyedEffects, effects).structure] = family
        variants = family.plans
        if variants:
            if not self._guarded:
                self.planned += 1
                interp.run_handlers(variants[0].handlers, effects)
                return True
            first = variants[0]
            if first.uncapturable and first.capture is None and not interp.checked:
                # Capture found no graph in this structure: its plans run eager's
                # handlers, which need no guard (as in fast mode without capture). A
                # plan that `recorded` stopped has graphs, and the others may replay.
                self.planned += 1
                interp.run_handlers(first.handlers, effects)
                return True
            if names is None:
                names = family.names(effects)
            env = interp.env
            for plan in variants:
                if plan.admits(env, names):
                    self._run(plan, effects, names)
                    return True
            if len(variants) >= _VARIANTS:
                self.eager += 1
                return False
        if names is None:
            names = family.names(effects)
        positions = roles(effects, names)
        buffers = interp.env.buffers
        inputs = {
            position: layout(buffers[typing.cast(BufferRef, names[position])])
            for position, role in enumerate(positions)
            if role == Role.READ and names[position] in buffers
        }
        identities = (
            {p: weakref.ref(buffers[typing.cast(BufferRef, names[p])]) for p in inputs}
            if self._capture
            else {}
        )
        # The first meeting runs eagerly: that validates the batch and raises eager's errors.
        self.eager += 1
        interp.perform_eager(effects)
        handlers = [interp.handler(e) for e in effects]
        contiguity = interp.checked or self._capture
        plan = Plan(
            effects, names, positions, inputs, handlers, contiguity=contiguity, device=self._capture
        )
        plan.identities = identities
        variants.append(plan)
        self.lowered += 1
        return True

    def recorded(self, tensor: torch.Tensor, stream: Stream) -> None:
        """A RecordStream of `tensor` on `stream` (eager's handler calls this for a stream
        in `unordered`). Static memory used on a stream its plan's replays are not ordered
        after would be rewritten under that use by the next replay: the plan replays no
        more, and runs eager's handlers (fresh memory) from now on."""
        storage: Any = tensor.untyped_storage()  # the narrow stubs lack data_ptr
        plan = self.static_plans.get(storage.data_ptr())
        if plan is not None and stream not in plan.capture.ordered:
            plan.uncapturable = True

    def _run(self, plan: Plan, effects: tuple[Effect, ...], names: list[Name]) -> None:
        interp = self._interp
        if self._capture and not plan.uncapturable:
            replayed = self._replay(interp, plan, effects, names, copies=self._copies)
            if replayed is not None:  # performed, by a replay or (instances held) the plan
                if replayed:
                    self.replayed += 1
                else:
                    self.planned += 1
                return
        self.planned += 1
        interp.run_handlers(plan.handlers, effects)
