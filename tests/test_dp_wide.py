"""The DP agreement in wide groups: every way `finish_agreement` reads a table's rows.

The finish reads each row's live bounds with list sorts up to 16 live ranks, one numpy
sort up to 256, and numpy's min and max beyond; the other DP tests use at most five
ranks, so these worlds are widened across each of those limits.
"""

from __future__ import annotations

import itertools

import attrs
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from purepp.cudagraph import CudaGraphDispatcher
from purepp.dp import (
    AgreementGroup,
    AgreementLanes,
    DispatchOutcome,
    RankBatch,
    TableLayout,
    agree_across_ranks,
    finish_agreement,
    start_agreement,
)
from tests.strategies import DPWorld, dp_worlds, table_layouts
from tests.test_dp_properties import as_plain, seed_procedure

LIMITS = [16, 17, 256, 257]  # each side of both limits of the finish's row reads
INT32 = np.iinfo(np.int32)


def widened(batches: list[RankBatch], width: int, data: st.DataObject) -> list[RankBatch]:
    """`width` ranks: the world's batches in turn, or once each then one of them repeated
    (so a row's least or most can sit in one column only)."""
    if data.draw(st.booleans(), label="cycle"):
        return list(itertools.islice(itertools.cycle(batches), width))
    filler = data.draw(st.sampled_from(batches), label="filler")
    return batches + [filler] * (width - len(batches))


@settings(max_examples=60, deadline=None)
@given(dp_worlds(), st.sampled_from(LIMITS), st.data())
def test_wide_groups_decide_as_the_seed_does(
    world: DPWorld, width: int, data: st.DataObject
) -> None:
    dispatcher, batches = world
    wide = widened(batches, width, data)
    outcomes = agree_across_ranks(dispatcher, wide)
    assert [as_plain(o) for o in outcomes] == seed_procedure(dispatcher, wide)


def finish_with_garbage_dead(
    dispatcher: CudaGraphDispatcher,
    batches: list[RankBatch],
    layout: TableLayout,
    live: frozenset[int],
    garbage: int,
) -> list[DispatchOutcome]:
    """Each survivor's outcome when every dead rank's cell holds `garbage`."""
    dp_size = len(batches)
    started = [
        start_agreement(
            AgreementLanes(),
            AgreementGroup(dp_size=dp_size, dp_rank=rank, layout=layout, live_ranks=live),
            dispatcher,
            batches[rank],
            step=3,
        )
        for rank in sorted(live)
    ]
    table = np.full((layout.rows, dp_size), garbage, dtype=np.int32)
    table[:, sorted(live)] = 0
    for begun in started:
        assert begun.result.contribution is not None
        table += begun.result.contribution
    return [finish_agreement(b.state, b.result, table).result for b in started]


@settings(max_examples=60, deadline=None)
@given(
    dp_worlds(min_size=2),
    table_layouts(),
    st.sampled_from(LIMITS),
    st.sampled_from([INT32.min, -7, 0, 3, INT32.max]),
    st.data(),
)
def test_wide_survivors_decide_as_a_group_of_the_survivors_alone(
    world: DPWorld, layout: TableLayout, live_count: int, garbage: int, data: st.DataObject
) -> None:
    dispatcher, batches = world
    dp_size = live_count + data.draw(st.integers(1, 5), label="dead ranks")
    wide = widened(batches, dp_size, data)
    live = frozenset(data.draw(st.permutations(range(dp_size)), label="rank order")[:live_count])
    survivors = sorted(live)
    dead = sorted(set(range(dp_size)) - live)
    outcomes = finish_with_garbage_dead(dispatcher, wide, layout, live, garbage)
    alone = agree_across_ranks(dispatcher, [wide[r] for r in survivors], layout=layout)
    for outcome, expected in zip(outcomes, alone, strict=True):
        assert outcome.descriptor == expected.descriptor
        if outcome.sync is None or expected.sync is None:
            assert outcome.sync is expected.sync is None
            continue
        counts = outcome.sync.num_tokens_across_dp
        assert counts[dead].tolist() == [0] * len(dead)  # a dead rank runs nothing
        assert attrs.evolve(outcome.sync, num_tokens_across_dp=counts[survivors]) == expected.sync
