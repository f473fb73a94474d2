"""The effect log: format, strict loading, the recorder, replay and golden-log diffs."""

from __future__ import annotations

import json
import os
import shutil
import typing
from collections.abc import Callable
from pathlib import Path

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from purepp.effects import logfile
from purepp.effects._converter import CONVERTER, structure_effect, unstructure_effect
from purepp.effects.checker import check_logs
from purepp.effects.interpreter import Interpreter
from purepp.effects.log import (
    EFFECT_KINDS,
    SCHEMA,
    EffectLog,
    LogHeader,
    LogRecord,
    LogStream,
    Recorder,
    assert_logs_equal,
    config_digest,
    diff_logs,
    dump_log,
    dump_logs,
    header_json,
    kind_of,
    load_log,
    load_logs,
    log_file_name,
    record_json,
    replay,
)
from purepp.effects.logmodel import Numbering
from purepp.effects.numpy_interpreter import NumpyInterpreter
from purepp.effects.vocabulary import (
    Allocate,
    AllReduce,
    Broadcast,
    BufferRef,
    Communicator,
    CopyHostToDevice,
    DType,
    Effect,
    EventRef,
    Op,
    RecordEvent,
    Release,
    ScatterRows,
    Section,
    Stream,
    WaitStream,
)
from purepp.errors import ConfigError, InterpreterError, InvalidInputError, LogFormatError
from purepp.layout import Layout
from purepp.testing import ScheduleConfig, make_schedule, record_scripted_logs
from tests.regen_golden import GOLDEN_DIR
from tests.strategies import effect_logs, effects_of, json_objects, layouts, log_headers

# -- a small realistic log --------------------------------------------------------

HEADER = LogHeader(
    rank=1, world=Layout(pp=2, dp=2), config={"model": "toy", "num_speculative_steps": 1}
)


def relay_broadcast(step: int) -> Broadcast:
    return Broadcast(
        step=step,
        op=Op.RECEIVE,
        buffer=BufferRef(f"recv/{step}"),
        shape=(4, 2),
        dtype=DType.INT64,
        src=1,
        comm=Communicator.PP_RELAY,
        stream=Stream.RELAY,
    )


SAMPLE_EFFECTS: tuple[Effect, ...] = (
    WaitStream(step=0, op=Op.RECEIVE, stream=Stream.RELAY, waits_for=Stream.MAIN),
    Allocate(
        step=0,
        op=Op.RECEIVE,
        buffer=BufferRef("recv/0"),
        shape=(4, 2),
        dtype=DType.INT64,
        stream=Stream.RELAY,
    ),
    relay_broadcast(0),
    RecordEvent(step=0, op=Op.RECEIVE, stream=Stream.RELAY, event=EventRef("recv/0")),
    AllReduce(
        step=1,
        op=Op.AGREE,
        contribution=np.array([[3, 0], [1, 0]], dtype=np.int32),
        result=BufferRef("dp/1"),
        comm=Communicator.DP_CPU,
        work=None,
    ),
    relay_broadcast(1),
    CopyHostToDevice(
        step=1,
        op=Op.BROADCAST,
        source=np.array([[1, 2], [3, 4]], dtype=np.int32),
        buffer=BufferRef("send/1"),
        stream=Stream.MAIN,
    ),
)
SAMPLE = EffectLog.from_effects(HEADER, SAMPLE_EFFECTS)


def line_of(record_index: int) -> int:
    """The file line a record is on: line 1 is the header."""
    return record_index + 2


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="ascii")
    return path


def sample_lines(tmp_path: Path) -> list[str]:
    path = tmp_path / "sample.jsonl"
    dump_log(SAMPLE, path)
    return path.read_text(encoding="ascii").splitlines()


# -- the format, pinned ---------------------------------------------------------


def test_header_line_is_the_documented_format() -> None:
    header = LogHeader(rank=3, world=Layout(pp=2, dp=2), config={"b": 1, "a": [1, 2]})
    assert header_json(header) == (
        '{"schema": "purepp.effects/2", "rank": 3, "world": {"pp": 2, "dp": 2}, '
        '"config": {"a": [1, 2], "b": 1}}'
    )


def test_record_lines_are_the_documented_format() -> None:
    assert [record_json(record) for record in SAMPLE.records[2:5]] == [
        '{"seq": 2, "comm_seq": 0, "effect": {"kind": "broadcast", "step": 0, "op": "receive", '
        '"buffer": "recv/0", "shape": [4, 2], "dtype": "int64", "src": 1, "comm": "pp_relay", '
        '"stream": "relay"}}',
        '{"seq": 3, "comm_seq": null, "effect": {"kind": "record_event", "step": 0, '
        '"op": "receive", "stream": "relay", "event": "recv/0"}}',
        '{"seq": 4, "comm_seq": 0, "effect": {"kind": "all_reduce", "step": 1, "op": "agree", '
        '"contribution": {"shape": [2, 2], "values": [[3, 0], [1, 0]]}, "result": "dp/1", '
        '"comm": "dp_cpu", "work": null}}',
    ]


# The fields each kind's records are written with, in SCHEMA's format. A log written
# before a field was added, removed or renamed fails on that field, so such a change
# bumps SCHEMA (old logs then get the version error) and regenerates the golden logs
# (python -m tests.regen_golden). A new kind alone keeps old logs readable. (2: a
# section's source_rows, a gather's index_rows and a scatter's target_rows, declared
# bounds that eager mode checks.)
SCHEMA_FIELDS: dict[str, dict[str, tuple[str, ...]]] = {
    "purepp.effects/2": {
        "alias": ("step", "op", "source", "out"),
        "all_reduce": ("step", "op", "contribution", "result", "comm", "work"),
        "allocate": ("step", "op", "buffer", "shape", "dtype", "stream"),
        "broadcast": ("step", "op", "buffer", "shape", "dtype", "src", "comm", "stream"),
        "check_header": ("step", "op", "buffer", "expected", "stream"),
        "copy_host_to_device": ("step", "op", "source", "buffer", "stream"),
        "forget_event": ("step", "op", "event"),
        "gather_rows": ("step", "op", "source", "index", "out", "stream", "index_rows"),
        "note_decision": (
            "step",
            "op",
            "table",
            "comm",
            "cg_mode",
            "num_ubatches",
            "num_tokens_across_dp",
            "uniform_token_count",
            "eager",
            "num_reqs",
            "max_query_len",
        ),
        "pack": ("step", "op", "sections", "out", "nbytes", "stream"),
        "pad_columns": ("step", "op", "source", "out", "width", "fill", "stream"),
        "record_event": ("step", "op", "stream", "event"),
        "record_stream": ("step", "op", "buffer", "stream"),
        "release": ("step", "op", "buffer"),
        "scatter_rows": (
            "step",
            "op",
            "source",
            "index",
            "target",
            "stream",
            "skips",
            "target_rows",
        ),
        "section": ("buffer", "offset", "shape", "dtype", "source_rows"),  # of pack and unpack
        "stack_rows": ("step", "op", "sources", "out", "stream"),
        "synchronize": ("step", "op", "stream"),
        "unpack": ("step", "op", "source", "sections", "stream"),
        "wait_event": ("step", "op", "stream", "event"),
        "wait_stream": ("step", "op", "stream", "waits_for"),
        "wait_work": ("step", "op", "work"),
    }
}


def test_a_change_to_an_existing_kinds_fields_changes_the_schema() -> None:
    pinned = SCHEMA_FIELDS.get(SCHEMA)
    assert pinned is not None, f"SCHEMA is {SCHEMA!r}: add its fields to SCHEMA_FIELDS"
    written = {kind: tuple(f.name for f in attrs.fields(cls)) for kind, cls in EFFECT_KINDS.items()}
    written["section"] = tuple(f.name for f in attrs.fields(Section))
    changed = sorted(kind for kind in pinned if written.get(kind, ()) != pinned[kind])
    assert not changed, (
        f"the fields of {changed} changed, so logs written as {SCHEMA!r} no longer load: "
        "bump SCHEMA in purepp/effects/logmodel.py, pin the new fields here under it, and "
        "run python -m tests.regen_golden"
    )
    new_kinds = sorted(set(written) - set(pinned))
    assert not new_kinds, f"pin the fields of the new kinds {new_kinds} under {SCHEMA!r}"


def test_every_effect_class_has_a_snake_case_kind() -> None:
    assert set(EFFECT_KINDS.values()) == set(typing.get_args(Effect))
    assert EFFECT_KINDS["broadcast"] is Broadcast
    assert EFFECT_KINDS["copy_host_to_device"] is CopyHostToDevice
    assert EFFECT_KINDS["all_reduce"] is AllReduce
    assert kind_of(relay_broadcast(0)) == "broadcast"


# -- round trip and determinism -------------------------------------------------


@pytest.mark.parametrize("cls", typing.get_args(Effect), ids=lambda cls: cls.__name__)
@settings(max_examples=25)
@given(data=st.data())
def test_any_effect_of_every_class_survives_json(cls: type[Effect], data: st.DataObject) -> None:
    # effects() is the one_of of these per-class strategies, so every class is covered.
    effect = data.draw(effects_of(cls), label="effect")
    text = json.dumps(unstructure_effect(effect))
    assert json.loads(text)["kind"] == kind_of(effect)
    restored = structure_effect(json.loads(text))
    assert restored == effect
    assert type(restored) is cls


@settings(max_examples=30)
@given(effect_logs())
def test_load_inverts_dump(tmp_path_factory: pytest.TempPathFactory, log: EffectLog) -> None:
    path = tmp_path_factory.mktemp("round_trip") / "rank.jsonl"
    dump_log(log, path)
    assert load_log(path) == log


@settings(max_examples=30)
@given(effect_logs())
def test_equal_logs_dump_byte_identical(
    tmp_path_factory: pytest.TempPathFactory, log: EffectLog
) -> None:
    # An equal log built from scratch: copied effects, config keys in reverse order.
    config = dict(reversed(list(log.header.config.items())))
    rebuilt = EffectLog.from_effects(
        attrs.evolve(log.header, config=config), [attrs.evolve(e) for e in log.effects]
    )
    assert rebuilt == log
    directory = tmp_path_factory.mktemp("determinism")
    dump_log(log, directory / "a.jsonl")
    dump_log(rebuilt, directory / "b.jsonl")
    assert (directory / "a.jsonl").read_bytes() == (directory / "b.jsonl").read_bytes()


