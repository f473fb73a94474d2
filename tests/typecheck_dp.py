"""Type-only tests of the DP agreement's API: mypy checks this file, pytest never runs it.

They pin that any CUDA-graph manager with the right `dispatch` plugs in (no subclass of
anything purepp defines), and the one shape of a start and a finish.
"""

from __future__ import annotations

from typing import assert_type

import numpy as np

from purepp.cudagraph import (
    BatchExecutionDescriptor,
    CudaGraphDispatcher,
    CUDAGraphMode,
    Dispatcher,
)
from purepp.dp import (
    AgreementGroup,
    AgreementLanes,
    DispatchOutcome,
    DPSyncState,
    Lane,
    PendingAgreement,
    RankBatch,
    finish_agreement,
    start_agreement,
    wait_for_agreement,
)
from purepp.effects.vocabulary import BufferRef, Effect
from purepp.step import Step


class MyGraphs:
    """A runner's own CUDA-graph manager: it subclasses nothing."""

    def dispatch(
        self,
        num_reqs: int,
        num_tokens: int,
        uniform_token_count: int | None,
        *,
        num_active_loras: int = 0,
        max_query_len: int | None = None,
    ) -> BatchExecutionDescriptor:
        return BatchExecutionDescriptor(
            cg_mode=CUDAGraphMode.NONE, num_tokens=num_tokens, num_reqs=num_reqs
        )


def _dispatchers_are_structural(graphs: CudaGraphDispatcher) -> None:
    mine: Dispatcher = MyGraphs()
    theirs: Dispatcher = graphs
    assert_type(mine.dispatch(1, 1, None), BatchExecutionDescriptor)
    assert_type(theirs.dispatch(1, 1, None, num_active_loras=0), BatchExecutionDescriptor)


def _one_start_shape() -> None:
    group = AgreementGroup(dp_size=2, dp_rank=1, live_ranks={0, 1})
    lanes = AgreementLanes()
    facts = RankBatch(num_reqs=2, num_tokens=4, uniform_token_count=2)
    started = start_agreement(lanes, group, MyGraphs(), facts, step=3, lane=Lane.DRAFTER)
    assert_type(started, Step[AgreementLanes, PendingAgreement])
    assert_type(started.effects, tuple[Effect, ...])
    waited = wait_for_agreement(started.result)
    assert_type(waited.result, BufferRef | None)
    table = None if waited.result is None else np.zeros((5, 2), dtype=np.int32)
    finished = finish_agreement(started.state, started.result, table)
    assert_type(finished, Step[AgreementLanes, DispatchOutcome])
    assert_type(finished.result.sync, DPSyncState | None)
    assert_type(finished.result.descriptor.num_ubatches, int)
    reuse = start_agreement(
        finished.state, group, None, RankBatch(num_reqs=2, num_tokens=4, need_eager=True), step=3
    )
    assert_type(reuse.result.decided, DispatchOutcome | None)
