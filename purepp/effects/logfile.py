"""Effect log files: one JSON Lines file per rank, written whole or read a line at a time.

Line 1 is the header::

    {"schema": "purepp.effects/2", "rank": 3, "world": {"pp": 2, "dp": 2}, "config": {...},
     "run_id": "...", "config_digest": "sha256:..."}

(`run_id` and `config_digest` are written only when set, so logs without them read
and write byte for byte as before), and every further line is one numbered record::

    {"seq": 7, "comm_seq": 2, "effect": {"kind": "broadcast", "step": 4, "op": "broadcast", ...}}

`load_log` is strict and all-or-nothing: any defect raises `LogFormatError` naming
the file, the line and what was wrong, and nothing half-loaded is returned.
`LogStream` reads the same format one record at a time for `purepp check`, and can
stop at a last line the writer never finished (the rank died while writing) instead
of refusing the file: that is the log a crash leaves.

Both read long logs fast, through one reader (`LogStream.scan`): a line that differs
from a line already validated in full only in its digits is built from its bytes at
the validated line's offsets, without decoding its JSON again; any other line is read
in full, so a bad log fails with the same error either way.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import re
import time
import typing
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Final

import attrs
import cattrs

from purepp._checks import check_bool, check_instance, check_int
from purepp._text import a_type
from purepp.effects._converter import (
    CONVERTER,
    EFFECT_CLASSES,
    EFFECT_KINDS,
    build_checked_effect,
    canonical_json,
    describe_structure_error,
    kind_of,
    reads_back,
    unreadable_value,
)
from purepp.effects.arrays import IntArray, int32_array
from purepp.effects.logmodel import (
    SCHEMA,
    EffectLog,
    LogHeader,
    LogRecord,
    Numbering,
    config_digest,
    numbering_problem,
)
from purepp.effects.vocabulary import BufferRef, Effect, EventRef, WorkRef
from purepp.errors import InvalidInputError, LogFormatError, PureppError
from purepp.layout import Layout

__all__ = [
    "LOCK_FILE",
    "CutHeader",
    "LogDirHeld",
    "LogStream",
    "as_path",
    "check_same_run",
    "dump_log",
    "dump_logs",
    "header_json",
    "load_log",
    "load_logs",
    "lock_log_dir",
    "log_dir_writer",
    "log_file_name",
    "log_paths",
    "os_reason",
    "rank_logs",
    "read_cut_header",
    "record_json",
    "record_lines",
]

# In a log folder, locked by the `purepp run` writing there (purepp.runner.supervise).
LOCK_FILE: Final = ".purepp.lock"

_REWRITE = "regenerate the log with purepp's Recorder or dump_log; do not edit logs by hand"
_ONE_RUN = "keep only the logs of one run in the directory"
# A record this purepp cannot build: another purepp version may have written it.
_OTHER_FIELDS = (
    "record the log again with this purepp (a golden log: regenerate it), since a log "
    "another purepp version wrote may have other effects or fields; do not edit logs by hand"
)
# Header keys a file may leave out (logs written before they existed).
_OPTIONAL_HEADER_KEYS = ("run_id", "config_digest")


# -- writing --------------------------------------------------------------------


def _dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=True, allow_nan=False)


def as_path(call: str, name: str, value: object) -> Path:
    """A caller's path argument as a Path; InvalidInputError for None, an int, bytes."""
    if not isinstance(value, str | os.PathLike):
        raise InvalidInputError(
            call,
            f"{name}={value!r} is {a_type(value)}, not a path",
            f"pass {name} as a str or a pathlib.Path",
        )
    return Path(value)


def check_world(call: str, expect_world: object) -> None:
    if expect_world is not None and not isinstance(expect_world, Layout):
        raise InvalidInputError(
            call,
            f"expect_world is {a_type(expect_world)}",
            "pass the run's Layout(pp=..., dp=...), or None to accept any",
        )


def header_json(header: LogHeader) -> str:
    """The header's line as written in a log file (without the newline)."""
    check_instance("header_json", "header", header, LogHeader)
    fields = CONVERTER.unstructure(header, LogHeader)
    for key in _OPTIONAL_HEADER_KEYS:
        if fields[key] is None:
            del fields[key]
    return _dumps({"schema": SCHEMA, **fields})


def record_json(record: LogRecord) -> str:
    """A record's line as written in a log file (without the newline)."""
    check_instance("record_json", "record", record, LogRecord)
    return _dumps(CONVERTER.unstructure(record, LogRecord))


def record_lines(call: str, records: Sequence[LogRecord], first_seq: int) -> list[str]:
    """Each record's line with its newline; InvalidInputError naming `call` if one cannot be."""
    lines: list[str] = []
    for record in records:
        try:
            fields = CONVERTER.unstructure(record, LogRecord)
            line = _dumps(fields)
        except (TypeError, ValueError, AttributeError) as exc:  # a str where a ref is declared
            raise InvalidInputError(
                call,
                f"effect {first_seq + len(lines)} ({record.effect!r}) cannot be written as "
                f"JSON: {exc}",
                "give effect fields the types their class declares (int, not float)",
            ) from exc
        # Written, it would never read back: load_log would refuse the whole log.
        problem = None if reads_back(record.effect) else unreadable_value(fields["effect"])
        if problem is not None:
            raise InvalidInputError(
                call,
                f"effect {first_seq + len(lines)} ({record.effect!r}) would be written as a "
                f"log that does not read back: {problem}",
                "give effect fields the values their class declares: steps, sizes, ranks "
                "and counts of 0 or more, int64 at most (fill: any int64), names as str",
            )
        lines.append(line + "\n")
    return lines


def _log_text(log: EffectLog) -> str:
    return header_json(log.header) + "\n" + "".join(record_lines("dump_log", log.records, 0))


def os_reason(error: OSError | ValueError) -> str:
    """What an OSError says (its strerror), or the ValueError of a path holding a NUL."""
    return (error.strerror if isinstance(error, OSError) else None) or str(error)


def _partial(path: Path) -> Path:
    """Where `path` is written before it is renamed into place."""
    return path.with_name(path.name + ".partial")


_WRITE_FIX = "pass a file path in an existing folder this process may write to"


