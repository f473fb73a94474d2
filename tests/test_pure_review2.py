"""A second review of the pure core's contracts: purity, immutability, typed errors.

Every public step of `purepp.relay`, `purepp.dp`, `purepp.cudagraph`, `purepp.batch` and
`purepp.rank` is run (a) over random valid sequences, checking that it never changes its
inputs (the caller's numpy arrays included, changed after the call), that every array it
returns or holds is read-only all the way down, that two calls give equal answers, and
that states and effects survive pickling and deep copies; and (b) with garbage and edge
values, checking for a typed `PureppError` that names the call and leaves the inputs as
they were. The tests that fail on the reviewed code name a bug in their docstring.
"""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
from collections.abc import Callable, Generator
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from purepp.batch import BatchFacts, need_sampled_mask
from purepp.cudagraph import (
    BatchExecutionDescriptor,
    CaptureMode,
    CudaGraphDispatcher,
    CUDAGraphMode,
)
from purepp.dp import (
    AgreementGroup,
    AgreementLanes,
    DPSyncState,
    Lane,
    RankBatch,
    decide_alone,
    finish_agreement,
    start_agreement,
    wait_for_agreement,
)
from purepp.effects.arrays import is_frozen
from purepp.effects.vocabulary import AllReduce, BufferRef, DType, Effect, EventRef, TensorSpec
from purepp.errors import PureppError
from purepp.rank import (
    Agreed,
    Begun,
    RankConfig,
    RankState,
    Sampled,
    ShapeFacts,
    agree,
    begin,
    finish,
    init_rank,
)
from purepp.relay import (
    PendingReceive,
    Platform,
    RelayConfig,
    Wire,
    broadcast_drafts,
    broadcast_sampled,
    consume_previous_step,
    end_step,
    free_request_slot,
    free_request_slots,
    init_relay,
    receive,
)
from tests.strategies import cudagraph_dispatchers, dead_rank_sets, dp_worlds, table_layouts

Array = npt.NDArray[Any]

FAST = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# ---- helpers: arrays reachable from a value --------------------------------------------------


def arrays_in(value: object, *, private: bool = True) -> list[Array]:
    """Every numpy array reachable from `value` through attrs fields, tuples, lists and
    dicts, once per path (`private=False` skips underscored attrs fields: memo caches)."""
    if isinstance(value, np.ndarray):
        return [value]
    children: list[object] = []
    kind: Any = type(value)
    if attrs.has(kind):
        children = [
            getattr(value, field.name)
            for field in attrs.fields(kind)
            if private or not field.name.startswith("_")
        ]
    elif isinstance(value, (tuple, list)):
        children = list(value)
    elif isinstance(value, dict):
        children = list(value.values())
    return [array for child in children for array in arrays_in(child, private=private)]


def thawable(array: Array) -> bool:
    """Whether `array` or any base under it can be made writable (or already is)."""
    chain: list[object] = [array]
    base = array.base
    while isinstance(base, np.ndarray):
        chain.append(base)
        base = base.base
    for link in chain:
        assert isinstance(link, np.ndarray)
        if link.flags.writeable:
            return True
        try:
            link.flags.writeable = True
        except ValueError:
            continue
        return True
    return False


def assert_frozen(value: object) -> None:
    for array in arrays_in(value):
        assert is_frozen(array), f"a {array.dtype}{list(array.shape)} array is not frozen"
        assert not thawable(array), f"a {array.dtype}{list(array.shape)} array can thaw"


def plain(value: object) -> object:
    """`value` as nested tuples comparable with `==`: arrays by dtype, shape and elements,
    attrs values by their public fields (memo caches left out)."""
    if isinstance(value, np.ndarray):
        data = value.tolist() if value.dtype.hasobject else value.tobytes()
        return ("array", value.dtype.str, value.shape, data)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, *(plain(item) for item in value))
    if isinstance(value, dict):
        return ("dict", *((key, plain(item)) for key, item in value.items()))
    kind: Any = type(value)
    if attrs.has(kind):
        fields = attrs.fields(kind)
        shown = [(f.name, plain(getattr(value, f.name))) for f in fields if f.name[0] != "_"]
        return (type(value).__name__, *shown)
    return value


def assert_round_trips(value: object) -> None:
    """Pickle and deepcopy give an equal value whose arrays are frozen again."""
    for copied in (pickle.loads(pickle.dumps(value)), copy.deepcopy(value)):
        assert copied == value
        assert plain(copied) == plain(value)
        assert_frozen(copied)


