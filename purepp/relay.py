"""The pipeline-parallel sampled-token relay as pure steps over a frozen state.

The last stage broadcasts each step's sampled tokens, their counts and (with
speculative decoding) draft tokens on a side stream over a dedicated
communicator, so the main stream is never gated by the matching peer call.
Every other stage posts the matching receives into a FIFO ring and consumes the
entry `ring_depth` steps later, when the activations of that step have come
back round the pipeline. Rows whose request slot was freed in between are
dropped: a per-slot generation counter, snapshot at receive time, tells.

One decode step on a rank calls, in order:
- non-last stage: `consume_previous_step`, (forward), `receive`, `end_step`;
- last stage: (forward, sample) `broadcast_sampled`, `broadcast_drafts` when
  speculating, `end_step`.
`free_request_slot(s)` may be called at any point between steps.

The caller binds its own tensors to the input references below (`SAMPLED_TOKENS`,
...) before a step and reads the consumed outputs through the references in
`ConsumedOutputs` until `end_step`.

With `RelayConfig.validate_header` (opt-in; off, the effects are the seed's call for
call) the last stage's first broadcast of a step is a fixed-shape header, `relay_header`
= [step, request count]; receivers post it first and check it on the device
(`CheckHeader`) before posting the step's other receives. Its wire shape never changes,
so a sender and receivers that disagree on the step or on the batch meet at the header
and the mismatch is named there, instead of hanging or corrupting data at the next,
differently shaped broadcast.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypedDict, TypeVar

import attrs
import numpy as np
import numpy.typing as npt

from purepp.batch import BatchFacts, need_sampled_mask
from purepp.effects.arrays import ARRAY_EQ, BoolArray, IntArray, bool_array, int32_array, readonly
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
    PadColumns,
    RecordEvent,
    RecordStream,
    Release,
    ScatterRows,
    StackRows,
    Stream,
    TensorSpec,
    WaitEvent,
    WaitStream,
)
from purepp.errors import ConfigError, InvalidInputError, WrongRankError
from purepp.step import Step

__all__ = [
    "DRAFT_TOKENS",
    "HEADER_SHAPE",
    "IDX_MAPPING",
    "NUM_REJECTED",
    "NUM_SAMPLED",
    "SAMPLED_TOKENS",
    "ConsumedOutputs",
    "PendingReceive",
    "RelayConfig",
    "RelayState",
    "broadcast_drafts",
    "broadcast_sampled",
    "consume_previous_step",
    "end_step",
    "free_request_slot",
    "free_request_slots",
    "init_relay",
    "receive",
    "relay_aux_hidden_states",
    "relay_header",
]

# The caller's tensors, bound under these names before the step that reads them.
# A fresh tensor each step: the ring keeps a reference to it until consumed.
IDX_MAPPING = BufferRef("input.idx_mapping")  # device [n] int32: batch row -> request slot
SAMPLED_TOKENS = BufferRef("input.sampled_token_ids")  # last stage: [n, k] int64, k <= spec + 1
NUM_SAMPLED = BufferRef("input.num_sampled")  # last stage: [n] int32
NUM_REJECTED = BufferRef("input.num_rejected")  # last stage: [n] int32
DRAFT_TOKENS = BufferRef("input.draft_tokens")  # last stage: [max_num_reqs, spec] int64 by slot

HEADER_SHAPE = (2,)  # wire shape of the opt-in relay header: [step, request count] int32

# The header's step wraps: it is int32 on the wire, and a server may run past 2**31 steps.
_HEADER_STEP_MODULUS = 2**31


def _check_config(instance: RelayConfig) -> None:
    call = "RelayConfig"
    if instance.pp_size < 1:
        raise ConfigError(call, f"pp_size={instance.pp_size}", "use a pipeline of at least 1 stage")
    if not 0 <= instance.stage < instance.pp_size:
        raise ConfigError(
            call,
            f"stage={instance.stage} is outside 0..{instance.pp_size - 1}",
            "pass this rank's index within its pipeline",
        )
    if instance.last_rank < 0:
        raise ConfigError(
            call, f"last_rank={instance.last_rank}", "pass the last stage's global rank"
        )
    if instance.max_num_reqs < 1:
        raise ConfigError(
            call, f"max_num_reqs={instance.max_num_reqs}", "allow at least one request slot"
        )
    if instance.num_speculative_steps < 0:
        raise ConfigError(
            call,
            f"num_speculative_steps={instance.num_speculative_steps}",
            "use 0 (no speculation) or more",
        )
    if not 1 <= instance.ring_depth <= instance.pp_size:
        raise ConfigError(
            call,
            f"ring_depth={instance.ring_depth} with pp_size={instance.pp_size}",
            "use pp_size (one entry per in-flight step), or 1 without microbatching",
        )
    if type(instance.validate_header) is not bool:
        raise ConfigError(
            call, f"validate_header={instance.validate_header!r}", "pass True or False"
        )


@attrs.frozen(kw_only=True)
class RelayConfig:
    """Static configuration of one rank's relay; equal inputs on every stage but `stage`."""

    pp_size: int  # stages in the pipeline
    stage: int  # this rank's stage, 0..pp_size-1
    last_rank: int  # global rank of the last stage (the broadcast source)
    max_num_reqs: int  # request slots, the length of the generation table
    num_speculative_steps: int  # draft tokens per request; 0 without speculation
    ring_depth: int  # steps between receive and consume: pp_size, or 1 without microbatching
    aux_hidden_state_keys: tuple[str, ...] = ()  # intermediate tensors relayed to the next stage
    validate_header: bool = False  # send [step, n] first each step; receivers check it (opt-in)

    def __attrs_post_init__(self) -> None:
        _check_config(self)

    @classmethod
    def for_stage(
        cls,
        *,
        pp_size: int,
        stage: int,
        max_num_reqs: int,
        num_speculative_steps: int = 0,
        first_rank: int = 0,
        microbatching: bool = True,
        aux_hidden_state_keys: tuple[str, ...] = (),
        validate_header: bool = False,
    ) -> RelayConfig:
        """The configuration of `stage` in a pipeline whose stages are global ranks
        `first_rank .. first_rank + pp_size - 1`."""
        return cls(
            pp_size=pp_size,
            stage=stage,
            last_rank=first_rank + pp_size - 1,
            max_num_reqs=max_num_reqs,
            num_speculative_steps=num_speculative_steps,
            ring_depth=pp_size if microbatching else 1,
            aux_hidden_state_keys=aux_hidden_state_keys,
            validate_header=validate_header,
        )

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp_size - 1

    @property
    def max_sample_len(self) -> int:
        """Wire width of sampled tokens: fixed, so sender and receivers always agree."""
        return self.num_speculative_steps + 1


