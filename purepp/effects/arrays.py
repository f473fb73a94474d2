"""Immutable numpy arrays as attrs fields.

Every array held by a state, an effect or a result is a view of a `bytes` object:
read-only all the way down, so neither the array nor its base can be made writable
again (`flags.writeable = True` raises). Such an array is recognised in O(1) and
shared as it is, so the library never copies or re-validates an array it built itself.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

__all__ = [
    "ARRAY_EQ",
    "BoolArray",
    "IntArray",
    "arrays_equal",
    "freeze_fields",
    "frozen",
    "int32_array",
    "is_frozen",
    "readonly",
    "reduce_frozen",
]

IntArray = npt.NDArray[np.int32]
BoolArray = npt.NDArray[np.bool_]


def is_frozen(array: npt.NDArray[Any]) -> bool:
    """Whether `array` is a view of immutable memory (its base chain ends in `bytes`)."""
    if array.flags.writeable:
        return False
    base: object = array.base
    while isinstance(base, np.ndarray):
        base = base.base
    return type(base) is bytes


def frozen(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """`array` as a C-contiguous view of a fresh `bytes` copy (the dtype is kept)."""
    out = np.frombuffer(np.ascontiguousarray(array).tobytes(), dtype=array.dtype)
    return out.reshape(array.shape)


def readonly(values: npt.ArrayLike, dtype: type[np.generic]) -> npt.NDArray[Any]:
    """An immutable `dtype` array holding `values`: `values` itself when it already is one.

    The conversion follows numpy's casting; callers validate caller input before this.
    """
    if type(values) is np.ndarray and values.dtype == dtype and is_frozen(values):
        return values
    return frozen(np.asarray(values, dtype=dtype))


def reduce_frozen(value: Any) -> tuple[Any, ...]:
    """`__reduce__` for a frozen attrs class that holds immutable arrays.

    numpy does not keep an array read-only across pickle or deepcopy: the copy's
    arrays are frozen again, field by field, as the original's were.
    """
    cls = type(value)
    return (_refrozen, (cls, tuple(getattr(value, field.name) for field in attrs.fields(cls))))


def _refrozen(cls: type[Any], values: tuple[Any, ...]) -> Any:
    instance = object.__new__(cls)
    fields = attrs.fields(cls)
    for field, value in zip(fields, values, strict=True):
        object.__setattr__(instance, field.name, value)
    freeze_fields(instance, *(field.name for field in fields))
    return instance


def freeze_fields(instance: object, *names: str) -> None:
    """Replace each array field of a frozen `instance` that is not immutable by a frozen
    copy: a value built by hand (or unpickled) holds none of the caller's writable
    memory. The library's own values, built frozen by trusted constructors, skip this."""
    for name in names:
        value = getattr(instance, name)
        if isinstance(value, np.ndarray) and not is_frozen(value):
            object.__setattr__(instance, name, frozen(value))


def arrays_equal(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> bool:
    """Equal dtype, shape and elements (numpy's `==` broadcasts; this does not)."""
    return a is b or (a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b)))


# Compares immutable array fields by dtype, shape and content.
ARRAY_EQ = attrs.cmp_using(eq=arrays_equal, class_name="ReadOnlyArray")


def int32_array(values: npt.ArrayLike) -> IntArray:
    """Field converter: an immutable int32 array (lists, tuples and arrays alike).

    Use as `attrs.field(converter=int32_array, eq=ARRAY_EQ, hash=False)`: written out
    in the class body, so mypy's attrs plugin types `__init__` from the converter.
    """
    out: IntArray = readonly(values, np.int32)
    return out
