"""A graph's static output used on another stream is never rewritten under that use.

A captured plan's outputs are static memory: the next replay of the same instance
rewrites it on the graph's stream S once no name holds it. Eager frees a buffer recorded
on another stream (RecordStream) only once that stream is past its uses, so a replay
keeps eager's semantics only if S is ordered after that stream. Capture therefore takes
a plan only when every stream its static memory is recorded on in the batch is S or one
the batch's prefix makes S wait for (WaitStream), as the relay's batches do; and a later
batch's RecordStream of static memory on another stream stops that plan's replays (it
runs eager's handlers, fresh memory, from then on).

The CPU tests emulate the graph (tests/test_plan_capture.py: `emulated_record`). The
`gpu` test makes the hazard real: main reads a static output behind a long sleep while
the next step's replay runs on the relay stream. Run:
    NCCL_NVLS_ENABLE=0 python -m pytest -q -m gpu -p no:cacheprovider \
        tests/test_capture_static_uses.py
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from purepp.effects.plan import Planner
from purepp.effects.torch_interpreter import TorchInterpreter
from purepp.effects.vocabulary import (
    BufferRef,
    DType,
    Effect,
    GatherRows,
    Op,
    RecordStream,
    Release,
    Section,
    Stream,
    Unpack,
    WaitStream,
)
from tests.test_plan_capture import capturing
from tests.test_plans_review import Tag

CPU = torch.device("cpu")
SOURCE, INDEX = BufferRef("caller.source"), BufferRef("caller.index")
MAIN, RELAY = Stream.MAIN, Stream.RELAY


def gathered(step: int) -> BufferRef:
    return BufferRef(f"step{step}.gathered")


def produce(step: int, *, ordered: bool, record_on: Stream | None) -> tuple[Effect, ...]:
    """A gather on the relay stream, captured as a graph; `ordered` puts the relay's
    WaitStream(relay, main) first; `record_on` declares a use of the output there."""
    tag = Tag(step=step, op=Op.RECEIVE)
    effects: list[Effect] = []
    if ordered:
        effects.append(WaitStream(**tag, stream=RELAY, waits_for=MAIN))
    effects.append(GatherRows(**tag, source=SOURCE, index=INDEX, out=gathered(step), stream=RELAY))
    if record_on is not None:
        effects.append(RecordStream(**tag, buffer=gathered(step), stream=record_on))
    return tuple(effects)


def use(step: int, stream: Stream, *, through_view: bool) -> tuple[Effect, ...]:
    """A later batch: the output (or a view of it) recorded on `stream`, then released."""
    tag = Tag(step=step, op=Op.CONSUME)
    out = gathered(step)
    if not through_view:
        return (RecordStream(**tag, buffer=out, stream=stream), Release(**tag, buffer=out))
    view = BufferRef(f"step{step}.row")
    section = Section(buffer=view, offset=8, shape=(2,), dtype=DType.INT64)
    return (
        Unpack(**tag, source=out, sections=(section,), stream=stream),
        RecordStream(**tag, buffer=view, stream=stream),
        Release(**tag, buffer=view),
        Release(**tag, buffer=out),
    )


def bind_inputs(interp: TorchInterpreter, step: int) -> None:
    interp.bind(SOURCE, torch.arange(8).reshape(4, 2) + 100 * step)
    interp.bind(INDEX, torch.tensor([step % 4, 3], dtype=torch.int32))


def expected_rows(step: int) -> torch.Tensor:
    """What step `step`'s gather makes: rows step % 4 and 3 of its source."""
    return (torch.arange(8).reshape(4, 2) + 100 * step)[torch.tensor([step % 4, 3])]


def planner_of(interp: TorchInterpreter) -> Planner:
    planner = interp.planner
    assert planner is not None
    return planner


