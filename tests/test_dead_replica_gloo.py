"""A DP replica of a 2-stage pipeline dies mid-run on real gloo ranks, and the
surviving replicas decode on with the single-stage model's tokens (vllm#44428, pp > 1).

The unit that dies is a whole replica, both its stages: a stage cannot serve without
its pipeline partner (the partner waits on it in the relay and the activations), and
the stages of a survivor must agree the same shapes (their forward passes activations
of the agreed size), so every survivor's stages must count the same replicas dead.

What the README tells an embedder: each survivor makes new DP groups over its stage's
survivors, swaps them into the interpreter it has (`replace_dp_groups`, which keeps
the relay's ring: entries received steps ago and consumed `ring_depth` steps later),
marks the replica dead in its `AgreementGroup`, and agrees again from the step's
`Begun`, batch and frees on a new `RankDriver`: the failed step's consume happened,
its agreement did not.
"""

from __future__ import annotations

import datetime
import os

import attrs
import pytest
import torch
import torch.distributed as dist

from purepp import dp
from purepp.effects.io import TorchIO
from purepp.effects.torch_interpreter import TorchInterpreter, build_communicators
from purepp.effects.vocabulary import Communicator
from purepp.errors import ConfigError, InvalidInputError, PeerFailureError, PureppError
from purepp.layout import Layout
from purepp.rank import Agreed, Begun, RankDriver
from purepp.runner.loop import RankLoop
from purepp.runner.parity import check_parity
from purepp.runner.results import RankResult
from purepp.runner.scheduler import ScheduledStep
from purepp.runner.settings import RunSettings
from purepp.runner.toy_model import reference_generate
from purepp.runner.workload import make_workload
from tests._dist import RankContext, describe_outcomes, run_ranks, spawn_ranks

pytestmark = pytest.mark.multiprocess

SETTINGS = RunSettings(pp=2, dp=3, spec=2, requests=9, timeout_s=10)
WORLD = Layout(pp=SETTINGS.pp, dp=SETTINGS.dp)
DEAD, DIES_AT = 2, 7  # replica 2 (ranks 4 and 5) dies before step 7's agreement


class Survivor(RankLoop):
    """The runner's loop, with the dead replica's death and the survivors' recovery."""

    recovered_at: int | None = None

    def agree(self, begun: Begun, scheduled: ScheduledStep, freed: list[int]) -> Agreed:
        if self.replica == DEAD and scheduled.step == DIES_AT:
            os._exit(3)  # both stages of the replica, without a word
        try:
            return super().agree(begun, scheduled, freed)
        except PeerFailureError:
            if self.recovered_at is not None:
                raise
        # Only this stage's survivors make these groups: the dead one can never join one.
        survivors = [r for r in WORLD.replicas(self.stage) if WORLD.dp_index(r) != DEAD]
        timeout = datetime.timedelta(seconds=SETTINGS.timeout_s)
        regroup = {}
        for comm in (Communicator.DP_CPU, Communicator.DP_DRAFTER_CPU):
            made = dist.new_group(
                survivors, backend="gloo", timeout=timeout, use_local_synchronization=True
            )
            assert isinstance(made, dist.ProcessGroup)  # this rank is a member
            regroup[comm] = made
        self.env.replace_dp_groups(regroup)
        self.config = attrs.evolve(self.config, group=self.config.group.mark_dead(DEAD))
        self.driver = RankDriver(self.config, self.interpreter, TorchIO(self.env))
        self.recovered_at = scheduled.step
        return super().agree(begun, scheduled, freed)  # the same begun, batch and frees


def run_rank(ctx: RankContext) -> tuple[RankResult, int | None]:
    groups = build_communicators(
        pp_groups=WORLD.pp_groups,
        dp_groups=WORLD.dp_groups,
        relay_backend="gloo",
        timeout=ctx.timeout,
    )
    env = TorchInterpreter(device=torch.device("cpu"), groups=groups, rank=ctx.rank)
    loop = Survivor(
        SETTINGS,
        make_workload(SETTINGS.workload),
        rank=ctx.rank,
        env=env,
        perform=env,
        activation_group=groups[Communicator.PP_CPU],
    )
    return loop.run(), loop.recovered_at


