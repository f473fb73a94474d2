"""Review of gloo's broadcast tree in the model (`CollectiveHub` with `backend='gloo'`).

A log that ends before a broadcast is reported as a missing rank, with a member that
waits on the broadcast: on gloo that must be a member the tree still holds, not one it
has let go (which the same report lists as ended).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from purepp.effects.checker import check_logs
from purepp.effects.log import LogHeader, Recorder, dump_logs
from purepp.effects.matching import MismatchReport
from purepp.effects.vocabulary import Backend, Stream
from tests.test_gloo_model_differential import Program


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_a_missing_rank_report_names_a_member_still_held_by_the_broadcast(
    backend: Backend, tmp_path: Path
) -> None:
    """Three stages, a broadcast from stage 1 (gloo's tree: 1 -> 2, 1 -> 0); stage 2's
    log ends before it. On gloo stage 0 has its data from stage 1 and goes on (its log
    ends), so the one waiting is stage 1, whose send to stage 2 never completes. On
    NCCL both wait, and the lowest is named, as before."""
    broadcast = ("broadcast", "b", 1, Stream.RELAY.value)
    program = Program(pp=3, dp=1, ranks=((broadcast,), (broadcast,), ()))
    recorders = [
        Recorder(LogHeader(rank=rank, world=program.world, config={"backend": backend}))
        for rank in range(3)
    ]
    for rank, recorder in enumerate(recorders):
        recorder.perform(program.effects(rank))
    dump_logs([recorder.log for recorder in recorders], tmp_path)
    report = check_logs(tmp_path)
    finding = report.finding
    assert isinstance(finding, MismatchReport)
    assert (finding.seq, finding.missing, finding.culprit) == (0, (2,), 2)
    assert finding.rank == (1 if backend == "gloo" else 0)
