"""Review of collective matching and its reports: the simulator, `purepp check` and
`match_collectives` over hand-written multi-rank programs with one injected mistake.

Each program is run by `simulate` and, recorded rank by rank through a `Recorder` with
no inner interpreter, by `check_logs`: both must report what was injected, field by
field, and say the same. The bugs the review found are plain tests now.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from tempfile import TemporaryDirectory

import attrs
import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings

from purepp.effects.checker import EXIT_FINDING, EXIT_OK, CheckReport, check_logs
from purepp.effects.log import LogHeader, Recorder, dump_logs
from purepp.effects.matching import (
    CollectiveReportError,
    CommInstance,
    DeadlockReport,
    MismatchClass,
    MismatchField,
    MismatchReport,
    Report,
    RingOverrunReport,
    check_posts,
    match_collectives,
    signature_of,
)
from purepp.effects.simulator import RankContext, simulate
from purepp.effects.vocabulary import (
    Allocate,
    AllReduce,
    Broadcast,
    BufferRef,
    Communicator,
    DType,
    Effect,
    EventRef,
    Op,
    RecordEvent,
    Stream,
    Synchronize,
    WaitEvent,
)
from purepp.layout import Layout

PP_CPU, DP_CPU, DRAFTER, RELAY = (
    Communicator.PP_CPU,
    Communicator.DP_CPU,
    Communicator.DP_DRAFTER_CPU,
    Communicator.PP_RELAY,
)

Program = list[list[tuple[Effect, ...]]]  # per rank, its steps' effect tuples


# -- helpers -----------------------------------------------------------------------------


def agree(step: int, comm: Communicator, columns: int = 2) -> AllReduce:
    """A synchronous all-reduce of a zero table of `columns` columns."""
    return AllReduce(
        step=step,
        op=Op.AGREE,
        contribution=np.zeros((5, columns), dtype=np.int32),
        result=BufferRef(f"{comm.value}.{step}"),
        comm=comm,
        work=None,
    )


def cast(
    step: int,
    src: int,
    *,
    shape: tuple[int, ...] = (2, 3),
    dtype: DType = DType.INT64,
    stream: Stream = Stream.MAIN,
    name: str = "wire",
) -> tuple[Effect, ...]:
    """Allocate a wire buffer and broadcast it over pp_relay from `src`."""
    buffer = BufferRef(f"{name}.{step}")
    return (
        Allocate(step=step, op=Op.RECEIVE, buffer=buffer, shape=shape, dtype=dtype, stream=stream),
        Broadcast(
            step=step,
            op=Op.RECEIVE,
            buffer=buffer,
            shape=shape,
            dtype=dtype,
            src=src,
            comm=RELAY,
            stream=stream,
        ),
    )


def one_step_each(per_rank: Sequence[Sequence[Effect]]) -> Program:
    """Each rank's effects, one tuple per run of one step."""
    program: Program = []
    for effects in per_rank:
        steps: list[tuple[Effect, ...]] = []
        batch: list[Effect] = []
        for effect in effects:
            if batch and effect.step != batch[-1].step:
                steps.append(tuple(batch))
                batch = []
            batch.append(effect)
        if batch:
            steps.append(tuple(batch))
        program.append(steps)
    return program


def simulated(
    world: Layout, program: Program, *, compare_steps: bool = True, in_flight: int | None = None
) -> Report | None:
    """The simulator's report on `program`, None when it runs to its end."""

    def run(context: RankContext) -> Iterator[tuple[Effect, ...]]:
        yield from program[context.rank]

    try:
        simulate(world, run, compare_steps=compare_steps, max_steps_in_flight=in_flight)
    except CollectiveReportError as error:
        return error.report
    return None


def checked(directory: Path, world: Layout, program: Program) -> CheckReport:
    """`purepp check` over the logs a `Recorder` (no inner interpreter) per rank writes."""
    recorders = [
        Recorder(LogHeader(rank=rank, world=world, config={"model": "review"}))
        for rank in range(world.world_size)
    ]
    for recorder, steps in zip(recorders, program, strict=True):
        for batch in steps:
            recorder.perform(batch)
    dump_logs([recorder.log for recorder in recorders], directory)
    return check_logs(directory)


