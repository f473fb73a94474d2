"""Review 76: the user-facing log path (record, dump, load, replay, diff).

- A writer (`dump_log`, `dump_logs`, a `Recorder` with a path) wrote effects whose
  integers the reader refuses (a negative step or size, one past int64, a `fill` past
  int64) and an event or work named by a non-str: the log was written, then `load_log`
  refused it, telling the user to record it again with this purepp.
- `dump_logs` of no logs (an iterator already read once) removed every rank log in the
  folder and wrote none.
- A decision's `cg_mode` edited to a value no decision has ("full") was refused with
  the reprs of attrs' `Attribute` and its validator buried in the message.
- `LogHeader(rank=np.int64(1), world=Layout(pp=2, dp=2))` was refused as "rank np.int64(1)
  is outside a world of 4": a rank inside the world, of the wrong type.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from purepp.effects.log import (
    EffectLog,
    LogHeader,
    Recorder,
    dump_log,
    dump_logs,
    load_log,
    load_logs,
)
from purepp.effects.vocabulary import (
    Allocate,
    BufferRef,
    DType,
    Effect,
    EventRef,
    GatherRows,
    Op,
    Pack,
    PadColumns,
    RecordEvent,
    Release,
    Section,
    Stream,
    WaitWork,
    WorkRef,
)
from purepp.errors import ConfigError, InvalidInputError, LogFormatError
from purepp.layout import Layout
from purepp.testing import ScheduleConfig, make_schedule, record_scripted_logs

HEADER = LogHeader(rank=0, world=Layout(pp=1, dp=1))
INT64_MAX = 2**63 - 1


def _release(step: int) -> Release:
    return Release(step=step, op=Op.END_STEP, buffer=BufferRef("x"))


def _pad(fill: int) -> PadColumns:
    return PadColumns(
        step=0,
        op=Op.RECEIVE,
        source=BufferRef("a"),
        out=BufferRef("b"),
        width=3,
        fill=fill,
        stream=Stream.RELAY,
    )


UNREADABLE: dict[str, tuple[Effect, str]] = {
    "negative step": (_release(-1), "effect.step is -1"),
    "step past int64": (_release(INT64_MAX + 1), f"effect.step is {INT64_MAX + 1}"),
    "negative size": (
        Allocate(
            step=0,
            op=Op.RECEIVE,
            buffer=BufferRef("x"),
            shape=(2, -1),
            dtype=DType.INT32,
            stream=Stream.RELAY,
        ),
        "effect.shape[1] is -1",
    ),
    "fill past int64": (_pad(INT64_MAX + 1), f"effect.fill is {INT64_MAX + 1}"),
    "negative section offset": (
        Pack(
            step=0,
            op=Op.RECEIVE,
            sections=(Section(buffer=BufferRef("a"), offset=-16, shape=(2,), dtype=DType.INT32),),
            out=BufferRef("o"),
            nbytes=16,
            stream=Stream.RELAY,
        ),
        "effect.sections[0].offset is -16",
    ),
    "event named by an int": (
        RecordEvent(step=0, op=Op.RECEIVE, stream=Stream.RELAY, event=EventRef(3)),  # type: ignore[arg-type]
        "effect.event is named 3, an int",
    ),
    "negative optional count": (
        GatherRows(
            step=0,
            op=Op.RECEIVE,
            source=BufferRef("a"),
            index=BufferRef("i"),
            out=BufferRef("o"),
            stream=Stream.RELAY,
            index_rows=-1,
        ),
        "effect.index_rows is -1",
    ),
    "work named by an int": (
        WaitWork(step=0, op=Op.AGREE, work=WorkRef(7)),  # type: ignore[arg-type]
        "effect.work is named 7, an int",
    ),
}


@pytest.mark.parametrize("case", sorted(UNREADABLE))
def test_dump_log_refuses_an_effect_the_reader_would_refuse(tmp_path: Path, case: str) -> None:
    effect, named = UNREADABLE[case]
    log = EffectLog.from_effects(HEADER, [_release(0), effect])
    path = tmp_path / "rank-0000.jsonl"
    with pytest.raises(InvalidInputError) as caught:
        dump_log(log, path)
    assert caught.value.call == "dump_log"
    assert caught.value.problem.startswith(f"effect 1 ({effect!r}) would be written as a log")
    assert named in caught.value.problem
    assert not path.exists()  # nothing written: never a log that load_log refuses


@pytest.mark.parametrize("case", sorted(UNREADABLE))
def test_a_recorder_refuses_an_effect_the_reader_would_refuse(tmp_path: Path, case: str) -> None:
    effect, named = UNREADABLE[case]
    path = tmp_path / "rank-0000.jsonl"
    recorder = Recorder(HEADER, path=path)
    recorder.perform((_release(0),))
    with pytest.raises(InvalidInputError, match=r"Recorder\.perform: effect 2 ") as caught:
        recorder.perform((_release(1), effect))
    assert named in caught.value.problem
    # Refused whole: the file still reads back, holding what was recorded before.
    assert load_log(path) == EffectLog.from_effects(HEADER, [_release(0)])
    recorder.perform((_release(1),))
    assert recorder.log == EffectLog.from_effects(HEADER, [_release(0), _release(1)])


@pytest.mark.parametrize("fill", [-(2**63), -1, INT64_MAX])
def test_every_int64_fill_still_reads_back(tmp_path: Path, fill: int) -> None:
    log = EffectLog.from_effects(HEADER, [_pad(fill), _release(INT64_MAX)])
    dump_log(log, tmp_path / "rank-0000.jsonl")
    assert load_log(tmp_path / "rank-0000.jsonl") == log


def test_dump_logs_of_no_logs_is_refused_and_keeps_the_folders_logs(tmp_path: Path) -> None:
    logs = record_scripted_logs(make_schedule(ScheduleConfig(pp=2, dp=1, spec=1, steps=3, seed=1)))
    once: Iterator[EffectLog] = iter(logs)
    dump_logs(once, tmp_path)
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    assert sorted(before) == ["rank-0000.jsonl", "rank-0001.jsonl"]
    with pytest.raises(InvalidInputError) as caught:
        dump_logs(once, tmp_path)  # the iterator is spent: no logs
    assert caught.value.call == "dump_logs"
    assert "logs holds no log" in caught.value.problem
    assert caught.value.fix.startswith("pass the ranks' logs")
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == before
    assert load_logs(tmp_path) == logs


def test_a_cg_mode_no_decision_has_is_refused_in_one_plain_line(tmp_path: Path) -> None:
    logs = record_scripted_logs(make_schedule(ScheduleConfig(pp=1, dp=2, spec=0, steps=2, seed=1)))
    dump_log(logs[0], tmp_path / "rank-0000.jsonl")
    lines = (tmp_path / "rank-0000.jsonl").read_text().splitlines(keepends=True)
    number = next(i for i, line in enumerate(lines) if '"cg_mode": "' in line)
    edited = lines[number].replace('"cg_mode": "NONE"', '"cg_mode": "full"')
    assert edited != lines[number]
    (tmp_path / "rank-0000.jsonl").write_text(
        "".join([*lines[:number], edited, *lines[number + 1 :]])
    )
    with pytest.raises(LogFormatError) as caught:
        load_log(tmp_path / "rank-0000.jsonl")
    assert caught.value.problem == (
        f"{tmp_path / 'rank-0000.jsonl'} line {number + 1}: invalid value: 'cg_mode' must be in "
        "('NONE', 'PIECEWISE', 'FULL') (got 'full') @ record.effect"
    )


@pytest.mark.parametrize("rank", [np.int64(1), True, 1.0])
def test_a_header_rank_of_another_type_is_named_as_such_not_as_outside_the_world(
    rank: object,
) -> None:
    with pytest.raises(ConfigError) as caught:
        LogHeader(rank=rank, world=Layout(pp=2, dp=2))  # type: ignore[arg-type]
    assert caught.value.problem.startswith(f"rank {rank!r} is a")
    assert caught.value.problem.endswith(", not an int")
    assert "outside" not in caught.value.problem
    assert caught.value.fix.startswith("pass the global rank as an int in 0..3")
    with pytest.raises(ConfigError, match="rank 4 is outside a world of 4"):
        LogHeader(rank=4, world=Layout(pp=2, dp=2))
