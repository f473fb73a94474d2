"""The DP agreement (`purepp.dp`) against a numpy re-expression of the seed, and its edges.

The first tests pin behaviours the other DP tests leave open (each one fails under a
mutation of purepp that the rest of the suite lets through). The tests after them pin
what a review found wrong at the edges (each was a bug): an idle step's drafter that
issued a second collective, a corrupt microbatch vote taken, an unpickled int32 table
refused, and caller input taken or answered with a raw exception.
"""

from __future__ import annotations

import pickle
from collections.abc import Generator
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings

from purepp import rank
from purepp.batch import BatchFacts
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
    AgreementStarted,
    DispatchOutcome,
    MicrobatchConfig,
    RankBatch,
    TableLayout,
    agree_across_ranks,
    finish_agreement,
    start_agreement,
)
from purepp.effects.arrays import IntArray
from purepp.effects.vocabulary import AllReduce, BufferRef, Effect, TensorSpec
from purepp.errors import InvalidInputError, PureppError
from purepp.relay import RelayConfig
from tests.strategies import DPWorld, dp_worlds

NONE = CUDAGraphMode.NONE
PIECEWISE = CUDAGraphMode.PIECEWISE
FREE = AgreementLanes()

# Uniform decode of 2 tokens per request (one draft) in FULL graphs, PIECEWISE otherwise.
SPEC = CudaGraphDispatcher(
    capture_sizes=(1, 2, 4, 8, 16),
    capture_mode=CaptureMode.FULL_AND_PIECEWISE,
    max_num_reqs=8,
    num_speculative_tokens=1,
)
MICRO = TableLayout(
    microbatch=MicrobatchConfig(decode_token_threshold=4, prefill_token_threshold=4)
)

R = TypeVar("R")


def started_ranks(
    batches: list[RankBatch], *, step: int = 3, layout: TableLayout = SEED_TABLE
) -> list[AgreementStarted]:
    """Every rank's start of one agreement over `batches` (rank i runs batches[i])."""
    return [
        start_agreement(
            FREE,
            AgreementGroup(dp_size=len(batches), dp_rank=r, layout=layout),
            SPEC,
            b,
            step=step,
        )
        for r, b in enumerate(batches)
    ]


def reduced(started: list[AgreementStarted]) -> IntArray:
    """The sum-all-reduce of the ranks' contributions, as a collective returns it."""
    table = np.zeros_like(started[0].result.contribution)
    for s in started:
        assert s.result.contribution is not None
        table += s.result.contribution
    return table


# --- a direct re-expression of the seed with numpy ---------------------------------------


def seed_agreement(
    dispatcher: CudaGraphDispatcher, batches: list[RankBatch]
) -> list[tuple[BatchExecutionDescriptor, tuple[list[int], int | None, bool, int, int | None]]]:
    """`dispatch_cg_and_sync_dp` then `sync_cudagraph_and_dp_padding`, over numpy, per rank.

    The sync's query-length bound is the seed's `synced_max_query_len` expression over
    the reduced row (purepp records it on every sync, eager ones included).
    """
    dp_size = len(batches)
    wanted = [
        BatchExecutionDescriptor(
            cg_mode=NONE,
            num_tokens=b.num_tokens,
            num_reqs=b.num_reqs,
            num_active_loras=b.num_active_loras,
        )
        if b.need_eager
        else dispatcher.dispatch(
            b.num_reqs,
            b.num_tokens,
            b.uniform_token_count,
            num_active_loras=b.num_active_loras,
            max_query_len=b.max_query_len,
        )
        for b in batches
    ]
    tensor = np.zeros((5, dp_size), dtype=np.int32)
    for r, (b, d) in enumerate(zip(batches, wanted, strict=True)):
        column = np.zeros((5, dp_size), dtype=np.int32)
        column[0][r] = b.num_tokens
        column[1][r] = d.cg_mode.value
        column[2][r] = b.uniform_token_count or 0
        column[3][r] = b.max_query_len or -1
        column[4][r] = b.num_reqs
        tensor += column  # the all-reduce (sum)
    tokens, modes, uniforms, query_lens, reqs = tensor
    uniform: int | None = int(uniforms[0])
    if uniform == 0 or not np.all(uniforms == uniform):
        uniform = None
    query_len = int(query_lens.max()) if bool(np.all(query_lens != -1)) else None
    results: list[
        tuple[BatchExecutionDescriptor, tuple[list[int], int | None, bool, int, int | None]]
    ] = []
    for b, d in zip(batches, wanted, strict=True):
        if np.all(tokens == 0):
            idle = BatchExecutionDescriptor(cg_mode=NONE, num_tokens=0, num_reqs=0)
            results.append((idle, ([0] * dp_size, None, False, 0, None)))
            continue
        if CUDAGraphMode(int(modes.min())) == NONE:
            eager = BatchExecutionDescriptor(
                cg_mode=NONE,
                num_tokens=b.num_tokens,
                num_reqs=b.num_reqs,
                num_active_loras=d.num_active_loras,
            )
            agreed = (tokens.tolist(), uniform, True, int(reqs.max()), query_len)
            results.append((eager, agreed))
            continue
        graph = dispatcher.dispatch(
            b.num_reqs,
            int(tokens.max()),
            uniform,
            num_active_loras=b.num_active_loras,
            max_query_len=query_len,
        )
        padded_reqs = (
            graph.num_reqs
            if graph.cg_mode == CUDAGraphMode.FULL and graph.num_reqs is not None
            else int(reqs.max())
        )
        counts = np.full_like(tokens, graph.num_tokens).tolist()
        results.append((graph, (counts, uniform, False, padded_reqs, query_len)))
    return results


