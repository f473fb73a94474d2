"""Interpreter host cost per relay step: eager, checked, plan and captured, side by side.

The effects come from purepp's real pure relay steps (consume_previous_step, free,
receive, broadcast_sampled, broadcast_drafts, end_step), driven the way a rank drives
them, and are recorded once with the caller's bindings in between. Each mode then
performs the same recording on a fresh `TorchInterpreter` in a one-rank world (gloo
on CPU, NCCL on one GPU, so every broadcast is a real collective with nothing on the
wire): the figure is the host time of `bind` + `perform` per step, without the pure
steps. The first `--warm` steps of each round are not timed (plans are lowered and
graphs captured there); on CUDA the device is synchronised only between rounds.

Cases: both roles, n in {8, 64, 256}, spec in {0, 3}; a slot freed every 7 steps, a
plain-sampler step ([n, 1] sampled tokens) every third step.

    python -m benchmarks.interpreter_modes [--device cpu|cuda] [--steps N] [--rounds R]
        [--persistent-inputs]

`--persistent-inputs`: one tensor per input and shape is bound for the whole run instead
of a fresh tensor every step, so a captured step reads its inputs in place rather than
copying them into the graph's buffers. It measures what that staging costs; a real
caller binds fresh tensors (the relay holds its inputs past the step, README).

On CUDA the table also gives, for the captured mode, the host time spent inside the
graph launches per step (each instance's launch wrapped in a timer): the rest of the
captured figure is the replay around them (choosing an instance, staging inputs,
switching streams, binding names).

`time_actions` is the hook other benchmarks use: it times any recorded effect program.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import numpy as np
import torch
import torch.distributed as dist

from benchmarks.one_rank import one_rank_world
from purepp.batch import BatchFacts
from purepp.effects import capture
from purepp.effects.torch_interpreter import TorchInterpreter
from purepp.effects.vocabulary import BufferRef, Communicator, DType, Effect, TensorSpec
from purepp.relay import (
    RelayConfig,
    RelayState,
    broadcast_drafts,
    broadcast_sampled,
    consume_previous_step,
    end_step,
    free_request_slots,
    init_relay,
    receive,
)
from purepp.step import Step

FREE_EVERY = 7
PLAIN_EVERY = 3
SLOTS = 512

# A recorded program: the caller's bindings and the effect batches, in order.
Bind: TypeAlias = tuple[BufferRef, torch.Tensor]
Action: TypeAlias = Bind | tuple[Effect, ...]
Make: TypeAlias = Callable[[], TorchInterpreter]


def record_relay(
    role: str, rows: int, spec: int, steps: int, device: torch.device
) -> tuple[list[Action], list[int]]:
    """The actions of `steps` relay steps of one rank, and where each step starts."""
    config = RelayConfig(
        pp_size=2,
        stage=1 if role == "sender" else 0,
        last_rank=0,  # a one-rank world: this rank is the source whichever stage it plays
        max_num_reqs=SLOTS,
        num_speculative_steps=spec,
    )
    inputs = config.inputs
    state = init_relay(config)
    rng = np.random.default_rng(rows * 10 + spec)
    actions: list[Action] = []
    starts: list[int] = []
    if spec:
        table = torch.zeros((SLOTS, spec), dtype=torch.int64, device=device)
        actions.append((inputs.draft_table, table))

    def take(step: Step[RelayState, Any]) -> None:
        nonlocal state
        state = step.state
        if step.effects:
            actions.append(step.effects)

    for step in range(steps):
        starts.append(len(actions))
        slots = rng.permutation(SLOTS)[:rows].astype(np.int32)
        facts = BatchFacts(
            idx_mapping=slots,
            num_computed_tokens=np.full(rows, 10, dtype=np.int32),
            num_scheduled_tokens=np.full(rows, 1 + spec, dtype=np.int32),
            prefill_len=np.full(rows, 4, dtype=np.int32),
        )
        if role == "receiver":
            take(consume_previous_step(config, state, update_drafts=spec > 0))
        if step % FREE_EVERY == 0:
            take(free_request_slots(config, state, [int(slots[0])]))
        actions.append((inputs.idx_mapping, torch.from_numpy(slots).to(device)))
        if role == "receiver":
            take(receive(config, state, facts))
        else:
            width = 1 if step % PLAIN_EVERY == PLAIN_EVERY - 1 else spec + 1
            tokens = rng.integers(0, 1000, size=(rows, width), dtype=np.int64)
            actions.append((inputs.sampled_tokens, torch.from_numpy(tokens).to(device)))
            counts = torch.ones(rows, dtype=torch.int32, device=device)
            actions.append((inputs.num_sampled, counts))
            actions.append((inputs.num_rejected, torch.zeros_like(counts)))
            sampled = TensorSpec(shape=(rows, width), dtype=DType.INT64)
            take(broadcast_sampled(config, state, facts, sampled))
            if spec:
                drafts = TensorSpec(shape=(SLOTS, spec), dtype=DType.INT64)
                take(broadcast_drafts(config, state, facts, drafts))
        take(end_step(config, state))
    return actions, starts


def persistent_inputs(actions: Sequence[Action]) -> list[Action]:
    """`actions` with every binding of an input replaced by the first tensor bound to that
    name with that shape (the values go stale, which host timing does not see; see the
    module's note on `--persistent-inputs`)."""
    first: dict[tuple[BufferRef, tuple[int, ...]], torch.Tensor] = {}
    out: list[Action] = []
    for action in actions:
        if isinstance(action[0], BufferRef):
            ref, tensor = action
            out.append((ref, first.setdefault((ref, tuple(tensor.shape)), tensor)))
        else:
            out.append(action)
    return out


def perform(interp: TorchInterpreter, actions: Sequence[Action]) -> None:
    for action in actions:
        if isinstance(action[0], BufferRef):
            ref, tensor = action
            interp.bind(ref, tensor)
        else:
            interp.perform(action)


def time_actions(
    make: Make,
    actions: Sequence[Action],
    starts: Sequence[int],
    *,
    warm: int,
    sync: Callable[[], None],
    timed: Callable[[], None] = lambda: None,
) -> tuple[float, TorchInterpreter]:
    """Host µs per step of one round on a fresh interpreter, after `warm` untimed steps
    (`timed` is called as the timed steps begin)."""
    interp = make()
    first = starts[warm]
    perform(interp, actions[:first])
    sync()
    timed()
    began = time.perf_counter()
    perform(interp, actions[first:])
    elapsed = time.perf_counter() - began
    sync()
    return elapsed / (len(starts) - warm) * 1e6, interp


MODES: dict[str, dict[str, bool | int]] = {
    "eager": {},
    "checked": {"checked": True},
    "plan": {"plans": True},
    "captured": {"capture": True, "capture_copies": 3},  # ring depth 2 + 1
}


class LaunchTimer:
    """Wraps every graph instance's launch to add up the host time spent inside it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._record = capture._record

    def __enter__(self) -> LaunchTimer:
        def record(kernels: list[capture.Kernel], slots: capture.Slots) -> Callable[[], None]:
            launch = self._record(kernels, slots)

            def timed_launch() -> None:
                began = time.perf_counter()
                launch()
                self.seconds += time.perf_counter() - began

            return timed_launch

        capture._record = record
        return self

    def __exit__(self, *exc: object) -> None:
        capture._record = self._record

    def reset(self) -> None:
        self.seconds = 0.0


def _maker(
    device: torch.device,
    groups: dict[Communicator, dist.ProcessGroup],
    kwargs: dict[str, bool | int],
) -> Make:
    def make() -> TorchInterpreter:
        return TorchInterpreter(
            device=device,
            groups=groups,
            rank=0,
            checked=bool(kwargs.get("checked", False)),
            plans=bool(kwargs.get("plans", False)),
            capture=bool(kwargs.get("capture", False)),
            capture_copies=int(kwargs.get("capture_copies", 3)),
        )

    return make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--warm", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--persistent-inputs", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with one_rank_world(args.device) as (device, groups):
        run(device, groups, args.steps, args.warm, args.rounds, persistent=args.persistent_inputs)


def run(
    device: torch.device,
    groups: dict[Communicator, dist.ProcessGroup],
    steps: int,
    warm: int,
    rounds: int,
    *,
    persistent: bool = False,
) -> None:
    cuda = device.type == "cuda"
    modes = [m for m in MODES if cuda or m != "captured"]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    bound = "persistent" if persistent else "fresh"
    print(
        f"host µs per relay step ({device}, {steps - warm} timed steps, median of {rounds}; "
        f"{bound} input tensors)"
    )
    split = ["captured: in launches"] if cuda else []
    columns = [*modes, *split, "plan/eager", "counters (plan, captured)"]
    print("| case | " + " | ".join(columns) + " |")
    print("| --- " * (len(columns) + 1) + "|")
    for role in ("receiver", "sender"):
        for rows in (8, 64, 256):
            for spec in (0, 3):
                actions, starts = record_relay(role, rows, spec, steps, device)
                if persistent:
                    actions = persistent_inputs(actions)
                makers = {mode: _maker(device, groups, MODES[mode]) for mode in modes}
                times: dict[str, list[float]] = {mode: [] for mode in [*modes, *split]}
                last: dict[str, TorchInterpreter] = {}
                for _ in range(rounds):  # interleaved, so load changes hit every mode alike
                    for mode in modes:
                        with LaunchTimer() as launches:
                            figure, last[mode] = time_actions(
                                makers[mode],
                                actions,
                                starts,
                                warm=warm,
                                sync=sync,
                                timed=launches.reset,
                            )
                        times[mode].append(figure)
                        if mode == "captured":
                            per_step = launches.seconds / (len(starts) - warm) * 1e6
                            times["captured: in launches"].append(per_step)
                figures = {mode: statistics.median(times[mode]) for mode in times}
                counters = []
                for mode in modes:
                    planner = last[mode].planner
                    if planner is not None:
                        counters.append(
                            f"{mode}: {planner.lowered} lowered, {planner.planned} planned, "
                            f"{planner.replayed} replayed, {planner.eager} eager"
                        )
                cells = " | ".join(f"{figures[m]:.1f}" for m in [*modes, *split])
                ratio = figures["plan"] / figures["eager"]
                print(
                    f"| {role} n={rows} spec={spec} | {cells} | {ratio:.2f} | "
                    f"{'; '.join(counters)} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
