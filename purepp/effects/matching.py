"""Matching collectives across ranks, per communicator instance, in issue order.

NCCL and gloo match collectives by position: the k-th collective a rank issues on
a communicator meets the k-th collective every other member issues on it, whatever
its shape. A disagreement is not detected by the library; it hangs or corrupts
data. This module compares the ranks' sequences itself and, at the first op that
diverges, says which rank, which communicator instance, which op number, at which
step and from which operation, and what each side posted.

The same comparison serves two callers: the simulator, online, as ranks post;
and the log checker, offline, over whole per-rank effect logs
(`match_collectives`). The report types for runs that cannot make progress
(`DeadlockReport`, `RingOverrunReport`) live here too, so every report a caller
may receive is in one place, carried by `CollectiveReportError`.

Two disagreements no collective shows are compared here as well. The stages of one
replica agree their batch shape in separate DP groups, so a stage-local fact in one
stage's column matches every collective and still makes the stages run different
shapes (`StageAgreements`, `StageDivergenceReport`, field failure 7). And the ranks
note what they decided (`NoteDecision`): ranks that decided one agreement differently,
from a corrupted all-reduce or a dispatcher of their own, match every collective of it
too (`Decisions`, `DecisionDivergenceReport`, field failure 17).

Communicator instances in a PP x DP world (`purepp.layout.Layout`: global
rank = dp_index * pp + pp_stage): PP_RELAY and PP_CPU groups are the stages of
one DP replica; DP_CPU and DP_DRAFTER_CPU groups (two lanes over the same ranks)
are the same stage across replicas.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Final, TypeAlias, assert_never

import attrs

from purepp._checks import check_instance
from purepp._text import a_type
from purepp.effects.vocabulary import (
    AllReduce,
    Broadcast,
    Communicator,
    DType,
    Effect,
    EventRef,
    NoteDecision,
    Op,
    Stream,
)
from purepp.errors import CollectiveMismatchError, ConfigError, InvalidInputError
from purepp.layout import Layout

__all__ = [
    "AGREEMENT_ROWS",
    "AwaitedCollective",
    "CollectiveKind",
    "CollectiveReportError",
    "CollectiveSignature",
    "CommInstance",
    "DeadlockReport",
    "DecisionDivergenceReport",
    "Decisions",
    "MismatchClass",
    "MismatchField",
    "MismatchReport",
    "RankDecision",
    "Report",
    "RingOverrunReport",
    "StageAgreements",
    "StageColumn",
    "StageDivergenceReport",
    "WaitCycle",
    "WaitEdge",
    "Waiter",
    "check_posts",
    "comm_group",
    "comm_instance",
    "find_wait_cycle",
    "match_collectives",
    "mismatch_order",
    "signature_of",
]


def comm_group(world: Layout, rank: int, comm: Communicator) -> tuple[int, ...]:
    """Global ranks of the instance of `comm` that `rank` belongs to, ascending."""
    stage, replica = world.pp_stage(rank), world.dp_index(rank)
    match comm:
        case Communicator.PP_RELAY | Communicator.PP_CPU:
            return world.pipeline(replica)
        case Communicator.DP_CPU | Communicator.DP_DRAFTER_CPU:
            return world.replicas(stage)
        case _:
            assert_never(comm)


def comm_instance(world: Layout, rank: int, comm: Communicator) -> CommInstance:
    """The instance of `comm` that `rank` belongs to."""
    return CommInstance(comm=comm, group=comm_group(world, rank, comm))


@attrs.frozen(kw_only=True)
class CommInstance:
    """One instance of a communicator: its kind and its members."""

    comm: Communicator  # which process group
    group: tuple[int, ...]  # its members' global ranks, ascending

    def describe(self) -> str:
        return f"{self.comm.value} (ranks {_ranks(self.group)})"


class CollectiveKind(enum.Enum):
    BROADCAST = "broadcast"
    ALL_REDUCE = "all_reduce"


@attrs.frozen(kw_only=True)
class CollectiveSignature:
    """What a rank declared for one collective: the fields peers must agree on, and why."""

    kind: CollectiveKind  # broadcast or all-reduce
    comm: Communicator  # process group it runs over
    shape: tuple[int, ...]  # wire shape (the table's shape for an all-reduce)
    dtype: DType  # wire dtype
    src: int | None  # global rank of the broadcast source; None for an all-reduce
    step: int  # decode step it belongs to
    op: Op  # operation that emitted it

    def describe(self) -> str:
        """E.g. `broadcast [4, 3] int64 from rank 2 (step 3, receive)`."""
        shape = "[" + ", ".join(str(d) for d in self.shape) + "]"
        source = "" if self.src is None else f" from rank {self.src}"
        return (
            f"{self.kind.value} {shape} {self.dtype.value}{source}"
            f" (step {self.step}, {self.op.value})"
        )


def signature_of(effect: Broadcast | AllReduce) -> CollectiveSignature:
    """The signature a collective effect declares."""
    match effect:
        case Broadcast():
            return CollectiveSignature(
                kind=CollectiveKind.BROADCAST,
                comm=effect.comm,
                shape=effect.shape,
                dtype=effect.dtype,
                src=effect.src,
                step=effect.step,
                op=effect.op,
            )
        case AllReduce():
            return CollectiveSignature(
                kind=CollectiveKind.ALL_REDUCE,
                comm=effect.comm,
                shape=tuple(int(d) for d in effect.contribution.shape),
                dtype=DType.INT32,
                src=None,
                step=effect.step,
                op=effect.op,
            )
        case _:
            assert_never(effect)


class MismatchField(enum.Enum):
    """A signature field on which two members disagree."""

    KIND = "kind"
    SRC = "src"
    STEP = "step"
    SHAPE = "shape"
    DTYPE = "dtype"


class MismatchClass(enum.Enum):
    """What kind of disagreement a report is, in PyTorch flight-recorder (fr_trace) terms."""

    TYPE = "type"  # different collectives (broadcast vs all-reduce)
    SOURCE = "source"  # broadcasts from different roots
    SIZE = "size"  # different wire shapes
    DTYPE = "dtype"  # different element types
    STEP = "step"  # same wire, different decode steps: a collective skipped or added earlier
    MISSING_RANK = "missing rank"  # a member never posted the op


# The first differing field names the class: a different type explains a different size.
_CLASS_OF_FIELD = (
    (MismatchField.KIND, MismatchClass.TYPE),
    (MismatchField.SRC, MismatchClass.SOURCE),
    (MismatchField.SHAPE, MismatchClass.SIZE),
    (MismatchField.DTYPE, MismatchClass.DTYPE),
    (MismatchField.STEP, MismatchClass.STEP),
)


def _differing(a: CollectiveSignature, b: CollectiveSignature) -> tuple[MismatchField, ...]:
    # The step is compared too: a skipped collective shows up at the step it was
    # skipped, not as a count mismatch at the end of the run.
    if (a.step, a.shape, a.src, a.kind, a.dtype) == (b.step, b.shape, b.src, b.kind, b.dtype):
        return ()  # the common case, in one comparison
    pairs = (
        (MismatchField.KIND, a.kind == b.kind),
        (MismatchField.SRC, a.src == b.src),
        (MismatchField.STEP, a.step == b.step),
        (MismatchField.SHAPE, a.shape == b.shape),
        (MismatchField.DTYPE, a.dtype == b.dtype),
    )
    return tuple(field for field, equal in pairs if not equal)


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


@attrs.frozen(kw_only=True)
class MismatchReport:
    """Two members of a communicator disagree on one op, or one waits for peers in vain.

    Three cases, told apart by the fields:
    - disagreement: `peer` and `received` are set, `differing` is not empty;
    - unmatched (count mismatch): `received` is None and `missing` names the members
      that never posted op `seq`; `rank` posted it and waits;
    - source outside the group: `differing` is (SRC,), no peer, nothing missing.
    """

    rank: int  # the rank whose collective disagrees, or that waits for absent peers
    instance: CommInstance  # the communicator instance both belong to
    seq: int  # op number within that instance, counted from 0 in issue order
    expected: CollectiveSignature  # what `rank` posted as op `seq`
    peer: int | None  # the member it was compared with; None when no peer applies
    received: CollectiveSignature | None  # what `peer` posted as op `seq`
    differing: tuple[MismatchField, ...]  # fields that disagree; empty when unmatched
    missing: tuple[int, ...]  # members that never posted op `seq`
    # the member to blame: the odd one out among the posts, None on a tie (two ranks,
    # say), where the posts cannot tell who is wrong; for an unmatched op, the lowest
    # missing member
    culprit: int | None = None

    @property
    def classification(self) -> MismatchClass:
        """The kind of disagreement: type, source, size, dtype, step or a missing rank."""
        if self.received is None and self.missing:
            return MismatchClass.MISSING_RANK
        return next(
            (cls for field, cls in _CLASS_OF_FIELD if field in self.differing),
            MismatchClass.SOURCE,
        )

    @property
    def comm(self) -> Communicator:
        return self.instance.comm

    @property
    def group(self) -> tuple[int, ...]:
        return self.instance.group

    @property
    def step(self) -> int:
        """The step of `rank`'s op `seq`."""
        return self.expected.step

    @property
    def op(self) -> Op:
        """The operation that emitted `rank`'s op `seq`."""
        return self.expected.op

    def render(self) -> str:
        return "\n".join((self._render_body(), f"  {self.classify_line()}"))

    def classify_line(self) -> str:
        """E.g. `mismatch: size; culprit: rank 2`."""
        if self.culprit is None:
            blamed = "none (as many ranks on each side)"
        else:
            blamed = f"rank {self.culprit}"
        return f"mismatch: {self.classification.value}; culprit: {blamed}"

    def _render_body(self) -> str:
        where = f"op #{self.seq} on {self.instance.describe()}"
        if self.received is None and self.missing:
            return "\n".join(
                (
                    f"Unmatched collective: {where}",
                    f"  rank {self.rank} posted   {self.expected.describe()} and waits",
                    f"  rank(s) {_ranks(self.missing)} never posted op #{self.seq}"
                    f" on {self.comm.value}",
                    "  A rank skipped or added a collective: every member must issue the"
                    " same collectives in the same order.",
                )
            )
        if self.received is None or self.peer is None:
            return "\n".join(
                (
                    f"Broadcast source outside its group: {where}",
                    f"  rank {self.rank} posted   {self.expected.describe()}",
                    f"  rank {self.expected.src} is not a member of {self.comm.value}",
                )
            )
        fields = ", ".join(f.value for f in self.differing)
        consequence = (
            "  Same wire, different steps: a rank skipped or added a collective, so every"
            " later op pairs with the wrong step."
            if self.differing == (MismatchField.STEP,)
            else "  NCCL does not compare these: the run would hang or corrupt data."
        )
        return "\n".join(
            (
                f"Collective mismatch: {where}",
                f"  rank {self.rank} expected {self.expected.describe()}",
                f"  rank {self.peer} posted   {self.received.describe()}",
                f"  they differ in: {fields}",
                consequence,
            )
        )

    def fix(self) -> str:
        if self.received is None and self.missing:
            return "make every member issue this collective at the same step, idle ranks included"
        received = self.received
        if received is None or self.peer is None:  # the source is outside the group
            return (
                "broadcast from a member of the group; a relay's source is its pipeline's "
                "last stage: pass RelayConfig.for_stage(first_rank=...) the global rank of "
                "the pipeline's first stage (dp_index * pp)"
            )
        if (
            self.differing == (MismatchField.SHAPE,)
            and self.comm is Communicator.PP_RELAY
            and received is not None
            and self.expected.shape[1:] == received.shape[1:]
        ):
            # Only the rows differ: a relay's rows are the step's batch, which the stages
            # of a pipeline must share (the caller's mistake, not the wire's).
            return (
                "pass every stage of a pipeline the same BatchFacts at each step (the relay's "
                "rows are the batch's); RelayConfig(validate_header=True) stops it on real "
                "ranks, whose broadcasts compare no shapes"
            )
        if MismatchField.SHAPE in self.differing or MismatchField.DTYPE in self.differing:
            return "derive wire shapes and dtypes from static configuration shared by all ranks"
        return "issue the same collectives in the same order on every member of the group"


