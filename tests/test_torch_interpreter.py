"""The torch interpreter's semantics, effect by effect, in one process on CPU.

Collectives run on a real single-rank gloo world (the multi-rank behaviour is in
test_gloo_interpreter.py). The GPU test at the end checks that a consume-like step
makes no device-to-host synchronisation; it is skipped without CUDA.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import TypedDict

import attrs
import numpy as np
import numpy.typing as npt
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from purepp.effects.numpy_interpreter import NumpyInterpreter
from purepp.effects.torch_interpreter import (
    TorchInterpreter,
    build_communicators,
    init_distributed,
)
from purepp.effects.torch_kernels import (
    section_view,
    section_views,
    torch_dtype,
)
from purepp.effects.vocabulary import (
    Alias,
    Allocate,
    AllReduce,
    Broadcast,
    BufferRef,
    CheckHeader,
    Communicator,
    CopyHostToDevice,
    DType,
    Effect,
    EventRef,
    GatherRows,
    Op,
    PadColumns,
    RecordEvent,
    RecordStream,
    Release,
    ScatterRows,
    Section,
    StackRows,
    Stream,
    WaitEvent,
    WaitStream,
    WaitWork,
    WorkRef,
)
from purepp.errors import ConfigError, HeaderMismatchError, InterpreterError, PeerFailureError
from tests.strategies import gather_cases, scatter_cases

CPU = torch.device("cpu")


class Tag(TypedDict):
    step: int
    op: Op


TAG = Tag(step=7, op=Op.CONSUME)
A, B, C, D = (BufferRef(name) for name in ("a", "b", "c", "d"))


@pytest.fixture(scope="module")
def groups() -> Iterator[dict[Communicator, dist.ProcessGroup]]:
    """A single-rank gloo world with every communicator, for the whole module."""
    if dist.is_initialized():
        pytest.fail("another test left a default process group initialised")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as rendezvous:
        init_distributed(
            backend="gloo",
            init_method=f"file://{rendezvous}/store",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=10),
        )
        try:
            yield build_communicators(
                pp_groups=[[0]],
                dp_groups=[[0]],
                relay_backend="gloo",
                timeout=datetime.timedelta(seconds=10),
            )
        finally:
            dist.destroy_process_group()


@pytest.fixture(params=[False, True], ids=["fast", "checked"])
def interp(
    groups: dict[Communicator, dist.ProcessGroup], request: pytest.FixtureRequest
) -> TorchInterpreter:
    """Both modes: every test of semantics holds in each."""
    checked: bool = request.param
    return TorchInterpreter(device=CPU, groups=groups, rank=0, checked=checked)


@pytest.fixture
def checked(groups: dict[Communicator, dist.ProcessGroup]) -> TorchInterpreter:
    """Checked mode: layout errors are named before anything changes."""
    return TorchInterpreter(device=CPU, groups=groups, rank=0, checked=True)


def values(tensor: torch.Tensor) -> npt.NDArray[np.int64]:
    return np.asarray(tensor.numpy(), dtype=np.int64)


def int64(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


# ---- construction and the environment --------------------------------------------------


def test_torch_dtype_maps_every_vocabulary_dtype() -> None:
    assert [torch_dtype(d) for d in DType] == [torch.int64, torch.int32]


_NUMPY = {DType.INT64: np.int64, DType.INT32: np.int32}


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_section_views_read_the_bytes_each_section_names(data: st.DataObject) -> None:
    # Either wire dtype, any aligned sections of either dtype: each view holds exactly
    # the section's bytes, by the fast path or the general one. A strided buffer (which
    # checked mode refuses) is read in its own dtype.
    wire = data.draw(st.sampled_from(list(DType)))
    words = data.draw(st.integers(2, 12))
    values = data.draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=words, max_size=words))
    packed = torch.tensor(values, dtype=torch_dtype(wire))
    strided = data.draw(st.booleans())
    if strided:  # every other word of a wider buffer
        packed = torch.tensor([v for v in values for _ in (0, 1)], dtype=packed.dtype)[::2]
    raw = bytes(np.array(values, dtype=_NUMPY[wire]).tobytes())
    sections = []
    for i in range(data.draw(st.integers(1, 4))):
        dtype = wire if strided else data.draw(st.sampled_from(list(DType)))
        itemsize = np.dtype(_NUMPY[dtype]).itemsize
        fits = len(raw) // itemsize
        count = data.draw(st.integers(1, fits))
        start = data.draw(st.integers(0, fits - count))
        shape = (count,) if count % 2 or data.draw(st.booleans()) else (2, count // 2)
        buffer = BufferRef(f"section{i}")
        sections.append(Section(buffer=buffer, offset=start * itemsize, shape=shape, dtype=dtype))
    for section, view in zip(sections, section_views(packed, sections), strict=True):
        size = int(np.prod(section.shape)) * np.dtype(_NUMPY[section.dtype]).itemsize
        region = raw[section.offset : section.offset + size]
        expected = np.frombuffer(region, dtype=_NUMPY[section.dtype]).reshape(section.shape)
        assert view.dtype is torch_dtype(section.dtype)
        assert view.numpy().tolist() == expected.tolist()
        assert section_view(packed, section).numpy().tolist() == expected.tolist()


def test_build_communicators_gives_the_relay_its_own_group(
    groups: dict[Communicator, dist.ProcessGroup],
) -> None:
    assert set(groups) == set(Communicator)
    assert groups[Communicator.PP_RELAY] is not groups[Communicator.PP_CPU]
    assert all(dist.get_process_group_ranks(g) == [0] for g in groups.values())


def test_build_communicators_rejects_a_rank_outside_the_world(
    groups: dict[Communicator, dist.ProcessGroup],
) -> None:
    with pytest.raises(ConfigError, match=r"rank 1 outside 0\.\.0"):
        build_communicators(
            pp_groups=[[0, 1]],
            dp_groups=[[0]],
            relay_backend="gloo",
            timeout=datetime.timedelta(seconds=1),
        )


@pytest.mark.parametrize(
    ("pp_groups", "problem"),
    [([[]], r"PP group \(\) is empty"), ([[0, 0]], r"PP group \(0, 0\) is empty or repeats")],
)
def test_build_communicators_rejects_an_empty_group_or_a_repeated_rank(
    groups: dict[Communicator, dist.ProcessGroup], pp_groups: list[list[int]], problem: str
) -> None:
    with pytest.raises(ConfigError, match=rf"^build_communicators: {problem}"):
        build_communicators(
            pp_groups=pp_groups,
            dp_groups=[[0]],
            relay_backend="gloo",
            timeout=datetime.timedelta(seconds=1),
        )
    with pytest.raises(ConfigError, match=r"^build_communicators: timeout=0:00:00"):
        build_communicators(
            pp_groups=[[0]], dp_groups=[[0]], relay_backend="gloo", timeout=datetime.timedelta(0)
        )


@pytest.mark.parametrize(
    ("rank", "world_size", "seconds"), [(0, 0, 1), (2, 2, 1), (-1, 2, 1), (0, 1, 0)]
)
def test_init_distributed_refuses_a_rank_outside_its_world_or_no_timeout(
    rank: int, world_size: int, seconds: int
) -> None:
    with pytest.raises(ConfigError, match=r"^init_distributed: (rank=|timeout=)"):
        init_distributed(
            backend="gloo",
            init_method="file:///nonexistent/store",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=seconds),
        )


def test_init_distributed_refuses_a_second_world_and_keeps_the_first(
    groups: dict[Communicator, dist.ProcessGroup],
) -> None:
    with pytest.raises(
        ConfigError, match=r"^init_distributed: the default process group is already initialised"
    ) as e:
        init_distributed(
            backend="gloo",
            init_method="file:///nonexistent/store",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=1),
        )
    assert "destroy_process_group before re-initialising" in str(e.value)
    assert dist.get_world_size() == 1
    assert dist.get_process_group_ranks(groups[Communicator.PP_RELAY]) == [0]


@pytest.mark.parametrize("kind", ["PP", "DP"])
def test_build_communicators_puts_a_rank_in_one_group_of_each_kind(
    groups: dict[Communicator, dist.ProcessGroup], kind: str
) -> None:
    twice, once = [[0], [0]], [[0]]
    with pytest.raises(ConfigError, match=rf"rank 0 is in more than one {kind} group") as e:
        build_communicators(
            pp_groups=twice if kind == "PP" else once,
            dp_groups=twice if kind == "DP" else once,
            relay_backend="gloo",
            timeout=datetime.timedelta(seconds=1),
        )
    assert f"put each rank in at most one {kind} group" in str(e.value)


def test_a_group_that_cannot_be_created_is_a_peer_failure_naming_it(
    groups: dict[Communicator, dist.ProcessGroup], monkeypatch: pytest.MonkeyPatch
) -> None:
    def peer_gone(*args: object, **kwargs: object) -> dist.ProcessGroup:
        raise RuntimeError("Connection closed by peer")  # a peer died meanwhile

    monkeypatch.setattr(dist, "new_group", peer_gone)
    with pytest.raises(
        PeerFailureError,
        match=r"^build_communicators: creating the gloo group for pp_relay over ranks \(0,\) "
        "failed on rank 0: Connection closed by peer",
    ) as e:
        build_communicators(
            pp_groups=[[0]],
            dp_groups=[[0]],
            relay_backend="gloo",
            timeout=datetime.timedelta(seconds=1),
        )
    assert "read the other ranks' logs" in str(e.value)


def test_the_interpreter_refuses_a_device_it_cannot_use_and_no_graph_copies() -> None:
    with pytest.raises(ConfigError, match=r"^TorchInterpreter: device meta"):
        TorchInterpreter(device=torch.device("meta"), groups={}, rank=0)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"^TorchInterpreter: device cuda.* unavailable"):
            TorchInterpreter(device=torch.device("cuda"), groups={}, rank=0)
    with pytest.raises(ConfigError, match=r"^TorchInterpreter: capture_copies=0"):
        TorchInterpreter(device=CPU, groups={}, rank=0, capture_copies=0)
    TorchInterpreter(device=CPU, groups={}, rank=0, capture_copies=1)


def test_a_group_that_excludes_the_rank_is_rejected(
    groups: dict[Communicator, dist.ProcessGroup],
) -> None:
    with pytest.raises(ConfigError, match="exclude rank 1"):
        TorchInterpreter(device=CPU, groups=groups, rank=1)


def test_bind_then_tensor_returns_the_same_tensor(interp: TorchInterpreter) -> None:
    tensor = torch.arange(3)
    interp.bind(A, tensor)
    assert interp.tensor(A) is tensor
    replacement = torch.arange(4)
    interp.bind(A, replacement)
    assert interp.tensor(A) is replacement


def test_an_unknown_ref_names_the_effect_and_the_ref(interp: TorchInterpreter) -> None:
    with pytest.raises(InterpreterError, match=r"Release step=7 op=consume.*'ghost' is not bound"):
        interp.perform((Release(**TAG, buffer=BufferRef("ghost")),))
    with pytest.raises(InterpreterError, match="'ghost' is not bound"):
        interp.tensor(BufferRef("ghost"))


def test_host_array_is_a_read_only_copy(interp: TorchInterpreter) -> None:
    tensor = torch.arange(4, dtype=torch.int32)
    interp.bind(A, tensor)
    array = interp.host_array(A)
    assert not array.flags.writeable
    tensor[0] = 99
    assert array.tolist() == [0, 1, 2, 3]


@attrs.frozen
class _Inner:
    counts: BufferRef
    note: int


@attrs.frozen
class _Outer:
    tokens: BufferRef
    inner: _Inner
    extra: tuple[BufferRef, ...]
    event: EventRef
    missing: BufferRef | None


def test_resolve_maps_every_buffer_ref_by_attribute_path(interp: TorchInterpreter) -> None:
    tensors = {ref: torch.arange(i + 1) for i, ref in enumerate((A, B, C, D))}
    for ref, tensor in tensors.items():
        interp.bind(ref, tensor)
    value = _Outer(
        tokens=A, inner=_Inner(counts=B, note=3), extra=(C, D), event=EventRef("e"), missing=None
    )
    resolved = interp.resolve(value)
    assert resolved == {
        "tokens": tensors[A],
        "inner.counts": tensors[B],
        "extra[0]": tensors[C],
        "extra[1]": tensors[D],
    }
    assert interp.resolve(None) == {}
    assert interp.resolve(A) == {"": tensors[A]}


def test_resolve_of_an_unbound_ref_is_an_error(interp: TorchInterpreter) -> None:
    with pytest.raises(InterpreterError, match=r"TorchInterpreter\.resolve.*'a' is not bound"):
        interp.resolve(_Inner(counts=A, note=0))


# ---- streams and events (no-ops on CPU, but names are still checked) -------------------


def test_events_are_recorded_once_and_consumed_by_their_wait(interp: TorchInterpreter) -> None:
    event = EventRef("received")
    record = RecordEvent(**TAG, stream=Stream.RELAY, event=event)
    wait = WaitEvent(**TAG, stream=Stream.MAIN, event=event)
    interp.perform((WaitStream(**TAG, stream=Stream.RELAY, waits_for=Stream.MAIN), record))
    assert event in interp.bound_refs()
    with pytest.raises(InterpreterError, match="'received' is already recorded"):
        interp.perform((record,))
    interp.perform((wait,))
    assert interp.bound_refs() == frozenset()
    with pytest.raises(InterpreterError, match=r"WaitEvent step=7.*'received' is not recorded"):
        interp.perform((wait,))


def test_record_stream_needs_a_bound_buffer(interp: TorchInterpreter) -> None:
    interp.bind(A, torch.zeros(2))
    interp.perform((RecordStream(**TAG, buffer=A, stream=Stream.MAIN),))
    with pytest.raises(InterpreterError, match="'b' is not bound"):
        interp.perform((RecordStream(**TAG, buffer=B, stream=Stream.MAIN),))


def test_cuda_stream_is_an_error_on_cpu(interp: TorchInterpreter) -> None:
    with pytest.raises(InterpreterError, match="only on a cuda device"):
        interp.cuda_stream(Stream.MAIN)


# ---- buffers -----------------------------------------------------------------------------


def test_allocate_binds_a_tensor_of_the_declared_layout(interp: TorchInterpreter) -> None:
    interp.perform(
        (Allocate(**TAG, buffer=A, shape=(3, 2), dtype=DType.INT32, stream=Stream.RELAY),)
    )
    tensor = interp.tensor(A)
    assert (tuple(tensor.shape), tensor.dtype, tensor.device) == ((3, 2), torch.int32, CPU)


def test_a_new_buffer_never_replaces_a_bound_one(interp: TorchInterpreter) -> None:
    interp.bind(A, torch.zeros(1))
    effects: list[Effect] = [
        Allocate(**TAG, buffer=A, shape=(1,), dtype=DType.INT64, stream=Stream.MAIN),
        CopyHostToDevice(**TAG, source=np.zeros(1, np.int32), buffer=A, stream=Stream.MAIN),
        Alias(**TAG, source=A, out=A),
    ]
    for effect in effects:
        with pytest.raises(InterpreterError, match="'a' is already bound"):
            interp.perform((effect,))


def test_copy_host_to_device_copies_the_values(interp: TorchInterpreter) -> None:
    effect = CopyHostToDevice(
        **TAG, source=np.array([4, -1, 2], np.int32), buffer=A, stream=Stream.MAIN
    )
    interp.perform((effect,))
    tensor = interp.tensor(A)
    assert tensor.dtype == torch.int32
    assert tensor.tolist() == [4, -1, 2]
    tensor[0] = 0  # the effect's array is the interpreter's to copy, never to share
    assert effect.source.tolist() == [4, -1, 2]


def test_release_drops_the_binding_and_alias_keeps_the_tensor(interp: TorchInterpreter) -> None:
    tensor = torch.arange(3)
    interp.bind(A, tensor)
    interp.perform((Alias(**TAG, source=A, out=B), Release(**TAG, buffer=A)))
    assert interp.tensor(B) is tensor
    assert interp.bound_refs() == frozenset({B})


# ---- device-side data moves ----------------------------------------------------------------


def test_pad_columns_pads_on_the_right_with_fill(interp: TorchInterpreter) -> None:
    interp.bind(A, int64([[1], [2]]))
    interp.perform((PadColumns(**TAG, source=A, out=B, width=3, fill=-1, stream=Stream.RELAY),))
    assert interp.tensor(B).tolist() == [[1, -1, -1], [2, -1, -1]]
    assert interp.tensor(B).dtype == torch.int64


def test_pad_columns_snapshots_even_at_full_width(interp: TorchInterpreter) -> None:
    source = int64([[1, 2], [3, 4]])
    interp.bind(A, source)
    interp.perform((PadColumns(**TAG, source=A, out=B, width=2, fill=0, stream=Stream.RELAY),))
    source[0, 0] = 9  # the caller may reuse its tensor as soon as the step is issued
    assert interp.tensor(B).tolist() == [[1, 2], [3, 4]]


@pytest.mark.parametrize("shape", [(2, 4), (4,)])
def test_pad_columns_rejects_a_source_it_cannot_pad(
    checked: TorchInterpreter, shape: tuple[int, ...]
) -> None:
    checked.bind(A, torch.zeros(shape, dtype=torch.int64))
    with pytest.raises(InterpreterError, match="cannot pad to width 3"):
        checked.perform((PadColumns(**TAG, source=A, out=B, width=3, fill=0, stream=Stream.RELAY),))
    assert B not in checked.bound_refs()


def test_stack_rows_stacks_equal_rows(interp: TorchInterpreter) -> None:
    interp.bind(A, torch.tensor([1, 2, 3], dtype=torch.int32))
    interp.bind(B, torch.tensor([0, 1, 0], dtype=torch.int32))
    interp.perform((StackRows(**TAG, sources=(A, B), out=C, stream=Stream.RELAY),))
    assert interp.tensor(C).tolist() == [[1, 2, 3], [0, 1, 0]]
    assert interp.tensor(C).dtype == torch.int32


def test_stack_rows_rejects_unequal_rows(checked: TorchInterpreter) -> None:
    checked.bind(A, torch.zeros(3, dtype=torch.int32))
    checked.bind(B, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(InterpreterError, match="1-D buffers of equal length and dtype"):
        checked.perform((StackRows(**TAG, sources=(A, B), out=C, stream=Stream.RELAY),))


@settings(max_examples=50, deadline=None)
@given(case=gather_cases())
def test_gather_rows_matches_numpy_indexing(
    groups: dict[Communicator, dist.ProcessGroup],
    case: tuple[npt.NDArray[np.int64], npt.NDArray[np.int32]],
) -> None:
    interp = TorchInterpreter(device=CPU, groups=groups, rank=0)
    source, index = case
    interp.bind(A, torch.from_numpy(source.copy()))
    interp.bind(B, torch.from_numpy(index.copy()))
    interp.perform((GatherRows(**TAG, source=A, index=B, out=C, stream=Stream.RELAY),))
    np.testing.assert_array_equal(values(interp.tensor(C)), source[index])


@settings(max_examples=80, deadline=None)
@given(case=scatter_cases())
def test_scatter_rows_writes_kept_rows_in_place_and_skips_minus_one(
    groups: dict[Communicator, dist.ProcessGroup],
    case: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int32]],
) -> None:
    interp = TorchInterpreter(device=CPU, groups=groups, rank=0)
    target, source, index = case
    target_tensor = torch.from_numpy(target.copy())
    interp.bind(A, torch.from_numpy(source.copy()))
    interp.bind(B, torch.from_numpy(index.copy()))
    interp.bind(C, target_tensor)
    interp.perform((ScatterRows(**TAG, source=A, index=B, target=C, stream=Stream.MAIN),))
    expected = target.copy()
    for row, slot in enumerate(index):
        if slot != -1:
            expected[slot] = source[row]
    assert interp.tensor(C) is target_tensor
    np.testing.assert_array_equal(values(target_tensor), expected)


@settings(max_examples=60, deadline=None)
@given(case=scatter_cases())
def test_a_scatter_that_skips_no_rows_writes_every_row_in_torch_and_numpy(
    groups: dict[Communicator, dist.ProcessGroup],
    case: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int32]],
) -> None:
    target, source, index = case
    kept = index != -1  # the case without its skipped rows: what `skips=False` promises
    source, index = source[kept], index[kept]
    scatter = ScatterRows(**TAG, source=A, index=B, target=C, stream=Stream.MAIN, skips=False)
    interp = TorchInterpreter(device=CPU, groups=groups, rank=0)
    target_tensor = torch.from_numpy(target.copy())
    interp.bind(A, torch.from_numpy(source.copy()))
    interp.bind(B, torch.from_numpy(index.copy()))
    interp.bind(C, target_tensor)
    interp.perform((scatter,))
    reference = NumpyInterpreter()
    reference.bind(A, source)
    reference.bind(B, index)
    reference.bind(C, target)
    reference.perform((scatter,))
    expected = target.copy()
    expected[index] = source
    np.testing.assert_array_equal(values(target_tensor), expected)
    np.testing.assert_array_equal(reference.tensor(C), expected)


def test_the_reference_refuses_minus_one_in_a_scatter_that_skips_no_rows() -> None:
    reference = NumpyInterpreter()
    reference.bind(A, np.ones((2, 3), dtype=np.int64))
    reference.bind(B, np.array([1, -1], dtype=np.int32))
    reference.bind(C, np.zeros((4, 3), dtype=np.int64))
    scatter = ScatterRows(**TAG, source=A, index=B, target=C, stream=Stream.MAIN, skips=False)
    with pytest.raises(InterpreterError, match=r"holds row -1 .*skips=False"):
        reference.perform((scatter,))
    assert reference.tensor(C).tolist() == [[0, 0, 0]] * 4


def test_scatter_rows_rejects_mismatched_rows_and_leaves_the_target(
    checked: TorchInterpreter,
) -> None:
    target = torch.zeros((4, 2), dtype=torch.int64)
    checked.bind(A, torch.ones((2, 3), dtype=torch.int64))
    checked.bind(B, torch.tensor([0, 1], dtype=torch.int32))
    checked.bind(C, target)
    with pytest.raises(InterpreterError, match="one source row per index entry"):
        checked.perform((ScatterRows(**TAG, source=A, index=B, target=C, stream=Stream.MAIN),))
    assert target.tolist() == [[0, 0]] * 4


def test_a_float_index_is_rejected(checked: TorchInterpreter) -> None:
    checked.bind(A, torch.zeros((2, 2), dtype=torch.int64))
    checked.bind(B, torch.zeros(2, dtype=torch.float32))
    with pytest.raises(InterpreterError, match="1-D int32 or int64 index"):
        checked.perform((GatherRows(**TAG, source=A, index=B, out=C, stream=Stream.MAIN),))


# ---- collectives on a single-rank gloo world --------------------------------------------


def broadcast(buffer: BufferRef, shape: tuple[int, ...], dtype: DType, src: int = 0) -> Broadcast:
    return Broadcast(
        **TAG,
        buffer=buffer,
        shape=shape,
        dtype=dtype,
        src=src,
        comm=Communicator.PP_RELAY,
        stream=Stream.RELAY,
    )


def test_broadcast_from_the_only_rank_keeps_the_values(interp: TorchInterpreter) -> None:
    interp.bind(A, int64([[5, 6]]))
    interp.perform((broadcast(A, (1, 2), DType.INT64),))
    assert interp.tensor(A).tolist() == [[5, 6]]


def test_broadcasts_are_issued_blocking_as_dist_broadcast_issues_them(
    interp: TorchInterpreter,
) -> None:
    # NCCL runs a blocking call on the current (relay) stream; an asynchronous one goes
    # through NCCL's own stream, events and tensor stashing, which cost over 100 us of
    # host time per call on an H200 (benchmarks/relay_floor.py).
    options = interp.broadcast_options(broadcast(A, (2,), DType.INT64))
    assert options.asyncOp is False
    assert options.rootRank == 0


@pytest.mark.parametrize(
    ("shape", "dtype"), [((1, 3), DType.INT64), ((2, 1), DType.INT64), ((1, 2), DType.INT32)]
)
def test_broadcast_checks_the_wire_layout_before_issuing(
    interp: TorchInterpreter, shape: tuple[int, ...], dtype: DType
) -> None:
    interp.bind(A, int64([[5, 6]]))
    with pytest.raises(InterpreterError, match=r"is torch\.int64 \(1, 2\) but the wire is"):
        interp.perform((broadcast(A, shape, dtype),))


def test_broadcast_rejects_a_source_outside_the_communicator(
    interp: TorchInterpreter, checked: TorchInterpreter
) -> None:
    for made in (interp, checked):  # the fast path and the checked one say the same
        made.bind(A, int64([[5, 6]]))
        with pytest.raises(
            InterpreterError, match=r"source rank 3 is not in communicator pp_relay"
        ) as raised:
            made.perform((broadcast(A, (1, 2), DType.INT64, src=3),))
        assert "give RelayConfig.for_stage the pipeline's first_rank" in str(raised.value)


def test_broadcast_rejects_a_non_contiguous_buffer(checked: TorchInterpreter) -> None:
    checked.bind(A, int64([[1, 2], [3, 4]])[:, 0])
    with pytest.raises(InterpreterError, match="not contiguous"):
        checked.perform((broadcast(A, (2,), DType.INT64),))


def test_a_communicator_without_a_group_is_an_error(
    groups: dict[Communicator, dist.ProcessGroup],
) -> None:
    interp = TorchInterpreter(device=CPU, groups={}, rank=0)
    interp.bind(A, int64([[5, 6]]))
    with pytest.raises(InterpreterError, match="communicator pp_relay has no process group"):
        interp.perform((broadcast(A, (1, 2), DType.INT64),))


# ---- the relay header's check ------------------------------------------------------------


def header_check(expected: list[int], step: int = 7) -> CheckHeader:
    tag = Tag(step=step, op=Op.RECEIVE)
    return CheckHeader(**tag, buffer=A, expected=expected, stream=Stream.RELAY)


def sent_header(values: list[int]) -> tuple[Effect, ...]:
    """The sender's side on a one-rank world: the header copied in and broadcast."""
    tag = Tag(step=7, op=Op.BROADCAST)
    return (
        CopyHostToDevice(**tag, source=values, buffer=A, stream=Stream.RELAY),
        broadcast(A, (2,), DType.INT32),
    )


