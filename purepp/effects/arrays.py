"""Read-only numpy arrays as attrs fields.

Every array held by a state, an effect or a result is a private read-only copy,
so a caller mutating its own array never changes a value purepp handed back.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

__all__ = ["BoolArray", "IntArray", "array_field", "arrays_equal", "readonly"]

IntArray = npt.NDArray[np.int32]
BoolArray = npt.NDArray[np.bool_]


def readonly(values: npt.ArrayLike, dtype: type[np.generic]) -> npt.NDArray[Any]:
    """A read-only copy of `values` as a C-contiguous array of `dtype`."""
    out = np.array(values, dtype=dtype, copy=True, order="C")
    out.flags.writeable = False
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
