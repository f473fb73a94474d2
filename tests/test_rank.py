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
from purepp.errors import InterpreterError, InvalidInputError
from purepp.rank import RankDriver, RankSteps, Sampled, ShapeFacts, StepIO, init_rank
from purepp.relay import RelayConfig, RelayState, Wire
from purepp.step import Step
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


# --- what the driver refuses, before it issues anything -------------------------------------


@attrs.frozen
class OneRank:
    """A one-rank driver on numpy, recorded, and the first step of its schedule."""

    schedule: Schedule
    driver: RankDriver[npt.NDArray[Any]]
    recorder: Recorder

    def issued(self) -> int:
        return len(self.recorder.log.effects)

    def sampled(self, **changed: npt.NDArray[Any]) -> Sampled[npt.NDArray[Any]]:
        planned = self.schedule.at(0, 0)
        drafts = np.zeros((self.schedule.config.max_num_reqs, self.schedule.config.spec), np.int64)
        arrays: dict[str, npt.NDArray[Any]] = {
            "tokens": np.array(planned.sampled_tokens),
            "num_sampled": np.array(planned.num_sampled),
            "num_rejected": np.array(planned.num_rejected),
            "draft_table": drafts,
        }
        arrays.update(changed)
        return Sampled[npt.NDArray[Any]](**arrays)


def one_rank_driver(**config: Any) -> OneRank:
    schedule = make_schedule(one_rank(Wire.SEED, 2))
    interpreter = NumpyInterpreter()
    recorder = Recorder(scripted_header(schedule, 0), interpreter)
    rank = attrs.evolve(rank_config(schedule, 0), **config)
    return OneRank(schedule, RankDriver(rank, recorder, NumpyIO(interpreter)), recorder)


def shape_of(schedule: Schedule, step: int) -> ShapeFacts:
    planned = schedule.at(step, 0)
    return ShapeFacts(
        num_tokens=planned.num_tokens, uniform_token_count=planned.uniform_token_count
    )


def test_the_driver_takes_each_phase_value_once_and_refuses_a_stale_one() -> None:
    world = one_rank_driver()
    driver, batch = world.driver, world.schedule.at(0, 0).batch
    first = init_rank(driver.config)
    begun = driver.begin(first)
    agreed = driver.agree(begun, batch, shape_of(world.schedule, 0))
    state = driver.finish(agreed, world.sampled())
    issued = world.issued()
    reused: list[tuple[str, Callable[[], object], str]] = [
        ("finish", lambda: driver.finish(agreed, world.sampled()), "the Agreed of step 0"),
        (
            "agree",
            lambda: driver.agree(begun, batch, shape_of(world.schedule, 0)),
            "the Begun of step 0",
        ),
        ("settle", lambda: driver.settle(begun), "the Begun of step 0"),
        ("begin", lambda: driver.begin(first), "the RankState of step 0"),
    ]
    for call, again, described in reused:
        with pytest.raises(InvalidInputError, match=rf"RankDriver\.{call}: {described}") as caught:
            again()
        assert "driver last returned (the RankState of step 1)" in str(caught.value)
        assert "pass each phase the value the phase before it returned, once" in str(caught.value)
        assert str(caught.value).endswith("next, begin that RankState")
    # Nothing was issued, and the driver goes on from the value it last returned.
    assert world.issued() == issued
    begun = driver.begin(state)
    assert driver.agree(begun, world.schedule.at(1, 0).batch, shape_of(world.schedule, 1))
    with pytest.raises(
        InvalidInputError,
        match=r"RankDriver\.begin: the RankState of step 1.*next, start_next or finish that Agreed",
    ):
        driver.begin(state)


