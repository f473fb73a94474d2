"""The collective matcher over whole per-rank effect sequences (what `purepp check` runs)."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from purepp.effects.matching import (
    CollectiveKind,
    CollectiveReportError,
    CollectiveSignature,
    CommInstance,
    MismatchClass,
    MismatchField,
    MismatchReport,
    StageAgreements,
    WaitEdge,
    check_posts,
    comm_group,
    find_wait_cycle,
    match_collectives,
    signature_of,
)
from purepp.effects.vocabulary import (
    Allocate,
    AllReduce,
    Broadcast,
    BufferRef,
    Communicator,
    DType,
    Effect,
    EventRef,
    Op,
    RecordEvent,
    Stream,
)
from purepp.errors import CollectiveMismatchError, InvalidInputError
from purepp.layout import Layout
from tests.strategies import collective_schedules

ROWS = 4  # requests in every step's batch
WIRE_WIDTH = 3  # num_speculative_steps + 1: the fixed wire width of sampled tokens


def relay_broadcast(step: int, *, src: int, width: int = WIRE_WIDTH, op: Op) -> Broadcast:
    return Broadcast(
        step=step,
        op=op,
        buffer=BufferRef(f"tokens.{step}"),
        shape=(ROWS, width),
        dtype=DType.INT64,
        src=src,
        comm=Communicator.PP_RELAY,
        stream=Stream.RELAY,
    )


def draft_broadcast(step: int, *, src: int, op: Op) -> Broadcast:
    return Broadcast(
        step=step,
        op=op,
        buffer=BufferRef(f"drafts.{step}"),
        shape=(ROWS, WIRE_WIDTH - 1),
        dtype=DType.INT64,
        src=src,
        comm=Communicator.PP_RELAY,
        stream=Stream.RELAY,
    )


def agreement(step: int, *, dp: int, column: int, tokens: int = 0) -> AllReduce:
    table = np.zeros((5, dp), dtype=np.int32)
    table[0, column] = tokens
    return AllReduce(
        step=step,
        op=Op.AGREE,
        contribution=table,
        result=BufferRef(f"dp.table.{step}"),
        comm=Communicator.DP_CPU,
        work=None,
    )


def relay_world(pp: int, steps: int, *, plain_step: int | None = None) -> dict[int, list[Effect]]:
    """One pipeline: the last stage broadcasts each step, the others post the receives.

    At `plain_step` the sender forgets to pad (FIELD_FAILURES row 1): [n, 1] goes out.
    """
    sender = pp - 1
    per_rank: dict[int, list[Effect]] = {}
    for rank in range(pp):
        effects: list[Effect] = []
        for step in range(steps):
            if rank == sender:
                width = 1 if step == plain_step else WIRE_WIDTH
                effects.append(relay_broadcast(step, src=sender, width=width, op=Op.BROADCAST))
            else:
                buffer = BufferRef(f"tokens.{step}")
                effects += [
                    Allocate(
                        step=step,
                        op=Op.RECEIVE,
                        buffer=buffer,
                        shape=(ROWS, WIRE_WIDTH),
                        dtype=DType.INT64,
                        stream=Stream.RELAY,
                    ),
                    relay_broadcast(step, src=sender, op=Op.RECEIVE),
                    RecordEvent(
                        step=step, op=Op.RECEIVE, stream=Stream.RELAY, event=EventRef(f"e{step}")
                    ),
                ]
        per_rank[rank] = effects
    return per_rank


# ---- communicator instances ------------------------------------------------------------


def test_groups_follow_the_layout() -> None:
    world = Layout(pp=2, dp=3)
    # Rank 3 is stage 1 of replica 1.
    assert comm_group(world, 3, Communicator.PP_RELAY) == (2, 3)
    assert comm_group(world, 3, Communicator.PP_CPU) == (2, 3)
    assert comm_group(world, 3, Communicator.DP_CPU) == (1, 3, 5)
    assert comm_group(world, 4, Communicator.DP_CPU) == (0, 2, 4)


# ---- agreement -------------------------------------------------------------------------


@pytest.mark.parametrize("pp", [1, 2, 3])
def test_a_fixed_relay_schedule_matches(pp: int) -> None:
    assert match_collectives(relay_world(pp, steps=5), Layout(pp=pp, dp=1)) is None


def test_local_effects_do_not_count() -> None:
    world = relay_world(2, steps=3)
    # Drop every non-collective effect on one rank: the collective sequences still match.
    world[0] = [e for e in world[0] if isinstance(e, Broadcast | AllReduce)]
    assert match_collectives(world, Layout(pp=2, dp=1)) is None


# ---- FIELD_FAILURES row 1: [n, 1] sent, [n, spec + 1] posted ------------------------------


def test_sender_width_mismatch_is_reported_at_the_op_that_diverged() -> None:
    report = match_collectives(relay_world(3, steps=5, plain_step=2), Layout(pp=3, dp=1))

    assert report is not None
    assert report.rank == 0  # the first receiver, compared with the sender
    assert report.peer == 2
    assert report.comm is Communicator.PP_RELAY
    assert report.group == (0, 1, 2)
    assert report.seq == 2  # one broadcast per step: the third op on pp_relay
    assert (report.step, report.op) == (2, Op.RECEIVE)
    assert report.expected.shape == (ROWS, WIRE_WIDTH)
    assert report.received is not None
    assert report.received.shape == (ROWS, 1)
    assert report.received.op is Op.BROADCAST
    assert report.differing == (MismatchField.SHAPE,)
    # Both receivers posted the padded width: the sender is the odd one out.
    assert (report.classification, report.culprit) == (MismatchClass.SIZE, 2)
    assert report.fix().startswith("derive wire shapes and dtypes from static configuration")


def test_stages_relaying_batches_of_different_rows_are_told_to_share_the_batch() -> None:
    world = relay_world(2, steps=3)
    sent = world[1][1]
    assert isinstance(sent, Broadcast)
    world[1][1] = attrs.evolve(sent, shape=(ROWS - 1, WIRE_WIDTH))  # the sender's batch is short
    report = match_collectives(world, Layout(pp=2, dp=1))

    assert report is not None
    assert report.differing == (MismatchField.SHAPE,)
    assert report.fix().startswith("pass every stage of a pipeline the same BatchFacts")
    assert "RelayConfig(validate_header=True)" in report.fix()
    # Another width is not a batch mismatch: the padding one stays (FIELD_FAILURES row 1).
    other = match_collectives(relay_world(2, steps=3, plain_step=1), Layout(pp=2, dp=1))
    assert other is not None
    assert other.fix().startswith("derive wire shapes and dtypes from static configuration")


def test_two_ranks_that_disagree_name_no_culprit() -> None:
    # One sender and one receiver: the posts cannot tell which of the two is wrong.
    report = match_collectives(relay_world(2, steps=5, plain_step=2), Layout(pp=2, dp=1))
    assert report is not None
    assert (report.rank, report.peer, report.classification) == (0, 1, MismatchClass.SIZE)
    assert report.culprit is None
    assert report.render().endswith("  mismatch: size; culprit: none (as many ranks on each side)")


def test_the_report_renders_both_sides() -> None:
    report = match_collectives(relay_world(3, steps=5, plain_step=2), Layout(pp=3, dp=1))
    assert report is not None
    assert report.render() == (
        "Collective mismatch: op #2 on pp_relay (ranks 0, 1, 2)\n"
        "  rank 0 expected broadcast [4, 3] int64 from rank 2 (step 2, receive)\n"
        "  rank 2 posted   broadcast [4, 1] int64 from rank 2 (step 2, broadcast)\n"
        "  they differ in: shape\n"
        "  NCCL does not compare these: the run would hang or corrupt data.\n"
        "  mismatch: size; culprit: rank 2"
    )


def test_the_error_carries_the_report() -> None:
    report = match_collectives(relay_world(2, steps=2, plain_step=0), Layout(pp=2, dp=1))
    assert report is not None
    error = CollectiveReportError.from_report("purepp check", report)
    assert isinstance(error, CollectiveMismatchError)
    assert error.report is report
    assert str(error).startswith("purepp check: Collective mismatch: op #0 on pp_relay")


# ---- FIELD_FAILURES row 10: an idle rank skips the agreement -----------------------------


def test_an_idle_rank_that_skips_the_agreement_is_reported_at_that_step() -> None:
    dp, steps, idle_step = 2, 6, 2
    per_rank: dict[int, list[Effect]] = {
        rank: [
            agreement(step, dp=dp, column=rank, tokens=3)
            for step in range(steps)
            if not (rank == 1 and step == idle_step)  # returns early when it has no work
        ]
        for rank in range(dp)
    }
    report = match_collectives(per_rank, Layout(pp=1, dp=dp))

    assert report is not None
    assert (report.rank, report.peer, report.seq) == (1, 0, idle_step)
    assert report.comm is Communicator.DP_CPU
    assert report.differing == (MismatchField.STEP,)
    assert report.expected.step == idle_step + 1  # rank 1's op #2 is already the next step's
    assert report.received is not None
    assert report.received.step == idle_step


def test_an_idle_rank_that_contributes_zeros_matches() -> None:
    dp = 3
    per_rank: dict[int, list[Effect]] = {
        rank: [
            agreement(step, dp=dp, column=rank, tokens=0 if rank == 1 else 5) for step in range(4)
        ]
        for rank in range(dp)
    }
    assert match_collectives(per_rank, Layout(pp=1, dp=dp)) is None


# ---- FIELD_FAILURES rows 3/4: a data-dependent draft broadcast --------------------------


def test_a_draft_broadcast_the_receiver_does_not_post_is_reported() -> None:
    # The sender broadcasts drafts every step; the receiver decides it needs none at step 1.
    sender: list[Effect] = []
    receiver: list[Effect] = []
    for step in range(4):
        sender += [
            relay_broadcast(step, src=1, op=Op.BROADCAST),
            draft_broadcast(step, src=1, op=Op.BROADCAST_DRAFTS),
        ]
        receiver.append(relay_broadcast(step, src=1, op=Op.RECEIVE))
        if step != 1:
            receiver.append(draft_broadcast(step, src=1, op=Op.RECEIVE))
    report = match_collectives({0: receiver, 1: sender}, Layout(pp=2, dp=1))

    assert report is not None
    assert (report.rank, report.peer, report.seq) == (0, 1, 3)
    assert report.expected == signature_of(relay_broadcast(2, src=1, op=Op.RECEIVE))
    assert report.received == signature_of(draft_broadcast(1, src=1, op=Op.BROADCAST_DRAFTS))
    assert report.differing == (MismatchField.STEP, MismatchField.SHAPE)


# ---- could not make progress: a collective no peer posts ---------------------------------


def test_a_collective_no_peer_ever_posts_is_reported_with_the_waiting_rank() -> None:
    dp = 2
    per_rank: dict[int, list[Effect]] = {
        rank: [agreement(step, dp=dp, column=rank) for step in range(3)] for rank in range(dp)
    }
    per_rank[0].append(agreement(3, dp=dp, column=0))
    report = match_collectives(per_rank, Layout(pp=1, dp=dp))

    assert report is not None
    assert (report.rank, report.seq, report.step, report.op) == (0, 3, 3, Op.AGREE)
    assert report.received is None
    assert report.peer is None
    assert report.missing == (1,)
    assert report.differing == ()
    assert "rank(s) 1 never posted op #3 on dp_cpu" in report.render()


def test_a_rank_that_never_posts_on_a_communicator_is_missing() -> None:
    per_rank: dict[int, list[Effect]] = {0: [agreement(0, dp=2, column=0)], 1: []}
    report = match_collectives(per_rank, Layout(pp=1, dp=2))
    assert report is not None
    assert (report.rank, report.seq, report.missing) == (0, 0, (1,))


# ---- other disagreements -------------------------------------------------------------


def test_a_source_outside_the_group_is_reported() -> None:
    # Replica 1 is ranks 2, 3; rank 3 names replica 0's last stage as the source.
    per_rank: dict[int, list[Effect]] = {
        0: [relay_broadcast(0, src=1, op=Op.RECEIVE)],
        1: [relay_broadcast(0, src=1, op=Op.BROADCAST)],
        2: [relay_broadcast(0, src=3, op=Op.RECEIVE)],
        3: [relay_broadcast(0, src=1, op=Op.BROADCAST)],
    }
    report = match_collectives(per_rank, Layout(pp=2, dp=2))
    assert report is not None
    assert (report.rank, report.group, report.differing) == (3, (2, 3), (MismatchField.SRC,))
    assert report.peer is None
    assert report.classification is MismatchClass.SOURCE
    assert report.render().startswith("Broadcast source outside its group: op #0")
    assert "rank 1 is not a member of pp_relay" in report.render()
    # The likely cause: a replica's relay configured without its first rank.
    assert report.fix().startswith("broadcast from a member of the group; a relay's source")
    assert "RelayConfig.for_stage(first_rank=...)" in report.fix()


def test_a_broadcast_against_an_all_reduce_differs_in_kind() -> None:
    broadcast = Broadcast(
        step=0,
        op=Op.AGREE,
        buffer=BufferRef("t"),
        shape=(5, 2),
        dtype=DType.INT32,
        src=0,
        comm=Communicator.DP_CPU,
        stream=Stream.MAIN,
    )
    per_rank: dict[int, list[Effect]] = {0: [broadcast], 1: [agreement(0, dp=2, column=1)]}
    report = match_collectives(per_rank, Layout(pp=1, dp=2))
    assert report is not None
    assert report.rank == 1
    assert report.differing == (MismatchField.KIND, MismatchField.SRC)


def test_the_earliest_step_is_reported_when_several_groups_disagree() -> None:
    # Two DP groups (stage 0: ranks 0, 2; stage 1: ranks 1, 3), each with a skip.
    world = Layout(pp=2, dp=2)
    skips = {2: 3, 3: 1}  # rank -> step it skips
    per_rank: dict[int, list[Effect]] = {
        rank: [
            agreement(step, dp=2, column=world.dp_index(rank))
            for step in range(5)
            if skips.get(rank) != step
        ]
        for rank in range(4)
    }
    report = match_collectives(per_rank, world)
    assert report is not None
    assert (report.group, report.rank, report.seq) == ((1, 3), 3, 1)


# ---- stage divergence: the columns of one replica's stages ---------------------------


def stage_table(table: list[list[int]], comm: Communicator = Communicator.DP_CPU) -> AllReduce:
    """A contribution to step 3's agreement, its table named as no purepp lane names it."""
    return AllReduce(
        step=3,
        op=Op.AGREE,
        contribution=np.array(table, dtype=np.int32),
        result=BufferRef("table"),
        comm=comm,
        work=None,
    )


