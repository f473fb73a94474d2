"""A review of `purepp run` and `purepp check`: option limits and combinations, log
folders, and ranks that die, freeze or get stuck at phases the other tests do not
reach (set-up, shutdown).

Each refusal test pins a bug the review found: a setting `launch` or the options took
that the ranks then refused (or silently dropped), a path that broke the run or `purepp
check`, a lock or a FIFO that gave a traceback or a hang, a stopped rank misreported.

Whole runs are bounded: a handful of steps, small `--timeout`s, and a deadline after
which the launcher is killed (its ranks die with it) and the test fails.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from purepp.effects.logfile import LOCK_FILE, log_file_name
from purepp.errors import ConfigError
from purepp.runner.cli import launch, main
from purepp.runner.exit_codes import Exit
from purepp.runner.options import (
    OptionParser,
    UsageError,
    add_run_options,
    settings_from_args,
)
from purepp.runner.progress import KILL_RANK_ENV, STUCK_RANK_ENV
from purepp.runner.settings import (
    MAX_SPECULATIVE_STEPS,
    MAX_TIMEOUT_S,
    MIN_TIMEOUT_S,
    RunSettings,
)
from purepp.runner.supervise import _Rank, _World, worker_argv
from tests._processes import MARK, marked_processes

PUREPP = [sys.executable, "-m", "purepp.runner.cli"]
TINY = ["--pp", "1", "--dp", "1", "--requests", "1", "--steps", "1"]
PAIR = ["--pp", "2", "--dp", "1", "--requests", "4"]


# -- helpers -------------------------------------------------------------------------------


def _one_refusal(capsys: pytest.CaptureFixture[str], code: int) -> str:
    """The single stderr line of a refusal before anything started (exit 2)."""
    out, err = capsys.readouterr()
    assert code == Exit.USAGE, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Fix:" in lines[0], lines[0]
    return lines[0]


def _worker_pids(mark: str, rank: str) -> list[int]:
    """Live rank processes of the marked run: `rank` is "0", "1", ... or "reference"."""
    found = []
    for pid in marked_processes(mark):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"purepp.runner.worker" not in argv:
            continue
        if rank == "reference":
            if b"--reference" in argv:
                found.append(pid)
        elif b"--reference" not in argv and f"RANK={rank}".encode() in environ:
            found.append(pid)
    return found


class _Run:
    """One `purepp run` in a subprocess, marked so every process it starts can be found,
    with a private TMPDIR that must end up empty."""

    def __init__(self, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.mark = uuid.uuid4().hex
        self.tmpdir = tmp_path / f"tmp-{self.mark[:8]}"
        self.tmpdir.mkdir()
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [*PUREPP, "run", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {}), MARK: self.mark, "TMPDIR": str(self.tmpdir)},
        )

    def until(self, condition: Callable[[], bool], limit_s: float, what: str) -> None:
        deadline = time.monotonic() + limit_s
        while not condition():
            if time.monotonic() > deadline or self.process.poll() is not None:
                pytest.fail(f"{what}: never happened ({self.process.poll()=})")
            time.sleep(0.02)

    def finish(self, limit_s: float) -> tuple[int, str, str, float]:
        """Exit code, stdout, stderr and seconds since start; fails past `limit_s`."""
        try:
            out, err = self.process.communicate(timeout=limit_s)
        except subprocess.TimeoutExpired:
            self.process.kill()  # SIGKILL: the ranks die by their parent-death signal
            out, err = self.process.communicate()
            pytest.fail(f"purepp run still ran after {limit_s} s: {err[-2000:]}")
        return self.process.returncode, out, err, time.monotonic() - self.started

    def assert_nothing_left(self) -> None:
        deadline = time.monotonic() + 10
        while marked_processes(self.mark) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marked_processes(self.mark) == []
        assert list(self.tmpdir.iterdir()) == []


@pytest.fixture
def runs() -> Iterator[list[_Run]]:
    started: list[_Run] = []
    yield started
    for run in started:
        if run.process.poll() is None:
            run.process.kill()
            run.process.communicate()


def _reports(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("purepp run:")]


# -- options at their limits -----------------------------------------------------------


@pytest.mark.parametrize("option", ["--steps", "--requests", "--dp", "--seed"])
def test_a_count_past_int32_is_a_usage_error_naming_its_option(
    capsys: pytest.CaptureFixture[str], option: str
) -> None:
    """`purepp run --steps 2147483648` is a bad option: one line naming `--steps` and
    its value, exit 2, nothing started."""
    line = _one_refusal(capsys, main(["run", *TINY, option, "2147483648"]))
    assert line.startswith(f"purepp run: {option} 2147483648 "), line


@pytest.mark.multiprocess
def test_a_timeout_every_rank_would_refuse_is_refused_before_any_process_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A `--timeout` the ranks cannot use (it rounds to no time at all) is refused by
    `purepp run` itself, exit 2, naming `--timeout`."""
    line = _one_refusal(capsys, main(["run", *TINY, "--timeout", "1e-7"]))
    assert "--timeout 1e-7" in line, line


