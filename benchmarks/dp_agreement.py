"""DP agreement host cost: purepp's pure decision against the seed's written with torch ops.

Two figures per case (dp in {2, 8, 64}, graph and eager branches):

- **finish**: the decision after the all-reduce. purepp's `finish_agreement` over the
  reduced numpy table against the seed's post-all-reduce logic of
  `sync_cudagraph_and_dp_padding`, re-expressed below with torch ops on a `[5, dp]`
  int32 tensor (`seed_decide`).
- **whole**: one rank's whole agreement. purepp: build the `RankBatch`,
  `start_agreement`, perform its `AllReduce`, `finish_agreement`. The seed: dispatch the
  desired descriptor, `torch.zeros(5, dp)`, fill this rank's column, `dist.all_reduce`,
  decide (`seed_whole`). Both all-reduce over the same one-rank gloo group with the same
  `dist.all_reduce` call; since one rank's all-reduce sums only its own column, both
  first add the other ranks' columns (one add on each side), so the decision is the
  one a real dp-rank group reaches. `--no-collective` leaves the all-reduce out on both
  sides (the host logic alone).

Both sides use the same `CudaGraphDispatcher`. Rounds are interleaved (every case and
both ways inside each round); the figures are the best and the median of the rounds,
in microseconds per agreement, and the ratio seed / purepp (> 1: purepp is faster).

Run: python benchmarks/dp_agreement.py [--rounds 7] [--iters 2000] [--no-collective]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist

from purepp.cudagraph import (
    BatchExecutionDescriptor,
    CaptureMode,
    CudaGraphDispatcher,
    CUDAGraphMode,
)
from purepp.dp import (
    AgreementGroup,
    AgreementLanes,
    RankBatch,
    agree_across_ranks,
    finish_agreement,
    start_agreement,
)
from purepp.effects.vocabulary import AllReduce

DISPATCHER = CudaGraphDispatcher(
    capture_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
    capture_mode=CaptureMode.FULL_AND_PIECEWISE,
    max_num_reqs=256,
    num_speculative_tokens=1,
)
RANK = 1  # the rank whose cost is measured


@dataclass(frozen=True)
class SeedSync:
    """The seed's DPSyncState (a tensor field, as in the seed)."""

    num_tokens_across_dp: torch.Tensor
    uniform_token_count: int | None
    eager: bool
    num_reqs: int


def seed_decide(
    manager: CudaGraphDispatcher,
    desired: BatchExecutionDescriptor,
    tensor: torch.Tensor,
    *,
    num_tokens: int,
    num_reqs: int,
    num_active_loras: int,
) -> tuple[BatchExecutionDescriptor, SeedSync | None]:
    """The seed's logic after its all-reduce, with torch ops on the reduced tensor."""
    tokens_across = tensor[0]
    modes_across = tensor[1]
    uniforms_across = tensor[2]
    query_lens_across = tensor[3]
    reqs_across = tensor[4]
    first = int(uniforms_across[0])
    uniform: int | None = first
    if first == 0 or not torch.all(uniforms_across == first):
        uniform = None
    if torch.all(tokens_across == 0).item():
        idle = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=0, num_reqs=0)
        return idle, None
    mode = CUDAGraphMode(int(modes_across.min().item()))
    if mode == CUDAGraphMode.NONE:
        eager = BatchExecutionDescriptor(
            cg_mode=CUDAGraphMode.NONE,
            num_tokens=num_tokens,
            num_reqs=num_reqs,
            num_active_loras=desired.num_active_loras,
        )
        most_reqs = int(reqs_across.max().item())
        return eager, SeedSync(tokens_across, uniform, True, most_reqs)
    most_tokens = int(tokens_across.max().item())
    query_len: int | None = None
    if bool(torch.all(query_lens_across != -1).item()):
        query_len = int(query_lens_across.max().item())
    graph = manager.dispatch(
        num_reqs, most_tokens, uniform, num_active_loras=num_active_loras, max_query_len=query_len
    )
    tokens_across[:] = graph.num_tokens
    padded_reqs = (
        graph.num_reqs
        if graph.cg_mode == CUDAGraphMode.FULL and graph.num_reqs is not None
        else int(reqs_across.max().item())
    )
    return graph, SeedSync(tokens_across, uniform, False, padded_reqs)


