"""The stream model's three known gaps, closed: each test states what CUDA, NCCL or gloo do.

Gap 6: a gloo broadcast blocks the host that issues it until gloo's tree lets it go
(over two ranks: until the other joins; NCCL's is only queued on its stream), so a
broadcast and a CPU all-reduce taken in crossed orders hang on gloo: the simulator with
`backend='gloo'` and `purepp check` on a gloo run's logs report that deadlock, and a
real two-process gloo world shows the hang (its collectives time out). The same program
passes under NCCL's semantics.

Gap 5: the host is a lane of its own. CUDA does not hold the host on a main-stream
`WaitEvent`, so a host that passes one and then meets a peer's CPU all-reduce completes
on CUDA and NCCL; only a host read of the main stream's outputs (between a program's
yields, or between a logged run's steps, as a `.cpu()` copy) waits for the main stream.

Gap 7: a buffer released without `RecordStream` while another stream's use of it is not
ordered before the release (no event or stream wait of its home stream, no host
synchronize after the use) may be reused under that use: the numpy model flags it by
that order, whether or not the use has run in the model yet.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from purepp.effects.checker import EXIT_UNUSABLE, CheckReport, check_logs
from purepp.effects.log import EffectLog, LogHeader, Recorder, dump_logs
from purepp.effects.matching import CollectiveReportError, DeadlockReport, Report
from purepp.effects.numpy_interpreter import LifetimeViolation, NumpyInterpreter
from purepp.effects.simulator import RankContext, simulate
from purepp.effects.torch_interpreter import TorchInterpreter, build_communicators
from purepp.effects.vocabulary import (
    Backend,
    BufferRef,
    Communicator,
    CopyHostToDevice,
    Effect,
    EventRef,
    GatherRows,
    Op,
    RecordEvent,
    Release,
    Stream,
    Synchronize,
    WaitEvent,
    WaitStream,
)
from purepp.errors import ConfigError, PeerFailureError
from purepp.layout import Layout
from purepp.testing import (
    ScheduleConfig,
    make_schedule,
    record_scripted_logs,
    scripted_program,
)
from tests._dist import RankContext as ProcessContext
from tests._dist import describe_outcomes, spawn_ranks
from tests.test_streams_review2 import agree, wire

Program = list[list[tuple[Effect, ...]]]  # per rank, its effect batches in order

WORLD = Layout(pp=2, dp=1)  # two stages of one replica: PP_RELAY and PP_CPU span both


# -- helpers (tests/test_streams_review2.py's, with the backend) -------------------------


def simulated(program: Program, *, backend: Backend) -> Report | None:
    """The simulator's report on `program` over WORLD, None when every rank completes."""

    def run(context: RankContext) -> Iterator[tuple[Effect, ...]]:
        yield from program[context.rank]

    try:
        simulate(WORLD, run, backend=backend)
    except CollectiveReportError as error:
        return error.report
    return None


def checked(directory: Path, program: Program, *, backend: str) -> CheckReport:
    """`purepp check` over the logs a `Recorder` (no inner interpreter) per rank writes
    under a header whose config names `backend`, as `purepp run` writes it."""
    recorders = [
        Recorder(LogHeader(rank=rank, world=WORLD, config={"backend": backend}))
        for rank in range(WORLD.world_size)
    ]
    for recorder, batches in zip(recorders, program, strict=True):
        for batch in batches:
            recorder.perform(batch)
    dump_logs([recorder.log for recorder in recorders], directory)
    return check_logs(directory)


# -- gap 6: a gloo broadcast blocks its host ------------------------------------------------


def crossed(stream: Stream) -> Program:
    """Rank 0 broadcasts on `stream`, then agrees over PP_CPU; rank 1 agrees first, then
    receives. Each communicator's own order matches."""
    return [[(*wire(0, 0, stream=stream), agree(0))], [(agree(0), *wire(0, 0, stream=stream))]]


