"""`purepp check` over what runs and crashes leave: the checker's findings and exit codes.

Logs here are written effect by effect (no relay), so each test shows one reading:
a matched run, a mismatch with its class and culprit, a cross-communicator order
deadlock with its wait-for cycle, a log cut mid-record, logs of other runs mixed in.
"""

from __future__ import annotations

import fcntl
import io
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from purepp.effects.checker import (
    EXIT_FINDING,
    EXIT_OK,
    EXIT_UNUSABLE,
    CheckReport,
    check_log_dir,
    check_logs,
)
from purepp.effects.log import EffectLog, LogHeader, dump_logs, load_log, log_file_name
from purepp.effects.logfile import LOCK_FILE, read_cut_header
from purepp.effects.logmodel import config_digest
from purepp.effects.matching import (
    DeadlockReport,
    MismatchClass,
    MismatchReport,
    match_collectives,
)
from purepp.effects.vocabulary import (
    Allocate,
    AllReduce,
    Broadcast,
    BufferRef,
    Communicator,
    DType,
    Effect,
    Op,
    Release,
    Stream,
    Synchronize,
)
from purepp.errors import InvalidInputError, LogFormatError
from purepp.layout import Layout
from purepp.testing import ScheduleConfig, make_schedule, record_scripted_logs
from tests.test_simulator import waits_for_a_work, waits_through_an_event

PAIR = Layout(pp=2, dp=1)  # a two-stage pipeline: ranks 0 and 1 share pp_relay
REPLICAS = Layout(pp=1, dp=2)  # two DP replicas: ranks 0 and 1 share dp_cpu and dp_drafter_cpu
CONFIG = {"model": "toy", "seed": 3}


def relay(
    step: int,
    *,
    src: int = 1,
    shape: tuple[int, ...] = (4, 2),
    dtype: DType = DType.INT64,
    op: Op = Op.RECEIVE,
) -> tuple[Effect, ...]:
    """A relay step's receive (or send): allocate the wire buffer, broadcast it, release it."""
    buffer = BufferRef(f"tokens.{step}")
    return (
        Allocate(step=step, op=op, buffer=buffer, shape=shape, dtype=dtype, stream=Stream.RELAY),
        Broadcast(
            step=step,
            op=op,
            buffer=buffer,
            shape=shape,
            dtype=dtype,
            src=src,
            comm=Communicator.PP_RELAY,
            stream=Stream.RELAY,
        ),
        Release(step=step, op=Op.END_STEP, buffer=buffer),
    )


def agree(step: int, comm: Communicator, column: int) -> AllReduce:
    table = np.zeros((5, 2), dtype=np.int32)
    table[0, column] = 3
    return AllReduce(
        step=step,
        op=Op.AGREE,
        contribution=table,
        result=BufferRef(f"{comm.value}.{step}"),
        comm=comm,
        work=None,
    )


def write(
    directory: Path,
    world: Layout,
    per_rank: Sequence[Sequence[Effect]],
    *,
    run_id: str | None = "run-1",
    config: dict[str, object] | None = None,
) -> Path:
    config = CONFIG if config is None else config
    logs = [
        EffectLog.from_effects(
            LogHeader(
                rank=rank,
                world=world,
                config=config,
                run_id=run_id,
                config_digest=None if run_id is None else config_digest(config),
            ),
            effects,
        )
        for rank, effects in enumerate(per_rank)
    ]
    dump_logs(logs, directory)
    return directory


def matched_pair(steps: int = 3) -> list[list[Effect]]:
    """Stage 1 sends every step's tokens, stage 0 receives them."""
    return [
        [e for step in range(steps) for e in relay(step, op=Op.RECEIVE)],
        [e for step in range(steps) for e in relay(step, op=Op.BROADCAST)],
    ]


def finding(report: CheckReport) -> MismatchReport | DeadlockReport:
    assert (report.ok, report.exit_code) == (False, EXIT_FINDING), report.text
    assert isinstance(report.finding, MismatchReport | DeadlockReport), report.text
    return report.finding


# ---- a matched run ----------------------------------------------------------------------


def test_matched_logs_are_ok_in_one_line(tmp_path: Path) -> None:
    report = check_logs(write(tmp_path, PAIR, matched_pair(steps=3)))
    assert (report.ok, report.exit_code, report.finding) == (True, EXIT_OK, None)
    assert report.text == "ok: 2 ranks, 6 collectives over 3 steps, every communicator matches"
    assert (report.ranks, report.records, report.collectives, report.steps) == (2, 18, 6, 3)


def test_a_lone_rank_of_one_step_is_counted_in_the_singular(tmp_path: Path) -> None:
    lone = Layout(pp=1, dp=1)
    report = check_logs(write(tmp_path, lone, [list(relay(0, src=0, op=Op.BROADCAST))]))
    assert report.text == "ok: 1 rank, 1 collective over 1 step, every communicator matches"


