"""An embedder's review of `purepp.rank`: what the README's rank step promises.

A whole world driven through the phases (sequential or overlapped, with a `RankState`
pickled mid-run) consumes what the schedule says, independently of the library's own
reader; the torch interpreter on CPU (eager, checked, plans) issues what numpy does; a
refused call names itself, leaves every value as it was and issues nothing.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Generator, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
import torch.distributed as dist

from purepp import dp
from purepp.batch import BatchFacts
from purepp.effects.io import NumpyIO, TorchIO
from purepp.effects.log import Recorder
from purepp.effects.numpy_interpreter import NumpyInterpreter
from purepp.effects.simulator import RankContext, simulate
from purepp.effects.torch_interpreter import TorchInterpreter
from purepp.effects.vocabulary import Communicator, Effect
from purepp.errors import InvalidInputError, PureppError
from purepp.rank import (
    RankConfig,
    RankDriver,
    Sampled,
    ShapeFacts,
    StepIO,
    agree,
    begin,
    finish,
    init_rank,
    settle,
    start_agreement_phase,
    start_next_agreement,
)
from purepp.relay import Wire
from purepp.testing import (
    NumpyTensors,
    RecordingTensors,
    ReplicaStep,
    Schedule,
    ScheduleConfig,
    make_schedule,
    rank_config,
    scripted_header,
)

Array = npt.NDArray[Any]
Rows = tuple[tuple[int, ...], ...]
# step, received_at_step, idx_mapping, tokens, num_sampled, num_rejected, drafts table
Consumed = tuple[int, int, tuple[int, ...], Rows, tuple[int, ...], tuple[int, ...], Rows | None]


def shape_of(planned: ReplicaStep) -> ShapeFacts:
    return ShapeFacts(
        num_tokens=planned.num_tokens, uniform_token_count=planned.uniform_token_count
    )


def sampled_arrays(schedule: Schedule, planned: ReplicaStep) -> dict[str, Array | None]:
    spec = schedule.config.spec
    table = np.zeros((schedule.config.max_num_reqs, spec), np.int64)
    table[planned.batch.idx_mapping] = planned.drafts
    return {
        "tokens": np.array(planned.sampled_tokens),
        "num_sampled": np.array(planned.num_sampled),
        "num_rejected": np.array(planned.num_rejected),
        "draft_table": table if spec else None,
    }


def numpy_sampled(schedule: Schedule, planned: ReplicaStep) -> Sampled[Array]:
    arrays = sampled_arrays(schedule, planned)
    tokens, num_sampled, num_rejected = (
        arrays["tokens"],
        arrays["num_sampled"],
        arrays["num_rejected"],
    )
    assert tokens is not None
    assert num_sampled is not None
    assert num_rejected is not None
    return Sampled(
        tokens=tokens,
        num_sampled=num_sampled,
        num_rejected=num_rejected,
        draft_table=arrays["draft_table"],
    )


def rows(array: Array) -> Rows:
    return tuple(tuple(int(v) for v in row) for row in array.tolist())


# --- the reference: what a non-last stage must consume, from the schedule alone -------------


def reference(schedule: Schedule, rank: int) -> tuple[Consumed, ...]:
    """Entry T is consumed at T + ring_depth; a row is kept when it samples and its slot was
    not freed between (frees at the consuming step come after its consume); an entry with
    no row kept hands nothing out; kept rows' drafts land in the table by slot."""
    config = rank_config(schedule, rank)
    if config.is_last_stage:
        return ()
    depth = config.relay.ring_depth
    replica = schedule.world.dp_index(rank)
    spec = schedule.config.spec
    table = np.zeros((schedule.config.max_num_reqs, spec), np.int64)
    out: list[Consumed] = []
    for step in range(depth, schedule.config.steps):
        source = step - depth
        planned = schedule.at(source, replica)
        if not planned.samples:
            continue
        freed = {s for t in range(source + 1, step) for s in schedule.at(t, replica).freed}
        mask = planned.batch.sampled_mask
        slots = [int(s) for s in planned.batch.idx_mapping.tolist()]
        kept = tuple(
            s if (mask is None or bool(mask[i])) and s not in freed else -1
            for i, s in enumerate(slots)
        )
        if all(s < 0 for s in kept):
            continue
        width = spec + 1
        tokens = tuple(
            tuple(list(r) + [0] * (width - len(r))) for r in rows(planned.sampled_tokens)
        )
        for i, s in enumerate(kept):
            if spec and s >= 0:
                table[s] = planned.drafts[i]
        out.append(
            (
                step,
                source,
                kept,
                tokens,
                tuple(int(c) for c in planned.num_sampled.tolist()),
                tuple(int(c) for c in planned.num_rejected.tolist()),
                rows(table) if spec else None,
            )
        )
    return tuple(out)


