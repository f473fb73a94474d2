"""Per-step batch facts, replicated on every rank, and the need-sampled mask."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from purepp.effects.arrays import ARRAY_EQ, BoolArray, IntArray, frozen
from purepp.errors import InvalidInputError

__all__ = ["BatchFacts", "need_sampled_mask"]

_INT32_MAX = int(np.iinfo(np.int32).max)


def _counts(name: str, values: npt.ArrayLike, rows: int | None) -> IntArray:
    """`values` as an immutable int32 row vector, or a typed error naming `name`.

    Floats, bools and strings are refused, not cast: a float slot would be truncated
    and a bool mask read as slots 0 and 1, both silently naming the wrong request.
    """
    call = "BatchFacts"
    array = np.asarray(values)
    if array.size == 0:
        array = array.astype(np.int32)
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
        raise InvalidInputError(
            call, f"{name}={_shown(array)} has dtype {array.dtype}", f"pass {name} as integers"
        )
    if array.ndim != 1 or (rows is not None and array.shape[0] != rows):
        raise InvalidInputError(
            call,
            f"{name} has shape {array.shape} but idx_mapping has {rows} rows",
            "pass one entry per batch row in every array",
        )
    if array.size and (int(array.min()) < 0 or int(array.max()) > _INT32_MAX):
        raise InvalidInputError(
            call,
            f"{name}={_shown(array)} holds a value outside 0..{_INT32_MAX}",
            "counts and slots are non-negative int32 values",
        )
    out: IntArray = frozen(array.astype(np.int32, copy=False))
    return out


def _shown(array: npt.NDArray[Any]) -> str:
    values = array.reshape(-1)[:8].tolist()
    return f"{values}{'...' if array.size > 8 else ''}"


@attrs.frozen(init=False)
class BatchFacts:
    """The host-side facts of one step's batch that every rank shares.

    All arrays are immutable int32, one entry per batch row; validated once, here.
    """

    idx_mapping: IntArray = attrs.field(eq=ARRAY_EQ, hash=False)  # batch row -> request slot
    num_computed_tokens: IntArray = attrs.field(eq=ARRAY_EQ, hash=False)  # tokens computed
    num_scheduled_tokens: IntArray = attrs.field(eq=ARRAY_EQ, hash=False)  # scheduled now
    prefill_len: IntArray = attrs.field(eq=ARRAY_EQ, hash=False)  # prompt length to finish
    # rows that produce a sampled token this step (None: no row does), computed once
    sampled_mask: BoolArray | None = attrs.field(eq=False, repr=False)
    # derived once here, read by every relay step: whether every row samples, and the
    # largest slot (-1 for an empty batch)
    all_sampled: bool = attrs.field(eq=False, repr=False)
    max_slot: int = attrs.field(eq=False, repr=False)

    def __init__(
        self,
        *,
        idx_mapping: npt.ArrayLike,
        num_computed_tokens: npt.ArrayLike,
        num_scheduled_tokens: npt.ArrayLike,
        prefill_len: npt.ArrayLike,
    ) -> None:
        slots = _counts("idx_mapping", idx_mapping, None)
        rows = slots.shape[0]
        if np.unique(slots).shape[0] != rows:
            values, seen = np.unique(slots, return_counts=True)
            raise InvalidInputError(
                "BatchFacts",
                f"idx_mapping maps several rows to slot {int(values[seen > 1][0])}",
                "give every batch row its own request slot",
            )
        computed = _counts("num_computed_tokens", num_computed_tokens, rows)
        scheduled = _counts("num_scheduled_tokens", num_scheduled_tokens, rows)
        prefill = _counts("prefill_len", prefill_len, rows)
        # int64 sum: two int32 counts near the limit must not wrap.
        mask = computed.astype(np.int64) + scheduled >= prefill
        sampled = frozen(mask) if mask.any() else None
        self.__attrs_init__(
            slots,
            computed,
            scheduled,
            prefill,
            sampled,
            sampled is not None and bool(mask.all()),
            int(slots.max()) if rows else -1,
        )

    @property
    def num_reqs(self) -> int:
        return int(self.idx_mapping.shape[0])


def need_sampled_mask(batch: BatchFacts) -> BoolArray | None:
    """Rows that produce a sampled token this step; None when no row does.

    A row samples once its computed plus scheduled tokens reach the prefill
    length: a non-final prefill chunk produces nothing to relay.
    """
    return batch.sampled_mask
