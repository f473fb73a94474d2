"""`purepp run` and `purepp check` as a user runs them: options refused before any
process starts, one-line errors on stderr, documented exit codes.

The refusals run in this process through `main(argv)`: they must not start a rank
nor import torch, so they stay fast. Whole runs live in tests/test_run_*.py.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from purepp.runner import supervise
from purepp.runner.cli import launch, main
from purepp.runner.exit_codes import Exit, interrupted
from purepp.runner.options import CLI, LAUNCH, Spelling, UsageError, check_log_dir
from purepp.runner.settings import RunSettings
from purepp.runner.summary import RunSummary, summarise
from purepp.runner.supervise import LOCK_FILE
from tests.test_run_parts import rank_result

GOLDEN = Path(__file__).parent / "data" / "golden" / "pp2_spec2"


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run `purepp ARGV`, expect a usage refusal, and return its one stderr line."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == Exit.USAGE, (out, err)
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Fix:" in lines[0]
    prefix = lines[0].split(": ", 1)[0]
    assert not lines[0].startswith(f"{prefix}: {prefix}"), lines[0]  # no doubled prefix
    return lines[0]


@pytest.mark.parametrize(
    ("args", "shown", "problem"),
    [
        (["--pp", "0"], "--pp 0", "is below 1"),
        (["--pp", "-1"], "--pp -1", "is below 1"),
        (["--pp", "9"], "--pp 9", "is above 8"),
        (["--pp", "two"], "--pp two", "is not a whole number"),
        (["--dp", "0"], "--dp 0", "is below 1"),
        (["--dp", "1.5"], "--dp 1.5", "is not a whole number"),
        (["--spec", "8"], "--spec 8", "is above 7"),
        (["--spec", "-1"], "--spec -1", "is below 0"),
        (["--seed", "-3"], "--seed -3", "is below 0"),
        (["--seed", "0.5"], "--seed 0.5", "is not a whole number"),
        (["--steps", "-1"], "--steps -1", "is below 0"),
        (["--requests", "0"], "--requests 0", "is below 1"),
        (["--backend", "mpi"], "--backend mpi", "is not a backend"),
        (["--interpreter", "jit"], "--interpreter jit", "is not an interpreter mode"),
        (["--interpreter", "captured"], "--interpreter captured", "needs --backend nccl"),
        (["--timeout", "inf"], "--timeout inf", "is not finite"),
        (["--timeout", "nan"], "--timeout nan", "is not finite"),
        (["--timeout", "0"], "--timeout 0", "is not above 0"),
        (["--timeout", "-5"], "--timeout -5", "is not above 0"),
        (["--timeout", "1e300"], "--timeout 1e300", "is above 86400"),
        (["--timeout", "soon"], "--timeout soon", "is not a number"),
        (["--log-dir", ""], "--log-dir ''", "is empty"),
        (["--trace", ""], "--trace ''", "is empty"),
        (["--trace", "   "], "--trace '   '", "is empty"),
    ],
)
def test_bad_options_are_one_line_naming_option_value_problem_and_fix(
    capsys: pytest.CaptureFixture[str], args: list[str], shown: str, problem: str
) -> None:
    line = _refused(capsys, "run", *args)
    assert line.startswith(f"purepp run: {shown} {problem}"), line


def test_trace_that_is_a_folder_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    line = _refused(capsys, "run", "--trace", str(tmp_path))
    assert "is a folder, but a trace is one file" in line
    line = _refused(capsys, "run", "--trace", f"{tmp_path / 'new'}{os.sep}")
    assert "is a folder" in line


def test_log_dir_that_is_a_file_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    line = _refused(capsys, "run", "--log-dir", str(blocker))
    assert f"--log-dir {blocker} cannot be written: {blocker} is a file" in line
    line = _refused(capsys, "run", "--log-dir", str(blocker / "logs"))
    assert f"{blocker} is a file, not a folder" in line
    line = _refused(capsys, "run", "--trace", str(blocker / "trace.json"))
    assert f"--trace {blocker / 'trace.json'} cannot be written" in line
    assert blocker.read_text() == "not a folder"


def test_a_log_dir_is_used_or_made_and_a_trace_on_a_pipe_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert check_log_dir(str(tmp_path)) == tmp_path  # a folder that is there already
    nested = tmp_path / "runs" / "today"
    assert check_log_dir(str(nested)) == nested
    assert nested.is_dir()  # made, with the folder above it
    # A pipe, not a device: were the check ever lost, the run would replace it, and
    # a root run replacing /dev/null would break the machine.
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    line = _refused(capsys, "run", "--trace", str(fifo))
    assert f"--trace {fifo} is not a regular file" in line


def test_unwritable_places_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # /proc refuses new entries even to root, so this holds whoever runs the tests.
    line = _refused(capsys, "run", "--log-dir", "/proc/purepp-logs")
    assert "--log-dir /proc/purepp-logs is not writable" in line
    line = _refused(capsys, "run", "--trace", "/proc/purepp-trace.json")
    assert "--trace /proc/purepp-trace.json is not writable" in line


def test_a_log_dir_in_use_by_another_run_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank-0000.jsonl").write_text("the other run's log\n")
    with (logs / LOCK_FILE).open("w") as held:
        held.write("4242 otherrun\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX)  # as a running `purepp run` holds it
        line = _refused(capsys, "run", "--log-dir", str(logs))
    assert f"--log-dir {logs} is in use by another purepp run (pid 4242)" in line
    assert (logs / "rank-0000.jsonl").read_text() == "the other run's log\n"  # untouched


def test_argparse_mistakes_are_one_line_too(capsys: pytest.CaptureFixture[str]) -> None:
    assert "unrecognized arguments: --bogus" in _refused(capsys, "run", "--bogus")
    assert "--pp: expected one argument" in _refused(capsys, "run", "--pp")
    assert "purepp:" in _refused(capsys)  # no command


def test_check_refuses_a_missing_folder_on_stderr(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    line = _refused(capsys, "check", str(tmp_path / "missing"))
    assert line.startswith("purepp check: ")
    assert "does not exist" in line
    (tmp_path / "file").write_text("")
    assert "is not a folder" in _refused(capsys, "check", str(tmp_path / "file"))
    assert "is empty" in _refused(capsys, "check", "")


def test_check_unreadable_logs_go_to_stderr(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "rank-0000.jsonl").write_text("this is not a log\n")
    code = main(["check", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == Exit.USAGE
    assert out == ""
    assert err.startswith("purepp check: ")


def test_check_of_a_log_whose_header_was_cut_is_a_finding_on_stdout(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # The rank died writing its first line: the others are checked, exit 1, not 2.
    for path in GOLDEN.glob("*.jsonl"):
        (tmp_path / path.name).write_bytes(path.read_bytes())
    cut = tmp_path / "rank-0001.jsonl"
    cut.write_bytes(cut.read_bytes()[:25])
    code = main(["check", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == Exit.FAILED, out + err
    assert out.startswith(
        "Log missing: rank 1 of a world of 2 (pp=2, dp=1) has no log: rank-0001.jsonl holds"
        " only a cut header (25 bytes of its first line: the rank died while writing it)"
    )
    assert err == ""


def test_check_reads_a_golden_log(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check", str(GOLDEN)])
    out, err = capsys.readouterr()
    assert code == Exit.OK, out + err
    assert out.startswith("ok")
    assert err == ""


def test_launch_takes_its_paths_as_a_path_too(tmp_path: Path) -> None:
    # launch(log_dir=Path) crashed with AttributeError ('PosixPath' has no strip) where
    # every log API takes a Path; a file in the way shows the Path was read and checked.
    (tmp_path / "file").write_text("")
    settings = RunSettings(pp=1, dp=1)
    with pytest.raises(UsageError, match=r"^launch: log_dir='.*' cannot be written: .*is a file"):
        launch(settings, log_dir=tmp_path / "file" / "logs", progress=False)
    with pytest.raises(UsageError, match=r"^launch: trace='.*' is a folder"):
        launch(settings, trace=tmp_path, progress=False)
    with pytest.raises(UsageError, match="launch: log_dir=3 is not a path"):
        launch(settings, log_dir=3, progress=False)  # type: ignore[arg-type]


def test_launch_names_its_own_arguments_where_purepp_run_names_its_flags(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # A research runner calls launch from Python: "--log-dir" would name a flag it never
    # typed. The same refusals through `purepp run` keep naming the flags.
    logs = tmp_path / "logs"
    logs.mkdir()
    with (logs / LOCK_FILE).open("w") as held:
        held.write("4242 otherrun\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(UsageError) as refused:
            launch(RunSettings(pp=1, dp=1), log_dir=logs, progress=False)
        line = _refused(capsys, "run", "--log-dir", str(logs))
    assert str(refused.value) == (
        f"launch: log_dir='{logs}' is in use by another purepp run (pid 4242). "
        "Fix: wait for it to finish, or pass another log_dir"
    )
    assert f"purepp run: --log-dir {logs} is in use by another purepp run (pid 4242)" in line
    assert line.endswith("Fix: wait for it to finish, or pass another --log-dir")
    with pytest.raises(UsageError, match=r"^launch: trace='' is empty\. Fix: .*trace='trace.json'"):
        launch(RunSettings(pp=1, dp=1), trace="", progress=False)
    line = _refused(capsys, "run", "--trace", "")
    assert (
        "purepp run: --trace '' is empty. Fix: name a file you can write to, e.g. --trace" in line
    )


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        ({"settings": {"pp": 1}}, "launch: settings is a dict. Fix: pass a RunSettings"),
        ({"progress": "yes"}, "launch: progress='yes' is not a bool"),
        ({"run_id": 5}, "launch: run_id=5 is not a run id"),
        ({"run_id": ""}, "launch: run_id='' is not a run id"),
    ],
)
def test_launch_refuses_arguments_of_the_wrong_kind_before_starting_anything(
    arguments: dict[str, Any], said: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A research runner calls launch untyped: refused here, not by every rank process.
    started: list[object] = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))
    given: dict[str, Any] = {"settings": RunSettings(pp=1, dp=1), "progress": False}
    given.update(arguments)
    settings = given.pop("settings")
    with pytest.raises(UsageError, match=f"^{re.escape(said)}"):
        launch(settings, **given)
    assert started == []


def test_a_log_folder_file_named_as_a_rank_log_that_is_no_log_is_refused_and_kept(
    tmp_path: Path,
) -> None:
    # The run empties its folder of rank logs; a file of that name holding something
    # else would be lost. It is refused before anything starts, as dump_logs refuses it.
    notes = tmp_path / "rank-0000.jsonl"
    notes.write_text("my notes\n")
    with pytest.raises(UsageError, match=r"^launch: .*rank-0000.jsonl is not a purepp log"):
        launch(RunSettings(pp=1, dp=1), log_dir=tmp_path, progress=False)
    assert notes.read_text() == "my notes\n"


# -- a run's end, the launcher's part given ---------------------------------------------
# These replace the supervisor's launch (the processes) with its result: the summary of
# ranks that produced `produced` against a reference that produced `expected`.


def _launched(
    monkeypatch: pytest.MonkeyPatch,
    produced: dict[int, list[int]],
    expected: dict[int, list[int]],
) -> list[dict[str, object]]:
    calls: list[dict[str, object]] = []

    def launch(
        settings: RunSettings,
        *,
        log_dir: str | None = None,
        trace: str | None = None,
        run_id: str | None = None,
        progress: bool = True,
        spelling: Spelling = LAUNCH,
    ) -> RunSummary:
        calls.append(
            dict(log_dir=log_dir, trace=trace, run_id=run_id, progress=progress, spelling=spelling)
        )
        return summarise(settings, [rank_result(0, produced)], [rank_result(0, expected)])

    monkeypatch.setattr(supervise, "launch", launch)
    return calls


def test_a_run_prints_its_summary_its_id_and_where_its_logs_and_trace_are(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls = _launched(monkeypatch, {3: [5, 6]}, {3: [5, 6]})
    logs, trace = tmp_path / "logs", tmp_path / "trace.json"
    code = main(["run", "--pp", "1", "--dp", "1", "--log-dir", str(logs), "--trace", str(trace)])
    out, err = capsys.readouterr()
    assert code == Exit.OK, err
    [call] = calls
    run_id = call.pop("run_id")
    # Drawn, for a user; its refusals name the flags.
    assert call == dict(log_dir=str(logs), trace=str(trace), progress=True, spelling=CLI)
    assert out.startswith("purepp run: pp=1 x dp=1 on gloo")
    assert "parity           OK: " in out
    assert f"  run id           {run_id}\n" in out
    assert f"  effect logs      {logs} (check them with: purepp check {logs})\n" in out
    assert f"  trace            {trace} (open it in the Perfetto UI)\n" in out


def test_a_run_without_logs_or_trace_names_neither_and_a_mismatch_exits_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _launched(monkeypatch, {3: [5, 6]}, {3: [5, 7]})
    code = main(["run", "--pp", "1", "--dp", "1"])
    out, _ = capsys.readouterr()
    assert code == Exit.FAILED
    assert "parity           MISMATCH" in out
    assert "effect logs" not in out
    assert "  trace " not in out


def test_ctrl_c_before_the_run_took_its_signals_exits_130(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted_launch(settings: RunSettings, **_: object) -> RunSummary:
        raise KeyboardInterrupt

    monkeypatch.setattr(supervise, "launch", interrupted_launch)
    code = main(["run"])
    out, err = capsys.readouterr()
    assert code == interrupted(signal.SIGINT) == 130
    assert out == ""
    assert err == "\npurepp run: interrupted; nothing was left running\n"


def test_exit_codes_are_distinct() -> None:
    codes = [*map(int, Exit), *(interrupted(s) for s in (2, 1, 15))]
    assert codes == [0, 1, 2, 3, 130, 129, 143]


def test_the_cli_imports_no_torch_for_help_check_or_a_refusal() -> None:
    probe = (
        "import sys\n"
        "from purepp.runner.cli import main\n"
        f"assert main(['check', {str(GOLDEN)!r}]) == 0\n"
        "assert main(['run', '--seed', '-3']) == 2\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr


def test_nccl_without_cuda_is_refused_before_start(capsys: pytest.CaptureFixture[str]) -> None:
    # Asked when the test runs: at collection torch may not be imported yet, and a
    # skip decided then ran this on the H200 host, where it cannot hold.
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    line = _refused(capsys, "run", "--backend", "nccl")
    assert "--backend nccl needs CUDA" in line
    assert line.endswith("Fix: use --backend gloo")
    with pytest.raises(UsageError) as refused:
        launch(RunSettings(backend="nccl"), progress=False)
    assert str(refused.value) == (
        "launch: backend='nccl' needs CUDA, and none is available. Fix: use backend='gloo'"
    )


def test_version_prints_the_installed_version_and_exits_0(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("purepp")
    except PackageNotFoundError:  # a checkout on the path, as on the GPU host
        installed = "(not installed)"
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"purepp {installed}\n"


def test_launch_takes_numpy_capture_sizes_and_names_a_bad_one_as_its_keyword() -> None:
    import numpy as np

    from purepp.runner.options import _capture_sizes

    assert _capture_sizes(LAUNCH, (np.int64(1), 2, np.int32(4))) == (1, 2, 4)
    with pytest.raises(UsageError, match=r"^launch: capture_sizes=\(True, 2\) is not strictly"):
        _capture_sizes(LAUNCH, (True, 2))
