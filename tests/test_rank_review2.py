"""A second review of `purepp.rank`: phases run out of their happy path.

What an embedder plausibly does with the rank step besides the README's loop: retry a
phase generator that failed, retry a driver call after the interpreter or the `StepIO`
failed mid-phase, start the next step's agreement twice. The bugs found fail here; the
behaviours that held are checked too (the driver issues what the raw phases issue).
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import pytest

from purepp import dp
from purepp.effects.arrays import IntArray
from purepp.effects.interpreter import Interpreter
from purepp.effects.log import Recorder
from purepp.effects.vocabulary import AllReduce, BufferRef, Effect
from purepp.errors import InvalidInputError, PureppError
from purepp.rank import (
    Agreed,
    Begun,
    RankConfig,
    RankDriver,
    RankState,
    Sampled,
    ShapeFacts,
    StepPhase,
    agree,
    begin,
    finish,
    init_rank,
    perform_phase,
    settle,
    start_agreement_phase,
    start_next_agreement,
)
from purepp.testing import (
    RecordingTensors,
    ReplicaStep,
    Schedule,
    ScheduleConfig,
    make_schedule,
    rank_config,
    scripted_header,
)

Array = npt.NDArray[Any]


def shape_of(planned: ReplicaStep) -> ShapeFacts:
    return ShapeFacts(
        num_tokens=planned.num_tokens, uniform_token_count=planned.uniform_token_count
    )


def sampled_of(schedule: Schedule, planned: ReplicaStep) -> Sampled[Array]:
    spec = schedule.config.spec
    table = None
    if spec:
        table = np.zeros((schedule.config.max_num_reqs, spec), np.int64)
        table[planned.batch.idx_mapping] = planned.drafts
    return Sampled(
        tokens=np.array(planned.sampled_tokens),
        num_sampled=np.array(planned.num_sampled),
        num_rejected=np.array(planned.num_rejected),
        draft_table=table,
    )


def prepared_io(schedule: Schedule, config: RankConfig) -> RecordingTensors:
    io = RecordingTensors(schedule)
    if config.updates_drafts:
        table = np.zeros((schedule.config.max_num_reqs, schedule.config.spec), np.int64)
        io.bind(config.relay.inputs.draft_table, table)
    return io


class FailsOnce:
    """An interpreter whose first `perform` raises (a transient device or network error),
    then forwards every later call to `inner`."""

    def __init__(self, inner: Interpreter) -> None:
        self.inner = inner
        self.failed = False

    def perform(self, effects: tuple[Effect, ...], /) -> None:
        if not self.failed:
            self.failed = True
            raise RuntimeError("injected: the device copy failed")
        self.inner.perform(effects)


class TableFailsOnce(RecordingTensors):
    """The recording seam, whose first `host_table` raises (a failed device-to-host read)."""

    failed = False

    def host_table(self, ref: BufferRef, /) -> IntArray:
        if not self.failed:
            self.failed = True
            raise RuntimeError("injected: the table's device-to-host copy failed")
        return super().host_table(ref)


# --- perform_phase and a phase generator used twice -------------------------------------------


def test_perform_phase_refuses_a_phase_generator_that_already_raised() -> None:
    """A phase that refused its input is finished: performing the same generator again
    must be a typed error naming perform_phase (and saying to call the phase again for a
    fresh generator). Today it returns None, typed as the phase's answer (an `Agreed`),
    so the embedder's loop fails later with an AttributeError far from the cause."""
    schedule = make_schedule(ScheduleConfig(pp=2, dp=1, spec=0, steps=4, seed=7))
    config = rank_config(schedule, 1)
    recorder = Recorder(scripted_header(schedule, 1))
    io = prepared_io(schedule, config)
    planned = schedule.at(0, 0)
    begun = perform_phase(begin(config, init_rank(config)), recorder)
    phase = agree(config, begun, planned.batch, ShapeFacts(num_tokens=0), io)
    with pytest.raises(InvalidInputError, match=r"^agree: ShapeFacts\.num_tokens=0"):
        perform_phase(phase, recorder)
    outcome: object
    try:
        outcome = perform_phase(phase, recorder)
    except InvalidInputError as refused:
        outcome = refused
    assert isinstance(outcome, InvalidInputError), f"perform_phase returned {outcome!r}"
    assert outcome.call == "perform_phase"


