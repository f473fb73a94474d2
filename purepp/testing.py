"""A scripted PP x DP world: a seeded schedule of batches, and the rank program that runs it.

No model runs here. A `Schedule` fixes, for every step and every DP replica, what a
serving loop would have decided: the slots freed before the batch (aborts and
finishes, each freed slot reused at once by a new request), the batch itself
(prefill chunks that do and do not sample, decodes), and what the last stage
sampled (tokens, counts, drafts), all deterministic integer functions of the seed,
the replica, the step and the row.

`scripted_rank_effects` drives the *real* pure steps for one rank from that schedule,
in the runner's order (`purepp/runner/loop.py`):

1. non-last stages `consume_previous_step` (drafts scattered into a target table);
2. `free_request_slots` for the slots freed before this step's batch;
3. the DP agreement (`dp.start_agreement` / `finish_agreement` over DP_CPU); every
   rank takes part, idle ones with zero tokens;
4. bind a fresh IDX_MAPPING; non-last stages `receive`, the last stage binds its
   sampled tokens, counts and drafts and calls `broadcast_sampled` (and
   `broadcast_drafts` when speculating);
5. `end_step`.

It is a generator of effect tuples: whoever drives it performs each tuple before
resuming it. Three drivers share it: the simulator (`scripted_program`,
`simulate_schedule`), a real rank on a `TorchInterpreter` (`run_scripted_rank`), and
a `Recorder` with nothing behind it (`record_scripted_logs`, for golden logs).

Caller tensors cross a small seam, `CallerTensors`: the program binds host numpy
arrays and reads results back as host numpy arrays; `NumpyTensors` and
`TorchTensors` adapt the two interpreters, `RecordingTensors` performs nothing and
answers the DP table from the schedule itself (what a matched all-reduce would give).

What a rank consumed (per step: the step that produced it, the filtered slot
mapping, the sampled tokens and counts, the draft table after the scatter) and what
it agreed is collected into a frozen, comparable `RankOutputs`.

Free distances: a request last scheduled at step T is freed at step T + d, d cycling
through 1..pp. The free comes after that step's consume, so its ring entry sits at
ring offset pp - 1 - d (0 = the next to be consumed) when d < pp and is dropped, and
d = pp frees it just after its tokens were consumed (kept: the boundary case).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import attrs
import numpy as np
import numpy.typing as npt

from purepp import dp
from purepp.batch import BatchFacts, need_sampled_mask
from purepp.cudagraph import BatchExecutionDescriptor, CaptureMode, CudaGraphDispatcher
from purepp.effects.arrays import ARRAY_EQ, IntArray, arrays_equal, int32_array, readonly
from purepp.effects.interpreter import Interpreter
from purepp.effects.log import EffectLog, Layout, LogHeader, Recorder
from purepp.effects.numpy_interpreter import NumpyInterpreter
from purepp.effects.simulator import RankContext, RankProgram, SimulationResult, simulate
from purepp.effects.vocabulary import (
    BufferRef,
    DType,
    Effect,
    TensorSpec,
)
from purepp.errors import ConfigError, InvalidInputError
from purepp.relay import (
    DRAFT_TOKENS,
    IDX_MAPPING,
    NUM_REJECTED,
    NUM_SAMPLED,
    SAMPLED_TOKENS,
    ConsumedOutputs,
    RelayConfig,
    RelayState,
    broadcast_drafts,
    broadcast_sampled,
    consume_previous_step,
    end_step,
    free_request_slots,
    init_relay,
    receive,
)
from purepp.step import Step

if TYPE_CHECKING:
    from purepp.effects.torch_interpreter import TorchInterpreter

__all__ = [
    "CAPTURE_SIZES",
    "DRAFTS_TARGET",
    "AgreementStart",
    "CallerTensors",
    "ConsumedStep",
    "NumpyTensors",
    "PureSteps",
    "RankOutputs",
    "RecordingTensors",
    "ReplicaStep",
    "Schedule",
    "ScheduleConfig",
    "ScriptedRun",
    "TorchTensors",
    "drive",
    "make_schedule",
    "record_scripted_logs",
    "record_scripted_rank",
    "reduced_agreement_table",
    "run_scripted_rank",
    "scripted_header",
    "scripted_program",
    "scripted_rank_effects",
    "simulate_schedule",
]

# Non-last stages: the [max_num_reqs, spec] int64 table the relay scatters drafts into
# (the name the runner binds it under).
DRAFTS_TARGET = BufferRef("input.drafts_to_update")

# Token counts with a captured graph: small, so larger batches run eager and the
# agreement sees every mode.
CAPTURE_SIZES = (1, 2, 4, 8)

Int64Array: TypeAlias = npt.NDArray[np.int64]


def _int64_array(values: npt.ArrayLike) -> Int64Array:
    """Field converter: a read-only int64 copy (token ids are int64 on the wire)."""
    out: Int64Array = readonly(values, np.int64)
    return out


_INT64_EQ = attrs.cmp_using(eq=arrays_equal, class_name="Int64Array")

# -- deterministic draws ----------------------------------------------------------------

_MASK64 = (1 << 64) - 1


class _Salt(enum.IntEnum):
    """What a draw decides, so two decisions on the same keys are independent."""

    PROMPT = 1
    LENGTH = 2
    IDLE = 3
    ORDER = 4


def _mix(*keys: int) -> int:
    """A splitmix64 hash of `keys`: the same on every platform and library version."""
    value = 0x9E3779B97F4A7C15
    for key in keys:
        value = (value ^ (key & _MASK64)) & _MASK64
        value = (value + 0x9E3779B97F4A7C15) & _MASK64
        value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
        value ^= value >> 31
    return value


def _pick(bound: int, *keys: int) -> int:
    """A deterministic integer in 0..bound-1."""
    return _mix(*keys) % bound


# -- the schedule -----------------------------------------------------------------------


def _check_schedule_config(instance: ScheduleConfig) -> None:
    call = "ScheduleConfig"
    for name in ("pp", "dp", "steps", "max_num_reqs", "chunk_size", "max_request_steps"):
        value = getattr(instance, name)
        if type(value) is not int or value < 1:
            raise ConfigError(call, f"{name}={value!r}", f"pass an integer {name} >= 1")
    if type(instance.spec) is not int or instance.spec < 0:
        raise ConfigError(call, f"spec={instance.spec!r}", "pass 0 (no speculation) or more")
    if type(instance.validate_header) is not bool:
        raise ConfigError(
            call, f"validate_header={instance.validate_header!r}", "pass True or False"
        )
    if instance.max_prompt_len <= instance.chunk_size:
        raise ConfigError(
            call,
            f"max_prompt_len={instance.max_prompt_len} <= chunk_size={instance.chunk_size}",
            "allow prompts longer than a chunk, so some prefill chunks do not sample",
        )


@attrs.frozen(kw_only=True)
class ScheduleConfig:
    """Everything a scripted schedule is derived from."""

    pp: int  # pipeline stages per replica
    dp: int  # data-parallel replicas
    spec: int  # speculative (draft) tokens per request; 0 without speculation
    steps: int  # decode steps
    seed: int  # the schedule's seed
    max_num_reqs: int = 4  # request slots per replica
    chunk_size: int = 3  # longest prefill chunk
    max_prompt_len: int = 7  # longest prompt (> chunk_size: some chunks do not sample)
    max_request_steps: int = 4  # most steps a request is scheduled before it is freed
    validate_header: bool = False  # the relay's opt-in header (RelayConfig.validate_header)

    def __attrs_post_init__(self) -> None:
        _check_schedule_config(self)

    @property
    def world(self) -> Layout:
        return Layout(pp=self.pp, dp=self.dp)


@attrs.frozen(kw_only=True)
class ReplicaStep:
    """One replica's share of one step: what every stage of that replica knows."""

    step: int  # decode step
    replica: int  # DP replica
    freed: tuple[int, ...]  # slots freed after this step's consume, before its batch
    request_ids: tuple[int, ...]  # per batch row, the request that holds the row's slot
    batch: BatchFacts  # the batch, replicated on every stage
    # last stage: [n, width] int64
    sampled_tokens: Int64Array = attrs.field(converter=_int64_array, eq=_INT64_EQ, hash=False)
    # last stage: [n] tokens kept per row
    num_sampled: IntArray = attrs.field(converter=int32_array, eq=ARRAY_EQ, hash=False)
    # last stage: [n] drafts rejected per row
    num_rejected: IntArray = attrs.field(converter=int32_array, eq=ARRAY_EQ, hash=False)
    # last stage: [n, spec] next drafts per row
    drafts: Int64Array = attrs.field(converter=_int64_array, eq=_INT64_EQ, hash=False)
    num_tokens: int  # scheduled tokens (0: an idle replica)
    uniform_token_count: int | None  # tokens per row when every row decodes, else None

    @property
    def samples(self) -> bool:
        """Whether some row produces a token (the relay moves data this step)."""
        return need_sampled_mask(self.batch) is not None


