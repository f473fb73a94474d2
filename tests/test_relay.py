"""The relay's pure steps, one behaviour of the seed's PPHandler per test."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, TypedDict

import attrs
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from purepp.batch import BatchFacts, need_sampled_mask
from purepp.effects.arrays import frozen, is_frozen
from purepp.effects.vocabulary import (
    Alias,
    Allocate,
    Broadcast,
    BufferRef,
    Communicator,
    CopyHostToDevice,
    DType,
    Effect,
    ForgetEvent,
    GatherRows,
    Op,
    PadColumns,
    RecordEvent,
    RecordStream,
    Release,
    ScatterRows,
    Section,
    StackRows,
    Stream,
    TensorSpec,
    Unpack,
    WaitEvent,
    WaitStream,
)
from purepp.errors import ConfigError, InvalidInputError, PureppError, WrongRankError
from purepp.relay import (
    ConsumedOutputs,
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
    free_request_slot,
    free_request_slots,
    init_relay,
    receive,
    relay_aux_hidden_states,
)
from tests.relay_reference import arrays_in
from tests.strategies import DECODE, PARTIAL, make_batch

# Every config here keeps the default name, so they all read the same inputs.
INPUTS = RelayConfig.for_stage(pp_size=1, stage=0, max_num_reqs=1).inputs
DRAFTS_TARGET = INPUTS.draft_table


class Tag(TypedDict):
    step: int
    op: Op


class Route(TypedDict):
    src: int
    comm: Communicator
    stream: Stream


def cfg(
    *,
    pp_size: int = 2,
    stage: int = 0,
    max_num_reqs: int = 8,
    spec: int = 0,
    platform: Platform = Platform.CUDA,
    keys: tuple[str, ...] = (),
) -> RelayConfig:
    return RelayConfig.for_stage(
        pp_size=pp_size,
        stage=stage,
        max_num_reqs=max_num_reqs,
        num_speculative_steps=spec,
        platform=platform,
        aux_hidden_state_keys=keys,
    )


def last(*, pp_size: int = 2, max_num_reqs: int = 8, spec: int = 0) -> RelayConfig:
    return cfg(pp_size=pp_size, stage=pp_size - 1, max_num_reqs=max_num_reqs, spec=spec)


def batch(slots: Sequence[int], rows: Sequence[tuple[int, int, int]] | None = None) -> BatchFacts:
    return make_batch(slots, [DECODE] * len(slots) if rows is None else rows)


def tokens(n: int, width: int = 1) -> TensorSpec:
    return TensorSpec((n, width), DType.INT64)


def pending(state: RelayState) -> PendingReceive:
    entry = state.ring[-1]
    assert entry is not None
    return entry


def consumed(step_result: ConsumedOutputs | None) -> ConsumedOutputs:
    assert step_result is not None
    return step_result


def advance(
    config: RelayConfig, state: RelayState, facts: BatchFacts
) -> tuple[RelayState, ConsumedOutputs | None]:
    """One whole step of a non-last stage: consume, receive, end_step."""
    taken = consume_previous_step(config, state, update_drafts=True)
    received = receive(config, taken.state, facts)
    return end_step(config, received.state).state, taken.result


def assert_names_call_and_fix(error: PureppError, call: str) -> None:
    assert error.call == call
    assert str(error).startswith(f"{call}: ")
    assert "Fix: " in str(error)
    assert error.fix


# --- init ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("pp_size", [1, 2, 4])
def test_init_last_stage_has_an_empty_ring(pp_size: int) -> None:
    state = init_relay(last(pp_size=pp_size, max_num_reqs=5))
    assert state.ring == ()
    assert state.step == 0
    assert state.to_release == ()


@pytest.mark.parametrize(
    ("pp_size", "platform", "depth"),
    [
        (2, Platform.CUDA, 2),
        (4, Platform.CUDA, 4),
        (4, Platform.XPU, 4),
        (4, Platform.XPU_NO_MICROBATCH, 1),
    ],
)
def test_init_other_stages_preseed_ring_depth_empty_entries(
    pp_size: int, platform: Platform, depth: int
) -> None:
    state = init_relay(cfg(pp_size=pp_size, stage=0, platform=platform))
    assert state.ring == (None,) * depth


def test_init_generations_are_zero_int32_and_read_only() -> None:
    state = init_relay(cfg(max_num_reqs=5))
    assert state.generations.dtype == np.int32
    assert state.generations.tolist() == [0] * 5
    assert not state.generations.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        state.generations[0] = 1


# --- free_request_slot(s) -----------------------------------------------------------------------


def test_free_request_slot_bumps_only_that_slot() -> None:
    config = cfg(max_num_reqs=4)
    freed = free_request_slot(config, init_relay(config), 2)
    assert freed.effects == ()
    assert freed.result is None
    assert freed.state.generations.tolist() == [0, 0, 1, 0]
    again = free_request_slot(config, freed.state, 2)
    assert again.state.generations.tolist() == [0, 0, 2, 0]


@pytest.mark.parametrize("dtype", [None, np.int64, np.int32, np.uint64, np.uint8])
def test_free_request_slots_bumps_once_per_occurrence(dtype: type | None) -> None:
    config = cfg(max_num_reqs=5)
    slots = [1, 3, 1, 4, 1]
    arg: list[int] | npt.NDArray[Any] = slots if dtype is None else np.array(slots, dtype=dtype)
    state = free_request_slots(config, init_relay(config), arg).state
    assert state.generations.tolist() == [0, 3, 0, 1, 1]
    assert free_request_slots(config, state, []).state == state


@given(
    st.lists(st.integers(0, 11), max_size=8),
    st.lists(st.integers(0, 11), min_size=40, max_size=60),
)
@settings(max_examples=60)
def test_free_request_slots_counts_every_occurrence_over_successive_frees(
    first: list[int], second: list[int]
) -> None:
    """A few slots, then dozens (the step bumps a few one by one and counts many: both
    ways are drawn every time, since Hypothesis's lists are short unless told)."""
    config = cfg(max_num_reqs=12)
    state = init_relay(config)
    before = state.generations
    once = free_request_slots(config, state, first).state
    twice = free_request_slots(config, once, np.array(second, dtype=np.int64)).state
    assert once.generations.tolist() == [first.count(s) for s in range(12)]
    assert twice.generations.tolist() == [(first + second).count(s) for s in range(12)]
    for freed in (once, twice):
        assert is_frozen(freed.generations)
        assert freed.generations.dtype == np.int32
    # The states each free was given are untouched, `once` by the second free too.
    assert before.tolist() == [0] * 12
    assert once.generations.tolist() == [first.count(s) for s in range(12)]


@pytest.mark.parametrize("slot", [-1, 5, 6, 1000])
def test_free_out_of_range_slot_raises_and_leaves_state_unchanged(slot: int) -> None:
    config = cfg(max_num_reqs=5)
    state = free_request_slot(config, init_relay(config), 0).state
    before = state.generations.copy()
    with pytest.raises(InvalidInputError, match=rf"slot {slot} is outside 0\.\.4") as caught:
        free_request_slots(config, state, [0, 4, slot])  # 0 and 4 are in range: slot is named
    assert_names_call_and_fix(caught.value, "free_request_slots")
    with pytest.raises(InvalidInputError):
        free_request_slot(config, state, slot)
    assert state.generations.tolist() == before.tolist()


@pytest.mark.parametrize("slots", [[1.7], [True, False], np.array([0.0, 2.0])])
def test_free_non_integer_slots_raises(slots: Sequence[object]) -> None:
    config = cfg(max_num_reqs=5)
    with pytest.raises(InvalidInputError) as caught:
        free_request_slots(config, init_relay(config), slots)  # type: ignore[arg-type]
    assert_names_call_and_fix(caught.value, "free_request_slots")


# --- need_sampled_mask --------------------------------------------------------------------------


def test_need_sampled_mask_examples() -> None:
    facts = make_batch(range(4), [(0, 4, 4), (3, 1, 5), (0, 2, 8), (9, 1, 4)])
    mask = need_sampled_mask(facts)
    assert mask is not None
    # Exactly at the prefill length samples; one short of it does not.
    assert mask.tolist() == [True, False, False, True]
    assert not mask.flags.writeable
    assert need_sampled_mask(batch([0, 1], [PARTIAL, PARTIAL])) is None
    assert need_sampled_mask(batch([])) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50), st.integers(0, 50)), max_size=6))
