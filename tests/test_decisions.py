"""Field failure 17: the ranks' noted decisions, compared across ranks.

`finish_agreement` notes what it decided from the reduced table (`NoteDecision`). The
decision is a function of the table, so the ranks that reduced one table decide alike,
and so do the stages of a replica, which are given one batch. A corrupted all-reduce on
one platform (vllm-ascend#10046) hands one rank a wrong sum in another rank's column:
that rank's own-column check passes, it decides another shape, and the ranks hang at
their next collective. The simulator and `purepp check` compare the notes and name the
rank that decided otherwise, on the table it decided from.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from purepp import dp
from purepp.cudagraph import CaptureMode, CudaGraphDispatcher, Dispatcher
from purepp.effects.checker import check_log_dir, check_logs
from purepp.effects.log import EffectLog, LogHeader, Recorder, dump_logs
from purepp.effects.logfile import load_log, log_file_name
from purepp.effects.matching import (
    CollectiveReportError,
    DecisionDivergenceReport,
    Decisions,
)
from purepp.effects.numpy_interpreter import NumpyInterpreter
from purepp.effects.scheduler import CollectiveHub
from purepp.effects.simulator import RankContext, simulate
from purepp.effects.torch_interpreter import TorchInterpreter, build_communicators
from purepp.effects.vocabulary import (
    AllReduce,
    BufferRef,
    Communicator,
    Effect,
    NoteDecision,
    Op,
)
from purepp.errors import InterpreterError, LogFormatError
from purepp.layout import Layout
from purepp.testing import CAPTURE_SIZES, simulate_schedule
from tests._dist import RankContext as ProcessContext
from tests._dist import run_ranks
from tests.test_field_failures import (
    LocalFact,
    first_divergence,
    local_steps,
    record_with,
    schedule_of,
)

DISPATCHER = CudaGraphDispatcher(
    capture_sizes=CAPTURE_SIZES, capture_mode=CaptureMode.FULL, max_num_reqs=8
)
# Each step's token count per replica: ranks decide FULL at the largest, padded.
TOKENS = ((2, 1, 2), (3, 3, 1), (1, 2, 2), (2, 2, 2))
CORRUPT_STEP = 2
# What the faulty all-reduce adds to another rank's token count in one rank's copy of
# the table: 2 + 5 = 7 tokens, so that rank pads every rank to 8 where the others pad to 2.
CORRUPTION = 5


def corrupt(table: npt.NDArray[Any], rank: int) -> npt.NDArray[Any]:
    """The fault: the sum handed to `rank` is wrong in another rank's token count (rank
    0's, or rank 1's for rank 0), a value its own-column check cannot see."""
    wrong = np.array(table, dtype=np.int32, copy=True)
    wrong[dp.ROW_NUM_TOKENS, 1 if rank == 0 else 0] += CORRUPTION
    return wrong


def agreements(
    context_rank: int, dp_size: int, table_of: Any, corrupt_on: set[tuple[int, int]]
) -> Iterator[tuple[Effect, ...]]:
    """One DP rank's agreements over `TOKENS`; `table_of(ref)` reads a reduced table,
    corrupted for the (rank, step) pairs in `corrupt_on`."""
    group = dp.AgreementGroup(dp_size=dp_size, dp_rank=context_rank)
    lanes = dp.AgreementLanes()
    for step, tokens in enumerate(TOKENS):
        batch = dp.RankBatch(num_reqs=tokens[context_rank], num_tokens=tokens[context_rank])
        started = dp.start_agreement(lanes, group, DISPATCHER, batch, step=step)
        yield started.effects
        assert started.result.table is not None
        table = table_of(started.result.table)
        if (context_rank, step) in corrupt_on:
            table = corrupt(table, context_rank)
        finished = dp.finish_agreement(started.state, started.result, table)
        yield finished.effects
        lanes = finished.state


def simulated_program(corrupt_on: set[tuple[int, int]]) -> Any:
    def program(context: RankContext) -> Iterator[tuple[Effect, ...]]:
        return agreements(
            context.rank, context.world.dp, context.interpreter.host_array, corrupt_on
        )

    return program


WORLD = Layout(pp=1, dp=3)


def assert_names_rank_1_at_the_corrupt_step(report: object) -> DecisionDivergenceReport:
    assert isinstance(report, DecisionDivergenceReport)
    assert (report.step, report.op, report.comm, report.lane) == (
        CORRUPT_STEP,
        Op.AGREE,
        Communicator.DP_CPU,
        "target",
    )
    assert report.table == f"dp.target.step{CORRUPT_STEP}.table"
    assert report.within_group
    majority, odd = report.decisions
    assert (majority.ranks, odd.ranks) == ((0, 2), (1,))
    assert majority.note.num_tokens_across_dp.tolist() == [2, 2, 2]
    assert odd.note.num_tokens_across_dp.tolist() == [8, 8, 8]
    assert report.differing == ("num_tokens_across_dp", "num_reqs")
    return report


# ---- the simulator ---------------------------------------------------------------------


def test_ff17_a_rank_handed_a_corrupt_sum_is_named_by_the_simulator() -> None:
    simulate(WORLD, simulated_program(set()))  # every rank decides alike

    with pytest.raises(CollectiveReportError) as caught:
        simulate(WORLD, simulated_program({(1, CORRUPT_STEP)}))

    report = assert_names_rank_1_at_the_corrupt_step(caught.value.report)
    text = report.render()
    assert text.startswith(
        f"Decision divergence: step {CORRUPT_STEP}, target lane (table"
        f" 'dp.target.step{CORRUPT_STEP}.table' reduced over dp_cpu, agree)"
    )
    assert "ranks 0, 2 decided cg_mode=FULL, num_ubatches=1, num_tokens_across_dp=[2, 2, 2]" in text
    assert "rank 1 decided cg_mode=FULL, num_ubatches=1, num_tokens_across_dp=[8, 8, 8]" in text
    assert "they differ in: num_tokens_across_dp, num_reqs" in text
    assert "the all-reduce gave them different sums" in text
    assert str(caught.value).startswith("simulate: Decision divergence")
    assert "faulty on this platform" in report.fix()


def test_ff17_the_divergence_is_found_when_the_odd_rank_notes_first_too() -> None:
    """Rank 0 is the one handed the corrupt sum: it notes first, so the others differ
    from it; the report still sides with the two that agree."""
    with pytest.raises(CollectiveReportError) as caught:
        simulate(WORLD, simulated_program({(0, CORRUPT_STEP)}))
    report = caught.value.report
    assert isinstance(report, DecisionDivergenceReport)
    assert [d.ranks for d in report.decisions] == [(1, 2), (0,)]


# ---- purepp check over recorded logs --------------------------------------------------------


def header(rank: int) -> LogHeader:
    return LogHeader(rank=rank, world=WORLD, config={"test": "ff17"})


def recorded_logs(corrupt_on: set[tuple[int, int]]) -> list[EffectLog]:
    """Every rank's log, recorded without performing: each reads the true sum of the
    ranks' contributions (computed here), but for the corrupt (rank, step)."""
    contributions: dict[int, list[npt.NDArray[np.int32]]] = {}
    for step, tokens in enumerate(TOKENS):
        for rank in range(WORLD.dp):
            group = dp.AgreementGroup(dp_size=WORLD.dp, dp_rank=rank)
            batch = dp.RankBatch(num_reqs=tokens[rank], num_tokens=tokens[rank])
            started = dp.start_agreement(dp.AgreementLanes(), group, DISPATCHER, batch, step=step)
            assert started.result.contribution is not None
            contributions.setdefault(step, []).append(started.result.contribution)

    def table_of(ref: BufferRef) -> npt.NDArray[np.int32]:
        step = int(ref.name.split(".step")[1].split(".")[0])
        total: npt.NDArray[np.int32] = np.sum(contributions[step], axis=0, dtype=np.int32)
        return total

    logs = []
    for rank in range(WORLD.dp):
        recorder = Recorder(header(rank))
        for effects in agreements(rank, WORLD.dp, table_of, corrupt_on):
            recorder.perform(effects)
        logs.append(recorder.log)
    return logs


