"""The reference interpreter: performs effects on numpy arrays, in one process.

It gives every effect the meaning the torch interpreter gives it (the vocabulary's
docstrings), with streams modelled explicitly so that ordering bugs show up:

- The host is a lane of its own: it waits only where a real host does (a CPU
  all-reduce, `WaitWork`, `Synchronize`, a gloo broadcast), and issues nothing
  more until that completes (`host_blocked`). A main-stream wait on unfinished
  side-stream work holds the main stream, not the host, as on CUDA; reading a
  buffer from the host (`tensor`, `host_array`) is the caller's to order, as a
  `.cpu()` copy waits for the main stream (the simulator resumes a program only once
  its main stream has drained, `main_idle`).
- Every stream (MAIN, RELAY) is a FIFO of pending effects. An effect queued behind a
  broadcast that has not completed waits, as it would on a CUDA stream; so does
  the event recorded after it.
- References are resolved and output buffers bound when an effect is issued, as
  torch returns a tensor object at once; their contents are written when the
  effect runs. Fresh buffers (Allocate and every kernel output) start out filled
  with `POISON`, so reading data that was never written is visible. A kernel that
  fails when it runs (a row outside its buffer, a header mismatch) is a device
  fault, not a refusal: its outputs stay bound and it stays at its stream's head.
- A broadcast runs as the relay's backend runs it: NCCL's (the default) is queued on
  its stream; gloo's blocks the host until it completes, as
  the torch interpreter's wait on a gloo broadcast does.
- Collectives go to a `CollectivePort`. Alone (the default port), only a
  one-member world is possible: a broadcast from this rank and an all-reduce of
  this rank's one-column table complete at once, and any other collective is refused.
  The simulator supplies a port that matches and moves data between ranks.
- `CheckHeader` is a kernel on its stream: it compares once the header's broadcast
  has completed, and a mismatch raises `HeaderMismatchError` (naming this rank, the
  step and both headers) from whichever call ran it; in the simulator the run stops.
- Buffer lifetimes follow the caching allocator: a buffer belongs to the pool of
  the stream it was made on, and a later allocation there is ordered only after
  what that stream waited for (events, `WaitStream`) and what the host synchronised
  with (`Synchronize`). When its last name is released while a use on another
  stream is not ordered before that point, and that stream was not recorded with
  `RecordStream`, its memory may be reused under the use, whether or not the model
  has run it yet: the array is overwritten with `POISON` and the interpreter notes
  a `LifetimeViolation`.

- `Synchronize` makes the host wait until the named stream has
  run what it holds (the torch interpreter waits on the CUDA stream; on CPU it has
  nothing to wait for). `Pack` is a kernel on its stream; `Unpack` binds views of the
  source's bytes at issue (no work), which share its memory and lifetime.

Names follow the torch interpreter (both keep purepp.effects._environment): effects
that create a binding refuse a name already bound; `bind` replaces; `WaitEvent` and
`WaitWork` consume their event or work; the table of an asynchronous all-reduce is
unreadable until its `WaitWork`.
"""

from __future__ import annotations

import math
import typing
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Final, Protocol, TypeAlias

import attrs
import numpy as np
import numpy.typing as npt

from purepp._checks import INT32_MAX, check_int, host_array
from purepp._text import a_type
from purepp.effects._environment import Environment, effect_call, itemsize
from purepp.effects.vocabulary import (
    Alias,
    Allocate,
    AllReduce,
    Backend,
    Broadcast,
    BufferRef,
    CheckHeader,
    CopyHostToDevice,
    DType,
    Effect,
    EventRef,
    ForgetEvent,
    GatherRows,
    NoteDecision,
    Op,
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
    check_backend,
    effect_batch,
)
from purepp.errors import (
    ConfigError,
    HeaderMismatchError,
    InterpreterError,
    InvalidInputError,
    PureppError,
)

__all__ = [
    "POISON",
    "CollectivePort",
    "LifetimeViolation",
    "NumpyInterpreter",
    "PostedCollective",
    "Stall",
    "describe_effect",
    "numpy_dtype",
    "section_view",
]

# Fill of fresh buffers and of memory reused too early: negative, so never a token id,
# and not -1, which index buffers use for "skip this row".
POISON: Final = -0x0BADF00D

_BIND_FIX = "bind int64 or int32 arrays"

Array: TypeAlias = npt.NDArray[Any]


def numpy_dtype(dtype: DType) -> np.dtype[Any]:
    """The numpy dtype a vocabulary dtype stands for."""
    match dtype:
        case DType.INT64:
            return np.dtype(np.int64)
        case DType.INT32:
            return np.dtype(np.int32)
        case _:
            typing.assert_never(dtype)