def test_a_new_driver_takes_any_first_value_and_a_refused_call_can_be_retried() -> None:
    world = one_rank_driver()
    driver, batch = world.driver, world.schedule.at(0, 0).batch
    begun = driver.begin(init_rank(driver.config))
    with pytest.raises(InvalidInputError, match="ShapeFacts"):
        driver.agree(begun, batch, "not a shape")  # type: ignore[arg-type]
    agreed = driver.agree(begun, batch, shape_of(world.schedule, 0))  # the same value, again
    assert driver.finish(agreed, world.sampled()).step == 1


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("num_sampled", np.ones(4, np.int64), "it is int64[4]"),
        ("num_rejected", np.zeros(3, np.int32), "it is int32[3]"),
        ("num_sampled", np.ones((4, 1), np.int32), "it is int32[4, 1]"),
    ],
)
def test_finish_refuses_counts_that_are_not_one_int32_per_row_before_issuing_anything(
    field: str, value: npt.NDArray[Any], shown: str
) -> None:
    world = one_rank_driver()
    driver = world.driver
    batch = world.schedule.at(0, 0).batch
    assert batch.num_reqs == 4  # the shapes above are wrong for this batch
    agreed = driver.agree(
        driver.begin(init_rank(driver.config)), batch, shape_of(world.schedule, 0)
    )
    issued = world.issued()
    with pytest.raises(
        InvalidInputError,
        match=rf"finish: Sampled\.{field} is not int32\[4\] for a batch of 4 rows: ",
    ) as caught:
        driver.finish(agreed, world.sampled(**{field: value}))
    assert shown in str(caught.value)
    assert f"pass {field} as an int32 tensor of shape [4]" in str(caught.value)
    assert world.issued() == issued
    assert driver.finish(agreed, world.sampled()).step == 1  # the corrected call goes through


@pytest.mark.parametrize("problem", ["int32", "too wide", "rows"])
def test_finish_names_sampled_tokens_of_the_wrong_shape_before_issuing_anything(
    problem: str,
) -> None:
    world = one_rank_driver()
    driver = world.driver
    batch = world.schedule.at(0, 0).batch
    width = driver.config.relay.max_sample_len
    tables: dict[str, npt.NDArray[Any]] = {
        "int32": np.zeros((4, 1), np.int32),
        "too wide": np.zeros((4, width + 1), np.int64),
        "rows": np.zeros((3, 1), np.int64),
    }
    tokens = tables[problem]
    agreed = driver.agree(
        driver.begin(init_rank(driver.config)), batch, shape_of(world.schedule, 0)
    )
    issued = world.issued()
    with pytest.raises(
        InvalidInputError,
        match=rf"finish: Sampled\.tokens is {tokens.dtype}\[{tokens.shape[0]}, "
        rf"{tokens.shape[1]}\] for a batch of 4 rows\. Fix: pass tokens as int64 \[4, k\] "
        rf"with 1 <= k <= spec \+ 1 = {width}",
    ):
        driver.finish(agreed, world.sampled(tokens=tokens))
    assert world.issued() == issued
    assert driver.finish(agreed, world.sampled()).step == 1


def test_a_missing_dispatcher_is_named_on_the_rank_config() -> None:
    world = one_rank_driver(dispatcher=None)
    driver, batch = world.driver, world.schedule.at(0, 0).batch
    begun = driver.begin(init_rank(driver.config))
    for attempt in (
        lambda: driver.agree(begun, batch, shape_of(world.schedule, 0)),
        lambda: driver.start(begun, batch, shape_of(world.schedule, 0)),
    ):
        with pytest.raises(InvalidInputError, match=r"RankConfig\.dispatcher is None") as caught:
            attempt()
        assert "pass RankConfig(dispatcher=...)" in str(caught.value)
    # A profile run forces eager and needs no dispatcher.
    agreed = driver.agree(begun, batch, ShapeFacts(num_tokens=12, need_eager=True))
    assert agreed.descriptor.cg_mode.name == "NONE"
    with pytest.raises(InvalidInputError, match=r"start_next_agreement: RankConfig\.dispatcher"):
        driver.start_next(agreed, world.schedule.at(1, 0).batch, shape_of(world.schedule, 1))


def test_the_agreement_dispatches_with_the_shapes_active_lora_count() -> None:
    # The seed's dispatch_cg_and_sync_dp takes this rank's active-LoRA count (not agreed).
    lora = attrs.evolve(one_rank_driver().schedule.dispatcher(), lora_capture_cases=(0, 2))
    world = one_rank_driver(dispatcher=lora)
    driver, batch = world.driver, world.schedule.at(0, 0).batch
    shape = attrs.evolve(shape_of(world.schedule, 0), num_active_loras=1)
    agreed = driver.agree(driver.begin(init_rank(driver.config)), batch, shape)
    expected = lora.dispatch(
        batch.num_reqs, shape.num_tokens, shape.uniform_token_count, num_active_loras=1
    )
    assert agreed.descriptor == expected
    assert agreed.descriptor.num_active_loras == 2  # the captured case serving 1 adapter
    for bad in (-1, True, 1.0, None):
        with pytest.raises(InvalidInputError, match=r"^ShapeFacts: num_active_loras="):
            ShapeFacts(num_tokens=4, num_active_loras=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [1, None, "yes"])