def test_perform_phase_does_not_resume_a_phase_past_effects_that_failed() -> None:
    """When the interpreter raises on a phase's effects, those effects were not (all)
    performed: performing the same generator again must be refused (a typed error naming
    perform_phase), never resumed past them. Today the retry resumes after the failed
    tuple: the last stage's finish skips its broadcasts, ends the step and returns the
    next step's RankState, so the receiving stages wait forever for step 2's tokens."""
    schedule = make_schedule(ScheduleConfig(pp=2, dp=1, spec=0, steps=4, seed=7))
    config = rank_config(schedule, 1)
    assert config.is_last_stage
    recorder = Recorder(scripted_header(schedule, 1))
    io = prepared_io(schedule, config)
    state = init_rank(config)
    for step in range(2):
        planned = schedule.at(step, 0)
        begun = perform_phase(begin(config, state), recorder)
        agreed = perform_phase(
            agree(config, begun, planned.batch, shape_of(planned), io, freed=planned.freed),
            recorder,
        )
        state = perform_phase(finish(config, agreed, io, sampled_of(schedule, planned)), recorder)
    planned = schedule.at(2, 0)
    assert planned.samples  # step 2 relays tokens to stage 0
    begun = perform_phase(begin(config, state), recorder)
    agreed = perform_phase(agree(config, begun, planned.batch, shape_of(planned), io), recorder)
    flaky = FailsOnce(recorder)
    phase = finish(config, agreed, io, sampled_of(schedule, planned))
    with pytest.raises(RuntimeError, match="injected"):
        perform_phase(phase, flaky)
    before = len(recorder.log.effects)
    outcome: RankState | InvalidInputError
    try:
        outcome = perform_phase(phase, flaky)
    except InvalidInputError as refused:
        outcome = refused
    issued = recorder.log.effects[before:]
    assert isinstance(outcome, InvalidInputError), (
        f"the retry returned step {outcome.step}'s state having issued "
        f"{[type(e).__name__ for e in issued]}: step 2's broadcasts were skipped"
    )
    assert outcome.call == "perform_phase"
    assert issued == ()


# --- RankDriver after a failure mid-phase -----------------------------------------------------


def test_the_driver_refuses_to_rerun_a_phase_that_issued_its_all_reduce_before_failing() -> None:
    """`agree` issued step 0's all-reduce, then the StepIO failed reading the reduced
    table. The driver must now refuse that Begun (a typed error naming RankDriver.agree,
    before issuing anything): the peer matched the all-reduce already, so a second one
    pairs with the peer's next collective (another step's table) or hangs. Today the
    driver takes the same Begun again and issues a second all-reduce of step 0."""
    schedule = make_schedule(ScheduleConfig(pp=1, dp=2, spec=0, steps=4, seed=7))
    config = rank_config(schedule, 0)
    recorder = Recorder(scripted_header(schedule, 0))
    driver = RankDriver(config, recorder, TableFailsOnce(schedule))
    planned = schedule.at(0, 0)
    begun = driver.begin(init_rank(config))
    with pytest.raises(RuntimeError, match="injected"):
        driver.agree(begun, planned.batch, shape_of(planned))
    outcome: Agreed | PureppError
    try:
        outcome = driver.agree(begun, planned.batch, shape_of(planned))
    except PureppError as refused:
        outcome = refused
    all_reduces = [e for e in recorder.log.effects if isinstance(e, AllReduce) and e.step == 0]
    assert len(all_reduces) == 1, f"step 0's all-reduce was issued {len(all_reduces)} times"
    assert isinstance(outcome, PureppError)
    assert outcome.call == "RankDriver.agree"


# --- the overlapped agreement -----------------------------------------------------------------


