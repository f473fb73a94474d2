"""Which plans can be captured into CUDA graphs, and what a replay copies, bakes and binds.

The analysis needs no GPU: it reads a plan's effects. (The replays themselves are in
tests/test_interpreter_cuda.py, on a GPU.)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from purepp.effects import capture
from purepp.effects.capture import Kernel, Slots, _analyse, _Bind
from purepp.effects.plan import Plan, abstract, layout, roles
from purepp.effects.torch_interpreter import TorchInterpreter
from purepp.effects.vocabulary import (
    Alias,
    Allocate,
    Broadcast,
    BufferRef,
    Communicator,
    DType,
    Effect,
    EventRef,
    GatherRows,
    Op,
    Pack,
    PadColumns,
    RecordEvent,
    Release,
    ScatterRows,
    Section,
    Stream,
    Unpack,
)
from purepp.errors import ConfigError
from purepp.relay import Wire
from tests import _interpreter_programs as programs
from tests.test_keyed_effects import keyed_relay_program

CPU = torch.device("cpu")


def plan_of(interp: TorchInterpreter, effects: tuple[Effect, ...]) -> Plan:
    _, names = abstract(effects)
    positions = roles(effects, names)
    inputs = {
        p: layout(interp.tensor(name))  # type: ignore[arg-type]
        for p, name in enumerate(names)
        if positions[p] == 0
    }
    handlers = [interp.handler(e) for e in effects]
    return Plan(effects, names, positions, inputs, handlers, contiguity=True, device=True)


@pytest.fixture
def interp() -> TorchInterpreter:
    made = TorchInterpreter(device=CPU, groups={}, rank=0)
    made.bind(programs.TABLE, torch.zeros((programs.SLOTS, programs.WIDTH), dtype=torch.int64))
    made.bind(programs.ROWS, torch.zeros(3, dtype=torch.int32))
    made.bind(programs.ref(4, "tokens"), torch.zeros((5, programs.WIDTH), dtype=torch.int64))
    made.bind(programs.ref(4, "counts_seen"), torch.zeros((2, 5), dtype=torch.int32))
    made.bind(programs.ref(4, "wire"), torch.zeros(8, dtype=torch.int64))
    made.bind(programs.ref(4, "kept"), torch.zeros((3, programs.WIDTH), dtype=torch.int64))
    return made


def test_a_consume_is_captured_between_its_wait_and_its_names(interp: TorchInterpreter) -> None:
    batch = programs.consume(5, 5)
    plan = plan_of(interp, batch)
    capturable = _analyse(interp, plan)
    assert capturable is not None
    assert capturable.stream is Stream.MAIN
    # WaitEvent before; CopyHostToDevice, ScatterRows, GatherRows captured; names after.
    assert (capturable.first, capturable.last) == (1, 3)
    at = {name: p for p, name in enumerate(plan.names)}
    table, tokens, rows = at[programs.TABLE], at[programs.ref(4, "tokens")], at[programs.ROWS]
    assert capturable.baked == (table,)  # scattered into in place: the caller's own tensor
    assert set(capturable.copied) == {tokens, rows}  # only read: copied in before a replay
    index, gathered = at[programs.ref(5, "index")], at[programs.ref(5, "gathered")]
    assert [(p, shape) for _, p, shape in capturable.host] == [(index, (5,))]
    assert set(capturable.made) == {index, gathered}
    assert capturable.name_ops[:2] == (_Bind(index, index), _Bind(gathered, gathered))
    assert len(capturable.kernels) == 2  # the scatter and the gather; the copy is outside


def test_host_work_is_kept_out_of_the_graph(interp: TorchInterpreter) -> None:
    agree = plan_of(interp, programs.agree(5))  # a gloo all-reduce and its wait
    assert _analyse(interp, agree) is None
    # Before or after the device work it runs as eager runs it; between, no capture.
    consume = programs.consume(5, 5)
    around = plan_of(interp, (*programs.agree(5), *consume))
    capturable = _analyse(interp, around)
    assert capturable is not None
    assert (capturable.first, capturable.last) == (3, 5)
    inside = (*consume[:3], *programs.agree(5), *consume[3:])
    assert _analyse(interp, plan_of(interp, inside)) is None
    releases = plan_of(interp, programs.consume(5, 5)[-4:])  # no device work at all
    assert _analyse(interp, releases) is None


def test_an_event_between_device_effects_stops_capture(interp: TorchInterpreter) -> None:
    tag = programs.Tag(step=5, op=Op.RECEIVE)
    a, b = BufferRef("a"), BufferRef("b")
    batch = (
        Allocate(**tag, buffer=a, shape=(2,), dtype=DType.INT64, stream=Stream.RELAY),
        RecordEvent(**tag, stream=Stream.RELAY, event=EventRef("e")),
        Allocate(**tag, buffer=b, shape=(2,), dtype=DType.INT64, stream=Stream.RELAY),
    )
    assert _analyse(interp, plan_of(interp, batch)) is None
    two_streams = (
        batch[0],
        Allocate(**tag, buffer=b, shape=(2,), dtype=DType.INT64, stream=Stream.MAIN),
    )
    assert _analyse(interp, plan_of(interp, two_streams)) is None


def test_an_unpack_is_views_not_device_work(interp: TorchInterpreter) -> None:
    tag = programs.Tag(step=5, op=Op.RECEIVE)
    wire, view = BufferRef("wire"), BufferRef("view")
    batch = (
        Allocate(**tag, buffer=wire, shape=(2,), dtype=DType.INT64, stream=Stream.RELAY),
        RecordEvent(**tag, stream=Stream.RELAY, event=EventRef("e")),
        Unpack(
            **tag,
            source=wire,
            sections=(Section(buffer=view, offset=0, shape=(4,), dtype=DType.INT32),),
            stream=Stream.MAIN,
        ),
    )
    capturable = _analyse(interp, plan_of(interp, batch))
    assert capturable is not None
    assert (capturable.first, capturable.last) == (0, 0)  # the event and the views follow


def test_a_name_made_twice_in_one_segment_is_not_captured(interp: TorchInterpreter) -> None:
    # One static slot per name: a graph cannot hold both buffers the name stood for.
    tag = programs.Tag(step=5, op=Op.RECEIVE)
    a = BufferRef("a")
    made = Allocate(**tag, buffer=a, shape=(2,), dtype=DType.INT64, stream=Stream.RELAY)
    assert _analyse(interp, plan_of(interp, (made,))) is not None
    twice = (made, Release(step=5, op=Op.RECEIVE, buffer=a), made)
    assert _analyse(interp, plan_of(interp, twice)) is None


def test_capture_needs_cuda() -> None:
    with pytest.raises(ConfigError, match="capture on a cuda device"):
        TorchInterpreter(device=CPU, groups={}, rank=0, capture=True)


# ---- replays on CPU: the graph emulated, everything around it real ------------------------


def emulated_record(kernels: list[Kernel], slots: Slots) -> Callable[[], None]:
    """What a CUDA graph does, on CPU: capturing makes the static outputs without
    touching the inputs (over zeroed stand-ins), and a replay reruns the kernels over
    the inputs and writes into those outputs. Like a graph, it holds no reference to
    its inputs (their memory stays alive through whoever owns them)."""
    inputs = {position: weakref.ref(tensor) for position, tensor in slots.items()}
    scratch = {position: torch.zeros_like(tensor) for position, tensor in slots.items()}
    for kernel in kernels:
        kernel(scratch)
    outputs = {p: tensor for p, tensor in scratch.items() if p not in inputs}
    slots.update(outputs)

    def launch() -> None:
        scratch: Slots = {}
        for position, ref in inputs.items():
            tensor = ref()
            assert tensor is not None, "a replay read an input whose tensor is gone"
            scratch[position] = tensor
        for kernel in kernels:
            kernel(scratch)
        for position, tensor in outputs.items():
            tensor.copy_(scratch[position])

    return launch


def test_only_nccl_broadcasts_are_captured(
    groups: dict[Communicator, dist.ProcessGroup], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A CUDA graph cannot hold a gloo collective: such a plan runs as a plan, uncaptured.
    interp = TorchInterpreter(device=CPU, groups=groups, rank=0)
    tag = programs.Tag(step=5, op=Op.RECEIVE)
    wire = BufferRef("wire")
    batch = (
        Allocate(**tag, buffer=wire, shape=(2,), dtype=DType.INT64, stream=Stream.RELAY),
        Broadcast(
            **tag,
            buffer=wire,
            shape=(2,),
            dtype=DType.INT64,
            src=0,
            comm=Communicator.PP_RELAY,
            stream=Stream.RELAY,
        ),
    )
    assert _analyse(interp, plan_of(interp, batch)) is None
    monkeypatch.setattr(dist, "get_backend", lambda group: "nccl")
    assert _analyse(interp, plan_of(interp, batch)) is not None


@pytest.mark.parametrize("copies", [2, 3])
@pytest.mark.parametrize("wire", list(Wire), ids=[w.value for w in Wire])
@pytest.mark.parametrize("spec", [0, 2])
def test_replays_match_eager_and_never_overwrite_a_held_receive(
    groups: dict[Communicator, dist.ProcessGroup],
    monkeypatch: pytest.MonkeyPatch,
    wire: Wire,
    spec: int,
    copies: int,
) -> None:
    """Receives are held for the ring's depth (2) and a step more: with 3 instances every
    steady batch replays; with 2, a receive whose instances are both held runs as its
    plan instead (fresh memory), never into a held instance."""
    monkeypatch.setattr(capture, "_record", emulated_record)
    monkeypatch.setattr(dist, "get_backend", lambda group: "nccl")  # gloo stands in
    eager = TorchInterpreter(device=CPU, groups=groups, rank=0)
    captured = TorchInterpreter(device=CPU, groups=groups, rank=0, plans=True)
    planner = captured.planner
    assert planner is not None
    # What capture=True sets up, which the constructor allows on CUDA only.
    planner._capture, planner._guarded, planner._copies = True, True, copies

    def distinct_receives(interp: TorchInterpreter) -> None:
        # Outputs of different steps' receives never share memory: a replay into an
        # instance whose outputs a ring entry still holds would make them share it.
        owners: dict[int, str] = {}
        for ref in interp.bound_refs():
            if isinstance(ref, BufferRef) and ref.name.startswith("rx.step"):
                step = ref.name.split(".")[1]
                storage: Any = interp.tensor(ref).untyped_storage()  # the stubs lack data_ptr
                pointer = storage.data_ptr()
                assert owners.setdefault(pointer, step) == step, ref.name

    def rows(step: int) -> int:
        return 2 if step < 20 else 1 + step % 3  # one structure, then three in turn

    want = keyed_relay_program(eager, spec, wire, rows=rows)
    got = keyed_relay_program(captured, spec, wire, after=distinct_receives, rows=rows)
    assert got == want
    if copies == 3:
        # Steady receives and sends replay (consumes too, when they scatter drafts).
        assert planner.replayed >= 2 * 30 - 12, (planner.replayed, planner.planned)
    # Never more graph instances of a plan than the copies allowed.
    plans = [plan for family in planner._keyed.values() for plan in family.plans]
    instances = [len(plan.capture.instances) for plan in plans if plan.capture is not None]
    assert instances
    assert max(instances) <= copies


def test_a_replayed_program_leaves_every_buffer_as_eager_does(
    groups: dict[Communicator, dist.ProcessGroup], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After every batch, replays and eager have bound the same names to the same values:
    with a host array staged into a graph (the consume's index, copied in before each
    replay) and inputs of one dtype copied in together (the send's two int32 counts)."""
    monkeypatch.setattr(capture, "_record", emulated_record)
    monkeypatch.setattr(dist, "get_backend", lambda group: "nccl")  # gloo stands in

    def run(interp: TorchInterpreter) -> list[dict[str, object]]:
        def bind(ref: BufferRef, values: Any) -> None:
            interp.bind(ref, torch.from_numpy(values.copy()))

        seen = []
        for batch in programs.program(30, bind):
            interp.perform(batch)
            pending = interp.env.pending_results  # an all-reduce's table: not yet readable
            seen.append(
                {
                    ref.name: interp.tensor(ref).tolist()
                    for ref in interp.bound_refs()
                    if isinstance(ref, BufferRef) and ref not in pending
                }
            )
        return seen

    captured = TorchInterpreter(device=CPU, groups=groups, rank=0, plans=True)
    planner = captured.planner
    assert planner is not None
    planner._capture, planner._guarded, planner._copies = True, True, 3
    assert run(captured) == run(TorchInterpreter(device=CPU, groups=groups, rank=0))
    analysed = [
        plan.capture
        for family in planner._plans.values()
        for plan in family.plans
        if plan.capture is not None
    ]
    assert planner.replayed > 30
    assert any(capturable.host for capturable in analysed)
    copy_groups = [g for capturable in analysed for g in capturable.copy_groups or ()]
    assert any(len(group) > 1 for group in copy_groups)