def overlapped_agreements(rank: int, steps: int) -> list[Effect]:
    """Each step's agreement started inside the step before (`purepp run --overlap-agreement`)."""
    effects: list[Effect] = [agree(0, Communicator.DP_CPU, rank)]
    for step in range(steps):
        effects.append(Release(step=step, op=Op.END_STEP, buffer=BufferRef(f"dp_cpu.{step}")))
        if step + 1 < steps:
            effects.append(agree(step + 1, Communicator.DP_CPU, rank))
        effects.append(Release(step=step, op=Op.END_STEP, buffer=BufferRef(f"out.{step}")))
    return effects


def test_steps_are_counted_once_when_the_next_steps_agreement_starts_inside_a_step(
    tmp_path: Path,
) -> None:
    per_rank = [overlapped_agreements(rank, steps=3) for rank in range(2)]
    # Step numbers go back and forth (0, 0, 1, 0, 1, 2, 1, 2, 2): still three steps.
    assert [e.step for e in per_rank[0]] == [0, 0, 1, 0, 1, 2, 1, 2, 2]
    report = check_logs(write(tmp_path, REPLICAS, per_rank))
    assert report.text == "ok: 2 ranks, 6 collectives over 3 steps, every communicator matches"
    assert report.steps == 3


def test_check_log_dir_prints_the_report_and_returns_its_exit_code(tmp_path: Path) -> None:
    out = io.StringIO()
    assert check_log_dir(write(tmp_path, PAIR, matched_pair()), out) == EXIT_OK
    assert out.getvalue().startswith("ok: 2 ranks, ")


def test_header_only_logs_are_nothing_recorded_not_ok(tmp_path: Path) -> None:
    report = check_logs(write(tmp_path, PAIR, [[], []]))
    assert (report.ok, report.exit_code) == (False, EXIT_FINDING)
    assert report.text.startswith(
        "nothing recorded: the logs of 2 ranks hold a header and no effect"
    )
    # A run whose steps all issued nothing (purepp run --pp 2 --dp 1 --steps 4: prefill
    # chunks only) is told to record more steps, not that it never ran.
    assert "its steps had nothing to relay or agree" in report.text
    assert report.text.endswith("raise --steps, or pass --steps 0 to run every request to the end)")


def test_logs_a_run_is_still_writing_are_checked_with_a_note_saying_so(tmp_path: Path) -> None:
    # The logs of a live run end where each rank is now, which reads as a cut or a hang.
    folder = write(tmp_path, PAIR, matched_pair())
    (folder / LOCK_FILE).write_text("4242 run-1\n")  # a finished run leaves its lock file
    assert check_logs(folder).text.startswith("ok: 2 ranks, ")
    assert "still writing" not in check_logs(folder).text
    with (folder / LOCK_FILE).open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as a running `purepp run` holds it
        report = check_logs(folder)
    assert (report.ok, report.exit_code) == (True, EXIT_OK)
    assert report.text.splitlines()[1] == (
        "note: a purepp run (pid and run id: 4242 run-1) is still writing these logs: this is "
        "the check of the logs so far; check them again when it ends"
    )
    assert "still writing" not in check_logs(folder).text


# ---- logs that are not one run's ---------------------------------------------------------


def test_logs_of_two_runs_are_rejected_naming_both_files(tmp_path: Path) -> None:
    write(tmp_path, PAIR, matched_pair(), run_id="run-a")
    other = write(tmp_path / "other", PAIR, matched_pair(), run_id="run-b")
    (other / log_file_name(1)).replace(tmp_path / log_file_name(1))

    report = check_logs(tmp_path)
    assert (report.ok, report.exit_code) == (False, EXIT_UNUSABLE)
    assert "rank-0000.jsonl and rank-0001.jsonl are of different runs" in report.text
    assert "'run-a'" in report.text
    assert "'run-b'" in report.text


def test_logs_of_two_configs_are_rejected_naming_both_files(tmp_path: Path) -> None:
    write(tmp_path, PAIR, matched_pair())
    other = write(tmp_path / "other", PAIR, matched_pair(), config={"model": "toy", "seed": 4})
    (other / log_file_name(1)).replace(tmp_path / log_file_name(1))

    report = check_logs(tmp_path)
    assert report.exit_code == EXIT_UNUSABLE
    assert "rank-0000.jsonl and rank-0001.jsonl differ in config_digest" in report.text


def test_logs_without_run_ids_are_still_compared_by_config(tmp_path: Path) -> None:
    # Logs written before run ids (the golden logs) still load; a changed config shows.
    write(tmp_path, PAIR, matched_pair(), run_id=None)
    assert check_logs(tmp_path).ok
    other = write(tmp_path / "other", PAIR, matched_pair(), run_id=None, config={"seed": 9})
    (other / log_file_name(0)).replace(tmp_path / log_file_name(0))

    report = check_logs(tmp_path)
    assert report.exit_code == EXIT_UNUSABLE
    assert "rank-0000.jsonl and rank-0001.jsonl have different configs" in report.text


