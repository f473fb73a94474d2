"""Review of `NoteDecision`: the ranks' noted decisions, compared by the simulator and the
checker (field failures 17 and 7), probed from the contract, the docstrings and the README.
"""

from __future__ import annotations

import copy
import datetime
import functools
import pickle
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from purepp import dp
from purepp.cudagraph import CaptureMode, CudaGraphDispatcher
from purepp.effects.checker import check_logs
from purepp.effects.log import LogHeader, Recorder, dump_logs
from purepp.effects.logfile import LogStream, load_log, log_file_name
from purepp.effects.matching import (
    CollectiveReportError,
    DecisionDivergenceReport,
    Report,
    comm_group,
)
from purepp.effects.numpy_interpreter import describe_effect
from purepp.effects.scheduler import LOCAL_KINDS, CollectiveHub
from purepp.effects.simulator import RankContext, simulate
from purepp.effects.torch_interpreter import TorchInterpreter, build_communicators
from purepp.effects.vocabulary import (
    BufferRef,
    Communicator,
    Effect,
    NoteDecision,
    Op,
    Release,
)
from purepp.errors import InterpreterError
from purepp.layout import Layout
from purepp.testing import CAPTURE_SIZES
from tests._dist import RankContext as ProcessContext
from tests._dist import run_ranks

DISPATCHER = CudaGraphDispatcher(
    capture_sizes=CAPTURE_SIZES, capture_mode=CaptureMode.FULL, max_num_reqs=8
)
TOKENS = ((2, 1, 2), (3, 3, 1), (1, 2, 2), (2, 2, 2))
Table = npt.NDArray[np.int32]
TableOf = Callable[[int, int, BufferRef], Table]
Program = Callable[[int, TableOf], Iterator[tuple[Effect, ...]]]


class Scenario:
    """Every rank's agreements over one lane and communicator, step after step."""

    def __init__(
        self,
        world: Layout,
        *,
        comm: Communicator = Communicator.DP_CPU,
        lane: dp.Lane = dp.Lane.TARGET,
        asynchronous: bool = False,
        tokens: tuple[tuple[int, ...], ...] = TOKENS,
        dead: frozenset[int] = frozenset(),
    ) -> None:
        self.world, self.comm, self.lane = world, comm, lane
        self.asynchronous, self.tokens, self.dead = asynchronous, tokens, dead

    def member(self, rank: int) -> int:
        if self.comm is Communicator.PP_CPU:
            return self.world.pp_stage(rank)
        return self.world.dp_index(rank)

    def group(self, rank: int) -> dp.AgreementGroup:
        if self.comm is Communicator.PP_CPU:
            size = self.world.pp
            group = dp.AgreementGroup(dp_size=size, dp_rank=self.member(rank), comm=self.comm)
        else:
            group = dp.AgreementGroup(dp_size=self.world.dp, dp_rank=self.member(rank))
        if self.member(rank) in self.dead or not self.dead:
            return group
        return group.mark_dead(*self.dead)

    def tokens_of(self, rank: int, step: int) -> int:
        # Replicas of a PP_CPU world schedule different counts: they decide apart.
        extra = self.world.dp_index(rank) if self.comm is Communicator.PP_CPU else 0
        return self.tokens[step][self.member(rank)] + extra

    def start(self, lanes: dp.AgreementLanes, rank: int, step: int) -> dp.AgreementStarted:
        n = self.tokens_of(rank, step)
        return dp.start_agreement(
            lanes,
            self.group(rank),
            DISPATCHER,
            dp.RankBatch(num_reqs=n, num_tokens=n),
            step=step,
            lane=self.lane,
            asynchronous=self.asynchronous,
        )

    def true_table(self, rank: int, step: int) -> Table:
        comm = self.group(rank).comm_of(self.lane)
        columns = []
        for peer in comm_group(self.world, rank, comm):
            contribution = self.start(dp.AgreementLanes(), peer, step).result.contribution
            assert contribution is not None
            columns.append(contribution)
        total: Table = np.sum(columns, axis=0, dtype=np.int32)
        return total

    def program(
        self,
        *,
        corrupt_on: frozenset[tuple[int, int]] = frozenset(),
        column: Callable[[int], int] = lambda member: 1 if member == 0 else 0,
        never_notes: frozenset[int] = frozenset(),
    ) -> Program:
        """Each rank's agreements; on the (rank, step) pairs of `corrupt_on` the sum handed
        to the rank is 5 tokens too many in `column(member)`. A rank of `never_notes` posts
        its all-reduces and never finishes one (it died with its column in flight)."""

        def agreements(rank: int, table_of: TableOf) -> Iterator[tuple[Effect, ...]]:
            lanes = dp.AgreementLanes()
            for step in range(len(self.tokens)):
                started = self.start(
                    lanes if rank not in never_notes else dp.AgreementLanes(), rank, step
                )
                yield started.effects
                if rank in never_notes:
                    continue
                waited = dp.wait_for_agreement(started.result)
                if waited.effects:
                    yield waited.effects
                assert started.result.table is not None
                table = table_of(rank, step, started.result.table)
                if (rank, step) in corrupt_on:
                    table = np.array(table, dtype=np.int32, copy=True)
                    table[dp.ROW_NUM_TOKENS, column(self.member(rank))] += 5
                finished = dp.finish_agreement(started.state, waited.state, table)
                yield finished.effects
                lanes = finished.state

        return agreements

    def simulated(self, program: Program) -> Report | None:
        def run(context: RankContext) -> Iterator[tuple[Effect, ...]]:
            host_array = context.interpreter.host_array
            return program(context.rank, lambda rank, step, ref: host_array(ref))

        try:
            simulate(self.world, run)
        except CollectiveReportError as error:
            return error.report
        return None

    def checked(self, program: Program, directory: Path) -> Report | None:
        """`purepp check` of the logs recorded without performing (tables summed here)."""
        logs = []
        for rank in range(self.world.world_size):
            recorder = Recorder(LogHeader(rank=rank, world=self.world, config={"t": "review"}))
            for effects in program(rank, lambda r, step, ref: self.true_table(r, step)):
                recorder.perform(effects)
            logs.append(recorder.log)
        dump_logs(logs, directory)
        report = check_logs(directory)
        if report.finding is None:
            assert report.exit_code == 0, report.text
        else:
            assert report.exit_code == 1
            assert report.text.endswith(report.finding.render())
        return report.finding


