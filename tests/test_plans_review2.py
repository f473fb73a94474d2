"""Review of plans and capture (second round): bindings a plan's guard does not check.

A plan's guard holds each input's shape, dtype and contiguity. A captured plan copies
the inputs it only reads into static buffers (aligned, on the graph's device) and
replays its kernels as one graph, applying the names changes after it; its outputs are
static memory reused by a later replay. Eager must be matched in every case: values,
names, devices and errors.

The CPU tests emulate the graph (tests/test_plan_capture.py: `emulated_record`), as
tests/test_plans_review.py does. The `gpu` tests need CUDA and skip without it; run:
    NCCL_NVLS_ENABLE=0 python -m pytest -q tests/test_plans_review2.py -m gpu -p no:cacheprovider
"""

from __future__ import annotations

import pytest
import torch

from purepp.effects.torch_interpreter import TorchInterpreter
from purepp.effects.vocabulary import (
    BufferRef,
    DType,
    Op,
    PadColumns,
    Release,
    Section,
    Stream,
    Unpack,
)
from purepp.errors import PureppError
from tests.test_plans_review import Tag, outcome

CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

IN, SPARE, SRC, IDX = (BufferRef(f"caller.{n}") for n in ("in", "spare", "src", "idx"))
TABLE, FIRST, VIEW = BufferRef("caller.table"), BufferRef("first"), BufferRef("view")


def pad(step: int, source: BufferRef, out: BufferRef, width: int, stream: Stream) -> PadColumns:
    return PadColumns(
        step=step, op=Op.CONSUME, source=source, out=out, width=width, fill=-1, stream=stream
    )


def int32_wire(step: int, *, misaligned: bool, device: torch.device = CPU) -> torch.Tensor:
    """A contiguous [4] int32 wire; misaligned: one int32 into its storage (byte 4)."""
    values = torch.arange(4, dtype=torch.int32, device=device) + 10 * step
    if not misaligned:
        return values
    return torch.cat((values[:1], values))[1:]


def unpack_int64(step: int) -> Unpack:
    """The wire's first 8 bytes as one int64 (a section wider than the wire's dtype)."""
    view = Section(buffer=VIEW, offset=0, shape=(1,), dtype=DType.INT64)
    tag = Tag(step=step, op=Op.RECEIVE)
    return Unpack(**tag, source=IN, sections=(view,), stream=Stream.MAIN)


# ---- CPU: the graph emulated --------------------------------------------------------------


def test_checked_mode_refuses_a_misaligned_wire_with_a_typed_error() -> None:
    """Checked mode validates an Unpack's source (contiguity, sections inside its bytes)
    but not its byte offset: a contiguous int32 wire starting 4 bytes into its storage,
    unpacked as int64, escapes as a raw RuntimeError from torch's dtype view. Correct
    (contract 9, errors are typed): a PureppError naming the Unpack and the wire."""
    interp = TorchInterpreter(device=CPU, groups={}, rank=0, checked=True)
    interp.bind(IN, int32_wire(0, misaligned=True))
    with pytest.raises(PureppError, match=r"caller\.in"):
        interp.perform((unpack_int64(0),))


def unpack_steps(interp: TorchInterpreter, misaligned: list[bool]) -> list[str]:
    """One Unpack of IN as int64 per step, IN bound to a wire misaligned or not; for each
    step the view's values, or the kind of error raised."""
    seen = []
    for step, odd in enumerate(misaligned):
        interp.bind(IN, int32_wire(step, misaligned=odd))
        try:
            interp.perform((unpack_int64(step),))
        except Exception as error:  # what kind escapes is the point
            seen.append(type(error).__name__)
            continue
        seen.append(str(interp.tensor(VIEW).tolist()))
        interp.perform((Release(**Tag(step=step, op=Op.END_STEP), buffer=VIEW),))
    return seen


@pytest.mark.parametrize(
    "mode",
    [{}, {"plans": True}, {"plans": True, "checked": True}],
    ids=["eager", "plan", "checked plan"],
)
def test_a_misaligned_wire_is_a_typed_error_in_every_mode_after_aligned_steps(
    mode: dict[str, bool],
) -> None:
    """Behaviour: after two aligned steps (a plan lowered), an Unpack of a wire bound
    4 bytes into its storage raises the typed InterpreterError checked mode raises, and
    a later aligned step unpacks again. Before, eager and plans let torch's raw
    RuntimeError out (a checked plan's guard admitted the view and skipped validation)."""
    interp = TorchInterpreter(device=CPU, groups={}, rank=0, **mode)
    seen = unpack_steps(interp, [False, False, True, False])
    assert seen[2] == "InterpreterError"
    assert seen[3] == str(int32_wire(3, misaligned=False).view(torch.int64)[:1].tolist())


# ---- CUDA: real graphs -------------------------------------------------------------------


