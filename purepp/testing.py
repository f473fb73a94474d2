"""A scripted PP x DP world: a seeded schedule of batches, and the rank program that runs it.

No model runs here. A `Schedule` fixes, for every step and every DP replica, what a
serving loop would have decided: the slots freed before the batch (aborts and
finishes, each freed slot reused at once by a new request), the batch itself
(prefill chunks that do and do not sample, decodes), and what the last stage
sampled (tokens, counts, drafts), all deterministic integer functions of the seed,
the replica, the step and the row.

`scripted_rank_effects` runs the library's one rank-step program (`purepp.rank`:
`begin`, `agree`, `finish`) for one rank of that schedule. It is a generator of effect
tuples: whoever drives it performs each tuple before resuming it. Three drivers share it:
the simulator (`scripted_program`, `simulate_schedule`), a real rank on a
`TorchInterpreter` (`run_scripted_rank`), and a `Recorder` with nothing behind it
(`record_scripted_logs`, for golden logs).

Caller tensors cross the rank step's seam (`purepp.rank.StepIO`) as host arrays, plus a
`read` to look at results: `NumpyTensors` and `TorchTensors` adapt the two interpreters,
`RecordingTensors` performs nothing and answers the DP table from the schedule itself
(what a matched all-reduce would give).

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
import typing
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import attrs
import numpy as np
import numpy.typing as npt

from purepp import dp
from purepp._checks import (
    INT32_MAX,
    check_bool,
    check_instance,
    check_int,
    check_optional_int,
    host_array,
    store_ints,
)
from purepp._text import a_type
from purepp.batch import BatchFacts, need_sampled_mask
from purepp.cudagraph import BatchExecutionDescriptor, CaptureMode, CudaGraphDispatcher
from purepp.effects.arrays import (
    ARRAY_EQ,
    IntArray,
    arrays_equal,
    is_frozen,
    readonly,
    reduce_frozen,
)
from purepp.effects.interpreter import Interpreter
from purepp.effects.io import NumpyIO, numpy_spec
from purepp.effects.log import EffectLog, Layout, LogHeader, Recorder
from purepp.effects.numpy_interpreter import describe_effect
from purepp.effects.simulator import RankContext, RankProgram, SimulationResult, simulate
from purepp.effects.vocabulary import BufferRef, Effect, TensorSpec
from purepp.errors import ConfigError, InterpreterError, InvalidInputError
from purepp.rank import (
    REAL_STEPS,
    RankConfig,
    RankSteps,
    Sampled,
    ShapeFacts,
    StepIO,
    agree,
    begin,
    finish,
    init_rank,
    perform_phase,
)
from purepp.relay import ConsumedOutputs, RelayConfig, Wire

if TYPE_CHECKING:
    from purepp.effects.torch_interpreter import TorchInterpreter

__all__ = [
    "CAPTURE_SIZES",
    "ConsumedStep",
    "NumpyTensors",
    "RankOutputs",
    "RecordingTensors",
    "ReplicaStep",
    "Schedule",
    "ScheduleConfig",
    "ScriptedIO",
    "ScriptedRun",
    "TorchTensors",
    "assert_effect_sequence",
    "drive",
    "make_schedule",
    "rank_config",
    "record_scripted_logs",
    "record_scripted_rank",
    "reduced_agreement_table",
    "run_scripted_rank",
    "scripted_header",
    "scripted_program",
    "scripted_rank_effects",
    "simulate_schedule",
]

# The newest agreement's thresholds, small enough that scripted batches (a few tokens per
# replica) microbatch on some steps and not on others.
_SCRIPTED_MICROBATCH = dp.MicrobatchConfig(
    num_ubatches=2, decode_token_threshold=2, prefill_token_threshold=4
)

# Token counts with a captured graph: small, so larger batches run eager and the
# agreement sees every mode.
CAPTURE_SIZES = (1, 2, 4, 8)

Int64Array: TypeAlias = npt.NDArray[np.int64]


def _checked_ints(
    field: str, values: object, dtype: type[np.signedinteger[Any]]
) -> npt.NDArray[Any]:
    """A ReplicaStep array field as a read-only `dtype` array; a typed error for values
    numpy's casting would change (floats truncated, bools, ints past `dtype`)."""
    if type(values) is np.ndarray and values.dtype == dtype and is_frozen(values):
        return values
    fix = f"pass {field} as integers that fit {np.dtype(dtype).name} (a list or an int array)"
    given = host_array("ReplicaStep", field, values, fix=fix)  # a ragged list is refused
    if given.size:
        if given.dtype.kind not in "iu":
            raise InvalidInputError("ReplicaStep", f"{field} holds {given.dtype} values", fix)
        info = np.iinfo(dtype)
        low, high = int(given.min()), int(given.max())
        if low < info.min or high > info.max:
            shown = low if low < info.min else high
            raise InvalidInputError("ReplicaStep", f"{field} holds {shown}", fix)
    return readonly(given, dtype)


