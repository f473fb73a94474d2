"""Review 78: a research runner of my own, from the README and public API only."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from purepp.batch import need_sampled_mask
from purepp.cudagraph import BatchExecutionDescriptor
from purepp.effects import Effect
from purepp.effects.simulator import RankContext, RankProgram, simulate
from purepp.rank import (
    RankConfig,
    Sampled,
    ShapeFacts,
    begin,
    finish,
    init_rank,
    settle,
    start_agreement_phase,
    start_next_agreement,
)
from purepp.testing import (
    ConsumedStep,
    NumpyTensors,
    ReplicaStep,
    Schedule,
    ScheduleConfig,
    make_schedule,
    rank_config,
    simulate_schedule,
)


def _shape(planned: ReplicaStep) -> ShapeFacts:
    return ShapeFacts(
        num_tokens=planned.num_tokens, uniform_token_count=planned.uniform_token_count
    )


def _sampled(schedule: Schedule, planned: ReplicaStep) -> Sampled[npt.NDArray[Any]]:
    spec = schedule.config.spec
    table = np.zeros((schedule.config.max_num_reqs, spec), dtype=np.int64)
    table[list(planned.batch.idx_mapping)] = planned.drafts
    return Sampled(
        tokens=np.array(planned.sampled_tokens),
        num_sampled=np.array(planned.num_sampled),
        num_rejected=np.array(planned.num_rejected),
        draft_table=table,
    )


def _overlapped(
    schedule: Schedule,
    consumed: dict[int, list[ConsumedStep]],
    agreed: dict[int, list[BatchExecutionDescriptor]],
) -> RankProgram:
    def program(context: RankContext) -> Iterator[tuple[Effect, ...]]:
        rank = context.rank
        config: RankConfig = rank_config(schedule, rank)
        io = NumpyTensors(context.interpreter)
        spec = schedule.config.spec
        if config.updates_drafts:
            io.bind(
                config.relay.inputs.draft_table,
                np.zeros((schedule.config.max_num_reqs, spec), np.int64),
            )
        state = init_rank(config)
        steps = schedule.config.steps
        consumed[rank] = []
        agreed[rank] = []
        for step in range(steps):
            planned = schedule.at(step, context.replica)
            begun = yield from begin(config, state)
            if begun.consumed is not None:
                out = begun.consumed
                tokens = io.read(out.sampled_tokens)
                slots = io.read(out.idx_mapping)
                table = io.read(config.relay.inputs.draft_table) if spec else None
                consumed[rank].append(
                    ConsumedStep(
                        step=step,
                        received_at_step=out.received_at_step,
                        idx_mapping=tuple(int(s) for s in slots.tolist()),
                        sampled_tokens=tuple(tuple(int(v) for v in r) for r in tokens.tolist()),
                        num_sampled=tuple(int(c) for c in io.read(out.num_sampled).tolist()),
                        num_rejected=tuple(int(c) for c in io.read(out.num_rejected).tolist()),
                        drafts_table=None
                        if table is None
                        else tuple(tuple(int(v) for v in r) for r in table.tolist()),
                    )
                )
            if begun.agreeing is None:
                begun = yield from start_agreement_phase(
                    config, begun, planned.batch, _shape(planned)
                )
            ag = yield from settle(config, begun, io, freed=planned.freed)
            agreed[rank].append(ag.descriptor)
            if step + 1 < steps:
                nxt = schedule.at(step + 1, context.replica)
                ag = yield from start_next_agreement(config, ag, nxt.batch, _shape(nxt))
            state = yield from finish(config, ag, io, _sampled(schedule, planned))

    return program


def test_overlapped_runner_matches_scripted() -> None:
    schedule = make_schedule(ScheduleConfig(pp=2, dp=2, spec=2, steps=24, seed=3))
    assert any(schedule.at(s, r).freed for s in range(24) for r in range(2))
    reference = simulate_schedule(schedule)
    consumed: dict[int, list[ConsumedStep]] = {}
    agreed: dict[int, list[BatchExecutionDescriptor]] = {}
    simulate(schedule.world, _overlapped(schedule, consumed, agreed))
    for rank in range(4):
        ref = reference.outputs[rank]
        assert tuple(agreed[rank]) == ref.agreed
        assert tuple(consumed[rank]) == ref.consumed
    assert sum(len(v) for v in consumed.values()) > 0


def test_overlapped_runner_drops_exactly_the_rows_freed_in_flight() -> None:
    """An oracle of its own (field failure 8): an entry sampled at step r is consumed at
    r + pp, keeping each sampled row's slot unless a step in between freed it, with the
    last stage's tokens and counts; every such entry with a kept row is consumed."""
    schedule = make_schedule(ScheduleConfig(pp=3, dp=2, spec=2, steps=20, seed=5))
    consumed: dict[int, list[ConsumedStep]] = {}
    simulate(schedule.world, _overlapped(schedule, consumed, {}))
    pp, checked = schedule.config.pp, 0
    for rank, entries in consumed.items():
        if schedule.world.pp_stage(rank) == pp - 1:
            assert not entries
            continue
        replica = schedule.world.dp_index(rank)
        by_step = {entry.received_at_step: entry for entry in entries}
        for sent in range(schedule.config.steps - pp):
            planned = schedule.at(sent, replica)
            freed = {s for k in range(sent + 1, sent + pp) for s in schedule.at(k, replica).freed}
            mask = need_sampled_mask(planned.batch)
            expected = [
                slot if slot not in freed and (mask is None or bool(mask[row])) else -1
                for row, slot in enumerate(planned.batch.idx_mapping.tolist())
            ]
            if not planned.samples or all(slot == -1 for slot in expected):
                assert sent not in by_step
                continue
            entry = by_step[sent]
            assert entry.step == sent + pp
            assert list(entry.idx_mapping) == expected
            assert entry.num_sampled == tuple(planned.num_sampled.tolist())
            width = planned.sampled_tokens.shape[1]
            for row, slot in enumerate(expected):
                if slot != -1:
                    got = entry.sampled_tokens[row][:width]
                    assert got == tuple(planned.sampled_tokens[row].tolist())
            checked += 1
    assert checked > 10