def divergence(report: Report | None) -> DecisionDivergenceReport:
    assert isinstance(report, DecisionDivergenceReport), report
    return report


def note_of(
    world: Layout, *, step: int = 0, tokens: int = 2, table: str | None = None
) -> NoteDecision:
    return NoteDecision(
        step=step,
        op=Op.AGREE,
        table=BufferRef(table or f"dp.target.step{step}.table"),
        comm=Communicator.DP_CPU,
        cg_mode="FULL",
        num_ubatches=1,
        num_tokens_across_dp=np.full(world.dp, tokens, dtype=np.int32),
        uniform_token_count=None,
        eager=False,
        num_reqs=tokens,
        max_query_len=None,
    )


# ---- the simulator and the checker, lane by lane ---------------------------------------------


def test_a_drafter_lane_async_divergence_is_named_alike_by_the_simulator_and_the_checker(
    tmp_path: Path,
) -> None:
    scenario = Scenario(Layout(pp=1, dp=3), lane=dp.Lane.DRAFTER, asynchronous=True)
    assert scenario.simulated(scenario.program()) is None
    assert scenario.checked(scenario.program(), tmp_path / "ok") is None

    program = scenario.program(corrupt_on=frozenset({(1, 2)}))
    report = divergence(scenario.simulated(program))
    assert (report.step, report.comm, report.lane, report.table) == (
        2,
        Communicator.DP_DRAFTER_CPU,
        "drafter",
        "dp.drafter.step2.table",
    )
    assert report.within_group
    assert [d.ranks for d in report.decisions] == [(0, 2), (1,)]
    assert all(d.note.comm is Communicator.DP_DRAFTER_CPU for d in report.decisions)
    assert "drafter lane" in report.render()
    assert scenario.checked(program, tmp_path / "broken") == report


