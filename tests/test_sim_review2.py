"""Review of the simulator, the log checker and collective matching (second pass).

Hand-written rank programs, run by `simulate` and, recorded rank by rank through a
`Recorder` with no inner interpreter, by `check_logs`. The tests that fail on the code
they were written against state the correct behaviour and why in their docstrings.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from tempfile import TemporaryDirectory

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from purepp.effects.checker import CheckReport, check_logs
from purepp.effects.log import LogHeader, Recorder, dump_logs
from purepp.effects.matching import (
    CollectiveReportError,
    DecisionDivergenceReport,
    Report,
    match_collectives,
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
    NoteDecision,
    Op,
    RecordEvent,
    Release,
    Stream,
    WaitEvent,
    WaitWork,
    WorkRef,
)
from purepp.errors import PureppError
from purepp.layout import Layout
from purepp.testing import assert_effect_sequence

Program = list[list[tuple[Effect, ...]]]  # per rank, its effect tuples in order

TABLE = BufferRef("dp.target.step0.table")


# -- helpers -----------------------------------------------------------------------------


def agree(
    step: int, dp: int, *, work: str | None = None, comm: Communicator = Communicator.DP_CPU
) -> AllReduce:
    """An all-reduce of a zero 5 x `dp` table, asynchronous when `work` names a handle."""
    return AllReduce(
        step=step,
        op=Op.AGREE,
        contribution=np.zeros((5, dp), dtype=np.int32),
        result=BufferRef(f"dp.target.step{step}.table"),
        comm=comm,
        work=None if work is None else WorkRef(work),
    )


def relay(step: int, src: int, *, stream: Stream = Stream.MAIN) -> tuple[Allocate, Broadcast]:
    buffer = BufferRef(f"wire.{step}")
    return (
        Allocate(
            step=step, op=Op.RECEIVE, buffer=buffer, shape=(2, 3), dtype=DType.INT64, stream=stream
        ),
        Broadcast(
            step=step,
            op=Op.RECEIVE,
            buffer=buffer,
            shape=(2, 3),
            dtype=DType.INT64,
            src=src,
            comm=Communicator.PP_RELAY,
            stream=stream,
        ),
    )


def note(mode: str, *, dp: int = 1) -> NoteDecision:
    """Step 0's target decision: `mode`, two requests, two tokens on every replica."""
    return NoteDecision(
        step=0,
        op=Op.AGREE,
        table=TABLE,
        comm=Communicator.DP_CPU,
        cg_mode=mode,
        num_ubatches=1,
        num_tokens_across_dp=np.full(dp, 2, dtype=np.int32),
        uniform_token_count=None,
        eager=mode == "NONE",
        num_reqs=2,
        max_query_len=None,
    )


def simulated(world: Layout, program: Program, *, in_flight: int | None = None) -> Report | None:
    """The simulator's report on `program`, None when every rank runs to its end."""

    def run(context: RankContext) -> Iterator[tuple[Effect, ...]]:
        yield from program[context.rank]

    try:
        simulate(world, run, max_steps_in_flight=in_flight)
    except CollectiveReportError as error:
        return error.report
    return None


def checked(
    directory: Path, world: Layout, program: Program, *, in_flight: int | None = None
) -> CheckReport:
    """`purepp check` over the logs a `Recorder` (no inner interpreter) per rank writes."""
    recorders = [
        Recorder(LogHeader(rank=rank, world=world, config={"model": "review2"}))
        for rank in range(world.world_size)
    ]
    for recorder, steps in zip(recorders, program, strict=True):
        for batch in steps:
            recorder.perform(batch)
    dump_logs([recorder.log for recorder in recorders], directory)
    return check_logs(directory, max_steps_in_flight=in_flight)


