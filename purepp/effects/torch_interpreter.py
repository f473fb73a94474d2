"""The torch interpreter: performs effects on real tensors, CUDA streams and torch.distributed.

It holds the environment (names -> tensors, events, async work handles), runs the
relay's kernels on the stream each effect names, and issues collectives on the
process group each communicator maps to: NCCL on GPUs, gloo on CPU. On CPU every
kernel completes before the next effect starts, so streams and events are no-ops
(events still get a marker, so waiting on an unrecorded one is still an error).

A steady-state step never synchronises the host with the device: host arrays
reach the device through pinned staging memory, and the in-place row scatter sends
skipped rows to a spare row instead of filtering them on the host.

The hot path is lean: one handler per effect kind from a dict, the current stream
switched only when a kernel's stream differs from the last one's (the caller's stream
is restored when `perform` returns), broadcasts and all-reduces issued on the process
group directly with options built once per (communicator, source), and error text
built only when raising (the shared environment, purepp.effects._environment, names
the effect). CUDA events are pooled: one that was waited on or forgotten is recorded
again by a later RecordEvent, and WaitStream records one reusable marker (a queued wait
keeps the state its event had when the wait was issued). `Synchronize` waits for the
CUDA stream; on CPU it has nothing to wait
for. `Pack` and `Unpack` move bytes of one int64 wire: Pack copies each source into
the top-left corner of its zeroed section, Unpack binds views (no copy).

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

import datetime
import functools
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import attrs
import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist

from purepp._checks import as_int, check_bool, check_int
from purepp._text import a_type
from purepp.effects._environment import Call, Environment
from purepp.effects.keyed import KeyedEffects
from purepp.effects.torch_kernels import (
    TORCH_DTYPES,
    pack,
    pad_columns,
    scatter_rows,
    section_views,
)
from purepp.effects.vocabulary import (
    Alias,
    Allocate,
    AllReduce,
    Backend,
    Broadcast,
    BufferRef,
    CheckHeader,
    Communicator,
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
    PeerFailureError,
)

if TYPE_CHECKING:
    from purepp.effects.plan import Planner

__all__ = [
    "Backend",
    "TorchInterpreter",
    "build_communicators",
    "init_distributed",
]


# --------------------------------------------------------------------------------------
# Process groups
# --------------------------------------------------------------------------------------


def _check_timeout(call: str, timeout: datetime.timedelta) -> None:
    given: object = timeout  # a caller's value, whatever its annotation says
    if not isinstance(given, datetime.timedelta):
        shown = f"timeout={given!r} is {a_type(given)}"
        raise ConfigError(call, shown, "pass a positive datetime.timedelta")
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
    # Checked here: torch refuses a wrong value only inside the rendezvous, which would
    # blame the peers (or raises a raw TypeError or ValueError).
    backend = check_backend(call, "backend", backend, "pass 'gloo' (CPU) or 'nccl' (CUDA)")
    if backend == "nccl" and not dist.is_nccl_available():
        raise ConfigError(
            call,
            "backend='nccl' but this build of torch has no NCCL",
            "use backend='gloo' (CPU), or a CUDA build of torch",
        )
    if type(init_method) is not str or not init_method:
        raise ConfigError(
            call,
            f"init_method={init_method!r}",
            "pass the rendezvous URL every rank shares, e.g. 'file:///tmp/rendezvous'",
        )
    exact_rank, exact_size = as_int(rank), as_int(world_size)  # a bool or a float is none
    if exact_rank is None or exact_size is None:
        name, value = ("rank", rank) if exact_rank is None else ("world_size", world_size)
        raise ConfigError(call, f"{name}={value!r} is {a_type(value)}", f"pass {name} as an int")
    rank, world_size = exact_rank, exact_size
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
    fix = "list each group's global ranks as ints, e.g. [[0, 1], [2, 3]]"
    given_groups: object = groups  # a caller's value, whatever its annotation says
    if not isinstance(given_groups, Iterable) or isinstance(given_groups, str | bytes):
        raise ConfigError(call, f"{kind.lower()}_groups is {a_type(given_groups)}", fix)
    for group in given_groups:
        if not isinstance(group, Iterable) or isinstance(group, str | bytes):
            raise ConfigError(call, f"{kind} group {group!r} is {a_type(group)}", fix)
        given = tuple(group)
        listed: list[int] = []
        for value in given:
            # torch takes a float rank as far as new_group, and a bool as rank 0 or 1.
            rank = as_int(value)
            if rank is None:
                raise ConfigError(
                    call, f"{kind} group {given} holds {value!r}, {a_type(value)}", fix
                )
            listed.append(rank)
        ranks = tuple(listed)
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
    DP group: DP_CPU and DP_DRAFTER_CPU (gloo, the drafter's own lane). Groups are
    lists of global ranks; a rank is in at most one PP and one DP group. The result
    holds only the groups this rank is in.
    """
    call = "build_communicators"
    if relay_backend not in ("gloo", "nccl"):
        raise ConfigError(call, f"relay_backend={relay_backend!r}", "use 'nccl' or 'gloo'")
    if relay_backend == "nccl" and not dist.is_nccl_available():
        raise ConfigError(
            call,
            "relay_backend='nccl' but this build of torch has no NCCL",
            "use relay_backend='gloo' (CPU), or a CUDA build of torch",
        )
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
        for comm in (Communicator.DP_CPU, Communicator.DP_DRAFTER_CPU):
            created.append((comm, _new_group(ranks, "gloo", timeout, comm)))
    groups = {comm: group for comm, group in created if group is not None}
    relay = groups.get(Communicator.PP_RELAY)
    if relay_backend == "nccl" and relay is not None:
        _create_nccl_communicator(relay)
    return groups


