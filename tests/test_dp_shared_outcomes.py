"""An agreed graph's outcome is shared between steps, and never handed to the wrong ones.

`AgreementGroup` keeps the frozen outcome of each agreed graph, keyed by the
descriptor's identity, so a steady decode builds no new sync per step. These tests hold
that a group used for many steps (and one copied or unpickled midway, whose cache names
objects of another process) decides exactly what a fresh group decides, step by step,
and against the seed's own procedure.
"""

from __future__ import annotations

import copy
import pickle

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from purepp.cudagraph import BatchExecutionDescriptor, CUDAGraphMode
from purepp.dp import (
    AgreementGroup,
    AgreementLanes,
    DispatchOutcome,
    RankBatch,
    finish_agreement,
    start_agreement,
)
from tests.strategies import DPWorld, dp_worlds, rank_batches
from tests.test_dp_against_seed import SPEC, plain, reduced, seed_agreement

FREE = AgreementLanes()


def _decide(groups: list[AgreementGroup], world: DPWorld, step: int) -> list[DispatchOutcome]:
    """Every rank's outcome of one agreement over `world`, each with its own group."""
    dispatcher, batches = world
    started = [
        start_agreement(FREE, group, dispatcher, batch, step=step)
        for group, batch in zip(groups, batches, strict=True)
    ]
    table = reduced(started)
    return [finish_agreement(s.state, s.result, table.copy()).result for s in started]


@st.composite
def world_sequences(draw: st.DrawFn) -> list[DPWorld]:
    """Steps of one DP group: mostly one dispatcher (so agreed graphs recur with other
    request counts and bounds), sometimes a second one with its own descriptors."""
    dp_size = draw(st.integers(2, 4))
    first = draw(dp_worlds(min_size=dp_size, max_size=dp_size))
    worlds = [first]
    for _ in range(draw(st.integers(0, 5))):
        if draw(st.integers(0, 4)):
            batch = rank_batches(first[0], kind=draw(st.sampled_from([None, "uniform"])))
            worlds.append((first[0], draw(st.lists(batch, min_size=dp_size, max_size=dp_size))))
        else:
            worlds.append(draw(dp_worlds(min_size=dp_size, max_size=dp_size)))
    return worlds


@settings(max_examples=60, deadline=None)
@given(world_sequences(), st.sampled_from(["kept", "pickled", "copied"]))
def test_groups_kept_across_steps_decide_as_fresh_groups_and_the_seed(
    worlds: list[DPWorld], midway: str
) -> None:
    """Each world is decided twice in a row (the second time from the cache), by groups
    that live across every step; halfway they are pickled or copied. Every outcome
    equals a fresh group's and the seed's."""
    dp_size = len(worlds[0][1])
    groups = [AgreementGroup(dp_size=dp_size, dp_rank=r) for r in range(dp_size)]
    step = 0
    for index, world in enumerate(worlds):
        if index == len(worlds) // 2 and midway != "kept":
            if midway == "pickled":
                groups = [pickle.loads(pickle.dumps(g)) for g in groups]
            else:
                groups = [copy.deepcopy(g) for g in groups]
        expected = seed_agreement(*world)
        for _ in range(2):
            step += 1
            fresh = [AgreementGroup(dp_size=dp_size, dp_rank=r) for r in range(dp_size)]
            kept = _decide(groups, world, step)
            assert kept == _decide(fresh, world, step)
            assert [plain(o, dp_size) for o in kept] == expected


def test_a_steady_graph_step_shares_one_outcome() -> None:
    """The same agreed graph twice: the second finish hands back the first one's outcome."""
    batches = [RankBatch(num_reqs=2, num_tokens=4, uniform_token_count=2)] * 2
    groups = [AgreementGroup(dp_size=2, dp_rank=r) for r in range(2)]
    first = _decide(groups, (SPEC, batches), step=1)
    second = _decide(groups, (SPEC, batches), step=2)
    assert first[0].descriptor.cg_mode is not CUDAGraphMode.NONE
    assert second[0] is first[0]
    assert second[1] is first[1]


