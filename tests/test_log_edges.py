"""The effect logs and the checker at their edges: round trips, findings, typed errors.

The first tests pin behaviour the other log tests leave open (a wait-for cycle of four
ranks through a device and a CPU communicator, the simulator and the checker agreeing
on random programs, the check's counts, a header's longest integer). The tests after
them pin what a review found wrong (each was a bug): raw exceptions from check_logs,
placeholder_inputs, the writers and replay; a false ring overrun in the simulator; a
deadlock report that named no unwaited work; a diff blind to JSON types; a header
written that could not be read back.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from purepp.effects.checker import EXIT_OK, EXIT_UNUSABLE, check_logs
from purepp.effects.log import (
    EffectLog,
    LogHeader,
    Recorder,
    diff_logs,
    dump_log,
    dump_logs,
    load_log,
    placeholder_inputs,
    replay,
)
from purepp.effects.matching import (
    CollectiveReportError,
    DeadlockReport,
    RingOverrunReport,
    match_collectives,
)
from purepp.effects.numpy_interpreter import NumpyInterpreter
from purepp.effects.simulator import RankContext, simulate
from purepp.effects.vocabulary import (
    Allocate,
    AllReduce,
    Backend,
    Broadcast,
    BufferRef,
    CheckHeader,
    Communicator,
    CopyHostToDevice,
    DType,
    Effect,
    EventRef,
    Op,
    RecordEvent,
    Release,
    ScatterRows,
    StackRows,
    Stream,
    Synchronize,
    WaitEvent,
    WaitStream,
    WaitWork,
    WorkRef,
)
from purepp.errors import InvalidInputError, PureppError
from purepp.layout import Layout
from purepp.testing import ScheduleConfig, make_schedule, record_scripted_logs

LONE = Layout(pp=1, dp=1)
PAIR = Layout(pp=2, dp=1)  # ranks 0 and 1 share pp_relay and pp_cpu
REPLICAS = Layout(pp=1, dp=2)  # ranks 0 and 1 share dp_cpu and dp_drafter_cpu
GRID = Layout(pp=2, dp=2)  # pp groups {0, 1}, {2, 3}; dp groups {0, 2}, {1, 3}


# -- helpers -----------------------------------------------------------------------------


def relay(
    step: int, src: int, *, stream: Stream = Stream.RELAY, op: Op = Op.RECEIVE, name: str = "w"
) -> list[Effect]:
    """Allocate a wire buffer and broadcast it over pp_relay from `src`."""
    buffer = BufferRef(f"{name}.{step}")
    return [
        Allocate(step=step, op=op, buffer=buffer, shape=(2,), dtype=DType.INT64, stream=stream),
        Broadcast(
            step=step,
            op=op,
            buffer=buffer,
            shape=(2,),
            dtype=DType.INT64,
            src=src,
            comm=Communicator.PP_RELAY,
            stream=stream,
        ),
    ]


def agree(step: int, comm: Communicator, *, columns: int = 2, work: str | None = None) -> AllReduce:
    """An all-reduce of a zero table (equal on every rank and stage)."""
    return AllReduce(
        step=step,
        op=Op.AGREE,
        contribution=np.zeros((5, columns), dtype=np.int32),
        result=BufferRef(f"{comm.value}.{step}"),
        comm=comm,
        work=None if work is None else WorkRef(work),
    )


def write(
    directory: Path,
    world: Layout,
    per_rank: Sequence[Sequence[Effect]],
    *,
    backend: str | None = None,
) -> Path:
    """Every rank's log of one run, as `purepp check` reads them (the header naming
    `backend` as a run's does, if given)."""
    header: dict[str, str] = {"model": "review"}
    if backend is not None:
        header["backend"] = backend
    dump_logs(
        [
            EffectLog.from_effects(LogHeader(rank=rank, world=world, config=header), effects)
            for rank, effects in enumerate(per_rank)
        ],
        directory,
    )
    return directory


def run_in_simulator(
    world: Layout,
    per_rank: Sequence[Sequence[Effect]],
    *,
    max_steps_in_flight: int | None = None,
    backend: Backend = "nccl",
) -> None:
    """Simulate every rank issuing its effects, one tuple per run of one step."""

    def program(context: RankContext) -> Iterator[tuple[Effect, ...]]:
        batch: list[Effect] = []
        for effect in per_rank[context.rank]:
            if batch and effect.step != batch[-1].step:
                yield tuple(batch)
                batch = []
            batch.append(effect)
        if batch:
            yield tuple(batch)

    simulate(world, program, max_steps_in_flight=max_steps_in_flight, backend=backend)


