"""Where a pure relay step's host time goes: each call of one decode step, timed alone.

The pure steps are functions of their arguments, so each call can be repeated on the
same state and timed by itself: the `BatchFacts` a caller builds, then a receiver's
consume, free, receive and end_step, or a sender's free, broadcast_sampled,
broadcast_drafts (seed wire with speculation) and end_step, in a steady state (the ring
full). The receiver's consume runs in turn over the states of the seed's cycle (its
inputs, a slot freed every FREE_EVERY steps: some consumes compare generations and drop
rows, as the seed's do); the other calls on one state with nothing dropped. A step's sum
counts the free once in FREE_EVERY steps, as the seed's cycle frees. Beside them, the
seed's whole step with every device call a no-op (`seed_noop` of
benchmarks/relay_host_cost.py), the figure the pure steps are held to. The effects
column counts what each call returns; every effect is a frozen value built per call, and
this table is where to look before optimising a step.

The last row of each case is the whole step through the rank step's phases (`purepp.rank`:
begin, agree with dp 1, finish; no free), as a `RankDriver` embedder pays it, with an I/O
seam that only records shapes and no interpreter.

`--no-effects` measures a bound instead of the library: every effect (and section)
constructor the relay calls is replaced by a no-op that still takes its keyword
arguments, which is about what steps that handed back bindings instead of effects would
still pay. The effects it returns are placeholders; nothing else may run in the process.

    python -m benchmarks.pure_breakdown [--rows 64] [--calls 20000] [--rounds 5] [--no-effects]
"""

from __future__ import annotations

import argparse
import itertools
import typing
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import numpy.typing as npt
import torch

from benchmarks.relay_floor import timed
from benchmarks.relay_host_cost import CYCLE, FREE_EVERY, Case, build_inputs, facts_of, seed_runner
from benchmarks.seed_relay import SeedRelay, noop_calls, placeholder
from purepp import relay
from purepp.batch import BatchFacts
from purepp.cudagraph import CaptureMode, CudaGraphDispatcher
from purepp.effects.arrays import IntArray
from purepp.effects.vocabulary import BufferRef, DType, Effect, Section, TensorSpec
from purepp.rank import (
    RankConfig,
    RankState,
    Sampled,
    ShapeFacts,
    StepPhase,
    agree,
    begin,
    finish,
    init_rank,
)
from purepp.relay import (
    RelayConfig,
    RelayState,
    Wire,
    broadcast_drafts,
    broadcast_sampled,
    consume_previous_step,
    default_buckets,
    end_step,
    free_request_slots,
    init_relay,
    receive,
)
from purepp.step import Step

T = TypeVar("T")
SLOTS = 256
WIRES = (Wire.SEED, Wire.PACKED, Wire.FIXED)
FREE = "free_request_slots (1 slot)"  # runs one step in FREE_EVERY: weighted so in the sum
CONSUME = "consume_previous_step (the seed's cycle)"  # in turn over the cycle's states


class _Placeholder:
    """What a no-op constructor returns: enough for the relay to read a section's name."""

    buffer = "placeholder"


def build_no_effects() -> None:
    """Replace the relay's effect constructors by no-ops (for `--no-effects` only)."""
    placeholder_effect = _Placeholder()

    def no_op(**fields: object) -> object:
        return placeholder_effect

    # The relay's trusted constructor of every effect kind, and of Pack's and Unpack's
    # sections (`_Broadcast` for Broadcast: purepp._trusted).
    replaced = 0
    for cls in (*typing.get_args(Effect), Section):
        name = f"_{cls.__name__}"
        if hasattr(relay, name):
            setattr(relay, name, no_op)
            replaced += 1
    if replaced < 10:  # the relay builds its effects some other way: this bound is void
        raise SystemExit(f"--no-effects replaced only {replaced} effect constructors")
    relay._input_sections.cache_clear()


def _no_sync() -> None:
    """Pure calls queue no device work: nothing to wait for between rounds."""


def relay_config(*, sender: bool, spec: int, wire: Wire) -> RelayConfig:
    return RelayConfig(
        pp_size=2,
        stage=1 if sender else 0,
        last_rank=1,
        max_num_reqs=SLOTS,
        num_speculative_steps=spec,
        wire=wire,
        buckets=default_buckets(SLOTS) if wire is Wire.FIXED else (),
    )


