"""Relay host cost per decode step: purepp beside the seed's imperative PPHandler.

Contenders, run in interleaved rounds on the same schedule:
- `seed`: `benchmarks.seed_relay.SeedRelay` making the seed's calls one for one on real
  tensors (CUDA streams and NCCL with `--device cuda`; CPU tensors and gloo otherwise);
- `eager`: purepp's pure steps plus `TorchInterpreter` performing their effects;
- `checked` (only with `--modes checked`): eager with every effect validated;
- `plan`: the same with the interpreter's step plans (`plans=True`), when it has them;
- `captured`: the same with plans captured into CUDA graphs (`capture=True`, CUDA only);
- `pure`: purepp's pure steps alone, with no interpreter;
- `seed_noop`: the seed's logic with every torch/dist call a no-op (host logic alone).

Ratios: eager, checked, plan and captured against `seed`; `pure` against `seed_noop`.
Every step, purepp's contenders build their `BatchFacts` from the batch's host arrays, as
a caller must (the seed reads its input batch directly). Every purepp call goes through
one adapter, `PureppRelay`; interpreter modes the installed interpreter lacks are
reported unavailable and skipped.

Cases: both roles (receiver = a non-last stage: consume, free, receive; sender = the last
stage: free, broadcast sampled, broadcast drafts), n in {8, 64, 256}, spec in {0, 3}, a
slot freed every 7 steps, a plain-sampler step ([n, 1] sampled tokens) every third step.
Every rank is one process of a one-rank world (gloo on CPU, NCCL on one GPU, the relay
group a second group over the same rank), so every broadcast is a real collective with
nothing on the wire and the figures are the host cost of issuing each step's work. Host
time is perf_counter around the step calls; on CUDA the device is synchronised only
between rounds, or with `--drain` after every step, untimed (a contender whose device work
outlasts its host calls then never waits for a full launch queue). On CUDA a sync count
(steady state, `torch.cuda.set_sync_debug_mode("warn")`) is reported per 200 steps for
each device contender.

    python -m benchmarks.relay_host_cost [--device cpu|cuda] [--quick] [--drain] [--json OUT]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist

from benchmarks.one_rank import one_rank_world
from benchmarks.seed_relay import (
    DeviceCalls,
    SeedBatch,
    SeedRelay,
    cuda_calls,
    host_calls,
    noop_calls,
    placeholder,
)
from purepp.batch import BatchFacts
from purepp.effects.torch_interpreter import TorchInterpreter
from purepp.effects.vocabulary import Communicator, DType, TensorSpec
from purepp.errors import PureppError
from purepp.relay import (
    RelayConfig,
    Wire,
    consume_previous_step,
    default_buckets,
    end_step,
    free_request_slots,
    init_relay,
    receive,
)
from purepp.relay import broadcast_drafts as purepp_broadcast_drafts
from purepp.relay import broadcast_sampled as purepp_broadcast_sampled

TORCH_VERSION = version("torch")

Role = Literal["receiver", "sender"]
Mode = Literal["eager", "checked", "plan", "captured"]

FREE_EVERY = 7  # a slot is freed every 7 steps
PLAIN_EVERY = 3  # every third step samples with a plain sampler: [n, 1] tokens
CYCLE = 2 * FREE_EVERY * PLAIN_EVERY  # distinct step inputs, reused in turn
SYNC_STEPS = 200  # steady-state steps the sync count runs

# How each interpreter mode is asked for; tried in order (older interpreters lack a keyword).
_MODE_KWARGS: dict[Mode, Callable[[int], list[dict[str, Any]]]] = {
    "eager": lambda ring: [{}],
    "checked": lambda ring: [{"checked": True}],  # eager, validating every effect
    "plan": lambda ring: [{"plans": True}],
    "captured": lambda ring: [
        {"plans": True, "capture": True, "capture_copies": ring + 1},
        {"capture": True},
    ],
}


def make_interpreter(
    mode: Mode,
    device: torch.device,
    groups: dict[Communicator, dist.ProcessGroup],
    ring_depth: int,
) -> tuple[TorchInterpreter | None, str]:
    """An interpreter in `mode`, or None and the reason it is unavailable."""
    reason = ""
    for kwargs in _MODE_KWARGS[mode](ring_depth):
        try:
            return TorchInterpreter(device=device, groups=groups, rank=0, **kwargs), ""
        except (TypeError, ImportError, PureppError) as error:
            reason = f"{type(error).__name__}: {error}"
    return None, reason


# ---- the one place the harness calls purepp ----------------------------------------------------


class PureppRelay:
    """purepp's relay for one rank, as the harness drives it: the ONE adapter to switch
    when the library's API changes. With no interpreter it runs the pure steps alone."""

    def __init__(
        self,
        *,
        role: Role,
        pp: int,
        slots: int,
        spec: int,
        env: TorchInterpreter | None,
        draft_table: torch.Tensor | None,
        wire: Wire = Wire.SEED,
    ) -> None:
        # A one-rank world: this rank is the broadcast source whichever stage it plays.
        self.config = RelayConfig(
            pp_size=pp,
            stage=pp - 1 if role == "sender" else 0,
            last_rank=0,
            max_num_reqs=slots,
            num_speculative_steps=spec,
            wire=wire,
            buckets=default_buckets(slots) if wire is Wire.FIXED else (),
        )
        self.state = init_relay(self.config)
        self.env = env
        self.inputs = self.config.inputs
        self.update_drafts = spec > 0 and role == "receiver"
        self.drafts_spec = TensorSpec(shape=(slots, spec), dtype=DType.INT64)
        if env is not None and draft_table is not None:
            env.bind(self.inputs.draft_table, draft_table)  # lives as long as the relay

    def consume(self) -> dict[str, torch.Tensor] | None:
        taken = consume_previous_step(self.config, self.state, update_drafts=self.update_drafts)
        self.state = taken.state
        env = self.env
        if env is None:
            return None
        env.perform(taken.effects)
        out = taken.result
        if out is None:
            return None
        # What a caller reads to apply the outputs (the seed hands back the same four).
        return {
            "sampled_tokens": env.tensor(out.sampled_tokens),
            "num_sampled": env.tensor(out.num_sampled),
            "num_rejected": env.tensor(out.num_rejected),
            "idx_mapping": env.tensor(out.idx_mapping),
        }

    def free(self, slots: Sequence[int]) -> None:
        self.state = free_request_slots(self.config, self.state, slots).state

    def receive(self, batch: BatchFacts, idx_mapping: torch.Tensor) -> None:
        env = self.env
        if env is not None:
            env.bind(self.inputs.idx_mapping, idx_mapping)
        posted = receive(self.config, self.state, batch)
        self.state = posted.state
        if env is not None:
            env.perform(posted.effects)

    def send(
        self,
        batch: BatchFacts,
        idx_mapping: torch.Tensor,
        sampled: torch.Tensor,
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
    ) -> None:
        env = self.env
        inputs = self.inputs
        if env is not None:
            env.bind(inputs.idx_mapping, idx_mapping)
            env.bind(inputs.sampled_tokens, sampled)
            env.bind(inputs.num_sampled, num_sampled)
            env.bind(inputs.num_rejected, num_rejected)
        tokens = TensorSpec(shape=tuple(sampled.shape), dtype=DType.INT64)
        packed = self.config.wire is not Wire.SEED
        drafts = self.drafts_spec if packed and self.config.num_speculative_steps else None
        sent = purepp_broadcast_sampled(self.config, self.state, batch, tokens, drafts)
        self.state = sent.state
        if env is not None:
            env.perform(sent.effects)
        if self.config.num_speculative_steps and not packed:
            sent = purepp_broadcast_drafts(self.config, self.state, batch, self.drafts_spec)
            self.state = sent.state
            if env is not None:
                env.perform(sent.effects)

    def end(self) -> None:
        ended = end_step(self.config, self.state)
        self.state = ended.state
        if self.env is not None:
            self.env.perform(ended.effects)

    def bound_names(self) -> int:
        return 0 if self.env is None else len(self.env.bound_refs())


