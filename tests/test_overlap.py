"""The DP agreement overlapped with work: started a step early, settled at the top of its step.

The overlapped rank step (`start_next_agreement` during step T for step T + 1, `settle`
at the top of step T + 1) must agree exactly what the sequential one (`agree`) agrees,
issue the same relay effects in the same order, and contribute the same columns in the
same order on the DP communicator; only the agreement's all-reduce moves a step earlier
and gains a work handle, completed by a `WaitWork` in the settle. A second start on a
busy lane is a `dp.LaneBusyError` raised before anything is issued.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable, Generator, Iterator
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import pytest

from purepp import dp, rank
from purepp.effects.log import Recorder
from purepp.effects.simulator import RankContext as SimContext
from purepp.effects.simulator import SimulationResult, simulate
from purepp.effects.torch_interpreter import TorchInterpreter, build_communicators
from purepp.effects.vocabulary import AllReduce, BufferRef, Communicator, Effect, Op, WaitWork
from purepp.errors import InvalidInputError
from purepp.runner.options import OptionParser, add_run_options, settings_from_args
from purepp.runner.supervise import worker_argv
from purepp.testing import (
    NumpyTensors,
    RankOutputs,
    RecordingTensors,
    ReplicaStep,
    Schedule,
    ScheduleConfig,
    ScriptedIO,
    TorchTensors,
    drive,
    make_schedule,
    rank_config,
    scripted_header,
    scripted_rank_effects,
)
from tests._dist import RankContext, run_ranks

STEPS = 12

# DP worlds with and without speculation; pp 2 so that stages consume and relay.
WORLDS = [
    pytest.param(ScheduleConfig(pp=2, dp=2, spec=1, steps=STEPS, seed=3), id="pp2-dp2-spec1"),
    pytest.param(ScheduleConfig(pp=1, dp=3, spec=0, steps=STEPS, seed=4), id="pp1-dp3"),
    pytest.param(ScheduleConfig(pp=3, dp=2, spec=2, steps=STEPS, seed=5), id="pp3-dp2-spec2"),
]

Outcomes = list[tuple[dp.DispatchOutcome, dp.DispatchOutcome | None]]


def _shape(planned: ReplicaStep) -> rank.ShapeFacts:
    return rank.ShapeFacts(
        num_tokens=planned.num_tokens, uniform_token_count=planned.uniform_token_count
    )


def _sampled(schedule: Schedule, planned: ReplicaStep) -> rank.Sampled[npt.NDArray[Any]]:
    table = None
    if schedule.config.spec:
        table = np.zeros((schedule.config.max_num_reqs, schedule.config.spec), dtype=np.int64)
        table[planned.batch.idx_mapping] = planned.drafts
    return rank.Sampled(
        tokens=np.array(planned.sampled_tokens),
        num_sampled=np.array(planned.num_sampled),
        num_rejected=np.array(planned.num_rejected),
        draft_table=table,
    )


def _config(schedule: Schedule, global_rank: int, drafter: bool) -> rank.RankConfig:
    config = rank_config(schedule, global_rank)
    if drafter:
        config = attrs.evolve(config, drafter_dispatcher=schedule.dispatcher())
    return config


def _prepare(config: rank.RankConfig, schedule: Schedule, io: ScriptedIO) -> None:
    if config.updates_drafts:
        table = np.zeros((schedule.config.max_num_reqs, schedule.config.spec), np.int64)
        io.bind(config.relay.inputs.draft_table, table)


def sequential_program(
    schedule: Schedule, global_rank: int, io: ScriptedIO, *, drafter: bool = False
) -> Generator[tuple[Effect, ...], None, Outcomes]:
    """The schedule through `agree`, as today."""
    config = _config(schedule, global_rank, drafter)
    replica = schedule.world.dp_index(global_rank)
    _prepare(config, schedule, io)
    state = rank.init_rank(config)
    outcomes: Outcomes = []
    for step in range(schedule.config.steps):
        planned = schedule.at(step, replica)
        begun = yield from rank.begin(config, state)
        agreed = yield from rank.agree(
            config, begun, planned.batch, _shape(planned), io, freed=planned.freed
        )
        outcomes.append((agreed.target, agreed.drafter))
        state = yield from rank.finish(config, agreed, io, _sampled(schedule, planned))
    return outcomes


def overlapped_program(
    schedule: Schedule, global_rank: int, io: ScriptedIO, *, drafter: bool = False
) -> Generator[tuple[Effect, ...], None, Outcomes]:
    """The schedule with each step's agreement started during the step before."""
    config = _config(schedule, global_rank, drafter)
    replica = schedule.world.dp_index(global_rank)
    _prepare(config, schedule, io)
    state = rank.init_rank(config)
    outcomes: Outcomes = []
    steps = schedule.config.steps
    for step in range(steps):
        planned = schedule.at(step, replica)
        begun = yield from rank.begin(config, state)
        if step == 0:
            assert begun.agreeing is None
            begun = yield from rank.start_agreement_phase(
                config, begun, planned.batch, _shape(planned)
            )
        agreed = yield from rank.settle(config, begun, io, freed=planned.freed)
        if step + 1 < steps:
            following = schedule.at(step + 1, replica)
            agreed = yield from rank.start_next_agreement(
                config, agreed, following.batch, _shape(following)
            )
        outcomes.append((agreed.target, agreed.drafter))
        state = yield from rank.finish(config, agreed, io, _sampled(schedule, planned))
    assert state.agreeing is None
    assert state.lanes == dp.AgreementLanes()
    return outcomes


