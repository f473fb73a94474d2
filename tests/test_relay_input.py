"""The relay's inputs: per-instance names, immutable values, and a boundary that takes no garbage.

- Two relays on one interpreter read and write only their own names.
- Every array a state, an effect or a result holds is immutable all the way down.
- Every public relay, batch and rank function given wrong types or values raises a
  `PureppError` (never a raw TypeError, AttributeError, OverflowError or ValueError)
  or returns a correct result, and leaves the state it was given as it was.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import attrs
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from purepp import dp
from purepp.batch import BatchFacts
from purepp.effects.arrays import is_frozen
from purepp.effects.io import NumpyIO
from purepp.effects.numpy_interpreter import NumpyInterpreter
from purepp.effects.simulator import RankContext, simulate
from purepp.effects.vocabulary import Broadcast, BufferRef, DType, Effect, EventRef, TensorSpec
from purepp.errors import InvalidInputError, PureppError
from purepp.layout import Layout
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
    perform_phase,
)
from purepp.relay import (
    Platform,
    RelayConfig,
    RelayState,
    Wire,
    broadcast_drafts,
    broadcast_sampled,
    consume_previous_step,
    default_buckets,
    end_step,
    free_request_slot,
    free_request_slots,
    init_relay,
    receive,
    relay_aux_hidden_states,
    relay_header,
)
from purepp.step import Step
from purepp.testing import ScheduleConfig, make_schedule, record_scripted_logs
from tests.relay_reference import arrays_in
from tests.strategies import DECODE, PARTIAL, UNREADABLE_ARRAYS, make_batch

R = TypeVar("R")

# --- two relays on one interpreter --------------------------------------------------------------

STEPS = 6
RELAYS = ("a", "b")


def names_in(effects: tuple[Effect, ...]) -> set[str]:
    """Every buffer and event name the effects mention."""
    found: set[str] = set()

    def walk(value: object) -> None:
        if isinstance(value, BufferRef | EventRef):
            found.add(value.name)
        elif attrs.has(type(value)):
            for field in attrs.fields(cast("type[attrs.AttrsInstance]", type(value))):
                walk(getattr(value, field.name))
        elif isinstance(value, tuple):
            for item in value:
                walk(item)

    for effect in effects:
        walk(effect)
    return found


def token(relay: str, step: int, row: int) -> int:
    return (1 + RELAYS.index(relay)) * 10_000 + step * 10 + row


def two_relays(
    seen: dict[str, list[tuple[int, list[int], list[int]]]], mentioned: dict[str, set[str]]
) -> Callable[[RankContext], Iterator[tuple[Effect, ...]]]:
    """A pp=2 program running relays "a" and "b" side by side on each rank's interpreter."""

    def program(context: RankContext) -> Iterator[tuple[Effect, ...]]:
        interpreter = context.interpreter
        configs = {
            name: RelayConfig.for_stage(
                pp_size=2, stage=context.stage, max_num_reqs=4, num_speculative_steps=1, name=name
            )
            for name in RELAYS
        }
        states = {name: init_relay(config) for name, config in configs.items()}
        for config in configs.values():
            if not config.is_last_stage:
                interpreter.bind(config.inputs.draft_table, np.zeros((4, 1), np.int64))
        for step in range(STEPS):
            slots = [step % 4, (step + 1) % 4]
            facts = make_batch(slots, [DECODE, DECODE])
            for name, config in configs.items():
                inputs = config.inputs
                state = states[name]
                steps: list[Step[RelayState, Any]] = []  # the step's calls, yet to perform
                interpreter.bind(inputs.idx_mapping, np.array(slots, np.int32))
                if config.is_last_stage:
                    tokens = np.array([[token(name, step, r)] for r in range(2)], np.int64)
                    table = np.zeros((4, 1), np.int64)
                    table[slots, 0] = [-token(name, step, r) for r in range(2)]
                    interpreter.bind(inputs.sampled_tokens, tokens)
                    interpreter.bind(inputs.num_sampled, np.ones(2, np.int32))
                    interpreter.bind(inputs.num_rejected, np.zeros(2, np.int32))
                    interpreter.bind(inputs.draft_table, table)
                    sent = broadcast_sampled(config, state, facts, TensorSpec((2, 1), DType.INT64))
                    drafts = TensorSpec((4, 1), DType.INT64)
                    steps += [sent, broadcast_drafts(config, sent.state, facts, drafts)]
                else:
                    # The consume is performed first: its outputs are read before receive.
                    taken = consume_previous_step(config, state, update_drafts=True)
                    mentioned[name] |= names_in(taken.effects)
                    yield taken.effects
                    if taken.result is not None:
                        out = taken.result
                        rows = interpreter.host_array(out.sampled_tokens)[:, 0].tolist()
                        table = interpreter.host_array(inputs.draft_table)
                        slots_read = out.idx_mapping_np.tolist()
                        drafts_read = [int(table[s, 0]) for s in slots_read]
                        seen[name].append((out.received_at_step, rows, drafts_read))
                    steps.append(receive(config, taken.state, facts))
                for made in steps:
                    mentioned[name] |= names_in(made.effects)
                ended = end_step(config, steps[-1].state)
                mentioned[name] |= names_in(ended.effects)
                states[name] = ended.state
                yield (*(e for made in steps for e in made.effects), *ended.effects)

    return program


