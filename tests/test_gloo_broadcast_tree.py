"""gloo's broadcast tree in the stream model: who a gloo broadcast holds, and for whom.

gloo's broadcast (gloo/broadcast.cc, which torch's CPU broadcast runs) renumbers the
group's members from the source and sends down a binomial tree: each member receives
from its parent, then sends to its children and waits for those sends, and a send
completes only once its receiver has joined. So the source's host is held until its
children have joined, and a receiver's until the data has come down to it and the
members it forwards to (from four members on) have joined. Over two members that is
"until every member joins"; over more it is not, and the model follows the tree
(`CollectiveHub` with `backend='gloo'`, `broadcast_tree`). NCCL's broadcasts still
complete for every member at once.

`tests/test_gloo_model_differential.py` runs programs like these on real gloo.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from purepp.effects.matching import CollectiveReportError, DeadlockReport, comm_instance
from purepp.effects.numpy_interpreter import PostedCollective
from purepp.effects.scheduler import CollectiveHub, broadcast_tree
from purepp.effects.simulator import RankContext, simulate
from purepp.effects.vocabulary import (
    Allocate,
    AllReduce,
    Backend,
    Broadcast,
    BufferRef,
    Communicator,
    DType,
    Effect,
    Op,
    Stream,
    WaitWork,
    WorkRef,
)
from purepp.layout import Layout
from tests.test_gloo_model_differential import (
    BROADCAST_FIRST,
    COMPLETES,
    HANGS,
    START_FIRST,
    WAIT_FIRST,
    checked,
    crossed,
    simulated,
)

# gloo's tree over stages 0..size-1, by hand, for (size, source): who sends to whom
# (members not listed send to none).
TREES: dict[tuple[int, int], dict[int, tuple[int, ...]]] = {
    (3, 0): {0: (1, 2)},
    (3, 1): {1: (2, 0)},
    (4, 0): {0: (1, 2), 1: (3,)},
    (4, 2): {2: (3, 0), 3: (1,)},
    (4, 3): {3: (0, 1), 0: (2,)},
    (5, 0): {0: (1, 2, 4), 1: (3,)},
    (5, 3): {3: (4, 0, 2), 4: (1,)},
}


def gloo_sends(size: int, root: int) -> dict[int, tuple[int, ...]]:
    """Who sends to whom, by group rank, found by stepping through gloo's own loop: in
    round i the renumbered ranks below 2**(i+1) pair up across bit i, the one without
    the bit sending to the one with it (if that one is inside the group)."""
    sends: dict[int, list[int]] = {rank: [] for rank in range(size)}
    rounds = (size - 1).bit_length()  # log2 of size, rounded up
    for i in range(rounds):
        for vrank in range(min(size, 1 << (i + 1))):
            vpeer = vrank ^ (1 << i)
            if vrank & (1 << i) == 0 and vpeer < size:
                sends[(vrank + root) % size].append((vpeer + root) % size)
    return {rank: tuple(peers) for rank, peers in sends.items()}


def hangs_on_gloo(size: int, src: int, orders: tuple[tuple[str, ...], ...]) -> bool:
    """Whether a `crossed` program hangs on gloo, by the hand-made tree: some stage that
    broadcasts first waits (above it, or among those it sends to) for a stage that joins
    the broadcast only once the all-reduce, which needs the first stage, has completed."""
    children = TREES[size, src]
    parent = {child: p for p, sent in children.items() for child in sent}

    def waits_for(stage: int) -> set[int]:
        above, up = set(), parent.get(stage)
        while up is not None:
            above.add(up)
            up = parent.get(up)
        return above | set(children.get(stage, ()))

    return any(
        orders[stage] == BROADCAST_FIRST and any(orders[w] == WAIT_FIRST for w in waits_for(stage))
        for stage in range(size)
    )


# -- the tree itself ------------------------------------------------------------------


@pytest.mark.parametrize(("size", "src"), sorted(TREES))
def test_the_tree_is_the_one_written_out_by_hand(size: int, src: int) -> None:
    """The sizes and sources the programs below use: the source sends to the members 1,
    2, 4, ... after it (wrapping round the group), and the member right after the source
    forwards to the one three after it, from four members on."""
    tree = broadcast_tree(tuple(range(size)), src)
    expected = TREES[size, src]
    assert {m: c for m, c in tree.children.items() if c} == expected
    assert tree.order[0] == src
    assert sorted(tree.order) == list(range(size))


@pytest.mark.parametrize("size", range(1, 18))
def test_the_tree_is_the_one_gloos_loop_walks_for_every_size_and_source(size: int) -> None:
    """Over a group of global ranks that are not its group ranks (every third rank), the
    tree matches gloo's loop stepped through by group rank, and each member comes after
    the member it receives from in `order`."""
    group = tuple(range(5, 5 + 3 * size, 3))
    for root in range(size):
        tree = broadcast_tree(group, group[root])
        sends = gloo_sends(size, root)
        assert {
            group.index(member): tuple(group.index(child) for child in children)
            for member, children in tree.children.items()
        } == sends
        for member, parent in tree.parent.items():
            assert tree.order.index(parent) < tree.order.index(member)
            assert member in tree.children[parent]
        assert set(tree.parent) == set(group) - {group[root]}


# -- who is held: programs in the simulator and the checker ------------------------------


@pytest.mark.parametrize(("size", "src"), sorted(TREES))
def test_every_order_of_a_broadcast_and_an_all_reduce_hangs_exactly_as_the_tree_says(
    size: int, src: int
) -> None:
    """Every way of giving each stage one of the three orders of a broadcast against an
    asynchronous all-reduce (start it first; broadcast first; wait for it first): the
    simulator on gloo reports a deadlock exactly when a stage that broadcasts first
    waits in the tree for one that waits first. Holding every member until all had
    joined would hang whenever both orders appear at all."""
    differs_from_all_at_once = 0
    for orders in itertools.product((START_FIRST, BROADCAST_FIRST, WAIT_FIRST), repeat=size):
        expected = hangs_on_gloo(size, src, orders)
        assert simulated(crossed(src, orders)) == (HANGS if expected else COMPLETES), orders
        differs_from_all_at_once += not expected and (
            BROADCAST_FIRST in orders and WAIT_FIRST in orders
        )
    assert differs_from_all_at_once > 0


@pytest.mark.parametrize(("size", "src"), sorted(TREES))
def test_the_checker_holds_the_same_members_as_the_simulator(
    size: int, src: int, tmp_path: Path
) -> None:
    """`purepp check` over gloo logs of every such program: the same verdicts as the
    simulator."""
    for index, orders in enumerate(
        itertools.product((START_FIRST, BROADCAST_FIRST, WAIT_FIRST), repeat=size)
    ):
        program = crossed(src, orders)
        assert checked(program, tmp_path / str(index)) == simulated(program), orders


def test_a_forwarder_waiting_for_its_late_child_is_a_cycle_of_those_two() -> None:
    """Four stages from stage 0: stage 1 receives and would forward to stage 3, which
    waits for the all-reduce stage 1 has not started. The report's wait-for cycle is
    stage 1 (the broadcast, waiting for its child) and stage 3 (the all-reduce), and
    stage 1 is named as held on the host by gloo's tree."""
    program = crossed(0, (START_FIRST, BROADCAST_FIRST, START_FIRST, WAIT_FIRST))

    def run(context: RankContext) -> Iterator[tuple[Effect, ...]]:
        yield program.effects(context.rank)

    with pytest.raises(CollectiveReportError) as raised:
        simulate(program.world, run, backend="gloo")
    report = raised.value.report
    assert isinstance(report, DeadlockReport)
    assert report.cycle is not None
    assert {(edge.rank, edge.peer, edge.via and edge.via.comm) for edge in report.cycle.edges} == {
        (1, 3, Communicator.PP_RELAY),
        (3, 1, Communicator.PP_CPU),
    }
    (forwarder,) = [w for w in report.waiters if w.rank == 1]
    assert forwarder.host
    assert "blocks the host on gloo" in forwarder.waiting_at