@pytest.mark.parametrize("stream", [Stream.RELAY, Stream.MAIN])
def test_a_crossed_broadcast_and_cpu_all_reduce_deadlock_on_gloo_in_both_tools(
    tmp_path: Path, stream: Stream
) -> None:
    """On gloo rank 0's host waits in its broadcast for rank 1, whose host waits in the
    PP_CPU all-reduce for rank 0: both tools report the deadlock with that cycle, name
    each rank's stuck effect and say why the broadcast holds its host."""
    simulated_report = simulated(crossed(stream), backend="gloo")
    assert isinstance(simulated_report, DeadlockReport)
    report = checked(tmp_path, crossed(stream), backend="gloo")
    assert isinstance(report.finding, DeadlockReport), report.text
    for found in (simulated_report, report.finding):
        assert found.cycle is not None
        assert sorted(found.cycle.ranks) == [0, 1]
        assert found.cycle.communicators == {Communicator.PP_RELAY, Communicator.PP_CPU}
        stuck = {waiter.rank: waiter.waiting_at for waiter in found.waiters}
        assert stuck[0].startswith("broadcast('wire.0' over pp_relay)")
        assert "blocks the host on gloo" in stuck[0]
        assert stuck[1].startswith("all_reduce('table.0' over pp_cpu")
    assert report.finding.cycle == simulated_report.cycle
    assert "blocks the host on gloo" in report.text


@pytest.mark.parametrize("stream", [Stream.RELAY, Stream.MAIN])
def test_the_crossed_program_passes_on_nccl_in_both_tools(tmp_path: Path, stream: Stream) -> None:
    """On NCCL rank 0's broadcast is only queued on its stream: its host goes on to the
    all-reduce, rank 1 then posts its receive, and both complete. (A broadcast on the
    main stream passes too: NCCL queues it there as well.)"""
    assert simulated(crossed(stream), backend="nccl") is None
    report = checked(tmp_path, crossed(stream), backend="nccl")
    assert report.ok, report.text


def test_the_simulator_keeps_nccl_semantics_by_default() -> None:
    """`simulate` without a backend models NCCL, as before the option existed."""

    def run(context: RankContext) -> Iterator[tuple[Effect, ...]]:
        yield from crossed(Stream.RELAY)[context.rank]

    simulate(WORLD, run)


def test_a_backend_that_is_none_is_a_typed_error_naming_it(tmp_path: Path) -> None:
    """`simulate` and `NumpyInterpreter` refuse a backend other than 'nccl' or 'gloo'
    with a ConfigError naming the call and the value; `purepp check` calls logs whose
    header names one unusable (exit 2), naming the value and the fix."""

    def run(context: RankContext) -> Iterator[tuple[Effect, ...]]:
        yield ()

    with pytest.raises(ConfigError) as raised:
        simulate(WORLD, run, backend="mpi")  # type: ignore[arg-type]
    assert (raised.value.call, "'mpi'" in raised.value.problem) == ("simulate", True)
    assert "'gloo'" in raised.value.fix
    with pytest.raises(ConfigError, match="backend is 'GLOO'"):
        NumpyInterpreter(backend="GLOO")  # type: ignore[arg-type]
    report = checked(tmp_path, crossed(Stream.RELAY), backend="mpi")
    assert report.exit_code == EXIT_UNUSABLE, report.text
    assert "'mpi'" in report.text
    assert "--backend nccl|gloo" in report.text


def test_a_gloo_broadcast_the_peer_joins_completes_and_moves_its_data() -> None:
    """On gloo the receiver's host waits in the broadcast until the sender joins, then
    reads the sent values: the simulator still moves the data."""
    seen: list[list[int]] = []

    def run(context: RankContext) -> Iterator[tuple[Effect, ...]]:
        if context.rank == 0:
            context.interpreter.bind(BufferRef("wire.0"), np.array([4, 5, 6], dtype=np.int64))
            yield (wire(0, 0)[1],)
        else:
            yield wire(0, 0)
            seen.append(context.interpreter.host_array(BufferRef("wire.0")).tolist())

    simulate(WORLD, run, backend="gloo")
    assert seen == [[4, 5, 6]]


SCHEDULES = [
    # What tests/test_gloo_world.py runs on real gloo processes, where every rank completes.
    ScheduleConfig(pp=2, dp=1, spec=2, steps=12, seed=21),
    ScheduleConfig(pp=3, dp=1, spec=1, steps=12, seed=22),
    ScheduleConfig(pp=2, dp=2, spec=1, steps=12, seed=23),
    ScheduleConfig(pp=3, dp=1, spec=2, steps=12, seed=22, validate_header=True),
]


