"""Review 2: the DP agreement and the CUDA-graph dispatcher against vLLM's own code.

The existing parity tests compare purepp's agreement with a transliteration of the seed
that calls purepp's own `CudaGraphDispatcher`. Here the dispatcher itself is held to a
transliteration of vLLM V2's `CudaGraphManager` (`vllm/v1/worker/gpu/cudagraph_utils.py`:
`_init_candidates`, `_is_compatible`, `dispatch`; the manager the seed's
`sync_cudagraph_and_dp_padding` calls), and the agreement to the seed running on it.

vLLM's manager keys its candidates by (num_tokens, effective LoRA case): the candidates
of a token count are, per mode (FULL first, then PIECEWISE), only the graphs of the
*smallest* captured size at or above it; the first compatible one wins, else eager.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from purepp.batch import BatchFacts
from purepp.cudagraph import (
    BatchExecutionDescriptor,
    CaptureMode,
    CudaGraphDispatcher,
    CUDAGraphMode,
)
from purepp.dp import AgreementGroup, RankBatch, agree_across_ranks
from purepp.effects.io import NumpyIO
from purepp.effects.numpy_interpreter import NumpyInterpreter
from purepp.effects.vocabulary import AllReduce, Effect
from purepp.errors import PureppError
from purepp.rank import Agreed, RankConfig, ShapeFacts, StepPhase, agree, begin, init_rank
from purepp.relay import RelayConfig

NONE, PIECEWISE, FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL


# -- a transliteration of vLLM's CudaGraphManager (no dynamic speculative decoding) -------


class VllmManager:
    """vLLM V2's CudaGraphManager candidate table and dispatch, step by step."""

    def __init__(self, dispatcher: CudaGraphDispatcher) -> None:
        mode = dispatcher.capture_mode
        self.max_num_reqs = dispatcher.max_num_reqs
        q = dispatcher.uniform_decode_query_len
        self.cases = list(dispatcher.lora_capture_cases)
        with_lora = sorted(c for c in self.cases if c > 0)
        self.lora_map: dict[int, int] = {}
        for n in range(1, (with_lora[-1] if with_lora else 0) + 1):
            self.lora_map[n] = next(c for c in with_lora if c >= n)
        self.max_case = with_lora[-1] if with_lora else 0
        self.candidates: dict[tuple[int, int], list[BatchExecutionDescriptor]] = {}
        sizes = sorted(dispatcher.capture_sizes)
        if mode is CaptureMode.NONE or not sizes:
            return
        decode, mixed = mode.decode_mode, mode.mixed_mode
        separate = mode.separate_decode_routine
        varlen = dispatcher.varlen_decode
        max_decode_tokens = self.max_num_reqs * q
        by_mode: dict[CUDAGraphMode, list[BatchExecutionDescriptor]] = {}
        for size, loras in itertools.product(sizes, self.cases):
            if separate and decode and varlen and size <= max_decode_tokens:
                by_mode.setdefault(decode, []).append(
                    BatchExecutionDescriptor(
                        cg_mode=decode,
                        num_tokens=size,
                        num_reqs=min(size, self.max_num_reqs),
                        max_query_len=q,
                        num_active_loras=loras,
                    )
                )
            elif separate and decode and not varlen:
                rounded = -(-size // q) * q
                if not (rounded > max_decode_tokens or rounded > sizes[-1]):
                    desc = BatchExecutionDescriptor(
                        cg_mode=decode,
                        num_tokens=rounded,
                        num_reqs=rounded // q,
                        uniform_token_count=q,
                        num_active_loras=loras,
                    )
                    if desc not in by_mode.setdefault(decode, []):
                        by_mode[decode].append(desc)
            if mixed:
                by_mode.setdefault(mixed, []).append(
                    BatchExecutionDescriptor(
                        cg_mode=mixed,
                        num_tokens=size,
                        num_reqs=min(size, self.max_num_reqs) if mixed is FULL else None,
                        num_active_loras=loras,
                    )
                )
        for mode_ in (FULL, PIECEWISE):
            ascending = sorted(by_mode.get(mode_, []), key=lambda d: d.num_tokens)
            for loras in self.cases:
                start = 0
                same = [d for d in ascending if d.num_active_loras == loras]
                for tokens, group in itertools.groupby(same, lambda d: d.num_tokens):
                    matching = list(group)
                    for i in range(start, tokens + 1):
                        self.candidates.setdefault((i, loras), []).extend(matching)
                    start = tokens + 1

    def dispatch(
        self,
        num_reqs: int,
        num_tokens: int,
        uniform: int | None,
        num_active_loras: int = 0,
        max_query_len: int | None = None,
    ) -> BatchExecutionDescriptor:
        loras = num_active_loras
        if loras > 0 and self.lora_map:
            loras = self.lora_map.get(loras, self.max_case)
        for d in self.candidates.get((num_tokens, loras), []) if num_tokens > 0 else []:
            if (
                (d.uniform_token_count is None or d.uniform_token_count == uniform)
                and (
                    d.max_query_len is None
                    or (max_query_len is not None and d.max_query_len >= max_query_len)
                )
                and (d.num_reqs is None or d.num_reqs >= num_reqs)
                and d.num_tokens >= num_tokens
                and d.num_active_loras == loras
            ):
                return d
        return BatchExecutionDescriptor(
            cg_mode=NONE, num_tokens=num_tokens, num_reqs=num_reqs, num_active_loras=loras
        )


@st.composite
def dispatchers(draw: st.DrawFn) -> CudaGraphDispatcher:
    mode = draw(st.sampled_from(list(CaptureMode)))
    return CudaGraphDispatcher(
        capture_sizes=tuple(sorted(draw(st.sets(st.integers(1, 16), min_size=1, max_size=4)))),
        capture_mode=mode,
        max_num_reqs=draw(st.integers(1, 8)),
        num_speculative_tokens=draw(st.integers(0, 2)),
        lora_capture_cases=draw(st.sampled_from([(0,), (0, 2), (0, 1, 4), (2,)])),
        varlen_decode=mode.separate_decode_routine and draw(st.booleans()),
    )


@st.composite
def rank_batches(draw: st.DrawFn, dispatcher: CudaGraphDispatcher) -> RankBatch:
    limit, q = dispatcher.max_num_reqs, dispatcher.uniform_decode_query_len
    loras = draw(st.sampled_from([0, 0, 0, 1, 2, 5]))
    eager = draw(st.sampled_from([False] * 5 + [True]))
    kind = draw(st.sampled_from(["idle", "uniform", "mixed"]))
    if kind == "idle":
        return RankBatch(num_reqs=0, num_tokens=0, need_eager=eager, num_active_loras=loras)
    reqs = draw(st.integers(1, limit))
    if kind == "uniform":
        uniform = draw(st.sampled_from([q, q, 1, 2]))
        return RankBatch(
            num_reqs=reqs,
            num_tokens=uniform * reqs + draw(st.sampled_from([0, 0, 1])),
            uniform_token_count=uniform,
            max_query_len=draw(st.sampled_from([uniform, None])),
            need_eager=eager,
            num_active_loras=loras,
        )
    return RankBatch(
        num_reqs=reqs,
        num_tokens=reqs + draw(st.integers(0, 14)),
        max_query_len=draw(st.sampled_from([None, 1, 2, 3, 5])),
        need_eager=eager,
        num_active_loras=loras,
    )


SeedSync = tuple[list[int], int | None, bool, int]


def seed_agreement(
    manager: VllmManager, batches: Sequence[RankBatch]
) -> list[tuple[BatchExecutionDescriptor, SeedSync | None]]:
    """The seed's dispatch_cg_and_sync_dp (no dp_sync), over vLLM's manager."""
    wanted = [
        BatchExecutionDescriptor(
            cg_mode=NONE, num_tokens=b.num_tokens, num_reqs=b.num_reqs,
            num_active_loras=b.num_active_loras,
        )
        if b.need_eager
        else manager.dispatch(
            b.num_reqs, b.num_tokens, b.uniform_token_count, b.num_active_loras, b.max_query_len
        )
        for b in batches
    ]  # fmt: skip
    if len(batches) == 1:
        return [(wanted[0], None)]
    tokens = [b.num_tokens for b in batches]
    uniforms = [b.uniform_token_count or 0 for b in batches]
    query_lens = [b.max_query_len or -1 for b in batches]
    most_reqs = max(b.num_reqs for b in batches)
    uniform: int | None = uniforms[0]
    if uniform == 0 or any(u != uniform for u in uniforms):
        uniform = None
    out: list[tuple[BatchExecutionDescriptor, SeedSync | None]] = []
    for b, w in zip(batches, wanted, strict=True):
        if all(t == 0 for t in tokens):
            out.append((BatchExecutionDescriptor(cg_mode=NONE, num_tokens=0, num_reqs=0), None))
        elif min(int(x.cg_mode) for x in wanted) == 0:
            eager = BatchExecutionDescriptor(
                cg_mode=NONE,
                num_tokens=b.num_tokens,
                num_reqs=b.num_reqs,
                num_active_loras=w.num_active_loras,
            )
            out.append((eager, (tokens, uniform, True, most_reqs)))
        else:
            bound = max(query_lens) if all(x != -1 for x in query_lens) else None
            d = manager.dispatch(b.num_reqs, max(tokens), uniform, b.num_active_loras, bound)
            reqs = d.num_reqs if d.cg_mode is FULL and d.num_reqs is not None else most_reqs
            out.append((d, ([d.num_tokens] * len(batches), uniform, False, reqs)))
    return out


# -- what was checked and holds ---------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(dispatchers(), st.data())
def test_dispatch_of_a_consistent_batch_matches_vllms_candidate_table(
    dispatcher: CudaGraphDispatcher, data: st.DataObject
) -> None:
    """Every capture mode, speculative length, LoRA case set and varlen setting, sizes
    above the largest graph included: a batch whose requests fit its tokens gets the
    graph (or eager descriptor) vLLM's CudaGraphManager.dispatch gives."""
    manager = VllmManager(dispatcher)
    tokens = data.draw(st.integers(0, 20))
    reqs = data.draw(st.integers(0, min(dispatcher.max_num_reqs, tokens)))
    uniform = data.draw(st.sampled_from([None, 1, 2, 3]))
    if uniform is not None and uniform * reqs > tokens:
        uniform = None
    loras = data.draw(st.integers(0, 5))
    bound = data.draw(st.sampled_from([None, 1, 2, 3, 4]))
    assert dispatcher.dispatch(
        reqs, tokens, uniform, num_active_loras=loras, max_query_len=bound
    ) == manager.dispatch(reqs, tokens, uniform, loras, bound)


@settings(max_examples=200, deadline=None)
@given(dispatchers(), st.data())
def test_every_rank_decides_as_the_seed_over_vllms_manager(
    dispatcher: CudaGraphDispatcher, data: st.DataObject
) -> None:
    """The agreement (mode, padded tokens, request bound, uniform count, LoRA case of an
    eager step, sizes above every graph) equals the seed's procedure run on vLLM's
    manager, not only on purepp's own dispatcher."""
    batches = data.draw(st.lists(rank_batches(dispatcher), min_size=1, max_size=4))
    expected = seed_agreement(VllmManager(dispatcher), batches)
    for outcome, (descriptor, sync) in zip(
        agree_across_ranks(dispatcher, batches), expected, strict=True
    ):
        assert outcome.descriptor == descriptor
        got = outcome.sync
        plain = (
            None
            if got is None
            else (
                got.num_tokens_across_dp.tolist(),
                got.uniform_token_count,
                got.eager,
                got.num_reqs,
            )
        )
        assert plain == sync


# -- bugs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dispatcher", "question"),
    [
        # FULL mixed graphs at 2 and 4 tokens, padding requests to min(size, 4).
        (
            CudaGraphDispatcher(
                capture_sizes=(2, 4), capture_mode=CaptureMode.FULL, max_num_reqs=4
            ),
            (3, 2, None),
        ),
        # Uniform-decode FULL graphs (spec 1) at 2, 4 and 8 tokens: 3 requests of 2 tokens
        # in 4 tokens.
        (
            CudaGraphDispatcher(
                capture_sizes=(2, 4, 8),
                capture_mode=CaptureMode.FULL_AND_PIECEWISE,
                max_num_reqs=8,
                num_speculative_tokens=1,
            ),
            (3, 4, 2),
        ),
    ],
)
def test_dispatch_never_jumps_to_a_larger_graph_than_vllms_manager_considers(
    dispatcher: CudaGraphDispatcher, question: tuple[int, int, int | None]
) -> None:
    """BUG. vLLM's CudaGraphManager only tries the graphs of the smallest captured size
    at or above num_tokens (its `_candidates[(num_tokens, loras)]`); when none of those
    serves the requests, it falls to PIECEWISE, then eager. purepp's `_dispatch` takes the
    smallest graph of *any* size that serves, so a batch with more requests than its
    tokens hold (3 requests in 2 tokens; 3 x 2 uniform tokens in 4) is padded to a larger
    FULL graph (4 tokens / 8 tokens) no vLLM rank would replay. README: the dispatcher is
    "the pure model of vLLM V2's CudaGraphManager". Correct: vLLM's answer, or a typed
    refusal of the inconsistent batch, as RankBatch refuses it ("more requests than
    tokens" is on the README's refused list)."""
    reqs, tokens, uniform = question
    expected = VllmManager(dispatcher).dispatch(reqs, tokens, uniform)
    answer: BatchExecutionDescriptor | str
    try:
        answer = dispatcher.dispatch(reqs, tokens, uniform)
    except PureppError as error:
        answer = str(error)
    if isinstance(answer, str):
        assert answer.startswith("CudaGraphDispatcher.dispatch: ")
    else:
        assert answer == expected


