"""`purepp check --backend`: which backend's model judges logs whose header names none.

A gloo broadcast holds its host until its tree lets the member go; an NCCL broadcast
holds only its stream. So one program can be fine on NCCL and a deadlock on gloo, and
logs that do not say what they ran on (a scripted run's) must be judged by a backend
the caller can name, with the report saying which one it assumed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from purepp.effects.checker import check_log_dir, check_logs
from purepp.effects.log import LogHeader, Recorder, dump_logs
from purepp.effects.vocabulary import (
    Allocate,
    AllReduce,
    Broadcast,
    BufferRef,
    Communicator,
    DType,
    Effect,
    Op,
    Stream,
)
from purepp.errors import ConfigError
from purepp.layout import Layout
from purepp.runner.cli import main

WORLD = Layout(pp=2, dp=1)  # PP_RELAY and PP_CPU span both ranks


def broadcast_then_agree(rank: int) -> tuple[Effect, ...]:
    """Rank 0 broadcasts on the relay stream, then all-reduces; rank 1 the other way round.

    NCCL: rank 0's host goes on to the all-reduce, which matches rank 1's, and rank 1's
    broadcast then matches rank 0's. gloo: rank 0's host waits in its broadcast for rank
    1, which waits in its all-reduce for rank 0: a deadlock.
    """
    buffer = BufferRef("wire")
    send = (
        Allocate(
            step=0,
            op=Op.BROADCAST,
            buffer=buffer,
            shape=(4,),
            dtype=DType.INT64,
            stream=Stream.RELAY,
        ),
        Broadcast(
            step=0,
            op=Op.BROADCAST,
            buffer=buffer,
            shape=(4,),
            dtype=DType.INT64,
            src=0,
            comm=Communicator.PP_RELAY,
            stream=Stream.RELAY,
        ),
    )
    agree = (
        AllReduce(
            step=0,
            op=Op.AGREE,
            contribution=np.zeros((2, 2), dtype=np.int32),
            result=BufferRef("table"),
            comm=Communicator.PP_CPU,
            work=None,
        ),
    )
    return send + agree if rank == 0 else agree + send


def write_logs(directory: Path, config: dict[str, object]) -> Path:
    recorders = [
        Recorder(LogHeader(rank=rank, world=WORLD, config=config))
        for rank in range(WORLD.world_size)
    ]
    for rank, recorder in enumerate(recorders):
        recorder.perform(broadcast_then_agree(rank))
    dump_logs([recorder.log for recorder in recorders], directory)
    return directory


def test_logs_without_a_backend_are_judged_as_nccl_with_gloos_verdict_beside(
    tmp_path: Path,
) -> None:
    report = check_logs(write_logs(tmp_path, {}))
    assert report.exit_code == 0, report.text
    assert report.ok
    assert report.backend == "nccl"
    assert report.text.startswith("ok: 2 ranks, 4 collectives over 1 step")
    assert (
        "note: the logs' header names no backend, so they were judged as NCCL's; as gloo's "
        "(a broadcast holds its host) they give exit 1: Deadlock: no rank can make progress"
    ) in report.text
    assert report.text.endswith("if they ran on gloo, check them with --backend gloo")


def test_no_note_where_both_backends_judge_alike(tmp_path: Path) -> None:
    # Both ranks broadcast, then all-reduce: on gloo rank 0's host waits in its broadcast
    # for rank 1 to join, which it does; so both models complete it.
    recorders = [Recorder(LogHeader(rank=rank, world=WORLD, config={})) for rank in range(2)]
    for recorder in recorders:
        recorder.perform(broadcast_then_agree(0))
    dump_logs([recorder.log for recorder in recorders], tmp_path)
    report = check_logs(tmp_path)
    assert report.text == "ok: 2 ranks, 4 collectives over 1 step, every communicator matches"


def test_the_caller_names_the_backend_the_header_left_out(tmp_path: Path) -> None:
    report = check_logs(write_logs(tmp_path, {}), backend="gloo")
    assert report.exit_code == 1, report.text
    assert report.backend == "gloo"
    assert "wait-for cycle: rank 0 -> pp_relay" in report.text
    assert "header names no backend" not in report.text
    nccl = check_logs(tmp_path, backend="nccl")
    assert nccl.exit_code == 0
    assert nccl.backend == "nccl"
    assert "header names no backend" not in nccl.text  # asked for, not assumed


@pytest.mark.parametrize("written", ["gloo", "nccl"])
def test_the_headers_backend_judges_and_is_not_noted(tmp_path: Path, written: str) -> None:
    report = check_logs(write_logs(tmp_path, {"backend": written}))
    assert report.backend == written
    assert report.exit_code == (1 if written == "gloo" else 0), report.text
    assert "header names no backend" not in report.text
    same = check_logs(tmp_path, backend="gloo" if written == "gloo" else "nccl")
    assert same.exit_code == report.exit_code


def test_a_backend_that_contradicts_the_header_makes_the_logs_unusable(tmp_path: Path) -> None:
    report = check_logs(write_logs(tmp_path, {"backend": "gloo"}), backend="nccl")
    assert report.exit_code == 2
    assert report.backend is None
    assert "backend='nccl' was given but the logs' header says they ran on 'gloo'" in report.text
    assert "leave the backend out" in report.text


def test_a_backend_that_is_none_is_refused_before_reading(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"check_logs: backend is 'mpi', not a backend"):
        check_logs(write_logs(tmp_path, {}), backend="mpi")  # type: ignore[arg-type]


def test_the_command_line_passes_the_backend_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = str(write_logs(tmp_path, {}))
    assert main(["check", folder]) == 0
    assert "judged as NCCL's" in capsys.readouterr().out
    assert main(["check", folder, "--backend", "gloo"]) == 1
    assert "Deadlock:" in capsys.readouterr().out
    assert main(["check", folder, "--backend", "mpi"]) == 2
    assert "invalid choice: 'mpi'" in capsys.readouterr().err


def test_check_log_dir_passes_the_backend_on(tmp_path: Path) -> None:
    import io

    out = io.StringIO()
    assert check_log_dir(write_logs(tmp_path, {}), out, backend="gloo") == 1
    assert "Deadlock:" in out.getvalue()