def checked(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call `fn` twice: equal answers, inputs unchanged, every output array frozen, and
    the outputs survive pickle and deepcopy."""
    given_values = (args, kwargs)
    seen = plain(given_values)
    first = fn(*args, **kwargs)
    second = fn(*args, **kwargs)
    assert first == second
    assert plain(given_values) == seen
    assert_frozen(first)
    assert_round_trips(first)
    return first


# ---- (a) the relay over random valid sequences ---------------------------------------------


@st.composite
def relay_setups(draw: st.DrawFn) -> RelayConfig:
    pp_size = draw(st.integers(1, 3))
    return RelayConfig.for_stage(
        pp_size=pp_size,
        stage=draw(st.integers(0, pp_size - 1)),
        max_num_reqs=draw(st.integers(1, 5)),
        num_speculative_steps=draw(st.integers(0, 2)),
        first_rank=draw(st.integers(0, 2)),
        platform=draw(st.sampled_from(Platform)),
        validate_header=draw(st.booleans()),
        wire=draw(st.sampled_from(Wire)),
    )


@st.composite
def caller_batches(draw: st.DrawFn, max_num_reqs: int) -> tuple[Array, Array, Array, Array]:
    """A batch's four arrays as a caller holds them: writable, of any integer dtype."""
    slots = draw(st.lists(st.integers(0, max_num_reqs - 1), unique=True, max_size=max_num_reqs))
    dtype = draw(st.sampled_from([np.int32, np.int64, np.uint16]))
    rows = [
        draw(st.tuples(st.integers(0, 40), st.integers(0, 5), st.integers(0, 40))) for _ in slots
    ]
    table = np.array(rows, dtype=dtype).reshape(len(slots), 3)
    return (
        np.array(slots, dtype=dtype),
        np.ascontiguousarray(table[:, 0]),
        np.ascontiguousarray(table[:, 1]),
        np.ascontiguousarray(table[:, 2]),
    )


def batch_from(arrays: tuple[Array, Array, Array, Array]) -> BatchFacts:
    """BatchFacts from the caller's arrays; changing those arrays later changes nothing."""
    batch = checked(
        BatchFacts,
        idx_mapping=arrays[0],
        num_computed_tokens=arrays[1],
        num_scheduled_tokens=arrays[2],
        prefill_len=arrays[3],
    )
    kept = plain(batch)
    mask = need_sampled_mask(batch)
    for held in arrays:
        np.add(held, 1, out=held)
    assert plain(batch) == kept
    assert need_sampled_mask(batch) is mask
    assert isinstance(batch, BatchFacts)
    return batch


@FAST
@given(data=st.data(), config=relay_setups())
def test_relay_steps_are_pure_deterministic_and_frozen_over_random_runs(
    data: st.DataObject, config: RelayConfig
) -> None:
    """Every relay step, over a random run of a random stage: inputs (the caller's batch
    arrays and slot arrays too, changed after the call) are never changed, two calls give
    equal steps, and every array a state, effect or result holds is frozen and stays
    frozen through pickle and deepcopy."""
    state = checked(init_relay, config)
    spec = config.num_speculative_steps
    drafts = TensorSpec((config.max_num_reqs, spec), DType.INT64) if spec else None
    for _ in range(data.draw(st.integers(1, 5), label="steps")):
        batch = batch_from(data.draw(caller_batches(config.max_num_reqs), label="batch"))
        if not config.is_last_stage:
            state = checked(consume_previous_step, config, state, update_drafts=bool(spec)).state
            state = checked(receive, config, state, batch).state
        else:
            tokens = TensorSpec((batch.num_reqs, data.draw(st.integers(1, spec + 1))), DType.INT64)
            packed = config.wire is not Wire.SEED
            state = checked(
                broadcast_sampled, config, state, batch, tokens, drafts if packed else None
            ).state
            if spec and not packed:
                state = checked(broadcast_drafts, config, state, batch, drafts).state
        frees = data.draw(st.lists(st.integers(0, config.max_num_reqs - 1), max_size=20))
        slots = np.array(frees, dtype=data.draw(st.sampled_from([np.int32, np.int64, np.uint8])))
        freed = checked(free_request_slots, config, state, slots)
        kept = plain(freed)
        slots += 1  # the caller reuses its array
        assert plain(freed) == kept
        if frees:
            state = checked(free_request_slot, config, freed.state, frees[0]).state
        state = checked(end_step, config, state).state
    assert_round_trips(state)


# ---- (a) the DP agreement over random valid worlds -------------------------------------------


@FAST
@given(data=st.data())
def test_agreement_steps_are_pure_deterministic_and_frozen_over_random_worlds(
    data: st.DataObject,
) -> None:
    """start, wait and finish on every live rank of a random world (any layout, dead ranks):
    inputs unchanged, equal answers twice, frozen outputs that survive pickling, and the
    caller's reduced table, changed after the finish, changes nothing it returned."""
    dispatcher, batches = data.draw(dp_worlds(min_size=1, max_size=5), label="world")
    layout = data.draw(table_layouts(), label="layout")
    size = len(batches)
    dead = data.draw(dead_rank_sets(size), label="dead") if size > 1 else frozenset()
    live = frozenset(range(size)) - dead
    step = data.draw(st.integers(0, 2**31 - 1), label="step")
    lane = data.draw(st.sampled_from(Lane), label="lane")
    asynchronous = data.draw(st.booleans(), label="asynchronous")
    started = []
    for rank, batch in enumerate(batches):
        group = AgreementGroup(
            dp_size=size, dp_rank=rank, layout=layout, live_ranks=live if rank in live else None
        )
        started.append(
            checked(
                start_agreement,
                AgreementLanes(),
                group,
                dispatcher,
                batch,
                step=step,
                lane=lane,
                asynchronous=asynchronous,
            )
        )
    pending = [s.result for s in started]
    table: Array | None = None
    if pending[0].contribution is not None:
        table = np.array(sum(p.contribution for p in pending), dtype=np.int32)
    for rank in sorted(live):
        checked(wait_for_agreement, pending[rank])
        mine = None if table is None else table.copy()  # the caller's own, writable
        done = checked(finish_agreement, started[rank].state, pending[rank], mine)
        kept = plain(done)
        if mine is not None:
            mine += 7
        assert plain(done) == kept
        if size == 1:
            group = pending[rank].group
            lanes = AgreementLanes()
            alone = checked(
                decide_alone, lanes, group, dispatcher, batches[rank], step=step, lane=lane
            )
            assert alone == done.result


@FAST
@given(data=st.data(), dispatcher=cudagraph_dispatchers())
def test_dispatch_is_pure_and_deterministic(
    data: st.DataObject, dispatcher: CudaGraphDispatcher
) -> None:
    """A dispatcher answers equal questions equally (numpy ints alike) and its value (what
    equality and pickling see) is unchanged by answering."""
    reqs = data.draw(st.integers(0, dispatcher.max_num_reqs))
    tokens = data.draw(st.integers(reqs, 40))
    uniform = data.draw(st.one_of(st.none(), st.integers(1, 3)))
    if uniform is not None and uniform * reqs > tokens:
        uniform = None
    query_len = data.draw(st.one_of(st.none(), st.integers(1, 4)))
    loras = data.draw(st.integers(0, 5))
    answer = checked(
        dispatcher.dispatch, reqs, tokens, uniform, num_active_loras=loras, max_query_len=query_len
    )
    numpy_dispatch: Any = dispatcher.dispatch  # numpy ints where the signature says int
    again = numpy_dispatch(
        np.int64(reqs),
        np.int32(tokens),
        None if uniform is None else np.int16(uniform),
        num_active_loras=np.uint8(loras),
        max_query_len=None if query_len is None else np.int64(query_len),
    )
    assert again == answer
    assert type(again.num_tokens) is int
    assert_round_trips(dispatcher)


# ---- (a) the rank step over random runs ------------------------------------------------------


class DictIO:
    """A StepIO over a dict of host arrays; reduced tables are set by `run_phase`."""

    def __init__(self) -> None:
        self.bound: dict[BufferRef, Array] = {}
        self.tables: dict[BufferRef, Array] = {}

    def bind(self, ref: BufferRef, value: Array, /) -> None:
        self.bound[ref] = value

    def spec(self, ref: BufferRef, /) -> TensorSpec:
        array = self.bound[ref]
        dtype = DType.INT64 if array.dtype == np.int64 else DType.INT32
        return TensorSpec(tuple(int(n) for n in array.shape), dtype)

    def upload(self, values: npt.NDArray[np.int32], /) -> Array:
        return np.array(values, copy=True)

    def host_table(self, ref: BufferRef, /) -> npt.NDArray[np.int32]:
        return self.tables[ref]


def run_phase(
    phase: Generator[tuple[Effect, ...], None, Any], io: DictIO
) -> tuple[list[tuple[Effect, ...]], Any]:
    """Drive a phase; a 2-rank group's table is both ranks' (equal) columns, summed: every
    rank of the test's group runs the same batch."""
    yielded: list[tuple[Effect, ...]] = []
    try:
        effects = next(phase)
        while True:
            yielded.append(effects)
            for effect in effects:
                if isinstance(effect, AllReduce):
                    column = effect.contribution
                    io.tables[effect.result] = column + column[:, ::-1]  # writable, the caller's
            effects = phase.send(None)
    except StopIteration as done:
        return yielded, done.value


def checked_phase(
    make: Callable[[DictIO], Generator[tuple[Effect, ...], None, Any]], inputs: tuple[Any, ...]
) -> Any:
    """Run a phase twice on fresh seams: equal effects and answers, inputs unchanged, frozen
    outputs surviving pickle; the reduced tables handed to it, changed after, change
    nothing."""
    seen = plain(inputs)
    first_io, second_io = DictIO(), DictIO()
    effects, answer = run_phase(make(first_io), first_io)
    again = run_phase(make(second_io), second_io)
    assert (effects, answer) == again
    assert plain(inputs) == seen
    assert_frozen((effects, answer))
    assert_round_trips(answer)
    kept = plain(answer)
    for table in first_io.tables.values():
        np.add(table, 3, out=table)
    assert plain(answer) == kept
    return answer


DISPATCHER = CudaGraphDispatcher(
    capture_sizes=(1, 2, 4, 8, 16),
    capture_mode=CaptureMode.FULL_AND_PIECEWISE,
    max_num_reqs=5,
    num_speculative_tokens=1,
)


@FAST
@given(data=st.data())
def test_rank_phases_are_pure_deterministic_and_frozen_over_random_runs(
    data: st.DataObject,
) -> None:
    """begin, agree and finish on a random stage of a random 1- or 2-rank DP group: each
    phase, run twice, issues equal effects and answers, changes none of its inputs and
    hands out only frozen values."""
    pp_size = data.draw(st.integers(1, 2))
    spec = data.draw(st.integers(0, 1))
    relay = RelayConfig.for_stage(
        pp_size=pp_size,
        stage=data.draw(st.integers(0, pp_size - 1)),
        max_num_reqs=5,
        num_speculative_steps=spec,
        wire=data.draw(st.sampled_from([Wire.SEED, Wire.PACKED])),
    )
    dp_size = data.draw(st.integers(1, 2))
    config = RankConfig(
        relay=relay,
        group=AgreementGroup(dp_size=dp_size, dp_rank=data.draw(st.integers(0, dp_size - 1))),
        dispatcher=attrs.evolve(DISPATCHER, num_speculative_tokens=spec),  # sized as the relay
        drafter_dispatcher=data.draw(st.sampled_from([None, DISPATCHER])),
    )
    state: RankState = init_rank(config)
    for _ in range(data.draw(st.integers(1, 4))):
        batch = batch_from(data.draw(caller_batches(5)))
        scheduled = int(np.sum(batch.num_scheduled_tokens))
        shape = ShapeFacts(num_tokens=max(scheduled, batch.num_reqs) + data.draw(st.integers(0, 2)))
        freed = tuple(data.draw(st.lists(st.integers(0, 4), max_size=3)))

        def beginning(io: DictIO, s: RankState = state) -> Any:
            return begin(config, s)

        begun: Begun = checked_phase(beginning, (config, state))

        def agreeing(
            io: DictIO,
            b: Begun = begun,
            f: BatchFacts = batch,
            s: ShapeFacts = shape,
            slots: tuple[int, ...] = freed,
        ) -> Any:
            return agree(config, b, f, s, io, freed=slots)

        agreed: Agreed = checked_phase(agreeing, (config, begun, batch, shape, freed))
        rows = batch.num_reqs
        sampled = None
        if relay.is_last_stage:
            sampled = Sampled(
                tokens=np.zeros((rows, 1), np.int64),
                num_sampled=np.ones(rows, np.int32),
                num_rejected=np.zeros(rows, np.int32),
                draft_table=np.zeros((5, spec), np.int64) if spec else None,
            )

        def finishing(io: DictIO, a: Agreed = agreed, s: Any = sampled) -> Any:
            if config.updates_drafts:
                io.bind(relay.inputs.draft_table, np.zeros((5, spec), np.int64))
            return finish(config, a, io, s)

        state = checked_phase(finishing, (config, agreed, sampled))


# ---- (b) garbage and edge values -------------------------------------------------------------

CONFIG = RelayConfig(pp_size=2, stage=0, last_rank=1, max_num_reqs=4, num_speculative_steps=1)
SENDER = attrs.evolve(CONFIG, stage=1)
BATCH = BatchFacts(
    idx_mapping=[0, 2],
    num_computed_tokens=[4, 0],
    num_scheduled_tokens=[1, 2],
    prefill_len=[4, 2],
)
GROUP = AgreementGroup(dp_size=2, dp_rank=0)
FACTS = RankBatch(num_reqs=2, num_tokens=4, uniform_token_count=2)
STARTED = start_agreement(AgreementLanes(), GROUP, DISPATCHER, FACTS, step=3)
TABLE = np.array(STARTED.result.contribution) + np.array(STARTED.result.contribution)[:, ::-1]


class IntArraySubclass(np.ndarray):
    """An ndarray subclass: the steps take exact numpy arrays or convert."""


def _writable(values: list[int]) -> Array:
    return np.array(values, dtype=np.int32)


def _locked(values: list[int]) -> Array:
    array = np.array(values, dtype=np.int32)
    array.flags.writeable = False  # read-only, but a view of writable memory
    return array


EDGE = st.one_of(
    st.sampled_from(
        [
            None,
            True,
            np.bool_(False),
            -1,
            2**31,
            2**63,
            -(2**70),
            float("nan"),
            3.0,
            np.float32(1.5),
            np.int8(-1),
            np.uint64(2**64 - 1),
            "1",
            b"1",
            (),
            [],
            [[0, 1]],
            object(),
            np.array([], np.int32),
            np.zeros((0, 0), np.int32),
            np.zeros((2, 2), np.int32),
            np.array([np.nan, 1.0]),
            np.array([0, 1], ">i4"),
            np.array([0, 1], np.int32).view(IntArraySubclass),
            _locked([0, 1]),
            _writable([0, 1]),
            np.array([0, 1], dtype=object),
            TensorSpec((2, 1), DType.INT32),
            TensorSpec((2, 9), DType.INT64),
            init_relay(SENDER),
            CONFIG,
            BATCH,
            FACTS,
            GROUP,
            Lane.DRAFTER,
            CUDAGraphMode.FULL,
            TABLE.T.copy(),
            TABLE.astype(np.int64),
            TABLE[None],
        ]
    ),
    st.integers(-(2**40), 2**40),
)

CALLS: dict[str, tuple[Callable[..., Any], dict[str, Any]]] = {
    "BatchFacts": (
        BatchFacts,
        {
            "idx_mapping": _writable([0, 2]),
            "num_computed_tokens": _locked([4, 0]),
            "num_scheduled_tokens": [1, 2],
            "prefill_len": np.array([4, 2], np.int64),
        },
    ),
    "need_sampled_mask": (need_sampled_mask, {"batch": BATCH}),
    "free_request_slots": (
        free_request_slots,
        {"config": CONFIG, "state": init_relay(CONFIG), "slots": _writable([1, 3])},
    ),
    "free_request_slot": (
        free_request_slot,
        {"config": CONFIG, "state": init_relay(CONFIG), "slot": 1},
    ),
    "consume_previous_step": (
        consume_previous_step,
        {"config": CONFIG, "state": init_relay(CONFIG), "update_drafts": True},
    ),
    "receive": (receive, {"config": CONFIG, "state": init_relay(CONFIG), "batch": BATCH}),
    "broadcast_sampled": (
        broadcast_sampled,
        {
            "config": SENDER,
            "state": init_relay(SENDER),
            "batch": BATCH,
            "sampled": TensorSpec((2, 1), DType.INT64),
        },
    ),
    "broadcast_drafts": (
        broadcast_drafts,
        {
            "config": SENDER,
            "state": init_relay(SENDER),
            "batch": BATCH,
            "drafts": TensorSpec((4, 1), DType.INT64),
        },
    ),
    "end_step": (end_step, {"config": CONFIG, "state": init_relay(CONFIG)}),
    "start_agreement": (
        start_agreement,
        {
            "lanes": AgreementLanes(),
            "group": GROUP,
            "dispatcher": DISPATCHER,
            "batch": FACTS,
            "step": 3,
            "lane": Lane.TARGET,
            "asynchronous": False,
        },
    ),
    "finish_agreement": (
        finish_agreement,
        {"lanes": STARTED.state, "pending": STARTED.result, "reduced_table": TABLE.copy()},
    ),
    "wait_for_agreement": (wait_for_agreement, {"pending": STARTED.result}),
    "CudaGraphDispatcher.dispatch": (
        DISPATCHER.dispatch,
        {"num_reqs": 2, "num_tokens": 4, "uniform_token_count": 2, "num_active_loras": 0},
    ),
    "RankBatch": (RankBatch, {"num_reqs": 2, "num_tokens": 4, "uniform_token_count": 2}),
    "DPSyncState": (
        DPSyncState,
        {
            "num_tokens_across_dp": _writable([4, 4]),
            "uniform_token_count": None,
            "eager": False,
            "num_reqs": 2,
        },
    ),
    "BatchExecutionDescriptor": (
        BatchExecutionDescriptor,
        {"cg_mode": CUDAGraphMode.FULL, "num_tokens": 4, "num_reqs": 2},
    ),
    "ShapeFacts": (ShapeFacts, {"num_tokens": 4}),
}


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), name=st.sampled_from(sorted(CALLS)))
def test_garbage_in_any_argument_is_a_typed_error_naming_the_call_or_a_frozen_answer(
    data: st.DataObject, name: str
) -> None:
    """One argument of a public call replaced by an edge value (numpy ints, bools, huge and
    negative ints, NaN, subclasses, empty and 2-D arrays, read-only and writable arrays,
    values of other calls): a PureppError whose message starts with the call it names and
    carries a fix, or an answer holding only frozen arrays; the inputs are unchanged."""
    function, good = CALLS[name]
    parameter = data.draw(st.sampled_from(sorted(good)), label="parameter")
    arguments = {**good, parameter: data.draw(EDGE, label="value")}
    seen = plain(arguments)
    outcome: object
    try:
        outcome = function(**arguments)
    except PureppError as error:
        outcome = error
    if isinstance(outcome, PureppError):
        assert str(outcome).startswith(f"{outcome.call}: ")
        assert outcome.fix
    else:
        assert_frozen(outcome)
    assert plain(arguments) == seen


