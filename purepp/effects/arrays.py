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

__all__ = ["BoolArray", "IntArray", "array_field", "arrays_equal", "readonly"]

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


_array_cmp = attrs.cmp_using(eq=arrays_equal, class_name="ReadOnlyArray")


def array_field(dtype: type[np.generic]) -> Any:
    """An attrs field holding a read-only copy of its value, compared by content."""

    def convert(values: npt.ArrayLike) -> npt.NDArray[Any]:
        return readonly(values, dtype)

    return attrs.field(converter=convert, eq=_array_cmp, hash=False)
