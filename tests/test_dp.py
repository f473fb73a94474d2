"""The DP agreement, case by case: one test per behaviour of the seed's DP sync."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import pytest

from purepp.cudagraph import (
    CaptureMode,
    CudaGraphDispatcher,
    CUDAGraphMode,
)
from purepp.dp import (
    ROW_CG_MODE,
    TABLE_ROWS,
    DispatchOutcome,
    DPSyncState,
    PendingAgreement,
    RankBatch,
    agree_across_ranks,
    finish_agreement,
    start_agreement,
    table_contribution,
    wait_for_agreement,
)
from purepp.effects.vocabulary import (
    AllReduce,
    BufferRef,
    Communicator,
    Op,
    Release,
    WaitWork,
    WorkRef,
)
from purepp.errors import (
    CollectiveMismatchError,
    ConfigError,
    InvalidInputError,
    StaleSyncError,
)
from tests.strategies import desc

FULL = CUDAGraphMode.FULL
PIECEWISE = CUDAGraphMode.PIECEWISE
NONE = CUDAGraphMode.NONE

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
    **kwargs: Any,
) -> Any:
    return start_agreement(
        dispatcher,
        step=kwargs.pop("step", 7),
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        uniform_token_count=uniform,
        dp_size=dp_size,
        dp_rank=dp_rank,
        **kwargs,
    )


def pending_of(**kwargs: Any) -> PendingAgreement:
    started = start(**kwargs)
    assert isinstance(started.state, PendingAgreement)
    return started.state


def batch(reqs: int, tokens: int, uniform: int | None = None, **kwargs: Any) -> RankBatch:
    return RankBatch(num_reqs=reqs, num_tokens=tokens, uniform_token_count=uniform, **kwargs)


# --- phase 1: decided at once ------------------------------------------------------


def test_a_single_rank_decides_at_once_with_no_effect_and_no_sync() -> None:
    started = start(dp_size=1)
    assert started.state is None
    assert started.effects == ()
    assert started.result == DispatchOutcome(descriptor=desc(FULL, 4, 2, uniform=2), sync=None)


def test_need_eager_runs_eager_with_this_ranks_own_counts() -> None:
    started = start(None, dp_size=1, num_reqs=3, num_tokens=5, uniform=None, need_eager=True)
    assert started.result == DispatchOutcome(descriptor=desc(NONE, 5, 3), sync=None)


def test_no_dispatcher_without_need_eager_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"^start_agreement: cudagraph dispatcher is None"):
        start(None)


def test_reusing_an_eager_sync_runs_eager_with_no_collective() -> None:
    agreed = sync([4, 3], eager=True, reqs=2)
    started = start(dp_sync=agreed, num_active_loras=1)
    assert started.effects == ()
    assert started.result == DispatchOutcome(descriptor=desc(NONE, 4, 2, loras=1), sync=agreed)


def test_reusing_a_graph_sync_keeps_it_when_this_dispatcher_pads_alike() -> None:
    agreed = sync([4, 4], uniform=2, reqs=2)
    started = start(dp_sync=agreed)
    assert started.effects == ()
    assert started.result == DispatchOutcome(descriptor=desc(FULL, 4, 2, uniform=2), sync=agreed)


def test_reusing_a_graph_sync_with_a_dispatcher_that_pads_further_reports_the_padded_count() -> (
    None
):
    coarse = attrs.evolve(SPEC, capture_sizes=(8, 16))
    started = start(coarse, dp_sync=sync([4, 4], uniform=2, reqs=2))
    assert started.result.descriptor == desc(FULL, 8, 4, uniform=2)
    assert started.result.sync == sync([8, 8], uniform=2, reqs=2)


def test_a_reused_sync_supplies_the_agreed_uniform_count() -> None:
    # The ranks disagreed (None): this rank's own uniform batch must not take a decode graph.
    started = start(dp_sync=sync([4, 4], uniform=None, reqs=2))
    assert started.result.descriptor == desc(PIECEWISE, 4, None)


def test_a_reused_sync_supplies_the_agreed_query_length_bound() -> None:
    # Beyond the seed: ranks that reuse an agreement with different local bounds would
    # otherwise pick different varlen graphs (field failure 11).
    first = agree_across_ranks(VARLEN, [batch(3, 4, max_query_len=2), batch(2, 3, max_query_len=1)])
    reused = [
        start_agreement(
            VARLEN,
            step=1,
            num_reqs=reqs,
            num_tokens=4,
            uniform_token_count=None,
            dp_size=2,
            dp_rank=rank,
            max_query_len=local_bound,
            dp_sync=first[rank].sync,
        ).result
        for rank, (reqs, local_bound) in enumerate([(3, 2), (2, None)])
    ]
    assert all(outcome is not None for outcome in reused)
    assert {o.descriptor for o in reused if o is not None} == {desc(FULL, 4, 4, query_len=2)}


def test_a_single_rank_never_returns_a_sync_even_when_one_is_reused() -> None:
    started = start(dp_size=1, dp_rank=0, dp_sync=sync([4], uniform=2))
    assert started.result == DispatchOutcome(descriptor=desc(FULL, 4, 2, uniform=2), sync=None)


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
        start(dp_sync=reused, uniform=uniform)
    assert reused.num_tokens_across_dp.flags.writeable is False


def test_a_sync_with_no_uniform_count_may_be_reused_by_a_uniform_batch() -> None:
    started = start(dp_sync=sync([4, 4], reqs=2), uniform=2)
    assert started.result.sync == sync([4, 4], reqs=2)


def test_a_sync_from_a_group_of_another_size_is_invalid_input() -> None:
    with pytest.raises(InvalidInputError, match="dp_sync holds 3 ranks but dp_size=2"):
        start(dp_sync=sync([4, 4, 4]))


# --- phase 1: the all-reduce ----------------------------------------------------------


def test_the_contribution_is_this_ranks_column_with_none_encoded() -> None:
    table = table_contribution(
        dp_size=3,
        dp_rank=1,
        cg_mode=PIECEWISE,
        num_tokens=9,
        num_reqs=3,
        uniform_token_count=None,
        max_query_len=None,
    )
    expected = np.zeros((TABLE_ROWS, 3), dtype=np.int32)
    expected[:, 1] = [9, 1, 0, -1, 3]
    assert table.dtype == np.int32
    assert np.array_equal(table, expected)
    assert table.flags.writeable is False


def test_several_ranks_issue_one_synchronous_all_reduce_over_the_dp_cpu_group() -> None:
    started = start(dp_size=3, dp_rank=2, max_query_len=2)
    pending = started.state
    assert isinstance(pending, PendingAgreement)
    assert started.result is None
    (effect,) = started.effects
    assert effect == AllReduce(
        step=7,
        op=Op.AGREE,
        contribution=pending.contribution,
        result=BufferRef("dp.step7.table"),
        comm=Communicator.DP_CPU,
        work=None,
    )
    assert pending.contribution[:, 2].tolist() == [4, int(FULL), 2, 2, 2]
    assert not pending.contribution[:, :2].any()
    assert wait_for_agreement(pending).effects == ()
    assert wait_for_agreement(pending).result == BufferRef("dp.step7.table")


def test_an_asynchronous_all_reduce_is_completed_by_a_wait_work() -> None:
    pending = pending_of(asynchronous=True, step=3, label="dp.draft")
    assert pending.work == WorkRef("dp.draft.step3.work")
    waited = wait_for_agreement(pending)
    assert waited.effects == (WaitWork(step=3, op=Op.AGREE, work=WorkRef("dp.draft.step3.work")),)
    assert waited.result == BufferRef("dp.draft.step3.table")
    assert waited.state == pending


def test_the_agreement_can_run_over_the_pipeline_group() -> None:
    # field failure 7: stages that pick graphs from rank-local facts never meet.
    started = start(comm=Communicator.PP_CPU)
    assert started.effects[0].comm is Communicator.PP_CPU


def test_need_eager_still_joins_the_collective_and_contributes_eager() -> None:
    pending = pending_of(dispatcher=None, need_eager=True)
    assert pending.contribution[ROW_CG_MODE, 0] == int(NONE)


def test_field_failure_10_an_idle_rank_joins_the_collective_with_neutral_values() -> None:
    busy = start(num_reqs=2, num_tokens=4, dp_rank=0)
    idle = start(num_reqs=0, num_tokens=0, uniform=None, dp_rank=1)
    (busy_effect,) = busy.effects
    (idle_effect,) = idle.effects
    assert attrs.evolve(idle_effect, contribution=busy_effect.contribution) == busy_effect
    assert idle_effect.contribution[:, 1].tolist() == [0, int(NONE), 0, -1, 0]


# --- phase 2: the decision ---------------------------------------------------------


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
    outcome = finish_agreement(pending, reduced).result
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
    reduced = first.contribution + second.contribution
    decided = finish_agreement(second, reduced)
    assert decided.state is None
    assert decided.effects == (Release(step=second.step, op=Op.AGREE, buffer=second.table),)
    assert decided.result == DispatchOutcome(
        descriptor=desc(FULL, 8, 4, uniform=2), sync=sync([8, 8], uniform=2, reqs=4)
    )


# --- validation --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"dp_size": 0}, ConfigError, "dp_size=0"),
        ({"dp_rank": 2}, ConfigError, "dp_rank=2 is outside 0..1"),
        ({"dp_rank": -1}, ConfigError, "dp_rank=-1"),
        ({"num_reqs": -1}, InvalidInputError, "num_reqs=-1"),
        ({"num_tokens": -4}, InvalidInputError, "num_tokens=-4"),
        ({"num_active_loras": -1}, InvalidInputError, "num_active_loras=-1"),
        ({"num_tokens": 2**31}, InvalidInputError, "the table holds int32"),
        ({"uniform": 0}, InvalidInputError, "uniform_token_count=0"),
        ({"max_query_len": 0}, InvalidInputError, "max_query_len=0"),
        ({"num_reqs": 5, "uniform": None}, InvalidInputError, "num_reqs=5 exceeds num_tokens=4"),
        ({"num_reqs": 3}, InvalidInputError, "uniform_token_count=2 x num_reqs=3"),
        ({"step": -1}, InvalidInputError, "step=-1"),
        ({"label": ""}, InvalidInputError, "label=''"),
        ({"num_reqs": 9, "num_tokens": 9, "uniform": None}, InvalidInputError, "max_num_reqs"),
    ],
)
def test_bad_input_raises_a_typed_error_naming_the_call(
    kwargs: dict[str, Any], error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error, match=r"Fix: ") as raised:
        start(**kwargs)
    assert fragment in str(raised.value)


def table_like(pending: PendingAgreement, **changes: Any) -> npt.NDArray[Any]:
    table = np.array(pending.contribution, dtype=changes.pop("dtype", np.int32))
    for (row, col), value in changes.pop("cells", {}).items():
        table[row, col] = value
    return table


@pytest.mark.parametrize(
    ("make_table", "fragment"),
    [
        (lambda p: np.zeros((TABLE_ROWS, 3), dtype=np.int32), "expected int32[5, 2]"),
        (lambda p: np.zeros((4, 2), dtype=np.int32), "expected int32[5, 2]"),
        (lambda p: table_like(p, dtype=np.int64), "int64"),
        (lambda p: table_like(p).tolist(), "reduced_table is a list"),
        (lambda p: table_like(p, cells={(0, 0): 5}), "column 0 is"),
        (lambda p: table_like(p, cells={(ROW_CG_MODE, 1): 3}), "values no rank contributes"),
        (lambda p: table_like(p, cells={(0, 1): -1}), "values no rank contributes"),
        (lambda p: table_like(p, cells={(3, 1): 0}), "values no rank contributes"),
    ],
)
def test_a_table_that_is_not_this_agreements_reduction_is_invalid_input(
    make_table: Any, fragment: str
) -> None:
    pending = pending_of()
    with pytest.raises(InvalidInputError, match=r"^finish_agreement: ") as raised:
        finish_agreement(pending, make_table(pending))
    assert fragment in str(raised.value)


def test_finish_leaves_the_callers_table_unchanged_and_holds_read_only_copies() -> None:
    first, second = pending_of(dp_rank=0), pending_of(dp_rank=1, num_reqs=1, num_tokens=2)
    reduced = np.array(first.contribution + second.contribution)
    before = reduced.copy()
    outcome = finish_agreement(first, reduced).result
    assert np.array_equal(reduced, before)
    assert outcome.sync is not None
    assert outcome.sync.num_tokens_across_dp.flags.writeable is False
    reduced[0, :] = 99
    assert outcome.sync.num_tokens_across_dp.tolist() == [4, 4]


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


def test_the_public_names_exist() -> None:
    import purepp.cudagraph
    import purepp.dp

    for module in (purepp.dp, purepp.cudagraph):
        assert all(hasattr(module, name) for name in module.__all__)
