"""Field failure 2, end to end: draft tokens that never reach the earlier stages make
them embed the wrong tokens, and the runner's parity check against the single-stage
model catches it; the correct runner, with rejections forced, matches token for token.

Each case runs the real per-rank loop (`RankLoop`) on a 2-process gloo world; the
fault is injected beneath it, in the interpreter, so the loop's code is untouched.

And a launcher killed by SIGKILL (no handler runs): its ranks die with it and its
temporary folder is removed all the same.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

from purepp.effects.torch_interpreter import TorchInterpreter, build_communicators
from purepp.effects.vocabulary import Effect, ScatterRows
from purepp.layout import Layout
from purepp.runner.loop import RankLoop
from purepp.runner.parity import ParityVerdict, check_parity
from purepp.runner.results import RankResult
from purepp.runner.settings import RunSettings
from purepp.runner.toy_model import reference_generate
from purepp.runner.workload import Workload, make_workload
from tests._dist import RankContext, run_ranks
from tests._processes import MARK, marked_processes

pytestmark = pytest.mark.multiprocess

SETTINGS = RunSettings(pp=2, dp=1, spec=2, requests=10, timeout_s=30)


class DraftsNeverArrive(TorchInterpreter):
    """The field bug: the relayed drafts are never written into the earlier stages'
    draft table, so they embed token 0 where the drafts belong."""

    def perform(self, effects: Iterable[Effect], /) -> None:
        super().perform(e for e in effects if not isinstance(e, ScatterRows))


def run_rank(drop_drafts: bool, ctx: RankContext) -> RankResult:
    world = Layout(pp=SETTINGS.pp, dp=SETTINGS.dp)
    groups = build_communicators(
        pp_groups=world.pp_groups,
        dp_groups=world.dp_groups,
        relay_backend="gloo",
        timeout=ctx.timeout,
    )
    kind = DraftsNeverArrive if drop_drafts else TorchInterpreter
    env = kind(device=torch.device("cpu"), groups=groups, rank=ctx.rank)
    loop = RankLoop(
        SETTINGS,
        make_workload(SETTINGS.workload),
        rank=ctx.rank,
        env=env,
        perform=env,
        activation_group=None,
    )
    return loop.run()


def verdict_of(drop_drafts: bool) -> tuple[ParityVerdict, RankResult]:
    results = run_ranks(functools.partial(run_rank, drop_drafts), SETTINGS.world_size)
    last = results[-1]
    workload: Workload = make_workload(SETTINGS.workload)
    reference = {
        r.request_id: reference_generate(
            r.prompt, r.max_tokens, SETTINGS.num_layers, workload.vocab_size
        )
        for r in workload.requests
    }
    return check_parity(last.outputs, frozenset(last.finished), reference), last


def test_the_correct_runner_matches_the_single_stage_model_with_rejections() -> None:
    verdict, last = verdict_of(drop_drafts=False)
    assert verdict.ok, verdict.render()
    assert verdict.exact > 0
    assert 0 < last.drafts_accepted < last.drafts_proposed  # rejections happened
    assert last.steps < SETTINGS.total_steps  # without DP, it stops once every request finished


def test_drafts_that_never_reach_earlier_stages_are_caught_by_parity() -> None:
    verdict, _ = verdict_of(drop_drafts=True)
    assert verdict.mismatch is not None
    assert verdict.mismatch.why == "different token"
    assert "expected" in verdict.render()


# -- a launcher killed by SIGKILL ------------------------------------------------------

PUREPP_RUN = [sys.executable, "-m", "purepp.runner.cli", "run"]


def test_a_launcher_killed_by_sigkill_leaves_no_process_and_no_temporary_folder(
    tmp_path: Path,
) -> None:
    mark = uuid.uuid4().hex
    tmpdir = tmp_path / "tmp"  # the run's TMPDIR: its temporary folders go here
    tmpdir.mkdir()
    launcher = subprocess.Popen(
        [*PUREPP_RUN, "--pp", "2", "--dp", "1", "--steps", "1000000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, MARK: mark, "TMPDIR": str(tmpdir)},
    )
    try:
        # Every rank and the reference beating, in the loop.
        beats = [f"run/progress/rank{rank}" for rank in range(2)] + ["ref/progress/rank0"]
        deadline = time.monotonic() + 120
        while not all(any(tmpdir.glob(f"purepp-run-*/{beat}")) for beat in beats):
            assert time.monotonic() < deadline, "the ranks never started"
            assert launcher.poll() is None, "the launcher exited early"
            time.sleep(0.2)
        time.sleep(2)
        assert len(marked_processes(mark)) >= 4  # the launcher, two ranks, the reference
    finally:
        launcher.kill()  # SIGKILL: no handler of the launcher runs
        launcher.wait()
    deadline = time.monotonic() + 15
    while (marked_processes(mark) or any(tmpdir.iterdir())) and time.monotonic() < deadline:
        time.sleep(0.2)  # the parent-death signal and the sweeper act asynchronously
    assert marked_processes(mark) == []
    assert list(tmpdir.iterdir()) == []
