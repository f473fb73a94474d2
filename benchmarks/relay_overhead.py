"""What purity costs: the relay's receive + consume per step, three ways, side by side.

1. `pure`: the pure steps alone (consume_previous_step, receive, end_step), no device work.
2. `purepp`: the pure steps plus the torch interpreter performing their effects.
3. `imperative`: the same device work written the seed's way, directly against torch
   (a deque of pending receives, torch.empty, dist.broadcast, events, record_stream).

Both (2) and (3) run on a one-rank world (gloo on CPU, NCCL on a GPU), so the
broadcasts are real collectives with nothing on the wire: the figures isolate the host
cost of each way of issuing the same work. Reported as microseconds per step and as the
ratio purepp / imperative, measured in one run.

    python benchmarks/relay_overhead.py [--device cpu|cuda] [--rows 64] [--steps 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import deque
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from one_rank import one_rank_world

from purepp.batch import BatchFacts
from purepp.effects.torch_interpreter import (
    TorchInterpreter,
)
from purepp.effects.vocabulary import Communicator
from purepp.relay import (
    IDX_MAPPING,
    RelayConfig,
    consume_previous_step,
    end_step,
    free_request_slot,
    init_relay,
    receive,
)

SPEC = 2
PP = 2


def _batches(rows: int, steps: int, slots: int) -> list[BatchFacts]:
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(steps):
        idx = rng.permutation(slots)[:rows]
        batches.append(
            BatchFacts(
                idx_mapping=idx,
                num_computed_tokens=np.full(rows, 10),
                num_scheduled_tokens=np.full(rows, 1 + SPEC),
                prefill_len=np.full(rows, 4),
            )
        )
    return batches


def bench_pure(config: RelayConfig, batches: list[BatchFacts]) -> float:
    state = init_relay(config)
    start = time.perf_counter()
    for step, batch in enumerate(batches):
        state = consume_previous_step(config, state).state
        if step % 7 == 0:
            state = free_request_slot(config, state, int(batch.idx_mapping[0])).state
        state = receive(config, state, batch).state
        state = end_step(config, state).state
    return (time.perf_counter() - start) / len(batches)


def bench_purepp(
    config: RelayConfig, batches: list[BatchFacts], env: TorchInterpreter, sync: Callable[[], None]
) -> float:
    state = init_relay(config)
    device_idx = [torch.from_numpy(np.array(b.idx_mapping)).to(env.device) for b in batches]
    sync()
    start = time.perf_counter()
    for step, batch in enumerate(batches):
        taken = consume_previous_step(config, state)
        env.perform(taken.effects)
        state = taken.state
        if step % 7 == 0:
            state = free_request_slot(config, state, int(batch.idx_mapping[0])).state
        env.bind(IDX_MAPPING, device_idx[step])
        posted = receive(config, state, batch)
        env.perform(posted.effects)
        state = posted.state
        ended = end_step(config, state)
        env.perform(ended.effects)
        state = ended.state
    sync()
    return (time.perf_counter() - start) / len(batches)


def bench_imperative(
    batches: list[BatchFacts],
    slots: int,
    device: torch.device,
    group: dist.ProcessGroup,
    sync: Callable[[], None],
) -> float:
    cuda = device.type == "cuda"
    main = torch.cuda.current_stream(device) if cuda else None
    side = torch.cuda.Stream(device) if cuda else None
    queue: deque[tuple[object, ...] | None] = deque([None] * PP)
    generations = np.zeros(slots, dtype=np.int32)
    device_idx = [torch.from_numpy(np.array(b.idx_mapping)).to(device) for b in batches]
    handed_out: list[object] = []  # what consume hands the runner, as purepp's result does
    sync()
    start = time.perf_counter()
    for step, batch in enumerate(batches):
        handed_out.clear()
        entry = queue.popleft()
        queue.append(None)
        if entry is not None:
            event, _, _, _, idx, idx_np, mask, gens = entry
            exclude = (generations[idx_np] != gens) | ~mask
            if exclude.any():
                filtered = np.where(exclude, -1, idx_np)
                idx = (
                    torch.from_numpy(filtered).pin_memory().to(device, non_blocking=True)
                    if cuda
                    else torch.from_numpy(filtered)
                )
            handed_out.append(idx)
            if cuda:
                main.wait_event(event)  # type: ignore[union-attr, arg-type]
        if step % 7 == 0:
            generations[int(batch.idx_mapping[0])] += 1
        n = batch.num_reqs
        mask = batch.num_computed_tokens + batch.num_scheduled_tokens >= batch.prefill_len
        gens = generations[batch.idx_mapping]
        if cuda:
            side.wait_stream(main)  # type: ignore[union-attr, arg-type]
            with torch.cuda.stream(side):  # type: ignore[arg-type]
                sampled = torch.empty((n, SPEC + 1), dtype=torch.int64, device=device)
                counts = torch.empty((2, n), dtype=torch.int32, device=device)
                drafts = torch.empty((n, SPEC), dtype=torch.int64, device=device)
                for tensor in (sampled, counts, drafts):
                    dist.broadcast(tensor, src=0, group=group)
                event = side.record_event()  # type: ignore[union-attr]
            for tensor in (sampled, counts, drafts):
                tensor.record_stream(main)  # type: ignore[arg-type]
        else:
            sampled = torch.empty((n, SPEC + 1), dtype=torch.int64)
            counts = torch.empty((2, n), dtype=torch.int32)
            drafts = torch.empty((n, SPEC), dtype=torch.int64)
            for tensor in (sampled, counts, drafts):
                dist.broadcast(tensor, src=0, group=group)
            event = None
        queue[-1] = (
            event,
            sampled,
            counts,
            drafts,
            device_idx[step],
            batch.idx_mapping,
            mask,
            gens,
        )
    sync()
    return (time.perf_counter() - start) / len(batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with one_rank_world(args.device) as (device, groups):
        sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
        slots = 2 * args.rows
        # Stage 0 of a 2-stage pipeline whose "last rank" is this one rank, so the
        # broadcasts are real collectives on a one-rank group.
        config = RelayConfig(
            pp_size=PP,
            stage=0,
            last_rank=0,
            max_num_reqs=slots,
            num_speculative_steps=SPEC,
            ring_depth=PP,
        )
        batches = _batches(args.rows, args.steps, slots)
        relay_group = groups[Communicator.PP_RELAY]
        results: dict[str, list[float]] = {"pure": [], "purepp": [], "imperative": []}
        for _ in range(args.repeats):  # interleaved, so drift hits every variant alike
            results["pure"].append(bench_pure(config, batches))
            env = TorchInterpreter(device=device, groups=groups, rank=0)  # fresh names
            results["purepp"].append(bench_purepp(config, batches, env, sync))
            results["imperative"].append(
                bench_imperative(batches, slots, device, relay_group, sync)
            )
    median = {name: statistics.median(times) * 1e6 for name, times in results.items()}
    print(f"device={device} rows={args.rows} steps={args.steps} repeats={args.repeats} (median)")
    for name, micros in median.items():
        print(f"  {name:<11} {micros:8.1f} us/step")
    print(f"  purepp / imperative = {median['purepp'] / median['imperative']:.2f}")
    print(f"  pure steps share of purepp = {median['pure'] / median['purepp']:.2f}")


if __name__ == "__main__":
    main()