# Field converters, one per field so an error names it (token ids are int64 on the wire).
def _sampled_tokens(values: npt.ArrayLike) -> Int64Array:
    return _checked_ints("sampled_tokens", values, np.int64)


def _drafts(values: npt.ArrayLike) -> Int64Array:
    return _checked_ints("drafts", values, np.int64)


def _num_sampled(values: npt.ArrayLike) -> IntArray:
    return _checked_ints("num_sampled", values, np.int32)


def _num_rejected(values: npt.ArrayLike) -> IntArray:
    return _checked_ints("num_rejected", values, np.int32)


def _check_replica_step(instance: ReplicaStep) -> None:
    """A ReplicaStep built by hand fits its batch: a wrong one is refused here, not as a
    raw numpy error (or as a rank phase's) halfway through a run."""
    call = "ReplicaStep"
    check_instance(call, "batch", instance.batch, BatchFacts)
    store_ints(
        instance,
        step=check_int(call, "step", instance.step, 0),
        replica=check_int(call, "replica", instance.replica, 0),
        num_tokens=check_int(call, "num_tokens", instance.num_tokens, 0),
        uniform_token_count=check_optional_int(
            call, "uniform_token_count", instance.uniform_token_count, 1
        ),
    )
    rows = instance.batch.num_reqs
    tokens, drafts = instance.sampled_tokens, instance.drafts
    shapes: tuple[tuple[str, bool, str], ...] = (
        ("sampled_tokens", tokens.ndim == 2 and tokens.shape[0] == rows, f"[{rows}, k], k >= 1"),
        ("num_sampled", instance.num_sampled.shape == (rows,), f"[{rows}]"),
        ("num_rejected", instance.num_rejected.shape == (rows,), f"[{rows}]"),
        ("drafts", drafts.ndim == 2 and drafts.shape[0] == rows, f"[{rows}, spec]"),
    )
    for field, fits, shape in shapes:
        if not fits or (field == "sampled_tokens" and tokens.shape[1] < 1):
            shown = list(getattr(instance, field).shape)
            raise InvalidInputError(
                call,
                f"{field} has shape {shown} for a batch of {rows} rows",
                f"pass {field} of shape {shape}, one row per batch row",
            )


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
    for name in (
        "pp",
        "dp",
        "steps",
        "max_num_reqs",
        "chunk_size",
        "max_prompt_len",
        "max_request_steps",
    ):
        value = getattr(instance, name)
        if type(value) is not int or not 1 <= value <= INT32_MAX:
            raise ConfigError(
                call, f"{name}={value!r}", f"pass an integer {name} in 1..{INT32_MAX}"
            )
    if type(instance.spec) is not int or not 0 <= instance.spec <= INT32_MAX:
        raise ConfigError(call, f"spec={instance.spec!r}", "pass 0 (no speculation) or more")
    if type(instance.seed) is not int:  # any int: the hash reads it modulo 2**64
        raise ConfigError(call, f"seed={instance.seed!r}", "pass an integer seed")
    for name in ("validate_header", "microbatch"):
        if type(getattr(instance, name)) is not bool:
            raise ConfigError(call, f"{name}={getattr(instance, name)!r}", "pass True or False")
    if not isinstance(instance.wire, Wire):
        raise ConfigError(call, f"wire={instance.wire!r}", "pass a relay.Wire, e.g. Wire.SEED")
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
    wire: Wire = Wire.SEED  # the relay's wire format (RelayConfig.wire)
    microbatch: bool = (
        False  # the newest vLLM's six-row agreement (thresholds small enough to trip)
    )

    def __attrs_post_init__(self) -> None:
        _check_schedule_config(self)

    @property
    def world(self) -> Layout:
        return Layout(pp=self.pp, dp=self.dp)


