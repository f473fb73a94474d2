"""Start a run's rank processes and the single-stage reference, watch them, and stop
them all whatever happens: a rank that crashes or freezes, Ctrl-C, SIGTERM, SIGHUP,
or the launcher itself dying.

Watching: every rank beats (`purepp.runner.progress`). A rank whose beat stops is
frozen (SIGSTOP, or stuck outside Python); its peers keep beating while they wait
for it in a collective, so the report names the frozen rank rather than the peer
whose collective timed out first. The reference process is watched the same way.

Stopping: the ranks run in their own sessions (Ctrl-C reaches only the launcher,
which stops them in order), carry Linux's parent-death signal (SIGKILL when the
launcher dies, even by SIGKILL) and watch their parent themselves. The run's
temporary folder has a sweeper process that removes it once the launcher is gone,
even by SIGKILL. No torch here.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType

import attrs

from purepp._text import a_type
from purepp.effects import logfile
from purepp.errors import InvalidInputError
from purepp.runner.exit_codes import RankExit
from purepp.runner.options import (
    LAUNCH,
    Spelling,
    UsageError,
    check_log_dir,
    check_trace,
)
from purepp.runner.progress import PARENT_PID_ENV, Beat, read_beat
from purepp.runner.results import RankResult, ResultsError, read_results
from purepp.runner.settings import RunSettings
from purepp.runner.summary import RunSummary, summarise

__all__ = [
    "LOCK_FILE",
    "Interrupted",
    "RankFailure",
    "launch",
    "summarise_against_reference",
    "without_source_paths",
    "worker_argv",
]

LOCK_FILE = logfile.LOCK_FILE  # in --log-dir, held by the run writing there (purepp check reads it)

_POLL_S = 0.1
_SETTLE_S = 1.0  # after a failure, for its peers to fail too before blaming one
_SILENT_S = 2.0  # a live rank this long without a beat, when a peer failed, is frozen
_STOP_GRACE_S = 3.0  # SIGTERM, then SIGKILL
# Nothing advanced for the timeout plus a margin: a hang. Starting (torch's import and
# the rendezvous, on a loaded machine) and ending (gathering and writing the results)
# get a long one. In the loop, a lone process (the reference) gets a short one; ranks
# with peers a longer one, so their collective timeouts come first: those leave the
# rank they waited for as the one still working, which names it best.
_START_MARGIN_S = 30.0
_ALONE_MARGIN_S = 2.0
_PEERS_MARGIN_S = 10.0


class RankFailure(Exception):
    """A rank or the reference cannot finish; the message is one line for the user."""


class Interrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP reached the launcher; every process was stopped."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


# -- stopping ---------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec function that makes the child get SIGKILL when this process dies."""
    if not sys.platform.startswith("linux") or threading.active_count() > 1:
        # Elsewhere, and where a fork could copy another thread's held lock into the
        # child (a torchrun rank running the reference), the rank's own parent watch
        # (progress.Heartbeat) is the guard.
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(RankExit.PARENT_GONE)

    return preexec


@contextlib.contextmanager
def _signals_stop_the_run() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise Interrupted once; later ones are ignored while
    the processes are being stopped, so a second Ctrl-C cannot leave orphans."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread can take signals; its caller owns them
        return
    raised = False

    def handler(signum: int, _: FrameType | None) -> None:
        nonlocal raised
        if not raised:
            raised = True
            raise Interrupted(signum)

    caught = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {signum: signal.signal(signum, handler) for signum in caught}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


