"""Does the relay hold what it should, and no more? Memory over a long run.

A non-last stage receives every step and consumes pp_size steps later, with slots
freed along the way (some entries dropped whole). In steady state the interpreter
should hold exactly the ring's pending entries, so both the number of bound names
and the device memory stay flat however long the run. The expected ring footprint is
computed from the wire shapes: pp_size entries of sampled tokens [n, spec+1] int64,
counts [2, n] int32 and drafts [n, spec] int64.

    python benchmarks/relay_memory.py [--device cpu|cuda] [--rows 64] [--steps 5000]

Prints bound names and allocated device memory (CUDA only) at several points, and
the ratio of the last to the first steady-state reading (1.00 means no growth).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from one_rank import one_rank_world

from purepp.batch import BatchFacts
from purepp.effects.torch_interpreter import (
    TorchInterpreter,
)
from purepp.relay import (
    IDX_MAPPING,
    RelayConfig,
    consume_previous_step,
    end_step,
    free_request_slots,
    init_relay,
    receive,
)

SPEC = 2
PP = 4


def _run(env: TorchInterpreter, rows: int, steps: int, cuda: bool) -> list[tuple[int, int, int]]:
    """Run `steps` relay steps; (step, names bound, bytes allocated) at a few checkpoints."""
    device = env.device
    slots = 2 * rows
    # Stage 0 of a pipeline whose last rank is this rank: real one-rank collectives.
    config = RelayConfig(
        pp_size=PP,
        stage=0,
        last_rank=0,
        max_num_reqs=slots,
        num_speculative_steps=SPEC,
        ring_depth=PP,
    )
    state = init_relay(config)
    rng = np.random.default_rng(0)
    checkpoints = sorted({PP * 4, steps // 4, steps // 2, steps - 1})
    readings: list[tuple[int, int, int]] = []
    for step in range(steps):
        taken = consume_previous_step(config, state)
        env.perform(taken.effects)
        state = taken.state
        # Free a few slots each step, sometimes every slot of an in-flight entry.
        freed = rng.choice(slots, size=slots if step % 50 == 0 else 3, replace=False)
        state = free_request_slots(config, state, freed).state
        idx = rng.permutation(slots)[:rows]
        batch = BatchFacts(
            idx_mapping=idx,
            num_computed_tokens=np.full(rows, 10),
            num_scheduled_tokens=np.full(rows, 1 + SPEC),
            prefill_len=np.full(rows, 4),
        )
        env.bind(IDX_MAPPING, torch.from_numpy(idx.astype(np.int32)).to(device))
        posted = receive(config, state, batch)
        env.perform(posted.effects)
        state = posted.state
        ended = end_step(config, state)
        env.perform(ended.effects)
        state = ended.state
        if step in checkpoints:
            if cuda:
                torch.cuda.synchronize()
            allocated = torch.cuda.memory_allocated() if cuda else 0
            readings.append((step, len(env.bound_refs()), allocated))
    return readings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5000)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    with one_rank_world(args.device) as (device, groups):
        env = TorchInterpreter(device=device, groups=groups, rank=0)
        readings = _run(env, args.rows, args.steps, cuda)
    n = args.rows
    ring_bytes = PP * (n * (SPEC + 1) * 8 + 2 * n * 4 + n * SPEC * 8 + n * 4)
    print(f"device={device} rows={n} pp={PP} spec={SPEC} steps={args.steps}")
    print(f"  expected ring footprint: {ring_bytes} bytes ({PP} entries, with slot mappings)")
    for step, names, allocated in readings:
        memory = f", {allocated} bytes allocated" if cuda else ""
        print(f"  step {step:>6}: {names} names bound{memory}")
    first, last = readings[0], readings[-1]
    print(f"  bound names last/first = {last[1] / first[1]:.2f}")
    if cuda:
        print(f"  allocated last/first = {last[2] / first[2]:.2f}")


if __name__ == "__main__":
    main()