def _create_nccl_communicator(group: dist.ProcessGroup) -> None:
    """Create `group`'s NCCL communicator now, with one tiny all-reduce over its members.

    torch creates it at the group's first collective, and that creation blocks the host
    until every member joins (ncclCommInitRank synchronises the ranks): the relay's
    first broadcast would hold its host as a gloo broadcast does, so a rank that first
    meets a peer's CPU all-reduce would hang at step 0, where every later step queues
    the broadcast on its stream (as the stream model takes an NCCL broadcast).
    """
    probe = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(probe, group=group)
    torch.cuda.current_stream().synchronize()


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
    """An asynchronous all-reduce in flight: torch's handle and its communicator."""

    handle: dist.Work  # waited on by WaitWork
    comm: Communicator  # the communicator it runs on, for error messages


# The raw stream calls behind torch.cuda.current_stream/set_stream: no Stream object is
# built per batch (the stubs in typings/ leave them out).
# (None in a CPU-only build, which never calls them.)
_current_stream: Any = getattr(torch._C, "_cuda_getCurrentStream", None)
_set_stream: Any = getattr(torch._C, "_cuda_setStream", None)


def _check_structure(call: str, effects: KeyedEffects) -> None:
    """A plan is found by the batch's structure key: one that cannot be hashed is refused."""
    try:
        hash(effects.structure)
    except TypeError:
        raise InvalidInputError(
            call,
            f"the KeyedEffects structure key {effects.structure!r} is not hashable",
            "key a batch by a hashable value (a tuple of ints, strings and enums)",
        ) from None


