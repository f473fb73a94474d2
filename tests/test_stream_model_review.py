"""Review of the stream model's three gaps (d88a5c8, df70504, 613a6c2): what is still wrong.

Each test states the correct behaviour and fails on the code it was written against;
its docstring says what is wrong, what is correct, and where the cause lies.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from purepp.effects.checker import EXIT_UNUSABLE, check_logs
from purepp.effects.log import LogHeader, Recorder, dump_logs
from purepp.effects.matching import CollectiveReportError, DeadlockReport, RingOverrunReport
from purepp.effects.simulator import RankContext, simulate
from purepp.effects.vocabulary import (
    Allocate,
    AllReduce,
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
from tests.test_streams_review2 import wire

Program = list[list[tuple[Effect, ...]]]  # per rank, its effect batches in order

PAIR = Layout(pp=2, dp=1)  # one pipeline of two stages: rank 1 is the last (the sender)


def agree(step: int, comm: Communicator = Communicator.PP_CPU) -> AllReduce:
    """A synchronous all-reduce of a zero 2 x 2 table over `comm` (a gloo group)."""
    return AllReduce(
        step=step,
        op=Op.AGREE,
        contribution=np.zeros((2, 2), dtype=np.int32),
        result=BufferRef(f"{comm.value}.{step}"),
        comm=comm,
        work=None,
    )


def marker(step: int) -> Allocate:
    """A main-stream allocation: an effect of `step` that waits for nothing."""
    return Allocate(
        step=step,
        op=Op.CONSUME,
        buffer=BufferRef(f"marker.{step}"),
        shape=(1,),
        dtype=DType.INT64,
        stream=Stream.MAIN,
    )


def write_logs(directory: Path, world: Layout, program: Program, *, backend: object) -> Path:
    """Every rank's log of `program`, under a header whose config names `backend`."""
    recorders = [
        Recorder(LogHeader(rank=rank, world=world, config={"backend": backend}))
        for rank in range(world.world_size)
    ]
    for recorder, batches in zip(recorders, program, strict=True):
        for batch in batches:
            recorder.perform(batch)
    dump_logs([recorder.log for recorder in recorders], directory)
    return directory


# -- ring overrun: lost when the rest of the consume's tuple is held back ----------------------

RECEIVED = EventRef("received.0")


def outrunning_receiver(*, split: bool) -> Iterator[tuple[Effect, ...]]:
    """Rank 0 receives step 0's entry, then consumes it at step 2 (a ring two steps deep)
    and goes on to step 3: in one tuple, or in one tuple per step (`split`)."""
    effects: tuple[Effect, ...] = (
        *wire(0, 1),
        RecordEvent(step=0, op=Op.RECEIVE, stream=Stream.RELAY, event=RECEIVED),
        marker(1),
        WaitEvent(step=2, op=Op.CONSUME, stream=Stream.MAIN, event=RECEIVED),
        marker(3),
    )
    if split:
        yield effects[:3]
        yield effects[3:4]
        yield effects[4:5]
        yield effects[5:]
    else:
        yield effects


def ring_overrun_run(*, split: bool) -> None:
    """Three steps in flight over a ring two deep: rank 1 sends step 0 only when it runs."""

    def run(context: RankContext) -> Iterator[tuple[Effect, ...]]:
        if context.rank == 0:
            yield from outrunning_receiver(split=split)
        else:
            context.interpreter.bind(BufferRef("wire.0"), np.array([1, 2, 3], dtype=np.int64))
            yield (wire(0, 1)[1],)

    simulate(PAIR, run, max_steps_in_flight=3)


def test_a_ring_overrun_is_found_when_the_rest_of_the_consumes_tuple_is_held_back() -> None:
    """Rank 0 waits at step 2 on step 0's entry, which rank 1 has not broadcast yet (three
    steps in flight, a ring two deep): a ring overrun, and the simulator reports it when
    the program yields a tuple per step. Yielded as one tuple, the same effects pass: the
    host now runs past the main-stream wait (gap 5), reaches step 3, which is held back
    (rank 1 is still at step 0), and `_advance` returns there without looking at the
    main stream's wait (simulator.py, `_advance`: the held-back `return progressed`
    skips `_check_overrun`, which runs only when the host blocks or at a yield boundary).
    Rank 1 then broadcasts and the overrun is gone. At 892e224 both forms were reported
    (the host blocked at the wait). Correct: the overrun is reported however the
    program groups its effects into tuples."""
    with pytest.raises(CollectiveReportError) as split:
        ring_overrun_run(split=True)
    assert isinstance(split.value.report, RingOverrunReport)
    with pytest.raises(CollectiveReportError) as whole:
        ring_overrun_run(split=False)
    report = whole.value.report
    assert isinstance(report, RingOverrunReport)
    assert (report.rank, report.step, report.event) == (0, 2, RECEIVED)