def _recorded(
    program: Generator[tuple[Effect, ...], None, Outcomes], schedule: Schedule, global_rank: int
) -> tuple[Outcomes, tuple[Effect, ...]]:
    recorder = Recorder(scripted_header(schedule, global_rank))
    outcomes = rank.perform_phase(program, recorder)
    return outcomes, recorder.log.effects


def _dp_contributions(effects: tuple[Effect, ...]) -> list[list[list[int]]]:
    return [
        e.contribution.tolist()
        for e in effects
        if isinstance(e, AllReduce) and e.comm is Communicator.DP_CPU
    ]


@pytest.mark.parametrize("drafter", [False, True], ids=["target", "with-drafter"])
@pytest.mark.parametrize("config", WORLDS)
def test_the_overlapped_rank_step_agrees_what_the_sequential_one_agrees(
    config: ScheduleConfig, drafter: bool
) -> None:
    schedule = make_schedule(config)
    for global_rank in range(schedule.world.world_size):
        io = RecordingTensors(schedule)
        plain, plain_effects = _recorded(
            sequential_program(schedule, global_rank, io, drafter=drafter), schedule, global_rank
        )
        io = RecordingTensors(schedule)
        ahead, ahead_effects = _recorded(
            overlapped_program(schedule, global_rank, io, drafter=drafter), schedule, global_rank
        )
        assert ahead == plain, f"rank {global_rank}"
        assert any(outcome.sync is not None for outcome, _ in plain)  # a real agreement
        # The relay's effects are untouched; the DP columns are the same, in the same order.
        relay = [e for e in plain_effects if e.op is not Op.AGREE]
        assert [e for e in ahead_effects if e.op is not Op.AGREE] == relay
        assert _dp_contributions(ahead_effects) == _dp_contributions(plain_effects)


def _simulated(
    schedule: Schedule, make: Callable[..., Generator[tuple[Effect, ...], None, Outcomes]]
) -> tuple[dict[int, Outcomes], SimulationResult]:
    outcomes: dict[int, Outcomes] = {}

    def program(context: SimContext) -> Iterator[tuple[Effect, ...]]:
        io = NumpyTensors(context.interpreter)
        outcomes[context.rank] = yield from make(schedule, context.rank, io, drafter=True)

    return outcomes, simulate(schedule.world, program)


@pytest.mark.parametrize("config", WORLDS)
def test_the_simulator_runs_the_overlapped_rank_step_as_the_sequential_one(
    config: ScheduleConfig,
) -> None:
    schedule = make_schedule(config)
    plain, plain_run = _simulated(schedule, sequential_program)
    ahead, ahead_run = _simulated(schedule, overlapped_program)
    assert ahead == plain
    # Every rank issued each step's all-reduce during the step before, ahead of the
    # rest of that step on some steps...
    for effects in ahead_run.effects:
        reduces = [
            i
            for i, e in enumerate(effects)
            if isinstance(e, AllReduce) and e.comm is Communicator.DP_CPU
        ]
        assert [effects[i].step for i in reduces] == list(range(STEPS))
        for i in reduces[1:]:
            assert max(e.step for e in effects[:i]) == effects[i].step - 1
        assert any(e.step < effects[i].step for i in reduces for e in effects[i:])
    # ...and the relay moved the same data: every rank ends with the same buffers.
    for global_rank, interpreter in enumerate(ahead_run.interpreters):
        expected = plain_run.interpreter(global_rank)
        assert interpreter.bound_refs() == expected.bound_refs()
        for ref in interpreter.bound_refs():
            if not isinstance(ref, BufferRef):
                continue  # an event or work handle holds no data
            np.testing.assert_array_equal(interpreter.tensor(ref), expected.tensor(ref))


