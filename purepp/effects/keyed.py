"""Effects that carry their structure key: a pure step says what shape its batch has.

A step plan (purepp.effects.plan) is found by the batch's *structure*: its effects with
the names abstracted to positions. Computing that from the effects costs about a
microsecond per effect on every batch. The pure step that built the batch already
knows what decided its shape (the configuration, the row count, the branch it took),
so it can hand that over as a cheap hashable key.

`KeyedEffects` IS a tuple of effects: every consumer of `Step.effects` keeps working,
and equality ignores the key. Any edit yields a plain tuple (slicing, concatenation,
`attrs.evolve(step, effects=...)` with a new tuple), which a planner treats as unkeyed,
so a key can never outlive the effects it describes.

The contract a step must keep: two batches with equal keys have equal structures.
Put into the key everything the effect kinds, shapes, dtypes, streams, communicators,
sources and the recurrence of names depend on, and the operation's name, so two steps'
keys never meet. (tests/test_keyed_effects.py checks it over random schedules.)
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

from purepp.effects.vocabulary import Effect

__all__ = ["KeyedEffects"]


class KeyedEffects(tuple[Effect, ...]):
    """A batch of effects with `structure`: equal keys promise equal abstracted structures."""

    structure: Hashable  # the key (a tuple subclass cannot have slots: it lives in __dict__)

    def __new__(cls, effects: Iterable[Effect], structure: Hashable) -> KeyedEffects:
        made = super().__new__(cls, effects)
        made.structure = structure
        return made

    def __reduce__(self) -> tuple[Any, ...]:
        return (KeyedEffects, (tuple(self), self.structure))