@attrs.frozen(kw_only=True)
class Schedule:
    """A whole scripted run: `steps[step][replica]`."""

    config: ScheduleConfig  # what it was derived from
    steps: tuple[tuple[ReplicaStep, ...], ...]  # by step, then by replica

    @property
    def world(self) -> Layout:
        return self.config.world

    def at(self, step: int, replica: int) -> ReplicaStep:
        return self.steps[step][replica]

    def dispatcher(self) -> CudaGraphDispatcher:
        """The CUDA-graph table every rank of the world agrees with."""
        return CudaGraphDispatcher(
            capture_sizes=CAPTURE_SIZES,
            capture_mode=CaptureMode.FULL_AND_PIECEWISE,
            max_num_reqs=self.config.max_num_reqs,
            num_speculative_tokens=self.config.spec,
        )

    def relay_config(self, rank: int) -> RelayConfig:
        world = self.world
        return RelayConfig.for_stage(
            pp_size=world.pp,
            stage=world.pp_stage(rank),
            max_num_reqs=self.config.max_num_reqs,
            num_speculative_steps=self.config.spec,
            first_rank=world.dp_index(rank) * world.pp,
            validate_header=self.config.validate_header,
        )


@attrs.define(kw_only=True)
class _Request:
    """A request holding a slot while the schedule is planned (mutable, private)."""

    request_id: int  # unique within its replica
    prompt_len: int  # tokens to prefill
    computed: int  # tokens computed so far
    remaining: int  # steps it is still scheduled
    free_distance: int  # steps between its last schedule and its free (1..pp)
    free_at: int | None = None  # the step whose frees release it, once known