@attrs.frozen(kw_only=True)
class PendingReceive:
    """One posted receive, waiting in the ring to be consumed."""

    step: int  # the step whose sampled tokens these are
    event: EventRef  # recorded on the relay stream after the receives
    sampled_tokens: BufferRef  # [n, spec + 1] int64
    counts: BufferRef  # [2, n] int32: num_sampled, num_rejected
    draft_tokens: BufferRef | None  # [n, spec] int64, or None without speculation
    idx_mapping: BufferRef  # the step's device slot mapping, kept alive until consumed
    # the same on the host
    idx_mapping_np: IntArray = attrs.field(converter=int32_array, eq=ARRAY_EQ, hash=False)
    # rows that produced a token
    need_sampled: BoolArray = attrs.field(converter=bool_array, eq=ARRAY_EQ, hash=False)
    # slot generations when received
    generations: IntArray = attrs.field(converter=int32_array, eq=ARRAY_EQ, hash=False)

    @property
    def buffers(self) -> tuple[BufferRef, ...]:
        drafts = () if self.draft_tokens is None else (self.draft_tokens,)
        return (self.sampled_tokens, self.counts, *drafts, self.idx_mapping)


@attrs.frozen(kw_only=True)
class RelayState:
    """The relay's state on one rank."""

    step: int  # current decode step; names every buffer and event deterministically
    ring: tuple[PendingReceive | None, ...]  # oldest first; None = nothing pending that step
    # per-slot count of frees
    generations: IntArray = attrs.field(converter=int32_array, eq=ARRAY_EQ, hash=False)
    to_release: tuple[BufferRef, ...] = ()  # buffers this step no longer needs after it ends


