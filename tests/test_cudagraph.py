"""The pure CUDA-graph dispatcher: its captured-graph table and the graph each batch gets."""

from __future__ import annotations

import inspect

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from purepp import cudagraph, dp
from purepp.cudagraph import (
    BatchExecutionDescriptor,
    CaptureMode,
    CudaGraphDispatcher,
    CUDAGraphMode,
)
from purepp.errors import ConfigError, InvalidInputError
from tests.strategies import cudagraph_dispatchers, desc

FULL = CUDAGraphMode.FULL
PIECEWISE = CUDAGraphMode.PIECEWISE
NONE = CUDAGraphMode.NONE


def make(
    mode: CaptureMode,
    sizes: tuple[int, ...] = (1, 2, 4, 8, 16),
    *,
    max_num_reqs: int = 8,
    spec: int = 0,
    loras: tuple[int, ...] = (0,),
    varlen: bool = False,
) -> CudaGraphDispatcher:
    return CudaGraphDispatcher(
        capture_sizes=sizes,
        capture_mode=mode,
        max_num_reqs=max_num_reqs,
        num_speculative_tokens=spec,
        lora_capture_cases=loras,
        varlen_decode=varlen,
    )


# --- modes -------------------------------------------------------------------------


def test_runtime_modes_are_ordered_so_the_minimum_is_the_most_conservative() -> None:
    assert [int(m) for m in (NONE, PIECEWISE, FULL)] == [0, 1, 2]
    assert min(FULL, PIECEWISE) is PIECEWISE
    assert min(PIECEWISE, NONE) is NONE


@pytest.mark.parametrize(
    ("mode", "decode", "mixed", "separate"),
    [
        (CaptureMode.NONE, NONE, NONE, False),
        (CaptureMode.PIECEWISE, PIECEWISE, PIECEWISE, False),
        (CaptureMode.FULL, FULL, FULL, False),
        (CaptureMode.FULL_DECODE_ONLY, FULL, NONE, True),
        (CaptureMode.FULL_AND_PIECEWISE, FULL, PIECEWISE, True),
    ],
)
def test_capture_mode_splits_into_decode_and_mixed_runtime_modes(
    mode: CaptureMode, decode: CUDAGraphMode, mixed: CUDAGraphMode, separate: bool
) -> None:
    assert (mode.decode_mode, mode.mixed_mode, mode.separate_decode_routine) == (
        decode,
        mixed,
        separate,
    )


# --- construction ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"sizes": ()}, "capture_sizes is empty with capture_mode=FULL"),
        ({"sizes": (4, 2)}, r"capture_sizes=\[4, 2\] is not strictly increasing"),
        ({"sizes": (2, 2, 4)}, r"capture_sizes=\[2, 2, 4\] is not strictly increasing"),
        ({"sizes": (0, 2)}, r"capture_sizes=\[0, 2\] is not strictly increasing"),
        ({"sizes": (-1, 2)}, "capture_sizes entry=-1 is outside"),
        ({"max_num_reqs": 0}, "max_num_reqs=0 is outside"),
        ({"spec": -1}, "num_speculative_tokens=-1 is outside"),
        ({"loras": ()}, r"lora_capture_cases=\[\] is not strictly increasing"),
        ({"loras": (2, 0)}, r"lora_capture_cases=\[2, 0\] is not strictly increasing"),
        ({"loras": (0, 0)}, r"lora_capture_cases=\[0, 0\] is not strictly increasing"),
        ({"loras": (-1, 0)}, "lora_capture_cases entry=-1 is outside"),
        ({"varlen": True}, "varlen_decode with capture_mode=FULL"),
    ],
)
def test_bad_configuration_is_a_config_error_naming_the_dispatcher(
    kwargs: dict[str, object], problem: str
) -> None:
    with pytest.raises(ConfigError, match=rf"^CudaGraphDispatcher: {problem}.* Fix: "):
        make(CaptureMode.FULL, **kwargs)  # type: ignore[arg-type]


def test_no_capture_mode_needs_no_sizes_and_captures_nothing() -> None:
    dispatcher = make(CaptureMode.NONE, ())
    assert dispatcher.graphs == ()
    assert dispatcher.dispatch(1, 1, 1) == desc(NONE, 1, 1)


def test_the_dispatcher_is_a_value() -> None:
    a = make(CaptureMode.FULL_AND_PIECEWISE, spec=1)
    b = make(CaptureMode.FULL_AND_PIECEWISE, spec=1)
    assert a == b
    assert hash(a) == hash(b)
    assert a != make(CaptureMode.FULL_AND_PIECEWISE, spec=2)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        a.max_num_reqs = 3  # type: ignore[misc]