@attrs.frozen(kw_only=True)
class ReplicaStep:
    """One replica's share of one step: what every stage of that replica knows."""

    __reduce__ = reduce_frozen  # its arrays stay frozen in a copy

    step: int  # decode step
    replica: int  # DP replica
    freed: tuple[int, ...]  # slots freed after this step's consume, before its batch
    request_ids: tuple[int, ...]  # per batch row, the request that holds the row's slot
    batch: BatchFacts  # the batch, replicated on every stage
    # last stage: [n, width] int64
    sampled_tokens: Int64Array = attrs.field(converter=_sampled_tokens, eq=_INT64_EQ, hash=False)
    # last stage: [n] tokens kept per row
    num_sampled: IntArray = attrs.field(converter=_num_sampled, eq=ARRAY_EQ, hash=False)
    # last stage: [n] drafts rejected per row
    num_rejected: IntArray = attrs.field(converter=_num_rejected, eq=ARRAY_EQ, hash=False)
    # last stage: [n, spec] next drafts per row
    drafts: Int64Array = attrs.field(converter=_drafts, eq=_INT64_EQ, hash=False)
    num_tokens: int  # scheduled tokens (0: an idle replica)
    uniform_token_count: int | None  # tokens per row when every row decodes, else None

    def __attrs_post_init__(self) -> None:
        _check_replica_step(self)

    @property
    def samples(self) -> bool:
        """Whether some row produces a token (the relay moves data this step)."""
        return need_sampled_mask(self.batch) is not None


def _check_fits(config: ScheduleConfig, step: int, replica: int, planned: ReplicaStep) -> None:
    """`steps[step][replica]` of a Schedule is that step's and replica's, and its arrays
    fit the config's speculation (ReplicaStep checked them against its batch)."""
    spec = config.spec
    problem = None
    if (planned.step, planned.replica) != (step, replica):
        problem = f"holds the ReplicaStep of step {planned.step}, replica {planned.replica}"
    elif planned.drafts.shape[1] != spec:
        problem = f"has drafts of shape {list(planned.drafts.shape)} but config.spec={spec}"
    elif planned.sampled_tokens.shape[1] > spec + 1:
        width = planned.sampled_tokens.shape[1]
        problem = f"has sampled_tokens {width} wide but config.spec={spec} (at most spec + 1)"
    if problem is not None:
        raise InvalidInputError(
            "Schedule",
            f"steps[{step}][{replica}] {problem}",
            f"give steps[{step}][{replica}] the ReplicaStep of step {step}, replica "
            f"{replica}, with drafts [rows, {spec}] and 1 to {spec + 1} tokens a row",
        )