@contextlib.contextmanager
def _log_dir_lock(folder: Path, run_id: str, spelling: Spelling) -> Iterator[None]:
    """Hold `folder/.purepp.lock` for the run: a second run there is refused."""
    path = folder / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:  # a folder of that name, another user's lock file
        raise UsageError(
            spelling.call,
            f"{spelling.given('log_dir', str(folder))} cannot be locked: {path} cannot be "
            f"opened ({logfile.os_reason(error)})",
            f"remove {path} if no run uses the folder, or pass another {spelling.name('log_dir')}",
        ) from error
    try:
        held = logfile.lock_log_dir(fd, f"{os.getpid()} {run_id}")
        if held is not None:
            if held.writer is None:
                user = "purepp check, reading it over and over"
            else:
                pid = held.writer.split()[:1]
                user = f"another purepp run{f' (pid {pid[0]})' if pid else ''}"
            raise UsageError(
                spelling.call,
                f"{spelling.given('log_dir', str(folder))} is in use by {user}",
                f"wait for it to finish, or pass another {spelling.name('log_dir')}",
            )
        yield
    finally:
        os.close(fd)  # releases the lock


# -- the processes of one world ---------------------------------------------------------


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_STORE_PORTS = 12_000  # how many ports below the ephemeral range to choose from
# Ports this launcher chose: the run's and the reference's worlds are started before
# either's rank 0 listens, so a check alone would not keep them apart.
_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for bind(0) and outgoing connections."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _can_listen(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore does
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _free_port() -> int:
    """A port for a world's TCPStore, chosen below the kernel's ephemeral range. A
    port from bind(0) is an ephemeral one: between our check and rank 0's listen,
    the other world's gloo connections can take it as their local end, and the
    rendezvous fails with "address already in use". No connection takes a port
    below that range, so only another listener could, and the check skips those."""
    low = _ephemeral_low()
    first = max(1024, low - _STORE_PORTS)
    chooser = random.SystemRandom()
    # No port below the range that a user process may take (a range from 1024 up):
    # straight to an ephemeral one.
    for _ in range(64 if first < low else 0):
        port = chooser.randrange(first, low)
        if port not in _HANDED_OUT and _can_listen(port):
            _HANDED_OUT.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))  # all of them taken, or none: an ephemeral one
        return int(sock.getsockname()[1])


def _own_environment() -> dict[str, str]:
    """This process's environment without a launcher's rendezvous settings: under
    torchrun, TORCHELASTIC_* would make a new world join torchrun's store."""
    return {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}


# Library source locations in messages, e.g. "[../third_party/gloo/.../pair.cc:446]".
_SOURCE_PATH = re.compile(
    r"\s*\[[^\]\s]*\.(?:cc|cpp|cu|h|hpp|c|py):\d+\]|\S+\.(?:cc|cpp|cu|h|hpp|py):\d+:?"
)
_RANK_PREFIX = re.compile(r"^purepp: rank \d+: ")
_TORCH_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")  # torch's prefix on a rank's stderr


def without_source_paths(line: str) -> str:
    """`line` without library source locations such as `[.../pair.cc:446]`."""
    return " ".join(_SOURCE_PATH.sub("", line).split())


def _one_line(text: str) -> str:
    """The message a rank left, without library source paths."""
    lines = [_TORCH_RANK_PREFIX.sub("", line.strip()) for line in text.splitlines()]
    lines = [line for line in lines if line]
    ours = [line for line in lines if _RANK_PREFIX.match(line)]
    line = (ours or lines or ["(no message)"])[-1]
    return without_source_paths(_RANK_PREFIX.sub("", line))