def test_ff17_purepp_check_names_the_rank_that_decided_otherwise(tmp_path: Path) -> None:
    dump_logs(recorded_logs(set()), tmp_path / "correct")
    correct = check_logs(tmp_path / "correct")
    assert correct.exit_code == 0
    assert correct.text == (
        "ok: 3 ranks, 12 collectives over 4 steps, every communicator matches,"
        " every rank decided its 4 agreements alike"
    )

    dump_logs(recorded_logs({(1, CORRUPT_STEP)}), tmp_path / "broken")
    checked = check_logs(tmp_path / "broken")
    assert (checked.ok, checked.exit_code) == (False, 1)
    report = assert_names_rank_1_at_the_corrupt_step(checked.finding)
    assert checked.text == report.render()
    with pytest.raises(CollectiveReportError) as caught:
        simulate(WORLD, simulated_program({(1, CORRUPT_STEP)}))
    assert caught.value.report == report  # the checker and the simulator say the same


def test_a_divergence_held_for_a_rank_whose_log_ends_comes_with_what_each_waits_on(
    tmp_path: Path,
) -> None:
    """Rank 2's log ends before it noted the corrupt step: ranks 0 and 1 decided apart
    and then wait for it at the next all-reduce. The report names the divergence first,
    then what every rank was waiting on."""
    dump_logs(recorded_logs({(1, CORRUPT_STEP)}), tmp_path)
    path = tmp_path / log_file_name(2)
    lines = path.read_text().splitlines(keepends=True)
    # the header, three records a step, and the corrupt step's all-reduce
    path.write_text("".join(lines[: 1 + 3 * CORRUPT_STEP + 1]))
    checked = check_logs(tmp_path)
    assert checked.exit_code == 1
    report = checked.finding
    assert isinstance(report, DecisionDivergenceReport)
    assert (report.step, report.within_group) == (CORRUPT_STEP, True)
    assert [d.ranks for d in report.decisions] == [(0,), (1,)]
    text = checked.text
    assert report.render() in text
    assert text.index(report.render()) < text.index("What every rank was waiting on:")
    assert f"all_reduce [5, 3] int32 (step {CORRUPT_STEP + 1}, agree)" in text


