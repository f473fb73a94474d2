"""The pieces `purepp run` is built from, without processes: heartbeats read whole or
not at all, results through the one converter, parity against a bounded reference,
the options a rank is started with, messages without source paths, and no import
cycle through the runner."""

from __future__ import annotations

import ast
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from purepp.effects.log import load_logs
from purepp.effects.recorder import Recorder
from purepp.effects.vocabulary import COLLECTIVES, Broadcast, NoteDecision
from purepp.errors import ConfigError
from purepp.runner.options import (
    MAX_TIMEOUT_S,
    OptionParser,
    UsageError,
    add_run_options,
    settings_from_args,
)
from purepp.runner.parity import check_parity
from purepp.runner.progress import Beat, Heartbeat, read_beat, write_beat
from purepp.runner.results import (
    PlanCounts,
    RankResult,
    ResultsError,
    read_results,
    write_results,
)
from purepp.runner.settings import MAX_SPECULATIVE_STEPS, RunSettings
from purepp.runner.summary import summarise
from purepp.runner.supervise import _Rank, without_source_paths, worker_argv
from purepp.runner.trace import Tracer
from purepp.runner.workload import WorkloadConfig, make_workload

ROOT = Path(__file__).resolve().parent.parent


def rank_result(rank: int, outputs: dict[int, list[int]]) -> RankResult:
    """A rank's result with `outputs`; every other field a plausible constant."""
    return RankResult(
        rank=rank,
        stage=rank,
        replica=0,
        steps=7,
        seconds=0.25,
        outputs=outputs,
        finished=(3,),
        aborted=(),
        drafts_proposed=4,
        drafts_accepted=2,
        padded_tokens=1,
        eager_steps=0,
    )


# -- heartbeats ---------------------------------------------------------------------


def test_a_beat_is_read_whole_or_not_at_all(tmp_path: Path) -> None:
    path = tmp_path / "rank0"
    assert read_beat(path) is None  # not started
    write_beat(path, Beat(done=12, total=40, count=3, leaving=True))
    assert read_beat(path) == Beat(done=12, total=40, count=3, leaving=True)
    assert [p.name for p in tmp_path.iterdir()] == ["rank0"]  # no partial file left
    for torn in ("", "12", "12 40", "12 40 3", "12 4x 3 0", "-1 40 3 0", "1 2 3 0 0"):
        path.write_text(torn)
        assert read_beat(path) is None


def test_the_launcher_keeps_the_last_whole_beat(tmp_path: Path) -> None:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    rank = _Rank(0, process, tmp_path / "err", tmp_path / "rank0")
    write_beat(rank.beat_path, Beat(done=30, total=40, count=9))
    rank.observe(now=1.0)
    rank.beat_path.write_text("")  # a reader that raced a writer sees nothing
    rank.observe(now=2.0)
    assert rank.done_steps == 30  # never back to step 0
    assert rank.beat_changed_at == 1.0  # and an empty read is not a sign of life


def test_the_heartbeat_writes_each_step(tmp_path: Path) -> None:
    path = tmp_path / "rank1"
    heartbeat = Heartbeat(path, total=9, parent_pid=None).start()
    heartbeat.step_done(4)
    beat = read_beat(path)
    heartbeat.stop()
    assert beat is not None
    assert (beat.done, beat.total) == (4, 9)
    final = read_beat(path)
    assert final is not None
    assert final.count > beat.count


# A rank process that beats on its own, with no step done, then ends without stopping
# its heartbeat, as a rank that succeeded does. argv: the beat file, then "none" (no
# parent to watch: a rank run by torchrun) or "parent" (its launcher, alive).
_BEATING_RANK = """
import os, sys, time
from pathlib import Path
from purepp.runner.progress import Heartbeat, read_beat
path = Path(sys.argv[1])
parent = None if sys.argv[2] == "none" else os.getppid()
Heartbeat(path, total=5, parent_pid=parent).start()
while (beat := read_beat(path)) is None or beat.count < 4:
    time.sleep(0.05)
"""


@pytest.mark.parametrize("parent", ["none", "parent"])
def test_a_rank_beats_while_its_launcher_lives_and_its_heartbeat_never_holds_it(
    tmp_path: Path, parent: str
) -> None:
    """The thread beats with no step done, whether it watches a parent or not; and the
    heartbeat never keeps a rank process from exiting."""
    path = tmp_path / "rank0"
    ended = subprocess.run(
        [sys.executable, "-c", _BEATING_RANK, str(path), parent],
        capture_output=True,
        text=True,
        timeout=120,  # a guard only: a heartbeat that held the process would hang here
        check=False,
    )
    assert ended.returncode == 0, ended.stderr[-2000:]
    beat = read_beat(path)
    assert beat is not None
    assert (beat.done, beat.total, beat.leaving) == (0, 5, False)


