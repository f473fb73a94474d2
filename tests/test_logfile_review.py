"""Review probes of the log format: its writer, its strict reader and the reader's fast path."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from purepp.effects import logfile
from purepp.effects._converter import unstructure_effect
from purepp.effects.checker import check_logs
from purepp.effects.log import (
    EffectLog,
    LogHeader,
    LogStream,
    Recorder,
    config_digest,
    diff_logs,
    dump_log,
    header_json,
    load_log,
    record_json,
)
from purepp.effects.logmodel import Numbering
from purepp.effects.scheduler import LOCAL_KINDS
from purepp.effects.vocabulary import (
    Allocate,
    AllReduce,
    Broadcast,
    BufferRef,
    CheckHeader,
    Communicator,
    CopyHostToDevice,
    DType,
    Effect,
    EventRef,
    NoteDecision,
    Op,
    PadColumns,
    RecordEvent,
    Release,
    ScatterRows,
    Stream,
    WorkRef,
)
from purepp.errors import LogFormatError
from purepp.layout import Layout
from tests.strategies import any_effect, effects_of, log_headers

HEADER = LogHeader(rank=0, world=Layout(pp=1, dp=1), config={"model": "toy"})


@pytest.fixture
def fresh_templates(monkeypatch: pytest.MonkeyPatch) -> None:
    """No template seen before the test (the reader's caches are process-wide)."""
    monkeypatch.setattr(logfile, "_SEEN_TEMPLATES", {})
    monkeypatch.setattr(logfile, "_ARRAYS", {})


def outcome(path: Path, *, in_full: bool, allow_cut_end: bool = False) -> object:
    """What load_log gives for `path` (a log, or the error's text), from no template seen,
    through templates or with every line read in full."""
    saved = logfile._SEEN_TEMPLATES, logfile._ARRAYS, logfile._template
    logfile._SEEN_TEMPLATES, logfile._ARRAYS = {}, {}
    if in_full:
        logfile._template = lambda rest, effect, kind: None
    try:
        return load_log(path, allow_cut_end=allow_cut_end)
    except LogFormatError as error:
        return f"LogFormatError: {error}"
    finally:
        logfile._SEEN_TEMPLATES, logfile._ARRAYS, logfile._template = saved


def both_ways(path: Path, *, allow_cut_end: bool = False) -> object:
    """load_log's outcome, asserted equal (down to repr) through templates and in full."""
    fast = outcome(path, in_full=False, allow_cut_end=allow_cut_end)
    slow = outcome(path, in_full=True, allow_cut_end=allow_cut_end)
    assert fast == slow
    assert repr(fast) == repr(slow)
    return fast


# -- a log whose late lines are built from templates -----------------------------


def varied_steps(steps: int) -> EffectLog:
    """Lines of many kinds and field types, repeated over steps of two digits."""
    effects: list[Effect] = []
    for step in range(11, 11 + steps):
        effects += [
            Allocate(
                step=step, op=Op.RECEIVE, buffer=BufferRef(f"r{step}"), shape=(4, 2),
                dtype=DType.INT64, stream=Stream.RELAY,
            ),
            Broadcast(
                step=step, op=Op.RECEIVE, buffer=BufferRef(f"r{step}"), shape=(4, 2),
                dtype=DType.INT64, src=1, comm=Communicator.PP_RELAY, stream=Stream.RELAY,
            ),
            CheckHeader(
                step=step, op=Op.RECEIVE, buffer=BufferRef(f"r{step}"),
                expected=np.array([step, 3], dtype=np.int32), stream=Stream.RELAY,
            ),
            AllReduce(
                step=step, op=Op.AGREE, contribution=np.array([[step, 5]], dtype=np.int32),
                result=BufferRef(f"dp{step}"), comm=Communicator.DP_CPU,
                work=WorkRef(f"w{step}"),
            ),
            PadColumns(
                step=step, op=Op.CONSUME, source=BufferRef(f"r{step}"),
                out=BufferRef(f"p{step}"), width=7, fill=-3, stream=Stream.MAIN,
            ),
            NoteDecision(
                step=step, op=Op.AGREE, table=BufferRef(f"dp{step}"), comm=Communicator.DP_CPU,
                cg_mode="FULL", num_ubatches=1,
                num_tokens_across_dp=np.array([step], dtype=np.int32),
                uniform_token_count=2, eager=False, num_reqs=3, max_query_len=4,
            ),
            RecordEvent(step=step, op=Op.RECEIVE, stream=Stream.RELAY, event=EventRef(f"e{step}")),
            ScatterRows(
                step=step, op=Op.CONSUME, source=BufferRef(f"p{step}"), index=BufferRef("i1"),
                target=BufferRef("t1"), stream=Stream.MAIN, skips=True,
            ),
            Release(step=step, op=Op.END_STEP, buffer=BufferRef(f"p{step}")),
        ]  # fmt: skip
    return EffectLog.from_effects(HEADER, effects)


VARIED = varied_steps(2)
KINDS_PER_STEP = 9


def last_step_lines(path: Path) -> tuple[list[bytes], int]:
    """The file's lines (with newlines) and the index of the first line of the last step."""
    lines = path.read_bytes().splitlines(keepends=True)
    return lines, len(lines) - KINDS_PER_STEP


# -- the fast path refuses exactly what the full path refuses --------------------


def test_every_single_byte_corruption_of_a_late_line_loads_as_reading_in_full_does(
    tmp_path: Path,
) -> None:
    # Each late line is of a template seen at an earlier step: a corruption is read
    # through that template, and must give what reading the line in full gives.
    path = tmp_path / "rank.jsonl"
    dump_log(VARIED, path)
    lines, first = last_step_lines(path)
    replacements = [b"0", b"9", b"-", b'"', b"\\"]
    refused = 0
    for index in range(first, len(lines)):
        line = lines[index]
        for at in range(len(line) - 1):  # the newline is kept: the cut is tested below
            for byte in replacements:
                if line[at : at + 1] == byte:
                    continue
                corrupt = line[:at] + byte + line[at + 1 :]
                path.write_bytes(b"".join([*lines[:index], corrupt, *lines[index + 1 :]]))
                result = both_ways(path)
                if isinstance(result, str):
                    assert f"line {index + 1}: " in result, result
                    refused += 1
                else:
                    assert isinstance(result, EffectLog)
    assert refused > 500


def digit_edits(line: bytes) -> Iterator[bytes]:
    """`line` with each run of digits after its step replaced by other spellings."""
    start = line.index(b'"step": ') + len(b'"step": ')
    start += re.match(rb"[0-9]+", line[start:]).end()  # type: ignore[union-attr]
    for match in re.finditer(rb"-?[0-9]+", line[start:]):
        at, end = start + match.start(), start + match.end()
        if line[at - 1 : at] not in (b" ", b"["):
            continue  # the digits of a name
        digits = match[0]
        for other in (
            b"-" + digits.lstrip(b"-"),
            b"0" + digits.lstrip(b"-"),
            b"-0",
            b"4294967296",
            b"2147483648",
            b"-2147483649",
            b"9" * 30,
            b"1e1",
            b"3.0",
            b'"3"',
            b"true",
            b"null",
            b"[]",
        ):
            if other != digits:
                yield line[:at] + other + line[end:]


def test_every_number_of_a_late_line_respelled_loads_as_reading_in_full_does(
    tmp_path: Path,
) -> None:
    path = tmp_path / "rank.jsonl"
    dump_log(VARIED, path)
    lines, first = last_step_lines(path)
    for index in range(first, len(lines)):
        for corrupt in digit_edits(lines[index]):
            path.write_bytes(b"".join([*lines[:index], corrupt, *lines[index + 1 :]]))
            result = both_ways(path)
            if b'"3"' in corrupt or b"3.0" in corrupt or b"1e1" in corrupt:
                assert isinstance(result, str)
                assert f"line {index + 1}: " in result


DIGIT_MAPS = st.permutations(list(b"123456789")).map(
    lambda image: bytes.maketrans(b"123456789", bytes(image))
)


def effect_text(line: str) -> str:
    return line[line.index('"effect": ') + len('"effect": ') : -1]


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(any_effect, min_size=1, max_size=6), DIGIT_MAPS)
def test_lines_differing_in_digits_alone_load_as_reading_in_full_does(
    tmp_path: Path, effects: list[Effect], digits: bytes
) -> None:
    # Any log, then each record again with its digits 1-9 permuted (zeros kept): every
    # second line has the key of its first, so it is read through that template.
    numbering = Numbering()
    first = [record_json(numbering.number(effect)) for effect in effects]
    again = [
        json.dumps({"seq": record.seq, "comm_seq": record.comm_seq})[:-1]
        + ', "effect": '
        + effect_text(line).encode("ascii").translate(digits).decode("ascii")
        + "}"
        for line, record in zip(first, (numbering.number(e) for e in effects), strict=True)
    ]
    path = tmp_path / "rank.jsonl"
    path.write_text("\n".join([header_json(HEADER), *first, *again]) + "\n")
    result = both_ways(path)
    if isinstance(result, EffectLog):
        assert result.effects[: len(effects)] == tuple(effects)