def test_shape_facts_refuse_a_need_eager_that_is_not_a_bool(bad: object) -> None:
    # 1 or "yes" would reach the DP table as a vote nobody meant.
    with pytest.raises(InvalidInputError, match=r"^ShapeFacts: need_eager=.*Fix: pass a bool"):
        ShapeFacts(num_tokens=4, need_eager=bad)  # type: ignore[arg-type]


def test_both_ios_upload_a_copy_of_the_host_array() -> None:
    """`StepIO.upload` makes a new tensor: the caller may reuse its array at once."""
    import torch

    values = np.array([3, 1, 2], dtype=np.int32)
    ios: tuple[NumpyIO, TorchIO] = (
        NumpyIO(NumpyInterpreter()),
        TorchIO(TorchInterpreter(device=torch.device("cpu"), groups={}, rank=0)),
    )
    uploaded = [io.upload(values) for io in ios]
    values[:] = 0
    for tensor in uploaded:
        assert tensor.tolist() == [3, 1, 2]


@pytest.mark.parametrize("dtype", ["float32", "int16", "uint8"])
def test_torch_io_refuses_the_spec_of_a_tensor_neither_int64_nor_int32(dtype: str) -> None:
    """The torch interpreter binds any tensor; its spec names the call, the buffer and the
    dtype. (The numpy interpreter refuses such an array when it is bound.)"""
    import torch

    ref = BufferRef("caller")
    interpreter = TorchInterpreter(device=torch.device("cpu"), groups={}, rank=0)
    interpreter.bind(ref, torch.zeros(3, dtype=getattr(torch, dtype)))
    with pytest.raises(InterpreterError, match=rf"^TorchIO.spec: buffer 'caller' is {dtype}\."):
        TorchIO(interpreter).spec(ref)
    with pytest.raises(InvalidInputError, match=rf"^NumpyInterpreter.bind: .* has dtype {dtype}"):
        NumpyInterpreter().bind(ref, np.zeros(3, dtype=dtype))


def test_finish_names_a_float_count_that_the_torch_interpreter_binds() -> None:
    import torch

    schedule = make_schedule(one_rank(Wire.SEED, 2))
    # A one-rank group decides at once, and finish checks before it issues: no communicator.
    interpreter = TorchInterpreter(device=torch.device("cpu"), groups={}, rank=0)
    driver = RankDriver(rank_config(schedule, 0), interpreter, TorchIO(interpreter))
    agreed = driver.agree(
        driver.begin(init_rank(driver.config)), schedule.at(0, 0).batch, shape_of(schedule, 0)
    )
    planned = schedule.at(0, 0)
    sampled = Sampled(
        tokens=torch.tensor(planned.sampled_tokens),
        num_sampled=torch.tensor(planned.num_sampled),
        num_rejected=torch.zeros(4, dtype=torch.float32),
        draft_table=torch.zeros((schedule.config.max_num_reqs, 2), dtype=torch.int64),
    )
    with pytest.raises(
        InvalidInputError, match=r"finish: Sampled\.num_rejected is not int32\[4\] for"
    ) as caught:
        driver.finish(agreed, sampled)
    assert "buffer 'relay.input.num_rejected' is float32" in str(caught.value)
    assert "pass num_rejected as an int32 tensor of shape [4]" in str(caught.value)


