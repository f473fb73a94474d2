"""The matching scheduler: every communicator of a world, and each rank's streams without data.

`CollectiveHub` is what the simulator and the log checker share. Ranks post their
collectives to it in issue order; it compares each op's posts as they arrive
(`check_posts`), completes an op once every member has posted it and it has reached
the head of its stream on every member (on gloo, a broadcast's members one by one, as
gloo's tree lets each go: `BroadcastTree`), and can say, for a stuck op, which members
it waits for. That last answer is the wait-for graph (rank -> communicator -> rank)
in which a cross-communicator order deadlock shows up as a cycle. It also hands each
all-reduce to `StageAgreements`, which reports the stages of one replica contributing
different columns to their per-stage agreements (field failure 7), and each noted
decision (`NoteDecision`) to `Decisions`, which reports ranks that decided one agreement
differently (field failures 17 and 7).

`StreamLanes` is one rank's streams with the interpreter's ordering rules and no
data: collectives wait for the hub, stream and event waits for the counts of the
streams they wait on; every other effect runs at once at its stream's head, so it
changes no wait's outcome and is not queued (the checker does not even build it). The checker
replays logs recorded on hardware through it, where the caller's tensors that a
step reads are not in the log, so data could not move anyway.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Final, TypeAlias, assert_never

import attrs
import numpy as np

from purepp.effects._converter import EFFECT_KINDS
from purepp.effects.matching import (
    AwaitedCollective,
    CollectiveKind,
    CollectiveReportError,
    CollectiveSignature,
    CommInstance,
    Decisions,
    MismatchReport,
    StageAgreements,
    WaitEdge,
    check_posts,
    comm_instance,
    mismatch_order,
    signature_of,
)
from purepp.effects.numpy_interpreter import PostedCollective, describe_effect
from purepp.effects.vocabulary import (
    Alias,
    Allocate,
    AllReduce,
    Backend,
    Broadcast,
    CheckHeader,
    Communicator,
    CopyHostToDevice,
    DType,
    Effect,
    EventRef,
    ForgetEvent,
    GatherRows,
    NoteDecision,
    Op,
    Pack,
    PadColumns,
    RecordEvent,
    RecordStream,
    Release,
    ScatterRows,
    StackRows,
    Stream,
    Synchronize,
    Unpack,
    WaitEvent,
    WaitStream,
    WaitWork,
    WorkRef,
    check_backend,
)
from purepp.layout import Layout

__all__ = [
    "LOCAL_KINDS",
    "BroadcastTree",
    "CollectiveHub",
    "StreamLanes",
    "broadcast_tree",
    "started_ahead",
    "waiting_at",
]


def started_ahead(effect: Effect | None, order_step: int | None) -> bool:
    """Whether `effect` is a later step's agreement started within step `order_step` (the
    step of the rank's last effect that was not one): an asynchronous all-reduce, which
    neither starts its step nor waits for anything, so it is never held back."""
    return (
        type(effect) is AllReduce
        and effect.work is not None
        and order_step is not None
        and effect.step > order_step
    )


def waiting_at(effect: Effect, backend: Backend) -> str:
    """A stuck effect in words for a deadlock report, saying why a gloo broadcast holds
    its host (an NCCL one would only hold its stream)."""
    text = describe_effect(effect)
    if backend == "gloo" and type(effect) is Broadcast:
        return (
            f"{text}, which blocks the host on gloo until the data has come down gloo's "
            "tree to it and every member it sends to has joined"
        )
    return text


@attrs.frozen(kw_only=True)
class BroadcastTree:
    """Who sends to whom in gloo's broadcast (gloo/broadcast.cc), which torch's CPU
    broadcast runs: a binomial tree over the members renumbered from the source (the
    source is 0, the members after it in group order 1, 2, ..., wrapping round).
    Renumbered member v > 0 receives from v less its highest set bit, then sends to
    v + 2**k for every 2**k > v inside the group, and waits for those sends; the source
    sends to every power of two inside the group. A send completes once its receiver
    has joined (gloo sends only into a posted receive), and a member can forward only
    what it has received, so a member is let go once every member above it in the tree
    and every member it sends to have joined. Over two or three members the source
    sends to all the others; from four on, some receivers forward."""

    order: tuple[int, ...]  # the members, renumbered order: each after the one it receives from
    parent: Mapping[int, int]  # member -> the member it receives from (the source: none)
    children: Mapping[int, tuple[int, ...]]  # member -> the members it sends to

    def above(self, member: int) -> tuple[int, ...]:
        """The members the data passes through on its way to `member`, source first."""
        chain: list[int] = []
        parent = self.parent.get(member)
        while parent is not None:
            chain.append(parent)
            parent = self.parent.get(parent)
        return tuple(reversed(chain))


@functools.cache
def broadcast_tree(group: tuple[int, ...], src: int) -> BroadcastTree:
    """gloo's broadcast tree over `group` (global ranks, ascending: the order of the
    gloo group's own ranks) from global rank `src`, a member."""
    size, root = len(group), group.index(src)
    order = tuple(group[(root + v) % size] for v in range(size))
    parent: dict[int, int] = {}
    children: dict[int, tuple[int, ...]] = {}
    for v, member in enumerate(order):
        if v:
            parent[member] = order[v - (1 << (v.bit_length() - 1))]
        # v sends along every bit above its highest set one (the source: every bit).
        bit = 1 << v.bit_length()
        sends: list[int] = []
        while v + bit < size:
            sends.append(order[v + bit])
            bit <<= 1
        children[member] = tuple(sends)
    return BroadcastTree(order=order, parent=parent, children=children)