# -- the checker reads records it does not build: it must refuse what loading refuses


def copies_over_steps(steps: int) -> EffectLog:
    return EffectLog.from_effects(
        HEADER,
        [
            CopyHostToDevice(
                step=step, op=Op.RECEIVE, source=np.array([step, 7], dtype=np.int32),
                buffer=BufferRef(f"h{step}"), stream=Stream.MAIN,
            )
            for step in range(10, 10 + steps)
        ],
    )  # fmt: skip


def test_a_table_not_of_its_declared_shape_in_a_built_record_is_refused_by_every_reader(
    tmp_path: Path, fresh_templates: None
) -> None:
    # The same edit as below, in a record the scan builds (no local kinds).
    path = tmp_path / "rank-0000.jsonl"
    dump_log(copies_over_steps(6), path)
    text = path.read_text()
    at = text.rindex('"shape": [2]')
    path.write_text(text[:at] + '"shape": [3]' + text[at + len('"shape": [2]') :])
    with pytest.raises(LogFormatError, match="line 7: expected a list of 3"):
        load_log(path)
    with pytest.raises(LogFormatError, match="line 7: expected a list of 3"):
        list(LogStream(path).scan(frozenset()))


def test_the_checker_refuses_a_table_not_of_its_declared_shape_as_loading_does(
    tmp_path: Path, fresh_templates: None
) -> None:
    path = tmp_path / "rank-0000.jsonl"
    dump_log(copies_over_steps(6), path)
    text = path.read_text()
    at = text.rindex('"shape": [2]')
    path.write_text(text[:at] + '"shape": [3]' + text[at + len('"shape": [2]') :])
    with pytest.raises(LogFormatError, match="line 7: expected a list of 3") as loading:
        load_log(path)
    logfile._SEEN_TEMPLATES.clear()
    with pytest.raises(LogFormatError) as scanning:
        list(LogStream(path, call="load_log").scan(LOCAL_KINDS))
    assert str(scanning.value) == str(loading.value)
    assert check_logs(tmp_path).exit_code != 0


