"""A review of `purepp run` and `purepp check` as a demanding user drives them from a
shell: documented bounds and exit codes, bad paths, the logs and trace a run writes
against what its summary and `purepp check` say, a dead rank, repeated Ctrl-C.

Refusals run in this process through `main(argv)`; whole runs in subprocesses
(`python -m purepp.runner.cli`), each under a private TMPDIR.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from purepp.runner import supervise
from purepp.runner.cli import main
from purepp.runner.exit_codes import Exit, interrupted
from purepp.runner.settings import RunSettings
from purepp.runner.summary import RunSummary, summarise
from tests.test_run_parts import rank_result

PUREPP = [sys.executable, "-m", "purepp.runner.cli"]
# NAME_MAX on Linux file systems: a name this long is valid, one byte more is not.
NAME_MAX = 255


def _refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run `purepp ARGV` here, expect a usage refusal (exit 2, nothing on stdout), and
    return its one line on stderr."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == Exit.USAGE, (code, out, err)
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Fix:" in lines[0], lines[0]
    return lines[0]


def _purepp(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`purepp ARGS` in a subprocess, its temporary folders under tmp_path/tmp."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    env = dict(os.environ, TMPDIR=str(tmp))
    return subprocess.run(
        [*PUREPP, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
        stdin=subprocess.DEVNULL,
    )


def _reports(err: str) -> list[str]:
    """The launcher's own lines on stderr (progress lines aside)."""
    return [line for line in err.splitlines() if line.startswith("purepp run:")]


def _records(log: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in log.read_text().splitlines()[1:]]


def _effect(record: dict[str, object]) -> dict[str, object]:
    effect = record["effect"]
    assert isinstance(effect, dict)
    return effect


# -- options refused before anything starts -----------------------------------------------


def test_a_bad_capture_sizes_refusal_names_the_flag_as_typed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = _refusal(capsys, "run", "--capture-sizes", "4,2")
    assert line.startswith("purepp run: --capture-sizes 4,2 "), line


def test_a_token_budget_below_a_decode_row_names_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = _refusal(capsys, "run", "--max-num-batched-tokens", "2", "--spec", "2")
    assert line.startswith("purepp run: --max-num-batched-tokens 2 "), line


def test_a_bad_capture_size_list_and_pp_above_layers_are_usage_errors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = _refusal(capsys, "run", "--capture-sizes", "1,,2")
    assert line.startswith("purepp run: --capture-sizes 1,,2 is not a list of whole numbers")
    line = _refusal(capsys, "run", "--num-layers", "3", "--pp", "4")
    assert line.startswith("purepp run: --pp 4 is above 3"), line
    line = _refusal(capsys, "run", "--steps", " ")
    assert line.startswith("purepp run: --steps ' ' is not a whole number"), line


