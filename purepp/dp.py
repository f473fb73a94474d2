"""The data-parallel agreement: one CUDA-graph mode and one padded token count per step.

Every DP rank contributes one column of a 5 x dp_size int32 table, the ranks
sum-all-reduce it, and each rank decides from the reduced table alone, so the
decision (mode, padded tokens, padded requests, uniform decode length) is the same on
every rank and the collectives the forward pass issues next match.

The agreement is two pure steps around the all-reduce:

1. `start_agreement` (the seed's `dispatch_cg_and_sync_dp`) either decides at once
   (a single rank, or a reused `DPSyncState`: no collective) or returns a
   `PendingAgreement` and the `AllReduce` effect that fills the table.
2. `finish_agreement` takes the pending agreement and the reduced table and decides
   (the seed's `sync_cudagraph_and_dp_padding`).

An asynchronous all-reduce is completed by the `WaitWork` that `wait_for_agreement`
returns. Idle ranks (zero tokens) and eager ranks take part like any other: a rank that
skipped the collective would leave the group one collective apart, and it would hang.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import attrs
import numpy as np
import numpy.typing as npt

from purepp.cudagraph import BatchExecutionDescriptor, CudaGraphDispatcher, CUDAGraphMode
from purepp.effects.arrays import ARRAY_EQ, IntArray, int32_array, readonly
from purepp.effects.vocabulary import (
    AllReduce,
    BufferRef,
    Communicator,
    Op,
    Release,
    WaitWork,
    WorkRef,
)
from purepp.errors import CollectiveMismatchError, ConfigError, InvalidInputError, StaleSyncError
from purepp.step import Step

__all__ = [
    "ROW_CG_MODE",
    "ROW_MAX_QUERY_LEN",
    "ROW_NUM_REQS",
    "ROW_NUM_TOKENS",
    "ROW_UNIFORM_TOKEN_COUNT",
    "TABLE_ROWS",
    "AgreementDecided",
    "AgreementStarted",
    "DPSyncState",
    "DispatchOutcome",
    "PendingAgreement",
    "RankBatch",
    "agree_across_ranks",
    "finish_agreement",
    "start_agreement",
    "table_contribution",
    "wait_for_agreement",
]

# Rows of the agreement table; each rank writes its own column and zeros elsewhere.
ROW_NUM_TOKENS = 0  # tokens this rank scheduled (padded by the caller)
ROW_CG_MODE = 1  # the CUDAGraphMode value this rank would run alone
ROW_UNIFORM_TOKEN_COUNT = 2  # uniform decode length, 0 for none
ROW_MAX_QUERY_LEN = 3  # per-request query-length bound, -1 for none
ROW_NUM_REQS = 4  # requests this rank scheduled
TABLE_ROWS = 5

_INT32_MAX = int(np.iinfo(np.int32).max)


def _check_sync(instance: DPSyncState) -> None:
    counts = instance.num_tokens_across_dp
    if counts.ndim != 1 or counts.shape[0] < 1 or (counts < 0).any():
        raise InvalidInputError(
            "DPSyncState",
            f"num_tokens_across_dp={counts.tolist()} is not one count >= 0 per rank",
            "pass a 1-D array of dp_size token counts",
        )
    if instance.uniform_token_count is not None and instance.uniform_token_count < 1:
        raise InvalidInputError(
            "DPSyncState",
            f"uniform_token_count={instance.uniform_token_count} is below 1",
            "pass None when the ranks agreed on no uniform decode length",
        )
    if instance.num_reqs < 0:
        raise InvalidInputError(
            "DPSyncState", f"num_reqs={instance.num_reqs} is negative", "counts are >= 0"
        )
    if instance.max_query_len is not None and instance.max_query_len < 1:
        raise InvalidInputError(
            "DPSyncState",
            f"max_query_len={instance.max_query_len} is below 1",
            "pass None when the ranks agreed on no query-length bound",
        )


@attrs.frozen(kw_only=True)
class DPSyncState:
    """What an agreement decided across DP ranks; every field is identical on every rank.

    Callers branch on these fields without disagreeing about whether to run a
    collective, so never add a per-rank value here.
    """

    num_tokens_across_dp: IntArray = attrs.field(converter=int32_array, eq=ARRAY_EQ, hash=False)
    # ^ per-rank token counts for the forward context: all the agreed padded count,
    #   unless `eager`, where each rank kept its own
    uniform_token_count: int | None  # agreed uniform decode length; None: ranks disagreed
    eager: bool  # the ranks agreed to run eager; a dispatch reusing this runs eager too
    num_reqs: int  # agreed request bound: a FULL graph's padded count, else the most scheduled
    # Agreed query-length bound (the largest), None unless every rank set one. Beyond the
    # seed: a reuse dispatches with it, so varlen graphs cannot differ between ranks.
    max_query_len: int | None = None

    def __attrs_post_init__(self) -> None:
        _check_sync(self)


@attrs.frozen(kw_only=True)
class DispatchOutcome:
    """A decided dispatch: the shape this rank runs, and the agreement to reuse later."""

    descriptor: BatchExecutionDescriptor  # mode and padded counts this rank runs
    sync: DPSyncState | None  # None with a single rank or when no rank had work


@attrs.frozen(kw_only=True)
class PendingAgreement:
    """An agreement waiting for its reduced table: everything `finish_agreement` needs."""

    step: int  # decode step the agreement belongs to
    comm: Communicator  # group the table is reduced over
    dp_size: int  # ranks in that group
    dp_rank: int  # this rank's column
    table: BufferRef  # where the interpreter binds the reduced table
    work: WorkRef | None  # async handle of the all-reduce; None when synchronous
    # this rank's table (others' columns zero)
    contribution: IntArray = attrs.field(converter=int32_array, eq=ARRAY_EQ, hash=False)
    dispatcher: CudaGraphDispatcher | None  # None only when this rank forced eager
    num_reqs: int  # this rank's requests (eager and PIECEWISE do not pad them)
    num_tokens: int  # this rank's tokens (kept when the ranks agree on eager)
    num_active_loras: int  # this rank's active adapters (never agreed across ranks)
    desired: BatchExecutionDescriptor  # what this rank would run alone


@attrs.frozen(kw_only=True)
class RankBatch:
    """One rank's per-step facts: the per-rank arguments of `start_agreement`."""

    num_reqs: int  # requests scheduled on this rank
    num_tokens: int  # tokens scheduled on this rank, padded by the caller
    uniform_token_count: int | None = None  # tokens per request of a uniform decode batch
    max_query_len: int | None = None  # per-request query-length bound, None: not tracked
    need_eager: bool = False  # force eager (profile run)
    num_active_loras: int = 0  # active LoRA adapters on this rank
    dp_sync: DPSyncState | None = None  # an agreement over this same batch, to reuse


