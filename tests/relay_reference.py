"""A plain mutable reference model of one rank's relay ring, and checks over values.

`ReferenceRelay` re-expresses the seed's deque logic directly (pre-seeded deque,
popleft + append(None), newest entry overwritten by receive, generation compare,
exclusion mask) with no device work, so the pure steps can be checked against it
step by step. It computes the need-sampled mask itself, from the definition in
the seeds' README, rather than calling purepp.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import attrs
import numpy as np
import numpy.typing as npt

from purepp.batch import BatchFacts

__all__ = ["ReferenceEntry", "ReferenceOutput", "ReferenceRelay", "arrays_in"]


@dataclass
class ReferenceEntry:
    """A pending receive: what the seed's PendingRecv holds on the host."""

    step: int  # the step that received it
    idx_mapping: npt.NDArray[np.int32]  # batch row -> slot at receive time
    need_sampled: npt.NDArray[np.bool_]  # rows that produced a token
    generations: npt.NDArray[np.int32]  # slot generations at receive time


@dataclass
class ReferenceOutput:
    """What a consume hands back."""

    received_at_step: int  # the step whose entry was consumed
    idx_mapping: npt.NDArray[np.int32]  # -1 for excluded rows
    filtered: bool  # whether any row was excluded (the seed copies a new mapping)


class ReferenceRelay:
    """One rank's ring and generation table, mutated in place like the seed's PPHandler."""

    def __init__(self, *, is_last_stage: bool, ring_depth: int, max_num_reqs: int) -> None:
        self.step = 0
        self.queue: deque[ReferenceEntry | None] = (
            deque() if is_last_stage else deque([None] * ring_depth)
        )
        self.generations = np.zeros(max_num_reqs, dtype=np.int32)

    def free(self, slot: int) -> None:
        self.generations[slot] += 1

    def receive(self, batch: BatchFacts) -> bool:
        computed = batch.num_computed_tokens.astype(np.int64)
        mask = computed + batch.num_scheduled_tokens >= batch.prefill_len
        if not mask.any():
            return False
        self.queue[-1] = ReferenceEntry(
            step=self.step,
            idx_mapping=np.array(batch.idx_mapping, dtype=np.int32),
            need_sampled=mask,
            generations=self.generations[batch.idx_mapping],
        )
        return bool(mask.all())

    def consume(self) -> ReferenceOutput | None:
        if not self.queue:
            return None
        entry = self.queue.popleft()
        self.queue.append(None)
        if entry is None:
            return None
        freed = self.generations[entry.idx_mapping] != entry.generations
        exclude = freed | ~entry.need_sampled
        if exclude.all():
            return None
        mapping = np.where(exclude, -1, entry.idx_mapping).astype(np.int32)
        return ReferenceOutput(entry.step, mapping, bool(exclude.any()))

    def end_step(self) -> None:
        self.step += 1


def arrays_in(value: object) -> Iterator[npt.NDArray[Any]]:
    """Every numpy array reachable from `value` through attrs fields, tuples and dicts."""
    if isinstance(value, np.ndarray):
        yield value
    elif attrs.has(type(value)):
        for field in attrs.fields(cast("type[attrs.AttrsInstance]", type(value))):
            yield from arrays_in(getattr(value, field.name))
    elif isinstance(value, tuple | list):
        for item in value:
            yield from arrays_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from arrays_in(item)
