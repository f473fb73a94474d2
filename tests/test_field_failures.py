"""Field failures (the README's FF1 to FF17) reproduced with the real pure steps, and caught.

Each broken variant is a small wrapper around a real pure step that alters its
effects or its inputs the way the field bug did, swapped into the scripted rank
program for the ranks that had the bug. The simulator (or `purepp check` over the
recorded logs) must stop at the op that diverged and say precisely where; the
correct program must run the same schedule cleanly.
"""

from __future__ import annotations

import datetime
import enum
import functools
import io
import tempfile
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any, TypeAlias

import attrs
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from purepp import dp
from purepp.batch import BatchFacts, need_sampled_mask
from purepp.cudagraph import CaptureMode, CudaGraphDispatcher, CUDAGraphMode, Dispatcher
from purepp.effects.arrays import IntArray
from purepp.effects.checker import check_log_dir, check_logs
from purepp.effects.log import Recorder, dump_logs
from purepp.effects.matching import (
    CollectiveKind,
    CollectiveReportError,
    MismatchField,
    MismatchReport,
    Report,
    RingOverrunReport,
    StageAgreements,
    StageDivergenceReport,
)
from purepp.effects.numpy_interpreter import POISON, PostedCollective
from purepp.effects.scheduler import CollectiveHub
from purepp.effects.simulator import RankContext, RankProgram, simulate
from purepp.effects.torch_interpreter import TorchInterpreter, build_communicators
from purepp.effects.vocabulary import (
    Alias,
    AllReduce,
    Broadcast,
    BufferRef,
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
from purepp.layout import Layout
from purepp.rank import (
    RankConfig,
    RankDriver,
    RankSteps,
    Sampled,
    ShapeFacts,
    agree,
    begin,
    finish,
    init_rank,
    perform_phase,
    settle,
    start_agreement_phase,
)
from purepp.relay import (
    RelayConfig,
    RelayState,
    Wire,
    broadcast_drafts,
    broadcast_sampled,
    end_step,
    free_request_slot,
    free_request_slots,
    receive,
)
from purepp.runner.cli import main as cli_main
from purepp.step import Step
from purepp.testing import (
    CAPTURE_SIZES,
    NumpyTensors,
    RankOutputs,
    RecordingTensors,
    Schedule,
    ScheduleConfig,
    ScriptedIO,
    ScriptedRun,
    TorchTensors,
    drive,
    make_schedule,
    record_scripted_logs,
    scripted_header,
    scripted_rank_effects,
    simulate_schedule,
)
from tests._dist import RankContext as ProcessContext
from tests._dist import run_ranks

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


# ---- FF7: the stages of one replica decide their mode from facts of their own ----------------
#
# In a PP x DP world each stage agrees its batch shape over its own DP group (the same
# stage across the replicas: ranks (0, 2) and (1, 3) in pp=2, dp=2). The stages of one
# replica are given the same batch, so they contribute the same column and decide the
# same mode and padded token count. A stage-local fact in one stage's column (need_eager
# on that stage, graphs it captured for fewer sizes) matches every collective of the
# agreement, yet the stages run different shapes and the activations passed between them
# never meet. The simulator and `purepp check` compare the stages' columns.

# A stage-local fact: what rank `rank` hands its agreement at `step` in place of the
# replicated dispatcher and batch.
LocalFact = Callable[[int, int, Dispatcher, dp.RankBatch], tuple[Dispatcher, dp.RankBatch]]


def no_local_fact(
    rank: int, step: int, dispatcher: Dispatcher, batch: dp.RankBatch
) -> tuple[Dispatcher, dp.RankBatch]:
    return dispatcher, batch


def eager_on(ranks: set[int], steps: set[int]) -> LocalFact:
    """The field bug: `ranks` force eager at `steps` from a fact of their own (a profile
    run on that stage, graphs it has not captured yet); their pipeline peers do not."""

    def fact(
        rank: int, step: int, dispatcher: Dispatcher, batch: dp.RankBatch
    ) -> tuple[Dispatcher, dp.RankBatch]:
        if rank in ranks and step in steps:
            return dispatcher, attrs.evolve(batch, need_eager=True)
        return dispatcher, batch

    return fact


def fewer_capture_sizes_on(stage: int, world: Layout) -> LocalFact:
    """The field bug: one stage's dispatcher captured graphs for fewer sizes (1, 2, 4)."""

    def fact(
        rank: int, step: int, dispatcher: Dispatcher, batch: dp.RankBatch
    ) -> tuple[Dispatcher, dp.RankBatch]:
        if world.pp_stage(rank) != stage or not isinstance(dispatcher, CudaGraphDispatcher):
            return dispatcher, batch
        return attrs.evolve(dispatcher, capture_sizes=(1, 2, 4)), batch

    return fact


def with_local_fact(
    rank: int, fact: LocalFact, *, over_pipeline: Layout | None = None
) -> RankSteps:
    """Rank `rank`'s steps with `fact` in its agreement; with `over_pipeline`, the stages
    of its replica agree with each other over PP_CPU instead (purepp's fix, as in the
    README example)."""

    def start(
        lanes: dp.AgreementLanes,
        group: dp.AgreementGroup,
        dispatcher: Dispatcher | None,
        batch: dp.RankBatch,
        *,
        step: int,
        lane: dp.Lane = dp.Lane.TARGET,
        asynchronous: bool = False,
    ) -> dp.AgreementStarted:
        assert dispatcher is not None  # the scripted world always passes one
        dispatcher, batch = fact(rank, step, dispatcher, batch)
        if over_pipeline is not None:
            group = attrs.evolve(
                group,
                dp_size=over_pipeline.pp,
                dp_rank=over_pipeline.pp_stage(rank),
                comm=Communicator.PP_CPU,
            )
        return dp.start_agreement(
            lanes, group, dispatcher, batch, step=step, lane=lane, asynchronous=asynchronous
        )

    return RankSteps(start_agreement=start)


def local_steps(
    fact: LocalFact, *, over_pipeline: Layout | None = None
) -> Callable[[int], RankSteps]:
    return lambda rank: with_local_fact(rank, fact, over_pipeline=over_pipeline)


def contribution_of(schedule: Schedule, fact: LocalFact, rank: int, step: int) -> IntArray:
    """What rank `rank` contributes to its DP group's agreement of `step` (the oracle: the
    pure agreement on the batch the scripted rank hands it)."""
    world = schedule.world
    replica = world.dp_index(rank)
    planned = schedule.at(step, replica)
    batch = dp.RankBatch(
        num_reqs=planned.batch.num_reqs,
        num_tokens=planned.num_tokens,
        uniform_token_count=planned.uniform_token_count,
    )
    dispatcher, batch = fact(rank, step, schedule.dispatcher(), batch)
    group = schedule.agreement_group(replica)
    started = dp.start_agreement(dp.AgreementLanes(), group, dispatcher, batch, step=step)
    assert started.result.contribution is not None  # dp > 1: an all-reduce
    return started.result.contribution


def stage_columns(schedule: Schedule, fact: LocalFact, step: int, replica: int) -> list[list[int]]:
    world = schedule.world
    return [
        contribution_of(schedule, fact, rank, step)[:, replica].tolist()
        for rank in world.pipeline(replica)
    ]


def first_divergence(schedule: Schedule, fact: LocalFact) -> tuple[int, set[int]] | None:
    """The first step at which some replica's stages contribute different columns, and
    which replicas' do; None when they never do."""
    for step in range(schedule.config.steps):
        diverged = {
            replica
            for replica in range(schedule.config.dp)
            if len({tuple(c) for c in stage_columns(schedule, fact, step, replica)}) > 1
        }
        if diverged:
            return step, diverged
    return None


def assert_names_the_divergence(
    report: Report, schedule: Schedule, fact: LocalFact
) -> StageDivergenceReport:
    found = first_divergence(schedule, fact)
    assert found is not None
    step, replicas = found
    assert isinstance(report, StageDivergenceReport)
    assert (report.step, report.replica) == (step, min(replicas))
    assert (report.lane, report.comm, report.op) == ("target", Communicator.DP_CPU, Op.AGREE)
    world = schedule.world
    assert report.pipeline == world.pipeline(report.replica)
    expected = stage_columns(schedule, fact, step, report.replica)
    assert len(report.columns) >= 2
    for column in report.columns:
        assert column.rank == report.pipeline[column.stage]
        assert list(column.column) == expected[column.stage]
    return report


def captured_step(schedule: Schedule, replica: int) -> int:
    """A step at which `replica` runs a captured graph (tokens within the capture sizes)."""
    return next(
        s for s in range(STEPS) if 0 < schedule.at(s, replica).num_tokens <= max(CAPTURE_SIZES)
    )


@pytest.mark.parametrize("microbatch", [False, True], ids=["seed-table", "six-row-table"])
def test_ff7_a_stage_that_forces_eager_on_its_own_is_named_with_replica_step_lane_and_columns(
    microbatch: bool,
) -> None:
    config = ScheduleConfig(pp=2, dp=2, spec=0, steps=STEPS, seed=0, microbatch=microbatch)
    schedule = make_schedule(config)
    step = captured_step(schedule, replica=1)
    planned = schedule.at(step, 1)
    fact = eager_on({3}, {step})  # stage 1 of replica 1

    report = assert_names_the_divergence(
        report_of(schedule, steps_for=local_steps(fact)), schedule, fact
    )

    assert (report.replica, report.pipeline, report.step) == (1, (2, 3), step)
    layout = schedule.agreement_group(1).layout
    rows = report.rows
    assert len(rows) == layout.rows
    assert (rows[dp.ROW_NUM_TOKENS], rows[dp.ROW_CG_MODE]) == ("num_tokens", "cg_mode")
    assert rows[layout.row_num_reqs] == "num_reqs"
    assert ("allow_ubatching" in rows) == microbatch
    if microbatch:
        assert rows[dp.ROW_ALLOW_UBATCHING] == "allow_ubatching"
    stage0, stage1 = report.columns
    assert (stage0.rank, stage0.stage, stage1.rank, stage1.stage) == (2, 0, 3, 1)
    assert stage0.column[dp.ROW_NUM_TOKENS] == stage1.column[dp.ROW_NUM_TOKENS]
    assert stage0.column[dp.ROW_NUM_TOKENS] == planned.num_tokens
    assert stage0.column[dp.ROW_CG_MODE] != CUDAGraphMode.NONE
    assert stage1.column[dp.ROW_CG_MODE] == CUDAGraphMode.NONE
    assert report.differing == ("cg_mode",)

    text = report.render()
    mode = CUDAGraphMode(stage0.column[dp.ROW_CG_MODE]).name
    assert text.startswith(
        f"Stage divergence: replica 1 (ranks 2, 3), step {step}, target lane"
        " (all_reduce on dp_cpu, agree)"
    )
    assert f"rank 2 (stage 0) contributed num_tokens={planned.num_tokens}, cg_mode=" in text
    assert f"cg_mode={stage0.column[dp.ROW_CG_MODE]} ({mode})" in text
    assert "rank 3 (stage 1) contributed" in text
    assert "cg_mode=0 (NONE)" in text
    assert "they differ in: cg_mode" in text
    assert "Communicator.PP_CPU" in report.fix()


def test_ff7_a_stage_with_fewer_capture_sizes_diverges_at_the_first_step_they_matter() -> None:
    schedule = schedule_of(pp=2, dp_size=2, spec=0)
    fact = fewer_capture_sizes_on(1, schedule.world)

    with pytest.raises(CollectiveReportError) as caught:
        simulate_schedule(schedule, steps_for=local_steps(fact))

    report = assert_names_the_divergence(caught.value.report, schedule, fact)
    # Tokens past the smaller capture sizes but within the others: stage 0 runs a graph.
    tokens = schedule.at(report.step, report.replica).num_tokens
    assert 4 < tokens <= max(CAPTURE_SIZES)
    assert report.differing == ("cg_mode",)
    assert str(caught.value).startswith(f"simulate: Stage divergence: replica {report.replica}")
    assert "Fix: decide every value of the column from facts replicated" in str(caught.value)


class StageTables(RecordingTensors):
    """The recording seam with each stage's own DP tables: the reduction its DP group
    gives when every rank contributes what `fact` makes it (a full log of a run with
    stage-local facts, which the schedule's one table cannot give)."""

    def __init__(self, schedule: Schedule, rank: int, fact: LocalFact) -> None:
        super().__init__(schedule)
        self._schedule, self._fact = schedule, fact
        self._group = schedule.world.replicas(schedule.world.pp_stage(rank))

    def host_table(self, ref: BufferRef, /) -> IntArray:
        step = int(ref.name.split(".step")[1].split(".")[0])
        tables = [contribution_of(self._schedule, self._fact, r, step) for r in self._group]
        reduced: IntArray = np.sum(tables, axis=0, dtype=np.int32)
        return reduced


def record_with(schedule: Schedule, fact: LocalFact, directory: Path) -> tuple[RankOutputs, ...]:
    """Every rank's run of `schedule` with `fact`, recorded to `directory` as
    `purepp run --log-dir` writes it; the ranks' outputs."""
    logs, outputs = [], []
    for rank in range(schedule.world.world_size):
        recorder = Recorder(scripted_header(schedule, rank))
        program = scripted_rank_effects(
            schedule, rank, StageTables(schedule, rank, fact), with_local_fact(rank, fact)
        )
        outputs.append(drive(program, recorder))
        logs.append(recorder.log)
    dump_logs(logs, directory)
    return tuple(outputs)


def test_ff7_purepp_check_names_the_divergence_in_recorded_logs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    schedule = schedule_of(pp=2, dp_size=2, spec=0)
    step = captured_step(schedule, replica=1)
    fact = eager_on({3}, {step})
    simulated = report_of(schedule, steps_for=local_steps(fact))

    outputs = record_with(schedule, fact, tmp_path / "broken")
    # The mistake itself: the recorded stages of replica 1 ran different shapes at `step`.
    assert outputs[2].agreed[step] != outputs[3].agreed[step]
    assert outputs[3].agreed[step].cg_mode is CUDAGraphMode.NONE

    checked = check_logs(tmp_path / "broken")
    assert (checked.ok, checked.exit_code) == (False, 1)
    assert checked.finding is not None
    assert assert_names_the_divergence(checked.finding, schedule, fact) == simulated
    assert checked.text == simulated.render()

    assert cli_main(["check", str(tmp_path / "broken")]) == 1
    assert capsys.readouterr().out.strip() == simulated.render()

    # The same schedule with no stage-local fact: every column agrees.
    record_with(schedule, no_local_fact, tmp_path / "correct")
    assert check_logs(tmp_path / "correct").exit_code == 0


@pytest.mark.parametrize(
    ("pp", "dp_size", "microbatch"), [(2, 2, False), (3, 2, False), (2, 3, True)]
)
def test_ff7_purepps_own_program_gives_the_stages_of_a_replica_one_decision(
    pp: int, dp_size: int, microbatch: bool
) -> None:
    config = ScheduleConfig(pp=pp, dp=dp_size, spec=1, steps=STEPS, seed=0, microbatch=microbatch)
    schedule = make_schedule(config)
    world = schedule.world

    # Every stage decides from the replicated batch: one column, one decision per replica.
    run = simulate_schedule(schedule)
    for replica in range(dp_size):
        stages = [run.outputs[rank].agreed for rank in world.pipeline(replica)]
        assert all(agreed == stages[0] for agreed in stages)
    assert first_divergence(schedule, no_local_fact) is None

    # One stage-local fact on the last stage of the last replica is caught.
    last = world.rank_of(pp_stage=pp - 1, dp_index=dp_size - 1)
    fact = eager_on({last}, {captured_step(schedule, dp_size - 1)})
    assert_names_the_divergence(report_of(schedule, steps_for=local_steps(fact)), schedule, fact)


def test_ff7_stages_that_agree_over_the_pipeline_decide_alike_despite_a_stage_local_fact() -> None:
    schedule = schedule_of(pp=2, dp_size=2, spec=0)
    world = schedule.world
    step = captured_step(schedule, replica=1)
    fact = eager_on({3}, {step})

    # Over DP groups, stage 1's own fact splits replica 1 ...
    report = report_of(schedule, steps_for=local_steps(fact))
    assert isinstance(report, StageDivergenceReport)
    assert (report.replica, report.step) == (1, step)

    # ... over the pipeline (PP_CPU, as the README example), both stages read one table:
    # the columns differ by design, nothing is reported, and both run eager at `step`.
    run = simulate_schedule(schedule, steps_for=local_steps(fact, over_pipeline=world))
    for replica in range(world.dp):
        stage0, stage1 = (run.outputs[rank].agreed for rank in world.pipeline(replica))
        assert stage0 == stage1
    assert run.outputs[3].agreed[step].cg_mode is CUDAGraphMode.NONE
    assert all(
        e.comm is Communicator.PP_CPU
        for effects in run.simulation.effects
        for e in effects
        if isinstance(e, AllReduce)
    )


def agreement(rank_column: list[int], *, replica: int, step: int, lane: dp.Lane) -> AllReduce:
    """An all-reduce of a seed-table contribution in a dp=2 world."""
    table = np.zeros((dp.TABLE_ROWS, 2), dtype=np.int32)
    table[:, replica] = rank_column
    comm = Communicator.DP_CPU if lane is dp.Lane.TARGET else Communicator.DP_DRAFTER_CPU
    return AllReduce(
        step=step,
        op=Op.AGREE,
        contribution=table,
        result=BufferRef(f"dp.{lane.value}.step{step}.table"),
        comm=comm,
        work=None,
    )


WORKING = [8, int(CUDAGraphMode.FULL), 1, -1, 8]  # a uniform decode of 8 requests
EAGER = [8, int(CUDAGraphMode.NONE), 1, -1, 8]  # the same batch, forced eager
IDLE = [0, int(CUDAGraphMode.NONE), 0, -1, 0]  # the neutral column of an idle rank


TARGET, DRAFTER = dp.Lane.TARGET, dp.Lane.DRAFTER
FF7_WORLD = Layout(pp=2, dp=2)  # replica 1: stage 0 is rank 2, stage 1 is rank 3


def test_ff7_the_target_and_drafter_lanes_are_never_compared_with_each_other() -> None:
    stages = StageAgreements(FF7_WORLD)
    for rank in (0, 1):  # replica 0 agrees on both lanes
        for lane in (TARGET, DRAFTER):
            assert stages.post(rank, agreement(WORKING, replica=0, step=4, lane=lane)) is None
    assert stages.post(2, agreement(WORKING, replica=1, step=4, lane=TARGET)) is None
    assert stages.post(3, agreement(EAGER, replica=1, step=4, lane=DRAFTER)) is None
    assert stages.post(3, agreement(WORKING, replica=1, step=4, lane=TARGET)) is None
    found = stages.post(2, agreement(IDLE, replica=1, step=4, lane=DRAFTER))

    assert isinstance(found, StageDivergenceReport)
    assert (found.replica, found.step, found.lane) == (1, 4, "drafter")
    assert found.comm is Communicator.DP_DRAFTER_CPU
    assert [(c.rank, c.column) for c in found.columns] == [(2, tuple(IDLE)), (3, tuple(EAGER))]
    assert found.differing == ("num_tokens", "uniform_token_count", "num_reqs")
    assert "drafter lane (all_reduce on dp_drafter_cpu, agree)" in found.render()


def test_ff7_idle_absent_single_stage_and_pipeline_agreements_are_no_divergence() -> None:
    # Idle stages contribute the neutral column; a whole idle replica agrees with itself ...
    stages = StageAgreements(FF7_WORLD)
    assert stages.post(0, agreement(IDLE, replica=0, step=0, lane=TARGET)) is None
    assert stages.post(1, agreement(IDLE, replica=0, step=0, lane=TARGET)) is None
    # ... and one stage idle where the other works is a divergence.
    found = stages.post(1, agreement(WORKING, replica=0, step=1, lane=TARGET))
    assert found is None
    found = stages.post(0, agreement(IDLE, replica=0, step=1, lane=TARGET))
    assert found is not None
    assert found.differing == ("num_tokens", "cg_mode", "uniform_token_count", "num_reqs")

    # A stage that never posts (it died) is compared with nothing; the other runs on.
    stages = StageAgreements(FF7_WORLD)
    for step in range(3000):
        assert stages.post(2, agreement(WORKING, replica=1, step=step, lane=TARGET)) is None
    assert stages.held is None

    # An agreement over PP_CPU spans the stages already: their columns differ by design.
    stages = StageAgreements(FF7_WORLD)
    for rank in (0, 1):
        over_pp = attrs.evolve(
            agreement(WORKING if rank == 0 else EAGER, replica=rank, step=0, lane=TARGET),
            comm=Communicator.PP_CPU,
        )
        assert stages.post(rank, over_pp) is None

    # With one stage per replica there is nothing to compare.
    solo = StageAgreements(Layout(pp=1, dp=2))
    assert solo.post(0, agreement(WORKING, replica=0, step=0, lane=TARGET)) is None
    assert solo.post(1, agreement(EAGER, replica=1, step=0, lane=TARGET)) is None


def test_ff7_a_divergence_waits_for_earlier_agreements_a_stage_behind_has_not_posted() -> None:
    # Replica 1's stage 1 runs behind: a divergence at step 5 in replica 0 waits while
    # replica 1's step 4 is incomplete, and gives way to the one found there.
    stages = StageAgreements(FF7_WORLD)
    for rank in (0, 1):
        assert stages.post(rank, agreement(WORKING, replica=0, step=4, lane=TARGET)) is None
    assert stages.post(2, agreement(WORKING, replica=1, step=4, lane=TARGET)) is None
    assert stages.post(2, agreement(WORKING, replica=1, step=5, lane=TARGET)) is None
    assert stages.post(0, agreement(WORKING, replica=0, step=5, lane=TARGET)) is None
    assert stages.post(1, agreement(EAGER, replica=0, step=5, lane=TARGET)) is None
    held = stages.held
    assert held is not None
    assert (held.replica, held.step) == (0, 5)
    first = stages.post(3, agreement(EAGER, replica=1, step=4, lane=TARGET))
    assert first is not None
    assert (first.replica, first.step) == (1, 4)

    # A divergence nothing can precede is returned at once ...
    stages = StageAgreements(FF7_WORLD)
    assert stages.post(0, agreement(WORKING, replica=0, step=0, lane=TARGET)) is None
    found = stages.post(1, agreement(EAGER, replica=0, step=0, lane=TARGET))
    assert found is not None
    assert (found.replica, found.step, found.differing) == (0, 0, ("cg_mode",))

    # ... and one in replica 1 once replica 0's stages have posted that step too (its
    # stages may post after replica 1's did, and a divergence there comes first).
    stages = StageAgreements(FF7_WORLD)
    assert stages.post(2, agreement(WORKING, replica=1, step=0, lane=TARGET)) is None
    assert stages.post(3, agreement(EAGER, replica=1, step=0, lane=TARGET)) is None
    assert stages.post(0, agreement(WORKING, replica=0, step=0, lane=TARGET)) is None
    found = stages.post(1, agreement(WORKING, replica=0, step=0, lane=TARGET))
    assert found is not None
    assert (found.replica, found.step) == (1, 0)


def both_lanes(eager_drafter: set[tuple[int, int]]) -> RankProgram:
    """Every rank agrees each step's target shape, then the drafter's afresh on its own
    lane (no reused sync); the drafter of (rank, step) in `eager_drafter` forces eager."""
    dispatcher = CudaGraphDispatcher(
        capture_sizes=CAPTURE_SIZES, capture_mode=CaptureMode.FULL, max_num_reqs=4
    )

    def program(context: RankContext) -> Iterator[tuple[Effect, ...]]:
        group = dp.AgreementGroup(dp_size=context.world.dp, dp_rank=context.replica)
        lanes = dp.AgreementLanes()
        for step in range(3):
            for lane in (TARGET, DRAFTER):
                eager = lane is DRAFTER and (context.rank, step) in eager_drafter
                batch = dp.RankBatch(num_reqs=2, num_tokens=2, need_eager=eager)
                started = dp.start_agreement(lanes, group, dispatcher, batch, step=step, lane=lane)
                yield started.effects
                assert started.result.table is not None
                table = context.interpreter.host_array(started.result.table)
                finished = dp.finish_agreement(started.state, started.result, table)
                yield finished.effects
                lanes = finished.state

    return program


def test_ff7_a_drafter_that_forces_eager_on_one_stage_is_named_on_the_drafter_lane() -> None:
    world = FF7_WORLD
    simulate(world, both_lanes(set()))  # every stage's drafter agrees: nothing to report

    with pytest.raises(CollectiveReportError) as caught:
        simulate(world, both_lanes({(1, 1), (3, 1)}))  # stage 1's drafters, at step 1

    report = caught.value.report
    assert isinstance(report, StageDivergenceReport)
    assert (report.replica, report.step, report.lane) == (0, 1, "drafter")
    assert report.comm is Communicator.DP_DRAFTER_CPU
    assert [c.rank for c in report.columns] == [0, 1]
    assert report.differing == ("cg_mode",)
    assert "step 1, drafter lane (all_reduce on dp_drafter_cpu, agree)" in report.render()


def posted(rank: int, effect: AllReduce) -> PostedCollective:
    return PostedCollective(rank, effect, np.empty(0))


def test_ff7_the_hub_both_drivers_share_raises_the_divergence() -> None:
    hub = CollectiveHub(FF7_WORLD, call="check", move_data=False)
    hub.post(posted(0, agreement(WORKING, replica=0, step=0, lane=TARGET)))
    with pytest.raises(CollectiveReportError) as caught:
        hub.post(posted(1, agreement(EAGER, replica=0, step=0, lane=TARGET)))
    assert isinstance(caught.value.report, StageDivergenceReport)
    assert caught.value.report.replica == 0

    # A divergence held for a stage that never posts is raised when the run ends.
    hub = CollectiveHub(FF7_WORLD, call="check", move_data=False)
    # (Rank 1, stage 1 of replica 0, never posts: replica 0 may still diverge first.)
    posts = ((0, WORKING, 0), (0, WORKING, 1), (2, WORKING, 0), (2, WORKING, 1), (3, EAGER, 1))
    for rank, column, step in posts:
        made = agreement(column, replica=FF7_WORLD.dp_index(rank), step=step, lane=TARGET)
        hub.post(posted(rank, made))
    with pytest.raises(CollectiveReportError) as caught:
        hub.raise_held()
    assert isinstance(caught.value.report, StageDivergenceReport)
    assert (caught.value.report.replica, caught.value.report.step) == (1, 1)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 3),
    pp=st.sampled_from([2, 3]),
    dp_size=st.sampled_from([2, 3]),
    eager=st.sets(st.tuples(st.integers(0, 8), st.integers(0, 7)), max_size=4),
)
def test_ff7_a_report_appears_iff_some_replicas_stages_contribute_different_columns(
    seed: int, pp: int, dp_size: int, eager: set[tuple[int, int]]
) -> None:
    """Random stage-local facts (rank, step: forced eager): the simulator and `purepp
    check` report the first divergence (step, then replica), and only when some
    replica's stages contribute different columns."""
    schedule = make_schedule(ScheduleConfig(pp=pp, dp=dp_size, spec=0, steps=8, seed=seed))
    flagged = {(rank % schedule.world.world_size, step) for rank, step in eager}

    def fact(
        rank: int, step: int, dispatcher: Dispatcher, batch: dp.RankBatch
    ) -> tuple[Dispatcher, dp.RankBatch]:
        if (rank, step) in flagged:
            return dispatcher, attrs.evolve(batch, need_eager=True)
        return dispatcher, batch

    with tempfile.TemporaryDirectory() as directory:
        record_with(schedule, fact, Path(directory))
        checked = check_logs(directory)
    if first_divergence(schedule, fact) is None:
        simulate_schedule(schedule, steps_for=local_steps(fact))
        assert checked.exit_code == 0
    else:
        simulated = report_of(schedule, steps_for=local_steps(fact))
        assert_names_the_divergence(simulated, schedule, fact)
        assert checked.finding == simulated


