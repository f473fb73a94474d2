"""Field failures (shared/FIELD_FAILURES.md) reproduced with the real pure steps, and caught.

Each broken variant is a small wrapper around a real pure step that alters its
effects or its inputs the way the field bug did, swapped into the scripted rank
program for the ranks that had the bug. The simulator (or `purepp check` over the
recorded logs) must stop at the op that diverged and say precisely where; the
correct program must run the same schedule cleanly.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest

from purepp import dp
from purepp.batch import BatchFacts, need_sampled_mask
from purepp.cudagraph import Dispatcher
from purepp.effects.checker import check_log_dir
from purepp.effects.log import dump_logs
from purepp.effects.matching import (
    CollectiveKind,
    CollectiveReportError,
    MismatchField,
    MismatchReport,
    Report,
    RingOverrunReport,
)
from purepp.effects.numpy_interpreter import POISON
from purepp.effects.vocabulary import (
    Alias,
    Broadcast,
    Communicator,
    DType,
    Effect,
    EventRef,
    Op,
    PadColumns,
    RecordStream,
    Stream,
    TensorSpec,
)
from purepp.errors import HeaderMismatchError
from purepp.rank import RankSteps
from purepp.relay import (
    RelayConfig,
    RelayState,
    broadcast_drafts,
    broadcast_sampled,
    end_step,
    receive,
)
from purepp.step import Step
from purepp.testing import (
    Schedule,
    ScheduleConfig,
    ScriptedRun,
    make_schedule,
    record_scripted_logs,
    simulate_schedule,
)

STEPS = 12
# The scripted world's relays keep the default name, so they read these inputs.
DRAFT_TABLE = RelayConfig.for_stage(pp_size=1, stage=0, max_num_reqs=1).inputs.draft_table


def schedule_of(pp: int, dp_size: int, spec: int, seed: int = 0) -> Schedule:
    return make_schedule(ScheduleConfig(pp=pp, dp=dp_size, spec=spec, steps=STEPS, seed=seed))


def only_on(broken_ranks: set[int], broken: RankSteps) -> Callable[[int], RankSteps]:
    return lambda rank: broken if rank in broken_ranks else RankSteps()


def report_of(schedule: Schedule, **options: object) -> Report:
    with pytest.raises(CollectiveReportError) as caught:
        simulate_schedule(schedule, **options)  # type: ignore[arg-type]
    return caught.value.report


def first_sampling_step(schedule: Schedule, replica: int = 0) -> int:
    return next(s for s in range(STEPS) if schedule.at(s, replica).samples)


# ---- FF1: [n, 1] sent on a plain-sampler step, [n, spec + 1] posted ------------------------


def unpadded_broadcast_sampled(
    config: RelayConfig,
    state: RelayState,
    batch: BatchFacts,
    sampled: TensorSpec,
    drafts: TensorSpec | None = None,
) -> Step[RelayState, bool]:
    """The field bug: the sender broadcasts the sampler's own [n, k], not the padded wire."""
    sent = broadcast_sampled(config, state, batch, sampled, drafts)

    def unpad(effect: Effect) -> Effect:
        match effect:
            case PadColumns():
                return Alias(step=effect.step, op=effect.op, source=effect.source, out=effect.out)
            case Broadcast() if effect.dtype is DType.INT64:
                return attrs.evolve(effect, shape=sampled.shape)
            case _:
                return effect

    return attrs.evolve(sent, effects=tuple(unpad(e) for e in sent.effects))


FF1_STEPS = only_on({2}, RankSteps(broadcast_sampled=unpadded_broadcast_sampled))