AgreementStarted: TypeAlias = Step[PendingAgreement, None]
AgreementDecided: TypeAlias = Step[None, DispatchOutcome]


def table_contribution(
    *,
    dp_size: int,
    dp_rank: int,
    cg_mode: CUDAGraphMode,
    num_tokens: int,
    num_reqs: int,
    uniform_token_count: int | None,
    max_query_len: int | None,
) -> IntArray:
    """This rank's read-only 5 x dp_size int32 table: its own column, zeros elsewhere.

    Summing every rank's contribution gives the reduced table, since each column has
    exactly one writer. None is written as 0 (uniform count) or -1 (query length).
    """
    table = np.zeros((TABLE_ROWS, dp_size), dtype=np.int32)
    table[ROW_NUM_TOKENS, dp_rank] = num_tokens
    table[ROW_CG_MODE, dp_rank] = int(cg_mode)
    table[ROW_UNIFORM_TOKEN_COUNT, dp_rank] = uniform_token_count or 0
    table[ROW_MAX_QUERY_LEN, dp_rank] = max_query_len or -1
    table[ROW_NUM_REQS, dp_rank] = num_reqs
    table.flags.writeable = False
    return table


def _check_start(
    dispatcher: CudaGraphDispatcher | None,
    *,
    step: int,
    batch: RankBatch,
    dp_size: int,
    dp_rank: int,
    label: str,
) -> None:
    call = "start_agreement"
    if dp_size < 1:
        raise ConfigError(call, f"dp_size={dp_size} is below 1", "pass the DP world size >= 1")
    if not 0 <= dp_rank < dp_size:
        raise ConfigError(
            call,
            f"dp_rank={dp_rank} is outside 0..{dp_size - 1}",
            "pass this rank's index in the DP group",
        )
    if step < 0 or not label:
        raise InvalidInputError(
            call,
            f"step={step}, label={label!r}",
            "pass the decode step (>= 0) and a non-empty label; they name the effects",
        )
    for name, value in (
        ("num_reqs", batch.num_reqs),
        ("num_tokens", batch.num_tokens),
        ("num_active_loras", batch.num_active_loras),
    ):
        if not 0 <= value <= _INT32_MAX:
            raise InvalidInputError(
                call, f"{name}={value} is outside 0..{_INT32_MAX}", "the table holds int32 counts"
            )
    for name, bound in (
        ("uniform_token_count", batch.uniform_token_count),
        ("max_query_len", batch.max_query_len),
    ):
        # 0 would read back as None from the table (0 and -1 encode None).
        if bound is not None and not 1 <= bound <= _INT32_MAX:
            raise InvalidInputError(
                call, f"{name}={bound} is outside 1..{_INT32_MAX}", f"pass None for no {name}"
            )
    # A rank with more requests than a FULL graph's padded request count falls back
    # to eager where the others replay the graph: different shapes (field failure 11).
    if batch.num_reqs > batch.num_tokens:
        raise InvalidInputError(
            call,
            f"num_reqs={batch.num_reqs} exceeds num_tokens={batch.num_tokens}",
            "every scheduled request carries at least one token; count tokens after padding",
        )
    uniform = batch.uniform_token_count
    if uniform is not None and uniform * batch.num_reqs > batch.num_tokens:
        raise InvalidInputError(
            call,
            f"uniform_token_count={uniform} x num_reqs={batch.num_reqs} exceeds "
            f"num_tokens={batch.num_tokens}",
            "pass the tokens per request of a uniform decode batch, else None",
        )
    reuse_eager = batch.dp_sync is not None and batch.dp_sync.eager
    if dispatcher is None and not (batch.need_eager or reuse_eager):
        raise ConfigError(
            call,
            "cudagraph dispatcher is None but the batch is not forced eager",
            "pass the dispatcher; only a profile run (need_eager=True) may omit it",
        )
    if batch.dp_sync is not None:
        _check_reuse(batch.dp_sync, batch, dp_size=dp_size, dp_rank=dp_rank)