def test_a_config_edited_after_the_run_no_longer_matches_its_digest(tmp_path: Path) -> None:
    write(tmp_path, PAIR, matched_pair())
    path = tmp_path / log_file_name(1)
    header, *records = path.read_text().splitlines(keepends=True)
    edited = json.loads(header)
    edited["config"]["seed"] = 4
    path.write_text(json.dumps(edited) + "\n" + "".join(records))

    report = check_logs(tmp_path)
    assert report.exit_code == EXIT_UNUSABLE
    assert f"{path} line 1: config_digest is" in report.text
    assert "the config was changed after the run" in report.text
    with pytest.raises(LogFormatError, match="the config was changed after the run"):
        load_log(path)


def test_a_digest_names_the_config_as_json() -> None:
    assert config_digest({"a": 1, "b": [1, 2]}) == config_digest({"b": [1, 2], "a": 1})
    assert config_digest({"a": 1}) != config_digest({"a": 1.0})
    assert config_digest({"a": 1}).startswith("sha256:")
    # Text outside ASCII is escaped, so one config has one spelling and one digest.
    assert config_digest({"model": "Qwen-é"}) != config_digest({"model": "Qwen-e"})


# ---- a rank with no log ------------------------------------------------------------------


def recorded_pp2_dp2(directory: Path, *, without: Sequence[int]) -> Path:
    """A recorded pp=2 x dp=2 run's logs, less those of the ranks `without`."""
    schedule = make_schedule(ScheduleConfig(pp=2, dp=2, spec=1, steps=4, seed=2024))
    dump_logs(record_scripted_logs(schedule), directory)
    for rank in without:
        (directory / log_file_name(rank)).unlink()
    return directory


def missing_line(rank: int, where: str | None = None) -> str:
    where = f"{log_file_name(rank)} is absent" if where is None else where
    return (
        f"Log missing: rank {rank} of a world of 4 (pp=2, dp=2) has no log: {where} (the rank "
        "died before writing its header, or its log was not copied); the other ranks are "
        "checked with it as a rank that issued nothing"
    )


def test_a_rank_with_no_log_is_named_and_the_others_are_checked(tmp_path: Path) -> None:
    # Rank 1 (stage 1 of replica 0) died before writing its header: the other three
    # logs are replayed, rank 1 as a rank that issued nothing.
    report = check_logs(recorded_pp2_dp2(tmp_path, without=[1]))
    missing = finding(report)
    assert isinstance(missing, MismatchReport)
    assert (missing.classification, missing.culprit, missing.comm, missing.seq) == (
        MismatchClass.MISSING_RANK,
        1,
        Communicator.DP_CPU,
        0,
    )
    assert (report.absent, report.ranks) == ((1,), 3)
    lines = report.text.splitlines()
    assert lines[0] == missing_line(1)
    assert lines[1] == "Unmatched collective: op #0 on dp_cpu (ranks 1, 3)"
    assert "  rank 3 posted   all_reduce [5, 2] int32 (step 0, agree) and waits" in lines
    assert (
        "  rank 1 has no log, so no record of op #0 on dp_cpu: the rank died before writing its "
        "header, or its log was not copied"
    ) in lines
    # What each present rank was waiting on when the run stopped.
    waits = lines[lines.index("What every rank was waiting on:") + 1 :]
    assert [line.split(" waits at ")[0] for line in waits if " waits at " in line] == [
        "  rank 0 [host]",
        "  rank 2 [relay stream]",
        "  rank 2 [between steps]",
        "  rank 3 [host]",
    ]
    assert (
        "  rank 3 [host] waits at step 0 (agree) on all_reduce("
        "'dp.target.step0.table' over dp_cpu, synchronous)"
    ) in waits
    assert waits[-1] == "  no log: rank(s) 1"


@pytest.mark.parametrize(("gone", "waiter"), [(0, 2), (3, 1)], ids=["rank-0", "last-rank"])
def test_the_first_or_the_last_rank_with_no_log_is_named(
    tmp_path: Path, gone: int, waiter: int
) -> None:
    report = check_logs(recorded_pp2_dp2(tmp_path, without=[gone]))
    missing = finding(report)
    assert isinstance(missing, MismatchReport)
    assert (missing.culprit, missing.rank, missing.comm, missing.seq) == (
        gone,
        waiter,
        Communicator.DP_CPU,
        0,
    )
    assert (report.absent, report.ranks) == ((gone,), 3)
    lines = report.text.splitlines()
    assert lines[0] == missing_line(gone)
    present = sorted({0, 1, 2, 3} - {gone})
    waits = lines[lines.index("What every rank was waiting on:") + 1 :]
    assert sorted({int(line.split()[1]) for line in waits if " waits at " in line}) == present
    assert waits[-1] == f"  no log: rank(s) {gone}"