def test_ff1_an_unpadded_plain_sampler_broadcast_is_a_shape_mismatch_at_that_op() -> None:
    schedule = schedule_of(pp=3, dp_size=1, spec=2)
    step = first_sampling_step(schedule)
    sent = schedule.at(step, 0)
    rows = sent.batch.num_reqs
    assert sent.sampled_tokens.shape == (rows, 1)  # prefill only: the plain sampler

    report = report_of(schedule, steps_for=FF1_STEPS)

    assert isinstance(report, MismatchReport)
    assert (report.rank, report.peer) == (0, 2)
    assert (report.comm, report.group) == (Communicator.PP_RELAY, (0, 1, 2))
    assert (report.seq, report.step, report.op) == (0, step, Op.RECEIVE)
    assert report.expected.shape == (rows, 3)
    assert report.received is not None
    assert (report.received.shape, report.received.op) == ((rows, 1), Op.BROADCAST)
    assert report.differing == (MismatchField.SHAPE,)
    assert "op #0 on pp_relay (ranks 0, 1, 2)" in report.render()


# ---- FF10: an idle DP rank returns early and skips the agreement ----------------------------


def skip_when_idle(
    lanes: dp.AgreementLanes,
    group: dp.AgreementGroup,
    dispatcher: Dispatcher | None,
    batch: dp.RankBatch,
    *,
    step: int,
    lane: dp.Lane = dp.Lane.TARGET,
    asynchronous: bool = False,
) -> dp.AgreementStarted:
    """The field bug: a rank with no tokens decides alone, as if it had no peers, and
    never all-reduces."""
    alone = dp.AgreementGroup(dp_size=1, dp_rank=0) if batch.num_tokens == 0 else group
    return dp.start_agreement(
        lanes, alone, dispatcher, batch, step=step, lane=lane, asynchronous=asynchronous
    )


FF10_STEPS = only_on({0}, RankSteps(start_agreement=skip_when_idle))


def test_ff10_an_idle_rank_that_skips_the_agreement_is_caught_at_that_step() -> None:
    # pp=2, dp=2: the DP groups are the stages across replicas, (0, 2) and (1, 3).
    schedule = schedule_of(pp=2, dp_size=2, spec=0)
    # Step 1: replica 0 is idle while replica 1 works.
    assert schedule.at(1, 0).num_tokens == 0
    assert schedule.at(1, 1).num_tokens > 0

    report = report_of(schedule, steps_for=FF10_STEPS)

    assert isinstance(report, MismatchReport)
    assert (report.comm, report.group, report.seq) == (Communicator.DP_CPU, (0, 2), 1)
    assert (report.rank, report.step, report.op) == (2, 1, Op.AGREE)
    assert report.peer == 0
    assert report.received is not None
    # Rank 0's op #1 is already the next step's agreement.
    assert (report.received.kind, report.received.step) == (CollectiveKind.ALL_REDUCE, 2)
    assert report.differing == (MismatchField.STEP,)


# ---- FF3/FF4: the draft broadcast gated differently on sender and receivers ------------------


def drafts_gated_on_decodes(
    config: RelayConfig, state: RelayState, batch: BatchFacts, drafts: TensorSpec
) -> Step[RelayState, bool]:
    """The field bug: the sender sends drafts only when some row decodes (a data-dependent
    gate); the receivers post them whenever a row samples."""
    decoding = bool((batch.num_computed_tokens >= batch.prefill_len).any())
    if not decoding:
        return Step(state, (), False)
    return broadcast_drafts(config, state, batch, drafts)


FF3_STEPS = only_on({1}, RankSteps(broadcast_drafts=drafts_gated_on_decodes))


def test_ff3_ff4_a_draft_broadcast_gated_differently_is_caught_at_that_op() -> None:
    schedule = schedule_of(pp=2, dp_size=1, spec=1)
    step = first_sampling_step(schedule)
    rows = schedule.at(step, 0).batch.num_reqs
    next_step = next(s for s in range(step + 1, STEPS) if schedule.at(s, 0).samples)

    report = report_of(schedule, steps_for=FF3_STEPS)

    assert isinstance(report, MismatchReport)
    assert (report.comm, report.group) == (Communicator.PP_RELAY, (0, 1))
    # Ops #0 and #1 (tokens, counts) match; #2 is the receivers' draft broadcast ...
    assert (report.rank, report.peer, report.seq) == (0, 1, 2)
    assert (report.step, report.op, report.expected.shape) == (step, Op.RECEIVE, (rows, 1))
    # ... which meets the sender's next step's sampled tokens.
    assert report.received is not None
    assert (report.received.step, report.received.op) == (next_step, Op.BROADCAST)
    assert MismatchField.STEP in report.differing