class _Instance:
    """One communicator instance: who posted which op, and how far it has completed."""

    def __init__(self, instance: CommInstance) -> None:
        self.instance = instance
        self.next_seq: dict[int, int] = dict.fromkeys(instance.group, 0)  # per member
        self.posts: dict[int, dict[int, PostedCollective]] = {}  # seq -> member -> post
        # seq -> member -> its signature's fields as tuples (see `_signature_key`)
        self.keys: dict[int, dict[int, _SignatureKey]] = {}
        self.completed = 0  # ops completed by every member, in order
        # Per member, the ops it is done with (ahead of `completed` only on gloo, where a
        # broadcast lets its members go one by one), and per such broadcast the members
        # that hold its data already.
        self.released: dict[int, int] = dict.fromkeys(instance.group, 0)
        self.received: dict[int, set[int]] = {}

    def reached(self, seq: int, member: int) -> bool:
        """Whether `member` has joined op `seq` (done with every op before it, and its post
        at the head of its stream) or is done with it too."""
        released = self.released[member]
        if released != seq:
            return released > seq
        post = self.posts[seq].get(member)
        return post is not None and post.at_head

    def signatures(self, seq: int) -> dict[int, CollectiveSignature]:
        """Op `seq`'s declared signatures, member -> signature, in posting order."""
        posts = self.posts[seq]
        return {rank: signature_of(posts[rank].effect) for rank in self.keys[seq]}

    def awaited(self, seq: int) -> AwaitedCollective:
        posts = self.posts[seq]
        first = posts[min(posts)]
        return AwaitedCollective(
            instance=self.instance,
            seq=seq,
            signature=signature_of(first.effect),
            missing=tuple(r for r in self.instance.group if r not in posts),
        )


