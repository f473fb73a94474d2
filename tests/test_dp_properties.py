"""Laws of the DP agreement over any per-rank schedule: the same on every rank, in any order.

Covers field failures 10 (idle ranks join the collective), 11 (the agreement fixes every
value that shapes a graph) and 12 (a stale sync is refused), and checks the two-phase
pure protocol against a plain transliteration of the seed's procedure.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from purepp.cudagraph import BatchExecutionDescriptor, CudaGraphDispatcher, CUDAGraphMode
from purepp.dp import (
    AgreementGroup,
    AgreementLanes,
    AgreementStarted,
    DispatchOutcome,
    DPSyncState,
    RankBatch,
    agree_across_ranks,
    finish_agreement,
    start_agreement,
)
from purepp.effects.vocabulary import AllReduce, Communicator
from purepp.errors import PureppError, StaleSyncError
from tests.strategies import DPWorld, cudagraph_dispatchers, dp_worlds


def start_rank(
    dispatcher: CudaGraphDispatcher,
    batches: list[RankBatch],
    rank: int,
    *,
    step: int = 5,
    asynchronous: bool = False,
) -> AgreementStarted:
    group = AgreementGroup(dp_size=len(batches), dp_rank=rank)
    return start_agreement(
        AgreementLanes(), group, dispatcher, batches[rank], step=step, asynchronous=asynchronous
    )


def seed_procedure(
    dispatcher: CudaGraphDispatcher, batches: list[RankBatch]
) -> list[tuple[BatchExecutionDescriptor, tuple[list[int], int | None, bool, int] | None]]:
    """The seed's dispatch-then-sync, step by step over a plain table (no dp_sync reuse)."""
    dp_size = len(batches)
    wanted = []
    for b in batches:
        if b.need_eager:
            wanted.append(
                BatchExecutionDescriptor(
                    cg_mode=CUDAGraphMode.NONE,
                    num_tokens=b.num_tokens,
                    num_reqs=b.num_reqs,
                    num_active_loras=b.num_active_loras,
                )
            )
        else:
            wanted.append(
                dispatcher.dispatch(
                    b.num_reqs,
                    b.num_tokens,
                    b.uniform_token_count,
                    num_active_loras=b.num_active_loras,
                    max_query_len=b.max_query_len,
                )
            )
    if dp_size == 1:
        return [(wanted[0], None)]
    table = [[0] * dp_size for _ in range(5)]
    for rank, (b, d) in enumerate(zip(batches, wanted, strict=True)):
        table[0][rank] = b.num_tokens
        table[1][rank] = int(d.cg_mode)
        table[2][rank] = b.uniform_token_count or 0
        table[3][rank] = b.max_query_len or -1
        table[4][rank] = b.num_reqs
    tokens, modes, uniforms, query_lens, reqs = table
    uniform: int | None = uniforms[0]
    if uniform == 0 or any(u != uniform for u in uniforms):
        uniform = None
    results: list[
        tuple[BatchExecutionDescriptor, tuple[list[int], int | None, bool, int] | None]
    ] = []
    for b, d in zip(batches, wanted, strict=True):
        if all(t == 0 for t in tokens):
            idle = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=0, num_reqs=0)
            results.append((idle, None))
            continue
        if min(modes) == 0:
            eager = BatchExecutionDescriptor(
                cg_mode=CUDAGraphMode.NONE,
                num_tokens=b.num_tokens,
                num_reqs=b.num_reqs,
                num_active_loras=d.num_active_loras,
            )
            results.append((eager, (list(tokens), uniform, True, max(reqs))))
            continue
        query_len = max(query_lens) if all(q != -1 for q in query_lens) else None
        graph = dispatcher.dispatch(
            b.num_reqs,
            max(tokens),
            uniform,
            num_active_loras=b.num_active_loras,
            max_query_len=query_len,
        )
        padded_reqs = (
            graph.num_reqs
            if graph.cg_mode == CUDAGraphMode.FULL and graph.num_reqs is not None
            else max(reqs)
        )
        results.append((graph, ([graph.num_tokens] * dp_size, uniform, False, padded_reqs)))
    return results