def capturing(
    monkeypatch: pytest.MonkeyPatch, groups: dict[Communicator, dist.ProcessGroup] | None = None
) -> TorchInterpreter:
    """A CPU interpreter whose plans capture, with the graph emulated, in 3 instances;
    with `groups` (gloo), its broadcasts are captured as NCCL ones would be."""
    monkeypatch.setattr(capture, "_record", emulated_record)
    if groups is not None:
        monkeypatch.setattr(dist, "get_backend", lambda group: "nccl")  # gloo stands in
    made = TorchInterpreter(device=CPU, groups=groups or {}, rank=0, plans=True)
    planner = made.planner
    assert planner is not None
    planner._capture, planner._guarded, planner._copies = True, True, 3
    return made


def bound_values(interp: TorchInterpreter) -> dict[str, object]:
    return {
        ref.name: interp.tensor(ref).tolist()
        for ref in interp.bound_refs()
        if isinstance(ref, BufferRef)
    }


def capturables(interp: TorchInterpreter) -> list[Any]:
    planner = interp.planner
    assert planner is not None
    plans = [plan for family in planner._plans.values() for plan in family.plans]
    return [plan.capture for plan in plans if plan.capture is not None]


SOURCE, INDEX = BufferRef("caller.source"), BufferRef("caller.index")