@attrs.frozen(kw_only=True)
class ConsumedOutputs:
    """What `consume_previous_step` hands back; the buffers stay valid until `end_step`."""

    received_at_step: int  # the step that sampled these tokens
    sampled_tokens: BufferRef  # [n, spec + 1] int64
    counts: BufferRef  # [2, n] int32: row 0 num_sampled, row 1 num_rejected
    idx_mapping: BufferRef  # [n] int32 slot per row, -1 for rows to skip
    # the same on the host
    idx_mapping_np: IntArray = attrs.field(converter=int32_array, eq=ARRAY_EQ, hash=False)


class _Tag(TypedDict):
    step: int
    op: Op


class _Wire(TypedDict):
    src: int
    comm: Communicator
    stream: Stream


def _wire(config: RelayConfig) -> _Wire:
    return _Wire(src=config.last_rank, comm=Communicator.PP_RELAY, stream=Stream.RELAY)


def _name(state: RelayState, what: str) -> str:
    return f"relay.step{state.step}.{what}"


def relay_header(step: int, num_reqs: int) -> IntArray:
    """The opt-in header of `step`'s broadcasts: [step mod 2**31, request count], int32.

    The last stage sends it; each receiver expects it from its own step counter and
    batch, so both sides compute it from the facts they must already share.
    """
    return int32_array([step % _HEADER_STEP_MODULUS, num_reqs])


def init_relay(config: RelayConfig) -> RelayState:
    """The state before step 0.

    The last stage keeps no ring. Other stages pre-seed the ring with
    `ring_depth` empty entries, so the first `ring_depth` consumes are no-ops.
    """
    ring: tuple[PendingReceive | None, ...] = (
        () if config.is_last_stage else (None,) * config.ring_depth
    )
    return RelayState(step=0, ring=ring, generations=np.zeros(config.max_num_reqs, dtype=np.int32))


def end_step(config: RelayConfig, state: RelayState) -> Step[RelayState, None]:
    """Close the current step: release what it no longer needs and advance the counter."""
    effects = tuple(
        Release(step=state.step, op=Op.END_STEP, buffer=buffer) for buffer in state.to_release
    )
    return Step(attrs.evolve(state, step=state.step + 1, to_release=()), effects, None)


def free_request_slot(config: RelayConfig, state: RelayState, slot: int) -> Step[RelayState, None]:
    """Bump `slot`'s generation: pending receives for its old request are dropped at consume."""
    return free_request_slots(config, state, (slot,))


def free_request_slots(
    config: RelayConfig, state: RelayState, slots: Sequence[int] | npt.NDArray[np.integer]
) -> Step[RelayState, None]:
    """Bump the generation of every slot in `slots` (once per occurrence)."""
    given = np.asarray(slots)
    # A float would be truncated and a bool mask read as slots 0/1: both free the wrong slot.
    if given.size and not np.issubdtype(given.dtype, np.integer):
        raise InvalidInputError(
            "free_request_slots",
            f"slots {given.tolist()} are {given.dtype}",
            "pass integer slot indices",
        )
    indices = given.astype(np.int64).reshape(-1)
    bad = indices[(indices < 0) | (indices >= config.max_num_reqs)]
    if bad.size:
        raise InvalidInputError(
            "free_request_slots",
            f"slot {int(bad[0])} is outside 0..{config.max_num_reqs - 1}",
            "free only slots below max_num_reqs",
        )
    generations = state.generations.copy()
    np.add.at(generations, indices, 1)
    return Step(attrs.evolve(state, generations=generations), (), None)


