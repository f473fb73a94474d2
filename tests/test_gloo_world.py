"""The scripted program on real processes: every rank's outputs equal the simulator's.

2- and 3-process worlds over gloo (and NCCL, given two GPUs) run the scripted
schedule for 30 steps, with frees at every ring offset and slots reused at once, on
a `TorchInterpreter` wrapped by a `Recorder`. Each rank's outputs (what it consumed,
what it agreed) must equal what the simulator's numpy ranks produced for the same
schedule, and each rank's recorded log must equal the pure recording.
"""

from __future__ import annotations

import datetime
import functools

import attrs
import pytest
import torch

from purepp.effects.log import EffectLog, Recorder, assert_logs_equal
from purepp.effects.torch_interpreter import Backend, TorchInterpreter, build_communicators
from purepp.effects.vocabulary import Effect
from purepp.errors import ConfigError
from purepp.relay import Wire
from purepp.testing import (
    RankOutputs,
    Schedule,
    ScheduleConfig,
    make_schedule,
    record_scripted_rank,
    run_scripted_rank,
    scripted_header,
    simulate_schedule,
)
from tests._dist import RankContext, run_ranks

pytestmark = pytest.mark.multiprocess

STEPS = 30


@attrs.frozen
class RankRun:
    """What one process sends back (picklable)."""

    outputs: RankOutputs  # what it consumed and agreed
    effects: tuple[Effect, ...]  # every effect its Recorder recorded, in order
    left_bound: tuple[str, ...]  # names still bound in its interpreter at the end


WARM_UP_STEPS = 4  # NCCL may synchronise while it sets up its communicators


@attrs.frozen
class NoSyncPerform:
    """Performs effects with CUDA's sync debug mode at "error" once warmed up: a
    steady-state relay or agreement step that synchronised with the host would raise."""

    inner: Recorder  # what performs (and records) the effects

    def perform(self, effects: tuple[Effect, ...], /) -> None:
        steady = bool(effects) and effects[0].step >= WARM_UP_STEPS
        torch.cuda.set_sync_debug_mode("error" if steady else "default")
        try:
            self.inner.perform(effects)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def rank_interpreter(schedule: Schedule, ctx: RankContext) -> TorchInterpreter:
    """This process's interpreter, over the communicators of the schedule's world."""
    groups = build_communicators(
        pp_groups=schedule.world.pp_groups,
        dp_groups=schedule.world.dp_groups,
        relay_backend=ctx.backend,
        timeout=ctx.timeout,
    )
    return TorchInterpreter(device=ctx.device, groups=groups, rank=ctx.rank)


def run_world_rank(config: ScheduleConfig, ctx: RankContext) -> RankRun:
    schedule = make_schedule(config)
    interpreter = rank_interpreter(schedule, ctx)
    recorder = Recorder(scripted_header(schedule, ctx.rank), interpreter)
    perform = NoSyncPerform(recorder) if ctx.device.type == "cuda" else recorder
    outputs = run_scripted_rank(interpreter, schedule.world, ctx.rank, schedule, perform=perform)
    left = tuple(sorted(ref.name for ref in interpreter.bound_refs()))
    return RankRun(outputs=outputs, effects=recorder.log.effects, left_bound=left)


def check_world(config: ScheduleConfig, backend: Backend) -> None:
    schedule = make_schedule(config)
    runs = run_ranks(
        functools.partial(run_world_rank, config),
        schedule.world.world_size,
        backend=backend,
        timeout=datetime.timedelta(seconds=30),
        deadline_s=120.0,
    )
    simulated = simulate_schedule(schedule)
    for rank, run in enumerate(runs):
        assert run.outputs == simulated.outputs[rank], f"rank {rank}"
        recorded = EffectLog.from_effects(scripted_header(schedule, rank), run.effects)
        assert_logs_equal(record_scripted_rank(schedule, rank), recorded)
        # Only the caller's own bindings and the last pp steps' ring entries remain.
        assert all(name.startswith(("input.", "relay.")) for name in run.left_bound), rank
    assert any(run.outputs.consumed for run in runs) or schedule.world.pp == 1