# ---- one case's inputs ---------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    role: Role
    rows: int
    spec: int
    wire: Wire = Wire.SEED  # purepp's wire format (the seed always uses its own)

    @property
    def label(self) -> str:
        wire = "" if self.wire is Wire.SEED else f" wire={self.wire.value}"
        return f"{self.role} n={self.rows} spec={self.spec}{wire}"


# A step's idx_mapping, num_computed_tokens, num_scheduled_tokens and prefill_len.
BatchArrays = tuple[
    npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.int32]
]


@dataclass
class Inputs:
    """A cycle of step inputs, built before timing and shared by every contender."""

    arrays: list[BatchArrays]  # the batch's host arrays, from which purepp builds its facts
    seed_batches: list[SeedBatch]  # the seed's InputBatch slice, over the same tensors
    noop_batches: list[SeedBatch]  # the same with placeholder tensors
    idx: list[torch.Tensor]  # device [n] int32 slot mappings
    freed: list[int]  # the slot freed at steps i % FREE_EVERY == 0
    sampled: list[torch.Tensor]  # sender: [n, k] int64, k = 1 on plain-sampler steps
    num_sampled: list[torch.Tensor]
    num_rejected: list[torch.Tensor]
    noop_sampled: list[torch.Tensor]  # placeholders of the same shapes
    noop_counts: torch.Tensor