def flat(program: Program) -> dict[int, list[Effect]]:
    return {rank: [e for batch in steps for e in batch] for rank, steps in enumerate(program)}


def both(tmp: Path, world: Layout, program: Program) -> tuple[Report | None, CheckReport]:
    return simulated(world, program), checked(tmp, world, program)


def agreements(world: Layout, steps: int, *, wide: dict[tuple[int, int], int]) -> Program:
    """Every rank agrees over dp_cpu at every step; (rank, step) in `wide` adds columns."""
    return one_step_each(
        [
            [agree(step, DP_CPU, world.dp + wide.get((rank, step), 0)) for step in range(steps)]
            for rank in range(world.world_size)
        ]
    )


# -- the culprit: the rank fewer ranks side with, none on a tie ---------------------------


@pytest.mark.parametrize(
    ("dp", "odd"),
    [(2, 0), (2, 1), (3, 0), (3, 1), (3, 2), (4, 0), (4, 2), (4, 3)],
)
def test_match_collectives_blames_the_odd_rank_out_or_none_of_two(dp: int, odd: int) -> None:
    world = Layout(pp=1, dp=dp)
    report = match_collectives(flat(agreements(world, 3, wide={(odd, 1): 1})), world)
    assert isinstance(report, MismatchReport)
    assert (report.classification, report.seq, report.step) == (MismatchClass.SIZE, 1, 1)
    assert report.differing == (MismatchField.SHAPE,)
    assert report.culprit == (None if dp == 2 else odd)
    assert {report.rank, report.peer} == ({1, 0} if odd == 0 else {odd, 0})
    blamed = "none (as many ranks on each side)" if dp == 2 else f"rank {odd}"
    assert report.render().endswith(f"  mismatch: size; culprit: {blamed}")


def test_match_collectives_names_no_culprit_on_a_two_against_two_tie() -> None:
    world = Layout(pp=1, dp=4)
    wide = {(0, 0): 1, (1, 0): 1}
    report = match_collectives(flat(agreements(world, 1, wide=wide)), world)
    assert isinstance(report, MismatchReport)
    assert (report.rank, report.peer, report.culprit) == (2, 0, None)


@pytest.mark.parametrize("dp", [3, 4])
def test_the_odd_rank_that_posts_last_is_blamed_by_both_tools(tmp_path: Path, dp: int) -> None:
    # Rank 1 disagrees at step 1, after rank 0 (and, by then, the highest rank) posted.
    world = Layout(pp=1, dp=dp)
    program = agreements(world, 3, wide={(1, 1): 1})
    sim, check = both(tmp_path, world, program)
    assert isinstance(sim, MismatchReport)
    assert check.finding == sim
    assert check.exit_code == EXIT_FINDING
    assert (sim.rank, sim.peer, sim.seq, sim.culprit) == (1, 0, 1, 1)
    assert sim.instance == CommInstance(comm=DP_CPU, group=tuple(range(dp)))
    assert (sim.expected.shape, sim.received and sim.received.shape) == ((5, dp + 1), (5, dp))
    assert "  mismatch: size; culprit: rank 1" in check.text.splitlines()


@pytest.mark.parametrize("tool", ["simulate", "check"])
def test_the_odd_rank_out_of_three_is_blamed_whatever_the_posting_order(
    tmp_path: Path, tool: str
) -> None:
    world = Layout(pp=1, dp=3)
    program = agreements(world, 2, wide={(0, 1): 1})
    offline = match_collectives(flat(program), world)
    assert offline is not None
    assert offline.culprit == 0
    report = simulated(world, program) if tool == "simulate" else checked(tmp_path, world, program)
    finding = report if not isinstance(report, CheckReport) else report.finding
    assert isinstance(finding, MismatchReport)
    assert finding.classification is MismatchClass.SIZE
    assert finding.culprit == 0


