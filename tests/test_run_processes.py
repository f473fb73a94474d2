"""Whole `purepp run`s in subprocesses: what is left after a signal, a frozen or dead
rank, a frozen reference, a parent that dies; the summary, logs and run id.

Every run carries a unique marker in its environment, which its rank processes
inherit, so "nothing is left" is checked by scanning /proc for that marker; the
run's temporary folders go under a private TMPDIR that must end up empty.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from purepp.runner.exit_codes import Exit, interrupted
from purepp.runner.progress import KILL_RANK_ENV, STOP_RANK_ENV, STUCK_RANK_ENV
from purepp.runner.settings import RunSettings
from purepp.runner.supervise import LOCK_FILE
from tests._processes import MARK, marked_processes

pytestmark = pytest.mark.multiprocess

PUREPP = [sys.executable, "-m", "purepp.runner.cli"]
SMALL = ["--pp", "2", "--dp", "1", "--requests", "4"]
LONG = ["--pp", "2", "--dp", "1", "--steps", "1000000"]


class Run:
    """One `purepp run` in a subprocess, marked so its processes can be found."""

    def __init__(self, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.mark = uuid.uuid4().hex
        self.tmpdir = tmp_path / f"tmp-{self.mark[:8]}"
        self.tmpdir.mkdir()
        self.process = subprocess.Popen(
            [*PUREPP, "run", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {}), MARK: self.mark, "TMPDIR": str(self.tmpdir)},
        )

    def processes(self) -> list[int]:
        """Live processes carrying this run's marker (the launcher and its ranks)."""
        return marked_processes(self.mark)

    def wait_for_ranks(self, count: int) -> None:
        """Until `count` processes besides the launcher run, and a moment in the loop."""
        deadline = time.monotonic() + 120
        while len(self.processes()) < count + 1:
            assert time.monotonic() < deadline, "the ranks never started"
            assert self.process.poll() is None, self.process.communicate()
            time.sleep(0.2)
        time.sleep(4)  # past torch's import and the rendezvous, into the loop

    def finish(self) -> tuple[int, str, str]:
        out, err = self.process.communicate(timeout=240)
        return self.process.returncode, out, err

    def assert_nothing_left(self) -> None:
        deadline = time.monotonic() + 15
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.2)  # the kernel delivers the parent-death signal asynchronously
        assert self.processes() == []
        assert list(self.tmpdir.iterdir()) == []


@pytest.fixture
def runs() -> Iterator[list[Run]]:
    started: list[Run] = []
    yield started
    for run in started:  # a failed test must not leave a run behind either
        if run.process.poll() is None:
            run.process.kill()
            run.process.communicate()


def _reports(err: str) -> list[str]:
    """The launcher's own lines on stderr (progress lines aside)."""
    return [line for line in err.splitlines() if line.startswith("purepp run:")]


def _progress(err: str) -> list[str]:
    """The progress lines on stderr (not a terminal: a line per tenth of the run)."""
    return [line for line in err.splitlines() if line.startswith("step ")]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_stops_every_rank_and_removes_the_temporary_folder(
    tmp_path: Path, runs: list[Run], signum: signal.Signals
) -> None:
    run = Run(tmp_path, *LONG)
    runs.append(run)
    run.wait_for_ranks(3)  # two ranks and the reference
    assert any(run.tmpdir.iterdir())  # the run's temporary folder exists meanwhile
    run.process.send_signal(signum)
    code, _, err = run.finish()
    assert code == interrupted(signum)
    assert f"interrupted by {signum.name}" in err
    run.assert_nothing_left()


def test_ranks_die_with_their_launcher(tmp_path: Path, runs: list[Run]) -> None:
    run = Run(tmp_path, *LONG)
    runs.append(run)
    run.wait_for_ranks(3)
    run.process.kill()  # SIGKILL: no handler runs, only the parent-death signal
    run.process.communicate()
    deadline = time.monotonic() + 15
    while run.processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert run.processes() == []


def test_a_frozen_rank_is_named_not_the_peer_that_timed_out(
    tmp_path: Path, runs: list[Run]
) -> None:
    args = ["--pp", "2", "--dp", "2", "--requests", "8", "--timeout", "5"]
    run = Run(tmp_path, *args, env={STOP_RANK_ENV: "1@5"})
    runs.append(run)
    code, _, err = run.finish()
    assert code == Exit.RANK_FAILED, err
    reports = _reports(err)
    assert len(reports) == 1, err
    assert reports[0].startswith("purepp run: rank 1 froze after step 6 of "), reports[0]
    assert "stopped by a signal" in reports[0]
    for source in (".cc:", ".cpp:", ".py:", "[../", "third_party"):
        assert source not in err
    run.assert_nothing_left()


def test_a_frozen_reference_is_named(tmp_path: Path, runs: list[Run]) -> None:
    run = Run(tmp_path, *SMALL, "--timeout", "5", env={STOP_RANK_ENV: "reference@3"})
    runs.append(run)
    code, _, err = run.finish()
    assert code == Exit.RANK_FAILED, err
    reports = _reports(err)
    assert len(reports) == 1, err
    assert "the reference process froze after step 4" in reports[0]
    run.assert_nothing_left()


def test_a_stuck_rank_that_still_beats_is_named(tmp_path: Path, runs: list[Run]) -> None:
    args = ["--pp", "2", "--dp", "2", "--requests", "8", "--timeout", "5"]
    run = Run(tmp_path, *args, env={STUCK_RANK_ENV: "1@5"})
    runs.append(run)
    code, _, err = run.finish()
    assert code == Exit.RANK_FAILED, err
    reports = _reports(err)
    assert len(reports) == 1, err
    assert reports[0].startswith("purepp run: rank 1 stopped advancing after step 6 "), err
    run.assert_nothing_left()


