"""Per-step batch facts, replicated on every rank, and the need-sampled mask."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from purepp._checks import INT32_MAX, host_array
from purepp._text import a_type
from purepp.effects.arrays import ARRAY_EQ, BoolArray, IntArray, reduce_frozen
from purepp.errors import InvalidInputError

__all__ = ["BatchFacts", "need_sampled_mask"]

_FIELDS = ("idx_mapping", "num_computed_tokens", "num_scheduled_tokens", "prefill_len")
_INT32 = np.dtype(np.int32)
# The byte of a native int32 that holds its sign bit.
_SIGN_BYTE = 3 if sys.byteorder == "little" else 0


def _int32_rows(given: tuple[npt.ArrayLike, ...]) -> IntArray:
    """The four arrays as the rows of one immutable int32 [4, rows] block, checked.

    One block, so a step pays one copy and one range check for all four. Floats, bools
    and strings are refused, not cast: a float slot would be truncated and a bool mask
    read as slots 0 and 1, both silently naming the wrong request.
    """
    arrays: Sequence[Any] = given
    # Most callers pass 1-D int32 arrays, which need no conversion: only their lengths
    # are compared. (A dtype equal to int32 but not numpy's own object takes the long way.)
    for array in given:
        if type(array) is not np.ndarray or array.dtype is not _INT32 or array.ndim != 1:
            arrays = [_int32_row(name, values) for name, values in zip(_FIELDS, given, strict=True)]
            break
    rows = arrays[0].shape[0]
    for name, array in zip(_FIELDS[1:], arrays[1:], strict=True):
        if array.shape[0] != rows:
            raise InvalidInputError(
                "BatchFacts",
                f"{name} has {array.shape[0]} entries but idx_mapping has {rows} rows",
                "pass one entry per batch row in every array",
            )
    # One immutable copy of the four, from their bytes (bytes.join reads contiguous
    # arrays directly; a strided one is copied to bytes first).
    try:
        raw = b"".join(arrays)
    except TypeError:
        raw = b"".join([array.tobytes() for array in arrays])
    # int32 values cannot exceed the int32 range: only a negative value is left to find,
    # and a negative int32 is one whose most significant byte has its top bit set, which
    # bytes.isascii() tests for every value at once in C.
    if not raw[_SIGN_BYTE::4].isascii():
        flat = np.frombuffer(raw, dtype=np.int32)
        first = int(np.flatnonzero(flat < 0)[0]) // rows
        raise _out_of_range(_FIELDS[first], arrays[first])
    out: IntArray = np.frombuffer(raw, dtype=np.int32).reshape(4, rows)
    return out


def _int32_row(name: str, values: npt.ArrayLike) -> npt.NDArray[Any]:
    """One of the four as a 1-D integer array that fits int32 (the long way: a list, another
    integer dtype, a cast)."""
    call = "BatchFacts"
    array = host_array(call, name, values)
    if array.size == 0:
        array = array.astype(np.int32)
    if array.dtype.kind not in "iu":  # bool is kind "b"
        raise InvalidInputError(
            call, f"{name}={_shown(array)} has dtype {array.dtype}", f"pass {name} as integers"
        )
    if array.ndim != 1:
        raise InvalidInputError(
            call, f"{name} has shape {array.shape}", f"pass {name} as a 1-D array"
        )
    if array.dtype != _INT32:
        if array.size and (int(array.min()) < 0 or int(array.max()) > INT32_MAX):
            raise _out_of_range(name, array)
        array = array.astype(np.int32)
    return array


def _out_of_range(name: str, array: npt.NDArray[Any]) -> InvalidInputError:
    return InvalidInputError(
        "BatchFacts",
        f"{name}={_shown(array)} holds a value outside 0..{INT32_MAX}",
        f"pass {name} as values in 0..{INT32_MAX} (slots and token counts are non-negative)",
    )


def _shown(array: npt.NDArray[Any]) -> str:
    values = array.reshape(-1)[:8].tolist()
    return f"{values}{'...' if array.size > 8 else ''}"


@attrs.frozen(init=False)
class BatchFacts:
    """The host-side facts of one step's batch that every rank shares.

    All arrays are immutable int32, one entry per batch row; validated once, here.
    """

    __reduce__ = reduce_frozen  # its arrays stay frozen in a copy

    idx_mapping: IntArray = attrs.field(eq=ARRAY_EQ, hash=False)  # batch row -> request slot
    num_computed_tokens: IntArray = attrs.field(eq=ARRAY_EQ, hash=False)  # tokens computed
    num_scheduled_tokens: IntArray = attrs.field(eq=ARRAY_EQ, hash=False)  # scheduled now
    prefill_len: IntArray = attrs.field(eq=ARRAY_EQ, hash=False)  # prompt length to finish
    # rows that produce a sampled token this step (None: no row does), computed once
    sampled_mask: BoolArray | None = attrs.field(init=False, eq=False, repr=False)
    # derived once here, read by every relay step: whether every row samples, and the
    # largest slot (-1 for an empty batch)
    # (derived, so not arguments: attrs.evolve passes the four arrays and gets them anew)
    all_sampled: bool = attrs.field(init=False, eq=False, repr=False)
    max_slot: int = attrs.field(init=False, eq=False, repr=False)

    def __init__(
        self,
        *,
        idx_mapping: npt.ArrayLike,
        num_computed_tokens: npt.ArrayLike,
        num_scheduled_tokens: npt.ArrayLike,
        prefill_len: npt.ArrayLike,
    ) -> None:
        block = _int32_rows((idx_mapping, num_computed_tokens, num_scheduled_tokens, prefill_len))
        # Row views of one immutable block (indexing: a third of unpacking's cost).
        slots, computed, scheduled, prefill = block[0], block[1], block[2], block[3]
        rows = slots.shape[0]
        ordered = slots.copy()
        ordered.sort()
        repeated = ordered[1:] == ordered[:-1]
        if np.count_nonzero(repeated):
            raise InvalidInputError(
                "BatchFacts",
                f"idx_mapping maps several rows to slot {int(ordered[1:][repeated][0])}",
                "give every batch row its own request slot",
            )
        # computed + scheduled >= prefill, without an int32 sum that could wrap: every
        # value is >= 0, so prefill - scheduled stays inside int32.
        mask = computed >= prefill - scheduled
        sampling = int(np.count_nonzero(mask))
        sampled = np.frombuffer(mask.tobytes(), dtype=np.bool_) if sampling else None
        self.__attrs_init__(slots, computed, scheduled, prefill)
        set_field = object.__setattr__
        set_field(self, "sampled_mask", sampled)
        set_field(self, "all_sampled", sampling == rows and rows > 0)
        set_field(self, "max_slot", int(ordered[-1]) if rows else -1)

    @property
    def num_reqs(self) -> int:
        return int(self.idx_mapping.shape[0])


def need_sampled_mask(batch: BatchFacts) -> BoolArray | None:
    """Rows that produce a sampled token this step; None when no row does.

    A row samples once its computed plus scheduled tokens reach the prefill
    length: a non-final prefill chunk produces nothing to relay.
    """
    if type(batch) is not BatchFacts:
        raise InvalidInputError(
            "need_sampled_mask", f"batch is {a_type(batch)}", "pass the step's BatchFacts"
        )
    return batch.sampled_mask