def without_loras(descriptor: BatchExecutionDescriptor) -> BatchExecutionDescriptor:
    return attrs.evolve(descriptor, num_active_loras=0)


def as_plain(outcome: DispatchOutcome) -> tuple[object, object]:
    sync = outcome.sync
    if sync is None:
        return outcome.descriptor, None
    plain = (
        sync.num_tokens_across_dp.tolist(),
        sync.uniform_token_count,
        sync.eager,
        sync.num_reqs,
    )
    return outcome.descriptor, plain


@settings(max_examples=300)
@given(dp_worlds())
def test_the_pure_agreement_reproduces_the_seed_procedure(world: DPWorld) -> None:
    dispatcher, batches = world
    outcomes = agree_across_ranks(dispatcher, batches)
    assert [as_plain(o) for o in outcomes] == seed_procedure(dispatcher, batches)


@given(dp_worlds(min_size=2))
def test_field_failure_10_every_rank_issues_the_same_collective(world: DPWorld) -> None:
    """Idle, eager and busy ranks alike issue one all-reduce, equal but for their column."""
    dispatcher, batches = world
    all_reduces: list[AllReduce] = []
    for rank in range(len(batches)):
        (effect,) = start_rank(dispatcher, batches, rank).effects
        assert isinstance(effect, AllReduce)
        all_reduces.append(effect)
    blank = np.zeros((5, len(batches)), dtype=np.int32)
    assert len({attrs.evolve(e, contribution=blank) for e in all_reduces}) == 1
    for rank, effect in enumerate(all_reduces):
        others = np.delete(effect.contribution, rank, axis=1)
        assert not others.any()
        assert effect.contribution.dtype == np.int32
        assert effect.comm is Communicator.DP_CPU


@settings(max_examples=300)
@given(dp_worlds())
def test_field_failure_11_every_rank_agrees_on_every_shaping_value(world: DPWorld) -> None:
    dispatcher, batches = world
    outcomes = agree_across_ranks(dispatcher, batches)
    syncs = {o.sync for o in outcomes if o.sync is not None}
    assert len(syncs) <= 1
    assert all(o.sync is None for o in outcomes) or all(o.sync is not None for o in outcomes)
    modes = {o.descriptor.cg_mode for o in outcomes}
    assert len(modes) == 1
    first = outcomes[0]
    if first.sync is None:
        if len(batches) > 1:  # no rank had work
            assert all(o.descriptor.num_tokens == 0 for o in outcomes)
        return
    agreed = first.sync
    for rank, (outcome, b) in enumerate(zip(outcomes, batches, strict=True)):
        d = outcome.descriptor
        # The forward context reports exactly the token count each rank runs.
        assert agreed.num_tokens_across_dp[rank] == d.num_tokens
        if agreed.eager:
            assert (d.cg_mode, d.num_tokens, d.num_reqs) == (
                CUDAGraphMode.NONE,
                b.num_tokens,
                b.num_reqs,
            )
            continue
        shape = (d.num_tokens, d.uniform_token_count, d.max_query_len)
        first_d = first.descriptor
        assert shape == (first_d.num_tokens, first_d.uniform_token_count, first_d.max_query_len)
        assert d.num_tokens >= max(x.num_tokens for x in batches)
        if d.cg_mode is CUDAGraphMode.FULL:
            assert d.num_reqs == agreed.num_reqs >= max(x.num_reqs for x in batches)
        if d.cg_mode is CUDAGraphMode.PIECEWISE:
            assert d.num_reqs is None
        if d.uniform_token_count is not None:
            assert all(x.uniform_token_count == d.uniform_token_count for x in batches)


@given(dp_worlds(min_size=2), st.data())
def test_the_agreement_does_not_depend_on_the_rank_order(
    world: DPWorld, data: st.DataObject
) -> None:
    dispatcher, batches = world
    order = data.draw(st.permutations(range(len(batches))))
    outcomes = agree_across_ranks(dispatcher, batches)
    permuted = agree_across_ranks(dispatcher, [batches[i] for i in order])
    for position, source in enumerate(order):
        assert permuted[position].descriptor == outcomes[source].descriptor
    sync, permuted_sync = outcomes[0].sync, permuted[0].sync
    if sync is None or permuted_sync is None:
        assert sync is permuted_sync is None
        return
    reordered = attrs.evolve(sync, num_tokens_across_dp=sync.num_tokens_across_dp[list(order)])
    assert permuted_sync == reordered