def test_need_sampled_mask_is_computed_plus_scheduled_reaching_prefill(
    rows: list[tuple[int, int, int]],
) -> None:
    facts = make_batch(range(len(rows)), rows)
    expected = [computed + scheduled >= prefill for computed, scheduled, prefill in rows]
    mask = need_sampled_mask(facts)
    if any(expected):
        assert mask is not None
        assert mask.tolist() == expected
    else:
        assert mask is None


# --- receive ------------------------------------------------------------------------------------


@pytest.mark.parametrize("slots", [[], [0, 3]])
def test_receive_with_no_row_needing_a_sample_does_nothing(slots: list[int]) -> None:
    config = cfg()
    state = consume_previous_step(config, init_relay(config)).state
    got = receive(config, state, batch(slots, [PARTIAL] * len(slots)))
    assert got.effects == ()
    assert got.result is False
    assert got.state == state
    assert got.state.ring[-1] is None


def counts_of(entry: PendingReceive) -> BufferRef:
    """The [2, n] counts buffer the seed's wire receives, unpacked into its two rows."""
    (counts,) = [b for b in entry.buffers if b.name.endswith(".counts")]
    return counts


def expected_receive_effects(config: RelayConfig, entry: PendingReceive, n: int) -> list[Effect]:
    """The seed's receive, call for call: wait main, allocate + broadcast, event, the
    counts' rows as views (the seed's unbind), record_stream."""
    spec = config.num_speculative_steps
    tag = Tag(step=entry.step, op=Op.RECEIVE)
    route = Route(src=config.last_rank, comm=Communicator.PP_RELAY, stream=Stream.RELAY)
    shape = (n, spec + 1)
    counts = counts_of(entry)
    effects: list[Effect] = [
        WaitStream(**tag, stream=Stream.RELAY, waits_for=Stream.MAIN),
        Allocate(
            **tag, buffer=entry.sampled_tokens, shape=shape, dtype=DType.INT64, stream=Stream.RELAY
        ),
        Allocate(**tag, buffer=counts, shape=(2, n), dtype=DType.INT32, stream=Stream.RELAY),
        Broadcast(**tag, **route, buffer=entry.sampled_tokens, shape=shape, dtype=DType.INT64),
        Broadcast(**tag, **route, buffer=counts, shape=(2, n), dtype=DType.INT32),
    ]
    received = [entry.sampled_tokens, counts]
    if spec:
        assert entry.draft_tokens is not None
        drafts = entry.draft_tokens
        effects += [
            Allocate(**tag, buffer=drafts, shape=(n, spec), dtype=DType.INT64, stream=Stream.RELAY),
            Broadcast(**tag, **route, buffer=drafts, shape=(n, spec), dtype=DType.INT64),
        ]
        received.append(drafts)
    effects.append(RecordEvent(**tag, stream=Stream.RELAY, event=entry.event))
    rows = (
        Section(buffer=entry.num_sampled, offset=0, shape=(n,), dtype=DType.INT32),
        Section(buffer=entry.num_rejected, offset=4 * n, shape=(n,), dtype=DType.INT32),
    )
    effects.append(Unpack(**tag, source=counts, stream=Stream.MAIN, sections=rows))
    effects += [RecordStream(**tag, buffer=b, stream=Stream.MAIN) for b in received]
    assert entry.idx_mapping is not None
    effects.append(Alias(**tag, source=INPUTS.idx_mapping, out=entry.idx_mapping))
    return effects


@pytest.mark.parametrize("spec", [0, 1, 3])
def test_receive_effects_follow_the_seed_order(spec: int) -> None:
    config = cfg(pp_size=3, stage=1, spec=spec)
    state = consume_previous_step(config, init_relay(config)).state
    got = receive(config, state, batch([4, 0, 2]))
    entry = pending(got.state)
    assert list(got.effects) == expected_receive_effects(config, entry, 3)
    assert (entry.draft_tokens is None) == (spec == 0)
    # Every buffer and the event get a distinct name.
    names = [b.name for b in entry.buffers] + [entry.event.name]
    assert len(set(names)) == len(names)