@pytest.mark.parametrize("shape", [(0,), (0, 3), (3, 0), (2, 0, 2), (), (1, 1, 1)])
def test_arrays_come_back_read_only_int32_of_the_same_shape(
    tmp_path: Path, shape: tuple[int, ...]
) -> None:
    source = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    copy = CopyHostToDevice(
        step=0, op=Op.BROADCAST, source=source, buffer=BufferRef("x"), stream=Stream.MAIN
    )
    dump_log(EffectLog.from_effects(HEADER, [copy]), tmp_path / "log.jsonl")
    loaded = load_log(tmp_path / "log.jsonl").effects[0]
    assert isinstance(loaded, CopyHostToDevice)
    assert loaded.source.shape == shape
    assert loaded.source.dtype == np.int32
    assert not loaded.source.flags.writeable
    assert loaded == copy


@settings(max_examples=30)
@given(effect_logs(), st.data())
def test_a_log_cut_anywhere_loads_only_at_a_line_end(
    tmp_path_factory: pytest.TempPathFactory, log: EffectLog, data: st.DataObject
) -> None:
    path = tmp_path_factory.mktemp("cut") / "rank.jsonl"
    dump_log(log, path)
    text = path.read_bytes()
    cut = data.draw(st.integers(0, len(text) - 1), label="cut")
    path.write_bytes(text[:cut])
    if cut == 0 or text[cut - 1 : cut] != b"\n":
        with pytest.raises(LogFormatError):
            load_log(path)
        return
    # A cut at a line end is a shorter valid log: what a streaming Recorder leaves.
    loaded = load_log(path)
    assert loaded.header == log.header
    assert loaded.records == log.records[: len(loaded.records)]


@settings(max_examples=30)
@given(effect_logs(min_effects=1), st.data())
def test_renumbering_any_record_is_rejected(
    tmp_path_factory: pytest.TempPathFactory, log: EffectLog, data: st.DataObject
) -> None:
    index = data.draw(st.integers(0, len(log.records) - 1), label="record")
    field = data.draw(st.sampled_from(["seq", "comm_seq"]), label="field")
    record = CONVERTER.unstructure(log.records[index], LogRecord)
    current = record[field]
    numbers: st.SearchStrategy[int | None] = st.integers(0, 20).filter(lambda n: n != current)
    # Any other number; for comm_seq also null where a number belongs (a seq of null
    # is a type error, tested elsewhere).
    if field == "comm_seq" and current is not None:
        numbers = st.none() | numbers
    other = data.draw(numbers, label="new number")
    lines = [header_json(log.header), *(record_json(r) for r in log.records)]
    lines[index + 1] = json.dumps({**record, field: other})
    path = write_lines(tmp_path_factory.mktemp("renumber") / "rank.jsonl", lines)
    with pytest.raises(LogFormatError, match=f"line {line_of(index)}: {field} is"):
        load_log(path)


# -- strict loading: every defect names the file and the line ---------------------

Mutation = Callable[[list[str]], list[str]]


def edit(line: int, change: Callable[[dict[str, typing.Any]], object]) -> Mutation:
    """Parse file line `line` (1-based), let `change` edit the object, write it back."""

    def mutate(lines: list[str]) -> list[str]:
        obj = json.loads(lines[line - 1])
        change(obj)
        return [*lines[: line - 1], json.dumps(obj), *lines[line:]]

    return mutate


def replace_line(line: int, text: str) -> Mutation:
    return lambda lines: [*lines[: line - 1], text, *lines[line:]]


BAD_LOGS: dict[str, tuple[Mutation, int, str]] = {
    # name: (mutation, line the error must name, what it must say)
    "unknown schema": (
        edit(1, lambda h: h.update(schema="purepp.effects/1")),
        1,
        "schema 'purepp.effects/1'; this purepp reads only 'purepp.effects/2'",
    ),
    "no schema": (edit(1, lambda h: h.pop("schema")), 1, "no schema"),
    "header unknown key": (
        edit(1, lambda h: h.update(host="a")),
        1,
        r"extra fields found \(host\)",
    ),
    "header missing key": (
        edit(1, lambda h: h.pop("world")),
        1,
        "required field missing @ header.world",
    ),
    "header without config": (
        edit(1, lambda h: h.pop("config")),
        1,
        "required field missing @ header.config",
    ),
    "config not an object": (
        edit(1, lambda h: h.update(config=[1])),
        1,
        "expected a JSON object, got a list",
    ),
    "world not an object": (
        edit(1, lambda h: h.update(world=[2, 2])),
        1,
        "expected an object for Layout, got a list \\[2, 2\\] @ header.world",
    ),
    "header rank outside world": (
        edit(1, lambda h: h.update(rank=4)),
        1,
        "rank 4 is outside a world of 4",
    ),
    "header bad world": (
        edit(1, lambda h: h["world"].update(pp=0)),
        1,
        "pp must be an integer >= 1, got 0",
    ),
    "config NaN": (
        replace_line(1, header_json(HEADER).replace('"toy"', "NaN")),
        1,
        "NaN is not JSON",
    ),
    "record unknown key": (
        edit(3, lambda r: r.update(note="x")),
        3,
        r"extra fields found \(note\) @ record\. Fix",
    ),
    "effect unknown key": (
        edit(4, lambda r: r["effect"].update(priority=1)),
        4,
        r"extra fields found \(priority\) @ record.effect",
    ),
    "unknown kind": (
        edit(4, lambda r: r["effect"].update(kind="send")),
        4,
        'unknown kind "send"; known kinds: alias',
    ),
    "no kind": (edit(4, lambda r: r["effect"].pop("kind")), 4, "effect has no kind"),
    "effect not an object": (
        edit(4, lambda r: r.update(effect=["broadcast", 0])),
        4,
        r'expected an effect object, got a list \["broadcast", 0\] @ record.effect',
    ),
    "missing key": (
        edit(4, lambda r: r["effect"].pop("src")),
        4,
        "required field missing @ record.effect.src",
    ),
    "string for int": (
        edit(4, lambda r: r["effect"].update(step="0")),
        4,
        'expected an integer in 0..9223372036854775807, got a string "0" @ record.effect.step',
    ),
    "bool for int": (
        edit(4, lambda r: r["effect"].update(src=True)),
        4,
        "expected an integer in 0..9223372036854775807, got a boolean true @ record.effect.src",
    ),
    "null for int": (
        edit(4, lambda r: r["effect"].update(src=None)),
        4,
        "expected an integer in 0..9223372036854775807, got null null @ record.effect.src",
    ),
    "float in shape": (
        edit(4, lambda r: r["effect"].update(shape=[4.0, 2])),
        4,
        r"record.effect.shape\[0\]",
    ),
    "unknown enum value": (
        edit(4, lambda r: r["effect"].update(stream="side")),
        4,
        'expected one of "main", "relay", got a string "side" @ record.effect.stream',
    ),
    "ref not a string": (
        edit(4, lambda r: r["effect"].update(buffer={"name": "recv/0"})),
        4,
        "expected a string, got an object",
    ),
    "array values disagree with shape": (
        edit(6, lambda r: r["effect"]["contribution"].update(shape=[2, 3])),
        6,
        "record.effect.contribution",
    ),
    "array object with an extra key": (
        edit(6, lambda r: r["effect"]["contribution"].update(dtype="int32")),
        6,
        r'expected an array object \{"shape": \[...\], "values": \[...\]\}, got an object',
    ),
    "array shape negative": (
        edit(6, lambda r: r["effect"]["contribution"].update(shape=[2, -2])),
        6,
        r"expected a shape: a list of integers >= 0, got a list \[2, -2\]",
    ),
    "array shape of floats": (
        edit(6, lambda r: r["effect"]["contribution"].update(shape=[2.0, 2])),
        6,
        r"expected a shape: a list of integers >= 0, got a list \[2.0, 2\]",
    ),
    "array value outside int32": (
        edit(8, lambda r: r["effect"]["source"].update(values=[[1, 2], [3, 2**31]])),
        8,
        "int32 integer",
    ),
    "seq gap": (lambda lines: lines[:3] + lines[4:], 4, "seq is 3, expected 2"),
    "seq repeated": (lambda lines: lines[:3] + lines[2:], 4, "seq is 1, expected 2"),
    "comm_seq off": (
        edit(7, lambda r: r.update(comm_seq=0)),
        7,
        "comm_seq is 0, expected 1: this is collective number 1 .* on communicator pp_relay",
    ),
    "comm_seq on a non-collective": (
        edit(2, lambda r: r.update(comm_seq=0)),
        2,
        "comm_seq is 0, expected null: a wait_stream effect is not a collective",
    ),
    "comm_seq missing on a collective": (
        edit(4, lambda r: r.update(comm_seq=None)),
        4,
        "comm_seq is null, expected 0",
    ),
    "corrupted JSON": (lambda lines: [*lines[:4], lines[4][:-9], *lines[5:]], 5, "corrupted JSON"),
    "duplicate key": (
        lambda lines: [
            *lines[:2],
            lines[2].replace('{"seq": 1,', '{"seq": 1, "seq": 1,'),
            *lines[3:],
        ],
        3,
        "key 'seq' appears twice",
    ),
    "record not an object": (replace_line(3, "[1, 2]"), 3, "expected a JSON object"),
    "blank line": (lambda lines: [*lines[:3], "", *lines[3:]], 4, "an empty line"),
    "two logs joined": (
        lambda lines: [*lines, *lines],
        len(SAMPLE.records) + 2,
        r'a header \("purepp.effects/2", rank 1\) where a record belongs: two logs were joined',
    ),
}


@pytest.mark.parametrize("name", BAD_LOGS)
def test_a_bad_log_is_rejected_naming_file_and_line(tmp_path: Path, name: str) -> None:
    mutate, line, problem = BAD_LOGS[name]
    path = write_lines(tmp_path / "rank-0001.jsonl", mutate(sample_lines(tmp_path)))
    with pytest.raises(LogFormatError) as caught:
        load_log(path)
    assert caught.value.call == "load_log"
    assert caught.value.problem.startswith(f"{path} line {line}: ")
    assert caught.value.fix
    caught.match(problem)