_EFFECTS = typing.get_args(Effect)  # every effect kind, for isinstance


def describe_effect(effect: Effect) -> str:
    """A short description of an effect for reports: kind and the names it involves."""
    if not isinstance(effect, _EFFECTS):
        raise InvalidInputError(
            "describe_effect", f"effect is {a_type(effect)}", "pass an effect (purepp.effects)"
        )
    match effect:
        case WaitStream():
            return f"wait_stream({effect.stream.value} waits for {effect.waits_for.value})"
        case RecordEvent():
            return f"record_event({effect.event.name!r} on {effect.stream.value})"
        case WaitEvent():
            return f"wait_event({effect.event.name!r} on {effect.stream.value})"
        case ForgetEvent():
            return f"forget_event({effect.event.name!r})"
        case Allocate():
            return f"allocate({effect.buffer.name!r})"
        case CopyHostToDevice():
            return f"copy_host_to_device({effect.buffer.name!r})"
        case Broadcast():
            return f"broadcast({effect.buffer.name!r} over {effect.comm.value})"
        case CheckHeader():
            return f"check_header({effect.buffer.name!r} == {effect.expected.tolist()})"
        case AllReduce():
            mode = "synchronous" if effect.work is None else f"work {effect.work.name!r}"
            return f"all_reduce({effect.result.name!r} over {effect.comm.value}, {mode})"
        case WaitWork():
            return f"wait_work({effect.work.name!r})"
        case NoteDecision():
            return f"note_decision({effect.table.name!r}: {effect.cg_mode})"
        case RecordStream():
            return f"record_stream({effect.buffer.name!r} on {effect.stream.value})"
        case Release():
            return f"release({effect.buffer.name!r})"
        case Alias():
            return f"alias({effect.source.name!r} as {effect.out.name!r})"
        case PadColumns():
            return f"pad_columns({effect.source.name!r} -> {effect.out.name!r})"
        case StackRows():
            return f"stack_rows(-> {effect.out.name!r})"
        case GatherRows():
            return f"gather_rows({effect.source.name!r} -> {effect.out.name!r})"
        case ScatterRows():
            return f"scatter_rows({effect.source.name!r} -> {effect.target.name!r})"
        case Synchronize():
            return f"synchronize({effect.stream.value})"
        case Pack():
            sources = ", ".join(repr(s.buffer.name) for s in effect.sections)
            return f"pack({sources} -> {effect.out.name!r})"
        case Unpack():
            views = ", ".join(repr(s.buffer.name) for s in effect.sections)
            return f"unpack({effect.source.name!r} -> {views})"
        case _:
            typing.assert_never(effect)


class PostedCollective:
    """A collective one rank has issued: what a port matches, and completes by moving data.

    Mutable bookkeeping shared between the interpreter that issued it and the port.
    """

    def __init__(self, rank: int, effect: Broadcast | AllReduce, array: Array) -> None:
        self.rank = rank  # the issuing global rank
        self.effect = effect  # what it declared
        self.array = array  # the live send/receive buffer, or the all-reduce table
        self.at_head = False  # whether it is first on its stream (async all-reduce: at once)
        self.done = False  # whether the data has moved

    def complete(self) -> None:
        self.done = True


class CollectivePort(Protocol):
    """Where an interpreter sends its collectives: a single rank, or the simulator."""

    def post(self, posted: PostedCollective, /) -> None:
        """`posted` was issued: called in issue order, before it can run."""

    def reach_head(self, posted: PostedCollective, /) -> None:
        """`posted` is first on its stream (or asynchronous): it may now complete."""


class _SoloPort:
    """A world of one rank: collectives complete as soon as they reach their stream's head."""

    def __init__(self, rank: int) -> None:
        self._rank = rank

    def post(self, posted: PostedCollective, /) -> None:
        effect = posted.effect
        if isinstance(effect, Broadcast) and effect.src != self._rank:
            raise InterpreterError(
                _describe(effect),
                f"broadcast from rank {effect.src} in the lone interpreter of rank {self._rank}",
                "run multi-rank programs in purepp.effects.simulator.simulate",
            )
        # A table has a column per member: summed alone, the absent members' columns would
        # stay zero and the group would quietly decide as if they were idle.
        table = effect.contribution if isinstance(effect, AllReduce) else None
        if table is not None and table.ndim == 2 and table.shape[1] > 1:
            raise InterpreterError(
                _describe(effect),
                f"all-reduce over a group of {table.shape[1]} ranks in the lone "
                f"interpreter of rank {self._rank}",
                "run multi-rank programs in purepp.effects.simulator.simulate",
            )

    def reach_head(self, posted: PostedCollective, /) -> None:
        effect = posted.effect
        if isinstance(effect, AllReduce):
            posted.array[...] = effect.contribution
        posted.complete()