class _ReplicaPlanner:
    """Plans one replica step by step: frees, reuse, the batch and the sampler's output."""

    def __init__(self, config: ScheduleConfig, replica: int) -> None:
        self.config = config
        self.replica = replica
        self.slots: list[_Request | None] = [None] * config.max_num_reqs
        self.admitted = 0

    def _admit(self, step: int) -> _Request:
        config = self.config
        keys = (config.seed, self.replica, self.admitted)
        # Step 0's requests all need more than one chunk: a batch where no row samples.
        shortest = config.chunk_size + 1 if step == 0 else 1
        prompt_len = shortest + _pick(config.max_prompt_len - shortest + 1, *keys, _Salt.PROMPT)
        request = _Request(
            request_id=self.admitted,
            prompt_len=prompt_len,
            computed=0,
            remaining=1 + _pick(config.max_request_steps, *keys, _Salt.LENGTH),
            free_distance=1 + self.admitted % config.pp,  # every ring offset in turn
        )
        self.admitted += 1
        return request

    def _idle(self, step: int) -> bool:
        config = self.config
        if step == 1:
            return self.replica == 0  # one replica idle while the others work (dp > 1)
        if step == 4:
            return True  # every replica idle at once
        return _pick(6, config.seed, self.replica, step, _Salt.IDLE) == 0

    def plan(self, step: int) -> ReplicaStep:
        config = self.config
        freed = tuple(
            slot for slot, r in enumerate(self.slots) if r is not None and r.free_at == step
        )
        for slot in freed:
            self.slots[slot] = None
        for slot, held in enumerate(self.slots):
            if held is None:
                self.slots[slot] = self._admit(step)  # a freed slot is reused at once
        ready = [slot for slot, r in enumerate(self.slots) if r is not None and r.remaining > 0]
        if self._idle(step):
            ready = []
        ready.sort(key=lambda slot: _mix(config.seed, self.replica, step, slot, _Salt.ORDER))
        rows: list[tuple[int, int, int]] = []
        request_ids: list[int] = []
        decodes = 0
        for slot in ready:
            request = self.slots[slot]
            if request is None:  # unreachable: `ready` holds occupied slots only
                continue
            if request.computed < request.prompt_len:
                scheduled = min(config.chunk_size, request.prompt_len - request.computed)
            else:
                scheduled = 1 + config.spec
                decodes += 1
            rows.append((request.computed, scheduled, request.prompt_len))
            request_ids.append(request.request_id)
            request.computed += scheduled if request.computed < request.prompt_len else 1
            request.remaining -= 1
            if request.remaining == 0:
                request.free_at = step + request.free_distance
        return self._replica_step(
            step=step, freed=freed, slots=ready, rows=rows, request_ids=request_ids, decodes=decodes
        )

    def _replica_step(
        self,
        *,
        step: int,
        freed: tuple[int, ...],
        slots: list[int],
        rows: list[tuple[int, int, int]],
        request_ids: list[int],
        decodes: int,
    ) -> ReplicaStep:
        config = self.config
        n = len(rows)
        columns = np.array(rows, dtype=np.int32).reshape(n, 3)
        batch = BatchFacts(
            idx_mapping=np.array(slots, dtype=np.int32),
            num_computed_tokens=columns[:, 0],
            num_scheduled_tokens=columns[:, 1],
            prefill_len=columns[:, 2],
        )
        # A plain-sampler step (no draft to verify) samples one token per row.
        width = 1 + config.spec if decodes else 1
        row, column = np.indices((n, width), dtype=np.int64)
        base = 100_000 * self.replica + 1000 * step
        tokens = 1 + base + 10 * row + column
        num_sampled = (1 + (self.replica + step + np.arange(n)) % width).astype(np.int32)
        draft_row, draft_column = np.indices((n, config.spec), dtype=np.int64)
        drafts = 7_000_000 + base + 10 * draft_row + draft_column
        return ReplicaStep(
            step=step,
            replica=self.replica,
            freed=freed,
            request_ids=tuple(request_ids),
            batch=batch,
            sampled_tokens=tokens,
            num_sampled=num_sampled,
            num_rejected=width - num_sampled,
            drafts=drafts,
            num_tokens=int(columns[:, 1].sum()),
            uniform_token_count=1 + config.spec if n and decodes == n else None,
        )


