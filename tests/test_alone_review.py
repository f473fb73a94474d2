"""Review: a rank alone in its DP group agrees by itself; the phases hand out no empty batch;
the agreement's facts are built trusted (commits 3bf5f43 and 9ee144f).

The lone-rank `agree` (`purepp.rank._agreed_alone`) must be indistinguishable from the
general path (the start, the wait and the finish, which a `RankSteps` with a start of its
own still takes): the values returned, the effects issued, the errors raised and their
text, in whole runs that mix it with the overlapped phases, a drafter, frees, profile
steps and checkpointed (pickled) states. The phases now yield only non-empty effect
batches: an embedder sees the same effects, and the same `StepIO` calls between them, as
under the previous revision. The agreement's `dp.RankBatch` is built without its checks:
every value a phase lets through must be one `RankBatch`'s own constructor takes, as is.

Three checks of `dp.start_agreement` the lone path first skipped (a step past int32, a
subclass of the group, a dispatcher that lost its `dispatch`) are plain tests now: the
lone path runs the start's checks (`dp.decide_alone`).
"""

from __future__ import annotations

import functools
import importlib.util
import pickle
import subprocess
import sys
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar, cast

import attrs
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from purepp import dp
from purepp import rank as rank_module
from purepp._checks import INT32_MAX
from purepp.batch import BatchFacts
from purepp.cudagraph import (
    BatchExecutionDescriptor,
    CaptureMode,
    CudaGraphDispatcher,
    CUDAGraphMode,
    Dispatcher,
)
from purepp.effects.io import NumpyIO
from purepp.effects.numpy_interpreter import NumpyInterpreter
from purepp.effects.simulator import RankContext, simulate
from purepp.effects.vocabulary import BufferRef, Effect
from purepp.errors import InvalidInputError
from purepp.rank import (
    Agreed,
    Begun,
    RankConfig,
    RankDriver,
    RankState,
    RankSteps,
    Sampled,
    ShapeFacts,
    StepPhase,
    agree,
    begin,
    init_rank,
    start_agreement_phase,
    start_next_agreement,
)
from purepp.relay import RelayConfig
from purepp.testing import (
    ConsumedStep,
    NumpyTensors,
    ReplicaStep,
    Schedule,
    ScheduleConfig,
    make_schedule,
    rank_config,
)
from tests.strategies import batch_facts, cudagraph_dispatchers

R = TypeVar("R")
Array = npt.NDArray[Any]
REPO = Path(__file__).resolve().parent.parent
BEFORE = "910f702"  # the revision before the lone path, the empty-batch skip and trusted facts


def _own_start(*args: Any, **kwargs: Any) -> dp.AgreementStarted:
    """The real start behind a runner's own function: `agree` then takes the general path."""
    return dp.start_agreement(*args, **kwargs)


GENERAL = RankSteps(start_agreement=_own_start)
ALONE = RankSteps()
SLOTS = 8
LAST = RelayConfig.for_stage(pp_size=1, stage=0, max_num_reqs=SLOTS)  # a pipeline of one
DISPATCHER = CudaGraphDispatcher(
    capture_sizes=(1, 2, 4, 8), capture_mode=CaptureMode.FULL_AND_PIECEWISE, max_num_reqs=SLOTS
)
BATCH = BatchFacts(
    idx_mapping=[3, 1], num_computed_tokens=[5, 6], num_scheduled_tokens=[1, 1], prefill_len=[2, 2]
)
SHAPE = ShapeFacts(num_tokens=2, uniform_token_count=1)
# every fact the dispatcher is asked about, none at its default
ODD_SHAPE = ShapeFacts(num_tokens=4, uniform_token_count=2, max_query_len=2, num_active_loras=1)
SAMPLED = Sampled[Array](
    tokens=np.array([[7], [9]], dtype=np.int64),
    num_sampled=np.ones(2, dtype=np.int32),
    num_rejected=np.zeros(2, dtype=np.int32),
)


def _run(phase: StepPhase[R]) -> tuple[list[tuple[Effect, ...]], R]:
    """Every batch a phase yields, and its answer."""
    batches: list[tuple[Effect, ...]] = []
    while True:
        try:
            batches.append(next(phase))
        except StopIteration as stop:
            answer: R = stop.value
            return batches, answer