def _write_partial(call: str, path: Path, text: str) -> Path:
    """Write `text` beside `path` (its `_partial`); on failure leave none, raise naming `path`."""
    if not path.name:  # "" or "/": a folder, and with_name would raise
        raise InvalidInputError(call, f"{str(path)!r} is a folder, not a file path", _WRITE_FIX)
    partial = _partial(path)
    try:
        partial.write_text(text, encoding="ascii")
    except (OSError, ValueError) as error:  # ValueError: a NUL in the path
        with contextlib.suppress(OSError, ValueError):
            partial.unlink(missing_ok=True)  # a failed write leaves no file behind
        raise InvalidInputError(
            call, f"{str(path)!r} cannot be written ({os_reason(error)})", _WRITE_FIX
        ) from error
    return partial


def _move_into_place(call: str, partial: Path, path: Path) -> None:
    try:
        os.replace(partial, path)
    except (OSError, ValueError) as error:
        with contextlib.suppress(OSError, ValueError):
            partial.unlink(missing_ok=True)
        raise InvalidInputError(
            call, f"{str(path)!r} cannot be written ({os_reason(error)})", _WRITE_FIX
        ) from error


def _write_atomically(call: str, path: Path, text: str) -> None:
    # Rename over the target, so a crash mid-write never leaves a half log behind.
    _move_into_place(call, _write_partial(call, path, text), path)


def dump_log(log: EffectLog, path: str | os.PathLike[str]) -> None:
    """Write `log` to `path` as JSON Lines. Equal logs give byte-identical files."""
    if not isinstance(log, EffectLog):
        raise InvalidInputError(
            "dump_log", f"log is {a_type(log)}", "pass an EffectLog (e.g. recorder.log)"
        )
    _write_atomically("dump_log", as_path("dump_log", "path", path), _log_text(log))


def log_file_name(rank: int) -> str:
    """The file name `dump_logs` gives rank `rank`'s log, e.g. "rank-0003.jsonl"."""
    return f"rank-{check_int('log_file_name', 'rank', rank, 0):04d}.jsonl"


# How every purepp log starts (any schema version), and so a header cut anywhere.
_LOG_START: Final = b'{"schema": "purepp.effects/'
_RANK_LOG_NAME = re.compile(r"rank-([0-9]{4,})\.jsonl")
_NOT_A_LOG_FIX = (
    "move it out of the folder (purepp check reads every *.jsonl there), or dump the logs "
    "into another folder"
)


def _not_a_purepp_log(path: Path) -> str | None:
    """Why `path` is not a purepp log file; None when it is one, or a crashed rank's start of one.

    A file holding the start of a header only (a rank killed while writing its first
    line, or before it: empty) is a purepp log too: nothing but purepp writes that.
    """
    try:
        if path.is_dir():
            return "a folder"
        if not path.is_file():
            return "not a regular file"
        with path.open("rb") as file:
            start = file.read(len(_LOG_START))
    except (OSError, ValueError) as error:
        return f"it cannot be read: {os_reason(error)}"
    if start != _LOG_START[: len(start)]:
        return f"it starts {start!r}"
    return None


def rank_logs(call: str, folder: Path) -> dict[str, Path]:
    """The files in `folder` named as `dump_logs` names a rank's log, by name: what
    `dump_logs` and `purepp run --log-dir` replace or remove.

    Raises InvalidInputError, naming the file, when one of them is not a purepp log:
    replaced or removed, it would be lost; left, `purepp check` would read it.
    """
    try:
        names = sorted(
            entry.name
            for entry in os.scandir(folder)
            if (match := _RANK_LOG_NAME.fullmatch(entry.name)) is not None
            and entry.name == log_file_name(int(match[1]))
        )
    except OSError as error:
        raise InvalidInputError(
            call,
            f"directory {str(folder)!r} cannot be read ({os_reason(error)})",
            "pass a folder this process may read and write",
        ) from error
    for name in names:
        why = _not_a_purepp_log(folder / name)
        if why is not None:
            raise InvalidInputError(
                call,
                f"{folder / name} is not a purepp log ({why}), and {call} owns the files "
                "named rank-NNNN.jsonl in its folder",
                _NOT_A_LOG_FIX,
            )
    return {name: folder / name for name in names}


# Times the folder's lock is tried while only readers (`purepp check`) hold it.
_LOCK_TRIES = 100


@attrs.frozen
class LogDirHeld:
    """Who holds a log folder's lock: what its writer wrote there (a run's pid and run
    id, a dump's pid; "" before it wrote), or None when only readers held it throughout."""

    writer: str | None


def lock_log_dir(fd: int, holder: str) -> LogDirHeld | None:
    """Take the exclusive lock on `fd`, a log folder's open `LOCK_FILE`, and write `holder`
    into it (so a writer refused meanwhile is named); None once taken, else who holds it.

    `purepp run` holds it for its whole run, a dump while it dumps. `purepp check` tests
    for a writer with a shared lock, held a moment: while only readers hold it, it is
    tried again, up to `_LOCK_TRIES` times. POSIX only (fcntl).
    """
    import fcntl  # here: logs are read and written on any OS; only locking needs POSIX

    for _ in range(_LOCK_TRIES):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            pass
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BlockingIOError:  # exclusive: a writer
            return LogDirHeld(os.pread(fd, 200, 0).decode("ascii", errors="replace").strip())
        time.sleep(0.001)
    else:
        return LogDirHeld(None)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{holder}\n".encode("ascii", errors="replace"), 0)
    return None


@contextlib.contextmanager
def _run_lock_held(call: str, folder: Path) -> Iterator[None]:
    """Hold the folder's `LOCK_FILE` while dumping, where a `purepp run` has made one.

    A live run holds it for its whole run: the dump is then refused. Held, it keeps a
    run from starting there mid-dump. A folder no run used has no lock file: none is
    made (a dump leaves its logs only), so a run started there during the dump is not
    kept out.
    """
    try:
        import fcntl  # noqa: F401  # only to know whether this OS locks (POSIX)
    except ImportError:
        yield
        return
    try:
        fd = os.open(folder / LOCK_FILE, os.O_RDWR)
    except FileNotFoundError:
        yield
        return
    except OSError as error:
        raise InvalidInputError(
            call,
            f"the lock file {str(folder / LOCK_FILE)!r} cannot be opened ({os_reason(error)}), "
            "so whether a purepp run writes the folder is not known",
            "make it readable and writable, or dump the logs into another folder",
        ) from error
    try:
        held = lock_log_dir(fd, f"{os.getpid()} dump_logs")
        if held is not None and held.writer is None:
            raise InvalidInputError(
                call,
                f"directory {str(folder)!r}: its lock is held by readers through "
                f"{_LOCK_TRIES} tries (purepp check, reading it over and over)",
                "dump the logs when nothing checks the folder, or into another folder",
            )
        if held is not None:
            raise InvalidInputError(
                call,
                f"directory {str(folder)!r} is being written by a live purepp run "
                f"(pid and run id: {held.writer or 'not written yet'})",
                "wait for the run to end, or dump the logs into another folder",
            )
        yield
    finally:
        os.close(fd)  # releases the lock