def test_receive_posts_a_pending_entry_with_a_generation_snapshot() -> None:
    config = cfg(pp_size=3, max_num_reqs=6)
    state = free_request_slots(config, init_relay(config), [2, 2, 5]).state
    state = consume_previous_step(config, state).state
    got = receive(config, state, batch([5, 0, 2], [DECODE, PARTIAL, DECODE]))
    assert got.state.ring[:-1] == (None, None)
    entry = pending(got.state)
    assert entry.step == 0
    assert entry.idx_mapping_np.tolist() == [5, 0, 2]
    assert entry.need_sampled is not None
    assert entry.need_sampled.tolist() == [True, False, True]
    # The state's table itself, shared: a free replaces it, so sharing is a snapshot.
    assert entry.generations_at_receive is state.generations
    assert entry.generations_at_receive[entry.idx_mapping_np].tolist() == [1, 0, 2]
    assert got.state.generations.tolist() == state.generations.tolist()


@pytest.mark.parametrize(
    ("rows", "all_need"),
    [([DECODE, DECODE], True), ([DECODE, PARTIAL], False), ([PARTIAL, DECODE], False)],
)
def test_receive_result_is_whether_every_row_needs_a_sample(
    rows: list[tuple[int, int, int]], all_need: bool
) -> None:
    config = cfg()
    state = consume_previous_step(config, init_relay(config)).state
    got = receive(config, state, batch([1, 2], rows))
    assert got.result is all_need
    assert got.state.ring[-1] is not None


def test_receive_twice_without_consume_raises_and_leaves_state_unchanged() -> None:
    config = cfg()
    state = receive(
        config, consume_previous_step(config, init_relay(config)).state, batch([0])
    ).state
    snapshot = attrs.evolve(state)
    with pytest.raises(InvalidInputError) as caught:
        receive(config, state, batch([1]))
    assert_names_call_and_fix(caught.value, "receive")
    assert state == snapshot
    # After the next step's consume, the newest entry is free again.
    state = consume_previous_step(config, end_step(config, state).state).state
    assert receive(config, state, batch([1])).state.ring[-1] is not None


def test_receive_slot_outside_the_table_raises() -> None:
    config = cfg(max_num_reqs=4)
    with pytest.raises(InvalidInputError) as caught:
        receive(config, init_relay(config), batch([1, 4]))
    assert_names_call_and_fix(caught.value, "receive")


# --- broadcast_sampled --------------------------------------------------------------------------


def test_broadcast_sampled_is_skipped_when_no_row_needs_a_sample() -> None:
    config = last()
    state = init_relay(config)
    got = broadcast_sampled(config, state, batch([0, 1], [PARTIAL, PARTIAL]), tokens(2))
    assert got.effects == ()
    assert got.result is False
    assert got.state == state


@pytest.mark.parametrize(
    "spec_of_tokens",
    [
        TensorSpec((2, 1), DType.INT32),  # not int64
        TensorSpec((2,), DType.INT64),  # not 2-D
        TensorSpec((2, 3), DType.INT64),  # wider than spec + 1 = 2
        TensorSpec((2, 0), DType.INT64),  # no column
        TensorSpec((3, 1), DType.INT64),  # rows differ from the batch
    ],
)
@pytest.mark.parametrize("rows", [[DECODE, DECODE], [PARTIAL, PARTIAL]])
def test_broadcast_sampled_rejects_bad_tokens_even_on_skipped_steps(
    spec_of_tokens: TensorSpec, rows: list[tuple[int, int, int]]
) -> None:
    config = last(spec=1)
    with pytest.raises(InvalidInputError) as caught:
        broadcast_sampled(config, init_relay(config), batch([0, 1], rows), spec_of_tokens)
    assert_names_call_and_fix(caught.value, "broadcast_sampled")


def broadcasts(
    effects: Sequence[Effect],
) -> list[tuple[tuple[int, ...], DType, int, Communicator, Stream]]:
    return [
        (e.shape, e.dtype, e.src, e.comm, e.stream) for e in effects if isinstance(e, Broadcast)
    ]


@pytest.mark.parametrize("spec", [0, 1, 2, 4])
def test_sender_wire_shapes_equal_receiver_wire_shapes_for_every_width(spec: int) -> None:
    # Field failure 1: a plain-sampler step sends [n, 1] while receivers post [n, spec + 1].
    facts = batch([3, 1, 0])
    receiver = cfg(pp_size=3, stage=0, spec=spec)
    posted = receive(receiver, init_relay(receiver), facts).effects
    posted_sampled_and_counts = broadcasts(posted)[:2]
    sender = last(pp_size=3, spec=spec)
    for width in range(1, spec + 2):
        sent = broadcast_sampled(sender, init_relay(sender), facts, tokens(3, width))
        assert broadcasts(sent.effects) == posted_sampled_and_counts


@pytest.mark.parametrize("width", [1, 3])
def test_broadcast_sampled_effects_follow_the_seed_order(width: int) -> None:
    config = last(pp_size=4, spec=2)
    state = attrs.evolve(init_relay(config), step=7)
    got = broadcast_sampled(config, state, batch([2, 5], [DECODE, PARTIAL]), tokens(2, width))
    assert got.result is True
    tag = Tag(step=7, op=Op.BROADCAST)
    route = Route(src=3, comm=Communicator.PP_RELAY, stream=Stream.RELAY)
    send_tokens, send_counts = got.state.to_release
    assert send_tokens != send_counts
    assert list(got.effects) == [
        WaitStream(**tag, stream=Stream.RELAY, waits_for=Stream.MAIN),
        PadColumns(
            **tag,
            source=INPUTS.sampled_tokens,
            out=send_tokens,
            width=3,
            fill=0,
            stream=Stream.RELAY,
        ),
        Broadcast(**tag, **route, buffer=send_tokens, shape=(2, 3), dtype=DType.INT64),
        StackRows(
            **tag,
            sources=(INPUTS.num_sampled, INPUTS.num_rejected),
            out=send_counts,
            stream=Stream.RELAY,
        ),
        Broadcast(**tag, **route, buffer=send_counts, shape=(2, 2), dtype=DType.INT32),
        RecordStream(**tag, buffer=INPUTS.sampled_tokens, stream=Stream.RELAY),
        RecordStream(**tag, buffer=INPUTS.num_sampled, stream=Stream.RELAY),
        RecordStream(**tag, buffer=INPUTS.num_rejected, stream=Stream.RELAY),
    ]