# ---- FF15: a reused slot inherits its old request's per-slot drafts ---------------------------
#
# With speculation, every non-last stage's consume writes the kept rows' drafts into the
# caller's [max_num_reqs, spec] table by slot. A row of a request whose slot was freed
# while its tokens were in flight must not be written: the slot's next request would
# start from the old request's drafts (vllm#48132 did this with the accepted-token count).
# The expected table is computed from who holds each slot (request identities), never
# from the relay's generations, and compared after every step's consume on every stage.


DraftTable: TypeAlias = npt.NDArray[np.int64]  # [max_num_reqs, spec] by slot


class FreeAt(enum.IntEnum):
    """Where in a step slots are freed; the value orders it among the step's points."""

    BEFORE_CONSUME = 0  # between steps: just before this step's consume
    AFTER_CONSUME = 2  # after the consume, before the batch (where the rank step frees)
    AFTER_RECEIVE = 4  # right after this step's receive, before the step ends


FF15_CONSUME, FF15_BATCH = 1, 3  # the reference model's other points of a step


class FreeKind(enum.Enum):
    """Every way the relay or the rank step offers to free slots."""

    SLOT = "free_request_slot"  # one call per slot
    SLOTS = "free_request_slots"  # one call for every slot freed at that point
    AGREE = "agree(freed=...)"  # the rank step's agree, or RankDriver.agree
    SETTLE = "settle(freed=...)"  # the overlapped step's settle, or RankDriver.settle