@pytest.mark.multiprocess
def test_launch_runs_the_ranks_with_every_setting_it_was_given(tmp_path: Path) -> None:
    """`launch(RunSettings(...))` runs the ranks with those settings: every rank's log
    header records the very settings the summary reports."""
    settings = RunSettings(
        pp=2,
        dp=1,
        requests=3,
        steps=4,
        timeout_s=30.0,
        num_layers=4,
        max_num_reqs=4,
        max_num_batched_tokens=16,
        chunk_size=4,
        capture_sizes=(1, 2, 4, 8, 12),
    )
    logs = tmp_path / "logs"
    summary = launch(settings, log_dir=logs, progress=False)
    assert summary.settings == settings
    expected = json.loads(json.dumps(attrs.asdict(settings)))
    for rank in range(settings.world_size):
        header = json.loads((logs / log_file_name(rank)).read_text().splitlines()[0])
        assert header["config"] == expected, rank


def test_settings_the_ranks_would_refuse_are_refused_when_built() -> None:
    """A run compares a request at least: `RunSettings(requests=0)` is refused when
    built, so `launch` never starts ranks that would refuse it."""
    with pytest.raises(ConfigError, match=r"^RunSettings: requests=0 is outside 1\.\."):
        RunSettings(pp=1, dp=1, requests=0, steps=1)


_COUNTS = st.integers(1, 64)


@settings(max_examples=60, deadline=None)
@given(
    pp=st.integers(1, 12),
    extra_layers=st.integers(0, 8),
    dp=_COUNTS,
    steps=st.integers(0, 2**31 - 1),
    requests=st.integers(1, 2**31 - 1),
    spec=st.integers(0, MAX_SPECULATIVE_STEPS),
    seed=st.integers(0, 2**31 - 1),
    max_num_reqs=_COUNTS,
    max_num_batched_tokens=_COUNTS,
    chunk_size=_COUNTS,
    capture_sizes=st.lists(st.integers(1, 512), min_size=1, max_size=6, unique=True).map(
        lambda sizes: tuple(sorted(sizes))
    ),
    timeout_s=st.floats(MIN_TIMEOUT_S, MAX_TIMEOUT_S),
    flags=st.tuples(st.booleans(), st.booleans()),
    wire=st.sampled_from(["seed", "packed", "fixed"]),
    interpreter=st.sampled_from(["eager", "checked", "plan"]),
)
def test_every_setting_launch_accepts_reaches_the_ranks_unchanged(
    pp: int,
    extra_layers: int,
    flags: tuple[bool, bool],
    **fields: Any,
) -> None:
    """Whatever `RunSettings` accepts, the ranks' own options (`worker_argv`, parsed and
    checked as a rank parses them) give back equal settings: nothing is dropped on the
    way (five fields once were), and nothing the launcher took is refused there."""
    fields["max_num_batched_tokens"] += fields["spec"]  # a decode row fits the budget
    given_settings = RunSettings(
        pp=pp,
        num_layers=pp + extra_layers,
        validate_header=flags[0],
        overlap_agreement=flags[1],
        **fields,
    )
    parser = OptionParser(prog="worker")
    add_run_options(parser)
    parsed = settings_from_args(parser.parse_args(worker_argv(given_settings, None, None)))
    assert parsed == given_settings


# -- paths ------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_a_trace_that_would_replace_one_of_the_runs_logs_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--trace` may not name a file `--log-dir` holds a rank's log in: refused, exit 2,
    before anything starts."""
    logs = tmp_path / "logs"
    trace = logs / log_file_name(1)
    argv = ["run", *PAIR, "--steps", "3", "--log-dir", str(logs), "--trace", str(trace)]
    line = _one_refusal(capsys, main(argv))
    assert "--trace" in line, line


def test_a_run_refused_for_its_trace_makes_no_log_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run refused before anything started leaves nothing behind: not even the
    `--log-dir` folder it would have made."""
    logs = tmp_path / "runs" / "logs"
    line = _one_refusal(capsys, main(["run", "--log-dir", str(logs), "--trace", str(tmp_path)]))
    assert "--trace" in line, line
    assert not (tmp_path / "runs").exists()


