"""The device kernels the torch interpreter and CUDA-graph capture share: dtypes, the
packed wire's section views, packing, the column pad and the row scatter.

A module of its own below both, so that capture (above the plans) need not import the
interpreter, and no two modules import each other.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F

from purepp.effects._environment import itemsize
from purepp.effects.vocabulary import DType, Section

__all__ = [
    "TORCH_DTYPES",
    "pack",
    "pad_columns",
    "scatter_rows",
    "section_view",
    "section_views",
    "torch_dtype",
]


def torch_dtype(dtype: DType) -> torch.dtype:
    """The torch dtype a vocabulary dtype stands for."""
    match dtype:
        case DType.INT64:
            return torch.int64
        case DType.INT32:
            return torch.int32
        case _:
            typing.assert_never(dtype)


TORCH_DTYPES: dict[DType, torch.dtype] = {d: torch_dtype(d) for d in DType}
_ITEMSIZE: dict[DType, int] = {d: itemsize(d) for d in DType}


def section_view(packed: torch.Tensor, section: Section) -> torch.Tensor:
    """The region of the contiguous `packed` buffer that `section` names, as a view."""
    dtype = TORCH_DTYPES[section.dtype]
    itemsize = _ITEMSIZE[section.dtype]
    count = math.prod(section.shape)
    if packed.dtype.itemsize >= itemsize:
        # The common case (an int64 wire, int64 or int32 sections) in one to three view
        # ops: the section's offset is a multiple of its own element size (checked at the
        # boundary).
        flat = packed if packed.dim() == 1 else packed.reshape(-1)
        if flat.dtype is not dtype:
            flat = flat.view(dtype)
        start = section.offset // itemsize
        region = flat[start : start + count]
        return region if len(section.shape) == 1 else region.view(*section.shape)
    size = count * itemsize
    # Flat first: viewing a 2-D buffer as bytes keeps its leading dimension.
    raw = packed.reshape(-1).view(torch.uint8)[section.offset : section.offset + size]
    return raw.view(TORCH_DTYPES[section.dtype]).view(*section.shape)


def section_views(packed: torch.Tensor, sections: Sequence[Section]) -> list[torch.Tensor]:
    """`section_view` of each section: the views an Unpack binds, in one pass.

    On a contiguous buffer (every wire), each dtype is viewed once and each section is
    one `as_strided` of it: a third of the tensor ops of viewing, slicing and reshaping
    each section in turn, and Unpack runs on every received step.
    """
    if not packed.is_contiguous():
        return [section_view(packed, section) for section in sections]
    wire_itemsize = packed.dtype.itemsize
    flats: dict[DType, torch.Tensor] = {}
    views = []
    for section in sections:
        itemsize = _ITEMSIZE[section.dtype]
        shape = section.shape
        start, misaligned = divmod(section.offset, itemsize)
        flat = flats.get(section.dtype)
        if flat is None and itemsize <= wire_itemsize:
            dtype = TORCH_DTYPES[section.dtype]
            flat = flats[section.dtype] = packed if packed.dtype is dtype else packed.view(dtype)
        if flat is None or misaligned or start + math.prod(shape) > flat.numel():
            views.append(section_view(packed, section))  # the general way (or its error)
            continue
        strides = (1,) if len(shape) == 1 else _contiguous_strides(shape)
        views.append(flat.as_strided(shape, strides, flat.storage_offset() + start))
    return views


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1]
    for size in reversed(shape[1:]):
        strides.append(strides[-1] * size)
    return tuple(reversed(strides))


def pack(out: torch.Tensor, sections: Iterable[tuple[Section, torch.Tensor]]) -> None:
    """Copy each source into the top-left corner of its section of the zeroed `out`."""
    for section, source in sections:
        region = section_view(out, section)
        if region.shape != source.shape:
            region = region[tuple(slice(0, size) for size in source.shape)]
        region.copy_(source)


def pad_columns(source: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    """A new row-major tensor: `source`'s rows, padded with `fill` up to `width` columns.

    Always a copy, even with nothing to add: send buffers are snapshots. Row-major too:
    `F.pad` keeps a non-contiguous source's strides (a transposed sampler output stays
    transposed), and a broadcast sends memory order, so each row's tokens would scatter
    over the receivers' rows, as the seed's `.contiguous()` before its send prevents.
    """
    return F.pad(source, (0, width - source.shape[1]), value=fill).contiguous()


def scatter_rows(
    source: torch.Tensor, index: torch.Tensor, target: torch.Tensor, *, skips: bool
) -> None:
    """`target[index[i]] = source[i]` where `index[i] != -1`, queued with no host sync.

    Without skipped rows (`skips` False) that is one indexed write. Otherwise filtering
    the skipped rows would need their count on the host, so the rows are written into a
    copy of the table with one spare row at its end, which index -1 names (a negative
    index counts from the end), and the table's own rows are copied back: three kernels
    (the sum of each row's change it replaces took six: 64 rows cost 33-38 µs of host
    time against 50-56 on the H200 host; benchmarks/relay_floor.py times both). Skipped
    rows may collide in the spare row, which is dropped; kept rows name distinct slots
    (the relay maps each slot to one row), so the result is exact, and the index never
    reaches the host. So nothing checks it here: -2 writes the table's last row and
    `rows` the spare row (checked mode refuses both for a host index; the handlers refuse
    a table shorter than the scatter's declared `target_rows`, in every mode).
    """
    if not skips:
        try:
            target.index_put_((index,), source)
        except RuntimeError:
            # torch refuses a source or index sharing the target's memory (a scatter of a
            # buffer into itself) before it writes: read them whole first, as numpy does.
            # Only on this error path, so the common scatter costs nothing more.
            if not (_shares_memory(source, target) or _shares_memory(index, target)):
                raise
            target.index_put_((index.clone(),), source.clone())
        return
    spare = torch.cat((target, target[:1]))
    spare.index_put_((index,), source)
    target.copy_(spare[:-1])


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata  # one StorageImpl
