"""The DP agreement overlapped with a forward: the wait it still exposes, per step.

A 2-process gloo world on CPU (one DP group of two single-stage ranks) runs the rank
step (`purepp.rank.RankDriver`) with a toy forward between the agreement and the
relay's finish: a spin of a fixed length (`--forward spin`, default), float32 matmuls
sized to that length (`--forward matmul`), or a sleep (`--forward sleep`: the host
blocked on a device, as with a GPU forward, leaving the CPU to gloo's threads). Each
step runs one of two ways:

- **sync**: `agree` (a synchronous all-reduce), then the forward. The all-reduce is
  all exposed: its whole time is on the step's critical path.
- **overlap**: `settle` this step's agreement (started during the step before), start
  the next step's (`start_next`, asynchronous all-reduce), then the forward; the only
  wait left is the `WaitWork` at the next settle.

First the all-reduce's own latency L is measured alone: the time to perform the
synchronous AllReduce with no forward between steps (the median over the steps; both
ranks take the larger of their two medians). The forward is then 0.5 L, 1 L and 2 L
(`--ratios`). The two ways alternate in `--rounds` rounds per case, so a change in
the machine's load hits both alike. Per case the table gives medians over the steps
of rank 0 (each run's first steps left out as warm-up): the exposed
wait (sync: the AllReduce; overlap: the WaitWork, and apart the cost of issuing the
asynchronous AllReduce) and the exposed wait as a share of L. The target: exposed
<= 10% of L when the forward is at least L long.

gloo's all-reduce progresses on its own threads, so on a CPU it needs a free core
while the forward runs: on a machine with fewer free cores than 2 ranks x (forward +
gloo thread) a spinning forward starves it, and the wait stays exposed. L and the
machine's load are printed with the table.

Run: python benchmarks/dp_overlap.py [--steps 400] [--rounds 4] [--ratios 0.5,1,2]
     [--forward spin|matmul|sleep]
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import torch
import torch.distributed as dist

from purepp.batch import BatchFacts
from purepp.cudagraph import CaptureMode, CudaGraphDispatcher
from purepp.dp import AgreementGroup
from purepp.effects.io import TorchIO
from purepp.effects.torch_interpreter import (
    TorchInterpreter,
    build_communicators,
    init_distributed,
)
from purepp.effects.vocabulary import AllReduce, Effect, WaitWork
from purepp.rank import RankConfig, RankDriver, Sampled, ShapeFacts, init_rank
from purepp.relay import RelayConfig

TIMEOUT = datetime.timedelta(seconds=60)
WORLD = 2
ROWS = 4  # decode rows per step on each rank
WARM_UP = 10  # steps of each run left out of every figure


@attrs.frozen
class Case:
    """One line of the table (rank 0's medians, in microseconds)."""

    ratio: float  # forward length / L
    forward_us: float  # the forward's length
    sync_exposed_us: float  # sync: time in the AllReduce (all of it exposed)
    overlap_wait_us: float  # overlap: time blocked in the WaitWork
    overlap_wait_p90_us: float  # its 90th percentile
    overlap_issue_us: float  # overlap: time to issue the asynchronous AllReduce
    sync_step_us: float  # whole step, sync
    overlap_step_us: float  # whole step, overlap


class TimedPerform:
    """Performs effects on the interpreter; times the tuples holding an AllReduce or a
    WaitWork (the agreement's phases yield each alone)."""

    def __init__(self, inner: TorchInterpreter) -> None:
        self.inner = inner
        self.reduce_s: list[float] = []
        self.wait_s: list[float] = []

    def perform(self, effects: tuple[Effect, ...], /) -> None:
        start = time.perf_counter()
        self.inner.perform(effects)
        elapsed = time.perf_counter() - start
        if any(isinstance(e, WaitWork) for e in effects):
            self.wait_s.append(elapsed)
        elif any(isinstance(e, AllReduce) for e in effects):
            self.reduce_s.append(elapsed)

    def reset(self) -> None:
        self.reduce_s.clear()
        self.wait_s.clear()


def _batch(step: int) -> BatchFacts:
    return BatchFacts(
        idx_mapping=np.arange(ROWS, dtype=np.int32),
        num_computed_tokens=np.full(ROWS, 10 + step, dtype=np.int32),
        num_scheduled_tokens=np.ones(ROWS, dtype=np.int32),
        prefill_len=np.full(ROWS, 5, dtype=np.int32),
    )


SHAPE = ShapeFacts(num_tokens=ROWS, uniform_token_count=1, max_query_len=1)


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _matmul_forward(seconds: float) -> Callable[[], None]:
    """float32 64 x 64 matmuls, their count calibrated to take `seconds` (BLAS releases
    the GIL, as a framework's forward does)."""
    a = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32) / 8
    start = time.perf_counter()
    x = a
    for _ in range(200):
        x = np.tanh(x @ a)
    per = (time.perf_counter() - start) / 200
    count = max(1, round(seconds / per))

    def forward() -> None:
        y = a
        for _ in range(count):
            y = np.tanh(y @ a)

    return forward


