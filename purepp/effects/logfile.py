"""Effect log files: one JSON Lines file per rank, written whole or read a line at a time.

Line 1 is the header::

    {"schema": "purepp.effects/1", "rank": 3, "world": {"pp": 2, "dp": 2}, "config": {...},
     "run_id": "...", "config_digest": "sha256:..."}

(`run_id` and `config_digest` are written only when set, so logs without them read
and write byte for byte as before), and every further line is one numbered record::

    {"seq": 7, "comm_seq": 2, "effect": {"kind": "broadcast", "step": 4, "op": "broadcast", ...}}

`load_log` is strict and all-or-nothing: any defect raises `LogFormatError` naming
the file, the line and what was wrong, and nothing half-loaded is returned.
`LogStream` reads the same format one record at a time for `purepp check`, and can
stop at a last line the writer never finished (the rank died while writing) instead
of refusing the file: that is the log a crash leaves.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

import attrs
import cattrs

from purepp.effects._converter import (
    CONVERTER,
    build_checked_effect,
    canonical_json,
    describe_structure_error,
    kind_of,
)
from purepp.effects.logmodel import (
    SCHEMA,
    EffectLog,
    LogHeader,
    LogRecord,
    Numbering,
    config_digest,
    numbering_problem,
)
from purepp.effects.vocabulary import Effect
from purepp.errors import InvalidInputError, LogFormatError, PureppError
from purepp.layout import Layout

__all__ = [
    "LogStream",
    "check_same_run",
    "dump_log",
    "dump_logs",
    "header_json",
    "load_log",
    "load_logs",
    "log_file_name",
    "log_paths",
    "record_json",
    "record_lines",
]

_REWRITE = "regenerate the log with purepp's Recorder or dump_log; do not edit logs by hand"
_ONE_RUN = "keep only the logs of one run in the directory"
# Header keys a file may leave out (logs written before they existed).
_OPTIONAL_HEADER_KEYS = ("run_id", "config_digest")


# -- writing --------------------------------------------------------------------


def _dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=True, allow_nan=False)


def header_json(header: LogHeader) -> str:
    """The header's line as written in a log file (without the newline)."""
    fields = CONVERTER.unstructure(header, LogHeader)
    for key in _OPTIONAL_HEADER_KEYS:
        if fields[key] is None:
            del fields[key]
    return _dumps({"schema": SCHEMA, **fields})


def record_json(record: LogRecord) -> str:
    """A record's line as written in a log file (without the newline)."""
    return _dumps(CONVERTER.unstructure(record, LogRecord))


def record_lines(call: str, records: Sequence[LogRecord], first_seq: int) -> list[str]:
    """Each record's line with its newline; InvalidInputError naming `call` if one cannot be."""
    lines = []
    for record in records:
        try:
            lines.append(record_json(record) + "\n")
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(
                call,
                f"effect {first_seq + len(lines)} ({record.effect!r}) cannot be written as "
                f"JSON: {exc}",
                "give effect fields the types their class declares (int, not float)",
            ) from exc
    return lines


def _log_text(log: EffectLog) -> str:
    return header_json(log.header) + "\n" + "".join(record_lines("dump_log", log.records, 0))


def _write_atomically(path: Path, text: str) -> None:
    # Rename over the target, so a crash mid-write never leaves a half log behind.
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text, encoding="ascii")
    os.replace(partial, path)


def dump_log(log: EffectLog, path: str | os.PathLike[str]) -> None:
    """Write `log` to `path` as JSON Lines. Equal logs give byte-identical files."""
    if not isinstance(log, EffectLog):
        raise InvalidInputError(
            "dump_log", f"log is a {type(log).__name__}", "pass an EffectLog (e.g. recorder.log)"
        )
    _write_atomically(Path(path), _log_text(log))


def log_file_name(rank: int) -> str:
    """The file name `dump_logs` gives rank `rank`'s log, e.g. "rank-0003.jsonl"."""
    return f"rank-{rank:04d}.jsonl"


