"""The effect vocabulary: inert, comparable data that says what to do on devices.

Pure steps return effects; interpreters (torch, recorder, simulator) give them
meaning. Device buffers, events, async work, streams and communicators appear only
as symbolic references, so a step never touches a tensor. Every effect carries the
decode step it belongs to and the operation that emitted it, so a log of effects
reads like a flight recorder.
"""

from __future__ import annotations

import enum
import typing
from collections.abc import Iterable
from typing import Final, Literal, TypeAlias

import attrs

from purepp._text import a_type
from purepp.effects.arrays import ARRAY_EQ, IntArray, int32_array, reduce_frozen
from purepp.errors import ConfigError, InvalidInputError

__all__ = [
    "COLLECTIVES",
    "DECIDED_MODES",
    "Alias",
    "AllReduce",
    "Allocate",
    "Broadcast",
    "BufferRef",
    "CheckHeader",
    "Communicator",
    "CopyHostToDevice",
    "DType",
    "Effect",
    "EventRef",
    "ForgetEvent",
    "GatherRows",
    "NoteDecision",
    "Op",
    "Pack",
    "PadColumns",
    "RecordEvent",
    "RecordStream",
    "Release",
    "ScatterRows",
    "Section",
    "StackRows",
    "Stream",
    "Synchronize",
    "TensorSpec",
    "Unpack",
    "WaitEvent",
    "WaitStream",
    "WaitWork",
    "WorkRef",
]


class _Enum(enum.Enum):
    """An enum hashed by identity. Its members are singletons compared by identity, so
    this hash is consistent with equality, and it is C code: Enum's own (of the member's
    name) is a Python call on every dict lookup, and the interpreters key their streams,
    groups and dtypes by these enums on every effect."""

    __hash__ = object.__hash__


class Stream(_Enum):
    """A device stream. MAIN is the runner's current stream; RELAY the relay's side stream."""

    MAIN = "main"
    RELAY = "relay"


class Communicator(_Enum):
    """A process group. The relay has its own so it never queues behind activations."""

    PP_RELAY = "pp_relay"  # sibling device group over the PP ranks, relay traffic only
    DP_CPU = "dp_cpu"  # CPU (gloo) group over the DP ranks, the agreement table
    DP_DRAFTER_CPU = "dp_drafter_cpu"  # a second CPU group over the DP ranks: the drafter's lane
    PP_CPU = "pp_cpu"  # CPU (gloo) group over the PP ranks, an agreement across stages


# What PP_RELAY runs on (the CPU groups are gloo either way). NCCL queues a broadcast on
# its stream and returns; gloo's blocks the host that issues it until the data has come
# down gloo's tree to it and the members it sends to have joined.
Backend: TypeAlias = Literal["nccl", "gloo"]
BACKENDS: Final[tuple[Backend, ...]] = ("nccl", "gloo")


def check_backend(call: str, name: str, value: object, fix: str | None = None) -> Backend:
    """`value` as a `Backend`; a ConfigError naming `call`, `name` and the value if it is
    none, with `fix` (default: pass one)."""
    for backend in BACKENDS:
        if type(value) is str and value == backend:
            return backend
    raise ConfigError(
        call,
        f"{name} is {value!r}, not a backend",
        fix
        or "pass 'nccl' (a broadcast queues on its stream) or 'gloo' (a broadcast blocks "
        "the host, as `purepp run --backend gloo` runs)",
    )


class DType(_Enum):
    """Element type of a buffer; part of a collective's wire contract."""

    INT64 = "int64"
    INT32 = "int32"


class Op(_Enum):
    """The pure operation that emitted an effect."""

    RECEIVE = "receive"
    BROADCAST = "broadcast"
    BROADCAST_DRAFTS = "broadcast_drafts"
    CONSUME = "consume"
    AGREE = "agree"
    END_STEP = "end_step"


@attrs.frozen
class TensorSpec:
    """Shape and dtype of a caller's tensor, so a pure step can validate it without touching it."""

    shape: tuple[int, ...]  # the tensor's shape
    dtype: DType  # its dtype


class BufferRef(str):
    """Names a device (or, for the DP table, host) tensor in the interpreter's environment.

    A str subclass: buffer refs are dict keys on every effect an interpreter performs,
    and a str hashes once (cached) and compares in C, where an attrs value runs a Python
    `__hash__` and `__eq__` on every lookup. A ref equals the plain string of its name,
    and never an EventRef or WorkRef.
    """

    __slots__ = ()
    __match_args__ = ("name",)

    def __new__(cls, name: str) -> BufferRef:
        if not isinstance(name, str):
            raise TypeError(f"BufferRef(name={name!r}): pass the buffer's name as a str")
        return str.__new__(cls, name)

    @property
    def name(self) -> str:
        """The name, as a plain str."""
        return str.__str__(self)

    def __repr__(self) -> str:
        return f"BufferRef(name={str.__repr__(self)})"

    def __reduce__(self) -> tuple[type[BufferRef], tuple[str]]:
        return (BufferRef, (self.name,))