def make_schedule(config: ScheduleConfig) -> Schedule:
    """The schedule `config` describes: equal configs give equal schedules, anywhere."""
    planners = [_ReplicaPlanner(config, replica) for replica in range(config.dp)]
    steps = tuple(tuple(planner.plan(step) for planner in planners) for step in range(config.steps))
    return Schedule(config=config, steps=steps)


# -- what a rank saw --------------------------------------------------------------------


def _rows(array: npt.NDArray[Any]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(v) for v in row) for row in array.tolist())


@attrs.frozen(kw_only=True)
class ConsumedStep:
    """What a non-last stage consumed at one step, read back through its interpreter."""

    step: int  # the step that consumed
    received_at_step: int  # the step whose sampled tokens these are
    idx_mapping: tuple[int, ...]  # the filtered slot per row (-1: dropped)
    sampled_tokens: tuple[tuple[int, ...], ...]  # [n][spec + 1] as received
    num_sampled: tuple[int, ...]  # [n]
    num_rejected: tuple[int, ...]  # [n]
    drafts_table: tuple[tuple[int, ...], ...] | None  # the target table after the scatter


@attrs.frozen(kw_only=True)
class RankOutputs:
    """Everything one rank consumed and agreed over a run: equal runs give equal values."""

    rank: int  # global rank
    consumed: tuple[ConsumedStep, ...]  # in step order; empty when nothing was performed
    agreed: tuple[BatchExecutionDescriptor, ...]  # the descriptor each step ran at