DIRECT_KINDS = (FreeKind.SLOT, FreeKind.SLOTS)
PHASE_KINDS = (FreeKind.AGREE, FreeKind.SETTLE)  # free only after the consume


@attrs.frozen
class Free:
    step: int
    at: FreeAt
    slots: tuple[int, ...]
    kind: FreeKind


@attrs.frozen
class Row:
    slot: int
    request: int  # unique per scenario: a reused slot gets a new one
    samples: bool  # a decode (a token and drafts), or a non-final prefill chunk (nothing)


@attrs.frozen
class Scenario:
    pp: int
    spec: int
    max_num_reqs: int
    wire: Wire
    batches: tuple[tuple[Row, ...], ...]  # by step
    frees: tuple[Free, ...]

    @property
    def steps(self) -> int:
        return len(self.batches)

    def frees_at(self, step: int, at: FreeAt) -> list[Free]:
        return [f for f in self.frees if f.step == step and f.at is at]


PROMPT = 4  # every request's prompt length


def draft_of(request: int, step: int, column: int) -> int:
    """The draft `request` proposed at `step`: a table value names whose it is."""
    return 100_000 * (request + 1) + 100 * step + column + 1


def drafts_of(request: int, step: int, spec: int) -> list[int]:
    return [draft_of(request, step, column) for column in range(spec)]


