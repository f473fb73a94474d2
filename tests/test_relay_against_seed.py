"""A review of the relay against the seed's `PPHandler`, from the edges in.

Passing tests check, end to end on simulated worlds, that every stage hands out what
the seed would, across wires, headers, platforms, pipeline depths, plain-sampler and
speculative widths, empty batches and slots freed and reused at every ring offset.
The tests after them pin the boundary checks that review found missing (each was a
bug): typed errors naming the call, value and fix, never a raw exception or a silently
wrapped value, for bad caller input.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from purepp import relay
from purepp.batch import BatchFacts
from purepp.effects.arrays import frozen
from purepp.effects.simulator import RankContext, simulate
from purepp.effects.vocabulary import Broadcast, DType, Effect, TensorSpec
from purepp.errors import PureppError
from purepp.layout import Layout
from purepp.relay import (
    PendingReceive,
    Platform,
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

SAMPLES = (10, 1, 4)  # computed, scheduled, prefill_len: a decode row, samples
PARTIAL = (0, 2, 8)  # a non-final prefill chunk: no sampled token this step
I32 = np.iinfo(np.int32)
I64 = np.iinfo(np.int64)


# --- a pipeline driven through the pure steps, and the seed's answer ---------------------------


@dataclass(frozen=True)
class Plan:
    """One step of a schedule: the batch, the sampler's width, the slots freed before it."""

    slots: tuple[int, ...]
    samples: tuple[bool, ...]
    width: int = 1  # columns of the last stage's sampled tokens (1: a plain sampler)
    frees: tuple[int, ...] = ()  # freed between the step before and this step's consume


@dataclass(frozen=True)
class World:
    pp: int
    spec: int
    max_num_reqs: int
    plans: tuple[Plan, ...]
    wire: Wire = Wire.SEED
    header: bool = False
    platform: Platform = Platform.CUDA
    buckets: tuple[int, ...] | None = None
    update_drafts: bool = True

    @property
    def depth(self) -> int:
        return 1 if self.platform is Platform.XPU_NO_MICROBATCH else self.pp


# (step consumed at, step received at, kept rows: slot, tokens, num_sampled, num_rejected, drafts)
Row = tuple[int, list[int], int, int, list[int] | None]
Consumed = tuple[int, int, list[Row]]


def facts(plan: Plan) -> BatchFacts:
    rows = np.array([SAMPLES if s else PARTIAL for s in plan.samples], np.int32).reshape(-1, 3)
    return BatchFacts(
        idx_mapping=np.array(plan.slots, np.int32),
        num_computed_tokens=rows[:, 0],
        num_scheduled_tokens=rows[:, 1],
        prefill_len=rows[:, 2],
    )


def token(step: int, slot: int, column: int) -> int:
    return 1000 * step + 10 * slot + column + 1


def draft(step: int, slot: int, column: int) -> int:
    return -token(step, slot, column)


def num_sampled(slot: int, width: int) -> int:
    return 1 + slot % width


def num_rejected(slot: int, width: int) -> int:
    return width - 1 - slot % width


def _config(world: World, stage: int) -> RelayConfig:
    return RelayConfig.for_stage(
        pp_size=world.pp,
        stage=stage,
        max_num_reqs=world.max_num_reqs,
        num_speculative_steps=world.spec,
        wire=world.wire,
        validate_header=world.header,
        platform=world.platform,
        buckets=world.buckets,
    )


def _send(
    world: World, config: RelayConfig, state: RelayState, context: RankContext, t: int
) -> tuple[RelayState, list[Effect]]:
    plan, inputs, it = world.plans[t], config.inputs, context.interpreter
    n, k = len(plan.slots), plan.width
    values = [[token(t, s, j) for j in range(k)] for s in plan.slots]
    it.bind(inputs.sampled_tokens, np.array(values, np.int64).reshape(n, k))
    it.bind(inputs.num_sampled, np.array([num_sampled(s, k) for s in plan.slots], np.int32))
    it.bind(inputs.num_rejected, np.array([num_rejected(s, k) for s in plan.slots], np.int32))
    table = np.zeros((world.max_num_reqs, world.spec), np.int64)
    for s in plan.slots:
        table[s] = [draft(t, s, j) for j in range(world.spec)]
    it.bind(inputs.draft_table, table)
    spec = TensorSpec((world.max_num_reqs, world.spec), DType.INT64)
    packed = world.wire is not Wire.SEED and world.spec > 0
    batch = facts(plan)
    sent = broadcast_sampled(
        config, state, batch, TensorSpec((n, k), DType.INT64), spec if packed else None
    )
    effects = list(sent.effects)
    state = sent.state
    if world.spec and world.wire is Wire.SEED:
        drafts = broadcast_drafts(config, state, batch, spec)
        effects += drafts.effects
        state = drafts.state
    return state, effects


