"""The DP agreement, case by case: one test per behaviour of the seed's DP sync, plus lanes."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import pytest

from purepp.cudagraph import (
    BatchExecutionDescriptor,
    CaptureMode,
    CudaGraphDispatcher,
    CUDAGraphMode,
)
from purepp.dp import (
    ROW_CG_MODE,
    TABLE_ROWS,
    AgreementGroup,
    AgreementLanes,
    AgreementStarted,
    DispatchOutcome,
    DPSyncState,
    Lane,
    LaneBusyError,
    PendingAgreement,
    RankBatch,
    agree_across_ranks,
    finish_agreement,
    start_agreement,
    wait_for_agreement,
)
from purepp.effects.arrays import is_frozen
from purepp.effects.vocabulary import (
    AllReduce,
    BufferRef,
    Communicator,
    NoteDecision,
    Op,
    Release,
    WaitWork,
    WorkRef,
)
from purepp.errors import (
    CollectiveMismatchError,
    ConfigError,
    InvalidInputError,
    PureppError,
    StaleSyncError,
)
from purepp.step import Step
from tests.strategies import desc

FULL = CUDAGraphMode.FULL
PIECEWISE = CUDAGraphMode.PIECEWISE
NONE = CUDAGraphMode.NONE
FREE = AgreementLanes()

# Uniform decode of 2 tokens per request (one draft) in FULL graphs, PIECEWISE otherwise.
SPEC = CudaGraphDispatcher(
    capture_sizes=(1, 2, 4, 8, 16),
    capture_mode=CaptureMode.FULL_AND_PIECEWISE,
    max_num_reqs=8,
    num_speculative_tokens=1,
)
VARLEN = attrs.evolve(SPEC, varlen_decode=True)
FULL_ONLY = CudaGraphDispatcher(
    capture_sizes=(1, 2, 4, 8, 16), capture_mode=CaptureMode.FULL, max_num_reqs=8
)


def sync(
    tokens: list[int],
    *,
    uniform: int | None = None,
    eager: bool = False,
    reqs: int = 0,
    query_len: int | None = None,
) -> DPSyncState:
    return DPSyncState(
        num_tokens_across_dp=np.array(tokens, dtype=np.int32),
        uniform_token_count=uniform,
        eager=eager,
        num_reqs=reqs,
        max_query_len=query_len,
    )


def start(
    dispatcher: CudaGraphDispatcher | None = SPEC,
    *,
    num_reqs: int = 2,
    num_tokens: int = 4,
    uniform: int | None = 2,
    dp_size: int = 2,
    dp_rank: int = 0,
    step: int = 7,
    lanes: AgreementLanes = FREE,
    lane: Lane = Lane.TARGET,
    asynchronous: bool = False,
    comm: Communicator = Communicator.DP_CPU,
    **batch_fields: Any,
) -> AgreementStarted:
    group = AgreementGroup(dp_size=dp_size, dp_rank=dp_rank, comm=comm)
    facts = RankBatch(
        num_reqs=num_reqs, num_tokens=num_tokens, uniform_token_count=uniform, **batch_fields
    )
    return start_agreement(
        lanes, group, dispatcher, facts, step=step, lane=lane, asynchronous=asynchronous
    )


def at_once(started: AgreementStarted) -> DispatchOutcome:
    """The outcome of a start that decided at once (it issued nothing)."""
    assert started.effects == ()
    assert started.result.table is None
    return finish_agreement(started.state, started.result, None).result


def pending_of(**kwargs: Any) -> PendingAgreement:
    started = start(**kwargs)
    assert started.result.decided is None
    return started.result


def finish(pending: PendingAgreement, table: Any) -> Any:
    """Finish with the lanes that have exactly `pending` in flight."""
    lanes = (
        AgreementLanes(target=pending.step)
        if pending.lane is Lane.TARGET
        else AgreementLanes(drafter=pending.step)
    )
    return finish_agreement(lanes, pending, table)


def batch(reqs: int, tokens: int, uniform: int | None = None, **kwargs: Any) -> RankBatch:
    return RankBatch(num_reqs=reqs, num_tokens=tokens, uniform_token_count=uniform, **kwargs)


# --- phase 1: decided at once ------------------------------------------------------


def test_a_single_rank_decides_at_once_with_no_effect_and_no_sync() -> None:
    started = start(dp_size=1)
    assert at_once(started) == DispatchOutcome(descriptor=desc(FULL, 4, 2, uniform=2), sync=None)


def test_start_is_synchronous_unless_asked_and_names_a_wrong_argument() -> None:
    group = AgreementGroup(dp_size=2, dp_rank=0)
    facts = batch(2, 4, 2)
    (effect,) = start_agreement(FREE, group, SPEC, facts, step=3).effects
    assert isinstance(effect, AllReduce)
    assert effect.work is None  # the seed's blocking all-reduce unless asynchronous=True
    for position, name, wrong, expected in (
        (0, "lanes", group, "an AgreementLanes"),
        (1, "group", facts, "an AgreementGroup"),
        (3, "batch", FREE, "a RankBatch"),
    ):
        args: list[Any] = [FREE, group, SPEC, facts]
        args[position] = wrong
        with pytest.raises(
            InvalidInputError, match=rf"^start_agreement: {name}=.* is not {expected}"
        ):
            start_agreement(*args, step=3)


def test_a_start_that_decides_at_once_still_occupies_its_lane_until_finished() -> None:
    started = start(dp_size=1)
    assert started.state == AgreementLanes(target=7)
    finished = finish_agreement(started.state, started.result, None)
    assert finished.state == FREE
    assert finished.effects == ()


def test_need_eager_runs_eager_with_this_ranks_own_counts() -> None:
    started = start(None, dp_size=1, num_reqs=3, num_tokens=5, uniform=None, need_eager=True)
    assert at_once(started) == DispatchOutcome(descriptor=desc(NONE, 5, 3), sync=None)


def test_need_eager_takes_numpys_bool_and_keeps_a_python_bool() -> None:
    # A flag computed with numpy (np.any(...)) is a numpy bool: taken, stored as bool.
    forced = batch(3, 5, need_eager=np.bool_(True))
    assert forced.need_eager is True
    assert batch(3, 5, need_eager=np.bool_(False)).need_eager is False


def test_no_dispatcher_without_need_eager_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"^start_agreement: cudagraph dispatcher is None"):
        start(None)


def test_reusing_an_eager_sync_runs_eager_with_no_collective() -> None:
    agreed = sync([4, 3], eager=True, reqs=2)
    started = start(dp_sync=agreed, num_active_loras=1)
    assert at_once(started) == DispatchOutcome(descriptor=desc(NONE, 4, 2, loras=1), sync=agreed)


def test_reusing_a_graph_sync_keeps_it_when_this_dispatcher_pads_alike() -> None:
    agreed = sync([4, 4], uniform=2, reqs=2)
    outcome = at_once(start(dp_sync=agreed))
    assert outcome == DispatchOutcome(descriptor=desc(FULL, 4, 2, uniform=2), sync=agreed)


def test_reusing_a_graph_sync_with_a_dispatcher_that_pads_further_reports_the_padded_count() -> (
    None
):
    coarse = attrs.evolve(SPEC, capture_sizes=(8, 16))
    outcome = at_once(start(coarse, dp_sync=sync([4, 4], uniform=2, reqs=2)))
    assert outcome.descriptor == desc(FULL, 8, 4, uniform=2)
    assert outcome.sync == sync([8, 8], uniform=2, reqs=2)


def test_a_reused_sync_padded_further_keeps_its_dead_ranks_at_zero() -> None:
    coarse = attrs.evolve(SPEC, capture_sizes=(8, 16))
    group = AgreementGroup(dp_size=3, dp_rank=0, live_ranks=frozenset({0, 2}))
    agreed = sync([4, 0, 4], uniform=2, reqs=2)  # rank 1 died before the agreement
    facts = RankBatch(num_reqs=2, num_tokens=4, uniform_token_count=2, dp_sync=agreed)
    started = start_agreement(FREE, group, coarse, facts, step=7)
    assert at_once(started).sync == sync([8, 0, 8], uniform=2, reqs=2)


def test_a_reused_sync_supplies_the_agreed_uniform_count() -> None:
    # The ranks disagreed (None): this rank's own uniform batch must not take a decode graph.
    outcome = at_once(start(dp_sync=sync([4, 4], uniform=None, reqs=2)))
    assert outcome.descriptor == desc(PIECEWISE, 4, None)


def test_a_reused_sync_supplies_the_agreed_query_length_bound() -> None:
    # Beyond the seed: ranks that reuse an agreement with different local bounds would
    # otherwise pick different varlen graphs (field failure 11).
    first = agree_across_ranks(VARLEN, [batch(3, 4, max_query_len=2), batch(2, 3, max_query_len=1)])
    reused = [
        at_once(
            start(
                VARLEN,
                num_reqs=reqs,
                num_tokens=4,
                uniform=None,
                dp_rank=rank,
                max_query_len=local_bound,
                dp_sync=first[rank].sync,
                lane=Lane.DRAFTER,
            )
        )
        for rank, (reqs, local_bound) in enumerate([(3, 2), (2, None)])
    ]
    assert {o.descriptor for o in reused} == {desc(FULL, 4, 4, query_len=2)}


def test_a_single_rank_never_returns_a_sync_even_when_one_is_reused() -> None:
    outcome = at_once(start(dp_size=1, dp_rank=0, dp_sync=sync([4], uniform=2)))
    assert outcome == DispatchOutcome(descriptor=desc(FULL, 4, 2, uniform=2), sync=None)


def test_a_reused_eager_sync_needs_no_dispatcher() -> None:
    # The seed asks the manager only when neither need_eager nor an eager sync forces
    # eager, so a reuse of an eager agreement may pass no manager; a graph sync may not.
    agreed = sync([4, 3], eager=True, reqs=2)
    outcome = at_once(start(None, dp_sync=agreed, num_active_loras=1))
    assert outcome == DispatchOutcome(descriptor=desc(NONE, 4, 2, loras=1), sync=agreed)
    single = at_once(start(None, dp_size=1, dp_sync=sync([4], eager=True, reqs=2)))
    assert single == DispatchOutcome(descriptor=desc(NONE, 4, 2), sync=None)
    with pytest.raises(ConfigError, match=r"^start_agreement: cudagraph dispatcher is None"):
        start(None, dp_sync=sync([4, 4], uniform=2, reqs=2))


# field failure 12: a sync taken over one batch, reused for another.
@pytest.mark.parametrize(
    ("reused", "uniform"),
    [
        (sync([8, 8], uniform=2, reqs=4), 2),  # another token count on this rank
        (sync([4, 4], uniform=1, reqs=4), 2),  # another uniform decode length
        (sync([4, 4], uniform=2, reqs=4), None),  # this batch is not uniform at all
        (sync([3, 4], eager=True, reqs=4), 2),  # an eager sync keeps per-rank counts
    ],
)
def test_field_failure_12_reusing_a_sync_from_another_batch_is_a_stale_sync_error(
    reused: DPSyncState, uniform: int | None
) -> None:
    with pytest.raises(StaleSyncError, match=r"^start_agreement: dp_sync .* Fix: reuse a sync"):
        start(dp_sync=reused, uniform=uniform, num_tokens=4)
    assert reused.num_tokens_across_dp.flags.writeable is False


def test_a_sync_with_no_uniform_count_may_be_reused_by_a_uniform_batch() -> None:
    outcome = at_once(start(dp_sync=sync([4, 4], reqs=2), uniform=2))
    assert outcome.sync == sync([4, 4], reqs=2)


def test_a_sync_from_a_group_of_another_size_is_invalid_input() -> None:
    with pytest.raises(InvalidInputError, match="dp_sync holds 3 ranks but dp_size=2"):
        start(dp_sync=sync([4, 4, 4]))


# --- phase 1: the all-reduce ----------------------------------------------------------


def test_the_contribution_is_this_ranks_column_with_none_encoded() -> None:
    pending = pending_of(
        dispatcher=SPEC, dp_size=3, dp_rank=1, num_reqs=3, num_tokens=9, uniform=None
    )
    expected = np.zeros((TABLE_ROWS, 3), dtype=np.int32)
    expected[:, 1] = [9, int(PIECEWISE), 0, -1, 3]
    assert pending.contribution is not None
    assert pending.contribution.dtype == np.int32
    assert np.array_equal(pending.contribution, expected)
    assert pending.contribution.flags.writeable is False
    assert pending.own == (9, int(PIECEWISE), 0, -1, 3)


def test_several_ranks_issue_one_synchronous_all_reduce_over_the_dp_cpu_group() -> None:
    started = start(dp_size=3, dp_rank=2, max_query_len=2)
    pending = started.result
    assert pending.contribution is not None
    (effect,) = started.effects
    assert effect == AllReduce(
        step=7,
        op=Op.AGREE,
        contribution=pending.contribution,
        result=BufferRef("dp.target.step7.table"),
        comm=Communicator.DP_CPU,
        work=None,
    )
    assert pending.contribution[:, 2].tolist() == [4, int(FULL), 2, 2, 2]
    assert not pending.contribution[:, :2].any()
    assert wait_for_agreement(pending).effects == ()
    assert wait_for_agreement(pending).result == BufferRef("dp.target.step7.table")


def test_an_asynchronous_all_reduce_is_completed_by_a_wait_work() -> None:
    pending = pending_of(asynchronous=True, step=3, lane=Lane.DRAFTER)
    assert pending.work == WorkRef("dp.drafter.step3.work")
    waited = wait_for_agreement(pending)
    assert waited.effects == (WaitWork(step=3, op=Op.AGREE, work=WorkRef("dp.drafter.step3.work")),)
    assert waited.result == BufferRef("dp.drafter.step3.table")
    assert waited.state == pending


def test_a_decided_start_waits_for_nothing_and_names_no_table() -> None:
    waited = wait_for_agreement(start(dp_size=1).result)
    assert (waited.effects, waited.result) == ((), None)


def test_the_agreement_can_run_over_the_pipeline_group() -> None:
    # field failure 7: stages that pick graphs from rank-local facts never meet.
    (effect,) = start(comm=Communicator.PP_CPU).effects
    assert isinstance(effect, AllReduce)
    assert effect.comm is Communicator.PP_CPU


def test_need_eager_still_joins_the_collective_and_contributes_eager() -> None:
    pending = pending_of(dispatcher=None, need_eager=True)
    assert pending.contribution is not None
    assert pending.contribution[ROW_CG_MODE, 0] == int(NONE)


def test_field_failure_10_an_idle_rank_joins_the_collective_with_neutral_values() -> None:
    (busy_effect,) = start(num_reqs=2, num_tokens=4, dp_rank=0).effects
    (idle_effect,) = start(num_reqs=0, num_tokens=0, uniform=None, dp_rank=1).effects
    assert isinstance(busy_effect, AllReduce)
    assert isinstance(idle_effect, AllReduce)
    assert attrs.evolve(idle_effect, contribution=busy_effect.contribution) == busy_effect
    assert idle_effect.contribution[:, 1].tolist() == [0, int(NONE), 0, -1, 0]


# --- lanes ------------------------------------------------------------------------------


def test_target_and_drafter_agreements_are_in_flight_at_once_on_their_own_groups() -> None:
    target = start(step=4, asynchronous=True)
    drafter = start(step=4, lanes=target.state, lane=Lane.DRAFTER, asynchronous=True)
    assert drafter.state == AgreementLanes(target=4, drafter=4)
    (target_effect,) = target.effects
    (drafter_effect,) = drafter.effects
    assert isinstance(target_effect, AllReduce)
    assert isinstance(drafter_effect, AllReduce)
    assert (target_effect.comm, drafter_effect.comm) == (
        Communicator.DP_CPU,
        Communicator.DP_DRAFTER_CPU,
    )
    # Named from the lane and the step: no label to pick, no name shared.
    assert target_effect.result != drafter_effect.result
    assert target_effect.work != drafter_effect.work


def test_a_second_start_on_a_busy_lane_is_a_lane_busy_error() -> None:
    first = start(step=4)
    with pytest.raises(LaneBusyError, match=r"^start_agreement: the target lane still has"):
        start(step=5, lanes=first.state)
    assert first.state == AgreementLanes(target=4)  # unchanged: it is a value


def test_finishing_frees_only_its_own_lane() -> None:
    target = start(step=4)
    drafter = start(step=4, lanes=target.state, lane=Lane.DRAFTER, dp_size=1)
    other = start(step=4, dp_rank=1)
    table = target.result.contribution
    assert table is not None
    assert other.result.contribution is not None
    finished = finish_agreement(drafter.state, target.result, table + other.result.contribution)
    assert finished.state == AgreementLanes(drafter=4)
    restarted = start(step=5, lanes=finished.state)
    assert restarted.state == AgreementLanes(target=5, drafter=4)


def test_an_agreement_is_finished_once() -> None:
    started = start(dp_size=1)
    finished = finish_agreement(started.state, started.result, None)
    with pytest.raises(InvalidInputError, match=r"^finish_agreement: the target lane has step"):
        finish_agreement(finished.state, started.result, None)


def test_a_table_for_an_agreement_decided_at_once_is_refused() -> None:
    started = start(dp_size=1)
    with pytest.raises(InvalidInputError, match="decided at once"):
        finish_agreement(started.state, started.result, np.zeros((5, 1), dtype=np.int32))


def test_a_group_with_one_communicator_for_both_lanes_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="both lanes use DP_CPU"):
        AgreementGroup(dp_size=2, dp_rank=0, drafter_comm=Communicator.DP_CPU)


# --- phase 2: the decision ---------------------------------------------------------


def test_agreeing_across_no_ranks_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"^agree_across_ranks: batches is empty"):
        agree_across_ranks(SPEC, [])


def test_all_ranks_idle_run_nothing_and_keep_no_sync() -> None:
    outcomes = agree_across_ranks(SPEC, [batch(0, 0), batch(0, 0)])
    assert outcomes == (DispatchOutcome(descriptor=desc(NONE, 0, 0), sync=None),) * 2


def test_any_eager_rank_makes_every_rank_eager_with_its_own_counts() -> None:
    outcomes = agree_across_ranks(
        SPEC,
        [batch(2, 4, 2, num_active_loras=1), batch(3, 6, 2, need_eager=True), batch(0, 0)],
    )
    agreed = sync([4, 6, 0], eager=True, reqs=3)
    assert outcomes == (
        DispatchOutcome(descriptor=desc(NONE, 4, 2, loras=1), sync=agreed),
        DispatchOutcome(descriptor=desc(NONE, 6, 3), sync=agreed),
        DispatchOutcome(descriptor=desc(NONE, 0, 0), sync=agreed),
    )


def test_an_eager_agreement_still_records_a_uniform_count_all_ranks_share() -> None:
    outcomes = agree_across_ranks(SPEC, [batch(2, 4, 2), batch(3, 6, 2, need_eager=True)])
    assert outcomes[0].sync == sync([4, 6], uniform=2, eager=True, reqs=3)


def test_ranks_pad_to_the_most_tokens_and_a_full_graph_pads_requests() -> None:
    outcomes = agree_across_ranks(SPEC, [batch(1, 2, 2), batch(3, 6, 2)])
    agreed = sync([8, 8], uniform=2, reqs=4)
    graph = desc(FULL, 8, 4, uniform=2)
    assert outcomes == (DispatchOutcome(descriptor=graph, sync=agreed),) * 2


def test_uniform_counts_agree_only_when_every_rank_has_the_same_one() -> None:
    differing = agree_across_ranks(SPEC, [batch(2, 4, 2), batch(4, 4, 1)])
    assert [o.descriptor for o in differing] == [desc(PIECEWISE, 4, None)] * 2
    assert differing[0].sync == sync([4, 4], reqs=4)
    one_missing = agree_across_ranks(SPEC, [batch(2, 4, 2), batch(2, 4, None)])
    assert [o.sync for o in one_missing] == [sync([4, 4], reqs=2)] * 2


def test_piecewise_pads_no_requests_and_agrees_on_the_most_scheduled() -> None:
    outcomes = agree_across_ranks(SPEC, [batch(1, 3), batch(5, 9)])
    assert [o.descriptor for o in outcomes] == [desc(PIECEWISE, 16, None)] * 2
    assert [o.sync for o in outcomes] == [sync([16, 16], reqs=5)] * 2


def test_the_query_length_bound_agrees_as_the_largest_when_every_rank_sets_one() -> None:
    outcomes = agree_across_ranks(
        VARLEN, [batch(3, 4, max_query_len=2), batch(2, 3, max_query_len=1)]
    )
    assert [o.descriptor for o in outcomes] == [desc(FULL, 4, 4, query_len=2)] * 2
    assert outcomes[0].sync == sync([4, 4], reqs=4, query_len=2)


def test_a_rank_without_a_query_length_bound_keeps_everyone_off_varlen_graphs() -> None:
    outcomes = agree_across_ranks(VARLEN, [batch(3, 4, max_query_len=2), batch(2, 3)])
    assert [o.descriptor for o in outcomes] == [desc(PIECEWISE, 4, None)] * 2


def test_an_agreed_count_above_the_largest_graph_runs_eager_at_that_count() -> None:
    # Seed behaviour: the dispatch of the agreed count is eager, yet the sync is not.
    # Reachable when another rank's dispatcher captured larger graphs than this one.
    pending = pending_of(dispatcher=FULL_ONLY, num_reqs=2, num_tokens=4, uniform=None)
    reduced = np.array(pending.contribution)
    reduced[:, 1] = [20, int(FULL), 0, -1, 5]
    outcome = finish(pending, reduced).result
    assert outcome == DispatchOutcome(descriptor=desc(NONE, 20, 2), sync=sync([20, 20], reqs=5))


def test_the_agreement_dispatches_with_this_ranks_active_loras() -> None:
    lora = attrs.evolve(SPEC, lora_capture_cases=(0, 2))
    outcomes = agree_across_ranks(lora, [batch(2, 4, 2, num_active_loras=1), batch(2, 4, 2)])
    assert [o.descriptor for o in outcomes] == [
        desc(FULL, 4, 2, uniform=2, loras=2),
        desc(FULL, 4, 2, uniform=2),
    ]


def test_field_failure_11_ranks_with_different_batches_agree_on_every_shaping_value() -> None:
    outcomes = agree_across_ranks(
        SPEC, [batch(1, 2, 2), batch(3, 6, 2), batch(2, 4, 2, num_active_loras=0)]
    )
    assert {o.descriptor for o in outcomes} == {desc(FULL, 8, 4, uniform=2)}
    assert all(o.sync == sync([8, 8, 8], uniform=2, reqs=4) for o in outcomes)


def test_finish_matches_a_table_reduced_by_hand() -> None:
    first = pending_of(dp_rank=0, num_reqs=1, num_tokens=2)
    second = pending_of(dp_rank=1, num_reqs=3, num_tokens=6)
    assert first.contribution is not None
    assert second.contribution is not None
    assert second.table is not None
    decided = finish(second, first.contribution + second.contribution)
    assert decided.state == FREE
    # The decision noted for the log (what the checker compares across ranks), then the
    # table released.
    note = NoteDecision(
        step=second.step,
        op=Op.AGREE,
        table=second.table,
        comm=Communicator.DP_CPU,
        cg_mode="FULL",
        num_ubatches=1,
        num_tokens_across_dp=np.array([8, 8], dtype=np.int32),
        uniform_token_count=2,
        eager=False,
        num_reqs=4,
        max_query_len=None,
    )
    assert decided.effects == (note, Release(step=second.step, op=Op.AGREE, buffer=second.table))
    assert decided.result == DispatchOutcome(
        descriptor=desc(FULL, 8, 4, uniform=2), sync=sync([8, 8], uniform=2, reqs=4)
    )


def test_an_idle_agreement_is_noted_as_eager_none_with_zero_counts() -> None:
    first = pending_of(dp_rank=0, num_reqs=0, num_tokens=0)
    second = pending_of(dp_rank=1, num_reqs=0, num_tokens=0)
    assert first.contribution is not None
    assert second.contribution is not None
    decided = finish(second, first.contribution + second.contribution)
    assert decided.result.sync is None
    note = decided.effects[0]
    assert isinstance(note, NoteDecision)
    assert (note.cg_mode, note.eager, note.num_reqs, note.num_ubatches) == ("NONE", True, 0, 1)
    assert note.num_tokens_across_dp.tolist() == [0, 0]
    assert (note.uniform_token_count, note.max_query_len) == (None, None)


def test_start_and_finish_build_what_the_public_constructors_build() -> None:
    # The library builds these values without their keyword constructors; they must be
    # equal to (and hash like) what the constructors build from the same fields.
    group = AgreementGroup(dp_size=3, dp_rank=1)
    facts = batch(2, 4, 2)
    started = start_agreement(FREE, group, SPEC, facts, step=7, asynchronous=True)
    table = BufferRef("dp.target.step7.table")
    work = WorkRef("dp.target.step7.work")
    own = (4, int(FULL), 2, -1, 2)
    contribution = np.zeros((TABLE_ROWS, 3), dtype=np.int32)
    contribution[:, 1] = own
    release = Release(step=7, op=Op.AGREE, buffer=table)
    pending = PendingAgreement(
        step=7,
        lane=Lane.TARGET,
        group=group,
        batch=facts,
        dispatcher=SPEC,
        desired=desc(FULL, 4, 2, uniform=2),
        decided=None,
        table=table,
        work=work,
        contribution=contribution,
        own=own,
        release=(release,),
    )
    all_reduce = AllReduce(
        step=7,
        op=Op.AGREE,
        contribution=contribution,
        result=table,
        comm=Communicator.DP_CPU,
        work=work,
    )
    assert started == Step(state=AgreementLanes(target=7), effects=(all_reduce,), result=pending)
    assert started.result.release == (release,)
    assert hash(started.result.release) == hash((release,))
    built = started.result.contribution
    assert built is not None
    assert built.dtype == np.int32
    assert built.shape == (TABLE_ROWS, 3)
    assert is_frozen(built)
    assert built.tolist() == contribution.tolist()

    reduced = np.array([own, own, own], dtype=np.int32).T  # three ranks alike
    finished = finish_agreement(started.state, started.result, reduced)
    agreed = sync([4, 4, 4], uniform=2, reqs=2)
    outcome = DispatchOutcome(descriptor=desc(FULL, 4, 2, uniform=2), sync=agreed)
    note = NoteDecision(
        step=7,
        op=Op.AGREE,
        table=table,
        comm=Communicator.DP_CPU,
        cg_mode="FULL",
        num_ubatches=1,
        num_tokens_across_dp=agreed.num_tokens_across_dp,
        uniform_token_count=2,
        eager=False,
        num_reqs=2,
        max_query_len=None,
    )
    assert finished == Step(state=AgreementLanes(), effects=(note, release), result=outcome)
    assert hash(finished.result) == hash(outcome)
    assert hash(finished.effects[0]) == hash(note)

    at_once_started = start_agreement(
        FREE, AgreementGroup(dp_size=1, dp_rank=0), SPEC, facts, step=7
    )
    decided = DispatchOutcome(descriptor=desc(FULL, 4, 2, uniform=2), sync=None)
    assert at_once_started == Step(
        state=AgreementLanes(target=7),
        effects=(),
        result=PendingAgreement(
            step=7,
            lane=Lane.TARGET,
            group=AgreementGroup(dp_size=1, dp_rank=0),
            batch=facts,
            dispatcher=SPEC,
            desired=desc(FULL, 4, 2, uniform=2),
            decided=decided,
            table=None,
            work=None,
            contribution=None,
            own=(),
            release=(),
        ),
    )


class ListDispatcher:
    """A CUDA-graph manager of its own: no subclass of anything purepp defines."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int | None, int, int | None]] = []

    def dispatch(
        self,
        num_reqs: int,
        num_tokens: int,
        uniform_token_count: int | None,
        *,
        num_active_loras: int = 0,
        max_query_len: int | None = None,
    ) -> BatchExecutionDescriptor:
        self.calls.append(
            (num_reqs, num_tokens, uniform_token_count, num_active_loras, max_query_len)
        )
        padded = 1 << (num_tokens - 1).bit_length() if num_tokens else 0
        return desc(PIECEWISE, padded, None) if padded else desc(NONE, 0, num_reqs)