def whose(row: DraftTable) -> str:
    value = int(row[0])
    if value == 0:
        return "nothing (never written)"
    return f"request {value // 100_000 - 1}'s drafts of step {value % 100_000 // 100}"


def ff15_config(scenario: Scenario, rank: int) -> RankConfig:
    return RankConfig(
        relay=RelayConfig.for_stage(
            pp_size=scenario.pp,
            stage=rank,
            max_num_reqs=scenario.max_num_reqs,
            num_speculative_steps=scenario.spec,
            wire=scenario.wire,
        ),
        dispatcher=CudaGraphDispatcher(
            capture_sizes=CAPTURE_SIZES,
            capture_mode=CaptureMode.FULL_AND_PIECEWISE,
            max_num_reqs=scenario.max_num_reqs,
            num_speculative_tokens=scenario.spec,
        ),
    )


def ff15_batch(scenario: Scenario, step: int) -> tuple[BatchFacts, ShapeFacts]:
    rows = scenario.batches[step]
    decode, chunk = (PROMPT, 1 + scenario.spec, PROMPT), (0, 1, PROMPT)
    facts = np.array([decode if r.samples else chunk for r in rows], np.int32).reshape(-1, 3)
    batch = BatchFacts(
        idx_mapping=np.array([r.slot for r in rows], np.int32),
        num_computed_tokens=facts[:, 0],
        num_scheduled_tokens=facts[:, 1],
        prefill_len=facts[:, 2],
    )
    uniform = 1 + scenario.spec if rows and all(r.samples for r in rows) else None
    return batch, ShapeFacts(num_tokens=int(facts[:, 1].sum()), uniform_token_count=uniform)


