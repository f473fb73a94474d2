"""purepp: pipeline- and data-parallel coordination as pure functions over immutable state.

The pure core (no torch): `purepp.relay` (the PP sampled-token relay), `purepp.dp` and
`purepp.cudagraph` (the DP agreement and CUDA-graph dispatch), `purepp.batch`,
`purepp.step`, `purepp.errors`. The effects (`purepp.effects`): the vocabulary, the
log, the interpreters, the simulator and the checker. The runner (`purepp.runner`):
a research decode loop and the `purepp` command.
"""

from purepp.batch import BatchFacts, need_sampled_mask
from purepp.cudagraph import (
    BatchExecutionDescriptor,
    CaptureMode,
    CudaGraphDispatcher,
    CUDAGraphMode,
)
from purepp.dp import (
    DispatchOutcome,
    DPSyncState,
    PendingAgreement,
    finish_agreement,
    start_agreement,
    wait_for_agreement,
)
from purepp.errors import PureppError
from purepp.relay import (
    ConsumedOutputs,
    RelayConfig,
    RelayState,
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
    "BatchExecutionDescriptor",
    "BatchFacts",
    "CUDAGraphMode",
    "CaptureMode",
    "ConsumedOutputs",
    "CudaGraphDispatcher",
    "DPSyncState",
    "DispatchOutcome",
    "PendingAgreement",
    "PureppError",
    "RelayConfig",
    "RelayState",
    "Step",
    "broadcast_drafts",
    "broadcast_sampled",
    "consume_previous_step",
    "end_step",
    "finish_agreement",
    "free_request_slot",
    "free_request_slots",
    "init_relay",
    "need_sampled_mask",
    "receive",
    "relay_aux_hidden_states",
    "start_agreement",
    "wait_for_agreement",
]
