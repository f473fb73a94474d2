"""Read-only numpy arrays as attrs fields.

Every array held by a state, an effect or a result is a private read-only copy,
so a caller mutating its own array never changes a value purepp handed back.
"""

from __future__ import annotations

import weakref
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

__all__ = [
    "ARRAY_EQ",
    "BoolArray",
    "IntArray",
    "arrays_equal",
    "bool_array",
    "int32_array",
    "readonly",
]

IntArray = npt.NDArray[np.int32]
BoolArray = npt.NDArray[np.bool_]


# Arrays this module made read-only, by id: they are shared instead of copied again, so
# `attrs.evolve` on a state does not copy every array it holds. Keyed weakly by id
# (ndarrays are unhashable), checked by identity.
_FROZEN: weakref.WeakValueDictionary[int, npt.NDArray[Any]] = weakref.WeakValueDictionary()


def readonly(values: npt.ArrayLike, dtype: type[np.generic]) -> npt.NDArray[Any]:
    """A read-only copy of `values` as a C-contiguous array of `dtype` (or `values`
    itself when it is already such an array made by this function)."""
    if _FROZEN.get(id(values)) is values and values.dtype == dtype:
        return values
    out = np.array(values, dtype=dtype, copy=True, order="C")
    out.flags.writeable = False
    _FROZEN[id(out)] = out
    return out


def arrays_equal(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> bool:
    """Equal dtype, shape and elements (numpy's `==` broadcasts; this does not)."""
    return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))


def _hash_array(a: npt.NDArray[Any]) -> int:
    return hash((a.dtype.str, a.shape, a.tobytes()))


# Compares read-only array fields by dtype, shape and content.
ARRAY_EQ = attrs.cmp_using(eq=arrays_equal, class_name="ReadOnlyArray")


def int32_array(values: npt.ArrayLike) -> IntArray:
    """Field converter: a read-only int32 copy (lists, tuples and arrays alike).

    Use as `attrs.field(converter=int32_array, eq=ARRAY_EQ, hash=False)`: written out
    in the class body, so mypy's attrs plugin types `__init__` from the converter.
    """
    out: IntArray = readonly(values, np.int32)
    return out


def bool_array(values: npt.ArrayLike) -> BoolArray:
    """Field converter: a read-only bool copy (see `int32_array`)."""
    out: BoolArray = readonly(values, np.bool_)
    return out