def test_any_dispatcher_with_the_same_dispatch_plugs_in() -> None:
    mine = ListDispatcher()
    outcomes = agree_across_ranks(mine, [batch(1, 3), batch(2, 5)])
    assert [o.descriptor for o in outcomes] == [desc(PIECEWISE, 8, None)] * 2
    assert (1, 5, None, 0, None) in mine.calls  # rank 0 dispatched the agreed count


class FullGraphsWithoutRequestCounts:
    """A manager whose FULL graphs state no padded request count (num_reqs None)."""

    def dispatch(
        self,
        num_reqs: int,
        num_tokens: int,
        uniform_token_count: int | None,
        *,
        num_active_loras: int = 0,
        max_query_len: int | None = None,
    ) -> BatchExecutionDescriptor:
        return desc(FULL, 8, None)


def test_a_full_graph_without_a_request_count_agrees_on_the_most_scheduled() -> None:
    # The seed takes a FULL graph's request count only when it has one.
    outcomes = agree_across_ranks(FullGraphsWithoutRequestCounts(), [batch(1, 3), batch(5, 6)])
    assert [o.descriptor for o in outcomes] == [desc(FULL, 8, None)] * 2
    assert [o.sync for o in outcomes] == [sync([8, 8], reqs=5)] * 2


def test_a_dispatcher_that_answers_no_descriptor_is_invalid_input() -> None:
    class Broken:
        def dispatch(self, *args: object, **kwargs: object) -> object:
            return "FULL"

    broken: Any = Broken()  # what an untyped caller can pass
    group = AgreementGroup(dp_size=2, dp_rank=0)
    with pytest.raises(InvalidInputError, match=r"Broken.dispatch returned 'FULL'"):
        start_agreement(FREE, group, broken, batch(1, 1), step=0)


