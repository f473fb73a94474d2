"""The torch interpreter across real processes: 2 and 3 gloo ranks (NCCL too, given GPUs).

A hand-written relay-and-agree program: the last rank broadcasts [n, k] int64 sampled
tokens (padded to the wire width) and [2, n] int32 counts on the relay communicator,
the others receive them and scatter the tokens into a slot table; meanwhile every
rank contributes its column to an asynchronous all-reduce of a 5 x dp table. Every
value is checked exactly. Then a dead peer and a stalled peer: the survivor raises
PeerFailureError instead of hanging.
"""

from __future__ import annotations

import datetime
import functools
import os
import time
from typing import TypedDict

import attrs
import numpy as np
import numpy.typing as npt
import pytest
import torch
import torch.distributed as dist

from purepp.effects.torch_interpreter import Backend, TorchInterpreter, build_communicators
from purepp.effects.vocabulary import (
    Allocate,
    AllReduce,
    Broadcast,
    BufferRef,
    Communicator,
    CopyHostToDevice,
    DType,
    Effect,
    EventRef,
    Op,
    PadColumns,
    RecordEvent,
    RecordStream,
    Release,
    ScatterRows,
    StackRows,
    Stream,
    WaitEvent,
    WaitStream,
    WaitWork,
    WorkRef,
)
from purepp.errors import PeerFailureError
from tests._dist import RankContext, run_ranks, spawn_ranks

pytestmark = pytest.mark.multiprocess

N = 4  # batch rows
SAMPLED_WIDTH = 2  # columns the sampler produced this step
WIRE_WIDTH = 3  # fixed wire width (num_speculative_steps + 1)
SLOTS = 6  # rows of the receivers' slot table
STEPS = 2
# Batch row -> slot; -1 rows were freed and must not be written.
IDX_MAPPING = np.array([4, -1, 0, 2], dtype=np.int32)

SAMPLED = BufferRef("input.sampled")
NUM_SAMPLED = BufferRef("input.num_sampled")
NUM_REJECTED = BufferRef("input.num_rejected")
SLOT_TABLE = BufferRef("input.slot_table")


class Tag(TypedDict):
    step: int
    op: Op


def sampled_tokens(step: int) -> npt.NDArray[np.int64]:
    rows, cols = np.indices((N, SAMPLED_WIDTH))
    tokens: npt.NDArray[np.int64] = (1000 * step + 10 * rows + cols).astype(np.int64)
    return tokens


def counts(step: int) -> npt.NDArray[np.int32]:
    stacked: npt.NDArray[np.int32] = np.stack(
        [np.arange(N) % 3 + 1 + step, np.arange(N) % 2]
    ).astype(np.int32)
    return stacked


def dp_column(rank: int, step: int) -> list[int]:
    """num_tokens, cudagraph mode, uniform length, max query length, num_reqs."""
    return [rank + step + 1, rank % 3, 1, -1 if rank == 0 else 2, rank]


def dp_contribution(rank: int, world: int, step: int) -> npt.NDArray[np.int32]:
    table = np.zeros((5, world), dtype=np.int32)
    table[:, rank] = dp_column(rank, step)
    return table


def names(step: int) -> tuple[BufferRef, BufferRef, BufferRef, EventRef, WorkRef]:
    prefix = f"step{step}"
    return (
        BufferRef(f"{prefix}.tokens"),
        BufferRef(f"{prefix}.counts"),
        BufferRef(f"{prefix}.dp_table"),
        EventRef(f"{prefix}.received"),
        WorkRef(f"{prefix}.agree"),
    )


def wire(buffer: BufferRef, shape: tuple[int, ...], dtype: DType, tag: Tag, src: int) -> Broadcast:
    return Broadcast(
        **tag,
        buffer=buffer,
        shape=shape,
        dtype=dtype,
        src=src,
        comm=Communicator.PP_RELAY,
        stream=Stream.RELAY,
    )