def plain(
    outcome: DispatchOutcome, dp_size: int
) -> tuple[BatchExecutionDescriptor, tuple[list[int], int | None, bool, int, int | None]]:
    sync = outcome.sync
    if sync is None:  # the seed's idle answer, with the sync spelled as an idle one
        return outcome.descriptor, ([0] * dp_size, None, False, 0, None)
    return outcome.descriptor, (
        sync.num_tokens_across_dp.tolist(),
        sync.uniform_token_count,
        sync.eager,
        sync.num_reqs,
        sync.max_query_len,
    )


@settings(max_examples=60, deadline=None)
@given(dp_worlds(min_size=2))
def test_every_rank_decides_as_the_seed_query_length_bound_included(
    world: DPWorld,
) -> None:
    """Each rank's descriptor and its whole sync (the agreed query-length bound too, which
    an eager sync records as the largest bound when every rank set one) are what the
    seed's procedure computes from the same batches."""
    dispatcher, batches = world
    outcomes = agree_across_ranks(dispatcher, batches)
    expected = seed_agreement(dispatcher, batches)
    assert [plain(o, len(batches)) for o in outcomes] == expected


def test_an_eager_sync_records_the_agreed_query_length_bound() -> None:
    """One eager rank makes every rank eager; the sync still holds the largest bound."""
    batches = [
        RankBatch(num_reqs=1, num_tokens=2, max_query_len=2),
        RankBatch(num_reqs=1, num_tokens=3, max_query_len=3, need_eager=True),
    ]
    outcomes = agree_across_ranks(SPEC, batches)
    syncs = [o.sync for o in outcomes]
    assert all(s is not None and s.eager and s.max_query_len == 3 for s in syncs)


# --- the reduced table and the lanes -------------------------------------------------------


def test_finishing_with_lanes_whose_lane_holds_another_step_is_refused() -> None:
    """A pending agreement of step 4 is not finished by lanes that have step 5 in flight on
    its lane: that would decide step 4 a second time and free step 5's lane."""
    batches = [RankBatch(num_reqs=1, num_tokens=1), RankBatch(num_reqs=1, num_tokens=3)]
    first = started_ranks(batches, step=4)
    table = reduced(first)
    done = finish_agreement(first[0].state, first[0].result, table)
    later = start_agreement(
        done.state, AgreementGroup(dp_size=2, dp_rank=0), SPEC, batches[0], step=5
    )
    assert later.state == AgreementLanes(target=5)
    with pytest.raises(
        InvalidInputError, match=r"has step 5 in flight, not this agreement's step 4"
    ):
        finish_agreement(later.state, first[0].result, table)


