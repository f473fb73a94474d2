"""The relay's pure steps key their batches: equal keys, equal structures; edits unkey.

A step plan is found by the key a pure step puts on its effects (`KeyedEffects`), so a
key that conflated two structures would run one batch by another's plan. Over random
configurations and schedules, every keyed batch is abstracted (`plan.abstract`) and
batches with equal keys must have equal structures. Then: a keyed batch runs its plans
on a one-rank gloo world exactly as eager does.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import attrs
import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from purepp.batch import BatchFacts
from purepp.effects.keyed import KeyedEffects
from purepp.effects.plan import Structure, abstract, name_reader
from purepp.effects.torch_interpreter import TorchInterpreter
from purepp.effects.vocabulary import (
    BufferRef,
    Communicator,
    DType,
    Effect,
    Op,
    Release,
    TensorSpec,
)
from purepp.errors import InvalidInputError
from purepp.relay import (
    Platform,
    RelayConfig,
    Wire,
    broadcast_drafts,
    broadcast_sampled,
    consume_previous_step,
    end_step,
    free_request_slots,
    init_relay,
    receive,
)
from tests.strategies import batch_schedules

CPU = torch.device("cpu")


@st.composite
def relay_pairs(draw: st.DrawFn) -> tuple[RelayConfig, RelayConfig]:
    """A receiving stage and the last stage of one pipeline, any wire and options."""
    pp = draw(st.integers(2, 3))
    common: dict[str, Any] = {
        "pp_size": pp,
        "max_num_reqs": draw(st.integers(1, 6)),
        "num_speculative_steps": draw(st.integers(0, 2)),
        "platform": draw(st.sampled_from(Platform)),
        "validate_header": draw(st.booleans()),
        "wire": draw(st.sampled_from(Wire)),
    }
    receiver = RelayConfig.for_stage(stage=draw(st.integers(0, pp - 2)), **common)
    return receiver, RelayConfig.for_stage(stage=pp - 1, **common)


Batches = list[tuple[Effect, ...]]


def sender_batches(
    config: RelayConfig, schedule: list[tuple[BatchFacts, tuple[int, ...]]], widths: list[int]
) -> Iterator[tuple[Effect, ...]]:
    state = init_relay(config)
    spec = config.num_speculative_steps
    table = TensorSpec(shape=(config.max_num_reqs, spec), dtype=DType.INT64)
    packed = config.wire is not Wire.SEED
    for (batch, freed), width in zip(schedule, widths, strict=False):
        tokens = TensorSpec(shape=(batch.num_reqs, min(width, spec + 1)), dtype=DType.INT64)
        sent = broadcast_sampled(config, state, batch, tokens, table if packed and spec else None)
        state = sent.state
        yield sent.effects
        if spec and not packed:
            drafts = broadcast_drafts(config, state, batch, table)
            state = drafts.state
            yield drafts.effects
        ended = end_step(config, state)
        state = free_request_slots(config, ended.state, freed).state
        yield ended.effects


def receiver_batches(
    config: RelayConfig, schedule: list[tuple[BatchFacts, tuple[int, ...]]], update: list[bool]
) -> Iterator[tuple[Effect, ...]]:
    state = init_relay(config)
    for (batch, freed), update_drafts in zip(schedule, update, strict=False):
        consumed = consume_previous_step(config, state, update_drafts=update_drafts)
        yield consumed.effects
        state = free_request_slots(config, consumed.state, freed).state
        posted = receive(config, state, batch)
        yield posted.effects
        ended = end_step(config, posted.state)
        state = ended.state
        yield ended.effects


@settings(max_examples=60, deadline=None)
@given(
    pairs=st.lists(relay_pairs(), min_size=1, max_size=3),
    data=st.data(),
)
def test_equal_keys_have_equal_structures(
    pairs: list[tuple[RelayConfig, RelayConfig]], data: st.DataObject
) -> None:
    seen: dict[Hashable, Structure] = {}
    keyed = 0
    for receiver, sender in pairs:
        schedule = data.draw(batch_schedules(receiver.max_num_reqs, max_steps=10))
        widths = data.draw(st.lists(st.integers(1, 3), min_size=len(schedule)))
        update = data.draw(st.lists(st.booleans(), min_size=len(schedule)))
        for batch in (
            *sender_batches(sender, schedule, widths),
            *receiver_batches(receiver, schedule, update),
        ):
            if not isinstance(batch, KeyedEffects):
                assert batch == ()  # only empty batches go unkeyed here
                continue
            keyed += 1
            structure, names = abstract(batch)
            assert seen.setdefault(batch.structure, structure) == structure, batch.structure
            # The generated reader finds this batch's names where the structure puts them.
            assert name_reader(batch)(batch) == names
    assert keyed > 0


def test_end_step_keys_its_releases_by_count_only_when_their_names_are_distinct() -> None:
    # A repeated name recurs in the structure: keyed by its count alone, (a, a) would
    # share the plan of (a, b).
    config = RelayConfig.for_stage(pp_size=2, stage=0, max_num_reqs=4)
    state = init_relay(config)
    a, b, c = (BufferRef(f"relay.test.{i}") for i in range(3))
    seen: dict[Hashable, Structure] = {}
    for releases in [(a,), (a, b), (a, a), (a, b, c), (a, b, a), (c, c, c)]:
        effects = end_step(config, attrs.evolve(state, to_release=releases)).effects
        assert len(effects) == len(releases)
        if isinstance(effects, KeyedEffects):
            structure, _ = abstract(effects)
            assert seen.setdefault(effects.structure, structure) == structure, releases
    assert len(seen) == 3  # (a,), (a, b) and (a, b, c); the repeats run unkeyed


def test_a_keyed_batch_is_a_tuple_and_any_edit_unkeys_it() -> None:
    config = RelayConfig.for_stage(pp_size=2, stage=1, max_num_reqs=4, num_speculative_steps=1)
    batch = BatchFacts(
        idx_mapping=np.array([2, 0], dtype=np.int32),
        num_computed_tokens=np.array([10, 10], dtype=np.int32),
        num_scheduled_tokens=np.array([2, 2], dtype=np.int32),
        prefill_len=np.array([4, 4], dtype=np.int32),
    )
    tokens = TensorSpec(shape=(2, 2), dtype=DType.INT64)
    sent = broadcast_sampled(config, init_relay(config), batch, tokens)
    effects = sent.effects
    assert isinstance(effects, KeyedEffects)
    assert effects == tuple(effects)
    assert hash(effects) == hash(tuple(effects))
    assert type(effects[1:]) is tuple
    assert type(effects + effects[:1]) is tuple
    assert type(attrs.evolve(sent, effects=tuple(effects[:-1])).effects) is tuple
    copied = pickle.loads(pickle.dumps(effects))
    assert copied == effects
    assert copied.structure == effects.structure


# ---- keyed plans run exactly as eager on a one-rank gloo world ---------------------------


def _bound_values(interp: TorchInterpreter) -> dict[str, list[object]]:
    """Every bound tensor's values by name, and (under "") every bound name."""
    # The relay stream may still be writing what the batch made (a send buffer, say):
    # reading it on the main stream before it finishes would race.
    if interp.device.type == "cuda":
        torch.cuda.synchronize(interp.device)
    refs = interp.bound_refs()
    # In a one-rank world a receive "receives" its own uninitialised buffer: only the
    # names of what the receiver made are compared, and everything else's values.
    values: dict[str, list[object]] = {
        r.name: interp.tensor(r).tolist()
        for r in refs
        if isinstance(r, BufferRef) and not r.name.startswith("rx.")
    }
    values[""] = [name for name in sorted(r.name for r in refs)]
    return values