# ---- real processes over gloo -----------------------------------------------------------------


def break_all_reduce(group: Any, rank: int, faulty_call: int) -> None:
    """From now on in this process, `group`'s all-reduce returns a wrong sum on its call
    number `faulty_call` (from 0): the real gloo all-reduce runs, then the fault corrupts
    its result, the symptom of the field report."""
    real = dist.ProcessGroup.allreduce
    calls = [0]

    def allreduce(self: Any, tensors: Any, *args: Any) -> Any:
        work = real(self, tensors, *args)
        if self is not group:
            return work
        assert work is not None  # gloo returns its work
        work.wait()
        if calls[0] == faulty_call:
            tensors[0].copy_(torch.from_numpy(corrupt(tensors[0].numpy(), rank)))
        calls[0] += 1
        return work

    dist.ProcessGroup.allreduce = allreduce  # type: ignore[method-assign,assignment]


def gloo_rank(log_dir: str, faulty_rank: int, ctx: ProcessContext) -> None:
    groups = build_communicators(
        pp_groups=WORLD.pp_groups,
        dp_groups=WORLD.dp_groups,
        relay_backend=ctx.backend,
        timeout=ctx.timeout,
    )
    if ctx.rank == faulty_rank:
        break_all_reduce(groups[Communicator.DP_CPU], ctx.rank, CORRUPT_STEP)
    interpreter = TorchInterpreter(device=ctx.device, groups=groups, rank=ctx.rank)
    path = Path(log_dir) / log_file_name(ctx.rank)
    recorder = Recorder(header(ctx.rank), interpreter, path=path)
    for effects in agreements(ctx.rank, WORLD.dp, interpreter.host_array, set()):
        recorder.perform(effects)


