"""Review of replay and `placeholder_inputs` over scripted logs of many shapes.

Properties over small scripted worlds (every wire, header on and off, microbatched
agreements): the placeholders let every rank's log replay to itself, on simulated numpy
ranks and on real gloo ranks; and the layouts they infer agree with the caller's own
where the records fix them. Hand-built programs probe the typed errors and the notes.
"""

from __future__ import annotations

import datetime
import functools
import itertools
from collections.abc import Iterator
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from purepp.effects.interpreter import Interpreter
from purepp.effects.io import numpy_spec
from purepp.effects.log import (
    EffectLog,
    Layout,
    LogHeader,
    Recorder,
    assert_logs_equal,
    dump_log,
    load_log,
    replay,
)
from purepp.effects.numpy_interpreter import NumpyInterpreter
from purepp.effects.plan import Role, abstract, roles
from purepp.effects.replay import InputShapeError, placeholder_inputs
from purepp.effects.simulator import RankContext as SimContext
from purepp.effects.simulator import simulate
from purepp.effects.torch_interpreter import TorchInterpreter, build_communicators
from purepp.effects.vocabulary import (
    Allocate,
    AllReduce,
    Broadcast,
    BufferRef,
    Communicator,
    CopyHostToDevice,
    DType,
    Effect,
    GatherRows,
    Op,
    Pack,
    Release,
    Section,
    Stream,
    TensorSpec,
    Unpack,
)
from purepp.errors import InterpreterError
from purepp.relay import Wire
from purepp.testing import ScheduleConfig, make_schedule, record_scripted_logs, scripted_program
from tests._dist import RankContext, run_ranks

HEADER = LogHeader(rank=0, world=Layout(pp=1, dp=1))
TABLE = BufferRef("input.draft_table")
MAIN = Stream.MAIN


@st.composite
def configs(draw: st.DrawFn) -> ScheduleConfig:
    dp = draw(st.integers(1, 2))
    return ScheduleConfig(
        pp=draw(st.integers(1, 3)),
        dp=dp,
        spec=draw(st.integers(0, 3)),
        steps=draw(st.integers(1, 5)),
        seed=draw(st.integers(0, 2**16)),
        wire=draw(st.sampled_from(list(Wire))),
        validate_header=draw(st.booleans()),
        microbatch=dp > 1 and draw(st.booleans()),
    )


def batches(log: EffectLog) -> Iterator[tuple[int, tuple[Effect, ...]]]:
    for step, group in itertools.groupby(log.records, key=lambda record: record.effect.step):
        yield step, tuple(record.effect for record in group)


# -- every rank of a scripted world replays to itself -----------------------------------