def test_a_log_folder_whose_lock_cannot_be_opened_is_a_one_line_refusal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A `--log-dir` whose lock file cannot be opened is refused like any other bad
    folder: one line naming `--log-dir`, exit 2."""
    logs = tmp_path / "logs"
    (logs / LOCK_FILE).mkdir(parents=True)
    line = _one_refusal(capsys, main(["run", *TINY, "--log-dir", str(logs)]))
    assert f"--log-dir {logs}" in line, line


@pytest.mark.parametrize("argument", ["log_dir", "trace", "run_id"])
def test_launch_refuses_a_nul_in_a_path_or_run_id_naming_the_argument(
    tmp_path: Path, argument: str
) -> None:
    """Bad input to `launch` is a typed error naming the argument, before anything
    starts: a NUL cannot be in a path or a command line."""
    settings = RunSettings(pp=1, dp=1, requests=1, steps=1)
    path = str(tmp_path / "bad\0name")

    def start() -> object:
        if argument == "log_dir":
            return launch(settings, log_dir=path, progress=False)
        if argument == "trace":
            return launch(settings, trace=path, progress=False)
        return launch(settings, run_id="run\0id", progress=False)

    with pytest.raises(UsageError, match=argument):
        start()


def test_check_of_a_folder_holding_a_fifo_named_as_a_log_does_not_hang(tmp_path: Path) -> None:
    """`purepp check` refuses a log folder holding something that is no file (exit 2)
    instead of waiting forever for a writer."""
    logs = tmp_path / "logs"
    logs.mkdir()
    os.mkfifo(logs / log_file_name(0))
    try:
        checked = subprocess.run(
            [*PUREPP, "check", str(logs)], capture_output=True, text=True, timeout=8, check=False
        )
    except subprocess.TimeoutExpired:
        pytest.fail("purepp check hung on a FIFO")
    assert checked.returncode == Exit.USAGE, checked.stdout + checked.stderr


# -- a rank frozen before its first heartbeat ------------------------------------------


@pytest.fixture
def stopped_process() -> Iterator[subprocess.Popen[bytes]]:
    """A sleeper in its own session, stopped by SIGSTOP; killed after the test."""
    process = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        os.kill(process.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "T":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        yield process
    finally:
        process.kill()
        process.wait()


def test_a_process_stopped_before_its_first_beat_is_named_as_stopped_within_the_timeout(
    tmp_path: Path, stopped_process: subprocess.Popen[bytes]
) -> None:
    """A reference process stopped by SIGSTOP before it ever beat is reported as stopped
    by a signal once the timeout passed, without the starting margin (it cannot run)."""
    rank = _Rank(0, stopped_process, tmp_path / "rank0.stderr", tmp_path / "progress" / "rank0")
    world = _World.__new__(_World)  # a bare world over the one stopped process
    world.name = "reference"
    world.work = tmp_path
    world.started_at = 0.0
    world.ranks = [rank]
    world._least_done = -1
    world._least_done_at = 0.0
    now, timeout_s = 12.0, 10.0  # the timeout passed, and a little more
    message = world.frozen(now, timeout_s) or world.hung(now, timeout_s)
    assert message is not None
    assert message.startswith("the reference process froze before its first step"), message
    assert "stopped by a signal" in message, message


# -- a rank that dies or gets stuck at set-up or at shutdown -----------------------------


@pytest.mark.multiprocess
def test_a_rank_stuck_after_its_last_step_is_named_while_its_peer_gathers(
    tmp_path: Path, runs: list[_Run]
) -> None:
    """A rank stuck after its last step, while rank 0 waits for its results in the
    gather, is named within --timeout plus a few seconds: the gather times out like
    any collective."""
    timeout = 3
    args = [*PAIR, "--steps", "6", "--timeout", str(timeout)]
    run = _Run(tmp_path, *args, env={STUCK_RANK_ENV: "1@5"})
    runs.append(run)
    # Start-up (torch's import, on 2 cores) plus the timeout and a few seconds; without a
    # timeout on the gather, the launcher's end-of-run margin (30 s) would come first.
    code, _, err, _ = run.finish(limit_s=19)
    assert code == Exit.RANK_FAILED, err
    reports = _reports(err)
    assert len(reports) == 1, err
    assert reports[0].startswith("purepp run: rank 1 stopped advancing after step 6 "), err
    run.assert_nothing_left()


@pytest.mark.multiprocess
def test_check_of_a_run_whose_rank_was_killed_names_that_rank(
    tmp_path: Path, runs: list[_Run]
) -> None:
    """The logs a failed run leaves are one run's: `purepp check` reads them and
    reports a finding (exit 1) that blames the rank that was killed."""
    logs = tmp_path / "logs"
    args = ["--pp", "2", "--dp", "2", "--requests", "6", "--timeout", "5", "--log-dir", str(logs)]
    run = _Run(tmp_path, *args, env={KILL_RANK_ENV: "1@3"})
    runs.append(run)
    code, _, err, _ = run.finish(limit_s=18)
    assert code == Exit.RANK_FAILED, err
    assert _reports(err) == ["purepp run: rank 1 was killed by SIGKILL"], err
    names = sorted(path.name for path in logs.glob("*.jsonl"))
    assert names == [log_file_name(rank) for rank in range(4)]
    checked = subprocess.run(
        [*PUREPP, "check", str(logs)], capture_output=True, text=True, timeout=15, check=False
    )
    assert checked.returncode == Exit.FAILED, checked.stdout + checked.stderr
    assert "culprit: rank 1" in checked.stdout, checked.stdout
    assert "rank 1's log ends at step 3" in checked.stdout, checked.stdout
    run.assert_nothing_left()