class Rank:
    def __init__(self, rank: int, groups: Any) -> None:
        self.interpreter = TorchInterpreter(device=torch.device("cpu"), groups=groups, rank=rank)
        self.timed = TimedPerform(self.interpreter)
        dispatcher = CudaGraphDispatcher(
            capture_sizes=(1, 2, 4, 8, 16),
            capture_mode=CaptureMode.FULL_AND_PIECEWISE,
            max_num_reqs=8,
        )
        self.config = RankConfig(
            relay=RelayConfig.for_stage(pp_size=1, stage=0, max_num_reqs=8, first_rank=rank),
            group=AgreementGroup(dp_size=WORLD, dp_rank=rank),
            dispatcher=dispatcher,
        )
        self.sampled = Sampled(
            tokens=torch.zeros((ROWS, 1), dtype=torch.int64),
            num_sampled=torch.ones(ROWS, dtype=torch.int32),
            num_rejected=torch.zeros(ROWS, dtype=torch.int32),
        )

    def fresh(self) -> RankDriver[torch.Tensor]:
        """A driver for one run from step 0 (a driver takes its own states only)."""
        return RankDriver(self.config, self.timed, TorchIO(self.interpreter))

    def run_sync(self, steps: int, forward: Callable[[], None]) -> list[float]:
        driver, state = self.fresh(), init_rank(self.config)
        step_s = []
        for step in range(steps):
            start = time.perf_counter()
            begun = driver.begin(state)
            agreed = driver.agree(begun, _batch(step), SHAPE)
            forward()
            state = driver.finish(agreed, self.sampled)
            step_s.append(time.perf_counter() - start)
        return step_s

    def run_overlap(self, steps: int, forward: Callable[[], None]) -> list[float]:
        driver, state = self.fresh(), init_rank(self.config)
        step_s = []
        for step in range(steps):
            start = time.perf_counter()
            begun = driver.begin(state)
            if begun.agreeing is None:
                begun = driver.start(begun, _batch(step), SHAPE)
            agreed = driver.settle(begun)
            if step + 1 < steps:
                agreed = driver.start_next(agreed, _batch(step + 1), SHAPE)
            forward()
            state = driver.finish(agreed, self.sampled)
            step_s.append(time.perf_counter() - start)
        return step_s


def _median_us(values: Sequence[float]) -> float:
    return statistics.median(values) * 1e6


def _p90_us(values: Sequence[float]) -> float:
    kept = sorted(values)
    return kept[int(0.9 * (len(kept) - 1))] * 1e6


def _forward(kind: str, seconds: float) -> Callable[[], None]:
    if kind == "spin":
        return lambda: _spin(seconds)
    if kind == "sleep":
        return lambda: time.sleep(seconds)
    return _matmul_forward(seconds)