class CollectiveHub:
    """Every communicator of the world: matches posts, completes ops, moves data if asked.

    Posts that disagree raise `CollectiveReportError` naming `call`, and so does an
    all-reduce whose table differs from another stage's of its replica for the same
    agreement (`StageAgreements`; pp > 1 only), and a noted decision that differs from
    another rank's for the same agreement (`Decisions`, through `note`). With
    `compare_steps=False` the step labels are ignored when comparing (as on the wire)
    and the report shows them as labelled. With `backend='gloo'` a broadcast lets each
    member go as gloo's tree does (`BroadcastTree`), not once every member has joined.
    `completed_ranks` collects the ranks whose posts completed since `run_completed`
    last ran them.
    """

    def __init__(
        self,
        world: Layout,
        *,
        call: str,
        compare_steps: bool = True,
        move_data: bool = True,
        backend: Backend = "nccl",
    ) -> None:
        self._world = world
        self._call = call
        self._compare_steps = compare_steps
        self._move_data = move_data
        # gloo lets a broadcast's members go one by one, down its tree; NCCL's broadcasts
        # (queued on streams) and every all-reduce complete for all members at once.
        self._tree_broadcasts = check_backend(call, "backend", backend) == "gloo"
        self._instances: dict[CommInstance, _Instance] = {}
        self._by_member: dict[tuple[int, Communicator], _Instance] = {}
        self._where: dict[PostedCollective, tuple[_Instance, int]] = {}
        self.completed_ranks: set[int] = set()
        # Whether every op's posts so far passed `check_posts` (with `compare_steps`),
        # each from a member of its group: cleared for good otherwise.
        self._agreed = True
        # With one stage per replica there are no stages to compare.
        self._stages = StageAgreements(world) if world.pp > 1 else None
        self._decisions = Decisions(world)
        # Ops seen to disagree while some member had not posted them, and their reports.
        self._mismatches: dict[tuple[_Instance, int], MismatchReport] = {}

    def post(self, posted: PostedCollective, /) -> None:
        """Match `posted` with its peers' posts of the same op, then compare an agreement's
        table with the other stages' of its replica."""
        self._match(posted)
        stages, effect = self._stages, posted.effect
        if stages is not None and type(effect) is AllReduce:
            divergence = stages.post(posted.rank, effect)
            if divergence is not None:
                raise CollectiveReportError.from_report(self._call, divergence)

    @property
    def decided_alike(self) -> int:
        """Agreements every rank that must has noted, every note alike."""
        return self._decisions.alike

    def note(self, rank: int, note: NoteDecision, /) -> None:
        """Compare `rank`'s noted decision with the other ranks' notes of its agreement:
        ranks of one group that decided apart are raised once `Decisions` has the whole
        agreement (`Decisions.ready`); stages that did are raised by `raise_held`."""
        decisions = self._decisions
        decisions.note(rank, note)
        divergence = decisions.ready()
        if divergence is not None:
            raise CollectiveReportError.from_report(self._call, divergence)

    def run_completed(self, advancers: Sequence[Callable[[], object]]) -> None:
        """Call `advancers[rank]()` for every rank whose posts completed since the last
        call, until advancing completes no more: after an issue, only those ranks' queues
        can move (the issuing rank ran what it could when it issued)."""
        completed = self.completed_ranks
        while completed:
            touched = sorted(completed)
            completed.clear()
            for rank in touched:
                advancers[rank]()

    def raise_held(self) -> None:
        """Raise a group's decisions that differed, held for a rank that never noted
        them, else the stages' divergence held back for an agreement some stage never
        posted (`StageAgreements.held`), else the stages' decisions that differed
        (`note`): call it when the run ends or cannot go on."""
        if self._mismatches:  # the first, as `match_collectives` orders problems
            report = min(self._mismatches.values(), key=mismatch_order)
            raise CollectiveReportError.from_report(self._call, report)
        within, stages = self._decisions.held()
        if within is not None:  # a cause of its own
            raise CollectiveReportError.from_report(self._call, within)
        held = None if self._stages is None else self._stages.held
        if held is not None:
            raise CollectiveReportError.from_report(self._call, held)
        if stages is not None:
            raise CollectiveReportError.from_report(self._call, stages)

    def _match(self, posted: PostedCollective) -> None:
        rank, effect = posted.rank, posted.effect
        state = self._by_member.get((rank, effect.comm))
        if state is None:
            key = comm_instance(self._world, rank, effect.comm)
            state = self._instances.get(key)
            if state is None:
                state = self._instances[key] = _Instance(key)
            self._by_member[rank, effect.comm] = state
            if rank not in key.group:
                self._agreed = False  # `check_posts` skips such a post: prove nothing
        next_seq = state.next_seq
        seq = next_seq[rank]
        next_seq[rank] = seq + 1
        posts = state.posts.get(seq)
        if posts is None:
            posts = state.posts[seq] = {}
            keys = state.keys[seq] = {}
        else:
            keys = state.keys[seq]
        posts[rank] = posted
        self._where[posted] = (state, seq)
        # The signature as plain tuples (see `_signature_key`), cheaper to build and
        # compare; the signatures themselves are built only when `check_posts` runs.
        signature = keys[rank] = _signature_key(effect)
        if self._mismatches and (state, seq) in self._mismatches:
            self._hold_or_raise(state, seq)  # an op already seen to disagree
            return
        if self._compare_steps:
            if len(keys) > 1:
                first = keys[next(iter(keys))]
                if signature == first:
                    return  # equal to a post already checked: nothing new can disagree
                if self._agreed and signature[0] == first[0]:
                    # Every op so far passed `check_posts`, from members of its group,
                    # so this op's posts agree on the compared fields and name a source
                    # in the group; so does this one (a sender's differs in `op` only).
                    return
            else:
                # The first post of an op (the common case): only its source can be wrong
                # (`check_posts`' own test for one post, without building the signature).
                group = state.instance.group
                src = signature[0][2]
                if rank in group and (src is None or src in group):
                    return
            agreed, self._agreed = self._agreed, False  # until the check comes back clean
            report = self._check(state, seq)
            if report is None:
                self._agreed = agreed
        else:
            report = self._check(state, seq)
        if report is not None:
            self._hold_or_raise(state, seq, report)

    def _check(self, state: _Instance, seq: int) -> MismatchReport | None:
        """`check_posts` over op `seq`'s posts so far (as the wire does without steps)."""
        signatures = state.signatures(seq)
        if self._compare_steps:
            return check_posts(state.instance, seq, signatures)
        # Compare as the wire does, then report the posts as they were labelled.
        unlabelled = {rank: attrs.evolve(sig, step=0) for rank, sig in signatures.items()}
        report = check_posts(state.instance, seq, unlabelled)
        if report is not None:
            peer = report.peer
            report = attrs.evolve(
                report,
                expected=signatures[report.rank],
                received=None if peer is None else signatures[peer],
            )
        return report

    def _hold_or_raise(
        self, state: _Instance, seq: int, report: MismatchReport | None = None
    ) -> None:
        """Raise op `seq`'s mismatch once every member has posted it, so that its culprit
        is counted over them all, whatever order they posted in; until then hold it (the
        op never completes: a member that never posts leaves it to `raise_held`)."""
        report = self._check(state, seq) if report is None else report
        if report is None:  # unreachable: posts that disagreed still disagree
            return
        posts = state.posts[seq]
        if all(member in posts for member in state.instance.group):
            self._mismatches.pop((state, seq), None)
            raise CollectiveReportError.from_report(self._call, report)
        self._mismatches[state, seq] = report

    def reach_head(self, posted: PostedCollective, /) -> None:
        state, _ = self._where[posted]
        self._complete_ready(state)

    def awaited(self, posted: PostedCollective) -> AwaitedCollective:
        state, seq = self._where[posted]
        return state.awaited(seq)

    def holds(self, awaited: AwaitedCollective, member: int) -> bool:
        """Whether `member` has posted op `awaited` and is not yet let go from it (on gloo,
        a broadcast lets some members go before others have joined)."""
        state = self._instances[awaited.instance]
        return state.released[member] == awaited.seq and member in state.posts[awaited.seq]

    def waits_for(self, posted: PostedCollective) -> tuple[WaitEdge, ...]:
        """Who `posted` (incomplete) waits for: members that have not posted its op, or
        whose post has not reached the head of its stream (of a gloo broadcast, only
        those above it in the tree and those it sends to)."""
        state, seq = self._where[posted]
        rank, effect = posted.rank, posted.effect
        # A broadcast held for a mismatch (its source may be no member) has no tree.
        if (
            self._tree_broadcasts
            and isinstance(effect, Broadcast)
            and (state, seq) not in self._mismatches
        ):
            tree = broadcast_tree(state.instance.group, effect.src)
            members: Sequence[int] = (*tree.above(rank), *tree.children[rank])
            waited = [member for member in members if not state.reached(seq, member)]
        else:
            posts = state.posts[seq]
            waited = [
                member
                for member in state.instance.group
                if member != rank and (member not in posts or not posts[member].at_head)
            ]
        return tuple(
            WaitEdge(rank=rank, via=state.instance, seq=seq, peer=member) for member in waited
        )

    def incomplete(self) -> tuple[AwaitedCollective, ...]:
        """The oldest incomplete op of every instance that has one."""
        return tuple(
            state.awaited(state.completed)
            for state in self._instances.values()
            if state.completed in state.posts
        )

    def _complete_ready(self, state: _Instance) -> None:
        """Complete what can complete, oldest op first: an op once every member has joined
        it, or on gloo a broadcast's members one by one (`_release_down_tree`), so that a
        member let go may already have joined the next op."""
        group = state.instance.group
        size = len(group)
        all_posts, where, released = state.posts, self._where, state.released
        seq = state.completed
        while True:
            posts = all_posts.get(seq)
            if posts is None:
                return
            effect = posts[next(iter(posts))].effect
            if self._tree_broadcasts and type(effect) is Broadcast:
                if (state, seq) in self._mismatches:
                    return  # held until every member has posted it, then raised
                self._release_down_tree(state, seq, posts, effect.src)
                if any(released[member] <= seq for member in group):
                    if all(released[member] <= seq for member in group):
                        return
                    seq += 1  # those let go may have joined the next op
                    continue
                del state.received[seq]
            else:
                # Every member's earlier ops are done once `completed` reaches this one.
                if seq != state.completed or len(posts) < size:
                    return
                for p in posts.values():
                    if not p.at_head:
                        return
                if self._move_data:
                    _move_data(posts)
                for p in posts.values():
                    p.complete()
                    del where[p]
                self.completed_ranks.update(posts)
                for member in posts:
                    released[member] = seq + 1
            # Every member is done with op `seq` (so with every op before it).
            del all_posts[seq]
            del state.keys[seq]
            state.completed = seq = seq + 1

    def _release_down_tree(
        self, state: _Instance, seq: int, posts: dict[int, PostedCollective], src: int
    ) -> None:
        """Let go the members of gloo broadcast `seq` that gloo would: a member holds the
        data once it and every member above it have joined (it is copied from the member
        it receives from, which holds it by then), and is let go once it holds it and
        every member it sends to has joined."""
        tree = broadcast_tree(state.instance.group, src)
        received = state.received.setdefault(seq, set())
        # Parents come before their children: data moves down the tree within one pass,
        # and every receive is done before a sender that is let go writes its buffer again.
        for member in tree.order:
            if member in received or not state.reached(seq, member):
                continue
            parent = tree.parent.get(member)
            if parent is None:
                received.add(member)
            elif parent in received:
                if self._move_data:
                    posts[member].array[...] = posts[parent].array
                received.add(member)
        released, where = state.released, self._where
        for member in tree.order:
            if (
                released[member] == seq
                and member in received
                and all(state.reached(seq, child) for child in tree.children[member])
            ):
                post = posts[member]
                post.complete()
                del where[post]
                released[member] = seq + 1
                self.completed_ranks.add(member)