def _outcome(call: Callable[[], R]) -> R | tuple[type[BaseException], str]:
    """What `call` returns, or the type and text of what it raises."""
    try:
        return call()
    except Exception as error:  # compared between the paths, whatever it is
        return type(error), str(error)


# --- whole runs: the lone path mixed with the overlapped phases ----------------------------


@attrs.frozen
class Plan:
    """How one step of a rank's run goes."""

    start: bool  # start_agreement_phase then settle, in place of agree
    ahead: bool  # start the next step's agreement during this step (start_next_agreement)
    pickled: bool  # the RankState after this step is checkpointed through pickle
    eager: bool  # a profile step: ShapeFacts(need_eager=True)
    numpy_frees: bool  # the freed slots as a numpy int64 array, not a tuple
    query_len: int | None = None  # ShapeFacts.max_query_len
    loras: int = 0  # ShapeFacts.num_active_loras


def _shape(m: ModuleType, planned: ReplicaStep, plan: Plan, eager: bool) -> Any:
    """The step's ShapeFacts, of module `m`'s class."""
    return m.ShapeFacts(
        num_tokens=planned.num_tokens,
        uniform_token_count=planned.uniform_token_count,
        max_query_len=plan.query_len,
        need_eager=eager or plan.eager,
        num_active_loras=plan.loras,
    )


def _sampled(m: ModuleType, schedule: Schedule, planned: ReplicaStep) -> Any:
    """The last stage's outputs, of module `m`'s class."""
    table = np.zeros((schedule.config.max_num_reqs, schedule.config.spec), np.int64)
    table[planned.batch.idx_mapping] = planned.drafts
    return m.Sampled(
        tokens=np.array(planned.sampled_tokens),
        num_sampled=np.array(planned.num_sampled),
        num_rejected=np.array(planned.num_rejected),
        draft_table=table if schedule.config.spec else None,
    )


def _rows(array: Array) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(v) for v in row) for row in array.tolist())


def planned_rank(
    m: ModuleType,
    schedule: Schedule,
    rank: int,
    io: NumpyTensors,
    plans: list[Plan],
    *,
    drafter: Dispatcher | None = None,
    target: Dispatcher | None = None,
    profile: bool = False,
    steps: object = None,
) -> Generator[tuple[Effect, ...], None, list[object]]:
    """The schedule on one rank through the phases of the rank-step module `m` (this
    revision's, or the one before), each step as `plans` says; what it agreed and
    consumed, step by step. `target` replaces the schedule's dispatcher; `profile`: no
    target dispatcher, every step eager."""
    base = rank_config(schedule, rank)
    config = m.RankConfig(
        relay=base.relay,
        group=base.group,
        dispatcher=None if profile else target or base.dispatcher,
        drafter_dispatcher=drafter,
    )
    by: dict[str, object] = {} if steps is None else {"steps": steps}
    inputs = config.relay.inputs
    spec = schedule.config.spec
    if config.updates_drafts:
        io.bind(inputs.draft_table, np.zeros((schedule.config.max_num_reqs, spec), np.int64))
    replica = schedule.world.dp_index(rank)
    last = schedule.config.steps - 1
    seen: list[object] = []
    state = m.init_rank(config)
    for step in range(schedule.config.steps):
        planned = schedule.at(step, replica)
        plan = plans[step]
        begun = yield from m.begin(config, state, **by)
        out = begun.consumed
        if out is not None:
            table = io.read(inputs.draft_table) if spec else None
            seen.append(
                ConsumedStep(
                    step=step,
                    received_at_step=out.received_at_step,
                    idx_mapping=tuple(int(s) for s in io.read(out.idx_mapping).tolist()),
                    sampled_tokens=_rows(io.read(out.sampled_tokens)),
                    num_sampled=tuple(int(c) for c in io.read(out.num_sampled).tolist()),
                    num_rejected=tuple(int(c) for c in io.read(out.num_rejected).tolist()),
                    drafts_table=None if table is None else _rows(table),
                )
            )
        freed: object = planned.freed
        if plan.numpy_frees:
            freed = np.array(planned.freed, dtype=np.int64)
        shape = _shape(m, planned, plan, profile)
        if begun.agreeing is None and not plan.start:
            agreed = yield from m.agree(config, begun, planned.batch, shape, io, freed=freed, **by)
        else:
            if begun.agreeing is None:
                begun = yield from m.start_agreement_phase(
                    config, begun, planned.batch, shape, **by
                )
            agreed = yield from m.settle(config, begun, io, freed=freed, **by)
        seen.append(agreed)
        if plan.ahead and step < last:
            following = schedule.at(step + 1, replica)
            agreed = yield from m.start_next_agreement(
                config,
                agreed,
                following.batch,
                _shape(m, following, plans[step + 1], profile),
                **by,
            )
        state = yield from m.finish(config, agreed, io, _sampled(m, schedule, planned), **by)
        if plan.pickled:
            state = pickle.loads(pickle.dumps(state))
    return seen