def dump_logs(logs: Iterable[EffectLog], directory: str | os.PathLike[str]) -> tuple[Path, ...]:
    """Write each rank's log into `directory` (created if missing) as `log_file_name(rank)`.

    The folder then holds these logs as its only rank logs, as `purepp run --log-dir`
    leaves it: the logs of other ranks an earlier dump or run left there (files named
    `log_file_name(rank)`) are removed, so `purepp check` reads this world alone. Any
    other file is left as it is. Raises InvalidInputError, and changes nothing, when
    `logs` holds none, when a file of such a name is not a purepp log, or a live
    `purepp run` writes the folder (it holds the folder's `LOCK_FILE`). Every log is
    written before any file is replaced or removed, so a log that cannot be written
    leaves the folder as it was.
    """
    call = "dump_logs"
    if not isinstance(logs, Iterable) or isinstance(logs, str | bytes | EffectLog):
        raise InvalidInputError(
            call, f"logs is {a_type(logs)}", "pass a sequence of EffectLogs, one per rank"
        )
    logs = tuple(logs)
    if not logs:
        # It would remove every rank log in the folder and write none.
        raise InvalidInputError(
            call,
            "logs holds no log (an iterator read once already?), and dump_logs would remove "
            f"every rank log in {str(directory)!r} for none",
            "pass the ranks' logs (a tuple or list: an iterator yields them once)",
        )
    for index, log in enumerate(logs):
        check_instance(call, f"logs[{index}]", log, EffectLog)
    folder = as_path(call, "directory", directory)
    ranks = [log.header.rank for log in logs]
    duplicates = sorted({rank for rank in ranks if ranks.count(rank) > 1})
    if duplicates:
        raise InvalidInputError(
            "dump_logs", f"ranks {duplicates} appear more than once", "pass one log per rank"
        )
    # Logs that load_logs and purepp check would refuse as not one run's: refused now,
    # before the folder is made or any file in it written or removed.
    check_dumpable(call, logs)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as error:  # ValueError: a NUL in the path
        raise InvalidInputError(
            call,
            f"directory {str(folder)!r} cannot be made ({os_reason(error)})",
            "pass a folder path (existing or not) under a folder this process may write to",
        ) from error
    paths = tuple(folder / log_file_name(rank) for rank in ranks)
    with _run_lock_held(call, folder):
        earlier = rank_logs(call, folder)
        partials: list[Path] = []
        try:
            for log, path in zip(logs, paths, strict=True):
                partials.append(_write_partial(call, path, _log_text(log)))
            # Only now, with every log written: a refusal above changed nothing.
            for name in sorted(set(earlier) - {path.name for path in paths}):
                try:
                    earlier[name].unlink(missing_ok=True)
                except OSError as error:
                    raise InvalidInputError(
                        call,
                        f"{earlier[name]}, an earlier log of another rank, cannot be removed "
                        f"({os_reason(error)})",
                        "remove it, or dump the logs into another folder",
                    ) from error
            for partial, path in zip(partials, paths, strict=True):
                _move_into_place(call, partial, path)
        except BaseException:
            for partial in partials:  # those not moved into place yet
                with contextlib.suppress(OSError):
                    partial.unlink(missing_ok=True)
            raise
    return paths


# -- reading one file -------------------------------------------------------------