def test_surviving_replicas_of_a_pipeline_decode_on_with_the_reference_tokens() -> None:
    outcomes = spawn_ranks(
        run_rank,
        WORLD.world_size,
        timeout=datetime.timedelta(seconds=SETTINGS.timeout_s),
        deadline_s=120.0,
    )
    workload = make_workload(SETTINGS.workload)
    compared = 0
    for outcome in outcomes:
        if WORLD.dp_index(outcome.rank) == DEAD:
            assert not outcome.returned, describe_outcomes(outcomes)
            assert outcome.exitcode == 3, describe_outcomes(outcomes)
            continue
        assert outcome.ok, describe_outcomes(outcomes)
        assert outcome.value is not None
        result, recovered_at = outcome.value
        assert recovered_at == DIES_AT
        assert result.steps == SETTINGS.total_steps
        reference = {
            r.request_id: reference_generate(
                r.prompt, r.max_tokens, SETTINGS.num_layers, workload.vocab_size
            )
            for r in workload.for_replica(result.replica)
        }
        verdict = check_parity(result.outputs, frozenset(result.finished), reference)
        assert verdict.ok, (outcome.rank, verdict.render())
        compared += verdict.compared
    assert compared > 0


def refusals(ctx: RankContext) -> list[tuple[str, str]]:
    """Each misuse of `replace_dp_groups` on a one-rank world: (error type, problem)."""
    groups = build_communicators(
        pp_groups=[[0]], dp_groups=[[0]], relay_backend="gloo", timeout=ctx.timeout
    )
    env = TorchInterpreter(device=torch.device("cpu"), groups=groups, rank=0)
    solo = {}
    for comm in (Communicator.DP_CPU, Communicator.DP_DRAFTER_CPU):
        made = dist.new_group([0], backend="gloo", use_local_synchronization=True)
        assert isinstance(made, dist.ProcessGroup)
        solo[comm] = made
    pp_cpu = groups[Communicator.PP_CPU]
    misuses: list[object] = [
        [solo[Communicator.DP_CPU]],  # not a mapping
        {Communicator.DP_CPU: solo[Communicator.DP_CPU]},  # the drafter's lane left out
        {**solo, Communicator.PP_RELAY: pp_cpu},  # a relay communicator
        {**solo, Communicator.DP_DRAFTER_CPU: "group"},  # not a process group
    ]
    seen: list[tuple[str, str]] = []
    for misuse in misuses:
        try:
            env.replace_dp_groups(misuse)  # type: ignore[arg-type]
        except PureppError as error:
            seen.append((type(error).__name__, error.problem))
    # An agreement started asynchronously is in flight on DP_CPU: its group stays.
    group = dp.AgreementGroup(dp_size=2, dp_rank=0)
    facts = dp.RankBatch(num_reqs=0, num_tokens=0, need_eager=True)
    started = dp.start_agreement(dp.AgreementLanes(), group, None, facts, step=0, asynchronous=True)
    env.perform(started.effects)
    try:
        env.replace_dp_groups(solo)
    except InvalidInputError as error:
        seen.append((type(error).__name__, error.problem))
    env.perform(dp.wait_for_agreement(started.result).effects)
    env.replace_dp_groups(solo)  # waited on: nothing is in flight, so it is taken
    assert env.group("test", Communicator.DP_CPU) is solo[Communicator.DP_CPU]
    return seen


def test_replace_dp_groups_refuses_what_would_break_the_relay_or_a_lane() -> None:
    (seen,) = run_ranks(refusals, 1)
    kinds = [kind for kind, _ in seen]
    assert kinds == [ConfigError.__name__] * 4 + [InvalidInputError.__name__], seen
    assert "is a list" in seen[0][1]
    assert "not exactly dp_cpu and dp_drafter_cpu" in seen[1][1]
    assert "pp_relay" in seen[2][1]
    assert "dp_drafter_cpu to a str" in seen[3][1]
    assert "is still in flight on dp_cpu" in seen[4][1]
