"""The run supervisor's decisions, without a run: which rank a report names and how,
when a silent or stuck rank is reported, how processes are stopped, the log folder's
lock, the temporary folder, the signals that stop a run, and the options the ranks
and the reference are started with.

Stand-in rank processes are small Python sleepers in their own sessions (as the real
ranks are); worlds are built bare, with their beats set by hand, so each decision is
checked at exact times instead of waiting for them.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import pytest

from purepp.runner import supervise
from purepp.runner.exit_codes import RankExit
from purepp.runner.options import (
    CLI,
    LAUNCH,
    OptionParser,
    UsageError,
    add_run_options,
    settings_from_args,
)
from purepp.runner.progress import Beat, write_beat
from purepp.runner.settings import RunSettings
from purepp.runner.supervise import (
    Interrupted,
    _blame_order,
    _check_devices,
    _die_with_parent,
    _is_stopped,
    _log_dir_lock,
    _one_line,
    _Rank,
    _reference_world,
    _show_progress,
    _signals_stop_the_run,
    _stop,
    _World,
    worker_argv,
)

SLEEPER = "import time; time.sleep(600)"
# Takes SIGTERM as a cue to tidy up a moment and exit 0, then says it is ready.
POLITE = (
    "import signal, sys, time\n"
    "def tidy(signum, frame):\n"
    "    time.sleep(0.1)\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, tidy)\n"
    "print('ready', flush=True)\n"
    "time.sleep(600)\n"
)
# Ignores SIGTERM, then says so: only SIGKILL ends it.
STUBBORN = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(600)\n"
)
WAIT_S = 30.0  # generous: how long a test waits for the kernel or a child to act


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Stand-in processes, each killed (and reaped) after the test whatever happened."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
        process.wait()
        if process.stdout is not None:
            process.stdout.close()


def _start(
    processes: list[subprocess.Popen[bytes]], code: str = SLEEPER, *, talks: bool = False
) -> subprocess.Popen[bytes]:
    """A stand-in running `code`; `talks`: its stdout is a pipe the test reads."""
    process = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE if talks else subprocess.DEVNULL,
        start_new_session=True,  # as a rank: its own process group, for killpg
    )
    processes.append(process)
    return process


def _exited(processes: list[subprocess.Popen[bytes]], code: int) -> subprocess.Popen[bytes]:
    """A process that has ended with `code` (negative: killed by that signal)."""
    if code < 0:
        process = _start(processes, f"import os; os.kill(os.getpid(), {-code})")
    else:
        process = _start(processes, f"import sys; sys.exit({code})")
    process.wait()
    return process


def _rank(
    tmp_path: Path,
    rank: int,
    process: subprocess.Popen[bytes],
    beat: Beat | None = None,
    *,
    beat_at: float = 0.0,
    done_at: float = 0.0,
    stderr: str = "",
) -> _Rank:
    """A rank whose last beat (read at `beat_at`, its steps last advanced at `done_at`)
    is `beat`; its beat file does not exist, so observing keeps that beat."""
    stderr_path = tmp_path / f"rank{rank}.stderr"
    stderr_path.write_text(stderr)
    entry = _Rank(rank, process, stderr_path, tmp_path / "progress" / f"rank{rank}")
    entry.beat = beat
    entry.beat_changed_at = beat_at
    entry.done_changed_at = done_at
    return entry


def _world(
    ranks: list[_Rank], *, name: str = "run", least_done: int = -1, least_done_at: float = 0.0
) -> _World:
    """A world over `ranks` as `_World` keeps one, without starting rank processes."""
    world = _World.__new__(_World)
    world.name = name
    world.work = Path("unused")
    world.started_at = 0.0
    world.ranks = ranks
    world._least_done = least_done
    world._least_done_at = least_done_at
    return world


def _wait_until_stopped(pid: int, stopped: bool) -> None:
    _wait_until(lambda: _is_stopped(pid) == stopped, f"pid {pid} never became stopped={stopped}")


def _gone(pid: int) -> bool:
    """Whether `pid` has ended (reaped, or a zombie nobody reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X")


def _wait_until(condition_met: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition_met():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


# -- which exit a report names ------------------------------------------------------------


def test_a_named_cause_comes_first_then_a_signal_then_a_crash_then_the_peers() -> None:
    order = [
        _blame_order(RankExit.PUREPP_ERROR),
        _blame_order(-signal.SIGKILL),
        _blame_order(1),
        _blame_order(RankExit.PEER_FAILURE),
    ]
    assert order == sorted(order)
    assert len(set(order)) == 4
    assert _blame_order(RankExit.PARENT_GONE) == _blame_order(RankExit.PEER_FAILURE)


def test_a_ranks_message_is_its_own_last_line_without_prefixes_or_source_paths() -> None:
    stderr = (
        "Traceback (most recent call last):\n"
        "[rank2]: purepp: rank 2: relay step 4: header [4, 2] expected [4, 3]. Fix: x\n"
        "[rank2]:[W pair.cc:12] a warning torch printed afterwards\n"
        "\n"
    )
    assert _one_line(stderr) == "relay step 4: header [4, 2] expected [4, 3]. Fix: x"
    crash = (
        "Traceback (most recent call last):\n"
        '  File "/x/loop.py", line 3, in run\n'
        "RuntimeError: [../third_party/gloo/transport/tcp/pair.cc:446] boom\n\n"
    )
    assert _one_line(crash) == "RuntimeError: boom"
    assert _one_line("") == "(no message)"
    assert _one_line("\n  \n") == "(no message)"


# -- stopped processes --------------------------------------------------------------------


def test_a_process_stopped_by_a_signal_is_seen_as_stopped(
    processes: list[subprocess.Popen[bytes]],
) -> None:
    process = _start(processes)
    assert not _is_stopped(process.pid)
    os.kill(process.pid, signal.SIGSTOP)
    _wait_until_stopped(process.pid, True)
    os.kill(process.pid, signal.SIGCONT)
    _wait_until_stopped(process.pid, False)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert not _is_stopped(process.pid)  # no such process: not stopped


# -- a frozen rank: its beat stopped -----------------------------------------------------


def test_the_longest_silent_rank_is_named_frozen_with_where_it_stopped(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    beat = Beat(done=6, total=40, count=9)
    world = _world(
        [
            _rank(tmp_path, 0, _start(processes), beat, beat_at=95.0),
            _rank(tmp_path, 1, _start(processes), beat, beat_at=80.0),
            _rank(tmp_path, 2, _start(processes), beat, beat_at=90.0),
        ]
    )
    assert world.frozen(now=100.0, timeout_s=30.0) is None  # 20 s: within the timeout
    assert world.frozen(now=100.0, timeout_s=20.0) == (
        "rank 1 froze after step 6 of 40: no heartbeat for 20.0 s, it is stuck outside "
        "Python, or starved of CPU; its peers wait for it"
    )
    assert world.frozen(now=100.0, timeout_s=5.0) is not None
    assert (world.frozen(now=100.0, timeout_s=5.0) or "").startswith("rank 1 froze")


def test_a_rank_not_yet_at_its_first_step_gets_the_starting_margin_unless_stopped(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    loading = Beat(done=0, total=40, count=1)
    rank = _rank(tmp_path, 0, _start(processes), loading, beat_at=0.0)
    world = _world([rank], name="reference")
    margin = supervise._START_MARGIN_S
    assert world.frozen(now=10.0 + margin - 0.5, timeout_s=10.0) is None  # torch may load
    late = world.frozen(now=10.0 + margin, timeout_s=10.0)
    assert late is not None
    assert late.startswith("the reference process froze before its first step: ")

    os.kill(rank.process.pid, signal.SIGSTOP)  # stopped: no margin for a process that cannot run
    _wait_until_stopped(rank.process.pid, True)
    stopped = world.frozen(now=10.0, timeout_s=10.0)
    assert stopped == (
        "the reference process froze before its first step: no heartbeat for 10.0 s, "
        "its process is stopped by a signal such as SIGSTOP; its peers wait for it"
    )
    assert world.frozen(now=9.5, timeout_s=10.0) is None


def test_a_rank_leaving_after_its_own_failure_or_gone_or_never_beating_is_not_frozen(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    leaving = Beat(done=6, total=40, count=9, leaving=True)
    world = _world(
        [
            _rank(tmp_path, 0, _start(processes), leaving, beat_at=0.0),
            _rank(tmp_path, 1, _exited(processes, 4), Beat(6, 40, 9), beat_at=0.0),
            _rank(tmp_path, 2, _start(processes), None, beat_at=0.0),
        ]
    )
    assert world.frozen(now=1000.0, timeout_s=1.0) is None


def test_a_beat_is_a_sign_of_life_and_a_step_done_is_a_sign_of_progress(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    (tmp_path / "progress").mkdir()
    rank = _rank(tmp_path, 0, _start(processes))
    write_beat(rank.beat_path, Beat(done=3, total=40, count=7))
    rank.observe(now=1.0)
    assert (rank.beat_changed_at, rank.done_changed_at) == (1.0, 1.0)
    write_beat(rank.beat_path, Beat(done=3, total=40, count=8))  # beating, stuck at 3
    rank.observe(now=2.0)
    assert (rank.beat_changed_at, rank.done_changed_at) == (2.0, 1.0)
    rank.observe(now=3.0)  # the same beat again: silent
    assert (rank.beat_changed_at, rank.done_changed_at) == (2.0, 1.0)
    write_beat(rank.beat_path, Beat(done=4, total=40, count=9))
    rank.observe(now=4.0)
    assert (rank.beat_changed_at, rank.done_changed_at) == (4.0, 4.0)


def test_a_rank_silent_for_the_whole_timeout_is_named_before_any_peer_gives_up(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    frozen = _start(processes)
    os.kill(frozen.pid, signal.SIGSTOP)
    _wait_until_stopped(frozen.pid, True)
    now = time.monotonic()
    beat = Beat(6, 40, 9)
    world = _world(
        [
            _rank(tmp_path, 0, _start(processes), beat, beat_at=now, done_at=now),
            _rank(tmp_path, 1, frozen, beat, beat_at=now - 100.0, done_at=now - 100.0),
        ],
        least_done=6,
        least_done_at=now,
    )
    with pytest.raises(supervise.RankFailure) as failed:
        supervise._wait([world], timeout_s=5.0, show=world)
    assert str(failed.value).startswith("rank 1 froze after step 6 of 40: no heartbeat for ")
    assert str(failed.value).endswith(
        "s, its process is stopped by a signal such as SIGSTOP; its peers wait for it"
    )


# -- a stuck rank: it beats, but its steps stopped ---------------------------------------


def test_a_worlds_progress_is_its_slowest_rank_and_dates_from_its_last_advance(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    (tmp_path / "progress").mkdir()
    ranks = [_rank(tmp_path, 0, _start(processes)), _rank(tmp_path, 1, _start(processes))]
    world = _world(ranks, least_done=-1, least_done_at=0.0)
    world.observe(now=1.0)  # no beat yet
    assert (world.progress(), world._least_done_at) == ((0, 0), 0.0)
    write_beat(ranks[0].beat_path, Beat(done=3, total=40, count=4))
    write_beat(ranks[1].beat_path, Beat(done=2, total=40, count=3))
    world.observe(now=2.0)
    assert (world.progress(), world._least_done_at) == ((2, 40), 2.0)
    write_beat(ranks[0].beat_path, Beat(done=4, total=40, count=5))  # not the slowest
    world.observe(now=3.0)
    assert (world.progress(), world._least_done_at) == ((2, 40), 2.0)
    write_beat(ranks[1].beat_path, Beat(done=4, total=40, count=4))
    world.observe(now=4.0)
    assert (world.progress(), world._least_done_at) == ((4, 40), 4.0)


def _stuck_world(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]], *, name: str, least_done: int
) -> _World:
    beat = Beat(done=least_done, total=40, count=9)
    return _world(
        [_rank(tmp_path, 0, _start(processes), beat, beat_at=100.0)],
        name=name,
        least_done=least_done,
        least_done_at=0.0,
    )


@pytest.mark.parametrize(
    "case",
    [
        ("run", 0, supervise._START_MARGIN_S, "before its first step"),
        ("reference", 6, supervise._ALONE_MARGIN_S, "after step 6"),
        ("run", 40, supervise._START_MARGIN_S, "after step 40"),  # gathering the results
    ],
)
def test_no_progress_for_the_timeout_and_a_margin_is_a_hang(
    tmp_path: Path,
    processes: list[subprocess.Popen[bytes]],
    case: tuple[str, int, float, str],
) -> None:
    name, done, margin, where = case
    world = _stuck_world(tmp_path, processes, name=name, least_done=done)
    assert world.hung(now=5.0 + margin, timeout_s=5.0) is None
    who = "rank 0" if name == "run" else "the reference process"
    assert world.hung(now=5.0 + margin + 0.1, timeout_s=5.0) == (
        f"{who} made no progress for {5.0 + margin:.0f} s {where} "
        "(alive and beating, but stuck or far too slow)"
    )


def test_ranks_with_peers_get_a_longer_margin_so_their_own_timeouts_come_first(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    ranks = [
        _rank(tmp_path, 0, _start(processes), Beat(7, 40, 9), done_at=20.0),
        _rank(tmp_path, 1, _start(processes), Beat(6, 40, 9), done_at=10.0),
        _rank(tmp_path, 2, _start(processes), Beat(6, 40, 9), done_at=10.0),
    ]
    world = _world(ranks, least_done=6, least_done_at=10.0)
    limit = 10.0 + 5.0 + supervise._PEERS_MARGIN_S
    assert supervise._PEERS_MARGIN_S > supervise._ALONE_MARGIN_S
    assert world.hung(now=limit, timeout_s=5.0) is None
    # The rank whose steps stopped first, then the fewest steps, then the lowest rank.
    assert (world.hung(now=limit + 0.1, timeout_s=5.0) or "").startswith(
        "rank 1 made no progress for 15 s after step 6 "
    )


def test_the_rank_the_others_waited_for_is_the_one_whose_steps_stopped_first(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    ranks = [
        _rank(tmp_path, 0, _start(processes), Beat(5, 40, 9), done_at=3.0),
        _rank(tmp_path, 1, _start(processes), Beat(4, 40, 9), done_at=3.0),
        _rank(tmp_path, 2, _start(processes), Beat(9, 40, 9), done_at=1.0),
        _rank(tmp_path, 3, _start(processes), Beat(4, 40, 9), done_at=3.0),
    ]
    world = _world(ranks)
    assert world._stuck_first(ranks) is ranks[2]
    assert world._stuck_first([ranks[0], ranks[1], ranks[3]]) is ranks[1]  # fewer steps
    assert world._stuck_first([ranks[3], ranks[1]]) is ranks[1]  # then the lower rank


# -- a failed rank: which one a report names ---------------------------------------------


@pytest.fixture
def no_settling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervise, "_SETTLE_S", 0.0)


@pytest.mark.usefixtures("no_settling")
def test_no_failure_while_ranks_run_or_exited_cleanly(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    world = _world(
        [
            _rank(tmp_path, 0, _start(processes), Beat(1, 9, 1)),
            _rank(tmp_path, 1, _exited(processes, 0), Beat(9, 9, 5)),
        ]
    )
    assert world.failure() is None
    assert not world.done()
    assert _world([_rank(tmp_path, 0, _exited(processes, 0))]).done()
    failed = [_rank(tmp_path, 0, _exited(processes, 0)), _rank(tmp_path, 1, _exited(processes, 4))]
    assert not _world(failed).done()  # so its failure is reported, not its missing results


@pytest.mark.usefixtures("no_settling")
def test_a_named_cause_is_reported_before_a_killed_rank_and_the_peers(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    own = "purepp: rank 2: relay step 4: a stale token. Fix: bump the generation\n"
    peer = "purepp: rank 0: a peer failed or timed out: Connection closed by peer\n"
    world = _world(
        [
            _rank(tmp_path, 0, _exited(processes, RankExit.PEER_FAILURE), stderr=peer),
            _rank(tmp_path, 1, _exited(processes, -signal.SIGKILL)),
            _rank(tmp_path, 2, _exited(processes, RankExit.PUREPP_ERROR), stderr=own),
        ]
    )
    assert world.failure() == (
        "rank 2 failed (exit 3): relay step 4: a stale token. Fix: bump the generation"
    )
    world.ranks.pop()
    assert world.failure() == "rank 1 was killed by SIGKILL"
    world.ranks.pop()
    assert world.failure() == (
        "rank 0 failed (exit 4): a peer failed or timed out: Connection closed by peer"
    )


@pytest.mark.usefixtures("no_settling")
def test_a_crash_is_reported_with_its_last_line(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    world = _world(
        [
            _rank(tmp_path, 0, _exited(processes, RankExit.PEER_FAILURE), stderr="peer\n"),
            _rank(tmp_path, 1, _exited(processes, 1), stderr="Traceback\nValueError: bad\n"),
        ],
        name="reference",
    )
    assert world.failure() == "the reference process failed (exit 1): ValueError: bad"


@pytest.mark.usefixtures("no_settling")
def test_when_only_peers_failed_the_live_rank_they_waited_for_is_named(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    now = time.monotonic()
    waiting = _rank(tmp_path, 1, _start(processes), Beat(6, 40, 9), beat_at=now, done_at=now - 9)
    world = _world(
        [
            _rank(tmp_path, 0, _exited(processes, RankExit.PEER_FAILURE), Beat(7, 40, 9)),
            waiting,
            _rank(tmp_path, 2, _exited(processes, RankExit.PARENT_GONE), Beat(7, 40, 9)),
        ]
    )
    assert world.failure() == (
        "rank 1 stopped advancing after step 6 (alive and beating, but stuck or far too "
        "slow); its peers timed out waiting for it"
    )
    waiting.beat = Beat(0, 40, 9)
    assert (world.failure() or "").startswith("rank 1 stopped advancing before its first step ")
    waiting.beat = Beat(6, 40, 9)
    # Silent past _SILENT_S as well: frozen, which says more.
    waiting.beat_changed_at = time.monotonic() - supervise._SILENT_S - 5.0
    assert (world.failure() or "").startswith("rank 1 froze after step 6 of 40: no heartbeat")
    # A live rank on its way out after its own failure is not the one they waited for.
    waiting.beat = Beat(6, 40, 10, leaving=True)
    assert (world.failure() or "").startswith("rank 0 failed (exit 4)")


class _SettleWatch:
    """`time` for the supervisor: `meanwhile` happens during its settling pause."""

    def __init__(self, meanwhile: Callable[[], None]) -> None:
        self.meanwhile = meanwhile
        self.pauses: list[float] = []

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.meanwhile()


def test_the_settling_pause_lets_the_cause_exit_before_one_is_blamed(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    cause = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read(); sys.exit(3)"],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )
    processes.append(cause)
    own = "purepp: rank 1: a stale token. Fix: bump the generation\n"
    now = time.monotonic()
    world = _world(
        [
            _rank(tmp_path, 0, _exited(processes, RankExit.PEER_FAILURE), Beat(7, 40, 9)),
            _rank(tmp_path, 1, cause, Beat(6, 40, 9), beat_at=now, done_at=now, stderr=own),
        ]
    )

    def cause_exits() -> None:  # after a peer's failure is seen, the cause exits too
        assert cause.stdin is not None
        cause.stdin.close()
        cause.wait()

    watch = _SettleWatch(cause_exits)
    monkeypatch.setattr(supervise, "time", watch)
    assert world.failure() == "rank 1 failed (exit 3): a stale token. Fix: bump the generation"
    assert watch.pauses == [supervise._SETTLE_S]


def test_the_beats_after_the_settling_pause_decide_who_is_named(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "progress").mkdir()
    now = time.monotonic()
    live = _rank(tmp_path, 1, _start(processes), Beat(6, 40, 9), beat_at=now, done_at=now)
    world = _world(
        [_rank(tmp_path, 0, _exited(processes, RankExit.PEER_FAILURE), Beat(7, 40, 9)), live]
    )
    # Meanwhile the live rank says it fails too: it is not the one the others waited for.
    leaving = Beat(6, 40, 10, leaving=True)
    monkeypatch.setattr(
        supervise, "time", _SettleWatch(lambda: write_beat(live.beat_path, leaving))
    )
    assert (world.failure() or "").startswith("rank 0 failed (exit 4)")
    assert live.beat == leaving


def test_a_finished_world_is_no_longer_watched_for_hangs(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    """The reference finishes long before a long run: its old progress is no hang."""
    long_ago = time.monotonic() - 1000.0
    finished = _world(
        [_rank(tmp_path, 0, _exited(processes, 0), Beat(9, 9, 5))],
        name="reference",
        least_done=9,
        least_done_at=long_ago,
    )
    finishing = _start(processes, "import time; time.sleep(1.0)")
    running = _world([_rank(tmp_path, 1, finishing)], least_done_at=time.monotonic())
    assert finished.hung(time.monotonic(), timeout_s=1.0) is not None  # were it watched
    supervise._wait([running, finished], timeout_s=1.0, show=running)
    assert running.done()


def test_a_world_starts_its_ranks_in_their_own_sessions_and_reports_their_refusal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real rank processes, refused at once by their options (no torch is loaded)."""
    monkeypatch.setattr(supervise, "_SETTLE_S", 0.0)
    started: list[_Rank] = []
    try:
        world = _World("run", 2, ["--pp", "0"], tmp_path / "run", started)
        assert [rank.rank for rank in started] == [0, 1]
        assert started == world.ranks
        for rank in started:  # a Ctrl-C at the terminal reaches the launcher alone
            assert os.getsid(rank.process.pid) == rank.process.pid != os.getsid(0)
        for rank in started:
            rank.process.wait(timeout=WAIT_S)
        assert (tmp_path / "run" / "progress").is_dir()
        assert (world.failure() or "").startswith(
            "rank 0 failed (exit 2): python -m purepp.runner.worker: --pp 0 is below 1. Fix: "
        )
    finally:
        _stop(started)


# -- stopping ------------------------------------------------------------------------------


def test_stopping_ends_a_stopped_rank_by_sigterm_gives_grace_and_then_sigkill(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(supervise, "_STOP_GRACE_S", 2.0)
    frozen = _start(processes)
    os.kill(frozen.pid, signal.SIGSTOP)
    _wait_until_stopped(frozen.pid, True)
    stubborn = _start(processes, STUBBORN, talks=True)
    polite = _start(processes, POLITE, talks=True)
    for process in (stubborn, polite):
        assert process.stdout is not None
        assert process.stdout.readline() == b"ready\n"
    gone = _exited(processes, RankExit.PEER_FAILURE)
    ranks = [_rank(tmp_path, i, p) for i, p in enumerate((frozen, stubborn, polite, gone))]
    stopper = threading.Thread(target=_stop, args=(ranks,), daemon=True)
    stopper.start()
    stopper.join(WAIT_S)
    assert not stopper.is_alive(), "_stop never returned"
    assert frozen.returncode == -signal.SIGTERM  # continued, so SIGTERM could end it
    assert stubborn.returncode == -signal.SIGKILL
    assert polite.returncode == 0  # the grace let it finish
    assert gone.returncode == RankExit.PEER_FAILURE


def _a_run_that_fails(ranks: list[_Rank], monkeypatch: pytest.MonkeyPatch) -> None:
    """A run whose rank fails; a Ctrl-C comes while its ranks are being stopped."""
    real_killpg = os.killpg

    def killpg_then_ctrl_c(pid: int, signum: int) -> None:
        real_killpg(pid, signum)
        signal.raise_signal(signal.SIGINT)  # the first signal raises Interrupted here

    with supervise._stopped_on_exit() as started:
        started.extend(ranks)
        monkeypatch.setattr(os, "killpg", killpg_then_ctrl_c)
        raise supervise.RankFailure("rank 0 failed")


def test_a_signal_while_stopping_after_a_failure_still_stops_every_rank(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user sees the interruption, and no rank is left running."""
    ranks = [_rank(tmp_path, 0, _start(processes)), _rank(tmp_path, 1, _start(processes))]
    with pytest.raises(Interrupted), _signals_stop_the_run():
        _a_run_that_fails(ranks, monkeypatch)
    monkeypatch.undo()
    assert [rank.process.poll() for rank in ranks] == [-signal.SIGTERM, -signal.SIGTERM]


_ORPHAN = """
import subprocess, sys, time
from purepp.runner.supervise import _die_with_parent
preexec = _die_with_parent()
assert preexec is not None, "no parent-death signal in a single-threaded launcher"
child = subprocess.Popen(
    [sys.executable, "-c", "import time; time.sleep(600)"],
    preexec_fn=preexec,
    start_new_session=True,
)
print(child.pid, flush=True)
time.sleep(600)
"""


def test_a_rank_without_a_parent_watch_still_dies_with_its_launcher(
    processes: list[subprocess.Popen[bytes]],
) -> None:
    launcher = _start(processes, _ORPHAN, talks=True)
    assert launcher.stdout is not None
    child = int(launcher.stdout.readline())
    try:
        assert not _gone(child)
        launcher.kill()  # SIGKILL: no handler of the launcher runs
        launcher.wait()
        _wait_until(lambda: _gone(child), "the child outlived its launcher")
    finally:
        if not _gone(child):
            os.kill(child, signal.SIGKILL)


def test_no_parent_death_signal_from_a_threaded_launcher() -> None:
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    try:
        assert _die_with_parent() is None  # a fork could copy another thread's held lock
    finally:
        release.set()
        thread.join()


# -- signals -------------------------------------------------------------------------------


def _signalled_twice(signum: int) -> None:
    """`signum`, then more signals while the run is being stopped."""
    try:
        signal.raise_signal(signum)  # its handler runs before this returns
    finally:  # stopping the processes: a second Ctrl-C must not cut that short
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGTERM)


def test_the_first_signal_interrupts_and_later_ones_are_ignored_while_stopping() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    for signum in before:
        with pytest.raises(Interrupted) as raised, _signals_stop_the_run():
            _signalled_twice(signum)
        assert raised.value.signum == signum
        assert str(raised.value) == signal.Signals(signum).name
        assert {s: signal.getsignal(s) for s in before} == before  # restored


def test_signals_are_left_to_the_caller_off_the_main_thread() -> None:
    errors: list[BaseException] = []

    def enter() -> None:
        try:
            with _signals_stop_the_run():
                pass
        except BaseException as error:  # reported by the assertion below
            errors.append(error)

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    assert errors == []


# -- the log folder's lock ----------------------------------------------------------------


def test_the_log_folder_lock_names_its_holder_and_is_released_after_the_run(
    tmp_path: Path,
) -> None:
    lock = tmp_path / supervise.LOCK_FILE
    lock.write_text("999999999 an-older-and-longer-run-id\n")
    with _log_dir_lock(tmp_path, "run1", CLI):
        assert lock.read_text() == f"{os.getpid()} run1\n"
        with pytest.raises(UsageError) as refused, _log_dir_lock(tmp_path, "run2", CLI):
            pass
        assert f"is in use by another purepp run (pid {os.getpid()})" in str(refused.value)
        assert "Fix: wait for it to finish, or pass another --log-dir" in str(refused.value)
    with _log_dir_lock(tmp_path, "run3", CLI):  # released: the next run takes it
        assert lock.read_text() == f"{os.getpid()} run3\n"


def test_a_lock_held_without_a_pid_is_refused_without_one(tmp_path: Path) -> None:
    with (tmp_path / supervise.LOCK_FILE).open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(UsageError) as refused, _log_dir_lock(tmp_path, "run", CLI):
            pass
    assert f"--log-dir {tmp_path} is in use by another purepp run. Fix:" in str(refused.value)


def test_a_lock_only_read_is_no_run_and_is_waited_out_a_while(tmp_path: Path) -> None:
    # purepp check tests for a writer with a shared lock, for a moment: the run tries
    # again (as dump_logs does, through the same logfile.lock_log_dir), and names a
    # reader that never lets go as what it is.
    with (tmp_path / supervise.LOCK_FILE).open("w") as held:
        fcntl.flock(held, fcntl.LOCK_SH)
        with pytest.raises(UsageError) as refused, _log_dir_lock(tmp_path, "run", CLI):
            pass
    assert f"--log-dir {tmp_path} is in use by purepp check, reading it over" in str(refused.value)
    with _log_dir_lock(tmp_path, "run", CLI):  # the reader let go: the run takes it
        assert (tmp_path / supervise.LOCK_FILE).read_text() == f"{os.getpid()} run\n"


# -- the temporary folder -----------------------------------------------------------------


# Run in a process of its own: the test process has run in-process torch worlds whose
# threads may still hold or close descriptors, and its children include other tests'.
_USER = """
import json, os
from pathlib import Path
from purepp.runner.supervise import _temporary_folder

def sweepers():
    # Live sweeper processes started by this process.
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[-1].split()
            command = (entry / "cmdline").read_bytes().split(b"\\0")
        except OSError:
            continue
        if int(stat[1]) == os.getpid() and stat[0] != "Z" and b"-I" in command:
            found.append(int(entry.name))
    return found

with _temporary_folder("purepp-test-") as folder:
    (folder / "rank0.stderr").write_text("x")
    during = sweepers()
    own_session = [os.getsid(pid) != os.getsid(0) for pid in during]
facts = dict(folder=str(folder), during=len(during), own_session=own_session)
facts.update(removed=not folder.exists(), after=len(sweepers()))
try:
    with _temporary_folder("purepp-test-") as failed:
        raise KeyError("a failure inside the run")
except KeyError:
    facts.update(failed_removed=not failed.exists())
print(json.dumps(facts))
"""


def test_the_temporary_folder_is_removed_on_exit_and_on_an_error(tmp_path: Path) -> None:
    environment = dict(os.environ, TMPDIR=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", _USER],
        env=environment,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout)
    folder = Path(facts["folder"])
    assert folder.parent == tmp_path
    assert folder.name.startswith("purepp-test-")
    assert facts["during"] == 1, facts  # one sweeper, alive while the folder is in use
    assert facts["own_session"] == [True]  # a Ctrl-C at the terminal misses it
    assert facts["removed"]
    assert facts["after"] == 0  # its sweeper ended with it
    assert facts["failed_removed"]


_OWNER = """
import sys, time
from purepp.runner.supervise import _temporary_folder
with _temporary_folder("purepp-test-") as folder:
    (folder / "rank0.stderr").write_text("x")
    print(folder, flush=True)
    time.sleep(1.0)  # the sweeper has started by now: it must wait for this process
    print(folder.exists(), flush=True)
    time.sleep(600)
"""


def test_the_temporary_folder_outlives_nothing_but_its_sigkilled_owner(
    processes: list[subprocess.Popen[bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    owner = _start(processes, _OWNER, talks=True)
    assert owner.stdout is not None
    folder = Path(owner.stdout.readline().decode().strip())
    assert folder.parent == tmp_path
    assert owner.stdout.readline() == b"True\n"  # kept while its owner runs
    owner.kill()  # SIGKILL: no handler of the owner runs
    owner.wait()
    _wait_until(lambda: not folder.exists(), "the sweeper left the folder behind")


def test_ranks_do_not_inherit_a_launchers_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun, TORCHELASTIC_* would make the new world join torchrun's store."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "outer")
    monkeypatch.setenv("PUREPP_KEPT", "yes")
    environment = supervise._own_environment()
    assert not [name for name in environment if name.startswith("TORCHELASTIC_")]
    assert environment["PUREPP_KEPT"] == "yes"
    assert environment["PATH"] == os.environ["PATH"]


# -- the options of the ranks and of the reference ----------------------------------------


def _parsed(argv: list[str]) -> tuple[RunSettings, str | None, str | None]:
    parser = OptionParser(prog="worker")
    add_run_options(parser)
    parser.add_argument("--reference", action="store_true")
    args = parser.parse_args(argv)
    return settings_from_args(args), args.log_dir, args.trace


def test_a_worlds_store_port_is_below_the_ephemeral_range_and_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An ephemeral port can become the local end of another world's connection
    # between the check and rank 0's listen (CI once failed so: "address already in use").
    low = supervise._ephemeral_low()
    ports = {supervise._free_port() for _ in range(20)}
    assert all(low - supervise._STORE_PORTS <= port < low for port in ports), (ports, low)
    assert len(ports) > 1  # drawn at random, so two launchers rarely meet
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        taken = listener.getsockname()[1]
        assert not supervise._can_listen(taken)
    tried: list[int] = []

    def busy_but_the_fourth(port: int) -> bool:
        tried.append(port)
        return len(tried) == 4

    monkeypatch.setattr(supervise, "_can_listen", busy_but_the_fourth)
    assert supervise._free_port() == tried[3]
    # Free, but handed out already (to a world whose rank 0 is not listening yet): the
    # draw after it, which is handed out from then on.
    monkeypatch.setattr(supervise, "_can_listen", lambda port: True)
    monkeypatch.setattr(supervise, "_STORE_PORTS", 2)
    monkeypatch.setattr(supervise, "_HANDED_OUT", {low - 2})

    class Draws:
        drawn = iter([low - 2, low - 1])

        def randrange(self, start: int, stop: int) -> int:
            assert (start, stop) == (low - 2, low)
            return next(self.drawn)

    monkeypatch.setattr(random, "SystemRandom", Draws)
    assert supervise._free_port() == low - 1
    assert sorted(supervise._HANDED_OUT) == [low - 2, low - 1]
    # An ephemeral range from 1024 up leaves no port below it: an ephemeral one (an
    # empty range to draw from raised ValueError).
    monkeypatch.setattr(supervise, "_ephemeral_low", lambda: 1024)
    assert supervise._free_port() >= 1024


def test_a_port_whose_closed_connections_wait_out_their_time_is_free() -> None:
    # TCPStore listens with SO_REUSEADDR: a port whose connections an ended store
    # closed (they wait in TIME_WAIT) is free to it, and the check must say so too.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            served, _ = listener.accept()
            served.close()  # closed first: the store's end waits out its time
    assert supervise._can_listen(port)


@pytest.mark.parametrize(
    ("text", "low"),
    [("40000\t60999\n", 40000), (None, 32768), ("", 32768), ("many ports\n", 32768)],
    ids=["read", "missing", "empty", "unreadable"],
)
def test_the_ephemeral_range_is_the_kernels_or_linuxs_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str | None, low: int
) -> None:
    path = tmp_path / "ip_local_port_range"
    if text is not None:
        path.write_text(text)
    monkeypatch.setattr(supervise, "_EPHEMERAL_RANGE", path)
    assert supervise._ephemeral_low() == low


def test_ranks_get_every_setting_and_the_log_folder_and_trace() -> None:
    settings = RunSettings(
        pp=2, dp=3, steps=7, validate_header=True, overlap_agreement=True, wire="fixed"
    )
    argv = worker_argv(settings, "logs", "trace.json")
    assert _parsed(argv) == (settings, "logs", "trace.json")
    assert _parsed(worker_argv(settings, None, None)) == (settings, None, None)
    plain = attrs.evolve(settings, validate_header=False, overlap_agreement=False)
    assert _parsed(worker_argv(plain, None, None))[0] == plain


def test_the_reference_is_one_eager_gloo_process_of_the_same_workload_without_aborts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[tuple[str, int, list[str], Path]] = []

    class Recorded(_World):
        def __init__(
            self, name: str, size: int, argv: list[str], work: Path, started: list[_Rank]
        ) -> None:
            built.append((name, size, argv, work))

    monkeypatch.setattr(supervise, "_World", Recorded)
    settings = RunSettings(
        pp=3,
        dp=2,
        steps=9,
        spec=3,
        seed=5,
        requests=11,
        timeout_s=12.5,
        backend="nccl",
        interpreter="captured",
        overlap_agreement=True,
        validate_header=True,
        wire="packed",
    )
    _reference_world(settings, tmp_path / "ref", [])
    [(name, size, argv, work)] = built
    assert (name, size, work) == ("reference", 1, tmp_path / "ref")
    assert "--reference" in argv
    expected = attrs.evolve(
        settings, pp=1, dp=1, backend="gloo", interpreter="eager", overlap_agreement=False
    )
    assert _parsed(argv) == (expected, None, None)  # no logs or trace of its own


def test_nccl_needs_a_gpu_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    with pytest.raises(UsageError) as refused:
        _check_devices(RunSettings(pp=2, dp=2, backend="nccl"), CLI)
    assert "--backend nccl with --pp 2 --dp 2 needs 4 GPUs, found 3" in str(refused.value)
    with pytest.raises(UsageError) as refused:
        _check_devices(RunSettings(pp=2, dp=2, backend="nccl"), LAUNCH)
    assert str(refused.value) == (
        "launch: backend='nccl' with pp=2 dp=2 needs 4 GPUs, found 3. "
        "Fix: lower pp or dp, or use backend='gloo'"
    )
    _check_devices(RunSettings(pp=3, dp=1, backend="nccl"), CLI)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _check_devices(RunSettings(pp=2, dp=2, backend="gloo"), CLI)


# -- progress ------------------------------------------------------------------------------


def _progress_world(tmp_path: Path, processes: list[subprocess.Popen[bytes]]) -> _World:
    return _world([_rank(tmp_path, 0, _exited(processes, 0), Beat(0, 20, 1))], least_done=0)


def test_progress_in_a_log_is_a_line_per_tenth_of_the_run(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    world = _progress_world(tmp_path, processes)
    shown = [-1]
    for done in (0, 0, 1, 2, 3, 19, 20, 20):
        world._least_done = done
        _show_progress(world, shown)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "step     0/20 [                              ]",
        "step     2/20 [###                           ]",
        "step    19/20 [############################  ]",
        "step    20/20 [##############################]",
    ]
    nothing = _world([_rank(tmp_path, 1, _exited(processes, 0))])
    _show_progress(nothing, [-1])  # no beat yet: nothing to show
    assert capsys.readouterr().err == ""


def test_progress_on_a_terminal_redraws_one_line_when_a_step_ends(
    tmp_path: Path,
    processes: list[subprocess.Popen[bytes]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    world = _progress_world(tmp_path, processes)
    shown = [-1]
    for done in (0, 0, 1, 1, 20):
        world._least_done = done
        _show_progress(world, shown)
    err = capsys.readouterr().err
    assert err.split("\r") == [
        "",
        "  step     0/20 [                              ]",
        "  step     1/20 [#                             ]",
        "  step    20/20 [##############################]",
    ]


def test_on_a_terminal_the_bar_ends_its_line_when_the_run_ends(
    tmp_path: Path,
    processes: list[subprocess.Popen[bytes]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (tmp_path / "progress").mkdir()
    rank = _rank(tmp_path, 0, _exited(processes, 0))
    write_beat(rank.beat_path, Beat(done=20, total=20, count=9))
    supervise._wait([_world([rank])], timeout_s=1.0, show=_world([rank]))
    assert capsys.readouterr().err == f"step    20/20 [{'#' * 30}]\n"  # a log: no blank line
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    supervise._wait([_world([rank])], timeout_s=1.0, show=_world([rank]))
    assert capsys.readouterr().err == f"\r  step    20/20 [{'#' * 30}]\n"
