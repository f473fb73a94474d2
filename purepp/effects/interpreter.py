"""What every interpreter offers: perform a step's effects, in order.

The torch and numpy interpreters, the recorder and the runner's tracer
(`purepp.runner.trace`) all satisfy `Interpreter` structurally; nothing subclasses it.
"""

from __future__ import annotations

from typing import Protocol

from purepp.effects.vocabulary import Effect

__all__ = ["Interpreter"]


class Interpreter(Protocol):
    """Gives effects meaning: runs them on devices, records them, or simulates them."""

    def perform(self, effects: tuple[Effect, ...], /) -> None:
        """Perform `effects` in order; return when all have been issued.

        Positional-only, so an implementation may name its parameter as it likes.
        """
