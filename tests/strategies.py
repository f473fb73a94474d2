"""Reusable hypothesis strategies, one clearly headed section per area."""

from __future__ import annotations

import enum
import types
import typing
from collections.abc import Sequence

import attrs
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import numpy as np
import torch

from purepp.batch import BatchFacts
from purepp.cudagraph import (
    BatchExecutionDescriptor,
    CaptureMode,
    CudaGraphDispatcher,
    CUDAGraphMode,
)
from purepp.dp import SEED_TABLE, MicrobatchConfig, RankBatch, TableLayout
from purepp.effects.arrays import IntArray
from purepp.effects.log import EffectLog, Layout, LogHeader
from purepp.effects.vocabulary import (
    DECIDED_MODES,
    AllReduce,
    Broadcast,
    BufferRef,
    Communicator,
    DType,
    Effect,
    EventRef,
    Op,
    Stream,
    WorkRef,
)
from purepp.relay import Platform, RelayConfig
from purepp.testing import ScheduleConfig

# Values numpy cannot read as an array, for the boundary garbage tests: a ragged list
# (numpy raises) and a device tensor (meta stands in for CUDA: no copy without a sync).
UNREADABLE_ARRAYS = st.sampled_from(
    [[[0, 1], [2]], torch.zeros(2, dtype=torch.int32, device="meta")]
)

# ---------------------------------------------------------------------------
# relay: batch facts, relay configurations, step plans (tests/test_relay*.py)
# ---------------------------------------------------------------------------

# How a batch row's tokens relate to its prompt: a decode row and a final
# prefill chunk produce a sampled token this step; a partial chunk does not.
ROW_KINDS = ("decode", "final_chunk", "partial_chunk")


@st.composite
def row_tokens(draw: st.DrawFn, kind: str | None = None) -> tuple[int, int, int]:
    """(num_computed_tokens, num_scheduled_tokens, prefill_len) for one batch row."""
    kind = draw(st.sampled_from(ROW_KINDS)) if kind is None else kind
    if kind == "decode":
        prefill = draw(st.integers(1, 32))
        computed = draw(st.integers(prefill, prefill + 64))
        return computed, draw(st.integers(1, 4)), prefill
    if kind == "final_chunk":
        # computed + scheduled lands exactly on the prefill length: the boundary case.
        prefill = draw(st.integers(1, 32))
        computed = draw(st.integers(0, prefill - 1))
        return computed, prefill - computed, prefill
    if kind == "partial_chunk":
        prefill = draw(st.integers(2, 32))
        computed = draw(st.integers(0, prefill - 2))
        return computed, draw(st.integers(1, prefill - 1 - computed)), prefill
    raise ValueError(f"row_tokens: unknown kind {kind!r}; use one of {ROW_KINDS}")


DECODE = (10, 1, 4)  # computed, scheduled, prefill_len: a decode row, samples
PARTIAL = (0, 2, 8)  # a non-final prefill chunk: no sampled token this step


def make_batch(slots: Sequence[int], rows: Sequence[tuple[int, int, int]]) -> BatchFacts:
    """BatchFacts from slots and (computed, scheduled, prefill_len) per row."""
    columns = np.array(rows, dtype=np.int32).reshape(len(rows), 3)
    return BatchFacts(
        idx_mapping=np.array(slots, dtype=np.int32),
        num_computed_tokens=columns[:, 0],
        num_scheduled_tokens=columns[:, 1],
        prefill_len=columns[:, 2],
    )


@st.composite
def batch_facts(
    draw: st.DrawFn,
    max_num_reqs: int,
    *,
    required_slots: Sequence[int] = (),
    min_rows: int = 0,
    kinds: Sequence[str] = ROW_KINDS,
) -> BatchFacts:
    """A batch over distinct slots below `max_num_reqs`, in any row order.

    `required_slots` (slots freed and reused at once) are always in the batch;
    `kinds` limits the rows' token situations (e.g. only rows that sample).
    """
    required = sorted(set(required_slots))
    pool = [slot for slot in range(max_num_reqs) if slot not in required]
    extra_min = max(0, min_rows - len(required))
    extra: list[int] = (
        draw(st.lists(st.sampled_from(pool), unique=True, min_size=extra_min, max_size=len(pool)))
        if pool
        else []
    )
    slots = draw(st.permutations(required + extra))
    rows = [draw(row_tokens(draw(st.sampled_from(list(kinds))))) for _ in slots]
    return make_batch(slots, rows)