# ---- FF3: pp_size + 1 steps in flight with a ring of pp_size -------------------------------


def test_ff3_more_steps_in_flight_than_the_ring_is_deep_is_a_ring_overrun() -> None:
    schedule = schedule_of(pp=2, dp_size=1, spec=1)

    report = report_of(schedule, max_steps_in_flight=3)

    assert isinstance(report, RingOverrunReport)
    assert (report.rank, report.step, report.op) == (0, 8, Op.CONSUME)
    assert report.event == EventRef("relay.step6.received")
    assert (report.ring_depth, report.max_steps_in_flight) == (2, 3)
    assert report.awaited.signature.step == 6
    assert report.awaited.missing == (1,)
    assert report.peers_at == ((1, 6),)
    assert report.render().startswith("Ring overrun: rank 0 at step 8 (consume)")


@pytest.mark.parametrize("in_flight", [1, 2])
def test_no_more_steps_in_flight_than_the_ring_is_deep_is_fine(in_flight: int) -> None:
    simulate_schedule(schedule_of(pp=2, dp_size=1, spec=1), max_steps_in_flight=in_flight)


# ---- FF3 with the opt-in validated header: disagreements named at the header ---------------
#
# The simulator compares the step labels effects carry; NCCL and gloo never see them.
# `compare_steps=False` matches posts as the wire does, so these tests show what a real
# run would do with and without the header: only the header's values can tell.


def header_schedule(*, seed: int, validate_header: bool) -> Schedule:
    config = ScheduleConfig(
        pp=2, dp=1, spec=1, steps=STEPS, seed=seed, validate_header=validate_header
    )
    return make_schedule(config)


def header_error(schedule: Schedule, **options: object) -> HeaderMismatchError:
    with pytest.raises(HeaderMismatchError) as caught:
        simulate_schedule(schedule, **options)  # type: ignore[arg-type]
    return caught.value


def sampled_gated_on_decodes(
    config: RelayConfig,
    state: RelayState,
    batch: BatchFacts,
    sampled: TensorSpec,
    drafts: TensorSpec | None = None,
) -> Step[RelayState, bool]:
    """The field bug: the sender skips a step's broadcasts unless some row decodes, while
    the receivers post whenever a row samples: they run one broadcast ahead of it."""
    if not bool((batch.num_computed_tokens >= batch.prefill_len).any()):
        return Step(state, (), False)
    return broadcast_sampled(config, state, batch, sampled, drafts)


FF3_SKIP_STEPS = only_on(
    {1},
    RankSteps(broadcast_sampled=sampled_gated_on_decodes, broadcast_drafts=drafts_gated_on_decodes),
)


def test_ff3_header_a_sender_skipping_a_step_is_named_at_the_header_with_both_values() -> None:
    # Seed 0: step 2 samples only final prefill chunks (skipped by the sender), step 3
    # decodes, and both batches have 4 rows, so the skip does not change any shape.
    plain = header_schedule(seed=0, validate_header=False)
    assert (plain.at(2, 0).batch.num_reqs, plain.at(3, 0).batch.num_reqs) == (4, 4)

    error = header_error(
        header_schedule(seed=0, validate_header=True), steps_for=FF3_SKIP_STEPS, compare_steps=False
    )

    assert (error.rank, error.step) == (0, 2)
    assert (error.expected, error.received) == ((2, 4), (3, 4))
    assert error.call == "NumpyInterpreter.perform(CheckHeader step=2 op=receive)"
    assert "sent at another step" in error.problem

    # Without the header the wire pairs step 2's receives with step 3's broadcasts
    # silently; the run stalls later, at a consume that waits for a broadcast never sent.
    report = report_of(plain, steps_for=FF3_SKIP_STEPS, compare_steps=False)
    assert isinstance(report, RingOverrunReport)
    assert report.step > 2

    # With the labels compared, the simulator stops at the header broadcast (op #0).
    labelled = report_of(header_schedule(seed=0, validate_header=True), steps_for=FF3_SKIP_STEPS)
    assert isinstance(labelled, MismatchReport)
    assert (labelled.seq, labelled.step, labelled.differing) == (0, 2, (MismatchField.STEP,))
    assert (labelled.expected.shape, labelled.expected.dtype) == ((2,), DType.INT32)