def _check_reuse(sync: DPSyncState, batch: RankBatch, *, dp_size: int, dp_rank: int) -> None:
    call = "start_agreement"
    if sync.num_tokens_across_dp.shape != (dp_size,):
        raise InvalidInputError(
            call,
            f"dp_sync holds {sync.num_tokens_across_dp.shape[0]} ranks but dp_size={dp_size}",
            "reuse only a sync taken over this DP group",
        )
    agreed_tokens = int(sync.num_tokens_across_dp[dp_rank])
    if agreed_tokens != batch.num_tokens:
        raise StaleSyncError(
            call,
            f"dp_sync was taken over a batch of {agreed_tokens} tokens on rank {dp_rank}, "
            f"this batch has num_tokens={batch.num_tokens}",
            "reuse a sync only for the batch it was taken over (same padded num_tokens), "
            "else pass dp_sync=None to agree afresh",
        )
    agreed_uniform = sync.uniform_token_count
    if agreed_uniform is not None and batch.uniform_token_count != agreed_uniform:
        raise StaleSyncError(
            call,
            f"dp_sync agreed uniform_token_count={agreed_uniform}, this batch has "
            f"{batch.uniform_token_count}",
            "reuse a sync only for the batch it was taken over, else pass dp_sync=None",
        )


def start_agreement(
    dispatcher: CudaGraphDispatcher | None,
    *,
    step: int,
    num_reqs: int,
    num_tokens: int,
    uniform_token_count: int | None,
    dp_size: int,
    dp_rank: int,
    max_query_len: int | None = None,
    need_eager: bool = False,
    num_active_loras: int = 0,
    dp_sync: DPSyncState | None = None,
    comm: Communicator = Communicator.DP_CPU,
    asynchronous: bool = False,
    label: str = "dp",
) -> AgreementStarted | AgreementDecided:
    """Pick this rank's descriptor and start agreeing it across the DP group.

    Decided at once, with no effect, when `dp_size` is 1 or `dp_sync` (an agreement
    over this same batch, e.g. the target's, reused by a drafter's prefill) is given.
    Otherwise returns a `PendingAgreement` and one `AllReduce` over `comm` of this
    rank's table column; feed the reduced table to `finish_agreement`. With
    `asynchronous` the all-reduce carries a `WorkRef`, completed by the `WaitWork`
    of `wait_for_agreement`. Effects are named `{label}.step{step}.table` / `.work`:
    give a second agreement in the same step its own label.

    Raises ConfigError (bad group, or no dispatcher without need_eager),
    InvalidInputError (bad counts), StaleSyncError (`dp_sync` from another batch).
    """
    batch = RankBatch(
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        uniform_token_count=uniform_token_count,
        max_query_len=max_query_len,
        need_eager=need_eager,
        num_active_loras=num_active_loras,
        dp_sync=dp_sync,
    )
    _check_start(dispatcher, step=step, batch=batch, dp_size=dp_size, dp_rank=dp_rank, label=label)
    desired = _desired_descriptor(dispatcher, batch)
    if dp_size == 1:
        return Step(state=None, effects=(), result=DispatchOutcome(descriptor=desired, sync=None))
    if dp_sync is not None:
        return Step(state=None, effects=(), result=_reuse(dp_sync, desired, num_tokens))
    contribution = table_contribution(
        dp_size=dp_size,
        dp_rank=dp_rank,
        cg_mode=desired.cg_mode,
        num_tokens=num_tokens,
        num_reqs=num_reqs,
        uniform_token_count=uniform_token_count,
        max_query_len=max_query_len,
    )
    table = BufferRef(f"{label}.step{step}.table")
    work = WorkRef(f"{label}.step{step}.work") if asynchronous else None
    pending = PendingAgreement(
        step=step,
        comm=comm,
        dp_size=dp_size,
        dp_rank=dp_rank,
        table=table,
        work=work,
        contribution=contribution,
        dispatcher=dispatcher,
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        num_active_loras=num_active_loras,
        desired=desired,
    )
    all_reduce = AllReduce(
        step=step, op=Op.AGREE, contribution=contribution, result=table, comm=comm, work=work
    )
    return Step(state=pending, effects=(all_reduce,), result=None)