def build_inputs(case: Case, slots: int, device: torch.device) -> Inputs:
    rng = np.random.default_rng(case.rows * 10 + case.spec)
    n = case.rows
    ones = np.ones(n, dtype=np.int32)
    out = Inputs([], [], [], [], [], [], [], [], [], placeholder((n,), torch.int32))
    for step in range(CYCLE):
        idx_np: npt.NDArray[np.int32] = rng.permutation(slots)[:n].astype(np.int32)
        computed = np.full(n, 10, dtype=np.int32)
        scheduled = ones * (1 + case.spec)
        prefill = np.full(n, 4, dtype=np.int32)
        idx = torch.from_numpy(idx_np.copy()).to(device)
        out.arrays.append((idx_np, computed, scheduled, prefill))
        out.seed_batches.append(SeedBatch(n, idx, idx_np, computed, scheduled, prefill))
        out.noop_batches.append(
            SeedBatch(n, placeholder((n,), torch.int32), idx_np, computed, scheduled, prefill)
        )
        out.idx.append(idx)
        out.freed.append(int(idx_np[0]))
        width = 1 if step % PLAIN_EVERY == PLAIN_EVERY - 1 else case.spec + 1
        tokens = rng.integers(0, 1000, size=(n, width), dtype=np.int64)
        out.sampled.append(torch.from_numpy(tokens).to(device))
        out.num_sampled.append(torch.ones(n, dtype=torch.int32).to(device))
        out.num_rejected.append(torch.zeros(n, dtype=torch.int32).to(device))
        out.noop_sampled.append(placeholder((n, width), torch.int64))
    return out


# ---- contenders -----------------------------------------------------------------------------

Runner = Callable[[int, int], None]  # run steps first .. first + count - 1


