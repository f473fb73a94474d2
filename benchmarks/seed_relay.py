"""The seed's PPHandler, re-expressed imperatively against torch: the relay benchmarks' baseline.

`SeedRelay` makes the seed's calls one for one, in the seed's order: a side stream that
waits on the main stream, fresh `torch.empty` receive buffers, two or three
`dist.broadcast`s on a dedicated group, `record_event`, `record_stream`; at consume the
pinned `async_tensor_h2d` of the filtered mapping, `torch.as_tensor` of the keep mask and
the boolean-mask gather of drafts (the two host syncs the seed has); on the sender
`F.pad` of sampled tokens, `torch.stack` of the counts and the draft-table gather by
idx_mapping. The ring is a deque pre-seeded with `ring_depth` Nones, and per-slot
generation counters drop rows whose slot was freed between receive and consume.

The device calls come from a `DeviceCalls` table, so one class serves three flavours:
- `cuda_calls()`: real CUDA streams, events and NCCL broadcasts (the seed as it runs);
- `host_calls()`: real tensors and gloo broadcasts on CPU, with streams, events and
  `record_stream` as no-ops (the torch interpreter treats them the same way on CPU);
- `noop_calls()`: every torch and torch.distributed call returns a placeholder at once,
  and the caller passes placeholder tensors (`placeholder`), so only the seed's
  host-side Python and numpy logic is timed.

Tensor methods (`unbind`, `contiguous`, mask and index subscripts) are called on the
tensors directly, as the seed does; in the no-op flavour they land on placeholders.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import NamedTuple, cast

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = [
    "DeviceCalls",
    "SeedBatch",
    "SeedRelay",
    "compute_need_sampled_mask",
    "cuda_calls",
    "host_calls",
    "noop_calls",
    "placeholder",
]

BoolArray = npt.NDArray[np.bool_]
Int32Array = npt.NDArray[np.int32]


@dataclass(frozen=True, slots=True)
class DeviceCalls:
    """The torch, torch.cuda and torch.distributed calls the seed makes, by role."""

    empty: Callable[..., torch.Tensor]  # torch.empty
    as_tensor: Callable[..., torch.Tensor]  # torch.as_tensor (a pageable, blocking h2d)
    pad: Callable[..., torch.Tensor]  # torch.nn.functional.pad
    stack: Callable[..., torch.Tensor]  # torch.stack
    broadcast: Callable[..., object]  # torch.distributed.broadcast
    h2d: Callable[[npt.NDArray[np.int32], torch.device], torch.Tensor]  # async_tensor_h2d
    record_stream: Callable[[torch.Tensor, torch.cuda.Stream], None]  # Tensor.record_stream
    new_stream: Callable[[torch.device], torch.cuda.Stream]  # torch.cuda.Stream
    current_stream: Callable[[torch.device], torch.cuda.Stream]  # torch.cuda.current_stream
    stream: Callable[[torch.cuda.Stream], AbstractContextManager[None]]  # torch.cuda.stream


# ---- the three flavours --------------------------------------------------------------------


def _pinned_h2d(array: npt.NDArray[np.int32], device: torch.device) -> torch.Tensor:
    # The seed's async_tensor_h2d: pinned staging memory, then a non-blocking copy.
    return torch.from_numpy(array).pin_memory().to(device, non_blocking=True)


def cuda_calls() -> DeviceCalls:
    """The seed's real calls on a CUDA device with an NCCL relay group."""
    return DeviceCalls(
        empty=torch.empty,
        as_tensor=torch.as_tensor,
        pad=F.pad,
        stack=torch.stack,
        broadcast=dist.broadcast,
        h2d=_pinned_h2d,
        record_stream=torch.Tensor.record_stream,
        new_stream=torch.cuda.Stream,
        current_stream=torch.cuda.current_stream,
        stream=torch.cuda.stream,
    )


class _NoContext:
    """A reusable context that does nothing (a stream context where there are no streams)."""

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        return None


_NO_CONTEXT = _NoContext()


class _NoEvent:
    """Stands in for a CUDA event where there are no streams."""


_NO_EVENT = _NoEvent()


class _NoStream:
    """Stands in for a CUDA stream on CPU: every kernel has finished when it returns."""

    def wait_stream(self, stream: object) -> None:
        return None

    def wait_event(self, event: object) -> None:
        return None

    def record_event(self, event: object = None) -> _NoEvent:
        return _NO_EVENT


_NO_STREAM = cast(torch.cuda.Stream, _NoStream())


def _no_stream(device: torch.device) -> torch.cuda.Stream:
    return _NO_STREAM


def _no_stream_context(stream: torch.cuda.Stream) -> AbstractContextManager[None]:
    return _NO_CONTEXT


