"""Review: a group's shared outcomes of agreed graphs, and the one-read table check
(commit 3bf5f43, `AgreementGroup._graph_outcome` and `dp._check_table`).

An `AgreementGroup` keeps the outcome of each agreed graph keyed by the descriptor's
identity and the agreed values, so a steady decode builds no sync per step. No cached
outcome may reach a step that should decide otherwise: groups kept across many
agreements (one dispatcher shared by groups of other sizes, dead ranks and layouts,
both lanes, dispatchers answering one shared descriptor object for many batches or a
new one per call, groups copied or pickled midway, a full cache) decide, step by step,
what fresh groups decide, notes included. A small group's table is now read with one
`tolist()`: it accepts and refuses exactly the tables the previous read did, with the
same text.

A bug in the group's caches found on the way is a plain test now: a group that went
through pickle or deepcopy handed out writable per-rank counts (a copy now starts with
empty caches).
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from purepp import dp
from purepp.cudagraph import (
    BatchExecutionDescriptor,
    CaptureMode,
    CudaGraphDispatcher,
    CUDAGraphMode,
    Dispatcher,
)
from purepp.dp import (
    ROW_ALLOW_UBATCHING,
    ROW_CG_MODE,
    ROW_MAX_QUERY_LEN,
    ROW_NUM_TOKENS,
    ROW_UNIFORM_TOKEN_COUNT,
    SEED_TABLE,
    AgreementFinished,
    AgreementGroup,
    AgreementLanes,
    Lane,
    MicrobatchConfig,
    PendingAgreement,
    RankBatch,
    TableLayout,
    finish_agreement,
    start_agreement,
)
from purepp.effects.arrays import IntArray, is_frozen
from purepp.effects.vocabulary import NoteDecision
from purepp.errors import InvalidInputError
from tests.strategies import dead_rank_sets, rank_batches

FREE = AgreementLanes()
SHARED = CudaGraphDispatcher(  # one dispatcher (and so one memo of descriptors) for all
    capture_sizes=(1, 2, 4, 8, 16),
    capture_mode=CaptureMode.FULL_AND_PIECEWISE,
    max_num_reqs=6,
    num_speculative_tokens=1,
    lora_capture_cases=(0, 1),
)
MICRO = TableLayout(
    microbatch=MicrobatchConfig(decode_token_threshold=6, prefill_token_threshold=10)
)


class Pooled:
    """A runner's manager that answers a few descriptor objects, shared by many batches:
    the graph of the token bucket alone, whatever the requests or bounds."""

    def __init__(self) -> None:
        self.pool = {
            size: BatchExecutionDescriptor(
                cg_mode=CUDAGraphMode.PIECEWISE if size > 4 else CUDAGraphMode.FULL,
                num_tokens=size,
                num_reqs=None if size > 4 else size,
            )
            for size in (4, 16)
        }

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
        if num_tokens > 16:
            return BatchExecutionDescriptor(
                cg_mode=CUDAGraphMode.NONE, num_tokens=num_tokens, num_reqs=num_reqs
            )
        return self.pool[4 if num_tokens <= 4 else 16]


class Afresh:
    """A manager that builds a new (equal) descriptor object on every call."""

    def __init__(self, inner: Dispatcher) -> None:
        self.inner = inner
        self.made = 0

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
        self.made += 1
        answer = self.inner.dispatch(
            num_reqs,
            num_tokens,
            uniform_token_count,
            num_active_loras=num_active_loras,
            max_query_len=max_query_len,
        )
        return attrs.evolve(answer)


POOLED = Pooled()
AFRESH = Afresh(SHARED)
DISPATCHERS: dict[str, Dispatcher] = {"shared": SHARED, "pooled": POOLED, "afresh": AFRESH}


@attrs.frozen
class World:
    """One kind of group: its size, layout and dead ranks."""

    dp_size: int
    layout: TableLayout
    dead: frozenset[int]

    def group(self, rank: int) -> AgreementGroup:
        live = None if not self.dead else frozenset(range(self.dp_size)) - self.dead
        return AgreementGroup(
            dp_size=self.dp_size, dp_rank=rank, layout=self.layout, live_ranks=live
        )

    @property
    def live(self) -> list[int]:
        return [r for r in range(self.dp_size) if r not in self.dead]


def agreement(
    world: World,
    groups: dict[int, AgreementGroup],
    dispatcher: Dispatcher,
    batches: Sequence[RankBatch],
    *,
    step: int,
    lane: Lane,
) -> list[AgreementFinished]:
    """Every live rank's finish of one agreement, each with its group in `groups`; a dead
    rank's column holds what it would contribute (a stale column, never read)."""
    started = []
    for rank in range(world.dp_size):
        group = (
            groups[rank]
            if rank not in world.dead
            else World(world.dp_size, world.layout, frozenset()).group(rank)
        )
        started.append(
            start_agreement(FREE, group, dispatcher, batches[rank], step=step, lane=lane)
        )
    table = np.zeros_like(started[0].result.contribution)
    for s in started:
        assert s.result.contribution is not None
        table += s.result.contribution
    return [finish_agreement(started[r].state, started[r].result, table.copy()) for r in world.live]