@attrs.frozen(kw_only=True)
class AwaitedCollective:
    """A posted collective that cannot complete yet, and who it waits for."""

    instance: CommInstance  # the communicator instance it runs over
    seq: int  # its op number within that instance
    signature: CollectiveSignature  # what the waiting rank posted
    missing: tuple[int, ...]  # members that have not posted op `seq` yet

    def describe(self) -> str:
        head = f"op #{self.seq} on {self.instance.describe()}: {self.signature.describe()}"
        if not self.missing:
            return f"{head}, posted by all members, queued behind other work"
        return f"{head}, not posted by rank(s) {_ranks(self.missing)}"


@attrs.frozen(kw_only=True)
class Waiter:
    """A rank that cannot proceed: a stream's stuck head, or a step it may not start yet."""

    rank: int  # the rank that waits
    stream: Stream | None  # the stuck stream (MAIN when `host`); None: between steps
    step: int  # step of the effect it waits at, or of the step it may not start
    op: Op | None  # operation that emitted that effect; None between steps
    waiting_at: str  # the effect it waits at, in words
    awaited: AwaitedCollective | None  # the collective the wait comes down to, if any
    held_back_by: tuple[int, ...] = ()  # slower ranks it may not run ahead of (steps in flight)
    host: bool = False  # the host itself waits (it issues nothing more), not a stream

    def describe(self) -> str:
        if self.stream is None:
            where = "between steps"
        elif self.host:
            where = "host"
        else:
            where = f"{self.stream.value} stream"
        emitted = "" if self.op is None else f" ({self.op.value})"
        line = f"rank {self.rank} [{where}] waits at step {self.step}{emitted} on {self.waiting_at}"
        if self.awaited is not None:
            line += f"\n      for {self.awaited.describe()}"
        if self.held_back_by:
            line += f"\n      until rank(s) {_ranks(self.held_back_by)} complete more steps"
        return line