@given(dp_worlds(), st.booleans())
def test_equal_inputs_give_equal_outputs_effect_names_included(
    world: DPWorld, asynchronous: bool
) -> None:
    dispatcher, batches = world
    twin = (attrs.evolve(dispatcher), [attrs.evolve(b) for b in batches])
    for rank in range(len(batches)):
        assert start_rank(dispatcher, batches, rank, asynchronous=asynchronous) == start_rank(
            *twin, rank, asynchronous=asynchronous
        )
    assert agree_across_ranks(dispatcher, batches) == agree_across_ranks(*twin)
    assert agree_across_ranks(dispatcher, batches, asynchronous=True) == agree_across_ranks(
        dispatcher, batches
    )


@given(dp_worlds(min_size=2))
def test_reusing_the_agreement_on_every_rank_reproduces_it_with_no_collective(
    world: DPWorld,
) -> None:
    """A drafter's prefill over the target's batch shape reuses the target's sync."""
    dispatcher, batches = world
    outcomes = agree_across_ranks(dispatcher, batches)
    agreed = outcomes[0].sync
    if agreed is None:
        return
    # The drafter passes the bound of the graph it replays, as a seed caller must; purepp's
    # reuse dispatches with the sync's agreed bound instead (README, parity).
    reusing = [
        attrs.evolve(
            b,
            num_tokens=int(agreed.num_tokens_across_dp[rank]),
            max_query_len=outcome.descriptor.max_query_len,
            dp_sync=agreed,
        )
        for rank, (b, outcome) in enumerate(zip(batches, outcomes, strict=True))
    ]
    for rank in range(len(batches)):
        assert start_rank(dispatcher, reusing, rank).effects == ()
        assert start_rank(dispatcher, reusing, rank).result.decided is not None
    reused = agree_across_ranks(dispatcher, reusing)
    assert [o.sync for o in reused] == [o.sync for o in outcomes]
    # An eager reuse reports the caller's LoRA count, the agreement the dispatched case.
    assert [without_loras(o.descriptor) for o in reused] == [
        without_loras(o.descriptor) for o in outcomes
    ]


def seed_reuse(
    dispatcher: CudaGraphDispatcher, batch: RankBatch, rank: int, agreed: DPSyncState
) -> tuple[BatchExecutionDescriptor, tuple[list[int], int | None, bool, int]]:
    """The seed's dispatch_cg_and_sync_dp given a dp_sync (dp_size > 1), step by step."""
    if batch.need_eager or agreed.eager:
        wanted = BatchExecutionDescriptor(
            cg_mode=CUDAGraphMode.NONE,
            num_tokens=batch.num_tokens,
            num_reqs=batch.num_reqs,
            num_active_loras=batch.num_active_loras,
        )
    else:
        wanted = dispatcher.dispatch(
            batch.num_reqs,
            batch.num_tokens,
            agreed.uniform_token_count,
            num_active_loras=batch.num_active_loras,
            max_query_len=batch.max_query_len,
        )
    assert agreed.num_tokens_across_dp[rank] == batch.num_tokens
    assert agreed.uniform_token_count in (None, batch.uniform_token_count)
    counts = agreed.num_tokens_across_dp.tolist()
    if not agreed.eager and wanted.num_tokens != batch.num_tokens:
        counts = [wanted.num_tokens] * len(counts)
    return wanted, (counts, agreed.uniform_token_count, agreed.eager, agreed.num_reqs)


