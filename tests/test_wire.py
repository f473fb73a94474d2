"""The opt-in wires (packed, fixed) and the platforms, against the seed's wire.

Packed and fixed deliver what the seed's wire delivers, in simulated scripted worlds;
packed sections are 16-byte aligned; the fixed wire's collectives depend only on the
bucket; XPU synchronises main before the sender's broadcasts, as the seed does.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from purepp.batch import BatchFacts
from purepp.effects.vocabulary import (
    Broadcast,
    CopyHostToDevice,
    DType,
    Effect,
    Op,
    Pack,
    Stream,
    Synchronize,
    TensorSpec,
    Unpack,
    WaitStream,
)
from purepp.relay import (
    Platform,
    RelayConfig,
    RelayState,
    Wire,
    broadcast_drafts,
    broadcast_sampled,
    consume_previous_step,
    end_step,
    init_relay,
    receive,
)
from purepp.testing import (
    ConsumedStep,
    RankOutputs,
    ScheduleConfig,
    make_schedule,
    simulate_schedule,
)
from tests.strategies import DECODE, PARTIAL, batch_facts, make_batch

STEPS = 10


@functools.cache
def outputs_of(pp: int, dp_size: int, spec: int, wire: Wire) -> tuple[RankOutputs, ...]:
    config = ScheduleConfig(pp=pp, dp=dp_size, spec=spec, steps=STEPS, seed=pp + spec, wire=wire)
    return simulate_schedule(make_schedule(config)).outputs


def kept(consumed: ConsumedStep) -> tuple[object, ...]:
    """What the apply kernel reads of a consumed step: the rows whose slot is not -1."""
    rows = [
        (slot, consumed.sampled_tokens[i], consumed.num_sampled[i], consumed.num_rejected[i])
        for i, slot in enumerate(consumed.idx_mapping)
        if slot != -1
    ]
    return (consumed.step, consumed.received_at_step, tuple(rows), consumed.drafts_table)


@pytest.mark.parametrize("wire", [Wire.PACKED, Wire.FIXED])
@pytest.mark.parametrize("dp_size", [1, 2])
@pytest.mark.parametrize("spec", [0, 2])
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_packed_and_fixed_wires_deliver_what_the_seed_wire_delivers(
    pp: int, spec: int, dp_size: int, wire: Wire
) -> None:
    seed = outputs_of(pp, dp_size, spec, Wire.SEED)
    other = outputs_of(pp, dp_size, spec, wire)
    assert any(outputs.consumed for outputs in seed)  # the schedule relays something
    for expected, got in zip(seed, other, strict=True):
        assert got.agreed == expected.agreed
        assert [kept(c) for c in got.consumed] == [kept(c) for c in expected.consumed]
        if wire is Wire.PACKED:
            # Same rows as the seed's wire, excluded ones included: the outputs are equal.
            assert got == expected


def test_the_fixed_wire_pads_rows_to_the_bucket_and_they_read_slot_minus_one() -> None:
    run = outputs_of(3, 1, 2, Wire.FIXED)
    seed = outputs_of(3, 1, 2, Wire.SEED)
    buckets = (1, 2, 4)  # default_buckets(4)
    padded = 0
    for got, expected in zip(run[0].consumed, seed[0].consumed, strict=True):
        n = len(expected.idx_mapping)
        rows = len(got.idx_mapping)
        assert rows == min(b for b in buckets if b >= n)
        assert got.idx_mapping[:n] == expected.idx_mapping
        assert got.idx_mapping[n:] == (-1,) * (rows - n)
        padded += rows - n
    assert padded  # the schedule has a batch that is not a bucket


# --- the packed layout --------------------------------------------------------------------------


def stage_config(
    pp: int,
    stage: int,
    spec: int,
    *,
    wire: Wire = Wire.SEED,
    platform: Platform = Platform.CUDA,
    header: bool = False,
    max_num_reqs: int = 8,
) -> RelayConfig:
    return RelayConfig.for_stage(
        pp_size=pp,
        stage=stage,
        max_num_reqs=max_num_reqs,
        num_speculative_steps=spec,
        wire=wire,
        platform=platform,
        validate_header=header,
    )


def send(config: RelayConfig, facts: BatchFacts, width: int = 1) -> tuple[Effect, ...]:
    """The last stage's broadcast effects for one step (drafts included)."""
    state = init_relay(config)
    tokens = TensorSpec((facts.num_reqs, width), DType.INT64)
    spec = config.num_speculative_steps
    table = TensorSpec((config.max_num_reqs, spec), DType.INT64) if spec else None
    if config.wire is not Wire.SEED:
        return broadcast_sampled(config, state, facts, tokens, table).effects
    sent = broadcast_sampled(config, state, facts, tokens)
    if table is None:
        return sent.effects
    return sent.effects + broadcast_drafts(config, sent.state, facts, table).effects