def test_a_bad_log_names_the_call_that_read_it(tmp_path: Path) -> None:
    mutate, line, _ = BAD_LOGS[next(iter(BAD_LOGS))]
    path = write_lines(tmp_path / "rank-0001.jsonl", mutate(sample_lines(tmp_path)))
    readers: dict[str, Callable[[], object]] = {
        "load_log": lambda: load_log(path),
        "load_logs": lambda: load_logs(tmp_path),
        "LogStream": lambda: tuple(LogStream(path)),
        "my_reader": lambda: tuple(LogStream(path, call="my_reader")),
    }
    for call, read in readers.items():
        with pytest.raises(LogFormatError) as caught:
            read()
        assert caught.value.call == call
        assert caught.value.problem.startswith(f"{path} line {line}: ")
    report = check_logs(tmp_path)  # a report, never raised
    assert report.exit_code == 2
    assert report.text.startswith(f"purepp check: {path} line {line}: ")
    with pytest.raises(InvalidInputError, match="LogStream: call is an int"):
        LogStream(path, call=3)  # type: ignore[arg-type]


def test_the_sample_log_itself_loads(tmp_path: Path) -> None:
    # The mutations above start from a valid file: a failure there is the mutation's.
    path = write_lines(tmp_path / "rank.jsonl", sample_lines(tmp_path))
    assert load_log(path) == SAMPLE


def test_a_truncated_last_line_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "rank.jsonl"
    dump_log(SAMPLE, path)
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(LogFormatError, match=f"{path} line 8: the last line is truncated"):
        load_log(path)


def test_a_log_cut_mid_record_loads_up_to_the_cut_when_asked(tmp_path: Path) -> None:
    # A rank killed while writing: its log in Python, as `purepp check` reads it.
    logs = world_logs(Layout(pp=2, dp=1))
    dump_logs(logs, tmp_path)
    path = tmp_path / log_file_name(1)
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(LogFormatError, match="line 8: the last line is truncated") as caught:
        load_logs(tmp_path)
    assert "allow_cut_end=True" in caught.value.fix
    cut = EffectLog(logs[1].header, logs[1].records[:-1])
    assert load_log(path, allow_cut_end=True) == cut
    assert load_logs(tmp_path, allow_cut_end=True) == (logs[0], cut)
    for call in (load_log, load_logs):
        with pytest.raises(InvalidInputError, match=f"{call.__name__}: allow_cut_end"):
            call(path, allow_cut_end=1)  # type: ignore[arg-type]


def test_a_log_another_purepp_wrote_is_to_be_recorded_again(tmp_path: Path) -> None:
    # A golden log committed before purepp changed an effect's fields: the fix is to
    # record it again, not the "do not edit by hand" meant for a corrupted file.
    lines = sample_lines(tmp_path)
    lines[1] = lines[1].replace('"waits_for": "main"', '"waits_for": "main", "priority": 1')
    path = write_lines(tmp_path / "rank.jsonl", lines)
    with pytest.raises(LogFormatError, match="line 2: extra fields found") as caught:
        load_log(path)
    assert caught.value.fix.startswith("record the log again with this purepp")
    header = json.loads(lines[0])
    path = write_lines(tmp_path / "rank.jsonl", [json.dumps({**header, "host": "a"}), *lines[1:]])
    with pytest.raises(LogFormatError, match="line 1: extra fields found") as caught:
        load_log(path)
    assert caught.value.fix.startswith("record the log again with this purepp")


def test_a_flag_written_as_a_number_is_rejected(tmp_path: Path) -> None:
    # `true` where a count belongs is refused; so is `1` where a flag belongs.
    scatter = ScatterRows(
        step=0,
        op=Op.CONSUME,
        source=BufferRef("rows"),
        index=BufferRef("slots"),
        target=BufferRef("table"),
        stream=Stream.MAIN,
    )
    path = tmp_path / "rank.jsonl"
    dump_log(EffectLog.from_effects(HEADER, [scatter]), path)
    path.write_text(path.read_text().replace('"skips": true', '"skips": 1'))
    with pytest.raises(LogFormatError) as caught:
        load_log(path)
    assert caught.value.problem == (
        f"{path} line 2: expected true or false, got an integer 1 @ record.effect.skips"
    )
    assert caught.value.fix.startswith("record the log again with this purepp")


def test_a_cut_header_is_not_sent_to_purepp_check(tmp_path: Path) -> None:
    # `purepp check` reads a log up to a cut record, but refuses a cut header too.
    path = tmp_path / "rank.jsonl"
    path.write_text(header_json(HEADER)[:-5])
    for allow_cut_end in (False, True):
        with pytest.raises(LogFormatError, match="line 1: the last line is truncated") as caught:
            LogStream(path, allow_cut_end=allow_cut_end)
        assert caught.value.fix == "record the run again: its header was never finished"


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"", "the file is empty"),
        # Read a line at a time: the bad byte is named where the reader meets it.
        (b'{"seq": 0, "comm\xff": null}\n', "line 2: byte 16 of the line is not UTF-8"),
    ],
)
def test_unreadable_bytes_are_rejected(tmp_path: Path, content: bytes, problem: str) -> None:
    path = tmp_path / "rank.jsonl"
    path.write_bytes(content and header_json(HEADER).encode() + b"\n" + content)
    with pytest.raises(LogFormatError, match=problem):
        load_log(path)


def test_a_missing_file_is_a_log_format_error(tmp_path: Path) -> None:
    with pytest.raises(LogFormatError, match="cannot be read"):
        load_log(tmp_path / "absent.jsonl")


def test_a_log_of_another_world_is_rejected_when_a_world_is_expected(tmp_path: Path) -> None:
    dump_log(SAMPLE, tmp_path / "rank.jsonl")
    assert load_log(tmp_path / "rank.jsonl", expect_world=Layout(pp=2, dp=2)) == SAMPLE
    with pytest.raises(LogFormatError, match=r"line 1: .* pp=2, dp=2, expected pp=4, dp=1"):
        load_log(tmp_path / "rank.jsonl", expect_world=Layout(pp=4, dp=1))


# -- a directory of ranks ---------------------------------------------------------


def world_logs(world: Layout) -> tuple[EffectLog, ...]:
    return tuple(
        EffectLog.from_effects(attrs.evolve(HEADER, rank=rank, world=world), SAMPLE_EFFECTS)
        for rank in range(world.world_size)
    )


def test_load_logs_returns_every_rank_in_rank_order(tmp_path: Path) -> None:
    logs = world_logs(Layout(pp=2, dp=2))
    paths = dump_logs(reversed(logs), tmp_path)
    assert sorted(path.name for path in paths) == [log_file_name(r) for r in range(4)]
    assert load_logs(tmp_path) == logs
    assert load_logs(tmp_path, expect_world=Layout(pp=2, dp=2)) == logs


def test_headers_decide_the_ranks_not_file_names(tmp_path: Path) -> None:
    logs = world_logs(Layout(pp=2, dp=1))
    dump_log(logs[1], tmp_path / "host-a.jsonl")
    dump_log(logs[0], tmp_path / "host-b.jsonl")
    assert load_logs(tmp_path) == logs


DirectoryDefect = Callable[[Path], object]


def _drop_rank(directory: Path) -> None:
    (directory / log_file_name(2)).unlink()


def _duplicate_rank(directory: Path) -> None:
    shutil.copy(directory / log_file_name(1), directory / "copy.jsonl")


def _other_world(directory: Path) -> None:
    dump_log(world_logs(Layout(pp=4, dp=1))[3], directory / log_file_name(3))


def _corrupt_one(directory: Path) -> None:
    path = directory / log_file_name(1)
    path.write_bytes(path.read_bytes()[:-1])


@pytest.mark.parametrize(
    ("defect", "problem"),
    [
        (_drop_rank, r"ranks \[2\] of a world of 4 \(pp=2, dp=2\) have no log"),
        (_duplicate_rank, "copy.jsonl and rank-0001.jsonl are both rank 1"),
        (_other_world, "rank-0000.jsonl is of world pp=2, dp=2 but rank-0003.jsonl of pp=4, dp=1"),
        (_corrupt_one, "rank-0001.jsonl line 8: the last line is truncated"),
    ],
)
def test_load_logs_rejects_an_inconsistent_directory(
    tmp_path: Path, defect: DirectoryDefect, problem: str
) -> None:
    dump_logs(world_logs(Layout(pp=2, dp=2)), tmp_path)
    defect(tmp_path)
    with pytest.raises(LogFormatError, match=problem):
        load_logs(tmp_path)


def test_two_logs_of_one_rank_of_one_run_say_to_give_each_rank_its_own_header(
    tmp_path: Path,
) -> None:
    # One run id: no other run's logs to remove, the recorders were given one rank.
    header = LogHeader.for_run(rank=0, world=Layout(pp=2, dp=1), config={}, run_id="r1")
    for name in ("worker-a.jsonl", "worker-b.jsonl"):
        dump_log(EffectLog.from_effects(header, SAMPLE_EFFECTS), tmp_path / name)
    with pytest.raises(LogFormatError) as caught:
        load_logs(tmp_path)
    assert caught.value.problem.endswith(
        "worker-a.jsonl and worker-b.jsonl are both rank 0 of run 'r1'"
    )
    assert caught.value.fix == "give each rank's Recorder a LogHeader of its own global rank"
    for path in tmp_path.iterdir():  # without run ids, either mistake
        dump_log(EffectLog(attrs.evolve(header, run_id=None), SAMPLE.records), path)
    with pytest.raises(LogFormatError, match=r"are both rank 0\. Fix: keep only") as caught:
        load_logs(tmp_path)
    assert caught.value.fix.endswith(
        "or give each rank's Recorder a LogHeader of its own global rank"
    )


