"""A hunt for behaviour where purepp and the seed's `PPHandler` could part, step by step.

`tests/test_relay_against_seed.py` compares every stage's consumes against an answer
worked out from the schedule. Here the seed itself runs beside purepp: the imperative
re-expression `benchmarks.seed_relay.SeedRelay` (the seed's calls one for one) on real CPU
tensors, its broadcasts carried by an in-process mailbox, and purepp's pure steps in a
simulated world, over the same schedules. The schedules reach what the other comparison
leaves out: arbitrary prefill chunks mixed with decodes (the need-sampled mask computed
from computed, scheduled and prefill lengths, not picked per row), steps where no row
samples and empty batches, slots freed both before the consume and between the consume
and the receive (the rank step's own order), a slot freed twice, and the receive's answer
(whether every row needs its token). Each consume's whole hand-out is compared: the
padded tokens, both counts, the slot mapping with its -1 rows, and the receiver's draft
table after the scatter.

Then the DP agreement against the seed's `dispatch_cg_and_sync_dp` /
`sync_cudagraph_and_dp_padding` with any pure dispatcher (a reuse, dp_size 1), the
EAGLE-3 aux-state relay, the dispatcher against vLLM V2's `CudaGraphManager`, and the
whole rank step in scripted PP x DP worlds against the seed's relay and agreement.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.seed_relay import DeviceCalls, SeedBatch, SeedRelay, host_calls
from purepp.batch import BatchFacts
from purepp.cudagraph import (
    BatchExecutionDescriptor,
    CaptureMode,
    CudaGraphDispatcher,
    CUDAGraphMode,
)
from purepp.dp import (
    AgreementGroup,
    AgreementLanes,
    DispatchOutcome,
    DPSyncState,
    Lane,
    RankBatch,
    agree_across_ranks,
    decide_alone,
    finish_agreement,
    start_agreement,
)
from purepp.effects.simulator import RankContext, simulate
from purepp.effects.vocabulary import DType, Effect, TensorSpec
from purepp.layout import Layout
from purepp.relay import (
    Platform,
    RelayConfig,
    RelayState,
    broadcast_drafts,
    broadcast_sampled,
    consume_previous_step,
    end_step,
    free_request_slots,
    init_relay,
    receive,
    relay_aux_hidden_states,
)
from purepp.testing import ConsumedStep, Schedule, ScheduleConfig, make_schedule, simulate_schedule

# One consume's hand-out, as plain lists: tokens, num_sampled, num_rejected, slot mapping,
# then the receiver's draft table after it (None without speculation or update).
Handout = tuple[list[list[int]], list[int], list[int], list[int]] | None
Seen = tuple[Handout, list[list[int]] | None]


@dataclass(frozen=True)
class Row:
    """One batch row: its slot and its token counts (the mask follows from the counts)."""

    slot: int
    computed: int
    scheduled: int
    prefill_len: int


@dataclass(frozen=True)
class Plan:
    rows: tuple[Row, ...]
    width: int  # columns of the last stage's sampled tokens
    frees_before: tuple[int, ...] = ()  # freed before this step's consume
    frees_mid: tuple[int, ...] = ()  # freed between this step's consume and its receive


@dataclass(frozen=True)
class World:
    pp: int
    spec: int
    max_num_reqs: int
    plans: tuple[Plan, ...]
    platform: Platform = Platform.CUDA
    update_drafts: bool = True

    @property
    def depth(self) -> int:
        return 1 if self.platform is Platform.XPU_NO_MICROBATCH else self.pp


def token(step: int, slot: int, column: int) -> int:
    return 1000 * step + 10 * slot + column + 1


def drafts_of(step: int, slot: int, spec: int) -> list[int]:
    return [-token(step, slot, j) for j in range(spec)]


def arrays(plan: Plan) -> tuple[npt.NDArray[np.int32], ...]:
    columns = [[r.slot, r.computed, r.scheduled, r.prefill_len] for r in plan.rows]
    block = np.array(columns, np.int32).reshape(-1, 4).T
    return tuple(np.ascontiguousarray(block[i]) for i in range(4))


def sampled_values(plan: Plan, t: int) -> tuple[npt.NDArray[np.int64], ...]:
    n, k = len(plan.rows), plan.width
    tokens = np.array([[token(t, r.slot, j) for j in range(k)] for r in plan.rows], np.int64)
    counts = np.array([1 + (r.slot + t) % k for r in plan.rows], np.int64)
    rejected = np.array([(r.slot * 3 + t) % k for r in plan.rows], np.int64)
    return tokens.reshape(n, k), counts, rejected


def draft_table(world: World, plan: Plan, t: int) -> npt.NDArray[np.int64]:
    table = np.full((world.max_num_reqs, world.spec), 7, np.int64)  # rows outside the batch
    for r in plan.rows:
        table[r.slot] = drafts_of(t, r.slot, world.spec)
    return table


# --- purepp: the pure steps in a simulated world --------------------------------------------


def send(
    world: World,
    config: RelayConfig,
    state: RelayState,
    context: RankContext,
    *,
    batch: BatchFacts,
    t: int,
) -> tuple[RelayState, list[Effect]]:
    """The last stage's step t: bind its outputs, broadcast them and the drafts."""
    plan, it, inputs = world.plans[t], context.interpreter, config.inputs
    tokens, counts, rejected = sampled_values(plan, t)
    it.bind(inputs.sampled_tokens, tokens)
    it.bind(inputs.num_sampled, counts.astype(np.int32))
    it.bind(inputs.num_rejected, rejected.astype(np.int32))
    it.bind(inputs.draft_table, draft_table(world, plan, t))
    shape = (len(plan.rows), plan.width)
    sent = broadcast_sampled(config, state, batch, TensorSpec(shape, DType.INT64))
    effects, state = list(sent.effects), sent.state
    if world.spec:
        spec = TensorSpec((world.max_num_reqs, world.spec), DType.INT64)
        drafted = broadcast_drafts(config, state, batch, spec)
        effects, state = effects + list(drafted.effects), drafted.state
    return state, effects