@pytest.mark.multiprocess
def test_ff17_a_faulty_gloo_all_reduce_on_one_rank_is_named_by_purepp_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_ranks(
        functools.partial(gloo_rank, str(tmp_path), 1),
        WORLD.world_size,
        timeout=datetime.timedelta(seconds=30),
        deadline_s=120.0,
    )
    logs = [load_log(tmp_path / log_file_name(rank)) for rank in range(WORLD.world_size)]
    assert all(isinstance(log.effects[-2], NoteDecision) for log in logs)
    assert check_log_dir(tmp_path) == 1
    out = capsys.readouterr().out
    assert f"Decision divergence: step {CORRUPT_STEP}, target lane" in out
    assert "rank 1 decided cg_mode=FULL, num_ubatches=1, num_tokens_across_dp=[8, 8, 8]" in out
    assert_names_rank_1_at_the_corrupt_step(check_logs(tmp_path).finding)


# ---- the stages of a replica: a dispatcher of a stage's own (field failure 7) ---------------


def more_capture_sizes_on(stage: int, world: Layout) -> LocalFact:
    """One stage captured graphs for every size up to 8: its mode matches the others'
    (so its column does), its padding does not."""

    def fact(
        rank: int, step: int, dispatcher: Dispatcher, batch: dp.RankBatch
    ) -> tuple[Dispatcher, dp.RankBatch]:
        if world.pp_stage(rank) != stage or not isinstance(dispatcher, CudaGraphDispatcher):
            return dispatcher, batch
        return attrs.evolve(dispatcher, capture_sizes=tuple(range(1, 9))), batch

    return fact


def test_ff7_stages_whose_dispatchers_pad_differently_are_named_though_their_columns_match(
    tmp_path: Path,
) -> None:
    schedule = schedule_of(pp=2, dp_size=2, spec=0)
    fact = more_capture_sizes_on(1, schedule.world)
    assert first_divergence(schedule, fact) is None  # no column shows it

    with pytest.raises(CollectiveReportError) as caught:
        simulate_schedule(schedule, steps_for=local_steps(fact))
    report = caught.value.report
    assert isinstance(report, DecisionDivergenceReport)
    assert not report.within_group
    assert report.differing[0] == "num_tokens_across_dp"
    # Each decision is one stage's: its DP group decided alike.
    stages = {tuple(schedule.world.pp_stage(r) for r in d.ranks) for d in report.decisions}
    assert stages == {(0, 0), (1, 1)}
    assert "the stages of a replica decided differently" in report.render()
    assert "the same dispatcher" in report.fix()

    # purepp check says the same of the recorded logs.
    record_with(schedule, fact, tmp_path)
    assert check_logs(tmp_path).finding == report


def test_stages_that_decided_differently_are_held_until_the_run_ends() -> None:
    """Each stage's DP group decided alike, the stages did not: held (a stage divergence
    of the columns, the likelier cause, may still be found), and raised at the end."""
    world = Layout(pp=2, dp=2)
    hub = CollectiveHub(world, call="check", move_data=False)
    for rank in range(4):
        hub.note(rank, note_of(world, rank, tokens=8 if world.pp_stage(rank) else 2))
    with pytest.raises(CollectiveReportError) as caught:
        hub.raise_held()
    report = caught.value.report
    assert isinstance(report, DecisionDivergenceReport)
    assert [d.ranks for d in report.decisions] == [(0, 2), (1, 3)]
    assert not report.within_group


# ---- the comparer itself -----------------------------------------------------------------------


def note_of(
    world: Layout,
    rank: int,
    *,
    tokens: int = 2,
    step: int = 0,
    comm: Communicator = Communicator.DP_CPU,
    table: str = "dp.target.step0.table",
    mode: str = "FULL",
) -> NoteDecision:
    return NoteDecision(
        step=step,
        op=Op.AGREE,
        table=BufferRef(table),
        comm=comm,
        cg_mode=mode,
        num_ubatches=1,
        num_tokens_across_dp=np.full(world.dp, tokens, dtype=np.int32),
        uniform_token_count=1,
        eager=False,
        num_reqs=tokens,
        max_query_len=None,
    )


def test_equal_notes_are_no_divergence_and_are_dropped_once_every_rank_noted() -> None:
    world = Layout(pp=2, dp=2)
    decisions = Decisions(world)
    for step in range(3):
        table = f"dp.target.step{step}.table"
        for rank in range(4):
            decisions.note(rank, note_of(world, rank, step=step, table=table))
            assert decisions.ready() is None
    assert decisions.held() == (None, None)
    assert decisions.alike == 3
    assert not decisions._notes  # every agreement complete: nothing kept