def test_two_worlds_in_one_run_say_to_give_every_rank_the_runs_layout(tmp_path: Path) -> None:
    for rank, world in enumerate((Layout(pp=2, dp=1), Layout(pp=2, dp=2))):
        header = LogHeader.for_run(rank=rank, world=world, config={}, run_id="r1")
        dump_log(EffectLog.from_effects(header, SAMPLE_EFFECTS), tmp_path / log_file_name(rank))
    with pytest.raises(LogFormatError) as caught:
        load_logs(tmp_path)
    assert caught.value.problem.endswith(
        "rank-0000.jsonl is of world pp=2, dp=1 but rank-0001.jsonl of pp=2, dp=2, both of run 'r1'"
    )
    assert caught.value.fix == "give every rank's LogHeader the run's one Layout"


def test_load_logs_rejects_an_unexpected_world_and_an_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(LogFormatError, match=r"holds no \*.jsonl logs"):
        load_logs(tmp_path)
    dump_logs(world_logs(Layout(pp=2, dp=2)), tmp_path)
    with pytest.raises(LogFormatError, match="expected pp=2, dp=4"):
        load_logs(tmp_path, expect_world=Layout(pp=2, dp=4))


def test_load_logs_of_a_folder_above_the_logs_names_the_folders_holding_them(
    tmp_path: Path,
) -> None:
    dump_logs(world_logs(Layout(pp=2, dp=1)), tmp_path / "run-a")
    with pytest.raises(LogFormatError) as caught:
        load_logs(tmp_path)
    assert caught.value.problem == (
        f"{tmp_path}: holds no *.jsonl logs, but its folder {str(tmp_path / 'run-a')!r} does"
    )
    assert caught.value.fix == (
        f"pass the folder a run's logs were written to, such as {str(tmp_path / 'run-a')!r}"
    )
    dump_logs(world_logs(Layout(pp=2, dp=1)), tmp_path / "run-b")
    with pytest.raises(LogFormatError, match=r"but its folders .*run-a.*, .*run-b.* do"):
        load_logs(tmp_path)
    report = check_logs(tmp_path)
    assert report.exit_code == 2
    assert "run-a" in report.text


def test_load_logs_of_compressed_logs_says_to_decompress_them(tmp_path: Path) -> None:
    for path in dump_logs(world_logs(Layout(pp=2, dp=1)), tmp_path):
        path.replace(path.with_name(path.name + ".gz"))  # as `gzip rank-*.jsonl` leaves them
    with pytest.raises(LogFormatError) as caught:
        load_logs(tmp_path)
    assert caught.value.problem == (
        f"{tmp_path}: holds no *.jsonl logs, but rank-0000.jsonl.gz, rank-0001.jsonl.gz"
    )
    assert caught.value.fix.startswith("decompress the logs into *.jsonl files")


def test_dump_logs_refuses_two_logs_of_one_rank(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match=r"ranks \[1\] appear more than once"):
        dump_logs([SAMPLE, SAMPLE], tmp_path)
    assert not list(tmp_path.iterdir())


def scripted_logs(*, pp: int, dp: int) -> tuple[EffectLog, ...]:
    """The logs of a scripted run of a pp x dp world: logs `purepp check` finds matched."""
    return record_scripted_logs(
        make_schedule(ScheduleConfig(pp=pp, dp=dp, spec=1, steps=3, seed=0))
    )


def listing(directory: Path) -> dict[str, bytes | None]:
    """Every entry of `directory`: a file's bytes, None for a folder."""
    return {p.name: p.read_bytes() if p.is_file() else None for p in directory.iterdir()}


def test_dump_logs_removes_the_logs_of_the_ranks_an_earlier_dump_left(tmp_path: Path) -> None:
    # A 2x2 world dumped, then a 1x2 world into the same folder: purepp check must read
    # the second world's logs alone, as after `purepp run --log-dir` into a used folder.
    dump_logs(scripted_logs(pp=2, dp=2), tmp_path)
    (tmp_path / "notes.txt").write_text("kept")
    (tmp_path / "rank-2.jsonl").write_text("not a name dump_logs gives: kept")
    (tmp_path / "rank-00002.jsonl").write_text("rank 2, but not as dump_logs names it: kept")
    (tmp_path / "rank-0002.jsonl.bak").write_text("kept")
    (tmp_path / "old").mkdir()
    smaller = scripted_logs(pp=1, dp=2)
    paths = dump_logs(smaller, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "notes.txt",
        "old",
        "rank-0000.jsonl",
        "rank-00002.jsonl",
        "rank-0001.jsonl",
        "rank-0002.jsonl.bak",
        "rank-2.jsonl",
    ]
    assert paths == (tmp_path / log_file_name(0), tmp_path / log_file_name(1))
    for name in ("rank-2.jsonl", "rank-00002.jsonl"):  # *.jsonl purepp check would read
        (tmp_path / name).unlink()
    assert load_logs(tmp_path) == smaller
    report = check_logs(tmp_path)
    assert (report.exit_code, report.ranks) == (0, 2), report.text


