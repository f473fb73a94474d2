"""Does the relay hold what it should, and no more? Memory over a long run.

A non-last stage receives every step and consumes pp_size steps later, with slots
freed along the way (some entries dropped whole). In steady state the interpreter
should hold exactly the ring's pending entries, so both the number of bound names
and the device memory stay flat however long the run. The expected ring footprint is
computed from the wire shapes: pp_size entries of sampled tokens [n, spec+1] int64,
counts [2, n] int32 and drafts [n, spec] int64.

    python -m benchmarks.relay_memory [--device cpu|cuda] [--mode eager|plan|captured]
        [--rows 64] [--steps 5000]

Prints bound names and allocated device memory (CUDA only) at several points, and
the ratio of the last to the first steady-state reading (1.00 means no growth).
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import torch

from benchmarks.one_rank import one_rank_world
from benchmarks.relay_host_cost import Mode, PureppRelay, make_interpreter
from purepp.batch import BatchFacts

SPEC = 2
PP = 4

Reading = tuple[int, int, int]  # step, names bound, bytes allocated (CUDA)


def _allocated() -> int:
    cuda: Any = torch.cuda  # the narrow stubs in typings/ leave out memory queries
    return int(cuda.memory_allocated())


def _run(relay: PureppRelay, rows: int, steps: int, device: torch.device) -> list[Reading]:
    """Run `steps` relay steps; (step, names bound, bytes allocated) at a few checkpoints."""
    cuda = device.type == "cuda"
    slots = relay.config.max_num_reqs
    rng = np.random.default_rng(0)
    checkpoints = sorted({PP * 4, steps // 4, steps // 2, steps - 1})
    readings: list[Reading] = []
    for step in range(steps):
        relay.consume()
        # Free a few slots each step, sometimes every slot of an in-flight entry.
        freed = rng.choice(slots, size=slots if step % 50 == 0 else 3, replace=False)
        relay.free(freed.tolist())
        idx = rng.permutation(slots)[:rows].astype(np.int32)
        batch = BatchFacts(
            idx_mapping=idx,
            num_computed_tokens=np.full(rows, 10),
            num_scheduled_tokens=np.full(rows, 1 + SPEC),
            prefill_len=np.full(rows, 4),
        )
        relay.receive(batch, torch.from_numpy(idx).to(device))
        relay.end()
        if step in checkpoints:
            if cuda:
                torch.cuda.synchronize()
            allocated = _allocated() if cuda else 0
            readings.append((step, relay.bound_names(), allocated))
    return readings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--mode", default="eager", choices=["eager", "plan", "captured"])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5000)
    args = parser.parse_args()
    mode: Mode = args.mode
    n = args.rows
    with one_rank_world(args.device) as (device, groups):
        env, reason = make_interpreter(mode, device, groups, PP)
        if env is None:
            raise SystemExit(f"purepp {mode} is unavailable here: {reason}")
        # Stage 0 of a pipeline whose last rank is this rank: real one-rank collectives.
        drafts = torch.zeros((2 * n, SPEC), dtype=torch.int64).to(device)
        relay = PureppRelay(
            role="receiver", pp=PP, slots=2 * n, spec=SPEC, env=env, draft_table=drafts
        )
        readings = _run(relay, n, args.steps, device)
    cuda = device.type == "cuda"
    ring_bytes = PP * (n * (SPEC + 1) * 8 + 2 * n * 4 + n * SPEC * 8 + n * 4)
    print(f"device={device} mode={mode} rows={n} pp={PP} spec={SPEC} steps={args.steps}")
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