class _BadJSON(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        keys = [key for key, _ in pairs]
        raise _BadJSON(f"key {next(k for k in keys if keys.count(k) > 1)!r} appears twice")
    return obj


def _no_constant(name: str) -> object:
    raise _BadJSON(f"{name} is not JSON")


_STRUCTURE_ERRORS = (cattrs.BaseValidationError, PureppError, ValueError, TypeError, KeyError)

# A record as the writer spells it, up to the effect's own fields, and those fields.
# At most 18 digits a number: a longer one (past int64, or past Python's int() digit
# limit) misses the fast path and is read in full, where it fails as a format error.
_PREFIX = re.compile(
    rb'\{"seq": (0|[1-9][0-9]{0,17}), "comm_seq": (null|0|[1-9][0-9]{0,17}), "effect": '
    rb'\{"kind": "([a-z_]+)", "step": (0|[1-9][0-9]{0,17}), (.*)'
)
_DECODER = json.JSONDecoder()
_BLOCK_BYTES = 1 << 18  # read a log this much at a time
_TRUNCATED = "the last line is truncated (no newline: the writer stopped mid-line)"
_TRUNCATED_FIX = (
    "check it with `purepp check`, or read it up to the cut with load_log or load_logs"
    "(..., allow_cut_end=True), or record the run again"
)
# Digits 1-9 as "1" (0 stays), so two lines differing only in numbers (and in the
# digits of names) of the same lengths and zeros share one key. A number with a
# leading zero ("007", not JSON) keys as "001", which no valid line has in that place.
_BLANK_DIGITS = bytes.maketrans(b"23456789", b"11111111")
_DIGITS = frozenset(b"0123456789")
# Ten digits may exceed an int32 array's range, fewer never do.
_LONG_NUMBER = re.compile(rb"[0-9]{10}")
# Nineteen may exceed int64 (the reader's bound on every integer), fewer never do: such a
# line has no template, since a line of its key may differ from it past that bound.
_INT64_LONG_NUMBER = re.compile(rb"[0-9]{19}")
_REFS: Final = (BufferRef, EventRef, WorkRef)

# Builds a record's effect from the text after its step (the regex's last group) and
# the step, for lines of one template: their fields sit at the same offsets.
_FieldsBuilder = Callable[[bytes, int], Effect]


def _enums(tp: Any, found: set[type[enum.Enum]]) -> set[type[enum.Enum]]:
    """Every enum class reachable from the type `tp` (fields, tuples, unions)."""
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        found.add(tp)
    elif isinstance(tp, type) and attrs.has(tp):
        for hint in typing.get_type_hints(tp).values():
            _enums(hint, found)
    else:
        for arg in typing.get_args(tp):
            _enums(arg, found)
    return found


# Enum values with digits ("int64"), each with a byte no ASCII line holds: a line's key
# spells them so, and they are not blanked with the digits of numbers and names.
_ENUM_MARKS: Final = tuple(
    (f'"{value}"'.encode("ascii"), bytes([0x80 + index]))
    for index, value in enumerate(
        sorted(
            str(member.value)
            for cls in _enums(Effect, set())
            for member in cls
            if _DIGITS.intersection(str(member.value).encode("ascii"))
        )
    )
)


# The kinds whose lines may hold such a value: only theirs need the marks.
_MARKED_KINDS: Final = frozenset(
    kind.encode("ascii")
    for kind, cls in EFFECT_KINDS.items()
    if any(
        _DIGITS.intersection(str(member.value).encode("ascii"))
        for enum_class in _enums(cls, set())
        for member in enum_class
    )
)


@attrs.frozen
class _Template:
    """What a line validated in full says about the other lines of its key."""

    kind: str  # the effect's kind
    # An int32 array, or numbers one may not hold: build every record to check them
    # (False: a record that never waits needs nothing checked but its numbering).
    build_always: bool
    builder: _FieldsBuilder | None  # builds the effect; None: the JSON decoder reads it


_FIELD_TYPES: Final = {cls: typing.get_type_hints(cls) for cls in EFFECT_CLASSES}
# Kinds holding an int32 array: a line that differs from a validated one in digits alone
# may declare a shape its values do not have, which only building the record checks.
_ARRAY_KINDS: Final = frozenset(
    kind for kind, cls in EFFECT_KINDS.items() if IntArray in _FIELD_TYPES[cls].values()
)

# Keys of lines already validated in full; bounded, as a cache.
_SEEN_TEMPLATES: dict[bytes, _Template] = {}
_MAX_TEMPLATES = 4096


def _template(rest: bytes, effect: Effect, kind: str) -> _Template | None:
    """The template of a valid line whose text after its step is `rest`; None if unusual.

    Escapes (a backslash) could spell digits with letters, and a number of nineteen
    digits or more may lie past int64, so such lines are always read in full.
    """
    if b"\\" in rest or _INT64_LONG_NUMBER.search(rest) is not None:
        return None
    return _Template(
        kind=kind,
        build_always=kind in _ARRAY_KINDS or _LONG_NUMBER.search(rest) is not None,
        builder=_fields_builder(rest, effect),
    )


def _ref_type(hint: Any) -> type[BufferRef | EventRef | WorkRef] | None:
    """The reference class of a field typed `hint` (a ref, or a ref or None), if it is one."""
    for ref in _REFS:
        if hint is ref or hint == ref | None:
            return ref
    return None


# An int32 array field's text (`{"shape": [...], "values": [...]}`) -> its immutable
# array: the same tables recur, step after step. Bounded, as a cache.
_ARRAYS: dict[bytes, IntArray] = {}


def _int32_array_of(text: bytes) -> IntArray:
    """The array an int32 array field's text holds, of a template's line.

    Raises OverflowError (a value outside int32) or ValueError (values not of the
    declared shape): the caller then reads the line in full for the error.
    """
    array = _ARRAYS.get(text)
    if array is None:
        value = _DECODER.raw_decode(text.decode("ascii"))[0]
        array = int32_array(value["values"])
        if array.shape != tuple(value["shape"]):
            raise ValueError(f"values of shape {list(array.shape)}, declared {value['shape']}")
        if len(_ARRAYS) >= _MAX_TEMPLATES:
            _ARRAYS.clear()
        _ARRAYS[text] = array
    return array


def _field_spans(text: str) -> dict[str, tuple[int, int]] | None:
    """Each field's (start, end) in `text` (`"op": ..., "field": value}}`); None if unusual."""
    spans: dict[str, tuple[int, int]] = {}
    at = 0
    try:
        while True:
            name, at = _DECODER.raw_decode(text, at)
            if type(name) is not str or text[at : at + 2] != ": " or name in spans:
                return None
            _, end = _DECODER.raw_decode(text, at + 2)
            spans[name] = (at + 2, end)
            if text[end:] == "}}":
                return spans
            if text[end : end + 2] != ", ":
                return None
            at = end + 2
    except json.JSONDecodeError:
        return None


def _fields_builder(rest: bytes, effect: Effect) -> _FieldsBuilder | None:
    """A builder for lines of `rest`'s template, whose effects are `effect`'s class, or None.

    The template's lines share every byte but the digits of numbers and names (an
    enum value's digits are part of the key), so a field without digits, or an enum,
    is `effect`'s own, and a field with digits is read at its fixed offsets: an int, a
    reference's name, a shape or an int32 array. Other fields (sections) are left to
    the JSON decoder (None).
    """
    spans = _field_spans(rest.decode("ascii"))
    cls = type(effect)
    names = [field.name for field in attrs.fields(cls)]
    if spans is None or sorted(spans) != sorted(names[1:]) or names[0] != "step":
        return None
    hints = _FIELD_TYPES[cls]
    namespace: dict[str, Any] = {"cls": cls, "tuple": tuple, "map": map, "int": int}
    arguments = ["step=step"]
    for name in names[1:]:
        start, end = spans[name]
        hint = hints[name]
        if not _DIGITS.intersection(rest[start:end]) or (
            isinstance(hint, type) and issubclass(hint, enum.Enum)
        ):
            namespace[f"same_{name}"] = getattr(effect, name)
            arguments.append(f"{name}=same_{name}")
        elif hint is int:
            arguments.append(f"{name}=int(rest[{start}:{end}])")
        elif (ref := _ref_type(hint)) is not None and rest[start : start + 1] == b'"':
            # (An optional ref's lines all hold a name: null has no digits.)
            namespace[f"ref_{name}"] = ref
            arguments.append(f"{name}=ref_{name}(rest[{start + 1}:{end - 1}].decode())")
        elif hint == tuple[int, ...]:
            arguments.append(f"{name}=tuple(map(int, rest[{start + 1}:{end - 1}].split(b', ')))")
        elif hint == IntArray:
            namespace["int32_array_of"] = _int32_array_of
            arguments.append(f"{name}=int32_array_of(rest[{start}:{end}])")
        else:
            return None
    # The text is built from field names and offsets only.
    exec(f"def build(rest, step):\n    return cls({', '.join(arguments)})\n", namespace)
    return typing.cast(_FieldsBuilder, namespace["build"])


class LogStream:
    """One rank's log read a record at a time: the header at once, records on demand.

    Every error names the file and the line. With `allow_cut_end`, a last line with
    no newline (the writer stopped mid-record) ends the records instead of raising,
    and `cut_line` then holds its line number; corruption anywhere else still raises.
    Iterate (or `scan`) once; the file is closed when the records end or on `close()`.
    Iterating builds every record as `scan` does, through the templates of lines
    already validated in full. Errors name `call`: a function that reads logs through a
    LogStream passes its own name, so its caller reads the call they made.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        expect_world: Layout | None = None,
        allow_cut_end: bool = False,
        call: str = "LogStream",
    ) -> None:
        if type(call) is not str:
            raise InvalidInputError(
                "LogStream", f"call is {a_type(call)}", "pass the name errors give, a str"
            )
        self._call = call
        self.path = as_path(call, "path", path)
        check_world(call, expect_world)
        self._allow_cut_end = check_bool(call, "allow_cut_end", allow_cut_end)
        self.cut_line: int | None = None  # line number of a cut last line, once reached
        self.lines_read = 0  # lines consumed so far, the header included
        try:
            self._file: BinaryIO | None = self.path.open("rb")
        except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
            raise self._fail(
                None, f"cannot be read ({os_reason(exc)})", "pass an existing log file"
            ) from exc
        try:
            self.header = self._read_header(expect_world)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __iter__(self) -> Iterator[LogRecord]:
        # The numbers as written: `scan` raises unless they are the ones this rule gives.
        numbering = Numbering()
        for _, _, effect, _ in self.scan(frozenset()):
            assert effect is not None  # no local kinds: every record is built
            yield numbering.number(effect)

    def scan(self, local_kinds: frozenset[str]) -> Iterator[tuple[int, str, Effect | None, int]]:
        """(step, kind, effect, count) per record, as strict as reading every line in full.

        For the checker, which reads long logs and needs the records of `local_kinds`
        only for their steps: those come as effect None, and consecutive ones of one
        step as one item counting them (`kind` is the first one's). A line that
        differs from a line already validated in full only in its digits (the same
        keys, kinds and enum values; numbers and names of the same lengths) is not
        validated again: it is built directly (its fields read at the validated
        line's offsets), or, for `local_kinds`, not built at all. Its numbering is
        still checked, a record holding a number of ten digits or more is still built
        (an int32 array may not hold it), and any other line is read in full, so a bad
        log fails with the error reading it all in full gives. The file is read a block
        at a time.
        """
        numbering = Numbering()
        local = frozenset(kind.encode("ascii") for kind in local_kinds)
        match, blank, seen = _PREFIX.match, _BLANK_DIGITS, _SEEN_TEMPLATES
        marks, marked_kinds = _ENUM_MARKS, _MARKED_KINDS
        run_step, run_kind, run = 0, "", 0  # the local records not yet yielded
        item: tuple[int, str, Effect | None, int]
        line_number = self.lines_read
        try:
            for block in self._blocks():
                for line in block:
                    line_number += 1
                    prefix = match(line)
                    key = template = None
                    if prefix is not None:
                        seq, comm_seq, kind, step, rest = prefix.groups()
                        # The key: the line after its step with the digits of numbers
                        # and names blanked, of ASCII lines only (as the writer's are),
                        # so a mark stands for its enum value alone.
                        if rest.isascii():
                            marked = rest
                            if kind in marked_kinds:
                                for value, mark in marks:
                                    marked = marked.replace(value, mark)
                            key = kind + marked.translate(blank)
                            template = seen.get(key)
                    if (
                        template is not None
                        and kind in local
                        and comm_seq == b"null"
                        and not template.build_always
                    ):
                        # The hot path: most records never wait and are not built.
                        if int(seq) != numbering.next_seq:
                            self.lines_read = line_number
                            self._record(line, numbering)  # raises, naming the seq
                        numbering.skip_local()
                        if run and int(step) == run_step:
                            run += 1
                            continue
                        item = (int(step), template.kind, None, 1)
                    else:
                        self.lines_read = line_number
                        item = (
                            self._validated(line, prefix, key, numbering, local_kinds)
                            if template is None
                            else self._from_template(
                                (seq, comm_seq, step, rest), template, line, numbering, local_kinds
                            )
                        )
                    if run and item[2] is None and item[0] == run_step:
                        run += 1
                        continue
                    if run:
                        yield run_step, run_kind, None, run
                        run = 0
                    if item[2] is None:
                        run_step, run_kind, run = item[0], item[1], 1
                    else:
                        yield item
                self.lines_read = line_number
            if run:
                yield run_step, run_kind, None, run
        finally:
            self.close()

    def _validated(
        self,
        line: bytes,
        prefix: re.Match[bytes] | None,
        key: bytes | None,
        numbering: Numbering,
        local_kinds: frozenset[str],
    ) -> tuple[int, str, Effect | None, int]:
        """Read `line` in full; remember its template under `key` once it proved valid."""
        effect = self._record(line, numbering).effect
        kind = kind_of(effect)
        if key is not None and prefix is not None:
            template = _template(prefix[5], effect, kind)
            if template is not None:
                if len(_SEEN_TEMPLATES) >= _MAX_TEMPLATES:
                    _SEEN_TEMPLATES.clear()
                _SEEN_TEMPLATES[key] = template
        return effect.step, kind, None if kind in local_kinds else effect, 1

    def _from_template(
        self,
        fields: tuple[bytes, bytes, bytes, bytes],
        template: _Template,
        line: bytes,
        numbering: Numbering,
        local_kinds: frozenset[str],
    ) -> tuple[int, str, Effect | None, int]:
        """Read `line`, of a template validated in full, without validating it again.

        `fields`: its seq, comm_seq and step as written, and the text after the step.
        """
        seq_digits, comm_seq, step_digits, rest = fields
        kind, seq, step = template.kind, int(seq_digits), int(step_digits)
        try:
            if template.builder is not None:
                effect = template.builder(rest, step)
                logged_comm_seq = None if comm_seq == b"null" else int(comm_seq)
            else:
                # The template's line was valid JSON and this one differs in digits alone,
                # so the plain decoder (no encoding sniffing, no trailing-text check) reads it.
                value = _DECODER.raw_decode(line.decode("utf-8"))[0]
                effect = build_checked_effect(kind, value["effect"])
                logged_comm_seq = value["comm_seq"]
        except (ValueError, OverflowError, KeyError):
            return step, kind, self._record(line, numbering).effect, 1  # raises the full error
        expected_seq, expected_comm_seq = numbering.expect(effect)
        if expected_seq != seq or expected_comm_seq != logged_comm_seq:
            record = LogRecord(seq=seq, comm_seq=logged_comm_seq, effect=effect)
            expected = LogRecord(seq=expected_seq, comm_seq=expected_comm_seq, effect=effect)
            raise self._fail(self.lines_read, str(numbering_problem(record, expected)))
        return step, kind, None if kind in local_kinds else effect, 1

    def _blocks(self) -> Iterator[list[bytes]]:
        """The complete lines after those read so far (without newlines), a block at a time.

        Stops at a cut last line (with `allow_cut_end`, setting `cut_line`) or raises
        naming it; `lines_read` is the caller's to advance.
        """
        if self._file is None:
            return
        read, tail, lines_read = self._file.read, b"", self.lines_read
        while block := read(_BLOCK_BYTES):
            lines = (tail + block).split(b"\n")
            tail = lines.pop()
            lines_read += len(lines)
            yield lines
        if tail:
            # Every line ends in a newline when written, so text after the last one is a
            # line the writer never finished (a crash or a kill mid-write).
            self.lines_read = lines_read + 1
            if self._allow_cut_end:
                self.cut_line = self.lines_read
                return
            raise self._fail(self.lines_read, _TRUNCATED, _TRUNCATED_FIX)

    # -- lines --

    def _fail(self, line: int | None, problem: str, fix: str = _REWRITE) -> LogFormatError:
        where = str(self.path) if line is None else f"{self.path} line {line}"
        return LogFormatError(self._call, f"{where}: {problem}", fix)

    def _header_line(self) -> bytes | None:
        """The first line (without its newline); None for an empty file."""
        assert self._file is not None  # opened by __init__, which reads the header first
        data = self._file.readline()
        if not data:
            return None
        self.lines_read = 1
        if data.endswith(b"\n"):
            return data[:-1]
        # Every line ends in a newline when written, and even a cut log needs its header
        # (`purepp check` reads the world from it).
        raise self._fail(1, _TRUNCATED, "record the run again: its header was never finished")

    def _json_object(self, data: bytes) -> dict[str, object]:
        line = self.lines_read
        try:
            value = json.loads(
                data.decode("utf-8"),
                object_pairs_hook=_no_duplicate_keys,
                parse_constant=_no_constant,
            )
        except UnicodeDecodeError as exc:
            problem = f"byte {exc.start} of the line is not UTF-8 (corrupted file)"
            raise self._fail(line, problem) from exc
        except json.JSONDecodeError as exc:
            if not data.strip():
                raise self._fail(line, "an empty line (a log has none)") from exc
            raise self._fail(line, f"corrupted JSON at column {exc.colno} ({exc.msg})") from exc
        except _BadJSON as exc:
            raise self._fail(line, f"corrupted JSON ({exc})") from exc
        except RecursionError as exc:  # json's C parser recurses per nesting level
            raise self._fail(line, "corrupted JSON (nested too deeply)") from exc
        except ValueError as exc:  # the one left: an integer past Python's digit limit
            raise self._fail(line, "corrupted JSON (a number too long to read)") from exc
        if type(value) is not dict:
            raise self._fail(line, f"expected a JSON object, got {data[:60]!r}")
        return value

    # -- header and records --

    def _read_header(self, expect_world: Layout | None) -> LogHeader:
        data = self._header_line()
        if data is None:
            raise self._fail(
                None, "the file is empty: no header line", "pass a log that dump_log wrote"
            )
        obj = self._json_object(data)
        # The version first: another version's header may have other keys.
        schema = obj.pop("schema", None)
        if schema != SCHEMA:
            what = "no schema" if schema is None else f"schema {schema!r}"
            raise self._fail(
                1,
                f"{what}; this purepp reads only {SCHEMA!r}",
                "read it with the purepp version that wrote it, or record the run again",
            )
        # Every key is required in a file, but for those added since (absent: not recorded).
        required = [f.name for f in attrs.fields(LogHeader) if f.name not in _OPTIONAL_HEADER_KEYS]
        missing = [name for name in required if name not in obj]
        if missing:
            raise self._fail(1, f"required field missing @ header.{missing[0]}")
        # The digest is compared here, naming the file: LogHeader would refuse it unnamed.
        digest = obj.pop("config_digest", None)
        try:
            header = CONVERTER.structure(obj, LogHeader)
        except _STRUCTURE_ERRORS as exc:
            raise self._fail(1, describe_structure_error(exc, "header"), _OTHER_FIELDS) from exc
        if digest is not None:
            if type(digest) is not str or digest != config_digest(header.config):
                raise self._fail(
                    1,
                    f"config_digest is {digest!r} but the config's digest is "
                    f"{config_digest(header.config)!r}: the config was changed after the run",
                    "check the logs the run wrote, unedited",
                )
            header = attrs.evolve(header, config_digest=digest)
        if expect_world is not None and header.world != expect_world:
            raise self._fail(
                1,
                f"the log is of world pp={header.world.pp}, dp={header.world.dp}, "
                f"expected pp={expect_world.pp}, dp={expect_world.dp}",
                "load the logs of the run you meant, or pass its layout as expect_world",
            )
        return header

    def _record(self, data: bytes, numbering: Numbering) -> LogRecord:
        obj = self._json_object(data)
        if "schema" in obj:
            raise self._fail(
                self.lines_read,
                f"a header ({_dumps(obj.get('schema'))}, rank {_dumps(obj.get('rank'))}) where a "
                "record belongs: two logs were joined into one file",
                "keep each rank's log in a file of its own, as dump_logs writes them",
            )
        try:
            record = CONVERTER.structure(obj, LogRecord)
        except _STRUCTURE_ERRORS as exc:
            raise self._fail(
                self.lines_read, describe_structure_error(exc, "record"), _OTHER_FIELDS
            ) from exc
        problem = numbering_problem(record, numbering.number(record.effect))
        if problem is not None:
            raise self._fail(self.lines_read, problem)
        return record


def load_log(
    path: str | os.PathLike[str],
    *,
    expect_world: Layout | None = None,
    allow_cut_end: bool = False,
) -> EffectLog:
    """Read one rank's log; raise LogFormatError (file, line, what) on any defect.

    With `expect_world`, a log of another PP x DP layout is rejected too. With
    `allow_cut_end`, a last line the writer never finished (the rank died while
    writing) ends the records instead of raising, as `purepp check` reads it.
    """
    return _read_log("load_log", path, expect_world=expect_world, allow_cut_end=allow_cut_end)


def _read_log(
    call: str,
    path: str | os.PathLike[str],
    *,
    expect_world: Layout | None,
    allow_cut_end: bool,
) -> EffectLog:
    stream = LogStream(path, expect_world=expect_world, allow_cut_end=allow_cut_end, call=call)
    return EffectLog(stream.header, tuple(stream))


# -- a header the writer never finished --------------------------------------------

# A header line as the writer spells it, up to its config: its text and, as None, the
# numbers of its rank, pp and dp.
_HEADER_PARTS: Final = (
    b'{"schema": "' + SCHEMA.encode("ascii") + b'", "rank": ',
    None,
    b', "world": {"pp": ',
    None,
    b', "dp": ',
    None,
    b'}, "config": ',
)
_HEADER_NUMBER = re.compile(rb"0|[1-9][0-9]{0,17}")
# What the writer's JSON lines hold (ensure_ascii escapes every other character).
_PRINTABLE = bytes(range(0x20, 0x7F))


@attrs.frozen(kw_only=True)
class CutHeader:
    """A log holding only the start of its header line: its rank died writing its first line.

    Such a rank recorded nothing: `purepp check` checks it as a rank with no log.
    """

    path: Path  # the file
    size: int  # bytes of the header line it holds (0: an empty file)
    rank: int | None  # the rank that wrote it, when the cut came after its rank
    world: Layout | None  # the world, when the cut came after it

    def describe(self) -> str:
        if self.size == 0:
            return f"{self.path.name} is empty (the rank died as it began to write its header)"
        return (
            f"{self.path.name} holds only a cut header ({self.size} bytes of its first line: "
            "the rank died while writing it)"
        )


def _header_start(data: bytes) -> tuple[int, ...] | None:
    """The numbers (rank, pp, dp) that `data`, the start of a header line, spells whole.

    None when `data` is not how a header line this purepp writes starts.
    """
    numbers: list[int] = []
    at = 0
    for part in _HEADER_PARTS:
        rest = data[at:]
        if part is None:
            number = _HEADER_NUMBER.match(rest)
            if number is None:
                return None if rest else tuple(numbers)
            if number.end() == len(rest):
                return tuple(numbers)  # cut in the number, or right after it: not known whole
            numbers.append(int(number[0]))
            at += number.end()
        elif not part.startswith(rest[: len(part)]):
            return None
        elif len(rest) <= len(part):
            return tuple(numbers)
        else:
            at += len(part)
    return tuple(numbers)  # then the config and the rest: any text JSON allows


def read_cut_header(path: str | os.PathLike[str]) -> CutHeader | None:
    """`path`'s header, when the file holds only the start of one (no newline); else None.

    The writer writes a header line whole, ending in a newline, so a file holding
    only the start of one (the printable ASCII the writer writes, spelling what a
    header of this purepp starts with) is a rank that died while writing its first
    line, or, empty, before. A file with a newline (a whole first line, perhaps
    corrupt), or bytes no header starts with, is not: None. So is one that cannot be
    read. `LogStream` refuses both; `purepp check` asks this which it was.
    """
    path = as_path("read_cut_header", "path", path)
    size = 0
    try:
        with path.open("rb") as file:
            numbers = None
            while block := file.read(_BLOCK_BYTES):
                if block.translate(None, _PRINTABLE):  # a newline, or bytes no writer writes
                    return None
                if numbers is None:
                    numbers = _header_start(block)  # its fixed text fits in one block
                    if numbers is None:
                        return None
                size += len(block)
    except (OSError, ValueError):
        return None
    rank = numbers[0] if numbers else None
    world = None
    if numbers is not None and len(numbers) == 3:
        try:
            world = Layout(pp=numbers[1], dp=numbers[2])
        except PureppError:
            return None  # pp or dp 0: no header holds that
    return CutHeader(path=path, size=size, rank=rank, world=world)


# -- reading a run's directory ----------------------------------------------------


def _dir_fail(directory: Path, problem: str, fix: str) -> LogFormatError:
    return LogFormatError("load_logs", f"{directory}: {problem}", fix)


def log_paths(directory: str | os.PathLike[str]) -> tuple[Path, ...]:
    """The `*.jsonl` logs in `directory`, sorted; LogFormatError when there are none."""
    directory = as_path("load_logs", "directory", directory)
    try:
        if not directory.is_dir():
            raise _dir_fail(
                directory,
                "is not a directory",
                "pass the directory the ranks' logs were written to",
            )
        paths = tuple(sorted(directory.glob("*.jsonl")))
        # A folder above the logs' (runs kept side by side): name where they are.
        below = () if paths else tuple(sorted({p.parent for p in directory.glob("*/*.jsonl")}))
        # Logs compressed to be moved between machines.
        packed = () if paths else tuple(sorted(p.name for p in directory.glob("*.jsonl.*")))
    except (OSError, ValueError) as error:  # a name too long, a NUL in the path
        raise _dir_fail(
            directory,
            f"cannot be read ({os_reason(error)})",
            "pass the directory the ranks' logs were written to",
        ) from error
    odd = [path.name for path in paths if not path.is_file()]  # a FIFO would block a read
    if odd:
        raise _dir_fail(
            directory,
            f"{odd[0]} is not a regular file",
            "keep only the ranks' log files under *.jsonl names in the folder",
        )
    if not paths:
        if below:
            shown = ", ".join(repr(str(folder)) for folder in below[:3])
            more = f" and {len(below) - 3} more" if len(below) > 3 else ""
            raise _dir_fail(
                directory,
                f"holds no *.jsonl logs, but its folder{'s' if len(below) > 1 else ''} "
                f"{shown}{more} {'do' if len(below) > 1 else 'does'}",
                f"pass the folder a run's logs were written to, such as {str(below[0])!r}",
            )
        if packed:
            raise _dir_fail(
                directory,
                f"holds no *.jsonl logs, but {', '.join(packed[:3])}"
                f"{', ...' if len(packed) > 3 else ''}",
                "decompress the logs into *.jsonl files (e.g. gunzip rank-*.jsonl.gz) first",
            )
        raise _dir_fail(
            directory, "holds no *.jsonl logs", "pass the directory the ranks' logs were written to"
        )
    return paths


def log_dir_writer(directory: Path) -> str | None:
    """The lock's text (pid and run id) when a `purepp run` still writes `directory`."""
    try:
        import fcntl  # here: logs are read on any OS, and purepp run locks only on POSIX
    except ImportError:
        return None
    try:
        with (directory / LOCK_FILE).open("r") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return lock.read(200).strip()
    except (OSError, ValueError):  # no lock file (a run removed it), a NUL in the path
        pass
    return None


def _show(value: str | None) -> str:
    return "none" if value is None else repr(value)


def _runs(named: Sequence[tuple[str, LogHeader]], holder: str) -> str:
    """Which logs are of which run, for a folder (or a `dump_logs` call) holding several
    runs' logs."""
    runs: dict[str | None, list[str]] = {}
    for name, header in named:
        runs.setdefault(header.run_id, []).append(name)
    shown = [
        f"run_id {_show(run_id)}: {', '.join(names[:4])}{', ...' if len(names) > 4 else ''}"
        for run_id, names in runs.items()
    ]
    return f"{holder} holds logs of {len(runs)} runs ({'; '.join(shown)})"


def _check_one_run(
    named: Sequence[tuple[str, LogHeader]],
    fail: Callable[[str, str], PureppError],
    *,
    holder: str,
    one_run: str,
    apart: str,
    allow_missing: bool,
) -> tuple[int, ...]:
    """The rule of one run's logs, for a folder read (`check_same_run`) and for the logs
    `dump_logs` would write; `fail(problem, fix)` is the error each raises."""
    first_name, first = named[0]
    world = first.world
    seen: dict[int, str] = {}
    for name, header in named:
        both = f"{first_name} and {name}"
        if header.world != world:
            one_run_id = header.run_id is not None and header.run_id == first.run_id
            raise fail(
                f"{first_name} is of world pp={world.pp}, dp={world.dp} but {name} "
                f"of pp={header.world.pp}, dp={header.world.dp}"
                + (f", both of run {header.run_id!r}" if one_run_id else ""),
                "give every rank's LogHeader the run's one Layout" if one_run_id else one_run,
            )
        if header.run_id != first.run_id:
            raise fail(
                f"{both} are of different runs; {_runs(named, holder)}", f"{one_run} ({apart})"
            )
        if header.config_digest != first.config_digest:
            raise fail(
                f"{both} differ in config_digest ({_show(first.config_digest)} and "
                f"{_show(header.config_digest)}): differently configured runs",
                one_run,
            )
        if canonical_json(header.config) != canonical_json(first.config):
            raise fail(
                f"{both} have different configs: "
                f"{canonical_json(first.config)[:80]} and {canonical_json(header.config)[:80]}",
                one_run,
            )
        if header.rank in seen:
            # One run id: one run whose ranks were given the same header rank.
            headers_fix = "give each rank's Recorder a LogHeader of its own global rank"
            raise fail(
                f"{seen[header.rank]} and {name} are both rank {header.rank}"
                + ("" if header.run_id is None else f" of run {header.run_id!r}"),
                headers_fix if header.run_id is not None else f"{one_run}, or {headers_fix}",
            )
        seen[header.rank] = name
    missing = [rank for rank in range(world.world_size) if rank not in seen]
    if missing and not allow_missing:
        raise fail(
            f"ranks {missing} of a world of {world.world_size} (pp={world.pp}, dp={world.dp}) "
            "have no log",
            "copy every rank's log into the directory",
        )
    return tuple(missing)


def check_same_run(
    directory: Path, headers: Sequence[tuple[Path, LogHeader]], *, allow_missing: bool = False
) -> tuple[int, ...]:
    """Raise LogFormatError, naming both files, unless the headers are one run's ranks.

    One run's logs share the world, the run id, the config and its digest, and hold
    every rank exactly once. With `allow_missing`, ranks that have no log are returned
    instead of refused (the headers say the world, so which ranks they are is known).
    """
    return _check_one_run(
        [(path.name, header) for path, header in headers],
        lambda problem, fix: _dir_fail(directory, problem, fix),
        holder="the folder",
        one_run=_ONE_RUN,
        apart="move each run's logs to a folder of its own",
        allow_missing=allow_missing,
    )


def check_dumpable(call: str, logs: Sequence[EffectLog]) -> None:
    """Raise InvalidInputError unless `logs` are ranks of one run, as `check_same_run`
    (so `load_logs` and `purepp check`) would find the folder they are written to.

    Ranks with no log are let be, as `purepp check` lets them (a rank that died wrote
    none); two logs of one rank, or of two worlds, runs or configs, are refused.
    """
    _check_one_run(
        [(f"logs[{index}] (rank {log.header.rank})", log.header) for index, log in enumerate(logs)],
        lambda problem, fix: InvalidInputError(call, problem, fix),
        holder="logs",
        one_run="pass the logs of one run",
        apart="dump each run's logs into a folder of its own",
        allow_missing=True,
    )


def load_logs(
    directory: str | os.PathLike[str],
    *,
    expect_world: Layout | None = None,
    allow_cut_end: bool = False,
) -> tuple[EffectLog, ...]:
    """Read every rank's log (`*.jsonl`) in `directory`, indexed by rank.

    The headers decide the ranks, not the file names. Raises LogFormatError when a
    log is bad, when the logs are not one run's (world, run id, config), or when a
    rank is missing or appears twice. `allow_cut_end`: as for `load_log`, every log.
    """
    directory = as_path("load_logs", "directory", directory)
    check_world("load_logs", expect_world)
    allow_cut_end = check_bool("load_logs", "allow_cut_end", allow_cut_end)
    logs = [
        (
            path,
            _read_log("load_logs", path, expect_world=expect_world, allow_cut_end=allow_cut_end),
        )
        for path in log_paths(directory)
    ]
    check_same_run(directory, [(path, log.header) for path, log in logs])
    return tuple(log for _, log in sorted(logs, key=lambda item: item[1].header.rank))