@pytest.mark.parametrize(
    "leftover",
    [b"", b'{"schema": "purepp.eff', b'{"schema": "purepp.effects/0", "rank": 9}\n'],
    ids=["empty", "cut-header", "other-version"],
)
def test_dump_logs_removes_what_a_crashed_or_older_purepp_left(
    tmp_path: Path, leftover: bytes
) -> None:
    # A rank killed while writing its header leaves an empty or cut file; an older
    # purepp's log has another schema: each is a purepp rank log, dump_logs's to remove.
    (tmp_path / log_file_name(5)).write_bytes(leftover)
    dump_logs(world_logs(Layout(pp=2, dp=1)), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [log_file_name(0), log_file_name(1)]


@pytest.mark.parametrize("rank", [0, 3], ids=["replaced", "left-beside"])
def test_dump_logs_refuses_to_remove_a_file_that_is_not_a_purepp_log(
    tmp_path: Path, rank: int
) -> None:
    dump_logs(world_logs(Layout(pp=2, dp=2)), tmp_path)
    foreign = tmp_path / log_file_name(rank)
    foreign.write_text('{"my": "data"}\n')
    before = listing(tmp_path)
    with pytest.raises(InvalidInputError) as caught:
        dump_logs(world_logs(Layout(pp=1, dp=2)), tmp_path)
    assert caught.value.call == "dump_logs"
    assert f"{foreign} is not a purepp log" in caught.value.problem
    assert "move it out of the folder" in caught.value.fix
    assert listing(tmp_path) == before  # refused before anything was written or removed
    (tmp_path / log_file_name(rank)).unlink()
    (tmp_path / log_file_name(rank)).mkdir()  # a folder of that name is no log either
    with pytest.raises(InvalidInputError, match=r"is not a purepp log \(a folder\)"):
        dump_logs(world_logs(Layout(pp=1, dp=2)), tmp_path)
    (tmp_path / log_file_name(rank)).rmdir()
    (tmp_path / log_file_name(rank)).symlink_to(tmp_path / "gone")  # to nothing
    with pytest.raises(InvalidInputError, match=r"is not a purepp log \(not a regular file\)"):
        dump_logs(world_logs(Layout(pp=1, dp=2)), tmp_path)


def test_a_refused_write_removes_no_earlier_log_and_leaves_no_partial_file(
    tmp_path: Path,
) -> None:
    dump_logs(world_logs(Layout(pp=2, dp=2)), tmp_path)
    (tmp_path / (log_file_name(1) + ".partial")).mkdir()  # rank 1's log cannot be written
    before = listing(tmp_path)
    with pytest.raises(InvalidInputError, match=r"rank-0001\.jsonl' cannot be written"):
        dump_logs(world_logs(Layout(pp=1, dp=2)), tmp_path)
    assert listing(tmp_path) == before


def test_dump_logs_refuses_a_folder_a_live_purepp_run_writes(tmp_path: Path) -> None:
    fcntl = pytest.importorskip("fcntl")
    dump_logs(world_logs(Layout(pp=2, dp=2)), tmp_path)
    # A run id longer than what a dump writes there: the dump's replaces it whole.
    (tmp_path / logfile.LOCK_FILE).write_text("4242 run-1-of-a-long-name\n")
    before = listing(tmp_path)
    with (tmp_path / logfile.LOCK_FILE).open("r+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as a running `purepp run` holds it
        with pytest.raises(InvalidInputError) as caught:
            dump_logs(world_logs(Layout(pp=1, dp=2)), tmp_path)
        assert caught.value.problem == (
            f"directory {str(tmp_path)!r} is being written by a live purepp run (pid and run "
            "id: 4242 run-1-of-a-long-name)"
        )
        assert caught.value.fix == "wait for the run to end, or dump the logs into another folder"
        assert listing(tmp_path) == before
        # Held shared, it is a reader (purepp check tests it so, for a moment), no run.
        fcntl.flock(held, fcntl.LOCK_SH)
        with pytest.raises(InvalidInputError, match="its lock is held by readers") as caught:
            dump_logs(world_logs(Layout(pp=1, dp=2)), tmp_path)
        assert "live purepp run" not in caught.value.problem
        assert listing(tmp_path) == before
    # The run ended (its lock file stays): the folder is the dump's, the run's logs go.
    dump_logs(world_logs(Layout(pp=1, dp=2)), tmp_path)
    assert sorted(listing(tmp_path)) == [logfile.LOCK_FILE, log_file_name(0), log_file_name(1)]
    assert logfile.log_dir_writer(tmp_path) is None
    assert (tmp_path / logfile.LOCK_FILE).read_text() == f"{os.getpid()} dump_logs\n"


def test_dump_logs_leaves_no_lock_file_in_a_folder_no_run_used(tmp_path: Path) -> None:
    dump_logs(world_logs(Layout(pp=2, dp=1)), tmp_path)
    assert sorted(listing(tmp_path)) == [log_file_name(0), log_file_name(1)]


def test_dump_logs_refuses_a_lock_file_it_cannot_open_and_writes_nothing(tmp_path: Path) -> None:
    pytest.importorskip("fcntl")
    # Whether a run writes the folder is not known: refused, not taken for "no run".
    (tmp_path / logfile.LOCK_FILE).mkdir()
    with pytest.raises(InvalidInputError) as caught:
        dump_logs(world_logs(Layout(pp=2, dp=1)), tmp_path)
    assert caught.value.call == "dump_logs"
    assert caught.value.problem == (
        f"the lock file {str(tmp_path / logfile.LOCK_FILE)!r} cannot be opened (Is a "
        "directory), so whether a purepp run writes the folder is not known"
    )
    assert caught.value.fix.startswith("make it readable and writable")
    assert listing(tmp_path) == {logfile.LOCK_FILE: None}


def test_dump_log_refuses_a_non_log_and_an_effect_json_cannot_hold(tmp_path: Path) -> None:
    path = tmp_path / "rank.jsonl"
    with pytest.raises(InvalidInputError, match="dump_log: log is a str") as caught:
        dump_log("rank.jsonl", path)  # type: ignore[arg-type]
    assert caught.value.fix == "pass an EffectLog (e.g. recorder.log)"
    # An attrs class checks no field types: a float step reaches the writer.
    fractional = attrs.evolve(relay_broadcast(1), step=1.5)  # type: ignore[arg-type]
    log = EffectLog.from_effects(HEADER, [relay_broadcast(0), fractional])
    with pytest.raises(InvalidInputError) as caught:
        dump_log(log, path)
    assert caught.value.call == "dump_log"
    assert caught.value.problem.startswith(
        f"effect 1 ({fractional!r}) cannot be written as JSON: 'float' object"
    )
    assert caught.value.fix.startswith("give effect fields the types their class declares")
    assert listing(tmp_path) == {}


# -- layout and header --------------------------------------------------------------


@given(layouts, st.data())
def test_global_rank_is_dp_index_times_pp_plus_stage(world: Layout, data: st.DataObject) -> None:
    rank = data.draw(st.integers(0, world.world_size - 1))
    stage, replica = world.pp_stage(rank), world.dp_index(rank)
    assert 0 <= stage < world.pp
    assert 0 <= replica < world.dp
    assert rank == replica * world.pp + stage == world.rank_of(pp_stage=stage, dp_index=replica)


@given(layouts)
def test_pp_and_dp_groups_partition_the_world(world: Layout) -> None:
    for groups in (world.pp_groups, world.dp_groups):
        members = sorted(rank for group in groups for rank in group)
        assert members == list(range(world.world_size))
    assert all(len({world.dp_index(r) for r in group}) == 1 for group in world.pp_groups)
    assert all(len({world.pp_stage(r) for r in group}) == 1 for group in world.dp_groups)
    assert Layout(pp=2, dp=3).pp_groups == ((0, 1), (2, 3), (4, 5))
    assert Layout(pp=2, dp=3).dp_groups == ((0, 2, 4), (1, 3, 5))


def test_layout_example_and_errors() -> None:
    world = Layout(pp=2, dp=4)
    header = LogHeader(rank=5, world=world)
    assert (header.pp_stage, header.dp_index) == (1, 2)
    with pytest.raises(ConfigError, match="pp must be an integer >= 1"):
        Layout(pp=0, dp=1)
    with pytest.raises(ConfigError, match="rank 8 is outside a world of 8"):
        world.pp_stage(8)
    with pytest.raises(ConfigError, match="pp_stage=2, dp_index=0 is outside"):
        world.rank_of(pp_stage=2, dp_index=0)
    with pytest.raises(ConfigError, match="pp_stage=0, dp_index=4 is outside"):
        world.rank_of(pp_stage=0, dp_index=4)
    with pytest.raises(ConfigError, match="rank 8 is outside"):
        LogHeader(rank=8, world=world)


def test_config_is_frozen_and_compared_as_json() -> None:
    caller_config: dict[str, object] = {"sizes": [1, 2], "nested": {"a": 1}}
    header = LogHeader(rank=0, world=Layout(pp=1, dp=1), config=caller_config)
    caller_config["sizes"] = [9]
    assert header.config["sizes"] == (1, 2)
    with pytest.raises(TypeError):
        header.config["nested"]["a"] = 2  # type: ignore[index]
    assert attrs.evolve(header, config={"a": 1}) != attrs.evolve(header, config={"a": 1.0})
    assert attrs.evolve(header, config={"a": 1, "b": 2}) == attrs.evolve(
        header, config={"b": 2, "a": 1}
    )
    for bad in ({"x": float("nan")}, {"x": {1: "non-string key"}}, {"x": object()}):
        with pytest.raises(InvalidInputError):
            attrs.evolve(header, config=bad)


@pytest.mark.parametrize("config", [[1, 2], "model=toy", None])
def test_a_config_that_is_not_a_json_object_is_refused_naming_the_call(config: object) -> None:
    world = Layout(pp=1, dp=1)
    with pytest.raises(InvalidInputError) as caught:
        LogHeader(rank=0, world=world, config=config)  # type: ignore[arg-type]
    assert caught.value.call == "LogHeader"
    assert caught.value.problem == f"config must be a JSON object, got {type(config).__name__}"
    assert caught.value.fix == "pass a dict"
    with pytest.raises(InvalidInputError, match="config_digest: config must be a JSON object"):
        config_digest(config)  # type: ignore[arg-type]


@given(log_headers(), json_objects)
def test_equal_headers_hash_equal(header: LogHeader, config: dict[str, object]) -> None:
    again = attrs.evolve(header, config=dict(reversed(list(config.items()))))
    assert attrs.evolve(header, config=config) == again
    assert hash(attrs.evolve(header, config=config)) == hash(again)


def test_an_effect_log_checks_its_numbering() -> None:
    effect = relay_broadcast(0)
    with pytest.raises(InvalidInputError, match="record 0: seq is 1, expected 0"):
        EffectLog(HEADER, [LogRecord(seq=1, comm_seq=0, effect=effect)])
    with pytest.raises(InvalidInputError, match="record 0: comm_seq is null, expected 0"):
        EffectLog(HEADER, [LogRecord(seq=0, comm_seq=None, effect=effect)])


def test_an_effect_log_refuses_what_is_not_a_record_of_an_effect() -> None:
    not_an_effect = LogRecord(seq=0, comm_seq=None, effect="broadcast")  # type: ignore[arg-type]
    for bad in (relay_broadcast(0), not_an_effect):
        with pytest.raises(InvalidInputError) as caught:
            EffectLog(HEADER, [bad])  # type: ignore[list-item]
        assert caught.value.call == "EffectLog"
        assert caught.value.problem == f"record 0 is {bad!r}"
        assert caught.value.fix == "pass LogRecords of effects"


# -- recorder and replay ------------------------------------------------------------


class BatchCollector:
    """An interpreter that keeps each perform call's batch, to see how replay batches."""

    def __init__(self) -> None:
        self.batches: list[tuple[Effect, ...]] = []

    def perform(self, effects: tuple[Effect, ...], /) -> None:
        self.batches.append(effects)


class FailingInterpreter:
    """An interpreter whose device calls fail, like a torch interpreter on a dead peer."""

    def perform(self, effects: tuple[Effect, ...], /) -> None:
        raise InterpreterError("perform", f"{len(effects)} effects could not run", "none")


def test_the_recorder_numbers_collectives_per_communicator() -> None:
    recorder = Recorder(HEADER)
    recorder.perform(SAMPLE_EFFECTS[:3])
    recorder.perform(SAMPLE_EFFECTS[3:])
    numbers = [(record.seq, record.comm_seq) for record in recorder.log.records]
    # broadcasts on pp_relay count 0, 1; the all-reduce on dp_cpu counts from 0 on its own.
    assert numbers == [(0, None), (1, None), (2, 0), (3, None), (4, 0), (5, 1), (6, None)]
    assert recorder.log == SAMPLE


def test_the_recorder_forwards_every_effect_in_order() -> None:
    inner = Recorder(HEADER)
    outer = Recorder(HEADER, inner)
    outer.perform(SAMPLE_EFFECTS[:2])
    outer.perform(SAMPLE_EFFECTS[2:])
    assert inner.log == outer.log == SAMPLE


def test_the_recorder_records_before_the_inner_interpreter_fails(tmp_path: Path) -> None:
    recorder = Recorder(HEADER, FailingInterpreter(), path=tmp_path / "rank.jsonl")
    with pytest.raises(InterpreterError):
        recorder.perform(SAMPLE_EFFECTS)
    # What a hung or crashed run leaves behind: the effects it was attempting.
    assert recorder.log == SAMPLE
    assert load_log(tmp_path / "rank.jsonl") == SAMPLE


def test_the_recorder_rejects_a_non_effect_and_records_nothing(tmp_path: Path) -> None:
    inner = BatchCollector()
    recorder = Recorder(HEADER, inner, path=tmp_path / "rank.jsonl")
    bad = (relay_broadcast(0), "broadcast")
    with pytest.raises(InvalidInputError, match=r"effects\[1\] is 'broadcast', a str"):
        recorder.perform(bad)  # type: ignore[arg-type]
    assert recorder.log == EffectLog(HEADER, ())
    assert inner.batches == []
    assert load_log(tmp_path / "rank.jsonl") == EffectLog(HEADER, ())


def test_a_recorder_refuses_what_is_not_a_header_and_tells_the_one_it_was_given() -> None:
    with pytest.raises(InvalidInputError) as caught:
        Recorder(SAMPLE)  # type: ignore[arg-type]
    assert (caught.value.call, caught.value.problem) == ("Recorder", "header is an EffectLog")
    assert caught.value.fix == "pass a LogHeader"
    assert Recorder(HEADER).header is HEADER


def test_a_recorder_writing_a_file_writes_nothing_of_a_batch_json_cannot_hold(
    tmp_path: Path,
) -> None:
    recorder = Recorder(HEADER, path=tmp_path / "rank.jsonl")
    recorder.perform(SAMPLE_EFFECTS[:2])
    fractional = attrs.evolve(relay_broadcast(1), step=1.5)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError) as caught:
        recorder.perform((SAMPLE_EFFECTS[2], fractional))
    assert caught.value.call == "Recorder.perform"
    # Numbered as the log numbers it: after the two records already written.
    assert caught.value.problem.startswith(f"effect 3 ({fractional!r}) cannot be written")
    # None of the batch is written: the file is still the log so far.
    assert recorder.log == EffectLog.from_effects(HEADER, SAMPLE_EFFECTS[:2])


@pytest.mark.parametrize("where", ["missing/rank.jsonl", "."])
def test_a_recorder_path_that_cannot_be_written_is_named(tmp_path: Path, where: str) -> None:
    path = tmp_path / where  # a folder that does not exist, or a folder itself
    with pytest.raises(InvalidInputError, match=r"Recorder: path=.* cannot be written") as caught:
        Recorder(HEADER, path=path)
    assert str(path) in str(caught.value)
    assert "pass a file path in an existing folder" in str(caught.value)
    assert sorted(tmp_path.iterdir()) == []  # nothing was made


@settings(max_examples=30)
@given(effect_logs(), st.data())
def test_a_streaming_recorder_file_is_always_the_log_so_far(
    tmp_path_factory: pytest.TempPathFactory, log: EffectLog, data: st.DataObject
) -> None:
    directory = tmp_path_factory.mktemp("stream")
    recorder = Recorder(log.header, path=directory / "stream.jsonl")
    effects_left = list(log.effects)
    while effects_left:
        size = data.draw(st.integers(1, len(effects_left)), label="batch size")
        recorder.perform(tuple(effects_left[:size]))
        del effects_left[:size]
        done = len(log.effects) - len(effects_left)
        assert load_log(directory / "stream.jsonl") == EffectLog(log.header, log.records[:done])
    dump_log(log, directory / "dumped.jsonl")
    assert (directory / "stream.jsonl").read_bytes() == (directory / "dumped.jsonl").read_bytes()


def test_a_recorder_writing_a_file_holds_no_records_in_memory(tmp_path: Path) -> None:
    # A flight recorder left on for a long run: what it has written, it does not keep.
    recorder = Recorder(HEADER, path=tmp_path / "rank.jsonl")
    for _ in range(3):
        recorder.perform(SAMPLE_EFFECTS)
    assert recorder._records == []  # the memory a long run would fill
    expected = EffectLog.from_effects(HEADER, SAMPLE_EFFECTS * 3)
    assert recorder.log == expected
    assert load_log(tmp_path / "rank.jsonl") == expected


@given(effect_logs())
def test_replaying_into_a_recorder_reproduces_the_log(log: EffectLog) -> None:
    recorder = Recorder(log.header)
    interpreter: Interpreter = recorder  # a Recorder is an Interpreter, structurally
    replay(log, interpreter)
    assert recorder.log == log


def test_replay_performs_one_batch_per_step() -> None:
    steps = [0, 0, 1, 1, 1, 0]
    log = EffectLog.from_effects(HEADER, [relay_broadcast(step) for step in steps])
    collector = BatchCollector()
    replay(log, collector)
    assert [[effect.step for effect in batch] for batch in collector.batches] == [
        [0, 0],
        [1, 1, 1],
        [0],
    ]


def test_a_replay_that_fails_says_where_in_the_log() -> None:
    # A log holds no caller tensors: a numpy interpreter stops at the first input it
    # reads, and the error (the interpreter's own, kept) says which step and records.
    effects = [
        SAMPLE_EFFECTS[1],  # allocates recv/0
        Release(step=0, op=Op.RECEIVE, buffer=BufferRef("recv/0")),
        Release(step=1, op=Op.END_STEP, buffer=BufferRef("relay.input.sampled_token_ids")),
    ]
    log = EffectLog.from_effects(LogHeader(rank=0, world=Layout(pp=1, dp=1)), effects)
    with pytest.raises(InterpreterError, match=r"'relay\.input\.sampled_token_ids'") as caught:
        replay(log, NumpyInterpreter())
    assert caught.value.__notes__ == [
        "in replay: step 1 of rank 0's log, records #2 to #2 (file lines 4 to 4)"
    ]


# -- golden-log diffs ---------------------------------------------------------------


def test_equal_logs_have_no_diff() -> None:
    assert diff_logs(SAMPLE, EffectLog.from_effects(HEADER, SAMPLE_EFFECTS)) is None
    assert_logs_equal(SAMPLE, SAMPLE)


def test_the_diff_shows_the_first_differing_record_and_the_ones_before() -> None:
    changed = list(SAMPLE_EFFECTS)
    changed[5] = attrs.evolve(relay_broadcast(1), shape=(4, 1))
    changed[6] = attrs.evolve(SAMPLE_EFFECTS[6], step=7)
    actual = EffectLog.from_effects(HEADER, changed)
    diff = diff_logs(SAMPLE, actual)
    assert diff is not None
    lines = diff.splitlines()
    assert lines[0] == ("effect logs differ at record 5 (file line 7); expected 7 records, got 7:")
    assert lines[1:4] == [f"    same     #{i}: {record_json(SAMPLE.records[i])}" for i in (2, 3, 4)]
    assert lines[4] == f"  - expected #5: {record_json(SAMPLE.records[5])}"
    assert lines[5] == f"  + actual   #5: {record_json(actual.records[5])}"
    assert lines[6] == "  fields that differ: effect.shape"
    assert len(lines) == 7


def test_the_diff_names_a_missing_or_extra_record_and_a_changed_kind() -> None:
    shorter = EffectLog.from_effects(HEADER, SAMPLE_EFFECTS[:3])
    assert "the actual log ends after 3 records" in (diff_logs(SAMPLE, shorter) or "")
    assert "the expected log ends after 3 records" in (diff_logs(shorter, SAMPLE) or "")
    swapped = EffectLog.from_effects(HEADER, [SAMPLE_EFFECTS[1], *SAMPLE_EFFECTS[1:]])
    assert "fields that differ: effect.kind" in (diff_logs(SAMPLE, swapped) or "")


def test_the_diff_shows_a_differing_header() -> None:
    other = EffectLog(attrs.evolve(HEADER, rank=3), SAMPLE.records)
    assert diff_logs(SAMPLE, other) == "\n".join(
        [
            "effect log headers differ (file line 1):",
            f"  - expected: {header_json(HEADER)}",
            f"  + actual:   {header_json(other.header)}",
            "  fields that differ: rank",
        ]
    )


def test_the_header_diff_names_each_config_key_and_the_run_fields_that_differ() -> None:
    run = LogHeader.for_run(
        rank=1, world=HEADER.world, config={"model": "toy", "seed": 0}, run_id="a"
    )
    other = LogHeader.for_run(
        rank=1, world=HEADER.world, config={"model": "toy", "seed": 1, "spec": 2}, run_id="b"
    )
    report = diff_logs(EffectLog(run, SAMPLE.records), EffectLog(other, SAMPLE.records))
    assert report is not None
    assert report.splitlines()[-1] == (
        "  fields that differ: config.seed, config.spec, run_id, config_digest"
    )


def test_the_header_diff_names_a_nested_config_key() -> None:
    nested = LogHeader(rank=1, world=HEADER.world, config={"scripted": {"seed": 1, "pp": 2}})
    other = attrs.evolve(nested, config={"scripted": {"seed": 2, "pp": 2}})
    report = diff_logs(EffectLog(nested, SAMPLE.records), EffectLog(other, SAMPLE.records))
    assert report is not None
    assert report.splitlines()[-1] == "  fields that differ: config.scripted.seed"


def test_two_runs_differing_in_their_run_id_alone_are_equal_when_it_is_ignored() -> None:
    # Every run gets a new run id: a golden log of a recorded run never equals a new run's.
    runs = [
        EffectLog(
            LogHeader.for_run(rank=1, world=HEADER.world, config={"seed": 0}, run_id=run_id),
            SAMPLE.records,
        )
        for run_id in ("a", "b")
    ]
    report = diff_logs(*runs)
    assert report is not None
    assert report.splitlines()[-2:] == [
        "  fields that differ: run_id",
        "  every record is equal (7): the logs are of two runs of one config; pass "
        "ignore_run_id=True to compare what the runs did",
    ]
    assert diff_logs(*runs, ignore_run_id=True) is None
    assert_logs_equal(*runs, ignore_run_id=True)
    other_config = EffectLog(
        LogHeader.for_run(rank=1, world=HEADER.world, config={"seed": 1}, run_id="b"),
        SAMPLE.records,
    )
    ignored = diff_logs(runs[0], other_config, ignore_run_id=True)
    assert ignored is not None
    assert ignored.splitlines()[-1] == "  fields that differ: config.seed, config_digest"
    shorter = EffectLog(runs[1].header, SAMPLE.records[:3])
    assert "every record is equal" not in (diff_logs(runs[0], shorter) or "")
    with pytest.raises(InvalidInputError, match="ignore_run_id"):
        diff_logs(*runs, ignore_run_id=1)  # type: ignore[arg-type]


def test_assert_logs_equal_raises_the_diff() -> None:
    shorter = EffectLog.from_effects(HEADER, SAMPLE_EFFECTS[:3])
    with pytest.raises(AssertionError) as caught:
        assert_logs_equal(SAMPLE, shorter)
    assert str(caught.value) == diff_logs(SAMPLE, shorter)


def test_schema_constant_is_the_documented_version() -> None:
    assert SCHEMA == "purepp.effects/2"


# -- run ids and config digests ---------------------------------------------------


def test_a_header_without_run_id_writes_the_format_before_run_ids() -> None:
    line = json.loads(header_json(HEADER))
    assert "run_id" not in line
    assert "config_digest" not in line


def test_a_run_header_carries_its_run_id_and_config_digest(tmp_path: Path) -> None:
    header = LogHeader.for_run(rank=1, world=Layout(pp=2, dp=2), config=HEADER.config, run_id="r7")
    assert header.config_digest == config_digest(HEADER.config)
    line = json.loads(header_json(header))
    assert (line["run_id"], line["config_digest"]) == ("r7", header.config_digest)
    log = EffectLog.from_effects(header, SAMPLE.effects)
    dump_log(log, tmp_path / "rank.jsonl")
    assert load_log(tmp_path / "rank.jsonl") == log


@pytest.mark.parametrize("value", ["", 3, True])
def test_a_run_id_is_a_non_empty_string(value: object) -> None:
    with pytest.raises(ConfigError, match="run_id"):
        LogHeader(rank=0, world=Layout(pp=1, dp=1), run_id=value)  # type: ignore[arg-type]


def test_load_logs_rejects_logs_of_two_runs_naming_both_files(tmp_path: Path) -> None:
    world = Layout(pp=2, dp=1)
    for rank, run_id in enumerate(("a", "b")):
        header = LogHeader.for_run(rank=rank, world=world, config={"x": 1}, run_id=run_id)
        dump_log(EffectLog.from_effects(header, ()), tmp_path / log_file_name(rank))
    with pytest.raises(
        LogFormatError, match=r"rank-0000\.jsonl and rank-0001\.jsonl are of different runs"
    ):
        load_logs(tmp_path)


def test_a_folder_of_two_runs_says_which_logs_are_of_which_run(tmp_path: Path) -> None:
    world = Layout(pp=2, dp=1)
    for run_id in ("a", "b"):
        for rank in range(2):
            header = LogHeader.for_run(rank=rank, world=world, config={"x": 1}, run_id=run_id)
            path = tmp_path / f"{run_id}-{log_file_name(rank)}"
            dump_log(EffectLog.from_effects(header, ()), path)
    with pytest.raises(LogFormatError) as caught:
        load_logs(tmp_path)
    assert caught.value.problem.endswith(
        "a-rank-0000.jsonl and b-rank-0000.jsonl are of different runs; the folder holds logs "
        "of 2 runs (run_id 'a': a-rank-0000.jsonl, a-rank-0001.jsonl; "
        "run_id 'b': b-rank-0000.jsonl, b-rank-0001.jsonl)"
    )
    assert caught.value.fix.endswith("(move each run's logs to a folder of its own)")


def test_a_stream_reads_up_to_a_cut_last_line_only_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "rank.jsonl"
    dump_log(SAMPLE, path)
    path.write_bytes(path.read_bytes()[:-5])
    stream = LogStream(path, allow_cut_end=True)
    assert tuple(stream) == SAMPLE.records[:-1]
    assert stream.cut_line == len(SAMPLE.records) + 1
    with pytest.raises(LogFormatError, match="the last line is truncated"):
        tuple(LogStream(path))


def test_a_stream_gives_its_records_once_and_none_after_it_is_closed(tmp_path: Path) -> None:
    path = tmp_path / "rank.jsonl"
    dump_log(SAMPLE, path)
    stream = LogStream(path)
    assert tuple(stream) == SAMPLE.records
    assert tuple(stream) == ()  # read once: the file was closed at its end
    closed = LogStream(path)
    closed.close()
    assert closed.header == HEADER  # read when it was opened
    assert list(closed.scan(frozenset())) == []


# -- the checker's fast reading is as strict as loading ------------------------------


def agreement_at(step: int, value: int) -> AllReduce:
    return AllReduce(
        step=step,
        op=Op.AGREE,
        contribution=np.full((2, 2), value, dtype=np.int32),
        result=BufferRef(f"dp.step{step}.table"),
        comm=Communicator.DP_CPU,
        work=None,
    )


def repeated_steps(steps: int) -> EffectLog:
    """Steps that differ only in digits, so later lines read through the template path."""
    effects: list[Effect] = []
    for step in range(10, 10 + steps):
        effects += [agreement_at(step, 1_147_483_648), relay_broadcast(step)]
        effects += [
            WaitStream(step=step, op=Op.RECEIVE, stream=Stream.RELAY, waits_for=Stream.MAIN)
        ]
    return EffectLog.from_effects(HEADER, effects)


def scan_all(path: Path) -> list[tuple[int, str, Effect | None, int]]:
    return list(LogStream(path).scan(frozenset({"wait_stream", "release"})))


def test_a_scan_gives_every_record_that_loading_gives(tmp_path: Path) -> None:
    log = repeated_steps(6)
    dump_log(log, tmp_path / "rank.jsonl")
    scanned = scan_all(tmp_path / "rank.jsonl")
    assert [(step, kind, count) for step, kind, _, count in scanned] == [
        (e.step, kind_of(e), 1) for e in log.effects
    ]
    assert [e for _, _, e, _ in scanned] == [
        None if isinstance(e, WaitStream) else e for e in log.effects
    ]


@pytest.mark.parametrize(
    "path",
    sorted(GOLDEN_DIR.glob("*/rank-*.jsonl")),
    ids=lambda path: f"{path.parent.name}/{path.name}",
)
def test_a_scan_of_every_golden_log_builds_what_loading_builds(path: Path) -> None:
    # Every kind of record the relay and the agreement write, over enough steps that
    # most lines are built from a template: each must equal its line read in full.
    loaded = load_log(path).effects
    scanned = list(LogStream(path).scan(frozenset()))  # no local kinds: every record built
    assert [(step, count) for step, _, _, count in scanned] == [(e.step, 1) for e in loaded]
    assert [effect for _, _, effect, _ in scanned] == list(loaded)


def test_a_scan_counts_a_run_of_local_records_of_one_step_as_one_item(tmp_path: Path) -> None:
    releases = [
        Release(step=s, op=Op.END_STEP, buffer=BufferRef(f"b{i}")) for s in (1, 2) for i in range(3)
    ]
    log = EffectLog.from_effects(HEADER, [*releases, relay_broadcast(2), *releases[3:]])
    dump_log(log, tmp_path / "rank.jsonl")
    items = [
        (step, kind, effect is None, count)
        for step, kind, effect, count in scan_all(tmp_path / "rank.jsonl")
    ]
    assert items == [
        (1, "release", True, 3),
        (2, "release", True, 3),
        (2, "broadcast", False, 1),
        (2, "release", True, 3),
    ]


def edit_a_late_line(path: Path, old: str, new: str, problem: str) -> LogFormatError:
    """Replace `old` by `new` in the last line that holds it, one read through a template
    seen earlier; what loading the edited log raises, naming that line and `problem`."""
    lines = path.read_text().splitlines(keepends=True)
    edited = next(i for i in range(len(lines) - 1, 0, -1) if old in lines[i])
    assert edited > 6  # a line after its template was seen
    lines[edited] = lines[edited].replace(old, new, 1)
    path.write_text("".join(lines))
    with pytest.raises(LogFormatError, match=f"line {edited + 1}: .*{problem}") as loading:
        load_log(path)
    return loading.value


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        # Each edit keeps the line's digit pattern, so only the template path sees it.
        ("[1147483648, 1147483648]]", "[2147483648, 1147483648]]", "int32"),
        ('"shape": [4, 2]', '"shape": [4, 02]', "corrupted JSON"),
        ('{"seq": 16, ', '{"seq": 17, ', "seq is 17, expected 16"),
        ('16, "comm_seq": 5, ', '16, "comm_seq": 6, ', "comm_seq is 6, expected 5"),
        ('"waits_for": "main"', '"waits_for": "rely"', "waits_for"),
        # An enum value's digits are not free to vary as a name's are.
        ('"dtype": "int64"', '"dtype": "int65"', "dtype"),
        ('{"shape": [2, 2], "values"', '{"shape": [3, 2], "values"', r"shape \[3, 2\]"),
    ],
    ids=["int32-range", "leading-zero", "seq", "comm-seq", "enum", "enum-digits", "array-shape"],
)
def test_a_scan_rejects_what_loading_rejects(
    tmp_path: Path, old: str, new: str, problem: str
) -> None:
    path = tmp_path / "rank.jsonl"
    dump_log(repeated_steps(6), path)
    loading = edit_a_late_line(path, old, new, problem)
    with pytest.raises(LogFormatError) as scanning:
        scan_all(path)
    # The same problem and fix; each names the call its caller made.
    assert (scanning.value.problem, scanning.value.fix) == (loading.problem, loading.fix)
    assert (scanning.value.call, loading.call) == ("LogStream", "load_log")