def ff15_sampled(scenario: Scenario, step: int) -> Sampled[npt.NDArray[Any]]:
    """The last stage's outputs: every batch row's drafts name its request and the step."""
    rows, spec = scenario.batches[step], scenario.spec
    n = len(rows)
    table = np.full((scenario.max_num_reqs, spec), -5, np.int64)  # never gathered
    for row in rows:
        table[row.slot] = drafts_of(row.request, step, spec)
    return Sampled(
        tokens=np.arange(n * (spec + 1), dtype=np.int64).reshape(n, spec + 1) + 1,
        num_sampled=np.ones(n, np.int32),
        num_rejected=np.full(n, spec, np.int32),
        draft_table=table,
    )


def expected_tables(scenario: Scenario) -> list[DraftTable]:
    """The draft table after each step's consume: a sampled row lands iff the request
    that sampled it still holds its slot when its entry is consumed, `pp` steps later."""
    table = np.zeros((scenario.max_num_reqs, scenario.spec), np.int64)
    holder: dict[int, int] = {}
    ended: set[int] = set()
    after: list[DraftTable] = []
    for step in range(scenario.steps):
        for point in range(5):
            if point == FF15_CONSUME:
                sent = step - scenario.pp
                for row in scenario.batches[sent] if sent >= 0 else ():
                    if row.samples and holder.get(row.slot) == row.request:
                        table[row.slot] = drafts_of(row.request, sent, scenario.spec)
                after.append(table.copy())
            elif point == FF15_BATCH:
                for row in scenario.batches[step]:
                    assert row.request not in ended, "a scenario schedules a freed request"
                    assert holder.setdefault(row.slot, row.request) == row.request
            else:
                for free in scenario.frees_at(step, FreeAt(point)):
                    for slot in free.slots:
                        if slot in holder:
                            ended.add(holder.pop(slot))
    return after