class _Buffer:
    """A tensor's memory: its array, the pool it belongs to, and who still uses it.

    A view (Unpack) is a `_Buffer` of its own array that shares its base's `memory`:
    names, uses and RecordStream marks count on the memory, as torch's storage would.
    """

    def __init__(self, array: Array, home: Stream, base: _Buffer | None = None) -> None:
        self.array = array  # the live contents (a view of `memory.array` for a view)
        self.memory: _Buffer = self if base is None else base.memory  # what is allocated
        self.home = home  # the stream whose allocation pool owns the memory
        self.recorded: set[Stream] = set()  # streams named by RecordStream
        self.names = 0  # environment names bound to it (and to its views)
        # By stream: the position (1-based, in its issue order) of its last effect using it.
        self.uses: dict[Stream, int] = {}


@attrs.frozen(kw_only=True)
class LifetimeViolation:
    """A buffer's last name was released while another stream still used it, unrecorded."""

    buffer: BufferRef  # the name whose release (or rebinding) freed it
    step: int | None  # step of the Release; None when the caller's `bind` replaced it
    op: Op | None  # operation that emitted the Release; None for a `bind`
    used_on: tuple[Stream, ...]  # streams whose use is not ordered before it, not recorded


@attrs.frozen(kw_only=True)
class _EventMark:
    """An event completes when its stream has run every effect queued before the record."""

    stream: Stream  # the stream it was recorded on
    target: int  # how many effects that stream must have run
    # By stream: how many of its effects are ordered before the record (`_point`).
    clock: dict[Stream, int] = attrs.field(eq=False, hash=False)


@attrs.define(eq=False)
class _Kernel:
    """A local effect queued on a stream: runs when it reaches the head."""

    effect: Effect  # the effect it performs
    run: Callable[[], None]  # writes the outputs
    touches: tuple[_Buffer, ...]  # buffers it reads or writes


@attrs.define(eq=False)
class _CollectiveStep:
    """A collective queued on a stream: done when the port has moved its data."""

    effect: Effect  # the collective
    posted: PostedCollective  # its bookkeeping with the port
    touches: tuple[_Buffer, ...]  # its buffer


@attrs.define(eq=False)
class _StreamWait:
    """A wait queued on a stream: done when `on` has run `target` effects."""

    effect: Effect  # WaitStream or WaitEvent
    on: Stream  # the stream waited for
    target: int  # its run count that releases the wait
    touches: tuple[_Buffer, ...] = ()  # none


@attrs.define(eq=False)
class _WorkWait:
    """The host waits for an asynchronous all-reduce."""

    effect: Effect  # the WaitWork
    posted: PostedCollective  # the all-reduce
    touches: tuple[_Buffer, ...] = ()  # none


_Queued: TypeAlias = _Kernel | _CollectiveStep | _StreamWait | _WorkWait


class _Lane:
    """One stream's FIFO of issued, unfinished effects."""

    def __init__(self) -> None:
        self.queue: deque[_Queued] = deque()
        self.issued = 0  # effects ever queued
        self.ran = 0  # effects ever run
        # By other stream: how many of its effects are ordered before this lane's next
        # one (what it waited for; for the host, what it synchronised with).
        self.clock: dict[Stream, int] = {}


@attrs.frozen(kw_only=True, eq=False)
class Stall:
    """The head of a stream that cannot run yet, and the collective it comes down to."""

    stream: Stream  # the stuck stream (MAIN when `host`)
    effect: Effect  # the effect at its head
    culprit: PostedCollective | None  # the unfinished collective it waits for, if any
    host: bool = False  # the host itself waits (it issues nothing more), not a stream


