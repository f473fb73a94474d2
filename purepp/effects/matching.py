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

Communicator instances in a PP x DP world (`purepp.layout.Layout`: global
rank = dp_index * pp + pp_stage): PP_RELAY and PP_CPU groups are the stages of
one DP replica; DP_CPU and DP_DRAFTER_CPU groups (two lanes over the same ranks)
are the same stage across replicas.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import TypeAlias, assert_never

import attrs

from purepp.effects.vocabulary import (
    AllReduce,
    Broadcast,
    Communicator,
    DType,
    Effect,
    EventRef,
    Op,
    Stream,
)
from purepp.errors import CollectiveMismatchError, InvalidInputError
from purepp.layout import Layout

__all__ = [
    "AwaitedCollective",
    "CollectiveKind",
    "CollectiveReportError",
    "CollectiveSignature",
    "CommInstance",
    "DeadlockReport",
    "MismatchClass",
    "MismatchField",
    "MismatchReport",
    "Report",
    "RingOverrunReport",
    "WaitCycle",
    "WaitEdge",
    "Waiter",
    "check_posts",
    "comm_group",
    "comm_instance",
    "find_wait_cycle",
    "match_collectives",
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
    stream: Stream | None  # the stuck stream (MAIN: the host waits with it); None: between steps
    step: int  # step of the effect it waits at, or of the step it may not start
    op: Op | None  # operation that emitted that effect; None between steps
    waiting_at: str  # the effect it waits at, in words
    awaited: AwaitedCollective | None  # the collective the wait comes down to, if any
    held_back_by: tuple[int, ...] = ()  # slower ranks it may not run ahead of (steps in flight)

    def describe(self) -> str:
        if self.stream is None:
            where = "between steps"
        elif self.stream is Stream.MAIN:
            where = "host and main stream"
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
        steps = ", ".join(
            f"rank {r}: {'finished' if n is None else n}" for r, n in enumerate(self.at_steps)
        )
        lines.append(f"  at step: {steps}")
        return "\n".join(lines)

    def fix(self) -> str:
        if self.cycle is not None and len(self.cycle.communicators) > 1:
            return (
                "issue collectives on every communicator in one order on every rank"
                " (NCCL asks for one issue order across communicators)"
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


Report: TypeAlias = MismatchReport | DeadlockReport | RingOverrunReport


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
    ranks = range(world.world_size)
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
    return min(problems, key=lambda p: (p.step, _COMM_ORDER[p.comm], p.group, p.seq))