@attrs.frozen(cache_hash=True)  # refs are dict keys on every effect
class EventRef:
    """Names a recorded device event."""

    name: str


@attrs.frozen(cache_hash=True)  # refs are dict keys on every effect
class WorkRef:
    """Names the handle of an asynchronous collective."""

    name: str


@attrs.frozen(kw_only=True)
class WaitStream:
    """`stream` waits for all work queued so far on `waits_for`."""

    step: int  # decode step the effect belongs to
    op: Op  # operation that emitted it
    stream: Stream  # the stream that waits
    waits_for: Stream  # the stream whose queued work it waits for


@attrs.frozen(kw_only=True)
class RecordEvent:
    """Record `event` on `stream` after the work queued so far."""

    step: int  # decode step the effect belongs to
    op: Op  # operation that emitted it
    stream: Stream  # stream the event is recorded on
    event: EventRef  # name the event is bound to


@attrs.frozen(kw_only=True)
class WaitEvent:
    """`stream` waits until `event` has completed."""

    step: int  # decode step the effect belongs to
    op: Op  # operation that emitted it
    stream: Stream  # the stream that waits
    event: EventRef  # the event it waits for


@attrs.frozen(kw_only=True)
class ForgetEvent:
    """Drop `event` unwaited: nothing will wait on it (its receive was dropped unconsumed)."""

    step: int  # decode step the effect belongs to
    op: Op  # operation that emitted it
    event: EventRef  # the event to unbind


@attrs.frozen(kw_only=True)
class Allocate:
    """Allocate an uninitialised buffer in `stream`'s allocation pool."""

    step: int  # decode step the effect belongs to
    op: Op  # operation that emitted it
    buffer: BufferRef  # name the new tensor is bound to
    shape: tuple[int, ...]  # its shape
    dtype: DType  # its dtype
    stream: Stream  # the stream whose pool owns it


@attrs.frozen(kw_only=True)
class CopyHostToDevice:
    """Copy a read-only host array to a new device buffer without blocking the host."""

    __reduce__ = reduce_frozen  # its arrays stay frozen in a copy

    step: int  # decode step the effect belongs to
    op: Op  # operation that emitted it
    # the host values (read-only int32)
    source: IntArray = attrs.field(converter=int32_array, eq=ARRAY_EQ, hash=False)
    buffer: BufferRef  # name the new device tensor is bound to
    stream: Stream  # stream the copy is queued on


@attrs.frozen(kw_only=True)
class Broadcast:
    """Broadcast `buffer` from global rank `src` over `comm`; receivers overwrite theirs."""

    step: int  # decode step the effect belongs to
    op: Op  # operation that emitted it
    buffer: BufferRef  # the send buffer on `src`, the receive buffer elsewhere
    shape: tuple[int, ...]  # wire shape: must be equal on every rank of `comm`
    dtype: DType  # wire dtype: must be equal on every rank of `comm`
    src: int  # global rank of the sender
    comm: Communicator  # process group it runs over
    stream: Stream  # stream it is queued on


@attrs.frozen(kw_only=True)
class CheckHeader:
    """Stop the run if the received header `buffer` differs from `expected`, with no host sync.

    The relay's opt-in header ([step, request count], int32) is the first broadcast of
    a step; every receiver checks it before its next receive, so a sender and receiver
    that paired broadcasts of different steps or batches are named there rather than
    hanging or corrupting data at a later, differently shaped broadcast. On CUDA the
    comparison is a device-side assertion queued on `stream`, with no host sync (the run
    fails at its next synchronisation and the CUDA context is lost; see the torch
    interpreter); elsewhere it raises `HeaderMismatchError` naming the rank, the step
    and both headers.
    """

    __reduce__ = reduce_frozen  # its arrays stay frozen in a copy

    step: int  # decode step the effect belongs to
    op: Op  # operation that emitted it
    buffer: BufferRef  # the received header, a 1-D int32 buffer
    # what it must hold (read-only int32), computed by the receiver itself
    expected: IntArray = attrs.field(converter=int32_array, eq=ARRAY_EQ, hash=False)
    stream: Stream  # stream the comparison is queued on (the one the header arrived on)