def test_ranks_with_no_log_exit_1_and_logs_that_cannot_say_which_exit_2(tmp_path: Path) -> None:
    folder = recorded_pp2_dp2(tmp_path / "run", without=[1, 2])
    out = io.StringIO()
    assert check_log_dir(folder, out) == EXIT_FINDING
    assert out.getvalue().splitlines()[:2] == [missing_line(1), missing_line(2)]
    assert check_logs(folder).absent == (1, 2)
    # A log of another world beside them: which ranks are missing is not known.
    write(tmp_path / "other", PAIR, matched_pair())
    (tmp_path / "other" / log_file_name(1)).replace(folder / log_file_name(1))
    report = check_logs(folder)
    assert (report.exit_code, report.absent) == (EXIT_UNUSABLE, ())
    assert "is of world pp=2, dp=2 but rank-0001.jsonl of pp=2, dp=1" in report.text
    # No logs at all.
    assert check_logs(tmp_path / "absent").exit_code == EXIT_UNUSABLE
    (tmp_path / "empty").mkdir()
    assert check_logs(tmp_path / "empty").exit_code == EXIT_UNUSABLE


def test_a_file_of_the_missing_ranks_name_holding_another_rank_is_said_so(
    tmp_path: Path,
) -> None:
    # Headers decide the ranks: rank 3's log renamed rank-0001.jsonl leaves rank 1 with none.
    folder = recorded_pp2_dp2(tmp_path, without=[1])
    (folder / log_file_name(3)).replace(folder / log_file_name(1))
    report = check_logs(folder)
    finding(report)
    assert report.absent == (1,)
    assert report.text.splitlines()[0] == missing_line(
        1, "no log has its header (rank-0001.jsonl holds rank 3's)"
    )


@pytest.mark.parametrize(
    ("lost", "shown"),
    [("removed", "no log"), ("header cut", "no log (its header was cut)")],
)
def test_a_rank_with_no_log_is_a_finding_even_when_the_others_matched(
    tmp_path: Path, lost: str, shown: str
) -> None:
    # Stage 0 issued only local effects: nothing waits on the missing stage 1, yet the
    # run is not ok, whether its log is gone or the rank died writing its header.
    local = [Release(step=step, op=Op.END_STEP, buffer=BufferRef("x")) for step in range(2)]
    write(tmp_path, PAIR, [local, local])
    path = tmp_path / log_file_name(1)
    if lost == "removed":
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[:20])
    report = check_logs(tmp_path)
    assert (report.ok, report.exit_code, report.finding, report.absent) == (
        False,
        EXIT_FINDING,
        None,
        (1,),
    )
    assert report.text.splitlines()[1:] == [
        "  every collective logged matched; each rank's log ends:",
        "  rank 0: log ends at step 1 (2 records), nothing pending",
        f"  rank 1: {shown}",
    ]


# ---- what a crash leaves -------------------------------------------------------------------


def cut_last_line(path: Path, keep: int = 9) -> None:
    """Cut the file mid-way through its last line, as a kill mid-write does."""
    data = path.read_bytes()
    last = data.rstrip(b"\n").rfind(b"\n") + 1
    path.write_bytes(data[: last + keep])


def test_a_log_cut_mid_record_is_read_up_to_the_cut(tmp_path: Path) -> None:
    # The sender died while writing its last step's broadcast: the receiver waits for it.
    write(tmp_path, PAIR, matched_pair(steps=3))
    sender = tmp_path / log_file_name(1)
    sender.write_bytes(sender.read_bytes()[: sender.read_bytes().rfind(b"\n{", 0, -1) + 1])
    sender.write_bytes(sender.read_bytes()[:-1])  # cut mid-way through the release line
    cut_last_line(tmp_path / log_file_name(1))

    report = check_logs(tmp_path)
    finding(report)
    (cut,) = report.cut
    assert (cut.rank, cut.line) == (1, 9)
    assert (
        "rank 1's log ends mid-record at rank-0001.jsonl line 9 (the rank died while writing)"
        in (report.text)
    )
    assert report.records == 16  # everything before the cut was read


def test_a_cut_sender_leaves_the_receiver_waiting_and_the_report_says_on_what(
    tmp_path: Path,
) -> None:
    per_rank = matched_pair(steps=3)
    per_rank[1] = per_rank[1][:-2]  # the sender's log stops before its last broadcast
    write(tmp_path, PAIR, per_rank)
    with (tmp_path / log_file_name(1)).open("a") as file:
        file.write('{"seq": 7, "comm_seq": 2, "eff')  # ...and dies writing it

    report = check_logs(tmp_path)
    missing = finding(report)
    assert isinstance(missing, MismatchReport)
    assert (missing.classification, missing.culprit, missing.seq) == (
        MismatchClass.MISSING_RANK,
        1,
        2,
    )
    lines = report.text.splitlines()
    assert lines[0].startswith("Log cut: rank 1's log ends mid-record at rank-0001.jsonl line 9")
    assert "  mismatch: missing rank; culprit: rank 1" in lines
    # The missing rank's log ended: a rank that died, not only one that skipped an op.
    assert (
        "  rank 1's log ends at step 2 (7 records), before op #2 on pp_relay: the rank died or "
        "stopped there, or skipped it"
    ) in lines
    assert "What every rank was waiting on:" in lines
    assert any(line.startswith("  rank 0 [relay stream] waits at step 2") for line in lines)