@pytest.mark.parametrize("tool", ["simulate", "check"])
def test_a_two_against_two_tie_names_no_culprit_in_either_tool(tmp_path: Path, tool: str) -> None:
    world = Layout(pp=1, dp=4)
    program = agreements(world, 1, wide={(0, 0): 1, (1, 0): 1})
    report = simulated(world, program) if tool == "simulate" else checked(tmp_path, world, program)
    finding = report if not isinstance(report, CheckReport) else report.finding
    assert isinstance(finding, MismatchReport)
    assert finding.culprit is None


def test_a_source_outside_the_group_on_one_rank_of_three_blames_that_rank() -> None:
    world = Layout(pp=3, dp=2)  # pipelines (0, 1, 2) and (3, 4, 5)
    per_rank = {
        rank: [e for step in range(2) for e in cast(step, world.pipeline(world.dp_index(rank))[-1])]
        for rank in range(world.world_size)
    }
    per_rank[4] = [*cast(0, 5), *cast(1, 2)]  # step 1: the other pipeline's last stage
    report = match_collectives(per_rank, world)
    assert isinstance(report, MismatchReport)
    assert (report.rank, report.seq, report.classification) == (4, 1, MismatchClass.SOURCE)
    assert report.culprit == 4


def test_a_source_outside_the_group_is_reported_by_both_tools_at_its_op(tmp_path: Path) -> None:
    world = Layout(pp=3, dp=2)
    per_rank = [
        [e for step in range(2) for e in cast(step, world.pipeline(world.dp_index(rank))[-1])]
        for rank in range(world.world_size)
    ]
    per_rank[4] = [*cast(0, 5), *cast(1, 2)]
    sim, check = both(tmp_path, world, one_step_each(per_rank))
    assert isinstance(sim, MismatchReport)
    assert check.finding == sim
    assert (sim.rank, sim.seq, sim.step, sim.peer, sim.received) == (4, 1, 1, None, None)
    assert sim.instance == CommInstance(comm=RELAY, group=(3, 4, 5))
    assert sim.differing == (MismatchField.SRC,)
    assert sim.expected.src == 2
    assert "  rank 2 is not a member of pp_relay" in check.text.splitlines()


# -- each class, at the op injected, in a replica other than the first ---------------------


@pytest.mark.parametrize(
    ("wrong", "field", "cls"),
    [
        ({"shape": (2, 4)}, MismatchField.SHAPE, MismatchClass.SIZE),
        ({"dtype": DType.INT32}, MismatchField.DTYPE, MismatchClass.DTYPE),
        ({"src": 3}, MismatchField.SRC, MismatchClass.SOURCE),
    ],
    ids=["size", "dtype", "source"],
)
def test_a_broadcast_mistake_in_replica_one_is_reported_at_that_op_by_both(
    tmp_path: Path, wrong: dict[str, object], field: MismatchField, cls: MismatchClass
) -> None:
    # pp 3 x dp 2: replica 1 is ranks 3, 4, 5 (sender 5); rank 4 gets step 2 wrong.
    world = Layout(pp=3, dp=2)
    per_rank = [
        [e for step in range(4) for e in cast(step, world.pipeline(world.dp_index(rank))[-1])]
        for rank in range(world.world_size)
    ]
    per_rank[4] = [
        e
        for step in range(4)
        for e in (cast(step, **{"src": 5, **wrong}) if step == 2 else cast(step, 5))  # type: ignore[arg-type]
    ]
    sim, check = both(tmp_path, world, one_step_each(per_rank))
    assert isinstance(sim, MismatchReport), sim
    assert check.finding == sim, check.text
    assert (sim.rank, sim.seq, sim.step, sim.differing) == (4, 2, 2, (field,))
    assert sim.instance == CommInstance(comm=RELAY, group=(3, 4, 5))
    assert sim.classification is cls
    assert sim.peer == 5  # the sender is the reference once it has posted
    assert sim.received is not None
    assert (sim.received.src, sim.received.shape, sim.received.dtype) == (5, (2, 3), DType.INT64)


