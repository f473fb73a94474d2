"""Review 78: a hand-built schedule's ReplicaSteps are checked; simulate_schedule names itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import attrs
import numpy as np
import pytest

from purepp.errors import ConfigError, InvalidInputError, PureppError
from purepp.rank import RankSteps
from purepp.testing import (
    RankOutputs,
    ReplicaStep,
    Schedule,
    ScheduleConfig,
    make_schedule,
    record_scripted_logs,
    scripted_program,
    simulate_schedule,
)

_CONFIG = ScheduleConfig(pp=2, dp=2, spec=2, steps=6, seed=0)


def _busy_step(schedule: Schedule) -> tuple[int, int]:
    """A (step, replica) whose batch has rows."""
    for step in range(schedule.config.steps):
        for replica in range(schedule.config.dp):
            if schedule.at(step, replica).batch.num_reqs:
                return step, replica
    raise AssertionError("no busy step")


def _with(schedule: Schedule, **changed: Any) -> Schedule:
    """`schedule` with one busy ReplicaStep changed (attrs.evolve runs its checks)."""
    step, replica = _busy_step(schedule)
    rows = [list(row) for row in schedule.steps]
    rows[step][replica] = attrs.evolve(rows[step][replica], **changed)
    return Schedule(config=schedule.config, steps=tuple(tuple(row) for row in rows))


def _planned(schedule: Schedule) -> ReplicaStep:
    return schedule.at(*_busy_step(schedule))


@pytest.mark.parametrize("run", [simulate_schedule, record_scripted_logs])
@pytest.mark.parametrize("broken", ["wider", "more-rows", "flat"])
def test_a_hand_built_schedule_with_drafts_of_another_shape_is_a_typed_error(
    run: Callable[[Schedule], object], broken: str
) -> None:
    """Drafts of another shape than [rows, spec] were a raw numpy ValueError halfway
    through the run (the scripted program's draft table write), after other ranks had
    issued their steps; now refused when the schedule is built, naming the step."""
    made = make_schedule(_CONFIG)
    rows = _planned(made).batch.num_reqs
    drafts = {
        "wider": np.zeros((rows, _CONFIG.spec + 1), np.int64),
        "more-rows": np.zeros((rows + 1, _CONFIG.spec), np.int64),
        "flat": np.zeros((rows,), np.int64),
    }[broken]
    with pytest.raises(PureppError, match="drafts"):  # a raw ValueError is no PureppError
        run(_with(made, drafts=drafts))


@pytest.mark.parametrize("field", ["sampled_tokens", "drafts", "num_sampled", "num_rejected"])
def test_a_replica_step_refuses_floats_instead_of_truncating_them(field: str) -> None:
    """ReplicaStep's array fields were converted with numpy's casting: 1.5 became 1 and
    the run went on with other values than the caller's."""
    planned = _planned(make_schedule(_CONFIG))
    changed: dict[str, Any] = {field: np.asarray(getattr(planned, field), np.float64) + 0.5}
    with pytest.raises(InvalidInputError, match=field) as raised:
        attrs.evolve(planned, **changed)
    assert raised.value.call == "ReplicaStep"


def test_a_replica_step_refuses_a_token_past_int64() -> None:
    """A token id past int64 was an OverflowError (or a wrapped uint64) from numpy."""
    planned = _planned(make_schedule(_CONFIG))
    rows, width = planned.sampled_tokens.shape
    with pytest.raises(InvalidInputError, match="sampled_tokens"):
        attrs.evolve(planned, sampled_tokens=[[2**63] * width] * rows)


def test_a_replica_step_of_another_step_or_replica_is_refused_by_the_schedule() -> None:
    made = make_schedule(_CONFIG)
    step, replica = _busy_step(made)
    with pytest.raises(InvalidInputError, match="replica"):
        _with(made, replica=1 - replica)
    with pytest.raises(InvalidInputError, match="step"):
        _with(made, step=step + 1)


@pytest.mark.parametrize(
    "given", [{"max_steps_in_flight": 0}, {"compare_steps": "no"}, {"max_steps_in_flight": 1.5}]
)
def test_simulate_schedule_names_itself_for_its_own_arguments(given: dict[str, Any]) -> None:
    """Its own keyword arguments were refused as `simulate`'s, a call the caller never made."""
    with pytest.raises(ConfigError) as raised:
        simulate_schedule(make_schedule(_CONFIG), **given)
    assert raised.value.call == "simulate_schedule"


def _no_steps(rank: int) -> RankSteps:
    """A steps_for that forgot its return (mypy would say so; a runner's test may not)."""
    return cast(RankSteps, None)


@pytest.mark.parametrize("run", ["simulate_schedule", "record_scripted_logs"])
@pytest.mark.parametrize("returned", ["none", "str"])
def test_a_steps_for_that_returns_no_rank_steps_is_named(run: str, returned: str) -> None:
    """A steps_for returning None silently ran the real steps (a broken-step test passing
    for nothing, or failing far from its cause); one returning another value was refused
    as `begin`'s `steps`, a call the caller never made."""
    schedule = make_schedule(_CONFIG)
    steps_for = _no_steps if returned == "none" else (lambda rank: cast(RankSteps, "x"))
    runs: dict[str, Callable[[], object]] = {
        "simulate_schedule": lambda: simulate_schedule(schedule, steps_for=steps_for),
        "record_scripted_logs": lambda: record_scripted_logs(schedule, steps_for=steps_for),
    }
    with pytest.raises(InvalidInputError, match="steps_for") as raised:
        runs[run]()
    assert raised.value.call == run
    assert "rank 0" in raised.value.problem


def test_scripted_program_refuses_outputs_that_are_no_dict_before_the_run() -> None:
    """outputs=[] was a raw IndexError once every rank had run."""
    schedule = make_schedule(_CONFIG)
    with pytest.raises(InvalidInputError, match="outputs") as raised:
        scripted_program(schedule, outputs=cast(dict[int, RankOutputs], []))
    assert raised.value.call == "scripted_program"