def test_finish_agreement_names_the_types_it_got_instead() -> None:
    with pytest.raises(InvalidInputError) as error:
        finish_agreement({}, None, None)  # type: ignore[arg-type]
    assert str(error.value).startswith(
        "finish_agreement: lanes is a dict and pending is a NoneType. Fix: pass the"
    )


def test_a_dispatcher_that_answers_no_descriptor_at_finish_names_finish_agreement() -> None:
    # finish_agreement asks the dispatcher again for the agreed counts; its error names
    # finish_agreement, the call the user made, not start_agreement.
    class BrokenOnSecondAsk:
        def __init__(self) -> None:
            self.asked = 0

        def dispatch(self, *args: object, **kwargs: object) -> object:
            self.asked += 1
            return desc(FULL, 8, None) if self.asked <= 2 else "FULL"

    broken: Any = BrokenOnSecondAsk()  # what an untyped caller can pass
    with pytest.raises(InvalidInputError, match=r"^finish_agreement: BrokenOnSecondAsk.dispatch"):
        agree_across_ranks(broken, [batch(1, 3), batch(5, 6)])


# --- validation --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"dp_size": 0}, ConfigError, "dp_size=0"),
        ({"dp_rank": 2}, ConfigError, "dp_rank=2 is outside 0..1"),
        ({"dp_rank": -1}, ConfigError, "dp_rank=-1"),
        ({"dp_size": 2.0}, ConfigError, "dp_size=2.0 is a float"),
        ({"dp_rank": True}, ConfigError, "dp_rank=True is a bool"),
        ({"num_reqs": -1}, InvalidInputError, "num_reqs=-1"),
        ({"num_tokens": -4}, InvalidInputError, "num_tokens=-4"),
        ({"num_tokens": 3.7}, InvalidInputError, "num_tokens=3.7 is a float"),
        ({"num_reqs": 2.5}, InvalidInputError, "num_reqs=2.5 is a float"),
        ({"num_tokens": "4"}, InvalidInputError, "num_tokens='4' is a str"),
        ({"num_active_loras": -1}, InvalidInputError, "num_active_loras=-1"),
        ({"num_active_loras": 1.0}, InvalidInputError, "num_active_loras=1.0 is a float"),
        ({"num_active_loras": True}, InvalidInputError, "num_active_loras=True is a bool"),
        ({"uniform": 2.0}, InvalidInputError, "uniform_token_count=2.0 is a float"),
        ({"num_tokens": 2**31}, InvalidInputError, "fit int32"),
        ({"uniform": 0}, InvalidInputError, "uniform_token_count=0"),
        ({"max_query_len": 0}, InvalidInputError, "max_query_len=0"),
        ({"max_query_len": float("nan")}, InvalidInputError, "max_query_len=nan"),
        ({"need_eager": 1}, InvalidInputError, "need_eager=1 is an int"),
        ({"num_reqs": 5, "uniform": None}, InvalidInputError, "num_reqs=5 exceeds num_tokens=4"),
        ({"num_reqs": 3}, InvalidInputError, "uniform_token_count=2 x num_reqs=3"),
        ({"step": -1}, InvalidInputError, "step=-1"),
        ({"step": 1.0}, InvalidInputError, "step=1.0 is a float"),
        ({"lane": "target"}, InvalidInputError, "lane='target' is not a Lane"),
        ({"asynchronous": "yes"}, InvalidInputError, "asynchronous='yes'"),
        ({"num_reqs": 9, "num_tokens": 9, "uniform": None}, InvalidInputError, "max_num_reqs"),
    ],
)
def test_bad_input_raises_a_typed_error_naming_the_call(
    kwargs: dict[str, Any], error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error, match=r"Fix: ") as raised:
        start(**kwargs)
    assert fragment in str(raised.value)