def local_steps(steps: int) -> EffectLog:
    """Records that never wait, of steps that differ only in digits."""
    effects: list[Effect] = []
    for step in range(10, 10 + steps):
        buffer = BufferRef(f"relay.step{step}.tokens")
        effects += [
            Allocate(
                step=step, op=Op.RECEIVE, buffer=buffer, shape=(4, 2), dtype=DType.INT64,
                stream=Stream.RELAY,
            ),
            CopyHostToDevice(
                step=step, op=Op.RECEIVE, source=np.full(2, 1_147_483_648, dtype=np.int32),
                buffer=BufferRef(f"host.step{step}"), stream=Stream.MAIN,
            ),
            Release(step=step, op=Op.END_STEP, buffer=buffer),
        ]  # fmt: skip
    return EffectLog.from_effects(HEADER, effects)


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        ('"dtype": "int64"', '"dtype": "int65"', "dtype"),
        ("[1147483648, 1147483648]", "[2147483648, 1147483648]", "int32"),
        # A release: a record of a kind not built, numbered as every other.
        ('{"seq": 17, ', '{"seq": 18, ', "seq is 18, expected 17"),
    ],
    ids=["enum-digits", "int32-range", "seq"],
)
def test_a_scan_rejects_in_records_it_does_not_build_what_loading_rejects(
    tmp_path: Path, old: str, new: str, problem: str
) -> None:
    path = tmp_path / "rank.jsonl"
    dump_log(local_steps(6), path)
    loading = edit_a_late_line(path, old, new, problem)
    never_built = frozenset({"allocate", "copy_host_to_device", "release"})
    with pytest.raises(LogFormatError) as scanning:
        list(LogStream(path, call="load_log").scan(never_built))
    assert str(scanning.value) == str(loading)