Event = tuple[str, object]


class TracedTensors(NumpyTensors):
    """A rank's seam that notes every call in `events`, beside the batches performed."""

    def __init__(self, interpreter: NumpyInterpreter, events: list[Event]) -> None:
        super().__init__(interpreter)
        self.events = events

    def bind(self, ref: BufferRef, value: Array, /) -> None:
        self.events.append(("bind", (str(ref), value.shape, str(value.dtype))))
        super().bind(ref, value)

    def spec(self, ref: BufferRef, /) -> Any:
        self.events.append(("spec", str(ref)))
        return super().spec(ref)

    def upload(self, values: Any, /) -> Array:
        self.events.append(("upload", tuple(int(v) for v in values)))
        return super().upload(values)

    def host_table(self, ref: BufferRef, /) -> Any:
        self.events.append(("host_table", str(ref)))
        return super().host_table(ref)

    def read(self, ref: BufferRef, /) -> Array:
        self.events.append(("read", str(ref)))
        return super().read(ref)


def _traced(
    program: Generator[tuple[Effect, ...], None, R], events: list[Event]
) -> Generator[tuple[Effect, ...], None, R]:
    """`program`, noting each batch it yields in `events` before it is performed."""
    while True:
        try:
            batch = next(program)
        except StopIteration as stop:
            answer: R = stop.value
            return answer
        events.append(("batch", tuple(batch)))
        yield batch


def run_world(
    m: ModuleType,
    schedule: Schedule,
    plans: list[Plan],
    *,
    drafter: Dispatcher | None = None,
    target: Dispatcher | None = None,
    profile: bool = False,
    steps: object = None,
) -> tuple[object, list[list[Event]]]:
    """Every rank's answers and issued effects (or the run's error), and its trace."""
    size = schedule.world.world_size
    traces: list[list[Event]] = [[] for _ in range(size)]
    answers: dict[int, list[object]] = {}

    def program(context: RankContext) -> Iterator[tuple[Effect, ...]]:
        events = traces[context.rank]
        io = TracedTensors(context.interpreter, events)
        ran = planned_rank(
            m,
            schedule,
            context.rank,
            io,
            plans,
            drafter=drafter,
            target=target,
            profile=profile,
            steps=steps,
        )
        answers[context.rank] = yield from _traced(ran, events)

    def whole() -> tuple[tuple[list[object], ...], tuple[tuple[Effect, ...], ...]]:
        result = simulate(schedule.world, program)
        return tuple(answers[r] for r in range(size)), result.effects

    return _outcome(whole), traces


@attrs.frozen
class LoneRun:
    """A pipeline-only world (dp 1) and how its run goes."""

    schedule: Schedule
    plans: list[Plan]  # each step's plan
    drafter: Dispatcher | None  # the drafter's dispatcher, or none
    target: Dispatcher | None  # a target dispatcher in place of the schedule's, or none
    profile: bool  # no target dispatcher at all, every step eager


@st.composite
def lone_runs(draw: st.DrawFn) -> LoneRun:
    config = ScheduleConfig(
        pp=draw(st.integers(1, 3)),
        dp=1,
        spec=draw(st.integers(0, 2)),
        steps=draw(st.integers(3, 7)),
        seed=draw(st.integers(0, 2**16)),
        max_num_reqs=draw(st.integers(1, 5)),
    )
    plans = [
        Plan(
            start=draw(st.booleans()),
            ahead=draw(st.sampled_from([False, False, True])),
            pickled=draw(st.sampled_from([False, False, False, True])),
            eager=draw(st.sampled_from([False] * 5 + [True])),
            numpy_frees=draw(st.booleans()),
            query_len=draw(st.sampled_from([None, None, 1, 1, 2, 3])),
            loras=draw(st.sampled_from([0, 0, 0, 1])),
        )
        for _ in range(config.steps)
    ]
    # Varlen decode graphs (picked by the query-length bound) and a LoRA case, at times.
    varlen = CudaGraphDispatcher(
        capture_sizes=sorted(
            draw(st.lists(st.integers(1, 8), min_size=1, max_size=4, unique=True))
        ),
        capture_mode=draw(
            st.sampled_from([CaptureMode.FULL_DECODE_ONLY, CaptureMode.FULL_AND_PIECEWISE])
        ),
        max_num_reqs=config.max_num_reqs,
        num_speculative_tokens=config.spec,
        lora_capture_cases=(0, 1),
        varlen_decode=True,
    )
    return LoneRun(
        schedule=make_schedule(config),
        plans=plans,
        drafter=draw(st.none() | cudagraph_dispatchers()),
        target=draw(st.sampled_from([None, varlen, varlen])),
        profile=draw(st.sampled_from([False] * 5 + [True])),
    )


