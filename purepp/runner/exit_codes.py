"""The exit codes of `purepp run` and `purepp check`, and those a rank process uses to
tell its launcher why it stopped."""

from __future__ import annotations

import enum
import signal

__all__ = ["Exit", "RankExit", "interrupted"]


class Exit(enum.IntEnum):
    """What `purepp` exits with. An interrupted run exits 128 + the signal's number."""

    OK = 0  # the run matched the single-stage run; the logs match
    FAILED = 1  # parity mismatch or nothing compared; `check` found a problem
    USAGE = 2  # refused before any process started: a bad option, path or log folder
    RANK_FAILED = 3  # a rank or the reference process crashed, stalled or timed out


def interrupted(signum: int) -> int:
    """The shell's convention: SIGINT (Ctrl-C) 130, SIGHUP 129, SIGTERM 143."""
    return 128 + int(signal.Signals(signum))


class RankExit(enum.IntEnum):
    """What a rank process (`python -m purepp.runner.worker`) exits with."""

    OK = 0
    PUREPP_ERROR = 3  # stopped on a PureppError that names its cause
    PEER_FAILURE = 4  # stopped because a peer died, stalled or timed out
    PARENT_GONE = 5  # the launcher died, so the rank stopped too