def run_purepp(world: World) -> tuple[dict[int, list[Seen]], dict[int, list[bool]]]:
    seen: dict[int, list[Seen]] = {}
    answers: dict[int, list[bool]] = {}

    def program(context: RankContext) -> Iterator[tuple[Effect, ...]]:
        config = RelayConfig.for_stage(
            pp_size=world.pp,
            stage=context.stage,
            max_num_reqs=world.max_num_reqs,
            num_speculative_steps=world.spec,
            platform=world.platform,
        )
        state: RelayState = init_relay(config)
        it, inputs = context.interpreter, config.inputs
        out = seen.setdefault(context.stage, [])
        said = answers.setdefault(context.stage, [])
        if not config.is_last_stage:
            it.bind(inputs.draft_table, np.zeros((world.max_num_reqs, world.spec), np.int64))
        for t, plan in enumerate(world.plans):
            slots, computed, scheduled, prefill = arrays(plan)
            batch = BatchFacts(
                idx_mapping=slots,
                num_computed_tokens=computed,
                num_scheduled_tokens=scheduled,
                prefill_len=prefill,
            )
            state = free_request_slots(config, state, list(plan.frees_before)).state
            it.bind(inputs.idx_mapping, slots)
            effects: list[Effect] = []
            if config.is_last_stage:
                state, effects = send(world, config, state, context, batch=batch, t=t)
            else:
                taken = consume_previous_step(config, state, update_drafts=world.update_drafts)
                yield taken.effects
                state = taken.state
                handout: Handout = None
                if taken.result is not None:
                    got = taken.result
                    device = it.host_array(got.idx_mapping).tolist()
                    assert device == got.idx_mapping_np.tolist()
                    handout = (
                        it.host_array(got.sampled_tokens).tolist(),
                        it.host_array(got.num_sampled).tolist(),
                        it.host_array(got.num_rejected).tolist(),
                        device,
                    )
                drafts = it.host_array(inputs.draft_table).tolist() if world.spec else None
                out.append((handout, drafts))
                state = free_request_slots(config, state, list(plan.frees_mid)).state
                posted = receive(config, state, batch)
                said.append(posted.result)
                effects, state = list(posted.effects), posted.state
            ended = end_step(config, state)
            state = ended.state
            yield (*effects, *ended.effects)

    in_flight = 1 if world.platform is Platform.XPU_NO_MICROBATCH else None
    simulate(Layout(pp=world.pp, dp=1), program, max_steps_in_flight=in_flight)
    last = world.pp - 1  # the last stage consumes and receives nothing
    assert (seen.pop(last), answers.pop(last)) == ([], [])
    return seen, answers


# --- the seed: SeedRelay on CPU tensors, broadcasts through a mailbox -------------------------


def mailbox_calls(
    send_to: list[deque[torch.Tensor]] | None, inbox: deque[torch.Tensor] | None
) -> DeviceCalls:
    """The seed's CPU calls, with `dist.broadcast` carried in process: the sender copies
    each tensor into every receiver's inbox; a receiver fills its tensor from its inbox
    (the shapes and dtypes must match, as NCCL's would have to)."""

    def broadcast(tensor: torch.Tensor, *, src: int, group: object) -> None:
        if send_to is not None:
            for box in send_to:
                box.append(tensor.clone())
            return
        assert inbox is not None
        came = inbox.popleft()
        assert (came.shape, came.dtype) == (tensor.shape, tensor.dtype)
        tensor.copy_(came)

    return replace(host_calls(), broadcast=broadcast)


