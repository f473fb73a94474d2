"""A DP rank dies mid-run on real gloo ranks, and the survivors go on (vllm#44428).

What the README tells an embedder: the survivors mark the rank dead
(`AgreementGroup.mark_dead`), all-reduce over groups of their own (the dead rank can
never join one that holds it), swapped into the interpreter they have
(`TorchInterpreter.replace_dp_groups`), and agree again from the failed step's `Begun`
on a new `RankDriver`. From then on they decide as a world that never had the dead rank
would. (tests/test_dead_replica_gloo.py does the same on a pipeline of two stages.)
"""

from __future__ import annotations

import datetime
import os

import attrs
import numpy as np
import pytest
import torch
import torch.distributed as dist

from purepp import dp
from purepp.batch import BatchFacts
from purepp.cudagraph import BatchExecutionDescriptor, CaptureMode, CudaGraphDispatcher
from purepp.effects.io import TorchIO
from purepp.effects.torch_interpreter import TorchInterpreter, build_communicators
from purepp.effects.vocabulary import Communicator
from purepp.errors import PeerFailureError
from purepp.rank import RankConfig, RankDriver, RankState, Sampled, ShapeFacts, init_rank
from purepp.relay import RelayConfig
from tests._dist import RankContext, describe_outcomes, spawn_ranks

STEPS, DIES_AT, DEAD, SLOTS = 6, 3, 2, 4
DISPATCHER = CudaGraphDispatcher(
    capture_sizes=(1, 2, 4, 8), capture_mode=CaptureMode.FULL, max_num_reqs=SLOTS
)


def planned(replica: int, step: int) -> tuple[BatchFacts, ShapeFacts]:
    """Uniform decodes. The survivors' fit a captured graph (0..2 rows, an idle one on
    some steps, 1 or 2 tokens each); the rank that dies schedules too many for any graph,
    so while it lives every rank runs eager."""
    rows, tokens = ((replica + step) % 3, 1 + step % 2) if replica != DEAD else (3, 5)
    batch = BatchFacts(
        idx_mapping=np.arange(rows, dtype=np.int32),
        num_computed_tokens=np.full(rows, 10, np.int32),
        num_scheduled_tokens=np.full(rows, tokens, np.int32),
        prefill_len=np.full(rows, 4, np.int32),
    )
    shape = ShapeFacts(num_tokens=rows * tokens, uniform_token_count=tokens if rows else None)
    return batch, shape


def expected(replicas: int, replica: int, step: int) -> BatchExecutionDescriptor:
    """The pure agreement of a `replicas`-rank world that never had another."""
    pendings = []
    for rank in range(replicas):
        batch, shape = planned(rank, step)
        facts = dp.RankBatch(
            num_reqs=batch.num_reqs,
            num_tokens=shape.num_tokens,
            uniform_token_count=shape.uniform_token_count,
        )
        group = dp.AgreementGroup(dp_size=replicas, dp_rank=rank)
        pendings.append(
            dp.start_agreement(dp.AgreementLanes(), group, DISPATCHER, facts, step=step)
        )
    table = np.zeros_like(pendings[0].result.contribution)
    for pending in pendings:
        contribution = pending.result.contribution
        assert contribution is not None  # a group of several ranks all-reduces
        table += contribution
    mine = pendings[replica]
    return dp.finish_agreement(mine.state, mine.result, table).result.descriptor


def survive(ctx: RankContext) -> list[tuple[int, BatchExecutionDescriptor]]:
    world = list(range(ctx.world_size))
    groups = build_communicators(
        pp_groups=[[rank] for rank in world],
        dp_groups=[world],
        relay_backend="gloo",
        timeout=ctx.timeout,
    )
    config = RankConfig(
        relay=RelayConfig.for_stage(pp_size=1, stage=0, max_num_reqs=SLOTS, first_rank=ctx.rank),
        group=dp.AgreementGroup(dp_size=ctx.world_size, dp_rank=ctx.rank),
        dispatcher=DISPATCHER,
    )
    interpreter = TorchInterpreter(device=ctx.device, groups=groups, rank=ctx.rank)
    driver = RankDriver(config, interpreter, TorchIO(interpreter))
    state: RankState = init_rank(config)
    agreed_at: list[tuple[int, BatchExecutionDescriptor]] = []
    while state.step < STEPS:
        if ctx.rank == DEAD and state.step == DIES_AT:
            os._exit(3)  # dies without a word
        batch, shape = planned(ctx.rank, state.step)
        begun = driver.begin(state)
        try:
            agreed = driver.agree(begun, batch, shape)
        except PeerFailureError:
            if DEAD not in config.group.live:
                raise
            survivors = [rank for rank in world if rank != DEAD]
            # Only the survivors make these groups: the dead rank can never join one.
            regroup = {}
            for comm in (Communicator.DP_CPU, Communicator.DP_DRAFTER_CPU):
                made = dist.new_group(
                    survivors, backend="gloo", timeout=ctx.timeout, use_local_synchronization=True
                )
                assert isinstance(made, dist.ProcessGroup)  # this rank is a member
                regroup[comm] = made
            interpreter.replace_dp_groups(regroup)
            config = attrs.evolve(config, group=config.group.mark_dead(DEAD))
            driver = RankDriver(config, interpreter, TorchIO(interpreter))
            agreed = driver.agree(begun, batch, shape)  # the same Begun: its consume is done
        agreed_at.append((state.step, agreed.descriptor))
        rows = batch.num_reqs
        sampled = Sampled(
            tokens=torch.zeros((rows, 1), dtype=torch.int64),
            num_sampled=torch.ones(rows, dtype=torch.int32),
            num_rejected=torch.zeros(rows, dtype=torch.int32),
        )
        state = driver.finish(agreed, sampled)
    return agreed_at


@pytest.mark.multiprocess
def test_survivors_of_a_dead_rank_regroup_and_agree_as_a_world_without_it() -> None:
    outcomes = spawn_ranks(survive, 3, timeout=datetime.timedelta(seconds=10), deadline_s=120.0)
    assert not outcomes[DEAD].returned
    assert outcomes[DEAD].exitcode == 3
    for replica in (0, 1):
        outcome = outcomes[replica]
        assert outcome.returned, describe_outcomes(outcomes)
        assert outcome.value is not None
        agreed = dict(outcome.value)
        assert sorted(agreed) == list(range(STEPS))
        for step, descriptor in agreed.items():
            replicas = 3 if step < DIES_AT else 2
            assert descriptor == expected(replicas, replica, step), (replica, step)
    # The death changed the decisions: graphs after it, where three ranks run eager.
    assert any(
        expected(3, replica, step) != expected(2, replica, step)
        for replica in (0, 1)
        for step in range(DIES_AT, STEPS)
    )
