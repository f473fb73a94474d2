"""The newest vLLM agreement (six rows, microbatching) and the dead-rank-neutral agreement.

The microbatch decision is checked against a plain re-expression of the newest vLLM
procedure (`newest_procedure`), with each rank's `uniform_decode` flag set the way a
consistent caller sets it; a separate test shows the hole that flag leaves open and
that purepp has no such input. Dead ranks: a decision never reads a dead column, and
the survivors agree with a world that never had the dead ranks.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from purepp.cudagraph import (
    BatchExecutionDescriptor,
    CaptureMode,
    CudaGraphDispatcher,
    CUDAGraphMode,
)
from purepp.dp import (
    ROW_ALLOW_UBATCHING,
    SEED_TABLE,
    AgreementGroup,
    AgreementLanes,
    DispatchOutcome,
    Lane,
    MicrobatchConfig,
    RankBatch,
    TableLayout,
    agree_across_ranks,
    finish_agreement,
    start_agreement,
)
from purepp.effects.arrays import IntArray
from purepp.effects.vocabulary import AllReduce
from purepp.errors import ConfigError, InvalidInputError
from tests.strategies import DPWorld, dead_rank_sets, dp_worlds, microbatch_configs, table_layouts

FREE = AgreementLanes()
NONE = CUDAGraphMode.NONE
SPEC = CudaGraphDispatcher(
    capture_sizes=(1, 2, 4, 8, 16),
    capture_mode=CaptureMode.FULL_AND_PIECEWISE,
    max_num_reqs=8,
    num_speculative_tokens=1,
)
MICRO = TableLayout(
    microbatch=MicrobatchConfig(decode_token_threshold=4, prefill_token_threshold=6)
)
Plain = tuple[BatchExecutionDescriptor, tuple[list[int], int | None, bool, int] | None]


def newest_procedure(
    dispatcher: CudaGraphDispatcher,
    batches: list[RankBatch],
    config: MicrobatchConfig,
    flags: list[bool] | None = None,
) -> list[Plain]:
    """The newest vLLM's six-row agreement, rank by rank over a plain table.

    `flags` are the ranks' own `uniform_decode` arguments; by default each rank sets it
    when its batch is a uniform decode. LoRA counts are left out of the comparison.
    """
    dp_size = len(batches)
    flags = [b.uniform_token_count is not None for b in batches] if flags is None else flags
    wanted = [
        BatchExecutionDescriptor(cg_mode=NONE, num_tokens=b.num_tokens, num_reqs=b.num_reqs)
        if b.need_eager
        else dispatcher.dispatch(
            b.num_reqs, b.num_tokens, b.uniform_token_count, max_query_len=b.max_query_len
        )
        for b in batches
    ]
    table = [[0] * dp_size for _ in range(6)]
    for rank, (b, d) in enumerate(zip(batches, wanted, strict=True)):
        table[0][rank] = b.num_tokens
        table[1][rank] = int(d.cg_mode)
        table[2][rank] = b.uniform_token_count or 0
        table[3][rank] = b.max_query_len or -1
        table[4][rank] = 1  # every rank allows microbatching
        table[5][rank] = b.num_reqs
    tokens, modes, uniforms, query_lens, votes, reqs = table
    uniform: int | None = uniforms[0]
    if uniform == 0 or any(u != uniform for u in uniforms):
        uniform = None
    results: list[Plain] = []
    for rank, b in enumerate(batches):
        if all(t == 0 for t in tokens):
            results.append((BatchExecutionDescriptor(cg_mode=NONE, num_tokens=0, num_reqs=0), None))
            continue
        if all(v == 1 for v in votes):
            decode = flags[rank] and all(u == (b.uniform_token_count or 0) for u in uniforms)
            threshold = config.decode_token_threshold if decode else config.prefill_token_threshold
            if min(tokens) >= threshold:
                most = max(tokens)
                split = BatchExecutionDescriptor(
                    cg_mode=NONE,
                    num_tokens=most,
                    num_reqs=b.num_reqs,
                    num_ubatches=config.num_ubatches,
                )
                results.append((split, ([most] * dp_size, uniform, True, max(reqs))))
                continue
        if min(modes) == 0:
            eager = BatchExecutionDescriptor(
                cg_mode=NONE, num_tokens=b.num_tokens, num_reqs=b.num_reqs
            )
            results.append((eager, (list(tokens), uniform, True, max(reqs))))
            continue
        query_len = max(query_lens) if all(q != -1 for q in query_lens) else None
        graph = dispatcher.dispatch(b.num_reqs, max(tokens), uniform, max_query_len=query_len)
        padded = graph.num_reqs if graph.cg_mode is CUDAGraphMode.FULL and graph.num_reqs else None
        results.append((graph, ([graph.num_tokens] * dp_size, uniform, False, padded or max(reqs))))
    return results


def plain(outcome: DispatchOutcome) -> Plain:
    descriptor = attrs.evolve(outcome.descriptor, num_active_loras=0)
    sync = outcome.sync
    if sync is None:
        return descriptor, None
    agreed = (
        sync.num_tokens_across_dp.tolist(),
        sync.uniform_token_count,
        sync.eager,
        sync.num_reqs,
    )
    return descriptor, agreed


def without_loras(world: DPWorld) -> DPWorld:
    # The re-expression dispatches without LoRA; LoRA never changes a decision's shape.
    dispatcher, batches = world
    return dispatcher, [attrs.evolve(b, num_active_loras=0) for b in batches]


# --- the newest layout -------------------------------------------------------------------


def test_the_newest_layout_has_six_rows_and_every_rank_votes() -> None:
    group = AgreementGroup(dp_size=3, dp_rank=2, layout=MICRO)
    idle = RankBatch(num_reqs=0, num_tokens=0)
    (effect,) = start_agreement(FREE, group, SPEC, idle, step=1).effects
    assert isinstance(effect, AllReduce)
    assert effect.contribution.shape == (6, 3)
    # An idle rank votes like any other (vllm#50945): it cannot opt the group out.
    assert effect.contribution[:, 2].tolist() == [0, int(NONE), 0, -1, 1, 0]
    assert ROW_ALLOW_UBATCHING == 4
    assert (SEED_TABLE.rows, SEED_TABLE.row_num_reqs) == (5, 4)
    assert (MICRO.rows, MICRO.row_num_reqs) == (6, 5)


@pytest.mark.parametrize("vote", [-1, 2, 3])
def test_a_microbatch_vote_no_rank_casts_is_refused(vote: int) -> None:
    # Every rank votes 0 or 1 in its own column: any other vote is not a reduction.
    group = AgreementGroup(dp_size=2, dp_rank=0, layout=MICRO)
    started = start_agreement(FREE, group, SPEC, RankBatch(num_reqs=2, num_tokens=4), step=1)
    pending = started.result
    assert pending.contribution is not None
    table = np.array(pending.contribution)
    table[:, 1] = table[:, 0]  # rank 1 contributed what this rank did, but its vote
    table[ROW_ALLOW_UBATCHING, 1] = vote
    with pytest.raises(InvalidInputError, match="values no rank contributes"):
        finish_agreement(started.state, pending, table)


def test_ranks_that_reach_the_threshold_split_eager_padded_to_the_most_tokens() -> None:
    batches = [RankBatch(num_reqs=3, num_tokens=6), RankBatch(num_reqs=4, num_tokens=9)]
    outcomes = agree_across_ranks(SPEC, batches, layout=MICRO)
    assert [o.descriptor for o in outcomes] == [
        BatchExecutionDescriptor(cg_mode=NONE, num_tokens=9, num_reqs=3, num_ubatches=2),
        BatchExecutionDescriptor(cg_mode=NONE, num_tokens=9, num_reqs=4, num_ubatches=2),
    ]
    sync = outcomes[0].sync
    assert sync is not None
    assert (sync.num_tokens_across_dp.tolist(), sync.eager, sync.num_reqs) == ([9, 9], True, 4)


def test_the_smallest_rank_below_the_threshold_keeps_the_seed_decision() -> None:
    batches = [RankBatch(num_reqs=3, num_tokens=5), RankBatch(num_reqs=4, num_tokens=9)]
    assert agree_across_ranks(SPEC, batches, layout=MICRO) == agree_across_ranks(SPEC, batches)


def test_an_idle_rank_holds_the_group_below_any_positive_threshold() -> None:
    batches = [RankBatch(num_reqs=0, num_tokens=0), RankBatch(num_reqs=8, num_tokens=16)]
    outcomes = agree_across_ranks(SPEC, batches, layout=MICRO)
    assert all(o.descriptor.num_ubatches == 1 for o in outcomes)


def test_a_uniform_decode_is_held_to_the_decode_threshold() -> None:
    # 2 requests x 2 tokens = 4 tokens: at the decode threshold (4), below the prefill one (6).
    decode = [RankBatch(num_reqs=2, num_tokens=4, uniform_token_count=2)] * 2
    assert {o.descriptor.num_ubatches for o in agree_across_ranks(SPEC, decode, layout=MICRO)} == {
        2
    }
    mixed = [RankBatch(num_reqs=2, num_tokens=4)] * 2
    assert {o.descriptor.num_ubatches for o in agree_across_ranks(SPEC, mixed, layout=MICRO)} == {1}


def test_the_per_rank_flag_of_the_newest_code_can_make_ranks_diverge_and_purepp_cannot() -> None:
    """The known hole: equal uniform counts, different `uniform_decode` flags."""
    batches = [RankBatch(num_reqs=2, num_tokens=4, uniform_token_count=2)] * 2
    config = MICRO.microbatch
    assert config is not None
    theirs = newest_procedure(SPEC, batches, config, flags=[True, False])
    assert theirs[0][0].num_ubatches != theirs[1][0].num_ubatches  # a hang in a real group
    ours = agree_across_ranks(SPEC, batches, layout=MICRO)
    assert ours[0].descriptor.num_ubatches == ours[1].descriptor.num_ubatches


def test_a_layout_takes_a_microbatch_config_and_thresholds_are_ints() -> None:
    with pytest.raises(ConfigError, match=r"^TableLayout: microbatch="):
        TableLayout(microbatch=2)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^MicrobatchConfig: decode_token_threshold=1.5"):
        MicrobatchConfig(decode_token_threshold=1.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"num_ubatches=1 is outside 2..64"):
        MicrobatchConfig(num_ubatches=1)


@settings(max_examples=300)
@given(dp_worlds(), microbatch_configs())
def test_the_newest_layout_reproduces_the_newest_procedure(
    world: DPWorld, config: MicrobatchConfig
) -> None:
    dispatcher, batches = without_loras(world)
    outcomes = agree_across_ranks(dispatcher, batches, layout=TableLayout(microbatch=config))
    expected = newest_procedure(dispatcher, batches, config)
    if len(batches) == 1:  # a single rank agrees nothing (no table, no microbatching)
        assert [o.sync for o in outcomes] == [None]
        return
    assert [plain(o) for o in outcomes] == expected


def _same_decision(outcomes: tuple[DispatchOutcome, ...]) -> None:
    syncs = {o.sync for o in outcomes}
    assert len(syncs) == 1
    shapes = {
        (o.descriptor.cg_mode, o.descriptor.num_ubatches, o.descriptor.uniform_token_count)
        for o in outcomes
    }
    assert len(shapes) == 1
    first = outcomes[0]
    if first.sync is not None and not (first.sync.eager and first.descriptor.num_ubatches == 1):
        # Padded to one count (graphs and microbatches); a plain eager step keeps its own.
        assert len({o.descriptor.num_tokens for o in outcomes}) == 1


@settings(max_examples=200)
@given(dp_worlds(min_size=2), table_layouts(), st.data())
def test_every_rank_decides_alike_in_any_rank_order_with_any_ranks_idle(
    world: DPWorld, layout: TableLayout, data: st.DataObject
) -> None:
    dispatcher, batches = world
    idle = data.draw(st.sets(st.integers(0, len(batches) - 1)))
    batches = [
        RankBatch(num_reqs=0, num_tokens=0) if r in idle else b for r, b in enumerate(batches)
    ]
    outcomes = agree_across_ranks(dispatcher, batches, layout=layout)
    _same_decision(outcomes)
    order = data.draw(st.permutations(range(len(batches))))
    permuted = agree_across_ranks(dispatcher, [batches[i] for i in order], layout=layout)
    for position, source in enumerate(order):
        assert permuted[position].descriptor == outcomes[source].descriptor


# --- dead ranks --------------------------------------------------------------------------


def finish_survivors(
    dispatcher: CudaGraphDispatcher,
    batches: list[RankBatch],
    layout: TableLayout,
    dead: frozenset[int],
    stale: IntArray,
) -> list[DispatchOutcome]:
    """Each survivor's outcome when the dead ranks' columns hold `stale`."""
    dp_size = len(batches)
    live = frozenset(range(dp_size)) - dead
    started = [
        start_agreement(
            FREE,
            AgreementGroup(dp_size=dp_size, dp_rank=rank, layout=layout, live_ranks=live),
            dispatcher,
            batches[rank],
            step=4,
        )
        for rank in sorted(live)
    ]
    table = np.zeros((layout.rows, dp_size), dtype=np.int32)
    for begun in started:
        assert begun.result.contribution is not None
        table += begun.result.contribution
    for rank in dead:
        table[:, rank] = stale[:, rank]
    return [finish_agreement(b.state, b.result, table).result for b in started]


def stale_tables(rows: int, dp_size: int) -> st.SearchStrategy[IntArray]:
    """Anything at all: a dead rank's column is whatever the collective left there."""
    values = st.integers(np.iinfo(np.int32).min, np.iinfo(np.int32).max)
    cells = st.lists(values, min_size=rows * dp_size, max_size=rows * dp_size)
    return cells.map(lambda v: np.array(v, dtype=np.int32).reshape(rows, dp_size))