@settings(max_examples=40, deadline=None)
@given(lone_runs())
def test_lone_runs_mixing_agree_with_the_overlapped_phases_match_the_general_path(
    run: LoneRun,
) -> None:
    """Whole pipeline-only runs, `agree` mixed with start/settle and start_next on other
    steps, a drafter or not, frees as tuples or numpy arrays, profile steps, the RankState
    pickled between steps: every rank agrees, consumes and issues the same (or fails with
    the same error) on the lone path as on the general one, and calls its seam alike."""
    outcomes = [
        run_world(
            rank_module,
            run.schedule,
            run.plans,
            drafter=run.drafter,
            target=run.target,
            profile=run.profile,
            steps=steps,
        )
        for steps in (ALONE, GENERAL)
    ]
    (alone, alone_trace), (general, general_trace) = outcomes
    assert alone == general
    assert alone_trace == general_trace
    # No phase hands out an empty batch (the lone path yields none at all).
    assert all(batch for trace in alone_trace for kind, batch in trace if kind == "batch")


# --- dispatchers with odd answers, through RankDriver ----------------------------------------


class Odd:
    """A dispatcher that notes each call and answers what `answer` makes of it."""

    def __init__(self, answer: Callable[[int, int, int | None], object]) -> None:
        self.answer = answer
        self.calls: list[tuple[object, ...]] = []

    def dispatch(
        self,
        num_reqs: int,
        num_tokens: int,
        uniform_token_count: int | None,
        /,
        *,
        num_active_loras: int = 0,
        max_query_len: int | None = None,
    ) -> BatchExecutionDescriptor:
        given = (num_reqs, num_tokens, uniform_token_count, num_active_loras, max_query_len)
        self.calls.append((*given, *(type(v).__name__ for v in given)))
        return cast(
            BatchExecutionDescriptor, self.answer(num_reqs, num_tokens, uniform_token_count)
        )


class SubDescriptor(BatchExecutionDescriptor):
    """A descriptor of a class of a runner's own: refused, as any non-descriptor is."""


SHARED = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.FULL, num_tokens=4, num_reqs=4)


def _raise(error: Exception) -> Callable[[int, int, int | None], object]:
    def answer(reqs: int, tokens: int, uniform: int | None) -> object:
        raise error

    return answer


ODD_ANSWERS: dict[str, Callable[[int, int, int | None], object]] = {
    "graph": lambda reqs, tokens, uniform: BatchExecutionDescriptor(
        cg_mode=CUDAGraphMode.FULL, num_tokens=8, num_reqs=8, uniform_token_count=uniform
    ),
    "one-shared-graph": lambda reqs, tokens, uniform: SHARED,
    "numpy-counts": lambda reqs, tokens, uniform: BatchExecutionDescriptor(
        cg_mode=CUDAGraphMode.PIECEWISE, num_tokens=cast(int, np.int64(16)), num_reqs=None
    ),
    "eager-below-the-batch": lambda reqs, tokens, uniform: BatchExecutionDescriptor(
        cg_mode=CUDAGraphMode.NONE, num_tokens=0, num_reqs=0
    ),
    "none": lambda reqs, tokens, uniform: None,
    "a-tuple": lambda reqs, tokens, uniform: (CUDAGraphMode.FULL, 8, 8),
    "a-subclass": lambda reqs, tokens, uniform: SubDescriptor(
        cg_mode=CUDAGraphMode.FULL, num_tokens=8, num_reqs=8
    ),
    "raises-value-error": _raise(ValueError("no graph for you")),
    "raises-purepp-error": _raise(InvalidInputError("MyManager.dispatch", "broken", "fix it")),
    "raises-attribute-error": _raise(AttributeError("the manager was torn down")),
}