def _rank_main(rank: int, store: str, args: argparse.Namespace, results: Any) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    init_distributed(
        backend="gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD,
        timeout=TIMEOUT,
    )
    try:
        groups = build_communicators(
            pp_groups=[[0], [1]], dp_groups=[[0, 1]], relay_backend="gloo", timeout=TIMEOUT
        )
        me = Rank(rank, groups)
        me.run_sync(args.steps, lambda: None)
        own = torch.tensor([_median_us(me.timed.reduce_s[WARM_UP:])], dtype=torch.float64)
        dist.all_reduce(own, op=dist.ReduceOp.MAX)
        latency_us = float(own.item())
        per_round = args.steps // args.rounds
        cases = []
        for ratio in args.ratios:
            seconds = ratio * latency_us * 1e-6
            forward = _forward(args.forward, seconds)
            figures: dict[str, list[float]] = {
                "sync_steps": [],
                "sync_reduce": [],
                "overlap_steps": [],
                "overlap_wait": [],
                "overlap_issue": [],
            }
            for _ in range(args.rounds):
                me.timed.reset()
                figures["sync_steps"] += me.run_sync(per_round, forward)[WARM_UP:]
                figures["sync_reduce"] += me.timed.reduce_s[WARM_UP:]
                me.timed.reset()
                figures["overlap_steps"] += me.run_overlap(per_round, forward)[WARM_UP:]
                figures["overlap_wait"] += me.timed.wait_s[WARM_UP:]
                figures["overlap_issue"] += me.timed.reduce_s[WARM_UP:]
            cases.append(
                Case(
                    ratio=ratio,
                    forward_us=seconds * 1e6,
                    sync_exposed_us=_median_us(figures["sync_reduce"]),
                    overlap_wait_us=_median_us(figures["overlap_wait"]),
                    overlap_wait_p90_us=_p90_us(figures["overlap_wait"]),
                    overlap_issue_us=_median_us(figures["overlap_issue"]),
                    sync_step_us=_median_us(figures["sync_steps"]),
                    overlap_step_us=_median_us(figures["overlap_steps"]),
                )
            )
        if rank == 0:
            results.put((latency_us, cases))
    finally:
        dist.destroy_process_group()


def _table(latency_us: float, cases: Sequence[Case], args: argparse.Namespace) -> str:
    lines = [
        f"DP agreement overlapped with a {args.forward} forward: 2 gloo ranks on CPU, "
        f"{args.steps} steps per case and way in {args.rounds} alternating rounds "
        f"({WARM_UP} warm-up steps of each left out), medians of rank 0",
        f"all-reduce latency alone (sync AllReduce, no forward): L = {latency_us:.1f} us; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
        "",
        "forward      | sync: exposed  | overlap: wait (p90)    issue "
        "| exposed/L | step sync -> overlap",
    ]
    for c in cases:
        share = 100 * c.overlap_wait_us / latency_us
        lines.append(
            f"{c.ratio:4.1f} L {c.forward_us:5.0f} us | {c.sync_exposed_us:8.1f} us"
            f"    | {c.overlap_wait_us:6.1f} us ({c.overlap_wait_p90_us:6.1f})"
            f" {c.overlap_issue_us:5.1f} us"
            f" | {share:6.1f} %  | {c.sync_step_us:6.0f} -> {c.overlap_step_us:6.0f} us"
        )
    lines += [
        "",
        "exposed/L: the overlap's WaitWork median over L (target <= 10% when forward >= L)",
        "command: python " + " ".join(sys.argv),
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="steps per case and way")
    parser.add_argument(
        "--ratios",
        type=lambda text: [float(x) for x in text.split(",")],
        default=[0.5, 1.0, 2.0],
        help="forward lengths as multiples of L, comma-separated",
    )
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds per case")
    parser.add_argument("--forward", choices=("spin", "matmul", "sleep"), default="spin")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps // args.rounds <= WARM_UP:
        parser.error(f"each of --rounds needs more than {WARM_UP} of --steps")
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "store")
        ranks = [
            context.Process(target=_rank_main, args=(rank, store, args, results))
            for rank in range(WORLD)
        ]
        for process in ranks:
            process.start()
        latency_us, cases = results.get(timeout=600)
        for process in ranks:
            process.join(timeout=60)
    print(_table(latency_us, cases, args))
    return 0 if all(p.exitcode == 0 for p in ranks) else 1


if __name__ == "__main__":
    sys.exit(main())