# --- broadcast_drafts ---------------------------------------------------------------------------


def test_broadcast_drafts_gathers_by_slot_and_sends_once() -> None:
    config = last(pp_size=2, spec=2, max_num_reqs=6)
    facts = batch([4, 1, 0])
    got = broadcast_drafts(config, init_relay(config), facts, TensorSpec((6, 2), DType.INT64))
    assert got.result is True
    (send,) = got.state.to_release
    tag = Tag(step=0, op=Op.BROADCAST_DRAFTS)
    assert list(got.effects) == [
        WaitStream(**tag, stream=Stream.RELAY, waits_for=Stream.MAIN),
        GatherRows(
            **tag,
            source=INPUTS.draft_table,
            index=INPUTS.idx_mapping,
            out=send,
            stream=Stream.RELAY,
            index_rows=3,  # one slot per batch row
        ),
        RecordStream(**tag, buffer=INPUTS.idx_mapping, stream=Stream.RELAY),
        # Beyond the seed: a caller may bind a fresh draft table each step (FF5).
        RecordStream(**tag, buffer=INPUTS.draft_table, stream=Stream.RELAY),
        Broadcast(
            **tag,
            buffer=send,
            shape=(3, 2),
            dtype=DType.INT64,
            src=1,
            comm=Communicator.PP_RELAY,
            stream=Stream.RELAY,
        ),
    ]
    # The receivers' third broadcast has the same wire shape.
    receiver = cfg(pp_size=2, stage=0, spec=2, max_num_reqs=6)
    assert (
        broadcasts(receive(receiver, init_relay(receiver), facts).effects)[2]
        == broadcasts(got.effects)[0]
    )


def test_broadcast_drafts_is_skipped_when_no_row_needs_a_sample() -> None:
    config = last(spec=1)
    state = init_relay(config)
    got = broadcast_drafts(config, state, batch([0], [PARTIAL]), TensorSpec((8, 1), DType.INT64))
    assert (got.state, got.effects, got.result) == (state, (), False)


@pytest.mark.parametrize(
    ("spec", "table"),
    [
        (0, TensorSpec((8, 1), DType.INT64)),  # receivers post no draft broadcast
        (2, TensorSpec((8, 1), DType.INT64)),  # too narrow
        (2, TensorSpec((7, 2), DType.INT64)),  # fewer rows than slots
        (2, TensorSpec((8, 2), DType.INT32)),  # not int64
        (2, TensorSpec((8,), DType.INT64)),  # not 2-D
    ],
)
def test_broadcast_drafts_rejects_bad_input(spec: int, table: TensorSpec) -> None:
    config = last(spec=spec, max_num_reqs=8)
    with pytest.raises(InvalidInputError) as caught:
        broadcast_drafts(config, init_relay(config), batch([0]), table)
    assert_names_call_and_fix(caught.value, "broadcast_drafts")


def opt_in(wire: Wire, spec: int) -> RelayConfig:
    """The last stage of a 4-stage relay with 8 slots on `wire`."""
    buckets = default_buckets(8) if wire is Wire.FIXED else ()
    changes = {"stage": 3, "num_speculative_steps": spec}
    return config_with(changes, wire=wire, buckets=buckets)


@pytest.mark.parametrize("wire", [Wire.PACKED, Wire.FIXED])
def test_broadcast_sampled_on_an_opt_in_wire_with_speculation_needs_the_draft_table(
    wire: Wire,
) -> None:
    # The drafts travel in the same broadcast as the tokens: without their table the
    # receivers' packed buffer would not match.
    config = opt_in(wire, spec=2)
    state = init_relay(config)
    with pytest.raises(InvalidInputError, match=f"no draft table on the {wire.value} wire"):
        broadcast_sampled(config, state, batch([0]), tokens(1, 3), None)


@pytest.mark.parametrize(("wire", "spec"), [(Wire.SEED, 2), (Wire.PACKED, 0), (Wire.FIXED, 0)])
def test_broadcast_sampled_refuses_drafts_its_wire_does_not_carry(wire: Wire, spec: int) -> None:
    # The seed's wire sends drafts by broadcast_drafts; without speculation none are sent.
    config = opt_in(wire, spec=spec)
    drafts = TensorSpec((8, max(spec, 1)), DType.INT64)
    with pytest.raises(InvalidInputError, match=f"drafts given on the {wire.value} wire") as caught:
        broadcast_sampled(config, init_relay(config), batch([0]), tokens(1, spec + 1), drafts)
    assert_names_call_and_fix(caught.value, "broadcast_sampled")


@pytest.mark.parametrize("wire", [Wire.PACKED, Wire.FIXED])
def test_broadcast_drafts_on_an_opt_in_wire_says_the_drafts_go_with_the_tokens(wire: Wire) -> None:
    config = opt_in(wire, spec=2)
    with pytest.raises(InvalidInputError, match="pass drafts to broadcast_sampled") as caught:
        broadcast_drafts(config, init_relay(config), batch([0]), TensorSpec((8, 2), DType.INT64))
    assert_names_call_and_fix(caught.value, "broadcast_drafts")


# --- consume_previous_step ----------------------------------------------------------------------


def test_consume_on_the_last_stage_returns_none_without_effects() -> None:
    config = last()
    state = init_relay(config)
    got = consume_previous_step(config, state, update_drafts=True)
    assert (got.state, got.effects, got.result) == (state, (), None)


def test_consume_of_an_empty_entry_returns_none_and_rotates() -> None:
    config = cfg(pp_size=3)
    state = init_relay(config)
    got = consume_previous_step(config, state)
    assert (got.effects, got.result) == ((), None)
    assert got.state.ring == (None, None, None)