def test_a_log_dir_name_too_long_is_a_one_line_refusal(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    folder = tmp_path / ("d" * (NAME_MAX + 1))
    line = _refusal(capsys, "run", "--log-dir", str(folder))
    assert line.startswith(f"purepp run: --log-dir {folder} "), line


def test_a_trace_name_too_long_is_a_one_line_refusal(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    trace = tmp_path / ("t" * (NAME_MAX + 1))
    line = _refusal(capsys, "run", "--trace", str(trace))
    assert line.startswith(f"purepp run: --trace {trace} "), line


def test_check_of_a_name_too_long_is_a_one_line_refusal(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = main(["check", str(tmp_path / ("c" * (NAME_MAX + 1)))])
    out, err = capsys.readouterr()
    assert code == Exit.USAGE, (code, out, err)
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err


def test_check_refuses_a_file_an_empty_folder_and_no_folder_on_stderr(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    afile = tmp_path / "rank-0000.jsonl"
    afile.write_text("{}\n")
    assert "is not a folder" in _refusal(capsys, "check", str(afile))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "holds no *.jsonl logs" in _refusal(capsys, "check", str(empty))
    assert "does not exist" in _refusal(capsys, "check", str(tmp_path / "nowhere"))


def test_the_summarys_check_command_works_for_a_log_dir_with_a_space(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def launch(settings: RunSettings, **_: object) -> RunSummary:
        return summarise(settings, [rank_result(0, {3: [5, 6]})], [rank_result(0, {3: [5, 6]})])

    monkeypatch.setattr(supervise, "launch", launch)
    logs = tmp_path / "my logs"
    code = main(["run", "--pp", "1", "--dp", "1", "--log-dir", str(logs)])
    out, _ = capsys.readouterr()
    assert code == Exit.OK
    [suggested] = re.findall(r"check them with: (.*)\)$", out, flags=re.MULTILINE)
    assert suggested == f"purepp check '{logs}'", suggested


# -- whole runs -----------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_a_trace_at_the_log_dir_itself_is_refused_before_any_rank_starts(
    tmp_path: Path,
) -> None:
    same = tmp_path / "out"
    done = _purepp(
        tmp_path, "run", "--pp", "1", "--dp", "2", "--steps", "2", "--requests", "2",
        "--log-dir", str(same), "--trace", str(same),
    )  # fmt: skip
    assert done.returncode == Exit.USAGE, done.stderr
    [report] = _reports(done.stderr)
    assert "--trace" in report, done.stderr


@pytest.mark.multiprocess
def test_a_trace_with_a_long_valid_name_is_written_or_refused_up_front(tmp_path: Path) -> None:
    trace = tmp_path / ("t" * (NAME_MAX - 5) + ".json")  # NAME_MAX bytes exactly
    assert len(trace.name) == NAME_MAX
    trace.write_text("{}")  # a valid name: the file system takes it
    trace.unlink()
    done = _purepp(
        tmp_path, "run", "--pp", "1", "--dp", "1", "--steps", "3", "--requests", "1",
        "--trace", str(trace),
    )  # fmt: skip
    assert done.returncode in (Exit.OK, Exit.USAGE), done.stderr
    if done.returncode == Exit.OK:
        assert "traceEvents" in json.loads(trace.read_text())


@pytest.fixture(scope="module")
def dp2_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One pp=2 x dp=2 run with --overlap-agreement, --wire packed and --interpreter
    plan, with its logs and trace: (its folder, its stdout)."""
    base = tmp_path_factory.mktemp("dp2")
    done = _purepp(
        base, "run", "--pp", "2", "--dp", "2", "--steps", "9", "--requests", "6",
        "--overlap-agreement", "--wire", "packed", "--interpreter", "plan",
        "--validate-header", "--log-dir", str(base / "logs"), "--trace",
        str(base / "trace.json"),
    )  # fmt: skip
    assert done.returncode in (Exit.OK, Exit.FAILED), done.stderr
    assert list((base / "tmp").iterdir()) == []  # the run's temporary folder is gone
    return base, done.stdout


@pytest.mark.multiprocess
def test_the_logs_headers_carry_every_option_and_the_printed_run_id(
    dp2_run: tuple[Path, str],
) -> None:
    base, out = dp2_run
    [run_id] = re.findall(r"^  run id +(\S+)$", out, flags=re.MULTILINE)
    logs = sorted((base / "logs").glob("*.jsonl"))
    assert [log.name for log in logs] == [f"rank-{r:04d}.jsonl" for r in range(4)]
    for rank, log in enumerate(logs):
        header = json.loads(log.read_text().splitlines()[0])
        assert header["rank"] == rank
        assert header["run_id"] == run_id
        assert header["world"] == {"pp": 2, "dp": 2}
        config = header["config"]
        assert config["overlap_agreement"] is True
        assert config["wire"] == "packed"
        assert config["interpreter"] == "plan"
        assert config["validate_header"] is True
        assert (config["steps"], config["requests"]) == (9, 6)
    assert "interpreter      plan: " in out
    assert ", relay header validated" in out.splitlines()[0]


@pytest.mark.multiprocess
def test_check_of_the_runs_logs_is_ok_with_one_agreement_per_step(
    dp2_run: tuple[Path, str],
) -> None:
    base, _ = dp2_run
    logs = base / "logs"
    collectives = sum(
        _effect(record)["kind"] in ("broadcast", "all_reduce")
        for log in logs.glob("*.jsonl")
        for record in _records(log)
    )
    steps = max(
        int(str(_effect(record)["step"]))
        for log in logs.glob("*.jsonl")
        for record in _records(log)
    )
    done = _purepp(base, "check", str(logs))
    assert done.returncode == Exit.OK, (done.stdout, done.stderr)
    assert done.stderr == ""
    assert done.stdout == (
        f"ok: 4 ranks, {collectives} collectives over {steps + 1} steps, every communicator "
        f"matches, every rank decided its {steps + 1} agreements alike\n"
    )
    assert steps + 1 == 9  # every step of --steps 9 agreed once


@pytest.mark.multiprocess
def test_the_trace_holds_every_logged_effect_of_every_rank_in_order(
    dp2_run: tuple[Path, str],
) -> None:
    base, _ = dp2_run
    events = json.loads((base / "trace.json").read_text())["traceEvents"]
    names = Counter((event["pid"], event["args"]["name"]) for event in events if event["ph"] == "M")
    for rank in range(4):
        assert names[(rank, f"rank {rank}")] == 1
        logged = [
            (_effect(record)["kind"], _effect(record)["step"], record["comm_seq"])
            for record in _records(base / "logs" / f"rank-{rank:04d}.jsonl")
        ]
        traced = [
            (
                re.sub(r"(?<!^)(?=[A-Z])", "_", event["name"]).lower(),
                event["args"]["step"],
                event["args"].get("comm_seq"),
            )
            for event in events
            if event["ph"] == "X" and event["pid"] == rank
        ]
        assert traced == logged, rank


@pytest.mark.multiprocess
def test_check_of_the_runs_logs_with_a_rank_deleted_cut_or_mixed(
    dp2_run: tuple[Path, str], tmp_path: Path
) -> None:
    base, _ = dp2_run
    missing = tmp_path / "missing"
    shutil.copytree(base / "logs", missing)
    (missing / "rank-0002.jsonl").unlink()
    done = _purepp(tmp_path, "check", str(missing))
    assert done.returncode == Exit.FAILED, done.stderr
    assert done.stdout.startswith("Log missing: rank 2 of a world of 4 (pp=2, dp=2)")
    assert "rank-0002.jsonl is absent" in done.stdout

    cut = tmp_path / "cut"
    shutil.copytree(base / "logs", cut)
    lines = (cut / "rank-0003.jsonl").read_bytes().split(b"\n")
    (cut / "rank-0003.jsonl").write_bytes(b"\n".join(lines[:6]) + b"\n" + lines[6][:15])
    done = _purepp(tmp_path, "check", str(cut))
    assert done.returncode == Exit.FAILED, done.stderr
    assert done.stdout.startswith(
        "Log cut: rank 3's log ends mid-record at rank-0003.jsonl line 7 (the rank died while "
        "writing), after 5 records"
    ), done.stdout
    assert "What every rank was waiting on:" in done.stdout

    mixed = tmp_path / "mixed"
    shutil.copytree(base / "logs", mixed)
    header = json.loads((mixed / "rank-0001.jsonl").read_text().splitlines()[0])
    other = dict(header, run_id="another-run")
    rest = (mixed / "rank-0001.jsonl").read_text().split("\n", 1)[1]
    (mixed / "rank-0001.jsonl").write_text(json.dumps(other) + "\n" + rest)
    done = _purepp(tmp_path, "check", str(mixed))
    assert done.returncode == Exit.USAGE, done.stdout
    assert done.stdout == ""
    assert "another-run" in done.stderr


@pytest.mark.multiprocess
def test_steps_0_runs_every_request_to_its_end_or_its_abort(tmp_path: Path) -> None:
    done = _purepp(tmp_path, "run", "--pp", "2", "--dp", "2", "--steps", "0", "--requests", "6")
    assert done.returncode == Exit.OK, done.stderr
    [aborted] = re.findall(r"^  requests +6 \((\d+) aborted in flight\)$", done.stdout, re.M)
    [(tokens, compared, exact, prefixes)] = re.findall(
        r"^  tokens +(\d+) in .*\n(?:.*\n)*?  parity +OK: (\d+) tokens? compared; (\d+) "
        r"requests? finished in both runs .*; (\d+) aborted",
        done.stdout,
        re.M,
    )
    # Every request ended: finished in both runs, or aborted (a prefix of the reference).
    assert int(exact) + int(aborted) == 6, done.stdout
    assert int(prefixes) == int(aborted), done.stdout
    assert int(tokens) == int(compared), done.stdout


def _children(pid: int) -> dict[str, int]:
    """The rank processes `pid` started, by RANK ('reference' for the reference)."""
    found: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != pid:
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if b"purepp.runner.worker" not in argv:
            continue
        rank = next(v[5:].decode() for v in environ if v.startswith(b"RANK="))
        found["reference" if b"--reference" in argv else rank] = int(entry.name)
    return found


@pytest.mark.multiprocess
def test_a_rank_killed_from_outside_is_named_within_the_timeout(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    args = ["run", "--pp", "2", "--dp", "1", "--steps", "100000", "--timeout", "5"]
    launcher = subprocess.Popen(
        [*PUREPP, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=dict(os.environ, TMPDIR=str(tmp)),
    )
    try:
        deadline = time.monotonic() + 60
        while len(ranks := _children(launcher.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert set(ranks) == {"0", "1", "reference"}
        time.sleep(4)  # into the loop
        os.kill(ranks["1"], signal.SIGKILL)
        killed_at = time.monotonic()
        _, err = launcher.communicate(timeout=60)
        took = time.monotonic() - killed_at
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == Exit.RANK_FAILED, err
    assert _reports(err) == ["purepp run: rank 1 was killed by SIGKILL"], err
    assert took < 5 + 5, took
    assert list(tmp.iterdir()) == []


@pytest.mark.multiprocess
def test_ctrl_c_pressed_repeatedly_still_exits_130(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    launcher = subprocess.Popen(
        [*PUREPP, "run", "--pp", "1", "--dp", "2", "--steps", "100000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=dict(os.environ, TMPDIR=str(tmp)),
    )
    try:
        deadline = time.monotonic() + 60
        while len(_children(launcher.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        while launcher.poll() is None:  # a user holding Ctrl-C down
            launcher.send_signal(signal.SIGINT)
            time.sleep(0.01)
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert "interrupted by SIGINT" in err
    assert launcher.returncode == interrupted(signal.SIGINT) == 130, err
