"""The torch interpreter: performs effects on real tensors, CUDA streams and torch.distributed.

It holds the environment (names -> tensors, events, async work handles), runs the
relay's kernels on the stream each effect names, and issues collectives on the
process group each communicator maps to: NCCL on GPUs, gloo on CPU. On CPU every
kernel completes before the next effect starts, so streams and events are no-ops
(events still get a marker, so waiting on an unrecorded one is still an error).

A steady-state step never synchronises the host with the device: host arrays
reach the device through pinned staging memory, and the in-place row scatter
routes skipped rows to a scratch row instead of filtering them on the host.

`CheckHeader` (the opt-in relay header) never reads the header on the host on CUDA:
the comparison is a device-side `torch._assert_async` on the relay stream. What a
mismatch looks like (seen with torch 2.11 on H200s):
- CUDA: `perform` returns normally. The assertion kernel fails on the device and
  stderr shows "Assertion `rank R: relay header mismatch at step S (expected [S, N])`
  failed"; no later work of the process runs, so the differently shaped receive after
  the header never executes. The next call that synchronises with the device raises
  `torch.AcceleratorError` ("CUDA error: device-side assert triggered"), and the CUDA
  context is lost: the process must exit. Its peers wait in their next collective until
  NCCL's watchdog times them out. With CUDA_LAUNCH_BLOCKING=1 the error is raised inside
  `perform` of the failing CheckHeader. The received values stay on the device; the
  simulator or a CPU run of the same program names them.
- CPU: the broadcast has completed when `perform` reaches the check, so it compares
  directly and raises `HeaderMismatchError` (rank, step, expected, received).

Lifetimes: `Release` drops a buffer's binding (the caching allocator reclaims it
stream-safely, given the `RecordStream` effects); `WaitEvent` and `WaitWork`
consume their event or work handle, which is recorded once and waited on once.
"""

from __future__ import annotations

import contextlib
import datetime
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, TypeAlias

import attrs
import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist
import torch.nn.functional as F

