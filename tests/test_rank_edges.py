"""The rank step (`purepp.rank`) and its testing kit (`purepp.testing`) at their edges.

What a rank step refuses must be refused before anything is issued: a collective
issued by a phase that then raises leaves the rank one collective ahead of its peers
(a hang), and the `RankDriver` lets the caller retry the phase, which issues it again.
Most tests here pin what a review found refused too late (after a collective) or not at
all: a seed-wire draft table, a last stage's foreign state, a slot past the relay's, a
Begun whose lanes lost its agreement, zero or short shape facts, a recording seam that
took float counts, a hand-built Schedule that did not fit its config.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import pytest

from purepp import dp
from purepp.batch import BatchFacts
from purepp.effects.io import NumpyIO
from purepp.effects.log import Recorder
from purepp.effects.numpy_interpreter import NumpyInterpreter
from purepp.effects.simulator import RankContext, simulate
from purepp.effects.vocabulary import BufferRef, Effect
from purepp.errors import InvalidInputError, PureppError
from purepp.rank import (
    Agreed,
    RankConfig,
    RankDriver,
    Sampled,
    ShapeFacts,
    agree,
    begin,
    finish,
    init_rank,
    perform_phase,
    settle,
    start_agreement_phase,
    start_next_agreement,
)
from purepp.relay import Wire
from purepp.testing import (
    ConsumedStep,
    NumpyTensors,
    RankOutputs,
    RecordingTensors,
    ReplicaStep,
    Schedule,
    ScheduleConfig,
    make_schedule,
    rank_config,
    scripted_header,
    simulate_schedule,
)

Array = npt.NDArray[Any]


def shape_of(planned: ReplicaStep) -> ShapeFacts:
    return ShapeFacts(
        num_tokens=planned.num_tokens, uniform_token_count=planned.uniform_token_count
    )


def sampled_of(schedule: Schedule, planned: ReplicaStep, **changed: Array) -> Sampled[Array]:
    """The last stage's outputs of `planned`, with some arrays replaced."""
    table = np.zeros((schedule.config.max_num_reqs, schedule.config.spec), np.int64)
    table[planned.batch.idx_mapping] = planned.drafts
    arrays: dict[str, Array] = {
        "tokens": np.array(planned.sampled_tokens),
        "num_sampled": np.array(planned.num_sampled),
        "num_rejected": np.array(planned.num_rejected),
        "draft_table": table,
    }
    arrays.update(changed)
    return Sampled[Array](**arrays)


@attrs.frozen
class LoneRank:
    """A one-rank world (pp 1, dp 1) on numpy, recorded, driven to a step whose rows sample."""

    schedule: Schedule
    driver: RankDriver[Array]
    recorder: Recorder
    planned: ReplicaStep  # the step the driver stopped at: agreed, not finished

    def issued(self) -> int:
        return len(self.recorder.log.effects)


def lone_rank_at_a_sampling_step(wire: Wire) -> tuple[LoneRank, Agreed]:
    """Steps run until one whose batch samples; that step is agreed and left unfinished."""
    schedule = make_schedule(ScheduleConfig(pp=1, dp=1, spec=2, steps=6, seed=7, wire=wire))
    interpreter = NumpyInterpreter()
    recorder = Recorder(scripted_header(schedule, 0), interpreter)
    driver = RankDriver(rank_config(schedule, 0), recorder, NumpyIO(interpreter))
    state = init_rank(driver.config)
    for step in range(schedule.config.steps):
        planned = schedule.at(step, 0)
        begun = driver.begin(state)
        agreed = driver.agree(begun, planned.batch, shape_of(planned), freed=planned.freed)
        if planned.samples:
            return LoneRank(schedule, driver, recorder, planned), agreed
        state = driver.finish(agreed, sampled_of(schedule, planned))
    raise AssertionError("no step of the schedule samples")


BAD_DRAFT_TABLES = [
    pytest.param(np.zeros((4, 3), np.int64), id="too-wide"),
    pytest.param(np.zeros((4, 2), np.int32), id="int32"),
    pytest.param(np.zeros((2, 2), np.int64), id="too-few-slots"),
]


@pytest.mark.parametrize("table", BAD_DRAFT_TABLES)
@pytest.mark.parametrize("wire", [Wire.PACKED, Wire.FIXED])
def test_a_packed_wire_refuses_a_bad_draft_table_before_issuing_anything(
    wire: Wire, table: Array
) -> None:
    """On the packed wires the drafts travel with the tokens, so a draft table of the
    wrong shape or dtype is refused by finish before any effect is issued, and the
    corrected call then ends the step."""
    world, agreed = lone_rank_at_a_sampling_step(wire)
    issued = world.issued()
    with pytest.raises(InvalidInputError, match=r"^finish: Sampled\.draft_table is"):
        world.driver.finish(agreed, sampled_of(world.schedule, world.planned, draft_table=table))
    assert world.issued() == issued
    state = world.driver.finish(agreed, sampled_of(world.schedule, world.planned))
    assert state.step == world.planned.step + 1