def _desired_descriptor(
    dispatcher: CudaGraphDispatcher | None, batch: RankBatch
) -> BatchExecutionDescriptor:
    sync = batch.dp_sync
    if batch.need_eager or (sync is not None and sync.eager):
        return _eager(batch.num_tokens, batch.num_reqs, batch.num_active_loras)
    if dispatcher is None:  # unreachable: _check_start rejects it
        raise ConfigError("start_agreement", "no dispatcher", "pass the dispatcher")
    # A reused sync's uniform count and query-length bound were agreed across ranks,
    # so they replace this rank's: every rank then picks the same graph.
    uniform = sync.uniform_token_count if sync is not None else batch.uniform_token_count
    query_len = sync.max_query_len if sync is not None else batch.max_query_len
    return dispatcher.dispatch(
        batch.num_reqs,
        batch.num_tokens,
        uniform,
        num_active_loras=batch.num_active_loras,
        max_query_len=query_len,
    )


def _eager(num_tokens: int, num_reqs: int, num_active_loras: int) -> BatchExecutionDescriptor:
    return BatchExecutionDescriptor(
        cg_mode=CUDAGraphMode.NONE,
        num_tokens=num_tokens,
        num_reqs=num_reqs,
        num_active_loras=num_active_loras,
    )


def _reuse(
    sync: DPSyncState, desired: BatchExecutionDescriptor, num_tokens: int
) -> DispatchOutcome:
    if not sync.eager and desired.num_tokens != num_tokens:
        # This dispatcher's capture sizes may pad further than the one that agreed;
        # every rank pads alike, so report the count that will run.
        padded = np.full_like(sync.num_tokens_across_dp, desired.num_tokens)
        sync = attrs.evolve(sync, num_tokens_across_dp=padded)
    return DispatchOutcome(descriptor=desired, sync=sync)