# -- the caller-tensor seam ---------------------------------------------------------------


class CallerTensors(Protocol):
    """How a rank program hands host arrays to an interpreter and reads results back."""

    def bind(self, ref: BufferRef, values: npt.NDArray[Any], /) -> None:
        """Bind a fresh copy of `values` to `ref` (on the interpreter's device)."""

    def read(self, ref: BufferRef, /) -> npt.NDArray[Any] | None:
        """A host copy of what `ref` holds now; None when nothing is performed."""

    def reduced_table(self, pending: dp.PendingAgreement, /) -> IntArray:
        """The reduced DP table of `pending` (its all-reduce has completed)."""


class NumpyTensors:
    """The seam over a `NumpyInterpreter` (the simulator's ranks)."""

    def __init__(self, interpreter: NumpyInterpreter) -> None:
        self._interpreter = interpreter

    def bind(self, ref: BufferRef, values: npt.NDArray[Any], /) -> None:
        self._interpreter.bind(ref, np.array(values, copy=True))

    def read(self, ref: BufferRef, /) -> npt.NDArray[Any]:
        return self._interpreter.host_array(ref)

    def reduced_table(self, pending: dp.PendingAgreement, /) -> IntArray:
        table: IntArray = self._interpreter.host_array(pending.table)
        return table


class TorchTensors:
    """The seam over a `TorchInterpreter`: arrays go to its device, results come back."""

    def __init__(self, interpreter: TorchInterpreter) -> None:
        self._interpreter = interpreter

    def bind(self, ref: BufferRef, values: npt.NDArray[Any], /) -> None:
        import torch

        host = torch.from_numpy(np.array(values, copy=True))
        self._interpreter.bind(ref, host.to(self._interpreter.device))

    def read(self, ref: BufferRef, /) -> npt.NDArray[Any]:
        # On a GPU this synchronises with the device: a test's read, not a steady-state one.
        return self._interpreter.host_array(ref)

    def reduced_table(self, pending: dp.PendingAgreement, /) -> IntArray:
        table: IntArray = self._interpreter.host_array(pending.table)
        return table


class RecordingTensors:
    """The seam when nothing performs the effects (a bare `Recorder`).

    Binds nothing and reads nothing; the reduced DP table is computed from the
    schedule, exactly what a matched all-reduce of every replica's column gives.
    """

    def __init__(self, schedule: Schedule) -> None:
        self._schedule = schedule

    def bind(self, ref: BufferRef, values: npt.NDArray[Any], /) -> None:
        pass

    def read(self, ref: BufferRef, /) -> None:
        return None

    def reduced_table(self, pending: dp.PendingAgreement, /) -> IntArray:
        return reduced_agreement_table(self._schedule, pending.step)


def _start(
    schedule: Schedule, replica_step: ReplicaStep, start: AgreementStart, dp_rank: int
) -> dp.AgreementStarted | dp.AgreementDecided:
    return start(
        schedule.dispatcher(),
        step=replica_step.step,
        num_reqs=replica_step.batch.num_reqs,
        num_tokens=replica_step.num_tokens,
        uniform_token_count=replica_step.uniform_token_count,
        dp_size=schedule.config.dp,
        dp_rank=dp_rank,
    )


def reduced_agreement_table(schedule: Schedule, step: int) -> IntArray:
    """The DP table every rank reads at `step`: the sum of every replica's contribution."""
    if not 0 <= step < schedule.config.steps:
        raise InvalidInputError(
            "reduced_agreement_table",
            f"step {step} is outside 0..{schedule.config.steps - 1}",
            "ask for a step of the schedule",
        )
    table = np.zeros((dp.TABLE_ROWS, schedule.config.dp), dtype=np.int32)
    for replica, replica_step in enumerate(schedule.steps[step]):
        started = _start(schedule, replica_step, dp.start_agreement, replica)
        if started.state is not None:
            table += started.state.contribution
    out: IntArray = readonly(table, np.int32)
    return out


# -- the pure steps a program runs ----------------------------------------------------------


