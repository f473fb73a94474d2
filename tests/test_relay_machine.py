"""Laws of the relay, checked over random schedules.

A state machine drives one rank's relay through consume / receive / end_step and
slot frees at any point, against the plain mutable re-expression of the seed in
`tests/relay_reference.py`. Two more laws: equal inputs give equal steps, and the
last stage's broadcasts match every other stage's receives for any schedule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from purepp.batch import BatchFacts, need_sampled_mask
from purepp.effects.vocabulary import (
    Alias,
    Allocate,
    Broadcast,
    BufferRef,
    Communicator,
    CopyHostToDevice,
    DType,
    Effect,
    EventRef,
    ForgetEvent,
    GatherRows,
    Pack,
    PadColumns,
    RecordEvent,
    RecordStream,
    Release,
    ScatterRows,
    StackRows,
    Stream,
    TensorSpec,
    Unpack,
    WaitEvent,
)
from purepp.errors import InvalidInputError, WrongRankError
from purepp.relay import (
    ConsumedOutputs,
    Platform,
    RelayConfig,
    RelayState,
    Wire,
    broadcast_drafts,
    broadcast_sampled,
    consume_previous_step,
    end_step,
    free_request_slots,
    init_relay,
    receive,
)
from purepp.step import Step
from tests.relay_reference import ReferenceRelay, arrays_in
from tests.strategies import ROW_KINDS, batch_facts, batch_schedules, make_batch, relay_configs


def _made_by(effect: Effect) -> tuple[BufferRef, ...]:
    """The buffers an effect brings into the environment."""
    match effect:
        case Allocate(buffer=made) | CopyHostToDevice(buffer=made):
            return (made,)
        case Alias(out=made) | PadColumns(out=made) | StackRows(out=made) | GatherRows(out=made):
            return (made,)
        case Pack(out=made):
            return (made,)
        case Unpack(sections=sections):
            return tuple(section.buffer for section in sections)
        case _:
            return ()


class RelayRingMachine(RuleBasedStateMachine):
    """One rank's relay under any interleaving the protocol allows, next to the reference."""

    def __init__(self) -> None:
        super().__init__()
        self.config = RelayConfig.for_stage(pp_size=2, stage=0, max_num_reqs=1)
        self.state = init_relay(self.config)
        self.model = ReferenceRelay(is_last_stage=False, ring_depth=2, max_num_reqs=1)
        self.update_drafts = False
        self.phase = "consume"  # next call the protocol allows: consume, receive or end
        self.reuse: set[int] = set()  # slots freed since the last batch: the next batch has them
        self.live: set[BufferRef] = set()  # buffers the relay made and has not released
        self.recorded: set[EventRef] = set()  # events recorded so far
        self.consumed_steps: list[int] = []  # steps whose entries were consumed, in order
        self.previous_generations = self.state.generations

    @initialize(
        # Mostly stages that receive; now and then a lone stage (pp_size 1, an empty ring).
        config=st.integers(0, 9).flatmap(
            lambda pick: relay_configs(max_pp_size=1) if pick == 7 else relay_configs(non_last=True)
        ),
        update_drafts=st.booleans(),
    )
    def start(self, config: RelayConfig, update_drafts: bool) -> None:
        self.config = config
        self.state = init_relay(config)
        self.model = ReferenceRelay(
            is_last_stage=config.is_last_stage,
            ring_depth=config.ring_depth,
            max_num_reqs=config.max_num_reqs,
        )
        self.update_drafts = update_drafts
        self.previous_generations = self.state.generations

    def _perform(self, step: Step[RelayState, Any]) -> None:
        """Check the effects' buffer and event discipline, then adopt the new state."""
        assert all(not array.flags.writeable for array in arrays_in(step))
        for effect in step.effects:
            assert effect.step == self.state.step
            for made in _made_by(effect):
                assert made not in self.live, f"{made} made twice"
                self.live.add(made)
            match effect:
                case Release(buffer=gone):
                    assert gone in self.live, f"{gone} released but not live"
                    self.live.remove(gone)
                case RecordEvent(event=event):
                    assert event not in self.recorded
                    self.recorded.add(event)
                case WaitEvent(event=event) | ForgetEvent(event=event):
                    assert event in self.recorded
                case Broadcast(buffer=used) | RecordStream(buffer=used) if used.name.startswith(
                    "relay."
                ):
                    assert used in self.live
                case ScatterRows(source=source, index=index):
                    assert source in self.live
                    assert index in self.live
                case _:
                    pass
        self.state = step.state

    # The protocol fixes the call order within a step (consume, receive, end_step), so
    # every rule first makes the calls it needs to become legal; none is ever disabled.

    def _consume(self) -> None:
        taken = consume_previous_step(self.config, self.state, update_drafts=self.update_drafts)
        expected = self.model.consume()
        entry = self.state.ring[0] if self.state.ring else None
        self._perform(taken)
        self.phase = "receive"
        event(f"consume: {'nothing' if expected is None else f'filtered={expected.filtered}'}")
        if expected is None:
            assert taken.result is None
            # An entry dropped whole only forgets its event: no copy, no wait.
            forgotten = () if entry is None else (entry.event,)
            assert tuple(e.event for e in taken.effects if isinstance(e, ForgetEvent)) == forgotten
            assert len(taken.effects) == len(forgotten)
            return
        out = taken.result
        assert isinstance(out, ConsumedOutputs)
        assert entry is not None
        assert out.received_at_step == expected.received_at_step
        # FIFO: consumed in the order received, exactly ring_depth steps later.
        assert out.received_at_step == self.state.step - self.config.ring_depth
        assert all(step < out.received_at_step for step in self.consumed_steps)
        self.consumed_steps.append(out.received_at_step)
        assert out.idx_mapping_np.tolist() == expected.idx_mapping.tolist()
        assert (out.sampled_tokens, out.num_sampled, out.num_rejected) == (
            entry.sampled_tokens,
            entry.num_sampled,
            entry.num_rejected,
        )
        kinds = [type(effect) for effect in taken.effects]
        scatters = entry.draft_tokens is not None and self.update_drafts
        assert kinds == [
            *([CopyHostToDevice] if expected.filtered else []),
            WaitEvent,
            *([ScatterRows] if scatters else []),
        ]
        if expected.filtered:
            copy = taken.effects[0]
            assert isinstance(copy, CopyHostToDevice)
            assert copy.source.tolist() == expected.idx_mapping.tolist()
            assert out.idx_mapping == copy.buffer
        else:
            assert out.idx_mapping == entry.idx_mapping
        if scatters:
            event("consume: scatters drafts")
            scatter = taken.effects[-1]
            assert isinstance(scatter, ScatterRows)
            assert (scatter.source, scatter.index) == (entry.draft_tokens, out.idx_mapping)

    def _receive(self, facts: BatchFacts) -> None:
        self.reuse.clear()
        self.phase = "end"
        if self.config.is_last_stage:
            with pytest.raises(WrongRankError):
                receive(self.config, self.state, facts)
            return
        got = receive(self.config, self.state, facts)
        assert got.result == self.model.receive(facts)
        self._perform(got)

    def _end(self) -> None:
        ended = end_step(self.config, self.state)
        self._perform(ended)
        self.model.end_step()
        self.phase = "consume"
        # The step released exactly what it no longer needs: only pending entries stay.
        pending = {buffer for entry in self.state.ring if entry for buffer in entry.buffers}
        assert self.live == pending

    def _draw_batch(
        self, data: st.DataObject, kinds: Sequence[str] = ROW_KINDS, min_rows: int = 0
    ) -> BatchFacts:
        """The next batch; slots freed since the last one are reused in it at once."""
        required = sorted(self.reuse)
        max_num_reqs = self.config.max_num_reqs
        return data.draw(
            batch_facts(max_num_reqs, required_slots=required, min_rows=min_rows, kinds=kinds)
        )

    @rule()
    def consume(self) -> None:
        if self.phase != "consume":
            self._end()
        self._consume()

    @rule(data=st.data())
    def receive_batch(self, data: st.DataObject) -> None:
        if self.phase == "end":
            self._end()
        if self.phase == "consume":
            self._consume()
        self._receive(self._draw_batch(data))

    @rule(data=st.data())
    def receive_twice(self, data: st.DataObject) -> None:
        # A second receive in one step would overwrite the first entry: refused.
        if self.config.is_last_stage:
            self._receive(self._draw_batch(data))
            return
        if self.phase == "end" and self.state.ring[-1] is None:
            self._end()
        if self.phase == "consume":
            self._consume()
        if self.phase == "receive":
            self._receive(self._draw_batch(data, kinds=("decode",), min_rows=1))
        before = self.state
        with pytest.raises(InvalidInputError):
            receive(self.config, self.state, self._draw_batch(data))
        assert self.state is before

    @rule()
    def end(self) -> None:
        if self.phase == "consume":
            self._consume()
        self._end()

    @rule(data=st.data(), free_after_receive=st.booleans())
    def whole_step(self, data: st.DataObject, free_after_receive: bool) -> None:
        # A steady-state step; a request that ends in it frees its slot before end_step.
        if self.phase != "consume":
            self._end()
        self._consume()
        self._receive(self._draw_batch(data))
        if free_after_receive:
            self.free(data)
        self._end()

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        # Any slots, repeats included (each occurrence counts), at any point of a step.
        slot = st.integers(0, self.config.max_num_reqs - 1)
        slots = data.draw(st.lists(slot, min_size=1, max_size=3))
        freed = free_request_slots(self.config, self.state, slots)
        assert freed.effects == ()
        self._perform(freed)
        for freed_slot in slots:
            self.model.free(freed_slot)
        self.reuse.update(slots)

    @invariant()
    def matches_the_reference(self) -> None:
        assert self.state.step == self.model.step
        assert self.state.generations.tolist() == self.model.generations.tolist()
        assert len(self.state.ring) == len(self.model.queue)
        for entry, expected in zip(self.state.ring, self.model.queue, strict=True):
            assert (entry is None) == (expected is None)
            if entry is not None and expected is not None:
                assert entry.step == expected.step
                assert entry.idx_mapping_np.tolist() == expected.idx_mapping.tolist()
                assert entry.need_sampled is not None
                assert entry.need_sampled.tolist() == expected.need_sampled.tolist()
                at_receive = entry.generations_at_receive[entry.idx_mapping_np]
                assert at_receive.tolist() == expected.generations.tolist()
                assert (entry.draft_tokens is None) == (self.config.num_speculative_steps == 0)

    @invariant()
    def ring_length_is_constant(self) -> None:
        expected = 0 if self.config.is_last_stage else self.config.ring_depth
        assert len(self.state.ring) == expected

    @invariant()
    def generations_never_decrease(self) -> None:
        assert (self.state.generations >= self.previous_generations).all()
        self.previous_generations = self.state.generations

    @invariant()
    def every_array_is_read_only(self) -> None:
        assert all(not array.flags.writeable for array in arrays_in(self.state))


RelayRingMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRelayRing = RelayRingMachine.TestCase


# --- determinism and matching collectives ------------------------------------------------------

Schedule = Sequence[tuple[BatchFacts, tuple[int, ...]]]


def _copy(facts: BatchFacts) -> BatchFacts:
    """An equal batch built from fresh arrays, so equality is by value, not identity."""
    rows = zip(
        facts.num_computed_tokens.tolist(),
        facts.num_scheduled_tokens.tolist(),
        facts.prefill_len.tolist(),
        strict=True,
    )
    return make_batch(facts.idx_mapping.tolist(), list(rows))


def run_stage(
    config: RelayConfig, schedule: Schedule, widths: Sequence[int]
) -> list[Step[RelayState, Any]]:
    """Every Step of one rank over the schedule, in call order."""
    state = init_relay(config)
    spec = config.num_speculative_steps
    draft_table = TensorSpec((config.max_num_reqs, spec), DType.INT64)
    steps: list[Step[RelayState, Any]] = []

    def keep(step: Step[RelayState, Any]) -> RelayState:
        steps.append(step)
        return step.state

    for (facts, frees), width in zip(schedule, widths, strict=True):
        if config.is_last_stage:
            sampled = TensorSpec((facts.num_reqs, width), DType.INT64)
            if config.wire is Wire.SEED:
                state = keep(broadcast_sampled(config, state, facts, sampled))
                if spec:
                    state = keep(broadcast_drafts(config, state, facts, draft_table))
            else:
                drafts = draft_table if spec else None
                state = keep(broadcast_sampled(config, state, facts, sampled, drafts))
        else:
            state = keep(consume_previous_step(config, state, update_drafts=True))
            state = keep(receive(config, state, facts))
        state = keep(free_request_slots(config, state, frees))
        state = keep(end_step(config, state))
    return steps