def test_numpy_integers_are_ints_and_come_back_as_python_ints() -> None:
    facts = RankBatch(num_reqs=np.int64(2), num_tokens=np.int32(4))  # type: ignore[arg-type]
    assert type(facts.num_reqs) is int
    assert type(facts.num_tokens) is int
    assert facts == RankBatch(num_reqs=2, num_tokens=4)
    # At the limits of the checks: as many requests as tokens, uniform x requests = tokens.
    full = RankBatch(
        num_reqs=np.int64(4),  # type: ignore[arg-type]
        num_tokens=np.int32(4),  # type: ignore[arg-type]
        uniform_token_count=np.int64(1),  # type: ignore[arg-type]
        max_query_len=np.int16(1),  # type: ignore[arg-type]
    )
    assert full == RankBatch(num_reqs=4, num_tokens=4, uniform_token_count=1, max_query_len=1)
    assert {type(full.uniform_token_count), type(full.max_query_len)} == {int}


@pytest.mark.parametrize("field", ["num_reqs", "num_tokens", "num_active_loras"])
@pytest.mark.parametrize("value", [1.0, True])
def test_rank_batch_refuses_a_float_or_bool_count_itself(field: str, value: object) -> None:
    # Refused when built, not first by a dispatcher the batch may never reach.
    counts: dict[str, Any] = {"num_reqs": 1, "num_tokens": 1, "num_active_loras": 0}
    counts[field] = value
    with pytest.raises(InvalidInputError, match=rf"^RankBatch: {field}={value!r} is a"):
        RankBatch(**counts)