@pytest.mark.parametrize(
    ("comm", "lane"),
    [(Communicator.DP_CPU, "target"), (Communicator.DP_DRAFTER_CPU, "drafter")],
)
def test_stage_tables_that_differ_outside_the_replicas_column_are_shown_whole(
    comm: Communicator, lane: str
) -> None:
    # Replica 0's stages agree on its column (0) but not on replica 1's.
    stages = StageAgreements(Layout(pp=2, dp=2))
    assert stages.post(0, stage_table([[1, 7]], comm)) is None
    report = stages.post(1, stage_table([[1, 8]], comm))

    assert report is not None
    assert report.differing == ()
    # The table's name says no lane: the communicator's own lane is named.
    assert report.lane == lane
    assert report.render().splitlines()[:4] == [
        f"Stage divergence: replica 0 (ranks 0, 1), step 3, {lane} lane (all_reduce on "
        f"{comm.value}, agree)",
        "  rank 0 (stage 0) contributed row 0=1",
        "  rank 1 (stage 1) contributed row 0=1",
        "  their tables differ outside column 0: rank 0 [[1, 7]]; rank 1 [[1, 8]]",
    ]


def test_stage_tables_too_narrow_to_hold_the_replicas_column_show_an_empty_one() -> None:
    # One column in a world of two replicas: replica 1's is not in the tables at all.
    stages = StageAgreements(Layout(pp=2, dp=2))
    assert stages.post(2, stage_table([[1]])) is None
    assert stages.post(3, stage_table([[2]])) is None  # held: replica 0 may diverge first
    report = stages.held

    assert report is not None
    assert [column.column for column in report.columns] == [(), ()]
    assert report.render().splitlines()[1:4] == [
        "  rank 2 (stage 0) contributed column []",
        "  rank 3 (stage 1) contributed column []",
        "  their tables differ outside column 1: rank 2 [[1]]; rank 3 [[2]]",
    ]