def phase_program(
    schedule: Schedule,
    context: RankContext,
    *,
    overlap: bool,
    pickle_at: int | None,
    consumed: dict[int, tuple[Consumed, ...]],
) -> Generator[tuple[Effect, ...], None, None]:
    """An embedder's loop through the phases, in the simulator."""
    config = rank_config(schedule, context.rank)
    io = NumpyTensors(context.interpreter)
    spec = schedule.config.spec
    inputs = config.relay.inputs
    if config.updates_drafts:
        io.bind(inputs.draft_table, np.zeros((schedule.config.max_num_reqs, spec), np.int64))
    seen: list[Consumed] = []
    state = init_rank(config)
    last = schedule.config.steps - 1
    for step in range(schedule.config.steps):
        if step == pickle_at:
            state = pickle.loads(pickle.dumps(state))
        planned = schedule.at(step, context.replica)
        begun = yield from begin(config, state)
        out = begun.consumed
        if out is not None:
            seen.append(
                (
                    step,
                    out.received_at_step,
                    tuple(int(s) for s in io.read(out.idx_mapping).tolist()),
                    rows(io.read(out.sampled_tokens)),
                    tuple(int(c) for c in io.read(out.num_sampled).tolist()),
                    tuple(int(c) for c in io.read(out.num_rejected).tolist()),
                    rows(io.read(inputs.draft_table)) if spec else None,
                )
            )
        if overlap:
            if begun.agreeing is None:
                begun = yield from start_agreement_phase(
                    config, begun, planned.batch, shape_of(planned)
                )
            agreed = yield from settle(config, begun, io, freed=planned.freed)
            if step < last:
                following = schedule.at(step + 1, context.replica)
                agreed = yield from start_next_agreement(
                    config, agreed, following.batch, shape_of(following)
                )
        else:
            agreed = yield from agree(
                config, begun, planned.batch, shape_of(planned), io, freed=planned.freed
            )
        sampled = numpy_sampled(schedule, planned) if config.is_last_stage else None
        state = yield from finish(config, agreed, io, sampled)
    consumed[context.rank] = tuple(seen)


def simulate_phases(
    schedule: Schedule, *, overlap: bool, pickle_at: int | None
) -> tuple[dict[int, tuple[Consumed, ...]], tuple[tuple[Effect, ...], ...]]:
    consumed: dict[int, tuple[Consumed, ...]] = {}

    def program(context: RankContext) -> Iterator[tuple[Effect, ...]]:
        return phase_program(
            schedule, context, overlap=overlap, pickle_at=pickle_at, consumed=consumed
        )

    return consumed, simulate(schedule.world, program).effects


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlapped"])
@pytest.mark.parametrize(
    "config",
    [
        pytest.param(ScheduleConfig(pp=2, dp=2, spec=2, steps=12, seed=1), id="pp2-dp2-spec2"),
        pytest.param(
            ScheduleConfig(pp=3, dp=2, spec=1, steps=12, seed=3, wire=Wire.PACKED),
            id="pp3-dp2-packed",
        ),
    ],
)
def test_a_world_driven_through_the_phases_consumes_what_the_schedule_says(
    config: ScheduleConfig, overlap: bool
) -> None:
    """Every non-last rank consumes exactly the reference; the same run again issues equal
    effects (names included), and so does a run whose RankStates were pickled mid-run."""
    schedule = make_schedule(config)
    consumed, effects = simulate_phases(schedule, overlap=overlap, pickle_at=None)
    for rank in range(schedule.world.world_size):
        assert consumed[rank] == reference(schedule, rank), f"rank {rank}"
    assert any(-1 in entry[2] for entries in consumed.values() for entry in entries)
    assert sum(len(entries) for entries in consumed.values()) > 4
    again, effects_again = simulate_phases(schedule, overlap=overlap, pickle_at=None)
    assert again == consumed
    assert effects_again == effects
    restored, effects_restored = simulate_phases(schedule, overlap=overlap, pickle_at=5)
    assert restored == consumed
    assert effects_restored == effects