def test_consume_pops_the_oldest_and_reserves_the_newest() -> None:
    config = cfg(pp_size=3)
    state = init_relay(config)
    state = receive(config, consume_previous_step(config, state).state, batch([0])).state
    entry = pending(state)
    state = end_step(config, state).state
    got = consume_previous_step(config, state)
    assert got.result is None
    assert got.state.ring == (None, entry, None)
    state = end_step(config, got.state).state
    state = end_step(config, consume_previous_step(config, state).state).state
    got = consume_previous_step(config, state)
    assert consumed(got.result).received_at_step == 0
    assert got.state.ring == (None, None, None)


def received_state(
    config: RelayConfig, facts: BatchFacts, *, frees: Sequence[int] = ()
) -> tuple[RelayState, PendingReceive]:
    """Receive `facts` at step 0, free `frees`, and advance to the step that consumes it."""
    state = consume_previous_step(config, init_relay(config)).state
    state = receive(config, state, facts).state
    entry = pending(state)
    state = free_request_slots(config, state, list(frees)).state
    state = end_step(config, state).state
    for _ in range(config.ring_depth - 1):
        state = end_step(config, consume_previous_step(config, state).state).state
    return state, entry


@pytest.mark.parametrize("update_drafts", [False, True])
def test_consume_without_exclusion_waits_and_hands_out_the_original_mapping(
    update_drafts: bool,
) -> None:
    config = cfg(pp_size=2, spec=1)
    state, entry = received_state(config, batch([3, 1]))
    got = consume_previous_step(config, state, update_drafts=update_drafts)
    out = consumed(got.result)
    wait = WaitEvent(step=2, op=Op.CONSUME, stream=Stream.MAIN, event=entry.event)
    assert entry.draft_tokens is not None
    assert entry.idx_mapping is not None
    scatter = ScatterRows(
        step=2,
        op=Op.CONSUME,
        source=entry.draft_tokens,
        index=entry.idx_mapping,
        target=DRAFTS_TARGET,
        stream=Stream.MAIN,
        skips=False,  # nothing excluded: the caller's mapping holds no -1
        target_rows=config.max_num_reqs,  # every slot is below it
    )
    assert list(got.effects) == ([wait, scatter] if update_drafts else [wait])
    if not update_drafts:  # the default leaves the caller's draft table alone
        assert consume_previous_step(config, state) == got
    assert out == ConsumedOutputs(
        received_at_step=0,
        sampled_tokens=entry.sampled_tokens,
        num_sampled=entry.num_sampled,
        num_rejected=entry.num_rejected,
        idx_mapping=entry.idx_mapping,
        idx_mapping_np=np.array([3, 1], dtype=np.int32),
    )
    assert got.state.to_release == entry.buffers


@pytest.mark.parametrize(
    ("rows", "frees", "expected"),
    [
        ([DECODE, DECODE, DECODE], [1], [3, -1, 5]),  # freed since receive
        ([DECODE, PARTIAL, DECODE], [], [3, -1, 5]),  # did not need a sample
        ([PARTIAL, DECODE, DECODE], [5], [-1, 1, -1]),  # both reasons
    ],
)
def test_consume_marks_excluded_rows_with_a_host_copy_before_the_wait(
    rows: list[tuple[int, int, int]], frees: list[int], expected: list[int]
) -> None:
    config = cfg(pp_size=2, spec=2)
    state, entry = received_state(config, batch([3, 1, 5], rows), frees=frees)
    got = consume_previous_step(config, state, update_drafts=True)
    out = consumed(got.result)
    copy, wait, scatter = got.effects
    assert isinstance(copy, CopyHostToDevice)
    assert copy.source.tolist() == expected
    assert copy.source.dtype == np.int32
    assert not copy.source.flags.writeable
    assert copy.stream is Stream.MAIN
    assert copy.buffer not in entry.buffers
    assert wait == WaitEvent(step=2, op=Op.CONSUME, stream=Stream.MAIN, event=entry.event)
    assert entry.draft_tokens is not None
    # Drafts go only to the kept rows' slots: the filtered mapping skips the -1 rows.
    assert scatter == ScatterRows(
        step=2,
        op=Op.CONSUME,
        source=entry.draft_tokens,
        index=copy.buffer,
        target=DRAFTS_TARGET,
        stream=Stream.MAIN,
        target_rows=config.max_num_reqs,
    )
    assert out.idx_mapping == copy.buffer
    assert out.idx_mapping_np.tolist() == expected
    assert (out.sampled_tokens, out.num_sampled, out.num_rejected) == (
        entry.sampled_tokens,
        entry.num_sampled,
        entry.num_rejected,
    )
    assert got.state.to_release == (*entry.buffers, copy.buffer)


@pytest.mark.parametrize(
    ("rows", "frees"),
    [([DECODE, DECODE], [3, 1]), ([PARTIAL, DECODE], [1]), ([DECODE, PARTIAL], [3, 3])],
)
def test_consume_with_every_row_excluded_returns_none_and_queues_release(
    rows: list[tuple[int, int, int]], frees: list[int]
) -> None:
    config = cfg(pp_size=2, spec=1)
    state, entry = received_state(config, batch([3, 1], rows), frees=frees)
    got = consume_previous_step(config, state, update_drafts=True)
    # No copy, no wait: the seed drops the entry; its unwaited event is forgotten.
    forget = ForgetEvent(step=state.step, op=Op.CONSUME, event=entry.event)
    assert (got.effects, got.result) == ((forget,), None)
    assert got.state.to_release == entry.buffers
    assert got.state.ring == (None, None)


def test_consume_without_speculation_never_scatters() -> None:
    config = cfg(pp_size=2, spec=0)
    state, _ = received_state(config, batch([0, 1]), frees=[1])
    got = consume_previous_step(config, state, update_drafts=True)
    assert not any(isinstance(e, ScatterRows) for e in got.effects)
    assert [type(e) for e in got.effects] == [CopyHostToDevice, WaitEvent]


# --- end_step -----------------------------------------------------------------------------------


