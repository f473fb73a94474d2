"""purepp.testing: sequence assertions (a pass is silent, a mismatch shows the whole log),
and scripted worlds on the newest vLLM agreement."""

from __future__ import annotations

import pytest
import torch

from purepp.batch import BatchFacts
from purepp.cudagraph import BatchExecutionDescriptor, CUDAGraphMode
from purepp.effects.simulator import simulate
from purepp.effects.torch_interpreter import TorchInterpreter
from purepp.effects.vocabulary import (
    Alias,
    Allocate,
    Broadcast,
    Effect,
    RecordEvent,
    RecordStream,
    Unpack,
    WaitStream,
)
from purepp.errors import ConfigError
from purepp.layout import Layout
from purepp.relay import RelayConfig, consume_previous_step, init_relay, receive
from purepp.testing import (
    ScheduleConfig,
    assert_effect_sequence,
    make_schedule,
    reduced_agreement_table,
    run_scripted_rank,
    scripted_program,
    simulate_schedule,
)


def _receive_effects() -> tuple[Effect, ...]:
    config = RelayConfig.for_stage(pp_size=2, stage=0, max_num_reqs=4)
    state = consume_previous_step(config, init_relay(config)).state
    batch = BatchFacts(
        idx_mapping=[0], num_computed_tokens=[3], num_scheduled_tokens=[1], prefill_len=[3]
    )
    return tuple(receive(config, state, batch).effects)


def _is_relay_wait(effect: Effect) -> bool:
    return isinstance(effect, WaitStream) and effect.stream.value == "relay"


def test_a_matching_sequence_of_kinds_values_and_predicates_passes() -> None:
    effects = _receive_effects()
    kinds = [Allocate, Allocate, Broadcast, Broadcast, RecordEvent, Unpack]
    assert_effect_sequence(
        effects, [_is_relay_wait, *kinds, RecordStream, RecordStream, effects[-1]]
    )


def test_a_mismatch_marks_the_effect_and_names_the_next_expected_one() -> None:
    with pytest.raises(AssertionError) as caught:
        assert_effect_sequence(_receive_effects(), [WaitStream, Allocate, Broadcast])
    text = str(caught.value)
    assert "differs at effect 2 of 10; next expected: any Broadcast" in text
    assert ">>   2 allocate('relay.step0.counts')" in text
    assert text.count("\n") == 10  # the whole sequence is shown


def test_a_sequence_that_ends_early_says_so() -> None:
    effects = _receive_effects()
    with pytest.raises(AssertionError, match="the sequence ends here"):
        assert_effect_sequence(effects[:2], [WaitStream, Allocate, Alias])


def test_a_sequence_that_runs_on_says_nothing_more_was_expected() -> None:
    effects = _receive_effects()
    with pytest.raises(AssertionError) as caught:
        assert_effect_sequence(effects, list(effects[:-1]))
    assert "differs at effect 9 of 10; next expected: nothing more" in str(caught.value)


def test_a_mismatch_names_an_expected_predicate_or_shows_an_expected_effect() -> None:
    effects = _receive_effects()
    with pytest.raises(AssertionError) as caught:
        assert_effect_sequence(effects, [_is_relay_wait, _is_relay_wait])
    assert "next expected: an effect satisfying _is_relay_wait" in str(caught.value)
    with pytest.raises(AssertionError) as caught:
        assert_effect_sequence(effects, [effects[1]])
    assert f"next expected: {effects[1]!r}" in str(caught.value)


@pytest.mark.parametrize(("pp", "dp"), [(1, 2), (2, 2), (1, 3)])
def test_every_rank_agrees_the_same_step_shapes_with_the_newest_six_row_table(
    pp: int, dp: int
) -> None:
    schedule = make_schedule(
        ScheduleConfig(pp=pp, dp=dp, spec=1, steps=30, seed=pp * 10 + dp, microbatch=True)
    )
    run = simulate_schedule(schedule)  # collectives matched: the six-row tables line up

    def shape(d: BatchExecutionDescriptor) -> tuple[object, ...]:
        # Plain eager keeps each rank's own tokens (the seed's rule); graphs and
        # microbatched steps pad every rank to one agreed count.
        shared = d.cg_mode is not CUDAGraphMode.NONE or d.num_ubatches > 1
        return (d.cg_mode, d.num_ubatches, d.num_tokens if shared else None)

    by_rank = [[shape(d) for d in outputs.agreed] for outputs in run.outputs]
    assert all(agreed == by_rank[0] for agreed in by_rank)
    microbatched = sum(ubatches == 2 for _, ubatches, _ in by_rank[0])
    assert 0 < microbatched < len(by_rank[0])  # the schedule exercises both decisions


# --- refusals before anything runs --------------------------------------------------------


def test_a_reduced_table_exists_only_in_a_dp_world() -> None:
    single = make_schedule(ScheduleConfig(pp=2, dp=1, spec=0, steps=2, seed=0))
    with pytest.raises(ConfigError, match=r"^reduced_agreement_table: step 0 decides without"):
        reduced_agreement_table(single, 0)


def test_a_scripted_program_refuses_to_be_simulated_in_another_world() -> None:
    # Ranks of another world would read batches and groups the schedule never planned.
    schedule = make_schedule(ScheduleConfig(pp=2, dp=1, spec=0, steps=2, seed=0))
    with pytest.raises(ConfigError, match=r"^scripted_program: the simulated world is pp=3"):
        simulate(Layout(pp=3, dp=1), scripted_program(schedule))


def test_run_scripted_rank_refuses_another_world_or_another_ranks_interpreter() -> None:
    # Checked before the first collective: a wrong rank would hang its peers instead.
    schedule = make_schedule(ScheduleConfig(pp=2, dp=1, spec=0, steps=2, seed=0))
    interpreter = TorchInterpreter(device=torch.device("cpu"), groups={}, rank=0)
    with pytest.raises(ConfigError, match=r"^run_scripted_rank: world pp=2, dp=2 but"):
        run_scripted_rank(interpreter, Layout(pp=2, dp=2), 0, schedule)
    with pytest.raises(ConfigError, match=r"^run_scripted_rank: the interpreter is rank 0's"):
        run_scripted_rank(interpreter, schedule.world, 1, schedule)