def _read(config: RelayConfig, context: RankContext, out: relay.ConsumedOutputs) -> list[Row]:
    it = context.interpreter
    tokens = it.host_array(out.sampled_tokens)
    sampled = it.host_array(out.num_sampled)
    rejected = it.host_array(out.num_rejected)
    device = it.host_array(out.idx_mapping)
    table = it.host_array(config.inputs.draft_table) if config.num_speculative_steps else None
    rows: list[Row] = []
    for i, slot in enumerate(out.idx_mapping_np.tolist()):
        assert int(device[i]) == slot  # the device mapping is the host one
        if slot != -1:
            drafts = None if table is None else [int(d) for d in table[slot]]
            tokens_row = [int(v) for v in tokens[i]]
            rows.append((slot, tokens_row, int(sampled[i]), int(rejected[i]), drafts))
    return rows


def run(world: World) -> dict[int, list[Consumed]]:
    """Every non-last stage's consumes, as (step, received at, kept rows), over a simulation."""
    seen: dict[int, list[Consumed]] = {}

    def program(context: RankContext) -> Iterator[tuple[Effect, ...]]:
        config = _config(world, context.stage)
        state = init_relay(config)
        it = context.interpreter
        if not config.is_last_stage:
            it.bind(config.inputs.draft_table, np.zeros((world.max_num_reqs, world.spec), np.int64))
        out = seen.setdefault(context.stage, [])
        for t, plan in enumerate(world.plans):
            state = free_request_slots(config, state, list(plan.frees)).state
            it.bind(config.inputs.idx_mapping, np.array(plan.slots, np.int32))
            effects: list[Effect] = []
            if config.is_last_stage:
                state, effects = _send(world, config, state, context, t)
            else:
                taken = consume_previous_step(config, state, update_drafts=world.update_drafts)
                yield taken.effects
                state = taken.state
                if taken.result is not None:
                    out.append(
                        (t, taken.result.received_at_step, _read(config, context, taken.result))
                    )
                posted = receive(config, state, facts(plan))
                effects = list(posted.effects)
                state = posted.state
            ended = end_step(config, state)
            state = ended.state
            yield (*effects, *ended.effects)

    in_flight = 1 if world.platform is Platform.XPU_NO_MICROBATCH else None
    simulate(Layout(pp=world.pp, dp=1), program, max_steps_in_flight=in_flight)
    return seen


def seed_answer(world: World) -> list[Consumed]:
    """What the seed's get_prev_sampled_outputs hands out at each step, from the schedule
    alone: the entry received ring_depth steps ago, its rows that sampled and whose slot
    was not freed since, tokens padded with zeros to spec + 1, drafts when updated."""
    answer: list[Consumed] = []
    for now in range(world.depth, len(world.plans)):
        then = now - world.depth
        plan = world.plans[then]
        freed = {s for p in world.plans[then + 1 : now + 1] for s in p.frees}
        k = plan.width
        rows: list[Row] = []
        for slot, samples in zip(plan.slots, plan.samples, strict=True):
            if not samples or slot in freed:
                continue
            tokens = [token(then, slot, j) for j in range(k)] + [0] * (world.spec + 1 - k)
            drafts = None
            if world.spec:  # the receiver's table: written only by a consume that updates it
                sent = [draft(then, slot, j) for j in range(world.spec)]
                drafts = sent if world.update_drafts else [0] * world.spec
            rows.append((slot, tokens, num_sampled(slot, k), num_rejected(slot, k), drafts))
        if rows:
            answer.append((now, then, rows))
    return answer