def test_a_broadcast_against_an_all_reduce_is_a_type_mismatch_in_both(tmp_path: Path) -> None:
    world = Layout(pp=2, dp=1)
    program = one_step_each(
        [
            [agree(0, PP_CPU), agree(1, PP_CPU)],
            [
                agree(0, PP_CPU),
                Broadcast(
                    step=1,
                    op=Op.AGREE,
                    buffer=BufferRef("t"),
                    shape=(5, 2),
                    dtype=DType.INT32,
                    src=1,
                    comm=PP_CPU,
                    stream=Stream.MAIN,
                ),
            ],
        ]
    )
    program[1][1] = (
        Allocate(
            step=1,
            op=Op.AGREE,
            buffer=BufferRef("t"),
            shape=(5, 2),
            dtype=DType.INT32,
            stream=Stream.MAIN,
        ),
        *program[1][1],
    )
    sim, check = both(tmp_path, world, program)
    assert isinstance(sim, MismatchReport)
    assert check.finding == sim
    assert (sim.classification, sim.seq, sim.step, sim.culprit) == (MismatchClass.TYPE, 1, 1, None)
    assert MismatchField.KIND in sim.differing


# -- a missing collective ------------------------------------------------------------------


def test_a_collective_missing_on_one_of_three_is_a_missing_rank_in_the_check(
    tmp_path: Path,
) -> None:
    world = Layout(pp=1, dp=3)
    program = agreements(world, 2, wide={})
    program[2] = program[2][:1]  # rank 2's log ends before step 1's agreement
    sim, check = both(tmp_path, world, program)
    assert isinstance(sim, DeadlockReport)
    assert sim.finished == (2,)
    (pending,) = sim.pending
    assert (pending.seq, pending.missing) == (1, (2,))
    missing = check.finding
    assert isinstance(missing, MismatchReport), check.text
    assert (missing.classification, missing.rank, missing.seq, missing.step) == (
        MismatchClass.MISSING_RANK,
        0,
        1,
        1,
    )
    assert (missing.missing, missing.culprit, missing.peer, missing.received) == (
        (2,),
        2,
        None,
        None,
    )
    assert missing.instance == CommInstance(comm=DP_CPU, group=(0, 1, 2))
    assert (
        "  rank 2's log ends at step 0 (1 records), before op #1 on dp_cpu: the rank died or "
        "stopped there, or skipped it"
    ) in check.text.splitlines()


def test_a_collective_skipped_mid_run_is_a_step_mismatch_in_both(tmp_path: Path) -> None:
    # FIELD_FAILURES row 10 on a 2 x 2 grid: rank 3 (stage 1, replica 1) skips step 1.
    world = Layout(pp=2, dp=2)
    per_rank = [
        [agree(step, DP_CPU) for step in range(3) if (rank, step) != (3, 1)] for rank in range(4)
    ]
    sim, check = both(tmp_path, world, one_step_each(per_rank))
    assert isinstance(sim, MismatchReport)
    assert check.finding == sim
    assert sim.instance == CommInstance(comm=DP_CPU, group=(1, 3))
    assert (sim.classification, sim.seq, sim.differing) == (
        MismatchClass.STEP,
        1,
        (MismatchField.STEP,),
    )
    assert {sim.rank, sim.peer} == {1, 3}
    assert sim.culprit is None  # two ranks always tie


# -- opposite issue orders: the wait-for cycle (field failure 14) --------------------------