def test_two_relays_on_one_interpreter_do_not_clash() -> None:
    seen: dict[str, list[tuple[int, list[int], list[int]]]] = {name: [] for name in RELAYS}
    mentioned: dict[str, set[str]] = {name: set() for name in RELAYS}
    simulate(Layout(pp=2, dp=1), two_relays(seen, mentioned))
    for name in RELAYS:
        # Each consumer reads its own relay's tokens and drafts, every step, in order.
        assert seen[name] == [
            (
                step,
                [token(name, step, r) for r in range(2)],
                [-token(name, step, r) for r in (0, 1)],
            )
            for step in range(STEPS - 2)
        ]
        assert all(found.startswith(f"{name}.") for found in mentioned[name])
    assert not mentioned["a"] & mentioned["b"]


def test_inputs_are_named_from_the_relay_name() -> None:
    config = RelayConfig.for_stage(pp_size=2, stage=0, max_num_reqs=4, name="draft_model")
    names = [ref.name for ref in attrs.astuple(config.inputs, recurse=False)]
    assert all(n.startswith("draft_model.input.") for n in names)
    assert len(set(names)) == 5
    # The inputs follow the name, and are not part of the config's identity.
    assert config == attrs.evolve(config)
    assert attrs.evolve(config, name="x").inputs.idx_mapping.name == "x.input.idx_mapping"


# --- immutability -------------------------------------------------------------------------------


def every_value_of_a_scripted_run(wire: Wire) -> Iterator[object]:
    """The pure steps' states, effects and results of a recorded scripted run."""
    schedule = make_schedule(ScheduleConfig(pp=2, dp=2, spec=1, steps=8, seed=1, wire=wire))
    for log in record_scripted_logs(schedule):
        yield from log.effects
    for stage in range(2):
        config = RelayConfig.for_stage(
            pp_size=2, stage=stage, max_num_reqs=4, num_speculative_steps=1, wire=wire
        )
        state = init_relay(config)
        yield state
        for step in range(6):
            facts = schedule.at(step, 0).batch
            steps: list[Step[RelayState, Any]] = []
            if config.is_last_stage:
                tokens = TensorSpec((facts.num_reqs, 2), DType.INT64)
                drafts = TensorSpec((4, 1), DType.INT64)
                if wire is Wire.SEED:
                    steps.append(broadcast_sampled(config, state, facts, tokens))
                    steps.append(broadcast_drafts(config, steps[-1].state, facts, drafts))
                else:
                    steps.append(broadcast_sampled(config, state, facts, tokens, drafts))
            else:
                steps.append(consume_previous_step(config, state, update_drafts=True))
                steps.append(receive(config, steps[-1].state, facts))
            steps.append(free_request_slots(config, steps[-1].state, [1]))
            steps.append(end_step(config, steps[-1].state))
            yield facts
            yield from steps
            state = steps[-1].state


@pytest.mark.parametrize("wire", list(Wire))
def test_every_array_in_a_state_effect_or_result_is_frozen(wire: Wire) -> None:
    arrays = [a for value in every_value_of_a_scripted_run(wire) for a in arrays_in(value)]
    assert len(arrays) > 50
    for array in arrays:
        assert is_frozen(array)
        with pytest.raises(ValueError, match=r"(?i)writeable"):
            array.flags.writeable = True
        base = array.base
        while isinstance(base, np.ndarray):
            with pytest.raises(ValueError, match=r"(?i)writeable"):
                base.flags.writeable = True
            base = base.base