def test_an_entry_for_another_descriptor_at_the_same_id_is_not_handed_out() -> None:
    """A cached entry counts only for its own descriptor object: an entry whose key holds
    a reused id (as after a pickle into another process) is recomputed, not returned."""
    group = AgreementGroup(dp_size=2, dp_rank=0)
    batches = [RankBatch(num_reqs=2, num_tokens=4, uniform_token_count=2)] * 2
    (outcome, _) = _decide([group, AgreementGroup(dp_size=2, dp_rank=1)], (SPEC, batches), 1)
    other = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.PIECEWISE, num_tokens=16, num_reqs=2)
    sync = outcome.sync
    assert sync is not None
    # Plant the first outcome under the key `other` would have.
    key = (id(other), sync.uniform_token_count, 2, sync.max_query_len)
    group._graph_outcomes[key] = outcome
    made = group._graph_outcome(other, sync.uniform_token_count, 2, sync.max_query_len)
    assert made.descriptor is other
    assert made.sync is not None
    assert made.sync.num_tokens_across_dp.tolist() == [16, 16]
    assert made == attrs.evolve(
        outcome,
        descriptor=other,
        sync=attrs.evolve(sync, num_tokens_across_dp=made.sync.num_tokens_across_dp),
    )


class _OneGraph:
    """A dispatcher that answers every batch with one and the same PIECEWISE graph."""

    def __init__(self) -> None:
        self.graph = BatchExecutionDescriptor(
            cg_mode=CUDAGraphMode.PIECEWISE, num_tokens=64, num_reqs=None
        )

    def dispatch(
        self,
        num_reqs: int,
        num_tokens: int,
        uniform_token_count: int | None,
        /,
        *,
        num_active_loras: int = 0,
        max_query_len: int | None = None,
    ) -> BatchExecutionDescriptor:
        return self.graph


def test_one_graph_object_with_other_agreed_values_gets_their_sync() -> None:
    """The descriptor alone does not key the outcome: the same graph object agreed with
    another request bound, uniform count or query-length bound gets a sync of those."""
    dispatcher = _OneGraph()
    groups = [AgreementGroup(dp_size=2, dp_rank=r) for r in range(2)]
    steps = [
        (RankBatch(num_reqs=2, num_tokens=4), RankBatch(num_reqs=3, num_tokens=4)),
        (RankBatch(num_reqs=2, num_tokens=4), RankBatch(num_reqs=4, num_tokens=4)),
        (
            RankBatch(num_reqs=2, num_tokens=4, uniform_token_count=2),
            RankBatch(num_reqs=2, num_tokens=4, uniform_token_count=2),
        ),
        (RankBatch(num_reqs=2, num_tokens=4), RankBatch(num_reqs=2, num_tokens=4)),
        (
            RankBatch(num_reqs=2, num_tokens=4, max_query_len=2),
            RankBatch(num_reqs=2, num_tokens=4, max_query_len=3),
        ),
        (
            RankBatch(num_reqs=2, num_tokens=4, max_query_len=2),
            RankBatch(num_reqs=2, num_tokens=4, max_query_len=5),
        ),
    ]
    seen = []
    for step, batches in enumerate(steps, start=1):
        kept = _decide(groups, (dispatcher, list(batches)), step)  # type: ignore[arg-type]
        fresh = [AgreementGroup(dp_size=2, dp_rank=r) for r in range(2)]
        assert kept == _decide(fresh, (dispatcher, list(batches)), step)  # type: ignore[arg-type]
        sync = kept[0].sync
        assert sync is not None
        seen.append((sync.num_reqs, sync.uniform_token_count, sync.max_query_len))
    assert seen == [
        (3, None, None),
        (4, None, None),
        (2, 2, None),
        (2, None, None),
        (2, None, 3),
        (2, None, 5),
    ]