class AgreementStart(Protocol):
    """`dp.start_agreement`'s shape, as far as the scripted program calls it."""

    def __call__(
        self,
        dispatcher: CudaGraphDispatcher | None,
        *,
        step: int,
        num_reqs: int,
        num_tokens: int,
        uniform_token_count: int | None,
        dp_size: int,
        dp_rank: int,
    ) -> dp.AgreementStarted | dp.AgreementDecided: ...


@attrs.frozen(kw_only=True)
class PureSteps:
    """The pure steps a rank program calls; tests swap one for a deliberately broken wrapper."""

    consume: Callable[
        [RelayConfig, RelayState, BufferRef | None], Step[RelayState, ConsumedOutputs | None]
    ] = consume_previous_step  # non-last stages, first thing in a step
    free: Callable[[RelayConfig, RelayState, Sequence[int]], Step[RelayState, None]] = (
        free_request_slots  # the slots freed before the batch
    )
    start_agreement: AgreementStart = dp.start_agreement  # the DP agreement's first half
    receive: Callable[[RelayConfig, RelayState, BatchFacts], Step[RelayState, bool]] = (
        receive  # non-last stages
    )
    broadcast_sampled: Callable[
        [RelayConfig, RelayState, BatchFacts, TensorSpec], Step[RelayState, bool]
    ] = broadcast_sampled  # the last stage
    broadcast_drafts: Callable[
        [RelayConfig, RelayState, BatchFacts, TensorSpec], Step[RelayState, bool]
    ] = broadcast_drafts  # the last stage, when speculating
    end_step: Callable[[RelayConfig, RelayState], Step[RelayState, None]] = end_step


# -- the rank program ---------------------------------------------------------------------

RankEffects: TypeAlias = Generator[tuple[Effect, ...], None, RankOutputs]


class _Rank:
    """One rank's run of a schedule: the relay state threaded through the steps."""

    def __init__(
        self, schedule: Schedule, rank: int, tensors: CallerTensors, steps: PureSteps
    ) -> None:
        self.schedule = schedule
        self.rank = rank
        self.tensors = tensors
        self.steps = steps
        self.replica = schedule.world.dp_index(rank)
        self.config = schedule.relay_config(rank)
        self.relay = init_relay(self.config)
        self.spec = schedule.config.spec
        self.consumed: list[ConsumedStep] = []
        self.agreed: list[BatchExecutionDescriptor] = []

    def run(self) -> RankEffects:
        if not self.config.is_last_stage and self.spec:
            target = np.zeros((self.schedule.config.max_num_reqs, self.spec), dtype=np.int64)
            self.tensors.bind(DRAFTS_TARGET, target)
        for step in range(self.schedule.config.steps):
            replica_step = self.schedule.at(step, self.replica)
            if not self.config.is_last_stage:
                yield from self._consume(step)
            self.relay = self.steps.free(self.config, self.relay, replica_step.freed).state
            yield from self._agree(replica_step)
            self.tensors.bind(IDX_MAPPING, replica_step.batch.idx_mapping)
            if self.config.is_last_stage:
                yield from self._broadcast(replica_step)
            else:
                yield self._apply(self.steps.receive(self.config, self.relay, replica_step.batch))
            yield self._apply(self.steps.end_step(self.config, self.relay))
        return RankOutputs(rank=self.rank, consumed=tuple(self.consumed), agreed=tuple(self.agreed))

    def _apply(self, step: Step[RelayState, Any]) -> tuple[Effect, ...]:
        self.relay = step.state
        return step.effects

    def _consume(self, step: int) -> Iterator[tuple[Effect, ...]]:
        target = DRAFTS_TARGET if self.spec else None
        taken = self.steps.consume(self.config, self.relay, target)
        yield self._apply(taken)
        if taken.result is not None:
            self._record(step, taken.result)

    def _record(self, step: int, outputs: ConsumedOutputs) -> None:
        read = self.tensors.read
        tokens, counts, slots = (
            read(outputs.sampled_tokens),
            read(outputs.counts),
            read(outputs.idx_mapping),
        )
        drafts = read(DRAFTS_TARGET) if self.spec else None
        if tokens is None or counts is None or slots is None:
            return  # nothing performed: nothing to read
        self.consumed.append(
            ConsumedStep(
                step=step,
                received_at_step=outputs.received_at_step,
                idx_mapping=tuple(int(s) for s in slots.tolist()),
                sampled_tokens=_rows(tokens),
                num_sampled=tuple(int(c) for c in counts[0].tolist()),
                num_rejected=tuple(int(c) for c in counts[1].tolist()),
                drafts_table=None if drafts is None else _rows(drafts),
            )
        )

    def _agree(self, replica_step: ReplicaStep) -> Iterator[tuple[Effect, ...]]:
        started = _start(self.schedule, replica_step, self.steps.start_agreement, self.replica)
        if started.state is None:
            if started.result is not None:
                self.agreed.append(started.result.descriptor)
            return
        pending = started.state
        yield started.effects
        waited = dp.wait_for_agreement(pending)
        yield waited.effects
        finished = dp.finish_agreement(pending, self.tensors.reduced_table(pending))
        self.agreed.append(finished.result.descriptor)
        yield finished.effects  # releases the table

    def _broadcast(self, replica_step: ReplicaStep) -> Iterator[tuple[Effect, ...]]:
        batch = replica_step.batch
        tensors = self.tensors
        tensors.bind(SAMPLED_TOKENS, replica_step.sampled_tokens)
        tensors.bind(NUM_SAMPLED, replica_step.num_sampled)
        tensors.bind(NUM_REJECTED, replica_step.num_rejected)
        sampled = TensorSpec(shape=replica_step.sampled_tokens.shape, dtype=DType.INT64)
        yield self._apply(self.steps.broadcast_sampled(self.config, self.relay, batch, sampled))
        if not self.spec:
            return
        table = np.zeros((self.schedule.config.max_num_reqs, self.spec), dtype=np.int64)
        table[batch.idx_mapping] = replica_step.drafts
        tensors.bind(DRAFT_TOKENS, table)
        drafts = TensorSpec(shape=table.shape, dtype=DType.INT64)
        yield self._apply(self.steps.broadcast_drafts(self.config, self.relay, batch, drafts))