def test_a_four_rank_cycle_through_pp_cpu_and_dp_cpu_is_named_alike_by_both(
    tmp_path: Path,
) -> None:
    world = Layout(pp=2, dp=2)  # pp_cpu (0, 1), (2, 3); dp_cpu (0, 2), (1, 3)
    dp_first = [agree(0, DP_CPU), agree(0, PP_CPU)]
    pp_first = [agree(0, PP_CPU), agree(0, DP_CPU)]
    per_rank = [dp_first, pp_first, pp_first, dp_first]
    assert match_collectives(dict(enumerate(per_rank)), world) is None
    sim, check = both(tmp_path, world, one_step_each(per_rank))
    assert isinstance(sim, DeadlockReport)
    assert check.finding == sim
    assert sim.cycle is not None
    assert [(e.rank, e.via and e.via.comm, e.seq, e.peer) for e in sim.cycle.edges] == [
        (0, DP_CPU, 0, 2),
        (2, PP_CPU, 0, 3),
        (3, DP_CPU, 0, 1),
        (1, PP_CPU, 0, 0),
    ]
    assert sim.cycle.communicators == {DP_CPU, PP_CPU}
    assert "in one order on every rank" in sim.fix()
    assert (
        "  wait-for cycle: rank 0 -> dp_cpu op #0 -> rank 2 -> pp_cpu op #0 -> rank 3"
        " -> dp_cpu op #0 -> rank 1 -> pp_cpu op #0 -> rank 0"
    ) in check.text.splitlines()


def test_one_rank_of_three_taking_the_lanes_the_other_way_is_a_two_rank_cycle(
    tmp_path: Path,
) -> None:
    world = Layout(pp=1, dp=3)
    per_rank = [
        [agree(0, DP_CPU, 3), agree(0, DRAFTER, 3)],
        [agree(0, DP_CPU, 3), agree(0, DRAFTER, 3)],
        [agree(0, DRAFTER, 3), agree(0, DP_CPU, 3)],
    ]
    sim, check = both(tmp_path, world, one_step_each(per_rank))
    assert isinstance(sim, DeadlockReport)
    assert check.finding == sim
    assert sim.cycle is not None
    assert [(e.rank, e.via and e.via.comm, e.peer) for e in sim.cycle.edges] == [
        (0, DP_CPU, 2),
        (2, DRAFTER, 0),
    ]
    assert [w.rank for w in sim.waiters] == [0, 1, 2]
    assert sim.at_steps == (0, 0, 0)


def test_a_rank_hung_in_its_last_record_has_not_finished_its_program(tmp_path: Path) -> None:
    world = Layout(pp=2, dp=1)
    # Rank 0 agrees before the relay, rank 1 relays first and its host waits for it: a
    # cycle; rank 0's log ends with the agreement it waits in.
    synchronize = Synchronize(step=0, op=Op.RECEIVE, stream=Stream.MAIN)
    program = one_step_each([[agree(0, PP_CPU)], [*cast(0, 1), synchronize, agree(0, PP_CPU)]])
    sim, check = both(tmp_path, world, program)
    assert isinstance(sim, DeadlockReport)
    assert sim.finished == ()
    assert sim.at_steps == (0, 0)
    deadlock = check.finding
    assert isinstance(deadlock, DeadlockReport)
    assert deadlock.cycle == sim.cycle
    assert deadlock.at_steps == (0, 0)
    assert "finished their program" not in check.text
    assert deadlock.finished == ()


# -- a receiver outrunning the ring ---------------------------------------------------------


def ring_program(world: Layout, steps: int, depth: int) -> Program:
    """Every replica's last stage sends each step; the others receive it on the relay
    stream, record an event, and consume the entry `depth` steps later on the host."""
    program: Program = []
    for rank in range(world.world_size):
        last = world.pipeline(world.dp_index(rank))[-1]
        rank_steps: list[tuple[Effect, ...]] = []
        for step in range(steps):
            effects: list[Effect] = []
            if rank != last and step >= depth:
                effects.append(
                    WaitEvent(
                        step=step,
                        op=Op.CONSUME,
                        stream=Stream.MAIN,
                        event=EventRef(f"e.{step - depth}"),
                    )
                )
            effects += cast(step, last, stream=Stream.RELAY)
            if rank != last:
                effects.append(
                    RecordEvent(
                        step=step, op=Op.RECEIVE, stream=Stream.RELAY, event=EventRef(f"e.{step}")
                    )
                )
            rank_steps.append(tuple(effects))
        program.append(rank_steps)
    return program