def test_end_step_releases_what_the_step_no_longer_needs() -> None:
    config = cfg(pp_size=2, spec=1)
    state, entry = received_state(config, batch([3, 1]), frees=[1])
    taken = consume_previous_step(config, state, update_drafts=True)
    copy = taken.effects[0]
    assert isinstance(copy, CopyHostToDevice)
    ended = end_step(config, taken.state)
    assert ended.effects == tuple(
        Release(step=2, op=Op.END_STEP, buffer=b) for b in (*entry.buffers, copy.buffer)
    )
    assert ended.state.step == 3
    assert ended.state.to_release == ()
    assert end_step(config, ended.state).effects == ()


def test_end_step_on_the_last_stage_releases_the_send_snapshots() -> None:
    config = last(spec=1, max_num_reqs=4)
    facts = batch([2, 0])
    state = broadcast_sampled(config, init_relay(config), facts, tokens(2)).state
    state = broadcast_drafts(config, state, facts, TensorSpec((4, 1), DType.INT64)).state
    receiver = cfg(spec=1, max_num_reqs=4)
    posted = receive(receiver, init_relay(receiver), facts).effects
    received_names = {e.buffer for e in posted if isinstance(e, Broadcast)}
    ended = end_step(config, state)
    released = [e.buffer for e in ended.effects if isinstance(e, Release)]
    assert len(released) == 3
    assert released == list(state.to_release)
    assert not received_names & set(released)  # send snapshots, never the receivers' names
    assert ended.state == attrs.evolve(state, step=1, to_release=())


def run_three_steps(config: RelayConfig) -> list[tuple[RelayState, tuple[Effect, ...]]]:
    state = init_relay(config)
    trace = []
    for slots in ([0, 1], [1, 2], [2, 0]):
        taken = consume_previous_step(config, state, update_drafts=True)
        got = receive(config, taken.state, batch(slots))
        ended = end_step(config, free_request_slot(config, got.state, slots[0]).state)
        trace.append((ended.state, taken.effects + got.effects + ended.effects))
        state = ended.state
    return trace


def test_names_are_deterministic_and_distinct_per_step() -> None:
    config = cfg(pp_size=2, spec=1)
    first, second = run_three_steps(config), run_three_steps(config)
    assert first == second
    allocated = [e.buffer.name for _, effects in first for e in effects if isinstance(e, Allocate)]
    assert len(allocated) == len(set(allocated)) == 9


# --- relay_aux_hidden_states --------------------------------------------------------------------


def test_aux_hidden_states_without_keys_are_a_copy_of_outgoing() -> None:
    outgoing = {"hidden_states": 1, "residual": 2}
    got = relay_aux_hidden_states(cfg(), None, outgoing)
    assert got == outgoing
    assert got is not outgoing
    got["extra"] = 3
    assert "extra" not in outgoing


def test_aux_hidden_states_merge_the_configured_keys() -> None:
    config = cfg(keys=("aux_0", "aux_1"))
    incoming = {"aux_0": "a0", "aux_1": "a1", "hidden_states": "in_h", "other": "x"}
    outgoing = {"hidden_states": "out_h", "aux_1": "stale"}
    got = relay_aux_hidden_states(config, incoming, outgoing)
    assert got == {"hidden_states": "out_h", "aux_0": "a0", "aux_1": "a1"}
    assert outgoing == {"hidden_states": "out_h", "aux_1": "stale"}


def test_aux_hidden_states_errors_are_typed() -> None:
    config = cfg(keys=("aux_0", "aux_1"))
    with pytest.raises(InvalidInputError) as no_incoming:
        relay_aux_hidden_states(config, None, {"hidden_states": 0})
    assert_names_call_and_fix(no_incoming.value, "relay_aux_hidden_states")
    with pytest.raises(InvalidInputError) as missing:
        relay_aux_hidden_states(config, {"aux_0": 0}, {"hidden_states": 0})
    assert_names_call_and_fix(missing.value, "relay_aux_hidden_states")
    assert "aux_1" in str(missing.value)


# --- wrong kind of rank -------------------------------------------------------------------------


def test_receive_on_the_last_stage_raises_wrong_rank() -> None:
    config = last()
    with pytest.raises(WrongRankError) as caught:
        receive(config, init_relay(config), batch([0]))
    assert_names_call_and_fix(caught.value, "receive")


def test_broadcasts_on_a_non_last_stage_raise_wrong_rank() -> None:
    config = cfg(pp_size=3, stage=1, spec=1)
    state = init_relay(config)
    with pytest.raises(WrongRankError) as sampled:
        broadcast_sampled(config, state, batch([0]), tokens(1))
    assert_names_call_and_fix(sampled.value, "broadcast_sampled")
    with pytest.raises(WrongRankError) as drafts:
        broadcast_drafts(config, state, batch([0]), TensorSpec((8, 1), DType.INT64))
    assert_names_call_and_fix(drafts.value, "broadcast_drafts")


# --- RelayConfig validation ---------------------------------------------------------------------

GOOD = {
    "pp_size": 4,
    "stage": 1,
    "last_rank": 3,
    "max_num_reqs": 8,
    "num_speculative_steps": 0,
}


def config_with(changes: dict[str, int], **options: Any) -> RelayConfig:
    values = GOOD | changes
    return RelayConfig(
        pp_size=values["pp_size"],
        stage=values["stage"],
        last_rank=values["last_rank"],
        max_num_reqs=values["max_num_reqs"],
        num_speculative_steps=values["num_speculative_steps"],
        **options,
    )


@pytest.mark.parametrize(
    "bad",
    [
        {"pp_size": 0, "stage": 0},
        {"stage": 4},
        {"stage": -1},
        {"num_speculative_steps": -1},
        {"max_num_reqs": 0},
        {"last_rank": -1},
    ],
)
def test_relay_config_rejects_impossible_values(bad: dict[str, int]) -> None:
    with pytest.raises(ConfigError) as caught:
        config_with(bad)
    assert_names_call_and_fix(caught.value, "RelayConfig")
    assert any(str(value) in caught.value.problem for value in bad.values())