def test_a_pp_cpu_agreement_compares_each_pipeline_alone(tmp_path: Path) -> None:
    """Over PP_CPU each replica's stages reduce their own table: replicas with other
    counts decide apart without a finding, and a corrupt sum names its own pipeline."""
    scenario = Scenario(Layout(pp=3, dp=2), comm=Communicator.PP_CPU)
    assert scenario.simulated(scenario.program()) is None
    assert scenario.checked(scenario.program(), tmp_path / "ok") is None

    program = scenario.program(corrupt_on=frozenset({(4, 2)}))
    report = divergence(scenario.simulated(program))
    assert (report.step, report.comm, report.lane) == (2, Communicator.PP_CPU, "target")
    assert report.within_group
    assert [d.ranks for d in report.decisions] == [(3, 5), (4,)]
    assert scenario.checked(program, tmp_path / "broken") == report


def test_a_dead_column_is_never_reported_and_a_rank_that_never_notes_is_waited_for_until_the_end(
    tmp_path: Path,
) -> None:
    """Rank 2 died with its column in flight: it posts and never notes. A corrupt value in
    its (dead) column changes no decision; one in a live column is reported at the end
    of the run, as the group is never complete."""
    scenario = Scenario(Layout(pp=1, dp=3), dead=frozenset({2}))
    dead_column = scenario.program(
        corrupt_on=frozenset({(1, 2)}), column=lambda member: 2, never_notes=frozenset({2})
    )
    assert scenario.simulated(dead_column) is None
    assert scenario.checked(dead_column, tmp_path / "dead") is None

    live_column = scenario.program(corrupt_on=frozenset({(1, 2)}), never_notes=frozenset({2}))
    report = divergence(scenario.simulated(live_column))
    assert report.step == 2
    assert report.within_group
    assert [d.ranks for d in report.decisions] == [(0,), (1,)]
    assert report.decisions[0].note.num_tokens_across_dp.tolist()[2] == 0  # dead: 0
    assert scenario.checked(live_column, tmp_path / "live") == report


# ---- the idle note ----------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["seed", "microbatch"])
def test_an_idle_agreement_is_noted_as_eager_none_with_no_request_and_zero_counts(
    layout: str,
) -> None:
    table_layout = (
        dp.SEED_TABLE if layout == "seed" else dp.TableLayout(microbatch=dp.MicrobatchConfig())
    )
    dp_size = 3
    groups = [
        dp.AgreementGroup(dp_size=dp_size, dp_rank=rank, layout=table_layout).mark_dead(2)
        for rank in range(2)
    ]
    idle = dp.RankBatch(num_reqs=0, num_tokens=0)
    started = [dp.start_agreement(dp.AgreementLanes(), g, DISPATCHER, idle, step=3) for g in groups]
    # The dead rank's stale column holds tokens: never read.
    stale = dp.AgreementGroup(dp_size=dp_size, dp_rank=2, layout=table_layout)
    busy = dp.RankBatch(num_reqs=4, num_tokens=4)
    dead = dp.start_agreement(dp.AgreementLanes(), stale, DISPATCHER, busy, step=3)
    columns = [s.result.contribution for s in (*started, dead)]
    table: Table = np.sum(columns, axis=0, dtype=np.int32)  # type: ignore[arg-type]
    for s in started:
        finished = dp.finish_agreement(s.state, s.result, table)
        note, release = finished.effects
        assert isinstance(note, NoteDecision)
        assert isinstance(release, Release)
        assert note.table == release.buffer == BufferRef("dp.target.step3.table")
        assert (note.step, note.op, note.comm) == (3, Op.AGREE, Communicator.DP_CPU)
        assert (note.cg_mode, note.eager, note.num_reqs, note.num_ubatches) == ("NONE", True, 0, 1)
        assert note.num_tokens_across_dp.tolist() == [0, 0, 0]
        assert (note.uniform_token_count, note.max_query_len) == (None, None)
        assert not note.num_tokens_across_dp.flags.writeable


# ---- the log: the fast path for lines differing only in digits --------------------------------