# -- the checker's "at step" line calls a rank with a stuck main stream finished --------------

GRID = Layout(pp=2, dp=2)  # pipelines (0, 1) and (2, 3)


def stuck_main_after_the_log_ends() -> Program:
    """Ranks 0 and 1 deadlock (rank 1's host synchronises on a broadcast rank 0 posts only
    after the PP_CPU all-reduce rank 1 has not reached). Rank 2's log ends with its main
    stream waiting for a broadcast rank 3 never sends."""
    event = EventRef("received.0")
    sync = Synchronize(step=0, op=Op.RECEIVE, stream=Stream.RELAY)
    return [
        [(agree(0), *wire(0, 1))],
        [(*wire(0, 1), sync, agree(0))],
        [
            (
                *wire(0, 3),
                RecordEvent(step=0, op=Op.RECEIVE, stream=Stream.RELAY, event=event),
                WaitEvent(step=0, op=Op.CONSUME, stream=Stream.MAIN, event=event),
            )
        ],
        [(marker(0),)],
    ]


def test_the_checker_gives_the_step_of_a_rank_whose_log_ended_on_a_stuck_main_stream(
    tmp_path: Path,
) -> None:
    """Rank 2's log has ended but its main stream is still stuck at step 0: both tools
    leave it out of 'finished their program', and the simulator's 'at step' line says
    'rank 2: 0'. The checker's says 'rank 2: finished', contradicting its own report:
    `_Check._at_step` (checker.py) asks only whether the host is blocked or the rank is
    between steps (which needs a next record), not whether the main stream is stuck
    (gap 5 moved the main stream's waits off the host). Correct: the checker's at_steps
    give rank 2 step 0, as the simulator's do."""
    program = stuck_main_after_the_log_ends()

    def run(context: RankContext) -> Iterator[tuple[Effect, ...]]:
        yield from program[context.rank]

    with pytest.raises(CollectiveReportError) as simulated:
        simulate(GRID, run)
    sim = simulated.value.report
    assert isinstance(sim, DeadlockReport)
    assert 2 not in sim.finished
    assert sim.at_steps[2] == 0

    report = check_logs(write_logs(tmp_path, GRID, program, backend="nccl"))
    found = report.finding
    assert isinstance(found, DeadlockReport), report.text
    assert 2 not in found.finished
    assert found.at_steps == sim.at_steps, report.text
    assert "rank 2: finished" not in report.text


# -- report text -------------------------------------------------------------------------------


def test_an_unknown_backend_in_the_logs_header_gets_a_fix_purepp_check_can_follow(
    tmp_path: Path,
) -> None:
    """`purepp check` on logs whose header config names an unknown backend says (exit 2)
    'Fix: pass 'nccl' (...) or 'gloo' (...)': `check_backend`'s fix for a caller's
    argument (vocabulary.py), reused by the checker (checker.py, `_Check._replay`). But
    `purepp check` takes only a folder: there is nothing to pass. Correct: the fix says
    what the user can do with logs (record them again with `purepp run --backend nccl`
    or `--backend gloo`, or the header names a backend this purepp does not know)."""
    program: Program = [[(marker(0),)], [(marker(0),)]]
    report = check_logs(write_logs(tmp_path, PAIR, program, backend="mpi"))
    assert report.exit_code == EXIT_UNUSABLE, report.text
    assert "'mpi'" in report.text
    fix = report.text.split("Fix: ", 1)[1]
    assert not fix.startswith("pass "), report.text
    assert "purepp run" in fix


def test_a_deadlock_that_only_gloo_has_is_not_blamed_on_nccl() -> None:
    """A broadcast and a CPU all-reduce taken in crossed orders hang on gloo and complete
    on NCCL (tests/test_stream_model_gaps.py). The simulator's gloo report ends with
    'Fix: ... (NCCL asks for one issue order across communicators)'
    (`DeadlockReport.fix`, matching.py), naming a backend the run does not use and on
    which this program completes. Correct: a gloo deadlock's fix does not name NCCL as
    the reason (gloo's blocking broadcast is)."""
    crossed: Program = [[(*wire(0, 0), agree(0))], [(agree(0), *wire(0, 0))]]

    def run(context: RankContext) -> Iterator[tuple[Effect, ...]]:
        yield from crossed[context.rank]

    with pytest.raises(CollectiveReportError) as raised:
        simulate(PAIR, run, backend="gloo")
    report = raised.value.report
    assert isinstance(report, DeadlockReport)
    assert report.cycle is not None
    assert "NCCL" not in report.fix(), report.fix()
