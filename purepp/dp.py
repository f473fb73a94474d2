"""The data-parallel agreement: one CUDA-graph mode and one padded token count per step.

Every DP rank contributes one column of an int32 table, the ranks sum-all-reduce it,
and each rank decides from the reduced table alone, so the decision (mode, padded
tokens, padded requests, uniform decode length, microbatches) is the same on every
rank and the collectives the forward pass issues next match.

The agreement is two pure steps around the all-reduce, with one shape:

1. `start_agreement(lanes, group, dispatcher, batch, step=...)` (the seed's
   `dispatch_cg_and_sync_dp`) always returns `Step[AgreementLanes, PendingAgreement]`.
   Its effects are one `AllReduce` of this rank's column over the lane's
   communicator, or nothing when it decides at once (a single rank, or a reused
   `DPSyncState`).
2. `finish_agreement(lanes, pending, reduced_table)` always returns the
   `DispatchOutcome` (the seed's `sync_cudagraph_and_dp_padding` after its
   all-reduce); the table is None when the start decided at once. Its effects are a
   `NoteDecision` of the decision, for the log checker to compare across ranks, and the
   table's `Release`; nothing when the start decided at once.

An asynchronous all-reduce is completed by the `WaitWork` that `wait_for_agreement`
returns. Idle ranks (zero tokens) and eager ranks take part like any other: a rank that
skipped the collective would leave the group one collective apart, and it would hang.

**Lanes.** The target model's agreement and the drafter's run on separate lanes, each
over its own communicator (`DP_CPU`, `DP_DRAFTER_CPU` by default), so both can be in
flight at once. `AgreementLanes` records which step each lane has in flight; it is
threaded explicitly, and a second start on a busy lane is a `LaneBusyError` that leaves
it as it was. Effects are named from the lane and the step (`dp.target.step7.table`),
so no two agreements of one rank share a name.

**Table layouts.** `SEED_TABLE` is the seed's five rows (tokens, mode, uniform count,
query-length bound, requests). `TableLayout(microbatch=MicrobatchConfig(...))` is the
newest vLLM's six rows, which add every rank's microbatching vote before the request
row, and decide microbatching as that code does: when every rank votes yes and the
smallest rank's token count reaches the threshold (the decode threshold for a uniform
decode, else the prefill one), every rank runs eager, padded to the largest token
count, split into `num_ubatches`.

**Dead ranks.** `AgreementGroup.live_ranks` names the ranks still alive. A dead rank's
column is whatever the fault-tolerant collective left there, so the decision never
reads it: it neither forces eager nor widens the padding, cannot block a uniform
decode or a microbatch, and its entry in the agreed per-rank counts is 0. The
survivors decide exactly as a group that never had the dead rank would.

Departures from the code the seed and the newest vLLM run (all on purpose):

- Newest layout, uniform decode: vLLM passes each rank's own `uniform_decode` flag,
  which is not in the table; two ranks with equal uniform counts but different flags
  hold the smallest count to different thresholds, decide differently, and the next
  collective hangs. purepp derives the flag from agreed values only (the live ranks
  agreed one non-zero uniform count), so no input can make the ranks diverge.
- Newest layout, the vote: every rank, idle or not, votes the group's configuration
  (`microbatch` set: yes); no batch can opt a rank out on its own (vllm#50945).
- A microbatched step keeps this rank's active-LoRA count on its descriptor (vLLM's
  drops it to 0 there, unlike its plain eager branch).
- `DPSyncState.max_query_len` records the agreed query-length bound, so a reuse picks
  the same varlen graph on every rank.
- Dead-rank neutrality (above) is purepp's; the seed has no notion of a dead rank.
"""

from __future__ import annotations

import enum
import functools
import struct
from collections.abc import Iterable, Sequence
from typing import Any, TypeAlias, cast

import attrs
import numpy as np
import numpy.typing as npt