def seed_desired(manager: CudaGraphDispatcher, shape: RankBatch) -> BatchExecutionDescriptor:
    """The seed's descriptor before the agreement: eager (no dispatch) when forced."""
    if shape.need_eager:
        return BatchExecutionDescriptor(
            cg_mode=CUDAGraphMode.NONE,
            num_tokens=shape.num_tokens,
            num_reqs=shape.num_reqs,
            num_active_loras=shape.num_active_loras,
        )
    return manager.dispatch(
        shape.num_reqs,
        shape.num_tokens,
        shape.uniform_token_count,
        num_active_loras=shape.num_active_loras,
        max_query_len=shape.max_query_len,
    )


def seed_whole(
    manager: CudaGraphDispatcher,
    shape: RankBatch,
    dp_size: int,
    others: npt.NDArray[np.int32],
    group: Any,
) -> tuple[BatchExecutionDescriptor, SeedSync | None]:
    """The seed's whole agreement on one rank: dispatch (eager when forced), table,
    all-reduce, decide."""
    desired = seed_desired(manager, shape)
    tensor = torch.zeros(5, dp_size, dtype=torch.int32, device="cpu")
    tensor[0][RANK] = shape.num_tokens
    tensor[1][RANK] = desired.cg_mode.value
    tensor[2][RANK] = shape.uniform_token_count or 0
    tensor[3][RANK] = shape.max_query_len or -1
    tensor[4][RANK] = shape.num_reqs
    # The other ranks' columns, what a dp-rank all-reduce would add: one numpy add, as
    # purepp's side does (torch's add_ costs 0.5 µs more, charged to no seed step).
    table = tensor.numpy()
    np.add(table, others, out=table)
    if group is not None:
        dist.all_reduce(tensor, group=group)
    return seed_decide(
        manager,
        desired,
        tensor,
        num_tokens=shape.num_tokens,
        num_reqs=shape.num_reqs,
        num_active_loras=shape.num_active_loras,
    )


def batches_for(dp_size: int, branch: str) -> list[RankBatch]:
    """Every rank decodes 4 requests of 2 tokens; for `eager`, rank 0 is forced eager."""
    batches = [
        RankBatch(num_reqs=4, num_tokens=8, uniform_token_count=2, max_query_len=2)
        for _ in range(dp_size)
    ]
    if branch == "eager":
        batches[0] = RankBatch(num_reqs=3, num_tokens=6, need_eager=True)
    return batches


@dataclass
class Case:
    """One measured case: the closures of both ways, for finish and whole."""

    name: str
    ways: dict[str, Callable[[], object]]