def step_calls(
    sender: bool, spec: int, wire: Wire, rows: int
) -> list[tuple[str, Callable[[], object]]]:
    """The named calls of one steady decode step, each repeatable on the same arguments."""
    rng = np.random.default_rng(rows)
    slots = rng.permutation(SLOTS)[:rows].astype(np.int32)
    computed = np.full(rows, 10, dtype=np.int32)
    scheduled = np.full(rows, 1 + spec, dtype=np.int32)
    prefill = np.full(rows, 4, dtype=np.int32)

    def facts() -> BatchFacts:
        return BatchFacts(
            idx_mapping=slots,
            num_computed_tokens=computed,
            num_scheduled_tokens=scheduled,
            prefill_len=prefill,
        )

    batch = facts()
    config = relay_config(sender=sender, spec=spec, wire=wire)
    state = init_relay(config)
    calls: list[tuple[str, Callable[[], object]]] = [("BatchFacts", facts)]
    freed_slot = (int(slots[0]),)
    if sender:
        calls.append((FREE, lambda: free_request_slots(config, state, freed_slot)))
        tokens = TensorSpec(shape=(rows, spec + 1), dtype=DType.INT64)
        table = TensorSpec(shape=(SLOTS, spec), dtype=DType.INT64)
        packed_drafts = table if spec and wire is not Wire.SEED else None
        sent = broadcast_sampled(config, state, batch, tokens, packed_drafts)
        calls.append(
            (
                "broadcast_sampled",
                lambda: broadcast_sampled(config, state, batch, tokens, packed_drafts),
            )
        )
        after = sent.state
        if spec and wire is Wire.SEED:
            sent_state = after
            calls.append(
                ("broadcast_drafts", lambda: broadcast_drafts(config, sent_state, batch, table))
            )
            after = broadcast_drafts(config, sent_state, batch, table).state
        ended = after
        calls.append(("end_step", lambda: end_step(config, ended)))
        return calls
    # A receiver in steady state: run whole steps until the ring's oldest entry is full.
    for _ in range(config.ring_depth):
        state = consume_previous_step(config, state, update_drafts=spec > 0).state
        state = end_step(config, receive(config, state, batch).state).state
    full = state
    consumed = consume_previous_step(config, full, update_drafts=spec > 0).state
    received = receive(config, consumed, batch).state
    rotation = itertools.cycle(cycle_states(config, rows))
    calls += [
        (
            CONSUME,
            lambda: consume_previous_step(config, next(rotation), update_drafts=spec > 0),
        ),
        (FREE, lambda: free_request_slots(config, consumed, freed_slot)),
        ("receive", lambda: receive(config, consumed, batch)),
        ("end_step", lambda: end_step(config, received)),
    ]
    return calls


def cycle_states(config: RelayConfig, rows: int) -> list[RelayState]:
    """A receiver's state before each consume of the seed's cycle in `relay_host_cost`:
    its inputs, and a slot of the step's batch freed every FREE_EVERY steps, so some
    consumes compare generations and drop rows, as the seed_noop step's do."""
    case = Case(role="receiver", rows=rows, spec=config.num_speculative_steps)
    inputs = build_inputs(case, SLOTS, torch.device("cpu"))
    update = config.num_speculative_steps > 0
    states: list[RelayState] = []
    state = init_relay(config)
    for i in range(2 * CYCLE):  # the first cycle fills the ring; the second is kept
        j = i % CYCLE
        if i >= CYCLE:
            states.append(state)
        state = consume_previous_step(config, state, update_drafts=update).state
        if i % FREE_EVERY == 0:
            state = free_request_slots(config, state, (inputs.freed[j],)).state
        state = end_step(config, receive(config, state, facts_of(inputs.arrays[j])).state).state
    return states


class _ShapesIO:
    """A `StepIO` for timing the phases alone: it keeps the shapes of what it is given."""

    def __init__(self) -> None:
        self.specs: dict[BufferRef, TensorSpec] = {}

    def bind(self, ref: BufferRef, value: npt.NDArray[np.int64] | npt.NDArray[np.int32]) -> None:
        dtype = DType.INT64 if value.dtype == np.int64 else DType.INT32
        self.specs[ref] = TensorSpec(shape=tuple(value.shape), dtype=dtype)

    def spec(self, ref: BufferRef) -> TensorSpec:
        return self.specs[ref]

    def upload(self, values: IntArray) -> npt.NDArray[np.int32]:
        return values

    def host_table(self, ref: BufferRef) -> IntArray:
        raise AssertionError("with dp 1 the agreement decides at once: no table")


def _drained(phase: StepPhase[T]) -> T:
    """Run a phase to its end, dropping the effects it yields (no interpreter)."""
    while True:
        try:
            next(phase)
        except StopIteration as stop:
            result: T = stop.value
            return result


