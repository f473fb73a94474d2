"""Review 77: refusals that leave state as it was, and a diff of a hand-built log.

- `dump_logs` wrote the logs of different worlds, runs or configs into one folder,
  which `load_logs` and `purepp check` then refused as not one run's logs. It now
  refuses them up front, by the rule those readers apply (`check_same_run`), and
  writes, makes and removes nothing.
- `PlaceholderInputs.__call__` counted the call and bound the inputs it could size
  before raising `InputShapeError` for one it could not: the refused call left
  placeholders bound, and the next call for the step bound the step's next run's
  inputs. It now finds every input's layout before it changes anything.
- `diff_logs` of an in-memory log whose differing record holds a hand-built effect
  with a field of the wrong type (`op="end_step"`) raised a bare AttributeError or
  TypeError from the converter. It now raises InvalidInputError naming diff_logs,
  the record and its field: a report renders records as log lines, and no log can
  hold such a record (dump_log and a Recorder refuse it, load_log never yields it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from purepp.effects.log import EffectLog, LogHeader, diff_logs, dump_logs, load_logs
from purepp.effects.logfile import log_file_name
from purepp.effects.numpy_interpreter import NumpyInterpreter
from purepp.effects.replay import InputShapeError, placeholder_inputs
from purepp.effects.vocabulary import (
    Allocate,
    BufferRef,
    DType,
    Effect,
    EventRef,
    Op,
    Pack,
    RecordEvent,
    Release,
    Section,
    StackRows,
    Stream,
)
from purepp.errors import InvalidInputError, LogFormatError
from purepp.layout import Layout
from purepp.testing import ScheduleConfig, make_schedule, record_scripted_logs

HEADER = LogHeader(rank=0, world=Layout(pp=1, dp=1))


def scripted(*, pp: int, dp: int) -> tuple[EffectLog, ...]:
    return record_scripted_logs(
        make_schedule(ScheduleConfig(pp=pp, dp=dp, spec=1, steps=2, seed=0))
    )


def listing(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in directory.iterdir()}


def _with_header(log: EffectLog, **changes: Any) -> EffectLog:
    return attrs.evolve(log, header=attrs.evolve(log.header, **changes))


# -- dump_logs: logs of one run, or nothing written ------------------------------------


def _not_one_run(case: str) -> tuple[list[EffectLog], str]:
    """Logs that are not one run's, and what the refusal names."""
    logs = list(scripted(pp=2, dp=1))
    if case == "world":
        return [logs[0], scripted(pp=1, dp=2)[1]], (
            "logs[0] (rank 0) is of world pp=2, dp=1 but logs[1] (rank 1) of pp=1, dp=2"
        )
    if case == "run id":
        return [_with_header(logs[0], run_id="run-a"), _with_header(logs[1], run_id="run-b")], (
            "logs[0] (rank 0) and logs[1] (rank 1) are of different runs; logs holds logs of "
            "2 runs (run_id 'run-a': logs[0] (rank 0); run_id 'run-b': logs[1] (rank 1))"
        )
    assert case == "config"
    return [logs[0], _with_header(logs[1], config={"model": "other"})], (
        "logs[0] (rank 0) and logs[1] (rank 1) have different configs"
    )


@pytest.mark.parametrize("case", ["world", "run id", "config"])
def test_dump_logs_refuses_logs_of_different_runs_and_changes_nothing(
    tmp_path: Path, case: str
) -> None:
    logs, named = _not_one_run(case)
    earlier = scripted(pp=2, dp=2)
    dump_logs(earlier, tmp_path)
    before = listing(tmp_path)
    with pytest.raises(InvalidInputError) as caught:
        dump_logs(logs, tmp_path)
    assert caught.value.call == "dump_logs"
    assert caught.value.problem.startswith(named)
    assert caught.value.fix.startswith("pass the logs of one run")
    assert listing(tmp_path) == before  # nothing written, nothing removed
    assert load_logs(tmp_path) == earlier
    with pytest.raises(InvalidInputError):
        dump_logs(logs, tmp_path / "new")
    assert not (tmp_path / "new").exists()  # not even the folder made


@pytest.mark.parametrize("case", ["world", "run id", "config"])
def test_the_refusal_is_the_one_load_logs_gives_the_folder(tmp_path: Path, case: str) -> None:
    logs, _ = _not_one_run(case)
    # Each log dumped alone (allowed), into one folder by hand: load_logs refuses it.
    for index, log in enumerate(logs):
        dump_logs([log], tmp_path / str(index))
        path = tmp_path / str(index) / log_file_name(log.header.rank)
        path.replace(tmp_path / path.name)
    with pytest.raises(LogFormatError) as read:
        load_logs(tmp_path)
    with pytest.raises(InvalidInputError) as dumped:
        dump_logs(logs, tmp_path / "dumped")
    names = {"rank-0000.jsonl": "logs[0] (rank 0)", "rank-0001.jsonl": "logs[1] (rank 1)"}
    expected = read.value.problem.removeprefix(f"{tmp_path}: ")
    for name, shown in names.items():
        expected = expected.replace(name, shown)
    assert dumped.value.problem == expected.replace("the folder holds", "logs holds")


def test_dump_logs_still_writes_a_run_with_a_rank_missing(tmp_path: Path) -> None:
    # purepp check reads a run whose rank wrote no log (it died): dump_logs writes one.
    logs = scripted(pp=2, dp=1)
    assert dump_logs(logs[1:], tmp_path) == (tmp_path / log_file_name(1),)