def test_agree_is_synchronous_and_the_overlapped_start_is_completed_by_a_wait() -> None:
    schedule = make_schedule(ScheduleConfig(pp=2, dp=2, spec=1, steps=STEPS, seed=3))
    last_stage = 1  # replica 0's last stage: it broadcasts at the end of each step
    _, plain = _recorded(
        sequential_program(schedule, last_stage, RecordingTensors(schedule)), schedule, last_stage
    )
    _, ahead = _recorded(
        overlapped_program(schedule, last_stage, RecordingTensors(schedule)), schedule, last_stage
    )
    assert not any(isinstance(e, WaitWork) for e in plain)
    assert all(e.work is None for e in plain if isinstance(e, AllReduce))
    reduces = [e for e in ahead if isinstance(e, AllReduce)]
    waits = [e for e in ahead if isinstance(e, WaitWork)]
    assert [e.work for e in reduces] == [w.work for w in waits]
    assert [e.step for e in reduces] == list(range(STEPS))
    # Step T + 1's all-reduce is issued after step T's wait and before step T's relay
    # sends: they (and the caller's forward before them) overlap it.
    overlapped = 0
    for step in range(STEPS - 1):
        wait = ahead.index(waits[step])
        issued = ahead.index(reduces[step + 1])
        tail = [
            i for i, e in enumerate(ahead) if i > wait and e.step == step and e.op is not Op.AGREE
        ]
        assert wait < issued
        assert all(issued < i for i in tail)
        overlapped += bool(tail)
    assert overlapped > 0


def _first_step(
    schedule: Schedule, config: rank.RankConfig, io: ScriptedIO
) -> tuple[rank.Agreed, ReplicaStep]:
    """Step 0 begun, started and settled, on a recorder."""
    recorder = Recorder(scripted_header(schedule, 0))
    planned = schedule.at(0, 0)
    begun = rank.perform_phase(rank.begin(config, rank.init_rank(config)), recorder)
    begun = rank.perform_phase(
        rank.start_agreement_phase(config, begun, planned.batch, _shape(planned)), recorder
    )
    agreed = rank.perform_phase(rank.settle(config, begun, io), recorder)
    return agreed, planned


def test_a_second_start_on_a_busy_lane_raises_before_issuing_anything() -> None:
    schedule = make_schedule(ScheduleConfig(pp=1, dp=2, spec=0, steps=4, seed=7))
    config = rank_config(schedule, 0)
    io = RecordingTensors(schedule)
    agreed, _ = _first_step(schedule, config, io)
    following = schedule.at(1, 0)
    recorder = Recorder(scripted_header(schedule, 0))
    ahead = rank.perform_phase(
        rank.start_next_agreement(config, agreed, following.batch, _shape(following)), recorder
    )
    assert ahead.lanes.target == 1
    assert ahead.ahead is not None
    assert ahead.ahead.step == 1
    issued = len(recorder.log.effects)

    again = rank.start_next_agreement(config, ahead, following.batch, _shape(following))
    busy = r"^start_next_agreement: step \d+ already started step \d+.s agreement"
    with pytest.raises(dp.LaneBusyError, match=busy):
        next(again)
    assert len(recorder.log.effects) == issued  # nothing issued, the first still in flight
    assert ahead.lanes.target == 1
    assert ahead.ahead is not None

    # The next step carries it: starting it again, or agreeing afresh, is refused too.
    state = rank.perform_phase(rank.finish(config, ahead, io), recorder)
    begun = rank.perform_phase(rank.begin(config, state), recorder)
    assert begun.agreeing == ahead.ahead
    phases: tuple[tuple[str, rank.StepPhase[object]], ...] = (
        (
            "start_agreement_phase",
            rank.start_agreement_phase(config, begun, following.batch, _shape(following)),
        ),
        ("agree", rank.agree(config, begun, following.batch, _shape(following), io)),
    )
    for call, phase in phases:
        with pytest.raises(
            dp.LaneBusyError, match=rf"^{call}: step 1 already has step 1's agreement in flight"
        ) as caught:
            next(phase)
        assert "settle it: settle(config, begun, io, freed=...) (RankDriver.settle)" in str(
            caught.value
        )
    # The one in flight still settles, at the agreement it started.
    settled = rank.perform_phase(rank.settle(config, begun, io), recorder)
    assert settled.lanes == dp.AgreementLanes()
    assert settled.batch is following.batch