def test_a_replay_makes_the_names_changes_inside_its_graph_as_eager_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Between the first and the last kernel: an alias of an input, views of a wire the
    # graph packs, and a release. The graph makes the buffers; the names are bound and
    # dropped after each replay, as eager binds and drops them.
    def receive(interp: TorchInterpreter, step: int) -> tuple[Effect, ...]:
        tag = programs.Tag(step=step, op=Op.RECEIVE)
        main = Stream.MAIN
        gathered, kept, wire = (programs.ref(step, w) for w in ("gathered", "kept", "wire"))
        view, padded = programs.ref(step, "view"), programs.ref(step, "padded")
        source = torch.arange(6, dtype=torch.int64).reshape(3, 2) + 10 * step
        interp.bind(SOURCE, source)
        interp.bind(INDEX, torch.tensor([step % 3, 2], dtype=torch.int32))
        return (
            GatherRows(**tag, source=SOURCE, index=INDEX, out=gathered, stream=main),
            Alias(**tag, source=SOURCE, out=kept),
            Pack(
                **tag,
                sections=(Section(buffer=gathered, offset=0, shape=(2, 2), dtype=DType.INT64),),
                out=wire,
                nbytes=32,
                stream=main,
            ),
            Unpack(
                **tag,
                source=wire,
                sections=(Section(buffer=view, offset=0, shape=(2, 2), dtype=DType.INT64),),
                stream=main,
            ),
            Release(**tag, buffer=gathered),
            PadColumns(**tag, source=view, out=padded, width=3, fill=-1, stream=main),
        )

    def end(step: int) -> tuple[Effect, ...]:
        tag = programs.Tag(step=step, op=Op.END_STEP)
        names = ("kept", "wire", "view", "padded")
        return tuple(Release(**tag, buffer=programs.ref(step, w)) for w in names)

    def run(interp: TorchInterpreter) -> list[dict[str, object]]:
        seen = []
        for i in range(6):
            interp.perform(receive(interp, i))
            seen.append(bound_values(interp))
            interp.perform(end(i))
        return seen

    captured = capturing(monkeypatch)
    assert run(captured) == run(TorchInterpreter(device=CPU, groups={}, rank=0))
    assert captured.planner is not None
    assert captured.planner.replayed == 5  # every batch after the first meeting
    (analysed,) = capturables(captured)
    assert (analysed.first, analysed.last) == (0, 5)