WORLDS = [
    pytest.param(ScheduleConfig(pp=2, dp=1, spec=2, steps=STEPS, seed=21), id="pp2-spec2"),
    pytest.param(ScheduleConfig(pp=3, dp=1, spec=1, steps=STEPS, seed=22), id="pp3-spec1"),
    pytest.param(ScheduleConfig(pp=1, dp=2, spec=0, steps=STEPS, seed=23), id="dp2"),
    pytest.param(ScheduleConfig(pp=1, dp=3, spec=1, steps=STEPS, seed=24), id="dp3"),
    # The opt-in relay header: sent, received and checked on real ranks.
    pytest.param(
        ScheduleConfig(pp=3, dp=1, spec=2, steps=STEPS, seed=22, validate_header=True),
        id="pp3-spec2-header",
    ),
    # The opt-in wires: one aligned broadcast per step; the fixed one padded to a bucket.
    pytest.param(
        ScheduleConfig(pp=2, dp=1, spec=2, steps=STEPS, seed=21, wire=Wire.PACKED), id="pp2-packed"
    ),
    pytest.param(
        ScheduleConfig(pp=3, dp=1, spec=1, steps=STEPS, seed=22, wire=Wire.FIXED), id="pp3-fixed"
    ),
]


@pytest.mark.parametrize("config", WORLDS)
def test_gloo_ranks_consume_and_record_what_the_simulator_does(config: ScheduleConfig) -> None:
    check_world(config, "gloo")


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize(
    "config",
    [
        pytest.param(ScheduleConfig(pp=2, dp=1, spec=2, steps=STEPS, seed=21), id="pp2-spec2"),
        pytest.param(ScheduleConfig(pp=1, dp=2, spec=1, steps=STEPS, seed=23), id="dp2"),
        pytest.param(
            ScheduleConfig(pp=2, dp=1, spec=2, steps=STEPS, seed=21, validate_header=True),
            id="pp2-spec2-header",
        ),
    ],
)
def test_nccl_ranks_consume_and_record_what_the_simulator_does(config: ScheduleConfig) -> None:
    # Also: after warm-up no performed effect synchronises the host (NoSyncPerform), the
    # header's device-side check included.
    check_world(config, "nccl")


def run_one_rank_world(ctx: RankContext) -> tuple[RankOutputs, list[str]]:
    """Run a one-rank schedule with the interpreter performing; collect two refusals."""
    schedule = make_schedule(ScheduleConfig(pp=1, dp=1, spec=1, steps=8, seed=5))
    interpreter = rank_interpreter(schedule, ctx)
    refused = []
    other = make_schedule(ScheduleConfig(pp=2, dp=1, spec=1, steps=8, seed=5))
    for world, rank, wrong in ((other.world, 0, schedule), (schedule.world, 1, schedule)):
        try:
            run_scripted_rank(interpreter, world, rank, wrong)
        except ConfigError as error:
            refused.append(str(error))
    return run_scripted_rank(interpreter, schedule.world, ctx.rank, schedule), refused


def test_a_scripted_rank_performs_on_its_interpreter_and_refuses_another_world_or_rank() -> None:
    [(outputs, refused)] = run_ranks(run_one_rank_world, 1, deadline_s=60.0)
    schedule = make_schedule(ScheduleConfig(pp=1, dp=1, spec=1, steps=8, seed=5))
    assert outputs == simulate_schedule(schedule).outputs[0]
    assert len(outputs.agreed) == 8
    assert len(refused) == 2
    assert "world pp=2, dp=1 but the schedule's is pp=1, dp=1" in refused[0]
    assert "the interpreter is rank 0's, asked to run rank 1" in refused[1]