@attrs.frozen(kw_only=True)
class Schedule:
    """A whole scripted run: `steps[step][replica]`."""

    config: ScheduleConfig  # what it was derived from
    steps: tuple[tuple[ReplicaStep, ...], ...]  # by step, then by replica

    def __attrs_post_init__(self) -> None:
        call = "Schedule"
        check_instance(call, "config", self.config, ScheduleConfig)
        config, steps = self.config, self.steps
        fits = (
            type(steps) is tuple
            and len(steps) == config.steps
            and all(
                type(row) is tuple
                and len(row) == config.dp
                and all(type(replica) is ReplicaStep for replica in row)
                for row in steps
            )
        )
        if not fits:
            raise InvalidInputError(
                call,
                f"steps is not {config.steps} tuples of {config.dp} ReplicaSteps "
                f"(config.steps x config.dp)",
                "build schedules with make_schedule, or give one ReplicaStep per step and replica",
            )
        for step, row in enumerate(steps):
            for replica, planned in enumerate(row):
                _check_fits(config, step, replica, planned)

    @property
    def world(self) -> Layout:
        return self.config.world

    def at(self, step: int, replica: int) -> ReplicaStep:
        config = self.config
        step = check_int("Schedule.at", "step", step, 0, config.steps - 1)
        replica = check_int("Schedule.at", "replica", replica, 0, config.dp - 1)
        return self.steps[step][replica]

    def agreement_group(self, replica: int) -> dp.AgreementGroup:
        """Replica `replica`'s DP group, with the seed's table or the newest six rows."""
        layout = (
            dp.TableLayout(microbatch=_SCRIPTED_MICROBATCH)
            if self.config.microbatch
            else dp.SEED_TABLE
        )
        return dp.AgreementGroup(dp_size=self.config.dp, dp_rank=replica, layout=layout)

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
            wire=self.config.wire,
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


def _expect_steps_for(call: str, steps_for: object) -> None:
    if not callable(steps_for):
        raise InvalidInputError(
            call,
            f"steps_for is {a_type(steps_for)}, not callable",
            "pass a function of a rank that returns that rank's RankSteps",
        )


def _steps_of(call: str, steps_for: Callable[[int], RankSteps], rank: int) -> RankSteps:
    """`steps_for(rank)`, refused in `call`'s name unless a RankSteps: None would run
    the real steps for a runner that forgot its return."""
    steps = steps_for(rank)
    if not isinstance(steps, RankSteps):
        raise InvalidInputError(
            call,
            f"steps_for returned {a_type(steps)} for rank {rank}",
            "return a RankSteps for every rank (REAL_STEPS for a rank that keeps the real steps)",
        )
    return steps


def make_schedule(config: ScheduleConfig) -> Schedule:
    """The schedule `config` describes: equal configs give equal schedules, anywhere."""
    check_instance("make_schedule", "config", config, ScheduleConfig)
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


class ScriptedIO(StepIO[npt.NDArray[Any]], Protocol):
    """The rank step's tensor seam with host arrays, plus reading results back."""

    def read(self, ref: BufferRef, /) -> npt.NDArray[Any] | None:
        """A host copy of what `ref` holds now; None when nothing is performed."""


class NumpyTensors(NumpyIO):
    """The seam over a `NumpyInterpreter` (the simulator's ranks)."""

    def bind(self, ref: BufferRef, value: npt.NDArray[Any], /) -> None:
        self.interpreter.bind(ref, np.array(value, copy=True))

    def read(self, ref: BufferRef, /) -> npt.NDArray[Any]:
        return self.interpreter.host_array(ref)


class TorchTensors:
    """The seam over a `TorchInterpreter`: arrays go to its device, results come back."""

    def __init__(self, interpreter: TorchInterpreter) -> None:
        from purepp.effects.torch_interpreter import TorchInterpreter  # torch only when used

        check_instance("TorchTensors", "interpreter", interpreter, TorchInterpreter)
        self._interpreter = interpreter

    def bind(self, ref: BufferRef, value: npt.NDArray[Any], /) -> None:
        import torch

        host = torch.from_numpy(np.array(value, copy=True))
        self._interpreter.bind(ref, host.to(self._interpreter.device))

    def spec(self, ref: BufferRef, /) -> TensorSpec:
        from purepp.effects.io import TorchIO

        return TorchIO(self._interpreter).spec(ref)

    def upload(self, values: IntArray, /) -> npt.NDArray[Any]:
        return np.array(values, copy=True)  # bind moves it to the device

    def host_table(self, ref: BufferRef, /) -> IntArray:
        table: IntArray = self._interpreter.host_array(ref)
        return table

    def read(self, ref: BufferRef, /) -> npt.NDArray[Any]:
        # On a GPU this synchronises with the device: a test's read, not a steady-state one.
        return self._interpreter.host_array(ref)