@pytest.mark.parametrize("config", SCHEDULES, ids=lambda c: f"pp{c.pp}-dp{c.dp}-spec{c.spec}")
def test_the_scripted_relay_that_completes_on_real_gloo_passes_the_gloo_model(
    tmp_path: Path, config: ScheduleConfig
) -> None:
    """The scripted relay completes on real gloo ranks (tests/test_gloo_world.py): the
    gloo model must not call it a deadlock, in the simulator or in the checker."""
    schedule = make_schedule(config)
    simulate(schedule.world, scripted_program(schedule), backend="gloo")
    logs = record_scripted_logs(schedule)
    gloo = [
        EffectLog.from_effects(
            LogHeader(
                rank=log.header.rank,
                world=log.header.world,
                config={**log.header.config, "backend": "gloo"},
            ),
            log.effects,
        )
        for log in logs
    ]
    dump_logs(gloo, tmp_path)
    report = check_logs(tmp_path)
    assert report.ok, report.text


# -- gap 6 against real gloo: the crossed program hangs until the collectives time out -----

# The collectives' timeout in the real world: short, so the hang ends the test quickly.
HANG_TIMEOUT = datetime.timedelta(seconds=3)


def crossed_on_gloo(context: ProcessContext) -> str:
    """Rank `context.rank` of the crossed program on real gloo groups; what stopped it."""
    groups = build_communicators(
        pp_groups=[[0, 1]], dp_groups=[[0], [1]], relay_backend="gloo", timeout=context.timeout
    )
    interp = TorchInterpreter(device=context.device, groups=groups, rank=context.rank)
    if context.rank == 0:
        interp.bind(BufferRef("wire.0"), torch.tensor([4, 5, 6], dtype=torch.int64))
    dist.barrier()  # every group is connected: what follows is the program alone
    batch = crossed(Stream.RELAY)[context.rank][0]
    try:
        interp.perform(batch[1:] if context.rank == 0 else batch)
    except PeerFailureError as error:
        return f"PeerFailureError: {error}"
    return "completed"


@pytest.mark.multiprocess
def test_the_crossed_program_really_hangs_on_gloo_until_its_collectives_time_out() -> None:
    """Two real gloo processes run the crossed program: rank 0 waits in its broadcast,
    rank 1 in its PP_CPU all-reduce, and neither completes: each raises PeerFailureError
    when its collective times out (bounded by a 3 s timeout and a 60 s deadline)."""
    outcomes = spawn_ranks(crossed_on_gloo, 2, timeout=HANG_TIMEOUT, deadline_s=60.0)
    assert all(outcome.ok for outcome in outcomes), describe_outcomes(outcomes)
    broadcast, all_reduce = (outcome.value for outcome in outcomes)
    assert broadcast is not None
    assert all_reduce is not None
    assert broadcast.startswith("PeerFailureError"), broadcast
    assert "Broadcast step=0 op=receive" in broadcast
    assert all_reduce.startswith("PeerFailureError"), all_reduce
    assert "AllReduce step=0 op=agree" in all_reduce


def crossed_on_nccl(context: ProcessContext) -> str:
    """Rank `context.rank` of the crossed program with its relay on NCCL (one GPU each)."""
    groups = build_communicators(
        pp_groups=[[0, 1]], dp_groups=[[0], [1]], relay_backend="nccl", timeout=context.timeout
    )
    interp = TorchInterpreter(device=context.device, groups=groups, rank=context.rank)
    if context.rank == 0:
        wire = torch.tensor([4, 5, 6], dtype=torch.int64, device=context.device)
        interp.bind(BufferRef("wire.0"), wire)
    dist.barrier()
    batch = crossed(Stream.RELAY)[context.rank][0]
    try:
        interp.perform(batch[1:] if context.rank == 0 else batch)
        torch.cuda.synchronize()
    except PeerFailureError as error:
        return f"PeerFailureError: {error}"
    return "completed"


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
)
def test_the_crossed_program_completes_on_nccl_from_its_first_step() -> None:
    """Two NCCL processes run the crossed program at step 0: each broadcast only queues
    on its stream, so both complete, as the NCCL model says. (`build_communicators`
    creates the relay's NCCL communicator: created by the first broadcast instead, its
    creation would block rank 0's host until rank 1 joins, and rank 1 waits in its CPU
    all-reduce for rank 0: a hang at step 0 that the model does not have.)"""
    outcomes = spawn_ranks(
        crossed_on_nccl, 2, backend="nccl", timeout=HANG_TIMEOUT, deadline_s=120.0
    )
    assert all(outcome.ok for outcome in outcomes), describe_outcomes(outcomes)
    assert [outcome.value for outcome in outcomes] == ["completed", "completed"]