def seed_runner(
    case: Case, inputs: Inputs, relay: SeedRelay, table: torch.Tensor | None, noop: bool
) -> Runner:
    batches = inputs.noop_batches if noop else inputs.seed_batches
    freed = inputs.freed
    if case.role == "receiver":

        def run_receiver(first: int, count: int) -> None:
            for i in range(first, first + count):
                j = i % CYCLE
                relay.get_prev_sampled_outputs(table)
                if i % FREE_EVERY == 0:
                    relay.on_req_idx_freed(freed[j])
                relay.receive(batches[j])

        return run_receiver

    sampled = inputs.noop_sampled if noop else inputs.sampled
    num_sampled = [inputs.noop_counts] * CYCLE if noop else inputs.num_sampled
    num_rejected = [inputs.noop_counts] * CYCLE if noop else inputs.num_rejected
    speculating = case.spec > 0

    def run_sender(first: int, count: int) -> None:
        for i in range(first, first + count):
            j = i % CYCLE
            if i % FREE_EVERY == 0:
                relay.on_req_idx_freed(freed[j])
            relay.broadcast(sampled[j], num_sampled[j], num_rejected[j], batches[j])
            if speculating:
                relay.broadcast_drafts(table, batches[j])  # type: ignore[arg-type]

    return run_sender


def facts_of(arrays: BatchArrays) -> BatchFacts:
    """What a caller builds every step from its input batch (the seed reads the batch)."""
    idx_mapping, computed, scheduled, prefill = arrays
    return BatchFacts(
        idx_mapping=idx_mapping,
        num_computed_tokens=computed,
        num_scheduled_tokens=scheduled,
        prefill_len=prefill,
    )


def purepp_runner(case: Case, inputs: Inputs, relay: PureppRelay) -> Runner:
    arrays, idx = inputs.arrays, inputs.idx
    freed = [(slot,) for slot in inputs.freed]
    if case.role == "receiver":

        def run_receiver(first: int, count: int) -> None:
            for i in range(first, first + count):
                j = i % CYCLE
                relay.consume()
                if i % FREE_EVERY == 0:
                    relay.free(freed[j])
                relay.receive(facts_of(arrays[j]), idx[j])
                relay.end()

        return run_receiver

    sampled, num_sampled, num_rejected = inputs.sampled, inputs.num_sampled, inputs.num_rejected

    def run_sender(first: int, count: int) -> None:
        for i in range(first, first + count):
            j = i % CYCLE
            if i % FREE_EVERY == 0:
                relay.free(freed[j])
            relay.send(facts_of(arrays[j]), idx[j], sampled[j], num_sampled[j], num_rejected[j])
            relay.end()

    return run_sender


@dataclass
class Contender:
    name: str
    run: Runner
    on_device: bool  # does device work (timed with syncs between rounds, sync-counted)
    next_step: int = 0
    times: list[float] = field(default_factory=list)  # seconds per step, one per round
    env: TorchInterpreter | None = None  # purepp's interpreter, for its plan counters

    def advance(self, count: int) -> None:
        self.run(self.next_step, count)
        self.next_step += count


def build_contenders(
    case: Case,
    inputs: Inputs,
    *,
    pp: int,
    slots: int,
    device: torch.device,
    groups: dict[Communicator, dist.ProcessGroup],
    modes: dict[Mode, str],
) -> list[Contender]:
    cuda = device.type == "cuda"
    spec = case.spec
    sender = case.role == "sender"

    def table() -> torch.Tensor | None:
        if not spec:
            return None
        return torch.zeros((slots, spec), dtype=torch.int64).to(device)

    def seed(calls: DeviceCalls, dev: torch.device, group: dist.ProcessGroup | None) -> SeedRelay:
        return SeedRelay(
            calls=calls,
            is_last_rank=sender,
            last_rank=0,
            ring_depth=pp,
            max_num_reqs=slots,
            num_speculative_steps=spec,
            device=dev,
            group=group,
        )

    relay_group = groups[Communicator.PP_RELAY]
    real = seed(cuda_calls() if cuda else host_calls(), device, relay_group)
    noop_table = placeholder((slots, spec), torch.int64) if spec else None
    contenders = [
        Contender("seed", seed_runner(case, inputs, real, table(), noop=False), on_device=True)
    ]
    for mode in modes:
        env, _ = make_interpreter(mode, device, groups, pp)
        assert env is not None  # `modes` holds only the available ones
        relay = PureppRelay(
            role=case.role,
            pp=pp,
            slots=slots,
            spec=spec,
            env=env,
            draft_table=table(),
            wire=case.wire,
        )
        runner = purepp_runner(case, inputs, relay)
        contenders.append(Contender(mode, runner, on_device=True, env=env))
    pure = PureppRelay(
        role=case.role, pp=pp, slots=slots, spec=spec, env=None, draft_table=None, wire=case.wire
    )
    contenders.append(Contender("pure", purepp_runner(case, inputs, pure), on_device=False))
    noop = seed(noop_calls(), device, None)
    contenders.append(
        Contender("seed_noop", seed_runner(case, inputs, noop, noop_table, noop=True), False)
    )
    return contenders