def test_python_dash_o_keeps_every_validation() -> None:
    """`assert` validates no input: under `python -O` garbage is refused exactly as without
    it (the one assert in these modules, in the consume, guards an internal invariant)."""
    probe = (
        "import numpy as np\n"
        "from purepp.relay import RelayConfig, init_relay, free_request_slots\n"
        "from purepp.batch import BatchFacts\n"
        "from purepp.dp import RankBatch\n"
        "from purepp.errors import PureppError\n"
        "c = RelayConfig(pp_size=2, stage=0, last_rank=1, max_num_reqs=4,"
        " num_speculative_steps=0)\n"
        "for f in (lambda: free_request_slots(c, init_relay(c), [9]),"
        " lambda: BatchFacts(idx_mapping=[1.5], num_computed_tokens=[0],"
        " num_scheduled_tokens=[0], prefill_len=[0]),"
        " lambda: RankBatch(num_reqs=True, num_tokens=1)):\n"
        "    try:\n"
        "        f()\n"
        "    except PureppError as e:\n"
        "        print(e)\n"
    )
    plain = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    optimised = subprocess.run(
        [sys.executable, "-O", "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert plain.count("\n") == 3
    assert optimised == plain


# ---- bugs: hand-built ring entries (purepp.relay.PendingReceive) ------------------------------

_STAGE0 = RelayConfig(pp_size=2, stage=0, last_rank=1, max_num_reqs=4, num_speculative_steps=0)


def _entry(slots: Any, generations: Any, need: Any = None, all_sampled: bool = True) -> Any:
    return PendingReceive(
        step=0,
        event=EventRef("event"),
        sampled_tokens=BufferRef("sampled"),
        num_sampled=BufferRef("num_sampled"),
        num_rejected=BufferRef("num_rejected"),
        draft_tokens=None,
        idx_mapping=BufferRef("idx_mapping"),
        buffers=(),
        idx_mapping_np=slots,
        need_sampled=np.ones(2, dtype=np.bool_) if need is None else need,
        all_sampled=all_sampled,
        generations_at_receive=generations,
        rows=2,
    )


def _consumed_slots(entry: Callable[[], Any], free: tuple[int, ...]) -> list[int] | str:
    """The slots a consume hands out for a hand-built ring entry after `free`, or the
    PureppError's call if a typed error refuses the entry (any other exception escapes)."""
    try:
        state = attrs.evolve(init_relay(_STAGE0), ring=(entry(), None))
        state = free_request_slots(_STAGE0, state, free).state
        consumed = consume_previous_step(_STAGE0, state).result
    except PureppError as error:
        return error.call
    return [] if consumed is None else consumed.idx_mapping_np.tolist()


def test_a_hand_built_ring_entry_with_int64_slots_never_has_its_bytes_reinterpreted() -> None:
    """BUG: a RelayState (and its ring entries) built by hand is the documented restore path
    ("a state built by hand ... is checked here"), and `np.array([1, 2])` is int64. After a
    free of slot 1, the consume must hand out [-1, 2] (row 0 dropped), or refuse the entry
    when it is built. It hands out [-1, -1, 2, 0]: `np.where(..., np.int32(-1), slots)`
    keeps int64, and `np.frombuffer(kept.tobytes(), int32)` reads each int64 as two int32,
    so a 2-row batch becomes 4 rows naming slots 2 and 0 wrongly. Cause: PendingReceive
    does not convert or check `idx_mapping_np` (no `int32_array` converter)."""
    entry = _consumed_slots(lambda: _entry(np.array([1, 2]), np.zeros(4, np.int32)), (1,))
    assert entry == [-1, 2] or isinstance(entry, str)  # the slots, or a typed refusal


def test_a_hand_built_ring_entry_with_an_int_mask_does_not_drop_every_row() -> None:
    """BUG: `need_sampled` is a bool mask. Given as ints [1, 0] (row 0 samples), the consume
    computes `~need_sampled` bitwise on ints ([-2, -1], all true), drops both rows and
    returns None: row 0's token is silently lost. Correct: refuse a non-bool mask when the
    entry is built (a PureppError), or read it as the mask it spells ([2, -1])."""
    need = np.array([1, 0])
    entry = _consumed_slots(
        lambda: _entry(np.array([2, 3], np.int32), np.zeros(4, np.int32), need, False), ()
    )
    assert entry == [2, -1] or isinstance(entry, str)  # row 0 kept, or a typed refusal


@pytest.mark.parametrize(
    "entry",
    [
        pytest.param(
            lambda: _entry(np.array([2, 3], np.int32), np.zeros(1, np.int32)), id="short-table"
        ),
        pytest.param(lambda: _entry([2, 3], np.zeros(4, np.int32)), id="list-slots"),
        pytest.param(
            lambda: _entry(
                np.array([2, 3], np.int32), np.zeros(4, np.int32), np.array([1, 0, 1], bool), False
            ),
            id="mask-of-3-rows",
        ),
    ],
)
def test_a_malformed_hand_built_ring_entry_is_a_typed_error(entry: Callable[[], Any]) -> None:
    """BUG (contract 9): a ring entry whose generation snapshot is shorter than the slots it
    maps, whose slots are a list, or whose mask has another length than its rows, must be
    refused with a PureppError (when built, or at the consume). Today the consume raises
    a bare IndexError or ValueError, and RelayState's own check an AttributeError
    ('list' object has no attribute 'size'). Fix: validate PendingReceive's arrays
    (1-D int32 slots, a 1-D bool mask of the same length, an int32 snapshot of the
    state's table length) in its `__attrs_post_init__` / `_check_state_fields`."""
    assert isinstance(_consumed_slots(entry, (0,)), str)


# ---- bug: a hand-built PendingAgreement ------------------------------------------------------


def test_a_pending_agreement_built_by_hand_holds_only_frozen_arrays() -> None:
    """BUG (contract 3): every array a state holds is read-only all the way down; the other
    array-holding values (PendingReceive, ConsumedOutputs, DPSyncState, the effects) freeze
    or convert a caller's array when built by hand or by attrs.evolve. PendingAgreement
    does not: `attrs.evolve(pending, contribution=writable)` keeps the caller's writable
    array, which it then reads at finish (and which the caller can change under it). Fix:
    `freeze_fields(self, "contribution")` in a PendingAgreement `__attrs_post_init__`."""
    mine = np.array(STARTED.result.contribution)
    pending = attrs.evolve(STARTED.result, contribution=mine)
    assert pending.contribution is not None
    assert is_frozen(pending.contribution)


def test_a_pending_agreement_with_a_wrong_field_is_a_typed_error() -> None:
    """BUG (contract 9): PendingAgreement is public and checks nothing when built: one whose
    group is not an AgreementGroup reaches `finish_agreement`, which raises a bare
    AttributeError ('str' object has no attribute 'layout'). Correct: a PureppError, when
    the value is built (as Agreeing/Begun/Agreed check their fields) or at the finish."""
    garbage: Any = "garbage"
    with pytest.raises(PureppError, match=r"^PendingAgreement: group="):
        attrs.evolve(STARTED.result, group=garbage)


# ---- minor bugs: naming and edge values -------------------------------------------------------


@pytest.mark.parametrize(
    "slots",
    [
        pytest.param(np.array([[1, 2]]), id="2-D array"),
        pytest.param([[1], [2]], id="nested list"),
        pytest.param(np.array(1), id="0-D array"),
    ],
)
def test_free_request_slots_refuses_slots_that_are_not_one_dimensional(slots: Any) -> None:
    """BUG (minor, contract 9): slots are a sequence of ints or a 1-D integer array
    (`SlotsLike`), as BatchFacts refuses 2-D idx_mapping. free_request_slots flattens
    anything (`given.reshape(-1)`), so a 2-D array, a nested list or a 0-D array free
    slots silently. Correct: an InvalidInputError naming free_request_slots and the
    shape (fix: `if given.ndim != 1: raise ...`)."""
    with pytest.raises(PureppError, match=r"^free_request_slots: "):
        free_request_slots(CONFIG, init_relay(CONFIG), slots)


@pytest.mark.parametrize("wire", [Wire.SEED, Wire.PACKED])
def test_wire_rows_checks_its_argument_on_every_wire(wire: Wire) -> None:
    """BUG (minor, contract 9): `RelayConfig.wire_rows` checks `num_reqs` on the fixed wire
    but returns anything unchecked on the others (`wire_rows("x") == "x"`, `-5` -> -5).
    Correct: the same InvalidInputError on every wire."""
    config = attrs.evolve(CONFIG, wire=wire)
    garbage: Any = "x"
    with pytest.raises(PureppError, match=r"^RelayConfig\.wire_rows: "):
        config.wire_rows(garbage)


def test_for_stage_names_first_rank_when_the_last_rank_overflows() -> None:
    """BUG (minor, contract 9): `RelayConfig.for_stage(first_rank=2**31 - 1, pp_size=2)`
    is refused as "RelayConfig: last_rank=2147483648 is outside ...": a call and a value
    the caller never wrote. Correct: name RelayConfig.for_stage and first_rank (check
    `first + size - 1 <= INT32_MAX` in for_stage)."""
    with pytest.raises(PureppError) as caught:
        RelayConfig.for_stage(pp_size=2, stage=0, max_num_reqs=4, first_rank=2**31 - 1)
    assert caught.value.call == "RelayConfig.for_stage"
    assert "first_rank" in str(caught.value)


def _phase_error(phase: Generator[tuple[Effect, ...], None, Any]) -> PureppError:
    with pytest.raises(PureppError) as caught:
        run_phase(phase, DictIO())
    return caught.value


def test_begin_names_itself_for_a_state_of_another_stage() -> None:
    """BUG (minor, contract 9): `begin` on the last stage refuses a state of another stage
    as "begin: ...", but on a non-last stage the same mistake is named
    "consume_previous_step: ...", a call the caller never made (the rank step's
    `_freed` re-raises under the phase's name for the same reason). Correct: "begin"."""
    config = RankConfig(relay=CONFIG, dispatcher=DISPATCHER)
    other = init_rank(RankConfig(relay=SENDER, dispatcher=DISPATCHER))
    assert _phase_error(begin(config, other)).call == "begin"


def test_agree_past_int32_steps_names_agree_and_not_start_agreement() -> None:
    """BUG (minor, contract 9): the relay runs past 2**31 steps by design (its header wraps,
    RelayState takes any step >= 0), but the DP lanes take steps in 0..2**31-1, so at relay
    step 2**31 `agree` fails with "start_agreement: step=2147483648 is outside ... Fix:
    pass the decode step as an int": a call and an argument the caller never made or
    passed. Correct at least: name `agree` and the relay state's step (better: let the
    agreement's step run as far as the relay's, as names and lanes need no int32)."""
    config = RankConfig(relay=SENDER, dispatcher=DISPATCHER)
    state = init_rank(config)
    late = attrs.evolve(state, relay=attrs.evolve(state.relay, step=2**31))
    begun = run_phase(begin(config, late), DictIO())[1]
    error = _phase_error(agree(config, begun, BATCH, ShapeFacts(num_tokens=4), DictIO()))
    assert error.call == "agree"