def run_seed(world: World) -> tuple[dict[int, list[Seen]], dict[int, list[bool]]]:
    inboxes: list[deque[torch.Tensor]] = [deque() for _ in range(world.pp - 1)]
    device = torch.device("cpu")

    def relay(calls: DeviceCalls, last: bool) -> SeedRelay:
        return SeedRelay(
            calls=calls,
            is_last_rank=last,
            last_rank=world.pp - 1,
            ring_depth=world.depth,
            max_num_reqs=world.max_num_reqs,
            num_speculative_steps=world.spec,
            device=device,
            group=None,
        )

    sender = relay(mailbox_calls(inboxes, None), True)
    receivers = [relay(mailbox_calls(None, box), False) for box in inboxes]
    tables = [torch.zeros(world.max_num_reqs, world.spec, dtype=torch.int64) for _ in inboxes]
    seen: dict[int, list[Seen]] = {stage: [] for stage in range(world.pp - 1)}
    answers: dict[int, list[bool]] = {stage: [] for stage in range(world.pp - 1)}
    for t, plan in enumerate(world.plans):
        slots, computed, scheduled, prefill = arrays(plan)
        batch = SeedBatch(
            num_reqs=len(plan.rows),
            idx_mapping=torch.from_numpy(slots.copy()),
            idx_mapping_np=slots,
            num_computed_tokens_np=computed,
            num_scheduled_tokens=scheduled,
            prefill_len_np=prefill,
        )
        tokens, counts, rejected = sampled_values(plan, t)
        sender.broadcast(
            torch.from_numpy(tokens),
            torch.from_numpy(counts.astype(np.int32)),
            torch.from_numpy(rejected.astype(np.int32)),
            batch,
        )
        if world.spec:
            sender.broadcast_drafts(torch.from_numpy(draft_table(world, plan, t)), batch)
        for stage, seed in enumerate(receivers):
            for slot in plan.frees_before:
                seed.on_req_idx_freed(slot)
            table = tables[stage] if world.update_drafts else None
            got = seed.get_prev_sampled_outputs(table)
            handout: Handout = None
            if got is not None:
                handout = (
                    got["sampled_tokens"].tolist(),
                    got["num_sampled"].tolist(),
                    got["num_rejected"].tolist(),
                    got["idx_mapping"].tolist(),
                )
            seen[stage].append((handout, tables[stage].tolist() if world.spec else None))
            for slot in plan.frees_mid:
                seed.on_req_idx_freed(slot)
            answers[stage].append(seed.receive(batch))
        assert all(not box for box in inboxes)  # every send was received, and no more
    return seen, answers


# --- schedules ------------------------------------------------------------------------------


@st.composite
def rows(draw: st.DrawFn, slot: int) -> Row:
    prefill = draw(st.integers(0, 9))
    computed = draw(st.integers(0, 9))
    scheduled = draw(st.integers(0, 4))
    return Row(slot=slot, computed=computed, scheduled=scheduled, prefill_len=prefill)


@st.composite
def worlds(draw: st.DrawFn) -> World:
    pp = draw(st.integers(2, 4))
    spec = draw(st.integers(0, 3))
    m = draw(st.integers(1, 5))
    frees = st.lists(st.integers(0, m - 1), max_size=3).map(tuple)
    plans = []
    for _ in range(draw(st.integers(1, 3 * pp + 2))):
        slots = draw(st.permutations(range(m)))[: draw(st.integers(0, m))]
        plans.append(
            Plan(
                rows=tuple(draw(rows(s)) for s in slots),
                width=draw(st.integers(1, spec + 1)),
                frees_before=draw(frees),
                frees_mid=draw(frees),
            )
        )
    return World(
        pp=pp,
        spec=spec,
        max_num_reqs=m,
        plans=tuple(plans),
        platform=draw(st.sampled_from(list(Platform))),
        update_drafts=draw(st.booleans()),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=worlds())
def test_every_receiver_hands_out_what_the_seed_hands_out_step_by_step(world: World) -> None:
    """Law: for any schedule of mixed prefill chunks and decodes, empty and non-sampling
    batches, frees before the consume and between the consume and the receive, plain and
    speculative widths and any platform, each receiving stage's consume hands out what the
    seed's `get_prev_sampled_outputs` returns at that step (None, or the same tokens, counts
    and filtered slot mapping), leaves the same draft table, and each receive answers as
    the seed's does."""
    assert run_purepp(world) == run_seed(world)


def test_a_slot_freed_between_consume_and_receive_keeps_this_steps_receive() -> None:
    """The rank step frees between the consume and the receive. A free there drops the
    entries already in flight for the slot, but not the one received after it: the
    receive snapshots the generation the free left, as the seed's does."""
    decode = Row(slot=0, computed=5, scheduled=1, prefill_len=5)
    plans = tuple(Plan(rows=(decode,), width=1, frees_mid=(0,) if t == 2 else ()) for t in range(6))
    world = World(pp=2, spec=1, max_num_reqs=1, plans=plans)
    seed_seen, _ = run_seed(world)
    pure_seen, _ = run_purepp(world)
    assert pure_seen == seed_seen
    kept = [t for t, (handout, _) in enumerate(seed_seen[0]) if handout is not None]
    # Received at 0..5, consumed at 2..: step 1's entry (in flight at the free) is dropped,
    # step 0's was consumed before it, step 2's was received after it.
    assert kept == [2, 4, 5]


@pytest.mark.parametrize("platform", list(Platform))
def test_a_batch_where_no_row_samples_posts_nothing_on_either_side(platform: Platform) -> None:
    """Every row a non-final prefill chunk, or no row at all: neither the seed nor purepp
    sends or posts anything, the receive answers False, and the consume of that step's
    entry hands out None."""
    chunk = Row(slot=1, computed=0, scheduled=3, prefill_len=8)
    plans = (Plan(rows=(chunk,), width=1), Plan(rows=(), width=1)) * 3
    world = World(pp=2, spec=2, max_num_reqs=2, plans=plans, platform=platform)
    pure = run_purepp(world)
    assert pure == run_seed(world)
    seen, answers = pure
    assert all(handout is None for handout, _ in seen[0])
    assert answers[0] == [False] * len(plans)


