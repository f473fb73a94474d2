"""A rank process's contract with its launcher, without torch.distributed: how each way
of failing becomes an exit code and one line on stderr, that a failing rank says it is
leaving, what a rank's run is asked to do, fault injection's targets, and the outputs
rank 0 writes."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from purepp.errors import PeerFailureError, StaleTokenError
from purepp.runner import rank_run, supervise, worker
from purepp.runner.exit_codes import Exit, RankExit
from purepp.runner.progress import (
    KILL_RANK_ENV,
    PARENT_PID_ENV,
    STOP_RANK_ENV,
    Beat,
    Heartbeat,
    read_beat,
)
from purepp.runner.results import read_results
from purepp.runner.settings import RunSettings
from tests.test_run_parts import rank_result

SETTINGS = RunSettings(pp=2, dp=1, steps=5)
OUTPUTS = {1: [4, 5]}  # what the results in these tests hold: any rank's will do


class DistError(RuntimeError):
    """Named as torch.distributed's own: what a failed store or collective raises."""


def _args(**overrides: object) -> argparse.Namespace:
    values: dict[str, object] = dict(
        out="out", log_dir=None, trace=None, verdict=False, reference=False, run_id=None
    )
    values.update(overrides)
    return argparse.Namespace(**values)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, object]]:
    """What each rank run was asked to do (each gathers nothing)."""
    seen: list[dict[str, object]] = []

    def run_rank(settings: RunSettings, **kwargs: object) -> object:
        seen.append(dict(kwargs, settings=settings))
        return None

    monkeypatch.setattr(rank_run, "run_rank", run_rank)
    return seen


def _failing_with(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    def run_rank(settings: RunSettings, **kwargs: object) -> object:
        raise error

    monkeypatch.setattr(rank_run, "run_rank", run_rank)


GLOO_CLOSED = (
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:446] Connection closed by peer "
    "[127.0.0.1]:5548\nException raised from ... (most recent call first)"
)


@pytest.mark.parametrize(
    ("error", "code", "line"),
    [
        (
            PeerFailureError("gather_object", "rank 3 went silent", "restart rank 3"),
            RankExit.PEER_FAILURE,
            "gather_object: rank 3 went silent. Fix: restart rank 3",
        ),
        (
            StaleTokenError("consume", "a stale token", "bump the generation"),
            RankExit.PUREPP_ERROR,
            "consume: a stale token. Fix: bump the generation",
        ),
        (
            RuntimeError(GLOO_CLOSED),
            RankExit.PEER_FAILURE,
            "a peer failed or timed out: Connection closed by peer [127.0.0.1]:5548",
        ),
        (
            RuntimeError("Timed out waiting 5000ms for recv operation to complete"),
            RankExit.PEER_FAILURE,
            "a peer failed or timed out: Timed out waiting 5000ms for recv operation to complete",
        ),
        (
            ConnectionResetError(),
            RankExit.PEER_FAILURE,
            "a peer failed or timed out: ConnectionResetError()",
        ),
        (DistError("the store went away"), RankExit.PEER_FAILURE, "the store went away"),
        (RuntimeError("Broken pipe"), RankExit.PEER_FAILURE, "Broken pipe"),
        (RuntimeError("connection reset"), RankExit.PEER_FAILURE, "connection reset"),
    ],
)
def test_each_failure_is_one_line_on_stderr_and_its_exit_code(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    error: Exception,
    code: int,
    line: str,
) -> None:
    _failing_with(monkeypatch, error)
    heartbeat = Heartbeat(None, total=5, parent_pid=None)
    assert worker._run(_args(), SETTINGS, 2, heartbeat) == code
    err = capsys.readouterr().err
    assert err.startswith("purepp: rank 2: "), err
    assert err.endswith(f"{line}\n"), err
    assert err.count("\n") == 1, err


