"""The pipeline-parallel sampled-token relay as pure steps over a frozen state.

The last stage broadcasts each step's sampled tokens, their counts and (with
speculative decoding) draft tokens on a side stream over a dedicated
communicator, so the main stream is never gated by the matching peer call.
Every other stage posts the matching receives into a FIFO ring and consumes the
entry `ring_depth` steps later, when the activations of that step have come
back round the pipeline. Rows whose request slot was freed in between are
dropped: a per-slot generation counter, snapshot at receive time, tells.

One decode step on a rank calls, in order (`purepp.rank` writes this order once):
- non-last stage: `consume_previous_step`, (forward), `receive`, `end_step`;
- last stage: (forward, sample) `broadcast_sampled`, `broadcast_drafts` when
  speculating on the seed's wire, `end_step`.
`free_request_slot(s)` may be called at any point between steps.

The caller's tensors are bound under the relay's own input names (`config.inputs`),
so two relays on one interpreter never clash; consumed outputs are read through the
names in `ConsumedOutputs` until `end_step`.

Wire formats (`RelayConfig.wire`):
- `Wire.SEED` (default): the seed's broadcasts call for call (tokens, counts, drafts).
- `Wire.PACKED`: one int64 broadcast per step carrying every section (header, tokens,
  counts, drafts), each aligned to 16 bytes (NCCL is slow on other sizes, and unaligned
  slices made Triton compile new kernels at serving time).
- `Wire.FIXED`: packed, with the rows padded up to a bucket (`RelayConfig.buckets`), and
  sent every step: the need-sampled gating moves from the wire to the consume, so the
  wire schedule depends only on configuration and the bucket, never on batch data. Rows
  past the batch carry slot -1 at consume, so the apply kernel skips them.

With `RelayConfig.validate_header` (opt-in) the sender's first section or broadcast of a
step is `relay_header` = [step, request count]; receivers check it on the device
(`CheckHeader`) before anything whose shape depends on the batch, so a sender and
receivers that disagree on the step or on the batch are named there instead of hanging.
"""

from __future__ import annotations

import enum
import functools
import operator
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias, TypeVar

import attrs
import numpy as np
import numpy.typing as npt

from purepp._checks import INT32_MAX, check_bool, check_int, host_array, store_ints
from purepp._text import a_type, with_article
from purepp._trusted import trusted
from purepp.batch import BatchFacts
from purepp.effects.arrays import (
    ARRAY_EQ,
    BoolArray,
    IntArray,
    freeze_fields,
    frozen,
    reduce_frozen,
)
from purepp.effects.keyed import KeyedEffects
from purepp.effects.vocabulary import (
    Alias,
    Allocate,
    Broadcast,
    BufferRef,
    CheckHeader,
    Communicator,
    CopyHostToDevice,
    DType,
    Effect,
    EventRef,
    ForgetEvent,
    GatherRows,
    Op,
    Pack,
    PadColumns,
    RecordEvent,
    RecordStream,
    Release,
    ScatterRows,
    Section,
    StackRows,
    Stream,
    Synchronize,
    TensorSpec,
    Unpack,
    WaitEvent,
    WaitStream,
)
from purepp.errors import ConfigError, InvalidInputError, WrongRankError
from purepp.step import Step

__all__ = [
    "HEADER_SHAPE",
    "ConsumedOutputs",
    "PendingReceive",
    "Platform",
    "RelayConfig",
    "RelayInputs",
    "RelayState",
    "SlotsLike",
    "Wire",
    "broadcast_drafts",
    "broadcast_sampled",
    "consume_previous_step",
    "default_buckets",
    "end_step",
    "free_request_slot",
    "free_request_slots",
    "init_relay",
    "receive",
    "relay_aux_hidden_states",
    "relay_header",
]

HEADER_SHAPE = (2,)  # shape of the opt-in relay header: [step, request count] int32

# The header's step wraps: it is int32 on the wire, and a server may run past 2**31 steps.
_HEADER_STEP_MODULUS = 2**31
_ALIGN = 16  # bytes: every packed section starts on a 16-byte boundary
_FEW_SLOTS = 16  # frees up to this many slots bump them one by one

# The steps build every effect from values they have checked, with the trusted
# constructors (purepp._trusted: half the cost of attrs's). Enum members they use on
# every step are module constants: one read through the class costs 80 ns on CPython
# 3.11, a module constant 8.
_Alias = trusted(Alias)
_Allocate = trusted(Allocate)
_Broadcast = trusted(Broadcast)
_CheckHeader = trusted(CheckHeader)
_CopyHostToDevice = trusted(CopyHostToDevice)
_ForgetEvent = trusted(ForgetEvent)
_GatherRows = trusted(GatherRows)
_Pack = trusted(Pack)
_PadColumns = trusted(PadColumns)
_RecordEvent = trusted(RecordEvent)
_RecordStream = trusted(RecordStream)
_Release = trusted(Release)
_ScatterRows = trusted(ScatterRows)
_Section = trusted(Section)
_Step = trusted(Step)  # the steps' own results: attrs's constructor costs 2.6x
_StackRows = trusted(StackRows)
_Synchronize = trusted(Synchronize)
_Unpack = trusted(Unpack)
_WaitEvent = trusted(WaitEvent)
_WaitStream = trusted(WaitStream)
_MAIN, _RELAY = Stream.MAIN, Stream.RELAY
_INT32, _INT64 = DType.INT32, DType.INT64
_PP_RELAY = Communicator.PP_RELAY
_new_str = str.__new__  # `_names` makes BufferRefs of its own strs: no caller's type to check


# Request slots as a caller passes them: a sequence of ints, or an integer array.
SlotsLike: TypeAlias = Sequence[int] | npt.NDArray[np.integer[Any]]


class Platform(enum.Enum):
    """The device platform, for the seed's platform-specific behaviour."""

    CUDA = "cuda"  # ring depth pp_size
    XPU = "xpu"  # ring depth pp_size; the sender synchronises main before broadcasting
    XPU_NO_MICROBATCH = "xpu_no_microbatch"  # as XPU, with a ring of depth 1


class Wire(enum.Enum):
    """How a step's relay data crosses the wire (see the module docstring)."""

    SEED = "seed"  # the seed's separate broadcasts
    PACKED = "packed"  # one aligned int64 broadcast per step
    FIXED = "fixed"  # packed, rows padded to a bucket, sent every step


@attrs.frozen
class RelayInputs:
    """The names this relay reads the caller's tensors from; bind them before the step."""

    idx_mapping: BufferRef  # device [n] int32: batch row -> request slot (fresh each step)
    sampled_tokens: BufferRef  # last stage: [n, k] int64, k <= spec + 1
    num_sampled: BufferRef  # last stage: [n] int32
    num_rejected: BufferRef  # last stage: [n] int32
    # [max_num_reqs, spec] int64 by slot: the last stage's proposals, or the table other
    # stages' consume writes the kept rows' drafts into
    draft_table: BufferRef


def _strict_int(call: str, name: str, value: object, low: int, high: int = INT32_MAX) -> int:
    """`value` if it is an int in low..high (bools, floats and strings are refused)."""
    if type(value) is not int and not isinstance(value, np.integer):
        raise ConfigError(call, f"{name}={value!r} is {a_type(value)}", f"pass {name} as an int")
    number = operator.index(value)
    if not low <= number <= high:
        raise ConfigError(call, f"{name}={number} is outside {low}..{high}", f"use {low}..{high}")
    return number


