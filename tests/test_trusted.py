"""Trusted constructors make what the classes' own constructors make.

The pure steps build their effects, names and states with `purepp._trusted.trusted(cls)`,
which sets the slots without the class's converters, validators or post-init checks.
That is sound only while every value they pass is one the class's own constructor
accepts unchanged. Over random relay schedules and DP worlds, every instance of a class
the library builds this way is rebuilt by the class itself from its fields: it must not
raise, must be equal, and every converter must hand back the value it was given.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import purepp.dp
import purepp.effects.io
import purepp.rank
import purepp.relay
from purepp._trusted import trusted
from purepp.dp import AgreementGroup, AgreementLanes, finish_agreement, start_agreement
from purepp.effects.io import NumpyIO, TorchIO
from purepp.effects.numpy_interpreter import NumpyInterpreter
from purepp.effects.torch_interpreter import TorchInterpreter
from purepp.effects.vocabulary import (
    Broadcast,
    BufferRef,
    Communicator,
    DType,
    EventRef,
    Op,
    Stream,
    TensorSpec,
)
from purepp.rank import RankDriver, Sampled, ShapeFacts, init_rank
from purepp.relay import (
    RelayConfig,
    Wire,
    consume_previous_step,
    end_step,
    init_relay,
    receive,
)
from purepp.testing import ScheduleConfig, make_schedule, rank_config
from tests.strategies import DPWorld, batch_schedules, dp_worlds
from tests.test_keyed_effects import relay_pairs, sender_batches


def _trusted_classes() -> set[type]:
    """Every class a purepp module builds with a trusted constructor."""
    found = set()
    for module in (purepp.relay, purepp.dp, purepp.rank, purepp.effects.io):
        for value in vars(module).values():
            if isinstance(value, types.FunctionType) and value.__code__.co_filename.startswith(
                "<purepp.trusted "
            ):
                found.add(value.__globals__["cls"])
    return found


TRUSTED = _trusted_classes()


def _instances(value: object) -> Iterator[Any]:
    """`value` and every attrs instance inside it (through attrs fields and tuples)."""
    if isinstance(value, tuple):
        for item in value:
            yield from _instances(item)
    elif attrs.has(type(value)):
        yield value
        for field in attrs.fields(type(value)):  # type: ignore[arg-type]  # attrs.has says
            yield from _instances(getattr(value, field.name))


def _rebuilt_equal(value: object) -> int:
    """Rebuild each trusted-class instance inside `value` with its class; count them."""
    checked = 0
    for instance in _instances(value):
        cls = type(instance)
        if cls not in TRUSTED:
            continue
        fields = {f.alias: getattr(instance, f.name) for f in attrs.fields(cls)}
        rebuilt = cls(**fields)
        assert rebuilt == instance, instance
        # Each converter handed back the very value it was given: nothing needed converting.
        for field in attrs.fields(cls):
            assert getattr(rebuilt, field.name) is getattr(instance, field.name), field.name
        checked += 1
    return checked


def test_the_library_builds_effects_and_states_with_trusted_constructors() -> None:
    names = {cls.__name__ for cls in TRUSTED}
    assert {"Broadcast", "Allocate", "Release", "RelayState", "PendingReceive"} <= names
    assert {"AllReduce", "NoteDecision", "PendingAgreement", "DPSyncState"} <= names
    assert "DispatchOutcome" in names
    assert {"Begun", "Agreed", "RankState", "Agreeing", "TensorSpec"} <= names


@pytest.mark.parametrize("dtype", ["int64", "int32"])
@pytest.mark.parametrize("shape", [(0,), (3,), (4, 2)])
def test_an_io_spec_is_what_tensorspec_would_build(dtype: str, shape: tuple[int, ...]) -> None:
    """Both StepIOs build the spec of a caller's tensor with a trusted constructor."""
    numpy_interpreter = NumpyInterpreter()
    torch_interpreter = TorchInterpreter(device=torch.device("cpu"), groups={}, rank=0)
    ref = BufferRef("caller")
    numpy_interpreter.bind(ref, np.zeros(shape, dtype=dtype))
    torch_interpreter.bind(ref, torch.zeros(shape, dtype=getattr(torch, dtype)))
    for io in (NumpyIO(numpy_interpreter), TorchIO(torch_interpreter)):
        spec = io.spec(ref)
        assert _rebuilt_equal(spec) == 1
        assert spec == TensorSpec(shape=shape, dtype=DType(dtype))
        assert type(spec.shape) is tuple
        assert all(type(n) is int for n in spec.shape)


@settings(max_examples=60, deadline=None)
@given(pair=relay_pairs(), data=st.data())
def test_every_relay_value_is_what_its_class_would_build(
    pair: tuple[RelayConfig, RelayConfig], data: st.DataObject
) -> None:
    receiver, sender = pair
    schedule = data.draw(batch_schedules(receiver.max_num_reqs, max_steps=8))
    widths = data.draw(st.lists(st.integers(1, 3), min_size=len(schedule)))
    checked = sum(_rebuilt_equal(batch) for batch in sender_batches(sender, schedule, widths))
    state = init_relay(receiver)
    checked += _rebuilt_equal(state)
    for batch, _ in schedule:
        consumed = consume_previous_step(receiver, state, update_drafts=True)
        posted = receive(receiver, consumed.state, batch)
        ended = end_step(receiver, posted.state)
        state = ended.state
        checked += sum(_rebuilt_equal(step) for step in (consumed, posted, ended))
    assert checked > 0