def keyed_relay_program(
    interp: TorchInterpreter,
    spec: int,
    wire: Wire,
    after: Callable[[TorchInterpreter], None] | None = None,
    rows: Callable[[int], int] = lambda step: 1 + step % 3,
) -> list[dict[str, list[object]]]:
    """A receiver and a sender relay (both rank 0) for 30 steps of `rows(step)` rows;
    every bound tensor after every batch (`after` is called after each, too)."""
    slots = 6
    common: dict[str, Any] = {
        "pp_size": 2,
        "last_rank": 0,
        "max_num_reqs": slots,
        "num_speculative_steps": spec,
    }
    buckets = (2, 4, slots) if wire is Wire.FIXED else ()
    receiver = RelayConfig(stage=0, wire=wire, buckets=buckets, name="rx", **common)
    sender = RelayConfig(stage=1, wire=wire, buckets=buckets, name="tx", **common)
    rx, tx = init_relay(receiver), init_relay(sender)
    device = interp.device
    table = torch.arange(slots * spec, dtype=torch.int64).reshape(slots, spec).to(device)
    interp.bind(sender.inputs.draft_table, table)
    interp.bind(
        receiver.inputs.draft_table, torch.zeros((slots, spec), dtype=torch.int64).to(device)
    )
    table_spec = TensorSpec(shape=(slots, spec), dtype=DType.INT64)
    rng = np.random.default_rng(spec)
    seen: list[dict[str, list[object]]] = []

    def perform(effects: tuple[Effect, ...]) -> None:
        interp.perform(effects)
        if after is not None:
            after(interp)
        seen.append(_bound_values(interp))

    for step in range(30):
        n = rows(step)
        idx = rng.permutation(slots)[:n].astype(np.int32)
        batch = BatchFacts(
            idx_mapping=idx,
            num_computed_tokens=np.full(n, 10, dtype=np.int32),
            num_scheduled_tokens=np.full(n, 1 + spec, dtype=np.int32),
            prefill_len=np.full(n, 4, dtype=np.int32),
        )
        width = 1 if step % 4 == 3 else spec + 1
        for config in (receiver, sender):
            interp.bind(config.inputs.idx_mapping, torch.from_numpy(idx.copy()).to(device))
        tokens_now = torch.full((n, width), step, dtype=torch.int64)
        interp.bind(sender.inputs.sampled_tokens, tokens_now.to(device))
        interp.bind(sender.inputs.num_sampled, torch.ones(n, dtype=torch.int32).to(device))
        interp.bind(sender.inputs.num_rejected, torch.zeros(n, dtype=torch.int32).to(device))
        # The sender's broadcast (this rank is the source) is what the receiver gets.
        consumed = consume_previous_step(receiver, rx, update_drafts=spec > 0)
        perform(consumed.effects)
        rx = free_request_slots(receiver, consumed.state, (int(idx[0]),) * (step % 5 == 0)).state
        packed = wire is not Wire.SEED
        tokens = TensorSpec(shape=(n, width), dtype=DType.INT64)
        sent = broadcast_sampled(sender, tx, batch, tokens, table_spec if packed and spec else None)
        posted = receive(receiver, rx, batch)
        perform(sent.effects)
        perform(posted.effects)
        tx, rx = sent.state, posted.state
        if spec and not packed:
            drafts = broadcast_drafts(sender, tx, batch, table_spec)
            perform(drafts.effects)
            tx = drafts.state
        for config, state in ((receiver, rx), (sender, tx)):
            ended = end_step(config, state)
            perform(ended.effects)
            if config is receiver:
                rx = ended.state
            else:
                tx = ended.state
    return seen


