"""On a GPU: plans and CUDA-graph replays give eager's outputs, with no host sync.

A one-rank NCCL world (the relay communicator is NCCL, so its broadcasts are real
NCCL calls and are captured into the graphs; the DP table goes over gloo). The
relay-like program of tests/_interpreter_programs.py runs ~50 steps on an eager
interpreter and on a capturing one; after every batch both hold the same names with
the same contents. Steady batches run under `torch.cuda.set_sync_debug_mode("error")`,
so any host synchronisation in them fails the test. Skipped without CUDA.

Run on a GPU host:
    NCCL_NVLS_ENABLE=0 python -m pytest -q tests/test_interpreter_cuda.py -p no:cacheprovider
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
import pytest
import torch
import torch.distributed as dist

from benchmarks.one_rank import one_rank_world
from purepp.effects.torch_interpreter import TorchInterpreter
from purepp.effects.vocabulary import (
    BufferRef,
    Communicator,
    DType,
    Effect,
    Op,
    Pack,
    Release,
    ScatterRows,
    Section,
    StackRows,
    Stream,
    Synchronize,
)
from purepp.errors import InterpreterError
from tests import _interpreter_programs as programs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

STEPS = 50
# Steps before the steady state: each structure's eager first meeting and the captures
# of its instances (torch.cuda.graph synchronises while capturing). The rarest
# structure (7 rows) is met at steps 4, 13 and 22.
WARM_STEPS = 16
COPIES = 3  # graph instances per plan: the program keeps received buffers one step


@pytest.fixture(scope="module")
def groups() -> Iterator[dict[Communicator, dist.ProcessGroup]]:
    """A one-rank NCCL world: PP_RELAY on NCCL, the CPU communicators on gloo."""
    if dist.is_initialized():
        pytest.fail("another test left a default process group initialised")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with one_rank_world("cuda") as (_, groups):
        yield groups


@contextlib.contextmanager
def no_host_sync(on: bool) -> Iterator[None]:
    if not on:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def bind_to(interp: TorchInterpreter) -> programs.Bind:
    def bind(ref: BufferRef, values: npt.NDArray[np.int64] | npt.NDArray[np.int32]) -> None:
        interp.bind(ref, torch.from_numpy(np.array(values, copy=True)).to(interp.device))

    return bind


def snapshot(interp: TorchInterpreter) -> dict[str, list[object]]:
    names = interp.bound_refs()
    out: dict[str, list[object]] = {"": [repr(name) for name in sorted(names, key=repr)]}
    for ref in names:
        if isinstance(ref, BufferRef):
            out[ref.name] = interp.tensor(ref).cpu().tolist()
    return out


def device_batches(bind: programs.Bind) -> Iterator[tuple[Effect, ...]]:
    """The program without its Synchronize effects: those are host syncs by design."""
    for batch in programs.program(STEPS, bind):
        yield tuple(e for e in batch if not isinstance(e, Synchronize))


def test_captured_plans_replay_eagers_outputs_without_a_host_sync(
    groups: dict[Communicator, dist.ProcessGroup],
) -> None:
    device = torch.device("cuda", 0)
    eager = TorchInterpreter(device=device, groups=groups, rank=0)
    captured = TorchInterpreter(
        device=device, groups=groups, rank=0, capture=True, capture_copies=COPIES
    )
    eager_batches = device_batches(bind_to(eager))
    captured_batches = device_batches(bind_to(captured))
    for batch_index, (want_batch, got_batch) in enumerate(
        zip(eager_batches, captured_batches, strict=True)
    ):
        assert want_batch == got_batch
        steady = want_batch[0].step >= WARM_STEPS
        with no_host_sync(steady):
            eager.perform(want_batch)
            captured.perform(got_batch)
        torch.cuda.synchronize()
        assert snapshot(captured) == snapshot(eager), (batch_index, want_batch[0])
    planner = captured.planner
    assert planner is not None
    # The send and consume batches of steady steps are graph replays (the agreement's
    # gloo all-reduce and the releases run as plans).
    assert planner.replayed >= 2 * (STEPS - WARM_STEPS)
    assert captured.bound_refs() == eager.bound_refs()


def test_plans_on_cuda_give_eagers_outputs_without_a_host_sync(
    groups: dict[Communicator, dist.ProcessGroup],
) -> None:
    device = torch.device("cuda", 0)
    eager = TorchInterpreter(device=device, groups=groups, rank=0, checked=True)
    planned = TorchInterpreter(device=device, groups=groups, rank=0, plans=True)
    for want_batch, got_batch in zip(
        device_batches(bind_to(eager)), device_batches(bind_to(planned)), strict=True
    ):
        with no_host_sync(want_batch[0].step >= WARM_STEPS):
            eager.perform(want_batch)
            planned.perform(got_batch)
        torch.cuda.synchronize()
        assert snapshot(planned) == snapshot(eager)
    assert planned.planner is not None
    assert planned.planner.planned > planned.planner.eager


def test_the_scatter_makes_no_host_sync_in_either_mode() -> None:
    device = torch.device("cuda", 0)
    for checked in (False, True):
        interp = TorchInterpreter(device=device, groups={}, rank=0, checked=checked)
        table = torch.full((8, 3), -1, dtype=torch.int64, device=device)
        rows = torch.arange(15, dtype=torch.int64, device=device).reshape(5, 3)
        index = torch.tensor([6, -1, 0, -1, 3], dtype=torch.int32, device=device)
        refs = BufferRef("rows"), BufferRef("index"), BufferRef("table")
        for ref, tensor in zip(refs, (rows, index, table), strict=True):
            interp.bind(ref, tensor)
        scatter = ScatterRows(
            step=0, op=Op.CONSUME, source=refs[0], index=refs[1], target=refs[2],
            stream=Stream.MAIN,
        )  # fmt: skip
        with no_host_sync(True):
            interp.perform((scatter,))
        expected = np.full((8, 3), -1)
        expected[[6, 0, 3]] = np.arange(15).reshape(5, 3)[[0, 2, 4]]
        np.testing.assert_array_equal(table.cpu().numpy(), expected)


def test_checked_mode_on_cuda_validates_before_it_runs_a_kernel() -> None:
    device = torch.device("cuda", 0)
    interp = TorchInterpreter(device=device, groups={}, rank=0, checked=True)
    first, second, out = BufferRef("first"), BufferRef("second"), BufferRef("stacked")
    interp.bind(first, torch.zeros(3, dtype=torch.int32, device=device))
    interp.bind(second, torch.zeros(2, dtype=torch.int32, device=device))
    stack = StackRows(step=0, op=Op.CONSUME, sources=(first, second), out=out, stream=Stream.MAIN)
    with pytest.raises(InterpreterError, match="1-D buffers of equal length and dtype"):
        interp.perform((stack,))
    assert out not in interp.bound_refs()


def test_relay_kernels_run_on_the_relay_stream_while_main_is_busy() -> None:
    # Main sleeps; a Pack on the relay stream must run at once, not queue behind it.
    device = torch.device("cuda", 0)
    interp = TorchInterpreter(device=device, groups={}, rank=0)
    source, out = BufferRef("tokens"), BufferRef("wire")
    interp.bind(source, torch.arange(1, 5, dtype=torch.int64, device=device))
    torch.cuda.synchronize()
    pack = Pack(
        step=0,
        op=Op.BROADCAST,
        sections=(Section(buffer=source, offset=0, shape=(4,), dtype=DType.INT64),),
        out=out,
        nbytes=32,
        stream=Stream.RELAY,
    )
    # Allocations first: a first pinned or device allocation may synchronise the device.
    # The warm-up packs zeros, so memory it leaves behind cannot pass for the result.
    host = torch.empty(4, dtype=torch.int64, pin_memory=True)
    tokens = interp.tensor(source)
    interp.bind(source, torch.zeros_like(tokens))
    interp.perform((pack, Release(step=0, op=Op.END_STEP, buffer=out)))
    interp.bind(source, tokens)
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # type: ignore[attr-defined]  # ~0.5 s of main
    interp.perform((pack,))
    relay = interp.cuda_stream(Stream.RELAY)
    with torch.cuda.stream(relay):
        host.copy_(interp.tensor(out), non_blocking=True)
    relay.synchronize()
    assert not torch.cuda.current_stream().query()  # main is still asleep
    assert host.tolist() == [1, 2, 3, 4]
    torch.cuda.synchronize()