def test_a_pipeline_agreement_compares_only_its_own_pipeline() -> None:
    """Over PP_CPU each replica's stages reduce one table: replicas may decide apart."""
    world = Layout(pp=2, dp=2)
    decisions = Decisions(world)
    decisions.note(0, note_of(world, 0, comm=Communicator.PP_CPU))
    decisions.note(1, note_of(world, 1, comm=Communicator.PP_CPU))
    decisions.note(2, note_of(world, 2, comm=Communicator.PP_CPU, tokens=8))
    assert decisions.ready() is None  # replica 1's pipeline: another table
    decisions.note(3, note_of(world, 3, comm=Communicator.PP_CPU, mode="PIECEWISE"))
    report = decisions.ready()
    assert report is not None
    assert report.within_group
    assert [d.ranks for d in report.decisions] == [(2,), (3,)]
    assert report.differing == ("cg_mode", "num_tokens_across_dp", "num_reqs")
    assert decisions.alike == 1  # replica 0's pipeline


def test_the_target_and_drafter_lanes_and_other_steps_are_never_compared() -> None:
    world = Layout(pp=1, dp=2)
    decisions = Decisions(world)
    decisions.note(0, note_of(world, 0))
    drafter = note_of(
        world, 1, tokens=8, comm=Communicator.DP_DRAFTER_CPU, table="dp.drafter.step0.table"
    )
    decisions.note(1, drafter)
    decisions.note(1, note_of(world, 1, tokens=8, step=1, table="dp.target.step1.table"))
    assert decisions.ready() is None
    assert decisions.held() == (None, None)


def test_the_hub_raises_a_divergence_within_a_group_once_the_group_noted_it() -> None:
    world = Layout(pp=1, dp=3)
    hub = CollectiveHub(world, call="check", move_data=False)
    hub.note(0, note_of(world, 0))
    hub.note(1, note_of(world, 1, tokens=4))  # rank 2 has not noted: which side is odd?
    with pytest.raises(CollectiveReportError) as caught:
        hub.note(2, note_of(world, 2))
    assert str(caught.value).startswith("check: Decision divergence: step 0, target lane")
    report = caught.value.report
    assert isinstance(report, DecisionDivergenceReport)
    assert [d.ranks for d in report.decisions] == [(0, 2), (1,)]


def test_a_later_divergence_waits_for_an_earlier_agreement_still_incomplete() -> None:
    """The first divergence by step is reported, whichever completes first."""
    world = Layout(pp=1, dp=2)
    hub = CollectiveHub(world, call="check", move_data=False)
    later = "dp.target.step1.table"
    hub.note(0, note_of(world, 0))  # step 0: rank 1 has not noted yet
    hub.note(0, note_of(world, 0, step=1, table=later))
    hub.note(1, note_of(world, 1, step=1, table=later, tokens=8))  # step 1 complete, apart
    with pytest.raises(CollectiveReportError) as caught:
        hub.note(1, note_of(world, 1, tokens=4))  # step 0 complete, apart too
    report = caught.value.report
    assert isinstance(report, DecisionDivergenceReport)
    assert report.step == 0