class RecordingTensors:
    """The seam when nothing performs the effects (a bare `Recorder`).

    Remembers the specs of what it is given and reads nothing; the reduced DP table is
    computed from the schedule, exactly what a matched all-reduce of every replica's
    column gives.
    """

    def __init__(self, schedule: Schedule) -> None:
        check_instance("RecordingTensors", "schedule", schedule, Schedule)
        self._schedule = schedule
        self._bound: dict[BufferRef, npt.NDArray[Any]] = {}

    def bind(self, ref: BufferRef, value: npt.NDArray[Any], /) -> None:
        check_instance("RecordingTensors.bind", ref.name, value, np.ndarray)
        self._bound[ref] = value

    def spec(self, ref: BufferRef, /) -> TensorSpec:
        """As `NumpyIO.spec`: the bound array's spec, refused unless int64 or int32."""
        array = self._bound.get(ref)
        if array is None:
            raise InterpreterError(
                "RecordingTensors.spec", f"buffer {ref.name!r} is not bound", "bind it first"
            )
        return numpy_spec("RecordingTensors.spec", ref, array)

    def upload(self, values: IntArray, /) -> npt.NDArray[Any]:
        return values

    def host_table(self, ref: BufferRef, /) -> IntArray:
        step = int(ref.name.split(".step")[1].split(".")[0])
        return reduced_agreement_table(self._schedule, step)

    def read(self, ref: BufferRef, /) -> None:
        return None


def reduced_agreement_table(schedule: Schedule, step: int) -> IntArray:
    """The reduced DP table of `step`: every replica's contribution, summed."""
    check_instance("reduced_agreement_table", "schedule", schedule, Schedule)
    dispatcher = schedule.dispatcher()
    columns = []
    for replica in range(schedule.config.dp):
        planned = schedule.at(step, replica)
        batch = dp.RankBatch(
            num_reqs=planned.batch.num_reqs,
            num_tokens=planned.num_tokens,
            uniform_token_count=planned.uniform_token_count,
        )
        group = schedule.agreement_group(replica)
        pending = dp.start_agreement(dp.AgreementLanes(), group, dispatcher, batch, step=step)
        if pending.result.contribution is None:
            raise ConfigError(
                "reduced_agreement_table",
                f"step {step} decides without an all-reduce",
                "ask only for steps of a DP world (dp > 1)",
            )
        columns.append(pending.result.contribution)
    table: IntArray = readonly(np.sum(columns, axis=0, dtype=np.int32), np.int32)
    return table


# -- the rank program ---------------------------------------------------------------------

RankEffects: TypeAlias = Generator[tuple[Effect, ...], None, RankOutputs]


def rank_config(schedule: Schedule, rank: int) -> RankConfig:
    """Rank `rank`'s configuration of the rank step in the schedule's world."""
    check_instance("rank_config", "schedule", schedule, Schedule)
    return RankConfig(
        relay=schedule.relay_config(rank),
        group=schedule.agreement_group(schedule.world.dp_index(rank)),
        dispatcher=schedule.dispatcher(),
    )