@st.composite
def worlds(draw: st.DrawFn) -> World:
    dp_size = draw(st.integers(2, 5))
    return World(
        dp_size=dp_size,
        layout=draw(st.sampled_from([SEED_TABLE, SEED_TABLE, MICRO])),
        dead=draw(st.sampled_from([frozenset()]) | dead_rank_sets(dp_size)),
    )


@st.composite
def agreement_runs(
    draw: st.DrawFn,
) -> tuple[list[World], list[tuple[int, str, list[RankBatch], Lane, str]]]:
    """Some worlds, then agreements over them in any order: which world, which
    dispatcher, the ranks' batches, the lane, and what becomes of the kept groups first
    ("kept", "pickled", "copied", "evolved" (an equal group built anew))."""
    kinds = draw(st.lists(worlds(), min_size=1, max_size=3))
    steps = []
    for _ in range(draw(st.integers(1, 10))):
        index = draw(st.integers(0, len(kinds) - 1))
        world = kinds[index]
        kind = draw(st.sampled_from([None, "uniform", "uniform", "varlen"]))
        batch = rank_batches(SHARED, kind=kind, eager=draw(st.sampled_from([False] * 4 + [None])))
        batches = draw(st.lists(batch, min_size=world.dp_size, max_size=world.dp_size))
        steps.append(
            (
                index,
                draw(st.sampled_from(sorted(DISPATCHERS))),
                batches,
                draw(st.sampled_from(list(Lane))),
                draw(st.sampled_from(["kept"] * 6 + ["pickled", "copied", "evolved"])),
            )
        )
    return kinds, steps


def _renewed(group: AgreementGroup, how: str) -> AgreementGroup:
    if how == "pickled":
        renewed: AgreementGroup = pickle.loads(pickle.dumps(group))
        return renewed
    if how == "copied":
        return copy.deepcopy(group)
    if how == "evolved":
        return attrs.evolve(group)
    return group


@settings(max_examples=120, deadline=None)
@given(agreement_runs())
def test_kept_groups_decide_every_agreement_as_fresh_groups_do(
    run: tuple[list[World], list[tuple[int, str, list[RankBatch], Lane, str]]],
) -> None:
    """Groups of several sizes, layouts and dead ranks, kept across agreements on either
    lane with one shared dispatcher (and managers that share or renew their descriptor
    objects), sometimes pickled, copied or rebuilt between two: each agreement (run
    twice, the second from the cache) decides, and notes, exactly what fresh groups
    decide."""
    kinds, steps = run
    kept = [{r: w.group(r) for r in w.live} for w in kinds]
    for number, (index, name, batches, lane, how) in enumerate(steps):
        world = kinds[index]
        kept[index] = {r: _renewed(g, how) for r, g in kept[index].items()}
        for again in range(2):
            step = 2 * number + again
            fresh = {r: world.group(r) for r in world.live}
            dispatcher = DISPATCHERS[name]
            got = agreement(world, kept[index], dispatcher, batches, step=step, lane=lane)
            expected = agreement(world, fresh, dispatcher, batches, step=step, lane=lane)
            assert got == expected
        for group in kept[index].values():
            assert len(group._graph_outcomes) <= dp._CACHED_PER_GROUP