def free_directly(
    scenario: Scenario, step: int, at: FreeAt, config: RelayConfig, state: RelayState
) -> RelayState:
    for free in scenario.frees_at(step, at):
        if free.kind is FreeKind.SLOTS:
            state = free_request_slots(config, state, free.slots).state
        elif free.kind is FreeKind.SLOT:
            for slot in free.slots:
                state = free_request_slot(config, state, slot).state
    return state


def phase_frees(scenario: Scenario, step: int) -> tuple[tuple[int, ...], bool]:
    """The slots the rank step frees at `step`, and whether through `settle`."""
    frees = [f for f in scenario.frees_at(step, FreeAt.AFTER_CONSUME) if f.kind in PHASE_KINDS]
    slots = tuple(slot for free in frees for slot in free.slots)
    return slots, any(free.kind is FreeKind.SETTLE for free in frees)


def ff15_rank(
    scenario: Scenario, rank: int, io: ScriptedIO
) -> Generator[tuple[Effect, ...], None, tuple[DraftTable, ...]]:
    """The scenario on one rank, through the rank-step phases; the draft table after
    each step's consume (non-last stages)."""
    config = ff15_config(scenario, rank)
    relay = config.relay
    drafts = relay.inputs.draft_table
    if config.updates_drafts:
        io.bind(drafts, np.zeros((scenario.max_num_reqs, scenario.spec), np.int64))

    def free_then_end(config: RelayConfig, state: RelayState) -> Step[RelayState, None]:
        # Right after the receive (finish calls end_step next): no phase frees here.
        freed = free_directly(scenario, state.step, FreeAt.AFTER_RECEIVE, config, state)
        return end_step(config, freed)

    steps = RankSteps(end_step=free_then_end)
    seen: list[DraftTable] = []
    state = init_rank(config)
    for step in range(scenario.steps):
        freed = free_directly(scenario, step, FreeAt.BEFORE_CONSUME, relay, state.relay)
        begun = yield from begin(config, attrs.evolve(state, relay=freed), steps)
        if config.updates_drafts:
            table = io.read(drafts)
            assert table is not None
            seen.append(table)
        freed = free_directly(scenario, step, FreeAt.AFTER_CONSUME, relay, begun.relay)
        begun = attrs.evolve(begun, relay=freed)
        batch, shape = ff15_batch(scenario, step)
        slots, settles = phase_frees(scenario, step)
        if settles:
            begun = yield from start_agreement_phase(config, begun, batch, shape, steps=steps)
            agreed = yield from settle(config, begun, io, freed=slots, steps=steps)
        else:
            agreed = yield from agree(config, begun, batch, shape, io, freed=slots, steps=steps)
        sampled = ff15_sampled(scenario, step) if config.is_last_stage else None
        state = yield from finish(config, agreed, io, sampled, steps)
    return tuple(seen)