# -- a wait-for cycle through a device and a CPU communicator -------------------------------


def cycle_through_pp_and_dp(stream: Stream) -> list[list[Effect]]:
    """Four ranks: 0 and 3 agree over dp_cpu before their relay broadcast on `stream`,
    1 and 2 broadcast first. Each communicator's own sequence matches."""
    return [
        [agree(0, Communicator.DP_CPU), *relay(0, 1, stream=stream)],
        [*relay(0, 1, stream=stream, op=Op.BROADCAST), agree(0, Communicator.DP_CPU)],
        [*relay(0, 3, stream=stream), agree(0, Communicator.DP_CPU)],
        [agree(0, Communicator.DP_CPU), *relay(0, 3, stream=stream, op=Op.BROADCAST)],
    ]


@pytest.mark.parametrize("stream", [Stream.MAIN, Stream.RELAY])
def test_a_four_rank_cycle_through_a_relay_and_a_dp_group_is_found(
    tmp_path: Path, stream: Stream
) -> None:
    """On gloo a broadcast holds its host, so ranks that take pp_relay and dp_cpu in
    crossed orders wait round a loop of all four ranks: the check names that cycle (no
    per-communicator comparison sees it). On NCCL the same program is ok on either
    stream: a broadcast is only queued there, and the host goes on to the all-reduce."""
    per_rank = cycle_through_pp_and_dp(stream)
    assert match_collectives(dict(enumerate(per_rank)), GRID) is None

    report = check_logs(write(tmp_path / "gloo", GRID, per_rank, backend="gloo"))
    assert isinstance(report.finding, DeadlockReport), report.text
    cycle = report.finding.cycle
    assert cycle is not None, report.text
    assert sorted(cycle.ranks) == [0, 1, 2, 3]
    assert cycle.communicators == {Communicator.DP_CPU, Communicator.PP_RELAY}
    with pytest.raises(CollectiveReportError) as simulated:
        run_in_simulator(GRID, per_rank, backend="gloo")
    assert isinstance(simulated.value.report, DeadlockReport)
    assert simulated.value.report.cycle == cycle

    report = check_logs(write(tmp_path / "nccl", GRID, per_rank, backend="nccl"))
    assert (report.ok, report.exit_code) == (True, EXIT_OK), report.text
    run_in_simulator(GRID, per_rank)


# -- the simulator and the checker agree on random programs ---------------------------------


# One collective a group issues at a step: kind, communicator, index, asynchronous, stream.
_GroupOp = tuple[str, Communicator, int, bool, Stream]


def _group_ops(rng: random.Random, world: Layout) -> dict[int, list[_GroupOp]]:
    """Per rank, the collectives its groups issue at one step (relay broadcasts, an
    agreement across the stages, DP agreements), each rank in its own order."""
    wanted: dict[int, list[_GroupOp]] = {rank: [] for rank in range(world.world_size)}
    for replica in range(world.dp):
        pipeline = world.pipeline(replica)
        if world.pp == 1:
            continue
        for k in range(rng.randint(0, 2)):
            stream = rng.choice([Stream.RELAY, Stream.RELAY, Stream.MAIN])
            for rank in pipeline:
                wanted[rank].append(("broadcast", Communicator.PP_RELAY, k, False, stream))
        if rng.random() < 0.5:
            asynchronous = rng.random() < 0.3
            for rank in pipeline:
                wanted[rank].append(("agree", Communicator.PP_CPU, 0, asynchronous, Stream.MAIN))
    for stage in range(world.pp):
        for comm in (Communicator.DP_CPU, Communicator.DP_DRAFTER_CPU):
            if rng.random() < 0.6:
                asynchronous = rng.random() < 0.3
                for rank in world.replicas(stage):
                    wanted[rank].append(("agree", comm, 0, asynchronous, Stream.MAIN))
    for ops in wanted.values():
        if rng.random() < 0.5:
            rng.shuffle(ops)
    return wanted


