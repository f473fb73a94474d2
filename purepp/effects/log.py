"""Effect logs: one JSON Lines file per rank, the recorder that writes them, and replay.

A log is a flight recorder. Line 1 is the header::

    {"schema": "purepp.effects/1", "rank": 3, "world": {"pp": 2, "dp": 2}, "config": {...}}

and every further line is one effect, numbered twice::

    {"seq": 7, "comm_seq": 2, "effect": {"kind": "broadcast", "step": 4, "op": "broadcast", ...}}

`seq` counts this rank's effects from 0; `comm_seq` counts the collectives
(`COLLECTIVES`: broadcasts and all-reduces) issued on the effect's communicator from 0,
and is null for every other effect. Ranks of one communicator must agree on what each
`comm_seq` is, so lining up the ranks' logs by (communicator, comm_seq) shows at once
which collective diverged and at which step (the NCCL flight recorder's ids do not line
up across ranks; these do by construction).

Reading is strict and all-or-nothing: any defect raises `LogFormatError` naming the
file, the line and what was wrong, and nothing half-loaded is returned.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Final

import attrs
import cattrs

from purepp.effects._converter import (
    CONVERTER,
    EFFECT_CLASSES,
    EFFECT_KINDS,
    JSONObject,
    canonical_json,
    describe_structure_error,
    freeze_json_object,
    kind_of,
)
from purepp.effects.interpreter import Interpreter
from purepp.effects.vocabulary import COLLECTIVES, Communicator, Effect
from purepp.errors import ConfigError, InvalidInputError, LogFormatError, PureppError

__all__ = [
    "EFFECT_KINDS",
    "SCHEMA",
    "EffectLog",
    "Layout",
    "LogHeader",
    "LogRecord",
    "Recorder",
    "assert_logs_equal",
    "diff_logs",
    "dump_log",
    "dump_logs",
    "header_json",
    "kind_of",
    "load_log",
    "load_logs",
    "log_file_name",
    "record_json",
    "replay",
]

# The format version this module writes and the only one it reads.
SCHEMA: Final = "purepp.effects/1"

_REWRITE = "regenerate the log with purepp's Recorder or dump_log; do not edit logs by hand"


# -- header ---------------------------------------------------------------------


def _at_least_one(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if type(value) is not int or value < 1:
        raise ConfigError(
            "Layout", f"{attribute.name} must be an integer >= 1, got {value!r}", "pass a size >= 1"
        )


@attrs.frozen
class Layout:
    """The world of a run: `dp` data-parallel replicas of a `pp`-stage pipeline.

    Global rank = dp_index * pp + pp_stage: a replica's stages are consecutive ranks,
    so rank 5 of pp=2, dp=4 is stage 1 of replica 2.
    """

    pp: int = attrs.field(validator=_at_least_one)  # pipeline stages per replica
    dp: int = attrs.field(validator=_at_least_one)  # data-parallel replicas

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    def pp_stage(self, rank: int) -> int:
        """The pipeline stage global `rank` runs (0 is the first stage)."""
        return self._check_rank("Layout.pp_stage", rank) % self.pp

    def dp_index(self, rank: int) -> int:
        """The data-parallel replica global `rank` belongs to."""
        return self._check_rank("Layout.dp_index", rank) // self.pp

    def rank_of(self, *, pp_stage: int, dp_index: int) -> int:
        """The global rank of stage `pp_stage` of replica `dp_index`."""
        if not (0 <= pp_stage < self.pp and 0 <= dp_index < self.dp):
            raise ConfigError(
                "Layout.rank_of",
                f"pp_stage={pp_stage}, dp_index={dp_index} is outside pp={self.pp}, dp={self.dp}",
                f"pass 0 <= pp_stage < {self.pp} and 0 <= dp_index < {self.dp}",
            )
        return dp_index * self.pp + pp_stage

    def pipeline(self, dp_index: int) -> tuple[int, ...]:
        """Global ranks of replica `dp_index`'s stages, first stage first (PP groups)."""
        return tuple(self.rank_of(pp_stage=s, dp_index=dp_index) for s in range(self.pp))

    def replicas(self, pp_stage: int) -> tuple[int, ...]:
        """Global ranks running stage `pp_stage` in every replica (DP groups)."""
        return tuple(self.rank_of(pp_stage=pp_stage, dp_index=d) for d in range(self.dp))

    @property
    def pp_groups(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.pipeline(d) for d in range(self.dp))

    @property
    def dp_groups(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.replicas(s) for s in range(self.pp))

    def _check_rank(self, call: str, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ConfigError(
                call,
                f"rank {rank} is outside a world of {self.world_size} (pp={self.pp}, dp={self.dp})",
                f"pass a global rank in 0..{self.world_size - 1}",
            )
        return rank


def _freeze_config(config: JSONObject) -> JSONObject:
    return freeze_json_object(config)


def _same_json(a: JSONObject, b: JSONObject) -> bool:
    return canonical_json(a) == canonical_json(b)


@attrs.frozen(kw_only=True)
class LogHeader:
    """Who wrote a log, in which world, under which configuration."""

    rank: int  # global rank that wrote the log (see Layout for the numbering)
    world: Layout  # the run's PP x DP layout
    # free-form run configuration; compared as JSON, so equal headers dump identically
    config: JSONObject = attrs.field(
        factory=dict,
        converter=_freeze_config,
        eq=attrs.cmp_using(eq=_same_json),
        hash=False,
    )

    def __attrs_post_init__(self) -> None:
        if type(self.rank) is not int or not 0 <= self.rank < self.world.world_size:
            raise ConfigError(
                "LogHeader",
                f"rank {self.rank!r} is outside a world of {self.world.world_size} "
                f"(pp={self.world.pp}, dp={self.world.dp})",
                f"pass a global rank in 0..{self.world.world_size - 1}",
            )

    @property
    def pp_stage(self) -> int:
        return self.world.pp_stage(self.rank)

    @property
    def dp_index(self) -> int:
        return self.world.dp_index(self.rank)


# -- records and logs -----------------------------------------------------------


@attrs.frozen(kw_only=True)
class LogRecord:
    """One performed effect with its place in the rank's and the communicator's order."""

    seq: int  # index among this rank's effects, from 0
    comm_seq: int | None  # index among the collectives on the effect's communicator, or None
    effect: Effect  # the effect itself (it carries its step and op)


def _communicator_of(effect: Effect) -> Communicator | None:
    """The communicator a collective runs over; None for every other effect."""
    return effect.comm if isinstance(effect, COLLECTIVES) else None


class _Numbering:
    """Hands out (seq, comm_seq) in issue order; the one rule both writer and reader use."""

    def __init__(
        self, next_seq: int = 0, next_comm_seq: dict[Communicator, int] | None = None
    ) -> None:
        self._next_seq = next_seq
        self._next_comm_seq = {} if next_comm_seq is None else dict(next_comm_seq)

    def copy(self) -> _Numbering:
        return _Numbering(self._next_seq, self._next_comm_seq)

    def number(self, effect: Effect) -> LogRecord:
        comm_seq: int | None = None
        comm = _communicator_of(effect)
        if comm is not None:
            comm_seq = self._next_comm_seq.get(comm, 0)
            self._next_comm_seq[comm] = comm_seq + 1
        record = LogRecord(seq=self._next_seq, comm_seq=comm_seq, effect=effect)
        self._next_seq += 1
        return record


def _numbering_problem(record: LogRecord, expected: LogRecord) -> str | None:
    """Why `record`'s numbers are not the ones issue order gives, or None."""
    if record.seq != expected.seq:
        return (
            f"seq is {json.dumps(record.seq)}, expected {expected.seq}: records count up from 0 "
            "without gaps (a record is missing, repeated or out of order)"
        )
    if record.comm_seq == expected.comm_seq and type(record.comm_seq) is type(expected.comm_seq):
        return None
    comm = _communicator_of(record.effect)
    if comm is None:
        return (
            f"comm_seq is {json.dumps(record.comm_seq)}, expected null: "
            f"a {kind_of(record.effect)} effect is not a collective"
        )
    return (
        f"comm_seq is {json.dumps(record.comm_seq)}, expected {expected.comm_seq}: "
        f"this is collective number {expected.comm_seq} (from 0) on communicator {comm.value}"
    )


def _check_records(
    instance: EffectLog,
    attribute: attrs.Attribute[tuple[LogRecord, ...]],
    records: tuple[LogRecord, ...],
) -> None:
    numbering = _Numbering()
    for index, record in enumerate(records):
        if not isinstance(record, LogRecord) or not isinstance(record.effect, EFFECT_CLASSES):
            raise InvalidInputError(
                "EffectLog", f"record {index} is {record!r}", "pass LogRecords of effects"
            )
        problem = _numbering_problem(record, numbering.number(record.effect))
        if problem is not None:
            raise InvalidInputError(
                "EffectLog",
                f"record {index}: {problem}",
                "build logs with EffectLog.from_effects or a Recorder",
            )


def _to_records(records: Iterable[LogRecord]) -> tuple[LogRecord, ...]:
    return tuple(records)


@attrs.frozen
class EffectLog:
    """One rank's header and effects, numbered in issue order (checked on construction)."""

    header: LogHeader  # who wrote it, in which world
    records: tuple[LogRecord, ...] = attrs.field(converter=_to_records, validator=_check_records)

    @classmethod
    def from_effects(cls, header: LogHeader, effects: Iterable[Effect]) -> EffectLog:
        """The log of performing `effects` in order (what a Recorder would record)."""
        numbering = _Numbering()
        return cls(header, tuple(numbering.number(effect) for effect in effects))

    @property
    def effects(self) -> tuple[Effect, ...]:
        return tuple(record.effect for record in self.records)


# -- writing --------------------------------------------------------------------


def _dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=True, allow_nan=False)