def test_a_steady_graph_is_shared_only_within_its_group() -> None:
    """One descriptor object agreed by a live group, a group with a dead rank and a
    bigger group: each shares its own outcome from step to step, none hands it to
    another."""
    batch = RankBatch(num_reqs=2, num_tokens=4, uniform_token_count=2)
    worlds_ = [
        World(2, SEED_TABLE, frozenset()),
        World(3, SEED_TABLE, frozenset({1})),
        World(3, SEED_TABLE, frozenset()),
    ]
    groups = [{r: w.group(r) for r in w.live} for w in worlds_]
    first = [
        agreement(w, g, SHARED, [batch] * w.dp_size, step=1, lane=Lane.TARGET)[0].result
        for w, g in zip(worlds_, groups, strict=True)
    ]
    again = [
        agreement(w, g, SHARED, [batch] * w.dp_size, step=2, lane=Lane.TARGET)[0].result
        for w, g in zip(worlds_, groups, strict=True)
    ]
    assert all(a is b for a, b in zip(first, again, strict=True))
    assert first[0].descriptor is first[1].descriptor is first[2].descriptor
    counts = [o.sync.num_tokens_across_dp.tolist() for o in first if o.sync is not None]
    assert counts == [[4, 4], [4, 0, 4], [4, 4, 4]]


def test_a_full_cache_still_decides_as_a_fresh_group() -> None:
    """A manager that builds a new descriptor per call fills a kept group's cache to its
    bound: later agreements are decided afresh, right, and the cache stays bounded; an
    outcome cached early is still shared."""
    afresh = Afresh(SHARED)
    world = World(2, SEED_TABLE, frozenset())
    kept = {r: world.group(r) for r in world.live}
    steady = RankBatch(num_reqs=2, num_tokens=4, uniform_token_count=2)
    first = agreement(world, kept, SHARED, [steady] * 2, step=0, lane=Lane.TARGET)
    for step in range(1, dp._CACHED_PER_GROUP + 40):
        batches = [
            RankBatch(num_reqs=1 + step % 3, num_tokens=4 + step % 5),
            RankBatch(num_reqs=2, num_tokens=2 + step % 7),
        ]
        got = agreement(world, kept, afresh, batches, step=step, lane=Lane.TARGET)
        if step % 97 == 0 or step > dp._CACHED_PER_GROUP:
            fresh = {r: world.group(r) for r in world.live}
            assert got == agreement(world, fresh, afresh, batches, step=step, lane=Lane.TARGET)
    assert all(len(g._graph_outcomes) == dp._CACHED_PER_GROUP for g in kept.values())
    last = agreement(world, kept, SHARED, [steady] * 2, step=9999, lane=Lane.TARGET)
    assert last[0].result is first[0].result


# --- the one-read table check ------------------------------------------------------------


def _check_table_before(
    pending: PendingAgreement, reduced_table: Any
) -> tuple[Sequence[Sequence[int]], npt.NDArray[np.int32]]:
    """`dp._check_table` as revision 910f702 wrote it (one column read, then the bounds)."""
    group = pending.group
    expected = (group.layout.rows, group.dp_size)
    if (
        type(reduced_table) is not np.ndarray
        or (reduced_table.dtype is not dp._INT32 and reduced_table.dtype != dp._INT32)
        or reduced_table.shape != expected
    ):
        described = (
            f"{reduced_table.dtype}{list(reduced_table.shape)}"
            if isinstance(reduced_table, np.ndarray)
            else type(reduced_table).__name__
        )
        raise dp._bad_table(
            f"reduced_table is {described}, expected an int32{list(expected)} numpy array",
            "pass the all-reduced table bound to the pending agreement's `table` (tensor.numpy())",
        )
    rank = group.dp_rank
    column = tuple(reduced_table[:, rank].tolist())
    if column != pending.own:
        raise dp._bad_table(
            f"column {rank} is {list(column)} but this rank contributed {list(pending.own)}",
            "pass the table reduced from this agreement's contribution (same lane and step)",
        )
    live_table = reduced_table if group.all_live else reduced_table[:, group.live]
    bounds = dp._row_bounds(live_table)
    modes = bounds[ROW_CG_MODE]
    query_low = bounds[ROW_MAX_QUERY_LEN][0]
    sane = (
        bounds[ROW_NUM_TOKENS][0] >= 0
        and bounds[group.layout.row_num_reqs][0] >= 0
        and bounds[ROW_UNIFORM_TOKEN_COUNT][0] >= 0
        and query_low >= -1
        and query_low != 0
        and modes[0] >= CUDAGraphMode.NONE
        and modes[-1] <= CUDAGraphMode.FULL
    )
    if sane and group.layout.microbatch is not None:
        votes = bounds[ROW_ALLOW_UBATCHING]
        sane = votes[0] == 1 == votes[-1]
    if not sane:
        raise dp._bad_table(
            f"reduced_table holds values no rank contributes: {reduced_table.tolist()}",
            "sum-all-reduce the contributions of start_agreement, nothing else",
        )
    return bounds, live_table