@attrs.frozen(kw_only=True)
class WaitEdge:
    """`rank` cannot proceed until `peer` does something: post or reach an op on `via`."""

    rank: int  # the waiting rank
    via: CommInstance | None  # the communicator of the awaited op; None: held back by steps
    seq: int | None  # the awaited op's number on `via`; None when held back
    peer: int  # the rank it waits for

    def describe(self) -> str:
        if self.via is None or self.seq is None:
            return "(steps in flight)"
        return f"{self.via.comm.value} op #{self.seq}"


@attrs.frozen(kw_only=True)
class WaitCycle:
    """Ranks that each wait for the next, round to the first: none can ever move.

    Two ranks issuing collectives on two communicators in opposite orders (A then B
    against B then A) wait on each other this way although each communicator's own
    sequence matches, so no per-communicator comparison can see it (ROCm/rccl#2191).
    """

    edges: tuple[WaitEdge, ...]  # edges[i].peer == edges[i + 1].rank, the last back to the first

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(edge.rank for edge in self.edges)

    @property
    def communicators(self) -> frozenset[Communicator]:
        """The communicators the waits go through (several: an issue-order deadlock)."""
        return frozenset(edge.via.comm for edge in self.edges if edge.via is not None)

    def render(self) -> str:
        """E.g. `rank 0 -> dp_cpu op #0 -> rank 1 -> dp_drafter_cpu op #0 -> rank 0`."""
        parts = [f"rank {edge.rank} -> {edge.describe()}" for edge in self.edges]
        return " -> ".join([*parts, f"rank {self.edges[0].rank}"])


def find_wait_cycle(edges: Sequence[WaitEdge]) -> WaitCycle | None:
    """A cycle in the wait-for graph `edges` (rank -> communicator -> rank), or None.

    Deterministic: the search starts from the lowest rank and follows edges in the
    order given, so equal inputs give equal cycles.
    """
    out: dict[int, list[WaitEdge]] = {}
    for edge in edges:
        if edge.peer != edge.rank:
            out.setdefault(edge.rank, []).append(edge)
    done: set[int] = set()
    for start in sorted(out):
        path: list[WaitEdge] = []
        on_path: dict[int, int] = {}  # rank -> its index in path
        stack = [(start, iter(out.get(start, ())))]
        on_path[start] = 0
        while stack:
            rank, choices = stack[-1]
            taken = next(choices, None)
            if taken is None:
                stack.pop()
                done.add(rank)
                del on_path[rank]
                if path:
                    path.pop()
                continue
            if taken.peer in on_path:
                return WaitCycle(edges=(*path[on_path[taken.peer] :], taken))
            if taken.peer in done:
                continue
            path.append(taken)
            on_path[taken.peer] = len(path)
            stack.append((taken.peer, iter(out.get(taken.peer, ()))))
    return None


@attrs.frozen(kw_only=True)
class DeadlockReport:
    """No rank can make progress and no collective can complete."""

    waiters: tuple[Waiter, ...]  # every stuck stream and held-back rank, by rank
    pending: tuple[AwaitedCollective, ...]  # the oldest incomplete op of every instance
    finished: tuple[int, ...]  # ranks whose program ended
    at_steps: tuple[int | None, ...]  # by rank: the step it is working on; None if finished
    cycle: WaitCycle | None = None  # ranks waiting on each other round a loop, if any
    # (rank, the AllReduce) of each asynchronous all-reduce no WaitWork completed
    unwaited: tuple[tuple[int, AllReduce], ...] = ()

    def render(self) -> str:
        lines = ["Deadlock: no rank can make progress and no collective can complete."]
        if self.cycle is not None:
            lines.append(f"  wait-for cycle: {self.cycle.render()}")
        lines += [f"  {waiter.describe()}" for waiter in self.waiters]
        named = {w.awaited for w in self.waiters}
        others = [awaited for awaited in self.pending if awaited not in named]
        if others:
            lines.append("  other incomplete collectives:")
            lines += [f"    {awaited.describe()}" for awaited in others]
        if self.finished:
            lines.append(f"  finished their program: rank(s) {_ranks(self.finished)}")
        if self.unwaited:
            lines.append("  asynchronous all-reduces never waited on:")
            lines += [
                f"    rank {rank}: work {effect.work.name!r}"
                f" (step {effect.step}, {effect.op.value})"
                for rank, effect in self.unwaited
                if effect.work is not None
            ]
        steps = ", ".join(
            f"rank {r}: {'finished' if n is None else n}" for r, n in enumerate(self.at_steps)
        )
        lines.append(f"  at step: {steps}")
        return "\n".join(lines)

    def fix(self) -> str:
        if self.cycle is not None and len(self.cycle.communicators) > 1:
            return (
                "issue collectives on every communicator in one order on every rank"
                " (taken in crossed orders, each rank waits in one for a collective that"
                " the other issues only after it)"
            )
        if self.unwaited and not self.waiters and not self.pending:
            return (
                "complete every asynchronous all-reduce with its WaitWork before the program "
                "ends (the overlapped rank step starts no agreement during its last step)"
            )
        return (
            "make every member of each communicator issue the same collectives in the same"
            " order; a rank must never wait for a collective that its peers issue later"
        )