def test_marking_this_rank_dead_is_refused_naming_mark_dead_and_its_argument() -> None:
    """BUG. DESIGN contract 9: an error names the call, the offending value and the fix.
    `group.mark_dead(group.dp_rank)` raises a ConfigError that names the constructor
    ("AgreementGroup: dp_rank=1 is not among live_ranks=[0, 2]") and tells the caller to
    "include it" in a live_ranks argument they never passed. Correct: the error names
    `AgreementGroup.mark_dead` and the rank it was given."""
    group = AgreementGroup(dp_size=3, dp_rank=1)
    with pytest.raises(PureppError, match=r"^AgreementGroup\.mark_dead: .*rank=1"):
        group.mark_dead(1)


def _drive_as_rank_0_of_two(
    phase: StepPhase[Agreed], interpreter: NumpyInterpreter, issued: list[Effect]
) -> None:
    """Run `phase` to its end, noting each effect; rank 1 contributed the same column."""
    effects = next(phase)
    while True:
        issued.extend(effects)
        for effect in effects:
            if isinstance(effect, AllReduce):
                table = np.array(effect.contribution, copy=True)
                table[:, 1] = table[:, 0]  # the peer rank scheduled the same batch
                interpreter.bind(effect.result, table)
        try:
            effects = phase.send(None)
        except StopIteration:
            return