def post(config: RelayConfig, facts: BatchFacts) -> tuple[RelayState, tuple[Effect, ...]]:
    """A non-last stage's receive effects for one step, and its state after the step."""
    state = consume_previous_step(config, init_relay(config)).state
    posted = receive(config, state, facts)
    return end_step(config, posted.state).state, posted.effects


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    pp=st.integers(2, 4),
    spec=st.integers(0, 4),
    wire=st.sampled_from([Wire.PACKED, Wire.FIXED]),
    header=st.booleans(),
)
def test_packed_sections_start_at_16_byte_offsets_and_both_sides_share_the_layout(
    data: st.DataObject, pp: int, spec: int, wire: Wire, header: bool
) -> None:
    facts = data.draw(batch_facts(8, min_rows=1, kinds=("decode",)))
    width = data.draw(st.integers(1, spec + 1))
    sender = send(stage_config(pp, pp - 1, spec, wire=wire, header=header), facts, width)
    _, posted = post(stage_config(pp, 0, spec, wire=wire, header=header), facts)
    (pack,) = [e for e in sender if isinstance(e, Pack)]
    sent_broadcasts = [e for e in sender if isinstance(e, Broadcast)]
    posted_broadcasts = [e for e in posted if isinstance(e, Broadcast)]
    assert len(sent_broadcasts) == len(posted_broadcasts) == 1  # one broadcast per step
    for broadcast in (*sent_broadcasts, *posted_broadcasts):
        assert broadcast.dtype is DType.INT64
        assert broadcast.shape == (pack.nbytes // 8,)
    assert pack.nbytes % 16 == 0
    assert all(section.offset % 16 == 0 for section in pack.sections)
    unpacked = [s for e in posted if isinstance(e, Unpack) for s in e.sections]
    # The receiver reads each section where the sender wrote it, with its shape and dtype.
    layout = sorted((s.offset, s.shape, s.dtype) for s in pack.sections)
    assert sorted((s.offset, s.shape, s.dtype) for s in unpacked) == layout
    # Sections never overlap.
    ends = [
        offset + int(np.prod(shape)) * (8 if dtype is DType.INT64 else 4)
        for offset, shape, dtype in layout
    ]
    assert all(end <= start for end, (start, _, _) in zip(ends, layout[1:], strict=False))
    assert ends[-1] <= pack.nbytes


# --- the fixed wire's schedule depends only on the bucket ---------------------------------------


def collectives(effects: Sequence[Effect]) -> list[tuple[tuple[int, ...], DType, Op]]:
    return [(e.shape, e.dtype, e.op) for e in effects if isinstance(e, Broadcast)]


def bucket_of(n: int, buckets: Sequence[int]) -> int:
    return min(b for b in buckets if b >= max(n, 1))


@settings(max_examples=80, deadline=None)
@given(
    data=st.data(),
    pp=st.integers(2, 4),
    spec=st.integers(0, 3),
    header=st.booleans(),
)
def test_on_the_fixed_wire_only_the_bucket_decides_the_collectives(
    data: st.DataObject, pp: int, spec: int, header: bool
) -> None:
    # Any batch (rows that do or do not sample, none at all): the same collectives as a
    # plain batch of the bucket's size, on the sender and on every receiver.
    facts = data.draw(batch_facts(8))
    width = data.draw(st.integers(1, spec + 1))
    sender_config = stage_config(pp, pp - 1, spec, wire=Wire.FIXED, header=header)
    bucket = bucket_of(facts.num_reqs, sender_config.buckets)
    plain = make_batch(range(bucket), [DECODE] * bucket)
    expected = collectives(send(sender_config, plain))
    assert len(expected) == 1
    if not header:
        # Without a header only the bucket is on the wire; the header's check reads n.
        assert collectives(send(sender_config, facts, width)) == expected
    for stage in range(pp - 1):
        receiver = stage_config(pp, stage, spec, wire=Wire.FIXED, header=header)
        _, posted = post(receiver, facts)
        assert collectives(posted) == [(s, d, Op.RECEIVE) for s, d, _ in expected]
    sent = collectives(send(sender_config, facts, width))
    assert [(s, d) for s, d, _ in sent] == [(s, d) for s, d, _ in expected]


@pytest.mark.parametrize("n", [0, 1, 3])
def test_the_fixed_wire_sends_even_when_no_row_samples(n: int) -> None:
    facts = make_batch(range(n), [PARTIAL] * n)
    sender = stage_config(2, 1, 1, wire=Wire.FIXED)
    assert collectives(send(sender, facts))
    # The seed's wire skips that step on both sides.
    assert send(stage_config(2, 1, 1), facts) == ()


def test_rows_past_the_batch_read_slot_minus_one_at_consume() -> None:
    config = stage_config(2, 0, 1, wire=Wire.FIXED, max_num_reqs=8)
    facts = make_batch([6, 2, 5], [DECODE, DECODE, DECODE])  # bucket 4
    state, _ = post(config, facts)
    state = end_step(config, consume_previous_step(config, state).state).state
    taken = consume_previous_step(config, state, update_drafts=True)
    out = taken.result
    assert out is not None
    assert out.idx_mapping_np.tolist() == [6, 2, 5, -1]
    (copy,) = [e for e in taken.effects if isinstance(e, CopyHostToDevice)]
    assert copy.source.tolist() == [6, 2, 5, -1]
    assert out.idx_mapping == copy.buffer


# --- platforms ----------------------------------------------------------------------------------


@pytest.mark.parametrize("wire", list(Wire))
@pytest.mark.parametrize("platform", [Platform.XPU, Platform.XPU_NO_MICROBATCH])
def test_xpu_synchronises_main_before_the_senders_broadcasts(
    platform: Platform, wire: Wire
) -> None:
    facts = make_batch([0, 3], [DECODE, DECODE])
    effects = send(stage_config(3, 2, 2, wire=wire, platform=platform), facts)
    syncs = [i for i, e in enumerate(effects) if isinstance(e, Synchronize)]
    first_broadcast = next(i for i, e in enumerate(effects) if isinstance(e, Broadcast))
    # Once per step, first: the host drains main before queueing anything on the relay
    # stream (the seed synchronises in its sampled-token broadcast, not its drafts').
    assert syncs == [0]
    assert effects[0] == Synchronize(step=0, op=Op.BROADCAST, stream=Stream.MAIN)
    assert isinstance(effects[1], WaitStream)
    assert first_broadcast > 1
    # Receivers do not synchronise.
    _, posted = post(stage_config(3, 0, 2, wire=wire, platform=platform), facts)
    assert not any(isinstance(e, Synchronize) for e in posted)


@pytest.mark.parametrize("wire", list(Wire))
def test_cuda_never_synchronises(wire: Wire) -> None:
    facts = make_batch([0, 3], [DECODE, DECODE])
    effects = send(stage_config(3, 2, 2, wire=wire), facts)
    assert not any(isinstance(e, Synchronize) for e in effects)


@pytest.mark.parametrize("platform", list(Platform))
def test_the_xpu_platforms_change_nothing_else(platform: Platform) -> None:
    facts = make_batch([0, 3], [DECODE, DECODE])
    cuda = send(stage_config(3, 2, 2), facts)
    other = send(stage_config(3, 2, 2, platform=platform), facts)
    assert [e for e in other if not isinstance(e, Synchronize)] == list(cuda)


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_xpu_without_microbatching_consumes_the_next_step(pp: int) -> None:
    config = stage_config(pp, 0, 0, platform=Platform.XPU_NO_MICROBATCH)
    assert config.ring_depth == 1
    assert stage_config(pp, 0, 0, platform=Platform.XPU).ring_depth == pp
    state, _ = post(config, make_batch([1], [DECODE]))
    taken = consume_previous_step(config, state)
    assert taken.result is not None
    assert taken.result.received_at_step == 0