def _drive(config: RankConfig, steps: RankSteps, shapes: list[ShapeFacts]) -> list[object]:
    """One step's agree through a RankDriver, retried with each of `shapes` in turn after
    a failure (the driver takes the same Begun again: nothing was handed out); then the
    step is finished. What each call answered or raised."""
    interpreter = NumpyInterpreter()
    driver = RankDriver(config, interpreter, NumpyIO(interpreter), steps)
    begun = driver.begin(init_rank(config))
    answers: list[object] = []
    for shape in shapes:
        agreed = _outcome(functools.partial(driver.agree, begun, BATCH, shape, freed=[3]))
        answers.append(agreed)
        if isinstance(agreed, Agreed):
            answers.append(_outcome(functools.partial(driver.finish, agreed, SAMPLED)))
            break
    return answers


@pytest.mark.parametrize("role", ["target", "drafter", "both"])
@pytest.mark.parametrize("answer", sorted(ODD_ANSWERS))
def test_a_lone_driver_meets_odd_dispatchers_as_the_general_path_does(
    role: str, answer: str
) -> None:
    """Dispatchers that answer odd descriptors, no descriptor, or raise: the lone path
    returns, or raises, exactly what the general path does, asks the dispatchers the same
    questions with the same (exact int) arguments, and leaves the driver where the general
    path leaves it (a profile step retried on the same Begun runs alike)."""
    results = []
    for steps in (ALONE, GENERAL):
        odd = Odd(ODD_ANSWERS[answer])
        target: Dispatcher = odd if role in ("target", "both") else DISPATCHER
        drafter: Dispatcher | None = odd if role in ("drafter", "both") else None
        config = RankConfig(relay=LAST, dispatcher=target, drafter_dispatcher=drafter)
        eager = attrs.evolve(ODD_SHAPE, need_eager=True)
        answers = _drive(config, steps, [ODD_SHAPE, eager])
        results.append((answers, odd.calls))
    assert results[0] == results[1]


def test_a_lone_profile_run_with_no_dispatcher_matches_the_general_path() -> None:
    """No target dispatcher (a profile run): eager, and a drafter's dispatcher eager too;
    refused alike without need_eager."""
    for drafter in (None, DISPATCHER):
        config = RankConfig(relay=LAST, dispatcher=None, drafter_dispatcher=drafter)
        shapes = [SHAPE, attrs.evolve(SHAPE, need_eager=True)]
        alone, general = (_drive(config, steps, shapes) for steps in (ALONE, GENERAL))
        assert alone == general
        assert isinstance(alone[0], tuple)
        assert alone[0][0] is InvalidInputError
        agreed = alone[1]
        assert isinstance(agreed, Agreed)
        assert agreed.descriptor.cg_mode is CUDAGraphMode.NONE


# --- the agreement's facts, built trusted ----------------------------------------------------


@st.composite
def shape_facts(draw: st.DrawFn) -> ShapeFacts:
    """Any ShapeFacts its own check takes: small counts mostly, some up to INT32_MAX."""
    count = st.integers(0, 40) | st.integers(0, INT32_MAX)
    positive = st.none() | st.integers(1, 12) | st.integers(1, INT32_MAX)
    return ShapeFacts(
        num_tokens=draw(count),
        uniform_token_count=draw(positive),
        max_query_len=draw(positive),
        need_eager=draw(st.booleans()),
        num_active_loras=draw(st.integers(0, 3) | st.integers(0, INT32_MAX)),
    )


def _constructed(batch: BatchFacts, shape: ShapeFacts) -> dp.RankBatch | None:
    """The facts as RankBatch's own constructor builds them; None when it refuses them."""
    try:
        return dp.RankBatch(
            num_reqs=batch.num_reqs,
            num_tokens=shape.num_tokens,
            uniform_token_count=shape.uniform_token_count,
            max_query_len=shape.max_query_len,
            need_eager=shape.need_eager,
            num_active_loras=shape.num_active_loras,
        )
    except InvalidInputError:
        return None