def wait_for_agreement(pending: PendingAgreement) -> Step[PendingAgreement, BufferRef]:
    """Complete the all-reduce before reading the table: a `WaitWork` when asynchronous.

    The result names the buffer the reduced table is bound to.
    """
    effects = () if pending.work is None else (_wait(pending, pending.work),)
    return Step(state=pending, effects=effects, result=pending.table)


def _wait(pending: PendingAgreement, work: WorkRef) -> WaitWork:
    return WaitWork(step=pending.step, op=Op.AGREE, work=work)


def finish_agreement(
    pending: PendingAgreement, reduced_table: npt.NDArray[Any]
) -> AgreementDecided:
    """Decide from the reduced table; the same table gives every rank the same decision.

    - No rank has tokens: NONE with 0 tokens and 0 requests, and no sync.
    - Any rank eager: all eager, each keeping its own counts; the sync records every
      rank's unpadded tokens and the most requests any rank scheduled.
    - Else dispatch the agreed values (most tokens of any rank, the uniform count if
      every rank had the same non-zero one, the largest query-length bound if every
      rank set one) with this rank's own requests, so PIECEWISE pads no requests;
      every rank's entry becomes the padded count, and the agreed request bound is the
      FULL graph's padded count, else the most any rank scheduled.

    The one effect releases the reduced table's binding: the caller has read it.

    Raises InvalidInputError when the table is not the int32 [5, dp_size] sum of the
    ranks' contributions for this agreement.
    """
    table = _check_table(pending, reduced_table)
    release = Release(step=pending.step, op=Op.AGREE, buffer=pending.table)
    return Step(state=None, effects=(release,), result=_decide(pending, table))


def _check_table(pending: PendingAgreement, reduced_table: npt.NDArray[Any]) -> IntArray:
    call = "finish_agreement"
    expected = (TABLE_ROWS, pending.dp_size)
    if not isinstance(reduced_table, np.ndarray):
        raise InvalidInputError(
            call,
            f"reduced_table is a {type(reduced_table).__name__}",
            "pass the reduced table as a numpy array (tensor.numpy())",
        )
    if reduced_table.dtype != np.int32 or reduced_table.shape != expected:
        raise InvalidInputError(
            call,
            f"reduced_table is {reduced_table.dtype}{list(reduced_table.shape)}, "
            f"expected int32{list(expected)}",
            "pass the all-reduced table bound to the pending agreement's `table`",
        )
    table: IntArray = readonly(reduced_table, np.int32)
    own = pending.contribution[:, pending.dp_rank]
    if not np.array_equal(table[:, pending.dp_rank], own):
        raise InvalidInputError(
            call,
            f"column {pending.dp_rank} is {table[:, pending.dp_rank].tolist()} but this rank "
            f"contributed {own.tolist()}",
            "pass the table reduced from this agreement's contribution (same step and label)",
        )
    modes = table[ROW_CG_MODE]
    malformed = (
        (table[ROW_NUM_TOKENS] < 0).any()
        or (table[ROW_NUM_REQS] < 0).any()
        or (table[ROW_UNIFORM_TOKEN_COUNT] < 0).any()
        or (table[ROW_MAX_QUERY_LEN] < -1).any()
        or (table[ROW_MAX_QUERY_LEN] == 0).any()
        or (modes < min(CUDAGraphMode)).any()
        or (modes > max(CUDAGraphMode)).any()
    )
    if malformed:
        raise InvalidInputError(
            call,
            f"reduced_table holds values no rank contributes: {table.tolist()}",
            "sum-all-reduce the contributions of start_agreement, nothing else",
        )
    return table