from purepp.effects.vocabulary import (
    Alias,
    Allocate,
    AllReduce,
    Broadcast,
    BufferRef,
    CheckHeader,
    Communicator,
    CopyHostToDevice,
    DType,
    Effect,
    EventRef,
    ForgetEvent,
    GatherRows,
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
from purepp.errors import ConfigError, HeaderMismatchError, InterpreterError, PeerFailureError

__all__ = [
    "Backend",
    "TorchInterpreter",
    "build_communicators",
    "init_distributed",
    "torch_dtype",
]

Backend: TypeAlias = Literal["nccl", "gloo"]

# How many bound names an "is not bound" error lists, so the message stays readable.
_NAMES_SHOWN = 8


def torch_dtype(dtype: DType) -> torch.dtype:
    """The torch dtype a vocabulary dtype stands for."""
    match dtype:
        case DType.INT64:
            return torch.int64
        case DType.INT32:
            return torch.int32
        case DType.BOOL:
            return torch.bool
        case _:
            typing.assert_never(dtype)


# --------------------------------------------------------------------------------------
# Process groups
# --------------------------------------------------------------------------------------


def _check_timeout(call: str, timeout: datetime.timedelta) -> None:
    if timeout <= datetime.timedelta(0):
        raise ConfigError(call, f"timeout={timeout}", "pass a positive datetime.timedelta")


def init_distributed(
    *,
    backend: Backend,
    init_method: str,
    rank: int,
    world_size: int,
    timeout: datetime.timedelta,
) -> None:
    """Initialise the default process group with a collective `timeout`.

    The timeout is what turns a dead or silent peer into an error instead of a hang:
    on gloo a collective that cannot complete within it raises, and the interpreter
    reports that as `PeerFailureError`. (NCCL enforces it in its watchdog, which
    aborts the process rather than raising.) For NCCL, call
    `torch.cuda.set_device(local_rank)` first.
    """
    call = "init_distributed"
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(
            call,
            f"rank={rank} with world_size={world_size}",
            "pass world_size >= 1 and a rank in 0..world_size-1",
        )
    _check_timeout(call, timeout)
    if dist.is_initialized():
        raise ConfigError(
            call,
            "the default process group is already initialised",
            "initialise it once per process (destroy_process_group before re-initialising)",
        )
    try:
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
    except RuntimeError as error:
        raise PeerFailureError(
            call,
            f"rank {rank} of {world_size} could not rendezvous at {init_method!r}: {error}",
            "start every rank with the same init_method and world_size within the timeout",
        ) from error


def _check_layout(
    call: str, kind: str, groups: Sequence[Sequence[int]], world_size: int
) -> tuple[tuple[int, ...], ...]:
    seen: set[int] = set()
    checked: list[tuple[int, ...]] = []
    for group in groups:
        ranks = tuple(group)
        if not ranks or len(set(ranks)) != len(ranks):
            raise ConfigError(
                call, f"{kind} group {ranks} is empty or repeats a rank", "list distinct ranks"
            )
        outside = [r for r in ranks if not 0 <= r < world_size]
        if outside:
            raise ConfigError(
                call,
                f"{kind} group {ranks} holds rank {outside[0]} outside 0..{world_size - 1}",
                "list global ranks of the initialised world",
            )
        twice = seen.intersection(ranks)
        if twice:
            raise ConfigError(
                call,
                f"rank {min(twice)} is in more than one {kind} group",
                f"put each rank in at most one {kind} group",
            )
        seen.update(ranks)
        checked.append(ranks)
    return tuple(checked)


def _new_group(
    ranks: tuple[int, ...], backend: Backend, timeout: datetime.timedelta, comm: Communicator
) -> dist.ProcessGroup | None:
    try:
        group = dist.new_group(ranks, timeout=timeout, backend=backend, group_desc=comm.value)
    except RuntimeError as error:
        raise PeerFailureError(
            "build_communicators",
            f"creating the {backend} group for {comm.value} over ranks {ranks} failed on rank "
            f"{dist.get_rank()}: {error}",
            "read the other ranks' logs: a peer died or never called build_communicators "
            "with the same groups",
        ) from error
    return group if isinstance(group, dist.ProcessGroup) else None


def build_communicators(
    *,
    pp_groups: Sequence[Sequence[int]],
    dp_groups: Sequence[Sequence[int]],
    relay_backend: Backend,
    timeout: datetime.timedelta,
) -> dict[Communicator, dist.ProcessGroup]:
    """Create the process groups the vocabulary's communicators name; return this rank's.

    Every rank of the initialised world must call this with the same arguments: each
    `new_group` is a collective over the whole world, created in one fixed order.
    For each PP group: PP_RELAY, a separate `relay_backend` group over the same ranks
    (so relay traffic never queues behind activations), and PP_CPU (gloo); for each
    DP group: DP_CPU (gloo). Groups are lists of global ranks; a rank is in at most
    one PP and one DP group. The result holds only the groups this rank is in.
    """
    call = "build_communicators"
    if not dist.is_initialized():
        raise ConfigError(call, "no default process group", "call init_distributed first")
    _check_timeout(call, timeout)
    world_size = dist.get_world_size()
    pp = _check_layout(call, "PP", pp_groups, world_size)
    dp = _check_layout(call, "DP", dp_groups, world_size)
    created: list[tuple[Communicator, dist.ProcessGroup | None]] = []
    for ranks in pp:
        for comm, backend in (
            (Communicator.PP_RELAY, relay_backend),
            (Communicator.PP_CPU, "gloo"),
        ):
            created.append((comm, _new_group(ranks, backend, timeout, comm)))
    for ranks in dp:
        created.append(
            (Communicator.DP_CPU, _new_group(ranks, "gloo", timeout, Communicator.DP_CPU))
        )
    return {comm: group for comm, group in created if group is not None}


# --------------------------------------------------------------------------------------
# The interpreter
# --------------------------------------------------------------------------------------


@attrs.frozen
class _CpuEvent:
    """Stands in for a CUDA event on CPU, where every kernel has finished when it returns."""

    event: EventRef  # the name it was recorded under


_Event: TypeAlias = torch.cuda.Event | _CpuEvent


@attrs.frozen
class _PendingWork:
    """An asynchronous all-reduce in flight: its handle and what it is writing."""

    handle: dist.Work  # torch's handle, waited on by WaitWork
    result: BufferRef  # the table it reduces into, unreadable until the wait
    comm: Communicator  # the communicator it runs on, for error messages


def _describe(effect: Effect) -> str:
    return (
        f"TorchInterpreter.perform({type(effect).__name__} step={effect.step} op={effect.op.value})"
    )


def _shown(names: Iterable[str]) -> str:
    ordered = sorted(names)
    more = len(ordered) - _NAMES_SHOWN
    listed = ", ".join(repr(name) for name in ordered[:_NAMES_SHOWN])
    return f"[{listed}{f', ... {more} more' if more > 0 else ''}]"


class TorchInterpreter:
    """Performs effects on one rank: real tensors, CUDA streams, torch.distributed groups.

    The caller `bind`s its own tensors before a step and reads results with `tensor`,
    `host_array` or `resolve` after it. Effects that create a binding (Allocate,
    CopyHostToDevice, AllReduce, Alias, PadColumns, StackRows, GatherRows,
    RecordEvent) refuse a name that is already bound: names come from the step
    counter, so a clash means a buffer was never released.
    """

    def __init__(
        self,
        *,
        device: torch.device,
        groups: Mapping[Communicator, dist.ProcessGroup],
        rank: int,
    ) -> None:
        """`device`: cpu or cuda:N. `groups`: this rank's communicators (see
        `build_communicators`). `rank`: this process's global rank.

        On CUDA, the main stream is the current stream now; the relay gets a new side stream.
        """
        call = "TorchInterpreter"
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(call, f"device {device}", "use a cpu or cuda device")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(call, f"device {device} but CUDA is unavailable", "use cpu")
        group_ranks: dict[Communicator, tuple[int, ...]] = {}
        for comm, group in groups.items():
            ranks = tuple(dist.get_process_group_ranks(group))
            if rank not in ranks:
                raise ConfigError(
                    call,
                    f"communicator {comm.value} spans ranks {ranks}, which exclude rank {rank}",
                    "pass only the groups this rank belongs to (build_communicators returns them)",
                )
            group_ranks[comm] = ranks
        self._device = device
        self._rank = rank
        self._groups = dict(groups)
        self._group_ranks = group_ranks
        self._streams: dict[Stream, torch.cuda.Stream] | None = None
        if device.type == "cuda":
            self._streams = {
                Stream.MAIN: torch.cuda.current_stream(device),
                Stream.RELAY: torch.cuda.Stream(device),
            }
        self._buffers: dict[BufferRef, torch.Tensor] = {}
        self._events: dict[EventRef, _Event] = {}
        self._works: dict[WorkRef, _PendingWork] = {}
        # Tables an async all-reduce is still writing: reading one is an error.
        self._pending_results: dict[BufferRef, WorkRef] = {}

    # ---- the caller's side -------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def rank(self) -> int:
        return self._rank

    def cuda_stream(self, stream: Stream) -> torch.cuda.Stream:
        """The CUDA stream behind `stream` (MAIN is the stream current at construction)."""
        if self._streams is None:
            raise InterpreterError(
                "TorchInterpreter.cuda_stream",
                f"stream {stream.value} requested on device {self._device}",
                "streams exist only on a cuda device",
            )
        return self._streams[stream]

    def bind(self, ref: BufferRef, tensor: torch.Tensor) -> None:
        """Bind the caller's `tensor` to `ref`, replacing any earlier binding of that name."""
        if ref in self._pending_results:
            raise InterpreterError(
                "TorchInterpreter.bind",
                f"buffer {ref.name!r} is being written by all-reduce "
                f"{self._pending_results[ref].name!r}",
                "perform its WaitWork before rebinding the name",
            )
        self._buffers[ref] = tensor

    def tensor(self, ref: BufferRef) -> torch.Tensor:
        """The tensor bound to `ref`."""
        return self._lookup("TorchInterpreter.tensor", ref)

    def host_array(self, ref: BufferRef) -> npt.NDArray[Any]:
        """A read-only numpy copy of the tensor bound to `ref` (e.g. the reduced DP table).

        Meant for host tensors; on a device tensor this is a device-to-host sync.
        """
        tensor = self._lookup("TorchInterpreter.host_array", ref)
        array: npt.NDArray[Any] = np.array(tensor.detach().cpu().numpy(), copy=True)
        array.flags.writeable = False
        return array

    def resolve(self, value: object) -> dict[str, torch.Tensor]:
        """Every BufferRef inside `value`, by attribute path, resolved to its tensor.

        Walks attrs instances, tuples and lists: `{"sampled_tokens": ..., "entries[0].counts":
        ...}`; a bare BufferRef is the empty path "". Other leaves (ints, arrays, events)
        are skipped, so `resolve(None)` is `{}`.
        """
        found: dict[str, torch.Tensor] = {}
        self._collect(value, "", found)
        return found

    def bound_refs(self) -> frozenset[BufferRef | EventRef | WorkRef]:
        """Every name the environment holds now (to check that a loop releases what it makes)."""
        return frozenset((*self._buffers, *self._events, *self._works))

    def perform(self, effects: Iterable[Effect], /) -> None:
        """Perform `effects` in order. Each effect is validated before it changes anything."""
        for effect in effects:
            self._perform_one(effect)

    # ---- dispatch ------------------------------------------------------------------------

    def _perform_one(self, effect: Effect) -> None:
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
            case RecordStream():
                self._record_stream(effect)
            case Release():
                self._release(effect)
            case Alias():
                self._alias(effect)
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

    def _collect(self, value: object, path: str, found: dict[str, torch.Tensor]) -> None:
        if isinstance(value, BufferRef):
            found[path] = self._lookup("TorchInterpreter.resolve", value)
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

    def _lookup(self, call: str, ref: BufferRef) -> torch.Tensor:
        if ref in self._pending_results:
            raise InterpreterError(
                call,
                f"buffer {ref.name!r} is the result of all-reduce "
                f"{self._pending_results[ref].name!r}, which has not been waited on",
                "perform its WaitWork before reading or releasing the table",
            )
        tensor = self._buffers.get(ref)
        if tensor is None:
            raise InterpreterError(
                call,
                f"buffer {ref.name!r} is not bound; bound: {_shown(b.name for b in self._buffers)}",
                "allocate or bind it before its first use and release it after its last",
            )
        return tensor

    def _check_unbound(self, call: str, ref: BufferRef) -> None:
        if ref in self._buffers or ref in self._pending_results:
            raise InterpreterError(
                call,
                f"buffer {ref.name!r} is already bound",
                "release the old buffer first, or name new buffers from the step counter",
            )

    def _stream_context(self, stream: Stream) -> contextlib.AbstractContextManager[None]:
        if self._streams is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._streams[stream])

    def _group(self, call: str, comm: Communicator) -> dist.ProcessGroup:
        group = self._groups.get(comm)
        if group is None:
            raise InterpreterError(
                call,
                f"communicator {comm.value} has no process group on rank {self._rank} "
                f"(have {sorted(c.value for c in self._groups)})",
                "build the interpreter with every communicator the program uses",
            )
        return group

    def _peer_failure(
        self, call: str, what: str, comm: Communicator, error: RuntimeError
    ) -> PeerFailureError:
        return PeerFailureError(
            call,
            f"{what} on communicator {comm.value} failed on rank {self._rank} "
            f"(group ranks {self._group_ranks.get(comm)}): {error}",
            "read the other ranks' logs: a peer died, stalled past the timeout, or issued "
            "a different collective",
        )

    # ---- streams and events --------------------------------------------------------------

    def _wait_stream(self, effect: WaitStream) -> None:
        if self._streams is not None:
            self._streams[effect.stream].wait_stream(self._streams[effect.waits_for])

    def _record_event(self, effect: RecordEvent) -> None:
        if effect.event in self._events:
            raise InterpreterError(
                _describe(effect),
                f"event {effect.event.name!r} is already recorded and not yet waited on",
                "record each event once under a fresh name (WaitEvent consumes it)",
            )
        event: _Event = (
            _CpuEvent(effect.event)
            if self._streams is None
            else self._streams[effect.stream].record_event()
        )
        self._events[effect.event] = event

    def _wait_event(self, effect: WaitEvent) -> None:
        event = self._events.get(effect.event)
        if event is None:
            raise InterpreterError(
                _describe(effect),
                f"event {effect.event.name!r} is not recorded (or was already waited on: "
                f"WaitEvent consumes its event); recorded: "
                f"{_shown(e.name for e in self._events)}",
                "record the event before waiting on it, and wait on it once",
            )
        if self._streams is not None and isinstance(event, torch.cuda.Event):
            self._streams[effect.stream].wait_event(event)
        del self._events[effect.event]

    def _forget_event(self, effect: ForgetEvent) -> None:
        if self._events.pop(effect.event, None) is None:
            raise InterpreterError(
                _describe(effect),
                f"event {effect.event.name!r} is not recorded (or was already waited on)",
                "forget only an event that was recorded and never waited on",
            )

    def _record_stream(self, effect: RecordStream) -> None:
        tensor = self._lookup(_describe(effect), effect.buffer)
        if self._streams is not None:
            tensor.record_stream(self._streams[effect.stream])

    # ---- buffers -------------------------------------------------------------------------

    def _allocate(self, effect: Allocate) -> None:
        call = _describe(effect)
        self._check_unbound(call, effect.buffer)
        if any(size < 0 for size in effect.shape):
            raise InterpreterError(
                call, f"shape {effect.shape} of {effect.buffer.name!r}", "use sizes >= 0"
            )
        with self._stream_context(effect.stream):
            tensor = torch.empty(effect.shape, dtype=torch_dtype(effect.dtype), device=self._device)
        self._buffers[effect.buffer] = tensor

    def _copy_host_to_device(self, effect: CopyHostToDevice) -> None:
        self._check_unbound(_describe(effect), effect.buffer)
        self._buffers[effect.buffer] = self._to_device(effect.source, effect.stream)

    def _to_device(self, source: npt.NDArray[np.int32], stream: Stream) -> torch.Tensor:
        """A new device tensor holding `source`, copied on `stream` without blocking the host."""
        if self._streams is None:
            return torch.from_numpy(source.copy())
        # Pinned staging memory makes the copy asynchronous; the caching host allocator
        # keeps it alive until the copy on this stream has finished.
        staging = torch.empty(source.shape, dtype=torch.int32, pin_memory=True)
        staging.numpy()[...] = source
        with self._stream_context(stream):
            return staging.to(self._device, non_blocking=True)

    def _release(self, effect: Release) -> None:
        self._lookup(_describe(effect), effect.buffer)
        del self._buffers[effect.buffer]

    def _alias(self, effect: Alias) -> None:
        call = _describe(effect)
        tensor = self._lookup(call, effect.source)
        self._check_unbound(call, effect.out)
        self._buffers[effect.out] = tensor

    # ---- collectives ---------------------------------------------------------------------

    def _broadcast(self, effect: Broadcast) -> None:
        call = _describe(effect)
        group = self._group(call, effect.comm)
        tensor = self._lookup(call, effect.buffer)
        ranks = self._group_ranks[effect.comm]
        if effect.src not in ranks:
            raise InterpreterError(
                call,
                f"source rank {effect.src} is not in communicator {effect.comm.value} {ranks}",
                "broadcast from a global rank of the communicator",
            )
        expected_dtype = torch_dtype(effect.dtype)
        # NCCL does not check sizes: a wrong shape would hang every rank, so check here.
        if tuple(tensor.shape) != effect.shape or tensor.dtype != expected_dtype:
            raise InterpreterError(
                call,
                f"buffer {effect.buffer.name!r} is {tensor.dtype} {tuple(tensor.shape)} but the "
                f"wire is {expected_dtype} {effect.shape}",
                "bind a tensor of the declared wire shape and dtype",
            )
        if not tensor.is_contiguous():
            raise InterpreterError(
                call,
                f"buffer {effect.buffer.name!r} is not contiguous",
                "broadcast a contiguous tensor (make a snapshot with PadColumns or GatherRows)",
            )
        try:
            with self._stream_context(effect.stream):
                dist.broadcast(tensor, src=effect.src, group=group)
        except RuntimeError as error:
            what = f"broadcast of {effect.buffer.name!r} {effect.shape} from rank {effect.src}"
            raise self._peer_failure(call, what, effect.comm, error) from error

    def _check_header(self, effect: CheckHeader) -> None:
        call = _describe(effect)
        received = self._lookup(call, effect.buffer)
        expected = effect.expected
        if tuple(received.shape) != expected.shape or received.dtype != torch.int32:
            raise InterpreterError(
                call,
                f"header {effect.buffer.name!r} is {received.dtype} {tuple(received.shape)} "
                f"but the expected header is torch.int32 {expected.shape}",
                "check an int32 header of the expected length",
            )
        if self._streams is None:
            # CPU: the broadcast has completed and reading the header costs no device sync.
            if not torch.equal(received, torch.from_numpy(expected.copy())):
                raise HeaderMismatchError(
                    call,
                    rank=self._rank,
                    step=effect.step,
                    expected=tuple(int(v) for v in expected.tolist()),
                    received=tuple(int(v) for v in received.tolist()),
                )
            return
        wanted = self._to_device(expected, effect.stream)
        with self._stream_context(effect.stream):
            # Reading the header on the host would synchronise every step: assert on the
            # device instead. The kernel prints the message; the failure stops the
            # process's later device work and surfaces at the next synchronisation.
            matches = (received == wanted).all()
            torch._assert_async(
                matches,
                f"rank {self._rank}: relay header mismatch at step {effect.step} "
                f"(expected {expected.tolist()})",
            )

    def _all_reduce(self, effect: AllReduce) -> None:
        call = _describe(effect)
        group = self._group(call, effect.comm)
        self._check_unbound(call, effect.result)
        if effect.work is not None and effect.work in self._works:
            raise InterpreterError(
                call,
                f"work {effect.work.name!r} is already in flight",
                "wait on it before reusing its name",
            )
        table = torch.from_numpy(effect.contribution.copy())
        what = f"all-reduce into {effect.result.name!r} {effect.contribution.shape}"
        try:
            if effect.work is None:
                dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group)
            else:
                handle = dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group, async_op=True)
                self._works[effect.work] = _PendingWork(handle, effect.result, effect.comm)
                self._pending_results[effect.result] = effect.work
        except RuntimeError as error:
            raise self._peer_failure(call, what, effect.comm, error) from error
        self._buffers[effect.result] = table

    def _wait_work(self, effect: WaitWork) -> None:
        call = _describe(effect)
        pending = self._works.get(effect.work)
        if pending is None:
            raise InterpreterError(
                call,
                f"work {effect.work.name!r} is not in flight (or was already waited on: "
                f"WaitWork consumes its handle); in flight: "
                f"{_shown(w.name for w in self._works)}",
                "issue an AllReduce with this work name first, and wait on it once",
            )
        try:
            pending.handle.wait()
        except RuntimeError as error:
            what = f"all-reduce into {pending.result.name!r} (work {effect.work.name!r})"
            raise self._peer_failure(call, what, pending.comm, error) from error
        del self._works[effect.work]
        del self._pending_results[pending.result]

    # ---- device-side data moves ------------------------------------------------------------

    def _pad_columns(self, effect: PadColumns) -> None:
        call = _describe(effect)
        source = self._lookup(call, effect.source)
        self._check_unbound(call, effect.out)
        if source.ndim != 2 or source.shape[1] > effect.width:
            raise InterpreterError(
                call,
                f"buffer {effect.source.name!r} has shape {tuple(source.shape)}, "
                f"cannot pad to width {effect.width}",
                "pad a 2-D buffer at most `width` columns wide",
            )
        with self._stream_context(effect.stream):
            # Always a new tensor, even with nothing to add: send buffers are snapshots.
            out = F.pad(source, (0, effect.width - source.shape[1]), value=effect.fill)
        self._buffers[effect.out] = out

    def _stack_rows(self, effect: StackRows) -> None:
        call = _describe(effect)
        sources = [self._lookup(call, ref) for ref in effect.sources]
        self._check_unbound(call, effect.out)
        layouts = {(tuple(t.shape), t.dtype) for t in sources}
        if not sources or len(layouts) != 1 or sources[0].ndim != 1:
            shapes = [f"{t.dtype} {tuple(t.shape)}" for t in sources]
            raise InterpreterError(
                call,
                f"sources {[r.name for r in effect.sources]} are {shapes}",
                "stack one or more 1-D buffers of equal length and dtype",
            )
        with self._stream_context(effect.stream):
            out = torch.stack(sources, dim=0)
        self._buffers[effect.out] = out

    def _check_index(self, call: str, ref: BufferRef, index: torch.Tensor) -> None:
        if index.ndim != 1 or index.dtype not in (torch.int32, torch.int64):
            raise InterpreterError(
                call,
                f"index {ref.name!r} is {index.dtype} {tuple(index.shape)}",
                "pass a 1-D int32 or int64 index",
            )

    def _gather_rows(self, effect: GatherRows) -> None:
        call = _describe(effect)
        source = self._lookup(call, effect.source)
        index = self._lookup(call, effect.index)
        self._check_unbound(call, effect.out)
        self._check_index(call, effect.index, index)
        if source.ndim < 1:
            raise InterpreterError(
                call, f"source {effect.source.name!r} is a scalar", "gather from a 1-D+ buffer"
            )
        with self._stream_context(effect.stream):
            out = torch.index_select(source, 0, index)
        self._buffers[effect.out] = out

    def _scatter_rows(self, effect: ScatterRows) -> None:
        call = _describe(effect)
        source = self._lookup(call, effect.source)
        index = self._lookup(call, effect.index)
        target = self._lookup(call, effect.target)
        self._check_index(call, effect.index, index)
        if (
            source.ndim < 1
            or source.shape[0] != index.shape[0]
            or tuple(source.shape[1:]) != tuple(target.shape[1:])
            or source.dtype != target.dtype
        ):
            raise InterpreterError(
                call,
                f"source {effect.source.name!r} {source.dtype} {tuple(source.shape)}, index "
                f"{tuple(index.shape)}, target {effect.target.name!r} {target.dtype} "
                f"{tuple(target.shape)}",
                "pass one source row per index entry, with the target's row shape and dtype",
            )
        rows = target.shape[0]
        with self._stream_context(effect.stream):
            # Filtering the skipped rows would need their count on the host (a sync), so
            # every row is written: skipped ones land on a spare scratch row, dropped after.
            # Only the spare row is written more than once, so no write races a kept one
            # (kept rows name distinct slots; the relay maps each slot to one row).
            index64 = index.to(torch.int64)
            destinations = torch.where(index64 == -1, rows, index64)
            scratch = torch.empty(
                (rows + 1, *target.shape[1:]), dtype=target.dtype, device=target.device
            )
            scratch[:rows].copy_(target)
            scratch.index_copy_(0, destinations, source)
            target.copy_(scratch[:rows])