@settings(max_examples=200)
@given(dp_worlds(min_size=2), table_layouts(), st.data())
def test_a_decision_never_depends_on_a_dead_ranks_column(
    world: DPWorld, layout: TableLayout, data: st.DataObject
) -> None:
    dispatcher, batches = world
    dead = data.draw(dead_rank_sets(len(batches)))
    first = data.draw(stale_tables(layout.rows, len(batches)))
    second = data.draw(stale_tables(layout.rows, len(batches)))
    outcomes = finish_survivors(dispatcher, batches, layout, dead, first)
    assert outcomes == finish_survivors(dispatcher, batches, layout, dead, second)
    _same_decision(tuple(outcomes))


@settings(max_examples=200)
@given(dp_worlds(min_size=2), table_layouts(), st.data())
def test_survivors_agree_with_a_world_that_never_had_the_dead_ranks(
    world: DPWorld, layout: TableLayout, data: st.DataObject
) -> None:
    dispatcher, batches = world
    dead = data.draw(dead_rank_sets(len(batches)))
    survivors = [r for r in range(len(batches)) if r not in dead]
    stale = data.draw(stale_tables(layout.rows, len(batches)))
    outcomes = finish_survivors(dispatcher, batches, layout, dead, stale)
    smaller = [batches[r] for r in survivors]
    if len(smaller) == 1:
        # A group of one agrees nothing; the survivor of a larger group still agrees
        # with itself: its shape is its own unless microbatched (an idle step of a group
        # reports no LoRA case, as in the seed).
        (alone,) = agree_across_ranks(dispatcher, smaller, layout=layout)
        (outcome,) = outcomes
        if outcome.descriptor.num_ubatches == 1:
            assert plain(outcome)[0] == plain(alone)[0]
        return
    expected = agree_across_ranks(dispatcher, smaller, layout=layout)
    for outcome, alone in zip(outcomes, expected, strict=True):
        assert outcome.descriptor == alone.descriptor
        if outcome.sync is None or alone.sync is None:
            assert outcome.sync is alone.sync is None
            continue
        counts = outcome.sync.num_tokens_across_dp
        assert counts[sorted(dead)].tolist() == [0] * len(dead)  # a dead rank runs nothing
        assert attrs.evolve(outcome.sync, num_tokens_across_dp=counts[survivors]) == alone.sync


