"""The DP agreement and the dispatcher take no garbage (issue 9, item 5).

Random wrong types and values go into every public entry point of `purepp.dp` and
`purepp.cudagraph`. Each call either raises a typed `PureppError` or gives a correct
result; never a raw TypeError, AttributeError or OverflowError, and an accepted value
is never a truncation (3.7 is never read as 3, True never as 1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from purepp.cudagraph import (
    BatchExecutionDescriptor,
    CaptureMode,
    CudaGraphDispatcher,
    CUDAGraphMode,
)
from purepp.dp import (
    AgreementGroup,
    AgreementLanes,
    DPSyncState,
    Lane,
    MicrobatchConfig,
    PendingAgreement,
    RankBatch,
    TableLayout,
    finish_agreement,
    start_agreement,
    wait_for_agreement,
)
from purepp.effects.vocabulary import Communicator
from purepp.errors import PureppError
from tests.strategies import UNREADABLE_ARRAYS

GARBAGE = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.booleans(),
    st.text(max_size=3),
    st.none(),
    st.sampled_from(
        [np.int64(3), np.int32(-1), np.uint8(7), np.float64(2.0), np.float32(2.5), np.bool_(True)]
    ),
    st.lists(st.integers(0, 3), max_size=3),
    st.sampled_from([object(), b"4", {}, (1, 2), frozenset({0, 1}), Lane.DRAFTER]),
    st.sampled_from([*Communicator, *CaptureMode, *CUDAGraphMode]),
    UNREADABLE_ARRAYS,
)

SPEC = CudaGraphDispatcher(
    capture_sizes=(1, 2, 4, 8),
    capture_mode=CaptureMode.FULL_AND_PIECEWISE,
    max_num_reqs=4,
    num_speculative_tokens=1,
)


def attempt(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The call's result, or None when it raised a PureppError (anything else escapes)."""
    try:
        return fn(*args, **kwargs)
    except PureppError:
        return None