def _exact(facts: dp.RankBatch) -> bool:
    """Every field holds what RankBatch's check stores: exact ints, a bool, None."""
    optional = (facts.uniform_token_count, facts.max_query_len)
    return (
        all(type(v) is int for v in (facts.num_reqs, facts.num_tokens, facts.num_active_loras))
        and all(v is None or type(v) is int for v in optional)
        and type(facts.need_eager) is bool
        and facts.dp_sync is None
    )


IO = NumpyIO(NumpyInterpreter())  # no lone agreement reads a table through it
ALONE_CONFIG = RankConfig(relay=LAST, dispatcher=DISPATCHER)
PAIR_CONFIG = attrs.evolve(ALONE_CONFIG, group=dp.AgreementGroup(dp_size=2, dp_rank=1))


@settings(max_examples=300, deadline=None)
@given(batch_facts(SLOTS), shape_facts(), st.sampled_from(["start", "start_next"]))
def test_the_phases_let_through_only_facts_rank_batch_itself_takes(
    batch: BatchFacts, shape: ShapeFacts, phase: str
) -> None:
    """Whatever a starting phase (start_agreement_phase, start_next_agreement) takes, the
    trusted RankBatch it builds is the one RankBatch's own constructor builds, field for
    field and type for type; whatever that constructor refuses, the phase refuses, as its
    own call."""
    expected = _constructed(batch, shape)
    facts: list[dp.RankBatch] = []
    refusals: list[str] = []
    for config in (ALONE_CONFIG, PAIR_CONFIG):
        _, begun = _run(begin(config, init_rank(config)))
        try:
            if phase == "start":
                _, started = _run(start_agreement_phase(config, begun, batch, shape))
                agreeing = started.agreeing
            else:
                _, agreed = _run(agree(ALONE_CONFIG, begun, BATCH, SHAPE, IO))
                _, ahead = _run(start_next_agreement(config, agreed, batch, shape))
                agreeing = ahead.ahead
        except InvalidInputError as refused:
            refusals.append(refused.call)
            continue
        assert agreeing is not None
        facts.append(agreeing.facts)
    if expected is None:
        assert facts == []
        assert set(refusals) <= {"start_agreement_phase", "start_next_agreement"}
        return
    for made in facts:
        assert made == expected
        assert _exact(made)


def test_a_uniform_count_of_an_empty_batch_reaches_the_facts_as_rank_batch_takes_it() -> None:
    """No rows: RankBatch takes any uniform count (its own check's slow path), so does
    the phase; the facts are the same."""
    empty = BatchFacts(
        idx_mapping=[], num_computed_tokens=[], num_scheduled_tokens=[], prefill_len=[]
    )
    shape = ShapeFacts(num_tokens=0, uniform_token_count=5)
    expected = _constructed(empty, shape)
    assert expected is not None
    _, begun = _run(begin(PAIR_CONFIG, init_rank(PAIR_CONFIG)))
    _, started = _run(start_agreement_phase(PAIR_CONFIG, begun, empty, shape))
    assert started.agreeing is not None
    assert started.agreeing.facts == expected


# --- the phases' batches against the revision before ----------------------------------------