def _no_record_stream(tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
    return None


def _host_h2d(array: npt.NDArray[np.int32], device: torch.device) -> torch.Tensor:
    # On CPU the "device" copy is a copy on the host (pinning needs CUDA), as purepp's.
    return torch.from_numpy(array.copy())


def host_calls() -> DeviceCalls:
    """Real tensors and gloo broadcasts on CPU; streams, events and record_stream are no-ops."""
    return DeviceCalls(
        empty=torch.empty,
        as_tensor=torch.as_tensor,
        pad=F.pad,
        stack=torch.stack,
        broadcast=dist.broadcast,
        h2d=_host_h2d,
        record_stream=_no_record_stream,
        new_stream=_no_stream,
        current_stream=_no_stream,
        stream=_no_stream_context,
    )


class _Placeholder:
    """What a no-op device call returns: answers the tensor methods the seed calls."""

    __slots__ = ("dtype", "shape")

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.shape = shape
        self.dtype = dtype

    def __getitem__(self, index: object) -> _Placeholder:
        return self

    def __setitem__(self, index: object, value: object) -> None:
        return None

    def contiguous(self) -> _Placeholder:
        return self

    def unbind(self, dim: int = 0) -> tuple[_Placeholder, _Placeholder]:
        return (self, self)


def placeholder(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A stand-in tensor for the no-op flavour: it has a shape and a dtype, and no data."""
    return cast(torch.Tensor, _Placeholder(shape, dtype))


_NOTHING = placeholder((0,), torch.int64)


def _nothing(*args: object, **kwargs: object) -> torch.Tensor:
    return _NOTHING


def _no_broadcast(*args: object, **kwargs: object) -> None:
    return None


def _no_h2d(array: npt.NDArray[np.int32], device: torch.device) -> torch.Tensor:
    return _NOTHING


def noop_calls() -> DeviceCalls:
    """Every device call a no-op returning a placeholder: times the seed's host logic alone."""
    return DeviceCalls(
        empty=_nothing,
        as_tensor=_nothing,
        pad=_nothing,
        stack=_nothing,
        broadcast=_no_broadcast,
        h2d=_no_h2d,
        record_stream=_no_record_stream,
        new_stream=_no_stream,
        current_stream=_no_stream,
        stream=_no_stream_context,
    )


# ---- the batch facts and the handler --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SeedBatch:
    """The slice of the seed's InputBatch the relay reads."""

    num_reqs: int
    idx_mapping: torch.Tensor  # device [n] int32: batch row -> request slot
    idx_mapping_np: Int32Array  # the same on the host
    num_computed_tokens_np: Int32Array
    num_scheduled_tokens: Int32Array
    prefill_len_np: Int32Array


def compute_need_sampled_mask(batch: SeedBatch) -> BoolArray | None:
    """Rows that produce a sampled token this step (a non-final prefill chunk does not);
    None when no row does."""
    mask: BoolArray = batch.num_computed_tokens_np + batch.num_scheduled_tokens >= (
        batch.prefill_len_np
    )
    if not mask.any():
        return None
    return mask


class PendingRecv(NamedTuple):
    """One posted receive waiting in the ring."""

    event: object  # recorded on the broadcast stream after the receives
    sampled_tokens: torch.Tensor  # [n, spec + 1] int64
    num_sampled: torch.Tensor  # [n] int32
    num_rejected: torch.Tensor  # [n] int32
    idx_mapping: torch.Tensor  # the step's device slot mapping
    idx_mapping_np: Int32Array
    need_sampled_mask: BoolArray
    gen_at_receive_np: Int32Array  # slot generations when received
    draft_tokens: torch.Tensor | None  # [n, spec] int64, or None without speculation


class SeedRelay:
    """One rank's relay, written the seed's way (mutable ring, generation counters)."""

    def __init__(
        self,
        *,
        calls: DeviceCalls,
        is_last_rank: bool,
        last_rank: int,
        ring_depth: int,
        max_num_reqs: int,
        num_speculative_steps: int,
        device: torch.device,
        group: dist.ProcessGroup | None,
    ) -> None:
        self.calls = calls
        self.is_last_rank = is_last_rank
        self.last_rank = last_rank
        self.max_sample_len = num_speculative_steps + 1
        self.num_speculative_steps = num_speculative_steps
        self.device = device
        self.main_stream = calls.current_stream(device)
        self.broadcast_stream = calls.new_stream(device)
        # Pre-seeded with ring_depth Nones so the first ring_depth consumes are no-ops.
        self.queue: deque[PendingRecv | None] = (
            deque() if is_last_rank else deque([None] * ring_depth)
        )
        self.req_idx_gen_np = np.zeros(max_num_reqs, dtype=np.int32)
        self.broadcast_group = group

    def on_req_idx_freed(self, req_idx: int) -> None:
        self.req_idx_gen_np[req_idx] += 1

    def get_prev_sampled_outputs(
        self, draft_tokens_to_update: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor] | None:
        """Consume the entry from ring_depth steps ago, minus rows freed since its receive."""
        c = self.calls
        if not self.queue:
            return None
        slot = self.queue.popleft()
        self.queue.append(None)  # this step's entry; receive fills it
        if slot is None:
            return None
        freed = self.req_idx_gen_np[slot.idx_mapping_np] != slot.gen_at_receive_np
        exclude_mask = freed | ~slot.need_sampled_mask
        idx_mapping = slot.idx_mapping
        if exclude_mask.any():
            if exclude_mask.all():
                return None
            idx_mapping_np = np.where(exclude_mask, -1, slot.idx_mapping_np)
            idx_mapping = c.h2d(idx_mapping_np, self.device)
        self.main_stream.wait_event(cast(torch.cuda.Event, slot.event))
        if slot.draft_tokens is not None and draft_tokens_to_update is not None:
            draft_tokens = slot.draft_tokens
            draft_idx_mapping = slot.idx_mapping
            if exclude_mask.any():
                keep = ~exclude_mask
                # Both of these synchronise the host: a pageable h2d and a mask gather.
                keep_t = c.as_tensor(keep, device=self.device)
                draft_tokens = draft_tokens[keep_t]
                draft_idx_mapping = c.h2d(slot.idx_mapping_np[keep], self.device)
            draft_tokens_to_update[draft_idx_mapping] = draft_tokens
        return {
            "sampled_tokens": slot.sampled_tokens,
            "num_sampled": slot.num_sampled,
            "num_rejected": slot.num_rejected,
            "idx_mapping": idx_mapping,
        }

    def broadcast_drafts(self, draft_tokens: torch.Tensor, input_batch: SeedBatch) -> None:
        """Send the batch's rows of the draft table (last rank)."""
        assert self.is_last_rank
        c = self.calls
        if compute_need_sampled_mask(input_batch) is None:
            return
        with c.stream(self.broadcast_stream):
            self.broadcast_stream.wait_stream(self.main_stream)
            send = draft_tokens[input_batch.idx_mapping].contiguous()
            # The mapping was made on the main stream and is read here.
            c.record_stream(input_batch.idx_mapping, self.broadcast_stream)
            c.broadcast(send, src=self.last_rank, group=self.broadcast_group)

    def receive(self, input_batch: SeedBatch) -> bool:
        """Post this step's receives (non-last rank); True iff every row needs its token."""
        assert not self.is_last_rank
        c = self.calls
        need_sampled_mask = compute_need_sampled_mask(input_batch)
        if need_sampled_mask is None:
            return False
        # Snapshot, so a later free of any of these slots is detectable at consume.
        gen_at_receive_np = self.req_idx_gen_np[input_batch.idx_mapping_np]
        num_reqs = input_batch.num_reqs
        with c.stream(self.broadcast_stream):
            self.broadcast_stream.wait_stream(self.main_stream)
            sampled_tokens = c.empty(
                num_reqs, self.max_sample_len, dtype=torch.int64, device=self.device
            )
            combined = c.empty(2, num_reqs, dtype=torch.int32, device=self.device)
            c.broadcast(sampled_tokens, src=self.last_rank, group=self.broadcast_group)
            c.broadcast(combined, src=self.last_rank, group=self.broadcast_group)
            draft_tokens = None
            if self.num_speculative_steps > 0:
                draft_tokens = c.empty(
                    num_reqs, self.num_speculative_steps, dtype=torch.int64, device=self.device
                )
                c.broadcast(draft_tokens, src=self.last_rank, group=self.broadcast_group)
            event = self.broadcast_stream.record_event()
        num_sampled, num_rejected = combined.unbind(dim=0)
        # Allocated on the broadcast stream, read on main at consume.
        c.record_stream(sampled_tokens, self.main_stream)
        c.record_stream(combined, self.main_stream)
        if draft_tokens is not None:
            c.record_stream(draft_tokens, self.main_stream)
        self.queue[-1] = PendingRecv(
            event,
            sampled_tokens,
            num_sampled,
            num_rejected,
            input_batch.idx_mapping,
            input_batch.idx_mapping_np,
            need_sampled_mask,
            gen_at_receive_np,
            draft_tokens,
        )
        return bool(need_sampled_mask.all())

    def broadcast(
        self,
        sampled_token_ids: torch.Tensor,
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
        input_batch: SeedBatch,
    ) -> None:
        """Send sampled tokens, padded to the fixed wire width, and their counts (last rank)."""
        assert self.is_last_rank
        c = self.calls
        if compute_need_sampled_mask(input_batch) is None:
            return
        assert sampled_token_ids.dtype == torch.int64
        with c.stream(self.broadcast_stream):
            self.broadcast_stream.wait_stream(self.main_stream)
            send_tokens = c.pad(
                sampled_token_ids, (0, self.max_sample_len - sampled_token_ids.shape[-1])
            )
            c.broadcast(send_tokens.contiguous(), src=self.last_rank, group=self.broadcast_group)
            combined = c.stack((num_sampled, num_rejected), dim=0)
            c.broadcast(combined, src=self.last_rank, group=self.broadcast_group)
            for tensor in (sampled_token_ids, num_sampled, num_rejected):
                c.record_stream(tensor, self.broadcast_stream)