def table_like(pending: PendingAgreement, **changes: Any) -> npt.NDArray[Any]:
    table = np.array(pending.contribution, dtype=changes.pop("dtype", np.int32))
    for (row, col), value in changes.pop("cells", {}).items():
        table[row, col] = value
    return table


@pytest.mark.parametrize(
    ("make_table", "fragment"),
    [
        (lambda p: np.zeros((TABLE_ROWS, 3), dtype=np.int32), "expected an int32[5, 2]"),
        (lambda p: np.zeros((4, 2), dtype=np.int32), "expected an int32[5, 2]"),
        (lambda p: table_like(p, dtype=np.int64), "int64"),
        (lambda p: table_like(p).tolist(), "reduced_table is list"),
        (lambda p: table_like(p, cells={(0, 0): 5}), "column 0 is"),
        (lambda p: table_like(p, cells={(ROW_CG_MODE, 1): 3}), "values no rank contributes"),
        (lambda p: table_like(p, cells={(0, 1): -1}), "values no rank contributes"),
        (lambda p: table_like(p, cells={(0, 1): 2, (3, 1): 0}), "values no rank contributes"),
        (lambda p: None, "reduced_table is NoneType"),
    ],
)
def test_a_table_that_is_not_this_agreements_reduction_is_invalid_input(
    make_table: Any, fragment: str
) -> None:
    pending = pending_of(max_query_len=2)
    with pytest.raises(InvalidInputError, match=r"^finish_agreement: ") as raised:
        finish(pending, make_table(pending))
    assert fragment in str(raised.value)