# -- the data --------------------------------------------------------------------------

WIRE = BufferRef("wire")


def receive(src: int) -> tuple[Allocate, Broadcast]:
    return (
        Allocate(
            step=0, op=Op.RECEIVE, buffer=WIRE, shape=(3,), dtype=DType.INT64, stream=Stream.RELAY
        ),
        send(src),
    )


def send(src: int) -> Broadcast:
    return Broadcast(
        step=0,
        op=Op.RECEIVE,
        buffer=WIRE,
        shape=(3,),
        dtype=DType.INT64,
        src=src,
        comm=Communicator.PP_RELAY,
        stream=Stream.RELAY,
    )


def test_a_late_child_gets_the_data_its_forwarder_received_not_what_the_source_holds_now() -> None:
    """Four stages from stage 0 (0 -> 1, 0 -> 2, 1 -> 3): the source is let go once stages
    1 and 2 have joined, and overwrites its buffer; stage 3 joins only after that (it
    waits for the all-reduce the source starts after the broadcast), and receives from
    stage 1 what stage 1 received, as gloo forwards it. Every member holds the source's
    data when its host goes on."""
    start = AllReduce(
        step=0,
        op=Op.AGREE,
        contribution=np.zeros((2, 2), dtype=np.int32),
        result=BufferRef("table"),
        comm=Communicator.PP_CPU,
        work=WorkRef("a"),
    )
    wait = WaitWork(step=0, op=Op.AGREE, work=WorkRef("a"))
    seen: dict[int, list[int]] = {}

    def run(context: RankContext) -> Iterator[tuple[Effect, ...]]:
        rank, interp = context.rank, context.interpreter
        if rank == 0:
            interp.bind(WIRE, np.array([7, 8, 9], dtype=np.int64))
            yield (send(0),)
            seen[rank] = interp.tensor(WIRE).tolist()
            interp.tensor(WIRE)[...] = -1  # the source reuses its buffer
            yield (start, wait)
        elif rank == 3:
            yield (start, wait)
            yield receive(0)
            seen[rank] = interp.tensor(WIRE).tolist()
        else:
            yield (start, *receive(0))
            seen[rank] = interp.tensor(WIRE).tolist()
            yield (wait,)

    simulate(Layout(pp=4, dp=1), run, backend="gloo")
    assert seen == {0: [7, 8, 9], 1: [7, 8, 9], 2: [7, 8, 9], 3: [7, 8, 9]}