from purepp._checks import (
    INT32_MAX,
    as_int,
    check_bool,
    check_int,
    check_optional_int,
    check_requests_fit,
    store_ints,
)
from purepp._text import a_type, with_article
from purepp._trusted import trusted
from purepp.cudagraph import BatchExecutionDescriptor, CUDAGraphMode, Dispatcher
from purepp.effects.arrays import ARRAY_EQ, IntArray, freeze_fields, readonly, reduce_frozen
from purepp.effects.vocabulary import (
    AllReduce,
    BufferRef,
    Communicator,
    Effect,
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

__all__ = [
    "ROW_ALLOW_UBATCHING",
    "ROW_CG_MODE",
    "ROW_MAX_QUERY_LEN",
    "ROW_NUM_REQS",
    "ROW_NUM_TOKENS",
    "ROW_UNIFORM_TOKEN_COUNT",
    "SEED_TABLE",
    "TABLE_ROWS",
    "AgreementFinished",
    "AgreementGroup",
    "AgreementLanes",
    "AgreementStarted",
    "DPSyncState",
    "DispatchOutcome",
    "Lane",
    "LaneBusyError",
    "MicrobatchConfig",
    "PendingAgreement",
    "RankBatch",
    "TableLayout",
    "agree_across_ranks",
    "decide_alone",
    "finish_agreement",
    "start_agreement",
    "wait_for_agreement",
]

# Rows of the agreement table; each rank writes its own column and zeros elsewhere.
ROW_NUM_TOKENS = 0  # tokens this rank scheduled (padded by the caller)
ROW_CG_MODE = 1  # the CUDAGraphMode value this rank would run alone
ROW_UNIFORM_TOKEN_COUNT = 2  # uniform decode length, 0 for none
ROW_MAX_QUERY_LEN = 3  # per-request query-length bound, -1 for none
ROW_NUM_REQS = 4  # requests this rank scheduled (seed layout; see TableLayout.row_num_reqs)
ROW_ALLOW_UBATCHING = 4  # newest layout only: 1 when this rank votes to microbatch
TABLE_ROWS = 5  # rows of the seed's layout

# The steps build these from values they have checked (purepp._trusted: no converters,
# validators or post-init checks, half the cost of attrs's constructor).
_AllReduce = trusted(AllReduce)
_Release = trusted(Release)
_NoteDecision = trusted(NoteDecision)
_Descriptor = trusted(BatchExecutionDescriptor)
_Step = trusted(Step)
_INT32 = np.dtype(np.int32)


class LaneBusyError(PureppError):
    """An agreement was started on a lane that already has one in flight."""


class Lane(enum.Enum):
    """Which agreement a lane carries; each lane has its own communicator."""

    TARGET = "target"  # the target model's batch shape
    DRAFTER = "drafter"  # the drafter's, which may be in flight beside the target's


# -- static configuration ---------------------------------------------------------------


def _not_a_lane(call: str, lane: object) -> InvalidInputError:
    return InvalidInputError(call, f"lane={lane!r} is not a Lane", "pass Lane.TARGET or DRAFTER")


def _check_microbatch(instance: MicrobatchConfig) -> None:
    call = "MicrobatchConfig"
    store_ints(
        instance,
        num_ubatches=check_int(call, "num_ubatches", instance.num_ubatches, 2, 64, config=True),
        decode_token_threshold=check_int(
            call, "decode_token_threshold", instance.decode_token_threshold, 0, config=True
        ),
        prefill_token_threshold=check_int(
            call, "prefill_token_threshold", instance.prefill_token_threshold, 0, config=True
        ),
    )


@attrs.frozen(kw_only=True)
class MicrobatchConfig:
    """The newest vLLM's microbatching (dual-batch overlap) thresholds; the same on every rank.

    Defaults are vLLM's (`num_ubatches`, `dbo_decode_token_threshold`,
    `dbo_prefill_token_threshold`).
    """

    num_ubatches: int = 2  # microbatches a microbatched step is split into
    decode_token_threshold: int = 32  # fewest tokens on every rank to split a uniform decode
    prefill_token_threshold: int = 512  # fewest tokens on every rank to split any other step

    def __attrs_post_init__(self) -> None:
        _check_microbatch(self)


def _check_layout(instance: TableLayout) -> None:
    micro = instance.microbatch
    if micro is not None and type(micro) is not MicrobatchConfig:
        raise ConfigError(
            "TableLayout",
            f"microbatch={micro!r} is {a_type(micro)}",
            "pass a MicrobatchConfig for the newest six-row layout, or None for the seed's",
        )


@attrs.frozen(kw_only=True)
class TableLayout:
    """The rows of the agreement table: the seed's five, or the newest vLLM's six.

    With `microbatch` set, row 4 carries every rank's microbatching vote and the request
    counts move to row 5, as in the newest vLLM.
    """

    microbatch: MicrobatchConfig | None = None  # None: the seed's layout, no microbatching
    rows: int = attrs.field(init=False)  # rows of the table
    row_num_reqs: int = attrs.field(init=False)  # the row of the request counts

    def __attrs_post_init__(self) -> None:
        _check_layout(self)
        newest = self.microbatch is not None
        object.__setattr__(self, "rows", 6 if newest else TABLE_ROWS)
        object.__setattr__(self, "row_num_reqs", 5 if newest else ROW_NUM_REQS)


SEED_TABLE = TableLayout()  # the seed's five rows (the default)


def _live_set(values: Iterable[int] | None) -> frozenset[int] | None:
    # Anything that is not a set of ranks passes through; the group's check names it.
    raw: Any = values
    if raw is None or isinstance(raw, (str, bytes)):
        return cast("frozenset[int] | None", raw)
    try:
        return frozenset(raw)
    except TypeError:
        return cast("frozenset[int] | None", raw)


def _check_group(instance: AgreementGroup) -> None:
    call = "AgreementGroup"
    dp_size = check_int(call, "dp_size", instance.dp_size, 1, config=True)
    dp_rank = check_int(
        call,
        "dp_rank",
        instance.dp_rank,
        0,
        dp_size - 1,
        fix="pass this rank's index in the DP group",
        config=True,
    )
    store_ints(instance, dp_size=dp_size, dp_rank=dp_rank)
    if type(instance.layout) is not TableLayout:
        raise ConfigError(
            call, f"layout={instance.layout!r} is not a TableLayout", "pass SEED_TABLE or one"
        )
    for name, comm in (("comm", instance.comm), ("drafter_comm", instance.drafter_comm)):
        if not isinstance(comm, Communicator):
            raise ConfigError(call, f"{name}={comm!r} is not a Communicator", "pass one")
    if instance.comm is instance.drafter_comm:
        raise ConfigError(
            call,
            f"both lanes use {instance.comm.name}",
            "give the drafter lane its own communicator (DP_DRAFTER_CPU), so the two "
            "agreements in flight cannot pair with each other",
        )
    live = instance.live_ranks
    if live is None:
        return
    if not isinstance(live, frozenset):
        raise ConfigError(
            call, f"live_ranks={live!r} is not a set of ranks", "pass ranks, e.g. {0, 2}"
        )
    ranks = frozenset(
        check_int(call, "live rank", rank, 0, dp_size - 1, config=True) for rank in live
    )
    object.__setattr__(instance, "live_ranks", ranks)
    if instance.dp_rank not in live:
        raise ConfigError(
            call,
            f"dp_rank={instance.dp_rank} is not among live_ranks={sorted(live)}",
            "a rank running the agreement is alive: include it",
        )


_CACHED_PER_GROUP = 1024  # a bound on each of a group's caches of shared frozen results


@attrs.frozen(kw_only=True)
class AgreementGroup:
    """The DP group an agreement runs in; built once, checked once.

    `live_ranks` is None while every rank is alive; once a rank has died, it names the
    survivors, whose decision never reads the dead ranks' columns.
    """

    dp_size: int  # ranks in the group
    dp_rank: int  # this rank's column
    layout: TableLayout = SEED_TABLE  # which rows the table has
    live_ranks: frozenset[int] | None = attrs.field(default=None, converter=_live_set)
    # ^ the ranks alive, this one included; None: all of them
    comm: Communicator = Communicator.DP_CPU  # the target lane's communicator
    drafter_comm: Communicator = Communicator.DP_DRAFTER_CPU  # the drafter lane's
    live: tuple[int, ...] = attrs.field(init=False, repr=False)  # live ranks, ascending
    all_live: bool = attrs.field(init=False, repr=False)  # no rank has died
    _padded_counts: dict[int, IntArray] = attrs.field(init=False, repr=False, eq=False, hash=False)
    # ^ frozen per-rank arrays of one agreed count, shared by every sync that holds it
    _graph_outcomes: dict[tuple[int, int | None, int, int | None], DispatchOutcome] = attrs.field(
        init=False, repr=False, eq=False, hash=False
    )
    # ^ frozen outcomes of agreed graphs, shared by the steps that agree the same one

    def __attrs_post_init__(self) -> None:
        _check_group(self)
        live = (
            tuple(range(self.dp_size))
            if self.live_ranks is None
            else tuple(sorted(self.live_ranks))
        )
        object.__setattr__(self, "live", live)
        object.__setattr__(self, "all_live", len(live) == self.dp_size)
        object.__setattr__(self, "_padded_counts", {})
        object.__setattr__(self, "_graph_outcomes", {})

    def comm_of(self, lane: Lane) -> Communicator:
        """The communicator `lane` reduces its table over."""
        if lane is Lane.TARGET:
            return self.comm
        if lane is Lane.DRAFTER:
            return self.drafter_comm
        raise _not_a_lane("AgreementGroup.comm_of", lane)

    def mark_dead(self, *ranks: int) -> AgreementGroup:
        """This group with `ranks` dead: later agreements ignore their columns."""
        dead = [
            check_int(
                "AgreementGroup.mark_dead",
                "rank",
                rank,
                0,
                self.dp_size - 1,
                fix=f"name ranks of this group, 0..{self.dp_size - 1}",
            )
            for rank in ranks
        ]
        if self.dp_rank in dead:
            raise InvalidInputError(
                "AgreementGroup.mark_dead",
                f"rank={self.dp_rank} is this group's own dp_rank",
                "mark only the other ranks dead; a rank that is itself gone agrees no more",
            )
        return attrs.evolve(self, live_ranks=frozenset(self.live).difference(dead))

    def _graph_outcome(
        self,
        descriptor: BatchExecutionDescriptor,
        uniform: int | None,
        most_reqs: int,
        max_query_len: int | None,
    ) -> DispatchOutcome:
        """The outcome of an agreed graph: every rank padded to the descriptor's tokens.

        A steady decode agrees the same graph step after step, so the frozen outcome is
        shared. Keyed by the descriptor's identity (a dispatcher's memo hands the same
        one back). An entry counts only for that very descriptor: one held by a copy of
        the group, or by a group unpickled in another process, is recomputed.
        """
        key = (id(descriptor), uniform, most_reqs, max_query_len)
        known = self._graph_outcomes.get(key)
        if known is not None and known.descriptor is descriptor:
            return known
        full_reqs = descriptor.num_reqs if descriptor.cg_mode is CUDAGraphMode.FULL else None
        sync = _sync(
            self.padded_counts(descriptor.num_tokens),
            uniform,
            False,
            full_reqs if full_reqs is not None else most_reqs,
            max_query_len,
        )
        outcome = _outcome(descriptor, sync)
        if known is not None or len(self._graph_outcomes) < _CACHED_PER_GROUP:
            self._graph_outcomes[key] = outcome
        return outcome

    def __reduce__(self) -> tuple[Any, ...]:
        # A copy (pickle, deepcopy) starts with empty caches: they are derived, and numpy
        # would hand their frozen arrays back writable.
        return (
            _rebuilt_group,
            (
                self.dp_size,
                self.dp_rank,
                self.layout,
                self.live_ranks,
                self.comm,
                self.drafter_comm,
            ),
        )

    def padded_counts(self, num_tokens: int) -> IntArray:
        """`num_tokens` for every live rank and 0 for every dead one, read-only."""
        if type(num_tokens) is not int or not 0 <= num_tokens <= INT32_MAX:
            num_tokens = check_int("AgreementGroup.padded_counts", "num_tokens", num_tokens, 0)
        known = self._padded_counts.get(num_tokens)
        if known is not None:
            return known
        counts = np.zeros(self.dp_size, dtype=np.int32)
        counts[list(self.live)] = num_tokens
        out: IntArray = readonly(counts, np.int32)
        if len(self._padded_counts) < _CACHED_PER_GROUP:
            self._padded_counts[num_tokens] = out
        return out


def _rebuilt_group(  # noqa: PLR0917  # AgreementGroup's fields, in their order
    dp_size: int,
    dp_rank: int,
    layout: TableLayout,
    live_ranks: frozenset[int] | None,
    comm: Communicator,
    drafter_comm: Communicator,
) -> AgreementGroup:
    return AgreementGroup(
        dp_size=dp_size,
        dp_rank=dp_rank,
        layout=layout,
        live_ranks=live_ranks,
        comm=comm,
        drafter_comm=drafter_comm,
    )


# -- per-step values ----------------------------------------------------------------------


def _check_sync(instance: DPSyncState) -> None:
    call = "DPSyncState"
    counts: Any = instance.num_tokens_across_dp
    if isinstance(counts, (list, tuple)):
        for count in counts:
            check_int(call, "num_tokens_across_dp entry", count, 0)
        counts = np.array(counts, dtype=np.int32)
    if (
        not isinstance(counts, np.ndarray)
        or counts.dtype.kind not in "iu"
        or counts.ndim != 1
        or counts.shape[0] < 1
        or (counts < 0).any()
        or (counts > INT32_MAX).any()
    ):
        raise InvalidInputError(
            call,
            f"num_tokens_across_dp={counts!r} is not one int count >= 0 per rank",
            "pass a 1-D integer array of dp_size token counts",
        )
    object.__setattr__(instance, "num_tokens_across_dp", readonly(counts, np.int32))
    uniform = check_optional_int(
        call,
        "uniform_token_count",
        instance.uniform_token_count,
        1,
        fix="pass None when the ranks agreed on no uniform decode length",
    )
    object.__setattr__(instance, "eager", check_bool(call, "eager", instance.eager))
    num_reqs = check_int(call, "num_reqs", instance.num_reqs, 0)
    query_len = check_optional_int(
        call,
        "max_query_len",
        instance.max_query_len,
        1,
        fix="pass None when the ranks agreed on no query-length bound",
    )
    store_ints(instance, uniform_token_count=uniform, num_reqs=num_reqs, max_query_len=query_len)


@attrs.frozen(kw_only=True)
class DPSyncState:
    """What an agreement decided across DP ranks; every field is identical on every rank.

    Callers branch on these fields without disagreeing about whether to run a
    collective, so never add a per-rank value here.
    """

    __reduce__ = reduce_frozen  # its arrays stay frozen in a copy

    num_tokens_across_dp: IntArray = attrs.field(eq=ARRAY_EQ, hash=False)
    # ^ per-rank token counts for the forward context: all the agreed padded count,
    #   unless `eager`, where each rank kept its own; 0 for a dead rank
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


_DPSyncState = trusted(DPSyncState)
_DispatchOutcome = trusted(DispatchOutcome)


def _outcome(descriptor: BatchExecutionDescriptor, sync: DPSyncState | None) -> DispatchOutcome:
    """A DispatchOutcome from values the library built (it has no checks to skip)."""
    return _DispatchOutcome(descriptor=descriptor, sync=sync)


def _check_batch(instance: RankBatch) -> None:
    call = "RankBatch"
    fields: Any = instance  # caller input: any type may arrive, whatever the annotations say
    reqs, tokens, loras = fields.num_reqs, fields.num_tokens, fields.num_active_loras
    uniform, query_len = fields.uniform_token_count, fields.max_query_len
    exact = (
        type(reqs) is int
        and type(tokens) is int
        and type(loras) is int
        and (uniform is None or type(uniform) is int)
        and (query_len is None or type(query_len) is int)
    )
    in_range = exact and (
        0 <= reqs <= tokens <= INT32_MAX
        and 0 <= loras <= INT32_MAX
        and (uniform is None or 1 <= uniform * max(reqs, 1) <= tokens)
        and (query_len is None or 1 <= query_len <= INT32_MAX)
    )
    if not in_range:
        _explain_batch(instance)
    if type(fields.need_eager) is not bool:
        object.__setattr__(
            instance, "need_eager", check_bool(call, "need_eager", fields.need_eager)
        )
    sync = fields.dp_sync
    if sync is not None and type(sync) is not DPSyncState:
        raise InvalidInputError(
            call, f"dp_sync={sync!r} is not a DPSyncState", "pass an agreement's sync, or None"
        )


def _explain_batch(instance: RankBatch) -> None:
    """Raise the error that says what is wrong, or store exact ints in place of numpy's."""
    call = "RankBatch"
    fix = "counts are ints >= 0 that fit int32"
    reqs = check_int(call, "num_reqs", instance.num_reqs, 0, fix=fix)
    tokens = check_int(call, "num_tokens", instance.num_tokens, 0, fix=fix)
    loras = check_int(call, "num_active_loras", instance.num_active_loras, 0, fix=fix)
    # 0 would read back as None from the table (0 and -1 encode None).
    uniform = check_optional_int(call, "uniform_token_count", instance.uniform_token_count, 1)
    query_len = check_optional_int(call, "max_query_len", instance.max_query_len, 1)
    # A rank with more requests than a FULL graph's padded request count falls back
    # to eager where the others replay the graph: different shapes (field failure 11).
    check_requests_fit(call, reqs, tokens, uniform)
    for name, value in (
        ("num_reqs", reqs),
        ("num_tokens", tokens),
        ("num_active_loras", loras),
        ("uniform_token_count", uniform),
        ("max_query_len", query_len),
    ):
        object.__setattr__(instance, name, value)


@attrs.frozen(kw_only=True)
class RankBatch:
    """One rank's facts for one agreement, checked when built."""

    num_reqs: int  # requests scheduled on this rank
    num_tokens: int  # tokens scheduled on this rank, padded by the caller
    uniform_token_count: int | None = None  # tokens per request of a uniform decode batch
    max_query_len: int | None = None  # per-request query-length bound, None: not tracked
    need_eager: bool = False  # force eager (profile run)
    num_active_loras: int = 0  # active LoRA adapters on this rank
    dp_sync: DPSyncState | None = None  # an agreement over this same batch, to reuse

    def __attrs_post_init__(self) -> None:
        _check_batch(self)


def _check_lanes(instance: AgreementLanes) -> None:
    call = "AgreementLanes"
    fix = "pass the step the lane has in flight, or None"
    store_ints(
        instance,
        target=check_optional_int(call, "target", instance.target, 0, fix=fix),
        drafter=check_optional_int(call, "drafter", instance.drafter, 0, fix=fix),
    )


@attrs.frozen
class AgreementLanes:
    """Which agreement each lane has in flight: the step, or None when the lane is free.

    Threaded explicitly: `start_agreement` takes a lane, `finish_agreement` frees it.
    """

    target: int | None = None  # step of the target agreement in flight
    drafter: int | None = None  # step of the drafter agreement in flight

    def __attrs_post_init__(self) -> None:
        _check_lanes(self)

    def in_flight(self, lane: Lane) -> int | None:
        """The step `lane` has in flight, or None."""
        if lane is Lane.TARGET:
            return self.target
        if lane is Lane.DRAFTER:
            return self.drafter
        raise _not_a_lane("AgreementLanes.in_flight", lane)


def _lanes(target: int | None, drafter: int | None) -> AgreementLanes:
    """Lanes from steps the library checked (no constructor checks: a start and a finish
    build one each)."""
    if target is None and drafter is None:
        return _IDLE_LANES  # the common free lanes: frozen, so one value is shared
    return _AgreementLanes(target=target, drafter=drafter)


_IDLE_LANES = AgreementLanes()
_AgreementLanes = trusted(AgreementLanes)


@attrs.frozen(kw_only=True)
class PendingAgreement:
    """A started agreement: everything `finish_agreement` needs. Built by `start_agreement`."""

    __reduce__ = reduce_frozen  # its arrays stay frozen in a copy

    step: int  # decode step the agreement belongs to
    lane: Lane  # the lane it occupies until finished
    group: AgreementGroup  # the group it runs in
    batch: RankBatch  # this rank's facts
    dispatcher: Dispatcher | None  # None only when this rank forced eager
    desired: BatchExecutionDescriptor  # what this rank would run alone
    decided: DispatchOutcome | None  # the outcome when decided at once, with no collective
    table: BufferRef | None  # where the interpreter binds the reduced table; None if decided
    work: WorkRef | None  # async handle of the all-reduce; None when synchronous or decided
    contribution: IntArray | None = attrs.field(eq=ARRAY_EQ, hash=False)
    # ^ this rank's table (others' columns zero); None when decided
    own: tuple[int, ...]  # this rank's column, to recognise its table
    # Known at the start, so the finish (on the critical path when the start overlaps
    # the forward) builds only the decision:
    release: tuple[Effect, ...]  # the finish's last effects: release the table's binding

    def __attrs_post_init__(self) -> None:
        # One built by hand (attrs.evolve of a start's) is checked here; the start builds
        # its own with a trusted constructor.
        for name, kinds in (
            ("lane", (Lane,)),
            ("group", (AgreementGroup,)),
            ("batch", (RankBatch,)),
            ("desired", (BatchExecutionDescriptor,)),
            ("decided", (DispatchOutcome, type(None))),
            ("table", (BufferRef, type(None))),
            ("work", (WorkRef, type(None))),
            ("contribution", (np.ndarray, type(None))),
            ("own", (tuple,)),
            ("release", (tuple,)),
        ):
            value = getattr(self, name)
            if not isinstance(value, kinds):
                raise InvalidInputError(
                    "PendingAgreement",
                    f"{name}={value!r} is {a_type(value)}",
                    "pass the PendingAgreement start_agreement returned (or an evolve of it)",
                )
        check_int("PendingAgreement", "step", self.step, 0, fix="pass a decode step")
        freeze_fields(self, "contribution")


_PendingAgreement = trusted(PendingAgreement)

AgreementStarted: TypeAlias = Step[AgreementLanes, PendingAgreement]
AgreementFinished: TypeAlias = Step[AgreementLanes, DispatchOutcome]


# -- start ----------------------------------------------------------------------------------


def _check_start(
    *,
    lanes: Any,
    group: Any,
    dispatcher: Any,
    batch: Any,
    step: Any,
    lane: Any,
    asynchronous: Any,
) -> None:
    call = "start_agreement"
    if (
        type(lanes) is not AgreementLanes
        or type(group) is not AgreementGroup
        or type(batch) is not RankBatch
    ):  # the loop names the first wrong one; the test above spares building its tuples
        for name, value, cls in (
            ("lanes", lanes, AgreementLanes),
            ("group", group, AgreementGroup),
            ("batch", batch, RankBatch),
        ):
            if type(value) is not cls:
                raise InvalidInputError(
                    call,
                    f"{name}={value!r} is not {with_article(cls.__name__)}",
                    f"pass {with_article(cls.__name__)}",
                )
    if type(step) is not int or not 0 <= step <= INT32_MAX:
        check_int(call, "step", step, 0, fix=f"pass the decode step as an int in 0..{INT32_MAX}")
    if type(lane) is not Lane:
        raise _not_a_lane(call, lane)
    if type(asynchronous) is not bool:
        check_bool(call, "asynchronous", asynchronous)
    if dispatcher is not None and not callable(getattr(dispatcher, "dispatch", None)):
        raise InvalidInputError(
            call,
            f"dispatcher={dispatcher!r} has no dispatch method",
            "pass a Dispatcher (e.g. CudaGraphDispatcher), or None for a profile run",
        )
    busy = lanes.in_flight(lane)
    if busy is not None:
        raise LaneBusyError(
            call,
            f"the {lane.value} lane still has the agreement of step {busy} in flight "
            f"(starting step {step})",
            "finish that agreement (finish_agreement) first, or start this one on the other lane",
        )
    sync = batch.dp_sync
    if dispatcher is None and not (batch.need_eager or (sync is not None and sync.eager)):
        raise ConfigError(
            call,
            "cudagraph dispatcher is None but the batch is not forced eager",
            "pass the dispatcher; only a profile run (need_eager=True) may omit it",
        )
    if sync is not None:
        _check_reuse(sync, batch, group)


def _check_reuse(sync: DPSyncState, batch: RankBatch, group: AgreementGroup) -> None:
    call = "start_agreement"
    if sync.num_tokens_across_dp.shape != (group.dp_size,):
        raise InvalidInputError(
            call,
            f"dp_sync holds {sync.num_tokens_across_dp.shape[0]} ranks but dp_size={group.dp_size}",
            "reuse only a sync taken over this DP group",
        )
    agreed_tokens = int(sync.num_tokens_across_dp[group.dp_rank])
    if agreed_tokens != batch.num_tokens:
        raise StaleSyncError(
            call,
            f"dp_sync was taken over a batch of {agreed_tokens} tokens on rank "
            f"{group.dp_rank}, this batch has num_tokens={batch.num_tokens}",
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


def _checked_descriptor(call: str, answer: object, dispatcher: object) -> BatchExecutionDescriptor:
    if type(answer) is not BatchExecutionDescriptor:
        raise InvalidInputError(
            call,
            f"{type(dispatcher).__name__}.dispatch returned {answer!r}",
            "return a BatchExecutionDescriptor from dispatch",
        )
    return answer


def start_agreement(
    lanes: AgreementLanes,
    group: AgreementGroup,
    dispatcher: Dispatcher | None,
    batch: RankBatch,
    *,
    step: int,
    lane: Lane = Lane.TARGET,
    asynchronous: bool = False,
) -> AgreementStarted:
    """Pick this rank's descriptor and start agreeing it across `group` on `lane`.

    Decided at once, with no effect, when the group has one rank or `batch.dp_sync`
    (an agreement over this same batch, e.g. the target's, reused by a drafter's
    prefill) is given. Otherwise the one effect is an `AllReduce` of this rank's table
    column over the lane's communicator; with `asynchronous` it carries a `WorkRef`,
    completed by the `WaitWork` of `wait_for_agreement`. Either way the lane is busy
    until `finish_agreement`.

    Raises LaneBusyError (the lane has an agreement in flight), ConfigError (no
    dispatcher without need_eager), InvalidInputError (wrong types, a dispatcher that
    answers no descriptor), StaleSyncError (`dp_sync` from another batch).
    """
    _check_start(
        lanes=lanes,
        group=group,
        dispatcher=dispatcher,
        batch=batch,
        step=step,
        lane=lane,
        asynchronous=asynchronous,
    )
    step = int(step)  # a checked numpy integer becomes the Python int every name uses
    desired = _desired_descriptor(dispatcher, batch)
    busy = _lanes(step, lanes.drafter) if lane is Lane.TARGET else _lanes(lanes.target, step)
    decided: DispatchOutcome | None = None
    if group.dp_size == 1:
        decided = _outcome(desired, None)  # decide_alone's answer, desired known already
    elif batch.dp_sync is not None:
        decided = _reuse(group, batch.dp_sync, desired, batch.num_tokens)
    if decided is not None:
        pending = _PendingAgreement(
            step=step,
            lane=lane,
            group=group,
            batch=batch,
            dispatcher=dispatcher,
            desired=desired,
            decided=decided,
            table=None,
            work=None,
            contribution=None,
            own=(),
            release=(),
        )
        return _Step(busy, (), pending)
    own = _column(group, batch, desired)
    # This rank's column packed into zeros: the bytes of the table, immutable all the
    # way down, so the AllReduce takes the array as it is.
    packed = _contribution_packer(group.layout.rows, group.dp_size, group.dp_rank).pack(*own)
    contribution: IntArray = np.ndarray((group.layout.rows, group.dp_size), _INT32, packed)
    prefix = f"dp.{lane.value}.step{step}"
    table_ref = BufferRef(f"{prefix}.table")
    work = WorkRef(f"{prefix}.work") if asynchronous else None
    pending = _PendingAgreement(
        step=step,
        lane=lane,
        group=group,
        batch=batch,
        dispatcher=dispatcher,
        desired=desired,
        decided=None,
        table=table_ref,
        work=work,
        contribution=contribution,
        own=own,
        release=(_release(step, table_ref),),
    )
    # Built without AllReduce's converter: the contribution is frozen int32 already.
    all_reduce = _AllReduce(
        step=step,
        op=Op.AGREE,
        contribution=contribution,
        result=table_ref,
        comm=group.comm_of(lane),
        work=work,
    )
    return _Step(busy, (all_reduce,), pending)


def decide_alone(
    lanes: AgreementLanes,
    group: AgreementGroup,
    dispatcher: Dispatcher | None,
    batch: RankBatch,
    *,
    step: int,
    lane: Lane,
) -> DispatchOutcome:
    """What `start_agreement` then `finish_agreement` decide in a group of one rank (this
    rank's own descriptor, no sync), without building either: checked and refused as the
    start checks and refuses. The lanes stay as they are."""
    _check_start(
        lanes=lanes,
        group=group,
        dispatcher=dispatcher,
        batch=batch,
        step=step,
        lane=lane,
        asynchronous=False,
    )
    if group.dp_size != 1:
        raise InvalidInputError(
            "decide_alone",
            f"the group has {group.dp_size} ranks",
            "decide alone only in a group of one rank; agree with start_agreement otherwise",
        )
    return _outcome(_desired_descriptor(dispatcher, batch), None)


@functools.lru_cache(maxsize=256)
def _contribution_packer(rows: int, dp_size: int, dp_rank: int) -> struct.Struct:
    """Packs a column into the bytes of a [rows, dp_size] int32 table, zeros elsewhere.

    One C call in place of zeros, a column write and a copy to bytes. Native byte order
    with standard sizes, as numpy's int32; the column's values fit int32 (checked).
    """
    row = f"{dp_rank * 4}xi{(dp_size - dp_rank - 1) * 4}x"
    return struct.Struct("=" + row * rows)


def _release(step: int, buffer: BufferRef) -> Release:
    """The finish's Release of the reduced table."""
    return _Release(step=step, op=Op.AGREE, buffer=buffer)


def _column(
    group: AgreementGroup, batch: RankBatch, desired: BatchExecutionDescriptor
) -> tuple[int, ...]:
    """This rank's column; None is written as 0 (uniform count) or -1 (query length)."""
    head = (
        batch.num_tokens,
        int(desired.cg_mode),
        batch.uniform_token_count or 0,
        batch.max_query_len or -1,
    )
    if group.layout.microbatch is None:
        return (*head, batch.num_reqs)
    # Every rank votes the group's configuration, idle or not (vllm#50945).
    return (*head, 1, batch.num_reqs)


def _desired_descriptor(
    dispatcher: Dispatcher | None, batch: RankBatch
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
    answer = dispatcher.dispatch(
        batch.num_reqs,
        batch.num_tokens,
        uniform,
        num_active_loras=batch.num_active_loras,
        max_query_len=query_len,
    )
    return _checked_descriptor("start_agreement", answer, dispatcher)


def _eager(
    num_tokens: int, num_reqs: int, num_active_loras: int, num_ubatches: int = 1
) -> BatchExecutionDescriptor:
    """An eager descriptor from counts the library checked (no constructor checks)."""
    return _Descriptor(
        cg_mode=CUDAGraphMode.NONE,
        num_tokens=num_tokens,
        num_reqs=num_reqs,
        uniform_token_count=None,
        max_query_len=None,
        num_active_loras=num_active_loras,
        num_ubatches=num_ubatches,
    )


def _eager_for(batch: RankBatch, desired: BatchExecutionDescriptor) -> BatchExecutionDescriptor:
    """This rank's own counts, eager: what it runs when any rank runs eager."""
    loras = desired.num_active_loras
    if (
        desired.cg_mode is CUDAGraphMode.NONE
        and desired.num_tokens == batch.num_tokens
        and desired.num_reqs == batch.num_reqs
        and desired.num_ubatches == 1
        and desired.uniform_token_count is None
        and desired.max_query_len is None
    ):
        return desired
    return _eager(batch.num_tokens, batch.num_reqs, loras)


def _reuse(
    group: AgreementGroup, sync: DPSyncState, desired: BatchExecutionDescriptor, num_tokens: int
) -> DispatchOutcome:
    if not sync.eager and desired.num_tokens != num_tokens:
        # This dispatcher's capture sizes may pad further than the one that agreed;
        # every rank pads alike, so report the count that will run: every live rank's,
        # as the seed's full_like, a live rank agreed at 0 tokens included (dead ranks
        # keep 0; a count of 0 does not make a rank dead).
        sync = attrs.evolve(sync, num_tokens_across_dp=group.padded_counts(desired.num_tokens))
    return _outcome(desired, sync)


# -- wait and finish --------------------------------------------------------------------------


def wait_for_agreement(pending: PendingAgreement) -> Step[PendingAgreement, BufferRef | None]:
    """Complete the all-reduce before reading the table: a `WaitWork` when asynchronous.

    The result names the buffer the reduced table is bound to, None when the start
    decided at once (then pass None as the table to `finish_agreement`).
    """
    if type(pending) is not PendingAgreement:
        raise InvalidInputError(
            "wait_for_agreement",
            f"pending={pending!r} is not a PendingAgreement",
            "pass the result of start_agreement",
        )
    if pending.work is None:
        return _Step(pending, (), pending.table)
    wait = WaitWork(step=pending.step, op=Op.AGREE, work=pending.work)
    return _Step(pending, (wait,), pending.table)


def finish_agreement(
    lanes: AgreementLanes,
    pending: PendingAgreement,
    reduced_table: npt.NDArray[Any] | None,
) -> AgreementFinished:
    """Decide from the reduced table (None when the start decided at once); free the lane.

    The same table gives every rank the same decision. Over the live ranks:

    - No rank has tokens: NONE with 0 tokens and 0 requests, and no sync.
    - Newest layout, every rank voted to microbatch and the fewest tokens reach the
      threshold: eager, split into `num_ubatches`, every rank padded to the most tokens.
    - Any rank eager: all eager, each keeping its own counts; the sync records every
      rank's unpadded tokens and the most requests any rank scheduled.
    - Else dispatch the agreed values (most tokens of any rank, the uniform count if
      every rank had the same non-zero one, the largest query-length bound if every
      rank set one) with this rank's own requests, so PIECEWISE pads no requests;
      every rank's entry becomes the padded count, and the agreed request bound is the
      FULL graph's padded count, else the most any rank scheduled.

    Two effects, when a table was reduced: a `NoteDecision` of the decision for the log
    (the checker and the simulator compare the ranks' notes: field failure 17), then the
    `Release` of the table's binding (the caller has read it).

    Raises InvalidInputError when `pending` is not in flight in `lanes`, or the table is
    not the int32 sum of the ranks' contributions for this agreement (a dead rank's
    column is never read, so it is never checked).
    """
    _check_finish(lanes, pending)
    free = (
        _lanes(None, lanes.drafter) if pending.lane is Lane.TARGET else _lanes(lanes.target, None)
    )
    if pending.decided is not None:
        if reduced_table is not None:
            raise InvalidInputError(
                "finish_agreement",
                "a reduced table was passed for an agreement decided at once",
                "pass None: this start issued no collective (wait_for_agreement gives None)",
            )
        return _Step(free, (), pending.decided)
    bounds, live_table = _check_table(pending, reduced_table)
    outcome = _decide(pending, bounds, live_table)
    return _Step(free, (_note(pending, outcome), *pending.release), outcome)


# Indexed by the mode's value: an IntEnum indexes a list in C, where hashing one for a
# dict is a Python call (Enum.__hash__).
_MODE_NAMES = [mode.name for mode in sorted(CUDAGraphMode)]


def _note(pending: PendingAgreement, outcome: DispatchOutcome) -> NoteDecision:
    """The decision noted for the log: the agreed sync, mode and microbatches."""
    descriptor, sync = outcome.descriptor, outcome.sync
    table = cast(BufferRef, pending.table)  # set: this agreement reduced a table
    group = pending.group
    comm = group.comm if pending.lane is Lane.TARGET else group.drafter_comm
    if sync is None:  # no rank had work: eager, nothing padded
        return _NoteDecision(
            step=pending.step,
            op=Op.AGREE,
            table=table,
            comm=comm,
            cg_mode="NONE",
            num_ubatches=1,
            num_tokens_across_dp=group.padded_counts(0),  # every rank's 0, frozen
            uniform_token_count=None,
            eager=True,
            num_reqs=0,
            max_query_len=None,
        )
    return _NoteDecision(
        step=pending.step,
        op=Op.AGREE,
        table=table,
        comm=comm,
        cg_mode=_MODE_NAMES[descriptor.cg_mode],
        num_ubatches=descriptor.num_ubatches,
        num_tokens_across_dp=sync.num_tokens_across_dp,
        uniform_token_count=sync.uniform_token_count,
        eager=sync.eager,
        num_reqs=sync.num_reqs,
        max_query_len=sync.max_query_len,
    )


def _check_finish(lanes: Any, pending: Any) -> None:
    call = "finish_agreement"
    if type(lanes) is not AgreementLanes or type(pending) is not PendingAgreement:
        raise InvalidInputError(
            call,
            f"lanes is {a_type(lanes)} and pending is {a_type(pending)}",
            "pass the AgreementLanes and the PendingAgreement start_agreement returned",
        )
    if lanes.in_flight(pending.lane) != pending.step:
        raise InvalidInputError(
            call,
            f"the {pending.lane.value} lane has step {lanes.in_flight(pending.lane)} in "
            f"flight, not this agreement's step {pending.step}",
            "finish each agreement once, with the lanes its start returned (or later ones)",
        )


def _bad_table(problem: str, fix: str) -> InvalidInputError:
    return InvalidInputError("finish_agreement", problem, fix)


_SMALL_GROUP = 16  # up to this many live columns, list.sort beats numpy's calls
_SORT_GROUP = 256  # up to this many, one numpy sort beats two reductions (min and max)


def _sorted_rows(rows: list[list[int]]) -> list[list[int]]:
    """`rows`, each sorted in place: its least first and its most last."""
    for row in rows:
        row.sort()
    return rows


def _row_bounds(live_table: npt.NDArray[np.int32]) -> Sequence[Sequence[int]]:
    """Each row's live values with the least first and the most last (or just those two)."""
    columns = live_table.shape[1]
    if columns <= _SMALL_GROUP:
        return _sorted_rows(live_table.tolist())
    if columns <= _SORT_GROUP:
        # Columns 0 and columns-1 of the sorted rows: each row's least and most (a copy
        # sorted in place: np.sort's Python wrapper costs a fifth of the whole).
        ordered = live_table.copy()
        ordered.sort()
        pairs: list[list[int]] = ordered[:, :: columns - 1].tolist()
        return pairs
    lows, highs = live_table.min(axis=1).tolist(), live_table.max(axis=1).tolist()
    return list(zip(lows, highs, strict=True))


def _check_table(
    pending: PendingAgreement, reduced_table: Any
) -> tuple[Sequence[Sequence[int]], npt.NDArray[np.int32]]:
    """Each row's live bounds (`_row_bounds`) and the live columns, checked once.

    The decision depends on the table only through these, so the table is read once:
    its shape and dtype, this rank's column, and that the live values the decision
    reads are ones some rank could contribute (a query-length bound beside a -1 is
    never read). A dead rank's column is never read, so never checked.
    """
    group = pending.group
    expected = (group.layout.rows, group.dp_size)
    if (
        type(reduced_table) is not np.ndarray
        or (reduced_table.dtype is not _INT32 and reduced_table.dtype != _INT32)
        or reduced_table.shape != expected
    ):
        described = (
            f"{reduced_table.dtype}{list(reduced_table.shape)}"
            if isinstance(reduced_table, np.ndarray)
            else type(reduced_table).__name__
        )
        raise _bad_table(
            f"reduced_table is {described}, expected an int32{list(expected)} numpy array",
            "pass the all-reduced table bound to the pending agreement's `table` (tensor.numpy())",
        )
    rank = group.dp_rank
    rows: list[list[int]] | None = None
    if group.all_live and group.dp_size <= _SMALL_GROUP:  # one read of the whole table
        rows = reduced_table.tolist()
        column = tuple([row[rank] for row in rows])
    else:
        column = tuple(reduced_table[:, rank].tolist())
    if column != pending.own:
        raise _bad_table(
            f"column {rank} is {list(column)} but this rank contributed {list(pending.own)}",
            "pass the table reduced from this agreement's contribution (same lane and step)",
        )
    live_table = reduced_table if group.all_live else reduced_table[:, group.live]
    bounds = _row_bounds(live_table) if rows is None else _sorted_rows(rows)
    modes = bounds[ROW_CG_MODE]
    query_low = bounds[ROW_MAX_QUERY_LEN][0]
    sane = (
        bounds[ROW_NUM_TOKENS][0] >= 0
        and bounds[group.layout.row_num_reqs][0] >= 0
        and bounds[ROW_UNIFORM_TOKEN_COUNT][0] >= 0
        and query_low >= -1
        and query_low != 0  # 0 is never written; with a -1 present no bound is read
        and modes[0] >= CUDAGraphMode.NONE
        and modes[-1] <= CUDAGraphMode.FULL
    )
    if sane and group.layout.microbatch is not None:
        votes = bounds[ROW_ALLOW_UBATCHING]
        sane = votes[0] == 1 == votes[-1]  # every rank votes 1 (see _column)
    if not sane:
        raise _bad_table(
            f"reduced_table holds values no rank contributes: {reduced_table.tolist()}",
            "sum-all-reduce the contributions of start_agreement, nothing else",
        )
    return bounds, live_table


_IDLE = DispatchOutcome(
    descriptor=BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=0, num_reqs=0),
    sync=None,
)


def _decide(
    pending: PendingAgreement,
    bounds: Sequence[Sequence[int]],
    live_table: npt.NDArray[np.int32],
) -> DispatchOutcome:
    """The decision from each row's live least ([0]) and most ([-1]), the same on every rank."""
    tokens = bounds[ROW_NUM_TOKENS]
    most_tokens = tokens[-1]
    if most_tokens == 0:
        return _IDLE
    group = pending.group
    most_reqs = bounds[group.layout.row_num_reqs][-1]
    # All equal and non-zero (0 encodes None); one dissenting rank is a disagreement.
    uniforms = bounds[ROW_UNIFORM_TOKEN_COUNT]
    uniform = uniforms[-1]
    agreed_uniform = uniform if uniform and uniforms[0] == uniform else None
    # Varlen graphs are chosen by the query-length bound, so it must be agreed too: the
    # largest, when no rank wrote -1 (None).
    query_lens = bounds[ROW_MAX_QUERY_LEN]
    agreed_query_len = query_lens[-1] if query_lens[0] != -1 else None
    micro = group.layout.microbatch
    if micro is not None:  # every rank voted to microbatch (the table check saw to it)
        # purepp's departure: uniform decode is derived from agreed values only.
        threshold = (
            micro.decode_token_threshold
            if agreed_uniform is not None
            else micro.prefill_token_threshold
        )
        # Thresholds grow with the token count: holding the smallest rank to them holds all.
        if tokens[0] >= threshold:
            batch = pending.batch
            descriptor = _eager(
                most_tokens, batch.num_reqs, pending.desired.num_active_loras, micro.num_ubatches
            )
            counts = group.padded_counts(most_tokens)
            sync = _sync(counts, agreed_uniform, True, most_reqs, agreed_query_len)
            return _outcome(descriptor, sync)
    if bounds[ROW_CG_MODE][0] == CUDAGraphMode.NONE:
        counts = _own_counts(group, live_table[ROW_NUM_TOKENS])
        sync = _sync(counts, agreed_uniform, True, most_reqs, agreed_query_len)
        return _outcome(_eager_for(pending.batch, pending.desired), sync)
    dispatcher = pending.dispatcher
    if dispatcher is None:  # unreachable: this rank contributed NONE, so the min is NONE
        raise _bad_table("no dispatcher for an agreed graph", "pass a checked table")
    batch = pending.batch
    descriptor = _checked_descriptor(
        "finish_agreement",
        dispatcher.dispatch(
            batch.num_reqs,
            most_tokens,
            agreed_uniform,
            num_active_loras=batch.num_active_loras,
            max_query_len=agreed_query_len,
        ),
        dispatcher,
    )
    return group._graph_outcome(descriptor, agreed_uniform, most_reqs, agreed_query_len)


def _own_counts(group: AgreementGroup, live_tokens: npt.NDArray[np.int32]) -> IntArray:
    """Every live rank's own (unpadded) token count, 0 for a dead rank: an immutable copy."""
    if not group.all_live:
        counts = np.zeros(group.dp_size, dtype=np.int32)
        counts[list(group.live)] = live_tokens
        live_tokens = counts
    # A view of bytes: the caller's table stays theirs, and the copy cannot be thawed.
    # (The dtype object, not np.int32, spares numpy converting it on every call.)
    out: IntArray = np.frombuffer(live_tokens.tobytes(), _INT32)
    return out


def _sync(
    counts: IntArray,
    uniform: int | None,
    eager: bool,
    num_reqs: int,
    max_query_len: int | None,
) -> DPSyncState:
    """A DPSyncState from agreed values the library checked (no constructor checks)."""
    return _DPSyncState(
        num_tokens_across_dp=counts,
        uniform_token_count=uniform,
        eager=eager,
        num_reqs=num_reqs,
        max_query_len=max_query_len,
    )


# -- every rank in one process ------------------------------------------------------------


def agree_across_ranks(
    dispatcher: Dispatcher | None,
    batches: Sequence[RankBatch],
    *,
    step: int = 0,
    layout: TableLayout = SEED_TABLE,
    live_ranks: Iterable[int] | None = None,
    lane: Lane = Lane.TARGET,
    asynchronous: bool = False,
) -> tuple[DispatchOutcome, ...]:
    """Every live rank's outcome, rank i running `batches[i]`: the all-reduce in-process.

    Runs `start_agreement` on every rank, sums the contributions and runs
    `finish_agreement` on every live rank: the same code a real group runs, for tests
    and the simulator. A dead rank's column holds what its batch would contribute (a
    stale column), which the survivors must ignore. Returns the live ranks' outcomes in
    rank order. Raises CollectiveMismatchError when some ranks would issue the
    all-reduce and others would not (a hang in a real group).
    """
    call = "agree_across_ranks"
    given: object = batches  # a caller's value, whatever its annotation says
    if not isinstance(given, Sequence) or isinstance(given, str):
        raise InvalidInputError(
            call, f"batches is {a_type(batches)}", "pass a list of RankBatch, one per rank"
        )
    dp_size = len(batches)
    if dp_size < 1:
        raise ConfigError(call, "batches is empty", "pass one batch per rank")
    try:
        live = None if live_ranks is None else frozenset(live_ranks)
    except TypeError:
        raise ConfigError(
            call, f"live_ranks={live_ranks!r} is not a set of ranks", "pass ranks, e.g. {0, 2}"
        ) from None
    if live is not None:
        if not live:
            raise ConfigError(call, "live_ranks is empty", "name the ranks still alive")
        # The live ranks' own groups check them; a set naming no rank of this world
        # would build none, and return no outcome at all.
        shown = sorted(live, key=repr)
        outside = [r for r in shown if (rank := as_int(r)) is None or not 0 <= rank < dp_size]
        if outside:
            raise ConfigError(
                call,
                f"live_ranks={shown} names {outside[0]!r}, not a rank of 0..{dp_size - 1}",
                "name live ranks by their index in batches",
            )
    # A dead rank ran its start before it died: its column is stale, not absent.
    groups = [
        AgreementGroup(
            dp_size=dp_size,
            dp_rank=rank,
            layout=layout,
            live_ranks=live if live is not None and rank in live else None,
        )
        for rank in range(dp_size)
    ]
    started = [
        start_agreement(
            _IDLE_LANES, g, dispatcher, b, step=step, lane=lane, asynchronous=asynchronous
        )
        for g, b in zip(groups, batches, strict=True)
    ]
    survivors = [r for r in range(dp_size) if live is None or r in live]
    pending = [s.result for s in started]
    decided = [p.decided for p in pending if p.decided is not None]
    if decided and len(decided) != dp_size:
        joined = [p.group.dp_rank for p in pending if p.decided is None]
        raise CollectiveMismatchError(
            call,
            f"ranks {joined} issue the agreement all-reduce, the others reuse a dp_sync",
            "reuse a dp_sync on every rank of the group or on none",
        )
    if decided:
        return tuple(decided[r] for r in survivors)
    reduced = np.zeros((layout.rows, dp_size), dtype=np.int32)
    for p in pending:
        reduced += p.contribution if p.contribution is not None else 0
    return tuple(finish_agreement(started[r].state, pending[r], reduced).result for r in survivors)
