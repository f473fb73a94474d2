"""Review of da2865b: uses of a graph's static output on other streams it did not see.

- A RecordStream inside another plan's captured segment (between two of its kernels)
  was replayed as a name op that recorded the tensor on its stream but never told the
  planner: a use of a static output on a stream its plan's replays are not ordered
  after went unseen, and that plan went on rewriting the memory under it. Such a
  RecordStream now runs by eager's handler, as an Unpack's views do.
- A use that stopped one plan's replays stopped every plan of its structure (one per
  input layout): the planner's fast path ran the first plan's handlers for all of them
  once it was marked, as if capture had found no graph in the structure.
- Every empty storage is at address 0: an empty static output's entry stood for any
  empty tensor, so a caller's, recorded on another stream, stopped that plan's replays.
- Cost: once any graph existed every RecordStream looked static memory up (a storage
  object per call), though none of the relay's static outputs can be used on a stream
  its replays are not ordered after: the relay's sends made 3 to 5 lookups a step.
  Only a record on a stream some graph's replays are not ordered after looks now.

CPU tests emulate the graph (tests/test_plan_capture.py: `emulated_record`). The `gpu`
test makes the hazard real. Run:
    NCCL_NVLS_ENABLE=0 python -m pytest -q -m gpu -p no:cacheprovider \
        tests/test_capture_static_uses_review.py
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from purepp.effects.plan import Plan, Planner
from purepp.effects.torch_interpreter import TorchInterpreter
from purepp.effects.vocabulary import (
    BufferRef,
    Communicator,
    Effect,
    GatherRows,
    Op,
    RecordStream,
    Release,
    Stream,
    WaitStream,
)
from purepp.relay import Wire
from tests.test_capture_static_uses import (
    INDEX,
    SOURCE,
    bind_inputs,
    expected_rows,
    gathered,
    late_reads_on_main,
    planner_of,
    produce,
)
from tests.test_keyed_effects import keyed_relay_program
from tests.test_plan_capture import capturing
from tests.test_plans_review import Tag

CPU = torch.device("cpu")
MAIN, RELAY = Stream.MAIN, Stream.RELAY
PICK = BufferRef("caller.pick")


def read_twice(step: int, *, record_inside: bool) -> tuple[Effect, ...]:
    """A batch on main that waits for the relay stream, reads step `step`'s gathered rows
    twice and declares that use (RecordStream on main): between its two gathers, inside
    its captured segment, or after them."""
    tag = Tag(step=step, op=Op.CONSUME)
    out = gathered(step)
    wait = WaitStream(**tag, stream=MAIN, waits_for=RELAY)
    first = GatherRows(**tag, source=out, index=PICK, out=BufferRef(f"step{step}.a"), stream=MAIN)
    second = GatherRows(**tag, source=out, index=PICK, out=BufferRef(f"step{step}.b"), stream=MAIN)
    record = RecordStream(**tag, buffer=out, stream=MAIN)
    return (wait, first, record, second) if record_inside else (wait, first, second, record)


def end(step: int) -> tuple[Effect, ...]:
    tag = Tag(step=step, op=Op.END_STEP)
    names = (gathered(step), BufferRef(f"step{step}.a"), BufferRef(f"step{step}.b"))
    return tuple(Release(**tag, buffer=name) for name in names)


def plans(interp: TorchInterpreter) -> list[Plan]:
    return [plan for family in planner_of(interp)._plans.values() for plan in family.plans]


@pytest.mark.parametrize("record_inside", [False, True], ids=["after", "inside"])
def test_a_use_declared_inside_another_graph_stops_the_owners_replays(
    monkeypatch: pytest.MonkeyPatch, record_inside: bool
) -> None:
    # The gather on the relay stream is not ordered after main; the batch on main reads
    # its output (a steady input, baked into the reader's graph) and records it on main.
    captured = capturing(monkeypatch)
    planner = planner_of(captured)
    captured.bind(PICK, torch.tensor([1, 0], dtype=torch.int32))
    how = {"record_inside": record_inside}
    produced = []  # whether each step's gather replayed
    for step in range(6):
        bind_inputs(captured, step)
        before = planner.replayed
        captured.perform(produce(step, ordered=False, record_on=None))
        produced.append(planner.replayed > before)
        captured.perform(read_twice(step, **how))
        want = expected_rows(step)[torch.tensor([1, 0])]
        assert captured.tensor(BufferRef(f"step{step}.b")).tolist() == want.tolist()
        captured.perform(end(step))
    # Step 0 lowered both plans; step 1 replayed the gather and its output was recorded
    # on main: from step 2 on the gather runs eager's handlers (fresh memory).
    assert produced == [False, True, False, False, False, False]
    (reader,) = [plan for plan in plans(captured) if plan.effects[0] == read_twice(0, **how)[0]]
    assert reader.capture is not None
    assert reader.capture.instances  # the reader itself replays


def test_a_use_that_stops_one_plan_leaves_the_others_of_its_structure_replaying(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One structure, two input layouts (sources 2 and 3 columns wide): two plans. Step 4's
    # output (the 2-wide plan's) is recorded on main, which the relay stream never waits
    # for: that plan stops; the 3-wide plan's outputs are never used there.
    captured = capturing(monkeypatch)
    planner = planner_of(captured)
    replayed = []
    for step in range(12):
        width = 2 + step % 2
        captured.bind(SOURCE, torch.arange(4 * width).reshape(4, width) + 100 * step)
        captured.bind(INDEX, torch.tensor([step % 4, 3], dtype=torch.int32))
        before = planner.replayed
        captured.perform(produce(step, ordered=False, record_on=None))
        replayed.append(planner.replayed > before)
        tag = Tag(step=step, op=Op.CONSUME)
        stream = MAIN if step == 4 else RELAY
        captured.perform((RecordStream(**tag, buffer=gathered(step), stream=stream),))
        captured.perform((Release(**tag, buffer=gathered(step)),))
    # Steps 0 and 1 lower the two plans; the 2-wide one replays at steps 2 and 4 only.
    assert replayed == [False, False, True, True, True, True] + [False, True] * 3


def test_an_empty_tensor_used_elsewhere_is_no_graphs_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A gather of no rows makes an empty static output; the caller's empty tensor,
    # recorded on main, shares its address (0) and nothing else.
    captured = capturing(monkeypatch)
    planner = planner_of(captured)
    captured.bind(INDEX, torch.zeros(0, dtype=torch.int32))
    empty = BufferRef("caller.empty")
    replayed = []
    for step in range(6):
        captured.bind(SOURCE, torch.arange(8).reshape(4, 2) + 100 * step)
        before = planner.replayed
        captured.perform(produce(step, ordered=False, record_on=None))
        replayed.append(planner.replayed > before)
        tag = Tag(step=step, op=Op.CONSUME)
        captured.bind(empty, torch.zeros(0, dtype=torch.int64))
        captured.perform((RecordStream(**tag, buffer=empty, stream=MAIN),))
        captured.perform((Release(**tag, buffer=gathered(step)), Release(**tag, buffer=empty)))
    assert replayed == [False, True, True, True, True, True]


@pytest.mark.parametrize("wire", list(Wire), ids=[w.value for w in Wire])
@pytest.mark.parametrize("spec", [0, 2])
def test_the_relays_replayed_steps_look_up_no_static_memory(
    groups: dict[Communicator, dist.ProcessGroup],
    monkeypatch: pytest.MonkeyPatch,
    wire: Wire,
    spec: int,
) -> None:
    """Every relay plan with static outputs begins with WaitStream(relay, main), so its
    replays are ordered after both streams: the sends' records of the caller's tensors
    (3 to 5 a step) need no lookup."""
    captured = capturing(monkeypatch, groups)
    planner = planner_of(captured)
    lookups = []
    real = Planner.recorded

    def counted(self: Planner, tensor: torch.Tensor, stream: Stream) -> None:
        lookups.append(stream)
        real(self, tensor, stream)

    monkeypatch.setattr(Planner, "recorded", counted)
    keyed_relay_program(captured, spec, wire)
    assert planner.replayed > 30
    assert lookups == []


# ---- on a GPU: a use declared inside another graph, read late on main ----------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_a_use_declared_inside_another_graph_keeps_its_step_values() -> None:
    """As tests/test_capture_static_uses.py's gpu test, with the use declared inside the
    reader's own captured segment: main sleeps, then copies step i's gathered rows while
    step i + 1's gather runs on the relay stream, which does not wait for main."""
    device = torch.device("cuda")
    interp = TorchInterpreter(device=device, groups={}, rank=0, capture=True, capture_copies=1)
    interp.bind(PICK, torch.tensor([1, 0], dtype=torch.int32, device=device))
    late_reads_on_main(interp, lambda step: read_twice(step, record_inside=True), end)