def _checked(
    check: Any, pending: PendingAgreement, table: object
) -> tuple[list[tuple[int, int]], list[list[int]]] | str:
    """Each row's least and most live value (all the decision reads of the bounds) and
    the live columns, or the text of the check's refusal."""
    try:
        bounds, live = check(pending, table)
    except InvalidInputError as refused:
        return str(refused)
    return [(row[0], row[-1]) for row in bounds], live.tolist()


@st.composite
def tables(draw: st.DrawFn) -> tuple[PendingAgreement, object]:
    """A started agreement of any group of 2 to 20 ranks (dead ones too), and a table for
    it: mostly the sum of real columns, else with odd values, this rank's column
    changed, another dtype, shape or container, or a non-contiguous view."""
    dp_size = draw(st.integers(2, 20))
    rank = draw(st.integers(0, dp_size - 1))
    dead = draw(dead_rank_sets(dp_size)) - {rank}
    layout = draw(st.sampled_from([SEED_TABLE, MICRO]))
    live = None if not dead else frozenset(range(dp_size)) - dead
    group = AgreementGroup(dp_size=dp_size, dp_rank=rank, layout=layout, live_ranks=live)
    columns = [draw(rank_batches(SHARED)) for _ in range(dp_size)]
    started = [
        start_agreement(
            FREE,
            group if r == rank else AgreementGroup(dp_size=dp_size, dp_rank=r, layout=layout),
            SHARED,
            columns[r],
            step=1,
        )
        for r in range(dp_size)
    ]
    table = np.zeros((layout.rows, dp_size), dtype=np.int32)
    for s in started:
        assert s.result.contribution is not None
        table += s.result.contribution
    how = draw(
        st.sampled_from(
            ["sum"] * 4 + ["odd", "own", "int64", "shape", "list", "strided", "big-endian"]
        )
    )
    given: object = table
    if how == "odd":
        rows = draw(st.lists(st.integers(0, layout.rows - 1), min_size=1, max_size=3))
        for row in rows:
            col = draw(st.integers(0, dp_size - 1))
            table[row, col] = draw(st.sampled_from([-2, -1, 0, 1, 3, 2**31 - 1, -(2**31)]))
    elif how == "own":
        table[draw(st.integers(0, layout.rows - 1)), rank] += draw(st.sampled_from([-1, 1]))
    elif how == "int64":
        given = table.astype(np.int64)
    elif how == "shape":
        given = np.zeros((layout.rows, dp_size + 1), dtype=np.int32)
    elif how == "list":
        given = table.tolist()
    elif how == "strided":
        wide = np.zeros((layout.rows, 2 * dp_size), dtype=np.int32)
        wide[:, ::2] = table
        given = wide[:, ::2]
    elif how == "big-endian":
        given = table.astype(">i4")
    return started[rank].result, given


@settings(max_examples=400, deadline=None)
@given(tables())
def test_the_one_read_table_check_takes_and_refuses_what_the_column_read_did(
    case: tuple[PendingAgreement, object],
) -> None:
    pending, table = case
    assert _checked(dp._check_table, pending, table) == _checked(
        _check_table_before, pending, table
    )


# --- bugs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["pickled", "copied"])
def test_a_restored_group_hands_out_frozen_counts_only(how: str) -> None:
    world = World(2, SEED_TABLE, frozenset())
    steady = [RankBatch(num_reqs=2, num_tokens=4, uniform_token_count=2)] * 2
    idle = [RankBatch(num_reqs=0, num_tokens=0)] * 2
    groups = {r: world.group(r) for r in world.live}
    agreement(world, groups, SHARED, steady, step=0, lane=Lane.TARGET)  # fills the caches
    agreement(world, groups, SHARED, idle, step=1, lane=Lane.TARGET)
    groups = {r: _renewed(g, how) for r, g in groups.items()}
    graph = agreement(world, groups, SHARED, steady, step=2, lane=Lane.TARGET)[0]
    note = agreement(world, groups, SHARED, idle, step=3, lane=Lane.TARGET)[0].effects[0]
    assert isinstance(note, NoteDecision)
    sync = graph.result.sync
    assert sync is not None
    arrays: list[IntArray] = [
        groups[0].padded_counts(4),
        sync.num_tokens_across_dp,
        note.num_tokens_across_dp,
    ]
    assert [is_frozen(a) for a in arrays] == [True, True, True]