def overlapped(world: Layout, steps: int, *, ring: int, stream: Stream) -> Program:
    """Every rank agrees each step over dp_cpu, the next step's agreement started early
    (asynchronously, inside this step, as `purepp.rank.start_next_agreement` does) and
    settled at the next step's start; with pp > 1 every stage relays each step from the
    last stage on `stream`, and the other stages consume each entry `ring` steps later."""
    program: Program = []
    for rank in range(world.world_size):
        last = world.pipeline(world.dp_index(rank))[-1]
        per_step: list[tuple[Effect, ...]] = []
        for step in range(steps):
            effects: list[Effect] = []
            if step == 0:
                effects.append(agree(0, world.dp))
            else:
                effects.append(WaitWork(step=step, op=Op.AGREE, work=WorkRef(f"w.{step}")))
            ahead = [agree(step + 1, world.dp, work=f"w.{step + 1}")] if step + 1 < steps else []
            if world.pp == 1:
                effects += ahead
            else:
                if rank != last and step >= ring:
                    effects.append(
                        WaitEvent(
                            step=step,
                            op=Op.CONSUME,
                            stream=Stream.MAIN,
                            event=EventRef(f"e.{step - ring}"),
                        )
                    )
                allocate, broadcast = relay(step, last, stream=stream)
                effects += [allocate, *ahead, broadcast]
                if rank != last:
                    effects.append(
                        RecordEvent(
                            step=step, op=Op.RECEIVE, stream=stream, event=EventRef(f"e.{step}")
                        )
                    )
            per_step.append(tuple(effects))
        program.append(per_step)
    return program


def flat(program: Program) -> dict[int, list[Effect]]:
    return {rank: [e for batch in steps for e in batch] for rank, steps in enumerate(program)}


# -- the next step's agreement started early: the checker and the steps in flight ---------


def test_the_checker_lets_the_next_steps_async_agreement_start_early_as_the_simulator_does(
    tmp_path: Path,
) -> None:
    """The simulator never holds back the next step's asynchronous all-reduce started
    inside this step (simulator docstring: "It starts no step: it is never held back";
    README "Simulate": "the next step's asynchronous all-reduce is the one effect that may
    come before the rest of its step"), and `check_logs` replays "through the simulator's
    matching scheduler" with `max_steps_in_flight` "as `simulate`". Yet the checker's
    `_advance` (purepp/effects/checker.py) applies the steps-in-flight bound to every
    record by its step, the early all-reduce included: with one step in flight, stage 0
    is held back at its early step-1 all-reduce (stage 1's next record is of step 0)
    while stage 1 waits in step 0 for stage 0 to post the broadcast that comes after
    that all-reduce in stage 0's log. The log of a run that completes (two stages, each
    its own DP group, alike programs) is reported as a deadlock. The checker should
    exempt such an all-reduce (asynchronous, of a step above the last non-early
    record's) from the bound, as the simulator's `_Rank.ahead` does."""
    world = Layout(pp=2, dp=1)
    allocate, broadcast = relay(0, 1)
    stage: list[tuple[Effect, ...]] = [
        (
            agree(0, 1),
            allocate,
            agree(1, 1, work="w.1"),  # the next step's agreement, started in this step
            broadcast,
            Release(step=0, op=Op.RECEIVE, buffer=BufferRef("wire.0")),
        ),
        (WaitWork(step=1, op=Op.AGREE, work=WorkRef("w.1")),),
    ]
    program = [stage, stage]
    assert simulated(world, program, in_flight=1) is None
    report = checked(tmp_path, world, program, in_flight=1)
    assert report.ok, report.text


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    pp=st.integers(1, 3),
    dp=st.integers(1, 2),
    steps=st.integers(1, 4),
    stream=st.sampled_from([Stream.MAIN, Stream.RELAY]),
)
def test_an_overlapped_agreement_with_a_ring_as_deep_as_the_pipeline_passes_every_tool(
    *, pp: int, dp: int, steps: int, stream: Stream
) -> None:
    """At the default steps in flight (pp), a program whose next agreement starts early
    and whose ring is pp deep runs to its end in the simulator, deterministically (two
    runs issue the same effects, each rank exactly what it yielded), every collective
    matches, and `purepp check` over its logs says ok."""
    world = Layout(pp=pp, dp=dp)
    program = overlapped(world, steps, ring=pp, stream=stream)

    def run(context: RankContext) -> Iterator[tuple[Effect, ...]]:
        yield from program[context.rank]

    first = simulate(world, run)
    second = simulate(world, run)
    assert first.effects == second.effects
    assert {rank: list(effects) for rank, effects in enumerate(first.effects)} == flat(program)
    assert match_collectives(flat(program), world) is None
    with TemporaryDirectory() as folder:
        report = checked(Path(folder), world, program)
    assert report.ok, report.text