def dump_logs(logs: Iterable[EffectLog], directory: str | os.PathLike[str]) -> tuple[Path, ...]:
    """Write each rank's log into `directory` (created if missing) as `log_file_name(rank)`."""
    logs = tuple(logs)
    ranks = [log.header.rank for log in logs]
    duplicates = sorted({rank for rank in ranks if ranks.count(rank) > 1})
    if duplicates:
        raise InvalidInputError(
            "dump_logs", f"ranks {duplicates} appear more than once", "pass one log per rank"
        )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = tuple(directory / log_file_name(rank) for rank in ranks)
    for log, path in zip(logs, paths, strict=True):
        dump_log(log, path)
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

# A record as the writer spells it, up to the effect's own fields.
_PREFIX = re.compile(
    rb'\{"seq": (0|[1-9][0-9]*), "comm_seq": (null|0|[1-9][0-9]*), "effect": '
    rb'\{"kind": "([a-z_]+)", "step": (0|[1-9][0-9]*), '
)
# Digits 1-9 as "1" (0 stays), so two lines differing only in numbers (and in the
# digits of names) of the same lengths and zeros share one key. A number with a
# leading zero ("007", not JSON) keys as "001", which no valid line has in that place.
_BLANK_DIGITS = bytes.maketrans(b"23456789", b"11111111")
# Keys of lines already validated in full; bounded, as a cache.
_SEEN_TEMPLATES: set[bytes] = set()
_MAX_TEMPLATES = 4096


