"""`purepp run` as a user runs it: exit codes, one-line errors, dead ranks, Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from purepp.runner.worker import KILL_RANK_ENV

PUREPP = [sys.executable, "-m", "purepp.runner.cli"]


def _purepp(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*PUREPP, *args],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env=None if env is None else {**os.environ, **env},
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pp", "0"], "--pp 0"),
        (["--dp", "0"], "--dp 0"),
        (["--spec", "50"], "--spec 50"),
        (["--backend", "mpi"], "--backend mpi"),
    ],
)
def test_invalid_options_give_one_line_and_start_nothing(args: list[str], message: str) -> None:
    started = time.monotonic()
    result = _purepp("run", *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert message in lines[0]
    assert "Fix:" in lines[0]
    assert time.monotonic() - started < 30  # no worker was spawned and waited for


@pytest.mark.skipif(
    sys.modules.get("torch") is not None and __import__("torch").cuda.is_available(),
    reason="this machine has CUDA",
)
def test_nccl_without_cuda_is_refused_before_start() -> None:
    result = _purepp("run", "--backend", "nccl")
    assert result.returncode == 1
    assert "needs CUDA" in result.stderr


def test_unwritable_log_dir_is_refused_before_start(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    result = _purepp("run", "--log-dir", str(blocker / "logs"))
    assert result.returncode == 1
    assert "--log-dir" in result.stderr
    assert "not writable" in result.stderr


@pytest.mark.multiprocess
def test_run_prints_summary_with_parity_verdict(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    result = _purepp("run", "--requests", "6", "--seed", "5", "--trace", str(trace))
    assert result.returncode == 0, result.stderr
    for field in ("steps", "requests", "tokens", "tokens/s", "drafts accepted", "parity"):
        assert field in result.stdout
    assert "parity           OK" in result.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == {0, 1, 2, 3}  # one process track per rank
    assert {e["name"] for e in slices} >= {"Broadcast", "AllReduce", "WaitEvent"}
    collectives = [e for e in slices if e["name"] == "Broadcast"]
    assert all(
        {"comm", "comm_seq", "shape", "dtype", "src"} <= e["args"].keys() for e in collectives
    )


@pytest.mark.multiprocess
def test_run_logs_replace_older_ones_and_pass_the_checker(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank-0007.jsonl").write_text("left over from a larger run\n")
    result = _purepp("run", "--pp", "2", "--dp", "1", "--requests", "5", "--log-dir", str(logs))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in logs.iterdir()) == ["rank-0000.jsonl", "rank-0001.jsonl"]
    checked = _purepp("check", str(logs))
    assert checked.returncode == 0, checked.stdout
    assert checked.stdout.startswith("ok: 2 ranks")


@pytest.mark.multiprocess
def test_torchrun_runs_the_same_job(tmp_path: Path) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    worker = ["-m", "purepp.runner.worker", "--pp", "2", "--dp", "1", "--requests", "6"]
    result = subprocess.run(
        [*torchrun, "--nproc-per-node", "2", *worker, "--out", str(tmp_path), "--verdict"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "parity           OK" in result.stdout
    assert (tmp_path / "results.json").exists()


@pytest.mark.multiprocess
def test_dead_rank_stops_the_run_naming_it() -> None:
    started = time.monotonic()
    result = _purepp("run", "--timeout", "10", env={KILL_RANK_ENV: "3@5"})
    assert result.returncode == 1
    assert "rank 3 was killed by SIGKILL" in result.stderr
    assert time.monotonic() - started < 120


def _workers_of(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = next(line.split()[1] for line in status.splitlines() if line.startswith("PPid"))
        if int(ppid) == parent and b"purepp.runner.worker" in cmdline:
            found.append(int(entry.name))
    return found


@pytest.mark.multiprocess
def test_ctrl_c_stops_every_process() -> None:
    process = subprocess.Popen(
        [*PUREPP, "run", "--steps", "100000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while len(_workers_of(process.pid)) < 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(3)  # let the ranks get into the loop
    workers = _workers_of(process.pid)
    assert len(workers) >= 4  # the 4 ranks (the reference may have finished)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130
    assert "interrupted" in stderr
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers)