def test_a_cut_after_the_last_collective_is_still_a_finding(tmp_path: Path) -> None:
    write(tmp_path, PAIR, matched_pair(steps=2))
    cut_last_line(tmp_path / log_file_name(0))

    report = check_logs(tmp_path)
    assert (report.ok, report.exit_code, report.finding) == (False, EXIT_FINDING, None)
    assert report.text.splitlines() == [
        "Log cut: rank 0's log ends mid-record at rank-0000.jsonl line 7 (the rank died while"
        " writing), after 5 records (step 1)",
        "  every collective logged before the cut matched; each rank's log ends:",
        "  rank 0: log ends at step 1 (5 records), nothing pending",
        "  rank 1: log ends at step 1 (6 records), nothing pending",
    ]


def test_corruption_before_the_last_line_is_unusable(tmp_path: Path) -> None:
    write(tmp_path, PAIR, matched_pair(steps=2))
    path = tmp_path / log_file_name(0)
    lines = path.read_text().splitlines(keepends=True)
    lines[3] = lines[3][:20] + "\n"
    path.write_text("".join(lines))

    report = check_logs(tmp_path)
    assert report.exit_code == EXIT_UNUSABLE
    assert report.text.startswith(f"purepp check: {path} line 4: corrupted JSON")


def test_an_unusable_folder_is_reported_under_the_check_not_the_reader(tmp_path: Path) -> None:
    # The check reads through load_logs' helpers; the report names what the user ran.
    report = check_logs(tmp_path)
    assert report.exit_code == EXIT_UNUSABLE
    assert report.text == (
        f"purepp check: {tmp_path}: holds no *.jsonl logs. "
        "Fix: pass the directory the ranks' logs were written to"
    )


def cut_header_line(rank: int, kept: int) -> str:
    """The line a rank's log starts with when it died after `kept` bytes of its header."""
    return (
        f"Log missing: rank {rank} of a world of 4 (pp=2, dp=2) has no log: "
        + (
            f"{log_file_name(rank)} is empty (the rank died as it began to write its header)"
            if kept == 0
            else f"{log_file_name(rank)} holds only a cut header ({kept} bytes of its first "
            "line: the rank died while writing it)"
        )
        + "; the other ranks are checked with it as a rank that issued nothing"
    )


@pytest.mark.parametrize("kept", [0, 1, 30, 40, 41, 200], ids=lambda kept: f"{kept}-bytes")
def test_a_cut_header_is_checked_as_a_rank_with_no_log(tmp_path: Path, kept: int) -> None:
    # Rank 1 died while writing its first line: it recorded nothing, as a rank with no
    # log; the other three are checked, and the report says what each waited on.
    folder = recorded_pp2_dp2(tmp_path, without=[])
    path = folder / log_file_name(1)
    header = path.read_bytes().split(b"\n")[0]
    assert len(header) > 200
    path.write_bytes(header[:kept])
    report = check_logs(folder)
    missing = finding(report)
    assert isinstance(missing, MismatchReport)
    assert (missing.classification, missing.culprit) == (MismatchClass.MISSING_RANK, 1)
    assert (report.absent, report.ranks) == ((1,), 3)
    (cut,) = report.cut_headers
    assert (cut.path, cut.size) == (path, kept)
    assert cut.rank == (1 if kept >= 41 else None)  # 41 bytes: up to the comma after its rank
    lines = report.text.splitlines()
    assert lines[0] == cut_header_line(1, kept)
    assert (
        "  rank 1 has no log, so no record of op #0 on dp_cpu: its header was cut (the rank "
        "died while writing it)"
    ) in lines
    waits = lines[lines.index("What every rank was waiting on:") + 1 :]
    assert sorted({int(line.split()[1]) for line in waits if " waits at " in line}) == [0, 2, 3]
    assert waits[-1] == "  no log: rank(s) 1"
    # As the command says it: a finding (exit 1) on stdout.
    out = io.StringIO()
    assert check_log_dir(folder, out) == EXIT_FINDING
    assert out.getvalue().splitlines()[0] == lines[0]


def test_a_cut_header_names_its_rank_when_the_cut_came_after_it(tmp_path: Path) -> None:
    # Headers decide the ranks: a cut header that says its rank is that rank's, whatever
    # the file's name; one cut before its rank is known by the name dump_logs gives it.
    folder = recorded_pp2_dp2(tmp_path, without=[])
    first_lines = {
        rank: (folder / log_file_name(rank)).read_bytes().split(b"\n")[0] for rank in (1, 2)
    }
    (folder / log_file_name(1)).unlink()
    (folder / "host-b.jsonl").write_bytes(first_lines[1][:60])
    (folder / log_file_name(2)).write_bytes(first_lines[2][:5])
    report = check_logs(folder)
    finding(report)
    assert report.absent == (1, 2)
    assert [(c.path.name, c.rank) for c in report.cut_headers] == [
        ("host-b.jsonl", 1),
        (log_file_name(2), None),
    ]
    lines = report.text.splitlines()
    assert lines[0] == cut_header_line(1, 60).replace(log_file_name(1), "host-b.jsonl")
    assert lines[1] == cut_header_line(2, 5)
    # Cut before its rank, under another name: which rank wrote it is not known.
    (folder / log_file_name(2)).replace(folder / "host-c.jsonl")
    report = check_logs(folder)
    finding(report)
    lines = report.text.splitlines()
    assert lines[1] == missing_line(2)
    assert lines[2] == (
        "Log cut: host-c.jsonl holds only a cut header (5 bytes of its first line: the rank "
        "died while writing it); which rank wrote it is not known (the cut came before its rank)"
    )