def seed_relay_aux(
    keys: tuple[str, ...], incoming: dict[str, int] | None, outgoing: dict[str, int]
) -> dict[str, int]:
    """PPHandler.relay_aux_hidden_states over plain dicts: the outgoing tensors, then the
    configured keys carried through from the incoming ones (they win a clash)."""
    if not keys:
        return outgoing
    assert incoming is not None
    return outgoing | {key: incoming[key] for key in keys}


names = st.sampled_from(["hidden_states", "residual", "aux_0", "aux_1", "aux_2"])


@given(
    keys=st.lists(names, unique=True, max_size=3).map(tuple),
    incoming=st.dictionaries(names, st.integers()),
    outgoing=st.dictionaries(names, st.integers()),
    data=st.data(),
)
def test_aux_hidden_states_are_carried_through_as_the_seed_carries_them(
    keys: tuple[str, ...],
    incoming: dict[str, int],
    outgoing: dict[str, int],
    data: st.DataObject,
) -> None:
    """Law: for any configured keys the incoming tensors hold (or none configured, with or
    without incoming tensors), the outgoing tensors are the seed's: the stage's own plus
    the configured keys from the previous stage, the carried ones winning a clash."""
    given_in: dict[str, int] | None = {**incoming, **{k: data.draw(st.integers()) for k in keys}}
    if not keys and data.draw(st.booleans()):
        given_in = None
    config = RelayConfig.for_stage(pp_size=3, stage=1, max_num_reqs=2, aux_hidden_state_keys=keys)
    got = relay_aux_hidden_states(config, given_in, outgoing)
    assert got == seed_relay_aux(keys, given_in, outgoing)
    assert list(got) == list(seed_relay_aux(keys, given_in, outgoing))  # the seed's order


# --- the DP agreement against the seed's procedure, with any dispatcher --------------------------

Answer = Callable[[int, int, int | None, int, int | None], BatchExecutionDescriptor]
# What a decision is compared by: the descriptor, and the sync's seed fields (None: no sync).
Decision = tuple[BatchExecutionDescriptor, tuple[list[int], int | None, bool, int] | None]


class AnyDispatcher:
    """A Dispatcher answering each question with a drawn descriptor, the same one every
    time it is asked (a pure function): nothing of `CudaGraphDispatcher`'s own habits (FULL
    before PIECEWISE, eager at 0 tokens, padded counts at least the asked ones) holds."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer

    def dispatch(
        self,
        num_reqs: int,
        num_tokens: int,
        uniform_token_count: int | None,
        /,
        *,
        num_active_loras: int = 0,
        max_query_len: int | None = None,
    ) -> BatchExecutionDescriptor:
        return self.answer(
            num_reqs, num_tokens, uniform_token_count, num_active_loras, max_query_len
        )


descriptors = st.builds(
    BatchExecutionDescriptor,
    cg_mode=st.sampled_from(list(CUDAGraphMode)),
    num_tokens=st.integers(0, 64),
    num_reqs=st.none() | st.integers(0, 16),
    uniform_token_count=st.none() | st.integers(1, 4),
    max_query_len=st.none() | st.integers(1, 8),
    num_active_loras=st.integers(0, 3),
)
answers = st.functions(like=lambda a, b, c, d, e: None, returns=descriptors, pure=True)


@st.composite
def rank_batches(draw: st.DrawFn) -> RankBatch:
    tokens = draw(st.integers(0, 24))
    reqs = draw(st.integers(0, tokens))
    uniform = draw(st.none() | st.integers(1, 3))
    if uniform is not None and uniform * reqs > tokens:
        uniform = None
    return RankBatch(
        num_reqs=reqs,
        num_tokens=tokens,
        uniform_token_count=uniform,
        max_query_len=draw(st.none() | st.integers(1, 6)),
        need_eager=draw(st.booleans()),
        num_active_loras=draw(st.integers(0, 3)),
    )


def seed_desired(manager: Any, b: RankBatch, uniform: int | None) -> BatchExecutionDescriptor:
    """dispatch_cg_and_sync_dp's first half: eager when forced (or reusing an eager sync),
    else the manager's answer."""
    reuse_eager = b.dp_sync is not None and b.dp_sync.eager
    if b.need_eager or reuse_eager:
        return BatchExecutionDescriptor(
            cg_mode=CUDAGraphMode.NONE,
            num_tokens=b.num_tokens,
            num_reqs=b.num_reqs,
            num_active_loras=b.num_active_loras,
        )
    answer: BatchExecutionDescriptor = manager.dispatch(
        b.num_reqs,
        b.num_tokens,
        uniform,
        num_active_loras=b.num_active_loras,
        max_query_len=b.max_query_len,
    )
    return answer