@pytest.mark.parametrize("wire", list(Wire), ids=[w.value for w in Wire])
@pytest.mark.parametrize("spec", [0, 2])
@pytest.mark.parametrize("checked", [False, True], ids=["fast", "checked"])
def test_keyed_plans_match_eager(
    groups: dict[Communicator, dist.ProcessGroup], wire: Wire, spec: int, checked: bool
) -> None:
    eager = TorchInterpreter(device=CPU, groups=groups, rank=0, checked=checked)
    planned = TorchInterpreter(device=CPU, groups=groups, rank=0, checked=checked, plans=True)
    assert keyed_relay_program(planned, spec, wire) == keyed_relay_program(eager, spec, wire)
    planner = planned.planner
    assert planner is not None
    assert planner.planned > 3 * planner.lowered  # steady steps ran their plans


def test_a_keyed_batch_whose_structure_cannot_be_hashed_is_a_typed_error() -> None:
    # A plan is found by the key: an embedder's own step keying by a list gets the fix.
    interp = TorchInterpreter(device=CPU, groups={}, rank=0, plans=True)
    release = Release(step=0, op=Op.END_STEP, buffer=BufferRef("gone"))
    with pytest.raises(InvalidInputError, match=r"structure key \['end_step'\] is not hashable"):
        interp.perform(KeyedEffects((release,), ["end_step"]))  # type: ignore[arg-type]
    assert interp.bound_refs() == frozenset()