def _is_stopped(pid: int) -> bool:
    """Whether the process is stopped by a signal (SIGSTOP, SIGTSTP), where /proc says."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[-1].split()
    return bool(fields) and fields[0] in ("T", "t")


def _blame_order(code: int) -> int:
    """Which exit to report first: a named cause, a rank killed by a signal, any
    other crash, and last the peers that failed because of it."""
    if code == RankExit.PUREPP_ERROR:
        return 0
    if code < 0:
        return 1
    return 3 if code in (RankExit.PEER_FAILURE, RankExit.PARENT_GONE) else 2


@attrs.define
class _Rank:
    rank: int
    process: subprocess.Popen[bytes]
    stderr_path: Path
    beat_path: Path
    beat: Beat | None = None  # the last whole beat read
    beat_changed_at: float = 0.0  # monotonic time the beat count last advanced
    done_changed_at: float = 0.0  # monotonic time the steps done last advanced

    def observe(self, now: float) -> None:
        beat = read_beat(self.beat_path)
        if beat is None:
            return  # not started, or between files: keep the last one read
        if self.beat is None or beat.count != self.beat.count:
            self.beat_changed_at = now
        if self.beat is None or beat.done != self.beat.done:
            self.done_changed_at = now
        self.beat = beat

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    @property
    def working(self) -> bool:
        """Running and not on its way out after a failure of its own."""
        return self.running and not (self.beat is not None and self.beat.leaving)

    @property
    def done_steps(self) -> int:
        return -1 if self.beat is None else self.beat.done


class _World:
    """The rank processes of one run (or of the reference), started like torchrun
    starts them."""

    def __init__(
        self, name: str, size: int, argv: list[str], work: Path, started: list[_Rank]
    ) -> None:
        self.name = name
        self.work = work
        beats = work / "progress"
        beats.mkdir(parents=True)
        port = _free_port()
        preexec = _die_with_parent()
        self.started_at = time.monotonic()
        self.ranks: list[_Rank] = []
        for rank in range(size):
            env = dict(
                _own_environment(),
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(size),
                LOCAL_WORLD_SIZE=str(size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                **{PARENT_PID_ENV: str(os.getpid())},
            )
            stderr_path = work / f"rank{rank}.stderr"
            command = [sys.executable, "-m", "purepp.runner.worker", *argv]
            command += ["--out", str(work), "--progress-dir", str(beats)]
            with stderr_path.open("wb") as stderr:
                process = subprocess.Popen(
                    command,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                    start_new_session=True,  # Ctrl-C reaches us; we stop them
                    preexec_fn=preexec,  # noqa: PLW1509  # None in a threaded launcher
                )
            entry = _Rank(rank, process, stderr_path, beats / f"rank{rank}")
            entry.beat_changed_at = entry.done_changed_at = self.started_at
            started.append(entry)
            self.ranks.append(entry)
        self._least_done = -1
        self._least_done_at = self.started_at

    def label(self, rank: int) -> str:
        return f"rank {rank}" if self.name == "run" else "the reference process"

    def observe(self, now: float) -> None:
        for rank in self.ranks:
            rank.observe(now)
        least = min(rank.done_steps for rank in self.ranks)
        if least != self._least_done:
            self._least_done, self._least_done_at = least, now

    def progress(self) -> tuple[int, int]:
        """The slowest rank's steps done, and the steps it runs (0 before any beat)."""
        totals = [rank.beat.total for rank in self.ranks if rank.beat is not None]
        return max(self._least_done, 0), max(totals, default=0)

    def done(self) -> bool:
        return all(rank.process.poll() == 0 for rank in self.ranks)

    def _frozen(self, now: float, silent_s: float, starting_s: float = 0.0) -> str | None:
        """A live rank whose beat stopped for `silent_s` (plus `starting_s` before its
        first step, unless /proc says it is stopped: loading torch can hold the
        interpreter a while), named with where it stopped."""

        def silent_too_long(rank: _Rank) -> bool:
            quiet = now - rank.beat_changed_at
            if not rank.working or quiet < silent_s:
                return False
            if rank.beat is None:  # never beat: frozen for sure only if stopped
                return _is_stopped(rank.process.pid)
            return (
                quiet >= silent_s + starting_s
                or rank.beat.done > 0
                or _is_stopped(rank.process.pid)
            )

        silent = [
            (now - rank.beat_changed_at, rank) for rank in self.ranks if silent_too_long(rank)
        ]
        quiet_for, rank = max(silent, key=lambda item: item[0], default=(0.0, None))
        if rank is None:
            return None
        why = (
            "its process is stopped by a signal such as SIGSTOP"
            if _is_stopped(rank.process.pid)
            else "it is stuck outside Python, or starved of CPU"
        )
        where = (
            f"after step {rank.beat.done} of {rank.beat.total}"
            if rank.beat is not None and rank.beat.done
            else "before its first step"
        )
        return (
            f"{self.label(rank.rank)} froze {where}: no heartbeat for {quiet_for:.1f} s, "
            f"{why}; its peers wait for it"
        )

    def _stuck_first(self, ranks: Sequence[_Rank]) -> _Rank:
        """Of `ranks`, the one whose progress stopped advancing first (then the fewest
        steps): the rank the others ended up waiting for."""
        return min(ranks, key=lambda rank: (rank.done_changed_at, rank.done_steps, rank.rank))

    def _behind(self) -> str | None:
        """After peers gave up waiting (timeouts, closed connections), the live rank
        they waited for: a rank waiting on them would have given up too."""
        running = [rank for rank in self.ranks if rank.working]
        if not running:
            return None
        slowest = self._stuck_first(running)
        where = (
            f"after step {slowest.done_steps}"
            if slowest.done_steps > 0
            else "before its first step"
        )
        return (
            f"{self.label(slowest.rank)} stopped advancing {where} (alive and beating, "
            "but stuck or far too slow); its peers timed out waiting for it"
        )

    def failure(self) -> str | None:
        """A one-line message naming the rank that started a failure, else None."""
        if all(rank.process.poll() in (None, 0) for rank in self.ranks):
            return None
        # One rank's failure makes its peers fail too (connection closed, timeout);
        # after a moment for them to exit, blame the cause, not the first to notice.
        time.sleep(_SETTLE_S)
        self.observe(time.monotonic())
        failures = [
            (rank, code) for rank in self.ranks if (code := rank.process.poll()) not in (None, 0)
        ]
        rank, code = min(failures, key=lambda item: (_blame_order(item[1]), item[0].rank))
        if _blame_order(code) == 3:
            named = self._frozen(time.monotonic(), _SILENT_S) or self._behind()
            if named is not None:
                return named
        who = self.label(rank.rank)
        if code < 0:
            return f"{who} was killed by {signal.Signals(-code).name}"
        message = _one_line(rank.stderr_path.read_text(errors="replace"))
        return f"{who} failed (exit {code}): {message}"

    def frozen(self, now: float, timeout_s: float) -> str | None:
        """A live rank silent for the whole collective timeout, before anyone gives up
        (when its peers give up first, `failure` names it all the same)."""
        return self._frozen(now, timeout_s, starting_s=_START_MARGIN_S)

    def hung(self, now: float, timeout_s: float) -> str | None:
        """Nothing advanced for the timeout though every rank beats: name the one behind
        (what catches a stuck reference, which has no peer to time out)."""
        _, total = self.progress()
        in_loop = 0 < self._least_done < total
        if not in_loop:
            margin = _START_MARGIN_S
        else:
            margin = _ALONE_MARGIN_S if len(self.ranks) == 1 else _PEERS_MARGIN_S
        limit_s = timeout_s + margin
        if now - self._least_done_at <= limit_s:
            return None
        slowest = self._stuck_first(self.ranks)
        where = (
            f"after step {slowest.done_steps}"
            if slowest.done_steps > 0
            else "before its first step"
        )
        return (
            f"{self.label(slowest.rank)} made no progress for {limit_s:.0f} s {where} "
            "(alive and beating, but stuck or far too slow)"
        )

    def results(self) -> tuple[RankResult, ...]:
        try:
            return read_results(self.work / "results.json")
        except ResultsError as error:
            raise RankFailure(f"{self.name}: every rank exited 0 but {error.problem}") from error