# -- the hub itself: one broadcast, members joining in any order --------------------------


@settings(max_examples=150, deadline=None)
@given(data=st.data(), size=st.integers(2, 8))
def test_each_member_is_let_go_once_those_above_it_and_those_it_sends_to_have_joined(
    data: st.DataObject, size: int
) -> None:
    """Members of one gloo broadcast join one by one, in any order: after each join,
    a member is done exactly when it, every member above it in the tree and every
    member it sends to have joined, and a member that is done holds the source's data
    (the source overwrites its buffer once it is let go)."""
    world = Layout(pp=size, dp=1)
    group = comm_instance(world, 0, Communicator.PP_RELAY).group
    src = data.draw(st.sampled_from(group))
    joins = data.draw(st.permutations(group))
    tree = broadcast_tree(group, src)
    hub = CollectiveHub(world, call="test", backend="gloo")
    effect = send(src)
    posts = {
        rank: PostedCollective(
            rank, effect, np.array([1, 2, 3]) if rank == src else np.zeros(3, dtype=np.int64)
        )
        for rank in group
    }
    joined: set[int] = set()
    for rank in joins:
        hub.post(posts[rank])
        posts[rank].at_head = True
        hub.reach_head(posts[rank])
        joined.add(rank)
        for member in group:
            waited = {*tree.above(member), *tree.children[member]}
            done = posts[member].done
            assert done == (member in joined and waited <= joined), (member, joined)
            if done:
                assert member == src or posts[member].array.tolist() == [1, 2, 3]
            elif member in joined:  # the deadlock report's edges: the members still awaited
                assert {edge.peer for edge in hub.waits_for(posts[member])} == waited - joined
        if posts[src].done:
            posts[src].array[...] = -1  # the source goes on and reuses its buffer


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_over_three_members_a_receiver_goes_on_before_the_other_joins_on_gloo_only(
    backend: Backend,
) -> None:
    """Three members from rank 0: with rank 0 and rank 2 joined, gloo lets rank 2 go
    (its data has come from rank 0, and it sends to none) and holds rank 0 (its send to
    rank 1 waits); NCCL's broadcast holds both until rank 1 joins, as before."""
    world = Layout(pp=3, dp=1)
    hub = CollectiveHub(world, call="test", backend=backend)
    effect = send(0)
    posts = [PostedCollective(rank, effect, np.full(3, rank, dtype=np.int64)) for rank in range(3)]
    for rank in (0, 2):
        hub.post(posts[rank])
        posts[rank].at_head = True
        hub.reach_head(posts[rank])
    assert [post.done for post in posts] == [False, False, backend == "gloo"]
    hub.post(posts[1])
    posts[1].at_head = True
    hub.reach_head(posts[1])
    assert all(post.done for post in posts)
    assert [post.array.tolist() for post in posts] == [[0, 0, 0]] * 3