def test_lines_that_differ_in_an_enum_values_digits_are_read_as_written(tmp_path: Path) -> None:
    log = EffectLog.from_effects(
        HEADER,
        [
            Allocate(
                step=step, op=Op.RECEIVE, buffer=BufferRef(f"b{step}"), shape=(4, 2),
                dtype=DType.INT64 if step % 2 else DType.INT32, stream=Stream.RELAY,
            )
            for step in range(10, 16)
        ],
    )  # fmt: skip
    dump_log(log, tmp_path / "rank.jsonl")
    scanned = LogStream(tmp_path / "rank.jsonl").scan(frozenset())
    assert [effect for _, _, effect, _ in scanned] == list(log.effects)


@pytest.mark.parametrize("wire", ["seed", "packed", "fixed"])
def test_a_scan_of_a_scripted_run_builds_every_effect_loading_builds(
    tmp_path: Path, wire: str
) -> None:
    # 120 steps cross 9 -> 10 and 99 -> 100: names and numbers change length, so lines
    # of one template differ in where their fields sit, not only in their digits.
    from purepp.relay import Wire
    from purepp.testing import ScheduleConfig, make_schedule, record_scripted_logs

    config = ScheduleConfig(pp=2, dp=2, spec=2, steps=120, seed=3, wire=Wire(wire))
    for log in record_scripted_logs(make_schedule(config)):
        path = tmp_path / f"rank-{log.header.rank}.jsonl"
        dump_log(log, path)
        scanned = list(LogStream(path).scan(frozenset()))
        assert [effect for _, _, effect, _ in scanned] == list(log.effects)
        assert list(load_log(path).effects) == list(log.effects)
        assert [step for step, _, _, _ in scanned] == [e.step for e in log.effects]


