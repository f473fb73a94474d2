"""Per-step batch facts, replicated on every rank, and the need-sampled mask."""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt

from purepp.effects.arrays import ARRAY_EQ, BoolArray, IntArray, int32_array, readonly
from purepp.errors import InvalidInputError

__all__ = ["BatchFacts", "need_sampled_mask"]


def _check_lengths(instance: BatchFacts) -> None:
    n = instance.idx_mapping.shape[0]
    for name in ("num_computed_tokens", "num_scheduled_tokens", "prefill_len"):
        array: IntArray = getattr(instance, name)
        if array.ndim != 1 or array.shape[0] != n:
            raise InvalidInputError(
                "BatchFacts",
                f"{name} has shape {array.shape} but idx_mapping has {n} rows",
                "pass one entry per batch row in every array",
            )
        if (array < 0).any():
            raise InvalidInputError(
                "BatchFacts",
                f"{name} holds a negative count {int(array.min())}",
                "token counts are >= 0",
            )
    if instance.idx_mapping.ndim != 1 or (instance.idx_mapping < 0).any():
        raise InvalidInputError(
            "BatchFacts",
            f"idx_mapping must be 1-D slot indices >= 0, got {instance.idx_mapping.tolist()}",
            "map each batch row to the request slot it belongs to",
        )


@attrs.frozen(kw_only=True)
class BatchFacts:
    """The host-side facts of one step's batch that every rank shares.

    All arrays are read-only int32 copies, one entry per batch row.
    """

    # batch row -> request slot
    idx_mapping: IntArray = attrs.field(converter=int32_array, eq=ARRAY_EQ, hash=False)
    # tokens already computed
    num_computed_tokens: IntArray = attrs.field(converter=int32_array, eq=ARRAY_EQ, hash=False)
    # tokens scheduled this step
    num_scheduled_tokens: IntArray = attrs.field(converter=int32_array, eq=ARRAY_EQ, hash=False)
    # prompt length (the prefill to finish)
    prefill_len: IntArray = attrs.field(converter=int32_array, eq=ARRAY_EQ, hash=False)

    def __attrs_post_init__(self) -> None:
        _check_lengths(self)

    @property
    def num_reqs(self) -> int:
        return int(self.idx_mapping.shape[0])


def need_sampled_mask(batch: BatchFacts) -> BoolArray | None:
    """Rows that produce a sampled token this step; None when no row does.

    A row samples once its computed plus scheduled tokens reach the prefill
    length: a non-final prefill chunk produces nothing to relay.
    """
    mask: npt.NDArray[np.bool_] = (
        batch.num_computed_tokens + batch.num_scheduled_tokens >= batch.prefill_len
    )
    if not mask.any():
        return None
    out: BoolArray = readonly(mask, np.bool_)
    return out