@st.composite
def worlds(draw: st.DrawFn) -> tuple[RelayConfig, Schedule, list[int]]:
    """A configuration, a batch schedule and the sampled width the last stage has each step."""
    config = draw(relay_configs())
    schedule = draw(batch_schedules(config.max_num_reqs))
    spec = config.num_speculative_steps
    widths = draw(
        st.lists(st.integers(1, spec + 1), min_size=len(schedule), max_size=len(schedule))
    )
    return config, schedule, widths


@settings(max_examples=40, deadline=None)
@given(worlds())
def test_equal_inputs_give_equal_steps(world: tuple[RelayConfig, Schedule, list[int]]) -> None:
    config, schedule, widths = world
    first = run_stage(config, schedule, widths)
    again = run_stage(config, [(_copy(facts), frees) for facts, frees in schedule], widths)
    assert first == again


def wire_schedule(
    steps: Sequence[Step[RelayState, Any]],
) -> list[tuple[int, tuple[int, ...], DType, int, Communicator, Stream]]:
    return [
        (e.step, e.shape, e.dtype, e.src, e.comm, e.stream)
        for step in steps
        for e in step.effects
        if isinstance(e, Broadcast)
    ]


@settings(max_examples=40, deadline=None)
@given(worlds(), st.sampled_from(Platform), st.sampled_from(Wire))
def test_every_stage_issues_the_same_collectives(
    world: tuple[RelayConfig, Schedule, list[int]], platform: Platform, wire: Wire
) -> None:
    config, schedule, widths = world
    sequences = []
    for stage in range(config.pp_size):
        stage_config = RelayConfig.for_stage(
            pp_size=config.pp_size,
            stage=stage,
            max_num_reqs=config.max_num_reqs,
            num_speculative_steps=config.num_speculative_steps,
            first_rank=config.last_rank - config.pp_size + 1,
            platform=platform,
            wire=wire,
        )
        sequences.append(wire_schedule(run_stage(stage_config, schedule, widths)))
    sender = sequences[-1]
    expected_per_step = {Wire.SEED: 3 if config.num_speculative_steps else 2}.get(wire, 1)
    sending_steps = [facts for facts, _ in schedule if need_sampled_mask(facts) is not None]
    # The fixed wire sends every step, whatever the batch.
    sends = len(schedule) if wire is Wire.FIXED else len(sending_steps)
    assert len(sender) == expected_per_step * sends
    for receiver in sequences[:-1]:
        assert receiver == sender
    assert all(src == config.last_rank for _, _, _, src, _, _ in sender)