# -- gap 5: the host and the main stream are two lanes --------------------------------------


def consume_then_agree(*, split: bool) -> Program:
    """Rank 0 receives step 0's wire from rank 1 on the relay stream, makes the main
    stream wait for it (an event) and agrees over PP_CPU; rank 1 agrees, then sends.
    `split`: rank 0 agrees in a batch of its own (its program may read in between)."""
    event = EventRef("received.0")
    receive: tuple[Effect, ...] = (
        *wire(0, 1),
        RecordEvent(step=0, op=Op.RECEIVE, stream=Stream.RELAY, event=event),
        WaitEvent(step=0, op=Op.CONSUME, stream=Stream.MAIN, event=event),
    )
    rank0 = [receive, (agree(0),)] if split else [(*receive, agree(0))]
    return [rank0, [(agree(0), wire(0, 1)[1])]]


def run_consume_then_agree(*, split: bool) -> None:
    """`consume_then_agree` in the simulator (rank 1 binds what it sends)."""

    def run(context: RankContext) -> Iterator[tuple[Effect, ...]]:
        if context.rank == 1:
            context.interpreter.bind(BufferRef("wire.0"), np.array([7, 8, 9], dtype=np.int64))
        yield from consume_then_agree(split=split)[context.rank]
        if context.rank == 0:
            received.append(context.interpreter.host_array(BufferRef("wire.0")).tolist())

    received: list[list[int]] = []
    simulate(WORLD, run)
    assert received == [[7, 8, 9]]  # read once the main stream had waited for it


def test_a_host_past_a_main_stream_wait_meets_the_peers_all_reduce_on_nccl(
    tmp_path: Path,
) -> None:
    """CUDA queues the main-stream wait and the host goes on to the CPU all-reduce,
    which rank 1 joins before it sends: the run completes in both tools, and rank 0
    reads the sent values after its program's last yield."""
    run_consume_then_agree(split=False)
    report = checked(tmp_path, consume_then_agree(split=False), backend="nccl")
    assert report.ok, report.text


def test_the_main_streams_wait_holds_a_program_that_reads_before_it_agrees() -> None:
    """The same ranks, but rank 0's program may read what the main stream waited for
    before its all-reduce (it yields in between): that read waits for the relay
    broadcast, which rank 1 sends only after the all-reduce. The simulator reports the
    deadlock, rank 0 waiting on its main stream, rank 1 on its host. (A log does not
    show where a run's host read within a step: the checker waits for the main stream
    only between steps, and steps never go back, so no such cycle spans two steps.)"""
    with pytest.raises(CollectiveReportError) as raised:
        run_consume_then_agree(split=True)
    found = raised.value.report
    assert isinstance(found, DeadlockReport)
    assert found.cycle is not None
    where = {(w.rank, w.stream, w.host): w.describe() for w in found.waiters}
    assert where[0, Stream.MAIN, False].startswith(
        "rank 0 [main stream] waits at step 0 (consume) on wait_event('received.0' on main)"
    )
    assert where[1, Stream.MAIN, True].startswith(
        "rank 1 [host] waits at step 0 (agree) on all_reduce"
    )


def test_on_gloo_the_receive_itself_holds_the_host_before_the_all_reduce(tmp_path: Path) -> None:
    """On gloo rank 0's host waits in the receive, before its all-reduce: a deadlock
    in both tools even within one batch."""
    program = consume_then_agree(split=False)
    assert isinstance(simulated(program, backend="gloo"), DeadlockReport)
    report = checked(tmp_path, program, backend="gloo")
    assert isinstance(report.finding, DeadlockReport), report.text