def make_case(dp_size: int, branch: str, group: Any) -> Case:
    batches = batches_for(dp_size, branch)
    shape = batches[RANK]
    agreement = AgreementGroup(dp_size=dp_size, dp_rank=RANK)
    lanes = AgreementLanes()
    # The other ranks' columns, from their own starts.
    others_np = np.zeros((5, dp_size), dtype=np.int32)
    for rank, b in enumerate(batches):
        if rank != RANK:
            g = AgreementGroup(dp_size=dp_size, dp_rank=rank)
            (effect,) = start_agreement(lanes, g, DISPATCHER, b, step=7).effects
            assert isinstance(effect, AllReduce)
            others_np += effect.contribution
    started = start_agreement(lanes, agreement, DISPATCHER, shape, step=7)
    (all_reduce,) = started.effects
    assert isinstance(all_reduce, AllReduce)
    reduced_np = all_reduce.contribution + others_np
    reduced_t = torch.from_numpy(reduced_np.copy())
    desired = seed_desired(DISPATCHER, shape)
    # Check both ways decide alike before timing them.
    ours = finish_agreement(started.state, started.result, reduced_np).result
    theirs, their_sync = seed_decide(
        DISPATCHER,
        desired,
        reduced_t.clone(),
        num_tokens=shape.num_tokens,
        num_reqs=shape.num_reqs,
        num_active_loras=0,
    )
    assert ours.descriptor == theirs, (ours, theirs)
    assert ours == agree_across_ranks(DISPATCHER, batches)[RANK]
    assert ours.sync is not None
    assert their_sync is not None
    assert ours.sync.num_tokens_across_dp.tolist() == their_sync.num_tokens_across_dp.tolist()
    assert ours.sync.eager == (branch == "eager") == their_sync.eager

    buffer_t = torch.zeros(5, dp_size, dtype=torch.int32)
    buffer_np = buffer_t.numpy()  # shares memory with buffer_t

    def purepp_finish() -> object:
        return finish_agreement(started.state, started.result, reduced_np)

    def seed_finish() -> object:
        return seed_decide(
            DISPATCHER,
            desired,
            reduced_t,
            num_tokens=shape.num_tokens,
            num_reqs=shape.num_reqs,
            num_active_loras=0,
        )

    def purepp_whole() -> object:
        rank_batch = RankBatch(
            num_reqs=shape.num_reqs,
            num_tokens=shape.num_tokens,
            uniform_token_count=shape.uniform_token_count,
            max_query_len=shape.max_query_len,
            need_eager=shape.need_eager,
        )
        begun = start_agreement(lanes, agreement, DISPATCHER, rank_batch, step=7)
        effect = begun.effects[0]
        assert isinstance(effect, AllReduce)
        # Perform the AllReduce: this rank's column plus the others' (see the docstring).
        np.add(effect.contribution, others_np, out=buffer_np)
        if group is not None:
            dist.all_reduce(buffer_t, group=group)
        return finish_agreement(begun.state, begun.result, buffer_np)

    def seed_whole_way() -> object:
        return seed_whole(DISPATCHER, shape, dp_size, others_np, group)

    return Case(
        name=f"dp={dp_size:<3} {branch:<5}",
        ways={
            "finish/purepp": purepp_finish,
            "finish/seed": seed_finish,
            "whole/purepp": purepp_whole,
            "whole/seed": seed_whole_way,
        },
    )


def time_once(fn: Callable[[], object], iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--no-collective", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    group = None
    if not args.no_collective:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
        group = dist.new_group([0], backend="gloo")
    cases = [make_case(dp, branch, group) for dp in (2, 8, 64) for branch in ("graph", "eager")]
    samples: dict[tuple[str, str], list[float]] = {}
    for case in cases:  # warm up every way once
        for fn in case.ways.values():
            time_once(fn, max(args.iters // 10, 1))
    for _ in range(args.rounds):
        for case in cases:
            for way, fn in case.ways.items():
                samples.setdefault((case.name, way), []).append(time_once(fn, args.iters))
    collective = "no collective" if group is None else "one-rank gloo all_reduce on both sides"
    print(
        f"DP agreement host cost, us per agreement ({collective}); best / median of "
        f"{args.rounds} interleaved rounds x {args.iters}; ratio = seed / purepp"
    )
    header = (
        f"{'case':<12} {'figure':<7} {'purepp':>15} {'seed':>15} {'ratio best':>11} {'median':>7}"
    )
    print(header)
    for case in cases:
        for figure in ("finish", "whole"):
            ours = samples[(case.name, f"{figure}/purepp")]
            theirs = samples[(case.name, f"{figure}/seed")]
            best_o, best_t = min(ours), min(theirs)
            med_o, med_t = statistics.median(ours), statistics.median(theirs)
            print(
                f"{case.name:<12} {figure:<7} {best_o:>6.1f} / {med_o:>6.1f} "
                f"{best_t:>6.1f} / {med_t:>6.1f} {best_t / best_o:>10.2f}x {med_t / med_o:>6.2f}x"
            )
    if group is not None:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