# -- loading reads through the checker's templates, and gives what reading in full gives


def load_both_ways(
    path: Path, monkeypatch: pytest.MonkeyPatch, *, allow_cut_end: bool = False
) -> tuple[EffectLog, int, EffectLog, int]:
    """load_log(path) through templates, then with every line read in full (no template
    kept), from no template seen; each log with how many lines were read in full."""
    full_reads = [0]
    read_in_full = LogStream._record

    def counted(stream: LogStream, data: bytes, numbering: Numbering) -> LogRecord:
        full_reads[0] += 1
        return read_in_full(stream, data, numbering)

    with monkeypatch.context() as patched:
        patched.setattr(LogStream, "_record", counted)
        patched.setattr(logfile, "_SEEN_TEMPLATES", {})
        fast = load_log(path, allow_cut_end=allow_cut_end)
        fast_reads, full_reads[0] = full_reads[0], 0
        patched.setattr(logfile, "_SEEN_TEMPLATES", {})
        patched.setattr(logfile, "_template", lambda rest, effect, kind: None)
        slow = load_log(path, allow_cut_end=allow_cut_end)
    return fast, fast_reads, slow, full_reads[0]


def assert_loaded_alike(path: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """Both ways give equal logs, down to each value's type; the lines read in full."""
    fast, fast_reads, slow, slow_reads = load_both_ways(path, monkeypatch)
    assert slow_reads == len(slow.records)  # the reference read every line in full
    assert fast == slow
    assert repr(fast) == repr(slow)  # a BufferRef, not a str equal to it
    dump_log(fast, path.with_name("again.jsonl"))
    assert path.with_name("again.jsonl").read_bytes() == path.read_bytes()
    return fast_reads


@pytest.mark.parametrize(
    "path",
    sorted(GOLDEN_DIR.glob("*/rank-*.jsonl")),
    ids=lambda path: f"{path.parent.name}/{path.name}",
)
def test_loading_a_golden_log_through_templates_gives_what_reading_in_full_gives(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = tmp_path / path.name
    shutil.copyfile(path, copy)
    fast_reads = assert_loaded_alike(copy, monkeypatch)
    assert fast_reads < len(load_log(path).records) / 2  # most lines built from a template


def test_loading_a_long_log_through_templates_gives_what_reading_in_full_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 150 steps cross 9 -> 10 and 99 -> 100, so names and numbers change length.
    from purepp.relay import Wire
    from purepp.testing import ScheduleConfig, make_schedule, record_scripted_logs

    for wire in Wire:
        config = ScheduleConfig(pp=3, dp=2, spec=2, steps=150, seed=5, wire=wire)
        for log in record_scripted_logs(make_schedule(config)):
            path = tmp_path / f"{wire.value}-rank-{log.header.rank}.jsonl"
            dump_log(log, path)
            fast_reads = assert_loaded_alike(path, monkeypatch)
            assert load_log(path) == log
            assert fast_reads < len(log.records) / 4


def test_loading_a_log_of_repeated_steps_through_templates_gives_what_reading_in_full_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Templates of ten-digit numbers (checked against int32 on every line), and local records.
    path = tmp_path / "rank.jsonl"
    dump_log(repeated_steps(200), path)
    assert assert_loaded_alike(path, monkeypatch) < 20
    dump_log(local_steps(200), path)
    assert assert_loaded_alike(path, monkeypatch) < 20


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("[1147483648, 1147483648]]", "[2147483648, 1147483648]]"),  # past int32
        ('"shape": [4, 2]', '"shape": [4, 02]'),  # a leading zero
        ('{"seq": 16, ', '{"seq": 17, '),
        ('16, "comm_seq": 5, ', '16, "comm_seq": 6, '),
        ('16, "comm_seq": 5, ', '16, "comm_seq": null, '),
        ('"waits_for": "main"', '"waits_for": "rely"'),
        ('"dtype": "int64"', '"dtype": "int65"'),
        ('{"shape": [2, 2], "values"', '{"shape": [3, 2], "values"'),
        ('"src": 1', '"src": 1.5'),
        ('"src": 1', '"src": ' + "1" * 5000),  # past Python's int() digit limit
        ('"step": 15, ', '"step": 15, "step": 15, '),
        ("}}\n", "}} x\n"),
        ("}}\n", "}}\n\n"),  # an empty line
        ("}}\n", "}}\n" + header_json(HEADER) + "\n"),  # two logs joined
        ('"op": "receive"', '"op": "r\\u00e9ceive"'),
        ('"op": "receive"', '"op": "r\u00e9ceive"'),  # not ASCII
        ("}}\n", "}}"),  # a cut last line
    ],
    ids=[
        "int32-range",
        "leading-zero",
        "seq",
        "comm-seq",
        "comm-seq-null",
        "enum",
        "enum-digits",
        "array-shape",
        "float",
        "too-long",
        "duplicate-key",
        "trailing-text",
        "empty-line",
        "joined-header",
        "escape",
        "not-ascii",
        "cut",
    ],
)
def test_loading_through_templates_rejects_a_bad_line_as_reading_in_full_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, old: str, new: str
) -> None:
    path = tmp_path / "rank.jsonl"
    dump_log(repeated_steps(6), path)
    text = path.read_text()
    at = text.rindex(old)  # a late line, read through a template seen earlier
    path.write_bytes((text[:at] + new + text[at + len(old) :]).encode("utf-8"))
    errors = []
    for without_templates in (False, True):
        with monkeypatch.context() as patched:
            patched.setattr(logfile, "_SEEN_TEMPLATES", {})
            if without_templates:
                patched.setattr(logfile, "_template", lambda rest, effect, kind: None)
            with pytest.raises(LogFormatError) as caught:
                load_log(path)
        errors.append((type(caught.value), str(caught.value)))
    assert errors[0] == errors[1]
    assert " line " in errors[0][1]


def test_loading_a_cut_log_through_templates_gives_what_reading_in_full_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "rank.jsonl"
    dump_log(repeated_steps(20), path)
    path.write_bytes(path.read_bytes()[:-7])
    fast, _, slow, _ = load_both_ways(path, monkeypatch, allow_cut_end=True)
    assert fast == slow
    assert len(fast.records) == len(repeated_steps(20).records) - 1


def test_the_readers_caches_stay_bounded_over_a_log_of_many_templates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Names whose digits differ in their zeros, and arrays of other values: more
    # templates and tables than the caches hold (made small here), so both are emptied.
    effects: list[Effect] = []
    for n in range(1, 40):
        effects += [
            Release(step=n, op=Op.END_STEP, buffer=BufferRef(f"b{n:b}")),
            CopyHostToDevice(
                step=n, op=Op.CONSUME, source=[n + 10, 11], buffer=BufferRef("c"),
                stream=Stream.MAIN,
            ),
        ]  # fmt: skip
    log = EffectLog.from_effects(HEADER, effects)
    path = tmp_path / "rank.jsonl"
    dump_log(log, path)
    with monkeypatch.context() as patched:
        patched.setattr(logfile, "_MAX_TEMPLATES", 8)
        patched.setattr(logfile, "_SEEN_TEMPLATES", {})
        patched.setattr(logfile, "_ARRAYS", {})
        assert load_log(path) == log
        # 39 templates of releases, and some 35 tables built from a template, were kept.
        assert 0 < len(logfile._SEEN_TEMPLATES) <= 8
        assert 0 < len(logfile._ARRAYS) <= 8


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ('"op": "receive"', '"op":"receive"'),
        ('"receive", "buffer"', '"receive","buffer"'),
        ('"receive", "buffer"', '"receive",  "buffer"'),
        ('"op": "agree"', '"op":"agree"'),  # a table, read by the decoder
    ],
    ids=["no-space-after-colon", "no-space-after-comma", "two-spaces", "table"],
)
def test_a_log_spelled_with_other_spacing_loads_as_reading_in_full_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, old: str, new: str
) -> None:
    # Valid JSON another writer (or a hand) spaced otherwise: its lines are not read at
    # the offsets of the writer's spelling.
    path = tmp_path / "rank.jsonl"
    dump_log(repeated_steps(6), path)
    path.write_text(path.read_text().replace(old, new))
    fast, _, slow, _ = load_both_ways(path, monkeypatch)
    assert fast == slow == repeated_steps(6)
    assert repr(fast) == repr(slow)


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        ('{"shape": [2, 2], "values"', '{"shape": [3, 2], "values"', r"shape \[3, 2\]"),
        ("[1147483648, 1147483648]]", "[2147483648, 1147483648]]", "int32"),
    ],
    ids=["array-shape", "int32-range"],
)
def test_a_bad_table_in_a_log_spelled_otherwise_is_rejected_as_reading_in_full_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, old: str, new: str, problem: str
) -> None:
    # Its lines are read by the decoder, not at offsets: the table is checked there.
    path = tmp_path / "rank.jsonl"
    dump_log(repeated_steps(6), path)
    path.write_text(path.read_text().replace('"op": "agree"', '"op":"agree"'))
    monkeypatch.setattr(logfile, "_SEEN_TEMPLATES", {})
    loading = edit_a_late_line(path, old, new, problem)  # through the template seen
    monkeypatch.setattr(logfile, "_SEEN_TEMPLATES", {})
    monkeypatch.setattr(logfile, "_template", lambda rest, effect, kind: None)
    with pytest.raises(LogFormatError) as in_full:
        load_log(path)
    assert str(in_full.value) == str(loading)