@st.composite
def worlds(draw: st.DrawFn) -> World:
    pp = draw(st.integers(2, 5))
    spec = draw(st.integers(0, 3))
    m = draw(st.integers(1, 6))
    wire = draw(st.sampled_from(list(Wire)))
    buckets = None
    if wire is Wire.FIXED and draw(st.booleans()):
        extra = draw(st.lists(st.integers(1, m + 3), max_size=3))
        buckets = tuple(sorted({*extra, m + draw(st.integers(0, 2))}))
    plans = []
    for _ in range(draw(st.integers(1, 3 * pp + 2))):
        slots = draw(st.permutations(range(m)))[: draw(st.integers(0, m))]
        plans.append(
            Plan(
                slots=tuple(slots),
                samples=tuple(draw(st.booleans()) for _ in slots),
                width=draw(st.integers(1, spec + 1)),
                frees=tuple(draw(st.lists(st.integers(0, m - 1), max_size=3))),
            )
        )
    return World(
        pp=pp,
        spec=spec,
        max_num_reqs=m,
        plans=tuple(plans),
        wire=wire,
        header=draw(st.booleans()),
        platform=draw(st.sampled_from(list(Platform))),
        buckets=buckets,
        update_drafts=draw(st.booleans()),
    )


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=worlds())
def test_every_stage_consumes_what_the_seed_hands_out_on_any_wire(world: World) -> None:
    """Behaviour: on every wire (with or without the header, any platform, custom buckets),
    each non-last stage's consume at step T yields exactly the seed's answer for the entry
    of step T - ring_depth: only rows that sampled and whose slot was not freed since, the
    sent tokens zero-padded from any width 1..spec+1 to spec+1, the sent counts, and the
    sent drafts written to the kept slots of the receiver's table with update_drafts (the
    table untouched without); None when no row is kept."""
    seen = run(world)
    expected = seed_answer(world)
    for stage in range(world.pp - 1):
        assert seen[stage] == expected, f"stage {stage}"


def reuse_plans(pp: int, offset: int) -> tuple[Plan, ...]:
    """Slot 1 is held by request A until step `offset`, freed, and taken by B at once;
    slot 0 is a bystander. Plain-sampler and speculative widths alternate."""
    return tuple(
        Plan(
            slots=(1, 0),
            samples=(True, True),
            width=1 + t % 3,
            frees=(1,) if t == offset + 1 else (),
        )
        for t in range(offset + pp + 3)
    )


@pytest.mark.parametrize("wire", list(Wire))
def test_a_deep_pipeline_drops_a_freed_slots_token_at_every_ring_offset(wire: Wire) -> None:
    """Behaviour: with pp_size 8 and speculation, a slot freed at any of the ring's 8 offsets
    and reused at once gets none of its old request's in-flight tokens or drafts on any of
    the 7 receiving stages, while the bystander slot keeps every step's."""
    pp = 8
    for offset in range(pp):
        world = World(pp=pp, spec=2, max_num_reqs=2, plans=reuse_plans(pp, offset), wire=wire)
        seen = run(world)
        expected = seed_answer(world)
        dropped = [then for _, then, rows in expected if all(r[0] != 1 for r in rows)]
        assert dropped == list(range(offset + 1)), offset  # every entry of A still in flight
        for stage in range(pp - 1):
            assert seen[stage] == expected, (offset, stage)