def seed_world(manager: Any, batches: list[RankBatch]) -> list[Decision]:
    """dispatch_cg_and_sync_dp on every rank (dp_size > 1, no dp_sync), the all-reduce a
    sum of the ranks' columns, then sync_cudagraph_and_dp_padding, line by line."""
    dp_size = len(batches)
    desired = [seed_desired(manager, b, b.uniform_token_count) for b in batches]
    tensor = torch.zeros(5, dp_size, dtype=torch.int32)
    for rank, (b, d) in enumerate(zip(batches, desired, strict=True)):
        tensor[0][rank] = b.num_tokens
        tensor[1][rank] = d.cg_mode.value
        tensor[2][rank] = b.uniform_token_count or 0
        tensor[3][rank] = b.max_query_len or -1
        tensor[4][rank] = b.num_reqs
    decisions: list[Decision] = []
    for b, d in zip(batches, desired, strict=True):
        reduced = tensor.clone()  # each rank's own reduced copy
        tokens_across, modes, uniforms, query_lens, reqs_across = reduced
        uniform: int | None = int(uniforms[0])
        if uniform == 0 or any(u != uniform for u in uniforms.tolist()):
            uniform = None
        if torch.all(tokens_across == 0).item():
            idle = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=0, num_reqs=0)
            decisions.append((idle, None))
            continue
        mode = CUDAGraphMode(int(modes.min().item()))
        if mode == CUDAGraphMode.NONE:
            eager = BatchExecutionDescriptor(
                cg_mode=CUDAGraphMode.NONE,
                num_tokens=b.num_tokens,
                num_reqs=b.num_reqs,
                num_active_loras=d.num_active_loras,
            )
            most = int(reqs_across.max().item())
            decisions.append((eager, (tokens_across.tolist(), uniform, True, most)))
            continue
        synced_tokens = int(tokens_across.max().item())
        query_len: int | None = None
        if bool(torch.all(query_lens != -1).item()):
            query_len = int(query_lens.max().item())
        synced: BatchExecutionDescriptor = manager.dispatch(
            b.num_reqs,
            synced_tokens,
            uniform,
            num_active_loras=b.num_active_loras,
            max_query_len=query_len,
        )
        tokens_across[:] = synced.num_tokens
        bound = (
            synced.num_reqs
            if synced.cg_mode == CUDAGraphMode.FULL and synced.num_reqs is not None
            else int(reqs_across.max().item())
        )
        decisions.append((synced, (tokens_across.tolist(), uniform, False, bound)))
    return decisions


def seed_reuse(manager: Any, b: RankBatch, rank: int) -> Decision:
    """dispatch_cg_and_sync_dp given a dp_sync (dp_size > 1): no collective."""
    sync = b.dp_sync
    assert sync is not None
    wanted = seed_desired(manager, b, sync.uniform_token_count)
    assert sync.num_tokens_across_dp[rank] == b.num_tokens
    assert sync.uniform_token_count is None or b.uniform_token_count == sync.uniform_token_count
    counts = sync.num_tokens_across_dp.tolist()
    if not sync.eager and wanted.num_tokens != b.num_tokens:
        counts = [wanted.num_tokens] * len(counts)
    return wanted, (counts, sync.uniform_token_count, sync.eager, sync.num_reqs)


def decided(outcome: DispatchOutcome) -> Decision:
    sync = outcome.sync
    if sync is None:
        return outcome.descriptor, None
    fields = (sync.num_tokens_across_dp.tolist(), sync.uniform_token_count, sync.eager)
    return outcome.descriptor, (*fields, sync.num_reqs)


@settings(max_examples=300, deadline=None)
@given(
    answer=answers,
    drafter_answer=answers,
    batches=st.lists(rank_batches(), min_size=2, max_size=5),
    data=st.data(),
)
def test_any_dispatcher_agrees_as_the_seed_and_a_reuse_reuses_as_the_seed(
    answer: Answer, drafter_answer: Answer, batches: list[RankBatch], data: st.DataObject
) -> None:
    """Law: whatever a (pure) dispatcher answers, each rank's descriptor and sync are the
    seed's, idle, eager and graph branches alike; and a drafter reusing a rank's sync with
    a dispatcher of its own, at the count the sync holds for it (its query-length bound
    the sync's, see README: purepp's reuse dispatches with the agreed one), forced eager
    or not, with fewer requests or other LoRA counts, decides as the seed's reuse does."""
    target = AnyDispatcher(answer)
    outcomes = agree_across_ranks(target, batches)
    assert [decided(o) for o in outcomes] == seed_world(target, batches)
    drafter = AnyDispatcher(drafter_answer)
    for rank, (b, outcome) in enumerate(zip(batches, outcomes, strict=True)):
        sync = outcome.sync
        if sync is None:
            continue
        tokens = int(sync.num_tokens_across_dp[rank])
        reqs = data.draw(st.integers(0, min(b.num_reqs, tokens)))
        if b.uniform_token_count is not None and b.uniform_token_count * reqs > tokens:
            continue  # a batch no caller has: more tokens for its requests than it holds
        reuse = RankBatch(
            num_reqs=reqs,
            num_tokens=tokens,
            uniform_token_count=b.uniform_token_count,
            max_query_len=sync.max_query_len,
            need_eager=data.draw(st.booleans()),
            num_active_loras=data.draw(st.integers(0, 3)),
            dp_sync=sync,
        )
        group = AgreementGroup(dp_size=len(batches), dp_rank=rank)
        started = start_agreement(
            AgreementLanes(), group, drafter, reuse, step=1, lane=Lane.DRAFTER
        )
        assert started.effects == ()
        done = finish_agreement(started.state, started.result, None)
        assert decided(done.result) == seed_reuse(drafter, reuse, rank)