def _check_config(config: RelayConfig) -> None:
    call = "RelayConfig"
    pp_size = _strict_int(call, "pp_size", config.pp_size, 1)
    stage = _strict_int(call, "stage", config.stage, 0)
    if stage >= pp_size:
        raise ConfigError(
            call,
            f"stage={stage} is outside 0..{pp_size - 1}",
            "pass this rank's index within its pipeline",
        )
    last_rank = _strict_int(call, "last_rank", config.last_rank, 0)
    max_num_reqs = _strict_int(call, "max_num_reqs", config.max_num_reqs, 1)
    spec = _strict_int(call, "num_speculative_steps", config.num_speculative_steps, 0, 1024)
    # Python ints from here on: a numpy int8 speculation depth would wrap spec + 1 (and
    # the cached packed layouts, keyed by equal values, would serve the wrapped one).
    store_ints(
        config,
        pp_size=pp_size,
        stage=stage,
        last_rank=last_rank,
        max_num_reqs=max_num_reqs,
        num_speculative_steps=spec,
    )
    for name, kind, value in (
        ("platform", Platform, config.platform),
        ("wire", Wire, config.wire),
    ):
        if not isinstance(value, kind):
            raise ConfigError(
                call,
                f"{name}={value!r}",
                f"pass {with_article(kind.__name__)} ({', '.join(kind.__members__)})",
            )
    if type(config.validate_header) is not bool:
        raise ConfigError(call, f"validate_header={config.validate_header!r}", "pass True or False")
    keys = config.aux_hidden_state_keys
    if type(keys) is not tuple or not all(type(key) is str for key in keys):
        raise ConfigError(
            call, f"aux_hidden_state_keys={keys!r}", "pass a tuple of tensor names (str)"
        )
    if type(config.name) is not str or not config.name:
        raise ConfigError(call, f"name={config.name!r}", "pass a non-empty name for this relay")
    _check_buckets(config)


def _check_buckets(config: RelayConfig) -> None:
    call = "RelayConfig"
    buckets = config.buckets
    if type(buckets) is not tuple:
        raise ConfigError(call, f"buckets={buckets!r}", "pass a tuple of row counts")
    if config.wire is not Wire.FIXED:
        if buckets:
            raise ConfigError(
                call, f"buckets={buckets} with wire={config.wire.value}", "buckets need Wire.FIXED"
            )
        return
    if not buckets:
        raise ConfigError(call, f"buckets={buckets!r}", "pass a non-empty tuple of row counts")
    sizes = [_strict_int(call, "bucket", b, 1) for b in buckets]
    if sizes != sorted(set(sizes)) or sizes[-1] < config.max_num_reqs:
        raise ConfigError(
            call,
            f"buckets={buckets} with max_num_reqs={config.max_num_reqs}",
            "pass increasing row counts whose largest is at least max_num_reqs",
        )
    object.__setattr__(config, "buckets", tuple(sizes))


def default_buckets(max_num_reqs: int) -> tuple[int, ...]:
    """Powers of two below `max_num_reqs`, then `max_num_reqs`: like CUDA-graph sizes."""
    max_num_reqs = check_int(
        "default_buckets", "max_num_reqs", max_num_reqs, 1, fix="pass the request slots (>= 1)"
    )
    sizes = [1 << i for i in range(max_num_reqs.bit_length()) if 1 << i < max_num_reqs]
    return (*sizes, max_num_reqs)


@attrs.frozen(kw_only=True, cache_hash=True)
class RelayConfig:
    """Static configuration of one rank's relay; equal on every stage but `stage`."""

    pp_size: int  # stages in the pipeline
    stage: int  # this rank's stage, 0..pp_size-1
    last_rank: int  # global rank of the last stage (the broadcast source)
    max_num_reqs: int  # request slots, the length of the generation table
    num_speculative_steps: int  # draft tokens per request; 0 without speculation
    platform: Platform = Platform.CUDA  # XPU synchronises before sending; may drop the ring
    aux_hidden_state_keys: tuple[str, ...] = ()  # intermediate tensors relayed to the next stage
    validate_header: bool = False  # send [step, n] first each step; receivers check it (opt-in)
    wire: Wire = Wire.SEED  # how the step's data crosses the wire (opt-in packed formats)
    buckets: tuple[int, ...] = ()  # Wire.FIXED: the row counts a step is padded up to
    name: str = "relay"  # prefixes every name this relay makes or reads
    inputs: RelayInputs = attrs.field(init=False, eq=False, repr=False)  # from `name`

    def __attrs_post_init__(self) -> None:
        _check_config(self)
        prefix = f"{self.name}.input"
        inputs = RelayInputs(
            idx_mapping=BufferRef(f"{prefix}.idx_mapping"),
            sampled_tokens=BufferRef(f"{prefix}.sampled_token_ids"),
            num_sampled=BufferRef(f"{prefix}.num_sampled"),
            num_rejected=BufferRef(f"{prefix}.num_rejected"),
            draft_table=BufferRef(f"{prefix}.draft_table"),
        )
        object.__setattr__(self, "inputs", inputs)

    @classmethod
    def for_stage(
        cls,
        *,
        pp_size: int,
        stage: int,
        max_num_reqs: int,
        num_speculative_steps: int = 0,
        first_rank: int = 0,
        platform: Platform = Platform.CUDA,
        aux_hidden_state_keys: tuple[str, ...] = (),
        validate_header: bool = False,
        wire: Wire = Wire.SEED,
        buckets: tuple[int, ...] | None = None,
        name: str = "relay",
    ) -> RelayConfig:
        """The configuration of `stage` in a pipeline whose stages are global ranks
        `first_rank .. first_rank + pp_size - 1`. `buckets` defaults to
        `default_buckets(max_num_reqs)` on the fixed wire."""
        call = "RelayConfig.for_stage"
        first = _strict_int(call, "first_rank", first_rank, 0)
        size = _strict_int(call, "pp_size", pp_size, 1)
        if first + size - 1 > INT32_MAX:
            raise ConfigError(
                call,
                f"first_rank={first} with pp_size={size} puts the last stage past rank {INT32_MAX}",
                f"pass first_rank <= {INT32_MAX - size + 1}",
            )
        if buckets is None:
            fixed = wire is Wire.FIXED
            requests = _strict_int(call, "max_num_reqs", max_num_reqs, 1)
            buckets = default_buckets(requests) if fixed else ()
        return cls(
            pp_size=size,
            stage=stage,
            last_rank=first + size - 1,
            max_num_reqs=max_num_reqs,
            num_speculative_steps=num_speculative_steps,
            platform=platform,
            aux_hidden_state_keys=aux_hidden_state_keys,
            validate_header=validate_header,
            wire=wire,
            buckets=buckets,
            name=name,
        )

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp_size - 1

    @property
    def ring_depth(self) -> int:
        """Steps between receive and consume: pp_size, or 1 on XPU without microbatching."""
        return 1 if self.platform is Platform.XPU_NO_MICROBATCH else self.pp_size

    @property
    def max_sample_len(self) -> int:
        """Wire width of sampled tokens: fixed, so sender and receivers always agree."""
        return self.num_speculative_steps + 1

    @property
    def reads_idx_mapping(self) -> bool:
        """Whether a step reads the caller's device slot mapping (`inputs.idx_mapping`):
        receivers keep it for the ring unless the fixed wire uploads its own at consume,
        and the last stage gathers drafts by it."""
        if self.is_last_stage:
            return self.num_speculative_steps > 0
        return self.wire is not Wire.FIXED

    def wire_rows(self, num_reqs: int) -> int:
        """Rows on the wire for a batch of `num_reqs`: itself, or its bucket (fixed wire)."""
        fixed = self.wire is Wire.FIXED
        largest = self.buckets[-1] if fixed else INT32_MAX
        if type(num_reqs) is not int or not 0 <= num_reqs <= largest:
            within = f"the largest bucket ({largest})" if fixed else f"0..{largest}"
            num_reqs = check_int(
                "RelayConfig.wire_rows",
                "num_reqs",
                num_reqs,
                0,
                largest,
                fix=f"pass a request count within {within}",
            )
        return _bucket(self.buckets, num_reqs) if fixed else num_reqs