def test_ff3_header_a_skip_that_changes_the_shape_is_still_named_as_a_step() -> None:
    # Seed 1: the skipped step has 4 rows, the sender's next one 3: without the header
    # the wire reports only that shapes differ.
    plain = report_of(
        header_schedule(seed=1, validate_header=False),
        steps_for=FF3_SKIP_STEPS,
        compare_steps=False,
    )
    assert isinstance(plain, MismatchReport)
    assert (plain.seq, plain.differing) == (0, (MismatchField.SHAPE,))
    assert plain.received is not None
    assert (plain.expected.shape, plain.received.shape) == ((4, 2), (3, 2))
    # The report shows the posts' labels (steps 2 and 3) though the wire ignored them.
    assert (plain.expected.step, plain.received.step) == (2, 3)

    error = header_error(
        header_schedule(seed=1, validate_header=True), steps_for=FF3_SKIP_STEPS, compare_steps=False
    )
    assert (error.rank, error.step, error.expected, error.received) == (0, 2, (2, 4), (3, 3))


def end_step_only_after_sending(config: RelayConfig, state: RelayState) -> Step[RelayState, None]:
    """The bug: the last stage ends the relay step only when it sent something, so its
    step counter falls behind the receivers' on every step where nothing sampled."""
    if not state.to_release:
        return Step(state, (), None)
    return end_step(config, state)


FF3_DRIFT_STEPS = only_on({1}, RankSteps(end_step=end_step_only_after_sending))


def test_ff3_header_a_drifting_step_counter_is_invisible_on_the_wire_but_not_to_the_header() -> (
    None
):
    plain = header_schedule(seed=0, validate_header=False)
    # Nothing on the wire differs: the run completes as the correct one does ...
    drifted = simulate_schedule(plain, steps_for=FF3_DRIFT_STEPS, compare_steps=False)
    assert drifted.outputs[0] == simulate_schedule(plain).outputs[0]

    # ... but the header carries the sender's counter, two steps behind at step 2.
    error = header_error(
        header_schedule(seed=0, validate_header=True),
        steps_for=FF3_DRIFT_STEPS,
        compare_steps=False,
    )
    assert (error.rank, error.step, error.expected, error.received) == (0, 2, (2, 4), (0, 4))


def receive_sampling_rows_only(
    config: RelayConfig, state: RelayState, batch: BatchFacts
) -> Step[RelayState, bool]:
    """The bug: a receiver builds its batch from the rows that sample (its own view of
    the batch), so it counts fewer requests than the sender broadcasts."""
    mask = need_sampled_mask(batch)
    if mask is None or mask.all():
        return receive(config, state, batch)
    rows = BatchFacts(
        idx_mapping=batch.idx_mapping[mask],
        num_computed_tokens=batch.num_computed_tokens[mask],
        num_scheduled_tokens=batch.num_scheduled_tokens[mask],
        prefill_len=batch.prefill_len[mask],
    )
    return receive(config, state, rows)


FF4_COUNT_STEPS = only_on({0}, RankSteps(receive=receive_sampling_rows_only))


