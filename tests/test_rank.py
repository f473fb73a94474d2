"""The rank step through `purepp.rank.RankDriver`, on real interpreters, against the simulator.

An embedder's loop (begin, agree, finish on a `RankDriver`) over a scripted schedule
consumes, agrees and issues exactly what the simulator's rank programs do: on a
`NumpyInterpreter` with `NumpyIO`, and on `TorchInterpreter` with `TorchIO` in real gloo
worlds (one rank, and a two-stage pipeline).
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import numpy as np
import numpy.typing as npt
import pytest

from purepp.cudagraph import BatchExecutionDescriptor
from purepp.effects.io import NumpyIO, TorchIO
from purepp.effects.log import Recorder
from purepp.effects.numpy_interpreter import NumpyInterpreter
from purepp.effects.torch_interpreter import TorchInterpreter, build_communicators
from purepp.effects.vocabulary import Broadcast, BufferRef, Effect
from purepp.rank import RankDriver, Sampled, ShapeFacts, StepIO, init_rank
from purepp.relay import Wire
from purepp.testing import (
    ConsumedStep,
    RankOutputs,
    Schedule,
    ScheduleConfig,
    make_schedule,
    rank_config,
    scripted_header,
    simulate_schedule,
)
from tests._dist import RankContext, run_ranks

T = TypeVar("T")
STEPS = 8


def rows(array: npt.NDArray[Any]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(v) for v in row) for row in array.tolist())


def drive_schedule(
    schedule: Schedule,
    rank: int,
    *,
    driver: RankDriver[T],
    io: StepIO[T],
    read: Callable[[BufferRef], npt.NDArray[Any]],
    host: Callable[[npt.NDArray[Any]], T],
) -> RankOutputs:
    """The schedule on one rank, as an embedder's loop: begin, agree, finish."""
    config = driver.config
    inputs = config.relay.inputs
    spec = schedule.config.spec
    replica = schedule.world.dp_index(rank)
    if config.updates_drafts:
        io.bind(inputs.draft_table, host(np.zeros((schedule.config.max_num_reqs, spec), np.int64)))
    consumed: list[ConsumedStep] = []
    agreed_at: list[BatchExecutionDescriptor] = []
    state = init_rank(config)
    for step in range(schedule.config.steps):
        planned = schedule.at(step, replica)
        begun = driver.begin(state)
        out = begun.consumed
        if out is not None:
            consumed.append(
                ConsumedStep(
                    step=step,
                    received_at_step=out.received_at_step,
                    idx_mapping=tuple(int(s) for s in read(out.idx_mapping).tolist()),
                    sampled_tokens=rows(read(out.sampled_tokens)),
                    num_sampled=tuple(int(c) for c in read(out.num_sampled).tolist()),
                    num_rejected=tuple(int(c) for c in read(out.num_rejected).tolist()),
                    drafts_table=rows(read(inputs.draft_table)) if spec else None,
                )
            )
        shape = ShapeFacts(
            num_tokens=planned.num_tokens, uniform_token_count=planned.uniform_token_count
        )
        agreed = driver.agree(begun, planned.batch, shape, freed=planned.freed)
        agreed_at.append(agreed.descriptor)
        table = None
        if spec:
            drafts = np.zeros((schedule.config.max_num_reqs, spec), np.int64)
            drafts[planned.batch.idx_mapping] = planned.drafts
            table = host(drafts)
        sampled = Sampled(
            tokens=host(np.array(planned.sampled_tokens)),
            num_sampled=host(np.array(planned.num_sampled)),
            num_rejected=host(np.array(planned.num_rejected)),
            draft_table=table,
        )
        state = driver.finish(agreed, sampled if config.is_last_stage else None)
    return RankOutputs(rank=rank, consumed=tuple(consumed), agreed=tuple(agreed_at))


@attrs.frozen
class DrivenRank:
    outputs: RankOutputs
    effects: tuple[Effect, ...]


@functools.cache
def simulated(
    config: ScheduleConfig,
) -> tuple[tuple[RankOutputs, ...], tuple[tuple[Effect, ...], ...]]:
    run = simulate_schedule(make_schedule(config))
    return run.outputs, tuple(tuple(effects) for effects in run.simulation.effects)


def one_rank(wire: Wire, spec: int) -> ScheduleConfig:
    return ScheduleConfig(pp=1, dp=1, spec=spec, steps=STEPS, seed=5 + spec, wire=wire)


def drive_numpy(config: ScheduleConfig) -> DrivenRank:
    schedule = make_schedule(config)
    interpreter = NumpyInterpreter()
    recorder = Recorder(scripted_header(schedule, 0), interpreter)
    io = NumpyIO(interpreter)
    driver = RankDriver(rank_config(schedule, 0), recorder, io)
    outputs = drive_schedule(
        schedule,
        0,
        driver=driver,
        io=io,
        read=interpreter.host_array,
        host=lambda array: np.array(array, copy=True),
    )
    return DrivenRank(outputs=outputs, effects=recorder.log.effects)


@pytest.mark.parametrize("wire", list(Wire))
@pytest.mark.parametrize("spec", [0, 2])
def test_the_driver_on_numpy_does_what_the_simulator_does(wire: Wire, spec: int) -> None:
    config = one_rank(wire, spec)
    outputs, effects = simulated(config)
    driven = drive_numpy(config)
    assert driven.outputs == outputs[0]
    assert driven.effects == effects[0]
    # The lone stage relays to itself: its broadcasts were performed, not skipped.
    assert any(isinstance(e, Broadcast) for e in driven.effects)


# --- real gloo worlds ---------------------------------------------------------------------------

PIPELINE = ScheduleConfig(pp=2, dp=1, spec=1, steps=STEPS, seed=1)


def drive_torch(config: ScheduleConfig, ctx: RankContext) -> DrivenRank:
    import torch

    schedule = make_schedule(config)
    groups = build_communicators(
        pp_groups=schedule.world.pp_groups,
        dp_groups=schedule.world.dp_groups,
        relay_backend=ctx.backend,
        timeout=ctx.timeout,
    )
    interpreter = TorchInterpreter(device=torch.device("cpu"), groups=groups, rank=ctx.rank)
    recorder = Recorder(scripted_header(schedule, ctx.rank), interpreter)
    io = TorchIO(interpreter)
    driver = RankDriver(rank_config(schedule, ctx.rank), recorder, io)
    outputs = drive_schedule(
        schedule,
        ctx.rank,
        driver=driver,
        io=io,
        read=lambda ref: interpreter.tensor(ref).numpy().copy(),
        host=lambda array: torch.from_numpy(np.array(array, copy=True)),
    )
    return DrivenRank(outputs=outputs, effects=recorder.log.effects)


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(one_rank(Wire.SEED, 2), id="one-rank-seed"),
        pytest.param(one_rank(Wire.FIXED, 2), id="one-rank-fixed"),
        pytest.param(PIPELINE, id="pp2-spec1"),
        pytest.param(attrs.evolve(PIPELINE, wire=Wire.PACKED), id="pp2-spec1-packed"),
    ],
)
def test_the_driver_on_gloo_does_what_the_simulator_does(config: ScheduleConfig) -> None:
    runs = run_ranks(
        functools.partial(drive_torch, config),
        config.pp * config.dp,
        backend="gloo",
        timeout=datetime.timedelta(seconds=30),
        deadline_s=120.0,
    )
    outputs, effects = simulated(config)
    for rank, run in enumerate(runs):
        assert run.outputs == outputs[rank], f"rank {rank}"
        assert run.effects == effects[rank], f"rank {rank}"
    assert config.pp == 1 or any(run.outputs.consumed for run in runs)