@attrs.frozen(kw_only=True)
class RingOverrunReport:
    """A receiver consumed a ring entry whose broadcast the sender had not issued yet."""

    rank: int  # the consuming rank
    step: int  # the step at which it consumes
    op: Op  # the operation that waits
    event: EventRef | None  # the event waited on; None for a stream wait
    awaited: AwaitedCollective  # the relay collective behind the event
    ring_depth: int  # steps between that collective and the consume
    max_steps_in_flight: int  # how far ranks of a pipeline may run ahead of each other
    peers_at: tuple[tuple[int, int | None], ...]  # (rank, step it is working on), absent peers

    def render(self) -> str:
        what = f"event {self.event.name}" if self.event is not None else "the relay stream"
        progress = ", ".join(f"rank {r} is still at step {n}" for r, n in self.peers_at)
        return "\n".join(
            (
                f"Ring overrun: rank {self.rank} at step {self.step} ({self.op.value}) waits on"
                f" {what}",
                f"  for {self.awaited.describe()}",
                f"  ({progress}).",
                f"  The entry was received {self.ring_depth} step(s) before it is consumed,"
                f" but up to {self.max_steps_in_flight} steps are in flight: the receiver"
                " runs ahead of the sender's broadcasts.",
            )
        )

    def fix(self) -> str:
        return (
            f"keep the ring at least as deep as the steps in flight"
            f" (ring depth {self.ring_depth} < {self.max_steps_in_flight})"
        )


# -- field failure 7: the stages of one replica agree in separate groups -----------------

# The agreement table's rows by the table's row count: the seed's five and the newest
# vLLM's six (purepp.dp's ROW_* constants; this layer does not import the core).
AGREEMENT_ROWS: Final[Mapping[int, tuple[str, ...]]] = {
    5: ("num_tokens", "cg_mode", "uniform_token_count", "max_query_len", "num_reqs"),
    6: (
        "num_tokens",
        "cg_mode",
        "uniform_token_count",
        "max_query_len",
        "allow_ubatching",
        "num_reqs",
    ),
}
# purepp.cudagraph.CUDAGraphMode's values, named in a rendered column.
_CG_MODE_NAMES: Final = {0: "NONE", 1: "PIECEWISE", 2: "FULL"}
# The communicators an agreement runs over per stage: a DP group is one stage across the
# replicas, so each stage of a replica decides from a table of its own. An agreement
# over PP_CPU spans the replica's stages: they decide from one table.
_PER_STAGE: Final = frozenset({Communicator.DP_CPU, Communicator.DP_DRAFTER_CPU})
_LANE_OF_COMM: Final = {Communicator.DP_CPU: "target", Communicator.DP_DRAFTER_CPU: "drafter"}
# Agreements held per lane while some stage has not posted them. A stage that never
# posts one (it died, or decided at once from a reused sync) would hold it for ever;
# no driver lets a stage run this far ahead of another, so the oldest is dropped.
_STAGE_WINDOW: Final = 1024


def _table(effect: AllReduce) -> tuple[tuple[int, ...], ...]:
    rows: list[list[int]] = effect.contribution.tolist()
    return tuple(tuple(row) for row in rows)


@attrs.frozen(kw_only=True)
class StageColumn:
    """What one stage of a replica contributed to an agreement over its DP group."""

    rank: int  # its global rank
    stage: int  # its pipeline stage
    table: tuple[tuple[int, ...], ...]  # its whole contribution, row by row
    column: tuple[int, ...]  # the replica's column of it (empty when the table is narrower)

    def describe(self, rows: Sequence[str]) -> str:
        """E.g. `num_tokens=3, cg_mode=2 (FULL), ...`, or the raw column for unknown rows."""
        if len(rows) != len(self.column):
            return f"column {list(self.column)}"
        return ", ".join(
            f"{name}={value} ({_CG_MODE_NAMES[value]})"
            if name == "cg_mode" and value in _CG_MODE_NAMES
            else f"{name}={value}"
            for name, value in zip(rows, self.column, strict=True)
        )


