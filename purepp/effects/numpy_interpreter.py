"""The reference interpreter: performs effects on numpy arrays, in one process.

It gives every effect the meaning the torch interpreter gives it (the vocabulary's
docstrings), with streams modelled explicitly so that ordering bugs show up:

- The host and the main stream advance together: a main-stream effect runs when
  it is issued, and a main-stream wait on unfinished side-stream work blocks the
  host. (A real host would run on and queue more main-stream kernels; blocking is
  the conservative model, and it is what lets the simulator see the wait.)
- A side stream (RELAY) is a FIFO of pending effects. An effect queued behind a
  broadcast that has not completed waits, as it would on a CUDA stream; so does
  the event recorded after it.
- References are resolved and output buffers bound when an effect is issued, as
  torch returns a tensor object at once; their contents are written when the
  effect runs. Fresh buffers (Allocate and every kernel output) start out filled
  with `POISON`, so reading data that was never written is visible.
- Collectives go to a `CollectivePort`. Alone (the default port), only a
  one-member world is possible: a broadcast from this rank and an all-reduce of
  this rank's table complete at once. The simulator supplies a port that matches
  and moves data between ranks.
- `CheckHeader` is a kernel on its stream: it compares once the header's broadcast
  has completed, and a mismatch raises `HeaderMismatchError` (naming this rank, the
  step and both headers) from whichever call ran it; in the simulator the run stops.
- Buffer lifetimes follow the caching allocator: a buffer belongs to the pool of
  the stream it was made on. When its last name is released while an unfinished
  effect on another stream still uses it, and that stream was not recorded with
  `RecordStream`, its memory may be reused at once: the array is overwritten
  with `POISON` and the interpreter notes a `LifetimeViolation`.

Names follow the torch interpreter: effects that create a binding refuse a name
already bound; `bind` replaces; `WaitEvent` and `WaitWork` consume their event or
work; the table of an asynchronous all-reduce is unreadable until its `WaitWork`.
"""

from __future__ import annotations

import typing
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Any, Final, Protocol, TypeAlias

import attrs
import numpy as np
import numpy.typing as npt

from purepp.effects.vocabulary import (
    Alias,
    Allocate,
    AllReduce,
    Broadcast,
    BufferRef,
    CheckHeader,
    CopyHostToDevice,
    DType,
    Effect,
    EventRef,
    ForgetEvent,
    GatherRows,
    Op,
    PadColumns,
    RecordEvent,
    RecordStream,
    Release,
    ScatterRows,
    StackRows,
    Stream,
    WaitEvent,
    WaitStream,
    WaitWork,
    WorkRef,
)
from purepp.errors import HeaderMismatchError, InterpreterError, InvalidInputError

__all__ = [
    "POISON",
    "CollectivePort",
    "LifetimeViolation",
    "NumpyInterpreter",
    "PostedCollective",
    "Stall",
    "describe_effect",
    "numpy_dtype",
]

# Fill of fresh buffers and of memory reused too early: negative, so never a token id,
# and not -1, which index buffers use for "skip this row".
POISON: Final = -0x0BADF00D

Array: TypeAlias = npt.NDArray[Any]


def numpy_dtype(dtype: DType) -> np.dtype[Any]:
    """The numpy dtype a vocabulary dtype stands for."""
    match dtype:
        case DType.INT64:
            return np.dtype(np.int64)
        case DType.INT32:
            return np.dtype(np.int32)
        case DType.BOOL:
            return np.dtype(np.bool_)
        case _:
            typing.assert_never(dtype)


def describe_effect(effect: Effect) -> str:
    """A short description of an effect for reports: kind and the names it involves."""
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
        case _:
            typing.assert_never(effect)


def _call(effect: Effect) -> str:
    return (
        f"NumpyInterpreter.perform({type(effect).__name__} step={effect.step} op={effect.op.value})"
    )


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
                _call(effect),
                f"broadcast from rank {effect.src} in the lone interpreter of rank {self._rank}",
                "run multi-rank programs in purepp.effects.simulator.simulate",
            )

    def reach_head(self, posted: PostedCollective, /) -> None:
        effect = posted.effect
        if isinstance(effect, AllReduce):
            posted.array[...] = effect.contribution
        posted.complete()