def _rank_step(
    rng: random.Random, world: Layout, rank: int, step: int, ops: list[_GroupOp]
) -> list[Effect]:
    """One rank's effects of a step: its collectives, then host, stream, event and work
    waits, each at a random place after what it waits for."""
    effects: list[Effect] = []
    waits: list[tuple[int, Effect]] = []  # each after the effect it waits for
    for kind, comm, k, asynchronous, stream in ops:
        if kind == "agree":
            work = f"w{step}.{comm.value}" if asynchronous else None
            effects.append(agree(step, comm, columns=max(world.pp, world.dp), work=work))
            if work is not None:
                waits.append((len(effects), WaitWork(step=step, op=Op.AGREE, work=WorkRef(work))))
            continue
        src = world.pipeline(world.dp_index(rank))[-1]
        effects += relay(step, src, stream=stream, name=f"b{k}")
        roll = rng.random()
        if roll < 0.2:
            effects.append(Synchronize(step=step, op=Op.RECEIVE, stream=stream))
        elif roll < 0.4:
            effects.append(
                WaitStream(step=step, op=Op.RECEIVE, stream=Stream.MAIN, waits_for=stream)
            )
        elif roll < 0.8:
            event = EventRef(f"e{step}.{k}")
            effects.append(RecordEvent(step=step, op=Op.RECEIVE, stream=stream, event=event))
            wait = WaitEvent(step=step, op=Op.CONSUME, stream=Stream.MAIN, event=event)
            waits.append((len(effects), wait))
    slots = [(rng.randint(after, len(effects)), wait) for after, wait in waits]
    ordered: list[Effect] = []
    for at in range(len(effects) + 1):
        ordered += [wait for slot, wait in slots if slot == at]
        ordered += effects[at : at + 1]
    return ordered


def _break_one(rng: random.Random, world: Layout, per_rank: list[list[Effect]]) -> None:
    """One rank drops its first agreement, or contributes a table of another shape."""
    rank = rng.randrange(world.world_size)
    at = next((i for i, e in enumerate(per_rank[rank]) if isinstance(e, AllReduce)), None)
    if at is None:
        return
    effect = per_rank[rank][at]
    assert isinstance(effect, AllReduce)
    if effect.work is None and rng.random() < 0.5:
        del per_rank[rank][at]
        return
    columns = max(world.pp, world.dp) + 1
    per_rank[rank][at] = agree(effect.step, effect.comm, columns=columns)
    per_rank[rank] = [
        e for e in per_rank[rank] if not (isinstance(e, WaitWork) and e.work == effect.work)
    ]


def random_programs(rng: random.Random) -> tuple[Layout, list[list[Effect]]]:
    """A small world whose groups issue one set of collectives per step, each rank in
    its own order, with waits; sometimes one rank breaks an agreement."""
    world = Layout(pp=rng.choice([1, 2, 3]), dp=rng.choice([1, 2]))
    per_rank: list[list[Effect]] = [[] for _ in range(world.world_size)]
    for step in range(rng.randint(1, 3)):
        for rank, ops in _group_ops(rng, world).items():
            per_rank[rank] += _rank_step(rng, world, rank, step, ops)
    if rng.random() < 0.3:
        _break_one(rng, world, per_rank)
    return world, per_rank


def test_the_simulator_and_the_checker_agree_on_random_programs(tmp_path: Path) -> None:
    """On programs of matched or broken collectives over several communicators, with
    host, stream and event waits, the checker finds a problem in the recorded logs
    exactly when the simulator stops the same program (a ring overrun, which only the
    simulator's adversarial schedule models, aside)."""
    compared = findings = 0
    for seed in range(120):
        world, per_rank = random_programs(random.Random(seed))
        if not any(per_rank):
            continue
        try:
            run_in_simulator(world, per_rank)
            simulated_ok = True
        except CollectiveReportError as error:
            if isinstance(error.report, RingOverrunReport):
                continue
            simulated_ok = False
        report = check_logs(write(tmp_path / str(seed), world, per_rank))
        assert report.exit_code != EXIT_UNUSABLE, report.text
        assert report.ok == simulated_ok, (seed, world, report.text)
        compared += 1
        findings += not report.ok
    assert compared > 80
    assert 10 < findings < compared - 10  # both outcomes were exercised


# -- what the check counts ------------------------------------------------------------------