# The fields `check_posts` compares (step, shape, src, kind, dtype), then the rest of a
# signature (comm, op): the whole is equal exactly when two signatures are.
_Compared: TypeAlias = tuple[int, tuple[int, ...], int | None, CollectiveKind, DType]
_SignatureKey: TypeAlias = tuple[_Compared, Communicator, Op]


def _signature_key(effect: Broadcast | AllReduce) -> _SignatureKey:
    """`signature_of(effect)`'s fields as tuples: the compared ones, then the others."""
    compared: _Compared
    if isinstance(effect, Broadcast):
        compared = (effect.step, effect.shape, effect.src, CollectiveKind.BROADCAST, effect.dtype)
    elif isinstance(effect, AllReduce):
        # A numpy array's shape is already a tuple of Python ints.
        shape = effect.contribution.shape
        compared = (effect.step, shape, None, CollectiveKind.ALL_REDUCE, DType.INT32)
    else:
        assert_never(effect)
    return (compared, effect.comm, effect.op)


def _move_data(posts: dict[int, PostedCollective]) -> None:
    effect = next(iter(posts.values())).effect
    match effect:
        case Broadcast():
            source = posts[effect.src].array
            for rank, p in posts.items():
                if rank != effect.src:
                    p.array[...] = source
        case AllReduce():
            # int32 sum with wrap-around, as torch and gloo reduce an int32 table.
            total = np.sum(np.stack([p.array for p in posts.values()]), axis=0, dtype=np.int32)
            for p in posts.values():
                p.array[...] = total