# --- the torch interpreter on CPU, in each mode, against numpy --------------------------------


def drive_one_rank(
    schedule: Schedule,
    recorder: Recorder,
    io: StepIO[Any],
    host: Callable[[Array], Any],
    *,
    overlap: bool,
) -> tuple[tuple[Effect, ...], list[object]]:
    config = rank_config(schedule, 0)
    driver: RankDriver[Any] = RankDriver(config, recorder, io)
    state = init_rank(config)
    descriptors: list[object] = []
    last = schedule.config.steps - 1
    for step in range(schedule.config.steps):
        planned = schedule.at(step, 0)
        begun = driver.begin(state)
        if overlap:
            if begun.agreeing is None:
                begun = driver.start(begun, planned.batch, shape_of(planned))
            agreed = driver.settle(begun, freed=planned.freed)
            if step < last:
                following = schedule.at(step + 1, 0)
                agreed = driver.start_next(agreed, following.batch, shape_of(following))
        else:
            agreed = driver.agree(begun, planned.batch, shape_of(planned), freed=planned.freed)
        descriptors.append(agreed.descriptor)
        arrays = {
            k: None if v is None else host(v) for k, v in sampled_arrays(schedule, planned).items()
        }
        state = driver.finish(agreed, Sampled[Any](**arrays))
    return recorder.log.effects, descriptors


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlapped"])
@pytest.mark.parametrize("mode", ["eager", "checked", "plans"])
@pytest.mark.parametrize("wire", [Wire.SEED, Wire.PACKED])
def test_the_torch_driver_on_cpu_issues_what_the_numpy_driver_issues(
    groups: dict[Communicator, dist.ProcessGroup], mode: str, overlap: bool, wire: Wire
) -> None:
    schedule = make_schedule(ScheduleConfig(pp=1, dp=1, spec=2, steps=8, seed=4, wire=wire))
    numpy_interpreter = NumpyInterpreter()
    expected = drive_one_rank(
        schedule,
        Recorder(scripted_header(schedule, 0), numpy_interpreter),
        NumpyIO(numpy_interpreter),
        lambda array: np.array(array, copy=True),
        overlap=False,
    )
    interpreter = TorchInterpreter(
        device=torch.device("cpu"),
        groups=groups,
        rank=0,
        checked=mode == "checked",
        plans=mode == "plans",
    )
    effects, descriptors = drive_one_rank(
        schedule,
        Recorder(scripted_header(schedule, 0), interpreter),
        TorchIO(interpreter),
        lambda array: torch.from_numpy(np.array(array, copy=True)),
        overlap=overlap,
    )
    assert descriptors == expected[1]
    assert len(effects) == len(expected[0])
    if not overlap:
        assert effects == expected[0]


# --- refusals: named, nothing issued, every value as it was -----------------------------------


