"""The effect log's one cattrs converter, and the strict JSON rules it enforces.

Every effect class of the closed union is written as a JSON object tagged with a
`"kind"` (the class name in snake case, e.g. `"copy_host_to_device"`); enums as
their values, references as plain strings, tuples as lists, read-only int32 arrays
as `{"shape": [...], "values": nested lists}`. The shape travels beside the values
because nested lists alone lose it when a dimension is zero (`[]` could be (0,),
(0, 3) or (0, 0, 2)), and an idle rank's copy can be empty.

Reading is strict: a log is evidence, so an integer written as `"3"` or `3.0`, a
`true` where a number belongs, an unknown key or an unknown kind is an error, never
coerced. Errors come out as cattrs validation errors; `describe_structure_error`
turns them into one line naming the path of every bad value.
"""

from __future__ import annotations

import enum
import json
import math
import operator
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, get_args, get_origin

import attrs
import cattrs
import numpy as np
from cattrs.gen import make_dict_structure_fn, override
from cattrs.strategies import configure_tagged_union
from cattrs.v import format_exception

from purepp._checks import INT32_MAX
from purepp._text import a_type
from purepp.effects.arrays import IntArray, readonly
from purepp.effects.vocabulary import BufferRef, Effect, EventRef, WorkRef
from purepp.errors import InvalidInputError, PureppError

__all__ = [
    "CONVERTER",
    "EFFECT_CLASSES",
    "EFFECT_KINDS",
    "JSONObject",
    "build_checked_effect",
    "canonical_json",
    "describe_structure_error",
    "freeze_json_object",
    "kind_of",
    "reads_back",
    "structure_effect",
    "thaw_json",
    "unreadable_value",
    "unstructure_effect",
]

# A free-form JSON object as purepp holds it: nested mappings are read-only
# proxies and arrays are tuples, so a frozen header stays frozen all the way down.
JSONObject = Mapping[str, object]

EFFECT_CLASSES: Final[tuple[type[Effect], ...]] = get_args(Effect)

_INT32_MIN: Final = int(np.iinfo(np.int32).min)