def test_finish_leaves_the_callers_table_unchanged_and_holds_read_only_copies() -> None:
    first, second = pending_of(dp_rank=0), pending_of(dp_rank=1, num_reqs=1, num_tokens=2)
    assert first.contribution is not None
    assert second.contribution is not None
    reduced = np.array(first.contribution + second.contribution)
    before = reduced.copy()
    outcome = finish(first, reduced).result
    assert np.array_equal(reduced, before)
    assert outcome.sync is not None
    counts = outcome.sync.num_tokens_across_dp
    assert counts.flags.writeable is False
    with pytest.raises(ValueError, match=r"(?i)writeable"):
        counts.flags.writeable = True  # not thawable: a view of bytes
    reduced[0, :] = 99
    assert counts.tolist() == [4, 4]


def test_an_eager_sync_copies_the_token_row_and_cannot_be_thawed() -> None:
    pendings = [pending_of(dp_rank=0), pending_of(dp_rank=1, need_eager=True, uniform=None)]
    reduced = np.array(sum(p.contribution for p in pendings if p.contribution is not None))
    outcome = finish(pendings[0], reduced).result
    assert outcome.sync is not None
    counts = outcome.sync.num_tokens_across_dp
    with pytest.raises(ValueError, match=r"(?i)writeable"):
        counts.flags.writeable = True
    reduced[0, :] = 99
    assert counts.tolist() == [4, 4]