def test_a_drafter_dispatcher_that_refuses_the_batch_is_refused_before_the_all_reduce() -> None:
    """BUG. With dp > 1, a drafter dispatcher whose max_num_reqs is below the batch's rows
    is refused only after the target agreement's AllReduce, NoteDecision and Release were
    issued (the drafter's reuse dispatches in `_settled`): this rank has completed a
    collective its retry would issue again, so the group ends one collective apart (field
    failure 10's hang). A lone rank (`_agreed_alone`) refuses the same batch before any
    effect. Correct (DESIGN contracts 5 and 9, and `_check_agree`'s own comment: refuse
    "now, not then"): `agree` refuses before yielding its first effect."""
    relay = RelayConfig(pp_size=2, stage=1, last_rank=1, max_num_reqs=8, num_speculative_steps=0)
    target = CudaGraphDispatcher(
        capture_sizes=(1, 2, 4, 8), capture_mode=CaptureMode.FULL, max_num_reqs=8
    )
    drafter = CudaGraphDispatcher(
        capture_sizes=(1, 2, 4, 8), capture_mode=CaptureMode.FULL, max_num_reqs=2
    )
    config = RankConfig(
        relay=relay,
        group=AgreementGroup(dp_size=2, dp_rank=0),
        dispatcher=target,
        drafter_dispatcher=drafter,
    )
    started = begin(config, init_rank(config))
    with pytest.raises(StopIteration) as stop:
        next(started)
    begun = stop.value.value
    batch = BatchFacts(
        idx_mapping=np.arange(4, dtype=np.int32),
        num_computed_tokens=np.full(4, 5, dtype=np.int32),
        num_scheduled_tokens=np.ones(4, dtype=np.int32),
        prefill_len=np.full(4, 5, dtype=np.int32),
    )
    interpreter = NumpyInterpreter()
    io = NumpyIO(interpreter)
    phase = agree(config, begun, batch, ShapeFacts(num_tokens=4), io)
    issued: list[Effect] = []
    with pytest.raises(PureppError):
        _drive_as_rank_0_of_two(phase, interpreter, issued)
    assert issued == [], f"refused after issuing {[type(e).__name__ for e in issued]}"


def test_the_vllm_transliteration_reads_the_example_of_the_docstring() -> None:
    """The transliteration itself: graphs of the smallest size at or above the tokens
    only, FULL before PIECEWISE, else eager."""
    manager = VllmManager(
        CudaGraphDispatcher(capture_sizes=(2, 4), capture_mode=CaptureMode.FULL, max_num_reqs=4)
    )
    assert manager.dispatch(2, 3, None) == BatchExecutionDescriptor(
        cg_mode=FULL, num_tokens=4, num_reqs=4
    )
    assert manager.dispatch(3, 2, None) == BatchExecutionDescriptor(
        cg_mode=NONE, num_tokens=2, num_reqs=3
    )
    assert manager.dispatch(1, 5, None).cg_mode is NONE