@st.composite
def relay_configs(
    draw: st.DrawFn,
    *,
    max_pp_size: int = 4,
    max_spec: int = 2,
    non_last: bool = False,
) -> RelayConfig:
    """A rank's relay configuration, on any platform.

    `non_last` picks a stage that receives (pp_size >= 2 then).
    """
    pp_size = draw(st.integers(2 if non_last else 1, max_pp_size))
    last = pp_size - 1
    stage = draw(st.integers(0, last - 1) if non_last else st.integers(0, last))
    return RelayConfig.for_stage(
        pp_size=pp_size,
        stage=stage,
        max_num_reqs=draw(st.integers(1, 6)),
        num_speculative_steps=draw(st.integers(0, max_spec)),
        first_rank=draw(st.integers(0, 3)) * pp_size,
        platform=draw(st.sampled_from(Platform)),
    )


@st.composite
def batch_schedules(
    draw: st.DrawFn, max_num_reqs: int, *, min_steps: int = 1, max_steps: int = 8
) -> list[tuple[BatchFacts, tuple[int, ...]]]:
    """Per step: the batch, and the slots freed after the step.

    A freed slot is handed to a new request at once, so it is in the next batch.
    """
    schedule: list[tuple[BatchFacts, tuple[int, ...]]] = []
    reused: tuple[int, ...] = ()
    for _ in range(draw(st.integers(min_steps, max_steps))):
        batch = draw(batch_facts(max_num_reqs, required_slots=reused))
        slots = st.integers(0, max_num_reqs - 1)
        reused = tuple(draw(st.lists(slots, unique=True, max_size=2)))
        schedule.append((batch, reused))
    return schedule


# ---------------------------------------------------------------------------
# dp / cudagraph: dispatchers and per-rank batches (tests/test_dp*.py, test_cudagraph.py)
# ---------------------------------------------------------------------------


def desc(
    mode: CUDAGraphMode,
    tokens: int,
    reqs: int | None,
    *,
    uniform: int | None = None,
    query_len: int | None = None,
    loras: int = 0,
) -> BatchExecutionDescriptor:
    """A descriptor, positionally: mode, padded tokens, padded requests."""
    return BatchExecutionDescriptor(
        cg_mode=mode,
        num_tokens=tokens,
        num_reqs=reqs,
        uniform_token_count=uniform,
        max_query_len=query_len,
        num_active_loras=loras,
    )


@st.composite
def cudagraph_dispatchers(
    draw: st.DrawFn,
    *,
    modes: Sequence[CaptureMode] = tuple(CaptureMode),
    varlen: bool | None = None,
) -> CudaGraphDispatcher:
    """A small dispatcher of any capture mode, speculative length and LoRA cases.

    `modes` limits the capture modes; `varlen` fixes varlen decode (where allowed).
    """
    mode = draw(st.sampled_from(list(modes)))
    sizes = draw(st.lists(st.integers(1, 24), unique=True, min_size=1, max_size=6))
    wants_varlen = draw(st.booleans()) if varlen is None else varlen
    return CudaGraphDispatcher(
        capture_sizes=sorted(sizes),
        capture_mode=mode,
        max_num_reqs=draw(st.integers(1, 8)),
        num_speculative_tokens=draw(st.integers(0, 3)),
        lora_capture_cases=draw(st.sampled_from([(0,), (0,), (0, 2), (0, 1, 4), (2,)])),
        varlen_decode=mode.separate_decode_routine and wants_varlen,
    )


BATCH_KINDS = ("idle", "uniform", "varlen", "mixed")


