"""A second review of the relay's parity: with the seed, between wires, between interpreters.

Each test states one behaviour. The ones that fail on the code as reviewed are bugs the
review found; their docstrings say what the correct behaviour is and where it comes from
(the seed's `PPHandler`, DESIGN.md, the README).
"""

from __future__ import annotations

import datetime

import numpy as np
import numpy.typing as npt
import pytest
import torch
import torch.distributed as dist

from purepp.batch import BatchFacts
from purepp.effects.numpy_interpreter import NumpyInterpreter
from purepp.effects.torch_interpreter import TorchInterpreter, build_communicators
from purepp.effects.vocabulary import BufferRef, Communicator, DType, Effect, TensorSpec
from purepp.errors import InterpreterError
from purepp.relay import (
    RelayConfig,
    RelayState,
    Wire,
    broadcast_drafts,
    broadcast_sampled,
    consume_previous_step,
    end_step,
    init_relay,
    receive,
)
from tests._dist import RankContext, run_ranks

CPU = torch.device("cpu")


def decode_batch(slots: list[int]) -> BatchFacts:
    """A batch of decode rows (every row samples) on `slots`."""
    n = len(slots)
    return BatchFacts(
        idx_mapping=np.array(slots, dtype=np.int32),
        num_computed_tokens=np.full(n, 10, dtype=np.int32),
        num_scheduled_tokens=np.ones(n, dtype=np.int32),
        prefill_len=np.full(n, 4, dtype=np.int32),
    )


# ---- the sender's snapshot of a non-contiguous sampler output -------------------------------

# Three rows of spec + 1 = 2 tokens, row r = [10 r + 1, 10 r + 2]; the sampler hands them
# out transposed (dense, but column-major): a full-width tensor that is not contiguous.
TOKENS = [[1, 2], [11, 12], [21, 22]]


def transposed_tokens() -> torch.Tensor:
    column_major = torch.tensor([1, 11, 21, 2, 12, 22], dtype=torch.int64)
    tokens = column_major.as_strided((3, 2), (1, 3), 0)  # what `.t()` of a [2, 3] gives
    assert not tokens.is_contiguous()
    assert tokens.tolist() == TOKENS
    return tokens


def _sender_config() -> RelayConfig:
    # The last stage on global rank 0 of a one-rank world: only the sender is observed.
    return RelayConfig(pp_size=2, stage=1, last_rank=0, max_num_reqs=4, num_speculative_steps=1)


def _send_once(
    interp: TorchInterpreter | NumpyInterpreter, tokens: torch.Tensor | npt.NDArray[np.int64]
) -> list[list[int]]:
    """One seed-wire send of `tokens`; the snapshot it broadcast, row-major, as a list."""
    config = _sender_config()
    inputs = config.inputs
    if isinstance(interp, TorchInterpreter):
        assert isinstance(tokens, torch.Tensor)
        interp.bind(inputs.sampled_tokens, tokens)
        interp.bind(inputs.num_sampled, torch.ones(3, dtype=torch.int32))
        interp.bind(inputs.num_rejected, torch.zeros(3, dtype=torch.int32))
    else:
        assert isinstance(tokens, np.ndarray)
        interp.bind(inputs.sampled_tokens, tokens)
        interp.bind(inputs.num_sampled, np.ones(3, dtype=np.int32))
        interp.bind(inputs.num_rejected, np.zeros(3, dtype=np.int32))
    sent = broadcast_sampled(
        config, init_relay(config), decode_batch([0, 1, 2]), TensorSpec((3, 2), DType.INT64)
    )
    interp.perform(sent.effects)
    snapshot = BufferRef("relay.step0.send_sampled_tokens")
    if isinstance(interp, TorchInterpreter):
        sent_tensor = interp.tensor(snapshot)
        # What a broadcast puts on the wire: the storage, in memory order.
        memory = sent_tensor.as_strided((sent_tensor.numel(),), (1,), sent_tensor.storage_offset())
        flat: list[int] = memory.tolist()
    else:
        flat = np.asarray(interp.tensor(snapshot)).reshape(-1).tolist()
    return [flat[i : i + 2] for i in range(0, len(flat), 2)]