def test_caller_arrays_are_copied_into_frozen_ones() -> None:
    slots = np.array([2, 0], np.int32)
    facts = BatchFacts(
        idx_mapping=slots,
        num_computed_tokens=[5, 5],
        num_scheduled_tokens=[1, 1],
        prefill_len=[3, 3],
    )
    slots[0] = 3
    assert facts.idx_mapping.tolist() == [2, 0]
    assert is_frozen(facts.idx_mapping)
    assert facts.sampled_mask is not None
    assert is_frozen(facts.sampled_mask)
    assert is_frozen(relay_header(3, 2))


# --- the boundary takes no garbage --------------------------------------------------------------

CONFIG = RelayConfig.for_stage(pp_size=2, stage=0, max_num_reqs=4, num_speculative_steps=1)
SENDER = RelayConfig.for_stage(pp_size=2, stage=1, max_num_reqs=4, num_speculative_steps=1)
PACKED = RelayConfig.for_stage(
    pp_size=2, stage=1, max_num_reqs=4, num_speculative_steps=1, wire=Wire.PACKED
)
OTHER = RelayConfig.for_stage(pp_size=3, stage=0, max_num_reqs=8)  # a config of another shape
BATCH = make_batch([0, 2], [DECODE, PARTIAL])
TOKENS = TensorSpec((2, 1), DType.INT64)
TABLE = TensorSpec((4, 1), DType.INT64)

NOT_AN_INT = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
    st.just(b"1"),
    st.just(object()),
    st.just([1]),
    st.just(np.float64(2.0)),
    st.just(np.bool_(True)),
)
GARBAGE = st.one_of(
    NOT_AN_INT,
    st.integers(-(2**70), 2**70),
    st.just(2**31),
    st.just(2**32),
    st.just(-1),
    st.lists(
        st.one_of(st.integers(-3, 2**40), st.floats(), st.booleans(), st.text(max_size=1)),
        max_size=3,
    ),
    st.just(np.array([0.5, 1.5])),
    st.just(np.array([True, False])),
    st.just(np.array(["0", "1"])),
    st.just(np.array([[0, 1]])),
    st.just(np.array([2**31, 0], np.int64)),
    st.just(np.array([1, 1])),
    UNREADABLE_ARRAYS,
    st.just(init_relay(OTHER)),
    st.just(init_relay(SENDER)),
    st.just(OTHER),
    st.just(BATCH),
    st.just(TOKENS),
    st.just(TensorSpec((2, 1), DType.INT32)),
    st.just(TensorSpec((2, 9), DType.INT64)),
    st.just(Platform.XPU),
    st.just(Wire.FIXED),
    st.just((1, 2)),
)

# Each public function with good arguments; one of them is replaced by garbage.
CALLS: dict[str, tuple[Callable[..., object], dict[str, object]]] = {
    "BatchFacts": (
        BatchFacts,
        {
            "idx_mapping": [0, 2],
            "num_computed_tokens": [4, 0],
            "num_scheduled_tokens": [1, 2],
            "prefill_len": [4, 8],
        },
    ),
    "RelayConfig": (
        RelayConfig,
        {
            "pp_size": 2,
            "stage": 0,
            "last_rank": 1,
            "max_num_reqs": 4,
            "num_speculative_steps": 1,
            "platform": Platform.CUDA,
            "aux_hidden_state_keys": ("aux",),
            "validate_header": False,
            "wire": Wire.SEED,
            "buckets": (),
            "name": "relay",
        },
    ),
    "RelayConfig.for_stage": (
        RelayConfig.for_stage,
        {
            "pp_size": 2,
            "stage": 0,
            "max_num_reqs": 4,
            "num_speculative_steps": 1,
            "first_rank": 0,
            "platform": Platform.CUDA,
            "wire": Wire.FIXED,
            "buckets": None,
            "name": "relay",
        },
    ),
    "init_relay": (init_relay, {"config": CONFIG}),
    "consume_previous_step": (
        consume_previous_step,
        {"config": CONFIG, "state": init_relay(CONFIG), "update_drafts": True},
    ),
    "receive": (receive, {"config": CONFIG, "state": init_relay(CONFIG), "batch": BATCH}),
    "broadcast_sampled": (
        broadcast_sampled,
        {"config": SENDER, "state": init_relay(SENDER), "batch": BATCH, "sampled": TOKENS},
    ),
    "broadcast_sampled(packed)": (
        broadcast_sampled,
        {
            "config": PACKED,
            "state": init_relay(PACKED),
            "batch": BATCH,
            "sampled": TOKENS,
            "drafts": TABLE,
        },
    ),
    "broadcast_drafts": (
        broadcast_drafts,
        {"config": SENDER, "state": init_relay(SENDER), "batch": BATCH, "drafts": TABLE},
    ),
    "free_request_slot": (
        free_request_slot,
        {"config": CONFIG, "state": init_relay(CONFIG), "slot": 3},
    ),
    "free_request_slots": (
        free_request_slots,
        {"config": CONFIG, "state": init_relay(CONFIG), "slots": [1, 3]},
    ),
    "end_step": (end_step, {"config": CONFIG, "state": init_relay(CONFIG)}),
    "relay_header": (relay_header, {"step": 3, "num_reqs": 2}),
    "relay_aux_hidden_states": (
        relay_aux_hidden_states,
        {
            "config": attrs.evolve(CONFIG, aux_hidden_state_keys=("aux",)),
            "incoming": {"aux": 1},
            "outgoing": {"h": 2},
        },
    ),
    "ShapeFacts": (ShapeFacts, {"num_tokens": 2, "uniform_token_count": 1}),
}