def test_a_receiver_outrunning_a_one_entry_ring_of_three_stages_is_an_overrun() -> None:
    world = Layout(pp=3, dp=2)
    report = simulated(world, ring_program(world, 5, depth=1))
    assert isinstance(report, RingOverrunReport)
    assert (report.rank, report.step, report.op) == (0, 1, Op.CONSUME)
    assert report.event == EventRef("e.0")
    assert (report.ring_depth, report.max_steps_in_flight) == (1, 3)
    assert report.awaited.instance == CommInstance(comm=RELAY, group=(0, 1, 2))
    assert (report.awaited.seq, report.awaited.signature.step) == (0, 0)
    # rank 1 has not run yet (lowest rank first): neither it nor the sender posted
    assert report.awaited.missing == (1, 2)
    assert report.peers_at == ((1, 0), (2, 0))


@pytest.mark.parametrize(("depth", "in_flight"), [(3, None), (1, 1), (2, 2)])
def test_a_ring_as_deep_as_the_steps_in_flight_never_overruns(
    depth: int, in_flight: int | None
) -> None:
    world = Layout(pp=3, dp=2)
    assert simulated(world, ring_program(world, 6, depth=depth), in_flight=in_flight) is None


# -- compare_steps=False: matched as the wire matches ---------------------------------------


def test_without_step_labels_a_skipped_agreement_pairs_the_next_one(tmp_path: Path) -> None:
    world = Layout(pp=1, dp=2)
    per_rank = [
        [agree(step, DP_CPU) for step in range(3)],
        [agree(step, DP_CPU) for step in range(3) if step != 1] + [agree(3, DP_CPU)],
    ]
    program = one_step_each(per_rank)
    assert simulated(world, program, compare_steps=False) is None
    labelled = simulated(world, program)
    assert isinstance(labelled, MismatchReport)
    assert labelled.classification is MismatchClass.STEP


def test_without_step_labels_a_shape_mismatch_shows_the_labels_as_posted() -> None:
    world = Layout(pp=1, dp=3)
    per_rank = [
        [agree(0, DP_CPU, 3), agree(1, DP_CPU, 3)],
        [agree(0, DP_CPU, 3), agree(1, DP_CPU, 3)],
        [agree(1, DP_CPU, 4)],  # skipped step 0, and its step 1 is wider
    ]
    report = simulated(world, one_step_each(per_rank), compare_steps=False)
    assert isinstance(report, MismatchReport)
    assert report.differing == (MismatchField.SHAPE,)
    assert report.classification is MismatchClass.SIZE
    assert report.received is not None
    assert (report.rank, report.peer, report.seq) == (2, 0, 0)
    assert (report.expected.step, report.received.step) == (1, 0)
    assert (report.expected.shape, report.received.shape) == ((5, 4), (5, 3))


# -- check_posts on its own -------------------------------------------------------------------


def test_check_posts_prefers_the_sender_as_reference() -> None:
    instance = CommInstance(comm=RELAY, group=(0, 1, 2))
    posts = {
        rank: signature_of(b)
        for rank, b in (
            (0, cast(0, 2, shape=(2, 4))[1]),
            (1, cast(0, 2, shape=(2, 4))[1]),
            (2, cast(0, 2)[1]),
        )
        if isinstance(b, Broadcast)
    }
    report = check_posts(instance, 0, posts)
    assert report is not None
    assert (report.rank, report.peer, report.culprit) == (0, 2, 2)
    assert attrs.evolve(report, culprit=None).classify_line() == (
        "mismatch: size; culprit: none (as many ranks on each side)"
    )


# -- random worlds, random mistakes: both tools say the same ---------------------------------

MISTAKES = ("none", "shape", "dtype", "src", "drop", "swap")