# -- gap 7: a release is judged by order, not by what the model has run ---------------------

SOURCE, INDEX, OUT = BufferRef("source"), BufferRef("index"), BufferRef("out")


def gathered_on_main() -> tuple[Effect, ...]:
    """A relay-stream buffer read on the main stream (which waits for the relay first):
    the read runs at once in the model."""
    return (
        CopyHostToDevice(
            step=0, op=Op.RECEIVE, source=np.array([[1, 2]]), buffer=SOURCE, stream=Stream.RELAY
        ),
        CopyHostToDevice(
            step=0, op=Op.RECEIVE, source=np.array([0]), buffer=INDEX, stream=Stream.MAIN
        ),
        WaitStream(step=0, op=Op.CONSUME, stream=Stream.MAIN, waits_for=Stream.RELAY),
        GatherRows(step=0, op=Op.CONSUME, source=SOURCE, index=INDEX, out=OUT, stream=Stream.MAIN),
    )


RELEASE = Release(step=0, op=Op.CONSUME, buffer=SOURCE)


def test_a_release_unordered_after_a_use_that_has_run_is_a_violation() -> None:
    """The main stream's read has run in the model, but nothing orders it before the
    relay stream's next allocation (on CUDA the host may be far ahead of the device):
    releasing the buffer without RecordStream is a violation naming the main stream."""
    interp = NumpyInterpreter()
    interp.perform((*gathered_on_main(), RELEASE))
    assert interp.lifetime_violations == (
        LifetimeViolation(buffer=SOURCE, step=0, op=Op.CONSUME, used_on=(Stream.MAIN,)),
    )


def ordered_after_the_read() -> list[tuple[str, tuple[Effect, ...]]]:
    done = EventRef("read")
    return [
        (
            "an event the relay stream waits on",
            (
                RecordEvent(step=0, op=Op.CONSUME, stream=Stream.MAIN, event=done),
                WaitEvent(step=0, op=Op.CONSUME, stream=Stream.RELAY, event=done),
            ),
        ),
        (
            "the relay stream waiting for the main stream",
            (WaitStream(step=0, op=Op.CONSUME, stream=Stream.RELAY, waits_for=Stream.MAIN),),
        ),
        ("a host synchronize", (Synchronize(step=0, op=Op.CONSUME, stream=Stream.MAIN),)),
        (
            # The event is recorded on the relay stream after its wait for the main
            # stream: waiting on it orders the read before too (order is transitive).
            "an event recorded after a wait on the main stream",
            (
                WaitStream(step=0, op=Op.CONSUME, stream=Stream.RELAY, waits_for=Stream.MAIN),
                RecordEvent(step=0, op=Op.CONSUME, stream=Stream.RELAY, event=done),
                WaitEvent(step=0, op=Op.CONSUME, stream=Stream.RELAY, event=done),
            ),
        ),
    ]


@pytest.mark.parametrize(("how", "order"), ordered_after_the_read(), ids=lambda v: str(v)[:40])
def test_a_release_ordered_after_the_other_streams_use_is_fine(
    how: str, order: tuple[Effect, ...]
) -> None:
    """Once the home stream (or the host) is ordered after the read, a reuse cannot
    overwrite it: no violation, without RecordStream."""
    interp = NumpyInterpreter()
    interp.perform((*gathered_on_main(), *order, RELEASE))
    assert interp.lifetime_violations == (), how
    assert interp.tensor(OUT).tolist() == [[1, 2]]


def test_a_use_after_the_wait_is_not_covered_by_it() -> None:
    """The relay stream waited for the main stream before the read was queued: that
    orders nothing after the read, so the release is still a violation."""
    interp = NumpyInterpreter()
    early = WaitStream(step=0, op=Op.CONSUME, stream=Stream.RELAY, waits_for=Stream.MAIN)
    setup, read = gathered_on_main()[:3], gathered_on_main()[3]
    interp.perform((*setup, early, read, RELEASE))
    assert [v.used_on for v in interp.lifetime_violations] == [(Stream.MAIN,)]