@attrs.frozen(kw_only=True)
class AllReduce:
    """Sum-all-reduce a host int32 table over `comm`; this rank contributes `contribution`.

    With `work` set the collective is issued asynchronously and a later `WaitWork`
    completes it; otherwise it completes before the next effect.
    """

    __reduce__ = reduce_frozen  # its arrays stay frozen in a copy

    step: int  # decode step the effect belongs to
    op: Op  # operation that emitted it
    # this rank's table (others' columns zero)
    contribution: IntArray = attrs.field(converter=int32_array, eq=ARRAY_EQ, hash=False)
    result: BufferRef  # name the reduced host table is bound to
    comm: Communicator  # process group it runs over
    work: WorkRef | None  # async handle name, or None for a synchronous all-reduce


@attrs.frozen(kw_only=True)
class WaitWork:
    """Block until the asynchronous collective behind `work` has completed."""

    step: int  # decode step the effect belongs to
    op: Op  # operation that emitted it
    work: WorkRef  # the handle to wait on


# The CUDA-graph modes a decision can name (purepp.cudagraph.CUDAGraphMode's names).
DECIDED_MODES: tuple[str, ...] = ("NONE", "PIECEWISE", "FULL")


@attrs.frozen(kw_only=True)
class NoteDecision:
    """Note in the log what an agreement decided from its reduced table; no device work.

    Every field but `step`, `op` and `comm` is the agreed `DPSyncState` and the mode
    and microbatch count every rank runs: a function of the table, so the same on every
    rank that reduced it, and on every stage of a pipeline that agreed over its own DP
    group. The log checker and the simulator compare the ranks' notes of one table and
    name a rank that decided otherwise: a corrupted all-reduce (field failure 17), or a
    stage whose dispatcher chose another graph (field failure 7). An agreement no rank
    had work for (which agrees no sync) is noted as eager mode NONE, with no request and
    every count 0: no other decision has them.
    """

    __reduce__ = reduce_frozen  # its arrays stay frozen in a copy

    step: int  # decode step the effect belongs to
    op: Op  # operation that emitted it
    table: BufferRef  # the reduced table decided from (its AllReduce's result), still bound
    comm: Communicator  # the group that reduced it (its AllReduce's)
    cg_mode: str = attrs.field(validator=attrs.validators.in_(DECIDED_MODES))  # mode run
    num_ubatches: int  # microbatches every rank splits the step into (1: not split)
    # every rank's token count for the forward context, 0 for a dead rank
    num_tokens_across_dp: IntArray = attrs.field(converter=int32_array, eq=ARRAY_EQ, hash=False)
    uniform_token_count: int | None  # agreed uniform decode length, None: none agreed
    eager: bool  # the ranks agreed to run eager
    num_reqs: int  # agreed request bound
    max_query_len: int | None  # agreed query-length bound, None: none agreed


@attrs.frozen(kw_only=True)
class RecordStream:
    """Mark `buffer` as used on `stream`, so its memory outlives that use (record_stream)."""

    step: int  # decode step the effect belongs to
    op: Op  # operation that emitted it
    buffer: BufferRef  # a buffer allocated on another stream
    stream: Stream  # the stream that uses it


@attrs.frozen(kw_only=True)
class Release:
    """Drop the environment's reference to `buffer`; the allocator reclaims it stream-safely."""

    step: int  # decode step the effect belongs to
    op: Op  # operation that emitted it
    buffer: BufferRef  # the name to unbind


@attrs.frozen(kw_only=True)
class Alias:
    """Bind `out` to the same tensor as `source` (keep a caller's buffer past its step)."""

    step: int  # decode step the effect belongs to
    op: Op  # operation that emitted it
    source: BufferRef  # an existing binding
    out: BufferRef  # the new name for the same tensor


@attrs.frozen(kw_only=True)
class PadColumns:
    """`out` = `source` [rows, k] padded on the right to [rows, width] with `fill`."""

    step: int  # decode step the effect belongs to
    op: Op  # operation that emitted it
    source: BufferRef  # a 2-D buffer at most `width` wide
    out: BufferRef  # a new buffer
    width: int  # columns of `out`
    fill: int  # value of the added columns
    stream: Stream  # stream the kernel runs on


@attrs.frozen(kw_only=True)
class StackRows:
    """`out` = the 1-D `sources` stacked as the rows of a new 2-D buffer."""

    step: int  # decode step the effect belongs to
    op: Op  # operation that emitted it
    sources: tuple[BufferRef, ...]  # equal-length 1-D buffers
    out: BufferRef  # a new [len(sources), n] buffer
    stream: Stream  # stream the kernel runs on


@attrs.frozen(kw_only=True)
class GatherRows:
    """`out` = `source[index]`: a new buffer of the indexed rows."""

    step: int  # decode step the effect belongs to
    op: Op  # operation that emitted it
    source: BufferRef  # the rows to pick from
    index: BufferRef  # 1-D row indices
    out: BufferRef  # a new buffer
    stream: Stream  # stream the kernel runs on
    # The entries `index` must have, exactly (the batch's rows; None: any). A short index
    # would gather a short buffer, which a later Pack would fill out with zeros.
    index_rows: int | None = None