# ---- measuring ------------------------------------------------------------------------------


def time_rounds(
    contenders: list[Contender],
    steps: int,
    rounds: int,
    warmup: int,
    sync: Callable[[], None],
    *,
    drain: bool = False,
) -> None:
    """Each contender's host seconds per step, one figure per round.

    With `drain`, each step is timed alone and the device is synchronised after it,
    untimed: the step's calls then never wait for a full launch queue, so a contender
    whose device work outlasts its host calls is timed by its host calls alone.
    """
    for contender in contenders:
        contender.advance(warmup)  # plans lowered, graphs captured, communicators up
    sync()
    clock = time.perf_counter
    for r in range(rounds):
        # Interleaved, and the order rotates, so drift and cache effects hit every one alike.
        order = contenders[r % len(contenders) :] + contenders[: r % len(contenders)]
        for contender in order:
            if drain:
                elapsed = 0.0
                for _ in range(steps):
                    start = clock()
                    contender.advance(1)
                    elapsed += clock() - start
                    sync()
            else:
                start = clock()
                contender.advance(steps)
                elapsed = clock() - start
                sync()
            contender.times.append(elapsed / steps)


def count_syncs(contender: Contender, steps: int) -> int:
    """Host syncs in `steps` steady-state steps, as CUDA's sync debug mode reports them."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            contender.advance(steps)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in caught)


def profiled(contender: Contender, steps: int, sync: Callable[[], None]) -> str:
    """The top functions by own time over `steps` more steps of `contender` (cProfile)."""
    profiler = cProfile.Profile()
    profiler.enable()
    contender.advance(steps)
    sync()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).sort_stats("tottime")
    stats.print_stats(25)
    stats.print_callees(10)  # what the top ten call: where their cumulative time goes
    return text.getvalue()


PLAN_COUNTERS = ("lowered", "planned", "eager", "replayed")


def plan_counters(env: TorchInterpreter | None) -> dict[str, int]:
    """The interpreter's plan-cache counters (empty without plans): shows a plan mode
    really ran its plans, not eager fallbacks."""
    planner = getattr(env, "planner", None)
    if planner is None:
        return {}
    found = {name: getattr(planner, name, None) for name in PLAN_COUNTERS}
    return {name: value for name, value in found.items() if isinstance(value, int)}


def _micros(times: list[float]) -> dict[str, float]:
    return {
        "median_us": statistics.median(times) * 1e6,
        "best_us": min(times) * 1e6,
    }


ORDER = ("seed", "eager", "checked", "plan", "captured", "pure", "seed_noop")
RATIOS = (
    ("eager", "seed"),
    ("checked", "seed"),
    ("plan", "seed"),
    ("captured", "seed"),
    ("pure", "seed_noop"),
)


def run_case(
    case: Case,
    *,
    pp: int,
    steps: int,
    rounds: int,
    warmup: int,
    sync_steps: int,
    device: torch.device,
    groups: dict[Communicator, dist.ProcessGroup],
    modes: dict[Mode, str],
    profile: Sequence[str] = (),
    drain: bool = False,
) -> dict[str, Any]:
    cuda = device.type == "cuda"
    slots = 2 * case.rows
    inputs = build_inputs(case, slots, device)
    contenders = build_contenders(
        case, inputs, pp=pp, slots=slots, device=device, groups=groups, modes=modes
    )
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    time_rounds(contenders, steps, rounds, warmup, sync, drain=drain)
    figures: dict[str, dict[str, Any]] = {
        c.name: {**_micros(c.times), "rounds_us": [t * 1e6 for t in c.times]} for c in contenders
    }
    ratios: dict[str, dict[str, float]] = {}
    for top, bottom in RATIOS:
        if top in figures and bottom in figures:
            ratios[f"{top}/{bottom}"] = {
                "median": figures[top]["median_us"] / figures[bottom]["median_us"],
                "best": figures[top]["best_us"] / figures[bottom]["best_us"],
            }
    result: dict[str, Any] = {
        "role": case.role,
        "n": case.rows,
        "spec": case.spec,
        "wire": case.wire.value,
        "contenders": figures,
        "ratios": ratios,
        "plan_counters": {
            c.name: counters for c in contenders if (counters := plan_counters(c.env))
        },
    }
    for contender in contenders:
        if contender.name in profile:
            print(f"profile of {contender.name}, {case.label}, {steps} steps:")
            print(profiled(contender, steps, sync))
    if cuda and sync_steps:
        result["syncs"] = {c.name: count_syncs(c, sync_steps) for c in contenders if c.on_device}
        result["sync_steps"] = sync_steps
    return result


# ---- reporting ------------------------------------------------------------------------------


def _cell(figures: dict[str, Any], name: str) -> str:
    entry = figures.get(name)
    return "-" if entry is None else f"{entry['median_us']:.1f}"


def _ratio(ratios: dict[str, dict[str, float]], key: str) -> str:
    entry = ratios.get(key)
    return "-" if entry is None else f"{entry['median']:.2f} ({entry['best']:.2f})"


def markdown(results: list[dict[str, Any]]) -> str:
    ran = {name for r in results for name in r["contenders"]}
    names = [name for name in ORDER if name in ran]
    ratios = [f"{a}/{b}" for a, b in RATIOS if a in ran and b in ran]
    head = "| role | n | spec | wire | " + " | ".join([*(f"{n} us" for n in names), *ratios]) + " |"
    lines = [head, "|" + " --- |" * (4 + len(names) + len(ratios))]
    for r in results:
        cells = [r["role"], str(r["n"]), str(r["spec"]), r["wire"]]
        cells += [_cell(r["contenders"], n) for n in names]
        cells += [_ratio(r["ratios"], key) for key in ratios]
        lines.append("| " + " | ".join(cells) + " |")
    if any("syncs" in r for r in results):
        counted = [n for n in names if any(n in r.get("syncs", {}) for r in results)]
        lines += ["", f"Host syncs per {results[0].get('sync_steps')} steady-state steps:", ""]
        lines += ["| role | n | spec | wire | " + " | ".join(counted) + " |"]
        lines += ["|" + " --- |" * (4 + len(counted))]
        for r in results:
            syncs = r.get("syncs", {})
            cells = [r["role"], str(r["n"]), str(r["spec"]), r["wire"]]
            cells += [str(syncs.get(n, "-")) for n in counted]
            lines.append("| " + " | ".join(cells) + " |")
    planned = [m for m in ("plan", "captured") if any(m in r["plan_counters"] for r in results)]
    if planned:
        lines += ["", "Plan counters over the whole case, " + "/".join(PLAN_COUNTERS) + ":", ""]
        lines += ["| role | n | spec | wire | " + " | ".join(planned) + " |"]
        lines += ["|" + " --- |" * (4 + len(planned))]
        for r in results:
            cells = [r["role"], str(r["n"]), str(r["spec"]), r["wire"]]
            for mode in planned:
                counters = r["plan_counters"].get(mode, {})
                cells.append("/".join(str(counters.get(k, "-")) for k in PLAN_COUNTERS))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _commit() -> str | None:
    """The checkout's commit, with "+dirty" when the tree has changes; None without git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{head}+dirty" if dirty else head


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return platform.processor() or platform.machine()
    cuda: Any = torch.cuda  # the narrow stubs in typings/ leave out device queries
    return str(cuda.get_device_name(device))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=2000, help="steps per contender per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2 * CYCLE)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--spec", type=int, nargs="+", default=[0, 3])
    parser.add_argument(
        "--roles", nargs="+", default=["receiver", "sender"], choices=["receiver", "sender"]
    )
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (ring depth)")
    parser.add_argument(
        "--wire",
        nargs="+",
        default=["seed"],
        choices=[w.value for w in Wire],
        help="purepp's relay wire formats to measure (the seed baseline always uses its own)",
    )
    parser.add_argument("--sync-steps", type=int, default=SYNC_STEPS, help="0: no sync count")
    parser.add_argument(
        "--modes",
        nargs="*",
        default=["eager", "plan", "captured"],
        choices=["eager", "checked", "plan", "captured"],
        help="purepp interpreter modes to run (checked: eager validating every effect)",
    )
    parser.add_argument(
        "--profile",
        nargs="+",
        default=[],
        metavar="CONTENDER",
        help="after each case's rounds, cProfile these contenders (seed, eager, plan, ...)",
    )
    parser.add_argument(
        "--drain",
        action="store_true",
        help="time each step alone and synchronise the device after it, untimed",
    )
    parser.add_argument("--quick", action="store_true", help="500 steps x 3 rounds (CUDA: ~2 min)")
    parser.add_argument("--json", metavar="OUT", help="write every figure to this JSON file")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 500, 3
    torch.set_num_threads(1)
    if args.device == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off on lent hosts
    cases = [
        Case(role, n, s, Wire(wire))
        for wire in args.wire
        for role in args.roles
        for n in args.rows
        for s in args.spec
    ]
    results: list[dict[str, Any]] = []
    with one_rank_world(args.device) as (device, groups):
        available: dict[Mode, str] = {}
        missing: dict[str, str] = {}
        for mode in args.modes:
            env, reason = make_interpreter(mode, device, groups, args.pp)
            if env is None:
                missing[mode] = reason
            else:
                available[mode] = ""
        for mode, reason in missing.items():
            print(f"purepp {mode}: unavailable ({reason})")
        for case in cases:
            started = time.perf_counter()
            result = run_case(
                case,
                pp=args.pp,
                steps=args.steps,
                rounds=args.rounds,
                warmup=args.warmup,
                sync_steps=args.sync_steps,
                device=device,
                groups=groups,
                modes=available,
                profile=args.profile,
                drain=args.drain,
            )
            results.append(result)
            print(f"  {case.label}: {time.perf_counter() - started:.1f} s", flush=True)
        name = _device_name(device)
    print()
    print(
        f"device={device} ({name}) torch={TORCH_VERSION} pp={args.pp} steps={args.steps} "
        f"rounds={args.rounds} warmup={args.warmup}{' drained' if args.drain else ''}: "
        "host us/step, median; ratios median (best)"
    )
    print()
    print(markdown(results))
    if args.json:
        report = {
            "command": "python -m benchmarks.relay_host_cost " + " ".join(sys.argv[1:]),
            "device": str(device),
            "device_name": name,
            "commit": _commit(),
            "torch": TORCH_VERSION,
            "python": platform.python_version(),
            "pp": args.pp,
            "steps": args.steps,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "drain": args.drain,
            "modes_unavailable": missing,
            "cases": results,
        }
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
