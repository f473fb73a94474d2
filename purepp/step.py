"""The one step contract: every pure step returns `Step(state, effects, result)`."""

from __future__ import annotations

from typing import Generic, TypeVar

import attrs

from purepp.effects.vocabulary import Effect

__all__ = ["Step"]

StateT = TypeVar("StateT")
ResultT = TypeVar("ResultT")


@attrs.frozen
class Step(Generic[StateT, ResultT]):
    """What a pure step returns. A reader who knows one step knows them all."""

    state: StateT  # the new state (the input state is never mutated)
    effects: tuple[Effect, ...]  # what an interpreter must perform, in order
    result: ResultT  # the step's answer to its caller