def test_notes_differing_only_in_digits_round_trip_through_the_log(tmp_path: Path) -> None:
    world = Layout(pp=1, dp=3)
    notes: list[Effect] = []
    for step, (count, reqs, ubatches) in enumerate(
        [(2, 2, 1), (8, 9, 2), (0, 0, 1), (7, 3, 3), (10, 12, 1), (1, 1, 1)]
    ):
        notes.append(
            NoteDecision(
                step=step,
                op=Op.AGREE,
                table=BufferRef(f"dp.target.step{step}.table"),
                comm=Communicator.DP_CPU,
                cg_mode="FULL",
                num_ubatches=ubatches,
                num_tokens_across_dp=np.array([count, count + 1, 0], dtype=np.int32),
                uniform_token_count=None if step % 2 else step + 1,
                eager=False,
                num_reqs=reqs,
                max_query_len=None,
            )
        )
    recorder = Recorder(LogHeader(rank=0, world=world, config={"t": "review"}))
    for note in notes:
        recorder.perform((note,))
    dump_logs([recorder.log], tmp_path)
    path = tmp_path / log_file_name(0)
    assert load_log(path).effects == tuple(notes)
    stream = LogStream(path)
    try:
        scanned = [effect for _, _, effect, _ in stream.scan(LOCAL_KINDS)]
    finally:
        stream.close()
    assert scanned == notes
    assert load_log(path) == recorder.log  # read again, every line through its template


# ---- the interpreters ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["eager", "checked", "plans"])
def test_the_torch_interpreter_notes_a_bound_table_and_refuses_an_unbound_one(mode: str) -> None:
    world = Layout(pp=1, dp=2)
    interpreter = TorchInterpreter(
        device=torch.device("cpu"),
        groups={},
        rank=0,
        checked=mode == "checked",
        plans=mode == "plans",
    )
    for step in range(3):  # one structure, recurring: a plan after the first
        table = BufferRef(f"dp.target.step{step}.table")
        interpreter.bind(table, torch.zeros((5, 2), dtype=torch.int32))
        note = note_of(world, step=step, tokens=step + 1)
        interpreter.perform((note,))
        assert interpreter.bound_refs() == {table}
        interpreter.perform((Release(step=step, op=Op.AGREE, buffer=table),))
    assert not interpreter.bound_refs()
    with pytest.raises(InterpreterError, match=r"dp\.target\.step3\.table"):
        interpreter.perform((note_of(world, step=3, tokens=4),))


WORLD_2 = Layout(pp=1, dp=2)


def gloo_rank(log_dir: str, mode: str, ctx: ProcessContext) -> list[str]:
    groups = build_communicators(
        pp_groups=WORLD_2.pp_groups,
        dp_groups=WORLD_2.dp_groups,
        relay_backend=ctx.backend,
        timeout=ctx.timeout,
    )
    interpreter = TorchInterpreter(
        device=ctx.device,
        groups=groups,
        rank=ctx.rank,
        checked=mode == "checked",
        plans=mode == "plans",
    )
    header = LogHeader(rank=ctx.rank, world=WORLD_2, config={"t": "review"})
    recorder = Recorder(header, interpreter, path=Path(log_dir) / log_file_name(ctx.rank))
    tokens = ((2, 1), (3, 3), (0, 0), (1, 2), (0, 0), (2, 2))
    scenario = Scenario(WORLD_2, lane=dp.Lane.DRAFTER, asynchronous=True, tokens=tokens)
    program = scenario.program()
    for effects in program(ctx.rank, lambda rank, step, ref: interpreter.host_array(ref)):
        recorder.perform(effects)
    return sorted(str(ref) for ref in interpreter.bound_refs())


@pytest.mark.multiprocess
def test_every_torch_mode_notes_real_gloo_agreements_that_purepp_check_passes(
    tmp_path: Path,
) -> None:
    logs = {}
    for mode in ("eager", "checked", "plans"):
        directory = tmp_path / mode
        directory.mkdir()
        bound = run_ranks(
            functools.partial(gloo_rank, str(directory), mode),
            WORLD_2.world_size,
            timeout=datetime.timedelta(seconds=30),
            deadline_s=120.0,
        )
        assert bound == [[], []]
        report = check_logs(directory)
        assert report.exit_code == 0, report.text
        logs[mode] = [load_log(directory / log_file_name(r)).effects for r in range(2)]
        notes = [e for e in logs[mode][0] if isinstance(e, NoteDecision)]
        assert [n.cg_mode for n in notes] == ["FULL", "FULL", "NONE", "FULL", "NONE", "FULL"]
    assert logs["eager"] == logs["checked"] == logs["plans"]


# ---- the effect itself ------------------------------------------------------------------