def _decide(pending: PendingAgreement, table: IntArray) -> DispatchOutcome:
    tokens = table[ROW_NUM_TOKENS]
    uniform_counts = table[ROW_UNIFORM_TOKEN_COUNT]
    query_lens = table[ROW_MAX_QUERY_LEN]
    most_reqs = int(table[ROW_NUM_REQS].max())
    # 0 encodes None, and one dissenting rank is a disagreement: then no uniform count.
    first_uniform = int(uniform_counts[0])
    agreed_uniform = (
        first_uniform if first_uniform != 0 and (uniform_counts == first_uniform).all() else None
    )
    # Varlen graphs are chosen by the query-length bound, so it must be agreed too.
    agreed_query_len = int(query_lens.max()) if (query_lens != -1).all() else None
    if (tokens == 0).all():
        descriptor = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=0, num_reqs=0)
        return DispatchOutcome(descriptor=descriptor, sync=None)
    if CUDAGraphMode(int(table[ROW_CG_MODE].min())) is CUDAGraphMode.NONE:
        descriptor = _eager(pending.num_tokens, pending.num_reqs, pending.desired.num_active_loras)
        sync = DPSyncState(
            num_tokens_across_dp=tokens,
            uniform_token_count=agreed_uniform,
            eager=True,
            num_reqs=most_reqs,
            max_query_len=agreed_query_len,
        )
        return DispatchOutcome(descriptor=descriptor, sync=sync)
    dispatcher = pending.dispatcher
    if dispatcher is None:  # unreachable: this rank contributed NONE, so the min is NONE
        raise InvalidInputError(
            "finish_agreement", "no dispatcher for an agreed graph", "pass a checked table"
        )
    descriptor = dispatcher.dispatch(
        pending.num_reqs,
        int(tokens.max()),
        agreed_uniform,
        num_active_loras=pending.num_active_loras,
        max_query_len=agreed_query_len,
    )
    full_reqs = descriptor.num_reqs if descriptor.cg_mode is CUDAGraphMode.FULL else None
    sync = DPSyncState(
        num_tokens_across_dp=np.full(pending.dp_size, descriptor.num_tokens, dtype=np.int32),
        uniform_token_count=agreed_uniform,
        eager=False,
        num_reqs=full_reqs if full_reqs is not None else most_reqs,
        max_query_len=agreed_query_len,
    )
    return DispatchOutcome(descriptor=descriptor, sync=sync)


def agree_across_ranks(
    dispatcher: CudaGraphDispatcher | None,
    batches: Sequence[RankBatch],
    *,
    step: int = 0,
    comm: Communicator = Communicator.DP_CPU,
    asynchronous: bool = False,
    label: str = "dp",
) -> tuple[DispatchOutcome, ...]:
    """Every rank's outcome, rank i running `batches[i]`: the all-reduce done in-process.

    Runs `start_agreement` on every rank, sums the contributions and runs
    `finish_agreement` on every rank: the same code a real group runs, for tests and
    the simulator. Raises CollectiveMismatchError when some ranks would issue the
    all-reduce and others would not (a hang in a real group).
    """
    dp_size = len(batches)
    if dp_size < 1:
        raise ConfigError("agree_across_ranks", "batches is empty", "pass one batch per rank")
    started = [
        start_agreement(
            dispatcher,
            step=step,
            num_reqs=b.num_reqs,
            num_tokens=b.num_tokens,
            uniform_token_count=b.uniform_token_count,
            dp_size=dp_size,
            dp_rank=rank,
            max_query_len=b.max_query_len,
            need_eager=b.need_eager,
            num_active_loras=b.num_active_loras,
            dp_sync=b.dp_sync,
            comm=comm,
            asynchronous=asynchronous,
            label=label,
        )
        for rank, b in enumerate(batches)
    ]
    decided = [s.result for s in started if s.result is not None]
    pending = [s.state for s in started if s.state is not None]
    if decided and pending:
        joined = [rank for rank, s in enumerate(started) if s.state is not None]
        raise CollectiveMismatchError(
            "agree_across_ranks",
            f"ranks {joined} issue the agreement all-reduce, the others reuse a dp_sync",
            "reuse a dp_sync on every rank of the group or on none",
        )
    if decided:
        return tuple(decided)
    reduced: IntArray = np.stack([p.contribution for p in pending]).sum(axis=0, dtype=np.int32)
    return tuple(finish_agreement(p, reduced).result for p in pending)