@pytest.mark.parametrize("table", BAD_DRAFT_TABLES)
def test_the_seed_wire_refuses_a_bad_draft_table_before_issuing_anything(table: Array) -> None:
    """On the seed wire, as on the packed ones, a draft table of the wrong shape or dtype
    is refused by finish before any effect is issued (the peers would match the token
    broadcasts and then wait for a draft broadcast that never comes), and the corrected
    call then ends the step."""
    world, agreed = lone_rank_at_a_sampling_step(Wire.SEED)
    issued = world.issued()
    with pytest.raises(InvalidInputError):
        world.driver.finish(agreed, sampled_of(world.schedule, world.planned, draft_table=table))
    assert world.issued() == issued
    state = world.driver.finish(agreed, sampled_of(world.schedule, world.planned))
    assert state.step == world.planned.step + 1


# --- values of another rank or config ---------------------------------------------------


def two_stage_dp2() -> Schedule:
    return make_schedule(ScheduleConfig(pp=2, dp=2, spec=0, steps=2, seed=7))


def test_a_first_stage_refuses_the_last_stages_state_before_issuing_anything() -> None:
    """begin on a non-last stage refuses a RankState made for the last stage (no ring)
    with a typed error, before any effect is issued."""
    schedule = two_stage_dp2()
    first, last = rank_config(schedule, 0), rank_config(schedule, 1)
    recorder = Recorder(scripted_header(schedule, 0))
    with pytest.raises(InvalidInputError, match=r"ring of 0, config has .* a ring of 2"):
        perform_phase(begin(first, init_rank(last)), recorder)
    assert recorder.log.effects == ()


def test_the_last_stage_refuses_a_first_stages_state_before_issuing_anything() -> None:
    """begin and agree on the last stage refuse a RankState made for another stage
    (a ring of pp entries) before any effect is issued, as the first stage does."""
    schedule = two_stage_dp2()
    first, last = rank_config(schedule, 0), rank_config(schedule, 1)
    planned = schedule.at(0, 0)
    recorder = Recorder(scripted_header(schedule, 1))
    io = RecordingTensors(schedule)

    def begin_and_agree() -> None:
        begun = perform_phase(begin(last, init_rank(first)), recorder)
        perform_phase(agree(last, begun, planned.batch, shape_of(planned), io), recorder)

    with pytest.raises(InvalidInputError):
        begin_and_agree()
    assert recorder.log.effects == ()


class TableIO(RecordingTensors):
    """A recording seam whose reduced DP table is this rank's column plus an idle peer's:
    what the all-reduce of a dp 2 group gives when the other rank has no work."""

    def __init__(self, schedule: Schedule, config: RankConfig, shape: ShapeFacts, rows: int):
        super().__init__(schedule)
        group = config.group
        columns = []
        for rank, batch in (
            (
                group.dp_rank,
                dp.RankBatch(
                    num_reqs=rows,
                    num_tokens=shape.num_tokens,
                    uniform_token_count=shape.uniform_token_count,
                ),
            ),
            (1 - group.dp_rank, dp.RankBatch(num_reqs=0, num_tokens=0)),
        ):
            peer = attrs.evolve(group, dp_rank=rank)
            started = dp.start_agreement(
                dp.AgreementLanes(), peer, config.dispatcher, batch, step=0
            )
            assert started.result.contribution is not None
            columns.append(started.result.contribution)
        self._table: Array = np.array(np.sum(columns, axis=0, dtype=np.int32))

    def host_table(self, ref: BufferRef, /) -> Array:
        return self._table


def test_agree_refuses_a_slot_beyond_the_relays_slots_before_the_all_reduce() -> None:
    """A batch mapping a row to a slot >= max_num_reqs can never be relayed: the phase
    that takes the batch (agree) refuses it before the DP all-reduce, not finish after it."""
    schedule = make_schedule(ScheduleConfig(pp=2, dp=2, spec=0, steps=2, seed=7))
    config = rank_config(schedule, 0)
    assert config.relay.max_num_reqs == 4
    shape = ShapeFacts(num_tokens=2, uniform_token_count=1)
    recorder = Recorder(scripted_header(schedule, 0))
    driver = RankDriver(config, recorder, TableIO(schedule, config, shape, rows=2))
    batch = BatchFacts(
        idx_mapping=[0, 9],
        num_computed_tokens=[5, 5],
        num_scheduled_tokens=[1, 1],
        prefill_len=[4, 4],
    )
    begun = driver.begin(init_rank(config))
    with pytest.raises(InvalidInputError, match="slot 9"):
        driver.agree(begun, batch, shape)
    assert recorder.log.effects == ()