@pytest.mark.parametrize("header", [False, True])
@pytest.mark.parametrize("wire", list(Wire))
def test_extreme_token_and_count_values_cross_every_wire_unchanged(
    wire: Wire, header: bool
) -> None:
    """Behaviour: the relay carries values, it does not interpret them: int64 extremes in
    the tokens and drafts and int32 extremes (and -1) in num_sampled / num_rejected reach
    the receivers bit for bit on every wire, with or without the header."""
    tokens = np.array([[I64.min, I64.max], [-1, 0]], np.int64)
    counts = np.array([I32.min, I32.max], np.int32)
    rejected = np.array([-1, I32.max], np.int32)
    table = np.array([[I64.max], [0], [I64.min]], np.int64)
    got: list[tuple[object, ...]] = []

    def program(context: RankContext) -> Iterator[tuple[Effect, ...]]:
        config = RelayConfig.for_stage(
            pp_size=2,
            stage=context.stage,
            max_num_reqs=3,
            num_speculative_steps=1,
            wire=wire,
            validate_header=header,
        )
        state, inputs, it = init_relay(config), config.inputs, context.interpreter
        if not config.is_last_stage:
            it.bind(inputs.draft_table, np.zeros((3, 1), np.int64))
        spec = TensorSpec((3, 1), DType.INT64)
        batch = facts(Plan(slots=(2, 0), samples=(True, True)))
        for _ in range(3):
            it.bind(inputs.idx_mapping, np.array([2, 0], np.int32))
            effects: list[Effect] = []
            if config.is_last_stage:
                for ref, value in (
                    (inputs.sampled_tokens, tokens),
                    (inputs.num_sampled, counts),
                    (inputs.num_rejected, rejected),
                    (inputs.draft_table, table),
                ):
                    it.bind(ref, value)
                packed = None if wire is Wire.SEED else spec
                sent = broadcast_sampled(
                    config, state, batch, TensorSpec((2, 2), DType.INT64), packed
                )
                effects, state = list(sent.effects), sent.state
                if wire is Wire.SEED:
                    drafts = broadcast_drafts(config, state, batch, spec)
                    effects, state = effects + list(drafts.effects), drafts.state
            else:
                taken = consume_previous_step(config, state, update_drafts=True)
                yield taken.effects
                if taken.result is not None:
                    out = taken.result
                    got.append(
                        (
                            it.host_array(out.sampled_tokens).tolist(),
                            it.host_array(out.num_sampled).tolist(),
                            it.host_array(out.num_rejected).tolist(),
                            it.host_array(inputs.draft_table).tolist(),
                        )
                    )
                posted = receive(config, taken.state, batch)
                effects, state = list(posted.effects), posted.state
            ended = end_step(config, state)
            state = ended.state
            yield (*effects, *ended.effects)

    simulate(Layout(pp=2, dp=1), program)
    assert got == [(tokens.tolist(), counts.tolist(), rejected.tolist(), table.tolist())]


# --- boundary checks ------------------------------------------------------------------------------


def _with_a_pending_entry() -> tuple[RelayConfig, RelayState]:
    """A speculating receiver (pp 2) whose next consume pops a real entry."""
    config = RelayConfig.for_stage(pp_size=2, stage=0, max_num_reqs=4, num_speculative_steps=1)
    state = init_relay(config)
    for plan in (Plan(slots=(0, 1), samples=(True, True)), Plan(slots=(2,), samples=(True,))):
        state = consume_previous_step(config, state).state
        state = receive(config, state, facts(plan)).state
        state = end_step(config, state).state
    return config, state


@pytest.mark.parametrize("bad", ["no", 1, np.array([True, True])], ids=["str", "int", "array"])
def test_consume_refuses_an_update_drafts_that_is_not_a_bool(bad: object) -> None:
    """Behaviour (contract 9): consume_previous_step given update_drafts that is not a bool
    raises a PureppError naming the call, the value and the fix, as validate_header does
    for RelayConfig; it neither reads "no" as True nor lets numpy's ValueError escape."""
    config, state = _with_a_pending_entry()
    with pytest.raises(PureppError) as caught:
        consume_previous_step(config, state, update_drafts=bad)  # type: ignore[arg-type]
    assert caught.value.call == "consume_previous_step"
    assert "update_drafts" in str(caught.value)


@pytest.mark.parametrize("spec", [np.uint8(255), np.int8(127)], ids=["uint8", "int8"])
def test_a_numpy_integer_speculation_depth_gives_the_python_int_wire_width(
    spec: np.integer[Any],
) -> None:
    """Behaviour: RelayConfig accepts numpy integers (they pass its range check), so a
    config built from one equals the Python-int config in every derived value: the wire
    width is spec + 1 and the receives post [n, spec + 1] tokens, never a wrapped width."""
    config = RelayConfig.for_stage(
        pp_size=2,
        stage=0,
        max_num_reqs=4,
        num_speculative_steps=spec,  # type: ignore[arg-type]
    )
    assert config.max_sample_len == int(spec) + 1
    state = consume_previous_step(config, init_relay(config)).state
    posted = receive(config, state, facts(Plan(slots=(0,), samples=(True,))))
    shapes = [e.shape for e in posted.effects if isinstance(e, Broadcast)]
    assert shapes[0] == (1, int(spec) + 1)


def _packed_receive_words(spec: int) -> tuple[int, ...]:
    config = RelayConfig(
        pp_size=2,
        stage=0,
        last_rank=1,
        max_num_reqs=32,
        num_speculative_steps=spec,
        wire=Wire.PACKED,
    )
    state = consume_previous_step(config, init_relay(config)).state
    plan = Plan(slots=tuple(range(20)), samples=(True,) * 20)
    posted = receive(config, state, facts(plan))
    (wire,) = [e for e in posted.effects if isinstance(e, Broadcast)]
    return wire.shape