# -- the recorder's file is the log it recorded -----------------------------------


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    log_headers(),
    st.lists(st.lists(any_effect, max_size=4), max_size=4),
)
def test_a_recorder_file_reads_back_as_the_recorders_memory_log(
    tmp_path: Path, header: LogHeader, batches: list[list[Effect]]
) -> None:
    path = tmp_path / "rank.jsonl"
    on_file, in_memory = Recorder(header, path=path), Recorder(header)
    for batch in batches:
        # Twice: the second copy of each line is read through the first's template.
        on_file.perform((*batch, *batch))
        in_memory.perform((*batch, *batch))
        assert on_file.log == in_memory.log
        assert repr(on_file.log) == repr(load_log(path))
    dump_log(in_memory.log, tmp_path / "dumped.jsonl")
    assert path.read_bytes() == (tmp_path / "dumped.jsonl").read_bytes()
    assert both_ways(path) == in_memory.log


@pytest.mark.parametrize("kind", range(KINDS_PER_STEP))
def test_a_log_cut_at_every_byte_of_its_last_line_reads_up_to_the_cut(
    tmp_path: Path, kind: int
) -> None:
    # The last line is of a template seen a step before: a cut in it is never built.
    log = EffectLog(HEADER, VARIED.records[: KINDS_PER_STEP + kind + 1])
    path = tmp_path / "rank.jsonl"
    dump_log(log, path)
    text = path.read_bytes()
    last = text.rindex(b"\n", 0, len(text) - 1) + 1
    line = text.count(b"\n")
    for cut in range(last + 1, len(text)):
        path.write_bytes(text[:cut])
        assert both_ways(path, allow_cut_end=True) == EffectLog(HEADER, log.records[:-1])
        refused = outcome(path, in_full=False)
        assert isinstance(refused, str)
        assert f"line {line}: the last line is truncated" in refused
        stream = LogStream(path, allow_cut_end=True)
        assert len(list(stream)) == len(log.records) - 1
        assert stream.cut_line == line


# -- headers -------------------------------------------------------------------

CONFIGS = [
    {"name": "\u00e9t\u00e9 \u2603 \U0001f600", "\u2603": {"\u00e9": []}},
    {"empty": {}, "nested": [[], {}, [{}]], "deep": {"a": {"b": {"c": []}}}},
    {"f": 0.1, "g": -0.0, "h": 1e300, "i": 5e-324, "j": 1.0, "k": [1, 1.0, True]},
    {"surrogate": "\ud800", "nul": "\x00", "quote": '"\\'},
]