@settings(
    max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(configs())
def test_placeholders_replay_every_ranks_log_on_simulated_numpy_ranks(
    config: ScheduleConfig,
) -> None:
    logs = record_scripted_logs(make_schedule(config))
    binders = [placeholder_inputs(log) for log in logs]

    def program(ctx: SimContext) -> Iterator[tuple[Effect, ...]]:
        for step, effects in batches(logs[ctx.rank]):
            binders[ctx.rank](step, ctx.interpreter)
            yield effects

    run = simulate(config.world, program)
    for log, effects in zip(logs, run.effects, strict=True):
        assert_logs_equal(log, EffectLog.from_effects(log.header, effects))


@settings(
    max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(configs())
def test_inferred_layouts_agree_with_the_callers_own(config: ScheduleConfig) -> None:
    compare_layouts(config)


@pytest.mark.parametrize("wire", list(Wire))
def test_the_layout_comparison_sees_every_input(wire: Wire) -> None:
    config = ScheduleConfig(pp=2, dp=2, spec=2, steps=6, seed=5, wire=wire, microbatch=True)
    assert compare_layouts(config) == {
        f"relay.input.{name}"
        for name in (
            "idx_mapping",
            "sampled_token_ids",
            "num_sampled",
            "num_rejected",
            "draft_table",
        )
    }


def compare_layouts(config: ScheduleConfig) -> set[str]:
    """Runs the schedule's real program, comparing the caller's bound tensors with the
    placeholders each batch's reads get: where the records fix a dimension the
    placeholder's equals it, and where they leave room it is within the room. The
    names compared."""
    schedule = make_schedule(config)
    binders = [placeholder_inputs(log) for log in record_scripted_logs(schedule)]
    inner = scripted_program(schedule)
    width = config.spec + 1
    compared: set[str] = set()

    def program(ctx: SimContext) -> Iterator[tuple[Effect, ...]]:
        interpreter = ctx.interpreter
        for effects in inner(ctx):
            if effects:
                names = abstract(effects)[1]
                read = {
                    name
                    for name, role in zip(names, roles(effects, names), strict=True)
                    if role == Role.READ
                }
                specs = binders[ctx.rank].specs(effects[0].step)
                for name, inferred in specs.items():
                    if name not in read or name not in interpreter.bound_refs():
                        continue
                    real = numpy_spec("review", name, interpreter.tensor(name))
                    check_layout(name.name, inferred, real, config, width)
                    compared.add(name.name)
            yield effects

    simulate(config.world, program)
    return compared


def check_layout(
    name: str, inferred: TensorSpec, real: TensorSpec, config: ScheduleConfig, width: int
) -> None:
    shown = f"{name}: inferred {inferred}, the caller's {real}"
    assert inferred.dtype is real.dtype, shown
    if name.endswith("idx_mapping") and inferred.shape == (0,):
        return  # only aliased this step: an empty vector
    assert len(inferred.shape) == len(real.shape), shown
    rows, real_rows = inferred.shape[0], real.shape[0]
    if name.endswith("draft_table"):
        assert inferred.shape[1:] == real.shape[1:] == (config.spec,), shown
        assert 1 <= rows <= real_rows, shown  # as few rows as the zero indices reach
        return
    if config.wire is Wire.FIXED:
        assert rows >= real_rows, shown  # as many as the bucket's region
    else:
        assert rows == real_rows, shown  # a broadcast or a packed region's exact rows
    if name.endswith("sampled_token_ids"):
        assert real.shape[1] <= inferred.shape[1] == width, shown  # padded to spec + 1


def replay_configs(world: Layout) -> list[ScheduleConfig]:
    made = []
    for seed, (spec, wire, header) in enumerate(
        itertools.product((0, 2), list(Wire), (False, True))
    ):
        micro = world.dp > 1 and seed % 2 == 0
        made.append(
            ScheduleConfig(
                pp=world.pp,
                dp=world.dp,
                spec=spec,
                steps=4,
                seed=seed,
                wire=wire,
                validate_header=header,
                microbatch=micro,
            )
        )
    return made


def replay_on_gloo(world: Layout, ctx: RankContext) -> list[str]:
    """Every config's log of this rank, replayed into a Recorder around a checked
    TorchInterpreter; the configs whose recording differs."""
    groups = build_communicators(
        pp_groups=world.pp_groups,
        dp_groups=world.dp_groups,
        relay_backend=ctx.backend,
        timeout=ctx.timeout,
    )
    different = []
    for config in replay_configs(world):
        log = record_scripted_logs(make_schedule(config))[ctx.rank]
        interpreter = TorchInterpreter(
            device=ctx.device, groups=groups, rank=ctx.rank, checked=True
        )
        recorder = Recorder(log.header, interpreter)
        replay(log, recorder, before_step=placeholder_inputs(log, into=interpreter))
        try:
            assert_logs_equal(log, recorder.log)
        except AssertionError as difference:
            different.append(f"{config}: {difference}")
    return different


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [Layout(pp=1, dp=1), Layout(pp=3, dp=1), Layout(pp=2, dp=2)])
def test_placeholders_replay_every_wire_on_real_gloo_ranks(world: Layout) -> None:
    found = run_ranks(
        functools.partial(replay_on_gloo, world),
        world.world_size,
        timeout=datetime.timedelta(seconds=30),
        deadline_s=120.0,
    )
    assert found == [[] for _ in range(world.world_size)]


# -- one rank, byte for byte ----------------------------------------------------------------


@pytest.mark.parametrize("wire", list(Wire))
@pytest.mark.parametrize("spec", [0, 2])
def test_a_lone_ranks_replay_dumps_to_the_same_bytes(wire: Wire, spec: int, tmp_path: Path) -> None:
    config = ScheduleConfig(pp=1, dp=1, spec=spec, steps=5, seed=3, wire=wire, validate_header=True)
    dump_log(record_scripted_logs(make_schedule(config))[0], tmp_path / "a.jsonl")
    log = load_log(tmp_path / "a.jsonl")
    inner = NumpyInterpreter()
    recorder = Recorder(log.header, inner)
    replay(log, recorder, before_step=placeholder_inputs(log, into=inner))
    dump_log(recorder.log, tmp_path / "b.jsonl")
    assert (tmp_path / "b.jsonl").read_bytes() == (tmp_path / "a.jsonl").read_bytes()


@pytest.mark.parametrize("wire", list(Wire))
def test_a_log_with_a_cut_last_line_replays_up_to_the_cut(wire: Wire, tmp_path: Path) -> None:
    config = ScheduleConfig(pp=1, dp=1, spec=2, steps=4, seed=1, wire=wire)
    full = record_scripted_logs(make_schedule(config))[0]
    path = tmp_path / "rank-0000.jsonl"
    dump_log(full, path)
    text = path.read_bytes()
    for keep in range(1, len(full.records), 3):  # cut record #keep in half
        lines = text.splitlines(keepends=True)
        cut = b"".join(lines[: keep + 1]) + lines[keep + 1][:20]
        path.write_bytes(cut)
        log = load_log(path, allow_cut_end=True)
        assert len(log.records) == keep
        inner = NumpyInterpreter()
        recorder = Recorder(log.header, inner)
        replay(log, recorder, before_step=placeholder_inputs(log, into=inner))
        assert_logs_equal(EffectLog.from_effects(full.header, full.effects[:keep]), recorder.log)


# -- typed errors ----------------------------------------------------------------------------


def agreed_index_log() -> EffectLog:
    """Step 0 reads nothing; step 1 gathers the table by a reduced host table's values."""
    index = BufferRef("s1.index")
    effects: list[Effect] = [
        Allocate(
            step=0,
            op=Op.CONSUME,
            buffer=BufferRef("s0.x"),
            shape=(1,),
            dtype=DType.INT32,
            stream=MAIN,
        ),
        AllReduce(
            step=1,
            op=Op.AGREE,
            contribution=[2, 0],
            result=index,
            comm=Communicator.DP_CPU,
            work=None,
        ),
        GatherRows(
            step=1, op=Op.CONSUME, source=TABLE, index=index, out=BufferRef("s1.rows"), stream=MAIN
        ),
    ]
    return EffectLog.from_effects(LogHeader(rank=0, world=Layout(pp=1, dp=2)), effects)


def test_a_table_indexed_by_a_reduced_table_is_refused_at_its_step() -> None:
    binder = placeholder_inputs(agreed_index_log())
    assert binder.specs(0) == {}
    with pytest.raises(InputShapeError) as caught:
        binder.specs(1)
    assert caught.value.buffer == TABLE
    assert "at step 1: record #2 (GatherRows) indexes its rows with 's1.index'" in str(caught.value)
    recorder = Recorder(HEADER)  # step 0 runs; step 1 is refused before it is performed
    with pytest.raises(InputShapeError) as raised:
        replay(agreed_index_log(), recorder, before_step=lambda s, i: binder(s, NumpyInterpreter()))
    assert raised.value.__notes__ == [
        "in replay: before_step, before step 1 of rank 0's log, records #1 to #2 "
        "(file lines 3 to 4)"
    ]
    assert [record.effect.step for record in recorder.log.records] == [0]


def unpacked_index_log(index_values: list[int]) -> EffectLog:
    """The table gathered by a section unpacked from a wire the other stage broadcast
    over the locally packed one (its values arrive at run time)."""
    copied, wire, view = BufferRef("s0.copied"), BufferRef("s0.wire"), BufferRef("s0.view")
    section = Section(buffer=copied, offset=0, shape=(len(index_values),), dtype=DType.INT32)
    effects: list[Effect] = [
        CopyHostToDevice(step=0, op=Op.CONSUME, source=index_values, buffer=copied, stream=MAIN),
        Pack(step=0, op=Op.BROADCAST, sections=(section,), out=wire, nbytes=16, stream=MAIN),
        Broadcast(
            step=0,
            op=Op.RECEIVE,
            buffer=wire,
            shape=(2,),
            dtype=DType.INT64,
            src=1,
            comm=Communicator.PP_RELAY,
            stream=MAIN,
        ),
        Unpack(step=0, op=Op.RECEIVE, source=wire, sections=(renamed(section, view),), stream=MAIN),
        GatherRows(
            step=0, op=Op.CONSUME, source=TABLE, index=view, out=BufferRef("s0.rows"), stream=MAIN
        ),
    ]
    return EffectLog.from_effects(LogHeader(rank=0, world=Layout(pp=2, dp=1)), effects)


def renamed(section: Section, buffer: BufferRef) -> Section:
    return Section(buffer=buffer, offset=section.offset, shape=section.shape, dtype=section.dtype)


def test_a_table_indexed_by_an_unpacked_view_is_a_typed_error_naming_it() -> None:
    with pytest.raises(InputShapeError) as caught:
        placeholder_inputs(unpacked_index_log([3])).specs(0)
    assert caught.value.buffer == TABLE
    assert "record #4 (GatherRows) indexes its rows with 's0.view'" in str(caught.value)


def test_a_table_indexed_by_copied_values_and_packed_into_a_region_fits_both() -> None:
    index = BufferRef("s0.index")
    section = Section(buffer=TABLE, offset=0, shape=(8, 2), dtype=DType.INT64)
    effects: list[Effect] = [
        CopyHostToDevice(step=0, op=Op.CONSUME, source=[4, 1], buffer=index, stream=MAIN),
        GatherRows(
            step=0, op=Op.CONSUME, source=TABLE, index=index, out=BufferRef("s0.rows"), stream=MAIN
        ),
        Pack(
            step=0,
            op=Op.BROADCAST,
            sections=(section,),
            out=BufferRef("s0.w"),
            nbytes=128,
            stream=MAIN,
        ),
    ]
    log = EffectLog.from_effects(HEADER, effects)
    # The pack's region allows 8 rows and the index reaches row 4: the region's width.
    assert placeholder_inputs(log).specs(0) == {TABLE: TensorSpec((8, 2), DType.INT64)}
    small = EffectLog.from_effects(
        HEADER,
        [
            *effects[:2],
            Pack(
                step=0,
                op=Op.BROADCAST,
                sections=(Section(buffer=TABLE, offset=0, shape=(4, 2), dtype=DType.INT64),),
                out=BufferRef("s0.w"),
                nbytes=128,
                stream=MAIN,
            ),
        ],
    )
    with pytest.raises(InputShapeError, match="a dimension of size 4 is indexed up to row 4"):
        placeholder_inputs(small).specs(0)
    replay(log, NumpyInterpreter(), before_step=placeholder_inputs(log))


# -- notes on errors ---------------------------------------------------------------------------


def test_an_interpreter_error_names_the_file_lines_that_hold_its_records(tmp_path: Path) -> None:
    config = ScheduleConfig(pp=1, dp=1, spec=2, steps=5, seed=1)
    dump_log(record_scripted_logs(make_schedule(config))[0], tmp_path / "r.jsonl")
    log = load_log(tmp_path / "r.jsonl")
    binder = placeholder_inputs(log)
    steps = sorted({record.effect.step for record in log.records})
    bad = next(
        step
        for step in steps[1:]
        if any(name.name.endswith("sampled_token_ids") for name in binder.specs(step))
    )

    def before(step: int, interpreter: Interpreter) -> None:
        binder(step, interpreter)
        assert isinstance(interpreter, NumpyInterpreter)
        for name in binder.specs(step):
            if step == bad and name.name.endswith("sampled_token_ids"):
                interpreter.bind(name, np.zeros((1, 1, 1), np.int64))  # 3-D: no pad takes it

    with pytest.raises(InterpreterError) as caught:
        replay(log, NumpyInterpreter(), before_step=before)
    records = [record for record in log.records if record.effect.step == bad]
    first, last = records[0].seq, records[-1].seq
    assert caught.value.__notes__[-1] == (
        f"in replay: step {bad} of rank 0's log, records #{first} to #{last} "
        f"(file lines {first + 2} to {last + 2})"
    )
    lines = (tmp_path / "r.jsonl").read_text().splitlines()  # line n is lines[n - 1]
    assert lines[first + 1].startswith(f'{{"seq": {first}, ')
    assert lines[last + 1].startswith(f'{{"seq": {last}, ')
    assert f'"step": {bad},' in lines[first + 1]
    assert f'"step": {bad},' not in lines[first]


class Exploding:
    """An interpreter (the protocol's one method) that fails at one step, not typed."""

    def __init__(self, at: int) -> None:
        self.at = at

    def perform(self, effects: tuple[Effect, ...], /) -> None:
        if effects[0].step == self.at:
            raise ValueError("the device fell over")


def two_step_log() -> EffectLog:
    effects: list[Effect] = [
        Release(step=step, op=Op.END_STEP, buffer=BufferRef(f"s{step}.{n}"))
        for step in (0, 1)
        for n in range(2)
    ]
    return EffectLog.from_effects(HEADER, effects)


def test_an_untyped_interpreter_error_keeps_its_type_and_gains_the_note() -> None:
    with pytest.raises(ValueError, match="the device fell over") as caught:
        replay(two_step_log(), Exploding(at=1))
    assert getattr(caught.value, "__notes__", []) == [
        "in replay: step 1 of rank 0's log, records #2 to #3 (file lines 4 to 5)"
    ]


def reused_name_log() -> EffectLog:
    """Step 0 in two runs: the first reads the caller's `x` and releases it; the second
    (after step 1's run) binds a buffer of its own under the same name."""
    x, wire = BufferRef("x"), BufferRef("s0.wire")
    section = Section(buffer=x, offset=0, shape=(2,), dtype=DType.INT32)
    effects: list[Effect] = [
        Pack(step=0, op=Op.BROADCAST, sections=(section,), out=wire, nbytes=16, stream=MAIN),
        Release(step=0, op=Op.BROADCAST, buffer=wire),
        Release(step=0, op=Op.BROADCAST, buffer=x),
        Release(step=1, op=Op.END_STEP, buffer=BufferRef("s1.none")),
        Allocate(step=0, op=Op.AGREE, buffer=x, shape=(3,), dtype=DType.INT64, stream=MAIN),
        Release(step=0, op=Op.AGREE, buffer=x),
    ]
    return EffectLog.from_effects(HEADER, effects)


def test_the_reused_name_log_replays_with_inputs_bound_per_run() -> None:
    runs = 0

    def before(step: int, interpreter: Interpreter) -> None:
        nonlocal runs
        assert isinstance(interpreter, NumpyInterpreter)
        if runs == 0:
            interpreter.bind(BufferRef("x"), np.zeros(2, np.int32))
        if step == 1:
            interpreter.bind(BufferRef("s1.none"), np.zeros(0, np.int32))
        runs += 1

    log = reused_name_log()
    inner = NumpyInterpreter()
    recorder = Recorder(log.header, inner)
    replay(log, recorder, before_step=lambda s, i: before(s, inner))
    assert_logs_equal(log, recorder.log)


def test_placeholders_bind_only_what_each_run_reads() -> None:
    log = reused_name_log()
    inner = NumpyInterpreter()
    recorder = Recorder(log.header, inner)
    replay(log, recorder, before_step=placeholder_inputs(log, into=inner))
    assert_logs_equal(log, recorder.log)