def test_checked_torch_sends_a_full_width_non_contiguous_sampler_output(
    groups: dict[Communicator, dist.ProcessGroup],
) -> None:
    """Behaviour: the last stage's seed-wire send of a sampler output already spec + 1
    wide but not contiguous (a transposed view) performs in checked mode, as in numpy.

    The seed pads the tokens and sends `send_tokens.contiguous()`; purepp's PadColumns is
    its snapshot (FF5, "send buffers are snapshots"). The torch interpreter builds it with
    `F.pad(source, (0, 0))`, which with nothing to add is a clone that keeps the source's
    strides, so checked mode refuses the relay's own snapshot ("buffer ... is not
    contiguous. Fix: ... make a snapshot with PadColumns", which it did), while the numpy
    reference performs the same program (contract: checked torch gives numpy's outcome)."""
    reference = NumpyInterpreter(rank=0)
    assert _send_once(reference, np.array(TOKENS, dtype=np.int64).T.copy().T) == TOKENS
    checked = TorchInterpreter(device=CPU, groups=groups, rank=0, checked=True)
    assert _send_once(checked, transposed_tokens()) == TOKENS


def test_eager_torch_snapshots_a_non_contiguous_sampler_output_in_row_major_order(
    groups: dict[Communicator, dist.ProcessGroup],
) -> None:
    """Behaviour: in eager mode the seed-wire send snapshot of a full-width, non-contiguous
    sampler output holds the tokens in row-major order, which is what a broadcast sends.

    The seed calls `.contiguous()` on the padded tokens before broadcasting. purepp's
    eager PadColumns keeps the transposed strides, so the broadcast (gloo sends the
    storage as it lies; NCCL refuses a non-contiguous tensor) carries [[1, 11], [21, 2],
    [12, 22]] instead of the tokens. Fix: make the PadColumns output contiguous
    (`F.pad(...).contiguous()`, or `new_full` + a copy into its first columns)."""
    eager = TorchInterpreter(device=CPU, groups=groups, rank=0)
    assert _send_once(eager, transposed_tokens()) == TOKENS


def _relay_transposed_tokens(ctx: RankContext) -> list[list[int]] | None:
    """Rank 1 (last stage) sends `TOKENS` transposed at step 0; rank 0 consumes it at step 2."""
    groups = build_communicators(
        pp_groups=[[0, 1]],
        dp_groups=[[0], [1]],
        relay_backend="gloo",
        timeout=datetime.timedelta(seconds=20),
    )
    interp = TorchInterpreter(device=ctx.device, groups=groups, rank=ctx.rank)
    # Speculation 1, tokens 2 wide: the full-width case, where PadColumns adds nothing.
    config = RelayConfig.for_stage(
        pp_size=2, stage=ctx.rank, max_num_reqs=4, num_speculative_steps=1
    )
    inputs = config.inputs
    state: RelayState = init_relay(config)
    batch = decode_batch([0, 1, 2])
    got = None
    for step in range(3):
        interp.bind(inputs.idx_mapping, torch.tensor([0, 1, 2], dtype=torch.int32))
        effects: list[Effect] = []
        if config.is_last_stage:
            interp.bind(inputs.sampled_tokens, transposed_tokens())
            interp.bind(inputs.num_sampled, torch.ones(3, dtype=torch.int32))
            interp.bind(inputs.num_rejected, torch.zeros(3, dtype=torch.int32))
            sent = broadcast_sampled(config, state, batch, TensorSpec((3, 2), DType.INT64))
            effects, state = list(sent.effects), sent.state
            # The drafts travel in their own broadcast on the seed's wire.
            interp.bind(inputs.draft_table, torch.zeros((4, 1), dtype=torch.int64))
            drafted = broadcast_drafts(config, state, batch, TensorSpec((4, 1), DType.INT64))
            effects, state = effects + list(drafted.effects), drafted.state
        else:
            taken = consume_previous_step(config, state)
            interp.perform(taken.effects)
            if taken.result is not None and step == 2:
                got = interp.tensor(taken.result.sampled_tokens).tolist()
            posted = receive(config, taken.state, batch)
            effects, state = list(posted.effects), posted.state
        interp.perform(tuple(effects))
        ended = end_step(config, state)
        interp.perform(ended.effects)
        state = ended.state
    return got