@pytest.mark.parametrize("width", [17, 100, 256])
def test_a_wide_group_pads_to_a_token_count_only_one_rank_has(width: int) -> None:
    """In a group of 17..256 ranks the most tokens of a single rank still sets everyone's
    padding (the finish reads each row's bounds with one numpy sort there)."""
    batches = [RankBatch(num_reqs=1, num_tokens=1)] * (width - 1)
    batches.append(RankBatch(num_reqs=1, num_tokens=9))
    outcomes = agree_across_ranks(SPEC, batches)
    assert {(o.descriptor.cg_mode, o.descriptor.num_tokens) for o in outcomes} == {(PIECEWISE, 16)}
    sync = outcomes[0].sync
    assert sync is not None
    assert sync.num_tokens_across_dp.tolist() == [16] * width


def test_a_microbatched_step_keeps_this_ranks_lora_count() -> None:
    """README: a microbatched step keeps this rank's active-LoRA count on its descriptor."""
    batches = [
        RankBatch(num_reqs=2, num_tokens=4, num_active_loras=3),
        RankBatch(num_reqs=2, num_tokens=6),
    ]
    outcomes = agree_across_ranks(SPEC, batches, layout=MICRO)
    assert [o.descriptor.num_ubatches for o in outcomes] == [2, 2]
    assert [o.descriptor.num_active_loras for o in outcomes] == [3, 0]
    assert [o.descriptor.num_tokens for o in outcomes] == [6, 6]


# --- edges ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dead", [True, 1.0, np.float64(1.0)])
def test_mark_dead_refuses_a_bool_or_a_float_for_a_rank(dead: Any) -> None:
    """A bool or a float is not a rank: marking it dead is a typed error, not rank 1 dead."""
    group = AgreementGroup(dp_size=3, dp_rank=0)
    with pytest.raises(PureppError):
        group.mark_dead(dead)


@pytest.mark.parametrize("dead", [3, 7, -1, "1"])
def test_mark_dead_refuses_a_rank_outside_the_group(dead: Any) -> None:
    """Marking dead a rank the group does not have is a ConfigError, as the constructor's
    `live_ranks` check makes it; a silent no-op leaves the real dead rank live."""
    group = AgreementGroup(dp_size=3, dp_rank=0)
    with pytest.raises(PureppError):
        group.mark_dead(dead)


def test_a_step_beyond_int32_is_refused_as_int_or_numpy_alike() -> None:
    """step=2**31 is refused like np.int64(2**31) is; else the returned lanes are ones
    AgreementLanes' own constructor refuses (target is checked to 0..2**31-1)."""
    group = AgreementGroup(dp_size=2, dp_rank=0)
    batch = RankBatch(num_reqs=1, num_tokens=1)
    with pytest.raises(InvalidInputError, match=r"step=2147483648 is outside"):
        start_agreement(FREE, group, SPEC, batch, step=np.int64(2**31))  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match=r"step=2147483648 is outside"):
        start_agreement(FREE, group, SPEC, batch, step=2**31)


def test_a_valid_table_that_crossed_a_pickle_is_accepted() -> None:
    """The reduced table sent between processes (pickled) is still this agreement's int32
    table: it decides exactly what the original does."""
    started = started_ranks(
        [RankBatch(num_reqs=2, num_tokens=4, uniform_token_count=2)] * 2, step=3
    )
    table = reduced(started)
    crossed: npt.NDArray[Any] = pickle.loads(pickle.dumps(table))
    assert crossed.dtype == np.int32
    assert np.array_equal(crossed, table)
    expected = finish_agreement(started[0].state, started[0].result, table)
    assert finish_agreement(started[0].state, started[0].result, crossed) == expected


def test_a_microbatch_vote_of_zero_is_not_a_reduction_of_purepp_ranks() -> None:
    """Every rank votes 1 in the six-row table (vllm#50945: no rank opts out), so a live
    column voting 0 is a corrupted table (field failure 17), refused like a vote of 2."""
    batches = [RankBatch(num_reqs=2, num_tokens=4)] * 2
    started = started_ranks(batches, layout=MICRO)
    table = reduced(started)
    clean = finish_agreement(started[0].state, started[0].result, table).result
    assert clean.descriptor.num_ubatches == 2  # what rank 1 decides from a clean table
    table[ROW_ALLOW_UBATCHING, 1] = 0
    with pytest.raises(InvalidInputError, match="values no rank contributes"):
        finish_agreement(started[0].state, started[0].result, table)