@settings(max_examples=60, deadline=None)
@given(
    dp_size=st.integers(2, 4),
    corrupt_on=st.sets(st.tuples(st.integers(0, 3), st.integers(0, 3)), max_size=3),
)
def test_ff17_a_report_appears_iff_some_rank_decided_from_a_different_sum(
    dp_size: int, corrupt_on: set[tuple[int, int]]
) -> None:
    """Random faults: the simulator reports the first step at which the ranks' decisions
    differ (the oracle: each rank's decision from the table it was handed), and nothing
    when the faults changed no decision."""
    world = Layout(pp=1, dp=dp_size)
    tokens = [row[:dp_size] + (1,) * (dp_size - len(row)) for row in TOKENS]
    corrupt_on = {(r, s) for r, s in corrupt_on if r < dp_size}

    def decisions_at(step: int) -> set[tuple[int, ...]]:
        group_tables = []
        for rank in range(dp_size):
            group = dp.AgreementGroup(dp_size=dp_size, dp_rank=rank)
            batch = dp.RankBatch(num_reqs=tokens[step][rank], num_tokens=tokens[step][rank])
            group_tables.append(
                dp.start_agreement(dp.AgreementLanes(), group, DISPATCHER, batch, step=step)
            )
        columns = [s.result.contribution for s in group_tables]
        total: npt.NDArray[np.int32] = np.sum(columns, axis=0, dtype=np.int32)  # type: ignore[arg-type]
        decided = set()
        for rank, started in enumerate(group_tables):
            table = corrupt(total, rank) if (rank, step) in corrupt_on else total
            outcome = dp.finish_agreement(started.state, started.result, table).result
            assert outcome.sync is not None
            decided.add(tuple(outcome.sync.num_tokens_across_dp.tolist()))
        return decided

    diverged = [step for step in range(len(TOKENS)) if len(decisions_at(step)) > 1]

    def program(context: RankContext) -> Iterator[tuple[Effect, ...]]:
        group = dp.AgreementGroup(dp_size=dp_size, dp_rank=context.rank)
        lanes = dp.AgreementLanes()
        for step in range(len(TOKENS)):
            n = tokens[step][context.rank]
            started = dp.start_agreement(
                lanes, group, DISPATCHER, dp.RankBatch(num_reqs=n, num_tokens=n), step=step
            )
            yield started.effects
            assert started.result.table is not None
            table = context.interpreter.host_array(started.result.table)
            if (context.rank, step) in corrupt_on:
                table = corrupt(table, context.rank)
            finished = dp.finish_agreement(started.state, started.result, table)
            yield finished.effects
            lanes = finished.state

    if not diverged:
        simulate(world, program)
        return
    with pytest.raises(CollectiveReportError) as caught:
        simulate(world, program)
    report = caught.value.report
    assert isinstance(report, DecisionDivergenceReport)
    assert report.step == diverged[0]
    assert report.within_group


# ---- interpreters and the log ---------------------------------------------------------------


def test_a_note_of_a_table_that_is_not_bound_is_refused_by_every_interpreter() -> None:
    world = Layout(pp=1, dp=1)
    note = note_of(world, 0, table="never.reduced")
    with pytest.raises(InterpreterError, match=r"never\.reduced"):
        NumpyInterpreter(rank=0).perform((note,))
    for mode in ("eager", "checked"):
        interpreter = TorchInterpreter(
            device=torch.device("cpu"), groups={}, rank=0, checked=mode == "checked"
        )
        with pytest.raises(InterpreterError, match=r"never\.reduced"):
            interpreter.perform((note,))


def test_a_note_changes_nothing_an_interpreter_holds() -> None:
    world = Layout(pp=1, dp=1)
    interpreter = NumpyInterpreter(rank=0)
    table = BufferRef("dp.target.step0.table")
    reduce = AllReduce(
        step=0,
        op=Op.AGREE,
        contribution=np.ones((5, 1), dtype=np.int32),
        result=table,
        comm=Communicator.DP_CPU,
        work=None,
    )
    interpreter.perform((reduce,))
    before = interpreter.host_array(table).tolist()
    interpreter.perform((note_of(world, 0, table=table.name),))
    assert interpreter.host_array(table).tolist() == before
    assert set(interpreter.bound_refs()) == {table}


def test_a_note_of_an_unknown_mode_is_refused_built_or_read_from_a_log(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cg_mode"):
        note_of(Layout(pp=1, dp=1), 0, mode="SOMETIMES")
    logs = recorded_logs(set())
    dump_logs(logs, tmp_path)
    path = tmp_path / log_file_name(0)
    text = path.read_text()
    assert '"cg_mode": "FULL"' in text
    path.write_text(text.replace('"cg_mode": "FULL"', '"cg_mode": "SOMETIMES"', 1))
    with pytest.raises(LogFormatError, match="cg_mode"):
        load_log(path)
    assert load_log(tmp_path / log_file_name(1)) == logs[1]