def _scripted_rank(schedule: Schedule, rank: int, io: ScriptedIO, steps: RankSteps) -> RankEffects:
    """The schedule's steps on one rank, through the library's one rank-step program."""
    config = rank_config(schedule, rank)
    replica = schedule.world.dp_index(rank)
    spec = schedule.config.spec
    inputs = config.relay.inputs
    consumed: list[ConsumedStep] = []
    agreed: list[BatchExecutionDescriptor] = []
    if config.updates_drafts:
        io.bind(inputs.draft_table, np.zeros((schedule.config.max_num_reqs, spec), np.int64))
    state = init_rank(config)
    for step in range(schedule.config.steps):
        planned = schedule.at(step, replica)
        begun = yield from begin(config, state, steps)
        if begun.consumed is not None:
            seen = _read_consumed(io, step, begun.consumed, inputs.draft_table if spec else None)
            if seen is not None:
                consumed.append(seen)
        shape = ShapeFacts(
            num_tokens=planned.num_tokens, uniform_token_count=planned.uniform_token_count
        )
        agreed_step = yield from agree(
            config, begun, planned.batch, shape, io, freed=planned.freed, steps=steps
        )
        agreed.append(agreed_step.descriptor)
        state = yield from finish(config, agreed_step, io, _sampled(schedule, planned), steps)
    return RankOutputs(rank=rank, consumed=tuple(consumed), agreed=tuple(agreed))


def _sampled(schedule: Schedule, planned: ReplicaStep) -> Sampled[npt.NDArray[Any]]:
    """The last stage's outputs as the schedule fixed them (unused on other stages)."""
    table = None
    if schedule.config.spec:
        table = np.zeros((schedule.config.max_num_reqs, schedule.config.spec), dtype=np.int64)
        table[planned.batch.idx_mapping] = planned.drafts
    return Sampled(
        tokens=planned.sampled_tokens,
        num_sampled=planned.num_sampled,
        num_rejected=planned.num_rejected,
        draft_table=table,
    )


def _read_consumed(
    io: ScriptedIO, step: int, outputs: ConsumedOutputs, drafts: BufferRef | None
) -> ConsumedStep | None:
    tokens, num_sampled, num_rejected, slots = (
        io.read(outputs.sampled_tokens),
        io.read(outputs.num_sampled),
        io.read(outputs.num_rejected),
        io.read(outputs.idx_mapping),
    )
    if tokens is None or num_sampled is None or num_rejected is None or slots is None:
        return None  # nothing performed: nothing to read
    table = None if drafts is None else io.read(drafts)
    return ConsumedStep(
        step=step,
        received_at_step=outputs.received_at_step,
        idx_mapping=tuple(int(s) for s in slots.tolist()),
        sampled_tokens=_rows(tokens),
        num_sampled=tuple(int(c) for c in num_sampled.tolist()),
        num_rejected=tuple(int(c) for c in num_rejected.tolist()),
        drafts_table=None if table is None else _rows(table),
    )


def _check_rank(call: str, schedule: Schedule, rank: int) -> None:
    check_instance(call, "schedule", schedule, Schedule)
    size = schedule.world.world_size
    if type(rank) is not int or not 0 <= rank < size:
        raise InvalidInputError(
            call, f"rank {rank!r} is outside a world of {size}", f"pass a rank in 0..{size - 1}"
        )


def scripted_rank_effects(
    schedule: Schedule, rank: int, io: ScriptedIO, steps: RankSteps | None = None
) -> RankEffects:
    """Rank `rank`'s program: a generator of effect tuples that returns its `RankOutputs`.

    The driver performs each tuple before resuming the generator, which may then read
    results through `io`. `steps` replaces the real pure steps (a broken variant in tests).
    """
    call = "scripted_rank_effects"
    _check_rank(call, schedule, rank)
    if not all(callable(getattr(io, m, None)) for m in ("bind", "spec", "upload", "host_table")):
        raise InvalidInputError(
            call, f"io is {a_type(io)}", "pass a ScriptedIO (e.g. NumpyTensors)"
        )
    if not callable(getattr(io, "read", None)):
        raise InvalidInputError(
            call,
            f"io is {a_type(io)}, which has no read method",
            "pass a ScriptedIO (e.g. NumpyTensors): a StepIO that also reads results back",
        )
    return _scripted_rank(schedule, rank, io, REAL_STEPS if steps is None else steps)


def drive(program: RankEffects, interpreter: Interpreter) -> RankOutputs:
    """Perform every tuple `program` yields on `interpreter`; return its outputs."""
    return perform_phase(program, interpreter)