def test_a_stuck_reference_is_named(tmp_path: Path, runs: list[Run]) -> None:
    run = Run(tmp_path, *SMALL, "--timeout", "5", env={STUCK_RANK_ENV: "reference@3"})
    runs.append(run)
    code, _, err = run.finish()
    assert code == Exit.RANK_FAILED, err
    reports = _reports(err)
    assert len(reports) == 1, err
    assert "the reference process made no progress for 7 s after step 4" in reports[0]
    run.assert_nothing_left()


def test_a_dead_rank_is_named(tmp_path: Path, runs: list[Run]) -> None:
    run = Run(tmp_path, "--timeout", "10", env={KILL_RANK_ENV: "3@5"})
    runs.append(run)
    code, _, err = run.finish()
    assert code == Exit.RANK_FAILED, err
    assert _reports(err) == ["purepp run: rank 3 was killed by SIGKILL"]
    run.assert_nothing_left()


def test_steps_bound_the_reference_and_nothing_compared_is_not_ok(
    tmp_path: Path, runs: list[Run]
) -> None:
    run = Run(tmp_path, "--pp", "2", "--dp", "1", "--requests", "3", "--steps", "2")
    runs.append(run)
    code, out, err = run.finish()
    assert code == Exit.FAILED, err
    assert "steps            2 (the single-stage reference: 2)" in out
    assert "parity           NOTHING COMPARED" in out
    assert "OK" not in out
    run.assert_nothing_left()


def test_run_prints_summary_with_parity_verdict_and_trace(tmp_path: Path, runs: list[Run]) -> None:
    trace = tmp_path / "trace.json"
    run = Run(tmp_path, "--requests", "6", "--seed", "5", "--trace", str(trace))
    runs.append(run)
    code, out, err = run.finish()
    assert code == Exit.OK, err
    for field in ("steps", "requests", "tokens", "tokens/s", "drafts accepted", "run id"):
        assert field in out
    assert "parity           OK: " in out
    assert "tokens compared" in out
    events = json.loads(trace.read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == {0, 1, 2, 3}  # one process track per rank
    assert {e["name"] for e in slices} >= {"Broadcast", "AllReduce", "WaitEvent"}
    collectives = [e for e in slices if e["name"] == "Broadcast"]
    assert all(
        {"comm", "comm_seq", "shape", "dtype", "src"} <= e["args"].keys() for e in collectives
    )
    run.assert_nothing_left()


def test_logs_carry_the_run_id_and_a_second_run_is_refused(tmp_path: Path, runs: list[Run]) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    # Left over from a larger run (a log of another purepp version: any purepp log goes).
    (logs / "rank-0007.jsonl").write_text('{"schema": "purepp.effects/0", "rank": 7}\n')
    first = Run(tmp_path, *LONG, "--log-dir", str(logs))
    runs.append(first)
    first.wait_for_ranks(3)
    second = Run(tmp_path, *SMALL, "--log-dir", str(logs))
    runs.append(second)
    code, _, err = second.finish()
    assert code == Exit.USAGE
    assert f"--log-dir {logs} is in use by another purepp run (pid {first.process.pid})" in err
    first.process.send_signal(signal.SIGTERM)
    assert first.finish()[0] == interrupted(signal.SIGTERM)

    third = Run(tmp_path, *SMALL, "--log-dir", str(logs))
    runs.append(third)
    code, out, err = third.finish()
    assert code == Exit.OK, err
    # Without DP the loop stops once every request finished, before the bound it started
    # with: the bar ends full at the steps the summary reports.
    steps = int(next(line.split()[1] for line in out.splitlines() if line.split()[:1] == ["steps"]))
    assert steps < RunSettings(pp=2, dp=1, requests=4).total_steps
    assert _progress(err)[-1] == f"step {steps:>5}/{steps} [{'#' * 30}]", err
    names = sorted(p.name for p in logs.iterdir() if not p.name.startswith("."))
    assert names == ["rank-0000.jsonl", "rank-0001.jsonl"]  # older logs replaced
    assert (logs / LOCK_FILE).exists()
    run_id = next(line.split()[-1] for line in out.splitlines() if "run id" in line)
    headers = [
        json.loads(path.read_text().splitlines()[0]) for path in sorted(logs.glob("*.jsonl"))
    ]
    assert [header.get("run_id") for header in headers] == [run_id, run_id]
    checked = subprocess.run(
        [*PUREPP, "check", str(logs)], capture_output=True, text=True, timeout=120, check=False
    )
    assert checked.returncode == Exit.OK, checked.stdout + checked.stderr
    third.assert_nothing_left()


def test_torchrun_runs_the_same_job(tmp_path: Path) -> None:
    """With logs in a folder no launcher made: each rank makes it, and they check."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    worker = ["-m", "purepp.runner.worker", "--pp", "2", "--dp", "1", "--requests", "6"]
    logs = tmp_path / "runs" / "logs"
    outputs = ["--out", str(tmp_path), "--verdict", "--log-dir", str(logs)]
    result = subprocess.run(
        [*torchrun, "--nproc-per-node", "2", *worker, *outputs],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "parity           OK" in result.stdout
    assert (tmp_path / "results.json").exists()
    assert sorted(p.name for p in logs.iterdir()) == ["rank-0000.jsonl", "rank-0001.jsonl"]
    checked = subprocess.run(
        [*PUREPP, "check", str(logs)], capture_output=True, text=True, timeout=120, check=False
    )
    assert checked.returncode == Exit.OK, checked.stdout + checked.stderr
