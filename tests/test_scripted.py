"""The scripted schedule run by the real pure steps in the simulator.

Laws: every PP x DP world matches its collectives for the whole run; every
non-last stage consumes exactly what its last stage sent `pp` steps earlier, with
the rows of slots freed in between (and rows that sampled nothing) dropped; equal
configurations give equal schedules, equal logs and equal outputs; and what the
simulator issues is exactly what a bare Recorder records.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from purepp.batch import need_sampled_mask
from purepp.cudagraph import CUDAGraphMode
from purepp.effects.log import EffectLog, assert_logs_equal
from purepp.effects.matching import match_collectives
from purepp.effects.numpy_interpreter import NumpyInterpreter
from purepp.errors import ConfigError, InvalidInputError
from purepp.testing import (
    ConsumedStep,
    NumpyTensors,
    Schedule,
    ScheduleConfig,
    ScriptedRun,
    make_schedule,
    record_scripted_logs,
    scripted_header,
    scripted_rank_effects,
    simulate_schedule,
)
from tests.strategies import schedule_configs

STEPS = 14


def expected_consumed(schedule: Schedule, rank: int) -> tuple[ConsumedStep, ...]:
    """The oracle, written from the relay's contract and not from its code.

    A non-last stage consumes at step S what its last stage sent at T = S - pp: every
    row, with the slot of a row that sampled nothing, or whose slot was freed at a
    step strictly between T and S, replaced by -1 (frees at T precede T's batch, frees
    at S follow S's consume). Nothing is consumed when no row is kept. Tokens arrive
    right-padded with 0 to spec + 1; kept rows' drafts land in the target table.
    """
    world, config = schedule.world, schedule.config
    replica = world.dp_index(rank)
    if world.pp_stage(rank) == world.pp - 1:
        return ()
    table = np.zeros((config.max_num_reqs, config.spec), dtype=np.int64)
    consumed: list[ConsumedStep] = []
    for step in range(world.pp, config.steps):
        sent = schedule.at(step - world.pp, replica)
        mask = need_sampled_mask(sent.batch)
        if mask is None:
            continue
        freed = {
            slot
            for between in range(sent.step + 1, step)
            for slot in schedule.at(between, replica).freed
        }
        slots = [
            slot if keep and slot not in freed else -1
            for slot, keep in zip(sent.batch.idx_mapping.tolist(), mask.tolist(), strict=True)
        ]
        if all(slot == -1 for slot in slots):
            continue
        padded = np.zeros((sent.batch.num_reqs, config.spec + 1), dtype=np.int64)
        padded[:, : sent.sampled_tokens.shape[1]] = sent.sampled_tokens
        for row, slot in enumerate(slots):
            if slot != -1:
                table[slot] = sent.drafts[row]
        consumed.append(
            ConsumedStep(
                step=step,
                received_at_step=sent.step,
                idx_mapping=tuple(slots),
                sampled_tokens=tuple(tuple(r) for r in padded.tolist()),
                num_sampled=tuple(sent.num_sampled.tolist()),
                num_rejected=tuple(sent.num_rejected.tolist()),
                drafts_table=tuple(tuple(r) for r in table.tolist()) if config.spec else None,
            )
        )
    return tuple(consumed)


def check_run(schedule: Schedule, run: ScriptedRun) -> None:
    world = schedule.world
    assert match_collectives(dict(enumerate(run.simulation.effects)), world) is None
    for rank, outputs in enumerate(run.outputs):
        assert outputs.rank == rank
        assert outputs.consumed == expected_consumed(schedule, rank), f"rank {rank}"
        assert len(outputs.agreed) == schedule.config.steps
        assert run.simulation.interpreter(rank).lifetime_violations == ()
    for step in range(schedule.config.steps):
        modes = {outputs.agreed[step].cg_mode for outputs in run.outputs}
        assert len(modes) == 1, f"step {step}: ranks run different modes {modes}"
        if modes != {CUDAGraphMode.NONE}:
            # A graph: every rank pads to the same token count.
            assert len({outputs.agreed[step].num_tokens for outputs in run.outputs}) == 1
        for replica in range(world.dp):
            stages = {
                run.outputs[world.rank_of(pp_stage=s, dp_index=replica)].agreed[step]
                for s in range(world.pp)
            }
            assert len(stages) == 1, f"step {step}: stages of replica {replica} disagree"


@settings(max_examples=40, deadline=None)
@given(config=schedule_configs())
def test_every_world_matches_and_consumes_what_was_sent(config: ScheduleConfig) -> None:
    schedule = make_schedule(config)
    check_run(schedule, simulate_schedule(schedule))


@pytest.mark.parametrize(("pp", "dp", "spec"), [(2, 1, 0), (3, 1, 2), (4, 2, 1), (2, 3, 2)])
def test_longer_runs_match_and_consume_what_was_sent(pp: int, dp: int, spec: int) -> None:
    schedule = make_schedule(ScheduleConfig(pp=pp, dp=dp, spec=spec, steps=40, seed=11))
    run = simulate_schedule(schedule)
    check_run(schedule, run)
    assert sum(len(o.consumed) for o in run.outputs) > 0


def sampled_slots(schedule: Schedule, step: int, replica: int) -> set[int]:
    batch = schedule.at(step, replica).batch
    mask = need_sampled_mask(batch)
    return set() if mask is None else set(batch.idx_mapping[mask].tolist())


def test_a_slot_freed_in_flight_and_reused_at_once_drops_only_the_old_row() -> None:
    schedule = make_schedule(ScheduleConfig(pp=3, dp=1, spec=1, steps=24, seed=3))
    pp, steps = schedule.world.pp, schedule.config.steps
    consumed = {c.received_at_step: c for c in simulate_schedule(schedule).outputs[0].consumed}
    reused = 0
    for sent_at in range(steps - pp):
        for slot in sampled_slots(schedule, sent_at, 0):
            window = range(sent_at + 1, sent_at + pp)
            freed_at = [s for s in window if slot in schedule.at(s, 0).freed]
            if not freed_at:
                continue
            # The old request's row is dropped ...
            if sent_at in consumed:
                assert slot not in consumed[sent_at].idx_mapping
            # ... and the new request, scheduled at once in the same window, keeps its own.
            for new_at in range(freed_at[0], sent_at + pp):
                later_frees = range(new_at + 1, new_at + pp)
                if (
                    new_at + pp < steps
                    and slot in sampled_slots(schedule, new_at, 0)
                    and not any(slot in schedule.at(s, 0).freed for s in later_frees)
                ):
                    assert slot in consumed[new_at].idx_mapping
                    reused += 1
    assert reused, "no slot was freed while its token was in flight and reused at once"


def free_distances(schedule: Schedule, replica: int) -> set[int]:
    """Steps between a request's last sampling row and the free of its slot."""
    distances: set[int] = set()
    last_sampled: dict[int, int] = {}  # slot -> last step its holder sampled
    for step in range(schedule.config.steps):
        replica_step = schedule.at(step, replica)
        for slot in replica_step.freed:
            if slot in last_sampled:
                distances.add(step - last_sampled.pop(slot))
        mask = need_sampled_mask(replica_step.batch)
        if mask is not None:
            for slot, samples in zip(replica_step.batch.idx_mapping.tolist(), mask, strict=True):
                if samples:
                    last_sampled[slot] = step
    return distances


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_the_schedule_covers_what_it_promises(pp: int) -> None:
    schedule = make_schedule(ScheduleConfig(pp=pp, dp=2, spec=1, steps=24, seed=5))
    # Frees at every ring offset: each distance 1..pp between a sampled row and its free.
    assert free_distances(schedule, 0) >= set(range(1, pp + 1))
    # A freed slot is reused by the very next batch.
    assert any(
        set(s.freed) & set(s.batch.idx_mapping.tolist()) for row in schedule.steps for s in row
    )
    first, second = schedule.at(1, 0), schedule.at(1, 1)
    assert (first.num_tokens, second.num_tokens > 0) == (0, True)  # one idle replica
    assert all(s.num_tokens == 0 for s in schedule.steps[4])  # every replica idle
    step_zero = schedule.at(0, 0)
    assert step_zero.batch.num_reqs > 0
    assert not step_zero.samples  # only partial chunks
    widths = {s.sampled_tokens.shape[1] for row in schedule.steps for s in row}
    assert widths == {1, 2}  # plain-sampler and speculative steps
    decodes = [s for row in schedule.steps for s in row if s.uniform_token_count is not None]
    assert decodes, "no all-decode batch"


def test_equal_configs_give_equal_schedules_logs_and_outputs() -> None:
    config = ScheduleConfig(pp=3, dp=2, spec=2, steps=STEPS, seed=9)
    first, second = make_schedule(config), make_schedule(config)
    assert first == second
    run_a, run_b = simulate_schedule(first), simulate_schedule(second)
    assert run_a.outputs == run_b.outputs
    for rank in range(config.world.world_size):
        header = scripted_header(first, rank)
        assert_logs_equal(
            EffectLog.from_effects(header, run_a.simulation.effects[rank]),
            EffectLog.from_effects(header, run_b.simulation.effects[rank]),
        )
    other = make_schedule(ScheduleConfig(pp=3, dp=2, spec=2, steps=STEPS, seed=10))
    assert other != first


def test_the_simulator_issues_exactly_what_a_bare_recorder_records() -> None:
    schedule = make_schedule(ScheduleConfig(pp=2, dp=2, spec=1, steps=STEPS, seed=4))
    run = simulate_schedule(schedule)
    for rank, log in enumerate(record_scripted_logs(schedule)):
        assert_logs_equal(log, EffectLog.from_effects(log.header, run.simulation.effects[rank]))


def test_bad_configs_and_ranks_are_refused() -> None:
    with pytest.raises(ConfigError, match="pp=0"):
        ScheduleConfig(pp=0, dp=1, spec=0, steps=1, seed=0)
    with pytest.raises(ConfigError, match="spec=-1"):
        ScheduleConfig(pp=1, dp=1, spec=-1, steps=1, seed=0)
    with pytest.raises(ConfigError, match="max_prompt_len=3 <= chunk_size=3"):
        ScheduleConfig(pp=1, dp=1, spec=0, steps=1, seed=0, max_prompt_len=3)
    schedule = make_schedule(ScheduleConfig(pp=2, dp=1, spec=0, steps=2, seed=0))
    with pytest.raises(InvalidInputError, match="rank 2 is outside a world of 2"):
        scripted_rank_effects(schedule, 2, NumpyTensors(NumpyInterpreter()))


@settings(max_examples=40, deadline=None)
@given(config=schedule_configs(steps=24))
def test_every_step_is_one_a_scheduler_and_a_sampler_could_produce(
    config: ScheduleConfig,
) -> None:
    # The oracle above trusts the schedule; these are the schedule's own promises: chunked
    # prefills that end at the prompt, decodes of 1 + spec tokens, sampler outputs of a
    # valid shape and count, positive tokens unique over the run, and slots that change
    # hands only through a free.
    schedule = make_schedule(config)
    seen_tokens: set[int] = set()
    for replica in range(config.dp):
        progress: dict[int, int] = {}  # request -> tokens computed after its last row
        holder: dict[int, int] = {}  # slot -> the request that last held it
        for step in range(config.steps):
            planned = schedule.at(step, replica)
            for slot in planned.freed:
                holder.pop(slot)
            batch, n = planned.batch, planned.batch.num_reqs
            rows = zip(
                planned.request_ids,
                batch.idx_mapping.tolist(),
                batch.num_computed_tokens.tolist(),
                batch.num_scheduled_tokens.tolist(),
                batch.prefill_len.tolist(),
                strict=True,
            )
            decodes = 0
            for request, slot, computed, scheduled, prompt in rows:
                assert holder.setdefault(slot, request) == request, (step, slot)
                assert computed == progress.get(request, 0), (step, request)
                assert 0 < prompt <= config.max_prompt_len
                if computed < prompt:  # a prefill chunk, ending at the prompt at most
                    assert 0 < scheduled <= min(config.chunk_size, prompt - computed)
                    progress[request] = computed + scheduled
                else:  # a decode: one token kept on this schedule's scripted sampler
                    assert scheduled == 1 + config.spec
                    progress[request] = computed + 1
                    decodes += 1
            width = 1 + config.spec if decodes else 1
            assert planned.sampled_tokens.shape == (n, width)
            assert planned.drafts.shape == (n, config.spec)
            assert ((planned.num_sampled >= 1) & (planned.num_sampled <= width)).all()
            assert (planned.num_rejected == width - planned.num_sampled).all()
            tokens = [*planned.sampled_tokens.ravel().tolist(), *planned.drafts.ravel().tolist()]
            assert min(tokens, default=1) > 0
            assert seen_tokens.isdisjoint(tokens)
            assert len(set(tokens)) == len(tokens)
            seen_tokens.update(tokens)
            assert planned.num_tokens == int(batch.num_scheduled_tokens.sum())
            uniform = 1 + config.spec if n and decodes == n else None
            assert planned.uniform_token_count == uniform