def corrupt_first_line(path: Path, kept: int) -> None:
    """A first line of `kept` bytes of garbage, then the log's records, as a disk fault leaves."""
    records = path.read_bytes().split(b"\n", 1)[1]
    path.write_bytes(b"x" * kept + b"\n" + records)


def no_newline_garbage(path: Path, kept: int) -> None:
    path.write_bytes(b"\0" * kept)  # a machine crash may leave zeros where the text was due


def header_of_another_world(path: Path, kept: int) -> None:
    path.write_bytes(path.read_bytes().replace(b'"dp": 2}', b'"dp": 3}')[:kept])


def header_with_a_leading_zero(path: Path, kept: int) -> None:
    path.write_bytes(b'{"schema": "purepp.effects/2", "rank": 01')


def header_of_a_rank_outside_the_world(path: Path, kept: int) -> None:
    path.write_bytes(b'{"schema": "purepp.effects/2", "rank": 4, "wor')  # the first past it


def header_of_another_schema(path: Path, kept: int) -> None:
    path.write_bytes(b'{"schema": "purepp.effects/9", "ra')


@pytest.mark.parametrize(
    ("defect", "problem"),
    [
        (corrupt_first_line, "rank-0001.jsonl line 1: corrupted JSON"),
        (no_newline_garbage, "rank-0001.jsonl line 1: the last line is truncated"),
        (header_of_another_world, "rank-0001.jsonl holds a cut header of world pp=2, dp=3"),
        (header_with_a_leading_zero, "rank-0001.jsonl line 1: the last line is truncated"),
        (
            header_of_a_rank_outside_the_world,
            "rank-0001.jsonl holds a cut header of rank 4, but rank-0000.jsonl is of a world of 4"
            " ranks (pp=2, dp=2)",
        ),
        (header_of_another_schema, "rank-0001.jsonl line 1: the last line is truncated"),
    ],
)
def test_a_corrupt_header_is_still_unusable(
    tmp_path: Path, defect: Callable[[Path, int], None], problem: str
) -> None:
    # Only the start of a header line, with no newline after it, is a cut header: a
    # first line of other bytes, or one followed by more lines, is a corrupted log.
    folder = recorded_pp2_dp2(tmp_path, without=[])
    defect(folder / log_file_name(1), 80)
    report = check_logs(folder)
    assert report.exit_code == EXIT_UNUSABLE, report.text
    assert problem in report.text
    assert report.cut_headers == ()


def test_a_cut_header_of_a_rank_that_has_a_log_is_of_another_run(tmp_path: Path) -> None:
    folder = recorded_pp2_dp2(tmp_path, without=[])
    header = (folder / log_file_name(1)).read_bytes().split(b"\n")[0]
    (folder / "old.jsonl").write_bytes(header[:60])
    report = check_logs(folder)
    assert report.exit_code == EXIT_UNUSABLE
    assert (
        "old.jsonl holds a cut header of rank 1, but rank-0001.jsonl is rank 1's log" in report.text
    )
    # Two cut headers of one rank.
    (folder / log_file_name(1)).write_bytes(header[:50])
    report = check_logs(folder)
    assert report.exit_code == EXIT_UNUSABLE
    assert (
        "rank-0001.jsonl holds a cut header of rank 1, but old.jsonl holds one of rank 1 too"
        in report.text
    )
    # Cut before its rank, in rank 1's file, while old.jsonl says it is rank 1: the
    # file's name does not place it over the header's own word.
    (folder / log_file_name(1)).write_bytes(header[:10])
    report = check_logs(folder)
    assert report.exit_code == EXIT_UNUSABLE
    assert (
        "rank-0001.jsonl holds a cut header, but every rank of the world of 4 (pp=2, dp=2) has "
        "a log or a cut header of its own: it is not of this run" in report.text
    ), report.text
    (folder / log_file_name(1)).write_bytes(header + b"\n")
    # Cut before its rank, while every rank has a log: no rank of this run wrote it.
    (folder / "old.jsonl").write_bytes(header[:10])
    report = check_logs(folder)
    assert report.exit_code == EXIT_UNUSABLE
    assert (
        "old.jsonl holds a cut header, but every rank of the world of 4 (pp=2, dp=2) has a "
        "log: it is not of this run" in report.text
    )