class World:
    """Rank 0 of a dp 2 world (pp 1, the fixed wire: it sends every step), recorded:
    agreements issue all-reduces."""

    def __init__(self) -> None:
        self.schedule = make_schedule(
            ScheduleConfig(pp=1, dp=2, spec=0, steps=4, seed=7, wire=Wire.FIXED)
        )
        self.config: RankConfig = rank_config(self.schedule, 0)
        self.recorder = Recorder(scripted_header(self.schedule, 0))
        self.driver = RankDriver(self.config, self.recorder, RecordingTensors(self.schedule))

    def planned(self, step: int) -> ReplicaStep:
        return self.schedule.at(step, 0)

    def refused(
        self, value: object, attempt: Callable[[], object], error: type[PureppError], match: str
    ) -> None:
        before, issued = pickle.dumps(value), len(self.recorder.log.effects)
        with pytest.raises(error, match=match) as caught:
            attempt()
        assert ". Fix: " in str(caught.value)
        assert pickle.dumps(value) == before
        assert len(self.recorder.log.effects) == issued


def test_each_phase_refuses_before_issuing_and_leaves_its_value_as_it_was() -> None:
    world = World()
    driver, first = world.driver, world.planned(0)
    begun = driver.begin(init_rank(world.config))
    far_slot = BatchFacts(
        idx_mapping=[0, 9],
        num_computed_tokens=[5, 5],
        num_scheduled_tokens=[1, 1],
        prefill_len=[4, 4],
    )
    world.refused(
        begun,
        lambda: driver.settle(begun),
        InvalidInputError,
        r"^settle: step 0 has no agreement in flight",
    )
    world.refused(
        begun,
        lambda: driver.agree(begun, first.batch, shape_of(first), freed=[99]),
        InvalidInputError,
        r"slot 99 is outside 0\.\.3",
    )
    started = driver.start(begun, first.batch, shape_of(first))
    world.refused(
        started,
        lambda: driver.agree(started, first.batch, shape_of(first)),
        dp.LaneBusyError,
        r"^agree: step 0 already has step 0's agreement in flight",
    )
    agreed = driver.settle(started, freed=first.freed)
    following = world.planned(1)
    world.refused(
        agreed,
        lambda: driver.start_next(agreed, far_slot, ShapeFacts(num_tokens=2)),
        InvalidInputError,
        r"^start_next_agreement: .*9",
    )
    ahead = driver.start_next(agreed, following.batch, shape_of(following))
    world.refused(
        ahead,
        lambda: driver.start_next(ahead, following.batch, shape_of(following)),
        dp.LaneBusyError,
        r"^start_next_agreement: step 0 already started step 1.s agreement",
    )
    assert first.batch.num_reqs > 0
    world.refused(
        ahead,
        lambda: driver.finish(ahead, None),
        InvalidInputError,
        r"^finish: the last stage passed no sampled outputs at step 0",
    )
    state = driver.finish(ahead, numpy_sampled(world.schedule, first))
    assert state.agreeing is not None
    assert state.agreeing.step == 1
    begun = driver.begin(state)
    world.refused(
        begun,
        lambda: driver.start(begun, following.batch, shape_of(following)),
        dp.LaneBusyError,
        r"^start_agreement_phase: step 1 already has step 1's agreement in flight",
    )
    # The one in flight settles, and the step ends with both lanes free.
    agreed = driver.settle(begun, freed=following.freed)
    assert agreed.lanes == dp.AgreementLanes()
    assert driver.finish(agreed, numpy_sampled(world.schedule, following)).step == 2


@pytest.mark.parametrize("phase", ["agree", "settle"])
def test_a_bad_freed_slot_is_named_on_the_phase_that_took_it(phase: str) -> None:
    world = World()
    driver, first = world.driver, world.planned(0)
    begun = driver.begin(init_rank(world.config))
    if phase == "agree":
        world.refused(
            begun,
            lambda: driver.agree(begun, first.batch, shape_of(first), freed=[99]),
            InvalidInputError,
            r"^agree: ",
        )
    else:
        started = driver.start(begun, first.batch, shape_of(first))
        world.refused(
            started, lambda: driver.settle(started, freed=[99]), InvalidInputError, r"^settle: "
        )