# -- results ------------------------------------------------------------------------


def test_results_cross_processes_through_the_converter(tmp_path: Path) -> None:
    results = (rank_result(0, {}), rank_result(1, {3: [5, 6], 10: []}))
    write_results(tmp_path / "results.json", results)
    assert read_results(tmp_path / "results.json") == results


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (
            '[{"rank": "0"}]',
            'expected an integer in 0..9223372036854775807, got a string "0" @ results[0].rank',
        ),
        ("[", "cannot be read as JSON"),
        ("{}", "results"),
    ],
)
def test_a_bad_results_file_is_refused_naming_the_value(
    tmp_path: Path, text: str, problem: str
) -> None:
    path = tmp_path / "results.json"
    path.write_text(text)
    with pytest.raises(ResultsError, match="read_results") as raised:
        read_results(path)
    assert problem in str(raised.value)


def test_outputs_keep_integer_request_ids(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    write_results(path, [rank_result(1, {3: [5]})])
    text = path.read_text().replace("[[3, [5]]]", '{"3": [5]}')
    path.write_text(text)
    with pytest.raises(ResultsError, match="outputs"):
        read_results(path)


# -- parity against a reference bounded by --steps ------------------------------------


def test_nothing_compared_is_not_ok() -> None:
    verdict = check_parity({0: []}, frozenset(), {0: [1, 2]}, frozenset())
    assert verdict.nothing_compared
    assert not verdict.ok
    assert verdict.render().startswith("NOTHING COMPARED")


def test_an_unfinished_reference_is_compared_as_far_as_both_got() -> None:
    # The run finished request 0 past where the bounded reference stopped: a prefix.
    verdict = check_parity({0: [1, 2, 3]}, frozenset({0}), {0: [1, 2]}, frozenset())
    assert verdict.ok
    assert (verdict.compared, verdict.prefixes) == (2, 1)
    wrong = check_parity({0: [1, 9, 3]}, frozenset({0}), {0: [1, 2]}, frozenset())
    assert wrong.mismatch is not None
    assert wrong.mismatch.position == 1
    assert wrong.compared == 1  # the tokens before the difference


def test_a_mismatch_counts_every_token_compared_before_it() -> None:
    reference = {0: [1, 2], 1: [3, 4, 5]}
    verdict = check_parity({0: [1, 2], 1: [3, 4, 9]}, frozenset({0, 1}), reference)
    assert verdict.mismatch is not None
    assert (verdict.mismatch.request_id, verdict.mismatch.position) == (1, 2)
    assert verdict.compared == 4


def test_a_run_past_a_finished_reference_is_a_mismatch() -> None:
    verdict = check_parity({0: [1, 2, 3]}, frozenset(), {0: [1, 2]}, frozenset({0}))
    assert verdict.mismatch is not None
    assert verdict.mismatch.why == "ran past the reference's end"


# -- the summary ----------------------------------------------------------------------


def _stage_result(
    rank: int, stage: int, outputs: dict[int, list[int]], **fields: Any
) -> RankResult:
    return attrs.evolve(rank_result(rank, outputs), stage=stage, **fields)


def test_the_summary_takes_tokens_from_the_last_stages_and_time_from_every_rank() -> None:
    """A 2 x 2 run: only the last stages sample, so only theirs are the run's tokens and
    drafts; steps, time and plans are every rank's."""
    first = dict(drafts_proposed=50, drafts_accepted=50, padded_tokens=50, eager_steps=50)
    results = [
        _stage_result(0, 0, {1: [9, 9, 9, 9]}, finished=(1,), aborted=(3,), steps=12, **first),
        _stage_result(1, 1, {1: [4, 5, 6], 2: [7]}, finished=(1,), aborted=(2,), seconds=0.5),
        _stage_result(2, 0, {}, seconds=0.75, plans=PlanCounts(lowered=1, planned=2, eager=3)),
        _stage_result(
            3,
            1,
            {3: [8, 8]},
            finished=(3,),
            aborted=(),
            drafts_proposed=5,
            drafts_accepted=0,
            padded_tokens=4,
            eager_steps=2,
            plans=PlanCounts(lowered=1, replayed=4),
        ),
    ]
    # The reference, bounded by --steps, did not finish request 3: compared as a prefix.
    reference = [_stage_result(0, 0, {1: [4, 5, 6], 2: [7, 1], 3: [8]}, finished=(1, 2), steps=11)]
    summary = summarise(RunSettings(pp=2, dp=2, requests=5), results, reference)
    assert (summary.steps, summary.reference_steps, summary.seconds) == (12, 11, 0.75)
    assert (summary.requests, summary.tokens, summary.aborted) == (5, 6, 1)
    assert (summary.drafts_proposed, summary.drafts_accepted) == (9, 2)
    assert (summary.padded_tokens, summary.eager_steps) == (5, 2)
    assert summary.plans == PlanCounts(lowered=2, planned=2, replayed=4, eager=3)
    assert summary.verdict.ok, summary.verdict.render()
    assert (summary.verdict.exact, summary.verdict.prefixes, summary.verdict.compared) == (1, 2, 5)
    lines = summary.render().splitlines()
    assert lines[0] == "purepp run: pp=2 x dp=2 on gloo, spec=2, seed=0"
    assert "  tokens           6 in 0.75 s (8.0 tokens/s)" in lines
    assert "  drafts accepted  2/9" in lines
    assert "  steps            12 (the single-stage reference: 11)" in lines


def test_a_summary_of_nothing_renders() -> None:
    """No rank reported a step (a run of no steps): no rate and no drafts to divide by."""
    settings = RunSettings(pp=2, dp=1, validate_header=True, interpreter="plan")
    summary = summarise(settings, [], [])
    assert (summary.steps, summary.reference_steps, summary.seconds) == (0, 0, 0.0)
    assert summary.verdict.nothing_compared
    lines = summary.render().splitlines()
    assert lines[0].endswith(", relay header validated")
    assert "  interpreter      plan: 0 plans lowered; batches run 0 by a plan, 0 eagerly" in lines
    assert "  tokens           0 in 0.00 s (0.0 tokens/s)" in lines
    assert "  drafts accepted  none" in lines


# -- the trace ------------------------------------------------------------------------


def test_the_trace_has_a_slice_per_effect_on_its_streams_track_numbered_like_the_log() -> None:
    """Each effect of a recorded PP x DP rank goes on, in order, to the interpreter the
    tracer wraps, and becomes a slice on its stream's track (host for host work), with
    its communicator's sequence number as the effect log counts it."""
    log = load_logs(ROOT / "tests" / "data" / "golden" / "dp2")[1]
    recorder = Recorder(log.header)
    tracer = Tracer(rank=5, inner=recorder)
    before = time.time_ns()
    tracer.perform(tuple(record.effect for record in log.records))
    after = time.time_ns()
    assert recorder.log == log
    meta = [e for e in tracer.events if e["ph"] == "M"]
    assert {"name": "process_name", "ph": "M", "pid": 5, "args": {"name": "rank 5"}} in meta
    tracks = {e["tid"]: e["args"] for e in meta if e["name"] == "thread_name"}
    assert sorted(tracks.values(), key=str) == [{"name": t} for t in ("host", "main", "relay")]
    slices = [e for e in tracer.events if e["ph"] == "X"]
    assert len(slices) == len(log.records)
    comms = set()
    notes = 0
    for event, record in zip(slices, log.records, strict=True):
        effect = record.effect
        assert (event["name"], event["pid"], event["cat"]) == (
            type(effect).__name__,
            5,
            effect.op.value,
        )
        stream = getattr(effect, "stream", None)
        track = "host" if stream is None else stream.value
        assert tracks[event["tid"]] == {"name": track}, effect
        args = event["args"]
        assert isinstance(args, dict)
        assert (args["step"], args["op"]) == (effect.step, effect.op.value)
        if isinstance(effect, COLLECTIVES):
            comms.add(effect.comm)
            assert (args["comm"], args["comm_seq"]) == (effect.comm.value, record.comm_seq)
        else:
            assert "comm" not in args
        if isinstance(effect, Broadcast):
            assert (args["shape"], args["dtype"], args["src"]) == (
                list(effect.shape),
                effect.dtype.value,
                effect.src,
            )
        else:
            assert "shape" not in args
        if isinstance(effect, NoteDecision):
            notes += 1
            assert (args["cg_mode"], args["num_ubatches"]) == (
                effect.cg_mode,
                effect.num_ubatches,
            )
            assert args["num_tokens_across_dp"] == effect.num_tokens_across_dp.tolist()
        else:
            assert "cg_mode" not in args
        start, length = event["ts"], event["dur"]
        assert isinstance(start, float)
        assert isinstance(length, float)
        assert before / 1000 <= start <= after / 1000  # microseconds, on the wall clock
        assert 0 < length < start  # a duration, not a point in time
    assert len(comms) > 1  # sequence numbers are each communicator's own
    assert notes == 12  # each step's agreement, with what it decided


# -- option bounds ---------------------------------------------------------------------


def test_each_option_accepts_its_upper_bound_and_refuses_one_past_it() -> None:
    parser = OptionParser(prog="purepp run")
    add_run_options(parser)

    def settings(*argv: str) -> RunSettings:
        return settings_from_args(parser.parse_args(argv))

    layers = RunSettings().num_layers
    top = (layers, MAX_SPECULATIVE_STEPS, MAX_TIMEOUT_S)
    at_bounds = settings("--pp", str(top[0]), "--spec", str(top[1]), "--timeout", str(top[2]))
    assert (at_bounds.pp, at_bounds.spec, at_bounds.timeout_s) == top
    for option, value in zip(("--pp", "--spec", "--timeout"), top, strict=True):
        with pytest.raises(UsageError, match=f"{option} {value + 1:g} is above"):
            settings(option, f"{value + 1:g}")


# -- the workload ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {"num_requests": -1},
        {"dp_size": 0},
        {"min_prompt": 0},
        {"min_prompt": 5, "max_prompt": 4},
        {"min_output": 0},
        {"min_output": 5, "max_output": 4},
        {"num_requests": True},  # a bool is not a count
        {"vocab_size": 0},
        {"arrival_span": 0},  # arrivals over steps 0..arrival_span-1: none
        {"seed": -1},  # numpy's generators take seeds >= 0
        {"abort_fraction": 1.5},
        {"abort_fraction": float("nan")},
    ],
)
def test_a_workload_config_out_of_bounds_is_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match=r"^WorkloadConfig: "):
        WorkloadConfig(**bad)  # type: ignore[arg-type]