class _Buffer:
    """A tensor's memory: its array, the pool it belongs to, and who still uses it."""

    def __init__(self, array: Array, home: Stream) -> None:
        self.array = array  # the live contents
        self.home = home  # the stream whose allocation pool owns the memory
        self.recorded: set[Stream] = set()  # streams named by RecordStream
        self.names = 0  # environment names bound to it
        self.pending: Counter[Stream] = Counter()  # queued, unfinished effects using it, by stream


@attrs.frozen(kw_only=True)
class LifetimeViolation:
    """A buffer's last name was released while another stream still used it, unrecorded."""

    buffer: BufferRef  # the name whose release (or rebinding) freed it
    step: int | None  # step of the Release; None when the caller's `bind` replaced it
    op: Op | None  # operation that emitted the Release; None for a `bind`
    used_on: tuple[Stream, ...]  # streams with unfinished effects on it, not recorded


@attrs.frozen(kw_only=True)
class _EventMark:
    """An event completes when its stream has run every effect queued before the record."""

    stream: Stream  # the stream it was recorded on
    target: int  # how many effects that stream must have run


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


@attrs.frozen(kw_only=True, eq=False)
class Stall:
    """The head of a stream that cannot run yet, and the collective it comes down to."""

    stream: Stream  # the stuck stream (MAIN: the host waits with it)
    effect: Effect  # the effect at its head
    culprit: PostedCollective | None  # the unfinished collective it waits for, if any


