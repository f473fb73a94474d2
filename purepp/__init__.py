"""purepp: pipeline- and data-parallel coordination as pure functions over immutable state.

The front door exports what an embedder needs:

- the rank step (`purepp.rank`): one rank's decode step as one program, in three typed
  phases (`begin`, `agree`, `finish`) that `RankDriver` performs on an interpreter;
- the pure core (no torch): the relay (`purepp.relay`), the DP agreement and CUDA-graph
  dispatch (`purepp.dp`, `purepp.cudagraph`), batch facts, the `Step` contract, errors.

Interpreters, logs, the simulator and the checker live in `purepp.effects`; seeded
schedules and simulated worlds for embedders' tests in `purepp.testing`; the research
runner and the `purepp` command in `purepp.runner`.
"""

from purepp.batch import BatchFacts, need_sampled_mask
from purepp.cudagraph import (
    BatchExecutionDescriptor,
    CaptureMode,
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
    LaneBusyError,
    MicrobatchConfig,
    PendingAgreement,
    RankBatch,
    TableLayout,
    decide_alone,
    finish_agreement,
    start_agreement,
    wait_for_agreement,
)
from purepp.errors import PureppError
from purepp.rank import (
    Agreed,
    Begun,
    RankConfig,
    RankDriver,
    RankState,
    RankSteps,
    Sampled,
    ShapeFacts,
    StepIO,
    init_rank,
)
from purepp.relay import (
    ConsumedOutputs,
    Platform,
    RelayConfig,
    RelayInputs,
    RelayState,
    Wire,
    broadcast_drafts,
    broadcast_sampled,
    consume_previous_step,
    end_step,
    free_request_slot,
    free_request_slots,
    init_relay,
    receive,
    relay_aux_hidden_states,
)
from purepp.step import Step

__all__ = [
    "Agreed",
    "AgreementGroup",
    "AgreementLanes",
    "BatchExecutionDescriptor",
    "BatchFacts",
    "Begun",
    "CUDAGraphMode",
    "CaptureMode",
    "ConsumedOutputs",
    "CudaGraphDispatcher",
    "DPSyncState",
    "DispatchOutcome",
    "Dispatcher",
    "Lane",
    "LaneBusyError",
    "MicrobatchConfig",
    "PendingAgreement",
    "Platform",
    "PureppError",
    "RankBatch",
    "RankConfig",
    "RankDriver",
    "RankState",
    "RankSteps",
    "RelayConfig",
    "RelayInputs",
    "RelayState",
    "Sampled",
    "ShapeFacts",
    "Step",
    "StepIO",
    "TableLayout",
    "Wire",
    "broadcast_drafts",
    "broadcast_sampled",
    "consume_previous_step",
    "decide_alone",
    "end_step",
    "finish_agreement",
    "free_request_slot",
    "free_request_slots",
    "init_rank",
    "init_relay",
    "need_sampled_mask",
    "receive",
    "relay_aux_hidden_states",
    "start_agreement",
    "wait_for_agreement",
]