def test_a_matching_header_passes(interp: TorchInterpreter) -> None:
    interp.perform((*sent_header([7, 3]), header_check([7, 3])))
    assert interp.tensor(A).tolist() == [7, 3]


@pytest.mark.parametrize(("sent", "why"), [([8, 3], "another step"), ([7, 2], "different batches")])
def test_a_wrong_header_on_cpu_raises_the_typed_error_naming_both(
    interp: TorchInterpreter, sent: list[int], why: str
) -> None:
    interp.perform(sent_header(sent))
    with pytest.raises(HeaderMismatchError) as caught:
        interp.perform((header_check([7, 3]),))
    error = caught.value
    assert (error.rank, error.step, error.expected, error.received) == (0, 7, (7, 3), tuple(sent))
    assert error.call == "TorchInterpreter.perform(CheckHeader step=7 op=receive)"
    assert why in error.problem


@pytest.mark.parametrize(
    "bound", [torch.tensor([7, 3], dtype=torch.int64), torch.tensor([7, 3, 0], dtype=torch.int32)]
)
def test_a_header_of_another_layout_is_refused(
    interp: TorchInterpreter, bound: torch.Tensor
) -> None:
    interp.bind(A, bound)
    with pytest.raises(InterpreterError, match=r"but the expected header is torch\.int32 \(2,\)"):
        interp.perform((header_check([7, 3]),))