def _real_steps(rank: int) -> RankSteps:
    return REAL_STEPS


def scripted_program(
    schedule: Schedule,
    *,
    outputs: dict[int, RankOutputs] | None = None,
    steps_for: Callable[[int], RankSteps] = _real_steps,
) -> RankProgram:
    """The schedule as a simulator program; each rank's outputs land in `outputs[rank]`.

    `steps_for(rank)` picks the pure steps of each rank (a broken variant, in tests).
    """
    return _scripted_program("scripted_program", schedule, outputs, steps_for)


def _scripted_program(
    call: str,
    schedule: Schedule,
    outputs: dict[int, RankOutputs] | None,
    steps_for: Callable[[int], RankSteps],
) -> RankProgram:
    """`scripted_program`, whose errors name `call` (the public function called)."""
    check_instance(call, "schedule", schedule, Schedule)
    _expect_steps_for(call, steps_for)
    if outputs is not None and not isinstance(outputs, dict):
        raise InvalidInputError(
            call,
            f"outputs is {a_type(outputs)}",
            "pass a dict (each rank's RankOutputs lands under its rank), or leave it out",
        )

    def program(context: RankContext) -> Iterator[tuple[Effect, ...]]:
        if context.world != schedule.world:
            raise ConfigError(
                call,
                f"the simulated world is pp={context.world.pp}, dp={context.world.dp} but the "
                f"schedule's is pp={schedule.world.pp}, dp={schedule.world.dp}",
                "simulate the schedule's own world (schedule.world)",
            )
        io = NumpyTensors(context.interpreter)
        steps = _steps_of(call, steps_for, context.rank)
        ran = yield from scripted_rank_effects(schedule, context.rank, io, steps)
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
    steps_for: Callable[[int], RankSteps] = _real_steps,
    max_steps_in_flight: int | None = None,
    compare_steps: bool = True,
) -> ScriptedRun:
    """Run every rank of the schedule's world in the simulator.

    Raises `CollectiveReportError` when the ranks' collectives disagree, deadlock or
    overrun the ring, and `HeaderMismatchError` when a relay header check fails (see
    `purepp.effects.simulator.simulate`, also for `compare_steps`).
    """
    call = "simulate_schedule"
    check_instance(call, "schedule", schedule, Schedule)
    _expect_steps_for(call, steps_for)
    # Checked here, so a wrong one is named as this call's and not as simulate's.
    if max_steps_in_flight is not None:
        fix = "allow at least one step in flight (an int), or leave it out"
        check_int(call, "max_steps_in_flight", max_steps_in_flight, 1, fix=fix, config=True)
    check_bool(call, "compare_steps", compare_steps, config=True)
    outputs: dict[int, RankOutputs] = {}
    result = simulate(
        schedule.world,
        _scripted_program(call, schedule, outputs, steps_for),
        max_steps_in_flight=max_steps_in_flight,
        compare_steps=compare_steps,
    )
    ranks = range(schedule.world.world_size)
    return ScriptedRun(simulation=result, outputs=tuple(outputs[rank] for rank in ranks))


def _plain(instance: object, field: attrs.Attribute[Any], value: object) -> object:
    return value.value if isinstance(value, Wire) else value


def _written(field: attrs.Attribute[Any], value: object) -> bool:
    # Opt-in switches are written only when on: logs of default runs stay byte-identical
    # to those recorded before the switch existed (the golden logs).
    if field.name == "microbatch":
        return value is True
    if field.name == "wire":
        return value is not Wire.SEED
    return not (field.name == "validate_header" and value is False)