@attrs.frozen(kw_only=True)
class StageDivergenceReport:
    """The stages of one replica contributed different columns to the same agreement.

    In a PP x DP world each stage agrees its batch shape over its own DP group (that
    stage across the replicas). A replica's stages are given the same batch, so their
    columns are equal and they decide the same mode and padded token count, unless a
    stage-local fact (need_eager on one stage, graphs not captured yet, other capture
    sizes) entered one stage's column: then the stages run different shapes and the
    activations they pass to each other never meet (field failure 7; vllm#45610,
    #45094). Every collective of the agreement still matches, so no per-communicator
    comparison can see it.
    """

    replica: int  # the DP replica whose stages diverged
    pipeline: tuple[int, ...]  # its stages' global ranks, first stage first
    step: int  # the agreement's decode step
    op: Op  # the operation that emitted it
    comm: Communicator  # the lane's communicator, one DP group per stage
    lane: str  # the agreement lane: "target" or "drafter"
    rows: tuple[str, ...]  # the table's row names (`AGREEMENT_ROWS`), "row i" if unknown
    columns: tuple[StageColumn, ...]  # each stage that had posted it, by stage
    differing: tuple[str, ...]  # rows whose values differ; empty: the tables differ elsewhere

    def render(self) -> str:
        lines = [
            f"Stage divergence: replica {self.replica} (ranks {_ranks(self.pipeline)}),"
            f" step {self.step}, {self.lane} lane (all_reduce on {self.comm.value},"
            f" {self.op.value})",
        ]
        lines += [
            f"  rank {c.rank} (stage {c.stage}) contributed {c.describe(self.rows)}"
            for c in self.columns
        ]
        if self.differing:
            lines.append(f"  they differ in: {', '.join(self.differing)}")
        else:
            lines.append(
                f"  their tables differ outside column {self.replica}: "
                + "; ".join(f"rank {c.rank} {[list(r) for r in c.table]}" for c in self.columns)
            )
        lines.append(
            "  Each stage decides from its own DP group's table: the stages of replica"
            f" {self.replica} run different CUDA-graph modes or padded token counts, and the"
            " activations passed between them never meet."
        )
        return "\n".join(lines)

    def fix(self) -> str:
        return (
            "decide every value of the column from facts replicated on all stages of a"
            " pipeline (the batch, configuration shared by every stage), never a stage's own"
            " (need_eager, captured graphs, capture sizes); or agree over the pipeline too:"
            " AgreementGroup(..., comm=Communicator.PP_CPU)"
        )


# An agreement's identity within a world: (replica, the lane's communicator, operation).
# Each lane has its own communicator (purepp.dp refuses one shared), so the target's and
# the drafter's agreements are kept apart by it.
_AgreementKey: TypeAlias = tuple[int, Communicator, Op]


class _Agreements:
    """One replica's agreements on one lane: those some stage has not posted yet."""

    __slots__ = ("last", "pending")

    def __init__(self, pp: int) -> None:
        # step -> stage -> its all-reduce, until every stage posted that step's
        self.pending: dict[int, dict[int, AllReduce]] = {}
        self.last = [-1] * pp  # by stage, the last step it posted (-1: none yet)


class StageAgreements:
    """Compares the columns the stages of each replica contribute to per-stage agreements.

    The simulator and the log checker (through `CollectiveHub`) `post` every all-reduce
    as it is issued. A table that differs from another stage's for the same agreement
    (replica, lane's communicator, step, operation) is a divergence; the first one, by
    step and then replica, is returned once no earlier one can still be found: a stage
    may run a few steps behind the others of its pipeline, and a replica's stages may
    post a step after another replica's did. When a run ends or stops, `held` is the
    divergence still waiting for a stage that never posted.

    Only agreements over DP groups are compared: one over PP_CPU spans the stages
    already. Idle stages take part like any other (their column is neutral, and equal
    when the whole replica is idle); a dead stage posts nothing, so nothing of it is
    compared; with pp=1 there is nothing to compare. The drafter's lane runs over its
    own communicator, so it is never compared with the target's.

    Not seen here: a stage-local fact that leaves the column alone (another dispatcher
    whose mode matches but whose padding does not, different dead ranks marked on two
    stages) changes only the decision, which `Decisions` compares; and with dp=1 a stage
    decides alone, with no collective at all.
    """

    def __init__(self, world: Layout) -> None:
        self._world = world
        self._pp = world.pp
        self._where: dict[int, tuple[int, int]] = {}  # rank -> (stage, replica), as met
        self._lanes: dict[_AgreementKey, _Agreements] = {}
        # the first divergence found so far: its agreement, step and report
        self._held: tuple[_AgreementKey, int, StageDivergenceReport] | None = None

    @property
    def held(self) -> StageDivergenceReport | None:
        """The first divergence found, not yet returned by `post` (an earlier agreement
        was still incomplete); the report to give when the run ends or stops."""
        return None if self._held is None else self._held[2]

    def post(self, rank: int, effect: AllReduce) -> StageDivergenceReport | None:
        """Note `rank`'s all-reduce; the first divergence once it is certain, else None."""
        if effect.comm not in _PER_STAGE or self._pp == 1:
            return None
        where = self._where.get(rank)
        if where is None:
            world = self._world
            where = self._where[rank] = (world.pp_stage(rank), world.dp_index(rank))
        stage, replica = where
        key = (replica, effect.comm, effect.op)
        agreements = self._lanes.get(key)
        if agreements is None:
            agreements = self._lanes[key] = _Agreements(self._pp)
        step = effect.step
        agreements.last[stage] = max(agreements.last[stage], step)
        steps = agreements.pending
        posts = steps.get(step)
        if posts is None:
            steps[step] = {stage: effect}
            if len(steps) > _STAGE_WINDOW:
                del steps[next(iter(steps))]
            return None if self._held is None else self._release()
        # Compared with the first other stage that posted it (any: all before agreed).
        reference = next((e for s, e in posts.items() if s != stage), None)
        diverged = reference is not None and not _same_table(reference, effect)
        if diverged:
            posts = steps[step] = {**posts, stage: effect}  # the post that differs, reported
        else:
            posts.setdefault(stage, effect)
        held = self._held
        if held is not None and (held[0], held[1]) == (key, step):
            # another stage of the held agreement: the report shows its column too
            self._held = (key, step, self._report(key, step, posts))
        elif diverged and (held is None or _order(key, step) < _order(held[0], held[1])):
            self._held = (key, step, self._report(key, step, posts))
        if len(posts) == self._pp:
            del steps[step]  # every stage posted it
        return None if self._held is None else self._release()

    def _release(self) -> StageDivergenceReport | None:
        """The held divergence once no agreement ordered before it can still diverge: the
        lower replicas' stages have all posted its step, and no earlier one is incomplete."""
        if self._held is None:
            return None
        key, step, report = self._held
        replica, comm, op = key
        for lower in range(replica):
            agreements = self._lanes.get((lower, comm, op))
            if agreements is None or min(agreements.last) < step:
                return None
        first = _order(key, step)
        for other, held_back in self._lanes.items():
            if any(_order(other, s) < first for s in held_back.pending):
                return None
        self._held = None
        return report

    def _report(
        self, key: _AgreementKey, step: int, posts: Mapping[int, AllReduce]
    ) -> StageDivergenceReport:
        replica, comm, op = key
        pipeline = self._world.pipeline(replica)
        columns = []
        for stage in sorted(posts):
            table = _table(posts[stage])
            column = (
                tuple(row[replica] for row in table)
                if all(replica < len(row) for row in table)
                else ()
            )
            columns.append(
                StageColumn(rank=pipeline[stage], stage=stage, table=table, column=column)
            )
        size = len(columns[0].table)
        rows = AGREEMENT_ROWS.get(size, tuple(f"row {i}" for i in range(size)))
        differing: tuple[str, ...] = ()
        if all(len(c.column) == len(rows) for c in columns):
            differing = tuple(
                name for i, name in enumerate(rows) if len({c.column[i] for c in columns}) > 1
            )
        return StageDivergenceReport(
            replica=replica,
            pipeline=pipeline,
            step=step,
            op=op,
            comm=comm,
            lane=_lane_of(posts[min(posts)].result.name, comm),
            rows=rows,
            columns=tuple(columns),
            differing=differing,
        )