def test_the_checks_counts_are_every_record_collective_and_step_of_the_logs(
    tmp_path: Path,
) -> None:
    """An ok check counts every record of every rank (runs of records that never wait
    included, though it does not build them), every collective, and the most distinct
    steps any rank logged."""
    logs = record_scripted_logs(make_schedule(ScheduleConfig(pp=2, dp=2, spec=1, steps=9, seed=2)))
    dump_logs(logs, tmp_path)
    report = check_logs(tmp_path)
    assert report.ok, report.text
    assert report.records == sum(len(log.records) for log in logs)
    assert report.collectives == sum(
        isinstance(e, Broadcast | AllReduce) for log in logs for e in log.effects
    )
    assert report.steps == max(len({e.step for e in log.effects}) for log in logs)
    assert report.ranks == GRID.world_size


# -- a header's longest integer ---------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 63, 64, 13_999, 14_000, 14_001, 14_200, 14_400])
def test_a_header_integer_is_refused_when_built_or_reads_back(tmp_path: Path, bits: int) -> None:
    """A config integer too long for Python to read back from JSON is refused when the
    header is built (a typed error); any integer the header accepts is written and read
    back equal, so a header always reads back."""
    value = -(2 ** (bits - 1)) if bits % 2 else 2**bits - 1
    config = {"big": value, "nested": [value]}
    if bits > 14_000:
        with pytest.raises(InvalidInputError, match="too long for a log"):
            LogHeader(rank=0, world=LONE, config=config)
        return
    log = EffectLog.from_effects(LogHeader(rank=0, world=LONE, config=config), [])
    dump_log(log, tmp_path / "rank.jsonl")
    assert load_log(tmp_path / "rank.jsonl") == log


# -- edges -------------------------------------------------------------------------------------


def test_a_folder_path_holding_a_nul_is_an_unusable_folder(tmp_path: Path) -> None:
    """`check_logs` never raises for a path to no usable logs: a folder path with a NUL
    byte in it (no such folder can exist) is a report with exit code 2."""
    report = check_logs(f"{tmp_path}/logs\x00x")
    assert (report.ok, report.exit_code) == (False, EXIT_UNUSABLE)


def test_placeholder_inputs_of_a_stack_of_no_rows_is_a_typed_error() -> None:
    """`placeholder_inputs` of a log whose StackRows has no sources raises a PureppError
    (the numpy interpreter refuses that effect as an InterpreterError)."""
    stack = StackRows(
        step=0, op=Op.CONSUME, sources=(), out=BufferRef("stacked"), stream=Stream.MAIN
    )
    log = EffectLog.from_effects(LogHeader(rank=0, world=LONE), [stack])
    with pytest.raises(PureppError):
        NumpyInterpreter().perform((stack,))
    with pytest.raises(PureppError):
        placeholder_inputs(log)


def test_a_sender_waiting_for_its_own_broadcast_is_no_ring_overrun(tmp_path: Path) -> None:
    """The last stage broadcasts at step 0 and, at step 1, synchronizes its relay stream:
    it waits for its own broadcast, which the first stage posts when it gets to it. The
    run completes: the check of its logs is ok, and so is the simulation, whichever rank
    the simulator happens to run first (here a synchronous pp_cpu all-reduce lets the
    sender run on before the receiver posts)."""
    per_rank: list[list[Effect]] = [
        [agree(0, Communicator.PP_CPU), *relay(0, 1)],
        [
            agree(0, Communicator.PP_CPU),
            *relay(0, 1, op=Op.BROADCAST),
            Synchronize(step=1, op=Op.BROADCAST, stream=Stream.RELAY),
        ],
    ]
    report = check_logs(write(tmp_path, PAIR, per_rank))
    assert report.ok, report.text
    run_in_simulator(PAIR, [effects[1:] for effects in per_rank])  # receiver runs first: ok
    run_in_simulator(PAIR, per_rank)


def test_an_asynchronous_all_reduce_never_waited_on_is_named_by_the_check(
    tmp_path: Path,
) -> None:
    """Both replicas start an asynchronous agreement and their logs end without its
    WaitWork. The check's finding names the work and the ranks that never waited on it,
    as the simulator's report of the same program does."""
    per_rank: list[list[Effect]] = [[agree(0, Communicator.DP_CPU, work="w0")] for _ in range(2)]
    with pytest.raises(CollectiveReportError) as simulated:
        run_in_simulator(REPLICAS, per_rank)
    assert isinstance(simulated.value.report, DeadlockReport)
    assert len(simulated.value.report.unwaited) == 2

    report = check_logs(write(tmp_path, REPLICAS, per_rank))
    assert isinstance(report.finding, DeadlockReport), report.text
    assert [rank for rank, _ in report.finding.unwaited] == [0, 1], report.text
    assert "'w0'" in report.text