@settings(max_examples=150, deadline=None)
@given(dp_worlds())
def test_every_agreement_value_is_what_its_class_would_build(world: DPWorld) -> None:
    dispatcher, batches = world
    groups = [AgreementGroup(dp_size=len(batches), dp_rank=r) for r in range(len(batches))]
    started = [
        start_agreement(AgreementLanes(), g, dispatcher, b, step=3)
        for g, b in zip(groups, batches, strict=True)
    ]
    checked = sum(_rebuilt_equal(s) for s in started)
    table = np.zeros((5, len(batches)), dtype=np.int32)
    for s in started:
        table += s.result.contribution if s.result.contribution is not None else 0
    for s in started:
        reduced = None if s.result.decided is not None else table
        checked += _rebuilt_equal(finish_agreement(s.state, s.result, reduced))
    assert checked > 0


@pytest.mark.parametrize("wire", list(Wire))
@pytest.mark.parametrize("overlap", [False, True])
def test_every_rank_phase_value_is_what_its_class_would_build(wire: Wire, overlap: bool) -> None:
    """One stage relaying to itself (both roles), agreeing at once or one step ahead."""
    schedule = make_schedule(ScheduleConfig(pp=1, dp=1, spec=2, steps=10, seed=4, wire=wire))
    interpreter = NumpyInterpreter()
    io = NumpyIO(interpreter)
    driver = RankDriver(rank_config(schedule, 0), interpreter, io)
    spec, slots = schedule.config.spec, schedule.config.max_num_reqs
    io.bind(driver.config.relay.inputs.draft_table, np.zeros((slots, spec), np.int64))
    state = init_rank(driver.config)
    checked = _rebuilt_equal(state)

    def shape_at(step: int) -> ShapeFacts:
        planned = schedule.at(step, 0)
        return ShapeFacts(
            num_tokens=planned.num_tokens, uniform_token_count=planned.uniform_token_count
        )

    for step in range(schedule.config.steps):
        planned = schedule.at(step, 0)
        begun = driver.begin(state)
        if not overlap:
            agreed = driver.agree(begun, planned.batch, shape_at(step), freed=planned.freed)
        else:
            if begun.agreeing is None:
                begun = driver.start(begun, planned.batch, shape_at(step))
            checked += _rebuilt_equal(begun)
            agreed = driver.settle(begun, freed=planned.freed)
            if step + 1 < schedule.config.steps:
                ahead = schedule.at(step + 1, 0).batch
                agreed = driver.start_next(agreed, ahead, shape_at(step + 1))
        drafts = np.zeros((slots, spec), np.int64)
        drafts[planned.batch.idx_mapping] = planned.drafts
        sampled = Sampled(
            tokens=np.array(planned.sampled_tokens),
            num_sampled=np.array(planned.num_sampled),
            num_rejected=np.array(planned.num_rejected),
            draft_table=drafts,
        )
        state = driver.finish(agreed, sampled)
        checked += sum(_rebuilt_equal(value) for value in (begun, agreed, state))
    assert checked > 0


def test_a_trusted_constructor_is_called_as_the_class_and_makes_a_frozen_equal_value() -> None:
    make = trusted(Broadcast)
    fields: dict[str, Any] = {
        "step": 3,
        "op": Op.RECEIVE,
        "buffer": BufferRef("relay.step3.wire"),
        "shape": (4,),
        "dtype": DType.INT64,
        "src": 1,
        "comm": Communicator.PP_RELAY,
        "stream": Stream.RELAY,
    }
    made = make(**fields)
    assert type(made) is Broadcast
    assert made == Broadcast(**fields)
    assert hash(made) == hash(Broadcast(**fields))
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        made.step = 4  # type: ignore[misc]
    positional: Any = make  # mypy refuses this call, as it refuses the class's
    with pytest.raises(TypeError):
        positional(3, Op.RECEIVE)  # keyword-only, as the class


def test_a_trusted_constructor_keeps_the_classes_defaults_and_positional_fields() -> None:
    @attrs.frozen
    class Pair:
        first: int
        second: tuple[int, ...] = ()

    make = trusted(Pair)
    assert make(1) == Pair(1)
    assert make(1, (2,)) == Pair(first=1, second=(2,))


@attrs.frozen
class _WithFactory:
    items: list[int] = attrs.field(factory=list)


@attrs.frozen(kw_only=False)
class _Mixed:
    a: int
    b: int = attrs.field(kw_only=True)


@attrs.define(slots=False)
class _NoSlots:
    a: int


@attrs.frozen
class _Derived:
    a: int
    b: int = attrs.field(init=False)


@pytest.mark.parametrize(
    ("cls", "why"),
    [
        (EventRef, "cache_hash"),
        (_NoSlots, "slotted"),
        (_WithFactory, "factory default"),
        (_Mixed, "mixes keyword-only"),
        (_Derived, "init=False"),
    ],
)
def test_a_class_a_trusted_constructor_cannot_build_alike_is_refused(cls: type, why: str) -> None:
    with pytest.raises(TypeError, match=why):
        trusted(cls)
