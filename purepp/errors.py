"""Typed errors. Every message names the call, the offending value and the fix.

Expected protocol outcomes (nothing to consume, a stale slot) are values, not
exceptions; these classes are for caller mistakes and broken runs.
"""

from __future__ import annotations

__all__ = [
    "CollectiveMismatchError",
    "ConfigError",
    "InterpreterError",
    "InvalidInputError",
    "LogFormatError",
    "PeerFailureError",
    "PureppError",
    "StaleSyncError",
    "StaleTokenError",
    "WrongRankError",
]


class PureppError(Exception):
    """Root of every error purepp raises on purpose."""

    def __init__(self, call: str, problem: str, fix: str) -> None:
        self.call = call
        self.problem = problem
        self.fix = fix
        super().__init__(f"{call}: {problem}. Fix: {fix}")


class InvalidInputError(PureppError, ValueError):
    """An argument is out of range, of the wrong dtype or inconsistent with another."""


class ConfigError(PureppError, ValueError):
    """A static configuration cannot work (sizes below 1, a rank outside the group)."""


class WrongRankError(PureppError):
    """A relay step was called on a rank whose role does not perform it."""


class StaleSyncError(PureppError):
    """A DP agreement taken over one batch was reused for another."""


class LogFormatError(PureppError):
    """An effect log is truncated, corrupted, of another version or another layout."""


class CollectiveMismatchError(PureppError):
    """Ranks issued collectives that cannot match, or no rank can make progress."""


class InterpreterError(PureppError):
    """An effect refers to something the interpreter's environment does not hold."""


class PeerFailureError(PureppError):
    """A peer process died or stopped answering within the configured timeout."""


class StaleTokenError(PureppError):
    """A sampled token reached a request slot that now holds another request."""