@pytest.mark.parametrize(
    ("ordered", "record_on", "replays"),
    [
        (False, MAIN, 0),  # used on main, S not ordered after it: never captured
        (True, MAIN, 5),  # the relay's way: the prefix orders S after main
        (False, RELAY, 5),  # used on S itself
        (False, None, 5),  # no other stream uses it
    ],
    ids=["unordered-main", "ordered-main", "on-its-own-stream", "no-use"],
)
def test_a_batch_recording_its_static_output_is_captured_only_when_ordered(
    monkeypatch: pytest.MonkeyPatch, ordered: bool, record_on: Stream | None, replays: int
) -> None:
    captured = capturing(monkeypatch)
    eager = TorchInterpreter(device=CPU, groups={}, rank=0)
    for step in range(6):
        for interp in (captured, eager):
            bind_inputs(interp, step)
            interp.perform(produce(step, ordered=ordered, record_on=record_on))
        assert captured.tensor(gathered(step)).tolist() == eager.tensor(gathered(step)).tolist()
        for interp in (captured, eager):
            interp.perform((Release(**Tag(step=step, op=Op.END_STEP), buffer=gathered(step)),))
    assert planner_of(captured).replayed == replays


@pytest.mark.parametrize("through_view", [False, True], ids=["the-output", "a-view-of-it"])
def test_a_later_use_on_an_unordered_stream_stops_the_plans_replays(
    monkeypatch: pytest.MonkeyPatch, through_view: bool
) -> None:
    captured = capturing(monkeypatch)
    planner = planner_of(captured)
    replays = []
    for step in range(6):
        bind_inputs(captured, step)
        captured.perform(produce(step, ordered=False, record_on=None))
        expected = expected_rows(step)
        assert captured.tensor(gathered(step)).tolist() == expected.tolist()
        replays.append(planner.replayed)
        # Step 2's output is read on main, which the relay stream never waits for.
        stream = MAIN if step == 2 else RELAY
        captured.perform(use(step, stream, through_view=through_view))
    # Steps 1 and 2 replayed (step 0 lowered the plan); from step 3 on it runs the plan.
    assert replays == [0, 1, 2, 2, 2, 2]


def test_a_use_on_a_stream_the_prefix_orders_keeps_the_replays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    captured = capturing(monkeypatch)
    for step in range(6):
        bind_inputs(captured, step)
        captured.perform(produce(step, ordered=True, record_on=None))
        captured.perform(use(step, MAIN, through_view=True))
    assert planner_of(captured).replayed == 5


# ---- on a GPU: main reads a static output late, while the next replay runs -----------------


def late_reads_on_main(
    interp: TorchInterpreter,
    use: Callable[[int], tuple[Effect, ...]],
    release: Callable[[int], tuple[Effect, ...]],
) -> None:
    """Eight steps of the relay-stream gather: after each, `use` declares a use of its
    output on main, main sleeps and then copies the output, and `release` lets it go.
    Meanwhile the next step runs on the relay stream, which does not wait for main. A
    replay into that step's instance (one copy) would rewrite the output before main
    reads it; eager's fresh memory would not. Every copy must hold its own step's rows."""
    device = interp.device
    main = torch.cuda.current_stream()
    # Every step's inputs made up front: the relay stream reads them without waiting
    # for main, which is about to sleep.
    sources = [torch.arange(8, device=device).reshape(4, 2) + 100 * step for step in range(8)]
    indexes = [torch.tensor([step % 4, 3], dtype=torch.int32, device=device) for step in range(8)]
    torch.cuda.synchronize()
    results: list[torch.Tensor] = []
    for step in range(8):
        interp.bind(SOURCE, sources[step])
        interp.bind(INDEX, indexes[step])
        interp.perform(produce(step, ordered=False, record_on=None))
        out = interp.tensor(gathered(step))
        interp.perform(use(step))
        cuda: Any = torch.cuda  # the narrow stubs in typings/ leave out _sleep
        cuda._sleep(50_000_000)  # on main: its read below runs late
        with torch.cuda.stream(main):
            results.append(out.clone())
        del out
        interp.perform(release(step))
    torch.cuda.synchronize()
    for step, got in enumerate(results):
        assert got.tolist() == expected_rows(step).tolist(), step


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_a_static_output_read_late_on_main_keeps_its_step_values() -> None:
    """The use is declared by a batch of its own (RecordStream on main)."""
    device = torch.device("cuda")
    interp = TorchInterpreter(device=device, groups={}, rank=0, capture=True, capture_copies=1)

    def record(step: int) -> tuple[Effect, ...]:
        tag = Tag(step=step, op=Op.CONSUME)
        return (RecordStream(**tag, buffer=gathered(step), stream=MAIN),)

    def release(step: int) -> tuple[Effect, ...]:
        return (Release(**Tag(step=step, op=Op.CONSUME), buffer=gathered(step)),)

    late_reads_on_main(interp, record, release)