def test_every_rank_needs_a_sequence() -> None:
    with pytest.raises(InvalidInputError, match=r"every rank 0\.\.1"):
        match_collectives({0: []}, Layout(pp=1, dp=2))


def test_online_checks_need_only_the_posts_so_far() -> None:
    instance = CommInstance(comm=Communicator.PP_RELAY, group=(0, 1, 2))
    receiver = signature_of(relay_broadcast(0, src=2, op=Op.RECEIVE))
    sender = signature_of(relay_broadcast(0, src=2, width=1, op=Op.BROADCAST))
    assert check_posts(instance, 0, {}) is None
    assert check_posts(instance, 0, {0: receiver, 1: receiver}) is None
    report = check_posts(instance, 0, {0: receiver, 2: sender})
    assert isinstance(report, MismatchReport)
    assert (report.rank, report.peer) == (0, 2)


def test_signatures_describe_themselves() -> None:
    signature = CollectiveSignature(
        kind=CollectiveKind.ALL_REDUCE,
        comm=Communicator.DP_CPU,
        shape=(5, 2),
        dtype=DType.INT32,
        src=None,
        step=7,
        op=Op.AGREE,
    )
    assert signature == signature_of(agreement(7, dp=2, column=0))
    assert signature.describe() == "all_reduce [5, 2] int32 (step 7, agree)"