def header_json(header: LogHeader) -> str:
    """The header's line as written in a log file (without the newline)."""
    return _dumps({"schema": SCHEMA, **CONVERTER.unstructure(header, LogHeader)})


def record_json(record: LogRecord) -> str:
    """A record's line as written in a log file (without the newline)."""
    return _dumps(CONVERTER.unstructure(record, LogRecord))


def _record_lines(call: str, records: Sequence[LogRecord], first_seq: int) -> list[str]:
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
    return header_json(log.header) + "\n" + "".join(_record_lines("dump_log", log.records, 0))


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


# -- reading --------------------------------------------------------------------


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


class _LineReader:
    """Parses one file's lines; every error names the file and the line."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, line: int | None, problem: str, fix: str = _REWRITE) -> LogFormatError:
        where = str(self.path) if line is None else f"{self.path} line {line}"
        return LogFormatError("load_log", f"{where}: {problem}", fix)

    def lines(self) -> list[str]:
        try:
            data = self.path.read_bytes()
        except OSError as exc:
            raise self.fail(
                None, f"cannot be read ({exc.strerror})", "pass an existing log file"
            ) from exc
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = data[: exc.start].count(b"\n") + 1
            raise self.fail(line, f"byte {exc.start} is not UTF-8 (corrupted file)") from exc
        if not text:
            raise self.fail(
                None, "the file is empty: no header line", "pass a log that dump_log wrote"
            )
        lines = text.split("\n")
        # Every line ends in a newline when written, so text after the last one is a
        # line the writer never finished (a crash or a kill mid-write).
        if lines[-1]:
            raise self.fail(
                len(lines),
                "the last line is truncated (no newline: the writer stopped mid-line)",
                "drop the partial last line to read what was written, or record the run again",
            )
        return lines[:-1]

    def json_object(self, line: int, text: str) -> dict[str, object]:
        try:
            value = json.loads(
                text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constant
            )
        except json.JSONDecodeError as exc:
            raise self.fail(line, f"corrupted JSON at column {exc.colno} ({exc.msg})") from exc
        except _BadJSON as exc:
            raise self.fail(line, f"corrupted JSON ({exc})") from exc
        if type(value) is not dict:
            raise self.fail(line, f"expected a JSON object, got {text[:60]!r}")
        return value

    def header(self, text: str, expect_world: Layout | None) -> LogHeader:
        obj = self.json_object(1, text)
        # The version first: another version's header may have other keys.
        schema = obj.pop("schema", None)
        if schema != SCHEMA:
            what = "no schema" if schema is None else f"schema {schema!r}"
            raise self.fail(
                1,
                f"{what}; this purepp reads only {SCHEMA!r}",
                "read it with the purepp version that wrote it, or record the run again",
            )
        # Every key is required in a file, even those LogHeader has a default for.
        missing = [field.name for field in attrs.fields(LogHeader) if field.name not in obj]
        if missing:
            raise self.fail(1, f"required field missing @ header.{missing[0]}")
        try:
            header = CONVERTER.structure(obj, LogHeader)
        except (cattrs.BaseValidationError, PureppError, ValueError, TypeError, KeyError) as exc:
            raise self.fail(1, describe_structure_error(exc, "header")) from exc
        if expect_world is not None and header.world != expect_world:
            raise self.fail(
                1,
                f"the log is of world pp={header.world.pp}, dp={header.world.dp}, "
                f"expected pp={expect_world.pp}, dp={expect_world.dp}",
                "load the logs of the run you meant, or pass its layout as expect_world",
            )
        return header

    def record(self, line: int, text: str, numbering: _Numbering) -> LogRecord:
        obj = self.json_object(line, text)
        try:
            record = CONVERTER.structure(obj, LogRecord)
        except (cattrs.BaseValidationError, PureppError, ValueError, TypeError, KeyError) as exc:
            raise self.fail(line, describe_structure_error(exc, "record")) from exc
        problem = _numbering_problem(record, numbering.number(record.effect))
        if problem is not None:
            raise self.fail(line, problem)
        return record


def load_log(path: str | os.PathLike[str], *, expect_world: Layout | None = None) -> EffectLog:
    """Read one rank's log; raise LogFormatError (file, line, what) on any defect.

    With `expect_world`, a log of another PP x DP layout is rejected too.
    """
    reader = _LineReader(Path(path))
    header_line, *record_lines = reader.lines()
    header = reader.header(header_line, expect_world)
    numbering = _Numbering()
    records = tuple(
        reader.record(line, text, numbering) for line, text in enumerate(record_lines, start=2)
    )
    return EffectLog(header, records)


def load_logs(
    directory: str | os.PathLike[str], *, expect_world: Layout | None = None
) -> tuple[EffectLog, ...]:
    """Read every rank's log (`*.jsonl`) in `directory`, indexed by rank.

    The headers decide the ranks, not the file names. Raises LogFormatError when a
    log is bad, when the logs disagree on the world, or when a rank is missing or
    appears twice.
    """
    directory = Path(directory)

    def fail(problem: str, fix: str) -> LogFormatError:
        return LogFormatError("load_logs", f"{directory}: {problem}", fix)

    if not directory.is_dir():
        raise fail("is not a directory", "pass the directory the ranks' logs were written to")
    paths = sorted(directory.glob("*.jsonl"))
    if not paths:
        raise fail("holds no *.jsonl logs", "pass the directory the ranks' logs were written to")
    logs = [(path, load_log(path, expect_world=expect_world)) for path in paths]
    first_path, first = logs[0]
    world = first.header.world
    by_rank: dict[int, tuple[Path, EffectLog]] = {}
    for path, log in logs:
        if log.header.world != world:
            raise fail(
                f"{first_path.name} is of world pp={world.pp}, dp={world.dp} but {path.name} "
                f"of pp={log.header.world.pp}, dp={log.header.world.dp}",
                "keep only the logs of one run in the directory",
            )
        if log.header.rank in by_rank:
            raise fail(
                f"{by_rank[log.header.rank][0].name} and {path.name} are both rank "
                f"{log.header.rank}",
                "keep only the logs of one run in the directory",
            )
        by_rank[log.header.rank] = (path, log)
    missing = [rank for rank in range(world.world_size) if rank not in by_rank]
    if missing:
        raise fail(
            f"ranks {missing} of a world of {world.world_size} (pp={world.pp}, dp={world.dp}) "
            "have no log",
            "copy every rank's log into the directory",
        )
    return tuple(by_rank[rank][1] for rank in range(world.world_size))


# -- recording and replay -------------------------------------------------------


class Recorder:
    """An interpreter that numbers and records every effect, then forwards it to `inner`.

    Effects are recorded (and, with `path`, written and flushed) *before* `inner`
    performs them, so when a run fails or hangs inside `inner` the log still ends
    with the effects it was attempting: the flight-recorder reading of a hang.
    With no `inner` it only records. With `path`, the file is at every moment a
    valid log of what has been recorded, byte for byte what `dump_log(recorder.log)`
    would write.
    """

    def __init__(
        self,
        header: LogHeader,
        inner: Interpreter | None = None,
        *,
        path: str | os.PathLike[str] | None = None,
    ) -> None:
        if not isinstance(header, LogHeader):
            raise InvalidInputError(
                "Recorder", f"header is a {type(header).__name__}", "pass a LogHeader"
            )
        self._header = header
        self._inner = inner
        self._path = None if path is None else Path(path)
        self._numbering = _Numbering()
        self._records: list[LogRecord] = []
        if self._path is not None:
            self._path.write_text(header_json(header) + "\n", encoding="ascii")

    @property
    def header(self) -> LogHeader:
        return self._header

    @property
    def log(self) -> EffectLog:
        """Everything recorded so far."""
        return EffectLog(self._header, tuple(self._records))

    def perform(self, effects: tuple[Effect, ...], /) -> None:
        """Record `effects` in order, then have the inner interpreter perform them."""
        for index, effect in enumerate(effects):
            if not isinstance(effect, EFFECT_CLASSES):
                raise InvalidInputError(
                    "Recorder.perform",
                    f"effects[{index}] is {effect!r}, not an effect",
                    "pass a tuple of effects from purepp.effects.vocabulary",
                )
        # Numbered on a copy first, so a failure leaves the recorder as it was.
        numbering = self._numbering.copy()
        new_records = [numbering.number(effect) for effect in effects]
        if self._path is not None:
            lines = _record_lines("Recorder.perform", new_records, len(self._records))
            with self._path.open("a", encoding="ascii") as file:
                file.write("".join(lines))
        self._numbering = numbering
        self._records.extend(new_records)
        if self._inner is not None:
            self._inner.perform(tuple(effects))


def replay(log: EffectLog, interpreter: Interpreter) -> None:
    """Feed `log`'s effects through `interpreter`, one `perform` call per decode step.

    A step is a run of consecutive records with the same `effect.step`, the batch a
    pure step function returned. Replaying into a `Recorder` reproduces `log`.
    """
    if not isinstance(log, EffectLog):
        raise InvalidInputError(
            "replay", f"log is a {type(log).__name__}", "pass an EffectLog (e.g. from load_log)"
        )
    for _, records in itertools.groupby(log.records, key=lambda record: record.effect.step):
        interpreter.perform(tuple(record.effect for record in records))


# -- comparing ------------------------------------------------------------------


def _differing_fields(expected: LogRecord, actual: LogRecord) -> list[str]:
    want = CONVERTER.unstructure(expected, LogRecord)
    got = CONVERTER.unstructure(actual, LogRecord)
    fields = [key for key in ("seq", "comm_seq") if want[key] != got[key]]
    if want["effect"]["kind"] != got["effect"]["kind"]:
        return [*fields, "effect.kind"]
    return fields + [
        f"effect.{key}" for key in want["effect"] if want["effect"][key] != got["effect"][key]
    ]


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
        f"    same     #{i}: {record_json(want[i])}" for i in range(max(0, first - context), first)
    ]
    if first < len(want):
        text.append(f"  - expected #{first}: {record_json(want[first])}")
    else:
        text.append(f"  - expected: nothing (the expected log ends after {first} records)")
    if first < len(got):
        text.append(f"  + actual   #{first}: {record_json(got[first])}")
    else:
        text.append(f"  + actual:   nothing (the actual log ends after {first} records)")
    if first < len(want) and first < len(got):
        text.append(
            f"  fields that differ: {', '.join(_differing_fields(want[first], got[first]))}"
        )
    return text


def diff_logs(expected: EffectLog, actual: EffectLog, *, context: int = 3) -> str | None:
    """None when the logs are equal; else a readable report for a golden-log test.

    It shows a differing header, and the first differing record (rendered as its log
    line) with the `context` records before it and the fields that differ.
    """
    if expected == actual:
        return None
    text: list[str] = []
    if expected.header != actual.header:
        text += [
            "effect log headers differ (file line 1):",
            f"  - expected: {header_json(expected.header)}",
            f"  + actual:   {header_json(actual.header)}",
        ]
    return "\n".join(text + _diff_records(expected, actual, context))


def assert_logs_equal(expected: EffectLog, actual: EffectLog, *, context: int = 3) -> None:
    """Raise AssertionError carrying `diff_logs`' report when the logs differ."""
    __tracebackhide__ = True  # pytest shows the caller's line, not this one
    difference = diff_logs(expected, actual, context=context)
    if difference is not None:
        raise AssertionError(difference)