def agree(rank: int, world: int, step: int) -> AllReduce:
    _, _, table, _, work = names(step)
    return AllReduce(
        step=step,
        op=Op.AGREE,
        contribution=dp_contribution(rank, world, step),
        result=table,
        comm=Communicator.DP_CPU,
        work=work,
    )


def sender_effects(step: int, rank: int, world: int) -> tuple[Effect, ...]:
    tag = Tag(step=step, op=Op.BROADCAST)
    tokens, count_rows, _, _, work = names(step)
    return (
        WaitStream(**tag, stream=Stream.RELAY, waits_for=Stream.MAIN),
        agree(rank, world, step),
        PadColumns(
            **tag, source=SAMPLED, out=tokens, width=WIRE_WIDTH, fill=0, stream=Stream.RELAY
        ),
        wire(tokens, (N, WIRE_WIDTH), DType.INT64, tag, src=rank),
        StackRows(**tag, sources=(NUM_SAMPLED, NUM_REJECTED), out=count_rows, stream=Stream.RELAY),
        wire(count_rows, (2, N), DType.INT32, tag, src=rank),
        *(RecordStream(**tag, buffer=b, stream=Stream.RELAY) for b in (SAMPLED, NUM_SAMPLED)),
        WaitWork(**tag, work=work),
        Release(**tag, buffer=tokens),
        Release(**tag, buffer=count_rows),
    )


def receiver_effects(step: int, rank: int, world: int) -> tuple[Effect, ...]:
    tag = Tag(step=step, op=Op.RECEIVE)
    tokens, count_rows, _, received, work = names(step)
    index = BufferRef(f"step{step}.index")
    last, relay = world - 1, Stream.RELAY
    return (
        WaitStream(**tag, stream=Stream.RELAY, waits_for=Stream.MAIN),
        agree(rank, world, step),
        Allocate(**tag, buffer=tokens, shape=(N, WIRE_WIDTH), dtype=DType.INT64, stream=relay),
        Allocate(**tag, buffer=count_rows, shape=(2, N), dtype=DType.INT32, stream=relay),
        wire(tokens, (N, WIRE_WIDTH), DType.INT64, tag, src=last),
        wire(count_rows, (2, N), DType.INT32, tag, src=last),
        RecordEvent(**tag, stream=Stream.RELAY, event=received),
        *(RecordStream(**tag, buffer=b, stream=Stream.MAIN) for b in (tokens, count_rows)),
        CopyHostToDevice(**tag, source=IDX_MAPPING, buffer=index, stream=Stream.MAIN),
        WaitEvent(**tag, stream=Stream.MAIN, event=received),
        ScatterRows(**tag, source=tokens, index=index, target=SLOT_TABLE, stream=Stream.MAIN),
        WaitWork(**tag, work=work),
    )  # fmt: skip


@attrs.frozen
class StepReport:
    """What one rank saw in one step (host copies, so they pickle)."""

    tokens: list[list[int]] | None  # the received [n, wire width] tokens; None on the sender
    counts: list[list[int]] | None  # the received [2, n] counts; None on the sender
    slot_table: list[list[int]] | None  # the receiver's slot table after the scatter
    dp_table: list[list[int]]  # the reduced 5 x dp table


@attrs.frozen
class RankReport:
    steps: tuple[StepReport, ...]  # one per step
    left_bound: tuple[str, ...]  # names still bound at the end
    planned: int  # batches run by a plan (plans mode)