def simulate_ff15(scenario: Scenario) -> dict[int, tuple[DraftTable, ...]]:
    """Every rank in the simulator (NumpyInterpreter); the non-last stages' tables."""
    tables: dict[int, tuple[DraftTable, ...]] = {}

    def program(context: RankContext) -> Iterator[tuple[Effect, ...]]:
        io = NumpyTensors(context.interpreter)
        tables[context.rank] = yield from ff15_rank(scenario, context.rank, io)

    simulate(Layout(pp=scenario.pp, dp=1), program)
    return {rank: tables[rank] for rank in range(scenario.pp - 1)}


def assert_tables_hold_only_current_requests_drafts(
    scenario: Scenario, tables: dict[int, tuple[DraftTable, ...]]
) -> None:
    expected = expected_tables(scenario)
    assert sorted(tables) == list(range(scenario.pp - 1))
    for stage, seen in tables.items():
        assert len(seen) == scenario.steps
        for step, (got, want) in enumerate(zip(seen, expected, strict=True)):
            for slot in range(scenario.max_num_reqs):
                assert got[slot].tolist() == want[slot].tolist(), (
                    f"stage {stage}, after step {step}'s consume: slot {slot} holds "
                    f"{whose(got[slot])}, expected {whose(want[slot])} ({scenario.frees})"
                )


# The reuse scenario's slots: request 0 ends in slot 0 at step LAST and is freed later;
# slot 1's request decodes throughout (a bystander); slot 2's request decodes until it
# is aborted with slot 0 (several rows in flight); slot 3 runs a chunk that samples
# nothing every other step. Both freed slots are reused by the very next batch.
LAST = 1
OLD, BYSTANDER, ABORTED, CHUNK = 0, 1, 2, 3
NEW, NEW_ABORTED = 10, 20


def first_batch_after(free: tuple[int, FreeAt]) -> int:
    step, at = free
    return step + 1 if at is FreeAt.AFTER_RECEIVE else step


def reuse_scenario(
    pp: int, free: tuple[int, FreeAt], kind: FreeKind, wire: Wire = Wire.SEED
) -> Scenario:
    reused = first_batch_after(free)
    batches = []
    for step in range(reused + pp + 2):
        rows = [Row(BYSTANDER, BYSTANDER, samples=True)]
        if step <= LAST:
            rows.append(Row(OLD, OLD, samples=True))
        if step >= reused:
            rows += [Row(OLD, NEW, samples=True), Row(ABORTED, NEW_ABORTED, samples=True)]
        else:
            rows.append(Row(ABORTED, ABORTED, samples=True))
        if step % 2 == 0:
            rows.append(Row(CHUNK, CHUNK, samples=False))
        batches.append(tuple(rows[::-1] if step % 2 else rows))  # rows are not slots
    return Scenario(
        pp=pp,
        spec=2,
        max_num_reqs=4,
        wire=wire,
        batches=tuple(batches),
        frees=(Free(free[0], free[1], (OLD, ABORTED), kind),),
    )


def free_points(pp: int, kind: FreeKind) -> list[tuple[int, FreeAt]]:
    """Every point from right after the old request's last receive (ring offset
    pp - 1) to just before its consume (offset 0), then just after it (kept)."""
    points = [(LAST, FreeAt.AFTER_RECEIVE)]
    points += [(LAST + d, at) for d in range(1, pp + 1) for at in FreeAt]
    return [p for p in points if kind in DIRECT_KINDS or p[1] is FreeAt.AFTER_CONSUME]


def in_flight_at_free(scenario: Scenario, request: int) -> list[int]:
    """The steps whose row of `request` was received before its slot's free and
    consumed after it."""
    (free,) = scenario.frees
    when = (free.step, int(free.at))
    return [
        step
        for step, rows in enumerate(scenario.batches)
        if any(r.request == request for r in rows)
        and (step, FF15_BATCH) < when < (step + scenario.pp, FF15_CONSUME)
    ]


def assert_reused_slots_start_clean(
    scenario: Scenario, tables: dict[int, tuple[DraftTable, ...]]
) -> None:
    """The old requests' in-flight drafts never reach the table; the new requests'
    first drafts are there once their first entry is consumed."""
    reused = first_batch_after((scenario.frees[0].step, scenario.frees[0].at))
    for stage, seen in tables.items():
        for slot, old, new in ((OLD, OLD, NEW), (ABORTED, ABORTED, NEW_ABORTED)):
            stale = [draft_of(old, s, 0) for s in in_flight_at_free(scenario, old)]
            for step, table in enumerate(seen):
                assert int(table[slot, 0]) not in stale, (
                    f"stage {stage}, step {step}: reused slot {slot} holds {whose(table[slot])}"
                )
            first = seen[reused + scenario.pp][slot].tolist()
            assert first == drafts_of(new, reused, scenario.spec), (
                f"stage {stage}: slot {slot} holds {whose(seen[reused + scenario.pp][slot])} "
                f"after request {new}'s first entry was consumed"
            )


@pytest.mark.parametrize("kind", list(FreeKind))
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_ff15_a_slot_freed_at_any_ring_offset_and_reused_at_once_gets_none_of_the_old_drafts(
    pp: int, kind: FreeKind
) -> None:
    dropped = 0
    for point in free_points(pp, kind):
        scenario = reuse_scenario(pp, point, kind)
        tables = simulate_ff15(scenario)
        assert_reused_slots_start_clean(scenario, tables)
        assert_tables_hold_only_current_requests_drafts(scenario, tables)
        dropped += bool(in_flight_at_free(scenario, OLD))
    # Every point before the old request's consume drops its row; the last ones keep it.
    assert dropped == len(free_points(pp, kind)) - (1 if kind in PHASE_KINDS else 2)