def test_some_ranks_reusing_a_sync_while_others_agree_is_a_collective_mismatch() -> None:
    with pytest.raises(CollectiveMismatchError, match=r"ranks \[1\] issue"):
        agree_across_ranks(SPEC, [batch(2, 4, 2, dp_sync=sync([4, 4], uniform=2)), batch(2, 4, 2)])


def test_every_rank_reusing_a_sync_agrees_with_no_collective() -> None:
    agreed = sync([4, 4], uniform=2, reqs=2)
    outcomes = agree_across_ranks(SPEC, [batch(2, 4, 2, dp_sync=agreed)] * 2)
    assert [o.sync for o in outcomes] == [agreed, agreed]


def test_sync_state_rejects_values_no_agreement_produces() -> None:
    with pytest.raises(InvalidInputError, match=r"^DPSyncState: "):
        sync([-1, 4])
    with pytest.raises(InvalidInputError, match="uniform_token_count=0"):
        sync([4, 4], uniform=0)
    with pytest.raises(InvalidInputError, match=r"^DPSyncState: num_tokens_across_dp"):
        DPSyncState(
            num_tokens_across_dp=np.array([1.5, 2.0]),
            uniform_token_count=None,
            eager=True,
            num_reqs=1,
        )
    widest: Any = np.array([2**31 - 1, 0], dtype=np.int64)  # a caller's int64 counts
    taken = DPSyncState(
        num_tokens_across_dp=widest, uniform_token_count=None, eager=True, num_reqs=1
    )
    assert taken.num_tokens_across_dp.tolist() == [2**31 - 1, 0]
    with pytest.raises(InvalidInputError, match=r"^DPSyncState: num_tokens_across_dp"):
        DPSyncState(
            num_tokens_across_dp=widest + 1, uniform_token_count=None, eager=True, num_reqs=1
        )
    with pytest.raises(PureppError, match="eager=1"):
        DPSyncState(
            num_tokens_across_dp=np.array([1, 2]),
            uniform_token_count=None,
            eager=1,  # type: ignore[arg-type]
            num_reqs=1,
        )


def test_the_public_names_exist() -> None:
    import purepp.cudagraph
    import purepp.dp

    for module in (purepp.dp, purepp.cudagraph):
        assert all(hasattr(module, name) for name in module.__all__)


@pytest.mark.parametrize(
    ("build", "name", "low"),
    [
        (
            lambda: RankBatch(num_reqs=1, num_tokens=1, uniform_token_count=0),
            "uniform_token_count",
            1,
        ),
        (lambda: RankBatch(num_reqs=1, num_tokens=1, max_query_len=0), "max_query_len", 1),
        (
            lambda: BatchExecutionDescriptor(cg_mode=CUDAGraphMode.FULL, num_tokens=4, num_reqs=-1),
            "num_reqs",
            0,
        ),
    ],
)
def test_an_optional_count_out_of_range_says_that_none_is_allowed(
    build: Any, name: str, low: int
) -> None:
    with pytest.raises(InvalidInputError) as caught:
        build()
    assert caught.value.fix == f"pass {name} in {low}..{2**31 - 1}, or None"