def _check_batch(call: str, config: RelayConfig, batch: BatchFacts) -> None:
    if batch.num_reqs and int(batch.idx_mapping.max()) >= config.max_num_reqs:
        raise InvalidInputError(
            call,
            f"idx_mapping holds slot {int(batch.idx_mapping.max())} "
            f"but max_num_reqs is {config.max_num_reqs}",
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


def receive(config: RelayConfig, state: RelayState, batch: BatchFacts) -> Step[RelayState, bool]:
    """Post this step's receives (non-last stages) into the ring's newest entry.

    The result is True iff every row of the batch needs its sampled token, so
    the caller may gather from all requests. With `validate_header`, the first
    receive is the sender's `relay_header`, checked on the relay stream against this
    rank's own step and request count before the step's other receives.
    """
    call = "receive"
    _require_stage(call, config, last=False)
    _check_batch(call, config, batch)
    if state.ring[-1] is not None:
        raise InvalidInputError(
            call,
            f"the ring's newest entry still holds step {state.ring[-1].step}",
            "call consume_previous_step once per step before receive",
        )
    mask = need_sampled_mask(batch)
    if mask is None:
        # The last stage skips its broadcasts too: leave the reserved entry empty.
        return Step(state, (), False)

    n = batch.num_reqs
    spec = config.num_speculative_steps
    relay = _Tag(step=state.step, op=Op.RECEIVE)
    wire = _wire(config)
    sampled = BufferRef(_name(state, "sampled_tokens"))
    counts = BufferRef(_name(state, "counts"))
    drafts = BufferRef(_name(state, "draft_tokens")) if spec > 0 else None
    event = EventRef(_name(state, "received"))
    idx_mapping = BufferRef(_name(state, "idx_mapping"))

    sampled_shape = (n, config.max_sample_len)
    effects: list[Effect] = [
        # Receives start only after the main stream's queued work, as the sends do.
        WaitStream(**relay, stream=Stream.RELAY, waits_for=Stream.MAIN)
    ]
    done_with: tuple[BufferRef, ...] = ()
    if config.validate_header:
        # The check runs on the relay stream ahead of every receive whose shape depends
        # on n; only that stream uses the header, so it is released at this step's end.
        header = BufferRef(_name(state, "header"))
        effects += [
            Allocate(
                **relay, buffer=header, shape=HEADER_SHAPE, dtype=DType.INT32, stream=Stream.RELAY
            ),
            Broadcast(**relay, **wire, buffer=header, shape=HEADER_SHAPE, dtype=DType.INT32),
            CheckHeader(
                **relay,
                buffer=header,
                expected=relay_header(state.step, n),
                stream=Stream.RELAY,
            ),
        ]
        done_with = (header,)
    effects += [
        Allocate(
            **relay, buffer=sampled, shape=sampled_shape, dtype=DType.INT64, stream=Stream.RELAY
        ),
        Allocate(**relay, buffer=counts, shape=(2, n), dtype=DType.INT32, stream=Stream.RELAY),
        Broadcast(**relay, **wire, buffer=sampled, shape=sampled_shape, dtype=DType.INT64),
        Broadcast(**relay, **wire, buffer=counts, shape=(2, n), dtype=DType.INT32),
    ]
    if drafts is not None:
        effects += [
            Allocate(
                **relay, buffer=drafts, shape=(n, spec), dtype=DType.INT64, stream=Stream.RELAY
            ),
            Broadcast(**relay, **wire, buffer=drafts, shape=(n, spec), dtype=DType.INT64),
        ]
    effects.append(RecordEvent(**relay, stream=Stream.RELAY, event=event))
    # Allocated on the relay stream but read on main at consume: keep them alive for it.
    received = (sampled, counts) if drafts is None else (sampled, counts, drafts)
    effects += [RecordStream(**relay, buffer=b, stream=Stream.MAIN) for b in received]
    effects.append(Alias(**relay, source=IDX_MAPPING, out=idx_mapping))

    pending = PendingReceive(
        step=state.step,
        event=event,
        sampled_tokens=sampled,
        counts=counts,
        draft_tokens=drafts,
        idx_mapping=idx_mapping,
        idx_mapping_np=batch.idx_mapping,
        need_sampled=mask,
        # Snapshot, so a free of any of these slots before consume is detectable.
        generations=state.generations[batch.idx_mapping],
    )
    new_state = attrs.evolve(
        state, ring=(*state.ring[:-1], pending), to_release=(*state.to_release, *done_with)
    )
    return Step(new_state, tuple(effects), bool(mask.all()))


def consume_previous_step(
    config: RelayConfig, state: RelayState, drafts_target: BufferRef | None = None
) -> Step[RelayState, ConsumedOutputs | None]:
    """Pop the oldest ring entry, reserve the newest, and hand out what is still wanted.

    Rows whose slot was freed since the receive, or that produced no token, get
    slot -1 (the apply kernel skips them). None when there is nothing to apply.
    With `drafts_target` (a [max_num_reqs, spec] int64 table bound by the
    caller), the kept rows' draft tokens are written into it.
    """
    if not state.ring:
        return Step(state, (), None)
    oldest = state.ring[0]
    # Reserve this step's entry; `receive` fills it if a broadcast happens.
    popped = attrs.evolve(state, ring=(*state.ring[1:], None))
    if oldest is None:
        return Step(popped, (), None)

    relay = _Tag(step=state.step, op=Op.CONSUME)
    released = popped.to_release + oldest.buffers
    freed = state.generations[oldest.idx_mapping_np] != oldest.generations
    exclude = freed | ~oldest.need_sampled
    if exclude.all():
        # No request wants these tokens any more; nothing waits on the receive, so its
        # event is dropped unwaited (the seed lets the entry be garbage-collected).
        forget = ForgetEvent(**relay, event=oldest.event)
        return Step(attrs.evolve(popped, to_release=released), (forget,), None)

    effects: list[Effect] = []
    idx_mapping = oldest.idx_mapping
    idx_mapping_np = oldest.idx_mapping_np
    if exclude.any():
        idx_mapping_np = readonly(np.where(exclude, -1, oldest.idx_mapping_np), np.int32)
        idx_mapping = BufferRef(_name(state, "idx_mapping_filtered"))
        effects.append(
            CopyHostToDevice(**relay, source=idx_mapping_np, buffer=idx_mapping, stream=Stream.MAIN)
        )
        released += (idx_mapping,)
    effects.append(WaitEvent(**relay, stream=Stream.MAIN, event=oldest.event))
    if oldest.draft_tokens is not None and drafts_target is not None:
        effects.append(
            ScatterRows(
                **relay,
                source=oldest.draft_tokens,
                index=idx_mapping,
                target=drafts_target,
                stream=Stream.MAIN,
            )
        )
    outputs = ConsumedOutputs(
        received_at_step=oldest.step,
        sampled_tokens=oldest.sampled_tokens,
        counts=oldest.counts,
        idx_mapping=idx_mapping,
        idx_mapping_np=idx_mapping_np,
    )
    return Step(attrs.evolve(popped, to_release=released), tuple(effects), outputs)


def _check_int64_2d(call: str, name: str, spec: TensorSpec) -> None:
    if spec.dtype is not DType.INT64 or len(spec.shape) != 2:
        raise InvalidInputError(
            call,
            f"{name} is {spec.dtype.value} of shape {spec.shape}",
            f"pass {name} as a 2-D int64 tensor",
        )


def broadcast_sampled(
    config: RelayConfig, state: RelayState, batch: BatchFacts, sampled: TensorSpec
) -> Step[RelayState, bool]:
    """Send this step's sampled tokens and counts to every other stage (last stage).

    `sampled` describes the tensor bound to SAMPLED_TOKENS; it is padded to the
    fixed wire width spec + 1, because a plain-sampler step produces [n, 1]
    while receivers always post [n, spec + 1] (a width mismatch hangs NCCL).
    With `validate_header`, `relay_header(step, n)` goes first (see `receive`).
    The result says whether anything was sent.
    """
    call = "broadcast_sampled"
    _require_stage(call, config, last=True)
    _check_batch(call, config, batch)
    _check_int64_2d(call, "sampled tokens", sampled)
    rows, width = sampled.shape
    if rows != batch.num_reqs or not 1 <= width <= config.max_sample_len:
        raise InvalidInputError(
            call,
            f"sampled tokens have shape {sampled.shape} for a batch of {batch.num_reqs} rows",
            f"pass [num_reqs, k] with 1 <= k <= spec + 1 = {config.max_sample_len}",
        )
    if need_sampled_mask(batch) is None:
        # No row produced a token; receivers see the same mask and post nothing.
        return Step(state, (), False)

    n = batch.num_reqs
    relay = _Tag(step=state.step, op=Op.BROADCAST)
    wire = _wire(config)
    send_tokens = BufferRef(_name(state, "send_sampled_tokens"))
    send_counts = BufferRef(_name(state, "send_counts"))
    sampled_shape = (n, config.max_sample_len)
    effects: list[Effect] = [WaitStream(**relay, stream=Stream.RELAY, waits_for=Stream.MAIN)]
    sent: tuple[BufferRef, ...] = ()
    if config.validate_header:
        # First on the wire, so receivers check step and n before any n-shaped receive.
        send_header = BufferRef(_name(state, "send_header"))
        effects += [
            CopyHostToDevice(
                **relay,
                source=relay_header(state.step, n),
                buffer=send_header,
                stream=Stream.RELAY,
            ),
            Broadcast(**relay, **wire, buffer=send_header, shape=HEADER_SHAPE, dtype=DType.INT32),
        ]
        sent = (send_header,)
    effects += [
        # Send buffers are fresh snapshots: the caller may reuse its tensors at once.
        PadColumns(
            **relay,
            source=SAMPLED_TOKENS,
            out=send_tokens,
            width=config.max_sample_len,
            fill=0,
            stream=Stream.RELAY,
        ),
        Broadcast(**relay, **wire, buffer=send_tokens, shape=sampled_shape, dtype=DType.INT64),
        StackRows(
            **relay, sources=(NUM_SAMPLED, NUM_REJECTED), out=send_counts, stream=Stream.RELAY
        ),
        Broadcast(**relay, **wire, buffer=send_counts, shape=(2, n), dtype=DType.INT32),
        # The caller's tensors were made on main and are read on the relay stream.
        *(
            RecordStream(**relay, buffer=b, stream=Stream.RELAY)
            for b in (SAMPLED_TOKENS, NUM_SAMPLED, NUM_REJECTED)
        ),
    ]
    released = (*state.to_release, *sent, send_tokens, send_counts)
    return Step(attrs.evolve(state, to_release=released), tuple(effects), True)


def broadcast_drafts(
    config: RelayConfig, state: RelayState, batch: BatchFacts, drafts: TensorSpec
) -> Step[RelayState, bool]:
    """Send this step's draft proposals so other stages embed real token ids (last stage).

    `drafts` describes the [max_num_reqs, spec] int64 table bound to DRAFT_TOKENS;
    the batch's rows are gathered from it by slot. Gated by the same mask as
    `broadcast_sampled`, which the receivers compute from the same batch.
    """
    call = "broadcast_drafts"
    _require_stage(call, config, last=True)
    _check_batch(call, config, batch)
    spec = config.num_speculative_steps
    if spec == 0:
        raise InvalidInputError(
            call,
            "num_speculative_steps is 0, so receivers post no draft broadcast",
            "configure num_speculative_steps > 0 or do not broadcast drafts",
        )
    _check_int64_2d(call, "draft tokens", drafts)
    if drafts.shape[1] != spec or drafts.shape[0] < config.max_num_reqs:
        raise InvalidInputError(
            call,
            f"draft tokens have shape {drafts.shape}",
            f"pass the [max_num_reqs={config.max_num_reqs}, {spec}] draft table",
        )
    if need_sampled_mask(batch) is None:
        return Step(state, (), False)

    relay = _Tag(step=state.step, op=Op.BROADCAST_DRAFTS)
    send_drafts = BufferRef(_name(state, "send_draft_tokens"))
    shape = (batch.num_reqs, spec)
    effects: tuple[Effect, ...] = (
        WaitStream(**relay, stream=Stream.RELAY, waits_for=Stream.MAIN),
        GatherRows(
            **relay, source=DRAFT_TOKENS, index=IDX_MAPPING, out=send_drafts, stream=Stream.RELAY
        ),
        # Both were made on main and are read on the relay stream. The seed records only
        # the mapping (its draft table lives forever); a caller may bind a fresh table
        # each step, so the table is recorded too, or it could be freed mid-gather.
        RecordStream(**relay, buffer=IDX_MAPPING, stream=Stream.RELAY),
        RecordStream(**relay, buffer=DRAFT_TOKENS, stream=Stream.RELAY),
        Broadcast(**relay, **_wire(config), buffer=send_drafts, shape=shape, dtype=DType.INT64),
    )
    new_state = attrs.evolve(state, to_release=(*state.to_release, send_drafts))
    return Step(new_state, effects, True)


T = TypeVar("T")


def relay_aux_hidden_states(
    config: RelayConfig, incoming: Mapping[str, T] | None, outgoing: Mapping[str, T]
) -> dict[str, T]:
    """The outgoing intermediate tensors plus the configured auxiliary hidden states
    carried through from the incoming ones (EAGLE-3 reads them on the last stage)."""
    keys = config.aux_hidden_state_keys
    if not keys:
        return dict(outgoing)
    call = "relay_aux_hidden_states"
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
            f"incoming intermediate tensors lack {missing} (have {sorted(incoming)})",
            "relay the configured keys from every stage",
        )
    return {**outgoing, **{key: incoming[key] for key in keys}}