def scatter(step: int) -> tuple[Effect, ...]:
    tag = programs.Tag(step=step, op=Op.CONSUME)
    return (
        ScatterRows(**tag, source=SOURCE, index=INDEX, target=programs.TABLE, stream=Stream.MAIN),
    )


def test_a_new_target_tensor_gets_an_instance_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    # A scatter's target is baked into the graph: a run with another tensor there never
    # replays an instance captured over the first (it would write the wrong table).
    def run(interp: TorchInterpreter) -> list[list[list[int]]]:
        tables = [torch.zeros((4, 2), dtype=torch.int64) for _ in range(2)]
        for i in range(6):
            interp.bind(programs.TABLE, tables[i // 3])  # the first table, then the second
            interp.bind(SOURCE, torch.full((1, 2), i + 1, dtype=torch.int64))
            interp.bind(INDEX, torch.tensor([i % 4], dtype=torch.int32))
            interp.perform(scatter(i))
        return [table.tolist() for table in tables]

    captured = capturing(monkeypatch)
    assert run(captured) == run(TorchInterpreter(device=CPU, groups={}, rank=0))
    assert captured.planner is not None
    assert captured.planner.replayed == 5
    (analysed,) = capturables(captured)
    assert len(analysed.instances) == 2  # one per table


def test_an_input_read_from_a_passing_tensor_is_never_baked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The table the plan was lowered with is baked (it stays); a run that reads another
    # tensor there runs as the plan rather than take one of the few instances over it.
    def run(interp: TorchInterpreter) -> list[dict[str, object]]:
        table = torch.arange(8, dtype=torch.int64).reshape(4, 2)
        seen = []
        for i in range(6):
            passing = i == 3
            interp.bind(programs.TABLE, table + 100 if passing else table)
            interp.bind(INDEX, torch.tensor([i % 4, 0], dtype=torch.int32))
            tag = programs.Tag(step=i, op=Op.CONSUME)
            gathered = programs.ref(i, "gathered")
            main = Stream.MAIN
            interp.perform(
                (GatherRows(**tag, source=programs.TABLE, index=INDEX, out=gathered, stream=main),)
            )
            seen.append(bound_values(interp))
            interp.perform((Release(**tag, buffer=gathered),))
        return seen

    captured = capturing(monkeypatch)
    assert run(captured) == run(TorchInterpreter(device=CPU, groups={}, rank=0))
    planner = captured.planner
    assert planner is not None
    assert planner.replayed == 4  # all but the first meeting and the passing table
    gather = next(c for c in capturables(captured) if c.steady)
    assert len(gather.instances) == 1  # captured over the table that stays, only