@pytest.mark.parametrize("count", [1.5, True, -5, 2**40, "x"])
def test_padded_counts_refuses_what_is_not_a_token_count(count: Any) -> None:
    """The public `padded_counts` takes an int32 count >= 0; anything else is a typed error."""
    group = AgreementGroup(dp_size=3, dp_rank=0)
    with pytest.raises(PureppError):
        group.padded_counts(count)


def test_a_lane_that_is_not_a_lane_is_refused_not_read_as_the_drafter() -> None:
    """in_flight('target') does not answer the drafter lane's step, nor comm_of its comm."""
    lanes = AgreementLanes(target=4, drafter=9)
    group = AgreementGroup(dp_size=2, dp_rank=0)
    bad: Any = "target"
    with pytest.raises(PureppError):
        lanes.in_flight(bad)
    with pytest.raises(PureppError):
        group.comm_of(bad)


@pytest.mark.parametrize(
    ("batches", "live"),
    [(None, None), ("iterator", None), ("list", 1), ("list", [[0]])],
)
def test_agree_across_ranks_refuses_garbage_with_a_typed_error(batches: Any, live: Any) -> None:
    """agree_across_ranks (exported by purepp) names bad arguments in a PureppError."""
    two = [RankBatch(num_reqs=1, num_tokens=1)] * 2
    given_batches = {"iterator": iter(two), "list": two}.get(batches, batches)
    with pytest.raises(PureppError):
        agree_across_ranks(SPEC, given_batches, live_ranks=live)


class _TablesIO:
    """A StepIO over tables computed in advance, by buffer name."""

    def __init__(self, tables: dict[str, IntArray]) -> None:
        self.tables = tables

    def bind(self, ref: BufferRef, value: object, /) -> None:
        pass

    def spec(self, ref: BufferRef, /) -> TensorSpec:
        raise KeyError(ref)

    def upload(self, values: IntArray, /) -> object:
        return values

    def host_table(self, ref: BufferRef, /) -> IntArray:
        return self.tables[ref.name]


def _drive(phase: Generator[tuple[Effect, ...], None, R], log: list[Effect]) -> R:
    """Run a phase to its answer, keeping every effect it yields."""
    while True:
        try:
            log.extend(next(phase))
        except StopIteration as stop:
            answer: R = stop.value
            return answer


def test_an_idle_steps_drafter_reuses_the_target_agreement_with_no_collective() -> None:
    """rank.agree: 'The drafter reuses the agreement (no collective)'. On a step where no
    DP rank has work the target decided 'nothing to run'; the drafter issues nothing."""
    relay = RelayConfig.for_stage(
        pp_size=1, stage=0, max_num_reqs=4, num_speculative_steps=1, first_rank=0
    )
    configs = [
        rank.RankConfig(
            relay=relay,
            group=AgreementGroup(dp_size=2, dp_rank=r),
            dispatcher=SPEC,
            drafter_dispatcher=SPEC,
        )
        for r in range(2)
    ]
    idle = [RankBatch(num_reqs=0, num_tokens=0)] * 2
    table = reduced(started_ranks(idle, step=0))
    io = _TablesIO({"dp.target.step0.table": table, "dp.drafter.step0.table": table})
    empty = np.zeros(0, dtype=np.int32)
    batch = BatchFacts(
        idx_mapping=empty, num_computed_tokens=empty, num_scheduled_tokens=empty, prefill_len=empty
    )
    log: list[Effect] = []
    config = configs[0]
    begun = _drive(rank.begin(config, rank.init_rank(config)), log)
    agreed = _drive(rank.agree(config, begun, batch, rank.ShapeFacts(num_tokens=0), io), log)
    assert agreed.target.sync is None  # no rank has work
    assert agreed.drafter is not None
    assert agreed.drafter.sync is None
    assert [type(e) for e in log].count(AllReduce) == 1  # the target's, only