def test_a_dead_eager_rank_no_longer_forces_eager() -> None:
    batches = [
        RankBatch(num_reqs=2, num_tokens=4, uniform_token_count=2),
        RankBatch(num_reqs=1, num_tokens=3, need_eager=True),
        RankBatch(num_reqs=2, num_tokens=4, uniform_token_count=2),
    ]
    assert agree_across_ranks(SPEC, batches)[0].descriptor.cg_mode is NONE
    outcomes = agree_across_ranks(SPEC, batches, live_ranks={0, 2})
    assert [o.descriptor.cg_mode for o in outcomes] == [CUDAGraphMode.FULL] * 2
    assert outcomes[0].sync is not None
    assert outcomes[0].sync.num_tokens_across_dp.tolist() == [4, 0, 4]


def test_a_group_marks_ranks_dead_and_must_keep_itself_alive() -> None:
    group = AgreementGroup(dp_size=4, dp_rank=1).mark_dead(3, 0)
    assert (group.live, group.all_live) == ((1, 2), False)
    with pytest.raises(ConfigError, match=r"dp_rank=1 is not among live_ranks=\[0, 2\]"):
        AgreementGroup(dp_size=4, dp_rank=1, live_ranks={0, 2})
    with pytest.raises(ConfigError, match=r"live rank=7 is outside 0..3"):
        AgreementGroup(dp_size=4, dp_rank=1, live_ranks={1, 7})
    with pytest.raises(ConfigError, match=r"live_ranks='12' is not a set of ranks"):
        AgreementGroup(dp_size=4, dp_rank=1, live_ranks="12")  # type: ignore[arg-type]