@pytest.mark.parametrize(
    ("field", "top"),
    [
        ("pp_size", 2**31 - 1),
        ("last_rank", 2**31 - 1),
        ("max_num_reqs", 2**31 - 1),
        ("num_speculative_steps", 1024),
    ],
)
def test_relay_config_takes_its_largest_values_and_refuses_one_more(field: str, top: int) -> None:
    assert getattr(config_with({field: top}), field) == top
    with pytest.raises(ConfigError, match=rf"^RelayConfig: {field}={top + 1} is outside"):
        config_with({field: top + 1})


def test_relay_config_defaults_are_the_seeds_behaviour() -> None:
    config = config_with({})
    assert config.platform is Platform.CUDA
    assert config.validate_header is False
    assert config.wire is Wire.SEED
    assert config.buckets == ()
    assert config.aux_hidden_state_keys == ()
    assert config.name == "relay"


@pytest.mark.parametrize("keys", [["aux_0"], ("aux_0", 3), "aux_0"])
def test_relay_config_refuses_aux_keys_that_are_not_a_tuple_of_names(keys: object) -> None:
    with pytest.raises(ConfigError, match=r"^RelayConfig: aux_hidden_state_keys="):
        config_with({}, aux_hidden_state_keys=keys)


@pytest.mark.parametrize("buckets", [(8, 4), (2, 2, 8), (2, 4)])
def test_the_fixed_wire_refuses_buckets_out_of_order_or_short_of_max_num_reqs(
    buckets: tuple[int, ...],
) -> None:
    # (8, 4) and (2, 2, 8) reach max_num_reqs but are not increasing; (2, 4) falls short.
    shown = re.escape(f"buckets={buckets} with max_num_reqs=8")
    with pytest.raises(ConfigError, match=rf"^RelayConfig: {shown}"):
        config_with({}, wire=Wire.FIXED, buckets=buckets)


@pytest.mark.parametrize("wire", [Wire.SEED, Wire.PACKED])
def test_buckets_belong_to_the_fixed_wire_alone(wire: Wire) -> None:
    # A bucket list on another wire would be silently ignored: refused instead.
    with pytest.raises(ConfigError, match=rf"^RelayConfig: buckets=\(8,\) with wire={wire.value}"):
        config_with({}, wire=wire, buckets=(8,))


def test_the_fixed_wire_refuses_an_empty_bucket_list() -> None:
    with pytest.raises(ConfigError, match=r"^RelayConfig: buckets=\(\).*non-empty tuple"):
        config_with({}, wire=Wire.FIXED, buckets=())


@pytest.mark.parametrize(
    ("stage", "spec", "wire", "reads"),
    [
        (1, 0, Wire.SEED, False),  # the last stage reads it only to gather drafts
        (1, 2, Wire.SEED, True),
        (1, 2, Wire.FIXED, True),
        (1, 0, Wire.FIXED, False),
        (0, 0, Wire.SEED, True),  # receivers keep it for the ring
        (0, 2, Wire.PACKED, True),
        (0, 2, Wire.FIXED, False),  # the fixed wire uploads its own mapping at consume
    ],
)
def test_reads_idx_mapping_says_which_steps_read_the_callers_device_mapping(
    stage: int, spec: int, wire: Wire, reads: bool
) -> None:
    config = RelayConfig.for_stage(
        pp_size=2, stage=stage, max_num_reqs=8, num_speculative_steps=spec, wire=wire
    )
    assert config.reads_idx_mapping is reads


def test_a_state_of_another_pipeline_depth_is_refused_and_named() -> None:
    # Same slot count, ring of 3 instead of 2: the ring's length gives it away.
    other = init_relay(cfg(pp_size=3, max_num_reqs=8))
    config = cfg(pp_size=2, max_num_reqs=8)
    for call, run in (
        ("consume_previous_step", lambda: consume_previous_step(config, other)),
        ("end_step", lambda: end_step(config, other)),
        ("receive", lambda: receive(config, other, batch([1]))),
    ):
        with pytest.raises(InvalidInputError, match=rf"^{call}: state has 8 slots and a ring of 3"):
            run()


def test_ring_depth_is_the_pipeline_unless_xpu_runs_without_microbatching() -> None:
    assert config_with({}).ring_depth == 4
    assert cfg(pp_size=4, platform=Platform.XPU).ring_depth == 4
    assert cfg(pp_size=4, platform=Platform.XPU_NO_MICROBATCH).ring_depth == 1
    assert last(pp_size=4).last_rank == 3


# --- inputs never mutated, every array read-only ------------------------------------------------


def test_caller_arrays_are_copied_and_states_never_mutated() -> None:
    config = cfg(pp_size=2, spec=1, max_num_reqs=4)
    slots = np.array([2, 0], dtype=np.int32)
    computed = np.array([5, 5], dtype=np.int32)
    facts = BatchFacts(
        idx_mapping=slots,
        num_computed_tokens=computed,
        num_scheduled_tokens=np.ones(2, np.int32),
        prefill_len=np.full(2, 3, np.int32),
    )
    start = consume_previous_step(config, init_relay(config)).state
    got = receive(config, start, facts)
    slots[:] = [3, 3]
    computed[:] = 0
    entry = pending(got.state)
    assert entry.idx_mapping_np.tolist() == [2, 0]
    assert entry.need_sampled is not None
    assert entry.need_sampled.tolist() == [True, True]
    assert start.ring == (None, None)
    to_free = np.array([2])
    freed = free_request_slots(config, got.state, to_free)
    to_free[0] = 1
    assert freed.state.generations.tolist() == [0, 0, 1, 0]
    assert got.state.generations.tolist() == [0, 0, 0, 0]


def test_every_array_in_states_effects_and_results_is_read_only() -> None:
    config = cfg(pp_size=2, spec=1, max_num_reqs=4)
    steps: list[object] = []
    state = init_relay(config)
    for slots, rows in (([0, 1], [DECODE, PARTIAL]), ([1, 2], [DECODE, DECODE]), ([2], [DECODE])):
        taken = consume_previous_step(config, state, update_drafts=True)
        got = receive(config, taken.state, batch(slots, rows))
        freed = free_request_slot(config, got.state, 1)
        ended = end_step(config, freed.state)
        steps += [taken, got, freed, ended]
        state = ended.state
    sender = last(spec=1, max_num_reqs=4)
    steps.append(broadcast_sampled(sender, init_relay(sender), batch([0, 1]), tokens(2, 2)))
    arrays = list(arrays_in(steps))
    assert len(arrays) > 10
    assert any(isinstance(e, CopyHostToDevice) for s in steps for e in getattr(s, "effects", ()))
    assert all(not a.flags.writeable for a in arrays)


