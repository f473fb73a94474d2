"""Each rank's heartbeat: how far it got, and proof that the process still runs.

A daemon thread in every rank process rewrites one small file every
`BEAT_INTERVAL_S`: the steps done, the steps it will run, and a counter that
advances with every write. The launcher reads them to draw progress and to tell a
frozen rank (its counter stopped: SIGSTOP, or stuck in native code holding the
interpreter) from its peers, which keep beating while they wait in a collective.

Writes are atomic (a temporary file, then `os.replace`), so a reader sees a whole
beat or the previous one, never an empty file read as step 0.

The same thread watches the launcher: when the parent process is gone, the rank
exits rather than run on as an orphan (a backstop for Linux's parent-death signal,
which `purepp run` also sets, and the only guard elsewhere).
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

import attrs

from purepp.runner.exit_codes import RankExit

__all__ = [
    "BEAT_INTERVAL_S",
    "KILL_RANK_ENV",
    "PARENT_PID_ENV",
    "STOP_RANK_ENV",
    "STUCK_RANK_ENV",
    "Beat",
    "Heartbeat",
    "read_beat",
    "write_beat",
]

BEAT_INTERVAL_S = 0.25
PARENT_PID_ENV = "PUREPP_PARENT_PID"  # set by `purepp run`: a rank exits when it is gone

# Fault injection for tests, "RANK@STEP" (or "reference@STEP"): after that step, that
# rank of the run (or the reference process) kills itself with SIGKILL (dies), stops
# itself with SIGSTOP (freezes: alive, no heartbeat), or sleeps forever in Python
# (stuck: alive and beating, no progress).
KILL_RANK_ENV = "PUREPP_FAULT_KILL_RANK"
STOP_RANK_ENV = "PUREPP_FAULT_STOP_RANK"
STUCK_RANK_ENV = "PUREPP_FAULT_STUCK_RANK"


@attrs.frozen
class Beat:
    """One heartbeat of a rank."""

    done: int  # steps finished
    total: int  # steps the rank runs
    count: int  # beats written so far; stops advancing when the process does
    leaving: bool = False  # the rank is exiting (done or failed): no longer a sign of life


def write_beat(path: Path, beat: Beat) -> None:
    partial = path.with_name(path.name + ".partial")
    text = f"{beat.done} {beat.total} {beat.count} {int(beat.leaving)}\n"
    partial.write_text(text, encoding="ascii")
    os.replace(partial, path)


def read_beat(path: Path) -> Beat | None:
    """The rank's last beat, or None before its first (or if the file is not a beat)."""
    try:
        fields = path.read_text(encoding="ascii").split()
    except (OSError, UnicodeDecodeError):
        return None
    if len(fields) != 4 or not all(field.isdigit() for field in fields):
        return None
    done, total, count, leaving = map(int, fields)
    return Beat(done=done, total=total, count=count, leaving=leaving == 1)


class Heartbeat:
    """The beating thread of one rank. `path` None: no file (a rank run by torchrun
    without `purepp run`); `parent_pid`: exit when that process is no longer the parent."""

    def __init__(self, path: Path | None, *, total: int, parent_pid: int | None) -> None:
        self._path = path
        self._parent_pid = parent_pid
        self._done = 0
        self._total = total
        self._count = 0
        self._leaving = False
        self._stop = threading.Event()
        self._writing = threading.Lock()  # the loop's writes and the thread's share a file
        self._thread = threading.Thread(target=self._run, name="purepp-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._beat()
        self._thread.start()
        return self

    def step_done(self, done: int) -> None:
        """Called by the loop after each step: written at once, so a rank that freezes
        next is reported at the step it reached (a file write per step, ~50 us)."""
        self._done = done
        self._beat()

    def loop_ended(self, steps: int) -> None:
        """The loop is over after `steps` steps: shown as every step done while the
        results are gathered and written. A run that finished its requests early ran
        fewer steps than the bound it started with, so the total becomes those steps
        (the bar ends where the summary's step count does)."""
        self._total = steps
        self.step_done(steps)

    def leaving(self) -> None:
        """The rank exits (done or failed): say so and stop beating, so the launcher does
        not take the silence of its shutdown for a freeze."""
        self._leaving = True
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._beat()

    def _beat(self) -> None:
        if self._path is None:
            return
        with self._writing:
            self._count += 1
            beat = Beat(
                done=self._done, total=self._total, count=self._count, leaving=self._leaving
            )
            # OSError: the launcher removed the folder, so it is stopping us anyway.
            with contextlib.suppress(OSError):
                write_beat(self._path, beat)

    def _run(self) -> None:
        while not self._stop.wait(BEAT_INTERVAL_S):
            if self._parent_pid is not None and os.getppid() != self._parent_pid:
                os._exit(RankExit.PARENT_GONE)
            self._beat()