@pytest.mark.multiprocess
def test_a_receiver_gets_a_non_contiguous_sampler_outputs_tokens_over_gloo() -> None:
    """Behaviour: over two real gloo ranks, the stage that consumes step 0's entry gets the
    tokens the last stage sampled, even when its sampler handed them out transposed.

    The seed's sender makes them contiguous before `torch.distributed.broadcast`, so its
    receivers always get the tokens. purepp's eager sender broadcasts a snapshot that kept
    the transposed strides, and gloo sends its storage as laid out: the receiver gets
    [[1, 11], [21, 2], [12, 22]], wrong tokens for every row, silently."""
    got = run_ranks(_relay_transposed_tokens, 2, deadline_s=90.0)
    assert got[0] == TOKENS


# ---- the packed wire's counts, in the dtype the wire declares -------------------------------


def _packed_send(interp: TorchInterpreter, num_sampled: torch.Tensor) -> None:
    config = RelayConfig(
        pp_size=2, stage=1, last_rank=0, max_num_reqs=4, num_speculative_steps=1, wire=Wire.PACKED
    )
    inputs = config.inputs
    interp.bind(inputs.sampled_tokens, torch.ones((3, 2), dtype=torch.int64))
    interp.bind(inputs.num_sampled, num_sampled)
    interp.bind(inputs.num_rejected, torch.zeros(3, dtype=torch.int32))
    interp.bind(inputs.draft_table, torch.zeros((4, 1), dtype=torch.int64))
    interp.bind(inputs.idx_mapping, torch.tensor([0, 1, 2], dtype=torch.int32))
    sent = broadcast_sampled(
        config,
        init_relay(config),
        decode_batch([0, 1, 2]),
        TensorSpec((3, 2), DType.INT64),
        TensorSpec((4, 1), DType.INT64),
    )
    interp.perform(sent.effects)


@pytest.mark.parametrize("checked", [False, True], ids=["eager", "checked"])
@pytest.mark.parametrize(
    "num_sampled",
    [torch.tensor([1, 1, 2**40]), torch.ones((3, 1), dtype=torch.int32)],
    ids=["int64 past int32", "[3, 1] for [3]"],
)
def test_the_packed_wire_refuses_counts_that_do_not_fit_their_section_in_every_mode(
    groups: dict[Communicator, dist.ProcessGroup], checked: bool, num_sampled: torch.Tensor
) -> None:
    """Behaviour: a packed send of counts bound in another dtype or rank than the wire's
    int32 [n] is refused with the same typed error in eager mode as in checked mode.

    The seed wire's eager broadcast refuses them (its wire check). The packed wire's Pack
    copied them with `copy_`, which casts and broadcasts silently: an int64 count of 2**40
    went out as 0, and a [3, 1] tensor filled the section by broadcasting."""
    interp = TorchInterpreter(device=CPU, groups=groups, rank=0, checked=checked)
    with pytest.raises(InterpreterError, match="does not fit section"):
        _packed_send(interp, num_sampled)


def test_the_packed_wire_sends_counts_that_fit_in_eager_mode(
    groups: dict[Communicator, dist.ProcessGroup],
) -> None:
    """The control of the test above: int32 [n] counts pack and send."""
    interp = TorchInterpreter(device=CPU, groups=groups, rank=0)
    _packed_send(interp, torch.ones(3, dtype=torch.int32))