def test_a_relay_step_names_the_type_it_got_instead() -> None:
    state = init_relay(CONFIG)
    refusals: dict[str, Callable[[], object]] = {
        "end_step: config is a dict": lambda: end_step({}, state),  # type: ignore[arg-type]
        "end_step: state is a NoneType": lambda: end_step(CONFIG, None),  # type: ignore[arg-type]
        "receive: batch is a list": lambda: receive(CONFIG, state, []),  # type: ignore[arg-type]
    }
    for message, call in refusals.items():
        with pytest.raises(PureppError) as error:
            call()
        assert str(error.value).startswith(message)


def call_or_error(call: Callable[[], object]) -> object:
    """The call's result, or the PureppError it raised (any other exception propagates)."""
    try:
        return call()
    except PureppError as error:
        return error


def snapshot(value: object) -> object:
    """A deep, comparable copy of a value's arrays (to see that nothing changed)."""
    return [a.tolist() for a in arrays_in(value)], repr(value)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), name=st.sampled_from(sorted(CALLS)))
def test_every_public_function_raises_a_pureppError_or_answers(
    data: st.DataObject, name: str
) -> None:
    function, good = CALLS[name]
    parameter = data.draw(st.sampled_from(sorted(good)), label="parameter")
    bad = data.draw(GARBAGE, label="value")
    arguments = {**good, parameter: bad}
    before = {key: snapshot(value) for key, value in arguments.items()}
    outcome = call_or_error(lambda: function(**arguments))
    if isinstance(outcome, PureppError):
        assert str(outcome).startswith(f"{outcome.call}: ")
        assert outcome.fix
    else:
        check_result(name, arguments, outcome)
    # Nothing passed in was changed (states and arrays above all).
    assert {key: snapshot(value) for key, value in arguments.items()} == before


def check_result(name: str, arguments: dict[str, object], result: object) -> None:
    """An accepted call gave a correct result: no silently truncated or reinterpreted value."""
    if name == "BatchFacts":
        assert isinstance(result, BatchFacts)
        for field in ("idx_mapping", "num_computed_tokens", "num_scheduled_tokens", "prefill_len"):
            given_values = np.asarray(arguments[field])
            assert given_values.dtype.kind in "iu"
            assert getattr(result, field).tolist() == given_values.tolist()
    elif name.startswith("RelayConfig"):
        assert isinstance(result, RelayConfig)
        for key, value in arguments.items():
            if key in ("first_rank", "buckets") or value is None:
                continue
            assert getattr(result, key) == value
            if key != "validate_header" and isinstance(value, int):
                assert type(value) is int  # not a bool, not an int subclass
    elif name == "init_relay":
        assert isinstance(result, RelayState)
    elif name == "relay_header":
        step, num_reqs = arguments["step"], arguments["num_reqs"]
        assert type(step) is int
        assert type(num_reqs) is int
        assert isinstance(result, np.ndarray)
        assert result.tolist() == [step % 2**31, num_reqs]
    elif name == "relay_aux_hidden_states":
        assert isinstance(result, dict)
    elif name == "ShapeFacts":
        assert isinstance(result, ShapeFacts)
        assert type(result.num_tokens) is int
        assert result.uniform_token_count is None or type(result.uniform_token_count) is int
    else:
        assert isinstance(result, Step)
        assert isinstance(result.state, RelayState)
        if "slot" in arguments:
            slot = arguments["slot"]
            assert type(slot) is int or isinstance(slot, np.integer)
            assert result.state.generations.tolist() == [int(i == slot) for i in range(4)]