def test_a_numpy_integer_config_does_not_shrink_the_packed_wire_of_any_config() -> None:
    """Behaviour: the packed wire of 20 rows with spec 3 is 160 int64 words (640 bytes of
    tokens, 80 + 80 of counts, 480 of drafts), whether the config's speculation depth was
    a numpy int8 or a Python int, and whichever was built first in the process."""
    caches = (relay._packed_layout, relay._input_sections)
    for cache in caches:
        cache.cache_clear()
    try:
        numpy_first = _packed_receive_words(np.int8(3))  # type: ignore[arg-type]
        python_after = _packed_receive_words(3)
    finally:
        for cache in caches:
            cache.cache_clear()  # leave no wrapped layout to other tests
    assert (numpy_first, python_after) == ((160,), (160,))


@pytest.mark.parametrize(
    "bad", [np.int64(5), 0, -1, 4.0, "4"], ids=["np.int64", "zero", "negative", "float", "str"]
)
def test_default_buckets_takes_numpy_ints_and_refuses_the_rest_with_a_typed_error(
    bad: object,
) -> None:
    """Behaviour: default_buckets (public, the fixed wire's default) gives
    default_buckets(5) == (1, 2, 4, 5) for numpy's 5 too, as RelayConfig.for_stage takes
    numpy ints; for anything that is not a request count >= 1 it raises a PureppError
    naming default_buckets, never a raw AttributeError or a bucket list RelayConfig refuses."""
    if isinstance(bad, np.integer):
        assert default_buckets(bad) == default_buckets(int(bad))  # type: ignore[arg-type]
        return
    with pytest.raises(PureppError) as caught:
        default_buckets(bad)  # type: ignore[arg-type]
    assert caught.value.call == "default_buckets"


def test_wire_rows_past_the_largest_bucket_is_a_typed_error() -> None:
    """Behaviour: the public RelayConfig.wire_rows, asked for more rows than the largest
    bucket, raises a PureppError naming the call and the count, not StopIteration."""
    config = RelayConfig.for_stage(pp_size=2, stage=0, max_num_reqs=4, wire=Wire.FIXED)
    assert config.wire_rows(3) == 4
    with pytest.raises(PureppError) as caught:
        config.wire_rows(5)
    assert "5" in str(caught.value)


def _hand_built(case: str) -> tuple[RelayConfig, RelayState]:
    config = RelayConfig.for_stage(pp_size=2, stage=0, max_num_reqs=4)
    good = init_relay(config)
    pending = receive(config, good, facts(Plan(slots=(0,), samples=(True,)))).state.ring[-1]
    assert isinstance(pending, PendingReceive)
    step: Any = good.step
    ring: Any = good.ring
    table: Any = good.generations
    if case == "0-d table":
        table = frozen(np.array(0, np.int32))
    elif case == "int64 table":
        table = frozen(np.zeros(4, np.int64))
    elif case == "str step":
        step = "7"
    else:
        ring = (1, pending)
    return config, RelayState(step=step, ring=ring, generations=table)


@pytest.mark.parametrize("case", ["0-d table", "int64 table", "str step", "int in ring"])
def test_a_hand_built_state_of_the_wrong_types_is_refused_when_built(case: str) -> None:
    """Behaviour (contract 9; RelayState is public, as the rank's phase values are): a
    RelayState whose generations table is not a 1-D int32 array, whose step is not an
    int, or whose ring holds something other than None / PendingReceive is refused when
    built, with an error naming RelayState and the field; a state the steps return
    (trusted, never rechecked) and a good hand-built one are taken."""
    config = RelayConfig.for_stage(pp_size=2, stage=0, max_num_reqs=4)
    good = init_relay(config)
    rebuilt = RelayState(step=good.step, ring=good.ring, generations=good.generations)
    assert rebuilt == good
    counted = RelayState(step=np.int64(3), ring=good.ring, generations=good.generations)  # type: ignore[arg-type]
    assert type(counted.step) is int  # numpy's step is stored as the int it equals
    assert end_step(config, rebuilt).state.step == 1
    field = {"0-d table": "generations", "int64 table": "generations", "str step": "step"}
    with pytest.raises(PureppError, match=rf"^RelayState: {field.get(case, 'ring')}") as caught:
        _hand_built(case)
    assert caught.value.call == "RelayState"