def scripted_header(schedule: Schedule, rank: int) -> LogHeader:
    """The log header of rank `rank` of a scripted run: the schedule's config as JSON."""
    check_instance("scripted_header", "schedule", schedule, Schedule)
    config = schedule.config
    return LogHeader(
        rank=rank,
        world=schedule.world,
        config={"scripted": attrs.asdict(config, filter=_written, value_serializer=_plain)},
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
    from purepp.effects.torch_interpreter import TorchInterpreter  # torch only when used

    call = "run_scripted_rank"
    check_instance(call, "interpreter", interpreter, TorchInterpreter)
    check_instance(call, "world", world, Layout)
    check_instance(call, "schedule", schedule, Schedule)
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
    schedule: Schedule, rank: int, steps: RankSteps | None = None
) -> EffectLog:
    """Rank `rank`'s effect log, recorded without performing anything."""
    _check_rank("record_scripted_rank", schedule, rank)
    recorder = Recorder(scripted_header(schedule, rank))
    drive(scripted_rank_effects(schedule, rank, RecordingTensors(schedule), steps), recorder)
    return recorder.log


def record_scripted_logs(
    schedule: Schedule, *, steps_for: Callable[[int], RankSteps] = _real_steps
) -> tuple[EffectLog, ...]:
    """Every rank's effect log, recorded rank by rank without performing anything."""
    check_instance("record_scripted_logs", "schedule", schedule, Schedule)
    _expect_steps_for("record_scripted_logs", steps_for)
    return tuple(
        record_scripted_rank(schedule, rank, _steps_of("record_scripted_logs", steps_for, rank))
        for rank in range(schedule.world.world_size)
    )


# -- sequence assertions ------------------------------------------------------------------

Expected: TypeAlias = "Effect | type[Effect] | Callable[[Effect], bool]"
_EFFECT_KINDS = typing.get_args(Effect)


def _matches(effect: Effect, expected: Expected) -> bool:
    if isinstance(expected, type):
        return isinstance(effect, expected)
    if attrs.has(type(expected)):
        return effect == expected
    return bool(expected(effect))  # type: ignore[operator]  # the callable alternative


def _shown(expected: Expected) -> str:
    if isinstance(expected, type):
        return f"any {expected.__name__}"
    if attrs.has(type(expected)):
        return repr(expected)
    return f"an effect satisfying {getattr(expected, '__name__', repr(expected))}"


def assert_effect_sequence(actual: Sequence[Effect], expected: Sequence[Expected]) -> None:
    """Assert that `actual` is exactly `expected`, item by item.

    Each expected item is an effect (equal), an effect class (any effect of that kind),
    or a predicate. On a mismatch the AssertionError prints the whole actual sequence,
    marks where it went wrong, and names the next expected effect.
    """
    given: tuple[tuple[str, object], ...] = (("actual", actual), ("expected", expected))
    for name, value in given:
        if not isinstance(value, Sequence) or isinstance(value, str | bytes):
            raise InvalidInputError(
                "assert_effect_sequence",
                f"{name} is {a_type(value)}",
                "pass a sequence (e.g. a tuple) of effects",
            )
    for index, item in enumerate(expected):
        if isinstance(item, type) and issubclass(item, _EFFECT_KINDS):
            continue
        if isinstance(item, type) or not (isinstance(item, _EFFECT_KINDS) or callable(item)):
            raise InvalidInputError(
                "assert_effect_sequence",
                f"expected item {index} is {item!r}, none of an effect, an effect class or "
                "a predicate",
                "expect an effect (equal), an effect class (any of that kind), or a "
                "callable taking an effect",
            )
    for index in range(max(len(actual), len(expected))):
        got = actual[index] if index < len(actual) else None
        want = expected[index] if index < len(expected) else None
        if got is not None and want is not None and _matches(got, want):
            continue
        lines = [
            f"{'>>' if i == index else '  '} {i:3d} {describe_effect(e)}  [step {e.step}, "
            f"{e.op.value}]"
            for i, e in enumerate(actual)
        ]
        if got is None:
            lines.append(f">> {index:3d} (the sequence ends here)")
        where = f"effect {index} of {len(actual)}"
        next_expected = "nothing more" if want is None else _shown(want)
        raise AssertionError(
            f"effect sequence differs at {where}; next expected: {next_expected}\n"
            + "\n".join(lines)
        )