class NumpyInterpreter:
    """Performs effects on numpy arrays for one rank.

    The caller `bind`s its own arrays before a step and reads results with
    `tensor` (the live array) or `host_array` (a read-only copy) after it.
    """

    def __init__(
        self,
        *,
        rank: int = 0,
        port: CollectivePort | None = None,
        fill: int = POISON,
        backend: Backend = "nccl",
    ) -> None:
        """`rank`: this rank's global rank. `port`: where collectives go (default: a
        world of this rank alone). `fill`: the contents of fresh buffers. `backend`:
        what the relay's broadcasts run on ('gloo': each blocks the host)."""
        call = "NumpyInterpreter"
        rank = check_int(call, "rank", rank, 0, config=True)
        self._backend = check_backend(call, "backend", backend)
        # int32 buffers are filled too: a fill past int32 would fail at the first Allocate.
        fill = check_int(call, "fill", fill, -INT32_MAX - 1, config=True)
        if port is not None and not all(
            callable(getattr(port, m, None)) for m in ("post", "reach_head")
        ):
            raise ConfigError(
                call,
                f"port is {a_type(port)}, not a CollectivePort",
                "leave port out (a world of this rank alone), or pass the simulator's port",
            )
        self._rank = rank
        self._port: CollectivePort = _SoloPort(rank) if port is None else port
        self._fill = fill
        self._env: Environment[_Buffer, _EventMark, PostedCollective] = Environment(
            "NumpyInterpreter"
        )
        self._lanes: dict[Stream, _Lane] = {stream: _Lane() for stream in Stream}
        # The host's own waits: it issues nothing while one is pending.
        self._host = _Lane()
        # What `advance` and `stalls` walk: the host (None), then every stream.
        self._walk: tuple[tuple[Stream | None, _Lane], ...] = (
            (None, self._host),
            *self._lanes.items(),
        )
        self._violations: list[LifetimeViolation] = []

    # ---- the caller's side -------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._rank

    def bind(self, ref: BufferRef, array: npt.ArrayLike) -> None:
        """Bind the caller's array to `ref` (on the main stream), replacing any earlier binding.

        An int64 or int32 array is bound itself, whatever its strides, so in-place
        effects (ScatterRows) write the caller's memory, as the torch interpreter writes
        its tensors; a read-only one is refused as a ScatterRows target, a stride-0 one
        as well; any other dtype is refused here.
        """
        call = "NumpyInterpreter.bind"
        self._env.check_rebindable(call, ref)
        value = host_array(call, f"the value for {ref.name!r}", array, fix=_BIND_FIX)
        allowed = {numpy_dtype(d) for d in DType}
        if value.dtype not in allowed:
            raise InvalidInputError(
                call,
                f"array for {ref.name!r} has dtype {value.dtype}",
                _BIND_FIX,
            )
        self._set(ref, _Buffer(value, Stream.MAIN), step=None, op=None)

    def tensor(self, ref: BufferRef) -> Array:
        """The live array bound to `ref`."""
        return self._env.lookup("NumpyInterpreter.tensor", ref).array

    def host_array(self, ref: BufferRef) -> Array:
        """A read-only copy of the array bound to `ref` (e.g. the reduced DP table)."""
        copy = np.array(self._env.lookup("NumpyInterpreter.host_array", ref).array, copy=True)
        copy.flags.writeable = False
        return copy

    def resolve(self, value: object) -> dict[str, Array]:
        """Every BufferRef inside `value`, by attribute path, resolved to its live array.

        Walks attrs instances, tuples and lists, as the torch interpreter's `resolve`.
        """
        return self._env.resolve(value, _array)

    def bound_refs(self) -> frozenset[BufferRef | EventRef | WorkRef]:
        """Every name the environment holds now."""
        return self._env.bound_refs()

    def event_completed(self, event: EventRef) -> bool:
        """Whether every effect queued before `event` was recorded has run."""
        mark = self._env.recorded_event("NumpyInterpreter.event_completed", event)
        return self._lanes[mark.stream].ran >= mark.target

    @property
    def lifetime_violations(self) -> tuple[LifetimeViolation, ...]:
        """Buffers released while another stream still used them without RecordStream."""
        return tuple(self._violations)

    def perform(self, effects: Iterable[Effect], /) -> None:
        """Perform `effects` in order; raise if the host would block (a peer is needed)."""
        call = "NumpyInterpreter.perform"
        batch = effect_batch(call, effects)  # whole, so a stranger issues nothing
        for effect in batch:
            self.issue(effect)
            if self.host_blocked() or (effect is batch[-1] and not self.main_idle()):
                stall = self.stalls()[0]  # the host's, else the main stream's
                raise InterpreterError(
                    _describe(effect),
                    f"the host waits on {describe_effect(stall.effect)}, which needs other ranks",
                    "run multi-rank programs in purepp.effects.simulator.simulate",
                )

    # ---- the driver's side (the simulator) -----------------------------------------------

    def host_blocked(self) -> bool:
        """Whether the host waits (a CPU all-reduce, WaitWork, Synchronize, a gloo
        broadcast) for something that cannot complete yet."""
        return bool(self._host.queue)

    def main_idle(self) -> bool:
        """Whether the main stream has run everything issued to it: a host read (as a
        `.cpu()` copy) would not wait."""
        return not self._lanes[Stream.MAIN].queue

    def idle(self) -> bool:
        """Whether every issued effect has run."""
        return not any(lane.queue for _, lane in self._walk)

    def issue(self, effect: Effect) -> None:
        """Validate one effect, bind its outputs, queue it on its stream, run what can run."""
        if self.host_blocked():
            head = self._host.queue[0].effect
            raise InterpreterError(
                _describe(effect),
                f"the host is still waiting on {describe_effect(head)}",
                "issue the next effect only once the host is unblocked (see host_blocked())",
            )
        self._issue(effect)
        self.advance()

    def advance(self) -> bool:
        """Run every queued effect that can run now; whether anything ran."""
        progressed = False
        moved = True
        while moved:
            moved = False
            for _, lane in self._walk:
                while lane.queue:
                    try:
                        if not self._try_run(lane.queue[0]):
                            break
                    except PureppError:
                        # A kernel that refused its data (an index out of range) is done,
                        # having written nothing: the stream goes on, as checked torch's
                        # refusal before the kernel leaves it.
                        self._done(lane)
                        raise
                    self._done(lane)
                    moved = progressed = True
        return progressed

    def _done(self, lane: _Lane) -> None:
        """The head of `lane`'s queue has run."""
        lane.queue.popleft()
        lane.ran += 1

    def stalls(self) -> tuple[Stall, ...]:
        """The host's wait, then each stream whose head cannot run yet, with the
        collective it waits for."""
        return tuple(
            Stall(
                stream=Stream.MAIN if stream is None else stream,
                effect=lane.queue[0].effect,
                culprit=self._culprit(stream, set()),
                host=stream is None,
            )
            for stream, lane in self._walk
            if lane.queue
        )

    def unfinished_works(self) -> tuple[PostedCollective, ...]:
        """Asynchronous all-reduces issued and not yet waited on."""
        return tuple(posted for posted, _ in self._env.works.values())

    # ---- dispatch ------------------------------------------------------------------------

    def _issue(self, effect: Effect) -> None:
        match effect:
            case WaitStream():
                self._wait_stream(effect)
            case RecordEvent():
                self._record_event(effect)
            case WaitEvent():
                self._wait_event(effect)
            case ForgetEvent():
                self._forget_event(effect)
            case Allocate():
                self._allocate(effect)
            case CopyHostToDevice():
                self._copy_host_to_device(effect)
            case Broadcast():
                self._broadcast(effect)
            case CheckHeader():
                self._check_header(effect)
            case AllReduce():
                self._all_reduce(effect)
            case WaitWork():
                self._wait_work(effect)
            case NoteDecision():
                self._env.lookup(effect, effect.table)  # decided from it: still bound
            case RecordStream():
                self._env.lookup(effect, effect.buffer).memory.recorded.add(effect.stream)
            case Release():
                self._env.lookup(effect, effect.buffer)
                self._unbind(effect.buffer, step=effect.step, op=effect.op)
            case Alias():
                buffer = self._env.lookup(effect, effect.source)
                self._env.check_unbound(effect, effect.out)
                self._set(effect.out, buffer, step=effect.step, op=effect.op)
            case PadColumns():
                self._pad_columns(effect)
            case StackRows():
                self._stack_rows(effect)
            case GatherRows():
                self._gather_rows(effect)
            case ScatterRows():
                self._scatter_rows(effect)
            case Synchronize():
                self._synchronize(effect)
            case Pack():
                self._pack(effect)
            case Unpack():
                self._unpack(effect)
            case _:  # a caller's garbage: refused before it changes anything
                # Only `issue` gets here: `perform` and the simulator check their effects first.
                raise InvalidInputError(
                    "NumpyInterpreter.issue",
                    f"{effect!r} is {a_type(effect)}, not an effect",
                    "pass one effect from purepp.effects.vocabulary",
                )

    # ---- environment helpers -------------------------------------------------------------

    def _set(self, ref: BufferRef, buffer: _Buffer, *, step: int | None, op: Op | None) -> None:
        if ref in self._env.buffers:
            self._unbind(ref, step=step, op=op)
        buffer.memory.names += 1
        self._env.buffers[ref] = buffer

    def _unbind(self, ref: BufferRef, *, step: int | None, op: Op | None) -> None:
        buffer = self._env.buffers.pop(ref).memory
        buffer.names -= 1
        if buffer.names:
            return
        # The memory goes back to its stream's pool: a reuse is ordered after that
        # stream's point now. Use on the same stream is before it; use on another is
        # safe if ordered before it (an event or stream wait, a host synchronize) or
        # recorded.
        reuse = self._point(buffer.home)
        unsafe = tuple(
            stream
            for stream, at in buffer.uses.items()
            if stream is not buffer.home
            and stream not in buffer.recorded
            and reuse.get(stream, 0) < at
        )
        if unsafe:
            buffer.array.fill(self._fill)
            self._violations.append(LifetimeViolation(buffer=ref, step=step, op=op, used_on=unsafe))

    def _fresh(self, shape: tuple[int, ...], dtype: np.dtype[Any], home: Stream) -> _Buffer:
        return _Buffer(np.full(shape, self._fill, dtype=dtype), home)

    def _queue(self, stream: Stream | None, item: _Queued) -> None:
        """Queue `item` on `stream`, or on the host's lane (None)."""
        if stream is None:
            # The host issues nothing until it completes: no release can race its buffers.
            lane = self._host
        else:
            lane = self._lanes[stream]
            for buffer in item.touches:
                buffer.memory.uses[stream] = lane.issued + 1
        lane.queue.append(item)
        lane.issued += 1

    def _point(self, stream: Stream) -> dict[Stream, int]:
        """How many of each stream's effects an effect issued on `stream` now is ordered
        after: what `stream` waited for, what the host synchronised with, and `stream`'s
        own effects so far."""
        lane = self._lanes[stream]
        point = _later(lane.clock, self._host.clock)
        point[stream] = lane.issued
        return point

    def _order_after(self, stream: Stream, point: dict[Stream, int]) -> None:
        """What `stream` runs from now on waits for `point` (an event or stream wait)."""
        lane = self._lanes[stream]
        lane.clock = _later(lane.clock, point)

    def _try_run(self, item: _Queued) -> bool:
        match item:
            case _Kernel():
                item.run()
                return True
            case _CollectiveStep():
                if not item.posted.at_head:
                    item.posted.at_head = True
                    self._port.reach_head(item.posted)
                return item.posted.done
            case _StreamWait():
                return self._lanes[item.on].ran >= item.target
            case _WorkWait():
                return item.posted.done
            case _:
                typing.assert_never(item)

    def _culprit(self, stream: Stream | None, seen: set[Stream]) -> PostedCollective | None:
        """The unfinished collective that the head of `stream` (None: the host's lane)
        comes down to."""
        lane = self._host if stream is None else self._lanes[stream]
        if not lane.queue or stream in seen:
            return None
        head = lane.queue[0]
        match head:
            case _CollectiveStep() | _WorkWait():
                return None if head.posted.done else head.posted
            case _StreamWait():
                return self._culprit(head.on, seen if stream is None else seen | {stream})
            case _Kernel():
                return None
            case _:
                typing.assert_never(head)

    # ---- streams and events --------------------------------------------------------------

    def _record_event(self, effect: RecordEvent) -> None:
        self._env.check_recordable(effect, effect.event)
        target = self._lanes[effect.stream].issued
        mark = _EventMark(stream=effect.stream, target=target, clock=self._point(effect.stream))
        self._env.record_event(effect, effect.event, mark)

    def _wait_event(self, effect: WaitEvent) -> None:
        mark = self._env.take_event(effect, effect.event)
        self._order_after(effect.stream, mark.clock)
        self._queue(effect.stream, _StreamWait(effect, mark.stream, mark.target))

    def _wait_stream(self, effect: WaitStream) -> None:
        target = self._lanes[effect.waits_for].issued
        self._order_after(effect.stream, self._point(effect.waits_for))
        self._queue(effect.stream, _StreamWait(effect, effect.waits_for, target))

    def _synchronize(self, effect: Synchronize) -> None:
        # The host waits until `stream` has run what it holds: all it issues later is after.
        target = self._lanes[effect.stream].issued
        self._host.clock = _later(self._host.clock, self._point(effect.stream))
        self._queue(None, _StreamWait(effect, effect.stream, target))

    def _forget_event(self, effect: ForgetEvent) -> None:
        self._env.forget_event(effect, effect.event)

    # ---- buffers -------------------------------------------------------------------------

    def _allocate(self, effect: Allocate) -> None:
        self._env.check_unbound(effect, effect.buffer)
        self._env.check_sizes(effect, effect.buffer, effect.shape)
        buffer = self._fresh(effect.shape, numpy_dtype(effect.dtype), effect.stream)
        self._set(effect.buffer, buffer, step=effect.step, op=effect.op)
        self._queue(effect.stream, _Kernel(effect, _nothing, (buffer,)))

    def _copy_host_to_device(self, effect: CopyHostToDevice) -> None:
        self._env.check_unbound(effect, effect.buffer)
        source = effect.source  # read-only: safe to read whenever the copy runs
        out = self._fresh(source.shape, np.dtype(np.int32), effect.stream)
        self._set(effect.buffer, out, step=effect.step, op=effect.op)

        def run() -> None:
            out.array[...] = source

        self._queue(effect.stream, _Kernel(effect, run, (out,)))

    # ---- collectives ---------------------------------------------------------------------

    def _broadcast(self, effect: Broadcast) -> None:
        buffer = self._env.lookup(effect, effect.buffer)
        self._env.check_wire(
            effect,
            ref=effect.buffer,
            shape=buffer.array.shape,
            dtype=buffer.array.dtype,
            wire=effect.shape,
            wire_dtype=numpy_dtype(effect.dtype),
        )
        posted = PostedCollective(self._rank, effect, buffer.array)
        self._port.post(posted)
        # gloo's broadcast holds the host until the port lets this member go (gloo's
        # tree); NCCL's only its stream.
        stream = None if self._backend == "gloo" else effect.stream
        self._queue(stream, _CollectiveStep(effect, posted, (buffer,)))

    def _check_header(self, effect: CheckHeader) -> None:
        received = self._env.lookup(effect, effect.buffer)
        expected = effect.expected
        self._env.check_header(
            effect,
            ref=effect.buffer,
            shape=received.array.shape,
            dtype=received.array.dtype,
            expected=expected.shape,
            int32=np.dtype(np.int32),
        )

        def run() -> None:
            # Runs once the header's broadcast has completed, as the device kernel would.
            if not np.array_equal(received.array, expected):
                raise HeaderMismatchError(
                    _describe(effect),
                    rank=self._rank,
                    step=effect.step,
                    expected=tuple(int(v) for v in expected.tolist()),
                    received=tuple(int(v) for v in received.array.tolist()),
                )

        self._queue(effect.stream, _Kernel(effect, run, (received,)))

    def _all_reduce(self, effect: AllReduce) -> None:
        self._env.check_unbound(effect, effect.result)
        if effect.work is not None:
            self._env.check_work_free(effect, effect.work)
        table = _Buffer(np.array(effect.contribution, dtype=np.int32, copy=True), Stream.MAIN)
        posted = PostedCollective(self._rank, effect, table.array)
        self._port.post(posted)  # may refuse it: bind the result only after
        self._set(effect.result, table, step=effect.step, op=effect.op)
        if effect.work is None:
            # Synchronous on the CPU group: the host waits for it.
            self._queue(None, _CollectiveStep(effect, posted, ()))
            return
        self._env.start_work(effect.work, posted, effect.result)
        # Gloo runs it on its own thread: it never waits behind a stream.
        posted.at_head = True
        self._port.reach_head(posted)

    def _wait_work(self, effect: WaitWork) -> None:
        posted, _ = self._env.work(effect, effect.work)
        self._env.end_work(effect.work)
        self._queue(None, _WorkWait(effect, posted))

    # ---- device-side data moves ------------------------------------------------------------

    def _pad_columns(self, effect: PadColumns) -> None:
        source = self._env.lookup(effect, effect.source)
        self._env.check_unbound(effect, effect.out)
        shape = source.array.shape
        self._env.check_pad(effect, effect.source, shape, effect.width)
        out = self._fresh((shape[0], effect.width), source.array.dtype, effect.stream)
        self._set(effect.out, out, step=effect.step, op=effect.op)
        columns = shape[1]

        def run() -> None:
            out.array[:, :columns] = source.array
            out.array[:, columns:] = effect.fill

        self._queue(effect.stream, _Kernel(effect, run, (source, out)))

    def _stack_rows(self, effect: StackRows) -> None:
        sources = [self._env.lookup(effect, ref) for ref in effect.sources]
        self._env.check_unbound(effect, effect.out)
        layouts = [(b.array.shape, b.array.dtype) for b in sources]
        self._env.check_stack(effect, effect.sources, layouts)
        first = sources[0].array
        out = self._fresh((len(sources), first.shape[0]), first.dtype, effect.stream)
        self._set(effect.out, out, step=effect.step, op=effect.op)

        def run() -> None:
            for row, source in enumerate(sources):
                out.array[row] = source.array

        self._queue(effect.stream, _Kernel(effect, run, (*sources, out)))

    def _index(self, effect: Effect, ref: BufferRef) -> _Buffer:
        index = self._env.lookup(effect, ref)
        array = index.array
        ok = array.dtype in {np.dtype(np.int32), np.dtype(np.int64)}
        self._env.check_index(effect, ref=ref, shape=array.shape, dtype=array.dtype, ok=ok)
        return index

    def _gather_rows(self, effect: GatherRows) -> None:
        source = self._env.lookup(effect, effect.source)
        index = self._index(effect, effect.index)
        self._env.check_index_rows(effect, index.array.shape)
        self._env.check_unbound(effect, effect.out)
        self._env.check_gather(effect, effect.source, source.array.shape)
        shape = (index.array.shape[0], *source.array.shape[1:])
        out = self._fresh(shape, source.array.dtype, effect.stream)
        self._set(effect.out, out, step=effect.step, op=effect.op)

        def run() -> None:
            self._env.check_rows(effect, index.array, source.array.shape[0])
            out.array[...] = source.array[index.array]

        self._queue(effect.stream, _Kernel(effect, run, (source, index, out)))

    def _scatter_rows(self, effect: ScatterRows) -> None:
        source = self._env.lookup(effect, effect.source)
        index = self._index(effect, effect.index)
        target = self._env.lookup(effect, effect.target)
        s, t = source.array, target.array
        self._env.check_scatter(
            effect,
            source_ref=effect.source,
            target_ref=effect.target,
            source=(s.shape, s.dtype),
            index=index.array.shape,
            target=(t.shape, t.dtype),
        )

        # Strides in elements, as torch gives them (numpy's are in bytes).
        strides = [stride // t.itemsize for stride in t.strides]
        self._env.check_scatter_target(effect, effect.target, t.shape, strides, t.flags.writeable)
        self._env.check_target_rows(effect, t.shape)

        def run() -> None:
            slots = index.array
            self._env.check_rows(effect, slots, target.array.shape[0])
            keep = slots != -1
            target.array[slots[keep]] = source.array[keep]

        self._queue(effect.stream, _Kernel(effect, run, (source, index, target)))

    def _pack(self, effect: Pack) -> None:
        sources = [self._env.lookup(effect, section.buffer) for section in effect.sections]
        self._env.check_unbound(effect, effect.out)
        layouts = [(b.array.shape, b.array.dtype) for b in sources]
        wanted = [numpy_dtype(section.dtype) for section in effect.sections]
        self._env.check_pack(effect, layouts, wanted)
        out = self._fresh((effect.nbytes // 8,), np.dtype(np.int64), effect.stream)
        self._set(effect.out, out, step=effect.step, op=effect.op)
        sections = effect.sections

        def run() -> None:
            out.array[...] = 0
            for section, source in zip(sections, sources, strict=True):
                region = section_view(out.array, section)
                region[tuple(slice(0, size) for size in source.array.shape)] = source.array

        self._queue(effect.stream, _Kernel(effect, run, (*sources, out)))

    def _unpack(self, effect: Unpack) -> None:
        source = self._env.lookup(effect, effect.source)
        array = source.array
        # The address past 16-byte alignment: where torch's view would start in its storage.
        offset = array.ctypes.data % 16
        self._env.check_unpack(effect, array.nbytes, array.flags.c_contiguous, offset)
        self._env.check_views_unbound(effect)
        # Views queue no work: each reads whatever the source holds when it is used.
        for section in effect.sections:
            view = _Buffer(section_view(array, section), source.memory.home, base=source)
            self._set(section.buffer, view, step=effect.step, op=effect.op)


def section_view(packed: Array, section: Section) -> Array:
    """The region of the contiguous `packed` array that `section` names, as a view."""
    size = math.prod(section.shape) * itemsize(section.dtype)
    raw = packed.reshape(-1).view(np.uint8)[section.offset : section.offset + size]
    return raw.view(numpy_dtype(section.dtype)).reshape(section.shape)


def _describe(effect: Effect) -> str:
    return effect_call("NumpyInterpreter", effect)


def _later(a: dict[Stream, int], b: dict[Stream, int]) -> dict[Stream, int]:
    """Per stream, the later of two points (a fresh dict)."""
    later = dict(a)
    for stream, count in b.items():
        if count > later.get(stream, 0):
            later[stream] = count
    return later


def _array(buffer: _Buffer) -> Array:
    return buffer.array


def _nothing() -> None:
    """An allocation has nothing to run: its buffer is bound (and poisoned) at issue."""