# --- the rank step's boundary -------------------------------------------------------------------

RANK = RankConfig(relay=CONFIG)
LAST = RankConfig(relay=SENDER)
SHAPE = ShapeFacts(num_tokens=3, need_eager=True)  # no dispatcher: a profile run


def run_phase(phase: StepPhase[R]) -> R:
    """Drive a phase on a fresh numpy interpreter with the relay's inputs bound."""
    interpreter = NumpyInterpreter()
    interpreter.bind(CONFIG.inputs.draft_table, np.zeros((4, 1), np.int64))
    return perform_phase(phase, interpreter)


def numpy_io() -> NumpyIO:
    interpreter = NumpyInterpreter()
    return NumpyIO(interpreter)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), phase=st.sampled_from(["begin", "agree", "finish", "init_rank"]))
def test_the_rank_phases_raise_a_pureppError_or_answer(data: st.DataObject, phase: str) -> None:
    state = init_rank(RANK)
    begun = run_phase(begin(RANK, state))
    io = numpy_io()
    agreed = run_phase(agree(RANK, begun, BATCH, SHAPE, io))
    good: dict[str, dict[str, object]] = {
        "begin": {"config": RANK, "state": state},
        "agree": {
            "config": RANK,
            "begun": begun,
            "batch": BATCH,
            "shape": SHAPE,
            "io": io,
            "freed": [1],
        },
        "finish": {"config": RANK, "agreed": agreed, "io": io},
        "init_rank": {"config": RANK},
    }
    functions: dict[str, Callable[..., Any]] = {
        "begin": begin,
        "agree": agree,
        "finish": finish,
        "init_rank": init_rank,
    }
    function = functions[phase]
    parameter = data.draw(st.sampled_from(sorted(good[phase])), label="parameter")
    bad = data.draw(
        st.one_of(GARBAGE, st.just(state), st.just(LAST), st.just(init_rank(LAST))), label="value"
    )
    arguments = {**good[phase], parameter: bad}

    def call() -> object:
        made = function(**arguments)
        return made if phase == "init_rank" else run_phase(made)

    outcome = call_or_error(call)
    if isinstance(outcome, PureppError):
        assert outcome.fix
    else:
        assert isinstance(outcome, RankState | type(begun) | type(agreed))


def test_finish_refuses_a_last_stage_without_sampled_outputs() -> None:
    state = init_rank(LAST)
    io = numpy_io()
    begun = run_phase(begin(LAST, state))
    agreed = run_phase(agree(LAST, begun, BATCH, SHAPE, io))
    with pytest.raises(PureppError, match="no sampled outputs"):
        run_phase(finish(LAST, agreed, io))
    # The fixed wire sends every step, so only an empty batch may go without them.
    fixed_relay = attrs.evolve(
        LAST.relay, wire=Wire.FIXED, buckets=default_buckets(LAST.relay.max_num_reqs)
    )
    fixed = attrs.evolve(LAST, relay=fixed_relay)
    begun = run_phase(begin(fixed, init_rank(fixed)))
    agreed = run_phase(agree(fixed, begun, BATCH, SHAPE, io))
    with pytest.raises(InvalidInputError, match=r"^finish: the last stage passed no sampled"):
        run_phase(finish(fixed, agreed, io))
    arrays: list[npt.NDArray[Any]] = [np.zeros((2, 1), np.int64), np.ones(2, np.int32)]
    sampled = Sampled(tokens=arrays[0], num_sampled=arrays[1], num_rejected=arrays[1] - 1)
    with pytest.raises(PureppError, match="no draft table"):
        run_phase(finish(LAST, agreed, io, sampled))