def test_a_copied_or_unpickled_note_keeps_its_counts_frozen() -> None:
    note = note_of(Layout(pp=1, dp=3), tokens=8)
    for copied in (pickle.loads(pickle.dumps(note)), copy.copy(note), copy.deepcopy(note)):
        assert copied == note
        counts = copied.num_tokens_across_dp
        assert not counts.flags.writeable
        with pytest.raises(ValueError, match="WRITEABLE"):
            counts.setflags(write=True)


def test_describe_effect_names_the_note_s_table_and_mode() -> None:
    note = note_of(Layout(pp=1, dp=2), step=7)
    assert describe_effect(note) == "note_decision('dp.target.step7.table': FULL)"


# ---- found by the review, and fixed ---------------------------------------------------------


def test_a_divergence_within_a_group_waits_for_that_group_not_another_stage_s() -> None:
    world = Layout(pp=2, dp=3)  # stage 0's DP group: ranks 0, 2, 4; stage 1's: 1, 3, 5
    hub = CollectiveHub(world, call="check", move_data=False)
    hub.note(0, note_of(world, tokens=8))  # handed a corrupt sum
    hub.note(2, note_of(world, tokens=2))
    for rank in (1, 3, 5):
        hub.note(rank, note_of(world, tokens=2))  # rank 4 has not noted yet: no report
    with pytest.raises(CollectiveReportError) as caught:
        hub.note(4, note_of(world, tokens=2))
    report = divergence(caught.value.report)
    assert [d.ranks for d in report.decisions] == [(1, 2, 3, 4, 5), (0,)]


def test_a_report_of_a_divergence_within_a_group_holds_every_rank_of_that_group(
    tmp_path: Path,
) -> None:
    scenario = Scenario(Layout(pp=2, dp=3))
    program = scenario.program(corrupt_on=frozenset({(5, 1)}))
    simulated = divergence(scenario.simulated(program))
    checked = divergence(scenario.checked(program, tmp_path))
    for report in (simulated, checked):
        assert report.within_group
        assert [d.ranks for d in report.decisions] == [(0, 1, 2, 3, 4), (5,)]


def test_a_held_divergence_within_a_group_is_not_dropped_for_an_earlier_stages_one() -> None:
    world = Layout(pp=2, dp=3)
    hub = CollectiveHub(world, call="check", move_data=False)
    for rank in range(world.world_size):  # step 0: the stages decided apart
        hub.note(rank, note_of(world, tokens=8 if world.pp_stage(rank) else 2))
    # Step 1: ranks 0 and 2 of one group decided apart; rank 4 (and stage 1) never noted.
    hub.note(0, note_of(world, step=1, tokens=2))
    hub.note(2, note_of(world, step=1, tokens=8))
    with pytest.raises(CollectiveReportError) as caught:
        hub.raise_held()
    report = divergence(caught.value.report)
    assert (report.step, report.within_group) == (1, True)


def test_the_simulator_and_the_checker_report_alike_with_two_stages(tmp_path: Path) -> None:
    scenario = Scenario(
        Layout(pp=2, dp=2), asynchronous=True, tokens=tuple(row[:2] for row in TOKENS)
    )
    program = scenario.program(corrupt_on=frozenset({(0, 2)}))
    simulated = divergence(scenario.simulated(program))
    assert scenario.checked(program, tmp_path) == simulated


@settings(max_examples=80, deadline=None)
@given(
    pp=st.integers(1, 3),
    dp_size=st.integers(2, 3),
    asynchronous=st.booleans(),
    corrupt_on=st.frozensets(st.tuples(st.integers(0, 8), st.integers(0, 3)), max_size=3),
)
def test_the_simulator_and_the_checker_report_alike_on_random_faults(
    pp: int, dp_size: int, asynchronous: bool, corrupt_on: frozenset[tuple[int, int]]
) -> None:
    """Random corrupt sums in PP x DP worlds: both tools give the same report, or none,
    whatever order each reads the ranks in."""
    world = Layout(pp=pp, dp=dp_size)
    tokens = tuple(row[:dp_size] + (1,) * (dp_size - len(row)) for row in TOKENS)
    scenario = Scenario(world, asynchronous=asynchronous, tokens=tokens)
    faults = frozenset((r % world.world_size, s) for r, s in corrupt_on)
    program = scenario.program(corrupt_on=faults)
    with tempfile.TemporaryDirectory() as directory:
        assert scenario.checked(program, Path(directory)) == scenario.simulated(program)