def _same_table(a: AllReduce, b: AllReduce) -> bool:
    x, y = a.contribution, b.contribution
    return x.shape == y.shape and x.tobytes() == y.tobytes()


def _order(key: _AgreementKey, step: int) -> tuple[int, int, int]:
    """Which divergence is reported first: the lowest step, then replica, then lane."""
    replica, comm, _ = key
    return (step, replica, _COMM_ORDER[comm])


def _lane_of(table: str, comm: Communicator) -> str:
    """The lane an agreement runs on: from its table's name (`dp.target.step7.table`, as
    purepp.dp names it), else from the communicator's default lane."""
    parts = table.split(".")
    if len(parts) > 2 and parts[0] == "dp" and parts[1]:
        return parts[1]
    return _LANE_OF_COMM.get(comm, comm.value)


# -- the decisions the ranks noted ---------------------------------------------------------

# Agreements held while some rank of their scope has not noted them. A rank that never
# does (it died) would hold one for ever; no driver lets a rank run this far ahead of
# another, so the oldest is dropped.
_DECISION_WINDOW: Final = 1024

# A decision's values, compared between ranks: everything but step, op, table and comm.
_Decided: TypeAlias = tuple[str, int, bytes, int | None, bool, int, int | None]
_DECIDED_FIELDS: Final = (
    "cg_mode",
    "num_ubatches",
    "num_tokens_across_dp",
    "uniform_token_count",
    "eager",
    "num_reqs",
    "max_query_len",
)


def _decided(note: NoteDecision) -> _Decided:
    return (
        note.cg_mode,
        note.num_ubatches,
        note.num_tokens_across_dp.tobytes(),
        note.uniform_token_count,
        note.eager,
        note.num_reqs,
        note.max_query_len,
    )


@attrs.frozen(kw_only=True)
class RankDecision:
    """One decision some ranks noted for an agreement, and which ranks noted it."""

    ranks: tuple[int, ...]  # global ranks that noted it, ascending
    note: NoteDecision  # the first of their notes (the decision's fields are in each)

    def describe(self) -> str:
        """E.g. `cg_mode=FULL, num_ubatches=1, num_tokens_across_dp=[8, 8], ...`."""
        note = self.note
        return ", ".join(
            f"{name}={note.num_tokens_across_dp.tolist()}"
            if name == "num_tokens_across_dp"
            else f"{name}={getattr(note, name)}"
            for name in _DECIDED_FIELDS
        )


@attrs.frozen(kw_only=True)
class DecisionDivergenceReport:
    """Ranks noted different decisions for one agreement (`NoteDecision`).

    A decision is a function of the reduced table, so the ranks of one all-reduce
    decide alike unless the all-reduce handed them different tables (a faulty backend:
    field failure 17, vllm-ascend#10046; `finish_agreement` refuses a table that is not
    consistent with this rank's own column, but cannot see another rank's column
    corrupted). And the stages of one replica, each agreeing over its own DP group,
    decide alike unless a stage-local fact shapes the decision without entering the
    table (another dispatcher, other dead ranks marked): field failure 7 again, where
    `StageDivergenceReport` sees only the tables. Every collective still matches.
    """

    step: int  # the agreement's decode step
    op: Op  # the operation that noted it
    table: str  # the reduced table's name, the agreement's identity
    comm: Communicator  # the communicator it was reduced over
    lane: str  # the agreement lane: "target" or "drafter" (from the table's name)
    decisions: tuple[RankDecision, ...]  # each decision noted, most ranks first
    differing: tuple[str, ...]  # the fields the decisions differ in
    # two ranks of one communicator instance noted different decisions: they were handed
    # different sums, or decide with different dispatchers or dead ranks (else only
    # separate groups, the stages of a replica, differ)
    within_group: bool

    def render(self) -> str:
        lines = [
            f"Decision divergence: step {self.step}, {self.lane} lane (table"
            f" {self.table!r} reduced over {self.comm.value}, {self.op.value})",
        ]
        for decision in self.decisions:
            who = "rank" if len(decision.ranks) == 1 else "ranks"
            lines.append(f"  {who} {_ranks(decision.ranks)} decided {decision.describe()}")
        lines.append(f"  they differ in: {', '.join(self.differing)}")
        if self.within_group:
            lines.append(
                "  Ranks that reduced one table decided differently: the all-reduce gave"
                " them different sums, or they decide with different dispatchers or dead"
                " ranks. They run different shapes, and their next collectives do not meet."
            )
        else:
            lines.append(
                "  Each group decided alike, but the stages of a replica decided"
                " differently from their own DP groups' tables: the activations passed"
                " between them never meet."
            )
        return "\n".join(lines)

    def fix(self) -> str:
        if self.within_group:
            return (
                "compare the ranks' AllReduce contributions in the logs with their sum:"
                " when the ranks were handed different sums, the backend's all-reduce is"
                " faulty on this platform (run the agreement's CPU group over one that sums"
                " correctly); else give every rank of the group the same dispatcher and"
                " the same dead ranks"
            )
        return (
            "decide from what every stage shares: give every stage the same dispatcher"
            " (capture sizes, cudagraph mode) and mark the same dead ranks on every stage"
        )