def test_read_cut_header_says_which_files_hold_only_the_start_of_a_header(
    tmp_path: Path,
) -> None:
    path = write(tmp_path, PAIR, [[], []]) / log_file_name(1)
    header = path.read_bytes()
    assert read_cut_header(path) is None  # a whole header line
    assert read_cut_header(tmp_path / "missing.jsonl") is None
    for size in range(len(header)):  # every cut of it
        path.write_bytes(header[:size])
        cut = read_cut_header(path)
        assert cut is not None
        assert (cut.path, cut.size) == (path, size)
        known = b'"rank": 1,' in header[:size]
        world = b'"dp": 1}' in header[:size]
        assert (cut.rank, cut.world is not None) == (1 if known else None, world)
    assert read_cut_header(path).world == PAIR  # type: ignore[union-attr]
    path.write_bytes(header[:60].replace(b"purepp", b"puRepp"))
    assert read_cut_header(path) is None
    # No number where one is due, a world of no stages, or a byte the writer never
    # writes (it escapes all but printable ASCII): no header starts so.
    at = header.index(b'"rank": ') + len(b'"rank": ')
    starts = [header[:at] + b"-", header[:at] + b"x1", header[:70].replace(b"2", b"0")]
    for start in [*starts, header[:90] + b"\0", header[:90] + "é".encode()]:
        path.write_bytes(start)
        assert read_cut_header(path) is None, start
    # A header longer than one read (a large config), cut: every byte of it counted.
    folder = write(tmp_path / "long", PAIR, [[], []], config={"note": "x" * 300_000})
    line = (folder / log_file_name(1)).read_bytes()
    (folder / log_file_name(1)).write_bytes(line[:-10])
    cut = read_cut_header(folder / log_file_name(1))
    assert cut is not None
    assert (cut.size, cut.rank, cut.world) == (len(line) - 10, 1, PAIR)
    with pytest.raises(
        InvalidInputError, match=r"read_cut_header: path=None is a NoneType, not a path"
    ):
        read_cut_header(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("ranks", [2, 4, 5])
def test_logs_whose_headers_are_all_cut_are_unusable(tmp_path: Path, ranks: int) -> None:
    write(tmp_path, Layout(pp=ranks, dp=1), [[]] * ranks)
    for rank in range(ranks):
        path = tmp_path / log_file_name(rank)
        path.write_bytes(path.read_bytes()[:30])
    report = check_logs(tmp_path)
    assert report.exit_code == EXIT_UNUSABLE
    names = ", ".join(log_file_name(rank) for rank in range(min(ranks, 4)))
    more = ", ..." if ranks > 4 else ""  # the first four named
    assert (
        f"every log holds only a cut header ({names}{more}): no rank wrote its header"
        in report.text
    ), report.text


# ---- mismatches, classified the way fr_trace does --------------------------------------------


@pytest.mark.parametrize(
    ("sent", "expected_class"),
    [
        ({"shape": (4, 1)}, MismatchClass.SIZE),
        ({"dtype": DType.INT32}, MismatchClass.DTYPE),
        ({"src": 0}, MismatchClass.SOURCE),
    ],
    ids=["size", "dtype", "source"],
)
def test_a_mismatch_is_classified_with_its_culprit(
    tmp_path: Path, sent: dict[str, object], expected_class: MismatchClass
) -> None:
    world = Layout(pp=3, dp=1)
    receive = [e for step in range(3) for e in relay(step, src=2)]
    wrong = {"src": 2, "op": Op.BROADCAST, **sent}
    bad = [
        e
        for step in range(3)
        for e in (relay(step, **wrong) if step == 1 else relay(step, src=2))  # type: ignore[arg-type]
    ]
    report = check_logs(write(tmp_path, world, [receive, receive, bad]))

    mismatch = finding(report)
    assert isinstance(mismatch, MismatchReport)
    assert (mismatch.classification, mismatch.seq, mismatch.step) == (expected_class, 1, 1)
    # Two receivers agree with each other: the sender is the odd one out.
    assert mismatch.culprit == 2
    assert f"  mismatch: {expected_class.value}; culprit: rank 2" in report.text.splitlines()


def test_a_collective_of_another_type_is_a_type_mismatch(tmp_path: Path) -> None:
    ranks: list[list[Effect]] = [[agree(0, Communicator.DP_CPU, 0)], []]
    ranks[1] = [
        Broadcast(
            step=0,
            op=Op.AGREE,
            buffer=BufferRef("table"),
            shape=(5, 2),
            dtype=DType.INT32,
            src=1,
            comm=Communicator.DP_CPU,
            stream=Stream.MAIN,
        )
    ]
    mismatch = finding(check_logs(write(tmp_path, REPLICAS, ranks)))
    assert isinstance(mismatch, MismatchReport)
    assert mismatch.classification is MismatchClass.TYPE


def test_a_rank_that_skipped_a_collective_is_named_at_the_step_it_skipped(tmp_path: Path) -> None:
    # FIELD_FAILURES row 10: an idle replica returns early at step 1.
    ranks = [
        [agree(step, Communicator.DP_CPU, rank) for step in range(4) if (rank, step) != (1, 1)]
        for rank in range(2)
    ]
    mismatch = finding(check_logs(write(tmp_path, REPLICAS, ranks)))
    assert isinstance(mismatch, MismatchReport)
    # Named as the rank whose op disagrees; of two ranks, neither is the odd one out.
    assert (mismatch.classification, mismatch.seq, mismatch.rank) == (MismatchClass.STEP, 1, 1)
    assert mismatch.culprit is None
    assert mismatch.received is not None
    assert (mismatch.expected.step, mismatch.received.step) == (2, 1)


# ---- cross-communicator order: a wait-for cycle ------------------------------------------------


def test_two_communicators_in_opposite_orders_are_a_wait_for_cycle(tmp_path: Path) -> None:
    # FIELD_FAILURES row 14: rank 0 agrees on dp_cpu then dp_drafter_cpu, rank 1 the other
    # way round. Each communicator's own sequence matches, so a per-communicator check
    # passes; replayed through the matching scheduler both hosts block on each other.
    target, drafter = Communicator.DP_CPU, Communicator.DP_DRAFTER_CPU
    ranks: list[list[Effect]] = [
        [agree(0, target, 0), agree(0, drafter, 0)],
        [agree(0, drafter, 1), agree(0, target, 1)],
    ]
    assert match_collectives(dict(enumerate(ranks)), REPLICAS) is None

    report = check_logs(write(tmp_path, REPLICAS, ranks))
    deadlock = finding(report)
    assert isinstance(deadlock, DeadlockReport)
    assert deadlock.cycle is not None
    assert [(e.rank, e.via and e.via.comm, e.peer) for e in deadlock.cycle.edges] == [
        (0, target, 1),
        (1, drafter, 0),
    ]
    assert (
        "  wait-for cycle: rank 0 -> dp_cpu op #0 -> rank 1 -> dp_drafter_cpu op #0 -> rank 0"
        in report.text.splitlines()
    )


@pytest.mark.parametrize(
    ("programs", "world"),
    [(waits_through_an_event, Layout(pp=2, dp=1)), (waits_for_a_work, Layout(pp=1, dp=2))],
    ids=["event", "work"],
)
def test_a_wait_on_an_event_or_a_work_is_replayed_as_the_simulator_runs_it(
    tmp_path: Path, programs: Callable[..., list[list[Effect]]], world: Layout
) -> None:
    deadlock = finding(check_logs(write(tmp_path / "waited", world, programs())))
    assert isinstance(deadlock, DeadlockReport)
    assert deadlock.cycle is not None
    assert sorted(deadlock.cycle.ranks) == [0, 1]
    moved = check_logs(write(tmp_path / "moved", world, programs(waited=False)))
    assert moved.ok, moved.text


def test_a_host_synchronize_waits_for_its_stream_and_names_what_it_waits_for(
    tmp_path: Path,
) -> None:
    # Stage 0 synchronizes with its relay stream after a receive the sender never posts.
    receive = [*relay(0)[:2], Synchronize(step=0, op=Op.RECEIVE, stream=Stream.RELAY)]
    report = check_logs(write(tmp_path, PAIR, [receive, []]))
    missing = finding(report)
    assert isinstance(missing, MismatchReport)
    assert (missing.classification, missing.culprit) == (MismatchClass.MISSING_RANK, 1)
    assert (
        "  rank 1's log ends before its first step (0 records), before op #0 on pp_relay: the "
        "rank died or stopped there, or skipped it"
    ) in report.text.splitlines()
    waits = [line for line in report.text.splitlines() if "[host]" in line]
    assert waits == ["  rank 0 [host] waits at step 0 (receive) on synchronize(relay)"]


def test_a_synchronize_after_matched_work_passes(tmp_path: Path) -> None:
    receive = [*relay(0), Synchronize(step=0, op=Op.RECEIVE, stream=Stream.RELAY)]
    report = check_logs(write(tmp_path, PAIR, [receive, list(relay(0, op=Op.BROADCAST))]))
    assert report.ok, report.text


# ---- bounded memory ---------------------------------------------------------------------------


def test_a_rank_is_replayed_at_most_the_steps_in_flight_ahead(tmp_path: Path) -> None:
    # Rank 1's log ends at step 0: with one step in flight rank 0 is held back at step 2,
    # not read to its end, and the report names the peer it waits for.
    ranks: list[list[Effect]] = [
        [Release(step=step, op=Op.END_STEP, buffer=BufferRef("x")) for step in range(1000)],
        [Release(step=0, op=Op.END_STEP, buffer=BufferRef("x"))],
    ]
    report = check_logs(write(tmp_path, PAIR, ranks), max_steps_in_flight=1)
    deadlock = finding(report)
    assert isinstance(deadlock, DeadlockReport)
    assert report.records == 3  # rank 0's steps 0 and 1, rank 1's step 0
    (waiter,) = deadlock.waiters
    assert (waiter.rank, waiter.step, waiter.held_back_by) == (0, 2, (1,))
