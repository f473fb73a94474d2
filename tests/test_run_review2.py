"""A second review of the runner, the CLI and the effect log pipeline.

Each test states one behaviour. The tests for bugs fail on the code as reviewed and
say in their docstring what is correct, and why.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from purepp.effects.checker import EXIT_UNUSABLE, check_logs
from purepp.effects.log import (
    EffectLog,
    Layout,
    LogHeader,
    dump_log,
    dump_logs,
    load_log,
    log_file_name,
)
from purepp.effects.vocabulary import (
    Allocate,
    Broadcast,
    BufferRef,
    Communicator,
    DType,
    Op,
    Release,
    Stream,
)
from purepp.errors import LogFormatError
from purepp.runner.cli import launch, main
from purepp.runner.settings import RunSettings

WORLD = Layout(pp=2, dp=1)


def _relay_log(rank: int) -> EffectLog:
    """One relay broadcast of a [2, 3] int64 buffer from the last stage, as a rank logs it."""
    buffer = BufferRef("relay.step4.sampled_tokens")
    return EffectLog.from_effects(
        LogHeader(rank=rank, world=WORLD),
        (
            Allocate(
                step=4,
                op=Op.RECEIVE,
                buffer=buffer,
                shape=(2, 3),
                dtype=DType.INT64,
                stream=Stream.RELAY,
            ),
            Broadcast(
                step=4,
                op=Op.BROADCAST,
                buffer=buffer,
                shape=(2, 3),
                dtype=DType.INT64,
                src=1,
                comm=Communicator.PP_RELAY,
                stream=Stream.RELAY,
            ),
            Release(step=4, op=Op.END_STEP, buffer=buffer),
        ),
    )


def _corrupt(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="ascii")
    assert old in text, (old, text)
    path.write_text(text.replace(old, new), encoding="ascii")


def test_the_sample_logs_load_and_check_clean(tmp_path: Path) -> None:
    """The logs the corruption tests start from are valid: they load and check ok."""
    paths = dump_logs([_relay_log(0), _relay_log(1)], tmp_path)
    for rank, path in enumerate(paths):
        assert load_log(path) == _relay_log(rank)
    report = check_logs(tmp_path)
    assert report.ok, report.text


def test_a_negative_dimension_in_a_broadcast_shape_is_a_format_error(tmp_path: Path) -> None:
    """A log is evidence and is read strictly: the reader refuses an int32 array's shape
    with a negative dimension ("expected a shape: a list of integers >= 0"), but takes a
    broadcast's (or an allocation's) `"shape": [-2, 3]` as it stands. No rank can
    allocate or broadcast a negative size, so such a line is corruption: it must be a
    `LogFormatError` naming the file, the line and the shape, like the array's."""
    path = tmp_path / "rank-0001.jsonl"
    dump_log(_relay_log(1), path)
    _corrupt(
        path,
        '"shape": [2, 3], "dtype": "int64", "src"',
        '"shape": [-2, 3], "dtype": "int64", "src"',
    )
    with pytest.raises(LogFormatError) as caught:
        load_log(path)
    assert f"{path} line 3" in caught.value.problem
    assert "-2" in caught.value.problem


def test_check_of_logs_that_broadcast_a_negative_shape_is_not_ok(tmp_path: Path) -> None:
    """`purepp check` says "ok ... every communicator matches" for two ranks whose logs
    broadcast a `[-2, 3]` buffer: the shapes match, so nothing is flagged. The logs are
    corrupt (no run can issue that collective): the check must not pass them; it must
    report an unusable log (exit 2) naming the file, as for any other corrupt value."""
    paths = dump_logs([_relay_log(0), _relay_log(1)], tmp_path)
    for path in paths:
        _corrupt(
            path,
            '"shape": [2, 3], "dtype": "int64", "src"',
            '"shape": [-2, 3], "dtype": "int64", "src"',
        )
    report = check_logs(tmp_path)
    assert not report.ok, report.text
    assert report.exit_code == EXIT_UNUSABLE, report.text


def test_a_step_past_int64_is_a_format_error(tmp_path: Path) -> None:
    """logfile's reader says of its fast path: "a longer one (past int64, or past
    Python's int() digit limit) misses the fast path and is read in full, where it fails
    as a format error". Read in full, a step of 2**63 (no int64 holds it; the torch
    interpreter and every int64 step counter overflow on it) is accepted as it stands,
    and `purepp check` can then report a deadlock at that step instead of a corrupt log.
    It must be a `LogFormatError` naming the file and the line."""
    path = tmp_path / "rank-0001.jsonl"
    dump_log(_relay_log(1), path)
    lines = path.read_text(encoding="ascii").splitlines(keepends=True)
    assert '"step": 4, "op": "broadcast"' in lines[2]
    lines[2] = lines[2].replace('"step": 4,', f'"step": {2**63},')
    path.write_text("".join(lines), encoding="ascii")
    with pytest.raises(LogFormatError) as caught:
        load_log(path)
    assert f"{path} line 3" in caught.value.problem


def test_launch_without_a_run_id_writes_logs_with_a_run_id_and_a_config_digest(
    tmp_path: Path,
) -> None:
    """`launch` "runs the same job" as `purepp run`, whose every log header carries a run
    id and the config's digest (the README: "a versioned header: schema, rank, PP x DP
    layout, config, run id and config digest"). Called without `run_id`, as the README's
    own example calls it, `launch` hands the ranks none, and the ranks then write the
    format from before run ids: no run id and no digest, so `purepp check` can neither
    tell this run's logs from another's nor catch a config edited after the run. The
    digest depends on the config alone; `launch` should make a run id when given none
    (as `purepp run` does) and the headers carry both."""
    settings = RunSettings(
        pp=1, dp=1, requests=2, steps=4, timeout_s=30.0, num_layers=1, max_num_reqs=2
    )
    logs = tmp_path / "logs"
    launch(settings, log_dir=logs, progress=False)
    header = json.loads((logs / log_file_name(0)).read_text(encoding="ascii").splitlines()[0])
    assert header.get("config_digest") is not None, header
    assert header.get("run_id") is not None, header


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["--pp", "\uff12"], "is not a whole number"),
        (["--pp", "1_0"], "is not a whole number"),
        (["--steps", "\u0663"], "is not a whole number"),
        (["--capture-sizes", "1,\uff12"], "is not a list of whole numbers"),
    ],
    ids=["full-width digit", "underscore", "arabic-indic digit", "a capture size"],
)
def test_number_options_take_ascii_decimal_digits_only(
    capsys: pytest.CaptureFixture[str], args: list[str], problem: str
) -> None:
    """`--pp \\uff12` (a full-width 2) ran as pp=2, and `--pp 1_0` as 10: Python's int()
    reads other scripts' digits and underscores, which nobody means on a command line.
    Such a value is refused (exit 2, one line), as any other non-number is."""
    assert main(["run", *args]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("purepp run: --"), line
    assert problem in line, line
