"""Review of `check --backend`'s note and `TorchInterpreter.replace_dp_groups`.

- The note comparing gloo's verdict with NCCL's read the report's first line, which is
  a "Log missing"/"Log cut" line whenever a rank's log is missing or cut: the same under
  both models, so a deadlock on gloo went unnoted where NCCL's model found none.
- Logs with no broadcast (the one effect the models differ on) were checked twice.
- A swap left the DP lanes' broadcast options built for the old group (a source's
  rank within the group changes when a rank before it leaves).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from purepp.effects import checker
from purepp.effects.checker import check_logs
from purepp.effects.log import LogHeader, Recorder, dump_logs
from purepp.effects.torch_interpreter import TorchInterpreter, build_communicators
from purepp.effects.vocabulary import Broadcast, BufferRef, Communicator, DType, Op, Stream
from purepp.errors import ConfigError
from purepp.layout import Layout
from tests._dist import RankContext, run_ranks
from tests.test_check_backend import broadcast_then_agree


def _write(directory: Path, world: Layout, ranks: range, order: int | None = None) -> Path:
    """`broadcast_then_agree` on `ranks` of `world` (each in its own order unless
    `order` names one for all), the other ranks' logs absent."""
    recorders = [Recorder(LogHeader(rank=rank, world=world, config={})) for rank in ranks]
    for rank, recorder in zip(ranks, recorders, strict=True):
        recorder.perform(broadcast_then_agree(rank if order is None else order))
    dump_logs([recorder.log for recorder in recorders], directory)
    return directory


def test_gloos_deadlock_is_noted_where_a_missing_rank_heads_both_reports(
    tmp_path: Path,
) -> None:
    # pp 2 x dp 2: pipeline 0 (ranks 0, 1) logged a program gloo deadlocks on; pipeline
    # 1's logs are missing. Both reports open with the same "Log missing" lines.
    report = check_logs(_write(tmp_path, Layout(pp=2, dp=2), range(2)))
    assert report.exit_code == 1, report.text
    assert "every collective logged matched" in report.text
    gloo = check_logs(tmp_path, backend="gloo")
    assert "Deadlock: no rank can make progress" in gloo.text
    assert (
        "as gloo's (a broadcast holds its host) they give exit 1: Deadlock: no rank can "
        "make progress and no collective can complete; if they ran on gloo"
    ) in report.text, report.text


def test_a_cut_log_that_matches_on_both_models_gets_no_note(tmp_path: Path) -> None:
    world = Layout(pp=2, dp=1)
    _write(tmp_path, world, range(2), order=0)  # both broadcast first: no deadlock
    with (tmp_path / "rank-0001.jsonl").open("a") as log:
        log.write('{"step": 1, "op"')  # rank 1 died writing its next record
    report = check_logs(tmp_path)
    assert report.exit_code == 1, report.text
    assert "Log cut: rank 1's log" in report.text
    assert "header names no backend" not in report.text, report.text


def test_logs_without_a_broadcast_are_read_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # pp 1: nothing is relayed, so both models replay the same; one check is enough.
    world = Layout(pp=1, dp=2)
    recorders = [Recorder(LogHeader(rank=rank, world=world, config={})) for rank in range(2)]
    for recorder in recorders:
        recorder.perform(broadcast_then_agree(1)[:1])  # the all-reduce only (over pp_cpu)
    dump_logs([recorder.log for recorder in recorders], tmp_path)
    runs: list[object] = []
    run = checker._Check.run

    def counted(self: checker._Check) -> checker.CheckReport:
        runs.append(self)
        return run(self)

    monkeypatch.setattr(checker._Check, "run", counted)
    report = check_logs(tmp_path)
    assert report.ok, report.text
    assert len(runs) == 1
    runs.clear()
    _write(tmp_path / "relayed", Layout(pp=2, dp=1), range(2))
    assert "header names no backend" in check_logs(tmp_path / "relayed").text
    assert len(runs) == 2  # a broadcast: gloo's model is asked too


def _root_after_swap(ctx: RankContext) -> tuple[int, int] | None:
    """Ranks 0 and 2 of a DP group (0, 1, 2) swap in a group without rank 1: a
    broadcast from rank 2 on dp_cpu has root 2 before, 1 after."""
    world = Layout(pp=1, dp=3)
    groups = build_communicators(
        pp_groups=world.pp_groups,
        dp_groups=world.dp_groups,
        relay_backend="gloo",
        timeout=ctx.timeout,
    )
    if ctx.rank == 1:
        return None
    env = TorchInterpreter(device=torch.device("cpu"), groups=groups, rank=ctx.rank)
    effect = Broadcast(
        step=0,
        op=Op.BROADCAST,
        buffer=BufferRef("x"),
        shape=(1,),
        dtype=DType.INT64,
        src=2,
        comm=Communicator.DP_CPU,
        stream=Stream.MAIN,
    )
    before = env.broadcast_options(effect).rootRank
    regroup = {}
    for comm in (Communicator.DP_CPU, Communicator.DP_DRAFTER_CPU):
        made = dist.new_group([0, 2], backend="gloo", use_local_synchronization=True)
        assert isinstance(made, dist.ProcessGroup)
        regroup[comm] = made
    env.replace_dp_groups(regroup)
    return before, env.broadcast_options(effect).rootRank


def test_a_swap_builds_the_lanes_broadcast_options_again() -> None:
    outcomes = run_ranks(_root_after_swap, 3)
    assert outcomes == [(2, 1), None, (2, 1)]


def _reused_groups(ctx: RankContext) -> list[str]:
    """What the swap says to the group it replaces, and to one group for both lanes;
    the interpreter keeps its groups through both refusals."""
    groups = build_communicators(
        pp_groups=[[0]], dp_groups=[[0]], relay_backend="gloo", timeout=ctx.timeout
    )
    env = TorchInterpreter(device=torch.device("cpu"), groups=groups, rank=0)
    lanes = (Communicator.DP_CPU, Communicator.DP_DRAFTER_CPU)
    made = dist.new_group([0], backend="gloo", use_local_synchronization=True)
    assert isinstance(made, dist.ProcessGroup)
    problems = []
    for misuse in ({comm: groups[comm] for comm in lanes}, dict.fromkeys(lanes, made)):
        with pytest.raises(ConfigError) as caught:
            env.replace_dp_groups(misuse)
        problems.append(caught.value.problem)
        assert all(env.group("test", comm) is groups[comm] for comm in lanes)
    return problems


def test_the_swap_refuses_the_group_it_replaces_and_one_group_for_both_lanes() -> None:
    (problems,) = run_ranks(_reused_groups, 1)
    assert problems == [
        "groups maps dp_cpu to the group it replaces (ranks (0,))",
        "groups maps dp_cpu and dp_drafter_cpu to one group, so the two lanes' agreements "
        "in flight could pair with each other",
    ]