def test_ff4_header_a_receiver_counting_other_requests_is_named_at_the_header() -> None:
    plain = report_of(header_schedule(seed=0, validate_header=False), steps_for=FF4_COUNT_STEPS)
    # Without the header: a shape mismatch at the sampled tokens, [1, 2] against [4, 2].
    assert isinstance(plain, MismatchReport)
    assert (plain.seq, plain.step, plain.differing) == (0, 2, (MismatchField.SHAPE,))
    assert plain.received is not None
    assert (plain.expected.shape, plain.received.shape) == ((1, 2), (4, 2))

    for compare_steps in (True, False):
        error = header_error(
            header_schedule(seed=0, validate_header=True),
            steps_for=FF4_COUNT_STEPS,
            compare_steps=compare_steps,
        )
        assert (error.rank, error.step, error.expected, error.received) == (0, 2, (2, 1), (2, 4))
        assert "different batches" in error.problem
        assert "rank 0 received relay header [step 2, 4 requests] at step 2" in str(error)


@pytest.mark.parametrize("seed", [0, 1, 3])
def test_the_correct_program_passes_with_the_header_in_both_matching_modes(seed: int) -> None:
    schedule = header_schedule(seed=seed, validate_header=True)
    expected = simulate_schedule(header_schedule(seed=seed, validate_header=False)).outputs
    for compare_steps in (True, False):
        assert simulate_schedule(schedule, compare_steps=compare_steps).outputs == expected


# ---- FF8: a free path that forgets to bump the generation ----------------------------------


def free_without_bump(
    config: RelayConfig, state: RelayState, slots: object
) -> Step[RelayState, None]:
    """The field bug: the slot is released to the scheduler, the relay never hears of it."""
    return Step(state, (), None)


def test_ff8_a_free_without_a_generation_bump_lets_stale_tokens_reach_reused_slots() -> None:
    schedule = schedule_of(pp=3, dp_size=1, spec=2, seed=3)
    correct = simulate_schedule(schedule)
    broken = simulate_schedule(schedule, steps_for=lambda rank: RankSteps(free=free_without_bump))

    # The wire schedule does not change (the bug is silent to every collective) ...
    assert broken.simulation.effects[2] == correct.simulation.effects[2]
    # ... but stage 0 applies tokens of requests whose slots were freed and reused.
    good, bad = correct.outputs[0].consumed, broken.outputs[0].consumed
    assert bad != good
    stale = stale_rows(schedule, broken)
    assert stale, "no stale row reached a reused slot"
    for step, slot in stale:
        kept = next(c for c in bad if c.step == step)
        dropped = next((c for c in good if c.step == step), None)
        assert slot in kept.idx_mapping
        assert dropped is None or slot not in dropped.idx_mapping
        # The stale drafts overwrite the new request's row of the draft table.
        assert kept.drafts_table is not None


def stale_rows(schedule: Schedule, run: ScriptedRun) -> list[tuple[int, int]]:
    """(consume step, slot) of every row applied although its slot was freed in flight."""
    stale = []
    for consumed in run.outputs[0].consumed:
        between = range(consumed.received_at_step + 1, consumed.step)
        freed = {slot for s in between for slot in schedule.at(s, 0).freed}
        stale += [(consumed.step, slot) for slot in consumed.idx_mapping if slot in freed]
    return stale


# ---- FF5: the caller's draft table freed under the relay stream's gather ---------------------


def drafts_without_record_stream(
    config: RelayConfig, state: RelayState, batch: BatchFacts, drafts: TensorSpec
) -> Step[RelayState, bool]:
    """The bug: nothing records the per-step draft table on the relay stream."""
    sent = broadcast_drafts(config, state, batch, drafts)
    kept = tuple(
        e
        for e in sent.effects
        if not (isinstance(e, RecordStream) and e.buffer == config.inputs.draft_table)
    )
    return attrs.evolve(sent, effects=kept)


def test_ff5_a_draft_table_freed_before_the_relay_gathered_it_sends_garbage() -> None:
    schedule = schedule_of(pp=2, dp_size=1, spec=1)
    broken = simulate_schedule(
        schedule, steps_for=lambda rank: RankSteps(broadcast_drafts=drafts_without_record_stream)
    )
    violations = broken.simulation.interpreter(1).lifetime_violations
    assert violations
    assert {(v.buffer, v.used_on) for v in violations} == {(DRAFT_TABLE, (Stream.RELAY,))}
    tables = [c.drafts_table for c in broken.outputs[0].consumed]
    assert any(POISON in row for table in tables if table is not None for row in table)

    correct = simulate_schedule(schedule)
    assert correct.simulation.interpreter(1).lifetime_violations == ()