def test_a_second_start_of_the_next_agreement_is_named_on_start_next_agreement() -> None:
    """`start_next_agreement` on an Agreed that already carries the next step's agreement
    is refused (LaneBusyError, nothing issued), but the error must name the phase the
    caller called and a fix the caller can apply (finish this step, then settle the one
    in flight), as `_check_not_started` does for agree and start_agreement_phase. Today
    it names dp's `start_agreement` and advises `finish_agreement` or "the other lane",
    neither of which a rank-step caller has."""
    schedule = make_schedule(ScheduleConfig(pp=1, dp=2, spec=0, steps=4, seed=7))
    config = rank_config(schedule, 0)
    recorder = Recorder(scripted_header(schedule, 0))
    driver = RankDriver(config, recorder, RecordingTensors(schedule))
    first, following = schedule.at(0, 0), schedule.at(1, 0)
    agreed = driver.agree(driver.begin(init_rank(config)), first.batch, shape_of(first))
    ahead = driver.start_next(agreed, following.batch, shape_of(following))
    issued = len(recorder.log.effects)
    with pytest.raises(dp.LaneBusyError) as caught:
        driver.start_next(ahead, following.batch, shape_of(following))
    assert len(recorder.log.effects) == issued
    assert caught.value.call == "start_next_agreement", str(caught.value)
    assert "finish_agreement" not in caught.value.fix
    assert "settle" in caught.value.fix


# --- what held ---------------------------------------------------------------------------------


@attrs.frozen
class Run:
    effects: tuple[Effect, ...]
    answers: tuple[object, ...]  # what each step's phases handed out, in order


def _steps_through_driver(schedule: Schedule, config: RankConfig, rank: int) -> Run:
    recorder = Recorder(scripted_header(schedule, rank))
    driver = RankDriver(config, recorder, prepared_io(schedule, config))
    replica = schedule.world.dp_index(rank)
    last = schedule.config.steps - 1
    answers: list[object] = []
    state = init_rank(config)
    for step in range(schedule.config.steps):
        planned = schedule.at(step, replica)
        begun = driver.begin(state)
        if begun.agreeing is None:
            begun = driver.start(begun, planned.batch, shape_of(planned))
        agreed = driver.settle(begun, freed=planned.freed)
        if step < last:
            following = schedule.at(step + 1, replica)
            agreed = driver.start_next(agreed, following.batch, shape_of(following))
        sampled = sampled_of(schedule, planned) if config.is_last_stage else None
        state = driver.finish(agreed, sampled)
        answers += [begun, agreed, state]
    return Run(recorder.log.effects, tuple(answers))


def _steps_through_phases(schedule: Schedule, config: RankConfig, rank: int) -> Run:
    recorder = Recorder(scripted_header(schedule, rank))
    io = prepared_io(schedule, config)
    replica = schedule.world.dp_index(rank)
    last = schedule.config.steps - 1
    answers: list[object] = []
    state = init_rank(config)
    for step in range(schedule.config.steps):
        planned = schedule.at(step, replica)
        begun: Begun = perform_phase(begin(config, state), recorder)
        if begun.agreeing is None:
            started: StepPhase[Begun] = start_agreement_phase(
                config, begun, planned.batch, shape_of(planned)
            )
            begun = perform_phase(started, recorder)
        agreed = perform_phase(settle(config, begun, io, freed=planned.freed), recorder)
        if step < last:
            following = schedule.at(step + 1, replica)
            agreed = perform_phase(
                start_next_agreement(config, agreed, following.batch, shape_of(following)),
                recorder,
            )
        sampled = sampled_of(schedule, planned) if config.is_last_stage else None
        state = perform_phase(finish(config, agreed, io, sampled), recorder)
        answers += [begun, agreed, state]
    return Run(recorder.log.effects, tuple(answers))


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_the_driver_issues_and_hands_out_what_the_raw_phases_do_overlapped_with_a_drafter(
    rank: int,
) -> None:
    """Every rank of a pp 2 x dp 2 speculating world, overlapped, with a drafter reusing
    the agreement: the driver's effects and every value it hands out equal the raw
    phases' (performed one by one with perform_phase)."""
    schedule = make_schedule(ScheduleConfig(pp=2, dp=2, spec=1, steps=6, seed=3))
    config = attrs.evolve(rank_config(schedule, rank), drafter_dispatcher=schedule.dispatcher())
    driven = _steps_through_driver(schedule, config, rank)
    raw = _steps_through_phases(schedule, config, rank)
    assert driven.effects == raw.effects
    assert driven.answers == raw.answers
    assert any(isinstance(e, AllReduce) for e in driven.effects)
