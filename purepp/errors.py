"""Typed errors. Every message names the call, the offending value and the fix.

Expected protocol outcomes (nothing to consume, a stale slot) are values, not
exceptions; these classes are for caller mistakes and broken runs.
"""

from __future__ import annotations

__all__ = [
    "CollectiveMismatchError",
    "ConfigError",
    "HeaderMismatchError",
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

    def __reduce__(self) -> tuple[object, ...]:
        # Rebuilt from its message and attributes, not by calling __init__ again (whose
        # arguments Exception does not keep): pickling and copying work for every subclass.
        return (_rebuilt, (type(self), self.args, self.__dict__))


def _rebuilt(
    cls: type[PureppError], args: tuple[object, ...], state: dict[str, object]
) -> PureppError:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


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


class HeaderMismatchError(CollectiveMismatchError):
    """A received relay header [step, request count] differs from the receiver's own.

    Sender and receiver paired broadcasts of different steps or different batches.
    Raised by the numpy interpreter and by the torch interpreter on CPU; on CUDA the
    same check is a device-side assertion (see `purepp.effects.vocabulary.CheckHeader`).
    """

    def __init__(
        self,
        call: str,
        *,
        rank: int,
        step: int,
        expected: tuple[int, ...],
        received: tuple[int, ...],
    ) -> None:
        self.rank = rank  # the receiving rank
        self.step = step  # the step of its receive
        self.expected = expected  # the header it computed from its own state and batch
        self.received = received  # the header the sender broadcast
        if len(expected) == len(received) == 2 and expected[0] != received[0]:
            why = "this broadcast was sent at another step"
            fix = (
                "issue the relay's broadcasts and receives at every step on every stage (no "
                "data-dependent gate) and call end_step once per step"
            )
        else:
            why = "sender and receiver hold different batches for this step"
            fix = "pass every stage the same replicated batch (same rows, same order) at each step"
        super().__init__(
            call,
            f"rank {rank} received relay header {_header(received)} at step {step}"
            f" but expected {_header(expected)}: {why}",
            fix,
        )


def _header(values: tuple[int, ...]) -> str:
    if len(values) == 2:
        return f"[step {values[0]}, {values[1]} requests]"
    return str(list(values))