# ---- FF13: `purepp check` over logs recorded from a broken run -----------------------------


@pytest.mark.parametrize(
    ("world", "steps_for"),
    [((3, 1, 2), FF1_STEPS), ((2, 2, 0), FF10_STEPS), ((2, 1, 1), FF3_STEPS)],
    ids=["ff1", "ff10", "ff3"],
)
def test_ff13_purepp_check_points_at_the_op_the_simulator_stopped_at(
    tmp_path: Path, world: tuple[int, int, int], steps_for: Callable[[int], RankSteps]
) -> None:
    pp, dp_size, spec = world
    schedule = schedule_of(pp=pp, dp_size=dp_size, spec=spec)
    simulated = report_of(schedule, steps_for=steps_for)
    assert isinstance(simulated, MismatchReport)
    dump_logs(record_scripted_logs(schedule, steps_for=steps_for), tmp_path)

    out = io.StringIO()
    assert check_log_dir(tmp_path, out) == 1

    assert out.getvalue().strip() == simulated.render()
    where = f"op #{simulated.seq} on {simulated.comm.value}"
    assert where in out.getvalue()
    assert f"step {simulated.step}, {simulated.op.value}" in out.getvalue()


@pytest.mark.parametrize(
    "world",
    [(3, 1, 2, 0), (2, 2, 0, 0), (2, 1, 1, 0), (3, 1, 2, 3)],
    ids=["ff1", "ff10", "ff3-ff5", "ff8"],
)
def test_the_correct_program_passes_every_field_failure_schedule(
    tmp_path: Path, world: tuple[int, int, int, int]
) -> None:
    pp, dp_size, spec, seed = world
    schedule = schedule_of(pp=pp, dp_size=dp_size, spec=spec, seed=seed)
    run = simulate_schedule(schedule)
    assert all(i.lifetime_violations == () for i in run.simulation.interpreters)
    assert all(
        POISON not in row
        for outputs in run.outputs
        for consumed in outputs.consumed
        for row in (*consumed.sampled_tokens, *(consumed.drafts_table or ()))
    )
    dump_logs(record_scripted_logs(schedule), tmp_path)
    assert check_log_dir(tmp_path, io.StringIO()) == 0


def test_need_sampled_mask_is_shared_so_sender_and_receivers_agree() -> None:
    # FF4's fix: both sides gate on the mask of the same replicated batch.
    schedule = schedule_of(pp=2, dp_size=1, spec=1)
    run = simulate_schedule(schedule)
    sends = [e.step for e in run.simulation.effects[1] if isinstance(e, Broadcast)]
    posts = [e.step for e in run.simulation.effects[0] if isinstance(e, Broadcast)]
    assert sends == posts
    assert sorted(set(sends)) == [
        s for s in range(STEPS) if need_sampled_mask(schedule.at(s, 0).batch) is not None
    ]


# ---- FF6: no receive is posted that its own step's send does not match ---------------------


@pytest.mark.parametrize(("pp", "spec"), [(2, 0), (3, 2), (4, 1)])
def test_ff6_every_relay_receive_is_matched_by_a_send_of_the_same_step(pp: int, spec: int) -> None:
    """A receive posted on the side stream waits for its send; purepp posts one only in
    the step whose send matches it, so no receive outlives its step window."""
    run = simulate_schedule(schedule_of(pp=pp, dp_size=1, spec=spec))
    by_rank = run.simulation.effects
    relay = [
        [e for e in by_rank[rank] if isinstance(e, Broadcast) and e.comm is Communicator.PP_RELAY]
        for rank in range(pp)
    ]
    sender = relay[pp - 1]
    assert sender  # the schedule relays something
    for receiver in relay[: pp - 1]:
        assert len(receiver) == len(sender)
        assert [e.step for e in receiver] == [e.step for e in sender]
        assert {e.op for e in receiver} == {Op.RECEIVE}