def relay_and_agree(ctx: RankContext, mode: str = "fast", steps: int = STEPS) -> RankReport:
    """`mode`: fast, checked or plans (the interpreter's modes give the same results)."""
    world, rank = ctx.world_size, ctx.rank
    everyone = list(range(world))
    groups = build_communicators(
        pp_groups=[everyone], dp_groups=[everyone], relay_backend=ctx.backend, timeout=ctx.timeout
    )
    interp = TorchInterpreter(
        device=ctx.device,
        groups=groups,
        rank=rank,
        checked=mode == "checked",
        plans=mode == "plans",
    )
    is_sender = rank == world - 1
    if not is_sender:
        interp.bind(SLOT_TABLE, torch.full((SLOTS, WIRE_WIDTH), -7, device=ctx.device))
    reports: list[StepReport] = []
    for step in range(steps):
        tokens, count_rows, dp_table, _, _ = names(step)
        if is_sender:
            interp.bind(SAMPLED, torch.from_numpy(sampled_tokens(step)).to(ctx.device))
            num_sampled, num_rejected = torch.from_numpy(counts(step)).to(ctx.device).unbind(0)
            interp.bind(NUM_SAMPLED, num_sampled)
            interp.bind(NUM_REJECTED, num_rejected)
            interp.perform(sender_effects(step, rank, world))
            reports.append(StepReport(None, None, None, interp.host_array(dp_table).tolist()))
        else:
            interp.perform(receiver_effects(step, rank, world))
            resolved = interp.resolve((tokens, count_rows, SLOT_TABLE))
            tokens_seen, counts_seen, table_seen = (resolved[f"[{i}]"].cpu() for i in range(3))
            reports.append(
                StepReport(
                    tokens_seen.tolist(),
                    counts_seen.tolist(),
                    table_seen.tolist(),
                    interp.host_array(dp_table).tolist(),
                )
            )
            tag = Tag(step=step, op=Op.CONSUME)
            index = BufferRef(f"step{step}.index")
            interp.perform(tuple(Release(**tag, buffer=b) for b in (tokens, count_rows, index)))
        interp.perform((Release(step=step, op=Op.AGREE, buffer=dp_table),))
    planned = 0 if interp.planner is None else interp.planner.planned
    return RankReport(
        tuple(reports), tuple(sorted(ref.name for ref in interp.bound_refs())), planned
    )


def expected_slot_table(last_step: int) -> list[list[int]]:
    table = np.full((SLOTS, WIRE_WIDTH), -7, dtype=np.int64)
    for step in range(last_step + 1):
        padded = np.pad(sampled_tokens(step), ((0, 0), (0, WIRE_WIDTH - SAMPLED_WIDTH)))
        for row, slot in enumerate(IDX_MAPPING):
            if slot != -1:
                table[slot] = padded[row]
    out: list[list[int]] = table.tolist()
    return out


def _layouts() -> list[object]:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [
        pytest.param("gloo", 2, id="gloo-2"),
        pytest.param("gloo", 3, id="gloo-3"),
        *(
            pytest.param(
                "nccl",
                world,
                id=f"nccl-{world}",
                marks=[
                    pytest.mark.gpu,
                    pytest.mark.skipif(gpus < world, reason=f"needs {world} GPUs"),
                ],
            )
            for world in (2, 3)
        ),
    ]


@pytest.mark.parametrize(("backend", "world"), _layouts())
def test_relay_broadcasts_and_async_agreement_arrive_exactly(backend: Backend, world: int) -> None:
    reports = run_ranks(
        relay_and_agree, world, backend=backend, timeout=datetime.timedelta(seconds=20)
    )
    check_reports(reports, world)


@pytest.mark.parametrize("mode", ["checked", "plans"])
def test_checked_and_planned_ranks_see_what_fast_ones_see(mode: str) -> None:
    steps = 4  # plans run from each structure's second step
    reports = run_ranks(
        functools.partial(relay_and_agree, mode=mode, steps=steps),
        2,
        backend="gloo",
        timeout=datetime.timedelta(seconds=20),
    )
    check_reports(reports, 2)
    if mode == "plans":
        assert all(report.planned >= steps - 1 for report in reports)


def check_reports(reports: list[RankReport], world: int) -> None:
    for rank, report in enumerate(reports):
        for step, seen in enumerate(report.steps):
            reduced = np.array([dp_column(r, step) for r in range(world)], dtype=np.int32).T
            assert seen.dp_table == reduced.tolist(), (rank, step)
            if rank == world - 1:
                continue
            padded = np.pad(sampled_tokens(step), ((0, 0), (0, WIRE_WIDTH - SAMPLED_WIDTH)))
            assert seen.tokens == padded.tolist(), (rank, step)
            assert seen.counts == counts(step).tolist(), (rank, step)
            assert seen.slot_table == expected_slot_table(step), (rank, step)
        caller_bound = (
            ("input.num_rejected", "input.num_sampled", "input.sampled")
            if rank == world - 1
            else ("input.slot_table",)
        )
        assert report.left_bound == caller_bound, rank