def all_reduce(table: list[list[int]], work: WorkRef | None) -> AllReduce:
    contribution = np.array(table, dtype=np.int32)
    return AllReduce(
        **TAG, contribution=contribution, result=D, comm=Communicator.DP_CPU, work=work
    )


def test_synchronous_all_reduce_binds_the_host_table(interp: TorchInterpreter) -> None:
    interp.perform((all_reduce([[3], [2], [1], [-1], [4]], None),))
    table = interp.host_array(D)
    assert table.dtype == np.int32
    assert table.tolist() == [[3], [2], [1], [-1], [4]]
    assert interp.tensor(D).device == CPU


def test_async_all_reduce_is_readable_only_after_its_wait(interp: TorchInterpreter) -> None:
    work = WorkRef("agree")
    interp.perform((all_reduce([[1], [0], [0], [-1], [1]], work),))
    with pytest.raises(InterpreterError, match="'agree', which has not been waited on"):
        interp.host_array(D)
    with pytest.raises(InterpreterError, match="being written by all-reduce 'agree'"):
        interp.bind(D, torch.zeros(1))
    interp.perform((WaitWork(**TAG, work=work),))
    assert interp.host_array(D).tolist() == [[1], [0], [0], [-1], [1]]
    assert interp.bound_refs() == frozenset({D})
    with pytest.raises(InterpreterError, match=r"WaitWork step=7.*'agree' is not in flight"):
        interp.perform((WaitWork(**TAG, work=work),))