def _check_rank(call: str, schedule: Schedule, rank: int) -> None:
    size = schedule.world.world_size
    if type(rank) is not int or not 0 <= rank < size:
        raise InvalidInputError(
            call, f"rank {rank!r} is outside a world of {size}", f"pass a rank in 0..{size - 1}"
        )


def scripted_rank_effects(
    schedule: Schedule, rank: int, tensors: CallerTensors, steps: PureSteps | None = None
) -> RankEffects:
    """Rank `rank`'s program: a generator of effect tuples that returns its `RankOutputs`.

    The driver performs each tuple before resuming the generator, which may then read
    results through `tensors`. `steps` replaces the real pure steps (tests only).
    """
    _check_rank("scripted_rank_effects", schedule, rank)
    return _Rank(schedule, rank, tensors, PureSteps() if steps is None else steps).run()


def drive(program: RankEffects, interpreter: Interpreter) -> RankOutputs:
    """Perform every tuple `program` yields on `interpreter`; return its outputs."""
    try:
        effects = next(program)
        while True:
            interpreter.perform(effects)
            effects = program.send(None)
    except StopIteration as done:
        outputs: RankOutputs = done.value
        return outputs


def _real_steps(rank: int) -> PureSteps:
    return PureSteps()


def scripted_program(
    schedule: Schedule,
    *,
    outputs: dict[int, RankOutputs] | None = None,
    steps_for: Callable[[int], PureSteps] = _real_steps,
) -> RankProgram:
    """The schedule as a simulator program; each rank's outputs land in `outputs[rank]`.

    `steps_for(rank)` picks the pure steps of each rank (a broken variant, in tests).
    """

    def program(context: RankContext) -> Iterator[tuple[Effect, ...]]:
        if context.world != schedule.world:
            raise ConfigError(
                "scripted_program",
                f"the simulated world is pp={context.world.pp}, dp={context.world.dp} but the "
                f"schedule's is pp={schedule.world.pp}, dp={schedule.world.dp}",
                "simulate the schedule's own world (schedule.world)",
            )
        tensors = NumpyTensors(context.interpreter)
        ran = yield from scripted_rank_effects(
            schedule, context.rank, tensors, steps_for(context.rank)
        )
        if outputs is not None:
            outputs[context.rank] = ran

    return program