# -- one rank's streams, without data ---------------------------------------------

_LOCAL: Final = (
    Allocate,
    CopyHostToDevice,
    CheckHeader,
    PadColumns,
    StackRows,
    GatherRows,
    ScatterRows,
    Pack,
    Unpack,
    RecordStream,
    Release,
    Alias,
)
# The kinds of effects that never wait. A replay may leave them out: a stream's wait is
# met once every waiting item queued before it has run, and these run at once at the
# head, so no wait's outcome changes (the checker skips building them).
LOCAL_KINDS: Final = frozenset(kind for kind, cls in EFFECT_KINDS.items() if cls in _LOCAL)

_NO_DATA: Final = np.empty(0, dtype=np.int64)  # the array a data-free post carries


@attrs.define(eq=False)
class _Collective:
    """A collective on a stream (or the host): done when the hub completes it."""

    effect: Effect
    posted: PostedCollective


@attrs.define(eq=False)
class _Wait:
    """A wait on a stream (or the host): done when stream `on` has run `target` effects."""

    effect: Effect
    on: Stream
    target: int


@attrs.define(eq=False)
class _HostWaitsWork:
    """The host waits for an asynchronous all-reduce."""

    effect: Effect
    posted: PostedCollective


_Queued: TypeAlias = _Collective | _Wait | _HostWaitsWork


