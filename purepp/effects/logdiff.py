"""Comparing effect logs: a readable first difference, for golden-log tests."""

from __future__ import annotations

import json
import re
import typing

import attrs

from purepp._checks import check_bool, check_int
from purepp._text import a_type
from purepp.effects._converter import CONVERTER
from purepp.effects.logfile import header_json, record_json
from purepp.effects.logmodel import EffectLog, LogHeader, LogRecord
from purepp.errors import InvalidInputError

__all__ = ["assert_logs_equal", "diff_logs"]


def _differing_fields(expected: LogRecord, actual: LogRecord) -> list[str]:
    want = CONVERTER.unstructure(expected, LogRecord)
    got = CONVERTER.unstructure(actual, LogRecord)
    fields = [key for key in ("seq", "comm_seq") if want[key] != got[key]]
    if want["effect"]["kind"] != got["effect"]["kind"]:
        return [*fields, "effect.kind"]
    return fields + [
        f"effect.{key}" for key in want["effect"] if want["effect"][key] != got["effect"][key]
    ]


def _same_as_written(want: object, got: object) -> bool:
    """Equal as JSON text: in Python 1 == 1.0 == True, in a log file they differ."""
    return json.dumps(want, sort_keys=True) == json.dumps(got, sort_keys=True)


def _differing_keys(prefix: str, want: object, got: object) -> list[str]:
    """The dotted names of what differs, down into nested objects ("config.scripted.seed")."""
    if _same_as_written(want, got):
        return []
    if not (isinstance(want, dict) and isinstance(got, dict)):
        return [prefix]
    return [
        name
        for key in dict.fromkeys([*want, *got])
        for name in _differing_keys(prefix + _member(key), want.get(key), got.get(key))
    ]


_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _member(key: str) -> str:
    """`.key`, or `["key"]` (as JSON) for a key a dotted name would garble: one holding a
    dot, a space, a newline, or nothing at all."""
    return f".{key}" if _PLAIN_KEY.fullmatch(key) else f"[{json.dumps(key)}]"


def _differing_header_fields(expected: LogHeader, actual: LogHeader) -> list[str]:
    """The header keys that differ as written, the config's down to its leaves."""
    want, got = json.loads(header_json(expected)), json.loads(header_json(actual))
    fields: list[str] = []
    for key in dict.fromkeys([*want, *got]):
        if key == "config":
            fields += _differing_keys("config", want.get(key), got.get(key))
        elif not _same_as_written(want.get(key), got.get(key)):
            fields.append(key)
    return fields


_UNSHOWABLE = (TypeError, ValueError, AttributeError)  # as record_lines catches them


def _mistyped_field(record: LogRecord) -> str | None:
    """The first field of `record` (or of its effect) that cannot be written as its
    declared type, as "effect.op is 'end_step', a str"; None if none is found alone."""
    for obj, prefix in ((record, ""), (record.effect, "effect.")):
        hints = typing.get_type_hints(type(obj))
        for field in attrs.fields(type(obj)):
            if field.name == "effect":
                continue
            value = getattr(obj, field.name)
            try:
                json.dumps(CONVERTER.unstructure(value, hints[field.name]), allow_nan=False)
            except _UNSHOWABLE:
                return f"{prefix}{field.name} is {value!r}, {a_type(value)}"
    return None


def _line(side: str, index: int, record: LogRecord) -> str:
    """The record's log line; a typed error naming it when it has none (a hand-built
    effect whose field is not of its declared type, which no log can hold)."""
    try:
        return record_json(record)
    except _UNSHOWABLE as error:
        raise InvalidInputError(
            "diff_logs",
            f"record {index} of the {side} log ({record.effect!r}) cannot be shown as a log line: "
            f"{_mistyped_field(record) or error}",
            "give effect fields the types their class declares (an enum member such as "
            "Op.END_STEP, not its str; an int, not a str or float), as load_log and a "
            "Recorder give them",
        ) from error


def _diff_records(expected: EffectLog, actual: EffectLog, context: int) -> list[str]:
    want, got = expected.records, actual.records
    first = next(
        (i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b),
        min(len(want), len(got)),
    )
    if first == len(want) == len(got):
        return []
    text = [
        f"effect logs differ at record {first} (file line {first + 2}); "
        f"expected {len(want)} records, got {len(got)}:"
    ]
    text += [
        f"    same     #{i}: {_line('expected', i, want[i])}"
        for i in range(max(0, first - context), first)
    ]
    if first < len(want):
        text.append(f"  - expected #{first}: {_line('expected', first, want[first])}")
    else:
        text.append(f"  - expected: nothing (the expected log ends after {first} records)")
    if first < len(got):
        text.append(f"  + actual   #{first}: {_line('actual', first, got[first])}")
    else:
        text.append(f"  + actual:   nothing (the actual log ends after {first} records)")
    if first < len(want) and first < len(got):
        text.append(
            f"  fields that differ: {', '.join(_differing_fields(want[first], got[first]))}"
        )
    return text


def diff_logs(
    expected: EffectLog, actual: EffectLog, *, context: int = 3, ignore_run_id: bool = False
) -> str | None:
    """None when the logs are equal; else a readable report for a golden-log test.

    It shows a differing header, and the first differing record (rendered as its log
    line) with the `context` records before it and the fields that differ. Every run
    gets a new run id, so a golden log of a recorded run passes `ignore_run_id=True`
    to compare what the runs did.
    """
    for name, log in (("expected", expected), ("actual", actual)):
        if not isinstance(log, EffectLog):
            raise InvalidInputError("diff_logs", f"{name} is {a_type(log)}", "pass two EffectLogs")
    context = check_int("diff_logs", "context", context, 0)
    ignore_run_id = check_bool("diff_logs", "ignore_run_id", ignore_run_id)
    if ignore_run_id:
        expected, actual = _without_run_id(expected), _without_run_id(actual)
    if expected == actual:
        return None
    text: list[str] = []
    if expected.header != actual.header:
        fields = _differing_header_fields(expected.header, actual.header)
        text += [
            "effect log headers differ (file line 1):",
            f"  - expected: {header_json(expected.header)}",
            f"  + actual:   {header_json(actual.header)}",
            "  fields that differ: " + ", ".join(fields),
        ]
        if fields == ["run_id"] and expected.records == actual.records:
            text.append(
                f"  every record is equal ({len(expected.records)}): the logs are of two runs of "
                "one config; pass ignore_run_id=True to compare what the runs did"
            )
    return "\n".join(text + _diff_records(expected, actual, context))


def _without_run_id(log: EffectLog) -> EffectLog:
    return attrs.evolve(log, header=attrs.evolve(log.header, run_id=None))


def assert_logs_equal(
    expected: EffectLog, actual: EffectLog, *, context: int = 3, ignore_run_id: bool = False
) -> None:
    """Raise AssertionError carrying `diff_logs`' report when the logs differ."""
    __tracebackhide__ = True  # pytest shows the caller's line, not this one
    difference = diff_logs(expected, actual, context=context, ignore_run_id=ignore_run_id)
    if difference is not None:
        raise AssertionError(difference)