@st.composite
def rank_batches(
    draw: st.DrawFn,
    dispatcher: CudaGraphDispatcher,
    *,
    kind: str | None = None,
    eager: bool | None = None,
    uniform: int | None = None,
) -> RankBatch:
    """One rank's valid batch for `dispatcher`: idle, uniform decode, varlen or mixed.

    Uniform lengths are usually the dispatcher's decode length, sometimes another;
    token counts sometimes exceed the largest capture size. `kind` fixes the batch
    kind, `eager` fixes need_eager, `uniform` the length of a uniform batch.
    """
    kind = draw(st.sampled_from(BATCH_KINDS)) if kind is None else kind
    # One forced-eager or idle rank makes the whole group eager: keep them the exception.
    need_eager = draw(st.sampled_from([False] * 15 + [True])) if eager is None else eager
    loras = draw(st.sampled_from([0] * 6 + [1, 2, 5]))
    if kind == "idle":
        return RankBatch(num_reqs=0, num_tokens=0, need_eager=need_eager, num_active_loras=loras)
    q = dispatcher.uniform_decode_query_len
    num_reqs = draw(st.integers(1, dispatcher.max_num_reqs))
    padding = draw(st.sampled_from([0, 0, 1, 2]))
    if kind == "uniform":
        uniform = draw(st.sampled_from([q, q, q, 1, 2])) if uniform is None else uniform
        return RankBatch(
            num_reqs=num_reqs,
            num_tokens=uniform * num_reqs + padding,
            uniform_token_count=uniform,
            max_query_len=draw(st.sampled_from([uniform, None])),
            need_eager=need_eager,
            num_active_loras=loras,
        )
    longest = draw(st.integers(1, q + 1)) if kind == "varlen" else draw(st.integers(1, 12))
    num_tokens = draw(st.integers(num_reqs, max(num_reqs, longest * num_reqs))) + padding
    return RankBatch(
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        max_query_len=draw(
            st.sampled_from([min(longest, num_tokens), min(longest, num_tokens), None])
        ),
        need_eager=need_eager,
        num_active_loras=loras,
    )


# A DP world as dp_worlds draws it: the dispatcher every rank shares, one batch per rank.
DPWorld = tuple[CudaGraphDispatcher, list[RankBatch]]


@st.composite
def dp_worlds(draw: st.DrawFn, *, min_size: int = 1, max_size: int = 5) -> DPWorld:
    """A dispatcher shared by every rank, and one batch per rank.

    Half the worlds give every rank the same kind of batch (all decoding, say), the
    schedules where graphs are agreed; the others mix kinds, idle ranks included.
    """
    shared = draw(st.sampled_from([None, None, None, "idle", "uniform", "uniform", "varlen"]))
    # Decode schedules mostly meet dispatchers with decode graphs of their kind.
    decode = shared in ("uniform", "varlen") and draw(st.booleans())
    separate = [m for m in CaptureMode if m.separate_decode_routine]
    dispatcher = draw(
        cudagraph_dispatchers(modes=separate, varlen=shared == "varlen")
        if decode
        else cudagraph_dispatchers()
    )
    q = dispatcher.uniform_decode_query_len
    uniform = draw(st.sampled_from([q, q, None])) if shared == "uniform" else None
    each = rank_batches(dispatcher, kind=shared, uniform=uniform)
    batches = draw(st.lists(each, min_size=min_size, max_size=max_size))
    return dispatcher, batches


# ---------------------------------------------------------------------------
# collective matching: per-rank schedules that agree (tests/test_matching.py)
# ---------------------------------------------------------------------------


@st.composite
def collective_schedules(
    draw: st.DrawFn, *, max_pp: int = 3, max_dp: int = 3, max_steps: int = 6
) -> tuple[Layout, dict[int, list[Effect]]]:
    """A world and every rank's collectives under one fixed wire schedule.

    Each step issues at most one op per communicator (a relay broadcast from the
    replica's last stage, a PP_CPU and a DP_CPU all-reduce, each optional), with
    shapes drawn per step and shared by all ranks; at least one op in all.
    """
    world = Layout(pp=draw(st.integers(1, max_pp)), dp=draw(st.integers(1, max_dp)))
    comms = [Communicator.PP_CPU, Communicator.DP_CPU]
    if world.pp > 1:
        comms.append(Communicator.PP_RELAY)
    plan: list[tuple[int, Communicator, tuple[int, int]]] = []
    for step in range(draw(st.integers(1, max_steps))):
        chosen = draw(st.lists(st.sampled_from(comms), unique=True, max_size=len(comms)))
        for comm in chosen:
            plan.append((step, comm, (draw(st.integers(1, 4)), draw(st.integers(1, 3)))))
    if not plan:
        plan.append((0, Communicator.PP_CPU, (5, world.dp)))
    per_rank: dict[int, list[Effect]] = {}
    for rank in range(world.world_size):
        last_stage = world.rank_of(pp_stage=world.pp - 1, dp_index=world.dp_index(rank))
        effects: list[Effect] = []
        for step, comm, shape in plan:
            if comm is Communicator.PP_RELAY:
                op = Op.BROADCAST if rank == last_stage else Op.RECEIVE
                effects.append(
                    Broadcast(
                        step=step,
                        op=op,
                        buffer=BufferRef(f"relay.{step}"),
                        shape=shape,
                        dtype=DType.INT64,
                        src=last_stage,
                        comm=comm,
                        stream=Stream.RELAY,
                    )
                )
            else:
                effects.append(
                    AllReduce(
                        step=step,
                        op=Op.AGREE,
                        contribution=np.zeros(shape, dtype=np.int32),
                        result=BufferRef(f"{comm.value}.{step}"),
                        comm=comm,
                        work=None,
                    )
                )
        per_rank[rank] = effects
    return world, per_rank