def test_a_begun_whose_lanes_do_not_hold_its_agreement_is_refused_before_issuing() -> None:
    """A hand-built Begun (attrs.evolve) whose lanes are free while its agreement is in
    flight is refused, when built or by settle, before anything is issued."""
    schedule = make_schedule(ScheduleConfig(pp=1, dp=2, spec=0, steps=2, seed=7))
    config = rank_config(schedule, 0)
    planned = schedule.at(0, 0)
    recorder = Recorder(scripted_header(schedule, 0))
    begun = perform_phase(begin(config, init_rank(config)), recorder)
    begun = perform_phase(
        start_agreement_phase(config, begun, planned.batch, shape_of(planned)), recorder
    )
    issued = len(recorder.log.effects)

    def lose_the_lane_and_settle() -> None:
        lost = attrs.evolve(begun, lanes=dp.AgreementLanes())
        perform_phase(settle(config, lost, RecordingTensors(schedule)), recorder)

    with pytest.raises(InvalidInputError):
        lose_the_lane_and_settle()
    assert len(recorder.log.effects) == issued


# --- shapes ------------------------------------------------------------------------------


def lone_dp2_driver() -> tuple[Schedule, RankDriver[Array], Recorder]:
    schedule = make_schedule(ScheduleConfig(pp=1, dp=2, spec=0, steps=2, seed=7))
    recorder = Recorder(scripted_header(schedule, 0))
    driver = RankDriver(rank_config(schedule, 0), recorder, RecordingTensors(schedule))
    return schedule, driver, recorder


@pytest.mark.parametrize("field", ["uniform_token_count", "max_query_len"])
def test_a_zero_uniform_count_or_query_bound_is_refused_naming_shape_facts(field: str) -> None:
    """0 encodes None in the DP table: a ShapeFacts holding 0 there is refused with an
    error that names ShapeFacts (the value the caller passed), before anything is issued."""
    schedule, driver, recorder = lone_dp2_driver()
    planned = schedule.at(0, 0)
    begun = driver.begin(init_rank(driver.config))

    def agree_with_zero() -> None:
        zero: dict[str, Any] = {field: 0}
        driver.agree(begun, planned.batch, ShapeFacts(num_tokens=planned.num_tokens, **zero))

    with pytest.raises(InvalidInputError, match=rf"ShapeFacts.*{field}"):
        agree_with_zero()
    assert recorder.log.effects == ()


def test_a_token_count_below_the_batchs_scheduled_tokens_is_refused() -> None:
    """ShapeFacts.num_tokens is the step's scheduled tokens after padding: a count below
    the batch's own scheduled tokens is refused, before anything is issued."""
    schedule = make_schedule(ScheduleConfig(pp=1, dp=1, spec=0, steps=2, seed=7))
    recorder = Recorder(scripted_header(schedule, 0))
    driver = RankDriver(rank_config(schedule, 0), recorder, RecordingTensors(schedule))
    batch = BatchFacts(
        idx_mapping=[0, 1],
        num_computed_tokens=[0, 0],
        num_scheduled_tokens=[3, 3],
        prefill_len=[6, 6],
    )
    begun = driver.begin(init_rank(driver.config))
    with pytest.raises(InvalidInputError, match="num_tokens"):
        driver.agree(begun, batch, ShapeFacts(num_tokens=2))
    assert recorder.log.effects == ()


# --- the testing kit -----------------------------------------------------------------------


def test_a_recorded_run_refuses_float_counts_as_a_performed_run_does() -> None:
    """The seams agree on what they take: float32 counts, refused by NumpyIO (and
    TorchIO), are refused by RecordingTensors too, so no log is recorded of a step that
    a real run would refuse."""
    schedule = make_schedule(ScheduleConfig(pp=1, dp=1, spec=0, steps=6, seed=7))
    config = rank_config(schedule, 0)

    def run(io: NumpyIO | RecordingTensors, recorder: Recorder) -> None:
        driver = RankDriver(config, recorder, io)
        state = init_rank(config)
        for step in range(schedule.config.steps):
            planned = schedule.at(step, 0)
            begun = driver.begin(state)
            agreed = driver.agree(begun, planned.batch, shape_of(planned), freed=planned.freed)
            floats = np.array(planned.num_sampled, dtype=np.float32)
            state = driver.finish(agreed, sampled_of(schedule, planned, num_sampled=floats))

    interpreter = NumpyInterpreter()
    with pytest.raises(InvalidInputError, match="float32"):
        run(NumpyIO(interpreter), Recorder(scripted_header(schedule, 0), interpreter))
    with pytest.raises(InvalidInputError, match="num_sampled"):
        run(RecordingTensors(schedule), Recorder(scripted_header(schedule, 0)))