@settings(max_examples=150, deadline=None)
@given(answer=answers, batch=rank_batches())
def test_a_lone_rank_decides_as_the_seeds_dispatch_with_dp_size_one(
    answer: Answer, batch: RankBatch
) -> None:
    """Law: with dp_size 1 the seed returns its first dispatch (eager when forced) and no
    sync; purepp's lone rank decides the same, with no effect, whatever the dispatcher."""
    dispatcher = AnyDispatcher(answer)
    group = AgreementGroup(dp_size=1, dp_rank=0)
    expected = seed_desired(dispatcher, batch, batch.uniform_token_count)
    alone = decide_alone(AgreementLanes(), group, dispatcher, batch, step=0, lane=Lane.TARGET)
    assert decided(alone) == (expected, None)
    started = start_agreement(AgreementLanes(), group, dispatcher, batch, step=0)
    assert started.effects == ()
    assert decided(finish_agreement(started.state, started.result, None).result) == (
        expected,
        None,
    )


class PadsToEight:
    """A drafter's dispatcher whose one graph has 8 tokens: it pads every batch to it."""

    def dispatch(
        self,
        num_reqs: int,
        num_tokens: int,
        uniform_token_count: int | None,
        /,
        *,
        num_active_loras: int = 0,
        max_query_len: int | None = None,
    ) -> BatchExecutionDescriptor:
        return BatchExecutionDescriptor(
            cg_mode=CUDAGraphMode.PIECEWISE, num_tokens=8, num_reqs=None
        )


def test_a_reuse_that_pads_further_pads_every_live_rank_a_zero_count_included() -> None:
    """Was a divergence: a reuse whose dispatcher pads past the agreed count reported the
    new count only for ranks whose agreed count was above 0 (0 was read as a dead rank).
    The seed's `full_like` gives it to every rank; purepp now gives it to every live rank
    (a dead rank keeps 0). An agreed count of 0 comes from a target dispatcher that
    answers a graph of 0 tokens, as the law above found."""
    sync = DPSyncState(
        num_tokens_across_dp=np.zeros(2, np.int32),
        uniform_token_count=None,
        eager=False,
        num_reqs=0,
    )
    batch = RankBatch(num_reqs=0, num_tokens=0, dp_sync=sync)
    live = AgreementGroup(dp_size=2, dp_rank=0)
    for group, expected in ((live, [8, 8]), (live.mark_dead(1), [8, 0])):
        started = start_agreement(
            AgreementLanes(), group, PadsToEight(), batch, step=0, lane=Lane.DRAFTER
        )
        outcome = finish_agreement(started.state, started.result, None).result
        assert outcome.sync is not None
        assert outcome.sync.num_tokens_across_dp.tolist() == expected
        assert outcome.descriptor.num_tokens == 8
    assert seed_reuse(PadsToEight(), batch, 0)[1] == ([8, 8], None, False, 0)


# --- the dispatcher against vLLM V2's CudaGraphManager.dispatch ----------------------------------


@dataclass(frozen=True)
class Table:
    """A captured-graph table's configuration, as the manager and the dispatcher take it."""

    sizes: tuple[int, ...]
    mode: CaptureMode
    max_num_reqs: int
    q: int  # the decode length, 1 + spec
    lora_cases: tuple[int, ...]
    varlen: bool


def manager_candidates(t: Table) -> dict[tuple[int, int], list[BatchExecutionDescriptor]]:
    """vLLM V2's `CudaGraphManager._init_candidates` (the version with LoRA cases and
    varlen decode), re-expressed: per capture size and LoRA case, a varlen-decode graph
    (up to max_num_reqs * q tokens) or a uniform-decode one at the size rounded up to
    whole requests (none past max_num_reqs * q or the largest size), then the mixed graph;
    then, for FULL and after it PIECEWISE, each token count up to a graph's size lists
    the graphs of the smallest such size, per LoRA case."""
    max_decode = t.max_num_reqs * t.q
    decode = t.mode.separate_decode_routine
    by_mode: dict[CUDAGraphMode, list[BatchExecutionDescriptor]] = {}
    for size in sorted(t.sizes):
        for loras in t.lora_cases:
            found: list[BatchExecutionDescriptor] = []
            if decode and t.varlen and size <= max_decode:
                found.append(
                    BatchExecutionDescriptor(
                        cg_mode=CUDAGraphMode.FULL,
                        num_tokens=size,
                        num_reqs=min(size, t.max_num_reqs),
                        max_query_len=t.q,
                        num_active_loras=loras,
                    )
                )
            elif decode and not t.varlen:
                rounded = -(-size // t.q) * t.q
                if rounded <= max_decode and rounded <= max(t.sizes):
                    graph = BatchExecutionDescriptor(
                        cg_mode=CUDAGraphMode.FULL,
                        num_tokens=rounded,
                        num_reqs=rounded // t.q,
                        uniform_token_count=t.q,
                        num_active_loras=loras,
                    )
                    if graph not in by_mode.get(CUDAGraphMode.FULL, []):
                        found.append(graph)
            mixed = t.mode.mixed_mode
            if mixed is not CUDAGraphMode.NONE:
                full = mixed is CUDAGraphMode.FULL
                found.append(
                    BatchExecutionDescriptor(
                        cg_mode=mixed,
                        num_tokens=size,
                        num_reqs=min(size, t.max_num_reqs) if full else None,
                        num_active_loras=loras,
                    )
                )
            for graph in found:
                by_mode.setdefault(graph.cg_mode, []).append(graph)
    candidates: dict[tuple[int, int], list[BatchExecutionDescriptor]] = {}
    for mode in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE):
        ascending = sorted(by_mode.get(mode, []), key=lambda g: g.num_tokens)
        for loras in t.lora_cases:
            start = 0
            for size in sorted({g.num_tokens for g in ascending if g.num_active_loras == loras}):
                group = [
                    g for g in ascending if g.num_active_loras == loras and g.num_tokens == size
                ]
                for n in range(start, size + 1):
                    candidates.setdefault((n, loras), []).extend(group)
                start = size + 1
    return candidates


