"""The numpy reference interpreter, and the simulator running hand-written rank programs.

The programs here are written out effect by effect (they do not use purepp.relay),
so each test shows one mechanism: data moving, a mismatch, a skipped agreement, a
deadlock, a ring overrun, a buffer freed too early.
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TypedDict

import attrs
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from purepp.effects.interpreter import Interpreter
from purepp.effects.matching import (
    CollectiveReportError,
    DeadlockReport,
    MismatchField,
    MismatchReport,
    Report,
    RingOverrunReport,
    check_posts,
    comm_instance,
    match_collectives,
    mismatch_order,
    signature_of,
)
from purepp.effects.numpy_interpreter import POISON, NumpyInterpreter, PostedCollective
from purepp.effects.scheduler import CollectiveHub
from purepp.effects.simulator import RankContext, RankProgram, simulate
from purepp.effects.vocabulary import (
    Alias,
    Allocate,
    AllReduce,
    Broadcast,
    BufferRef,
    CheckHeader,
    Communicator,
    CopyHostToDevice,
    DType,
    Effect,
    EventRef,
    GatherRows,
    Op,
    PadColumns,
    RecordEvent,
    RecordStream,
    Release,
    ScatterRows,
    StackRows,
    Stream,
    Synchronize,
    WaitEvent,
    WaitStream,
    WaitWork,
    WorkRef,
)
from purepp.errors import (
    CollectiveMismatchError,
    ConfigError,
    HeaderMismatchError,
    InterpreterError,
    InvalidInputError,
)
from purepp.layout import Layout

Int64 = npt.NDArray[np.int64]

WIRE_WIDTH = 3  # num_speculative_steps + 1
DRAFTS = 2  # num_speculative_steps
SAMPLED = BufferRef("input.sampled")  # the sender's [n, k] tokens, bound each step
DRAFT_TABLE = BufferRef("input.drafts")  # the sender's [n, DRAFTS] drafts, bound each step


class Tag(TypedDict):
    step: int
    op: Op


def report_of(error: pytest.ExceptionInfo[CollectiveMismatchError]) -> Report:
    assert isinstance(error.value, CollectiveReportError)
    return error.value.report


def sent_tokens(step: int, rows: int, width: int, replica: int) -> Int64:
    """What the last stage of `replica` samples at `step`: distinct per step and replica."""
    return (
        np.arange(rows * width, dtype=np.int64).reshape(rows, width) + 1000 * step + 100 * replica
    )


def wire_tokens(step: int, rows: int, width: int, replica: int) -> Int64:
    """`sent_tokens` as it travels: right-padded with 0 to the wire width."""
    padded = np.zeros((rows, WIRE_WIDTH), dtype=np.int64)
    padded[:, :width] = sent_tokens(step, rows, width, replica)
    return padded


# ---- hand-written relay programs -------------------------------------------------------


def relay_program(
    rows: list[int],
    *,
    ring_depth: int,
    received: dict[tuple[int, int], Int64],
    width_at: Callable[[int], int] = lambda step: WIRE_WIDTH,
    pad: bool = True,
    drafts: bool = False,
    receiver_skips_drafts_at: int | None = None,
) -> RankProgram:
    """A pipeline relay written by hand: the last stage sends every step with rows > 0.

    Non-last stages receive each step into a ring and consume the entry `ring_depth`
    steps later: wait on its event, then read it into `received[(rank, step)]`.
    """

    def program(ctx: RankContext) -> Iterator[tuple[Effect, ...]]:
        last = ctx.world.rank_of(pp_stage=ctx.world.pp - 1, dp_index=ctx.replica)
        if ctx.rank == last:
            yield from _sender(ctx, last)
        else:
            yield from _receiver(ctx, last)

    def _sender(ctx: RankContext, last: int) -> Iterator[tuple[Effect, ...]]:
        for step, n in enumerate(rows):
            if n == 0:  # no row needs a token: the receivers see the same batch
                yield ()
                continue
            width = width_at(step)
            ctx.interpreter.bind(SAMPLED, sent_tokens(step, n, width, ctx.replica))
            send = BufferRef(f"send.{step}")
            wire_shape = (n, WIRE_WIDTH if pad else width)
            tag = Tag(step=step, op=Op.BROADCAST)
            effects: list[Effect] = [WaitStream(**tag, stream=Stream.RELAY, waits_for=Stream.MAIN)]
            if pad:
                effects.append(
                    PadColumns(
                        **tag,
                        source=SAMPLED,
                        out=send,
                        width=WIRE_WIDTH,
                        fill=0,
                        stream=Stream.RELAY,
                    )
                )
            else:
                effects.append(Alias(**tag, source=SAMPLED, out=send))
            effects += [
                _broadcast(step, Op.BROADCAST, send, wire_shape, last),
                RecordStream(**tag, buffer=SAMPLED, stream=Stream.RELAY),
                Release(**tag, buffer=send),
            ]
            if drafts:
                table = np.full((n, DRAFTS), 7 + step, dtype=np.int64)
                ctx.interpreter.bind(DRAFT_TABLE, table)
                send_drafts = BufferRef(f"send_drafts.{step}")
                tag = Tag(step=step, op=Op.BROADCAST_DRAFTS)
                effects += [
                    PadColumns(
                        **tag,
                        source=DRAFT_TABLE,
                        out=send_drafts,
                        width=DRAFTS,
                        fill=0,
                        stream=Stream.RELAY,
                    ),
                    _broadcast(step, Op.BROADCAST_DRAFTS, send_drafts, (n, DRAFTS), last),
                    Release(**tag, buffer=send_drafts),
                ]
            yield tuple(effects)

    def _receiver(ctx: RankContext, last: int) -> Iterator[tuple[Effect, ...]]:
        ring: deque[int | None] = deque([None] * ring_depth)
        for step, n in enumerate(rows):
            effects: list[Effect] = []
            oldest = ring.popleft()
            ring.append(None)
            if oldest is not None:
                effects.append(
                    WaitEvent(
                        step=step, op=Op.CONSUME, stream=Stream.MAIN, event=EventRef(f"e.{oldest}")
                    )
                )
            if n:
                tokens = BufferRef(f"recv.{step}")
                tag = Tag(step=step, op=Op.RECEIVE)
                effects += [
                    WaitStream(**tag, stream=Stream.RELAY, waits_for=Stream.MAIN),
                    Allocate(
                        **tag,
                        buffer=tokens,
                        shape=(n, WIRE_WIDTH),
                        dtype=DType.INT64,
                        stream=Stream.RELAY,
                    ),
                    _broadcast(step, Op.RECEIVE, tokens, (n, WIRE_WIDTH), last),
                ]
                if drafts and step != receiver_skips_drafts_at:
                    draft_buffer = BufferRef(f"recv_drafts.{step}")
                    effects += [
                        Allocate(
                            **tag,
                            buffer=draft_buffer,
                            shape=(n, DRAFTS),
                            dtype=DType.INT64,
                            stream=Stream.RELAY,
                        ),
                        _broadcast(step, Op.RECEIVE, draft_buffer, (n, DRAFTS), last),
                    ]
                effects += [
                    RecordEvent(**tag, stream=Stream.RELAY, event=EventRef(f"e.{step}")),
                    RecordStream(**tag, buffer=tokens, stream=Stream.MAIN),
                ]
                ring[-1] = step
            yield tuple(effects)
            # The host passed the wait: the consumed entry is complete.
            if oldest is not None:
                entry = BufferRef(f"recv.{oldest}")
                received[(ctx.rank, oldest)] = ctx.interpreter.host_array(entry)

    return program


def _broadcast(step: int, op: Op, buffer: BufferRef, shape: tuple[int, ...], src: int) -> Broadcast:
    return Broadcast(
        step=step,
        op=op,
        buffer=buffer,
        shape=shape,
        dtype=DType.INT64,
        src=src,
        comm=Communicator.PP_RELAY,
        stream=Stream.RELAY,
    )


def expected_receipts(
    world: Layout, rows: list[int], ring_depth: int
) -> dict[tuple[int, int], Int64]:
    """What every non-last stage reads: each sent step consumed `ring_depth` steps later."""
    expected: dict[tuple[int, int], Int64] = {}
    for rank in range(world.world_size):
        if world.pp_stage(rank) == world.pp - 1:
            continue
        for step, n in enumerate(rows):
            if n and step + ring_depth < len(rows):
                expected[(rank, step)] = wire_tokens(step, n, WIRE_WIDTH, world.dp_index(rank))
    return expected


# ---- data moves ------------------------------------------------------------------------


@pytest.mark.parametrize(("pp", "dp"), [(2, 1), (3, 1), (2, 2)])
def test_a_correct_relay_moves_every_step_to_every_stage(pp: int, dp: int) -> None:
    world = Layout(pp=pp, dp=dp)
    rows = [3, 2, 0, 4, 1, 2, 3]
    received: dict[tuple[int, int], Int64] = {}

    result = simulate(world, relay_program(rows, ring_depth=pp, received=received))

    assert received.keys() == expected_receipts(world, rows, pp).keys()
    for key, tokens in expected_receipts(world, rows, pp).items():
        np.testing.assert_array_equal(received[key], tokens)
    assert match_collectives(dict(enumerate(result.effects)), world) is None
    assert all(not i.lifetime_violations for i in result.interpreters)


def test_narrow_sampled_tokens_arrive_padded_to_the_wire_width() -> None:
    world = Layout(pp=2, dp=1)
    rows = [2, 2, 2, 2]
    received: dict[tuple[int, int], Int64] = {}
    widths = [3, 1, 2, 1]  # a plain-sampler step samples one token per row

    simulate(
        world,
        relay_program(rows, ring_depth=2, received=received, width_at=widths.__getitem__),
    )

    np.testing.assert_array_equal(received[(0, 1)], [[1000, 0, 0], [1001, 0, 0]])
    np.testing.assert_array_equal(received[(0, 0)], wire_tokens(0, 2, 3, 0))


@settings(max_examples=25, deadline=None)
@given(
    pp=st.integers(1, 3),
    dp=st.integers(1, 2),
    rows=st.lists(st.integers(0, 3), min_size=1, max_size=6),
    in_flight=st.integers(1, 3),
)
def test_a_ring_as_deep_as_the_steps_in_flight_delivers_everything(
    pp: int, dp: int, rows: list[int], in_flight: int
) -> None:
    world = Layout(pp=pp, dp=dp)
    received: dict[tuple[int, int], Int64] = {}
    depth = max(in_flight, 1)

    result = simulate(
        world,
        relay_program(rows, ring_depth=depth, received=received),
        max_steps_in_flight=in_flight,
    )

    expected = expected_receipts(world, rows, depth)
    assert received.keys() == expected.keys()
    for key, tokens in expected.items():
        np.testing.assert_array_equal(received[key], tokens)
    assert match_collectives(dict(enumerate(result.effects)), world) is None


# ---- FIELD_FAILURES row 1: [n, 1] sent, [n, spec + 1] posted ------------------------------


def test_an_unpadded_plain_sampler_step_stops_the_run_at_that_op() -> None:
    world = Layout(pp=3, dp=1)
    rows = [4, 4, 4, 4, 4]
    widths = [3, 3, 1, 3, 3]  # step 2 used the plain sampler: [4, 1]

    with pytest.raises(CollectiveMismatchError) as error:
        simulate(
            world,
            relay_program(rows, ring_depth=3, received={}, width_at=widths.__getitem__, pad=False),
        )

    report = report_of(error)
    assert isinstance(report, MismatchReport)
    assert (report.rank, report.peer) == (0, 2)
    assert (report.comm, report.group) == (Communicator.PP_RELAY, (0, 1, 2))
    assert (report.seq, report.step, report.op) == (2, 2, Op.RECEIVE)
    assert report.expected.shape == (4, 3)
    assert report.received is not None
    assert report.received.shape == (4, 1)
    assert report.differing == (MismatchField.SHAPE,)
    assert "op #2 on pp_relay (ranks 0, 1, 2)" in str(error.value)


# ---- FIELD_FAILURES row 10: an idle DP rank skips the agreement --------------------------


def agreement_program(
    *, steps: int, idle: set[tuple[int, int]], skip_when_idle: bool, seen: dict[int, list[int]]
) -> RankProgram:
    """Each step every DP rank all-reduces a [5, dp] table; idle (rank, step) pairs have no work.

    Row 0 is the token count, the only row this test fills. `seen[rank]` collects the
    agreed maximum per step.
    """

    def program(ctx: RankContext) -> Iterator[tuple[Effect, ...]]:
        dp = ctx.world.dp
        for step in range(steps):
            is_idle = (ctx.rank, step) in idle
            if is_idle and skip_when_idle:
                yield ()  # the bug: return early without joining the collective
                continue
            table = np.zeros((5, dp), dtype=np.int32)
            table[0, ctx.replica] = 0 if is_idle else 8 + ctx.rank
            result = BufferRef(f"dp.table.{step}")
            yield (
                AllReduce(
                    step=step,
                    op=Op.AGREE,
                    contribution=table,
                    result=result,
                    comm=Communicator.DP_CPU,
                    work=None,
                ),
            )
            seen.setdefault(ctx.rank, []).append(int(ctx.interpreter.host_array(result)[0].max()))
            yield (Release(step=step, op=Op.AGREE, buffer=result),)

    return program


def test_idle_ranks_that_contribute_zeros_agree_with_everyone() -> None:
    seen: dict[int, list[int]] = {}
    idle = {(1, 1), (2, 1), (2, 2)}

    simulate(
        Layout(pp=1, dp=3),
        agreement_program(steps=4, idle=idle, skip_when_idle=False, seen=seen),
    )

    assert seen[0] == seen[1] == seen[2] == [10, 8, 9, 10]


def test_an_idle_rank_that_skips_the_agreement_is_reported_at_that_step() -> None:
    with pytest.raises(CollectiveMismatchError) as error:
        simulate(
            Layout(pp=1, dp=3),
            agreement_program(steps=4, idle={(2, 1)}, skip_when_idle=True, seen={}),
        )

    report = report_of(error)
    assert isinstance(report, MismatchReport)
    assert (report.rank, report.peer, report.seq) == (2, 0, 1)
    assert (report.comm, report.group) == (Communicator.DP_CPU, (0, 1, 2))
    assert report.differing == (MismatchField.STEP,)
    assert report.expected.step == 2  # rank 2's op #1 is already step 2's agreement
    assert report.received is not None
    assert report.received.step == 1


# ---- FIELD_FAILURES rows 3/4: a draft broadcast one side does not post ---------------------


def test_a_draft_broadcast_the_receiver_does_not_post_stops_the_run() -> None:
    with pytest.raises(CollectiveMismatchError) as error:
        simulate(
            Layout(pp=2, dp=1),
            relay_program(
                [2, 2, 2, 2], ring_depth=2, received={}, drafts=True, receiver_skips_drafts_at=1
            ),
        )

    report = report_of(error)
    assert isinstance(report, MismatchReport)
    assert (report.rank, report.peer, report.seq) == (0, 1, 3)
    # The receiver's op #3 is step 2's tokens; the sender's is step 1's drafts.
    assert (report.expected.step, report.expected.shape) == (2, (2, WIRE_WIDTH))
    assert report.received is not None
    assert (report.received.step, report.received.op) == (1, Op.BROADCAST_DRAFTS)
    assert report.received.shape == (2, DRAFTS)
    assert report.differing == (MismatchField.STEP, MismatchField.SHAPE)


def test_draft_broadcasts_on_both_sides_arrive() -> None:
    received: dict[tuple[int, int], Int64] = {}
    result = simulate(
        Layout(pp=2, dp=1), relay_program([2, 2, 2], ring_depth=2, received=received, drafts=True)
    )
    drafts = result.interpreter(0).tensor(BufferRef("recv_drafts.2"))
    np.testing.assert_array_equal(drafts, np.full((2, DRAFTS), 9))


# ---- deadlocks ---------------------------------------------------------------------------


def int32_broadcast(
    op: Op,
    buffer: BufferRef,
    *,
    shape: tuple[int, ...],
    src: int,
    stream: Stream = Stream.RELAY,
    step: int = 0,
) -> Broadcast:
    return Broadcast(
        step=step,
        op=op,
        buffer=buffer,
        shape=shape,
        dtype=DType.INT32,
        src=src,
        comm=Communicator.PP_RELAY,
        stream=stream,
    )


def scripted(steps: Mapping[int, Sequence[tuple[Effect, ...]]]) -> RankProgram:
    """Each rank yields its own fixed list of steps."""

    def program(ctx: RankContext) -> Iterator[tuple[Effect, ...]]:
        yield from steps[ctx.rank]

    return program


def pp_cpu_agreement(step: int) -> AllReduce:
    return AllReduce(
        step=step,
        op=Op.AGREE,
        contribution=np.zeros((5, 1), dtype=np.int32),
        result=BufferRef(f"pp.table.{step}"),
        comm=Communicator.PP_CPU,
        work=None,
    )


def main_stream_broadcast(step: int, rank: int) -> tuple[Effect, ...]:
    buffer = BufferRef(f"x.{step}")
    return (
        CopyHostToDevice(
            step=step,
            op=Op.BROADCAST,
            source=np.zeros(4, np.int32),
            buffer=buffer,
            stream=Stream.MAIN,
        ),
        int32_broadcast(
            Op.BROADCAST if rank == 1 else Op.RECEIVE,
            buffer,
            shape=(4,),
            src=1,
            stream=Stream.MAIN,
            step=step,
        ),
    )


def test_two_communicators_taken_in_opposite_orders_deadlock() -> None:
    # Each communicator's sequence matches on its own; only the order across them differs.
    # On gloo rank 1's host waits in its broadcast (NCCL would only queue it on the main
    # stream, and the host would go on to the all-reduce: tests/test_stream_model_gaps.py).
    steps: dict[int, list[tuple[Effect, ...]]] = {
        0: [(pp_cpu_agreement(0), *main_stream_broadcast(0, 0))],
        1: [(*main_stream_broadcast(0, 1), pp_cpu_agreement(0))],
    }
    per_rank = {rank: [e for step in plan for e in step] for rank, plan in steps.items()}
    assert match_collectives(per_rank, Layout(pp=2, dp=1)) is None

    with pytest.raises(CollectiveMismatchError) as error:
        simulate(Layout(pp=2, dp=1), scripted(steps), backend="gloo")

    report = report_of(error)
    assert isinstance(report, DeadlockReport)
    assert [(w.rank, w.stream, w.host, w.step, w.op) for w in report.waiters] == [
        (0, Stream.MAIN, True, 0, Op.AGREE),
        (1, Stream.MAIN, True, 0, Op.BROADCAST),
    ]
    awaited = [w.awaited for w in report.waiters]
    assert awaited[0] is not None
    assert awaited[1] is not None
    assert (awaited[0].instance.comm, awaited[0].seq, awaited[0].missing) == (
        Communicator.PP_CPU,
        0,
        (1,),
    )
    assert (awaited[1].instance.comm, awaited[1].seq, awaited[1].missing) == (
        Communicator.PP_RELAY,
        0,
        (0,),
    )
    assert report.finished == ()
    assert "Deadlock" in report.render()
    # FIELD_FAILURES row 14: the report shows who waits for whom, round the loop.
    assert report.cycle is not None
    assert [(e.rank, e.via and e.via.comm, e.seq, e.peer) for e in report.cycle.edges] == [
        (0, Communicator.PP_CPU, 0, 1),
        (1, Communicator.PP_RELAY, 0, 0),
    ]
    assert (
        "  wait-for cycle: rank 0 -> pp_cpu op #0 -> rank 1 -> pp_relay op #0 -> rank 0"
        in report.render().splitlines()
    )
    assert "in one order on every rank" in report.fix()


def test_two_communicators_taken_in_opposite_orders_on_one_stream_deadlock_though_all_posted() -> (
    None
):
    # Both broadcasts are on the relay stream: every rank posts both, but each rank's
    # first is queued behind the other on its peer's stream.
    def broadcasts(rank: int) -> tuple[Effect, ...]:
        op = Op.BROADCAST if rank == 1 else Op.RECEIVE
        made, posted = [], {}
        for name, comm in (("x", Communicator.PP_RELAY), ("y", Communicator.PP_CPU)):
            buffer = BufferRef(name)
            made.append(
                CopyHostToDevice(
                    step=0, op=op, source=np.zeros(4, np.int32), buffer=buffer, stream=Stream.RELAY
                )
            )
            posted[comm] = attrs.evolve(int32_broadcast(op, buffer, shape=(4,), src=1), comm=comm)
        order = (Communicator.PP_RELAY, Communicator.PP_CPU)
        return (*made, *(posted[comm] for comm in (order if rank == 0 else order[::-1])))

    with pytest.raises(CollectiveMismatchError) as error:
        simulate(Layout(pp=2, dp=1), scripted({rank: [broadcasts(rank)] for rank in (0, 1)}))

    report = report_of(error)
    assert isinstance(report, DeadlockReport)
    assert [(a.instance.comm, a.missing) for a in report.pending] == [
        (Communicator.PP_RELAY, ()),
        (Communicator.PP_CPU, ()),
    ]
    lines = report.render().splitlines()
    assert lines[3] == (
        "      for op #0 on pp_relay (ranks 0, 1): broadcast [4] int32 from rank 1 (step 0, "
        "receive), posted by all members, queued behind other work"
    )
    assert report.cycle is not None
    assert sorted(report.cycle.ranks) == [0, 1]


def dp_agreement(step: int, comm: Communicator, rank: int) -> AllReduce:
    return AllReduce(
        step=step,
        op=Op.AGREE,
        contribution=np.full((5, 2), rank, dtype=np.int32),
        result=BufferRef(f"{comm.value}.table.{step}"),
        comm=comm,
        work=None,
    )


def waits_through_an_event(*, waited: bool = True) -> list[list[Effect]]:
    """Rank 0's main stream waits for its relay receive through an event, and its host
    for main, before an agreement; rank 1 agrees before it sends. So each waits for the
    other, unless the wait on the event is left out (a pp 2 x dp 1 world)."""
    received, event = BufferRef("r"), EventRef("received")
    receive: list[Effect] = [
        Allocate(
            step=0,
            op=Op.RECEIVE,
            buffer=received,
            shape=(4,),
            dtype=DType.INT32,
            stream=Stream.RELAY,
        ),
        int32_broadcast(Op.RECEIVE, received, shape=(4,), src=1),
        RecordEvent(step=0, op=Op.RECEIVE, stream=Stream.RELAY, event=event),
        *([WaitEvent(step=0, op=Op.CONSUME, stream=Stream.MAIN, event=event)] if waited else []),
        Synchronize(step=0, op=Op.CONSUME, stream=Stream.MAIN),
        pp_cpu_agreement(0),
    ]
    sent = BufferRef("s")
    send: list[Effect] = [
        pp_cpu_agreement(0),
        Allocate(
            step=0, op=Op.BROADCAST, buffer=sent, shape=(4,), dtype=DType.INT32, stream=Stream.RELAY
        ),
        int32_broadcast(Op.BROADCAST, sent, shape=(4,), src=1),
    ]
    return [receive, send]


def waits_for_a_work(*, waited: bool = True) -> list[list[Effect]]:
    """Rank 0's host waits for the target lane's asynchronous agreement before the
    drafter's; rank 1 takes the drafter's first. So each waits for the other, unless
    rank 0 waits for its work last (a pp 1 x dp 2 world)."""
    target, drafter = Communicator.DP_CPU, Communicator.DP_DRAFTER_CPU
    works = WorkRef("target.0"), WorkRef("target.1")
    asynchronous = [attrs.evolve(dp_agreement(0, target, r), work=works[r]) for r in (0, 1)]
    waits = [WaitWork(step=0, op=Op.AGREE, work=work) for work in works]
    rank0: list[Effect] = [asynchronous[0], waits[0], dp_agreement(0, drafter, 0)]
    if not waited:
        rank0 = [asynchronous[0], dp_agreement(0, drafter, 0), waits[0]]
    return [rank0, [dp_agreement(0, drafter, 1), asynchronous[1], waits[1]]]


@pytest.mark.parametrize(
    ("programs", "world"),
    [(waits_through_an_event, Layout(pp=2, dp=1)), (waits_for_a_work, Layout(pp=1, dp=2))],
)
def test_a_wait_on_an_event_or_a_work_is_a_wait_on_the_peers_behind_it(
    programs: Callable[..., list[list[Effect]]], world: Layout
) -> None:
    def run(per_rank: list[list[Effect]]) -> None:
        simulate(world, scripted({rank: [tuple(effects)] for rank, effects in enumerate(per_rank)}))

    with pytest.raises(CollectiveMismatchError) as error:
        run(programs())
    report = report_of(error)
    assert isinstance(report, DeadlockReport)
    assert report.cycle is not None
    assert sorted(report.cycle.ranks) == [0, 1]
    run(programs(waited=False))  # the same collectives, the wait moved: no cycle


def test_the_drafter_lane_taken_before_the_target_lane_on_one_replica_is_a_cycle() -> None:
    # DP_DRAFTER_CPU is a second group over the DP ranks: its ops match among the same
    # ranks as DP_CPU's, so the two lanes in opposite orders wait on each other.
    target, drafter = Communicator.DP_CPU, Communicator.DP_DRAFTER_CPU
    steps: dict[int, list[tuple[Effect, ...]]] = {
        0: [(dp_agreement(0, target, 0), dp_agreement(0, drafter, 0))],
        1: [(dp_agreement(0, drafter, 1), dp_agreement(0, target, 1))],
    }
    with pytest.raises(CollectiveMismatchError) as error:
        simulate(Layout(pp=1, dp=2), scripted(steps))

    report = report_of(error)
    assert isinstance(report, DeadlockReport)
    assert report.cycle is not None
    assert [(e.rank, e.via and e.via.comm, e.peer) for e in report.cycle.edges] == [
        (0, target, 1),
        (1, drafter, 0),
    ]


def test_both_lanes_in_one_order_sum_each_table_over_the_replicas() -> None:
    target, drafter = Communicator.DP_CPU, Communicator.DP_DRAFTER_CPU
    steps: dict[int, list[tuple[Effect, ...]]] = {
        rank: [(dp_agreement(0, target, rank), dp_agreement(0, drafter, rank + 1))]
        for rank in range(2)
    }
    result = simulate(Layout(pp=1, dp=2), scripted(steps))
    for rank in range(2):
        interpreter = result.interpreter(rank)
        assert (interpreter.host_array(BufferRef("dp_cpu.table.0")) == 1).all()
        assert (interpreter.host_array(BufferRef("dp_drafter_cpu.table.0")) == 3).all()


def relay_receive_then_synchronize(step: int) -> tuple[Effect, ...]:
    buffer = BufferRef(f"r.{step}")
    return (
        Allocate(
            step=step,
            op=Op.RECEIVE,
            buffer=buffer,
            shape=(4,),
            dtype=DType.INT32,
            stream=Stream.RELAY,
        ),
        int32_broadcast(Op.RECEIVE, buffer, shape=(4,), src=1, step=step),
        Synchronize(step=step, op=Op.RECEIVE, stream=Stream.RELAY),
    )


def test_synchronize_blocks_the_host_until_the_stream_has_run_its_work() -> None:
    # The host may read the received buffer right after the synchronize: no event needed.
    seen: list[npt.NDArray[np.int32]] = []

    def program(ctx: RankContext) -> Iterator[tuple[Effect, ...]]:
        if ctx.rank == 0:
            yield relay_receive_then_synchronize(0)
            seen.append(ctx.interpreter.host_array(BufferRef("r.0")))
        else:
            yield main_stream_broadcast(0, 1)

    simulate(Layout(pp=2, dp=1), program)
    assert [row.tolist() for row in seen] == [[0, 0, 0, 0]]


def test_a_synchronize_on_a_stream_whose_broadcast_is_never_matched_is_a_deadlock() -> None:
    steps: dict[int, list[tuple[Effect, ...]]] = {0: [relay_receive_then_synchronize(0)], 1: []}
    with pytest.raises(CollectiveMismatchError) as error:
        simulate(Layout(pp=2, dp=1), scripted(steps))

    report = report_of(error)
    assert isinstance(report, DeadlockReport)
    host = next(w for w in report.waiters if w.stream is Stream.MAIN)
    assert (host.rank, host.step, host.op) == (0, 0, Op.RECEIVE)
    assert "synchronize" in host.waiting_at
    assert host.awaited is not None
    assert (host.awaited.instance.comm, host.awaited.missing) == (Communicator.PP_RELAY, (1,))
    assert "not posted by rank(s) 1" in report.render()


def test_a_synchronize_past_the_ring_is_a_ring_overrun() -> None:
    # Waiting at step 2 on a step-0 receive the sender has not posted: the host ran ahead.
    steps: dict[int, list[tuple[Effect, ...]]] = {
        0: [
            relay_receive_then_synchronize(0)[:2],
            (Synchronize(step=2, op=Op.CONSUME, stream=Stream.RELAY),),
        ],
        1: [
            (Release(step=0, op=Op.END_STEP, buffer=BufferRef("none")),),
            main_stream_broadcast(5, 1),
        ],
    }
    with pytest.raises(CollectiveMismatchError) as error:
        simulate(Layout(pp=2, dp=1), scripted(steps), max_steps_in_flight=3)
    report = report_of(error)
    assert isinstance(report, RingOverrunReport)
    assert (report.rank, report.step, report.event) == (0, 2, None)


def test_a_collective_no_peer_posts_leaves_its_rank_waiting() -> None:
    steps: dict[int, list[tuple[Effect, ...]]] = {
        0: [(pp_cpu_agreement(0),), (pp_cpu_agreement(1),)],
        1: [(pp_cpu_agreement(0),)],
    }

    with pytest.raises(CollectiveMismatchError) as error:
        simulate(Layout(pp=2, dp=1), scripted(steps))

    report = report_of(error)
    assert isinstance(report, DeadlockReport)
    (waiter,) = report.waiters
    assert (waiter.rank, waiter.step, waiter.op) == (0, 1, Op.AGREE)
    assert waiter.awaited is not None
    assert (waiter.awaited.seq, waiter.awaited.missing) == (1, (1,))
    assert report.finished == (1,)
    assert report.at_steps == (1, None)
    lines = report.render().splitlines()
    assert "not posted by rank(s) 1" in report.render()
    assert "  finished their program: rank(s) 1" in lines
    assert lines[-1] == "  at step: rank 0: 1, rank 1: finished"


def test_a_relay_broadcast_no_peer_posts_leaves_the_stream_stuck() -> None:
    # Rank 1 ends before posting its send: rank 0's program ends too, its stream cannot.
    send = main_stream_broadcast(0, 1)
    steps: dict[int, list[tuple[Effect, ...]]] = {
        0: [
            (
                Allocate(
                    step=0,
                    op=Op.RECEIVE,
                    buffer=BufferRef("r"),
                    shape=(4,),
                    dtype=DType.INT32,
                    stream=Stream.RELAY,
                ),
                int32_broadcast(Op.RECEIVE, BufferRef("r"), shape=(4,), src=1),
            )
        ],
        1: [send[:1]],
    }
    with pytest.raises(CollectiveMismatchError) as error:
        simulate(Layout(pp=2, dp=1), scripted(steps))

    report = report_of(error)
    assert isinstance(report, DeadlockReport)
    (waiter,) = report.waiters
    assert (waiter.rank, waiter.stream) == (0, Stream.RELAY)
    assert report.finished == (0, 1)
    (pending,) = report.pending
    assert (pending.instance.comm, pending.missing) == (Communicator.PP_RELAY, (1,))


def test_a_rank_held_back_by_a_stuck_peer_is_named_with_it() -> None:
    # Rank 1 waits at step 0 for an agreement that rank 0 only issues at step 1, and
    # with one step in flight rank 0 may not start step 1 before rank 1 ends step 0.
    steps: dict[int, list[tuple[Effect, ...]]] = {
        0: [(Release(step=1, op=Op.END_STEP, buffer=BufferRef("none")), pp_cpu_agreement(1))],
        1: [(pp_cpu_agreement(0),)],
    }
    with pytest.raises(CollectiveMismatchError) as error:
        simulate(Layout(pp=2, dp=1), scripted(steps), max_steps_in_flight=1)

    report = report_of(error)
    assert isinstance(report, DeadlockReport)
    held, stuck = report.waiters
    assert (held.rank, held.stream, held.step, held.held_back_by) == (0, None, 1, (1,))
    assert (stuck.rank, stuck.stream, stuck.step) == (1, Stream.MAIN, 0)
    assert report.at_steps == (1, 0)
    assert "until rank(s) 1 complete more steps" in report.render()
    # One communicator and the steps in flight: not an issue-order deadlock.
    assert report.cycle is not None
    assert (
        report.cycle.render() == "rank 0 -> (steps in flight) -> rank 1 -> pp_cpu op #0 -> rank 0"
    )
    assert "in one order on every rank" not in report.fix()


def test_steps_never_go_back() -> None:
    steps: dict[int, list[tuple[Effect, ...]]] = {
        0: [(pp_cpu_agreement(1),), (pp_cpu_agreement(0),)],
    }
    with pytest.raises(InvalidInputError, match="step-0 AllReduce after a step-1 effect"):
        simulate(Layout(pp=1, dp=1), scripted(steps))


# ---- ring overrun: more steps in flight than the ring is deep ------------------------------


def test_a_receiver_running_ahead_of_the_ring_is_a_ring_overrun() -> None:
    # pp_size + 1 steps in flight with a ring of pp_size entries (FIELD_FAILURES row 3).
    with pytest.raises(CollectiveMismatchError) as error:
        simulate(
            Layout(pp=2, dp=1),
            relay_program([2] * 6, ring_depth=2, received={}),
            max_steps_in_flight=3,
        )

    report = report_of(error)
    assert isinstance(report, RingOverrunReport)
    assert (report.rank, report.step, report.op) == (0, 2, Op.CONSUME)
    assert report.event == EventRef("e.0")
    assert (report.ring_depth, report.max_steps_in_flight) == (2, 3)
    assert (report.awaited.seq, report.awaited.signature.step) == (0, 0)
    assert report.awaited.missing == (1,)
    assert report.peers_at == ((1, 0),)
    assert report.render().startswith("Ring overrun: rank 0 at step 2 (consume)")


def test_a_one_entry_ring_with_a_pipeline_in_flight_overruns() -> None:
    # Microbatching off (ring depth 1) while the default lets pp steps be in flight.
    with pytest.raises(CollectiveMismatchError) as error:
        simulate(Layout(pp=2, dp=1), relay_program([1] * 4, ring_depth=1, received={}))
    report = report_of(error)
    assert isinstance(report, RingOverrunReport)
    assert (report.step, report.ring_depth, report.max_steps_in_flight) == (1, 1, 2)


def test_a_one_entry_ring_with_one_step_in_flight_is_fine() -> None:
    received: dict[tuple[int, int], Int64] = {}
    world = Layout(pp=2, dp=1)
    simulate(world, relay_program([1] * 4, ring_depth=1, received=received), max_steps_in_flight=1)
    assert received.keys() == expected_receipts(world, [1] * 4, 1).keys()


# ---- stream order and buffer lifetimes ----------------------------------------------------


def test_relay_work_queued_behind_a_pending_broadcast_waits_for_it() -> None:
    # Rank 0 posts first; its gather of the received rows must run after the data lands.
    received, index, picked = BufferRef("r"), BufferRef("i"), BufferRef("picked")
    receiver: tuple[Effect, ...] = (
        Allocate(
            step=0,
            op=Op.RECEIVE,
            buffer=received,
            shape=(3,),
            dtype=DType.INT32,
            stream=Stream.RELAY,
        ),
        int32_broadcast(Op.RECEIVE, received, shape=(3,), src=1),
        CopyHostToDevice(
            step=0, op=Op.RECEIVE, source=np.array([2, 0]), buffer=index, stream=Stream.RELAY
        ),
        GatherRows(
            step=0, op=Op.RECEIVE, source=received, index=index, out=picked, stream=Stream.RELAY
        ),
        RecordEvent(step=0, op=Op.RECEIVE, stream=Stream.RELAY, event=EventRef("done")),
    )
    consume = (WaitEvent(step=1, op=Op.CONSUME, stream=Stream.MAIN, event=EventRef("done")),)
    payload = BufferRef("p")
    sender: tuple[Effect, ...] = (
        CopyHostToDevice(
            step=0, op=Op.BROADCAST, source=np.array([5, 6, 7]), buffer=payload, stream=Stream.RELAY
        ),
        int32_broadcast(Op.BROADCAST, payload, shape=(3,), src=1),
    )
    result = simulate(
        Layout(pp=2, dp=1),
        scripted({0: [receiver, consume], 1: [sender, ()]}),
        max_steps_in_flight=1,
    )
    np.testing.assert_array_equal(result.interpreter(0).tensor(picked), [7, 5])


def lifetime_program(*, record_stream: bool) -> RankProgram:
    """Rank 0 sends a main-stream buffer on the relay stream and frees it at once."""
    payload = BufferRef("payload")
    receive = BufferRef("r")
    recorded: tuple[Effect, ...] = (
        (RecordStream(step=0, op=Op.BROADCAST, buffer=payload, stream=Stream.RELAY),)
        if record_stream
        else ()
    )
    steps: dict[int, list[tuple[Effect, ...]]] = {
        0: [
            (
                CopyHostToDevice(
                    step=0,
                    op=Op.BROADCAST,
                    source=np.array([4, 5, 6]),
                    buffer=payload,
                    stream=Stream.MAIN,
                ),
                int32_broadcast(Op.BROADCAST, payload, shape=(3,), src=0),
                *recorded,
                Release(step=0, op=Op.BROADCAST, buffer=payload),
            )
        ],
        1: [
            (
                Allocate(
                    step=0,
                    op=Op.RECEIVE,
                    buffer=receive,
                    shape=(3,),
                    dtype=DType.INT32,
                    stream=Stream.RELAY,
                ),
                int32_broadcast(Op.RECEIVE, receive, shape=(3,), src=0),
            )
        ],
    }
    return scripted(steps)


def test_a_send_buffer_freed_before_its_broadcast_ran_sends_garbage() -> None:
    # FIELD_FAILURES row 5: no record_stream, so the memory is reused under the broadcast.
    result = simulate(Layout(pp=2, dp=1), lifetime_program(record_stream=False))

    np.testing.assert_array_equal(result.interpreter(1).tensor(BufferRef("r")), [POISON] * 3)
    (violation,) = result.interpreter(0).lifetime_violations
    assert (violation.buffer, violation.used_on) == (BufferRef("payload"), (Stream.RELAY,))


def test_record_stream_keeps_a_freed_send_buffer_alive_for_its_broadcast() -> None:
    result = simulate(Layout(pp=2, dp=1), lifetime_program(record_stream=True))

    np.testing.assert_array_equal(result.interpreter(1).tensor(BufferRef("r")), [4, 5, 6])
    assert result.interpreter(0).lifetime_violations == ()


# ---- asynchronous all-reduce -------------------------------------------------------------


def test_an_async_all_reduce_completes_at_its_wait() -> None:
    work, result_ref = WorkRef("w"), BufferRef("table")
    tables: dict[int, Int64] = {}

    def program(ctx: RankContext) -> Iterator[tuple[Effect, ...]]:
        contribution = np.zeros((2, ctx.world.dp), dtype=np.int32)
        contribution[:, ctx.replica] = [ctx.replica + 1, 10]
        yield (
            AllReduce(
                step=0,
                op=Op.AGREE,
                contribution=contribution,
                result=result_ref,
                comm=Communicator.DP_CPU,
                work=work,
            ),
        )
        with pytest.raises(InterpreterError, match="has not been waited on"):
            ctx.interpreter.host_array(result_ref)
        yield (WaitWork(step=0, op=Op.AGREE, work=work),)
        tables[ctx.rank] = ctx.interpreter.host_array(result_ref)

    simulate(Layout(pp=1, dp=2), program)
    np.testing.assert_array_equal(tables[0], [[1, 2], [10, 10]])
    np.testing.assert_array_equal(tables[1], tables[0])


def test_the_next_steps_async_all_reduce_may_come_before_this_steps_last_effects() -> None:
    # purepp.rank.start_next_agreement: step 1's agreement starts during step 0's forward,
    # before step 0's relay effects; steps still never go back otherwise.
    ahead, ahead_result = WorkRef("dp.step1.work"), BufferRef("dp.step1.table")
    tables: dict[int, Int64] = {}

    def program(ctx: RankContext) -> Iterator[tuple[Effect, ...]]:
        contribution = np.zeros((1, ctx.world.dp), dtype=np.int32)
        contribution[0, ctx.replica] = ctx.replica + 1
        yield (dp_agreement(0, Communicator.DP_CPU, ctx.replica),)
        yield (
            AllReduce(
                step=1,
                op=Op.AGREE,
                contribution=contribution,
                result=ahead_result,
                comm=Communicator.DP_CPU,
                work=ahead,
            ),
        )
        yield (WaitStream(step=0, op=Op.END_STEP, stream=Stream.MAIN, waits_for=Stream.RELAY),)
        yield (WaitWork(step=1, op=Op.AGREE, work=ahead),)
        tables[ctx.rank] = ctx.interpreter.host_array(ahead_result)

    simulate(Layout(pp=1, dp=2), program)
    np.testing.assert_array_equal(tables[0], [[1, 2]])
    np.testing.assert_array_equal(tables[1], [[1, 2]])

    def back_after_the_wait(ctx: RankContext) -> Iterator[tuple[Effect, ...]]:
        yield from program(ctx)
        yield (WaitStream(step=0, op=Op.END_STEP, stream=Stream.MAIN, waits_for=Stream.RELAY),)

    with pytest.raises(InvalidInputError, match="step-0 WaitStream after a step-1 effect"):
        simulate(Layout(pp=1, dp=2), back_after_the_wait)


def test_an_async_all_reduce_never_waited_on_is_reported() -> None:
    def program(ctx: RankContext) -> Iterator[tuple[Effect, ...]]:
        if ctx.rank == 0:
            yield (
                AllReduce(
                    step=0,
                    op=Op.AGREE,
                    contribution=np.zeros((1, 2), np.int32),
                    result=BufferRef("t"),
                    comm=Communicator.DP_CPU,
                    work=WorkRef("w"),
                ),
            )

    with pytest.raises(CollectiveMismatchError) as error:
        simulate(Layout(pp=1, dp=2), program)
    report = report_of(error)
    assert isinstance(report, DeadlockReport)
    (pending,) = report.pending
    assert pending.missing == (1,)


def test_an_async_all_reduce_every_rank_posted_and_none_waited_on_is_named() -> None:
    # An overlapped loop that starts the next step's agreement during its last step too.
    def program(ctx: RankContext) -> Iterator[tuple[Effect, ...]]:
        yield (
            AllReduce(
                step=5,
                op=Op.AGREE,
                contribution=np.zeros((1, 2), np.int32),
                result=BufferRef("dp.step5.table"),
                comm=Communicator.DP_CPU,
                work=WorkRef("dp.step5.work"),
            ),
        )

    with pytest.raises(CollectiveMismatchError) as error:
        simulate(Layout(pp=1, dp=2), program)
    report = report_of(error)
    assert isinstance(report, DeadlockReport)
    assert (report.waiters, report.pending, report.finished) == ((), (), (0, 1))
    assert [(rank, effect.step) for rank, effect in report.unwaited] == [(0, 5), (1, 5)]
    lines = report.render().splitlines()
    assert "  asynchronous all-reduces never waited on:" in lines
    assert "    rank 1: work 'dp.step5.work' (step 5, agree)" in lines
    assert report.fix().startswith("complete every asynchronous all-reduce with its WaitWork")


# ---- simulate's own checks --------------------------------------------------------------


def test_steps_in_flight_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="max_steps_in_flight=0"):
        simulate(Layout(pp=1, dp=1), scripted({0: []}), max_steps_in_flight=0)


def test_a_step_must_be_a_tuple_of_effects() -> None:
    def program(ctx: RankContext) -> Iterator[tuple[Effect, ...]]:
        yield [Release(step=0, op=Op.END_STEP, buffer=BufferRef("x"))]  # type: ignore[misc]

    with pytest.raises(InvalidInputError, match="yielded list as step #0"):
        simulate(Layout(pp=1, dp=1), program)


def test_a_step_holding_a_non_effect_is_refused_naming_it() -> None:
    def program(ctx: RankContext) -> Iterator[tuple[Effect, ...]]:
        yield (Synchronize(step=0, op=Op.CONSUME, stream=Stream.MAIN),)
        yield (Synchronize(step=1, op=Op.CONSUME, stream=Stream.MAIN), "sync")  # type: ignore[misc]

    with pytest.raises(InvalidInputError) as caught:
        simulate(Layout(pp=1, dp=1), program)
    assert caught.value.call == "simulate"
    assert caught.value.problem == "rank 0's step #1 holds str, which is not an effect"
    assert caught.value.fix == "yield only effects from purepp.effects.vocabulary"


# ---- the interpreter alone ---------------------------------------------------------------


def local(make: Callable[..., Effect], **fields: object) -> Effect:
    """An effect at step 0 from Op.CONSUME, on the main stream unless told otherwise."""
    defaults: dict[str, object] = {"step": 0, "op": Op.CONSUME}
    if "stream" in inspect.signature(make).parameters:
        defaults["stream"] = Stream.MAIN
    return make(**(defaults | fields))


def test_fresh_buffers_are_poisoned_so_unwritten_data_shows() -> None:
    interpreter = NumpyInterpreter()
    interpreter.perform((local(Allocate, buffer=BufferRef("a"), shape=(2, 3), dtype=DType.INT64),))
    tensor = interpreter.tensor(BufferRef("a"))
    assert tensor.dtype == np.int64
    np.testing.assert_array_equal(tensor, np.full((2, 3), POISON))


def test_a_header_check_of_other_than_step_and_count_names_both_headers_as_lists() -> None:
    # The relay's header is [step, requests]; any other is shown as the values it holds.
    interpreter = NumpyInterpreter()
    interpreter.bind(BufferRef("h"), np.array([1, 2, 4], dtype=np.int32))
    check = CheckHeader(
        step=0, op=Op.RECEIVE, buffer=BufferRef("h"), expected=[1, 2, 3], stream=Stream.RELAY
    )
    with pytest.raises(HeaderMismatchError) as caught:
        interpreter.perform((check,))
    assert (caught.value.expected, caught.value.received) == ((1, 2, 3), (1, 2, 4))
    assert caught.value.problem == (
        "rank 0 received relay header [1, 2, 4] at step 0 but expected [1, 2, 3]: sender and "
        "receiver hold different batches for this step"
    )
    assert caught.value.fix.startswith("pass every stage the same replicated batch")


def test_pad_stack_gather_scatter() -> None:
    interpreter = NumpyInterpreter()
    interpreter.bind(BufferRef("tokens"), np.array([[1], [2], [3]], dtype=np.int64))
    interpreter.bind(BufferRef("a"), np.array([1, 2, 3], dtype=np.int32))
    interpreter.bind(BufferRef("b"), np.array([4, 5, 6], dtype=np.int32))
    target = np.zeros((4, 3), dtype=np.int64)
    interpreter.bind(BufferRef("target"), target)
    interpreter.perform(
        (
            local(
                PadColumns, source=BufferRef("tokens"), out=BufferRef("padded"), width=3, fill=-5
            ),
            local(StackRows, sources=(BufferRef("a"), BufferRef("b")), out=BufferRef("stacked")),
            local(CopyHostToDevice, source=np.array([2, 0]), buffer=BufferRef("rows")),
            local(
                GatherRows,
                source=BufferRef("padded"),
                index=BufferRef("rows"),
                out=BufferRef("gathered"),
            ),
            local(CopyHostToDevice, source=np.array([3, -1, 0]), buffer=BufferRef("slots")),
            local(
                ScatterRows,
                source=BufferRef("padded"),
                index=BufferRef("slots"),
                target=BufferRef("target"),
            ),
        )
    )
    np.testing.assert_array_equal(
        interpreter.tensor(BufferRef("padded")), [[1, -5, -5], [2, -5, -5], [3, -5, -5]]
    )
    np.testing.assert_array_equal(interpreter.tensor(BufferRef("stacked")), [[1, 2, 3], [4, 5, 6]])
    np.testing.assert_array_equal(
        interpreter.tensor(BufferRef("gathered")), [[3, -5, -5], [1, -5, -5]]
    )
    # Row 1 maps to -1 and is skipped; the caller's own array is updated in place.
    np.testing.assert_array_equal(target, [[3, -5, -5], [0, 0, 0], [0, 0, 0], [1, -5, -5]])


def test_alias_release_and_names() -> None:
    interpreter = NumpyInterpreter()
    interpreter.bind(BufferRef("x"), np.array([1, 2], dtype=np.int64))
    interpreter.perform(
        (
            local(Alias, source=BufferRef("x"), out=BufferRef("y")),
            local(Release, buffer=BufferRef("x")),
        )
    )
    np.testing.assert_array_equal(interpreter.tensor(BufferRef("y")), [1, 2])
    assert interpreter.bound_refs() == frozenset({BufferRef("y")})
    with pytest.raises(InterpreterError, match="'x' is not bound"):
        interpreter.tensor(BufferRef("x"))
    with pytest.raises(InterpreterError, match="'y' is already bound"):
        interpreter.perform((local(Alias, source=BufferRef("y"), out=BufferRef("y")),))


def test_host_arrays_are_read_only_copies() -> None:
    interpreter = NumpyInterpreter()
    interpreter.bind(BufferRef("x"), np.array([1, 2], dtype=np.int64))
    copy = interpreter.host_array(BufferRef("x"))
    assert not copy.flags.writeable
    interpreter.tensor(BufferRef("x"))[0] = 9
    assert copy[0] == 1


def test_events_are_consumed_by_their_wait() -> None:
    interpreter = NumpyInterpreter()
    event = EventRef("e")
    interpreter.perform((local(RecordEvent, stream=Stream.RELAY, event=event),))
    assert interpreter.event_completed(event)
    interpreter.perform((local(WaitEvent, stream=Stream.MAIN, event=event),))
    with pytest.raises(InterpreterError, match="already waited on"):
        interpreter.perform((local(WaitEvent, stream=Stream.MAIN, event=event),))


def test_out_of_range_rows_are_refused() -> None:
    interpreter = NumpyInterpreter()
    interpreter.bind(BufferRef("src"), np.zeros((2, 1), dtype=np.int64))
    interpreter.bind(BufferRef("idx"), np.array([0, 2], dtype=np.int32))
    with pytest.raises(InterpreterError, match="holds row 2 of a 2-row source"):
        interpreter.perform(
            (
                local(
                    GatherRows, source=BufferRef("src"), index=BufferRef("idx"), out=BufferRef("o")
                ),
            )
        )


def test_a_broadcast_must_match_its_declared_wire() -> None:
    interpreter = NumpyInterpreter()
    interpreter.bind(BufferRef("t"), np.zeros((2, 1), dtype=np.int64))
    with pytest.raises(InterpreterError, match="but the wire is int64 \\(2, 3\\)"):
        interpreter.perform(
            (
                Broadcast(
                    step=0,
                    op=Op.BROADCAST,
                    buffer=BufferRef("t"),
                    shape=(2, 3),
                    dtype=DType.INT64,
                    src=0,
                    comm=Communicator.PP_RELAY,
                    stream=Stream.RELAY,
                ),
            )
        )


def test_alone_a_rank_cannot_receive_from_another() -> None:
    interpreter = NumpyInterpreter(rank=0)
    interpreter.bind(BufferRef("t"), np.zeros(2, dtype=np.int64))
    with pytest.raises(InterpreterError, match="broadcast from rank 1"):
        interpreter.perform(
            (
                Broadcast(
                    step=0,
                    op=Op.RECEIVE,
                    buffer=BufferRef("t"),
                    shape=(2,),
                    dtype=DType.INT64,
                    src=1,
                    comm=Communicator.PP_RELAY,
                    stream=Stream.RELAY,
                ),
            )
        )


def _lone_all_reduce(table: list[list[int]]) -> AllReduce:
    return AllReduce(
        step=0,
        op=Op.AGREE,
        contribution=np.array(table),
        result=BufferRef("t"),
        comm=Communicator.DP_CPU,
        work=None,
    )


def test_alone_an_all_reduce_returns_the_contribution() -> None:
    interpreter = NumpyInterpreter()
    interpreter.perform((_lone_all_reduce([[3], [1]]),))
    np.testing.assert_array_equal(interpreter.host_array(BufferRef("t")), [[3], [1]])


def test_alone_an_all_reduce_over_a_larger_group_is_refused() -> None:
    # Summed alone, the absent rank's column would stay 0: it would look idle, and the
    # group would quietly decide for a world that does not exist.
    interpreter = NumpyInterpreter(rank=0)
    with pytest.raises(InterpreterError, match="all-reduce over a group of 2 ranks") as caught:
        interpreter.perform((_lone_all_reduce([[3, 0]]),))
    assert "lone interpreter of rank 0" in str(caught.value)
    assert "purepp.effects.simulator.simulate" in str(caught.value)


def test_the_numpy_interpreter_is_an_interpreter() -> None:
    interpreter: Interpreter = NumpyInterpreter()  # checked by mypy: the shared protocol
    interpreter.perform(())


_POSTS = st.tuples(
    st.integers(0, 2),  # rank
    st.booleans(),  # broadcast, else all-reduce
    st.integers(0, 1),  # step
    st.integers(1, 2),  # width
    st.sampled_from([0, 2, 5]),  # broadcast source (5 is outside the group)
    st.sampled_from([Op.BROADCAST, Op.RECEIVE]),
)


@settings(max_examples=200, deadline=None)
@given(posts=st.lists(_POSTS, max_size=9))
def test_the_hub_reports_exactly_what_check_posts_finds_once_the_group_posted(
    posts: list[tuple[int, bool, int, int, int, Op]],
) -> None:
    # The hub skips `check_posts` where it can prove the answer (an equal post, or one
    # differing only in what is not compared); the answer must never change. An op that
    # disagrees is raised once every member has posted it (its culprit counted over them
    # all); until then it is held, and `raise_held` raises the first held op.
    world = Layout(pp=3, dp=1)
    hub = CollectiveHub(world, call="test")
    instance = comm_instance(world, 0, Communicator.PP_RELAY)
    declared: dict[int, dict[int, Broadcast | AllReduce]] = {}  # seq -> rank -> effect
    issued = dict.fromkeys(instance.group, 0)
    for rank, is_broadcast, step, width, src, op in posts:
        effect: Broadcast | AllReduce
        if is_broadcast:
            effect = _broadcast(step, op, BufferRef("b"), (width,), src)
        else:
            effect = AllReduce(
                step=step,
                op=op,
                contribution=np.zeros((1, width), dtype=np.int32),
                result=BufferRef("t"),
                comm=Communicator.PP_RELAY,
                work=None,
            )
        seq = issued[rank]
        issued[rank] += 1
        declared.setdefault(seq, {})[rank] = effect
        signatures = {r: signature_of(e) for r, e in declared[seq].items()}
        expected = check_posts(instance, seq, signatures)
        posted = PostedCollective(rank, effect, np.zeros(width, dtype=np.int64))
        if expected is None or len(signatures) < len(instance.group):
            hub.post(posted)
            continue
        with pytest.raises(CollectiveReportError) as error:
            hub.post(posted)
        assert error.value.report == expected
        return
    held = [
        report
        for seq, effects in declared.items()
        if (report := check_posts(instance, seq, {r: signature_of(e) for r, e in effects.items()}))
    ]
    if not held:
        hub.raise_held()
        return
    with pytest.raises(CollectiveReportError) as error:
        hub.raise_held()
    assert error.value.report == min(held, key=mismatch_order)


def test_a_post_waits_for_peers_that_have_not_posted_or_are_not_at_their_streams_head() -> None:
    # The deadlock report's wait-for edges: a peer that posted the op but still has
    # earlier work on its stream blocks the op as much as one that never posted it.
    world = Layout(pp=3, dp=1)
    hub = CollectiveHub(world, call="test")
    instance = comm_instance(world, 0, Communicator.PP_RELAY)
    effect = _broadcast(0, Op.RECEIVE, BufferRef("b"), (2,), 2)
    posts = [PostedCollective(rank, effect, np.zeros(2, dtype=np.int64)) for rank in range(3)]

    def waited_peers() -> list[int]:
        edges = hub.waits_for(posts[0])
        assert all((e.rank, e.via, e.seq) == (0, instance, 0) for e in edges)
        return [e.peer for e in edges]

    hub.post(posts[0])
    posts[0].at_head = True
    hub.reach_head(posts[0])
    assert waited_peers() == [1, 2]  # neither peer has posted
    hub.post(posts[1])
    assert waited_peers() == [1, 2]  # rank 1 posted, behind earlier work on its stream
    posts[1].at_head = True
    hub.reach_head(posts[1])
    assert waited_peers() == [2]
    hub.post(posts[2])
    posts[2].at_head = True
    hub.reach_head(posts[2])
    assert all(post.done for post in posts)
