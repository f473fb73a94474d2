"""purepp.effects.arrays: the immutability every state and effect relies on, and the
array equality attrs compares them by.

`is_frozen` is the oracle other tests assert with, so it is tested here on the arrays
it must refuse: one it answered True for too readily would let those tests pass on
arrays a caller could still change.
"""

from __future__ import annotations

import numpy as np
import pytest

from purepp.effects.arrays import arrays_equal, frozen, is_frozen, readonly


def test_only_views_of_bytes_are_frozen() -> None:
    writable = np.arange(4, dtype=np.int32)
    assert not is_frozen(writable)
    locked = writable.view()
    locked.flags.writeable = False
    assert not is_frozen(locked)  # read-only, but its base can still change it
    built = frozen(writable)
    assert is_frozen(built)
    assert is_frozen(built[1:3])  # a view of a frozen array: bytes at the end of the chain
    writable[0] = 9
    assert built[0] == 0  # a copy, not a view of the caller's array
    with pytest.raises(ValueError, match="read-only"):
        built[0] = 1


def test_readonly_returns_a_frozen_array_of_the_dtype_and_reuses_one_that_is() -> None:
    already = frozen(np.array([1, 2], dtype=np.int32))
    assert readonly(already, np.int32) is already
    widened = readonly(already, np.int64)
    assert widened.dtype == np.int64
    assert is_frozen(widened)
    caller = np.array([3, 4], dtype=np.int32)
    copied = readonly(caller, np.int32)
    assert copied is not caller
    assert is_frozen(copied)
    assert copied.tolist() == [3, 4]


def test_arrays_are_equal_only_with_equal_dtype_shape_and_elements() -> None:
    a = np.array([[1, 2]], dtype=np.int32)
    assert arrays_equal(a, a)
    assert arrays_equal(a, a.copy())
    assert not arrays_equal(a, np.array([[1, 3]], dtype=np.int32))
    assert not arrays_equal(a, a.astype(np.int64))
    assert not arrays_equal(a, np.array([1, 2], dtype=np.int32))  # == would broadcast
    assert not arrays_equal(np.ones((1, 2), np.int32), np.ones((2, 1), np.int32))