@pytest.mark.parametrize(("want", "got"), [(1, 1.0), (True, 1)], ids=["int-float", "bool-int"])
def test_a_header_diff_names_a_config_value_of_another_json_type(want: object, got: object) -> None:
    """Two headers whose config holds `1` and `1.0` (or `true` and `1`) are different
    logs; the diff names the config key that differs."""
    expected = EffectLog(LogHeader(rank=0, world=LONE, config={"seed": want}), ())
    actual = EffectLog(LogHeader(rank=0, world=LONE, config={"seed": got}), ())
    assert expected != actual
    difference = diff_logs(expected, actual)
    assert difference is not None
    assert "fields that differ: config.seed" in difference.splitlines()[-1]


@pytest.mark.parametrize("writer", ["recorder", "dump_log"])
def test_an_effect_holding_a_plain_str_name_is_refused_as_json_cannot_hold_it(
    tmp_path: Path, writer: str
) -> None:
    """An effect whose buffer name is a plain str (attrs checks no field types) is
    refused with the InvalidInputError a float step gets, and nothing is written."""
    header = LogHeader(rank=0, world=LONE)
    plain = Release(step=0, op=Op.END_STEP, buffer="tokens")  # type: ignore[arg-type]
    path = tmp_path / "rank.jsonl"
    if writer == "recorder":
        recorder = Recorder(header, path=path)
        with pytest.raises(InvalidInputError, match="cannot be written as JSON"):
            recorder.perform((plain,))
        assert recorder.log.records == ()
    else:
        log = EffectLog.from_effects(header, [plain])
        with pytest.raises(InvalidInputError, match="cannot be written as JSON"):
            dump_log(log, path)
        assert not path.exists()


def test_a_header_with_a_digest_that_is_not_its_configs_is_refused_or_reads_back(
    tmp_path: Path,
) -> None:
    """A header whose config_digest is not its config's is either refused when built,
    or written and read back equal: never written and then unreadable."""
    try:
        header = LogHeader(
            rank=0,
            world=LONE,
            config={"seed": 1},
            run_id="run-1",
            config_digest="sha256:0000000000000000",
        )
    except PureppError:
        return
    recorder = Recorder(header, path=tmp_path / "rank.jsonl")
    recorder.perform((Release(step=0, op=Op.END_STEP, buffer=BufferRef("x")),))
    assert recorder.log.header == header


def copy(step: int, name: str, values: object) -> CopyHostToDevice:
    return CopyHostToDevice(
        step=step,
        op=Op.CONSUME,
        source=np.array(values, dtype=np.int32),
        buffer=BufferRef(name),
        stream=Stream.MAIN,
    )


def test_replaying_a_two_dimensional_header_check_gives_a_typed_error() -> None:
    """Replaying a log whose header check compares a 2-D header that differs raises a
    PureppError carrying replay's note of the step (a 1-D one raises
    HeaderMismatchError so)."""
    header = BufferRef("header")
    check = CheckHeader(
        step=3,
        op=Op.RECEIVE,
        buffer=header,
        expected=np.array([[3, 4]], dtype=np.int32),
        stream=Stream.MAIN,
    )
    log = EffectLog.from_effects(
        LogHeader(rank=0, world=LONE), [copy(3, "header", [[1, 2]]), check]
    )
    with pytest.raises(PureppError) as caught:
        replay(log, NumpyInterpreter())
    assert any("step 3" in note for note in caught.value.__notes__)


def test_replaying_a_scatter_into_a_scalar_gives_a_typed_error() -> None:
    """Replaying a log that scatters rows into a 0-d buffer raises a PureppError naming
    the step, as any other bad scatter does."""
    scatter = ScatterRows(
        step=3,
        op=Op.CONSUME,
        source=BufferRef("rows"),
        index=BufferRef("slots"),
        target=BufferRef("scalar"),
        stream=Stream.MAIN,
        skips=False,
    )
    effects: list[Effect] = [
        copy(3, "scalar", 5),
        copy(3, "rows", [7]),
        copy(3, "slots", [0]),
        scatter,
    ]
    log = EffectLog.from_effects(LogHeader(rank=0, world=LONE), effects)
    with pytest.raises(PureppError) as caught:
        replay(log, NumpyInterpreter())
    assert any("step 3" in note for note in caught.value.__notes__)