# ---------------------------------------------------------------------------
# effects and effect logs: every class of the closed union (tests/test_log.py)
# ---------------------------------------------------------------------------

# Any text: a log must carry whatever names a step gives its buffers.
effect_steps = st.integers(0, 10_000)
effect_ranks = st.integers(0, 7)
ref_names = st.text(max_size=8)
int32s = st.integers(int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max))
# Shapes with zero-length dimensions included: an idle rank copies empty arrays.
int32_arrays: st.SearchStrategy[IntArray] = hnp.arrays(
    np.int32,
    hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3),
    elements=int32s,
)


def _field_strategy(
    owner: type,
    name: str,
    tp: object,
    steps: st.SearchStrategy[int],
    ranks: st.SearchStrategy[int],
) -> st.SearchStrategy[object]:
    """A strategy for one effect field, chosen by its declared type (and name, for ints)."""
    int_fields: dict[str, st.SearchStrategy[int]] = {"step": steps, "src": ranks, "fill": int32s}
    args = typing.get_args(tp)
    if tp is int:
        return int_fields.get(name, st.integers(0, 64))
    if tp is bool:
        return st.booleans()
    if tp is str and name == "cg_mode":  # one of a few names
        return st.sampled_from(DECIDED_MODES)
    if isinstance(tp, type) and issubclass(tp, BufferRef | EventRef | WorkRef):
        return ref_names.map(tp)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from(tp)
    if tp == IntArray:
        return int32_arrays
    if typing.get_origin(tp) is tuple and args[1:] == (Ellipsis,):
        items = _field_strategy(owner, name, args[0], steps, ranks)
        return st.lists(items, max_size=4).map(tuple)
    if isinstance(tp, type) and attrs.has(tp):  # a value inside an effect (Section)
        hints = typing.get_type_hints(tp)
        parts = {
            f.name: _field_strategy(tp, f.name, hints[f.name], steps, ranks)
            for f in attrs.fields(tp)
        }
        return st.builds(tp, **parts)
    if isinstance(tp, types.UnionType) and type(None) in args:
        (inner,) = (arg for arg in args if arg is not type(None))
        return st.none() | _field_strategy(owner, name, inner, steps, ranks)
    # A new field type in the vocabulary: teach this function to generate it.
    raise TypeError(f"no strategy for {owner.__name__}.{name}: {tp!r}")


def effects_of(
    cls: type[Effect],
    *,
    steps: st.SearchStrategy[int] = effect_steps,
    ranks: st.SearchStrategy[int] = effect_ranks,
) -> st.SearchStrategy[Effect]:
    """Arbitrary valid effects of one class, built from its declared field types."""
    hints = typing.get_type_hints(cls)
    fields = {
        field.name: _field_strategy(cls, field.name, hints[field.name], steps, ranks)
        for field in attrs.fields(cls)
    }
    return st.builds(cls, **fields)


def effects(
    *,
    steps: st.SearchStrategy[int] = effect_steps,
    ranks: st.SearchStrategy[int] = effect_ranks,
) -> st.SearchStrategy[Effect]:
    """Arbitrary valid effects of every class of the closed union `Effect`."""
    return st.one_of([effects_of(cls, steps=steps, ranks=ranks) for cls in typing.get_args(Effect)])


# Built once: building reads every class's type hints.
any_effect = effects()
layouts = st.builds(Layout, pp=st.integers(1, 4), dp=st.integers(1, 4))


def _json_containers(children: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    keys = st.text(max_size=8)
    return st.lists(children, max_size=3) | st.dictionaries(keys, children, max_size=3)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    _json_containers,
    max_leaves=8,
)
json_objects = st.dictionaries(st.text(max_size=8), json_values, max_size=4)