@attrs.frozen(kw_only=True, eq=False)
class ScriptedRun:
    """A simulated run of a schedule: the simulation, and every rank's outputs."""

    simulation: SimulationResult  # the interpreters and the effects each rank issued
    outputs: tuple[RankOutputs, ...]  # by global rank


def simulate_schedule(
    schedule: Schedule,
    *,
    steps_for: Callable[[int], PureSteps] = _real_steps,
    max_steps_in_flight: int | None = None,
    compare_steps: bool = True,
) -> ScriptedRun:
    """Run every rank of the schedule's world in the simulator.

    Raises `CollectiveReportError` when the ranks' collectives disagree, deadlock or
    overrun the ring, and `HeaderMismatchError` when a relay header check fails (see
    `purepp.effects.simulator.simulate`, also for `compare_steps`).
    """
    outputs: dict[int, RankOutputs] = {}
    result = simulate(
        schedule.world,
        scripted_program(schedule, outputs=outputs, steps_for=steps_for),
        max_steps_in_flight=max_steps_in_flight,
        compare_steps=compare_steps,
    )
    ranks = range(schedule.world.world_size)
    return ScriptedRun(simulation=result, outputs=tuple(outputs[rank] for rank in ranks))


def _written(field: attrs.Attribute[Any], value: object) -> bool:
    # Opt-in switches are written only when on: logs of default runs stay byte-identical
    # to those recorded before the switch existed (the golden logs).
    return not (field.name == "validate_header" and value is False)


def scripted_header(schedule: Schedule, rank: int) -> LogHeader:
    """The log header of rank `rank` of a scripted run: the schedule's config as JSON."""
    config = schedule.config
    return LogHeader(
        rank=rank,
        world=schedule.world,
        config={"scripted": attrs.asdict(config, filter=_written)},
    )


def run_scripted_rank(
    interpreter: TorchInterpreter,
    world: Layout,
    rank: int,
    schedule: Schedule,
    *,
    perform: Interpreter | None = None,
) -> RankOutputs:
    """Run rank `rank` of `schedule` for real: the effects go to `perform` (default the
    interpreter itself; e.g. a `Recorder` wrapping it), tensors to and from `interpreter`.

    Every rank of `world` must run it, each in its own process with its communicators.
    """
    call = "run_scripted_rank"
    if world != schedule.world:
        raise ConfigError(
            call,
            f"world pp={world.pp}, dp={world.dp} but the schedule's is "
            f"pp={schedule.world.pp}, dp={schedule.world.dp}",
            "run the schedule in its own world",
        )
    if interpreter.rank != rank:
        raise ConfigError(
            call,
            f"the interpreter is rank {interpreter.rank}'s, asked to run rank {rank}",
            "pass this process's rank and its interpreter",
        )
    program = scripted_rank_effects(schedule, rank, TorchTensors(interpreter))
    return drive(program, interpreter if perform is None else perform)


def record_scripted_rank(
    schedule: Schedule, rank: int, steps: PureSteps | None = None
) -> EffectLog:
    """Rank `rank`'s effect log, recorded without performing anything."""
    _check_rank("record_scripted_rank", schedule, rank)
    recorder = Recorder(scripted_header(schedule, rank))
    drive(scripted_rank_effects(schedule, rank, RecordingTensors(schedule), steps), recorder)
    return recorder.log


def record_scripted_logs(
    schedule: Schedule, *, steps_for: Callable[[int], PureSteps] = _real_steps
) -> tuple[EffectLog, ...]:
    """Every rank's effect log, recorded rank by rank without performing anything."""
    return tuple(
        record_scripted_rank(schedule, rank, steps_for(rank))
        for rank in range(schedule.world.world_size)
    )