def _stop(ranks: Sequence[_Rank]) -> None:
    """SIGTERM (and SIGCONT, so a stopped rank can take it), then SIGKILL stragglers."""
    for rank in ranks:
        if rank.running:
            for signum in (signal.SIGTERM, signal.SIGCONT):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(rank.process.pid, signum)
    deadline = time.monotonic() + _STOP_GRACE_S
    for rank in ranks:
        try:
            rank.process.wait(timeout=max(deadline - time.monotonic(), 0.05))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(rank.process.pid, signal.SIGKILL)
            rank.process.wait()


# The sweeper: waits for the end of a pipe that only the launcher holds (closed when
# the launcher exits, however it exits: SIGKILL too), then removes the folder in argv[1],
# again while a dying rank still writes into it. Standard library only, so it starts fast.
_SWEEPER = """
import os, shutil, sys, time
sys.stdin.buffer.read()
deadline = time.monotonic() + 60
while os.path.lexists(sys.argv[1]) and time.monotonic() < deadline:
    shutil.rmtree(sys.argv[1], ignore_errors=True)
    time.sleep(0.1)
"""


@contextlib.contextmanager
def _temporary_folder(prefix: str) -> Iterator[Path]:
    """A new temporary folder, removed on exit, even when this process is SIGKILLed.

    No handler runs then, and the ranks die by their parent-death signal, so a
    sweeper process in its own session (Ctrl-C does not reach it) removes the folder
    once this process is gone; after a normal exit it finds nothing left to remove.
    """
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    read_end, write_end = os.pipe()  # neither is inherited by the ranks
    try:
        sweeper = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _SWEEPER, str(folder)],
            stdin=read_end,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    except BaseException:
        os.close(write_end)
        shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        os.close(read_end)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        os.close(write_end)
        with contextlib.suppress(subprocess.TimeoutExpired):
            sweeper.wait(timeout=_STOP_GRACE_S)