@pytest.mark.parametrize("spec", [0, 1])
def test_a_fixed_wire_last_stage_sends_an_empty_batch_without_sampled_outputs(spec: int) -> None:
    # The fixed wire broadcasts every step, so its receivers post the same receives.
    relay = RelayConfig(  # the last stage as global rank 0: the lone interpreter's rank
        pp_size=2,
        stage=1,
        last_rank=0,
        max_num_reqs=4,
        num_speculative_steps=spec,
        wire=Wire.FIXED,
        buckets=default_buckets(4),
    )
    last = RankConfig(relay=relay)
    empty = BatchFacts(
        idx_mapping=[], num_computed_tokens=[], num_scheduled_tokens=[], prefill_len=[]
    )
    begun = run_phase(begin(last, init_rank(last)))
    agreed = run_phase(agree(last, begun, empty, SHAPE, numpy_io()))
    effects = [e for batch in finish(last, agreed, numpy_io()) for e in batch]
    assert [type(e) for e in effects if isinstance(e, Broadcast)] == [Broadcast]
    assert run_phase(finish(last, agreed, numpy_io())).relay.step == 1


def test_rank_facts_take_int32_counts_and_only_receivers_with_drafts_update_them() -> None:
    top = 2**31 - 1
    assert ShapeFacts(num_tokens=top, uniform_token_count=top, max_query_len=top).num_tokens == top
    for field in ("num_tokens", "uniform_token_count", "max_query_len"):
        with pytest.raises(InvalidInputError, match=rf"^ShapeFacts: {field}={top + 1}"):
            ShapeFacts(**{"num_tokens": 1, field: top + 1})  # type: ignore[arg-type]
    for stage, spec, updates in ((0, 0, False), (0, 1, True), (1, 1, False)):
        relay = RelayConfig.for_stage(
            pp_size=2, stage=stage, max_num_reqs=4, num_speculative_steps=spec
        )
        assert RankConfig(relay=relay).updates_drafts is updates


def test_a_group_of_one_decides_without_a_collective() -> None:
    assert RANK.group == dp.AgreementGroup(dp_size=1, dp_rank=0)
    begun = run_phase(begin(RANK, init_rank(RANK)))
    phase = agree(RANK, begun, BATCH, ShapeFacts(num_tokens=3, need_eager=True), numpy_io())
    effects = [e for batch in phase for e in batch]
    assert effects == []


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(0, 80)), max_size=12
    ),
    slot_offset=st.integers(0, 100),
)
def test_batch_facts_derive_the_mask_summary_and_the_largest_slot_from_their_arrays(
    rows: list[tuple[int, int, int]], slot_offset: int
) -> None:
    slots = [slot_offset + 3 * i for i in range(len(rows))]
    batch = BatchFacts(
        idx_mapping=slots,
        num_computed_tokens=[r[0] for r in rows],
        num_scheduled_tokens=[r[1] for r in rows],
        prefill_len=[r[2] for r in rows],
    )
    samples = [computed + scheduled >= prefill for computed, scheduled, prefill in rows]
    assert batch.max_slot == (max(slots) if slots else -1)
    assert batch.all_sampled == (bool(samples) and all(samples))
    if any(samples):
        assert batch.sampled_mask is not None
        assert batch.sampled_mask.tolist() == samples
    else:
        assert batch.sampled_mask is None


@pytest.mark.parametrize("field", range(4))
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_batch_facts_name_the_array_that_holds_a_negative_value(field: int, dtype: type) -> None:
    names = ["idx_mapping", "num_computed_tokens", "num_scheduled_tokens", "prefill_len"]
    arrays: list[npt.NDArray[Any]] = [np.array([1, 3, 5], dtype) for _ in names]
    arrays[field][1] = -2
    for other in range(4):  # zeros elsewhere are in range: the negative value is named
        if other != field:
            arrays[other][0] = 0
    with pytest.raises(InvalidInputError, match=rf"^BatchFacts: {names[field]}=\[1, -2, 5\] holds"):
        BatchFacts(**dict(zip(names, arrays, strict=True)))


@pytest.mark.parametrize(
    ("rows", "shown"), [(8, "[0, 1, 2, 3, 4, 5, 6, -1] "), (9, "[0, 1, 2, 3, 4, 5, 6, 7]... ")]
)
def test_batch_facts_show_at_most_eight_values_of_a_bad_array(rows: int, shown: str) -> None:
    slots = [*range(rows - 1), -1]
    with pytest.raises(InvalidInputError) as caught:
        BatchFacts(
            idx_mapping=slots,
            num_computed_tokens=[0] * rows,
            num_scheduled_tokens=[1] * rows,
            prefill_len=[1] * rows,
        )
    assert shown in str(caught.value)