# ---- laws ------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(schedule=collective_schedules(), data=st.data())
def test_identical_schedules_match_and_any_dropped_op_is_found_where_it_was_dropped(
    schedule: tuple[Layout, dict[int, list[Effect]]], data: st.DataObject
) -> None:
    world, per_rank = schedule
    assert match_collectives(per_rank, world) is None

    rank = data.draw(st.sampled_from([r for r in per_rank if per_rank[r]]), label="rank")
    index = data.draw(st.integers(0, len(per_rank[rank]) - 1), label="index")
    dropped = per_rank[rank][index]
    assert isinstance(dropped, Broadcast | AllReduce)
    assume(len(comm_group(world, rank, dropped.comm)) > 1)  # a group of one always agrees
    seq = sum(
        1
        for e in per_rank[rank][:index]
        if isinstance(e, Broadcast | AllReduce) and e.comm is dropped.comm
    )
    per_rank[rank] = per_rank[rank][:index] + per_rank[rank][index + 1 :]

    report = match_collectives(per_rank, world)
    assert report is not None
    assert report.comm is dropped.comm
    assert rank in report.group
    assert report.seq == seq  # at most one op per communicator per step: the next one differs
    assert rank in (report.rank, report.peer, *report.missing)


# ---- classification (fr_trace's categories) and wait-for cycles ----------------------------