@pytest.mark.parametrize("config", CONFIGS, ids=["unicode", "empty", "floats", "escapes"])
def test_a_run_header_of_an_unusual_config_reads_back_with_its_digest(
    tmp_path: Path, config: dict[str, object]
) -> None:
    header = LogHeader.for_run(rank=0, world=Layout(pp=1, dp=1), config=config, run_id="r\u00e9")
    path = tmp_path / "rank.jsonl"
    dump_log(EffectLog(header, ()), path)
    loaded = load_log(path)
    assert loaded.header == header
    assert loaded.header.config_digest == config_digest(config)
    assert header_json(loaded.header) == header_json(header)
    path.write_text(path.read_text().replace("1.0", "1", 1))  # 1.0 and 1 differ as JSON
    if "1.0" in header_json(header):
        with pytest.raises(LogFormatError, match="line 1: config_digest is"):
            load_log(path)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ('"rank": 0', '"rank": "0"'),
        ('"rank": 0', '"rank": 0.0'),
        ('"rank": 0', '"rank": false'),
        ('"pp": 1', '"pp": 1.0'),
        ('"dp": 1', '"dp": true'),
        ('"dp": 1}', '"dp": 1, "tp": 1}'),
        ('"run_id": "r"', '"run_id": 7'),
        ('"config_digest": "sha256:', '"config_digest": "sha256:0'),
        ('"rank": 0', '"rank": 0, "rank": 0'),
    ],
)
def test_a_header_value_of_another_json_type_is_refused_naming_line_one(
    tmp_path: Path, old: str, new: str
) -> None:
    header = LogHeader.for_run(rank=0, world=Layout(pp=1, dp=1), config={"b": 2}, run_id="r")
    path = tmp_path / "rank.jsonl"
    dump_log(EffectLog(header, ()), path)
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(LogFormatError, match=r"rank\.jsonl line 1: "):
        load_log(path)


# -- diffs ---------------------------------------------------------------------


def changed_field(effect: Effect, data: st.DataObject) -> tuple[str, Effect]:
    """One field of `effect` (not its step) given another value of its declared type."""
    names = [field.name for field in attrs.fields(type(effect))]
    other = data.draw(effects_of(type(effect)), label="other")
    differing = [
        name
        for name in names
        if json.dumps(unstructure_effect(other)[name], sort_keys=True)
        != json.dumps(unstructure_effect(effect)[name], sort_keys=True)
    ]
    if not differing:
        return "", effect
    name = data.draw(st.sampled_from(differing), label="field")
    return name, attrs.evolve(effect, **{name: getattr(other, name)})


@settings(max_examples=80)
@given(st.lists(any_effect, min_size=1, max_size=6), st.data())
def test_the_diff_names_the_one_record_and_field_that_differ(
    effects: list[Effect], data: st.DataObject
) -> None:
    index = data.draw(st.integers(0, len(effects) - 1), label="index")
    name, changed = changed_field(effects[index], data)
    if not name:
        return
    expected = EffectLog.from_effects(HEADER, effects)
    actual = EffectLog.from_effects(HEADER, [*effects[:index], changed, *effects[index + 1 :]])
    report = diff_logs(expected, actual, context=0)
    assert report is not None
    lines = report.splitlines()
    assert lines[0].startswith(f"effect logs differ at record {index} (file line {index + 2});")
    assert lines[1] == f"  - expected #{index}: {record_json(expected.records[index])}"
    assert lines[2] == f"  + actual   #{index}: {record_json(actual.records[index])}"
    # Another communicator may give the record another comm_seq too.
    renumbered = (
        name == "comm" and expected.records[index].comm_seq != actual.records[index].comm_seq
    )
    assert lines[3] == f"  fields that differ: {'comm_seq, ' if renumbered else ''}effect.{name}"


@settings(max_examples=40)
@given(log_headers(), st.data())
def test_the_header_diff_names_each_config_key_that_differs(
    header: LogHeader, data: st.DataObject
) -> None:
    key = data.draw(st.text(max_size=4).filter(lambda k: k not in header.config), label="key")
    other = attrs.evolve(header, config={**header.config, key: [1.0]})
    report = diff_logs(EffectLog(header, ()), EffectLog(other, ()))
    assert report is not None
    # A key a dotted name would garble (a dot, a space, a newline, or empty) is quoted.
    shown = f".{key}" if re.fullmatch(r"[A-Za-z0-9_-]+", key) else f"[{json.dumps(key)}]"
    assert report.split("\n")[-1] == f"  fields that differ: config{shown}"


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"model": "llama"}, "config.model"),
        ({"a.b": 2}, 'config["a.b"]'),  # not config.a.b, a nested key it is not
        ({"x y": 2}, 'config["x y"]'),
        ({"": 2}, 'config[""]'),
        ({"two\nlines": 2}, 'config["two\\nlines"]'),  # the report stays one line a field
    ],
)
def test_a_config_key_a_dotted_name_would_garble_is_quoted(
    config: dict[str, object], named: str
) -> None:
    other = attrs.evolve(HEADER, config={**HEADER.config, **config})
    report = diff_logs(EffectLog(HEADER, ()), EffectLog(other, ()))
    assert report is not None
    assert report.splitlines()[-1] == f"  fields that differ: {named}"