def test_batch_facts_name_a_repeated_slot_and_a_short_array() -> None:
    with pytest.raises(InvalidInputError, match="several rows to slot 4"):
        BatchFacts(
            idx_mapping=[9, 4, 1, 4],
            num_computed_tokens=[0] * 4,
            num_scheduled_tokens=[1] * 4,
            prefill_len=[1] * 4,
        )
    with pytest.raises(InvalidInputError, match="prefill_len has 3 entries but idx_mapping has 4"):
        BatchFacts(
            idx_mapping=[9, 4, 1, 2],
            num_computed_tokens=[0] * 4,
            num_scheduled_tokens=[1] * 4,
            prefill_len=[1] * 3,
        )
    with pytest.raises(
        InvalidInputError, match="num_computed_tokens has 3 entries but idx_mapping has 0"
    ):
        BatchFacts(
            idx_mapping=[],
            num_computed_tokens=[1, 2, 3],
            num_scheduled_tokens=[1] * 3,
            prefill_len=[1] * 3,
        )


@pytest.mark.parametrize("layout", ["strided", "big-endian", "int16", "list", "mixed"])
def test_batch_facts_read_the_same_values_whatever_their_layout(layout: str) -> None:
    # int32 arrays are read through their buffers; any other layout is converted first.
    values = [[7, 0, 3], [5, 1, 0], [1, 1, 2], [6, 9, 2]]
    wide: list[npt.NDArray[Any]] = [np.array(v, np.int32).repeat(2)[::2] for v in values]
    layouts: dict[str, list[Any]] = {
        "strided": wide,
        "big-endian": [np.array(v, ">i4") for v in values],
        "int16": [np.array(v, np.int16) for v in values],
        "list": values,
        "mixed": [np.array(values[0], np.int32), values[1], np.array(values[2], np.int64), wide[3]],
    }
    given = layouts[layout]
    names = ["idx_mapping", "num_computed_tokens", "num_scheduled_tokens", "prefill_len"]
    facts = BatchFacts(**dict(zip(names, given, strict=True)))
    plain = BatchFacts(**{n: np.array(v, np.int32) for n, v in zip(names, values, strict=True)})
    assert facts == plain
    assert [getattr(facts, n).tolist() for n in names] == values
    assert all(is_frozen(getattr(facts, n)) for n in names)
    assert facts.max_slot == 7
    assert facts.sampled_mask is not None
    assert facts.sampled_mask.tolist() == [True, False, True]


@pytest.mark.parametrize("shape", [(2, 2), ()])
def test_batch_facts_refuse_int32_arrays_that_are_not_one_row_per_request(
    shape: tuple[int, ...],
) -> None:
    # Every array int32 and of one shape: only the number of dimensions is wrong.
    names = ["idx_mapping", "num_computed_tokens", "num_scheduled_tokens", "prefill_len"]
    arrays = {name: np.arange(math.prod(shape), dtype=np.int32).reshape(shape) for name in names}
    with pytest.raises(InvalidInputError, match=rf"idx_mapping has shape {re.escape(str(shape))}"):
        BatchFacts(**arrays)


def test_batch_facts_near_the_int32_limit_do_not_wrap() -> None:
    # computed + scheduled overflows int32; the mask must still say the row samples.
    top = 2**31 - 1
    facts = BatchFacts(
        idx_mapping=[0, 1],
        num_computed_tokens=[top, 0],
        num_scheduled_tokens=[top, 0],
        prefill_len=[top, top],
    )
    assert facts.sampled_mask is not None
    assert facts.sampled_mask.tolist() == [True, False]
    assert not facts.all_sampled


@pytest.mark.parametrize(
    ("value", "dtype"),
    [(2**31, np.int64), (2**32 + 5, np.int64), (2**63 - 1, np.int64), (2**64 - 1, np.uint64)],
)
def test_batch_facts_refuse_a_wide_value_past_int32_instead_of_wrapping(
    value: int, dtype: type
) -> None:
    # 2**32 + 5 cast to int32 is 5: a check after the cast could not see it.
    scheduled: npt.NDArray[Any] = np.array([1, value], dtype=dtype)
    with pytest.raises(InvalidInputError, match=rf"num_scheduled_tokens=\[1, {value}\] holds"):
        BatchFacts(
            idx_mapping=[0, 1],
            num_computed_tokens=[0, 0],
            num_scheduled_tokens=scheduled,
            prefill_len=[1, 1],
        )