def test_descriptor_rejects_negative_counts_and_zero_bounds() -> None:
    with pytest.raises(InvalidInputError, match=r"^BatchExecutionDescriptor: num_tokens=-1"):
        desc(NONE, -1, 0)
    with pytest.raises(InvalidInputError, match="uniform_token_count=0"):
        desc(FULL, 4, 4, uniform=0)


# --- the captured-graph table ------------------------------------------------------


def test_full_and_piecewise_captures_uniform_decode_graphs_rounded_to_the_decode_length() -> None:
    dispatcher = make(CaptureMode.FULL_AND_PIECEWISE, (1, 2, 4, 8), max_num_reqs=4, spec=2)
    full = {g for g in dispatcher.graphs if g.cg_mode is FULL}
    # 1 and 2 round up to 3; 4 to 6; 8 rounds to 9, above the largest size: not captured.
    assert full == {desc(FULL, 3, 1, uniform=3), desc(FULL, 6, 2, uniform=3)}
    piecewise = [g for g in dispatcher.graphs if g.cg_mode is PIECEWISE]
    assert piecewise == [desc(PIECEWISE, s, None) for s in (1, 2, 4, 8)]


def test_uniform_decode_graphs_stop_at_max_num_reqs_requests() -> None:
    dispatcher = make(CaptureMode.FULL_DECODE_ONLY, (1, 2, 4, 8), max_num_reqs=2)
    assert [g.num_tokens for g in dispatcher.graphs] == [1, 2]
    assert all(g.uniform_token_count == 1 for g in dispatcher.graphs)


def test_full_mode_captures_mixed_graphs_padding_requests_up_to_the_limit() -> None:
    dispatcher = make(CaptureMode.FULL, (1, 4, 16), max_num_reqs=8)
    assert dispatcher.graphs == (desc(FULL, 1, 1), desc(FULL, 4, 4), desc(FULL, 16, 8))


def test_varlen_decode_replaces_uniform_decode_graphs() -> None:
    dispatcher = make(
        CaptureMode.FULL_DECODE_ONLY, (1, 2, 4, 8, 16), max_num_reqs=4, spec=1, varlen=True
    )
    # Decode batches hold at most 4 requests x 2 tokens: 16 is above that.
    assert dispatcher.graphs == tuple(desc(FULL, s, min(s, 4), query_len=2) for s in (1, 2, 4, 8))


def test_every_lora_case_gets_the_same_graphs() -> None:
    dispatcher = make(CaptureMode.FULL_AND_PIECEWISE, (1, 2, 4), loras=(0, 2))
    by_case = {
        case: {
            attrs.evolve(g, num_active_loras=0)
            for g in dispatcher.graphs
            if g.num_active_loras == case
        }
        for case in (0, 2)
    }
    assert by_case[0] == by_case[2]
    assert len(by_case[0]) == 6


# --- dispatch ----------------------------------------------------------------------


def test_dispatch_picks_the_smallest_size_that_fits() -> None:
    dispatcher = make(CaptureMode.PIECEWISE)
    assert dispatcher.dispatch(3, 3, None) == desc(PIECEWISE, 4, None)
    assert dispatcher.dispatch(2, 4, None) == desc(PIECEWISE, 4, None)
    assert dispatcher.dispatch(5, 9, None) == desc(PIECEWISE, 16, None)


def test_full_graphs_pad_requests_and_piecewise_graphs_do_not() -> None:
    full = make(CaptureMode.FULL, max_num_reqs=8)
    assert full.dispatch(3, 5, None) == desc(FULL, 8, 8)
    assert full.dispatch(3, 9, None) == desc(FULL, 16, 8)
    assert make(CaptureMode.PIECEWISE).dispatch(3, 5, None).num_reqs is None


def test_uniform_decode_graph_only_for_its_uniform_count() -> None:
    dispatcher = make(CaptureMode.FULL_AND_PIECEWISE, spec=1)
    assert dispatcher.dispatch(2, 4, 2) == desc(FULL, 4, 2, uniform=2)
    # A uniform batch of another length, or a mixed batch, takes a PIECEWISE graph.
    assert dispatcher.dispatch(4, 4, 1) == desc(PIECEWISE, 4, None)
    assert dispatcher.dispatch(2, 4, None) == desc(PIECEWISE, 4, None)