def manager_dispatch(  # noqa: PLR0917  # the table, then dispatch's arguments in order
    t: Table,
    num_reqs: int,
    num_tokens: int,
    uniform: int | None,
    num_active_loras: int,
    max_query_len: int | None,
) -> BatchExecutionDescriptor:
    """vLLM V2's `CudaGraphManager.dispatch`: the active-LoRA count rounded up to the
    smallest captured case (clamped to the largest), then the first graph listed for the
    token count and that case which serves the batch, else eager."""
    with_lora = sorted(c for c in t.lora_cases if c > 0)
    loras = num_active_loras
    if loras > 0 and with_lora:
        loras = next((c for c in with_lora if c >= loras), with_lora[-1])
    if num_tokens > 0:
        for g in manager_candidates(t).get((num_tokens, loras), []):
            if (
                (g.uniform_token_count is None or g.uniform_token_count == uniform)
                and (
                    g.max_query_len is None
                    or (max_query_len is not None and g.max_query_len >= max_query_len)
                )
                and (g.num_reqs is None or g.num_reqs >= num_reqs)
                and g.num_tokens >= num_tokens
                and g.num_active_loras == loras
            ):
                return g
    return BatchExecutionDescriptor(
        cg_mode=CUDAGraphMode.NONE,
        num_tokens=num_tokens,
        num_reqs=num_reqs,
        num_active_loras=loras,
    )


@st.composite
def tables(draw: st.DrawFn) -> Table:
    mode = draw(st.sampled_from(list(CaptureMode)))
    sizes = draw(st.lists(st.integers(1, 24), unique=True, min_size=1, max_size=6))
    return Table(
        sizes=tuple(sorted(sizes)),
        mode=mode,
        max_num_reqs=draw(st.integers(1, 8)),
        q=1 + draw(st.integers(0, 3)),
        lora_cases=draw(st.sampled_from([(0,), (0, 2), (0, 1, 4), (2,)])),
        varlen=mode.separate_decode_routine and draw(st.booleans()),
    )