@functools.cache
def _bucket(buckets: tuple[int, ...], num_reqs: int) -> int:
    return next(size for size in buckets if size >= num_reqs)


@attrs.frozen(kw_only=True)
class PendingReceive:
    """One posted receive, waiting in the ring to be consumed."""

    __reduce__ = reduce_frozen  # its arrays stay frozen in a copy

    step: int  # the step whose sampled tokens these are
    event: EventRef  # recorded on the relay stream after the receives
    sampled_tokens: BufferRef  # [rows, spec + 1] int64
    num_sampled: BufferRef  # [rows] int32
    num_rejected: BufferRef  # [rows] int32
    draft_tokens: BufferRef | None  # [rows, spec] int64, or None without speculation
    idx_mapping: BufferRef | None  # the step's device slot mapping; None on the fixed wire
    buffers: tuple[BufferRef, ...]  # every name the entry holds, released at consume
    idx_mapping_np: IntArray = attrs.field(eq=ARRAY_EQ)  # the slot mapping on the host
    # rows that produced a token (None: none did; only the fixed wire posts such a step)
    need_sampled: BoolArray | None = attrs.field(eq=ARRAY_EQ)
    all_sampled: bool  # every row produced a token: consume skips no row for the mask
    # The state's per-slot generations when received: the whole immutable table, shared,
    # not copied. Every free replaces the table, so the same table at consume means no
    # slot was freed since, and only otherwise are the rows' generations compared.
    generations_at_receive: IntArray = attrs.field(eq=ARRAY_EQ)
    rows: int  # wire rows: the batch's, or its bucket on the fixed wire

    def __attrs_post_init__(self) -> None:
        # An entry built by hand (a restored state) is checked here; the relay's steps
        # build theirs with a trusted constructor.
        _check_entry_arrays(self)
        freeze_fields(self, "idx_mapping_np", "need_sampled", "generations_at_receive")


def _check_entry_arrays(entry: PendingReceive) -> None:
    """A ring entry's host arrays: its 1-D int32 slots, its per-row bool mask (or None)
    and its 1-D int32 generations snapshot; a wrong dtype would be misread at consume."""
    call = "PendingReceive"
    slots, mask, then = entry.idx_mapping_np, entry.need_sampled, entry.generations_at_receive
    for name, array, dtype in (
        ("idx_mapping_np", slots, np.int32),
        ("generations_at_receive", then, np.int32),
        ("need_sampled", mask, np.bool_),
    ):
        if array is None and name == "need_sampled":
            continue
        if type(array) is not np.ndarray or array.dtype != dtype or array.ndim != 1:
            raise InvalidInputError(
                call,
                f"{name} is {_described(array)}",
                f"pass {name} as a 1-D {np.dtype(dtype)} numpy array (a step's own)",
            )
    if mask is not None and mask.shape != slots.shape:
        raise InvalidInputError(
            call,
            f"need_sampled has {mask.shape[0]} rows but idx_mapping_np has {slots.shape[0]}",
            "pass one mask entry per batch row",
        )


@attrs.frozen(kw_only=True)
class RelayState:
    """The relay's state on one rank. Build it with `init_relay`; steps return new ones."""

    __reduce__ = reduce_frozen  # its arrays stay frozen in a copy

    step: int  # current decode step; names every buffer and event deterministically
    ring: tuple[PendingReceive | None, ...]  # oldest first; None = nothing pending that step
    generations: IntArray = attrs.field(eq=ARRAY_EQ)  # per-slot count of frees, immutable
    to_release: tuple[BufferRef, ...] = ()  # buffers this step no longer needs after it ends

    def __attrs_post_init__(self) -> None:
        # A state built by hand (or by attrs.evolve) is checked here, once; the steps
        # build theirs with trusted constructors and check only that it fits the config.
        _check_state_fields(self)


def _check_state_fields(state: RelayState) -> None:
    call = "RelayState"
    step = check_int(
        call, "step", state.step, 0, sys.maxsize, fix="pass the decode step as an int >= 0"
    )
    store_ints(state, step=step)
    generations = state.generations
    if (
        type(generations) is not np.ndarray
        or generations.dtype != np.int32
        or generations.ndim != 1
    ):
        raise InvalidInputError(
            call,
            f"generations is {_described(generations)}",
            "pass a 1-D int32 numpy array of per-slot generations (init_relay's, or a step's)",
        )
    freeze_fields(state, "generations")  # a read-only view of writable memory can thaw
    ring, to_release = state.ring, state.to_release
    if type(ring) is not tuple or not all(
        entry is None or type(entry) is PendingReceive for entry in ring
    ):
        raise InvalidInputError(
            call,
            f"ring={ring!r} holds something other than PendingReceive and None",
            "pass the ring of a state the relay's steps returned",
        )
    slots = generations.shape[0]
    for entry in ring:
        if entry is not None and entry.generations_at_receive.shape[0] != slots:
            raise InvalidInputError(
                call,
                f"the ring entry of step {entry.step} holds generations of "
                f"{entry.generations_at_receive.shape[0]} slots, the state {slots}",
                "pass ring entries of a state of this relay (the steps' own)",
            )
        if entry is not None and entry.idx_mapping_np.size:
            mapping = entry.idx_mapping_np
            if int(mapping.min()) < 0 or int(mapping.max()) >= slots:
                raise InvalidInputError(
                    call,
                    f"the ring entry of step {entry.step} maps rows to slots "
                    f"{mapping.tolist()[:8]} of a {slots}-slot generations table",
                    "pass ring entries of a state of this relay (the steps' own)",
                )
    if type(to_release) is not tuple or not all(type(ref) is BufferRef for ref in to_release):
        raise InvalidInputError(
            call, f"to_release={to_release!r}", "pass a tuple of BufferRef (a step's own)"
        )