def device_run(
    interp: TorchInterpreter, inputs: list[torch.Tensor]
) -> list[tuple[str, str, object]]:
    """Pad each step's input (bound to one name) into a new buffer on main; for each
    step: the outcome, and the output's device and values."""
    seen: list[tuple[str, str, object]] = []
    for i, tensor in enumerate(inputs):
        out = BufferRef(f"step{i}.out")
        interp.bind(IN, tensor)
        done = outcome(interp, (pad(i, IN, out, 3, Stream.MAIN),))
        if out in interp.env.buffers:
            made = interp.tensor(out)
            seen.append((done, made.device.type, made.cpu().tolist()))
            interp.perform((Release(**Tag(step=i, op=Op.END_STEP), buffer=out),))
        else:
            seen.append((done, "", None))
    return seen


@pytest.mark.gpu
@needs_cuda
def test_gpu_an_input_rebound_to_a_host_tensor_runs_as_eager_does() -> None:
    """A captured pad whose input is a CUDA tensor for five steps, then a host tensor
    of the same shape, dtype and contiguity. Eager pads the host tensor on the host (a
    CPU output; a broadcast of it would raise). Correct: the capture gives eager's
    outcome, output device and values (the binding is not the plan's: it runs eagerly).
    Before the fix (seen on an H200, torch 2.11): the guard's layout has no device, so the plan
    admits the host tensor and the replay stages it (`_stage` copies it into the graph's
    CUDA buffer, then calls `record_stream` on the host tensor): step 5 raises a raw
    NotImplementedError ('aten::record_stream' on CPU) where eager performs."""
    cuda = torch.device("cuda", 0)
    inputs = [
        torch.full((2, 2), i, dtype=torch.int64, device=cuda if i < 5 else CPU) for i in range(6)
    ]
    eager = TorchInterpreter(device=cuda, groups={}, rank=0)
    captured = TorchInterpreter(device=cuda, groups={}, rank=0, capture=True, capture_copies=2)
    want = device_run(eager, inputs)
    assert want[-1][1] == "cpu"
    assert device_run(captured, inputs) == want


@pytest.mark.gpu
@needs_cuda
def test_gpu_a_segment_over_host_tensors_gives_each_steps_values() -> None:
    """On a CUDA interpreter a caller binds host (CPU) tensors, new values each step, to
    a pad's input. Eager pads each on the host. Correct: the capture gives the same
    outcomes and values every step (such a plan cannot be a CUDA graph: host kernels
    run while capturing and are not replayed). Before the fix (seen on an H200, torch 2.11):
    `_analyse` captures it regardless, and every step after the first raises a raw
    NotImplementedError from `_stage`'s `record_stream` of the host tensor. (Without
    that call, the pad would run once at capture over an uninitialised static copy and
    the empty graph never replay: stale values.)"""
    cuda = torch.device("cuda", 0)
    inputs = [torch.full((2, 2), i, dtype=torch.int64) for i in range(6)]
    eager = TorchInterpreter(device=cuda, groups={}, rank=0)
    captured = TorchInterpreter(device=cuda, groups={}, rank=0, capture=True, capture_copies=2)
    assert device_run(captured, inputs) == device_run(eager, inputs)


@pytest.mark.gpu
@needs_cuda
def test_gpu_a_captured_unpack_refuses_a_misaligned_wire_as_eager_does() -> None:
    """A captured Unpack of an int32 wire as one int64 [1, 1], padded to two columns:
    aligned for three steps (lowered, captured, replayed), then bound 4 bytes into its
    storage, then aligned again. Correct: the misaligned step raises eager's typed error
    (the guard holds the input's alignment, so no replay stages it) and the next step
    replays again. Before, the guard admitted it: the replay staged the wire into its
    aligned static copy and failed after its graph ran."""
    cuda = torch.device("cuda", 0)
    steps = [False, False, False, True, False]
    view = Section(buffer=VIEW, offset=0, shape=(1, 1), dtype=DType.INT64)

    def on_cuda(interp: TorchInterpreter) -> list[str]:
        seen = []
        for step, odd in enumerate(steps):
            out = BufferRef(f"step{step}.out")
            tag = Tag(step=step, op=Op.RECEIVE)
            unpack = Unpack(**tag, source=IN, sections=(view,), stream=Stream.MAIN)
            interp.bind(IN, int32_wire(step, misaligned=odd, device=cuda))
            try:
                interp.perform((unpack, pad(step, VIEW, out, 2, Stream.MAIN)))
            except PureppError as error:
                seen.append(type(error).__name__)
                continue
            seen.append(str(interp.tensor(out).cpu().tolist()))
            ended = Tag(step=step, op=Op.END_STEP)
            interp.perform((Release(**ended, buffer=VIEW), Release(**ended, buffer=out)))
        return seen

    eager = TorchInterpreter(device=cuda, groups={}, rank=0)
    captured = TorchInterpreter(device=cuda, groups={}, rank=0, capture=True, capture_copies=2)
    want = on_cuda(eager)
    assert want[3] == "InterpreterError"
    assert on_cuda(captured) == want
    assert captured.planner is not None
    assert captured.planner.replayed >= 2