@settings(max_examples=400, deadline=None)
@given(table=tables(), data=st.data())
def test_the_dispatcher_picks_the_graph_vllms_manager_picks(
    table: Table, data: st.DataObject
) -> None:
    """Law: for any capture mode, sizes (multiples of the decode length or not), request
    limit, speculative length, LoRA cases and varlen decode, the dispatcher answers every
    batch (uniform decode of the decode length or another, varlen, mixed, idle, above the
    largest size, any LoRA count and query-length bound) with the descriptor vLLM V2's
    manager picks: its search of every graph, FULL before PIECEWISE, lands where the
    manager's look-up of the smallest fitting FULL size, then PIECEWISE size, does."""
    dispatcher = CudaGraphDispatcher(
        capture_sizes=table.sizes,
        capture_mode=table.mode,
        max_num_reqs=table.max_num_reqs,
        num_speculative_tokens=table.q - 1,
        lora_capture_cases=table.lora_cases,
        varlen_decode=table.varlen,
    )
    sizes, max_num_reqs = table.sizes, table.max_num_reqs
    # Token counts at and beside the sizes and their roundings up to whole requests.
    edges = {e + d for s in sizes for e in (s, -(-s // table.q) * table.q) for d in (-1, 0, 1)}
    tokens = data.draw(st.sampled_from(sorted(e for e in edges if e >= 0)) | st.integers(0, 30))
    reqs = data.draw(st.integers(0, min(tokens, max_num_reqs)))
    if data.draw(st.booleans()):  # a full decode batch: q tokens per request
        reqs = min(tokens // table.q, max_num_reqs)
    uniform = data.draw(st.none() | st.sampled_from([table.q, table.q, 1, 2, 3]))
    if uniform is not None and uniform * reqs > tokens:
        uniform = None
    query_len = data.draw(st.none() | st.integers(1, table.q + 1))
    loras = data.draw(st.integers(0, 5))
    got = dispatcher.dispatch(
        reqs, tokens, uniform, num_active_loras=loras, max_query_len=query_len
    )
    assert got == manager_dispatch(table, reqs, tokens, uniform, loras, query_len)


# --- the whole rank step (purepp.testing's scripted worlds) against the seed ---------------------


def seed_run(schedule: Schedule) -> tuple[dict[int, list[ConsumedStep]], dict[int, list[Any]]]:
    """The seed's relay and DP procedure over a scripted schedule: per replica, SeedRelay
    on every stage (consume, then the step's frees, then receive; the last stage sends its
    tokens and drafts), and per step and stage `seed_world` over the replicas' batches."""
    config, world = schedule.config, schedule.world
    consumed: dict[int, list[ConsumedStep]] = {r: [] for r in range(world.world_size)}
    agreed: dict[int, list[Any]] = {r: [] for r in range(world.world_size)}
    dispatcher = schedule.dispatcher()
    pipes = []
    for _ in range(config.dp):
        inboxes: list[deque[torch.Tensor]] = [deque() for _ in range(world.pp - 1)]

        def relay(calls: DeviceCalls, last: bool) -> SeedRelay:
            return SeedRelay(
                calls=calls,
                is_last_rank=last,
                last_rank=world.pp - 1,
                ring_depth=world.pp,
                max_num_reqs=config.max_num_reqs,
                num_speculative_steps=config.spec,
                device=torch.device("cpu"),
                group=None,
            )

        sender = relay(mailbox_calls(inboxes, None), True)
        receivers = [relay(mailbox_calls(None, box), False) for box in inboxes]
        tables = [torch.zeros(config.max_num_reqs, config.spec, dtype=torch.int64) for _ in inboxes]
        pipes.append((sender, receivers, tables))
    for step in range(config.steps):
        row = [schedule.at(step, replica) for replica in range(config.dp)]
        batches = [
            RankBatch(
                num_reqs=p.batch.num_reqs,
                num_tokens=p.num_tokens,
                uniform_token_count=p.uniform_token_count,
            )
            for p in row
        ]
        decisions = seed_world(dispatcher, batches) if config.dp > 1 else None
        for replica, (planned, (sender, receivers, tables)) in enumerate(
            zip(row, pipes, strict=True)
        ):
            b = planned.batch
            batch = SeedBatch(
                num_reqs=b.num_reqs,
                idx_mapping=torch.from_numpy(b.idx_mapping.copy()),
                idx_mapping_np=b.idx_mapping,
                num_computed_tokens_np=b.num_computed_tokens,
                num_scheduled_tokens=b.num_scheduled_tokens,
                prefill_len_np=b.prefill_len,
            )
            for stage in range(world.pp):
                rank = world.rank_of(pp_stage=stage, dp_index=replica)
                if decisions is None:
                    agreed[rank].append(
                        seed_desired(dispatcher, batches[0], batches[0].uniform_token_count)
                    )
                else:
                    agreed[rank].append(decisions[replica][0])
            drafts = np.zeros((config.max_num_reqs, config.spec), np.int64)
            drafts[b.idx_mapping] = planned.drafts
            sender.broadcast(
                torch.from_numpy(planned.sampled_tokens.copy()),
                torch.from_numpy(planned.num_sampled.copy()),
                torch.from_numpy(planned.num_rejected.copy()),
                batch,
            )
            if config.spec:
                sender.broadcast_drafts(torch.from_numpy(drafts), batch)
            for stage, (seed, table) in enumerate(zip(receivers, tables, strict=True)):
                got = seed.get_prev_sampled_outputs(table if config.spec else None)
                if got is not None:
                    consumed[world.rank_of(pp_stage=stage, dp_index=replica)].append(
                        ConsumedStep(
                            step=step,
                            received_at_step=step - world.pp,
                            idx_mapping=tuple(got["idx_mapping"].tolist()),
                            sampled_tokens=tuple(tuple(r) for r in got["sampled_tokens"].tolist()),
                            num_sampled=tuple(got["num_sampled"].tolist()),
                            num_rejected=tuple(got["num_rejected"].tolist()),
                            drafts_table=tuple(tuple(r) for r in table.tolist())
                            if config.spec
                            else None,
                        )
                    )
                for slot in planned.freed:
                    seed.on_req_idx_freed(slot)
                seed.receive(batch)
    return consumed, agreed


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pp=st.integers(1, 4),
    dp=st.integers(1, 3),
    spec=st.integers(0, 2),
    steps=st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
def test_every_rank_step_consumes_and_agrees_as_the_seed(
    pp: int, dp: int, spec: int, steps: int, seed: int
) -> None:
    """Law: in a scripted PP x DP world run through the library's one rank-step program
    (begin, agree with the step's frees, finish), every rank consumes at each step what
    the seed's relay hands out there (tokens, counts, filtered slots, its draft table),
    and runs at the descriptor the seed's DP procedure agrees for its replica."""
    schedule = make_schedule(ScheduleConfig(pp=pp, dp=dp, spec=spec, steps=steps, seed=seed))
    run = simulate_schedule(schedule)
    consumed, agreed = seed_run(schedule)
    for out in run.outputs:
        assert list(out.consumed) == consumed[out.rank], out.rank
        assert list(out.agreed) == agreed[out.rank], out.rank