@pytest.fixture(scope="module")
def before(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    """`purepp.rank` as it was before these changes, imported under a name of its own."""
    try:
        source = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{BEFORE}:purepp/rank.py"],
            capture_output=True,
            check=True,
            text=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"no git history holding {BEFORE}")
    name = f"purepp_rank_{BEFORE}"
    path = tmp_path_factory.mktemp("before") / f"{name}.py"
    path.write_text(source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its values pickle by the module's name
    spec.loader.exec_module(module)
    return module


def _plain(answers: Any) -> list[list[object]]:
    """Each rank's consumed steps and agreed outcomes (the Agreed classes of two revisions
    differ; what they hold is this revision's)."""
    return [
        [x if isinstance(x, ConsumedStep) else (x.target, x.drafter, x.lanes) for x in rank]
        for rank in answers
    ]


def _without_empty(trace: list[Event]) -> list[Event]:
    return [event for event in trace if event != ("batch", ())]


@pytest.mark.parametrize(
    ("config", "drafter", "overlap"),
    [
        (ScheduleConfig(pp=1, dp=1, spec=0, steps=6, seed=1), True, False),
        (ScheduleConfig(pp=2, dp=1, spec=2, steps=8, seed=2), True, True),
        (ScheduleConfig(pp=3, dp=1, spec=1, steps=8, seed=3), False, True),
        (ScheduleConfig(pp=2, dp=2, spec=1, steps=8, seed=4), True, False),
        (ScheduleConfig(pp=2, dp=2, spec=2, steps=8, seed=5), True, True),
        (ScheduleConfig(pp=2, dp=3, spec=0, steps=8, seed=6, microbatch=True), False, True),
    ],
)
def test_an_embedder_sees_the_same_effects_and_seam_calls_as_before(
    before: ModuleType, config: ScheduleConfig, drafter: bool, overlap: bool
) -> None:
    """Each rank's whole sequence of performed batches and StepIO calls (binds, uploads,
    table reads, spec reads, result reads), in order, is the previous revision's with its
    empty batches left out: no bind moved across an effect, no effect was lost, and
    every rank consumes and agrees the same."""
    schedule = make_schedule(config)
    plans = [
        Plan(
            start=overlap and s % 3 == 1,
            ahead=overlap and s % 3 == 0,
            pickled=False,
            eager=s == 4,
            numpy_frees=s % 2 == 0,
        )
        for s in range(config.steps)
    ]
    spare = CudaGraphDispatcher(
        capture_sizes=(2, 4), capture_mode=CaptureMode.FULL, max_num_reqs=config.max_num_reqs
    )
    extra = spare if drafter else None
    now, now_trace = run_world(rank_module, schedule, plans, drafter=extra)
    then, then_trace = run_world(before, schedule, plans, drafter=extra)
    assert isinstance(now, tuple)
    assert isinstance(then, tuple)
    now_answers, now_effects = now
    then_answers, then_effects = then
    assert not isinstance(now_answers, type)  # the run ended, no error
    assert now_effects == then_effects  # every rank's issued effects, in order
    assert _plain(now_answers) == _plain(then_answers)
    assert now_trace == [_without_empty(trace) for trace in then_trace]
    assert any(("batch", ()) in trace for trace in then_trace)  # the old phases did yield some


# --- divergences: the start's checks the lone path skips ------------------------------------


def _agreed(config: RankConfig, begun: Begun, shape: ShapeFacts, steps: RankSteps) -> Agreed:
    return _run(agree(config, begun, BATCH, shape, IO, steps=steps))[1]


def _both_paths(
    config: RankConfig, state: RankState | None = None, shape: ShapeFacts = SHAPE
) -> list[object]:
    """One agree on the lone and the general path: the Agreed, or the error."""
    begun = _run(begin(config, state or init_rank(config)))[1]
    return [
        _outcome(functools.partial(_agreed, config, begun, shape, steps))
        for steps in (ALONE, GENERAL)
    ]


def test_a_step_past_int32_is_refused_alone_as_on_the_general_path() -> None:
    config = RankConfig(relay=LAST, dispatcher=DISPATCHER)
    state = init_rank(config)
    late = attrs.evolve(state, relay=attrs.evolve(state.relay, step=INT32_MAX + 1))
    alone, general = _both_paths(config, late)
    assert isinstance(general, tuple)
    assert general[0] is InvalidInputError
    assert alone == general


class MyGroup(dp.AgreementGroup):
    """A runner's own subclass of AgreementGroup: RankConfig takes it (isinstance)."""


def test_a_group_of_another_class_is_refused_alone_as_on_the_general_path() -> None:
    config = RankConfig(relay=LAST, group=MyGroup(dp_size=1, dp_rank=0), dispatcher=DISPATCHER)
    alone, general = _both_paths(config)
    assert isinstance(general, tuple)
    assert general[0] is InvalidInputError
    assert alone == general


class Closable:
    """A graph manager whose dispatch goes away when it is closed (a torn-down runner)."""

    def __init__(self) -> None:
        self.inner: CudaGraphDispatcher | None = DISPATCHER

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("inner")
        if name != "dispatch" or inner is None:
            raise AttributeError(name)
        return inner.dispatch


@pytest.mark.parametrize("eager", [False, True])
def test_a_dispatcher_without_dispatch_is_refused_alone_as_on_the_general_path(
    eager: bool,
) -> None:
    manager = Closable()
    config = RankConfig(relay=LAST, dispatcher=cast(Dispatcher, manager))
    manager.inner = None
    alone, general = _both_paths(config, shape=attrs.evolve(SHAPE, need_eager=eager))
    assert isinstance(general, tuple)
    assert general[0] is InvalidInputError
    assert alone == general