def test_settling_a_step_with_no_agreement_in_flight_is_refused() -> None:
    schedule = make_schedule(ScheduleConfig(pp=1, dp=2, spec=0, steps=4, seed=7))
    config = rank_config(schedule, 0)
    begun = rank.perform_phase(
        rank.begin(config, rank.init_rank(config)), Recorder(scripted_header(schedule, 0))
    )
    with pytest.raises(
        InvalidInputError, match=r"^settle: step 0 has no agreement in flight, not its own"
    ):
        next(rank.settle(config, begun, RecordingTensors(schedule)))


# -- real processes ---------------------------------------------------------------------


@attrs.frozen
class _Both:
    plain: Outcomes
    ahead: Outcomes
    sequential_outputs: RankOutputs  # the scripted world's own run, for a sanity check


def _both_ways(config: ScheduleConfig, ctx: RankContext) -> _Both:
    schedule = make_schedule(config)
    groups = build_communicators(
        pp_groups=schedule.world.pp_groups,
        dp_groups=schedule.world.dp_groups,
        relay_backend=ctx.backend,
        timeout=ctx.timeout,
    )

    def fresh() -> TorchInterpreter:
        return TorchInterpreter(device=ctx.device, groups=groups, rank=ctx.rank)

    interpreter = fresh()
    plain = rank.perform_phase(
        sequential_program(schedule, ctx.rank, TorchTensors(interpreter)), interpreter
    )
    interpreter = fresh()
    ahead = rank.perform_phase(
        overlapped_program(schedule, ctx.rank, TorchTensors(interpreter)), interpreter
    )
    # Every work handle was waited on: only the caller's and the relay's names remain.
    assert all(not ref.name.startswith("dp.") for ref in interpreter.bound_refs())
    interpreter = fresh()
    outputs = drive(
        scripted_rank_effects(schedule, ctx.rank, TorchTensors(interpreter)), interpreter
    )
    return _Both(plain=plain, ahead=ahead, sequential_outputs=outputs)


@pytest.mark.multiprocess
def test_on_two_gloo_ranks_overlap_agrees_what_no_overlap_agrees() -> None:
    config = ScheduleConfig(pp=1, dp=2, spec=1, steps=STEPS, seed=11)
    runs = run_ranks(
        functools.partial(_both_ways, config),
        2,
        backend="gloo",
        timeout=datetime.timedelta(seconds=30),
        deadline_s=120.0,
    )
    for global_rank, run in enumerate(runs):
        assert run.ahead == run.plain, f"rank {global_rank}"
        agreed = [outcome.descriptor for outcome, _ in run.plain]
        assert agreed == list(run.sequential_outputs.agreed)
    # Both ranks agreed one padded count per step (what the agreement is for).
    for (first, _), (second, _) in zip(runs[0].ahead, runs[1].ahead, strict=True):
        assert (first.sync is None) == (second.sync is None)
        if first.sync is not None and second.sync is not None:
            assert first.sync == second.sync


# -- the runner's option ----------------------------------------------------------------


def test_purepp_run_overlaps_the_agreement_only_when_asked() -> None:
    parser = OptionParser(prog="purepp run")
    add_run_options(parser)
    plain = settings_from_args(parser.parse_args([]))
    overlapped = settings_from_args(parser.parse_args(["--overlap-agreement"]))
    assert plain.overlap_agreement is False
    assert overlapped.overlap_agreement is True
    # The rank processes get the flag; a plain run's argv is what it was.
    assert "--overlap-agreement" in worker_argv(overlapped, None, None)
    assert "--overlap-agreement" not in worker_argv(plain, None, None)