def random_world_program(
    world: Layout, steps: int, *, mistake: str, rank: int, step: int, which: int
) -> Program:
    """Every rank relays (pp > 1), agrees over dp_cpu (dp > 1) and over pp_cpu (pp > 1)
    each step; `rank` makes `mistake` at `step` on its `which`-th collective there."""
    pp, dp = world.pp, world.dp
    program: Program = []
    for r in range(world.world_size):
        last = world.pipeline(world.dp_index(r))[-1]
        rank_steps: list[tuple[Effect, ...]] = []
        for s in range(steps):
            ops: list[tuple[Effect, ...]] = []
            if pp > 1:
                ops.append(cast(s, last))
            if dp > 1:
                ops.append((agree(s, DP_CPU, 4),))
            if pp > 1:
                ops.append((agree(s, PP_CPU, 4),))
            if (r, s) == (rank, step) and ops:
                at = which % len(ops)
                target = ops[at]
                coll = target[-1]
                if mistake == "shape":
                    if isinstance(coll, AllReduce):
                        ops[at] = (agree(s, coll.comm, 5),)
                    else:
                        ops[at] = cast(s, last, shape=(2, 4))
                elif mistake == "dtype" and isinstance(coll, Broadcast):
                    ops[at] = cast(s, last, dtype=DType.INT32)
                elif mistake == "src" and isinstance(coll, Broadcast):
                    others = [m for m in world.pipeline(world.dp_index(r)) if m != last]
                    ops[at] = cast(s, others[which % len(others)])
                elif mistake == "drop":
                    del ops[at]
                elif mistake == "swap" and len(ops) > 1:
                    ops[at], ops[at - 1] = ops[at - 1], ops[at]
            rank_steps.append(tuple(e for op in ops for e in op))
        program.append(rank_steps)
    return program


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    pp=st.integers(1, 3),
    dp=st.integers(1, 3),
    steps=st.integers(1, 3),
    mistake=st.sampled_from(MISTAKES),
    pick=st.integers(0, 100),
    which=st.integers(0, 5),
)
@example(pp=1, dp=2, steps=3, mistake="drop", pick=1, which=0)  # skipped mid-run
@example(pp=2, dp=2, steps=2, mistake="swap", pick=3, which=1)  # a cycle
@example(pp=3, dp=2, steps=2, mistake="src", pick=4, which=0)
def test_random_mistakes_in_random_worlds_are_reported_alike_by_both_tools(
    *, pp: int, dp: int, steps: int, mistake: str, pick: int, which: int
) -> None:
    world = Layout(pp=pp, dp=dp)
    rank, step = pick % world.world_size, pick % steps
    program = random_world_program(world, steps, mistake=mistake, rank=rank, step=step, which=which)
    correct = program == random_world_program(world, steps, mistake="none", rank=0, step=0, which=0)
    with TemporaryDirectory() as folder:
        sim, check = both(Path(folder), world, program)
    if correct:
        assert sim is None
        assert check.exit_code == (EXIT_OK if any(map(any, program)) else EXIT_FINDING), check.text
        return
    if sim is None:
        # Only a swap of two collectives can leave the run going (they may still meet).
        assert mistake == "swap"
        assert check.ok, check.text
        return
    finding = check.finding
    assert finding is not None, check.text
    if isinstance(sim, DeadlockReport) and isinstance(finding, MismatchReport):
        # A log that ends before an op is read as a rank that died there.
        assert finding.classification is MismatchClass.MISSING_RANK
        assert (finding.instance, finding.seq) in {(p.instance, p.seq) for p in sim.pending}
    else:
        assert finding == sim, (sim, check.text)
    if isinstance(sim, MismatchReport) and mistake in ("shape", "dtype", "src"):
        assert sim.step == step
        assert rank in (sim.rank, sim.peer)
        assert (
            sim.classification
            is {
                "shape": MismatchClass.SIZE,
                "dtype": MismatchClass.DTYPE,
                "src": MismatchClass.SOURCE,
            }[mistake]
        )
