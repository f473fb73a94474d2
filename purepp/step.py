"""The one step contract: every pure step returns `Step(state, effects, result)`."""

from __future__ import annotations

from typing import Generic, TypeVar

import attrs

from purepp.effects.vocabulary import Effect

__all__ = ["Step"]

# Covariant: a Step is immutable, so a step answering None is a step whose answer may
# be None (a swapped-in step typed `Step[RelayState, None]` plugs in where the real one
# answers `ConsumedOutputs | None`).
StateT_co = TypeVar("StateT_co", covariant=True)
ResultT_co = TypeVar("ResultT_co", covariant=True)


@attrs.frozen
class Step(Generic[StateT_co, ResultT_co]):
    """What a pure step returns. A reader who knows one step knows them all."""

    state: StateT_co  # the new state (the input state is never mutated)
    effects: tuple[Effect, ...]  # what an interpreter must perform, in order
    result: ResultT_co  # the step's answer to its caller