@functools.lru_cache(maxsize=1024)
def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape`. An allocation passes them to
    `torch.empty_strided`, which skips `torch.empty`'s memory-format handling: 3.4
    against 5.2 µs of host time on the H200 host, 1.1 against 1.6 on CPU."""
    strides = [1] * len(shape)
    for axis in range(len(shape) - 1, 0, -1):
        strides[axis - 1] = strides[axis] * max(shape[axis], 1)
    return tuple(strides)


def _all_reduce_options(asynchronous: bool) -> dist.AllreduceOptions:
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.SUM
    options.asyncOp = asynchronous
    return options


def _shape(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(tensor.shape)


def _layout(tensor: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    return tuple(tensor.shape), tensor.dtype


class TorchInterpreter:
    """Performs effects on one rank: real tensors, CUDA streams, torch.distributed groups.

    The caller `bind`s its own tensors before a step and reads results with `tensor`,
    `host_array` or `resolve` after it. Effects that create a binding refuse a name
    that is already bound: names come from the step counter, so a clash means a
    buffer was never released.

    Two modes, the same semantics:
    - fast (the default) checks the environment's names (bound, unbound, recorded, in
      flight) on every effect, and trusts the layouts the library's pure steps built:
      the row moves, pack and unpack run without checking shapes and dtypes (torch
      still raises on an impossible one). The wire layout of a broadcast is always
      checked, since NCCL would hang on a wrong one.
    - `checked=True` also validates every effect's layouts before it changes anything:
      shapes and dtypes of the row moves, pack and unpack sections, contiguity, the
      broadcast's source rank, the header's layout; and a host index's rows (a device
      index is not read: that would sync).
    `plans=True` lowers each batch structure it meets a second time into a plan (see
    purepp.effects.plan); `capture=True` (CUDA) also captures plans into CUDA graphs.
    """

    def __init__(
        self,
        *,
        device: torch.device,
        groups: Mapping[Communicator, dist.ProcessGroup],
        rank: int,
        checked: bool = False,
        plans: bool = False,
        capture: bool = False,
        capture_copies: int = 3,
    ) -> None:
        """`device`: cpu or cuda:N. `groups`: this rank's communicators (see
        `build_communicators`). `rank`: this process's global rank. `checked`: validate
        every effect's layouts. `plans`: run repeated batch structures as plans.
        `capture`: capture plans into CUDA graphs (CUDA only; implies `plans`), each
        in `capture_copies` rotating instances so that outputs kept for that many
        steps minus one are never overwritten (the relay: ring_depth + 1).

        On CUDA, the main stream is the current stream now; the relay gets a new side stream.
        """
        call = "TorchInterpreter"
        if not isinstance(device, torch.device):
            raise ConfigError(
                call,
                f"device={device!r} is {a_type(device)}",
                'pass a torch.device, e.g. torch.device("cpu") or torch.device("cuda", 0)',
            )
        rank = check_int(call, "rank", rank, 0, config=True)
        checked = check_bool(call, "checked", checked, config=True)
        plans = check_bool(call, "plans", plans, config=True)
        capture = check_bool(call, "capture", capture, config=True)
        capture_copies = check_int(call, "capture_copies", capture_copies, 1, config=True)
        if not isinstance(groups, Mapping):
            raise ConfigError(
                call,
                f"groups is {a_type(groups)}",
                "pass a dict of Communicator to ProcessGroup (build_communicators returns it)",
            )
        for comm, group in groups.items():
            if not isinstance(comm, Communicator) or not isinstance(group, dist.ProcessGroup):
                raise ConfigError(
                    call,
                    f"groups maps {comm!r} to {a_type(group)}",
                    "map each Communicator to its ProcessGroup (build_communicators returns them)",
                )
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(call, f"device {device}", "use a cpu or cuda device")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(call, f"device {device} but CUDA is unavailable", "use cpu")
        if capture and device.type != "cuda":
            raise ConfigError(call, f"capture=True on device {device}", "capture on a cuda device")
        if capture_copies < 1:
            raise ConfigError(call, f"capture_copies={capture_copies}", "pass 1 or more")
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
        self._checked = checked
        self._groups = dict(groups)
        self._group_ranks = group_ranks
        # Broadcast options per (communicator, global source rank), built on first use.
        self._broadcast_options: dict[tuple[Communicator, int], dist.BroadcastOptions] = {}
        # All-reduce options, blocking and asynchronous (an AllReduce with a WorkRef).
        self._all_reduce_options = {
            asynchronous: _all_reduce_options(asynchronous) for asynchronous in (False, True)
        }
        self._streams: dict[Stream, torch.cuda.Stream] | None = None
        if device.type == "cuda":
            self._streams = {
                Stream.MAIN: torch.cuda.current_stream(device),
                Stream.RELAY: torch.cuda.Stream(device),
            }
        # The stream kernels are queued on now (CUDA); None outside `perform`.
        self._current: Stream | None = None
        # CUDA events waited on or forgotten, recorded again by later RecordEvents.
        self._event_pool: list[torch.cuda.Event] = []
        # The event a WaitStream records on the stream waited for (CUDA).
        self._marker: Any = None if self._streams is None else torch.cuda.Event()
        # The caller's stream while `_current` is set: (stream id, device index, type).
        self._prior: tuple[int, int, int] = (0, 0, 0)
        main: Any = None if self._streams is None else self._streams[Stream.MAIN]
        self._device_index: int = -1 if main is None else main.device_index
        self.env: Environment[torch.Tensor, _Event, _PendingWork] = Environment("TorchInterpreter")
        self._handlers: dict[type, Callable[[Any], None]] = {
            WaitStream: self._wait_stream,
            RecordEvent: self._record_event,
            WaitEvent: self._wait_event,
            ForgetEvent: self._forget_event,
            Allocate: self._allocate,
            CopyHostToDevice: self._copy_host_to_device,
            Broadcast: self._broadcast,
            CheckHeader: self._check_header,
            AllReduce: self._all_reduce,
            WaitWork: self._wait_work,
            NoteDecision: self._note_decision,
            RecordStream: self._record_stream,
            Release: self._release,
            Alias: self._alias,
            PadColumns: self._pad_columns,
            StackRows: self._stack_rows,
            GatherRows: self._gather_rows,
            ScatterRows: self._scatter_rows,
            Synchronize: self._synchronize,
            Pack: self._pack,
            Unpack: self._unpack,
        }
        self._planner: Planner | None = None
        if plans or capture:
            # The modules that build on this one (deferred: they import it to type-check).
            from purepp.effects.capture import replay
            from purepp.effects.plan import Planner

            self._planner = Planner(self, capture=capture, copies=capture_copies, replay=replay)

    # ---- the caller's side -------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def checked(self) -> bool:
        return self._checked

    @property
    def planner(self) -> Planner | None:
        """The plan cache (plans=True), for its counters; None in eager mode."""
        return self._planner

    def cuda_stream(self, stream: Stream) -> torch.cuda.Stream:
        """The CUDA stream behind `stream` (MAIN is the stream current at construction)."""
        if self._streams is None:
            raise InterpreterError(
                "TorchInterpreter.cuda_stream",
                f"stream {stream.value} requested on device {self._device}",
                "streams exist only on a cuda device",
            )
        return self._streams[stream]

    def group(self, call: Call, comm: Communicator) -> dist.ProcessGroup:
        """The process group behind `comm`; an error naming `call` if this rank has none."""
        group = self._groups.get(comm)
        if group is None:
            self.env.fail(
                call,
                f"communicator {comm.value} has no process group on rank {self._rank} "
                f"(have {sorted(c.value for c in self._groups)})",
                "build the interpreter with every communicator the program uses",
            )
        return group

    def replace_dp_groups(self, groups: Mapping[Communicator, dist.ProcessGroup]) -> None:
        """Agree over `groups` from now on: new DP groups over the survivors of a dead DP
        replica (vllm#44428), in place of the ones this interpreter was built with.

        Everything else is kept: the relay's ring (the entries received in earlier steps
        and consumed `ring_depth` steps later), its bound tensors, streams and plans. So a
        pipeline stage goes on from the step whose all-reduce failed, which a new
        interpreter could not (it holds no ring entry: its first consume fails).

        `groups` holds DP_CPU and DP_DRAFTER_CPU, each a new group of its own (not the
        one it replaces, nor the other lane's) over the same ranks,
        which include this rank and are among the replaced group's (`dist.new_group(
        survivors, backend="gloo", use_local_synchronization=True)`, one per communicator).
        The relay's communicators are not replaced: a replica whose stage died is dead
        as a whole. Everything is checked before anything changes: a refusal leaves the
        interpreter as it was.
        """
        call = "TorchInterpreter.replace_dp_groups"
        lanes = (Communicator.DP_CPU, Communicator.DP_DRAFTER_CPU)
        fix = (
            "pass {Communicator.DP_CPU: ..., Communicator.DP_DRAFTER_CPU: ...}, two groups "
            "made by dist.new_group(survivors, backend='gloo', use_local_synchronization="
            "True) over the same surviving ranks of this rank's DP group"
        )
        if not isinstance(groups, Mapping):
            raise ConfigError(call, f"groups is {a_type(groups)}", fix)
        if set(groups) != set(lanes):
            shown = sorted(c.value if isinstance(c, Communicator) else repr(c) for c in groups)
            raise ConfigError(
                call,
                f"groups maps {shown}, not exactly dp_cpu and dp_drafter_cpu (the relay's "
                "communicators hold its ring and are never replaced)",
                fix,
            )
        new_ranks: dict[Communicator, tuple[int, ...]] = {}
        for comm in lanes:
            group = groups[comm]
            if not isinstance(group, dist.ProcessGroup):
                raise ConfigError(call, f"groups maps {comm.value} to {a_type(group)}", fix)
            old = self._group_ranks.get(comm)
            if old is None:
                raise ConfigError(
                    call,
                    f"this interpreter has no {comm.value} group to replace on rank {self._rank}",
                    "build the interpreter with the DP groups build_communicators returns",
                )
            if group is self._groups[comm]:
                raise ConfigError(
                    call,
                    f"groups maps {comm.value} to the group it replaces (ranks {old})",
                    fix,
                )
            ranks = tuple(dist.get_process_group_ranks(group))
            if self._rank not in ranks or not set(ranks) <= set(old):
                raise ConfigError(
                    call,
                    f"the new {comm.value} group spans ranks {ranks}, which are not this "
                    f"rank {self._rank} and survivors of its group {old}",
                    fix,
                )
            new_ranks[comm] = ranks
        if new_ranks[Communicator.DP_CPU] != new_ranks[Communicator.DP_DRAFTER_CPU]:
            raise ConfigError(
                call,
                f"dp_cpu spans ranks {new_ranks[Communicator.DP_CPU]} but dp_drafter_cpu "
                f"spans {new_ranks[Communicator.DP_DRAFTER_CPU]}",
                fix,
            )
        if groups[Communicator.DP_CPU] is groups[Communicator.DP_DRAFTER_CPU]:
            raise ConfigError(
                call,
                "groups maps dp_cpu and dp_drafter_cpu to one group, so the two lanes' "
                "agreements in flight could pair with each other",
                fix,
            )
        for work, (pending, _) in self.env.works.items():
            if pending.comm in lanes:
                raise InvalidInputError(
                    call,
                    f"work {work.name!r} is still in flight on {pending.comm.value}: an "
                    "agreement started asynchronously (start_agreement_phase, "
                    "start_next_agreement) over the group being replaced",
                    "recover only from a synchronous agree (RankDriver.agree): an agreement "
                    "in flight over a dead group cannot be finished or taken back",
                )
        for comm in lanes:
            self._groups[comm] = groups[comm]
            self._group_ranks[comm] = new_ranks[comm]
        # A source's rank within the group changed with it: options are built again.
        for key in [key for key in self._broadcast_options if key[0] in lanes]:
            del self._broadcast_options[key]

    def bind(self, ref: BufferRef, tensor: torch.Tensor) -> None:
        """Bind the caller's `tensor` to `ref`, replacing any earlier binding of that name."""
        self.env.check_rebindable("TorchInterpreter.bind", ref)
        if not isinstance(tensor, torch.Tensor):
            raise InvalidInputError(
                "TorchInterpreter.bind",
                f"{ref.name!r} got {a_type(tensor)}, not a torch.Tensor",
                "bind torch tensors (torch.from_numpy(array) for a numpy array)",
            )
        self.env.buffers[ref] = tensor

    def tensor(self, ref: BufferRef) -> torch.Tensor:
        """The tensor bound to `ref`."""
        return self.env.lookup("TorchInterpreter.tensor", ref)

    def host_array(self, ref: BufferRef) -> npt.NDArray[Any]:
        """A read-only numpy copy of the tensor bound to `ref` (e.g. the reduced DP table).

        Meant for host tensors; on a device tensor this is a device-to-host sync.
        """
        tensor = self.env.lookup("TorchInterpreter.host_array", ref)
        array: npt.NDArray[Any] = np.array(tensor.detach().cpu().numpy(), copy=True)
        array.flags.writeable = False
        return array

    def resolve(self, value: object) -> dict[str, torch.Tensor]:
        """Every BufferRef inside `value`, by attribute path, resolved to its tensor.

        Walks attrs instances, tuples and lists: `{"sampled_tokens": ..., "entries[0].counts":
        ...}`; a bare BufferRef is the empty path "". Other leaves (ints, arrays, events)
        are skipped, so `resolve(None)` is `{}`.
        """
        return self.env.resolve(value, _same)

    def bound_refs(self) -> frozenset[BufferRef | EventRef | WorkRef]:
        """Every name the environment holds now (to check that a loop releases what it makes)."""
        return self.env.bound_refs()

    def perform(self, effects: Iterable[Effect], /) -> None:
        """Perform `effects` in order. Each effect is checked before it changes anything.

        With plans on, a batch (a tuple) whose structure was seen before runs its plan.
        """
        try:
            if (
                self._planner is not None
                and isinstance(effects, tuple)
                and self._planner.perform(effects)
            ):
                return
        except (KeyError, TypeError):  # the error path only: no cost per batch
            call = "TorchInterpreter.perform"
            effect_batch(call, effects)  # raises the typed error
            if type(effects) is KeyedEffects:
                _check_structure(call, effects)
            raise
        self.perform_eager(effects)

    def perform_eager(self, effects: Iterable[Effect], /) -> None:
        """Perform `effects` one by one (what a plan falls back to).

        A batch a pure step built (`KeyedEffects`) is trusted; any other is checked whole
        first (a set lookup per effect), so a stranger in it performs nothing.
        """
        handlers = self._handlers
        checked = self._checked
        if checked or type(effects) is not KeyedEffects:
            effects = effect_batch("TorchInterpreter.perform", effects)
        try:
            if self._streams is None:
                for effect in effects:
                    if checked:
                        self._validate(effect)
                    handlers[type(effect)](effect)
                return
            # CUDA: kernels switch the current stream only when theirs differs (one switch
            # per run of effects on one stream); the caller's stream comes back at the end.
            try:
                for effect in effects:
                    if checked:
                        self._validate(effect)
                    handlers[type(effect)](effect)
            finally:
                self.restore_stream()
        except (KeyError, TypeError):  # the error path only: no cost per effect
            effect_batch("TorchInterpreter.perform", effects)  # raises the typed error
            raise

    def handler(self, effect: Effect) -> Callable[[Any], None]:
        """The fast handler of `effect`'s kind (plans call it without validation); in
        checked mode a row move's also checks its index's rows (a plan's guard cannot)."""
        kind = type(effect)
        if self._checked and (kind is GatherRows or kind is ScatterRows):
            return self._checked_rows
        return self._handlers[kind]

    def run_handlers(
        self, handlers: Sequence[Callable[[Any], None]], effects: Sequence[Effect]
    ) -> None:
        """Call `handlers[i](effects[i])` in order: a plan's run, already validated."""
        if self._streams is None:
            for handler, effect in zip(handlers, effects, strict=True):
                handler(effect)
            return
        try:
            for handler, effect in zip(handlers, effects, strict=True):
                handler(effect)
        finally:
            self.restore_stream()

    def restore_stream(self) -> None:
        """Make the caller's stream current again if a kernel switched streams (CUDA)."""
        if self._current is not None:
            self._current = None
            stream_id, device_index, device_type = self._prior
            _set_stream(stream_id=stream_id, device_index=device_index, device_type=device_type)

    def on_stream(self, stream: Stream) -> None:
        """Make `stream` current for the kernels that follow (CUDA; inside `perform`).

        The caller's stream is read at the first switch only (raw ids, no Stream object),
        so a batch that queues no kernel never asks for it."""
        if self._streams is not None and self._current is not stream:
            if self._current is None:
                self._prior = _current_stream(self._device_index)
            torch.cuda.set_stream(self._streams[stream])
            self._current = stream

    # ---- checked mode: every effect's layouts, before it changes anything ---------------

    def _validate(self, effect: Effect) -> None:
        env = self.env
        lookup = env.lookup
        match effect:
            case Allocate():
                env.check_sizes(effect, effect.buffer, effect.shape)
            case Broadcast():
                self.group(effect, effect.comm)
                tensor = lookup(effect, effect.buffer)
                self._check_source(effect)
                env.check_contiguous(effect, effect.buffer, tensor.is_contiguous())
            case PadColumns():
                env.check_pad(
                    effect, effect.source, _shape(lookup(effect, effect.source)), effect.width
                )
            case StackRows():
                layouts = [_layout(lookup(effect, ref)) for ref in effect.sources]
                env.check_stack(effect, effect.sources, layouts)
            case GatherRows():
                source = lookup(effect, effect.source)
                index = self._check_index(effect, effect.index)
                env.check_index_rows(effect, _shape(index))
                env.check_gather(effect, effect.source, _shape(source))
                self._check_rows(effect)
            case ScatterRows():
                source = lookup(effect, effect.source)
                index = self._check_index(effect, effect.index)
                target = lookup(effect, effect.target)
                env.check_scatter(
                    effect,
                    source_ref=effect.source,
                    target_ref=effect.target,
                    source=_layout(source),
                    index=_shape(index),
                    target=_layout(target),
                )
                env.check_scatter_target(
                    effect, effect.target, _shape(target), target.stride(), writable=True
                )
                env.check_target_rows(effect, _shape(target))
                self._check_rows(effect)
            case Pack():
                sources = [_layout(lookup(effect, s.buffer)) for s in effect.sections]
                wanted = [TORCH_DTYPES[s.dtype] for s in effect.sections]
                env.check_pack(effect, sources, wanted)
            case Unpack():
                source = lookup(effect, effect.source)
                nbytes = source.numel() * source.dtype.itemsize
                offset = source.storage_offset() * source.dtype.itemsize
                env.check_unpack(effect, nbytes, source.is_contiguous(), offset)
            case (
                WaitStream()
                | RecordEvent()
                | WaitEvent()
                | ForgetEvent()
                | CopyHostToDevice()
                | CheckHeader()
                | AllReduce()
                | WaitWork()
                | NoteDecision()
                | RecordStream()
                | Release()
                | Alias()
                | Synchronize()
            ):
                pass  # nothing past the names, which every mode checks
            case _:  # perform_eager checked the batch whole (effect_batch) before this
                typing.assert_never(effect)

    def _check_rows(self, effect: GatherRows | ScatterRows) -> None:
        """The index's rows are in range, where reading it costs no device sync (a host
        index). A device index is not read: a steady step never syncs the host, so there
        an index outside the rows faults the gather, and a skipping scatter writes its
        -2 to the last row and its `rows` to the dropped spare row, silently (a declared
        `target_rows` catches the short table the relay's scatter could meet)."""
        env = self.env
        index = env.lookup(effect, effect.index)
        if index.device.type != "cpu":
            return
        rows = env.lookup(
            effect, effect.source if isinstance(effect, GatherRows) else effect.target
        )
        env.check_rows(effect, index.numpy(), rows.shape[0])

    def _checked_rows(self, effect: GatherRows | ScatterRows) -> None:
        """A checked plan's handler of a row move: the rows checked, then the fast handler."""
        self._check_rows(effect)
        self._handlers[type(effect)](effect)

    def _check_index(self, effect: Effect, ref: BufferRef) -> torch.Tensor:
        index = self.env.lookup(effect, ref)
        ok = index.dtype in {torch.int32, torch.int64}
        self.env.check_index(effect, ref=ref, shape=_shape(index), dtype=index.dtype, ok=ok)
        return index

    def _peer_failure(
        self, call: Call, what: str, comm: Communicator, error: RuntimeError
    ) -> PeerFailureError:
        return PeerFailureError(
            self.env.describe(call),
            f"{what} on communicator {comm.value} failed on rank {self._rank} "
            f"(group ranks {self._group_ranks.get(comm)}): {error}",
            "read the other ranks' logs: a peer died, stalled past the timeout, or issued "
            "a different collective",
        )

    # ---- streams and events --------------------------------------------------------------

    def _wait_stream(self, effect: WaitStream) -> None:
        if self._streams is not None:
            # What Stream.wait_stream does, with one reusable event instead of a new one
            # per call: a wait is queued with the state the event has when it is issued.
            marker = self._marker
            marker.record(self._streams[effect.waits_for])
            self._streams[effect.stream].wait_event(marker)

    def _record_event(self, effect: RecordEvent) -> None:
        env = self.env
        if self._streams is None:
            env.record_event(effect, effect.event, _CpuEvent(effect.event))
            return
        env.check_recordable(effect, effect.event)
        # Events come back to the pool once waited on or forgotten: a wait is queued with
        # the state the event had when it was issued, so recording it again is safe, and
        # no CUDA event is created and destroyed per step.
        pool = self._event_pool
        event = pool.pop() if pool else torch.cuda.Event()
        event.record(self._streams[effect.stream])
        env.events[effect.event] = event

    def _wait_event(self, effect: WaitEvent) -> None:
        event = self.env.take_event(effect, effect.event)
        if self._streams is not None and isinstance(event, torch.cuda.Event):
            self._streams[effect.stream].wait_event(event)
            self._event_pool.append(event)

    def _forget_event(self, effect: ForgetEvent) -> None:
        event = self.env.events.get(effect.event)
        self.env.forget_event(effect, effect.event)
        if isinstance(event, torch.cuda.Event):
            self._event_pool.append(event)

    def _record_stream(self, effect: RecordStream) -> None:
        tensor = self.env.lookup(effect, effect.buffer)
        if self._streams is not None:
            tensor.record_stream(self._streams[effect.stream])
        planner = self._planner
        if planner is not None and effect.stream in planner.unordered:  # a graph's memory?
            planner.recorded(tensor, effect.stream)

    def _synchronize(self, effect: Synchronize) -> None:
        # CPU: every kernel has finished when it returns, so there is nothing to wait for.
        if self._streams is not None:
            self._streams[effect.stream].synchronize()

    # ---- buffers -------------------------------------------------------------------------

    def _allocate(self, effect: Allocate) -> None:
        env = self.env
        env.check_unbound(effect, effect.buffer)
        self.on_stream(effect.stream)
        shape = effect.shape
        env.buffers[effect.buffer] = torch.empty_strided(
            shape, _row_major(shape), dtype=TORCH_DTYPES[effect.dtype], device=self._device
        )

    def _copy_host_to_device(self, effect: CopyHostToDevice) -> None:
        self.env.check_unbound(effect, effect.buffer)
        self.env.buffers[effect.buffer] = self.to_device(effect.source, effect.stream)

    def to_device(self, source: npt.NDArray[np.int32], stream: Stream) -> torch.Tensor:
        """A new device tensor holding `source`, copied on `stream` without blocking the host."""
        if self._streams is None:
            return torch.from_numpy(source.copy())
        # Pinned staging memory makes the copy asynchronous; the caching host allocator
        # keeps it alive until the copy on this stream has finished.
        staging = torch.empty(source.shape, dtype=torch.int32, pin_memory=True)
        staging.numpy()[...] = source
        self.on_stream(stream)
        return staging.to(self._device, non_blocking=True)

    def _release(self, effect: Release) -> None:
        self.env.release(effect, effect.buffer)

    def _alias(self, effect: Alias) -> None:
        env = self.env
        tensor = env.lookup(effect, effect.source)
        env.check_unbound(effect, effect.out)
        env.buffers[effect.out] = tensor

    # ---- collectives ---------------------------------------------------------------------

    def _check_source(self, effect: Broadcast) -> None:
        """The broadcast's source is a global rank of its communicator."""
        ranks = self._group_ranks[effect.comm]
        if effect.src not in ranks:
            self.env.fail(
                effect,
                f"source rank {effect.src} is not in communicator {effect.comm.value} {ranks}",
                "broadcast from a global rank of the communicator (a relay's source is its "
                "last stage: give RelayConfig.for_stage the pipeline's first_rank)",
            )

    def broadcast_options(self, effect: Broadcast) -> dist.BroadcastOptions:
        """The options of a direct `ProcessGroup.broadcast` from `effect.src` over its group."""
        key = (effect.comm, effect.src)
        options = self._broadcast_options.get(key)
        if options is None:
            group = self.group(effect, effect.comm)
            self._check_source(effect)
            options = dist.BroadcastOptions()
            options.rootRank = dist.get_group_rank(group, effect.src)
            options.rootTensor = 0
            # Blocking, as dist.broadcast(async_op=False) sets it: NCCL then runs on the
            # current stream itself, without the internal stream, events and tensor
            # stashing of async work (over 100 us of host time per call on an H200 host).
            options.asyncOp = False
            self._broadcast_options[key] = options
        return options

    def _broadcast(self, effect: Broadcast) -> None:
        env = self.env
        group = self.group(effect, effect.comm)
        tensor = env.lookup(effect, effect.buffer)
        wire_dtype = TORCH_DTYPES[effect.dtype]
        if tensor.shape != effect.shape or tensor.dtype is not wire_dtype:
            env.check_wire(
                effect,
                ref=effect.buffer,
                shape=_shape(tensor),
                dtype=tensor.dtype,
                wire=effect.shape,
                wire_dtype=wire_dtype,
            )
        options = self.broadcast_options(effect)
        self.on_stream(effect.stream)
        try:
            # What dist.broadcast does, minus its per-call checks: queue the collective on
            # the current stream; the wait makes that stream (NCCL) or the host (gloo) wait.
            work = group.broadcast([tensor], options)
            if work is not None:  # NCCL returns None: it ordered the stream already
                work.wait()
        except RuntimeError as error:
            what = f"broadcast of {effect.buffer.name!r} {effect.shape} from rank {effect.src}"
            raise self._peer_failure(effect, what, effect.comm, error) from error

    def _check_header(self, effect: CheckHeader) -> None:
        received = self.env.lookup(effect, effect.buffer)
        expected = effect.expected
        if received.shape != expected.shape or received.dtype is not torch.int32:
            self.env.check_header(
                effect,
                ref=effect.buffer,
                shape=_shape(received),
                dtype=received.dtype,
                expected=expected.shape,
                int32=torch.int32,
            )
        if self._streams is None:
            # CPU: the broadcast has completed and reading the header costs no device sync.
            if not torch.equal(received, torch.from_numpy(expected.copy())):
                raise HeaderMismatchError(
                    self.env.describe(effect),
                    rank=self._rank,
                    step=effect.step,
                    expected=tuple(int(v) for v in expected.tolist()),
                    received=tuple(int(v) for v in received.tolist()),
                )
            return
        wanted = self.to_device(expected, effect.stream)
        self.on_stream(effect.stream)
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
        env = self.env
        group = self.group(effect, effect.comm)
        env.check_unbound(effect, effect.result)
        if effect.work is not None:
            env.check_work_free(effect, effect.work)
        table = torch.from_numpy(effect.contribution.copy())
        try:
            handle = group.allreduce([table], self._all_reduce_options[effect.work is not None])
            if effect.work is None:
                if handle is not None:  # a blocking NCCL call returns None: done already
                    handle.wait()
            else:
                assert handle is not None  # asynchronous calls always return their work
                env.start_work(effect.work, _PendingWork(handle, effect.comm), effect.result)
        except RuntimeError as error:
            what = f"all-reduce into {effect.result.name!r} {effect.contribution.shape}"
            raise self._peer_failure(effect, what, effect.comm, error) from error
        env.buffers[effect.result] = table

    def _note_decision(self, effect: NoteDecision) -> None:
        self.env.lookup(effect, effect.table)  # a note for the log: the table is still bound

    def _wait_work(self, effect: WaitWork) -> None:
        pending, result = self.env.work(effect, effect.work)
        try:
            pending.handle.wait()
        except RuntimeError as error:
            what = f"all-reduce into {result.name!r} (work {effect.work.name!r})"
            raise self._peer_failure(effect, what, pending.comm, error) from error
        self.env.end_work(effect.work)

    # ---- device-side data moves ------------------------------------------------------------

    def _pad_columns(self, effect: PadColumns) -> None:
        env = self.env
        source = env.lookup(effect, effect.source)
        env.check_unbound(effect, effect.out)
        shape = source.shape
        if len(shape) != 2 or shape[1] > effect.width:  # F.pad would crop it
            env.check_pad(effect, effect.source, tuple(shape), effect.width)
        self.on_stream(effect.stream)
        env.buffers[effect.out] = pad_columns(source, effect.width, effect.fill)

    def _stack_rows(self, effect: StackRows) -> None:
        env = self.env
        sources = [env.lookup(effect, ref) for ref in effect.sources]
        env.check_unbound(effect, effect.out)
        self.on_stream(effect.stream)
        try:
            env.buffers[effect.out] = torch.stack(sources, dim=0)
        except RuntimeError:  # a caller's rows of unequal shapes: checked mode's error
            self._validate(effect)
            raise

    def _gather_rows(self, effect: GatherRows) -> None:
        env = self.env
        source = env.lookup(effect, effect.source)
        index = env.lookup(effect, effect.index)
        rows = effect.index_rows
        if rows is not None and (index.dim() != 1 or index.shape[0] != rows):
            self._validate(effect)  # a short index: its gather would be short
        env.check_unbound(effect, effect.out)
        self.on_stream(effect.stream)
        try:
            env.buffers[effect.out] = torch.index_select(source, 0, index)
        except (RuntimeError, IndexError):  # a caller's index or rows: checked mode's error
            self._validate(effect)
            raise

    def _scatter_rows(self, effect: ScatterRows) -> None:
        env = self.env
        source = env.lookup(effect, effect.source)
        index = env.lookup(effect, effect.index)
        target = env.lookup(effect, effect.target)
        if not target.is_contiguous():  # a caller's table: an expansion would take one row
            env.check_scatter_target(
                effect, effect.target, _shape(target), target.stride(), writable=True
            )
        rows = effect.target_rows
        if rows is not None and (not target.dim() or target.shape[0] < rows):
            # A short table: the skipping scatter's spare row would take its last slot.
            env.check_target_rows(effect, _shape(target))
        self.on_stream(effect.stream)
        try:
            scatter_rows(source, index, target, skips=effect.skips)
        except (RuntimeError, IndexError):  # a caller's index or table: checked mode's error
            self._validate(effect)
            raise

    def _pack(self, effect: Pack) -> None:
        env = self.env
        sources = [env.lookup(effect, section.buffer) for section in effect.sections]
        # copy_ would cast a source of another dtype silently (an int64 count past int32
        # sent as garbage), and broadcast one of another rank: refuse both, as checked does.
        # So is a source short of its declared rows (those it lacks would pack as zeros).
        for section, source in zip(effect.sections, sources, strict=True):
            wanted = TORCH_DTYPES[section.dtype]
            rows = section.source_rows
            if (
                source.dtype is not wanted
                or source.dim() != len(section.shape)
                or (rows is not None and (not source.dim() or source.shape[0] != rows))
            ):
                self._validate(effect)
        env.check_unbound(effect, effect.out)
        self.on_stream(effect.stream)
        out = torch.zeros(effect.nbytes // 8, dtype=torch.int64, device=self._device)
        try:
            pack(out, zip(effect.sections, sources, strict=True))
        except RuntimeError:  # a source larger than its section: checked mode's error
            self._validate(effect)
            raise
        env.buffers[effect.out] = out

    def _unpack(self, effect: Unpack) -> None:
        env = self.env
        source = env.lookup(effect, effect.source)
        env.check_views_unbound(effect)
        try:
            views = section_views(source, effect.sections)
        except RuntimeError:  # a source at an offset no section's dtype can view: typed
            self._validate(effect)
            raise
        for section, view in zip(effect.sections, views, strict=True):
            env.buffers[section.buffer] = view


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