# An agreement's identity: its step, its reduced table's name, and the ranks that must
# decide it alike (ordered by step first: the earliest divergence is reported first).
_DecisionKey: TypeAlias = tuple[int, str, tuple[int, ...]]
# An agreement's notes so far: decision -> the ranks that noted it, and the first note.
_Noted: TypeAlias = dict[_Decided, tuple[list[int], NoteDecision]]


class Decisions:
    """Compares the decisions the ranks note for each agreement (`NoteDecision`).

    The simulator and the log checker (through `CollectiveHub`) `note` every
    `NoteDecision` as it is issued. An agreement is identified by its step and its
    reduced table's name. Who must decide alike: the ranks of one communicator instance
    (they reduced one table), and for an agreement over a DP lane every rank of the
    world (each stage's DP group reduces a table of its own, and the stages of a replica
    are given one batch): the agreement's scope.

    What is reported does not depend on the order the ranks are read in. A divergence
    within a group is `ready` once every rank of its scope has noted it and no agreement
    of an earlier step is still incomplete; `held` gives what is left when a run ends
    or stops. Stages that decided apart from equal-looking groups are `held` only (the
    first, by step): when their columns differed, the stages' divergence
    (`StageAgreements`) is the cause.
    """

    def __init__(self, world: Layout) -> None:
        self._world = world
        self._notes: dict[_DecisionKey, _Noted] = {}  # until every rank of the scope noted
        # For each incomplete agreement noted with two decisions: each group's decisions.
        self._groups: dict[_DecisionKey, dict[tuple[int, ...], set[_Decided]]] = {}
        self._within: dict[_DecisionKey, _Noted] = {}  # two decisions within one group
        self._stages: tuple[_DecisionKey, _Noted] | None = None  # the first of stages only
        self._group_of: dict[tuple[int, Communicator], tuple[int, ...]] = {}
        self._world_scope = tuple(range(world.world_size))  # a DP lane's agreement's
        self.alike = 0  # agreements every rank of their scope noted, all alike

    def note(self, rank: int, note: NoteDecision) -> None:
        """Note `rank`'s decision for its agreement."""
        comm = note.comm
        scope = self._world_scope if comm in _PER_STAGE else self._group(rank, comm)
        key = (note.step, note.table, scope)  # a BufferRef keys as its name
        decided = _decided(note)
        seen = self._notes.get(key)
        if seen is None:
            seen = self._notes[key] = {decided: ([rank], note)}
            if len(self._notes) > _DECISION_WINDOW:
                del self._notes[next(iter(self._notes))]
        else:
            # A rank that notes one agreement twice counts once: its second note must not
            # stand in for a rank yet to note (and if it differs, the rank diverged).
            again = any(rank in ranks for ranks, _ in seen.values())
            same = seen.get(decided)
            if same is None:
                seen[decided] = ([rank], note)
            elif not again:
                same[0].append(rank)
            if len(seen) > 1:
                self._diverged(key, seen, rank, decided, comm)
        noted = (
            len(next(iter(seen.values()))[0])
            if len(seen) == 1
            else len({r for ranks, _ in seen.values() for r in ranks})
        )
        if noted == len(scope):
            del self._notes[key]  # complete
            self._groups.pop(key, None)
            self.alike += len(seen) == 1

    def _diverged(
        self, key: _DecisionKey, seen: _Noted, rank: int, decided: _Decided, comm: Communicator
    ) -> None:
        """Keep `key`, noted with two decisions, as a divergence within a group or the first
        of stages only; only the groups of its ranks are kept up to date, not a report."""
        groups = self._groups.get(key)
        if groups is None:  # it just diverged: every note so far
            groups = self._groups[key] = {}
            for value, (ranks, _) in seen.items():
                for r in ranks:
                    groups.setdefault(self._group(r, comm), set()).add(value)
        else:
            groups.setdefault(self._group(rank, comm), set()).add(decided)
        if key in self._within:
            return
        if any(len(values) > 1 for values in groups.values()):
            self._within[key] = seen
        elif self._stages is None or key <= self._stages[0]:
            self._stages = (key, seen)

    def _group(self, rank: int, comm: Communicator) -> tuple[int, ...]:
        group = self._group_of.get((rank, comm))
        if group is None:
            group = self._group_of[rank, comm] = comm_group(self._world, rank, comm)
        return group

    def ready(self) -> DecisionDivergenceReport | None:
        """The first divergence within a group that no rank is left to note, once no
        agreement of an earlier step can still diverge; None until then."""
        if not self._within:
            return None
        complete = [key for key in self._within if key not in self._notes]
        if not complete:
            return None
        first = min(complete)
        if any(key[0] < first[0] for key in self._notes):
            return None
        return self._report(self._within.pop(first))

    def held(self) -> tuple[DecisionDivergenceReport | None, DecisionDivergenceReport | None]:
        """What a run that ends or stops leaves: the first divergence within a group, and
        the first of stages only, by step (either None)."""
        within = self._report(self._within[min(self._within)]) if self._within else None
        stages = None if self._stages is None else self._report(self._stages[1])
        if stages is not None and stages.within_group:  # became one since (held in `within`)
            stages = None
        return within, stages

    def _report(self, seen: _Noted) -> DecisionDivergenceReport:
        decisions = sorted(
            (RankDecision(ranks=tuple(sorted(r)), note=first) for r, first in seen.values()),
            key=lambda d: (-len(d.ranks), d.ranks),
        )
        note = decisions[0].note
        values = list(seen)
        differing = tuple(
            name
            for i, name in enumerate(_DECIDED_FIELDS)
            if len({value[i] for value in values}) > 1
        )
        # Within a group: some group's ranks took two decisions.
        groups: dict[tuple[int, ...], set[int]] = {}
        for index, decision in enumerate(decisions):
            for rank in decision.ranks:
                groups.setdefault(self._group(rank, note.comm), set()).add(index)
        return DecisionDivergenceReport(
            step=note.step,
            op=note.op,
            table=str(note.table),
            comm=note.comm,
            lane=_lane_of(note.table, note.comm),
            decisions=tuple(decisions),
            differing=differing,
            within_group=any(len(indices) > 1 for indices in groups.values()),
        )