def test_a_count_mismatch_blames_the_member_that_never_posted() -> None:
    per_rank: dict[int, list[Effect]] = {
        0: [agreement(0, dp=2, column=0), agreement(1, dp=2, column=0)],
        1: [agreement(0, dp=2, column=1)],
    }
    report = match_collectives(per_rank, Layout(pp=1, dp=2))
    assert report is not None
    assert (report.classification, report.culprit, report.missing) == (
        MismatchClass.MISSING_RANK,
        1,
        (1,),
    )
    assert report.render().endswith("  mismatch: missing rank; culprit: rank 1")
    assert report.render().startswith("Unmatched collective: op #1")
    assert report.fix().startswith("make every member issue this collective at the same step")


def test_drafter_lane_ops_match_among_the_dp_ranks() -> None:
    world = Layout(pp=2, dp=2)
    assert comm_group(world, 3, Communicator.DP_DRAFTER_CPU) == (1, 3)
    assert comm_group(world, 3, Communicator.DP_DRAFTER_CPU) == comm_group(
        world, 3, Communicator.DP_CPU
    )


def edge(rank: int, peer: int, comm: Communicator | None = Communicator.DP_CPU) -> WaitEdge:
    via = None if comm is None else CommInstance(comm=comm, group=(0, 1, 2))
    return WaitEdge(rank=rank, via=via, seq=None if comm is None else 0, peer=peer)


def test_a_wait_for_cycle_is_found_round_the_loop() -> None:
    edges = [edge(0, 1), edge(1, 2, Communicator.PP_RELAY), edge(2, 0, None)]
    cycle = find_wait_cycle(edges)
    assert cycle is not None
    assert cycle.edges == tuple(edges)
    assert cycle.render() == (
        "rank 0 -> dp_cpu op #0 -> rank 1 -> pp_relay op #0 -> rank 2 -> (steps in flight)"
        " -> rank 0"
    )


def test_a_chain_that_ends_at_a_rank_waiting_for_nobody_is_no_cycle() -> None:
    assert find_wait_cycle([edge(0, 1), edge(1, 2), edge(2, 2)]) is None
    assert find_wait_cycle([]) is None


def test_the_cycle_found_is_the_loop_not_the_path_into_it() -> None:
    cycle = find_wait_cycle([edge(0, 1), edge(1, 2), edge(2, 1)])
    assert cycle is not None
    assert cycle.ranks == (1, 2)