@pytest.mark.parametrize("error", [RuntimeError("shapes [3] and [4] differ"), KeyError("slot")])
def test_a_bug_is_not_taken_for_a_peer_its_traceback_is_the_report(
    monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    _failing_with(monkeypatch, error)
    with pytest.raises(type(error)):
        worker._run(_args(), SETTINGS, 0, Heartbeat(None, total=5, parent_pid=None))


def _main_with_beat(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, rank: int
) -> tuple[Callable[[], int], Path]:
    monkeypatch.delenv(PARENT_PID_ENV, raising=False)  # no parent watch in the test process
    monkeypatch.setenv("RANK", str(rank))
    argv = ["--pp", "2", "--dp", "1", "--steps", "5", "--progress-dir", str(tmp_path)]
    return lambda: worker.main(argv), tmp_path / f"rank{rank}"


def test_a_failing_rank_says_it_is_leaving_before_it_exits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main, beat_path = _main_with_beat(monkeypatch, tmp_path, rank=1)
    _failing_with(monkeypatch, PeerFailureError("recv", "rank 0 went silent", "restart it"))
    assert main() == RankExit.PEER_FAILURE
    beat = read_beat(beat_path)
    assert beat is not None
    assert beat.leaving
    assert (beat.done, beat.total) == (0, 5)
    assert capsys.readouterr().err.startswith("purepp: rank 1: recv: rank 0 went silent")


def test_a_rank_that_succeeded_says_it_is_leaving_too(
    calls: list[dict[str, object]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Torch's teardown can hold the interpreter past a short --timeout: the launcher must
    not take a finished rank's exit for a freeze."""
    main, beat_path = _main_with_beat(monkeypatch, tmp_path, rank=0)
    assert main() == RankExit.OK
    assert len(calls) == 1
    beat = read_beat(beat_path)
    assert beat is not None
    assert beat.leaving


def test_a_rank_interrupted_or_crashing_says_it_is_leaving_too(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    main, beat_path = _main_with_beat(monkeypatch, tmp_path, rank=0)
    _failing_with(monkeypatch, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        main()
    beat = read_beat(beat_path)
    assert beat is not None
    assert beat.leaving


def test_bad_options_exit_with_the_usage_code_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _failing_with(monkeypatch, AssertionError("a refused rank must not run"))
    code = worker.main(["--pp", "0", "--progress-dir", str(tmp_path)])
    assert code == Exit.USAGE
    err = capsys.readouterr().err
    assert err.startswith("python -m purepp.runner.worker: --pp 0 is below 1"), err
    assert list(tmp_path.iterdir()) == []  # no heartbeat either


def test_a_rank_refuses_a_log_folder_or_trace_it_cannot_write(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under torchrun no launcher probed `--log-dir` or `--trace`: each rank does."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    _failing_with(monkeypatch, AssertionError("a refused rank must not run"))
    for option, value in (("--log-dir", blocker / "logs"), ("--trace", blocker / "t.json")):
        assert worker.main([option, str(value)]) == Exit.USAGE
        err = capsys.readouterr().err
        assert err.startswith(f"python -m purepp.runner.worker: {option} "), err
        assert "is a file, not a folder" in err


def test_a_rank_makes_its_log_folder(calls: list[dict[str, object]], tmp_path: Path) -> None:
    nested = tmp_path / "runs" / "logs"
    assert worker.main(["--log-dir", str(nested)]) == Exit.OK
    assert nested.is_dir()
    assert [call["log_dir"] for call in calls] == [str(nested)]


def test_a_rank_whose_launcher_is_gone_exits_whatever_it_is_doing(tmp_path: Path) -> None:
    """The backstop for the parent-death signal: the rank watches its parent itself.
    This one waits in the rendezvous for a peer that never comes (for 300 s)."""
    environment = dict(
        os.environ,
        RANK="0",
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(supervise._free_port()),
        **{PARENT_PID_ENV: "1"},  # not its parent: its launcher is gone
    )
    argv = ["--pp", "2", "--dp", "1", "--timeout", "300", "--progress-dir", str(tmp_path)]
    result = subprocess.run(
        [sys.executable, "-m", "purepp.runner.worker", *argv],
        env=environment,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == RankExit.PARENT_GONE, result.stderr[-2000:]


# -- what a rank's run is asked to do ------------------------------------------------------


def test_a_rank_runs_its_part_and_beats_each_step(
    calls: list[dict[str, object]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv(KILL_RANK_ENV, raising=False)
    monkeypatch.delenv(STOP_RANK_ENV, raising=False)
    heartbeat = Heartbeat(tmp_path / "rank3", total=5, parent_pid=None)
    args = _args(out="o", log_dir="logs", trace="t.json", run_id="r1")
    assert worker._run(args, SETTINGS, 3, heartbeat) == RankExit.OK
    [call] = calls
    assert call["settings"] == SETTINGS
    assert {k: call[k] for k in ("rank", "local_rank", "out_dir", "log_dir", "trace_path")} == {
        "rank": 3,
        "local_rank": 1,
        "out_dir": "o",
        "log_dir": "logs",
        "trace_path": "t.json",
    }
    assert (call["abort_requests"], call["run_id"], call["init_method"]) == (True, "r1", "env://")
    on_step = call["on_step"]
    on_loop_end = call["on_loop_end"]
    assert callable(on_step)
    assert callable(on_loop_end)
    on_step(1)  # the loop finished its second step
    assert read_beat(tmp_path / "rank3") == Beat(done=2, total=5, count=1)
    on_loop_end(3)  # the requests finished early: the bar ends at the 3 steps run
    assert read_beat(tmp_path / "rank3") == Beat(done=3, total=3, count=2)


def test_the_reference_aborts_no_request(
    calls: list[dict[str, object]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    args = _args(reference=True)
    assert worker._run(args, SETTINGS, 0, Heartbeat(None, total=5, parent_pid=None)) == 0
    [call] = calls
    assert call["abort_requests"] is False
    assert call["local_rank"] == 0  # the rank, without LOCAL_RANK


def test_faults_strike_only_the_rank_they_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KILL_RANK_ENV, "12@3")
    assert worker._fault_step(KILL_RANK_ENV, "12") == 3
    assert worker._fault_step(KILL_RANK_ENV, "1") is None
    assert worker._fault_step(KILL_RANK_ENV, "2") is None
    assert worker._fault_step(KILL_RANK_ENV, "reference") is None
    monkeypatch.setenv(KILL_RANK_ENV, "reference@0")
    assert worker._fault_step(KILL_RANK_ENV, "reference") == 0
    assert worker._fault_step(KILL_RANK_ENV, "0") is None
    monkeypatch.delenv(KILL_RANK_ENV)
    assert worker._fault_step(KILL_RANK_ENV, "0") is None


_KILLED_AFTER_STEP = """
import os, sys
from purepp.runner.worker import KILL_RANK_ENV, _on_step
os.environ[KILL_RANK_ENV] = "reference@2"
step_done = _on_step("reference", None)
for step in range(5):
    step_done(step)
    print(step, flush=True)
"""


def test_a_killed_fault_strikes_after_its_step() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _KILLED_AFTER_STEP],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == -9, result.stderr
    assert result.stdout.split() == ["0", "1"]


# -- the verdict of a world started by torchrun ---------------------------------------------


class _Verdict:
    def __init__(self, ok: bool) -> None:
        self.ok = ok


class _Summary:
    def __init__(self, ok: bool) -> None:
        self.verdict = _Verdict(ok)

    def render(self) -> str:
        return f"parity {'OK' if self.verdict.ok else 'MISMATCH'}"


@pytest.mark.parametrize(("ok", "code"), [(True, Exit.OK), (False, Exit.FAILED)])
def test_rank_0_prints_the_verdict_and_exits_by_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], ok: bool, code: int
) -> None:
    gathered = (rank_result(0, OUTPUTS), rank_result(1, OUTPUTS))
    compared: list[object] = []

    def summarise(settings: RunSettings, results: object) -> _Summary:
        compared.append(results)
        return _Summary(ok)

    def run_rank(settings: RunSettings, **kwargs: object) -> object:
        return gathered if kwargs["rank"] == 0 else None

    monkeypatch.setattr(worker, "summarise_against_reference", summarise)
    monkeypatch.setattr(rank_run, "run_rank", run_rank)
    heartbeat = Heartbeat(None, total=5, parent_pid=None)
    assert worker._run(_args(verdict=True), SETTINGS, 0, heartbeat) == code
    assert compared == [gathered]
    assert capsys.readouterr().out == f"{_Summary(ok).render()}\n"
    assert worker._run(_args(verdict=True), SETTINGS, 1, heartbeat) == RankExit.OK
    assert compared == [gathered]  # only rank 0 has the results to compare
    assert worker._run(_args(), SETTINGS, 0, heartbeat) == RankExit.OK
    assert compared == [gathered]


# -- what rank 0 writes ----------------------------------------------------------------------


def test_rank_0_writes_every_ranks_result_and_the_merged_trace(tmp_path: Path) -> None:
    events: list[dict[str, object]] = [{"name": "Broadcast", "ph": "X", "pid": 1}]
    gathered: list[object] = [(rank_result(0, OUTPUTS), []), (rank_result(1, OUTPUTS), events)]
    trace = tmp_path / "trace.json"
    out = tmp_path / "out"
    written = rank_run._write_outputs(gathered, str(out), str(trace))
    assert written == (rank_result(0, OUTPUTS), rank_result(1, OUTPUTS))
    assert read_results(out / "results.json") == written
    assert json.loads(trace.read_text()) == {"traceEvents": events, "displayTimeUnit": "ms"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "trace.json"]  # no .partial
    assert rank_run._write_outputs(gathered, None, None) == written
    with pytest.raises(RuntimeError, match="gathered int, not a rank's result"):
        rank_run._write_outputs([(rank_result(0, OUTPUTS), []), 7], str(out), None)