def test_a_workload_at_its_bounds_is_drawn() -> None:
    assert make_workload(WorkloadConfig(num_requests=0)).requests == ()
    config = WorkloadConfig(num_requests=6, min_prompt=1, max_prompt=1, min_output=2, max_output=2)
    requests = make_workload(config).requests
    assert [len(r.prompt) for r in requests] == [1] * 6
    assert [r.max_tokens for r in requests] == [2] * 6


def test_numpy_counts_are_kept_as_python_ints() -> None:
    """A count given as a numpy integer is stored as the Python int it equals, so the
    settings equal the plain ones and no later sum (pp * dp, a seed + rank) wraps."""
    settings = RunSettings(pp=np.int8(2), dp=np.uint8(2), steps=np.int64(9))  # type: ignore[arg-type]
    assert settings == RunSettings(pp=2, dp=2, steps=9)
    assert {type(settings.pp), type(settings.dp), type(settings.steps)} == {int}
    workload = WorkloadConfig(num_requests=np.int8(120), seed=np.int16(7))  # type: ignore[arg-type]
    assert type(workload.num_requests) is int
    assert type(workload.seed) is int
    assert workload == WorkloadConfig(num_requests=120, seed=7)


# -- the ranks' options ---------------------------------------------------------------


def test_ranks_get_the_settings_the_launcher_checked() -> None:
    settings = RunSettings(pp=3, dp=2, steps=11, requests=5, spec=1, seed=9, timeout_s=0.1 + 0.2)
    parser = OptionParser(prog="worker")
    add_run_options(parser)
    parsed = settings_from_args(parser.parse_args(worker_argv(settings, None, None)))
    assert parsed == settings


def test_messages_lose_library_source_paths() -> None:
    gloo = (
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[127.0.0.1]:5548: Connection reset by peer"
    )
    assert without_source_paths(gloo) == "Read error [127.0.0.1]:5548: Connection reset by peer"
    timed_out = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out"
    assert without_source_paths(timed_out) == "Timed out"


# -- the house ------------------------------------------------------------------------


def _imports(path: Path, module: str) -> set[str]:
    """purepp modules `module` imports anywhere in it (lazy imports count too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name.startswith("purepp") and name != module}


def test_no_import_cycle_runs_through_the_runner() -> None:
    modules = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts): path
        for path in (ROOT / "purepp").rglob("*.py")
    }
    modules = {name.removesuffix(".__init__"): path for name, path in modules.items()}
    graph = {name: _imports(path, name) & modules.keys() for name, path in modules.items()}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            name = todo.pop()
            for nxt in graph.get(name, ()):
                if nxt == goal:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    runner = sorted(name for name in modules if name.startswith("purepp.runner."))
    assert "purepp.runner.cli" in runner
    cycles = [name for name in runner if reaches(name, name)]
    assert cycles == []