def is_integer(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def kept_exactly(given_value: object, stored: object) -> bool:
    """An accepted int is an integer stored as the same Python int (no truncation)."""
    if given_value is None:
        return stored is None
    return is_integer(given_value) and type(stored) is int and stored == given_value


def spoiled(data: st.DataObject, valid: dict[str, Any]) -> dict[str, Any]:
    """`valid` with one or more of its values replaced by garbage."""
    names = data.draw(st.sets(st.sampled_from(sorted(valid)), min_size=1))
    return {**valid, **{n: data.draw(GARBAGE) for n in names}}


@settings(max_examples=200)
@given(st.data())
def test_a_rank_batch_refuses_garbage_and_never_truncates(data: st.DataObject) -> None:
    valid = {
        "num_reqs": 2,
        "num_tokens": 4,
        "uniform_token_count": 2,
        "max_query_len": 2,
        "need_eager": False,
        "num_active_loras": 0,
        "dp_sync": None,
    }
    kwargs = spoiled(data, valid)
    batch = attempt(RankBatch, **kwargs)
    if batch is None:
        return
    for name in (
        "num_reqs",
        "num_tokens",
        "num_active_loras",
        "uniform_token_count",
        "max_query_len",
    ):
        assert kept_exactly(kwargs[name], getattr(batch, name)), name
    assert type(batch.need_eager) is bool
    assert isinstance(kwargs["need_eager"], (bool, np.bool_))
    assert batch.need_eager == kwargs["need_eager"]
    assert batch.dp_sync is None or type(batch.dp_sync) is DPSyncState


@settings(max_examples=150)
@given(st.data())
def test_groups_layouts_and_lanes_refuse_garbage(data: st.DataObject) -> None:
    group_kwargs = spoiled(
        data,
        {
            "dp_size": 4,
            "dp_rank": 1,
            "layout": TableLayout(),
            "live_ranks": {1, 2},
            "comm": Communicator.DP_CPU,
            "drafter_comm": Communicator.DP_DRAFTER_CPU,
        },
    )
    group = attempt(AgreementGroup, **group_kwargs)
    if group is not None:
        assert kept_exactly(group_kwargs["dp_size"], group.dp_size)
        assert kept_exactly(group_kwargs["dp_rank"], group.dp_rank)
        assert group.dp_rank in group.live
        assert all(type(r) is int and 0 <= r < group.dp_size for r in group.live)
    config_kwargs = spoiled(
        data,
        {"num_ubatches": 2, "decode_token_threshold": 32, "prefill_token_threshold": 512},
    )
    config = attempt(MicrobatchConfig, **config_kwargs)
    if config is not None:
        for name, value in config_kwargs.items():
            assert kept_exactly(value, getattr(config, name))
    layout = attempt(TableLayout, microbatch=data.draw(GARBAGE))
    assert layout is None or layout.microbatch is None
    lanes_kwargs = spoiled(data, {"target": 3, "drafter": None})
    lanes = attempt(AgreementLanes, **lanes_kwargs)
    if lanes is not None:
        assert kept_exactly(lanes_kwargs["target"], lanes.target)
        assert kept_exactly(lanes_kwargs["drafter"], lanes.drafter)


@settings(max_examples=150)
@given(st.data())
def test_syncs_and_descriptors_refuse_garbage(data: st.DataObject) -> None:
    sync_kwargs = spoiled(
        data,
        {
            "num_tokens_across_dp": np.array([4, 4], dtype=np.int32),
            "uniform_token_count": 2,
            "eager": False,
            "num_reqs": 2,
            "max_query_len": None,
        },
    )
    sync = attempt(DPSyncState, **sync_kwargs)
    if sync is not None:
        given_counts = sync_kwargs["num_tokens_across_dp"]
        assert sync.num_tokens_across_dp.dtype == np.int32
        assert sync.num_tokens_across_dp.tolist() == list(np.asarray(given_counts).tolist())
        assert kept_exactly(sync_kwargs["num_reqs"], sync.num_reqs)
        assert isinstance(sync_kwargs["eager"], (bool, np.bool_))
    descriptor_kwargs = spoiled(
        data,
        {
            "cg_mode": CUDAGraphMode.FULL,
            "num_tokens": 4,
            "num_reqs": 2,
            "uniform_token_count": None,
            "max_query_len": None,
            "num_active_loras": 0,
            "num_ubatches": 1,
        },
    )
    descriptor = attempt(BatchExecutionDescriptor, **descriptor_kwargs)
    if descriptor is not None:
        assert isinstance(descriptor.cg_mode, CUDAGraphMode)
        for name in ("num_tokens", "num_active_loras", "num_ubatches"):
            assert is_integer(descriptor_kwargs[name])


@settings(max_examples=150)
@given(st.data())
def test_the_dispatcher_refuses_garbage_in_its_configuration_and_its_questions(
    data: st.DataObject,
) -> None:
    kwargs = spoiled(
        data,
        {
            "capture_sizes": (1, 2, 4),
            "capture_mode": CaptureMode.FULL,
            "max_num_reqs": 4,
            "num_speculative_tokens": 0,
            "lora_capture_cases": (0,),
            "varlen_decode": False,
        },
    )
    dispatcher = attempt(CudaGraphDispatcher, **kwargs)
    if dispatcher is not None:
        assert all(type(s) is int for s in dispatcher.capture_sizes)
        assert isinstance(kwargs["capture_mode"], CaptureMode)
    question = spoiled(
        data,
        {
            "num_reqs": 2,
            "num_tokens": 4,
            "uniform_token_count": None,
            "num_active_loras": 0,
            "max_query_len": None,
        },
    )
    answer = attempt(SPEC.dispatch, **question)
    if answer is not None:
        for name in ("num_reqs", "num_tokens", "num_active_loras"):
            assert is_integer(question[name]), name
        assert type(answer) is BatchExecutionDescriptor


@settings(max_examples=200)
@given(st.data())
def test_the_agreement_steps_refuse_garbage_and_leave_the_lanes_as_they_were(
    data: st.DataObject,
) -> None:
    lanes = AgreementLanes()
    group = AgreementGroup(dp_size=2, dp_rank=0)
    batch = RankBatch(num_reqs=2, num_tokens=4, uniform_token_count=2)
    args = spoiled(
        data,
        {
            "lanes": lanes,
            "group": group,
            "dispatcher": SPEC,
            "batch": batch,
            "step": 3,
            "lane": Lane.TARGET,
            "asynchronous": False,
        },
    )
    started = attempt(
        start_agreement,
        args["lanes"],
        args["group"],
        args["dispatcher"],
        args["batch"],
        step=args["step"],
        lane=args["lane"],
        asynchronous=args["asynchronous"],
    )
    assert lanes == AgreementLanes()  # a value: never changed by a refused start
    if started is not None:
        assert kept_exactly(args["step"], started.result.step)
        assert type(started.result) is PendingAgreement
    good = start_agreement(lanes, group, SPEC, batch, step=3)
    table = data.draw(
        st.one_of(
            GARBAGE,
            st.lists(st.integers(-(2**31), 2**31 - 1), min_size=10, max_size=10).map(
                lambda v: np.array(v, dtype=np.int32).reshape(5, 2)
            ),
        )
    )
    finished = attempt(finish_agreement, good.state, good.result, table)
    if finished is not None:
        assert finished.state == AgreementLanes()
    assert attempt(finish_agreement, data.draw(GARBAGE), good.result, table) is None
    assert attempt(wait_for_agreement, data.draw(GARBAGE)) is None