def rank_step_call(sender: bool, spec: int, wire: Wire, rows: int) -> Callable[[], object]:
    """One steady step through the rank step's phases, repeatable on the same state."""
    config = RankConfig(
        relay=relay_config(sender=sender, spec=spec, wire=wire),
        dispatcher=CudaGraphDispatcher(
            capture_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            capture_mode=CaptureMode.FULL_AND_PIECEWISE,
            max_num_reqs=SLOTS,
            num_speculative_tokens=spec,
        ),
    )
    slots = np.random.default_rng(rows).permutation(SLOTS)[:rows].astype(np.int32)
    batch = BatchFacts(
        idx_mapping=slots,
        num_computed_tokens=np.full(rows, 10, dtype=np.int32),
        num_scheduled_tokens=np.full(rows, 1 + spec, dtype=np.int32),
        prefill_len=np.full(rows, 4, dtype=np.int32),
    )
    shape = ShapeFacts(num_tokens=rows * (1 + spec), uniform_token_count=1 + spec)
    io = _ShapesIO()
    io.bind(config.relay.inputs.draft_table, np.zeros((SLOTS, spec), dtype=np.int64))
    sampled = Sampled(
        tokens=np.zeros((rows, spec + 1), dtype=np.int64),
        num_sampled=np.ones(rows, dtype=np.int32),
        num_rejected=np.zeros(rows, dtype=np.int32),
        draft_table=np.zeros((SLOTS, spec), dtype=np.int64) if spec else None,
    )
    given = sampled if sender else None

    def step(state: RankState) -> RankState:
        begun = _drained(begin(config, state))
        agreed = _drained(agree(config, begun, batch, shape, io))
        return _drained(finish(config, agreed, io, given))

    state = init_rank(config)
    for _ in range(config.relay.ring_depth):  # a full ring: every consume hands rows out
        state = step(state)
    steady = state
    return lambda: step(steady)


def seed_noop_step(sender: bool, spec: int, rows: int) -> Callable[[], None]:
    """One step of the seed's logic with every device call a no-op (as relay_host_cost)."""
    case = Case(role="sender" if sender else "receiver", rows=rows, spec=spec)
    inputs = build_inputs(case, SLOTS, torch.device("cpu"))
    relay = SeedRelay(
        calls=noop_calls(),
        is_last_rank=sender,
        last_rank=0,
        ring_depth=2,
        max_num_reqs=SLOTS,
        num_speculative_steps=spec,
        device=torch.device("cpu"),
        group=None,
    )
    table = placeholder((SLOTS, spec), torch.int64) if spec else None
    run = seed_runner(case, inputs, relay, table, noop=True)
    step = [0]

    def one() -> None:
        run(step[0], 1)
        step[0] += 1

    return one


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-effects", action="store_true", help="the bound: build no effects")
    args = parser.parse_args()
    if args.no_effects:
        build_no_effects()
    bound = " (--no-effects: effect constructors are no-ops)" if args.no_effects else ""
    timing = f"median µs per call of {args.rounds} x {args.calls}"
    print(f"pure relay calls, n={args.rows}, {timing}{bound}")
    print()
    print("| role | spec | wire | call | µs | effects |")
    print("| --- | --- | --- | --- | --- | --- |")
    for sender in (False, True):
        role = "sender" if sender else "receiver"
        for spec in (0, 3):
            for wire in WIRES:
                total = 0.0
                for name, call in step_calls(sender, spec, wire, args.rows):
                    micros = timed(call, args.calls, args.rounds, _no_sync)
                    total += micros / FREE_EVERY if name == FREE else micros
                    made = call()
                    effects = str(len(made.effects)) if isinstance(made, Step) else ""
                    print(f"| {role} | {spec} | {wire.value} | {name} | {micros:.2f} | {effects} |")
                step = f"**step (a free 1 in {FREE_EVERY})** | **{total:.2f}**"
                print(f"| {role} | {spec} | {wire.value} | {step} | |")
                phases = rank_step_call(sender, spec, wire, args.rows)
                micros = timed(phases, args.calls, args.rounds, _no_sync)
                rank_step = "rank step: begin, agree (dp 1), finish; no free"
                print(f"| {role} | {spec} | {wire.value} | {rank_step} | {micros:.2f} | |")
            noop = timed(seed_noop_step(sender, spec, args.rows), args.calls, args.rounds, _no_sync)
            print(f"| {role} | {spec} | | seed_noop: the seed's whole step | {noop:.2f} | |")


if __name__ == "__main__":
    main()
