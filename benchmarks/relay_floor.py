"""Host cost of each torch call a relay step is made of: the floor under every contender.

Each call is timed alone (perf_counter around `--calls` calls, median of `--rounds`),
on the one-rank world of the other benchmarks (NCCL on one GPU, gloo on CPU), so the
relay figures of benchmarks/relay_host_cost.py can be read as sums of these.

    python -m benchmarks.relay_floor [--device cpu|cuda] [--calls 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.one_rank import one_rank_world
from purepp.effects.torch_kernels import scatter_rows, section_view
from purepp.effects.vocabulary import BufferRef, Communicator, DType, Section


def timed(call: Callable[[], object], calls: int, rounds: int, sync: Callable[[], None]) -> float:
    """Median µs per call."""
    for _ in range(50):
        call()
    sync()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) / calls)
        sync()
    return statistics.median(times) * 1e6


def cuda_calls(
    device: torch.device,
    group: dist.ProcessGroup,
    options: dist.BroadcastOptions,
    tensors: dict[str, torch.Tensor],
    host: npt.NDArray[np.int32],
) -> dict[str, Callable[[], object]]:
    """The stream, event, staging and graph calls (CUDA only)."""
    n = host.shape[0]
    tokens, index, table, drafts = (tensors[k] for k in ("tokens", "index", "table", "drafts"))
    side = torch.cuda.Stream(device)
    main = torch.cuda.current_stream(device)
    event = torch.cuda.Event()
    staging = index.clone()

    def switch() -> None:
        torch.cuda.set_stream(side)
        torch.cuda.set_stream(main)

    def pinned_h2d() -> None:
        buffer = torch.empty(n, dtype=torch.int32, pin_memory=True)
        buffer.numpy()[...] = host
        staging.copy_(buffer, non_blocking=True)

    graph = torch.cuda.CUDAGraph()
    slots = {"index": index.clone(), "drafts": drafts.clone()}
    with torch.cuda.graph(graph):
        scatter_rows(slots["drafts"], slots["index"], table, skips=True)
    one = torch.cuda.CUDAGraph()
    loose: Any = tokens  # the stubs leave out add_
    with torch.cuda.graph(one):
        loose.add_(1)
    current: Any = torch.cuda.current_stream  # the stubs leave out its device
    # What a captured send replays: a pad and the NCCL broadcast of its result.
    padded: dict[str, torch.Tensor] = {"out": F.pad(tokens[:, :1], (0, 3), value=0)}
    # Eagerly first: NCCL sets up the communicator on its first call, which a capture
    # cannot contain.
    _wait(group.broadcast([padded["out"]], options))
    torch.cuda.synchronize()
    send = torch.cuda.CUDAGraph()
    with torch.cuda.graph(send, capture_error_mode="thread_local"):
        padded["out"] = F.pad(tokens[:, :1], (0, 3), value=0)
        _wait(group.broadcast([padded["out"]], options))
    return {
        "torch.cuda.Event()": torch.cuda.Event,
        "event.record(stream)": lambda: event.record(side),
        "stream.wait_event(event)": lambda: main.wait_event(event),
        "stream.wait_stream(stream)": lambda: side.wait_stream(main),
        "tensor.record_stream(stream)": lambda: tokens.record_stream(side),
        "torch.cuda.set_stream x2": switch,
        "torch.cuda.current_stream()": lambda: current(device),
        "pinned staging + copy_ [64] int32": pinned_h2d,
        "graph.replay() of one kernel": one.replay,
        "graph.replay() of scatter_rows with skips (3 kernels)": graph.replay,
        "graph.replay() of a pad + NCCL broadcast": send.replay,
    }


def scatter_by_change(source: torch.Tensor, index: torch.Tensor, target: torch.Tensor) -> None:
    """The skipping scatter as purepp wrote it before 63e96fa, kept as the baseline of
    today's `scatter_rows`: each kept row adds its change to its slot, a skipped row (-1)
    adds zero to slot 0 (six kernels, where the spare-row write takes three)."""
    keep = index != -1
    rows = index.clamp(min=0)
    delta = (source - target.index_select(0, rows)) * keep.view(-1, *([1] * (source.ndim - 1)))
    target.index_add_(0, rows, delta)


def _wait(work: dist.Work | None) -> None:
    """Wait for `work`; a blocking NCCL call returns None, having ordered the stream."""
    if work is not None:
        work.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.device == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with one_rank_world(args.device) as (device, groups):
        cuda = device.type == "cuda"
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        group = groups[Communicator.PP_RELAY]
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        blocking = dist.BroadcastOptions()  # as dist.broadcast and purepp issue it
        blocking.rootRank, blocking.rootTensor, blocking.asyncOp = 0, 0, False
        n = 64
        wire = torch.zeros(n * 4, dtype=torch.int64, device=device)
        tokens = torch.zeros((n, 4), dtype=torch.int64, device=device)
        index = torch.arange(n, dtype=torch.int32, device=device)
        table = torch.zeros((2 * n, 3), dtype=torch.int64, device=device)
        drafts = torch.zeros((n, 3), dtype=torch.int64, device=device)
        staged = torch.zeros((n, 4), dtype=torch.int64, device=device)  # a capture's static input
        host = np.arange(n, dtype=np.int32)
        # Three inputs of one dtype staged into a graph's buffers (a sender's counts, say).
        sources = [torch.ones(n, dtype=torch.int32, device=device) for _ in range(3)]
        targets = [torch.zeros(n, dtype=torch.int32, device=device) for _ in range(3)]

        def copy_each() -> None:
            for target, source in zip(targets, sources, strict=True):
                target.copy_(source, non_blocking=True)

        section = Section(buffer=BufferRef("s"), offset=64, shape=(n,), dtype=DType.INT32)
        calls: dict[str, Callable[[], object]] = {
            "torch.empty [64, 4] int64": lambda: torch.empty(
                (n, 4), dtype=torch.int64, device=device
            ),
            # What the torch interpreter's Allocate calls (since ef36043).
            "torch.empty_strided of the same": lambda: torch.empty_strided(
                (n, 4), (4, 1), dtype=torch.int64, device=device
            ),
            "ProcessGroup.broadcast(...).wait() [256] int64": lambda: _wait(
                group.broadcast([wire], options)
            ),
            "ProcessGroup.broadcast, asyncOp=False [256] int64": lambda: _wait(
                group.broadcast([wire], blocking)
            ),
            "dist.broadcast [256] int64": lambda: dist.broadcast(wire, 0, group=group),
            # Into another tensor: a copy onto itself is skipped by torch, costing nothing.
            "copy_ device to device [64, 4]": lambda: staged.copy_(tokens, non_blocking=True),
            "section_view (int32 of an int64 wire)": lambda: section_view(wire, section),
            "scatter_rows [64, 3] into [128, 3]": lambda: scatter_rows(
                drafts, index, table, skips=True
            ),
            "scatter_rows, skips=False [64, 3] into [128, 3]": lambda: scatter_rows(
                drafts, index.clamp(min=0), table, skips=False
            ),
            "the same scatter by each row's change (before 63e96fa)": lambda: scatter_by_change(
                drafts, index, table
            ),
            "copy_ x3, [64] int32 each": copy_each,
            "torch._foreach_copy_ of the same three": lambda: torch._foreach_copy_(
                targets, sources, non_blocking=True
            ),
            "torch.from_numpy(host).to(device) [64] int32": lambda: torch.from_numpy(host).to(
                device, non_blocking=True
            ),
        }
        if cuda:
            tensors = {"tokens": tokens, "index": index, "table": table, "drafts": drafts}
            calls |= cuda_calls(device, group, blocking, tensors, host)  # as purepp captures
        print(f"device={device} torch={version('torch')}: host µs per call, median")
        print()
        print("| call | µs |")
        print("| --- | --- |")
        for name, call in calls.items():
            print(f"| {name} | {timed(call, args.calls, args.rounds, sync):.2f} |")


if __name__ == "__main__":
    main()