class NumpyInterpreter:
    """Performs effects on numpy arrays for one rank.

    The caller `bind`s its own arrays before a step and reads results with
    `tensor` (the live array) or `host_array` (a read-only copy) after it.
    """

    def __init__(
        self, *, rank: int = 0, port: CollectivePort | None = None, fill: int = POISON
    ) -> None:
        """`rank`: this rank's global rank. `port`: where collectives go (default: a
        world of this rank alone). `fill`: the contents of fresh buffers."""
        self._rank = rank
        self._port: CollectivePort = _SoloPort(rank) if port is None else port
        self._fill = fill
        self._buffers: dict[BufferRef, _Buffer] = {}
        self._events: dict[EventRef, _EventMark] = {}
        self._works: dict[WorkRef, tuple[PostedCollective, BufferRef]] = {}
        self._pending_results: dict[BufferRef, WorkRef] = {}
        self._lanes: dict[Stream, _Lane] = {stream: _Lane() for stream in Stream}
        self._violations: list[LifetimeViolation] = []

    # ---- the caller's side -------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._rank

    def bind(self, ref: BufferRef, array: npt.ArrayLike) -> None:
        """Bind the caller's array to `ref` (on the main stream), replacing any earlier binding.

        A writable int64/int32/bool array is bound itself, so in-place effects
        (ScatterRows) are visible to the caller; anything else is copied first.
        """
        call = "NumpyInterpreter.bind"
        if ref in self._pending_results:
            raise InterpreterError(
                call,
                f"buffer {ref.name!r} is being written by all-reduce "
                f"{self._pending_results[ref].name!r}",
                "perform its WaitWork before rebinding the name",
            )
        value = np.asarray(array)
        allowed = {numpy_dtype(d) for d in DType}
        if value.dtype not in allowed:
            raise InvalidInputError(
                call,
                f"array for {ref.name!r} has dtype {value.dtype}",
                "bind int64, int32 or bool arrays",
            )
        if not (value.flags.writeable and value.flags.c_contiguous):
            value = np.array(value, copy=True, order="C")
        self._set(ref, _Buffer(value, Stream.MAIN), step=None, op=None)

    def tensor(self, ref: BufferRef) -> Array:
        """The live array bound to `ref`."""
        return self._lookup("NumpyInterpreter.tensor", ref).array

    def host_array(self, ref: BufferRef) -> Array:
        """A read-only copy of the array bound to `ref` (e.g. the reduced DP table)."""
        copy = np.array(self._lookup("NumpyInterpreter.host_array", ref).array, copy=True)
        copy.flags.writeable = False
        return copy

    def resolve(self, value: object) -> dict[str, Array]:
        """Every BufferRef inside `value`, by attribute path, resolved to its live array.

        Walks attrs instances, tuples and lists, as the torch interpreter's `resolve`.
        """
        found: dict[str, Array] = {}
        self._collect(value, "", found)
        return found

    def bound_refs(self) -> frozenset[BufferRef | EventRef | WorkRef]:
        """Every name the environment holds now."""
        return frozenset((*self._buffers, *self._events, *self._works))

    def event_completed(self, event: EventRef) -> bool:
        """Whether every effect queued before `event` was recorded has run."""
        mark = self._events.get(event)
        if mark is None:
            raise InterpreterError(
                "NumpyInterpreter.event_completed",
                f"event {event.name!r} is not recorded (or was already waited on)",
                "ask about an event that is recorded and not yet consumed",
            )
        return self._lanes[mark.stream].ran >= mark.target

    @property
    def lifetime_violations(self) -> tuple[LifetimeViolation, ...]:
        """Buffers released while another stream still used them without RecordStream."""
        return tuple(self._violations)

    def perform(self, effects: Iterable[Effect], /) -> None:
        """Perform `effects` in order; raise if the host would block (a peer is needed)."""
        for effect in effects:
            self.issue(effect)
            if self.host_blocked():
                stall = self.stalls()[0]
                raise InterpreterError(
                    _call(effect),
                    f"the host waits on {describe_effect(stall.effect)}, which needs other ranks",
                    "run multi-rank programs in purepp.effects.simulator.simulate",
                )

    # ---- the driver's side (the simulator) -----------------------------------------------

    def host_blocked(self) -> bool:
        """Whether the host waits: the main stream has an effect that cannot run yet."""
        return bool(self._lanes[Stream.MAIN].queue)

    def idle(self) -> bool:
        """Whether every issued effect has run."""
        return not any(lane.queue for lane in self._lanes.values())

    def issue(self, effect: Effect) -> None:
        """Validate one effect, bind its outputs, queue it on its stream, run what can run."""
        if self.host_blocked():
            head = self._lanes[Stream.MAIN].queue[0].effect
            raise InterpreterError(
                _call(effect),
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
            for stream, lane in self._lanes.items():
                while lane.queue and self._try_run(lane.queue[0]):
                    done = lane.queue.popleft()
                    for buffer in done.touches:
                        buffer.pending[stream] -= 1
                    lane.ran += 1
                    moved = progressed = True
        return progressed

    def stalls(self) -> tuple[Stall, ...]:
        """Each stream whose head cannot run yet, with the collective it waits for."""
        return tuple(
            Stall(stream=stream, effect=lane.queue[0].effect, culprit=self._culprit(stream, set()))
            for stream, lane in self._lanes.items()
            if lane.queue
        )

    def unfinished_works(self) -> tuple[PostedCollective, ...]:
        """Asynchronous all-reduces issued and not yet waited on."""
        return tuple(posted for posted, _ in self._works.values())

    # ---- dispatch ------------------------------------------------------------------------

    def _issue(self, effect: Effect) -> None:
        match effect:
            case WaitStream():
                target = self._lanes[effect.waits_for].issued
                self._queue(effect.stream, _StreamWait(effect, effect.waits_for, target))
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
            case RecordStream():
                self._lookup(_call(effect), effect.buffer).recorded.add(effect.stream)
            case Release():
                self._lookup(_call(effect), effect.buffer)
                self._unbind(effect.buffer, step=effect.step, op=effect.op)
            case Alias():
                buffer = self._lookup(_call(effect), effect.source)
                self._check_unbound(_call(effect), effect.out)
                self._set(effect.out, buffer, step=effect.step, op=effect.op)
            case PadColumns():
                self._pad_columns(effect)
            case StackRows():
                self._stack_rows(effect)
            case GatherRows():
                self._gather_rows(effect)
            case ScatterRows():
                self._scatter_rows(effect)
            case _:
                typing.assert_never(effect)

    # ---- environment helpers -------------------------------------------------------------

    def _collect(self, value: object, path: str, found: dict[str, Array]) -> None:
        if isinstance(value, BufferRef):
            found[path] = self._lookup("NumpyInterpreter.resolve", value).array
            return
        if isinstance(value, tuple | list):
            for i, item in enumerate(value):
                self._collect(item, f"{path}[{i}]", found)
            return
        cls = type(value)
        if attrs.has(cls):
            for field in attrs.fields(cls):
                name = f"{path}.{field.name}" if path else field.name
                self._collect(getattr(value, field.name), name, found)

    def _lookup(self, call: str, ref: BufferRef) -> _Buffer:
        if ref in self._pending_results:
            raise InterpreterError(
                call,
                f"buffer {ref.name!r} is the result of all-reduce "
                f"{self._pending_results[ref].name!r}, which has not been waited on",
                "perform its WaitWork before reading or releasing the table",
            )
        buffer = self._buffers.get(ref)
        if buffer is None:
            bound = sorted(b.name for b in self._buffers)
            raise InterpreterError(
                call,
                f"buffer {ref.name!r} is not bound; bound: {bound[:8]}",
                "allocate or bind it before its first use and release it after its last",
            )
        return buffer

    def _check_unbound(self, call: str, ref: BufferRef) -> None:
        if ref in self._buffers or ref in self._pending_results:
            raise InterpreterError(
                call,
                f"buffer {ref.name!r} is already bound",
                "release the old buffer first, or name new buffers from the step counter",
            )

    def _set(self, ref: BufferRef, buffer: _Buffer, *, step: int | None, op: Op | None) -> None:
        if ref in self._buffers:
            self._unbind(ref, step=step, op=op)
        buffer.names += 1
        self._buffers[ref] = buffer

    def _unbind(self, ref: BufferRef, *, step: int | None, op: Op | None) -> None:
        buffer = self._buffers.pop(ref)
        buffer.names -= 1
        if buffer.names:
            return
        # The memory goes back to its stream's pool. Use on the same stream is ordered
        # before any reuse; use on another stream is safe only if recorded.
        unsafe = tuple(
            stream
            for stream, count in buffer.pending.items()
            if count > 0 and stream is not buffer.home and stream not in buffer.recorded
        )
        if unsafe:
            buffer.array.fill(self._fill)
            self._violations.append(LifetimeViolation(buffer=ref, step=step, op=op, used_on=unsafe))

    def _fresh(self, shape: tuple[int, ...], dtype: np.dtype[Any], home: Stream) -> _Buffer:
        return _Buffer(np.full(shape, self._fill, dtype=dtype), home)

    def _queue(self, stream: Stream, item: _Queued) -> None:
        lane = self._lanes[stream]
        for buffer in item.touches:
            buffer.pending[stream] += 1
        lane.queue.append(item)
        lane.issued += 1

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

    def _culprit(self, stream: Stream, seen: set[Stream]) -> PostedCollective | None:
        """The unfinished collective that the head of `stream` comes down to."""
        lane = self._lanes[stream]
        if not lane.queue or stream in seen:
            return None
        head = lane.queue[0]
        match head:
            case _CollectiveStep() | _WorkWait():
                return None if head.posted.done else head.posted
            case _StreamWait():
                return self._culprit(head.on, seen | {stream})
            case _Kernel():
                return None
            case _:
                typing.assert_never(head)

    # ---- streams and events --------------------------------------------------------------

    def _record_event(self, effect: RecordEvent) -> None:
        if effect.event in self._events:
            raise InterpreterError(
                _call(effect),
                f"event {effect.event.name!r} is already recorded and not yet waited on",
                "record each event once under a fresh name (WaitEvent consumes it)",
            )
        target = self._lanes[effect.stream].issued
        self._events[effect.event] = _EventMark(stream=effect.stream, target=target)

    def _wait_event(self, effect: WaitEvent) -> None:
        mark = self._events.pop(effect.event, None)
        if mark is None:
            raise InterpreterError(
                _call(effect),
                f"event {effect.event.name!r} is not recorded (or was already waited on: "
                f"WaitEvent consumes its event); recorded: {sorted(e.name for e in self._events)}",
                "record the event before waiting on it, and wait on it once",
            )
        self._queue(effect.stream, _StreamWait(effect, mark.stream, mark.target))

    def _forget_event(self, effect: ForgetEvent) -> None:
        if self._events.pop(effect.event, None) is None:
            raise InterpreterError(
                _call(effect),
                f"event {effect.event.name!r} is not recorded (or was already waited on)",
                "forget only an event that was recorded and never waited on",
            )

    # ---- buffers -------------------------------------------------------------------------

    def _allocate(self, effect: Allocate) -> None:
        call = _call(effect)
        self._check_unbound(call, effect.buffer)
        if any(size < 0 for size in effect.shape):
            raise InterpreterError(
                call, f"shape {effect.shape} of {effect.buffer.name!r}", "use sizes >= 0"
            )
        buffer = self._fresh(effect.shape, numpy_dtype(effect.dtype), effect.stream)
        self._set(effect.buffer, buffer, step=effect.step, op=effect.op)
        self._queue(effect.stream, _Kernel(effect, _nothing, (buffer,)))

    def _copy_host_to_device(self, effect: CopyHostToDevice) -> None:
        self._check_unbound(_call(effect), effect.buffer)
        source = effect.source  # read-only: safe to read whenever the copy runs
        out = self._fresh(source.shape, np.dtype(np.int32), effect.stream)
        self._set(effect.buffer, out, step=effect.step, op=effect.op)

        def run() -> None:
            out.array[...] = source

        self._queue(effect.stream, _Kernel(effect, run, (out,)))

    # ---- collectives ---------------------------------------------------------------------

    def _broadcast(self, effect: Broadcast) -> None:
        call = _call(effect)
        buffer = self._lookup(call, effect.buffer)
        wire = numpy_dtype(effect.dtype)
        # NCCL does not check sizes: a wrong shape would hang every rank, so check here.
        if buffer.array.shape != effect.shape or buffer.array.dtype != wire:
            raise InterpreterError(
                call,
                f"buffer {effect.buffer.name!r} is {buffer.array.dtype} {buffer.array.shape} "
                f"but the wire is {wire} {effect.shape}",
                "bind a buffer of the declared wire shape and dtype",
            )
        posted = PostedCollective(self._rank, effect, buffer.array)
        self._port.post(posted)
        self._queue(effect.stream, _CollectiveStep(effect, posted, (buffer,)))

    def _check_header(self, effect: CheckHeader) -> None:
        call = _call(effect)
        received = self._lookup(call, effect.buffer)
        expected = effect.expected
        if received.array.shape != expected.shape or received.array.dtype != np.int32:
            raise InterpreterError(
                call,
                f"header {effect.buffer.name!r} is {received.array.dtype} "
                f"{received.array.shape} but the expected header is int32 {expected.shape}",
                "check an int32 header of the expected length",
            )

        def run() -> None:
            # Runs once the header's broadcast has completed, as the device kernel would.
            if not np.array_equal(received.array, expected):
                raise HeaderMismatchError(
                    call,
                    rank=self._rank,
                    step=effect.step,
                    expected=tuple(int(v) for v in expected.tolist()),
                    received=tuple(int(v) for v in received.array.tolist()),
                )

        self._queue(effect.stream, _Kernel(effect, run, (received,)))

    def _all_reduce(self, effect: AllReduce) -> None:
        call = _call(effect)
        self._check_unbound(call, effect.result)
        if effect.work is not None and effect.work in self._works:
            raise InterpreterError(
                call,
                f"work {effect.work.name!r} is already in flight",
                "wait on it before reusing its name",
            )
        table = _Buffer(np.array(effect.contribution, dtype=np.int32, copy=True), Stream.MAIN)
        self._set(effect.result, table, step=effect.step, op=effect.op)
        posted = PostedCollective(self._rank, effect, table.array)
        self._port.post(posted)
        if effect.work is None:
            # Synchronous on the CPU group: the host waits for it.
            self._queue(Stream.MAIN, _CollectiveStep(effect, posted, ()))
            return
        self._works[effect.work] = (posted, effect.result)
        self._pending_results[effect.result] = effect.work
        # Gloo runs it on its own thread: it never waits behind a stream.
        posted.at_head = True
        self._port.reach_head(posted)

    def _wait_work(self, effect: WaitWork) -> None:
        entry = self._works.pop(effect.work, None)
        if entry is None:
            raise InterpreterError(
                _call(effect),
                f"work {effect.work.name!r} is not in flight (or was already waited on: "
                f"WaitWork consumes its handle); in flight: {sorted(w.name for w in self._works)}",
                "issue an AllReduce with this work name first, and wait on it once",
            )
        posted, result = entry
        del self._pending_results[result]
        self._queue(Stream.MAIN, _WorkWait(effect, posted))

    # ---- device-side data moves ------------------------------------------------------------

    def _pad_columns(self, effect: PadColumns) -> None:
        call = _call(effect)
        source = self._lookup(call, effect.source)
        self._check_unbound(call, effect.out)
        shape = source.array.shape
        if len(shape) != 2 or shape[1] > effect.width:
            raise InterpreterError(
                call,
                f"buffer {effect.source.name!r} has shape {shape}, cannot pad to width "
                f"{effect.width}",
                "pad a 2-D buffer at most `width` columns wide",
            )
        out = self._fresh((shape[0], effect.width), source.array.dtype, effect.stream)
        self._set(effect.out, out, step=effect.step, op=effect.op)
        columns = shape[1]

        def run() -> None:
            out.array[:, :columns] = source.array
            out.array[:, columns:] = effect.fill

        self._queue(effect.stream, _Kernel(effect, run, (source, out)))

    def _stack_rows(self, effect: StackRows) -> None:
        call = _call(effect)
        sources = [self._lookup(call, ref) for ref in effect.sources]
        self._check_unbound(call, effect.out)
        layouts = {(b.array.shape, b.array.dtype) for b in sources}
        if not sources or len(layouts) != 1 or sources[0].array.ndim != 1:
            shapes = [f"{b.array.dtype} {b.array.shape}" for b in sources]
            raise InterpreterError(
                call,
                f"sources {[r.name for r in effect.sources]} are {shapes}",
                "stack one or more 1-D buffers of equal length and dtype",
            )
        first = sources[0].array
        out = self._fresh((len(sources), first.shape[0]), first.dtype, effect.stream)
        self._set(effect.out, out, step=effect.step, op=effect.op)

        def run() -> None:
            for row, source in enumerate(sources):
                out.array[row] = source.array

        self._queue(effect.stream, _Kernel(effect, run, (*sources, out)))

    def _check_index(self, call: str, ref: BufferRef, index: Array) -> None:
        if index.ndim != 1 or index.dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
            raise InterpreterError(
                call,
                f"index {ref.name!r} is {index.dtype} {index.shape}",
                "pass a 1-D int32 or int64 index",
            )

    def _gather_rows(self, effect: GatherRows) -> None:
        call = _call(effect)
        source = self._lookup(call, effect.source)
        index = self._lookup(call, effect.index)
        self._check_unbound(call, effect.out)
        self._check_index(call, effect.index, index.array)
        if source.array.ndim < 1:
            raise InterpreterError(
                call, f"source {effect.source.name!r} is a scalar", "gather from a 1-D+ buffer"
            )
        shape = (index.array.shape[0], *source.array.shape[1:])
        out = self._fresh(shape, source.array.dtype, effect.stream)
        self._set(effect.out, out, step=effect.step, op=effect.op)

        def run() -> None:
            rows = source.array.shape[0]
            bad = index.array[(index.array < 0) | (index.array >= rows)]
            if bad.size:
                raise InterpreterError(
                    call,
                    f"index {effect.index.name!r} holds row {int(bad[0])} of a "
                    f"{rows}-row source {effect.source.name!r}",
                    "gather rows 0..rows-1 only (a device kernel would fault)",
                )
            out.array[...] = source.array[index.array]

        self._queue(effect.stream, _Kernel(effect, run, (source, index, out)))

    def _scatter_rows(self, effect: ScatterRows) -> None:
        call = _call(effect)
        source = self._lookup(call, effect.source)
        index = self._lookup(call, effect.index)
        target = self._lookup(call, effect.target)
        self._check_index(call, effect.index, index.array)
        s, t = source.array, target.array
        if s.ndim < 1 or s.shape[0] != index.array.shape[0] or s.shape[1:] != t.shape[1:]:
            raise InterpreterError(
                call,
                f"source {effect.source.name!r} {s.dtype} {s.shape}, index "
                f"{index.array.shape}, target {effect.target.name!r} {t.dtype} {t.shape}",
                "pass one source row per index entry, with the target's row shape and dtype",
            )
        if s.dtype != t.dtype:
            raise InterpreterError(
                call,
                f"source {effect.source.name!r} is {s.dtype} but target "
                f"{effect.target.name!r} is {t.dtype}",
                "scatter rows of the target's dtype",
            )

        def run() -> None:
            rows = target.array.shape[0]
            slots = index.array
            bad = slots[(slots != -1) & ((slots < 0) | (slots >= rows))]
            if bad.size:
                raise InterpreterError(
                    call,
                    f"index {effect.index.name!r} holds row {int(bad[0])} of a "
                    f"{rows}-row target {effect.target.name!r}",
                    "scatter to rows 0..rows-1, or -1 to skip a row",
                )
            keep = slots != -1
            target.array[slots[keep]] = source.array[keep]

        self._queue(effect.stream, _Kernel(effect, run, (source, index, target)))


def _nothing() -> None:
    """An allocation has nothing to run: its buffer is bound (and poisoned) at issue."""