class StreamLanes:
    """One rank's streams as the interpreters order them, with no data.

    The host is a lane of its own, as in the numpy interpreter: it is blocked while
    it waits for a CPU all-reduce, a `WaitWork`, a `Synchronize`, or with
    `backend='gloo'` a broadcast (as gloo's does); a main-stream wait holds only the
    main stream, as on CUDA. `issue` never raises for a wait on an unknown event or
    work (a log from hardware is evidence, not input to validate); such a wait is
    done at once.
    """

    def __init__(self, rank: int, hub: CollectiveHub, *, backend: Backend = "nccl") -> None:
        self.rank = rank
        self._hub = hub
        # Where a broadcast is queued: the host's lane on gloo, else its own stream.
        self._host_broadcasts = check_backend("StreamLanes", "backend", backend) == "gloo"
        self._queues: dict[Stream, deque[_Queued]] = {stream: deque() for stream in Stream}
        self._host: deque[_Queued] = deque()  # the host's own waits: it issues nothing more
        # What `advance` and `stalls` walk: the host (None), then the streams in order.
        self._lanes: tuple[tuple[Stream | None, deque[_Queued]], ...] = (
            (None, self._host),
            *self._queues.items(),
        )
        self._issued: dict[Stream, int] = dict.fromkeys(Stream, 0)
        self._ran: dict[Stream, int] = dict.fromkeys(Stream, 0)
        self._events: dict[EventRef, tuple[Stream, int]] = {}
        self._works: dict[WorkRef, PostedCollective] = {}

    def host_blocked(self) -> bool:
        return bool(self._host)

    def main_idle(self) -> bool:
        """Whether the main stream has run everything issued to it."""
        return not self._queues[Stream.MAIN]

    def idle(self) -> bool:
        return not any(queue for _, queue in self._lanes) and not self._works

    def unwaited(self) -> tuple[AllReduce, ...]:
        """Asynchronous all-reduces that no `WaitWork` waited on (a rank must wait on each)."""
        return tuple(
            posted.effect for posted in self._works.values() if isinstance(posted.effect, AllReduce)
        )

    def issue(self, effect: Effect) -> None:
        """Queue `effect` on its stream and run whatever can run."""
        # The cases in order of how often a log holds them (no effect class is another's
        # subclass, so the order cannot change which case matches).
        match effect:
            case Broadcast():
                posted = PostedCollective(self.rank, effect, _NO_DATA)
                self._hub.post(posted)
                if self._host_broadcasts:
                    self._host.append(_Collective(effect, posted))
                else:
                    self._issued[effect.stream] += 1
                    self._queues[effect.stream].append(_Collective(effect, posted))
            case WaitStream():
                target = self._issued[effect.waits_for]
                self._issued[effect.stream] += 1
                self._queues[effect.stream].append(_Wait(effect, effect.waits_for, target))
            case AllReduce():
                posted = PostedCollective(self.rank, effect, _NO_DATA)
                self._hub.post(posted)
                if effect.work is None:
                    self._host.append(_Collective(effect, posted))
                else:
                    # Runs on the CPU group's own thread: never behind a stream.
                    self._works[effect.work] = posted
                    posted.at_head = True
                    self._hub.reach_head(posted)
            case RecordEvent():
                self._events[effect.event] = (effect.stream, self._issued[effect.stream])
            case WaitEvent():
                mark = self._events.pop(effect.event, None)
                if mark is not None:
                    self._issued[effect.stream] += 1
                    self._queues[effect.stream].append(_Wait(effect, mark[0], mark[1]))
            case ForgetEvent():
                self._events.pop(effect.event, None)
            case NoteDecision():
                self._hub.note(self.rank, effect)
            case Synchronize():
                # The host waits for everything queued so far on the stream.
                target = self._issued[effect.stream]
                self._host.append(_Wait(effect, effect.stream, target))
            case WaitWork():
                awaited = self._works.pop(effect.work, None)
                if awaited is not None:
                    self._host.append(_HostWaitsWork(effect, awaited))
            case (
                Allocate()
                | CopyHostToDevice()
                | CheckHeader()
                | PadColumns()
                | StackRows()
                | GatherRows()
                | ScatterRows()
                | Pack()
                | Unpack()
                | RecordStream()
                | Release()
                | Alias()
            ):
                pass  # local (LOCAL_KINDS): runs at its stream's head, so waits for nothing
            case _:
                assert_never(effect)
        self.advance()

    def advance(self) -> bool:
        """Run every queued effect that can run now; whether anything ran."""
        # Whether a head may run is decided inline, not in a call per head: this runs
        # after every record the checker replays.
        progressed = False
        moved = True
        ran, hub = self._ran, self._hub
        while moved:
            moved = False
            for stream, queue in self._lanes:
                while queue:
                    item = queue[0]
                    if isinstance(item, _Collective):
                        posted = item.posted
                        if not posted.at_head:
                            posted.at_head = True
                            hub.reach_head(posted)
                        if not posted.done:
                            break
                    elif isinstance(item, _Wait):
                        if ran[item.on] < item.target:
                            break
                    elif isinstance(item, _HostWaitsWork) and not item.posted.done:
                        break
                    queue.popleft()
                    if stream is not None:  # the host's lane: nothing waits for its count
                        ran[stream] += 1
                    moved = progressed = True
        return progressed

    def stalls(self) -> Iterator[tuple[Stream | None, Effect, PostedCollective | None]]:
        """The host's wait (its stream None), then each stuck stream: the head effect and
        the collective it comes down to."""
        for stream, queue in self._lanes:
            if queue:
                yield stream, queue[0].effect, self._culprit(stream, frozenset())

    def at_step(self) -> int | None:
        """The step of the host's stuck effect, else of the main stream's, if stuck."""
        queue = self._host or self._queues[Stream.MAIN]
        return queue[0].effect.step if queue else None

    def _culprit(self, stream: Stream | None, seen: frozenset[Stream]) -> PostedCollective | None:
        """The unfinished collective the head of `stream` (None: the host's) comes down to."""
        queue = self._host if stream is None else self._queues[stream]
        if not queue or stream in seen:
            return None
        head = queue[0]
        match head:
            case _Collective() | _HostWaitsWork():
                return None if head.posted.done else head.posted
            case _Wait():
                return self._culprit(head.on, seen if stream is None else seen | {stream})
            case _:
                assert_never(head)