# -- noted decisions: one rank's note is not another's ---------------------------------------


def duplicate_note_program() -> Program:
    """Two stages of one replica (each its own DP group) reduce equal tables; stage 0
    notes FULL twice, stage 1 notes NONE once."""
    return [
        [(agree(0, 1), note("FULL"), note("FULL"))],
        [(agree(0, 1), note("NONE"))],
    ]


def test_a_stage_noting_its_decision_twice_does_not_hide_another_stage_deciding_apart() -> None:
    """The stages of one replica decided FULL and NONE for one agreement: they run
    different graphs and their activations never meet (field failure 7; matching.py
    `Decisions`: a DP lane's agreement must be decided alike by every rank of the world).
    Once stage 0 notes its decision twice, the simulator reports nothing, because
    `Decisions.note` counts notes, not ranks: stage 0's two notes fill the two-rank scope,
    the agreement is closed as decided alike, and stage 1's note opens a fresh entry
    that never completes. A second note by one rank must not stand for another rank:
    count distinct ranks (and refuse, or report, a rank that notes one agreement twice)."""
    world = Layout(pp=2, dp=1)
    report = simulated(world, duplicate_note_program())
    assert isinstance(report, DecisionDivergenceReport), report
    assert [d.ranks for d in report.decisions] in ([(0,), (1,)], [(1,), (0,)])
    assert report.differing[0] == "cg_mode"


def test_the_checker_does_not_claim_a_decision_a_rank_never_noted(tmp_path: Path) -> None:
    """`purepp check` says "every rank decided its N agreement(s) alike" (checker.py
    `_completed`, from `Decisions.alike`: "agreements every rank that must has noted,
    every note alike"). Rank 1 never noted step 0's agreement, rank 0 noted it twice:
    the summary must not count it as decided alike by every rank (the same note-count
    in `Decisions.note` closes the agreement on rank 0's two notes)."""
    world = Layout(pp=2, dp=1)
    program: Program = [
        [(agree(0, 1), note("FULL"), note("FULL"))],
        [(agree(0, 1),)],
    ]
    report = checked(tmp_path, world, program)
    assert "decided its 1 agreement alike" not in report.text, report.text


# -- typed errors at the matching boundary ---------------------------------------------------


@pytest.mark.parametrize(
    ("per_rank", "world"),
    [
        ({0: [], 1: []}, "pp=1, dp=2"),
        ([[], []], Layout(pp=1, dp=2)),
        ({0: 5, 1: []}, Layout(pp=1, dp=2)),
    ],
    ids=["world-not-a-layout", "per-rank-a-list", "a-rank-s-effects-not-a-sequence"],
)
def test_match_collectives_refuses_garbage_with_a_typed_error(
    per_rank: object, world: object
) -> None:
    """`match_collectives` is public (matching.__all__) and documents its inputs: a
    mapping of every rank to its effects, and a `Layout`. DESIGN contract 9: bad input
    raises a `PureppError` naming the call, the value and the fix (as `simulate` does
    for a world that is not a Layout: ConfigError). Today a world that is not a Layout
    escapes as AttributeError, a list of sequences as TypeError (unhashable), and a
    rank's non-iterable effects as TypeError."""
    with pytest.raises(PureppError, match="match_collectives"):
        match_collectives(per_rank, world)  # type: ignore[arg-type]


def test_assert_effect_sequence_refuses_an_expected_item_of_no_known_kind() -> None:
    """`assert_effect_sequence` takes expected items that are effects, effect classes or
    predicates (its docstring). A string (say the kind's name, "release") is none of
    those: DESIGN contract 9 asks for a typed error naming the call and the item, not
    the raw TypeError ("'str' object is not callable") `_matches` lets escape."""
    effect = Release(step=0, op=Op.RECEIVE, buffer=BufferRef("x"))
    expected: Sequence[object] = ("release",)
    with pytest.raises(PureppError, match="assert_effect_sequence"):
        assert_effect_sequence((effect,), expected)  # type: ignore[arg-type]
