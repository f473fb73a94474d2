"""Checks of caller input shared by the pure core: ints that are ints, values in range.

A public entry point checks its arguments here once, then trusts what it builds. Each
check raises a typed error naming the call, the value and the fix; none of them ever
truncates (3.7 is refused, never read as 3) or lets a raw TypeError escape.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import numpy.typing as npt

from purepp._text import a_type, with_article
from purepp.errors import ConfigError, InvalidInputError

__all__ = [
    "INT32_MAX",
    "as_int",
    "check_bool",
    "check_instance",
    "check_int",
    "check_interpreter",
    "check_optional_int",
    "host_array",
    "store_ints",
]

INT32_MAX = int(np.iinfo(np.int32).max)


def as_int(value: Any) -> int | None:
    """`value` as an int when it is an int or a numpy integer, else None.

    Subclasses of int are refused: a bool or an IntEnum member is not a count.
    """
    if type(value) is int:
        return value
    if isinstance(value, np.integer):
        return operator.index(value)
    return None


def check_int(
    call: str,
    name: str,
    value: Any,
    lo: int,
    hi: int = INT32_MAX,
    *,
    fix: str = "",
    config: bool = False,
) -> int:
    """`value` as an int in lo..hi; a typed error otherwise (ConfigError when `config`)."""
    error = ConfigError if config else InvalidInputError
    exact = as_int(value)
    if exact is None:
        raise error(
            call,
            f"{name}={value!r} is {a_type(value)}, not an int",
            fix or f"pass {name} as an int in {lo}..{hi}",
        )
    if not lo <= exact <= hi:
        raise error(
            call, f"{name}={exact} is outside {lo}..{hi}", fix or f"pass {name} in {lo}..{hi}"
        )
    return exact


def check_optional_int(
    call: str, name: str, value: Any, lo: int, hi: int = INT32_MAX, *, fix: str = ""
) -> int | None:
    """None, or `value` as an int in lo..hi (see `check_int`)."""
    if value is None:
        return None
    return check_int(call, name, value, lo, hi, fix=fix or f"pass {name} in {lo}..{hi}, or None")


def host_array(call: str, name: str, values: object, *, fix: str = "") -> npt.NDArray[Any]:
    """`values` (an array, a list, a CPU tensor) as a numpy array, or a typed error.

    A device tensor is refused rather than copied: reading it would make the host wait
    for the device, every step. Ragged lists are refused too (numpy raises for them).
    """
    try:
        return np.asarray(values)
    except (TypeError, ValueError, RuntimeError) as error:
        raise InvalidInputError(
            call,
            f"{name} is {a_type(values)} that numpy cannot read as an array ({error})",
            fix
            or f"pass {name} as host integers (a numpy array, a list or a CPU tensor); for a "
            "device tensor, pass the host array it was copied from",
        ) from None


def check_bool(call: str, name: str, value: Any, *, config: bool = False) -> bool:
    """`value` when it is a bool (numpy's too); 1, 'yes' and None are refused."""
    if type(value) is bool:
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    error = ConfigError if config else InvalidInputError
    raise error(call, f"{name}={value!r} is {a_type(value)}", f"pass {name} as a bool")


def check_instance(call: str, name: str, value: object, kind: type, *, fix: str = "") -> None:
    """Refuse `value` unless it is a `kind`, naming what it is instead."""
    if not isinstance(value, kind):
        raise InvalidInputError(
            call, f"{name} is {a_type(value)}", fix or f"pass {with_article(kind.__name__)}"
        )


def check_interpreter(
    call: str,
    name: str,
    value: object,
    *,
    fix: str = "pass an Interpreter (e.g. a NumpyInterpreter or a TorchInterpreter)",
) -> None:
    """Refuse `value` unless it has the interpreters' one method, `perform`."""
    if not callable(getattr(value, "perform", None)):
        raise InvalidInputError(
            call, f"{name} is {a_type(value)}, which has no perform method", fix
        )


def store_ints(instance: object, **values: int | None) -> None:
    """Store checked ints on a frozen instance, so numpy integers become Python ints."""
    for name, value in values.items():
        object.__setattr__(instance, name, value)


def check_requests_fit(call: str, num_reqs: int, num_tokens: int, uniform: int | None) -> None:
    """The batch's requests fit its tokens: at least one token each, `uniform` each in a
    uniform decode. (Checked ints; raises InvalidInputError naming `call`.)"""
    if num_reqs > num_tokens:
        raise InvalidInputError(
            call,
            f"num_reqs={num_reqs} exceeds num_tokens={num_tokens}",
            "every scheduled request carries at least one token; count tokens after padding",
        )
    if uniform is not None and uniform * num_reqs > num_tokens:
        raise InvalidInputError(
            call,
            f"uniform_token_count={uniform} x num_reqs={num_reqs} exceeds num_tokens={num_tokens}",
            "pass the tokens per request of a uniform decode batch, else None",
        )
