"""The pure core at its edges: the CUDA-graph dispatcher against vLLM's own candidate
table, batch facts, the layout, the effect vocabulary's arrays and the typed errors.

Besides behaviour no other test checks, these pin what a review found wrong (each was a
bug): typed errors that could not be pickled or copied, frozen arrays that came back
writable from a pickle or deepcopy, `attrs.evolve` of a BatchFacts, a speculation depth
and a world size past int32.
"""

from __future__ import annotations

import copy
import pickle
from itertools import groupby
from typing import Any

import attrs
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
from purepp.effects.arrays import is_frozen
from purepp.effects.vocabulary import (
    AllReduce,
    BufferRef,
    CheckHeader,
    Communicator,
    CopyHostToDevice,
    Op,
    Stream,
)
from purepp.errors import (
    CollectiveMismatchError,
    ConfigError,
    HeaderMismatchError,
    InvalidInputError,
    PureppError,
    StaleSyncError,
)
from purepp.layout import Layout

FULL = CUDAGraphMode.FULL
PIECEWISE = CUDAGraphMode.PIECEWISE
NONE = CUDAGraphMode.NONE
INT32_MAX = 2**31 - 1


# --- the dispatcher against vLLM's own candidate table -------------------------------


def _vllm_candidates(
    d: CudaGraphDispatcher,
) -> dict[tuple[int, int], list[BatchExecutionDescriptor]]:
    """vLLM V2 `CudaGraphManager._init_candidates`, re-expressed: for each (token count,
    LoRA case), the graphs of the smallest captured size at or above it, FULL first."""
    if d.capture_mode is CaptureMode.NONE:
        return {}
    sizes = sorted(d.capture_sizes)
    q = d.uniform_decode_query_len
    top = d.max_num_reqs
    decode, mixed = d.capture_mode.decode_mode, d.capture_mode.mixed_mode
    separate = d.capture_mode.separate_decode_routine
    by_mode: dict[CUDAGraphMode, list[BatchExecutionDescriptor]] = {}
    for size in sizes:
        for loras in d.lora_capture_cases:
            if separate and decode and d.varlen_decode and size <= top * q:
                by_mode.setdefault(decode, []).append(
                    BatchExecutionDescriptor(
                        cg_mode=decode,
                        num_tokens=size,
                        num_reqs=min(size, top),
                        max_query_len=q,
                        num_active_loras=loras,
                    )
                )
            elif separate and decode and not d.varlen_decode:
                rounded = -(-size // q) * q
                if not (rounded > top * q or rounded > sizes[-1] or rounded // q > top):
                    graph = BatchExecutionDescriptor(
                        cg_mode=decode,
                        num_tokens=rounded,
                        num_reqs=rounded // q,
                        uniform_token_count=q,
                        num_active_loras=loras,
                    )
                    if graph not in by_mode.setdefault(decode, []):
                        by_mode[decode].append(graph)
            if mixed:
                by_mode.setdefault(mixed, []).append(
                    BatchExecutionDescriptor(
                        cg_mode=mixed,
                        num_tokens=size,
                        num_reqs=min(size, top) if mixed is FULL else None,
                        num_active_loras=loras,
                    )
                )
    candidates: dict[tuple[int, int], list[BatchExecutionDescriptor]] = {}
    for mode in (FULL, PIECEWISE):
        ascending = sorted(by_mode.get(mode, []), key=lambda g: g.num_tokens)
        for loras in d.lora_capture_cases:
            start = 0
            case = [g for g in ascending if g.num_active_loras == loras]
            for tokens, group in groupby(case, key=lambda g: g.num_tokens):
                graphs = list(group)
                for count in range(start, tokens + 1):
                    candidates.setdefault((count, loras), []).extend(graphs)
                start = tokens + 1
    return candidates


def _vllm_dispatch(
    d: CudaGraphDispatcher,
    *,
    num_reqs: int,
    num_tokens: int,
    uniform: int | None,
    loras: int,
    query_len: int | None,
) -> BatchExecutionDescriptor:
    """vLLM V2 `CudaGraphManager.dispatch`: the first compatible candidate, else eager."""
    effective = d.effective_loras(loras)
    for g in _vllm_candidates(d).get((num_tokens, effective), []) if num_tokens > 0 else []:
        if (
            g.uniform_token_count in (None, uniform)
            and (
                g.max_query_len is None or (query_len is not None and query_len <= g.max_query_len)
            )
            and (g.num_reqs is None or g.num_reqs >= num_reqs)
            and g.num_tokens >= num_tokens
            and g.num_active_loras == effective
        ):
            return g
    return BatchExecutionDescriptor(
        cg_mode=NONE, num_tokens=num_tokens, num_reqs=num_reqs, num_active_loras=effective
    )


@st.composite
def _dispatchers(draw: st.DrawFn) -> CudaGraphDispatcher:
    mode = draw(st.sampled_from(list(CaptureMode)))
    return CudaGraphDispatcher(
        capture_sizes=tuple(sorted(draw(st.sets(st.integers(1, 40), min_size=1, max_size=6)))),
        capture_mode=mode,
        max_num_reqs=draw(st.integers(1, 12)),
        num_speculative_tokens=draw(st.integers(0, 3)),
        lora_capture_cases=tuple(sorted(draw(st.sets(st.integers(0, 4), min_size=1, max_size=3)))),
        varlen_decode=mode.separate_decode_routine and draw(st.booleans()),
    )


@settings(max_examples=250, deadline=None)
@given(dispatcher=_dispatchers(), data=st.data())
def test_dispatch_answers_every_consistent_batch_as_vllms_candidate_table_does(
    dispatcher: CudaGraphDispatcher, data: st.DataObject
) -> None:
    """For every batch a runner can hold (no more requests than tokens, a uniform count
    covering its requests), dispatch picks the graph vLLM's own table picks: the smallest
    captured size at or above the tokens, FULL before PIECEWISE, else eager."""
    q = dispatcher.uniform_decode_query_len
    num_tokens = data.draw(st.integers(0, 45))
    uniform = data.draw(st.sampled_from([None, q, q + 1]))
    most = min(num_tokens // (uniform or 1), dispatcher.max_num_reqs)
    num_reqs = data.draw(st.integers(0, most))
    cases = list(dispatcher.lora_capture_cases)
    loras = data.draw(st.sampled_from(cases) | st.integers(0, 5))
    query_len = data.draw(st.none() | st.integers(1, q + 1))
    got = dispatcher.dispatch(num_reqs, num_tokens, uniform, loras, query_len)
    assert got == _vllm_dispatch(
        dispatcher,
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        uniform=uniform,
        loras=loras,
        query_len=query_len,
    )


def test_a_speculative_length_one_below_the_int32_limit_builds_varlen_graphs() -> None:
    """A speculative length one below the int32 limit still builds varlen graphs."""
    dispatcher = CudaGraphDispatcher(
        capture_sizes=(1,),
        capture_mode=CaptureMode.FULL_DECODE_ONLY,
        max_num_reqs=1,
        num_speculative_tokens=INT32_MAX - 1,
        varlen_decode=True,
    )
    assert [g.max_query_len for g in dispatcher.graphs] == [INT32_MAX]


def test_a_speculative_length_at_the_int32_limit_is_a_config_error_of_the_dispatcher() -> None:
    """A configuration whose decode length 1 + spec leaves int32 is refused as a
    ConfigError naming CudaGraphDispatcher and num_speculative_tokens."""
    with pytest.raises(ConfigError, match=r"^CudaGraphDispatcher: num_speculative_tokens"):
        CudaGraphDispatcher(
            capture_sizes=(1,),
            capture_mode=CaptureMode.FULL_DECODE_ONLY,
            max_num_reqs=1,
            num_speculative_tokens=INT32_MAX,
            varlen_decode=True,
        )


# --- batch facts -----------------------------------------------------------------------


def _batch() -> BatchFacts:
    return BatchFacts(
        idx_mapping=np.array([3, 1], np.int32),
        num_computed_tokens=[4, 0],
        num_scheduled_tokens=[1, 2],
        prefill_len=[4, 5],
    )


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_a_copied_batch_facts_still_holds_frozen_arrays(how: str) -> None:
    """BatchFacts that crossed a pickle (to another process) or a deepcopy still hold
    immutable arrays, so nothing can change them behind their derived facts."""
    batch = _batch()
    again = pickle.loads(pickle.dumps(batch)) if how == "pickle" else copy.deepcopy(batch)
    assert again == batch
    arrays = [again.idx_mapping, again.num_computed_tokens, again.num_scheduled_tokens]
    arrays += [again.prefill_len]
    assert all(is_frozen(a) for a in arrays)
    with pytest.raises(ValueError, match="read-only"):
        again.idx_mapping[0] = 1  # would name slot 1 twice


@pytest.mark.parametrize("field", ["source", "contribution", "expected"])
def test_an_effect_that_crossed_a_pickle_still_holds_a_frozen_array(field: str) -> None:
    """An effect's host array stays immutable when the effect is pickled and read back."""
    values = np.array([[1, 2]], np.int32)
    tag: dict[str, Any] = {"step": 0, "op": Op.AGREE}
    effect: CopyHostToDevice | AllReduce | CheckHeader
    if field == "source":
        effect = CopyHostToDevice(**tag, source=values, buffer=BufferRef("b"), stream=Stream.MAIN)
    elif field == "contribution":
        effect = AllReduce(
            **tag, contribution=values, result=BufferRef("t"), comm=Communicator.DP_CPU, work=None
        )
    else:
        effect = CheckHeader(**tag, buffer=BufferRef("h"), expected=values, stream=Stream.RELAY)
    assert is_frozen(getattr(effect, field))
    again = pickle.loads(pickle.dumps(effect))
    assert again == effect
    assert is_frozen(getattr(again, field))


def test_an_effect_copies_a_callers_writable_array() -> None:
    """An effect built from a caller's writable int32 array holds its own frozen copy:
    the caller writing into its array afterwards changes nothing in the effect."""
    caller = np.array([4, 5, 6], np.int32)
    effect = CopyHostToDevice(
        step=0, op=Op.RECEIVE, source=caller, buffer=BufferRef("x"), stream=Stream.MAIN
    )
    caller[0] = 99
    assert effect.source.tolist() == [4, 5, 6]
    assert is_frozen(effect.source)


def test_attrs_evolve_of_batch_facts_builds_a_checked_batch() -> None:
    """attrs.evolve(batch, idx_mapping=...) gives the BatchFacts of the new arrays, its
    derived facts recomputed (as for every other frozen purepp value)."""
    moved = attrs.evolve(_batch(), idx_mapping=[7, 2])
    assert moved.idx_mapping.tolist() == [7, 2]
    assert moved.max_slot == 7
    with pytest.raises(InvalidInputError, match="several rows to slot 2"):
        attrs.evolve(_batch(), idx_mapping=[2, 2])


# --- the layout ------------------------------------------------------------------------


def test_a_world_whose_ranks_leave_int32_is_a_config_error() -> None:
    """A layout whose global ranks would not fit int32 is refused when built."""
    with pytest.raises(ConfigError, match=r"^Layout: "):
        Layout(pp=2**16, dp=2**16)


# --- the typed errors ------------------------------------------------------------------


def _errors() -> list[PureppError]:
    return [
        InvalidInputError("BatchFacts", "idx_mapping=[1, 1] repeats a slot", "fix it"),
        ConfigError("Layout", "pp=0", "pass pp >= 1"),
        StaleSyncError("dispatch_cg_and_sync_dp", "a stale sync", "agree again"),
        CollectiveMismatchError("simulate", "rank 1 waits", "issue the same collectives"),
        HeaderMismatchError("receive", rank=1, step=3, expected=(3, 2), received=(2, 2)),
    ]


@pytest.mark.parametrize("index", range(5))
@pytest.mark.parametrize("how", ["pickle", "copy"])
def test_every_typed_error_survives_pickle_and_copy(index: int, how: str) -> None:
    """A PureppError read back from a pickle, or copied, is the same error: same class,
    same call, problem, fix and message."""
    error = _errors()[index]
    again = pickle.loads(pickle.dumps(error)) if how == "pickle" else copy.copy(error)
    assert type(again) is type(error)
    assert (again.call, again.problem, again.fix) == (error.call, error.problem, error.fix)
    assert str(again) == str(error)