def test_a_work_name_in_flight_is_not_reused_by_either_interpreter(
    interp: TorchInterpreter,
) -> None:
    # The second all-reduce would lose the first one's handle: refused, as numpy does.
    work = WorkRef("agree")
    interp.perform((all_reduce([[1], [0], [0], [-1], [1]], work),))
    again = attrs.evolve(all_reduce([[2], [0], [0], [-1], [1]], work), result=C)
    with pytest.raises(InterpreterError, match="work 'agree' is already in flight"):
        interp.perform((again,))
    reference = NumpyInterpreter(rank=0)
    reference.perform((all_reduce([[1], [0], [0], [-1], [1]], work),))
    with pytest.raises(InterpreterError, match="work 'agree' is already in flight"):
        reference.perform((again,))
    interp.perform((WaitWork(**TAG, work=work),))


# ---- GPU: a steady-state step makes no device-to-host synchronisation -------------------


def consume_like_step(step: int, n: int, slots: int, width: int) -> tuple[Effect, ...]:
    """A receive-then-consume sequence as the relay emits it, with buffers named by step."""
    tag = Tag(step=step, op=Op.CONSUME)

    def ref(what: str) -> BufferRef:
        return BufferRef(f"s{step}.{what}")

    event = EventRef(f"s{step}.received")
    index = np.where(np.arange(n) % 3 == 1, -1, (np.arange(n) * 2) % slots).astype(np.int32)
    main, relay = Stream.MAIN, Stream.RELAY
    drafts, rows, table = BufferRef("drafts"), BufferRef("rows"), BufferRef("table")
    return (
        WaitStream(**tag, stream=relay, waits_for=main),
        Allocate(**tag, buffer=ref("tokens"), shape=(n, width), dtype=DType.INT64, stream=relay),
        GatherRows(**tag, source=drafts, index=rows, out=ref("sent"), stream=relay),
        PadColumns(**tag, source=ref("sent"), out=ref("padded"), width=width, fill=0, stream=relay),
        StackRows(**tag, sources=(rows, rows), out=ref("counts"), stream=relay),
        RecordEvent(**tag, stream=relay, event=event),
        RecordStream(**tag, buffer=ref("padded"), stream=main),
        CopyHostToDevice(**tag, source=index, buffer=ref("index"), stream=main),
        WaitEvent(**tag, stream=main, event=event),
        ScatterRows(**tag, source=ref("padded"), index=ref("index"), target=table, stream=main),
        Alias(**tag, source=ref("padded"), out=ref("kept")),
        *(Release(**tag, buffer=ref(w)) for w in ("tokens", "sent", "padded", "counts", "index")),
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_consume_like_step_makes_no_device_to_host_sync() -> None:
    device = torch.device("cuda", 0)
    n, slots, width = 6, 12, 3
    interp = TorchInterpreter(device=device, groups={}, rank=0)
    interp.bind(
        BufferRef("drafts"), torch.arange(slots * width, device=device).reshape(slots, width)
    )
    interp.bind(BufferRef("rows"), torch.arange(n, dtype=torch.int32, device=device))
    table = torch.zeros((slots, width), dtype=torch.int64, device=device)
    interp.bind(BufferRef("table"), table)
    interp.perform(consume_like_step(0, n, slots, width))  # warm-up: first-use allocations
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            table.nonzero()  # the mode is on: a data-dependent shape would fail the step
        for step in range(1, 4):
            interp.perform(consume_like_step(step, n, slots, width))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    index = np.where(np.arange(n) % 3 == 1, -1, (np.arange(n) * 2) % slots)
    drafts = np.arange(slots * width).reshape(slots, width)
    expected = np.zeros((slots, width), dtype=np.int64)
    for row, slot in enumerate(index):
        if slot != -1:
            expected[slot] = drafts[row]
    np.testing.assert_array_equal(values(table.cpu()), expected)
    assert {r for r in interp.bound_refs() if isinstance(r, BufferRef)} == {
        BufferRef(name)
        for name in ("drafts", "rows", "table", "s0.kept", "s1.kept", "s2.kept", "s3.kept")
    }


# ---- GPU: the header check is a device-side assertion ------------------------------------

# Run in a fresh process: a failed device assertion leaves the CUDA context unusable.
_WRONG_HEADER_ON_CUDA = """
import sys
import torch
from purepp.effects.torch_interpreter import TorchInterpreter
from purepp.effects.vocabulary import BufferRef, CheckHeader, Op, Stream

device = torch.device("cuda", 0)
interp = TorchInterpreter(device=device, groups={}, rank=0)
header = BufferRef("header")
interp.bind(header, torch.tensor([7, 3], dtype=torch.int32, device=device))
torch.cuda.synchronize()
check = CheckHeader(step=7, op=Op.RECEIVE, buffer=header, expected=[7, 4], stream=Stream.RELAY)
torch.cuda.set_sync_debug_mode("error")
interp.perform((check,))
torch.cuda.set_sync_debug_mode("default")
print("performed without a sync", flush=True)
try:
    torch.cuda.synchronize()
except RuntimeError as error:
    print("raised at synchronize:", str(error).splitlines()[0], flush=True)
    sys.exit(0)
print("no error at synchronize", flush=True)
sys.exit(1)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_wrong_header_on_cuda_trips_a_device_assertion_seen_only_at_a_sync() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _WRONG_HEADER_ON_CUDA],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert "performed without a sync" in result.stdout, result.stderr
    assert "raised at synchronize:" in result.stdout, result.stdout + result.stderr
    assert "device-side assert" in result.stdout
    # The kernel's own report carries the interpreter's message.
    assert "relay header mismatch at step 7 (expected [7, 4])" in result.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_right_header_on_cuda_passes_without_a_sync() -> None:
    device = torch.device("cuda", 0)
    interp = TorchInterpreter(device=device, groups={}, rank=0)
    steps = range(7, 12)
    headers = torch.tensor([[step, 3] for step in steps], dtype=torch.int32, device=device)
    for row, step in enumerate(steps):
        interp.bind(BufferRef(f"header{step}"), headers[row])
    torch.cuda.synchronize()

    def check(step: int) -> CheckHeader:
        return attrs.evolve(header_check([step, 3], step=step), buffer=BufferRef(f"header{step}"))

    interp.perform((check(7),))  # warm-up: first-use pinned and device memory
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in steps[1:]:
            interp.perform((check(step),))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()  # raises if any check failed on the device