@attrs.frozen(kw_only=True)
class ScatterRows:
    """`target[index[i]] = source[i]` for every i with `index[i] != -1`, in place.

    `skips` says whether `index` may hold -1 at all. The host that built the index knows;
    the device does not without a sync. Without skipped rows the scatter is one kernel,
    with them a few (every row is written as an exact integer addition, so nothing is
    filtered on the host).
    """

    step: int  # decode step the effect belongs to
    op: Op  # operation that emitted it
    source: BufferRef  # rows to write
    index: BufferRef  # 1-D destination rows, -1 to skip
    target: BufferRef  # the buffer updated in place
    stream: Stream  # stream the kernel runs on
    skips: bool = True  # False: no index entry is -1 (a plain scatter)
    # Every index entry is below this, so the target needs at least these rows (None: not
    # declared). The host knows the bound; a device index is never read, and a skipping
    # scatter's spare row would take row `rows` of a short target silently.
    target_rows: int | None = None


@attrs.frozen(kw_only=True)
class Synchronize:
    """Block the host until all work queued so far on `stream` has finished.

    The seed does this on XPU before the last stage's broadcasts; on CPU it is a no-op.
    """

    step: int  # decode step the effect belongs to
    op: Op  # operation that emitted it
    stream: Stream  # the stream the host waits for


@attrs.frozen(kw_only=True)
class Section:
    """One region of a packed wire buffer: `shape` elements of `dtype` at byte `offset`."""

    buffer: BufferRef  # Pack: the source copied in; Unpack: the view bound out
    offset: int  # byte offset in the packed buffer (a multiple of 16 on the packed wire)
    shape: tuple[int, ...]  # the region's shape (a Pack source may be smaller: top-left corner)
    dtype: DType  # element type the region is read as
    # Pack: the rows its source must have, exactly (the batch's; a fixed wire's region has
    # its bucket's). None: any up to the region's. A short source would pack as zeros.
    # Unpack: None.
    source_rows: int | None = None


@attrs.frozen(kw_only=True)
class Pack:
    """`out` = a new zeroed int64 buffer of `nbytes` bytes holding every section's source.

    Each source is copied into the top-left corner of its region (rows and columns past
    the source's own stay zero), so one fixed-shape broadcast carries them all.
    """

    step: int  # decode step the effect belongs to
    op: Op  # operation that emitted it
    sections: tuple[Section, ...]  # what goes where
    out: BufferRef  # the new packed buffer, int64 [nbytes // 8]
    nbytes: int  # its size in bytes, a multiple of 16
    stream: Stream  # stream the copies run on


@attrs.frozen(kw_only=True)
class Unpack:
    """Bind each section's buffer to a view of `source`'s bytes (no copy)."""

    step: int  # decode step the effect belongs to
    op: Op  # operation that emitted it
    source: BufferRef  # a contiguous buffer (the received packed wire)
    sections: tuple[Section, ...]  # the views to bind
    stream: Stream  # stream the views are read on (views queue no work)


Effect: TypeAlias = (
    WaitStream
    | RecordEvent
    | WaitEvent
    | ForgetEvent
    | Allocate
    | CopyHostToDevice
    | Broadcast
    | CheckHeader
    | AllReduce
    | WaitWork
    | NoteDecision
    | RecordStream
    | Release
    | Alias
    | PadColumns
    | StackRows
    | GatherRows
    | ScatterRows
    | Synchronize
    | Pack
    | Unpack
)

EFFECT_TYPES: frozenset[type] = frozenset(typing.get_args(Effect))

EFFECTS_FIX = "pass a tuple of effects from purepp.effects.vocabulary (what a pure step returns)"


def effect_batch(call: str, effects: object) -> tuple[Effect, ...]:
    """`effects` as a tuple, every item checked to be an effect before any is performed.

    A caller's batch is checked whole (a set lookup per effect), so a stranger in it
    performs and records nothing. A one-shot iterator is read into the tuple first.
    """
    if type(effects) is not tuple:
        if not isinstance(effects, Iterable) or isinstance(effects, str | bytes):
            raise InvalidInputError(call, f"effects is {a_type(effects)}", EFFECTS_FIX)
        effects = tuple(effects)
    batch = typing.cast(tuple[object, ...], effects)
    for index, item in enumerate(batch):
        if type(item) not in EFFECT_TYPES:
            raise InvalidInputError(
                call, f"effects[{index}] is {item!r}, {a_type(item)}, not an effect", EFFECTS_FIX
            )
    return typing.cast(tuple[Effect, ...], batch)


# Effects that every rank of a communicator must issue in the same order.
COLLECTIVES: tuple[type[Broadcast] | type[AllReduce], ...] = (Broadcast, AllReduce)