@st.composite
def ff15_scenarios(draw: st.DrawFn) -> Scenario:
    """Random batches and frees: any slots, at any point, by any kind, each freed slot
    taken by a new request at once (which may be freed again before it samples)."""
    pp = draw(st.sampled_from([2, 3, 4]))
    slots = draw(st.integers(2, 4))
    holder = list(range(slots))
    admitted = slots
    batches: list[tuple[Row, ...]] = []
    frees: list[Free] = []

    def free_some(step: int, at: FreeAt) -> None:
        nonlocal admitted
        chosen = draw(st.lists(st.integers(0, slots - 1), max_size=2))
        if not chosen:
            return
        kinds = list(FreeKind) if at is FreeAt.AFTER_CONSUME else list(DIRECT_KINDS)
        frees.append(Free(step, at, tuple(chosen), draw(st.sampled_from(kinds))))
        for slot in dict.fromkeys(chosen):
            holder[slot] = admitted
            admitted += 1

    for step in range(3 * pp + 2):
        free_some(step, FreeAt.BEFORE_CONSUME)
        free_some(step, FreeAt.AFTER_CONSUME)
        order = draw(st.permutations(range(slots)))
        kinds = draw(st.lists(st.sampled_from("dci"), min_size=slots, max_size=slots))
        batches.append(
            tuple(Row(s, holder[s], samples=kinds[s] == "d") for s in order if kinds[s] != "i")
        )
        free_some(step, FreeAt.AFTER_RECEIVE)
    return Scenario(
        pp=pp,
        spec=draw(st.integers(1, 2)),
        max_num_reqs=slots,
        wire=draw(st.sampled_from(list(Wire))),
        batches=tuple(batches),
        frees=tuple(frees),
    )


@settings(max_examples=60, deadline=None)
@given(scenario=ff15_scenarios())
def test_ff15_every_draft_table_row_holds_only_its_current_requests_drafts(
    scenario: Scenario,
) -> None:
    assert_tables_hold_only_current_requests_drafts(scenario, simulate_ff15(scenario))


def ff15_driver_rank(
    scenario: Scenario, rank: int, interpreter: TorchInterpreter
) -> tuple[DraftTable, ...]:
    """The scenario on one rank as an embedder runs it: a RankDriver, whose agree and
    settle take the frees (its phases take only the value the one before returned)."""
    assert all(free.kind in PHASE_KINDS for free in scenario.frees)
    config = ff15_config(scenario, rank)
    io = TorchTensors(interpreter)
    driver = RankDriver(config, interpreter, io)
    drafts = config.relay.inputs.draft_table
    if config.updates_drafts:
        io.bind(drafts, np.zeros((scenario.max_num_reqs, scenario.spec), np.int64))
    seen: list[DraftTable] = []
    state = init_rank(config)
    for step in range(scenario.steps):
        begun = driver.begin(state)
        if config.updates_drafts:
            seen.append(io.read(drafts))
        batch, shape = ff15_batch(scenario, step)
        slots, settles = phase_frees(scenario, step)
        if settles:
            agreed = driver.settle(driver.start(begun, batch, shape), freed=slots)
        else:
            agreed = driver.agree(begun, batch, shape, freed=slots)
        sampled = ff15_sampled(scenario, step) if config.is_last_stage else None
        state = driver.finish(agreed, sampled)
    return tuple(seen)


def ff15_gloo_worker(
    scenarios: tuple[Scenario, ...], context: ProcessContext
) -> list[tuple[tuple[DraftTable, ...], tuple[DraftTable, ...] | None]]:
    """Each scenario on this rank of a real gloo pipeline, on TorchInterpreter (CPU):
    through the rank-step phases, and (frees by agree or settle only) a RankDriver."""
    import torch

    world = Layout(pp=context.world_size, dp=1)
    groups = build_communicators(
        pp_groups=world.pp_groups,
        dp_groups=world.dp_groups,
        relay_backend=context.backend,
        timeout=context.timeout,
    )

    def interpreter() -> TorchInterpreter:
        return TorchInterpreter(device=torch.device("cpu"), groups=groups, rank=context.rank)

    results: list[tuple[tuple[DraftTable, ...], tuple[DraftTable, ...] | None]] = []
    for scenario in scenarios:
        phases = interpreter()
        tables = perform_phase(ff15_rank(scenario, context.rank, TorchTensors(phases)), phases)
        driven = None
        if all(free.kind in PHASE_KINDS for free in scenario.frees):
            driven = ff15_driver_rank(scenario, context.rank, interpreter())
        results.append((tables, driven))
    return results


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_ff15_on_torch_over_gloo_a_reused_slot_gets_none_of_the_old_drafts(pp: int) -> None:
    """The same scenarios on TorchInterpreter (CPU, one process per stage): every kind of
    free, at every point, through the phases; agree's and settle's also through a
    RankDriver. The tables equal the reference's and the simulator's."""
    scenarios = tuple(
        reuse_scenario(pp, point, kind, wire)
        for kind in FreeKind
        for point in free_points(pp, kind)
        for wire in (Wire.SEED, Wire.FIXED)
    )
    runs = run_ranks(
        functools.partial(ff15_gloo_worker, scenarios),
        pp,
        backend="gloo",
        timeout=datetime.timedelta(seconds=30),
        deadline_s=240.0,
    )
    driven = 0
    for index, scenario in enumerate(scenarios):
        simulated = simulate_ff15(scenario)
        for by in (0, 1):
            tables = {rank: runs[rank][index][by] for rank in range(pp - 1)}
            if any(seen is None for seen in tables.values()):
                continue
            driven += by
            checked = {rank: seen for rank, seen in tables.items() if seen is not None}
            assert_reused_slots_start_clean(scenario, checked)
            assert_tables_hold_only_current_requests_drafts(scenario, checked)
            for rank, seen in checked.items():
                assert [t.tolist() for t in seen] == [t.tolist() for t in simulated[rank]]
    assert driven == 2 * 2 * pp  # agree and settle, two wires, pp points each