def test_dump_logs_of_one_rank_twice_is_still_refused(tmp_path: Path) -> None:
    logs = scripted(pp=2, dp=1)
    with pytest.raises(InvalidInputError, match=r"ranks \[1\] appear more than once"):
        dump_logs([logs[0], logs[1], _with_header(logs[1], run_id="other")], tmp_path)
    assert not list(tmp_path.iterdir())


# -- placeholder_inputs: a refused call binds nothing and counts as no call -------------

NUM_SAMPLED = BufferRef("input.num_sampled")
NUM_REJECTED = BufferRef("input.num_rejected")
TOKENS = BufferRef("input.tokens")


def _stacked_with(step: int, run: int, length: int, source: BufferRef) -> list[Effect]:
    made = BufferRef(f"run{run}.made")
    return [
        Allocate(
            step=step,
            op=Op.BROADCAST,
            buffer=made,
            shape=(length,),
            dtype=DType.INT32,
            stream=Stream.MAIN,
        ),
        StackRows(
            step=step,
            op=Op.BROADCAST,
            sources=(made, source),
            out=BufferRef(f"run{run}.stacked"),
            stream=Stream.MAIN,
        ),
    ]


def _packed(dtype: DType, wire: str) -> Pack:
    return Pack(
        step=0,
        op=Op.BROADCAST,
        sections=(Section(buffer=TOKENS, offset=0, shape=(2,), dtype=dtype),),
        out=BufferRef(wire),
        nbytes=64,
        stream=Stream.MAIN,
    )


def _two_runs_of_step_0() -> EffectLog:
    """Step 0 in two runs (an overlapped agreement splits it). The first reads the
    counts, which it sizes, and the tokens, packed as int32 and as int64, which no one
    placeholder fits; the second reads the rejected counts."""
    effects: list[Effect] = [
        *_stacked_with(0, 0, 2, NUM_SAMPLED),
        _packed(DType.INT32, "run0.wire32"),
        _packed(DType.INT64, "run0.wire64"),
        *_stacked_with(1, 1, 1, NUM_SAMPLED),
        *_stacked_with(0, 2, 3, NUM_REJECTED),
    ]
    return EffectLog.from_effects(HEADER, effects)


def test_a_refused_placeholder_call_binds_nothing_and_is_not_counted() -> None:
    binder = placeholder_inputs(_two_runs_of_step_0())
    interpreter = NumpyInterpreter()
    with pytest.raises(InputShapeError) as caught:
        binder(0, interpreter)
    assert caught.value.buffer == TOKENS
    assert interpreter.bound_refs() == frozenset()  # not the counts it could size
    # The caller binds the tokens and calls again: still the step's first run.
    tokens = np.zeros(2, np.int32)
    interpreter.bind(TOKENS, tokens)
    binder(0, interpreter)
    assert interpreter.bound_refs() == {TOKENS, NUM_SAMPLED}
    assert interpreter.tensor(TOKENS) is tokens
    assert np.asarray(interpreter.tensor(NUM_SAMPLED)).shape == (2,)
    binder(0, interpreter)  # then the second run's
    assert interpreter.bound_refs() == {TOKENS, NUM_SAMPLED, NUM_REJECTED}
    assert np.asarray(interpreter.tensor(NUM_REJECTED)).shape == (3,)


# -- diff_logs: a record no log can hold is named, not a converter's AttributeError -----


def _release(step: object = 1, op: object = Op.END_STEP) -> Release:
    return Release(step=step, op=op, buffer=BufferRef("x"))  # type: ignore[arg-type]


MISTYPED: dict[str, tuple[Effect, str]] = {
    "op as its str": (_release(op="end_step"), "effect.op is 'end_step', a str"),
    "step as a str": (_release(step="1"), "effect.step is '1', a str"),
    "step as a float": (_release(step=1.5), "effect.step is 1.5, a float"),
    "stream as its str": (
        RecordEvent(step=1, op=Op.RECEIVE, stream="relay", event=EventRef("e")),  # type: ignore[arg-type]
        "effect.stream is 'relay', a str",
    ),
}


@pytest.mark.parametrize("case", sorted(MISTYPED))
@pytest.mark.parametrize("side", ["expected", "actual"])
def test_diff_logs_names_a_differing_record_of_a_mistyped_effect(case: str, side: str) -> None:
    effect, named = MISTYPED[case]
    good = EffectLog.from_effects(HEADER, [_release(0), _release(1)])
    bad = EffectLog.from_effects(HEADER, [_release(0), effect])
    pair = (good, bad) if side == "actual" else (bad, good)
    with pytest.raises(InvalidInputError) as caught:
        diff_logs(*pair)
    assert caught.value.call == "diff_logs"
    assert caught.value.problem == (
        f"record 1 of the {side} log ({effect!r}) cannot be shown as a log line: {named}"
    )
    assert caught.value.fix.startswith("give effect fields the types their class declares")


def test_a_mistyped_record_the_report_does_not_show_is_no_error() -> None:
    # Equal in both logs and outside the context: the report never renders it.
    mistyped = _release(step=0, op="end_step")
    expected = EffectLog.from_effects(HEADER, [mistyped, *map(_release, range(1, 5))])
    actual = EffectLog.from_effects(HEADER, [mistyped, *map(_release, range(1, 4)), _release(9)])
    report = diff_logs(expected, actual, context=1)
    assert report is not None
    assert report.startswith("effect logs differ at record 4 (file line 6)")
    assert diff_logs(expected, expected) is None