# ---- a dead or stalled peer makes the survivor fail, not hang ------------------------------


def _relay_broadcast(step: int) -> Broadcast:
    return wire(BufferRef("probe"), (2, 3), DType.INT64, Tag(step=step, op=Op.RECEIVE), src=1)


def dies_before_broadcast(ctx: RankContext) -> str:
    groups = build_communicators(
        pp_groups=[[0, 1]], dp_groups=[[0, 1]], relay_backend="gloo", timeout=ctx.timeout
    )
    interp = TorchInterpreter(device=ctx.device, groups=groups, rank=ctx.rank)
    interp.bind(BufferRef("probe"), torch.zeros((2, 3), dtype=torch.int64))
    dist.barrier()  # both ranks have finished connecting every group
    if ctx.rank == 1:
        os._exit(0)  # gone without a word, as a crashed worker would be
    interp.perform((_relay_broadcast(0),))
    return "the broadcast completed without its source"


def test_a_dead_peer_makes_the_survivor_raise_peer_failure() -> None:
    survivor, dead = spawn_ranks(
        dies_before_broadcast, 2, timeout=datetime.timedelta(seconds=5), deadline_s=40.0
    )
    assert (dead.returned, dead.error, dead.exitcode) == (False, None, 0)
    assert survivor.error is not None, survivor
    assert survivor.error.type_name == "PeerFailureError"
    assert "Broadcast step=0 op=receive" in survivor.error.message
    assert "communicator pp_relay failed on rank 0" in survivor.error.message


def stalls_past_the_timeout(ctx: RankContext) -> list[str]:
    groups = build_communicators(
        pp_groups=[[0, 1]], dp_groups=[[0, 1]], relay_backend="gloo", timeout=ctx.timeout
    )
    interp = TorchInterpreter(device=ctx.device, groups=groups, rank=ctx.rank)
    interp.bind(BufferRef("probe"), torch.zeros((2, 3), dtype=torch.int64))
    if ctx.rank == 1:
        # Alive but silent (stuck in a compile, say) for longer than both collectives wait.
        time.sleep(3 * ctx.timeout.total_seconds())
        return []
    failures: list[str] = []
    try:
        interp.perform((_relay_broadcast(0),))
    except PeerFailureError as error:
        failures.append(str(error))
    try:
        interp.perform((agree(0, 2, 1), WaitWork(step=1, op=Op.AGREE, work=names(1)[4])))
    except PeerFailureError as error:
        failures.append(str(error))
    return failures


def test_a_stalled_peer_makes_the_survivor_raise_peer_failure() -> None:
    survivor, _ = run_ranks(
        stalls_past_the_timeout, 2, timeout=datetime.timedelta(seconds=2), deadline_s=40.0
    )
    assert len(survivor) == 2, survivor
    broadcast_failure, agreement_failure = survivor
    assert "Broadcast step=0" in broadcast_failure
    assert "communicator pp_relay" in broadcast_failure
    assert "step=1 op=agree" in agreement_failure
    assert "communicator dp_cpu" in agreement_failure


def test_spawn_helper_reports_a_failing_rank_with_its_traceback() -> None:
    outcomes = spawn_ranks(functools.partial(_fail_on_rank, 1), 2)
    assert [o.ok for o in outcomes] == [True, False]
    error = outcomes[1].error
    assert error is not None
    assert error.type_name == "ValueError"
    assert "rank 1 refuses" in error.traceback


def _fail_on_rank(failing: int, ctx: RankContext) -> int:
    # Every rank has finished connecting before one exits: a rank that raised at once
    # could close its gloo pairs while a peer's connect was still in flight.
    dist.barrier()
    if ctx.rank == failing:
        raise ValueError(f"rank {ctx.rank} refuses")
    return ctx.rank