Report: TypeAlias = (
    MismatchReport
    | DeadlockReport
    | RingOverrunReport
    | StageDivergenceReport
    | DecisionDivergenceReport
)


class CollectiveReportError(CollectiveMismatchError):
    """A `CollectiveMismatchError` that carries the structured report behind its message."""

    def __init__(self, call: str, problem: str, fix: str, *, report: Report) -> None:
        super().__init__(call, problem, fix)
        self.report = report

    @classmethod
    def from_report(cls, call: str, report: Report) -> CollectiveReportError:
        # PureppError adds ". Fix: ..." after the problem.
        return cls(call, report.render().rstrip("."), report.fix(), report=report)


def check_posts(
    instance: CommInstance, seq: int, posts: Mapping[int, CollectiveSignature]
) -> MismatchReport | None:
    """The first disagreement among the members' op `seq`, given those posted so far.

    The reference is the broadcast's sender when it has posted (a receiver
    "expected" its own declaration and "received" the sender's), else the
    lowest-ranked member that posted. Members are compared in ascending order.
    """
    if len(posts) == 1:
        # The first post of an op (the common case): only its source can be wrong.
        ((rank, signature),) = posts.items()
        if rank in instance.group and (signature.src is None or signature.src in instance.group):
            return None
    members = [r for r in instance.group if r in posts]
    for rank in members:
        signature = posts[rank]
        if signature.src is not None and signature.src not in instance.group:
            return MismatchReport(
                rank=rank,
                instance=instance,
                seq=seq,
                expected=signature,
                peer=None,
                received=None,
                differing=(MismatchField.SRC,),
                missing=(),
                culprit=rank,  # its source is in no member's group: no side to count
            )
    senders = [r for r in members if posts[r].src == r]
    reference = senders[0] if senders else members[0] if members else None
    if reference is None:
        return None
    for rank in members:
        if rank == reference:
            continue
        differing = _differing(posts[rank], posts[reference])
        if differing:
            return MismatchReport(
                rank=rank,
                instance=instance,
                seq=seq,
                expected=posts[rank],
                peer=reference,
                received=posts[reference],
                differing=differing,
                missing=(),
                culprit=_odd_one_out(posts, rank, reference),
            )
    return None


def _odd_one_out(posts: Mapping[int, CollectiveSignature], rank: int, reference: int) -> int | None:
    """Of two disagreeing members, the one fewer members side with (fr_trace's culprit);
    None when as many side with each, as two ranks always do."""
    with_rank = sum(not _differing(post, posts[rank]) for post in posts.values())
    with_reference = sum(not _differing(post, posts[reference]) for post in posts.values())
    if with_rank == with_reference:
        return None
    return reference if with_rank > with_reference else rank


def _first_problem(
    instance: CommInstance, sequences: Mapping[int, Sequence[CollectiveSignature]]
) -> MismatchReport | None:
    longest = max((len(sequences.get(r, ())) for r in instance.group), default=0)
    for seq in range(longest):
        posts = {r: sequences[r][seq] for r in instance.group if seq < len(sequences.get(r, ()))}
        report = check_posts(instance, seq, posts)
        if report is not None:
            return report
        missing = tuple(r for r in instance.group if r not in posts)
        if missing:
            waiting = min(posts)
            return MismatchReport(
                rank=waiting,
                instance=instance,
                seq=seq,
                expected=posts[waiting],
                peer=None,
                received=None,
                differing=(),
                missing=missing,
                culprit=missing[0],
            )
    return None


_COMM_ORDER = {comm: i for i, comm in enumerate(Communicator)}


def match_collectives(
    per_rank: Mapping[int, Sequence[Effect]], world: Layout
) -> MismatchReport | None:
    """Match every rank's collectives per communicator instance, in issue order.

    `per_rank` maps every global rank of `world` to the effects it issued, in
    order (non-collective effects are ignored). None when every collective
    matches; otherwise the report of the earliest problem (lowest step, then
    communicator, then group): a disagreement on kind, source, step, shape or
    dtype, or a collective some member never posted.
    """
    call = "match_collectives"
    if not isinstance(world, Layout):
        raise ConfigError(call, f"world is {a_type(world)}", "pass a Layout(pp=..., dp=...)")
    check_instance(call, "per_rank", per_rank, Mapping, fix="pass a dict of rank -> effects")
    ranks = range(world.world_size)
    for rank, effects in per_rank.items():
        if not isinstance(effects, Sequence):
            raise InvalidInputError(
                call,
                f"rank {rank!r}'s effects are {a_type(effects)}",
                "pass each rank's effects as a sequence (a list or a tuple)",
            )
    if set(per_rank) != set(ranks):
        raise InvalidInputError(
            call,
            f"got effects for ranks {sorted(per_rank)} in a world of pp={world.pp}, dp={world.dp}",
            f"pass one effect sequence for every rank 0..{world.world_size - 1}",
        )
    sequences: dict[CommInstance, dict[int, list[CollectiveSignature]]] = {}
    for rank in ranks:
        for effect in per_rank[rank]:
            if isinstance(effect, Broadcast | AllReduce):
                instance = comm_instance(world, rank, effect.comm)
                sequences.setdefault(instance, {}).setdefault(rank, []).append(signature_of(effect))
    problems = [
        report
        for instance, by_rank in sequences.items()
        if (report := _first_problem(instance, by_rank)) is not None
    ]
    if not problems:
        return None
    return min(problems, key=mismatch_order)


def mismatch_order(report: MismatchReport) -> tuple[int, int, tuple[int, ...], int]:
    """Which mismatch is reported first: the lowest step, then communicator, group, op."""
    return (report.step, _COMM_ORDER[report.comm], report.group, report.seq)