@settings(max_examples=300)
@given(dp_worlds(min_size=2), cudagraph_dispatchers(), st.data())
def test_a_reuse_reproduces_the_seeds_dispatch_with_a_dp_sync(
    world: DPWorld, drafter: CudaGraphDispatcher, data: st.DataObject
) -> None:
    """Another dispatcher (a drafter's), fewer requests, forced eager or other LoRA counts:
    each rank decides as the seed does, with no collective. The caller passes the agreed
    query-length bound, where purepp's reuse takes it from the sync (a documented
    difference, stated by test_dp.py::test_a_reused_sync_supplies_the_agreed_query_length_bound).
    """
    dispatcher, batches = world
    agreed = agree_across_ranks(dispatcher, batches)[0].sync
    assume(agreed is not None)  # no rank had work: nothing to reuse
    assert agreed is not None
    limit = max(drafter.max_num_reqs, dispatcher.max_num_reqs)
    drafter = data.draw(st.sampled_from([dispatcher, attrs.evolve(drafter, max_num_reqs=limit)]))
    reusing = [
        attrs.evolve(
            b,
            num_reqs=data.draw(st.integers(0, b.num_reqs)),
            num_tokens=int(agreed.num_tokens_across_dp[rank]),
            max_query_len=agreed.max_query_len,
            need_eager=data.draw(st.sampled_from([False, False, False, True])),
            num_active_loras=data.draw(st.sampled_from([0, 0, 1, 2, 5])),
            dp_sync=agreed,
        )
        for rank, b in enumerate(batches)
    ]
    for rank, b in enumerate(reusing):
        group = AgreementGroup(dp_size=len(batches), dp_rank=rank)
        started = start_agreement(AgreementLanes(), group, drafter, b, step=5)
        assert started.effects == ()
        outcome = finish_agreement(started.state, started.result, None).result
        assert as_plain(outcome) == seed_reuse(drafter, b, rank, agreed)


@given(dp_worlds(min_size=2), st.data())
def test_field_failure_12_a_sync_from_another_batch_is_refused(
    world: DPWorld, data: st.DataObject
) -> None:
    dispatcher, batches = world
    agreed = agree_across_ranks(dispatcher, batches)[0].sync
    if agreed is None:
        return
    rank = data.draw(st.integers(0, len(batches) - 1))
    other = int(agreed.num_tokens_across_dp[rank]) + data.draw(st.integers(1, 8))
    stale = attrs.evolve(batches[rank], num_tokens=other, dp_sync=agreed)
    before = agreed.num_tokens_across_dp.copy()
    with pytest.raises(StaleSyncError, match=r"^start_agreement: dp_sync was taken over"):
        start_rank(dispatcher, [*batches[:rank], stale, *batches[rank + 1 :]], rank)
    assert np.array_equal(agreed.num_tokens_across_dp, before)


@given(dp_worlds(min_size=2), st.data())
def test_bad_input_raises_a_typed_error_and_changes_nothing(
    world: DPWorld, data: st.DataObject
) -> None:
    dispatcher, batches = world
    rank = data.draw(st.integers(0, len(batches) - 1))
    field = data.draw(st.sampled_from(["num_reqs", "num_tokens", "num_active_loras"]))
    value = -data.draw(st.integers(1, 5))
    with pytest.raises(PureppError, match=rf"^RankBatch: {field}=-"):
        attrs.evolve(batches[rank], **{field: value})  # type: ignore[arg-type]
    # A corrupted table is refused and neither it nor the pending agreement changes.
    started = [start_rank(dispatcher, batches, r) for r in range(len(batches))]
    pendings = [s.result for s in started]
    assert all(p.decided is None for p in pendings)
    pending = pendings[rank]
    reduced = np.zeros_like(pendings[rank].contribution)
    for p in pendings:
        reduced += p.contribution
    reduced[1, rank] += 7
    before, kept = reduced.copy(), attrs.evolve(pending)
    with pytest.raises(PureppError, match=r"^finish_agreement: "):
        finish_agreement(started[rank].state, pending, reduced)
    assert np.array_equal(reduced, before)
    assert pending == kept


def test_a_sync_state_holds_only_values_equal_on_every_rank() -> None:
    # A guard against adding a per-rank field: every field is agreed.
    assert [f.name for f in attrs.fields(DPSyncState)] == [
        "num_tokens_across_dp",
        "uniform_token_count",
        "eager",
        "num_reqs",
        "max_query_len",
    ]