# --- field failures 8 and 9 ---------------------------------------------------------------------


@pytest.mark.parametrize(("pp_size", "offset"), [(p, k) for p in (2, 3, 4) for k in range(p)])
def test_slot_freed_at_any_ring_offset_and_reused_at_once_drops_the_stale_token(
    pp_size: int, offset: int
) -> None:
    # Field failure 8. Request A decodes in slot 2 from step 0 and ends at step `offset`
    # (its slot is freed after that step's receive); request B takes slot 2 in the very
    # next batch, starting with a final prefill chunk. Slot 5 holds a bystander request.
    config = cfg(pp_size=pp_size, spec=1, max_num_reqs=8)
    state = init_relay(config)
    outputs: dict[int, ConsumedOutputs | None] = {}
    new_request = (0, 6, 6)
    for step in range(offset + 1 + pp_size + 1):
        row = DECODE if step <= offset or step > offset + 1 else new_request
        taken = consume_previous_step(config, state, update_drafts=True)
        outputs[step] = taken.result
        if taken.result is not None:
            # Drafts are written through the same filtered mapping: B's slot is not touched.
            (scatter,) = [e for e in taken.effects if isinstance(e, ScatterRows)]
            assert scatter.index == taken.result.idx_mapping
        got = receive(config, taken.state, batch([2, 5], [row, DECODE]))
        state = got.state
        if step == offset:
            state = free_request_slot(config, state, 2).state
        state = end_step(config, state).state
    for step, out in outputs.items():
        if step < pp_size:
            assert out is None
            continue
        got_out = consumed(out)
        received_at = step - pp_size
        assert got_out.received_at_step == received_at
        a_was_in_the_slot = received_at <= offset
        assert got_out.idx_mapping_np.tolist() == ([-1, 5] if a_was_in_the_slot else [2, 5])


@pytest.mark.parametrize("freed", [None, 2, 5])
def test_a_state_rebuilt_with_an_equal_generations_table_consumes_alike(freed: int | None) -> None:
    # Consume skips the generation check when the state still holds the very table the
    # receive saw (frees replace it). A state rebuilt around an equal copy must take the
    # comparing path and reach the same answer.
    config = cfg(pp_size=2, spec=1, max_num_reqs=8)
    state = init_relay(config)
    state = advance(config, state, batch([2, 5]))[0]
    if freed is not None:
        state = free_request_slot(config, state, freed).state
    state = advance(config, state, batch([3]))[0]
    rebuilt = attrs.evolve(state, generations=frozen(state.generations.copy()))
    assert rebuilt.generations is not state.generations
    ours = consume_previous_step(config, state, update_drafts=True)
    theirs = consume_previous_step(config, rebuilt, update_drafts=True)
    assert ours.effects == theirs.effects
    assert consumed(ours.result).idx_mapping_np.tolist() == [
        -1 if slot == freed else slot for slot in (2, 5)
    ]
    assert ours.result == theirs.result


def test_slots_freed_together_reach_every_in_flight_entry() -> None:
    # Field failure 8, second half: an abort must reach requests in every in-flight entry.
    config = cfg(pp_size=3, max_num_reqs=8)
    state = init_relay(config)
    for slots in ([0, 1], [1, 2], [2, 3]):
        state = advance(config, state, batch(slots))[0]
    state = free_request_slots(config, state, [1, 2]).state
    results = []
    for _ in range(3):
        state, out = advance(config, state, batch([4]))
        results.append(None if out is None else out.idx_mapping_np.tolist())
    assert results == [[0, -1], None, [-1, 3]]


@pytest.mark.parametrize("pp_size", [2, 3, 4])
@pytest.mark.parametrize("max_tokens", [1, 2, 3])
def test_a_request_ending_exactly_at_max_tokens_has_its_last_token_relayed(
    pp_size: int, max_tokens: int
) -> None:
    # Field failure 9. Prompt of 4 in slot 1, `max_tokens` output tokens: the prefill step
    # samples the first, each decode step one more. The last stage learns the request has
    # ended only from the step that sampled its last token; the slot is freed when that
    # step's tokens come back round (after the consume that applies them).
    receiver = cfg(pp_size=pp_size, max_num_reqs=4)
    sender = last(pp_size=pp_size, max_num_reqs=4)
    steps_with_the_request = [(0, 4, 4) if i == 0 else (4 + i - 1, 1, 4) for i in range(max_tokens)]
    state, sender_state = init_relay(receiver), init_relay(sender)
    applied: list[int] = []
    for step in range(max_tokens + pp_size + 1):
        rows = [steps_with_the_request[step]] if step < max_tokens else []
        facts = batch([1] * len(rows), rows)
        sent = broadcast_sampled(sender, sender_state, facts, tokens(len(rows)))
        assert sent.result is (step < max_tokens)
        sender_state = end_step(sender, sent.state).state
        taken = consume_previous_step(receiver, state)
        if taken.result is not None:
            assert taken.result.idx_mapping_np.tolist() == [1]
            applied.append(taken.result.received_at_step)
        state = receive(receiver, taken.state, facts).state
        if taken.result is not None and taken.result.received_at_step == max_tokens - 1:
            state = free_request_slot(receiver, state, 1).state
        state = end_step(receiver, state).state
    assert applied == list(range(max_tokens))


def test_a_state_built_with_a_writable_generations_table_holds_a_frozen_copy() -> None:
    # Consume reads an unchanged table object as "no slot freed", so a table that can be
    # edited in place (instead of freed through free_request_slots) must not get in.
    config = cfg(pp_size=2, max_num_reqs=4)
    table = np.zeros(4, dtype=np.int32)
    state = attrs.evolve(init_relay(config), generations=table)
    assert is_frozen(state.generations)
    table[0] = 7  # the caller's array, not the state's
    assert state.generations.tolist() == [0, 0, 0, 0]
    assert consume_previous_step(config, state).state.generations is state.generations