def test_full_decode_only_runs_other_batches_eager() -> None:
    dispatcher = make(CaptureMode.FULL_DECODE_ONLY)
    assert dispatcher.dispatch(3, 3, 1) == desc(FULL, 4, 4, uniform=1)
    assert dispatcher.dispatch(2, 3, None) == desc(NONE, 3, 2)


def test_full_graphs_are_preferred_to_piecewise_ones() -> None:
    dispatcher = make(CaptureMode.FULL_AND_PIECEWISE, (1, 2, 4, 8, 16), spec=2)
    # 7 tokens: the uniform-decode graph has 9 (8 rounded up to 3s), a PIECEWISE one 8.
    assert dispatcher.dispatch(2, 7, 3) == desc(FULL, 9, 3, uniform=3)
    assert dispatcher.dispatch(2, 6, 3) == desc(FULL, 6, 2, uniform=3)


def test_varlen_graph_only_when_the_query_length_bound_fits() -> None:
    dispatcher = make(CaptureMode.FULL_AND_PIECEWISE, spec=2, varlen=True)
    assert dispatcher.dispatch(3, 5, None, max_query_len=3) == desc(FULL, 8, 8, query_len=3)
    assert dispatcher.dispatch(3, 5, None, max_query_len=1) == desc(FULL, 8, 8, query_len=3)
    # A longer request (a prefill), or a caller that does not track the bound: PIECEWISE.
    assert dispatcher.dispatch(3, 5, None, max_query_len=4) == desc(PIECEWISE, 8, None)
    assert dispatcher.dispatch(3, 5, None) == desc(PIECEWISE, 8, None)


def test_lora_counts_round_up_to_a_captured_case() -> None:
    dispatcher = make(CaptureMode.PIECEWISE, (4,), loras=(0, 2, 4))
    assert [
        dispatcher.dispatch(1, 4, None, num_active_loras=n).num_active_loras for n in range(7)
    ] == [
        0,
        2,
        2,
        4,
        4,
        4,
        4,
    ]


def test_active_loras_without_lora_graphs_run_eager() -> None:
    dispatcher = make(CaptureMode.PIECEWISE)
    assert dispatcher.dispatch(1, 4, None, num_active_loras=1) == desc(NONE, 4, 1, loras=1)


def test_zero_tokens_and_batches_above_the_largest_graph_run_eager_unpadded() -> None:
    dispatcher = make(CaptureMode.FULL)
    assert dispatcher.dispatch(0, 0, None) == desc(NONE, 0, 0)
    assert dispatcher.dispatch(3, 17, None) == desc(NONE, 17, 3)


@pytest.mark.parametrize(
    "args",
    [
        (-1, 4, None, 0, None),
        (1, -4, None, 0, None),
        (1, 4, None, -1, None),
        (1, 4, 0, 0, None),
        (1, 4, None, 0, 0),
        (9, 16, None, 0, None),
    ],
)
def test_bad_dispatch_input_is_an_invalid_input_error_naming_dispatch(
    args: tuple[int, int, int | None, int, int | None],
) -> None:
    dispatcher = make(CaptureMode.FULL, max_num_reqs=8)
    num_reqs, num_tokens, uniform, loras, query_len = args
    with pytest.raises(InvalidInputError, match=r"^CudaGraphDispatcher\.dispatch: "):
        dispatcher.dispatch(num_reqs, num_tokens, uniform, loras, query_len)


@pytest.mark.parametrize("field", range(5))
@pytest.mark.parametrize("kind", [float, bool])
def test_a_remembered_answer_still_refuses_a_float_or_bool_equal_to_its_question(
    field: int, kind: type
) -> None:
    # 1.0 and True hash and compare equal to 1: the memo must not answer them.
    dispatcher = make(CaptureMode.FULL_AND_PIECEWISE, max_num_reqs=8, varlen=True)
    args: list[object] = [1, 1, 1, 1, 1]  # num_reqs, num_tokens, uniform, loras, query len
    names = ["num_reqs", "num_tokens", "uniform_token_count", "num_active_loras", "max_query_len"]
    dispatcher.dispatch(1, 1, 1, 1, 1)
    args[field] = kind(1)
    with pytest.raises(InvalidInputError, match=rf"dispatch: {names[field]}={kind(1)!r} is a"):
        dispatcher.dispatch(*args)  # type: ignore[arg-type]


def test_the_dispatch_memo_stays_bounded() -> None:
    dispatcher = make(CaptureMode.FULL)
    bound = cudagraph._MAX_ANSWERS
    for tokens in range(1, bound + 50):  # above every graph: each a new question
        assert dispatcher.dispatch(1, tokens, None) == dispatcher.dispatch(1, tokens, None)
        assert len(dispatcher._answers) <= bound