@pytest.mark.parametrize("broken", ["fewer-steps", "fewer-replicas", "no-steps"])
def test_a_schedule_that_does_not_fit_its_config_is_a_typed_error(broken: str) -> None:
    """Schedule is public: one built by hand whose steps do not fit its config is
    refused with a PureppError (when built, or when simulated), never a raw exception."""
    config = ScheduleConfig(pp=2, dp=2, spec=1, steps=3, seed=1)
    made = make_schedule(config)
    steps: Any = {
        "fewer-steps": made.steps[:2],
        "fewer-replicas": tuple(row[:1] for row in made.steps),
        "no-steps": None,
    }[broken]
    with pytest.raises(PureppError):
        simulate_schedule(Schedule(config=config, steps=steps))


# --- overlap ---------------------------------------------------------------------------------


def _rows(array: Array) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(v) for v in row) for row in array.tolist())


def overlapped_rank(
    schedule: Schedule, rank: int, io: NumpyTensors
) -> Generator[tuple[Effect, ...], None, RankOutputs]:
    """The scripted schedule with each step's agreement started during the step before
    (start_next_agreement) and its frees applied at the settle; what it consumes is read
    back as `purepp.testing` reads it."""
    config = rank_config(schedule, rank)
    replica = schedule.world.dp_index(rank)
    spec = schedule.config.spec
    inputs = config.relay.inputs
    if config.updates_drafts:
        io.bind(inputs.draft_table, np.zeros((schedule.config.max_num_reqs, spec), np.int64))
    consumed: list[ConsumedStep] = []
    agreed_at = []
    state = init_rank(config)
    last = schedule.config.steps - 1
    for step in range(schedule.config.steps):
        planned = schedule.at(step, replica)
        begun = yield from begin(config, state)
        out = begun.consumed
        if out is not None:
            slots, tokens = io.read(out.idx_mapping), io.read(out.sampled_tokens)
            num_sampled, num_rejected = io.read(out.num_sampled), io.read(out.num_rejected)
            table = io.read(inputs.draft_table) if spec else None
            consumed.append(
                ConsumedStep(
                    step=step,
                    received_at_step=out.received_at_step,
                    idx_mapping=tuple(int(s) for s in slots.tolist()),
                    sampled_tokens=_rows(tokens),
                    num_sampled=tuple(int(c) for c in num_sampled.tolist()),
                    num_rejected=tuple(int(c) for c in num_rejected.tolist()),
                    drafts_table=None if table is None else _rows(table),
                )
            )
        if begun.agreeing is None:
            begun = yield from start_agreement_phase(
                config, begun, planned.batch, shape_of(planned)
            )
        agreed = yield from settle(config, begun, io, freed=planned.freed)
        agreed_at.append(agreed.descriptor)
        if step < last:
            following = schedule.at(step + 1, replica)
            agreed = yield from start_next_agreement(
                config, agreed, following.batch, shape_of(following)
            )
        state = yield from finish(config, agreed, io, sampled_of(schedule, planned))
    return RankOutputs(rank=rank, consumed=tuple(consumed), agreed=tuple(agreed_at))


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(ScheduleConfig(pp=3, dp=2, spec=2, steps=16, seed=21), id="pp3-dp2-spec2"),
        pytest.param(
            ScheduleConfig(
                pp=2, dp=2, spec=1, steps=14, seed=5, wire=Wire.FIXED, validate_header=True
            ),
            id="pp2-dp2-fixed-header",
        ),
        pytest.param(
            ScheduleConfig(pp=2, dp=3, spec=1, steps=14, seed=8, microbatch=True),
            id="pp2-dp3-microbatch",
        ),
    ],
)
def test_the_overlapped_rank_step_consumes_what_the_sequential_one_consumes(
    config: ScheduleConfig,
) -> None:
    """With the agreement overlapped and the frees given to settle (slots freed at every
    ring offset and reused at once), every rank consumes, step by step, exactly what the
    sequential rank step consumes, and runs at the same agreed shapes."""
    schedule = make_schedule(config)
    expected = simulate_schedule(schedule).outputs
    outputs: dict[int, RankOutputs] = {}

    def program(context: RankContext) -> Iterator[tuple[Effect, ...]]:
        io = NumpyTensors(context.interpreter)
        outputs[context.rank] = yield from overlapped_rank(schedule, context.rank, io)

    simulate(schedule.world, program)
    assert tuple(outputs[rank] for rank in range(schedule.world.world_size)) == expected
    # Some consume dropped a freed slot's row: the frees at the settle took effect.
    assert any(-1 in c.idx_mapping for out in expected for c in out.consumed)
