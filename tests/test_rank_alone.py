"""A rank alone in its DP group agrees by itself, exactly as the start, wait and finish would.

`agree` in a group of one rank (every pipeline-only deployment) decides without
building the agreement's start, wait and finish: each dispatcher's answer for the
rank's own batch, no sync. These tests hold it equal to the general path, which a
`RankSteps` with a start of its own still takes, value for value, with the same
refusals.
"""

from __future__ import annotations

from typing import Any, TypeVar

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from purepp import dp
from purepp.batch import BatchFacts
from purepp.cudagraph import CaptureMode, CudaGraphDispatcher
from purepp.effects.io import NumpyIO
from purepp.effects.numpy_interpreter import NumpyInterpreter
from purepp.effects.vocabulary import Effect
from purepp.errors import InvalidInputError
from purepp.rank import (
    Agreed,
    RankConfig,
    RankSteps,
    ShapeFacts,
    StepPhase,
    agree,
    begin,
    init_rank,
)
from purepp.relay import RelayConfig
from purepp.testing import ScheduleConfig, make_schedule, simulate_schedule
from tests.strategies import batch_facts, cudagraph_dispatchers

R = TypeVar("R")
SLOTS = 8
RELAY = RelayConfig(pp_size=2, stage=0, last_rank=1, max_num_reqs=SLOTS, num_speculative_steps=0)


def _own_start(*args: Any, **kwargs: Any) -> dp.AgreementStarted:
    """The real start, behind a function of a runner's own: the general path."""
    return dp.start_agreement(*args, **kwargs)


GENERAL = RankSteps(start_agreement=_own_start)
IO = NumpyIO(NumpyInterpreter())  # read only for a reduced table, which no lone rank has
DISPATCHER = CudaGraphDispatcher(
    capture_sizes=(1, 2, 4, 8), capture_mode=CaptureMode.FULL_AND_PIECEWISE, max_num_reqs=SLOTS
)


def _run(phase: StepPhase[R]) -> tuple[list[tuple[Effect, ...]], R]:
    batches: list[tuple[Effect, ...]] = []
    while True:
        try:
            batches.append(next(phase))
        except StopIteration as stop:
            answer: R = stop.value
            return batches, answer


@st.composite
def lone_steps(draw: st.DrawFn) -> tuple[RankConfig, BatchFacts, ShapeFacts]:
    """A lone rank's configuration (a drafter's dispatcher or not) and one step's facts."""
    dispatcher: CudaGraphDispatcher = draw(cudagraph_dispatchers())
    drafter = draw(st.none() | cudagraph_dispatchers())
    # Mostly rows every dispatcher takes; sometimes more, which both paths refuse alike.
    most = min(SLOTS, dispatcher.max_num_reqs, drafter.max_num_reqs if drafter else SLOTS)
    batch = draw(batch_facts(draw(st.sampled_from([most, most, most, SLOTS]))))
    scheduled = int(batch.num_scheduled_tokens.sum())
    num_tokens = draw(st.integers(max(scheduled, batch.num_reqs), max(scheduled, 1) * 3 + 4))
    rows = max(batch.num_reqs, 1)
    uniform = draw(st.none() | st.integers(1, max(1, num_tokens // rows)))
    if uniform is not None and uniform * rows > num_tokens:
        uniform = None
    shape = ShapeFacts(
        num_tokens=num_tokens,
        uniform_token_count=uniform,
        max_query_len=draw(st.none() | st.integers(1, 8)),
        need_eager=draw(st.booleans()),
        num_active_loras=draw(st.sampled_from([0, 0, 1])),
    )
    config = RankConfig(
        relay=attrs.evolve(RELAY, num_speculative_steps=dispatcher.num_speculative_tokens),
        dispatcher=dispatcher,
        drafter_dispatcher=drafter,
    )
    return config, batch, shape


@settings(max_examples=150, deadline=None)
@given(lone_steps())
def test_a_lone_rank_agrees_what_the_start_wait_and_finish_decide(
    step: tuple[RankConfig, BatchFacts, ShapeFacts],
) -> None:
    config, batch, shape = step
    _, begun = _run(begin(config, init_rank(config)))
    answers: list[tuple[object, object]] = []
    for steps in (GENERAL, RankSteps()):
        try:
            answers.append(_run(agree(config, begun, batch, shape, IO, steps=steps)))
        except InvalidInputError as refused:  # e.g. more rows than a dispatcher takes
            answers.append((type(refused), str(refused)))
    general, alone = answers
    assert alone == general
    batches, agreed = alone
    if not isinstance(agreed, Agreed):  # refused alike
        return
    assert batches == []  # no collective, and no empty batch handed out
    assert agreed.lanes == begun.lanes
    assert agreed.target.sync is None
    assert (agreed.drafter is None) == (config.drafter_dispatcher is None)


@pytest.mark.parametrize(("pp", "spec"), [(1, 0), (2, 0), (2, 2), (3, 1)])
def test_a_pipeline_only_world_runs_as_under_the_general_path(pp: int, spec: int) -> None:
    """Whole scripted pipelines (dp 1): every rank's effects and outputs are the same."""
    schedule = make_schedule(ScheduleConfig(pp=pp, dp=1, spec=spec, steps=9, seed=pp + spec))
    alone = simulate_schedule(schedule)
    general = simulate_schedule(schedule, steps_for=lambda rank: GENERAL)
    assert alone.outputs == general.outputs
    assert alone.simulation.effects == general.simulation.effects  # every rank's, in order


def test_a_uniform_count_beyond_the_tokens_is_refused_by_the_phase() -> None:
    """Named on the call the caller made (not on dp.RankBatch, which the phase builds),
    before anything is issued, on both paths."""
    config = RankConfig(
        relay=RELAY,
        dispatcher=DISPATCHER,
    )
    batch = BatchFacts(
        idx_mapping=[0, 1, 2],
        num_computed_tokens=[5, 5, 5],
        num_scheduled_tokens=[1, 1, 1],
        prefill_len=[2, 2, 2],
    )
    _, begun = _run(begin(config, init_rank(config)))
    shape = ShapeFacts(num_tokens=4, uniform_token_count=2)
    for steps in (RankSteps(), GENERAL):
        with pytest.raises(
            InvalidInputError,
            match=r"^agree: ShapeFacts\.uniform_token_count=2 x 3 rows exceeds "
            r"ShapeFacts\.num_tokens=4",
        ):
            _run(agree(config, begun, batch, shape, IO, steps=steps))


def test_a_busy_lane_is_refused_on_the_general_path_as_before() -> None:
    """A Begun whose lanes hold an agreement in flight takes the general path, whose start
    refuses the busy lane."""
    config = RankConfig(
        relay=RELAY,
        dispatcher=DISPATCHER,
    )
    _, begun = _run(begin(config, init_rank(config)))
    busy = attrs.evolve(begun, lanes=dp.AgreementLanes(target=0))
    batch = BatchFacts(
        idx_mapping=[0], num_computed_tokens=[5], num_scheduled_tokens=[1], prefill_len=[2]
    )
    with pytest.raises(dp.LaneBusyError):
        _run(agree(config, busy, batch, ShapeFacts(num_tokens=1), IO))