@st.composite
def dispatch_args(
    draw: st.DrawFn,
) -> tuple[CudaGraphDispatcher, int, int, int | None, int, int | None]:
    dispatcher = draw(cudagraph_dispatchers())
    num_tokens = draw(st.integers(0, 30))
    num_reqs = draw(st.integers(0, min(num_tokens, dispatcher.max_num_reqs)))
    # A uniform decode's requests fit its tokens (dispatch refuses more).
    most_uniform = min(4, num_tokens // num_reqs) if num_reqs else 4
    uniform = draw(st.none() | st.integers(1, most_uniform))
    query_len = draw(st.none() | st.integers(1, 5))
    return dispatcher, num_reqs, num_tokens, uniform, draw(st.integers(0, 5)), query_len


def _serves(
    graph: BatchExecutionDescriptor,
    *,
    num_reqs: int,
    num_tokens: int,
    uniform: int | None,
    loras: int,
    query_len: int | None,
) -> bool:
    return (
        graph.num_tokens >= num_tokens
        and (graph.num_reqs is None or graph.num_reqs >= num_reqs)
        and graph.num_active_loras == loras
        and graph.uniform_token_count in (None, uniform)
        and (
            graph.max_query_len is None
            or (query_len is not None and query_len <= graph.max_query_len)
        )
    )


@given(dispatch_args())
def test_dispatch_returns_the_smallest_serving_graph_of_the_best_mode(
    args: tuple[CudaGraphDispatcher, int, int, int | None, int, int | None],
) -> None:
    dispatcher, num_reqs, num_tokens, uniform, loras, query_len = args
    got = dispatcher.dispatch(num_reqs, num_tokens, uniform, loras, query_len)
    effective = dispatcher.effective_loras(loras)
    serving = [
        g
        for g in dispatcher.graphs
        if num_tokens > 0
        and _serves(
            g,
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            uniform=uniform,
            loras=effective,
            query_len=query_len,
        )
    ]
    if not serving:
        assert got == desc(NONE, num_tokens, num_reqs, loras=effective)
        return
    best_mode = max(g.cg_mode for g in serving)
    assert got.cg_mode is best_mode
    assert got in serving
    assert got.num_tokens == min(g.num_tokens for g in serving if g.cg_mode is best_mode)


@given(dispatch_args())
def test_dispatch_is_deterministic(
    args: tuple[CudaGraphDispatcher, int, int, int | None, int, int | None],
) -> None:
    dispatcher, num_reqs, num_tokens, uniform, loras, query_len = args
    rebuilt = attrs.evolve(dispatcher)
    assert dispatcher.dispatch(num_reqs, num_tokens, uniform, loras, query_len) == rebuilt.dispatch(
        num_reqs, num_tokens, uniform, loras, query_len
    )


class _PositionalDispatcher:
    """A manager whose dispatch takes the first three only by position, under its own names."""

    def __init__(self, inner: CudaGraphDispatcher) -> None:
        self.inner = inner

    def dispatch(
        self,
        reqs: int,
        tokens: int,
        uniform_decode_len: int | None,
        /,
        *,
        num_active_loras: int = 0,
        max_query_len: int | None = None,
    ) -> BatchExecutionDescriptor:
        return self.inner.dispatch(
            reqs,
            tokens,
            uniform_decode_len,
            num_active_loras=num_active_loras,
            max_query_len=max_query_len,
        )


def test_the_agreement_passes_dispatchs_first_three_arguments_by_position() -> None:
    # The Dispatcher protocol marks them positional-only, so a manager may name them its
    # own way (pyright checks names otherwise): the agreement must pass them by position,
    # before the all-reduce (start) and after it (finish).
    inner = make(CaptureMode.FULL, (1, 2, 4, 8))
    kinds = inspect.signature(cudagraph.Dispatcher.dispatch).parameters
    assert [kinds[name].kind for name in ("num_reqs", "num_tokens", "uniform_token_count")] == [
        inspect.Parameter.POSITIONAL_ONLY
    ] * 3
    batches = [
        dp.RankBatch(num_reqs=2, num_tokens=2, uniform_token_count=1),
        dp.RankBatch(num_reqs=3, num_tokens=3, uniform_token_count=1),
    ]
    own = dp.agree_across_ranks(_PositionalDispatcher(inner), batches)
    assert own == dp.agree_across_ranks(inner, batches)
    assert own[0].descriptor.cg_mode is FULL