class LogStream:
    """One rank's log read a record at a time: the header at once, records on demand.

    Every error names the file and the line. With `allow_cut_end`, a last line with
    no newline (the writer stopped mid-record) ends the records instead of raising,
    and `cut_line` then holds its line number; corruption anywhere else still raises.
    Iterate once; the file is closed when the records end or on `close()`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        expect_world: Layout | None = None,
        allow_cut_end: bool = False,
    ) -> None:
        self.path = Path(path)
        self._allow_cut_end = allow_cut_end
        self.cut_line: int | None = None  # line number of a cut last line, once reached
        self.lines_read = 0  # lines consumed so far, the header included
        try:
            self._file: BinaryIO | None = self.path.open("rb")
        except OSError as exc:
            raise self._fail(
                None, f"cannot be read ({exc.strerror})", "pass an existing log file"
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
        numbering = Numbering()
        try:
            while (line := self._next_line()) is not None:
                yield self._record(line, numbering)
        finally:
            self.close()

    def scan(self, local_kinds: frozenset[str]) -> Iterator[tuple[int, str, Effect | None, int]]:
        """(step, kind, effect, count) per record, as strict as iterating.

        For the checker, which reads long logs and needs the records of `local_kinds`
        only for their steps: those come as effect None, and consecutive ones of one
        step as one item counting them (`kind` is the first one's). A line that
        differs from a line already validated in full only in its digits (the same
        keys, kinds and enum values; numbers and names of the same lengths) is not
        validated again: it is built directly, or, for `local_kinds`, not built at
        all. Its numbering is still checked, and any other line is read in full, so
        a bad log fails as it does when iterated.
        """
        numbering = Numbering()
        local = {kind.encode("ascii"): kind for kind in local_kinds}
        run_step, run_kind, run = 0, "", 0  # the local records not yet yielded
        try:
            while (line := self._next_line()) is not None:
                prefix = _PREFIX.match(line)
                key = None if prefix is None else _template_key(prefix, line)
                if key is None or prefix is None or key not in _SEEN_TEMPLATES:
                    effect = self._record(line, numbering).effect
                    if key is not None:
                        if len(_SEEN_TEMPLATES) >= _MAX_TEMPLATES:
                            _SEEN_TEMPLATES.clear()
                        _SEEN_TEMPLATES.add(key)
                    kind = kind_of(effect)
                    item = (effect.step, kind, None if kind in local_kinds else effect, 1)
                elif prefix[3] in local and prefix[2] == b"null":
                    # The hot path: most records never wait and are not built.
                    if int(prefix[1]) != numbering.next_seq:
                        self._record(line, numbering)  # raises, naming the seq
                    numbering.skip_local()
                    step = int(prefix[4])
                    if run and step == run_step:
                        run += 1
                        continue
                    item = (step, local[prefix[3]], None, 1)
                else:
                    item = self._from_template(prefix, line, numbering, local_kinds)
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
            if run:
                yield run_step, run_kind, None, run
        finally:
            self.close()

    def _from_template(
        self,
        prefix: re.Match[bytes],
        line: bytes,
        numbering: Numbering,
        local_kinds: frozenset[str],
    ) -> tuple[int, str, Effect | None, int]:
        """Read `line`, whose template was validated in full, without validating it again."""
        seq, kind, step = int(prefix[1]), prefix[3].decode("ascii"), int(prefix[4])
        value = json.loads(line)
        try:
            effect = build_checked_effect(kind, value["effect"])
        except (ValueError, OverflowError):
            return step, kind, self._record(line, numbering).effect, 1  # raises the full error
        expected_seq, expected_comm_seq = numbering.expect(effect)
        if expected_seq != seq or expected_comm_seq != value["comm_seq"]:
            record = LogRecord(seq=seq, comm_seq=value["comm_seq"], effect=effect)
            expected = LogRecord(seq=expected_seq, comm_seq=expected_comm_seq, effect=effect)
            raise self._fail(self.lines_read, str(numbering_problem(record, expected)))
        return step, kind, None if kind in local_kinds else effect, 1

    # -- lines --

    def _fail(self, line: int | None, problem: str, fix: str = _REWRITE) -> LogFormatError:
        where = str(self.path) if line is None else f"{self.path} line {line}"
        return LogFormatError("load_log", f"{where}: {problem}", fix)

    def _next_line(self) -> bytes | None:
        """The next complete line (without its newline); None at the end or at a cut."""
        if self._file is None:
            return None
        data = self._file.readline()
        if not data:
            return None
        self.lines_read += 1
        if data.endswith(b"\n"):
            return data[:-1]
        # Every line ends in a newline when written, so text after the last one is a
        # line the writer never finished (a crash or a kill mid-write).
        if self._allow_cut_end and self.lines_read > 1:
            self.cut_line = self.lines_read
            return None
        raise self._fail(
            self.lines_read,
            "the last line is truncated (no newline: the writer stopped mid-line)",
            "check it with `purepp check`, which reads a log up to the cut, "
            "or record the run again",
        )

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
            raise self._fail(line, f"corrupted JSON at column {exc.colno} ({exc.msg})") from exc
        except _BadJSON as exc:
            raise self._fail(line, f"corrupted JSON ({exc})") from exc
        if type(value) is not dict:
            raise self._fail(line, f"expected a JSON object, got {data[:60]!r}")
        return value

    # -- header and records --

    def _read_header(self, expect_world: Layout | None) -> LogHeader:
        data = self._next_line()
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
        try:
            header = CONVERTER.structure(obj, LogHeader)
        except _STRUCTURE_ERRORS as exc:
            raise self._fail(1, describe_structure_error(exc, "header")) from exc
        if header.config_digest is not None and header.config_digest != config_digest(
            header.config
        ):
            raise self._fail(
                1,
                f"config_digest is {header.config_digest!r} but the config's digest is "
                f"{config_digest(header.config)!r}: the config was changed after the run",
                "check the logs the run wrote, unedited",
            )
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
        try:
            record = CONVERTER.structure(obj, LogRecord)
        except _STRUCTURE_ERRORS as exc:
            raise self._fail(self.lines_read, describe_structure_error(exc, "record")) from exc
        problem = numbering_problem(record, numbering.number(record.effect))
        if problem is not None:
            raise self._fail(self.lines_read, problem)
        return record


def _template_key(prefix: re.Match[bytes], line: bytes) -> bytes:
    """The line with its digits blanked (the seq, comm_seq and step groups apart)."""
    null = b"n" if prefix[2] == b"null" else b"i"
    return prefix[3] + null + line[prefix.end() :].translate(_BLANK_DIGITS)


def load_log(path: str | os.PathLike[str], *, expect_world: Layout | None = None) -> EffectLog:
    """Read one rank's log; raise LogFormatError (file, line, what) on any defect.

    With `expect_world`, a log of another PP x DP layout is rejected too.
    """
    stream = LogStream(path, expect_world=expect_world)
    return EffectLog(stream.header, tuple(stream))


# -- reading a run's directory ----------------------------------------------------


def _dir_fail(directory: Path, problem: str, fix: str) -> LogFormatError:
    return LogFormatError("load_logs", f"{directory}: {problem}", fix)


def log_paths(directory: str | os.PathLike[str]) -> tuple[Path, ...]:
    """The `*.jsonl` logs in `directory`, sorted; LogFormatError when there are none."""
    directory = Path(directory)
    if not directory.is_dir():
        raise _dir_fail(
            directory, "is not a directory", "pass the directory the ranks' logs were written to"
        )
    paths = tuple(sorted(directory.glob("*.jsonl")))
    if not paths:
        raise _dir_fail(
            directory, "holds no *.jsonl logs", "pass the directory the ranks' logs were written to"
        )
    return paths


def _show(value: str | None) -> str:
    return "none" if value is None else repr(value)


def check_same_run(directory: Path, headers: Sequence[tuple[Path, LogHeader]]) -> None:
    """Raise LogFormatError, naming both files, unless the headers are one run's ranks.

    One run's logs share the world, the run id, the config and its digest, and hold
    every rank exactly once.
    """
    first_path, first = headers[0]
    world = first.world
    seen: dict[int, Path] = {}
    for path, header in headers:
        both = f"{first_path.name} and {path.name}"
        if header.world != world:
            raise _dir_fail(
                directory,
                f"{first_path.name} is of world pp={world.pp}, dp={world.dp} but {path.name} "
                f"of pp={header.world.pp}, dp={header.world.dp}",
                _ONE_RUN,
            )
        if header.run_id != first.run_id:
            raise _dir_fail(
                directory,
                f"{both} are of different runs (run_id {_show(first.run_id)} and "
                f"{_show(header.run_id)})",
                _ONE_RUN,
            )
        if header.config_digest != first.config_digest:
            raise _dir_fail(
                directory,
                f"{both} differ in config_digest ({_show(first.config_digest)} and "
                f"{_show(header.config_digest)}): differently configured runs",
                _ONE_RUN,
            )
        if canonical_json(header.config) != canonical_json(first.config):
            raise _dir_fail(
                directory,
                f"{both} have different configs: "
                f"{canonical_json(first.config)[:80]} and {canonical_json(header.config)[:80]}",
                _ONE_RUN,
            )
        if header.rank in seen:
            raise _dir_fail(
                directory,
                f"{seen[header.rank].name} and {path.name} are both rank {header.rank}",
                _ONE_RUN,
            )
        seen[header.rank] = path
    missing = [rank for rank in range(world.world_size) if rank not in seen]
    if missing:
        raise _dir_fail(
            directory,
            f"ranks {missing} of a world of {world.world_size} (pp={world.pp}, dp={world.dp}) "
            "have no log",
            "copy every rank's log into the directory",
        )


def load_logs(
    directory: str | os.PathLike[str], *, expect_world: Layout | None = None
) -> tuple[EffectLog, ...]:
    """Read every rank's log (`*.jsonl`) in `directory`, indexed by rank.

    The headers decide the ranks, not the file names. Raises LogFormatError when a
    log is bad, when the logs are not one run's (world, run id, config), or when a
    rank is missing or appears twice.
    """
    directory = Path(directory)
    logs = [(path, load_log(path, expect_world=expect_world)) for path in log_paths(directory)]
    check_same_run(directory, [(path, log.header) for path, log in logs])
    return tuple(log for _, log in sorted(logs, key=lambda item: item[1].header.rank))