def _described(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"a {value.ndim}-D {value.dtype} array"
    return a_type(value)


@attrs.frozen(kw_only=True)
class ConsumedOutputs:
    """What `consume_previous_step` hands back; the buffers stay valid until `end_step`."""

    __reduce__ = reduce_frozen  # its arrays stay frozen in a copy

    received_at_step: int  # the step that sampled these tokens
    sampled_tokens: BufferRef  # [rows, spec + 1] int64
    num_sampled: BufferRef  # [rows] int32
    num_rejected: BufferRef  # [rows] int32
    idx_mapping: BufferRef  # [rows] int32 slot per row, -1 for rows to skip
    idx_mapping_np: IntArray = attrs.field(eq=ARRAY_EQ)  # the same on the host

    def __attrs_post_init__(self) -> None:
        freeze_fields(self, "idx_mapping_np")


_PendingReceive = trusted(PendingReceive)
_RelayState = trusted(RelayState)
_ConsumedOutputs = trusted(ConsumedOutputs)


def relay_header(step: int, num_reqs: int) -> IntArray:
    """The opt-in header of `step`'s broadcasts: [step mod 2**31, request count], int32.

    The last stage sends it; each receiver expects it from its own step counter and
    batch, so both sides compute it from the facts they must already share.
    """
    if (
        type(step) is not int
        or type(num_reqs) is not int
        or step < 0
        or not 0 <= num_reqs <= INT32_MAX
    ):
        raise InvalidInputError(
            "relay_header",
            f"step={step!r}, num_reqs={num_reqs!r}",
            f"pass a step >= 0 and a request count in 0..{INT32_MAX}, as ints",
        )
    out: IntArray = frozen(np.array([step % _HEADER_STEP_MODULUS, num_reqs], dtype=np.int32))
    return out


def init_relay(config: RelayConfig) -> RelayState:
    """The state before step 0.

    The last stage keeps no ring. Other stages pre-seed the ring with
    `ring_depth` empty entries, so the first `ring_depth` consumes are no-ops.
    """
    _check_config_type("init_relay", config)
    ring: tuple[PendingReceive | None, ...] = (
        () if config.is_last_stage else (None,) * config.ring_depth
    )
    generations = frozen(np.zeros(config.max_num_reqs, dtype=np.int32))
    return _RelayState(step=0, ring=ring, generations=generations)


def _check_config_type(call: str, config: object) -> None:
    if type(config) is not RelayConfig:
        raise ConfigError(call, f"config is {a_type(config)}", "pass the RelayConfig of this relay")


def check_state(call: str, config: RelayConfig, state: object) -> RelayState:
    """The boundary check of every step: the right types, and a state of this config."""
    if type(config) is not RelayConfig or type(state) is not RelayState:
        _check_config_type(call, config)
        raise InvalidInputError(
            call, f"state is {a_type(state)}", "pass the RelayState returned by init_relay"
        )
    depth = 0 if config.is_last_stage else config.ring_depth
    # A RelayState holds a frozen 1-D int32 table (checked and frozen when built by
    # hand): consume trusts an unchanged table object to mean no slot was freed.
    generations = state.generations
    if generations.shape[0] != config.max_num_reqs or len(state.ring) != depth:
        raise InvalidInputError(
            call,
            f"state has {state.generations.shape[0]} slots and a ring of {len(state.ring)}, "
            f"config has max_num_reqs={config.max_num_reqs} and a ring of {depth}",
            "pass the state made by init_relay(config) for this same config",
        )
    return state


def end_step(config: RelayConfig, state: RelayState) -> Step[RelayState, None]:
    """Close the current step: release what it no longer needs and advance the counter."""
    check_state("end_step", config, state)
    step = state.step
    releases = state.to_release
    effects: tuple[Effect, ...] = tuple(
        [_Release(step=step, op=Op.END_STEP, buffer=buffer) for buffer in releases]
    )
    count = len(releases)
    if count < 2 or len(set(releases)) == count:  # distinct names: the count is the structure
        effects = KeyedEffects(effects, ("relay.end_step", count))
    return _Step(
        _RelayState(step=step + 1, ring=state.ring, generations=state.generations), effects, None
    )


def free_request_slot(config: RelayConfig, state: RelayState, slot: int) -> Step[RelayState, None]:
    """Bump `slot`'s generation: pending receives for its old request are dropped at consume."""
    given: object = slot  # a caller's value, whatever its annotation says
    if type(given) is not int and not isinstance(given, np.integer):
        raise InvalidInputError(
            "free_request_slot", f"slot={slot!r} is {a_type(slot)}", "pass one int slot"
        )
    return free_request_slots(config, state, (slot,))


def free_request_slots(
    config: RelayConfig, state: RelayState, slots: SlotsLike
) -> Step[RelayState, None]:
    """Bump the generation of every slot in `slots` (once per occurrence)."""
    call = "free_request_slots"
    check_state(call, config, state)
    given = host_array(call, "slots", slots)
    if not given.size:
        return _Step(state, (), None)
    # A float would be truncated and a bool mask read as slots 0/1: both free the wrong slot.
    if given.dtype.kind not in "iu":  # bool is kind "b"
        raise InvalidInputError(
            call, f"slots {given.tolist()} are {given.dtype}", "pass integer slot indices"
        )
    if given.ndim != 1:
        raise InvalidInputError(
            call, f"slots have shape {given.shape}", "pass a sequence or 1-D array of slots"
        )
    values: list[int] = given.tolist()  # a few slots: builtins beat numpy's reductions
    if min(values) < 0 or max(values) >= config.max_num_reqs:
        bad = next(v for v in values if not 0 <= v < config.max_num_reqs)
        raise InvalidInputError(
            call,
            f"slot {bad} is outside 0..{config.max_num_reqs - 1}",
            "free only slots below max_num_reqs",
        )
    # One count per occurrence (a slot freed twice gains 2); a new table, so consume
    # sees that something was freed. A step frees a few slots: one item add each beats
    # counting them all (bincount, an add, a cast) until there are dozens.
    if len(values) <= _FEW_SLOTS:
        generations = state.generations.copy()
        for value in values:
            generations[value] += 1
    else:
        bumps = np.bincount(given.astype(np.intp, copy=False), minlength=config.max_num_reqs)
        generations = (state.generations + bumps).astype(np.int32, copy=False)
    new_state = _RelayState(
        step=state.step,
        ring=state.ring,
        generations=np.frombuffer(generations.tobytes(), dtype=np.int32),
        to_release=state.to_release,
    )
    return _Step(new_state, (), None)


def check_batch(call: str, config: RelayConfig, batch: BatchFacts) -> None:
    if type(batch) is not BatchFacts:
        raise InvalidInputError(call, f"batch is {a_type(batch)}", "pass the step's BatchFacts")
    if batch.max_slot >= config.max_num_reqs:
        raise InvalidInputError(
            call,
            f"idx_mapping holds slot {batch.max_slot} but max_num_reqs is {config.max_num_reqs}",
            "map batch rows to slots below max_num_reqs",
        )


def _require_stage(call: str, config: RelayConfig, *, last: bool) -> None:
    if config.is_last_stage != last:
        where = "the last stage" if last else "a non-last stage"
        raise WrongRankError(
            call,
            f"stage {config.stage} of {config.pp_size} called it",
            f"call {call} only on {where}",
        )


# ---- the packed wire's layout -------------------------------------------------------------


@attrs.frozen
class _Layout:
    """Byte offsets of a packed step's sections; every one 16-byte aligned."""

    header: int
    tokens: int
    num_sampled: int
    num_rejected: int
    drafts: int
    nbytes: int


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


@functools.cache
def _packed_layout(rows: int, spec: int, header: bool) -> _Layout:
    offset = 0
    sizes = (
        8 if header else 0,  # [2] int32
        rows * (spec + 1) * 8,  # [rows, spec + 1] int64
        rows * 4,  # [rows] int32
        rows * 4,  # [rows] int32
        rows * spec * 8,  # [rows, spec] int64
    )
    starts = []
    for size in sizes:
        starts.append(offset)
        offset += _aligned(size)
    header_at, tokens, num_sampled, num_rejected, drafts = starts
    return _Layout(header_at, tokens, num_sampled, num_rejected, drafts, max(offset, _ALIGN))


def _broadcast(  # noqa: PLR0917  # the wire contract's fields, in their order
    config: RelayConfig,
    step: int,
    op: Op,
    buffer: BufferRef,
    shape: tuple[int, ...],
    dtype: DType,
) -> Broadcast:
    """A relay broadcast: from the last stage, over the relay communicator and stream."""
    return _Broadcast(
        step=step,
        op=op,
        buffer=buffer,
        shape=shape,
        dtype=dtype,
        src=config.last_rank,
        comm=_PP_RELAY,
        stream=_RELAY,
    )


def _names(config: RelayConfig, step: int, *what: str) -> list[BufferRef]:
    """This step's buffer names, `{config.name}.step{step}.{what}`, for each `what`."""
    prefix = f"{config.name}.step{step}."
    return [_new_str(BufferRef, prefix + w) for w in what]


# ---- receive ------------------------------------------------------------------------------


def receive(config: RelayConfig, state: RelayState, batch: BatchFacts) -> Step[RelayState, bool]:
    """Post this step's receives (non-last stages) into the ring's newest entry.

    The result is True iff every row of the batch needs its sampled token, so
    the caller may gather from all requests. With `validate_header`, the first
    thing received is the sender's `relay_header`, checked on the relay stream against
    this rank's own step and request count before anything shaped by the batch.
    """
    call = "receive"
    check_state(call, config, state)
    _require_stage(call, config, last=False)
    check_batch(call, config, batch)
    newest = state.ring[-1]
    if newest is not None:
        raise InvalidInputError(
            call,
            f"the ring's newest entry still holds step {newest.step}",
            "call consume_previous_step once per step before receive",
        )
    mask = batch.sampled_mask
    if mask is None and config.wire is not Wire.FIXED:
        # The last stage skips its broadcasts too: leave the reserved entry empty.
        return _Step(state, (), False)
    if config.wire is Wire.SEED:
        effects, pending = _receive_seed(config, state, batch, mask)
    else:
        effects, pending = _receive_packed(config, state, batch, mask)
    # The batch's structure follows from the configuration and the wire rows alone.
    effects = KeyedEffects(effects, ("relay.receive", config, pending.rows))
    new_state = _RelayState(
        step=state.step,
        ring=(*state.ring[:-1], pending),
        generations=state.generations,
        to_release=state.to_release,
    )
    return _Step(new_state, effects, batch.all_sampled)


def _pending(
    state: RelayState,
    batch: BatchFacts,
    mask: BoolArray | None,
    *,
    rows: int,
    event: EventRef,
    views: tuple[BufferRef, BufferRef, BufferRef, BufferRef | None],
    idx_mapping: BufferRef | None,
    buffers: tuple[BufferRef, ...],
) -> PendingReceive:
    """The ring entry of this step's receive, whichever wire it came over.

    `views` are the tokens, both counts and the drafts (None without speculation).
    """
    sampled, num_sampled, num_rejected, drafts = views
    return _PendingReceive(
        step=state.step,
        event=event,
        sampled_tokens=sampled,
        num_sampled=num_sampled,
        num_rejected=num_rejected,
        draft_tokens=drafts,
        idx_mapping=idx_mapping,
        buffers=buffers,
        idx_mapping_np=batch.idx_mapping,
        need_sampled=mask,
        all_sampled=batch.all_sampled,
        generations_at_receive=state.generations,
        rows=rows,
    )


def _receive_seed(
    config: RelayConfig, state: RelayState, batch: BatchFacts, mask: BoolArray | None
) -> tuple[tuple[Effect, ...], PendingReceive]:
    step = state.step
    op = Op.RECEIVE
    n = batch.num_reqs
    spec = config.num_speculative_steps
    relay = _RELAY
    sampled, counts, num_sampled, num_rejected, idx_mapping = _names(
        config, step, "sampled_tokens", "counts", "num_sampled", "num_rejected", "idx_mapping"
    )
    event = EventRef(f"{config.name}.step{step}.received")
    sampled_shape = (n, config.max_sample_len)
    # Receives start only after the main stream's queued work, as the sends do.
    effects: list[Effect] = [_WaitStream(step=step, op=op, stream=relay, waits_for=_MAIN)]
    header: tuple[BufferRef, ...] = ()
    if config.validate_header:
        # Checked on the relay stream ahead of every receive whose shape depends on n.
        header = tuple(_names(config, step, "header"))
        effects += [
            _Allocate(
                step=step,
                op=op,
                buffer=header[0],
                shape=HEADER_SHAPE,
                dtype=_INT32,
                stream=relay,
            ),
            _broadcast(config, step, op, header[0], HEADER_SHAPE, _INT32),
            _CheckHeader(
                step=step, op=op, buffer=header[0], expected=relay_header(step, n), stream=relay
            ),
        ]
    effects += [
        _Allocate(
            step=step, op=op, buffer=sampled, shape=sampled_shape, dtype=_INT64, stream=relay
        ),
        _Allocate(step=step, op=op, buffer=counts, shape=(2, n), dtype=_INT32, stream=relay),
        _broadcast(config, step, op, sampled, sampled_shape, _INT64),
        _broadcast(config, step, op, counts, (2, n), _INT32),
    ]
    drafts = None
    if spec:
        (drafts,) = _names(config, step, "draft_tokens")
        effects += [
            _Allocate(step=step, op=op, buffer=drafts, shape=(n, spec), dtype=_INT64, stream=relay),
            _broadcast(config, step, op, drafts, (n, spec), _INT64),
        ]
    effects.append(_RecordEvent(step=step, op=op, stream=relay, event=event))
    # The counts' two rows, as views (the seed's unbind): no copy, no kernel.
    effects.append(
        _Unpack(
            step=step,
            op=op,
            source=counts,
            stream=_MAIN,
            sections=(
                _Section(buffer=num_sampled, offset=0, shape=(n,), dtype=_INT32),
                _Section(buffer=num_rejected, offset=4 * n, shape=(n,), dtype=_INT32),
            ),
        )
    )
    # Allocated on the relay stream but read on main at consume: keep them alive for it.
    received = (sampled, counts) if drafts is None else (sampled, counts, drafts)
    effects += [_RecordStream(step=step, op=op, buffer=b, stream=_MAIN) for b in received]
    effects.append(_Alias(step=step, op=op, source=config.inputs.idx_mapping, out=idx_mapping))
    pending = _pending(
        state,
        batch,
        mask,
        rows=n,
        event=event,
        views=(sampled, num_sampled, num_rejected, drafts),
        idx_mapping=idx_mapping,
        buffers=(*header, *received, num_sampled, num_rejected, idx_mapping),
    )
    return tuple(effects), pending


def _receive_packed(
    config: RelayConfig, state: RelayState, batch: BatchFacts, mask: BoolArray | None
) -> tuple[tuple[Effect, ...], PendingReceive]:
    step = state.step
    op = Op.RECEIVE
    n = batch.num_reqs
    rows = config.wire_rows(n)
    spec = config.num_speculative_steps
    layout = _packed_layout(rows, spec, config.validate_header)
    relay = _RELAY
    wire, sampled, num_sampled, num_rejected = _names(
        config, step, "wire", "sampled_tokens", "num_sampled", "num_rejected"
    )
    event = EventRef(f"{config.name}.step{step}.received")
    words = (layout.nbytes // 8,)
    effects: list[Effect] = [
        _WaitStream(step=step, op=op, stream=relay, waits_for=_MAIN),
        _Allocate(step=step, op=op, buffer=wire, shape=words, dtype=_INT64, stream=relay),
        _broadcast(config, step, op, wire, words, _INT64),
    ]
    names: list[BufferRef] = [wire]
    if config.validate_header:
        (header,) = _names(config, step, "header")
        names.append(header)
        effects += [
            _Unpack(
                step=step,
                op=op,
                source=wire,
                stream=relay,
                sections=(_Section(buffer=header, offset=0, shape=HEADER_SHAPE, dtype=_INT32),),
            ),
            _CheckHeader(
                step=step, op=op, buffer=header, expected=relay_header(step, n), stream=relay
            ),
        ]
    effects.append(_RecordEvent(step=step, op=op, stream=relay, event=event))
    sections = [
        _Section(buffer=sampled, offset=layout.tokens, shape=(rows, spec + 1), dtype=_INT64),
        _Section(buffer=num_sampled, offset=layout.num_sampled, shape=(rows,), dtype=_INT32),
        _Section(buffer=num_rejected, offset=layout.num_rejected, shape=(rows,), dtype=_INT32),
    ]
    drafts = None
    if spec:
        (drafts,) = _names(config, step, "draft_tokens")
        sections.append(
            _Section(buffer=drafts, offset=layout.drafts, shape=(rows, spec), dtype=_INT64)
        )
    effects += [
        _Unpack(step=step, op=op, source=wire, stream=_MAIN, sections=tuple(sections)),
        # Allocated on the relay stream, read on main at consume; the views share its memory.
        _RecordStream(step=step, op=op, buffer=wire, stream=_MAIN),
    ]
    names += [s.buffer for s in sections]
    idx_mapping = None
    if config.wire is Wire.PACKED:
        (idx_mapping,) = _names(config, step, "idx_mapping")
        effects.append(_Alias(step=step, op=op, source=config.inputs.idx_mapping, out=idx_mapping))
        names.append(idx_mapping)
    pending = _pending(
        state,
        batch,
        mask,
        rows=rows,
        event=event,
        views=(sampled, num_sampled, num_rejected, drafts),
        idx_mapping=idx_mapping,
        buffers=tuple(names),
    )
    return tuple(effects), pending


# ---- consume ------------------------------------------------------------------------------


def consume_previous_step(
    config: RelayConfig, state: RelayState, *, update_drafts: bool = False
) -> Step[RelayState, ConsumedOutputs | None]:
    """Pop the oldest ring entry, reserve the newest, and hand out what is still wanted.

    Rows whose slot was freed since the receive, or that produced no token, get
    slot -1 (the apply kernel skips them); so do the padding rows of the fixed wire.
    None when there is nothing to apply. With `update_drafts`, the kept rows' draft
    tokens are written into the caller's [max_num_reqs, spec] int64 table bound to
    `config.inputs.draft_table`.
    """
    check_state("consume_previous_step", config, state)
    flag: object = update_drafts  # a caller's value, whatever its annotation says
    if type(flag) is not bool:
        update_drafts = check_bool("consume_previous_step", "update_drafts", flag)
    if not state.ring:
        return _Step(state, (), None)
    oldest = state.ring[0]
    # Reserve this step's entry; `receive` fills it if a broadcast happens.
    ring = (*state.ring[1:], None)
    if oldest is None:
        popped = _RelayState(
            step=state.step, ring=ring, generations=state.generations, to_release=state.to_release
        )
        return _Step(popped, (), None)

    step = state.step
    op = Op.CONSUME
    released = state.to_release + oldest.buffers
    slots = oldest.idx_mapping_np
    n = slots.shape[0]
    # Rows to drop: freed since the receive, or that produced no token. None: no row.
    exclude: BoolArray | None = None
    then = oldest.generations_at_receive
    if state.generations is not then:  # some slot was freed since (frees replace the table)
        exclude = state.generations[slots] != then[slots]
    if oldest.need_sampled is None:
        exclude = np.ones(n, dtype=np.bool_)
    elif not oldest.all_sampled:
        exclude = ~oldest.need_sampled if exclude is None else exclude | ~oldest.need_sampled
    # The common case (no free, every row sampled) reads no array at all.
    dropped = exclude is not None and bool(exclude.any())
    if not n or (dropped and exclude is not None and exclude.all()):
        # No request wants these tokens any more; nothing waits on the receive, so its
        # event is dropped unwaited (the seed lets the entry be garbage-collected).
        forget = _ForgetEvent(step=step, op=op, event=oldest.event)
        emptied = _RelayState(
            step=step, ring=ring, generations=state.generations, to_release=released
        )
        return _Step(emptied, KeyedEffects((forget,), ("relay.consume.forget",)), None)

    effects: list[Effect] = []
    idx_mapping = oldest.idx_mapping
    idx_mapping_np = slots
    filtered_rows = False
    scatter = oldest.draft_tokens is not None and update_drafts
    skips = dropped or oldest.rows > n  # -1 marks a dropped row or a fixed-wire padding row
    if idx_mapping is None or dropped:
        filtered_rows = True
        # The dropped rows, and the padding rows of the fixed wire, read slot -1 (an
        # int32 -1 is four 0xff bytes): one immutable copy, built from bytes.
        kept = slots if exclude is None else np.where(exclude, np.int32(-1), slots)
        padding = b"\xff" * (4 * (oldest.rows - n))
        idx_mapping_np = np.frombuffer(kept.tobytes() + padding, dtype=np.int32)
        (idx_mapping,) = _names(config, step, "idx_mapping_filtered")
        effects.append(
            _CopyHostToDevice(
                step=step, op=op, source=idx_mapping_np, buffer=idx_mapping, stream=_MAIN
            )
        )
        released += (idx_mapping,)
    effects.append(_WaitEvent(step=step, op=op, stream=_MAIN, event=oldest.event))
    if scatter:
        assert oldest.draft_tokens is not None
        effects.append(
            _ScatterRows(
                step=step,
                op=op,
                source=oldest.draft_tokens,
                index=idx_mapping,
                target=config.inputs.draft_table,
                stream=_MAIN,
                skips=skips,
                target_rows=config.max_num_reqs,  # every slot is below it
            )
        )
    outputs = _ConsumedOutputs(
        received_at_step=oldest.step,
        sampled_tokens=oldest.sampled_tokens,
        num_sampled=oldest.num_sampled,
        num_rejected=oldest.num_rejected,
        idx_mapping=idx_mapping,
        idx_mapping_np=idx_mapping_np,
    )
    new_state = _RelayState(
        step=step, ring=ring, generations=state.generations, to_release=released
    )
    key = ("relay.consume", config, oldest.rows, filtered_rows, skips, scatter)
    return _Step(new_state, KeyedEffects(effects, key), outputs)


# ---- the last stage -----------------------------------------------------------------------


def check_drafts(
    call: str,
    config: RelayConfig,
    drafts: TensorSpec,
    *,
    shown_as: str = "draft tokens",
    passed_as: str = "the draft table",
) -> None:
    """`drafts` is the int64 [max_num_reqs, spec] draft table (`broadcast_drafts`, the
    packed wires' `broadcast_sampled`, and the rank step's `finish` the caller's
    `Sampled.draft_table` (`shown_as`, `passed_as`) before it sends)."""
    spec = config.num_speculative_steps
    if type(drafts) is TensorSpec:
        shape = drafts.shape
        if (
            drafts.dtype is _INT64
            and len(shape) == 2
            and shape[1] == spec
            and shape[0] >= config.max_num_reqs
        ):
            return
        shown = f"{drafts.dtype.value}{list(shape)}"
    else:
        shown = f"{drafts!r}, {a_type(drafts)}"
    raise InvalidInputError(
        call,
        f"{shown_as} is {shown}",
        f"pass {passed_as} as int64 [max_num_reqs={config.max_num_reqs}, {spec}]",
    )


def check_sampled_tokens(
    call: str,
    config: RelayConfig,
    rows: int,
    sampled: TensorSpec,
    *,
    shown_as: str = "sampled tokens",
    passed_as: str = "sampled tokens",
) -> None:
    """`sampled` is int64 [rows, k] with 1 <= k <= spec + 1, the widths the wire pads.

    `broadcast_sampled` checks its argument with it, and the rank step's `finish` the
    caller's `Sampled.tokens` (`shown_as`, `passed_as`), before anything is issued.
    """
    if type(sampled) is TensorSpec:
        shape = sampled.shape
        if (
            sampled.dtype is _INT64
            and len(shape) == 2
            and shape[0] == rows
            and 1 <= shape[1] <= config.max_sample_len
        ):
            return
        shown = f"{sampled.dtype.value}{list(shape)}"
    else:
        shown = f"{sampled!r}, {a_type(sampled)}"
    raise InvalidInputError(
        call,
        f"{shown_as} is {shown} for a batch of {rows} rows",
        f"pass {passed_as} as int64 [{rows}, k] with 1 <= k <= spec + 1 = {config.max_sample_len}",
    )


def broadcast_sampled(
    config: RelayConfig,
    state: RelayState,
    batch: BatchFacts,
    sampled: TensorSpec,
    drafts: TensorSpec | None = None,
) -> Step[RelayState, bool]:
    """Send this step's sampled tokens and counts to every other stage (last stage).

    `sampled` describes the tensor bound to `config.inputs.sampled_tokens`; it is padded
    to the fixed wire width spec + 1, because a plain-sampler step produces [n, 1] while
    receivers always post [n, spec + 1] (a width mismatch hangs NCCL). On the packed
    wires the drafts travel in the same broadcast: pass `drafts`, the draft table bound to
    `config.inputs.draft_table`, when speculating (on the seed's wire, call
    `broadcast_drafts` instead). The result says whether anything was sent.
    """
    call = "broadcast_sampled"
    check_state(call, config, state)
    _require_stage(call, config, last=True)
    check_batch(call, config, batch)
    check_sampled_tokens(call, config, batch.num_reqs, sampled)
    packed = config.wire is not Wire.SEED
    if packed and config.num_speculative_steps:
        if drafts is None:
            raise InvalidInputError(
                call,
                f"no draft table on the {config.wire.value} wire with speculation",
                "pass drafts=TensorSpec of the draft table: it travels with the tokens",
            )
        check_drafts(call, config, drafts)
    elif drafts is not None:
        raise InvalidInputError(
            call,
            f"drafts given on the {config.wire.value} wire "
            f"with num_speculative_steps={config.num_speculative_steps}",
            "on the seed's wire call broadcast_drafts; without speculation pass no drafts",
        )
    if batch.sampled_mask is None and config.wire is not Wire.FIXED:
        # No row produced a token; receivers see the same mask and post nothing.
        return _Step(state, (), False)
    effects, sent = (_send_packed if packed else _send_seed)(config, state, batch)
    # The structure follows from the configuration, the wire rows and the batch's rows (a
    # packed section declares them; the caller's token width is an input layout, guarded
    # by plans, not structure).
    n = batch.num_reqs
    effects = KeyedEffects(effects, ("relay.send", config, config.wire_rows(n), n))
    new_state = _RelayState(
        step=state.step,
        ring=state.ring,
        generations=state.generations,
        to_release=(*state.to_release, *sent),
    )
    return _Step(new_state, effects, True)


def _before_send(config: RelayConfig, step: int, op: Op) -> list[Effect]:
    effects: list[Effect] = []
    if config.platform is not Platform.CUDA:
        # The seed's XPU path drains main on the host before it queues the broadcasts.
        effects.append(_Synchronize(step=step, op=op, stream=_MAIN))
    effects.append(_WaitStream(step=step, op=op, stream=_RELAY, waits_for=_MAIN))
    return effects


def _send_seed(
    config: RelayConfig, state: RelayState, batch: BatchFacts
) -> tuple[tuple[Effect, ...], tuple[BufferRef, ...]]:
    step = state.step
    op = Op.BROADCAST
    n = batch.num_reqs
    relay = _RELAY
    inputs = config.inputs
    send_tokens, send_counts = _names(config, step, "send_sampled_tokens", "send_counts")
    sampled_shape = (n, config.max_sample_len)
    effects = _before_send(config, step, op)
    sent: tuple[BufferRef, ...] = ()
    if config.validate_header:
        # First on the wire, so receivers check step and n before any n-shaped receive.
        sent = tuple(_names(config, step, "send_header"))
        effects += [
            _CopyHostToDevice(
                step=step, op=op, source=relay_header(step, n), buffer=sent[0], stream=relay
            ),
            _broadcast(config, step, op, sent[0], HEADER_SHAPE, _INT32),
        ]
    effects += [
        # Send buffers are fresh snapshots: the caller may reuse its tensors at once.
        _PadColumns(
            step=step,
            op=op,
            source=inputs.sampled_tokens,
            out=send_tokens,
            width=config.max_sample_len,
            fill=0,
            stream=relay,
        ),
        _broadcast(config, step, op, send_tokens, sampled_shape, _INT64),
        _StackRows(
            step=step,
            op=op,
            sources=(inputs.num_sampled, inputs.num_rejected),
            out=send_counts,
            stream=relay,
        ),
        _broadcast(config, step, op, send_counts, (2, n), _INT32),
        # The caller's tensors were made on main and are read on the relay stream.
        *(
            _RecordStream(step=step, op=op, buffer=b, stream=relay)
            for b in (inputs.sampled_tokens, inputs.num_sampled, inputs.num_rejected)
        ),
    ]
    return tuple(effects), (*sent, send_tokens, send_counts)


def _send_packed(
    config: RelayConfig, state: RelayState, batch: BatchFacts
) -> tuple[tuple[Effect, ...], tuple[BufferRef, ...]]:
    step = state.step
    op = Op.BROADCAST
    n = batch.num_reqs
    rows = config.wire_rows(n)
    spec = config.num_speculative_steps
    layout = _packed_layout(rows, spec, config.validate_header)
    relay = _RELAY
    inputs = config.inputs
    (wire,) = _names(config, step, "send_wire")
    effects = _before_send(config, step, op)
    sections: list[Section] = []
    made: list[BufferRef] = [wire]
    if config.validate_header:
        (header,) = _names(config, step, "send_header")
        effects.append(
            _CopyHostToDevice(
                step=step, op=op, source=relay_header(step, n), buffer=header, stream=relay
            )
        )
        sections.append(_Section(buffer=header, offset=0, shape=HEADER_SHAPE, dtype=_INT32))
        made.append(header)
    if n == 0:
        # An empty batch (the fixed wire still sends): the zeroed wire carries nothing
        # but the header, and no caller tensor is read.
        return _packed_broadcast(
            config, step, effects, sections=sections, wire=wire, layout=layout, read=()
        ), tuple(made)
    sections += _input_sections(config, rows, n)
    read = [inputs.sampled_tokens, inputs.num_sampled, inputs.num_rejected]
    if spec:
        (gathered,) = _names(config, step, "send_draft_tokens")
        effects.append(
            _GatherRows(
                step=step,
                op=op,
                source=inputs.draft_table,
                index=inputs.idx_mapping,
                out=gathered,
                stream=relay,
                index_rows=n,  # a short slot mapping would send zeros for drafts
            )
        )
        sections.append(
            _Section(buffer=gathered, offset=layout.drafts, shape=(rows, spec), dtype=_INT64)
        )
        made.append(gathered)
        read += [inputs.idx_mapping, inputs.draft_table]
    return _packed_broadcast(
        config, step, effects, sections=sections, wire=wire, layout=layout, read=read
    ), tuple(made)


@functools.lru_cache(maxsize=4096)  # one entry per batch size a deployment sees
def _input_sections(config: RelayConfig, rows: int, n: int) -> tuple[Section, ...]:
    """The caller's tokens and counts in a packed send of `n` requests on `rows` wire rows:
    the same for every such step. Each must have `n` rows: a short one would pack zeros."""
    layout = _packed_layout(rows, config.num_speculative_steps, config.validate_header)
    inputs = config.inputs
    return (
        _Section(
            buffer=inputs.sampled_tokens,
            offset=layout.tokens,
            shape=(rows, config.max_sample_len),
            dtype=_INT64,
            source_rows=n,
        ),
        _Section(
            buffer=inputs.num_sampled,
            offset=layout.num_sampled,
            shape=(rows,),
            dtype=_INT32,
            source_rows=n,
        ),
        _Section(
            buffer=inputs.num_rejected,
            offset=layout.num_rejected,
            shape=(rows,),
            dtype=_INT32,
            source_rows=n,
        ),
    )


def _packed_broadcast(
    config: RelayConfig,
    step: int,
    effects: list[Effect],
    *,
    sections: Sequence[Section],
    wire: BufferRef,
    layout: _Layout,
    read: Sequence[BufferRef],
) -> tuple[Effect, ...]:
    """Pack `sections` into `wire`, broadcast it, and keep the caller's tensors alive."""
    op = Op.BROADCAST
    relay = _RELAY
    words = (layout.nbytes // 8,)
    effects += [
        # A fresh snapshot: the caller may reuse its tensors at once.
        _Pack(
            step=step, op=op, sections=tuple(sections), out=wire, nbytes=layout.nbytes, stream=relay
        ),
        _broadcast(config, step, op, wire, words, _INT64),
        # The caller's tensors were made on main and are read on the relay stream.
        *(_RecordStream(step=step, op=op, buffer=b, stream=relay) for b in read),
    ]
    return tuple(effects)


def broadcast_drafts(
    config: RelayConfig, state: RelayState, batch: BatchFacts, drafts: TensorSpec
) -> Step[RelayState, bool]:
    """Send this step's draft proposals so other stages embed real token ids (last stage,
    seed's wire).

    `drafts` describes the [max_num_reqs, spec] int64 table bound to
    `config.inputs.draft_table`; the batch's rows are gathered from it by slot. Gated by
    the same mask as `broadcast_sampled`, which the receivers compute from the same batch.
    """
    call = "broadcast_drafts"
    check_state(call, config, state)
    _require_stage(call, config, last=True)
    check_batch(call, config, batch)
    spec = config.num_speculative_steps
    if spec == 0:
        raise InvalidInputError(
            call,
            "num_speculative_steps is 0, so receivers post no draft broadcast",
            "configure num_speculative_steps > 0 or do not broadcast drafts",
        )
    if config.wire is not Wire.SEED:
        raise InvalidInputError(
            call,
            f"the {config.wire.value} wire sends drafts with the sampled tokens",
            "pass drafts to broadcast_sampled instead",
        )
    check_drafts(call, config, drafts)
    if batch.sampled_mask is None:
        return _Step(state, (), False)

    step = state.step
    op = Op.BROADCAST_DRAFTS
    relay = _RELAY
    inputs = config.inputs
    (send_drafts,) = _names(config, step, "send_draft_tokens")
    shape = (batch.num_reqs, spec)
    effects: tuple[Effect, ...] = (
        _WaitStream(step=step, op=op, stream=relay, waits_for=_MAIN),
        _GatherRows(
            step=step,
            op=op,
            source=inputs.draft_table,
            index=inputs.idx_mapping,
            out=send_drafts,
            stream=relay,
            index_rows=batch.num_reqs,
        ),
        # Both were made on main and are read on the relay stream. The seed records only
        # the mapping (its draft table lives forever); a caller may bind a fresh table
        # each step, so the table is recorded too, or it could be freed mid-gather.
        _RecordStream(step=step, op=op, buffer=inputs.idx_mapping, stream=relay),
        _RecordStream(step=step, op=op, buffer=inputs.draft_table, stream=relay),
        _broadcast(config, step, op, send_drafts, shape, _INT64),
    )
    effects = KeyedEffects(effects, ("relay.broadcast_drafts", config, batch.num_reqs))
    new_state = _RelayState(
        step=step,
        ring=state.ring,
        generations=state.generations,
        to_release=(*state.to_release, send_drafts),
    )
    return _Step(new_state, effects, True)


T = TypeVar("T")


def relay_aux_hidden_states(
    config: RelayConfig, incoming: Mapping[str, T] | None, outgoing: Mapping[str, T]
) -> dict[str, T]:
    """The outgoing intermediate tensors plus the configured auxiliary hidden states
    carried through from the incoming ones (EAGLE-3 reads them on the last stage)."""
    call = "relay_aux_hidden_states"
    _check_config_type(call, config)
    for name, given in (("incoming", incoming), ("outgoing", outgoing)):
        if not isinstance(given, Mapping) and not (name == "incoming" and given is None):
            raise InvalidInputError(
                call, f"{name} is {a_type(given)}", f"pass {name} as a dict of tensors"
            )
    keys = config.aux_hidden_state_keys
    if not keys:
        return dict(outgoing)
    if incoming is None:
        raise InvalidInputError(
            call,
            f"no incoming intermediate tensors but keys {keys} are configured",
            "pass the tensors received from the previous stage",
        )
    missing = [key for key in keys if key not in incoming]
    if missing:
        raise InvalidInputError(
            call,
            f"incoming intermediate tensors lack {missing} (have {sorted(map(str, incoming))})",
            "relay the configured keys from every stage",
        )
    return {**outgoing, **{key: incoming[key] for key in keys}}