@st.composite
def log_headers(draw: st.DrawFn, world: Layout | None = None) -> LogHeader:
    """A header for any rank of `world` (any layout when None), with a free-form config."""
    world = draw(layouts) if world is None else world
    rank = draw(st.integers(0, world.world_size - 1))
    return LogHeader(rank=rank, world=world, config=draw(json_objects))


@st.composite
def effect_logs(draw: st.DrawFn, *, min_effects: int = 0, max_effects: int = 8) -> EffectLog:
    """A valid log: a header and arbitrary effects numbered in issue order."""
    header = draw(log_headers())
    chosen = draw(st.lists(any_effect, min_size=min_effects, max_size=max_effects))
    return EffectLog.from_effects(header, chosen)


# ---------------------------------------------------------------------------
# torch interpreter: row gathers and scatters (tests/test_torch_interpreter.py)
# ---------------------------------------------------------------------------

Int64Rows = np.ndarray[tuple[int, ...], np.dtype[np.int64]]
Int32Index = np.ndarray[tuple[int, ...], np.dtype[np.int32]]


@st.composite
def gather_cases(draw: st.DrawFn) -> tuple[Int64Rows, Int32Index]:
    """(source [rows, cols] int64, index [n] int32): any in-range rows, repeats allowed."""
    rows = draw(st.integers(1, 8))
    cols = draw(st.integers(0, 4))
    source = np.arange(rows * cols, dtype=np.int64).reshape(rows, cols) * 7 - 3
    index = draw(st.lists(st.integers(0, rows - 1), max_size=10))
    return source, np.array(index, dtype=np.int32).reshape(-1)


@st.composite
def scatter_cases(draw: st.DrawFn) -> tuple[Int64Rows, Int64Rows, Int32Index]:
    """(target [slots, cols], source [n, cols], index [n]) as the relay's consume makes them.

    Kept rows name distinct slots (one row per request slot); any number of rows,
    possibly all, are skipped with -1.
    """
    slots = draw(st.integers(1, 10))
    cols = draw(st.integers(1, 4))
    kept = draw(st.lists(st.integers(0, slots - 1), unique=True, max_size=slots))
    skipped = draw(st.integers(0, 4))
    index = np.array(draw(st.permutations([*kept, *([-1] * skipped)])), dtype=np.int32)
    index = index.reshape(-1)
    target = np.full((slots, cols), -5, dtype=np.int64)
    source = 100 + np.arange(index.size * cols, dtype=np.int64).reshape(index.size, cols)
    return target, source, index


# ---------------------------------------------------------------------------
# scripted schedules (tests/test_scripted.py)
# ---------------------------------------------------------------------------


@st.composite
def schedule_configs(
    draw: st.DrawFn, *, max_pp: int = 4, max_dp: int = 3, max_spec: int = 2, steps: int = 14
) -> ScheduleConfig:
    """A scripted PP x DP schedule's configuration: any world up to the bounds, any seed,
    with or without the relay's validated header."""
    return ScheduleConfig(
        pp=draw(st.integers(1, max_pp)),
        dp=draw(st.integers(1, max_dp)),
        spec=draw(st.integers(0, max_spec)),
        steps=steps,
        seed=draw(st.integers(0, 2**32 - 1)),
        max_num_reqs=draw(st.integers(1, 6)),
        validate_header=draw(st.booleans()),
    )


# ---------------------------------------------------------------------------
# DP agreement: table layouts and dead ranks (tests/test_dp_newest.py)
# ---------------------------------------------------------------------------


@st.composite
def microbatch_configs(draw: st.DrawFn) -> MicrobatchConfig:
    """Thresholds low enough that the batches of `rank_batches` often reach them."""
    return MicrobatchConfig(
        num_ubatches=draw(st.integers(2, 4)),
        decode_token_threshold=draw(st.integers(0, 12)),
        prefill_token_threshold=draw(st.integers(0, 40)),
    )


def table_layouts() -> st.SearchStrategy[TableLayout]:
    """The seed's five rows, or the newest six with some microbatching thresholds."""
    newest = microbatch_configs().map(lambda config: TableLayout(microbatch=config))
    return st.one_of(st.just(SEED_TABLE), newest)


@st.composite
def dead_rank_sets(draw: st.DrawFn, dp_size: int) -> frozenset[int]:
    """Ranks of a `dp_size` group that died: any set leaving at least one survivor."""
    ranks = draw(st.lists(st.integers(0, dp_size - 1), unique=True, max_size=dp_size - 1))
    return frozenset(ranks)