@contextlib.contextmanager
def _stopped_on_exit() -> Iterator[list[_Rank]]:
    started: list[_Rank] = []
    try:
        yield started
    finally:
        try:
            _stop(started)
        except Interrupted:  # the first signal came while stopping: stop the rest too
            _stop(started)  # (later signals are ignored)
            raise


# -- watching ---------------------------------------------------------------------------


def _show_progress(world: _World, last_shown: list[int]) -> None:
    """A bar on a terminal; elsewhere (a CI log) a line per tenth of the run."""
    reached, total = world.progress()
    if not total:
        return
    bar = "#" * (30 * min(reached, total) // total)
    line = f"  step {reached:>5}/{total} [{bar:<30}]"
    if sys.stderr.isatty():
        if reached != last_shown[0]:
            print(f"\r{line}", end="", file=sys.stderr, flush=True)
        last_shown[0] = reached
        return
    tenth = 10 * min(reached, total) // total
    if tenth != last_shown[0]:
        print(line.strip(), file=sys.stderr, flush=True)
        last_shown[0] = tenth


def _wait(worlds: Sequence[_World], timeout_s: float, show: _World | None) -> None:
    """Until every world is done; RankFailure when a rank fails, freezes or hangs.
    `show`: the world whose progress is drawn on stderr (None: draw nothing)."""
    last_shown = [-1]
    while not all(world.done() for world in worlds):
        now = time.monotonic()
        for world in worlds:
            world.observe(now)
        for world in worlds:
            if world.done():
                continue
            message = world.failure() or world.frozen(now, timeout_s) or world.hung(now, timeout_s)
            if message is not None:
                raise RankFailure(message)
        if show is not None:
            _show_progress(show, last_shown)
        time.sleep(_POLL_S)
    if show is None:
        return
    show.observe(time.monotonic())
    _show_progress(show, last_shown)
    if sys.stderr.isatty() and last_shown[0] >= 0:
        print(file=sys.stderr)


# -- a run ------------------------------------------------------------------------------


def worker_argv(settings: RunSettings, log_dir: str | None, trace: str | None) -> list[str]:
    """The rank processes' options for `settings`."""
    argv = [
        f"--pp={settings.pp}",
        f"--dp={settings.dp}",
        f"--steps={settings.steps}",
        f"--requests={settings.requests}",
        f"--spec={settings.spec}",
        f"--seed={settings.seed}",
        f"--backend={settings.backend}",
        f"--timeout={settings.timeout_s!r}",
        f"--wire={settings.wire}",
        f"--interpreter={settings.interpreter}",
        f"--num-layers={settings.num_layers}",
        f"--max-num-reqs={settings.max_num_reqs}",
        f"--max-num-batched-tokens={settings.max_num_batched_tokens}",
        f"--chunk-size={settings.chunk_size}",
        f"--capture-sizes={','.join(map(str, settings.capture_sizes))}",
    ]
    if settings.validate_header:
        argv.append("--validate-header")
    if settings.overlap_agreement:
        argv.append("--overlap-agreement")
    if log_dir is not None:
        argv.append(f"--log-dir={log_dir}")
    if trace is not None:
        argv.append(f"--trace={trace}")
    return argv


def _reference_world(settings: RunSettings, work: Path, started: list[_Rank]) -> _World:
    """The single-stage run of the same workload (same --steps), without aborts, on CPU."""
    # The plain rank step, eagerly, even when the run overlaps its agreement or runs plans
    # or graphs: parity compares the two.
    reference = attrs.evolve(
        settings, pp=1, dp=1, backend="gloo", overlap_agreement=False, interpreter="eager"
    )
    argv = [*worker_argv(reference, None, None), "--reference"]
    return _World("reference", 1, argv, work, started)


def _check_devices(settings: RunSettings, spelling: Spelling) -> None:
    if settings.backend != "nccl":
        return
    import torch  # only here: a gloo run's launcher never needs it

    nccl, gloo = spelling.given("backend", "nccl"), spelling.given("backend", "gloo")
    if not torch.cuda.is_available():
        raise UsageError(spelling.call, f"{nccl} needs CUDA, and none is available", f"use {gloo}")
    if torch.cuda.device_count() < settings.world_size:
        shape = f"{spelling.given('pp', settings.pp)} {spelling.given('dp', settings.dp)}"
        raise UsageError(
            spelling.call,
            f"{nccl} with {shape} needs {settings.world_size} GPUs, "
            f"found {torch.cuda.device_count()}",
            f"lower {spelling.name('pp')} or {spelling.name('dp')}, or use {gloo}",
        )


def _path_text(name: str, value: str | os.PathLike[str] | None) -> str | None:
    """A path argument as the text the ranks' options take; a Path as well as a str."""
    if value is None:
        return None
    text = value if isinstance(value, str) else None
    if isinstance(value, os.PathLike) and isinstance(path := os.fspath(value), str):
        text = path
    if text is None:
        raise UsageError(
            "launch", f"{name}={value!r} is not a path", f"pass {name} as a str or a pathlib.Path"
        )
    if "\0" in text:
        raise UsageError(
            "launch",
            f"{name}={value!r} holds a NUL character",
            f"pass {name} as a path without one",
        )
    return text


def _trace_clash(trace: str, log_dir: str, spelling: Spelling) -> str | None:
    """Why the trace cannot go where it is asked to, beside the log folder (links and `..`
    resolved); None when it can."""
    try:
        path, folder = Path(trace).resolve(), Path(log_dir).resolve()
    except (OSError, RuntimeError):  # a link loop: check_trace names it
        return None
    given = spelling.given("log_dir", log_dir)
    if path.parent == folder:
        return (
            f"is inside {given}, which holds the run's logs only "
            "(purepp check reads every *.jsonl there)"
        )
    if path == folder or path in folder.parents:
        return (
            f"is {given} or a folder above it, which the run makes a folder (a trace is one file)"
        )
    return None


def launch(
    settings: RunSettings,
    *,
    log_dir: str | os.PathLike[str] | None = None,
    trace: str | os.PathLike[str] | None = None,
    run_id: str | None = None,
    progress: bool = True,
    spelling: Spelling = LAUNCH,
) -> RunSummary:
    """Run the world and the single-stage reference side by side; summarise both.
    With `progress` the run's steps are drawn on stderr as it goes. Errors name
    `launch` and its arguments (`log_dir=...`); `purepp run` passes its flags'
    `spelling` (`--log-dir ...`). Every log header holds `run_id` (a fresh one when
    None, as `purepp run` makes) and the config's digest.

    Raises UsageError before anything starts (a bad path, a log folder in use),
    RankFailure when a rank or the reference fails, freezes or hangs, and
    Interrupted on SIGINT, SIGTERM or SIGHUP; every process is stopped and the
    temporary folder removed in each case.
    """
    if type(settings) is not RunSettings:
        raise UsageError(
            spelling.call, f"settings is {a_type(settings)}", "pass a RunSettings (its options)"
        )
    if type(progress) is not bool:
        raise spelling.refuse("progress", progress, "is not a bool", "pass True or False")
    if run_id is not None and (
        type(run_id) is not str or not run_id or run_id != run_id.strip() or "\0" in run_id
    ):
        fix = "pass a non-empty id without spaces around it (every log header holds it)"
        raise spelling.refuse("run_id", run_id, "is not a run id", fix)
    log_dir, trace = _path_text("log_dir", log_dir), _path_text("trace", trace)
    _check_devices(settings, spelling)
    clash = None if log_dir is None or trace is None else _trace_clash(trace, log_dir, spelling)
    if clash is not None:
        fix = f"write the trace to a file beside {log_dir}, not in it or above it"
        raise spelling.refuse("trace", trace, clash, fix)
    # The trace first: a run refused for it has made no log folder yet.
    if trace is not None:
        check_trace(trace, spelling=spelling)
    if log_dir is not None:
        check_log_dir(log_dir, spelling=spelling)
    argv = worker_argv(settings, log_dir, trace)
    if run_id is None:
        run_id = uuid.uuid4().hex
    argv.append(f"--run-id={run_id}")
    with contextlib.ExitStack() as stack:
        stack.enter_context(_signals_stop_the_run())
        if log_dir is not None:
            stack.enter_context(_log_dir_lock(Path(log_dir), run_id, spelling))
            # The folder must hold this run's logs only: `purepp check` reads every one.
            try:
                old_logs = logfile.rank_logs(spelling.call, Path(log_dir))
            except InvalidInputError as error:  # a file of a log's name that is no log
                raise UsageError(error.call, error.problem, error.fix) from error
            for old_log in old_logs.values():
                old_log.unlink()
        tmp = stack.enter_context(_temporary_folder("purepp-run-"))
        started = stack.enter_context(_stopped_on_exit())
        world = _World("run", settings.world_size, argv, tmp / "run", started)
        reference = _reference_world(settings, tmp / "ref", started)
        _wait([world, reference], settings.timeout_s, show=world if progress else None)
        return summarise(settings, world.results(), reference.results())
    raise AssertionError("unreachable: the with block returns or raises")  # for mypy


def summarise_against_reference(settings: RunSettings, results: Sequence[RankResult]) -> RunSummary:
    """Run the single-stage reference here and summarise `results` (the gathered
    results of a world started elsewhere, e.g. by torchrun) against it."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(_signals_stop_the_run())
        tmp = stack.enter_context(_temporary_folder("purepp-ref-"))
        started = stack.enter_context(_stopped_on_exit())
        reference = _reference_world(settings, tmp / "ref", started)
        _wait([reference], settings.timeout_s, show=reference)
        return summarise(settings, results, reference.results())
    raise AssertionError("unreachable: the with block returns or raises")