def _snake_case(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


# kind tag -> effect class, e.g. "all_reduce" -> AllReduce.
EFFECT_KINDS: Final[Mapping[str, type[Effect]]] = types.MappingProxyType(
    {_snake_case(cls.__name__): cls for cls in EFFECT_CLASSES}
)
_KIND_OF_CLASS: Final[Mapping[type[Effect], str]] = {cls: k for k, cls in EFFECT_KINDS.items()}


def kind_of(effect: Effect) -> str:
    """The `"kind"` tag an effect is written with, e.g. `"broadcast"`."""
    try:
        return _KIND_OF_CLASS[type(effect)]
    except KeyError:  # the error path only
        raise InvalidInputError(
            "kind_of",
            f"{effect!r} is {a_type(effect)}, not an effect",
            "pass an effect from purepp.effects.vocabulary",
        ) from None


class _BadValue(ValueError):
    """A value of the right JSON shape but the wrong content; the message says what."""


def _show(value: object) -> str:
    """A short JSON rendering of a rejected value, for error messages."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _json_type(value: object) -> str:
    match value:
        case None:
            return "null"
        case bool():
            return "a boolean"
        case int():
            return "an integer"
        case float():
            return "a number with a fraction"
        case str():
            return "a string"
        case list():
            return "a list"
        case dict():
            return "an object"
        case _:
            return type(value).__name__


def _expect(what: str, value: object) -> _BadValue:
    return _BadValue(f"expected {what}, got {_json_type(value)} {_show(value)}")


# -- JSON values held in headers ------------------------------------------------


def freeze_json_object(value: object, *, call: str = "LogHeader") -> JSONObject:
    """A deep read-only copy of a JSON object (str keys; no NaN or infinity).

    Raises InvalidInputError naming `call` when `value` is not one.
    """
    if not isinstance(value, Mapping):
        raise InvalidInputError(
            call, f"config must be a JSON object, got {type(value).__name__}", "pass a dict"
        )
    try:
        return _freeze_mapping(value, call, "config")
    except RecursionError:
        raise InvalidInputError(
            call,
            "config is nested too deeply, or holds itself",
            "pass a config of plain values nested a few levels at most",
        ) from None


# Python reads back no integer of more decimal digits (sys.int_info.default_max_str_digits:
# 4300 digits, 14_284 bits); a little below, so a header always reads back.
_MAX_INT_BITS: Final = 14_000


def _freeze_mapping(value: Mapping[Any, object], call: str, where: str) -> JSONObject:
    # Keys sorted, so equal configs are also written byte for byte the same.
    items: dict[str, object] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise InvalidInputError(
                call, f"{where} has a non-string key {key!r}", "use string keys only"
            )
        items[key] = _freeze(item, call, f"{where}.{key}")
    return types.MappingProxyType(dict(sorted(items.items())))


def _freeze(value: object, call: str, where: str) -> object:
    match value:
        case int() if value.bit_length() > _MAX_INT_BITS:
            raise InvalidInputError(
                call,
                f"{where} holds an integer of {value.bit_length()} bits, too long for a log",
                f"use integers of at most {_MAX_INT_BITS} bits (e.g. a digest as a string)",
            )
        case None | bool() | int() | str():
            return value
        case float() if math.isfinite(value):
            return value
        case Mapping():
            return _freeze_mapping(value, call, where)
        case list() | tuple():
            return tuple(_freeze(item, call, f"{where}[{i}]") for i, item in enumerate(value))
        case _:
            raise InvalidInputError(
                call,
                f"{where} holds {value!r}, which JSON cannot represent exactly",
                "use null, booleans, integers, finite floats, strings, lists and dicts",
            )


def thaw_json(value: object) -> object:
    """Plain dicts and lists again, ready for `json.dumps`."""
    match value:
        case Mapping():
            return {key: thaw_json(item) for key, item in value.items()}
        case tuple() | list():
            return [thaw_json(item) for item in value]
        case _:
            return value


def canonical_json(value: object) -> str:
    """One spelling per JSON value, so equal values give byte-identical text.

    `1`, `1.0` and `true` compare equal in Python but are different JSON; two configs
    are equal exactly when their canonical texts are.
    """
    return json.dumps(thaw_json(value), sort_keys=True, ensure_ascii=True, allow_nan=False)


# -- structure hooks: strict, JSON type first -----------------------------------


_INT64_MAX = 2**63 - 1
# The one integer field a log holds that may be negative: PadColumns' fill value. Every
# other one is a step, a size, a rank, an offset or a count, none below 0 on any run.
_SIGNED_FIELDS = frozenset({"fill"})


# Fields naming an event or a work handle: attrs checks no field types, so a name that
# is no str reaches the writer (a BufferRef checks its own).
_NAME_TYPES: Final = (EventRef, WorkRef, EventRef | None, WorkRef | None)
_NAME_FIELDS: Final = frozenset(
    name
    for cls in EFFECT_CLASSES
    for name, hint in typing.get_type_hints(cls).items()
    if hint in _NAME_TYPES
)


def _reads_back_check(cls: type) -> Callable[[Any], bool]:
    """A fast test that an attrs value of `cls`, written, reads back (`unreadable_value`
    says what does not): each integer in its field's range, each event or work name a
    str. Generated straight-line code, as `_fast_attrs_builder` is: it runs per record."""
    hints = typing.get_type_hints(cls)
    namespace: dict[str, Any] = {"MAX": _INT64_MAX, "MIN": -_INT64_MAX - 1, "str": str}
    tests = ["True"]
    for field in attrs.fields(cls):
        value, hint = f"value.{field.name}", hints[field.name]
        low = "MIN" if field.name in _SIGNED_FIELDS else "0"
        if hint is int:
            tests.append(f"{low} <= {value} <= MAX")
        elif hint == int | None:
            tests.append(f"({value} is None or 0 <= {value} <= MAX)")
        elif hint == tuple[int, ...]:
            tests.append(f"(not {value} or (min({value}) >= 0 and max({value}) <= MAX))")
        elif hint in (EventRef, WorkRef):
            tests.append(f"type({value}.name) is str")
        elif hint in (EventRef | None, WorkRef | None):
            tests.append(f"({value} is None or type({value}.name) is str)")
        elif _is_homogeneous_tuple(hint) and attrs.has(get_args(hint)[0]):
            namespace[f"check_{field.name}"] = _reads_back_check(get_args(hint)[0])
            tests.append(f"all(map(check_{field.name}, {value}))")
    # The text is built above from field names only.
    exec(f"def check(value):\n    return {' and '.join(tests)}\n", namespace)
    return typing.cast(Callable[[Any], bool], namespace["check"])


def reads_back(effect: Effect) -> bool:
    """Whether `effect`, written, reads back (else `unreadable_value` says what does not)."""
    return _READS_BACK[type(effect)](effect)


def unreadable_value(value: object, where: str = "effect") -> str | None:
    """What in `value`, an effect's (or record's) unstructured JSON, the reader refuses.

    The writer's check, so a log is never written that `load_log` cannot read back: an
    integer outside the range its field is read in (0..int64 max; `fill`: any int64),
    or an event's or work's name that is no string. An int32 array's values are
    int32 by construction: only its shape is looked at. None when all of it reads back.
    """
    match value:
        case bool() | None | str() | float():
            return None
        case int():
            low = -_INT64_MAX - 1 if where.rpartition(".")[2] in _SIGNED_FIELDS else 0
            if not low <= value <= _INT64_MAX:
                return f"{where} is {value}, outside {low}..{_INT64_MAX}, the range a log reads"
            return None
        case list():
            for index, item in enumerate(value):
                problem = unreadable_value(item, f"{where}[{index}]")
                if problem is not None:
                    return problem
            return None
        case dict():
            if value.keys() == {"shape", "values"}:  # an int32 array
                return unreadable_value(value["shape"], f"{where}.shape")
            for key, item in value.items():
                if key in _NAME_FIELDS and item is not None and type(item) is not str:
                    return f"{where}.{key} is named {item!r}, {a_type(item)}, not a str"
                problem = unreadable_value(item, f"{where}.{key}")
                if problem is not None:
                    return problem
            return None
        case _:
            return None


def _structure_int(value: object, _: type) -> int:
    # bool is an int subclass in Python, but `true` in a count field is corruption.
    if type(value) is not int or not 0 <= value <= _INT64_MAX:
        raise _expect(f"an integer in 0..{_INT64_MAX}", value)
    return value


def _structure_signed_int(value: object, _: type) -> int:
    if type(value) is not int or not -_INT64_MAX - 1 <= value <= _INT64_MAX:
        raise _expect("an int64 integer", value)
    return value


def _structure_bool(value: object, _: type) -> bool:
    if type(value) is not bool:
        raise _expect("true or false", value)
    return value


def _structure_str(value: object, _: type) -> str:
    if type(value) is not str:
        raise _expect("a string", value)
    return value


def _structure_enum(value: object, cls: type[enum.Enum]) -> enum.Enum:
    # The value map, not cls(value): this runs for several fields of every log record.
    member = cls._value2member_map_.get(value) if type(value) is str else None
    if member is None:
        allowed = ", ".join(_show(m.value) for m in cls)
        raise _expect(f"one of {allowed}", value)
    return member


def _structure_ref(cls: type[BufferRef | EventRef | WorkRef]) -> Callable[[object, type], Any]:
    def structure(value: object, _: type) -> BufferRef | EventRef | WorkRef:
        return cls(_structure_str(value, str))

    return structure


def _is_homogeneous_tuple(tp: Any) -> bool:
    args = get_args(tp)
    return get_origin(tp) is tuple and len(args) == 2 and args[1] is Ellipsis


def _structure_tuple_factory(
    tp: Any, converter: cattrs.Converter
) -> Callable[[object, type], tuple[Any, ...]]:
    item_type = get_args(tp)[0]
    as_list = list[item_type]  # type: ignore[valid-type]  # built from a runtime type

    def structure(value: object, _: type) -> tuple[Any, ...]:
        if type(value) is not list:
            raise _expect("a list", value)
        # Through list[...] so a bad item's error carries its index.
        return tuple(converter.structure(value, as_list))

    return structure


def _unstructure_tuple_factory(
    tp: Any, converter: cattrs.Converter
) -> Callable[[tuple[Any, ...]], list[Any]]:
    item_hook = converter.get_unstructure_hook(get_args(tp)[0])

    def unstructure(value: tuple[Any, ...]) -> list[Any]:
        return [item_hook(item) for item in value]

    return unstructure


def _check_nested(values: object, shape: Sequence[int], where: str) -> None:
    """`values` is a nested list of int32 integers of exactly `shape`."""
    if not shape:
        if type(values) is not int or not _INT32_MIN <= values <= INT32_MAX:
            raise _expect(f"an int32 integer at {where}", values)
        return
    if type(values) is not list or len(values) != shape[0]:
        raise _expect(f"a list of {shape[0]} at {where} (shape {list(shape)})", values)
    for i, item in enumerate(values):
        _check_nested(item, shape[1:], f"{where}[{i}]")


def _structure_array(value: object, _: type) -> IntArray:
    if type(value) is not dict or set(value) != {"shape", "values"}:
        raise _expect('an array object {"shape": [...], "values": [...]}', value)
    shape = value["shape"]
    if type(shape) is not list or not all(type(n) is int and n >= 0 for n in shape):
        raise _expect("a shape: a list of integers >= 0", shape)
    _check_nested(value["values"], shape, "values")
    flat = readonly(value["values"], np.int32).reshape(shape)
    flat.flags.writeable = False
    return flat


def _unstructure_array(array: IntArray) -> dict[str, object]:
    return {"shape": list(array.shape), "values": array.tolist()}


def _structure_attrs_factory(
    cls: type, converter: cattrs.Converter
) -> Callable[[object, type], Any]:
    # cattrs' generated function indexes into the value; a list there would surface
    # as an AttributeError, so say plainly that an object was expected.
    # Enum fields take `_structure_enum` by name: cattrs 25 builds enums inline in the
    # generated function, past the converter's hooks, with a message that omits the
    # allowed values (cattrs 26 asks the hook). A signed field (`fill`) takes the signed
    # hook by name, as every other int is read as a count (>= 0).
    hints = typing.get_type_hints(cls)
    overrides: dict[str, Any] = {  # field name -> override, as make_dict_structure_fn takes them
        field.name: override(struct_hook=_structure_enum)
        for field in attrs.fields(cls)
        if isinstance(hints.get(field.name), type) and issubclass(hints[field.name], enum.Enum)
    }
    for field in attrs.fields(cls):
        if field.name in _SIGNED_FIELDS and hints.get(field.name) is int:
            overrides[field.name] = override(struct_hook=_structure_signed_int)
    generated: Callable[[Mapping[str, Any], type], Any] = make_dict_structure_fn(
        cls, converter, **overrides
    )

    def structure(value: object, _: type) -> Any:
        if type(value) is not dict:
            raise _expect(f"an object for {cls.__name__}", value)
        return generated(value, cls)

    return structure


def _structure_json_object(value: object, _: type) -> JSONObject:
    if type(value) is not dict:
        raise _expect("a JSON object", value)
    return freeze_json_object(value, call="load_log")


# -- the effect union -----------------------------------------------------------


def _register_effect_union(converter: cattrs.Converter) -> None:
    """The closed union as a tagged union (cattrs' strategy), checked before dispatch.

    cattrs' own hook answers an unknown or missing tag with a bare KeyError; this
    wrapper names the tag and the known kinds, and puts `"kind"` first in the output
    so a log line reads `{"kind": "broadcast", "step": ...}`.
    """
    configure_tagged_union(
        Effect, converter, tag_generator=_KIND_OF_CLASS.__getitem__, tag_name="kind"
    )
    dispatch = converter.get_structure_hook(Effect)
    unstructure_tagged = converter.get_unstructure_hook(Effect)

    def structure(value: object, _: type) -> Effect:
        if type(value) is not dict:
            raise _expect("an effect object", value)
        kind = value.get("kind")
        if kind not in EFFECT_KINDS:
            known = ", ".join(sorted(EFFECT_KINDS))
            what = "no kind" if "kind" not in value else f"unknown kind {_show(kind)}"
            raise _BadValue(f"effect has {what}; known kinds: {known}")
        effect: Effect = dispatch(value, Effect)
        return effect

    def unstructure(effect: Effect) -> dict[str, object]:
        fields = unstructure_tagged(effect)
        kind = fields.pop("kind")
        return {"kind": kind, **fields}

    converter.register_structure_hook(Effect, structure)
    converter.register_unstructure_hook(Effect, unstructure)


def _make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    converter.register_structure_hook_factory(attrs.has, _structure_attrs_factory)
    converter.register_structure_hook(int, _structure_int)
    converter.register_structure_hook(str, _structure_str)
    converter.register_structure_hook(bool, _structure_bool)
    # operator.index: a numpy integer in a shape is written as a plain int, a float refused.
    converter.register_unstructure_hook(int, operator.index)
    converter.register_unstructure_hook(bool, bool)  # true/false, not the int hook's 1/0
    converter.register_structure_hook_func(
        lambda tp: isinstance(tp, type) and issubclass(tp, enum.Enum), _structure_enum
    )
    for ref in (BufferRef, EventRef, WorkRef):
        converter.register_structure_hook(ref, _structure_ref(ref))
        converter.register_unstructure_hook(ref, operator.attrgetter("name"))
    converter.register_structure_hook_func(lambda tp: tp == IntArray, _structure_array)
    converter.register_unstructure_hook_func(lambda tp: tp == IntArray, _unstructure_array)
    converter.register_structure_hook_func(lambda tp: tp == JSONObject, _structure_json_object)
    converter.register_unstructure_hook_func(lambda tp: tp == JSONObject, thaw_json)
    converter.register_structure_hook_factory(_is_homogeneous_tuple, _structure_tuple_factory)
    converter.register_unstructure_hook_factory(_is_homogeneous_tuple, _unstructure_tuple_factory)
    return converter


# The one converter: logs, replay, diffs and the checker all read and write through it.
CONVERTER: Final[cattrs.Converter] = _make_converter()
_register_effect_union(CONVERTER)


def unstructure_effect(effect: Effect) -> dict[str, Any]:
    """An effect as its log JSON object, `"kind"` first."""
    unstructured: dict[str, Any] = CONVERTER.unstructure(effect, Effect)
    return unstructured


def structure_effect(value: object) -> Effect:
    """The effect a log JSON object describes; cattrs validation errors when it is bad."""
    # cattrs types `structure` over classes; the closed union is a UnionType, hence the cast.
    return typing.cast(Effect, CONVERTER.structure(value, Effect))  # type: ignore[arg-type]


# -- building effects of a known-good shape ---------------------------------------


def _fast_builder(tp: Any) -> Callable[[Any], Any]:
    """A converter from JSON to `tp` that trusts the JSON's shape (no checks)."""
    args = get_args(tp)
    if tp is int or tp is str or tp is bool:
        return _same
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp._value2member_map_.__getitem__
    if tp in (BufferRef, EventRef, WorkRef):
        return typing.cast(Callable[[Any], Any], tp)
    if tp == IntArray:
        return _fast_array
    if _is_homogeneous_tuple(tp):
        item = _fast_builder(args[0])
        return lambda value: tuple(map(item, value))
    if isinstance(tp, types.UnionType) and len(args) == 2 and type(None) in args:
        inner = _fast_builder(next(arg for arg in args if arg is not type(None)))
        return lambda value: None if value is None else inner(value)
    if isinstance(tp, type) and attrs.has(tp):
        return _fast_attrs_builder(tp)
    raise TypeError(f"no fast builder for {tp!r}")  # a new field type: teach this function


def _same(value: Any) -> Any:
    return value


def _fast_array(value: Mapping[str, Any]) -> IntArray:
    # numpy refuses a value outside int32 (OverflowError): the one check a shape cannot make.
    array = np.asarray(value["values"], dtype=np.int32)
    shape = tuple(value["shape"])
    if array.shape != shape:
        raise _BadValue(f"values of shape {list(array.shape)}, declared {list(shape)}")
    return array


def _fast_attrs_builder(cls: type) -> Callable[[Any], Any]:
    # Generated straight-line code, as cattrs does: one call per record, no loop over fields.
    hints = typing.get_type_hints(cls)
    namespace: dict[str, Any] = {"cls": cls}
    arguments = []
    for field in attrs.fields(cls):
        builder = _fast_builder(hints[field.name])
        read = f"value[{field.name!r}]"
        if field.default is not attrs.NOTHING:  # a field added later: older logs lack it
            namespace[f"default_{field.name}"] = field.default
            read = f"value.get({field.name!r}, default_{field.name})"
        if builder is _same:
            arguments.append(f"{field.name}={read}")
        else:
            namespace[f"build_{field.name}"] = builder
            arguments.append(f"{field.name}=build_{field.name}({read})")
    # The text is built above from field names only.
    exec(f"def build(value):\n    return cls({', '.join(arguments)})\n", namespace)
    return typing.cast(Callable[[Any], Any], namespace["build"])


_READS_BACK: Final[Mapping[type, Callable[[Any], bool]]] = {
    cls: _reads_back_check(cls) for cls in EFFECT_CLASSES
}

_FAST_BUILDERS: Final[Mapping[str, Callable[[Any], Any]]] = {
    kind: _fast_attrs_builder(cls) for kind, cls in EFFECT_KINDS.items()
}


def build_checked_effect(kind: str, value: Mapping[str, Any]) -> Effect:
    """The effect `value` describes, built with only the checks its shape cannot show.

    Only for a value whose shape (keys, JSON types, enum values, nesting) equals one
    that `structure_effect` accepted: the log reader's fast path for lines that
    differ from a validated line in their digits alone. Raises ValueError (an int32
    array value out of range, or values not of the declared shape); the caller then
    reads the line in full for the error.
    """
    return typing.cast(Effect, _FAST_BUILDERS[kind](value))


# -- errors ---------------------------------------------------------------------


def _format_exception(exc: BaseException, tp: type | None) -> str:
    match exc:
        case _BadValue():
            return str(exc)
        case PureppError():
            return exc.problem
        case ValueError() if len(exc.args) > 1 and isinstance(exc.args[0], str):
            # An attrs validator's (`in_`): its message, then the attribute, the allowed
            # values and the value, whose reprs would bury it.
            return f"invalid value: {exc.args[0]}"
        case ValueError() if str(exc):  # a field's validator, which names the field
            return f"invalid value: {exc}"
        case _:
            return format_exception(exc, tp)


def describe_structure_error(exc: Exception, root: str) -> str:
    """One line naming every bad value in a failed `CONVERTER.structure` call."""
    if isinstance(exc, cattrs.BaseValidationError):
        problems = cattrs.transform_error(exc, path=root, format_exception=_format_exception)
        return "; ".join(problems)
    return f"{_format_exception(exc, None)} @ {root}"