def test_a_drafter_reusing_a_split_agreement_runs_eager_at_the_agreed_count_unsplit() -> None:
    """The seed's reuse of an eager sync builds its eager descriptor without a split: the
    drafter runs eager at the agreed (padded) count with one microbatch, on every rank,
    with no collective."""
    batches = [RankBatch(num_reqs=3, num_tokens=6), RankBatch(num_reqs=4, num_tokens=9)]
    outcomes = agree_across_ranks(SPEC, batches, layout=MICRO)
    assert {o.descriptor.num_ubatches for o in outcomes} == {2}
    for rank, (batch, outcome) in enumerate(zip(batches, outcomes, strict=True)):
        sync = outcome.sync
        assert sync is not None
        reuse = attrs.evolve(batch, dp_sync=sync, num_tokens=int(sync.num_tokens_across_dp[rank]))
        group = AgreementGroup(dp_size=2, dp_rank=rank, layout=MICRO)
        started = start_agreement(FREE, group, SPEC, reuse, step=1, lane=Lane.DRAFTER)
        assert started.effects == ()
        drafter = finish_agreement(started.state, started.result, None).result
        assert drafter.descriptor == BatchExecutionDescriptor(
            cg_mode=NONE, num_tokens=9, num_reqs=batch.num_reqs, num_ubatches=1
        )
        assert drafter.sync == sync