def test_a_token_count_below_the_batchs_scheduled_tokens_is_named_on_the_call_that_took_it() -> (
    None
):
    world = one_rank_driver()
    driver, batch = world.driver, world.schedule.at(0, 0).batch
    assert batch.num_reqs == 4
    begun = driver.begin(init_rank(driver.config))
    short = ShapeFacts(num_tokens=3)
    for call, attempt in (
        ("agree", lambda: driver.agree(begun, batch, short)),
        ("start_agreement_phase", lambda: driver.start(begun, batch, short)),
    ):
        with pytest.raises(
            InvalidInputError,
            match=rf"^{call}: ShapeFacts\.num_tokens=3 is below the batch's \d+ scheduled "
            r"tokens \(4 rows\)",
        ) as caught:
            attempt()
        assert "pass the step's scheduled tokens (after padding) as num_tokens" in str(caught.value)
    assert world.issued() == 0
    agreed = driver.agree(begun, batch, shape_of(world.schedule, 0))
    with pytest.raises(InvalidInputError, match=r"^start_next_agreement: ShapeFacts\.num_tokens"):
        driver.start_next(agreed, batch, short)


def first_stage_driver() -> tuple[Schedule, RankDriver[npt.NDArray[Any]], Recorder, NumpyIO]:
    """Stage 0 of a speculating two-stage pipeline, recorded without performing."""
    schedule = make_schedule(ScheduleConfig(pp=2, dp=1, spec=2, steps=STEPS, seed=3))
    recorder = Recorder(scripted_header(schedule, 0))
    io = NumpyIO(NumpyInterpreter())
    return schedule, RankDriver(rank_config(schedule, 0), recorder, io), recorder, io


@pytest.mark.parametrize(
    ("table", "shown"),
    [
        (None, "buffer 'relay.input.draft_table' is not bound"),
        (np.zeros((4, 3), np.int64), "it is int64[4, 3]"),
        (np.zeros((4, 2), np.int32), "it is int32[4, 2]"),
    ],
)
def test_a_speculating_receiver_without_its_draft_table_is_refused_at_the_first_finish(
    table: npt.NDArray[Any] | None, shown: str
) -> None:
    # The consume scatters drafts into it ring_depth steps later, mid-step: name it now.
    schedule, driver, recorder, io = first_stage_driver()
    inputs = driver.config.relay.inputs
    if table is not None:
        io.bind(inputs.draft_table, table)
    state = init_rank(driver.config)
    agreed = driver.agree(driver.begin(state), schedule.at(0, 0).batch, shape_of(schedule, 0))
    issued = len(recorder.log.effects)
    with pytest.raises(
        InvalidInputError,
        match=r"^finish: the draft table 'relay.input.draft_table' of a non-last stage with "
        r"num_speculative_steps=2 is not int64\[4, 2\]: ",
    ) as caught:
        driver.finish(agreed)
    assert shown in str(caught.value)
    assert "bind an int64 tensor of shape [4, 2] (zeros)" in str(caught.value)
    assert len(recorder.log.effects) == issued  # nothing issued
    io.bind(inputs.draft_table, np.zeros((4, 2), np.int64))
    assert driver.finish(agreed).step == 1


def test_a_step_run_twice_is_named_as_such_by_the_buffer_it_binds_again() -> None:
    # An embedder's own loop that never ends its relay's step issues the next step under
    # the same step's names: the interpreter says what went wrong, not only which name.
    def never_ends(config: RelayConfig, state: RelayState) -> Step[RelayState, None]:
        return Step(state=state, effects=(), result=None)

    schedule = make_schedule(ScheduleConfig(pp=2, dp=1, spec=1, steps=STEPS, seed=3))
    with pytest.raises(InterpreterError, match=r"step0\.\w+' is already bound") as caught:
        simulate_schedule(schedule, steps_for=lambda rank: RankSteps(end_step=never_ends))
    assert "if a step ran twice, pass begin (or a relay step) the state the last finish" in str(
        caught.value
    )


@pytest.mark.parametrize("missing", ["bind", "spec", "upload", "host_table"])
def test_an_io_lacking_any_one_of_its_four_methods_is_refused_naming_the_call(
    missing: str,
) -> None:
    interpreter = NumpyInterpreter()
    complete = NumpyIO(interpreter)

    class Partial:
        """A StepIO but for `missing`."""

    partial = Partial()
    for method in ("bind", "spec", "upload", "host_table"):
        if method != missing:
            setattr(partial, method, getattr(complete, method))
    schedule = make_schedule(one_rank(Wire.SEED, 0))
    with pytest.raises(InvalidInputError, match="RankDriver: io is a Partial"):
        RankDriver(rank_config(schedule, 0), interpreter, partial)  # type: ignore[arg-type]
