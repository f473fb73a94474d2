"""Review of plans and (emulated) capture: recurring structures under changing bindings.

Random programs recur round after round while the caller rebinds the inputs between
rounds (fresh tensors, the same tensor under two names, another dtype or layout,
non-contiguous views, releases); eager, plans and emulated capture must end every batch
with the same names, values and errors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypedDict

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from purepp.effects import capture
from purepp.effects.torch_interpreter import TorchInterpreter
from purepp.effects.vocabulary import (
    Alias,
    AllReduce,
    BufferRef,
    CheckHeader,
    Communicator,
    CopyHostToDevice,
    DType,
    Effect,
    EventRef,
    ForgetEvent,
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
    WaitEvent,
    WaitStream,
    WaitWork,
    WorkRef,
)
from purepp.errors import PureppError
from purepp.relay import Wire
from tests.test_keyed_effects import keyed_relay_program
from tests.test_plan_capture import emulated_record

CPU = torch.device("cpu")


class Tag(TypedDict):
    step: int
    op: Op


@contextlib.contextmanager
def zeroed_allocations() -> Iterator[None]:
    """Allocations are zeroed (eager's and the emulated graph's), so contents compare."""
    real_strided, real_empty = torch.empty_strided, torch.empty

    def empty_strided(*args: Any, **kwargs: Any) -> torch.Tensor:
        return real_strided(*args, **kwargs).zero_()

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        return real_empty(*args, **kwargs).zero_()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "empty_strided", empty_strided)
        patch.setattr(torch, "empty", empty)
        yield


def make(mode: str, groups: dict[Communicator, dist.ProcessGroup]) -> TorchInterpreter:
    """eager, checked, plans, checked-plans, or capture (emulated on CPU, 3 instances)."""
    interp = TorchInterpreter(
        device=CPU,
        groups=groups,
        rank=0,
        checked="checked" in mode,
        plans=mode not in {"eager", "checked"},
    )
    if mode == "capture":
        planner = interp.planner
        assert planner is not None
        planner._capture, planner._guarded, planner._copies = True, True, 3
    return interp


def env_of(interp: TorchInterpreter) -> dict[str, object]:
    """Every bound name with its layout and values (a table in flight: 'in flight')."""
    seen: dict[str, object] = {}
    for ref in interp.bound_refs():
        if not isinstance(ref, BufferRef):
            seen[f"{type(ref).__name__}:{ref.name}"] = "bound"
            continue
        if ref in interp.env.pending_results:
            seen[ref.name] = "in flight"
            continue
        tensor = interp.tensor(ref)
        seen[ref.name] = (tuple(tensor.shape), str(tensor.dtype), tensor.tolist())
    return seen


def outcome(interp: TorchInterpreter, batch: tuple[Effect, ...]) -> str:
    try:
        interp.perform(batch)
    except PureppError as error:
        return f"{type(error).__name__} at {error.call.split('.perform')[-1]}"
    except Exception as error:
        return f"raw {type(error).__name__}: {error}"
    return "performed"


# ---- random recurring programs ----------------------------------------------------------
#
# A program is a few batch templates over the caller's inputs (A and B: [3, 2] int64 tables,
# C: [2, 2] int64, INDEX: a [2] int32 index of distinct rows), each made name renamed every
# round; a template's ops only use what exists at their point, so most batches perform.
# Some made names are kept to the next round (released there: an alias outliving its
# batch). Between rounds the caller rebinds inputs: a fresh tensor of the layout, the
# same tensor, the other table's tensor, a non-contiguous or offset view, another dtype.

A, B, C, INDEX = (BufferRef(f"caller.{n}") for n in "ABCI")
Shape2 = tuple[int, int]
# An op: (kind, operands: ("in", ref) or ("made", slot), its made slot, extra, a shape).
Operand = tuple[str, Any]
Template = list[tuple[str, tuple[Operand, ...], int, int, Shape2]]


@st.composite
def templates(draw: st.DrawFn) -> list[Template]:
    batches: list[Template] = []
    for _ in range(draw(st.integers(1, 3))):
        pool: dict[Operand, Shape2] = {("in", A): (3, 2), ("in", B): (3, 2), ("in", C): (2, 2)}
        indices: list[Operand] = [("in", INDEX)]
        ops: Template = []
        made = 0
        for _ in range(draw(st.integers(1, 6))):
            kind = draw(st.sampled_from(["pad", "gather", "scatter", "alias", "wire", "host"]))
            names = sorted(pool, key=repr)
            tall = [n for n in names if pool[n][0] == 3]
            if kind == "scatter":
                target = draw(st.sampled_from(tall))
                sources = [n for n in names if pool[n] == (2, pool[target][1])]
                if sources:
                    source, index = draw(st.sampled_from(sources)), draw(st.sampled_from(indices))
                    ops.append((kind, (source, index, target), -1, 0, pool[target]))
                continue
            if kind == "host":  # a host index of two distinct rows
                ops.append((kind, (), made, draw(st.integers(0, 5)), (2, 0)))
                indices.append(("made", made))
                made += 1
                continue
            source = draw(st.sampled_from(tall if kind == "gather" else names))
            shape, extra = pool[source], draw(st.integers(0, 1))
            operands: tuple[Operand, ...] = (source,)
            if kind == "gather":
                operands += (draw(st.sampled_from(indices)),)
            ops.append((kind, operands, made, extra, shape))
            made += kind == "wire"  # the wire, then its view
            pool[("made", made)] = {
                "pad": (shape[0], shape[1] + extra),
                "gather": (2, shape[1]),
            }.get(kind, shape)
            made += 1
        keep = draw(st.sets(st.integers(0, max(made - 1, 0)), max_size=2))
        ops.append(("end", (), made, sum(1 << k for k in keep), (0, 0)))
        batches.append(ops)
    return batches


ROWS = ((0, 1), (1, 2), (2, 0), (0, 2), (1, 0), (2, 1))


def materialize(template: Template, b: int, r: int) -> tuple[Effect, ...]:
    """Batch `b` of round `r`: the template with its made names renamed for the round."""
    tag = Tag(step=r, op=Op.CONSUME)
    main = Stream.MAIN

    def name(operand: Operand, round_: int = r) -> BufferRef:
        kind, what = operand
        if kind == "in":
            ref: BufferRef = what
            return ref
        return BufferRef(f"r{round_}.b{b}.m{what}")

    # b + 1 stream waits first: batches of one round never share a structure (two that
    # did would share plans, and a kept output would meet the bug of
    # test_a_replay_never_overwrites_an_output_a_name_still_holds).
    batch: list[Effect] = [
        WaitStream(**tag, stream=Stream.MAIN, waits_for=Stream.RELAY) for _ in range(b + 1)
    ]
    *_, (_, _, count, keep, _) = template
    if r:  # what the last round kept
        kept = [k for k in range(count) if keep >> k & 1]
        batch += [Release(**tag, buffer=name(("made", k), r - 1)) for k in kept]
    for kind, operands, k, extra, (rows, cols) in template:
        ins, made = [name(o) for o in operands], name(("made", k))
        if kind == "pad":
            batch.append(
                PadColumns(**tag, source=ins[0], out=made, width=cols + extra, fill=-1, stream=main)
            )
        elif kind == "gather":
            batch.append(GatherRows(**tag, source=ins[0], index=ins[1], out=made, stream=main))
        elif kind == "scatter":
            batch.append(
                ScatterRows(**tag, source=ins[0], index=ins[1], target=ins[2], stream=main)
            )
        elif kind == "alias":
            batch.append(Alias(**tag, source=ins[0], out=made))
        elif kind == "wire":
            nbytes = -(-rows * cols * 8 // 16) * 16
            section = Section(buffer=ins[0], offset=0, shape=(rows, cols), dtype=DType.INT64)
            view = Section(
                buffer=name(("made", k + 1)), offset=0, shape=(rows, cols), dtype=DType.INT64
            )
            batch.append(Pack(**tag, sections=(section,), out=made, nbytes=nbytes, stream=main))
            batch.append(Unpack(**tag, source=made, sections=(view,), stream=main))
        elif kind == "host":
            host = np.array(ROWS[(extra + r) % len(ROWS)], dtype=np.int32)
            batch.append(CopyHostToDevice(**tag, source=host, buffer=made, stream=main))
        else:  # the end: release what is not kept
            batch += [
                Release(**tag, buffer=name(("made", j))) for j in range(k) if not extra >> j & 1
            ]
    return tuple(batch)


# A rebinding of an input between rounds: (input, how, values seed).
Rebind = tuple[int, str, int]
rebinds = st.lists(
    st.tuples(
        st.integers(0, 3),
        st.sampled_from(["fresh", "fresh", "same", "other", "strided", "offset", "int32"]),
        st.integers(0, 5),
    ),
    max_size=3,
)
INPUTS: tuple[tuple[BufferRef, tuple[int, ...]], ...] = (
    (A, (3, 2)),
    (B, (3, 2)),
    (C, (2, 2)),
    (INDEX, (2,)),
)


def input_tensor(which: int, how: str, seed: int) -> torch.Tensor:
    ref, shape = INPUTS[which]
    if ref == INDEX:
        values = torch.tensor(ROWS[seed % len(ROWS)], dtype=torch.int32)
    else:
        count = int(np.prod(shape))
        values = (torch.arange(count, dtype=torch.int64) * (seed + 1)).reshape(*shape)
    if how == "strided":  # the same values, not contiguous
        wide = torch.zeros(2 * values.numel(), dtype=values.dtype)
        wide[::2] = values.reshape(-1)
        strides = (2,) if values.dim() == 1 else (2 * values.shape[1], 2)
        return wide.as_strided(tuple(values.shape), strides, 0)
    if how == "offset":  # a contiguous view one element into its storage
        flat = values.reshape(-1)
        return torch.cat((flat[:1], flat))[1:].view(*values.shape)
    if how == "int32" and ref != INDEX:
        return values.to(torch.int32)
    return values


def run_program(
    interp: TorchInterpreter, program: list[Template], rounds: list[list[Rebind]]
) -> list[object]:
    for which in range(len(INPUTS)):
        interp.bind(INPUTS[which][0], input_tensor(which, "fresh", which))
    seen: list[object] = []
    for r, changes in enumerate(rounds):
        for which, how, seed in changes:
            ref = INPUTS[which][0]
            if how == "other" and ref in (A, B):
                interp.bind(ref, interp.tensor(B if ref == A else A))
            elif how != "same":
                interp.bind(ref, input_tensor(which, how, seed))
        seen.append(("rebound", env_of(interp)))
        for b, template in enumerate(program):
            seen.append((outcome(interp, materialize(template, b, r)), env_of(interp)))
    return seen


@settings(
    max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(program=templates(), rounds=st.lists(rebinds, min_size=3, max_size=6))
def test_recurring_programs_under_rebinding_match_eager_in_every_mode(
    program: list[Template], rounds: list[list[Rebind]]
) -> None:
    """Random programs whose batches recur round after round with renamed outputs, some
    kept a round, while the caller rebinds the inputs: plans, checked plans and emulated
    capture end every batch with eager's names, values and errors."""
    captured_like_eager(lambda interp: run_program(interp, program, rounds))


# ---- targeted sequences ------------------------------------------------------------------

IN, OUT, SRC, IDX, TABLE, VIEW = (
    BufferRef(n) for n in ("caller.in", "out", "caller.src", "caller.idx", "caller.table", "view")
)
SPARE, FIRST = BufferRef("caller.spare"), BufferRef("first")


def pad(step: int, source: BufferRef, out: BufferRef, width: int) -> PadColumns:
    return PadColumns(
        step=step, op=Op.CONSUME, source=source, out=out, width=width, fill=-1, stream=Stream.MAIN
    )


def out(step: int) -> BufferRef:
    return BufferRef(f"step{step}.out")


def captured_like_eager(
    run: Callable[[TorchInterpreter], list[object]],
    groups: dict[Communicator, dist.ProcessGroup] | None = None,
    modes: tuple[str, ...] = ("plans", "capture", "checked-plans"),
) -> dict[str, TorchInterpreter]:
    """Run `run` in eager (fast and checked) and in `modes`; each mode gives its eager's."""
    made: dict[str, TorchInterpreter] = {}
    with zeroed_allocations(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(capture, "_record", emulated_record)
        patch.setattr(dist, "get_backend", lambda group: "nccl")
        want = {kind: run(make(kind, groups or {})) for kind in ("eager", "checked")}
        for mode in modes:
            made[mode] = make(mode, groups or {})
            got = run(made[mode])
            assert got == want["checked" if "checked" in mode else "eager"], mode
    return made


def test_a_replay_never_overwrites_an_output_a_name_still_holds() -> None:
    # One output per batch, every output kept: each instance is held once used, so after
    # the 3 instances every batch must run as the plan, into fresh memory.
    def run(interp: TorchInterpreter) -> list[object]:
        seen: list[object] = []
        for i in range(6):
            interp.bind(IN, torch.full((2, 2), i, dtype=torch.int64))
            interp.perform((pad(i, IN, out(i), 3),))
            seen.append(env_of(interp))
        return seen

    captured_like_eager(run, modes=("capture",))


def test_a_replay_over_a_non_contiguous_input_fails_where_eager_does() -> None:
    def run(interp: TorchInterpreter) -> list[object]:
        interp.bind(SPARE, torch.zeros((1, 1), dtype=torch.int64))
        interp.bind(TABLE, torch.zeros((3, 2), dtype=torch.int64))
        seen: list[object] = []
        for i in range(4):
            tag = Tag(step=i, op=Op.CONSUME)
            wire = torch.arange(8, dtype=torch.int64)
            interp.bind(IN, wire[::2] if i == 3 else wire[:4])  # strided at the last step
            interp.bind(SRC, torch.full((1, 2), i + 1, dtype=torch.int64))
            interp.bind(IDX, torch.tensor([i % 3], dtype=torch.int32))
            view = Section(buffer=VIEW, offset=0, shape=(2,), dtype=DType.INT32)
            batch = (
                pad(i, SPARE, FIRST, 1),
                Unpack(**tag, source=IN, sections=(view,), stream=Stream.MAIN),
                ScatterRows(**tag, source=SRC, index=IDX, target=TABLE, stream=Stream.MAIN),
            )
            seen.append((outcome(interp, batch), env_of(interp)))
            for ref in (FIRST, VIEW):
                if ref in interp.env.buffers:
                    interp.perform((Release(**tag, buffer=ref),))
        return seen

    captured_like_eager(run, modes=("capture",))


def distinct_receives(interp: TorchInterpreter) -> None:
    """Receives of different steps never share memory (a replay into a held instance
    would make them)."""
    owners: dict[int, str] = {}
    for ref in interp.bound_refs():
        if isinstance(ref, BufferRef) and ref.name.startswith("rx.step"):
            step = ref.name.split(".")[1]
            storage: Any = interp.tensor(ref).untyped_storage()
            assert owners.setdefault(storage.data_ptr(), step) == step, ref.name


@pytest.mark.parametrize("wire", list(Wire), ids=[w.value for w in Wire])
@pytest.mark.parametrize("spec", [0, 1, 2, 3])
def test_relay_programs_on_every_wire_give_eager_names_and_values_after_every_batch(
    groups: dict[Communicator, dist.ProcessGroup], wire: Wire, spec: int
) -> None:
    """A receiver and a sender relay over 30 steps of changing rows: plans, checked plans
    and emulated capture bind eager's names to eager's values after every batch."""

    def rows(step: int) -> int:
        return 1 + (step * 7) % 4 if step > 8 else 2  # one structure, then four in turn

    def run(interp: TorchInterpreter) -> list[object]:
        after = distinct_receives if interp.planner is not None else None
        return list(keyed_relay_program(interp, spec, wire, after=after, rows=rows))

    made = captured_like_eager(run, groups)
    planner = made["capture"].planner
    assert planner is not None
    assert planner.replayed > 30, (planner.replayed, planner.planned)
    assert made["plans"].planner is not None
    assert made["plans"].planner.planned > 3 * made["plans"].planner.lowered


def test_an_input_of_another_dtype_shape_or_tensor_falls_back_to_what_eager_does() -> None:
    """One structure met with its input rebound: another tensor of the layout, another
    dtype, another shape, released and bound anew, bound to a second name's tensor."""

    def run(interp: TorchInterpreter) -> list[object]:
        tensors = [
            torch.full((2, 2), 1, dtype=torch.int64),
            torch.full((2, 2), 2, dtype=torch.int32),
            torch.full((3, 2), 3, dtype=torch.int64),
            torch.full((2, 2), 4, dtype=torch.int64),
        ]
        seen: list[object] = []
        for i in range(12):
            tag = Tag(step=i, op=Op.CONSUME)
            interp.bind(IN, tensors[i % 4] + i)
            if i % 5 == 4:  # released and bound anew
                interp.perform((Release(**tag, buffer=IN),))
                interp.bind(IN, torch.full((2, 2), -i, dtype=torch.int64))
            interp.bind(SRC, interp.tensor(IN))  # a second name for the same tensor
            batch = (pad(i, IN, out(i), 3), pad(i, SRC, OUT, 4))
            seen.append((outcome(interp, batch), env_of(interp)))
            for ref in (out(i), OUT):
                interp.perform((Release(**tag, buffer=ref),))
        return seen

    made = captured_like_eager(run)
    for mode in ("capture", "checked-plans"):
        planner = made[mode].planner
        assert planner is not None
        families = [family.plans for family in planner._plans.values()]
        pads = [
            plans for plans in families if plans and isinstance(plans[0].effects[0], PadColumns)
        ]
        assert [len(plans) for plans in pads] == [3], mode  # one plan per input layout


HEADER = BufferRef("header")


def header_batch(step: int) -> tuple[Effect, ...]:
    """A segment that packs the caller's header into a wire; its view checked after."""
    tag = Tag(step=step, op=Op.RECEIVE)
    wire = BufferRef(f"step{step}.wire")
    section = Section(buffer=SRC, offset=0, shape=(2,), dtype=DType.INT32)
    return (
        pad(step, SPARE, FIRST, 1),
        Pack(**tag, sections=(section,), out=wire, nbytes=16, stream=Stream.MAIN),
        Unpack(
            **tag,
            source=wire,
            sections=(Section(buffer=HEADER, offset=0, shape=(2,), dtype=DType.INT32),),
            stream=Stream.MAIN,
        ),
        Release(**tag, buffer=FIRST),
        CheckHeader(
            **tag, buffer=HEADER, expected=np.array([step, 2], np.int32), stream=Stream.MAIN
        ),
    )


def test_a_batch_failing_after_its_graph_leaves_what_eager_leaves() -> None:
    """A header check after the captured segment fails at some steps: replays leave the
    names and values eager leaves at the failure, and later steps carry on alike."""

    def run(interp: TorchInterpreter) -> list[object]:
        interp.bind(SPARE, torch.zeros((1, 1), dtype=torch.int64))
        seen: list[object] = []
        for i in range(10):
            tag = Tag(step=i, op=Op.END_STEP)
            wrong = i % 4 == 3
            interp.bind(SRC, torch.tensor([i + wrong, 2], dtype=torch.int32))
            seen.append((outcome(interp, header_batch(i)), env_of(interp)))
            held = (HEADER, BufferRef(f"step{i}.wire"))
            interp.perform(tuple(Release(**tag, buffer=r) for r in held if r in interp.env.buffers))
        return seen

    made = captured_like_eager(run)
    planner = made["capture"].planner
    assert planner is not None
    assert planner.replayed >= 6


def test_events_work_and_aliases_that_outlive_their_batch_replay_as_eager(
    groups: dict[Communicator, dist.ProcessGroup],
) -> None:
    """An event recorded and an all-reduce started after one step's graph are waited on
    (or the event forgotten) before the next step's; an alias of a graph's output is
    kept two steps: replays never overwrite it, and every batch ends as in eager."""

    def make_step(i: int) -> tuple[Effect, ...]:
        tag = Tag(step=i, op=Op.BROADCAST)
        return (
            pad(i, IN, BufferRef(f"step{i}.x"), 3),
            RecordEvent(**tag, stream=Stream.MAIN, event=EventRef(f"step{i}.done")),
            AllReduce(
                **tag,
                contribution=np.arange(5, dtype=np.int32).reshape(5, 1) + i,
                result=BufferRef(f"step{i}.table"),
                comm=Communicator.DP_CPU,
                work=WorkRef(f"step{i}.agree"),
            ),
        )

    def use_step(i: int) -> tuple[Effect, ...]:
        tag, last = Tag(step=i, op=Op.CONSUME), i - 1
        event = EventRef(f"step{last}.done")
        y, kept = BufferRef(f"step{i}.y"), BufferRef(f"step{i}.kept")
        return (
            ForgetEvent(**tag, event=event)
            if i % 3 == 0
            else WaitEvent(**tag, stream=Stream.MAIN, event=event),
            WaitWork(**tag, work=WorkRef(f"step{last}.agree")),
            pad(i, BufferRef(f"step{last}.x"), y, 4),
            Alias(**tag, source=y, out=kept),
            Release(**tag, buffer=y),
            Release(**tag, buffer=BufferRef(f"step{last}.x")),
            *((Release(**tag, buffer=BufferRef(f"step{i - 2}.kept")),) if i >= 3 else ()),
            pad(i, SPARE, BufferRef(f"step{i}.last"), 1),
        )

    def end_step(i: int) -> tuple[Effect, ...]:
        # The table, whose all-reduce the step waited for, is read in a batch of its own.
        tag, table, padded = Tag(step=i, op=Op.END_STEP), f"step{i - 1}.table", f"step{i}.padded"
        return (
            pad(i, BufferRef(table), BufferRef(padded), 2),
            *(Release(**tag, buffer=BufferRef(n)) for n in (table, padded, f"step{i}.last")),
        )

    def run(interp: TorchInterpreter) -> list[object]:
        interp.bind(SPARE, torch.zeros((1, 1), dtype=torch.int64))
        seen: list[object] = []
        for i in range(12):
            interp.bind(IN, torch.full((2, 2), i, dtype=torch.int64))
            if i:
                seen.append((outcome(interp, use_step(i)), env_of(interp)))
                seen.append((outcome(interp, end_step(i)), env_of(interp)))
            seen.append((outcome(interp, make_step(i)), env_of(interp)))
        return seen

    made = captured_like_eager(run, groups)
    planner = made["capture"].planner
    assert planner is not None
    assert planner.replayed >= 3 * 8, (planner.replayed, planner.planned)


def test_the_plan_cache_grows_by_structures_and_at_most_eight_layouts_each() -> None:
    """Forty structures (a host index of 1..40 rows) each met thrice lower forty plans;
    one structure met with twelve input layouts keeps eight (guarded modes) or one
    (fast plans, which need no guard), and runs the rest eagerly, as eager does."""

    def run(interp: TorchInterpreter) -> list[object]:
        interp.bind(TABLE, torch.arange(12, dtype=torch.int64).reshape(6, 2))
        seen: list[object] = []
        for round_ in range(3):
            for n in range(1, 41):
                tag, index = Tag(step=n, op=Op.CONSUME), BufferRef(f"step{n}.index")
                host = (np.arange(n) * (round_ + 1)) % 6
                batch = (
                    CopyHostToDevice(**tag, source=host, buffer=index, stream=Stream.MAIN),
                    GatherRows(**tag, source=TABLE, index=index, out=OUT, stream=Stream.MAIN),
                    Release(**tag, buffer=index),
                )
                seen.append((outcome(interp, batch), env_of(interp)))
                interp.perform((Release(**tag, buffer=OUT),))
        for i in range(24):
            interp.bind(IN, torch.full((2, 1 + i % 12), i, dtype=torch.int64))
            seen.append((outcome(interp, (pad(i, IN, OUT, 13),)), env_of(interp)))
            interp.perform((Release(**Tag(step=i, op=Op.END_STEP), buffer=OUT),))
        return seen

    made = captured_like_eager(run)
    for mode, interp in made.items():
        planner = interp.planner
        assert planner is not None
        plans = {
            type(family.plans[0].effects[0]).__name__: len(family.plans)
            for family in planner._plans.values()
            if family.plans and len(family.plans[0].effects) > 1
        }
        assert plans == {"CopyHostToDevice": 1}, mode  # one family per row count...
        gathers = [f for f in planner._plans.values() if f.plans and len(f.plans[0].effects) == 3]
        assert len(gathers) == 40, mode
        (pads,) = [
            f.plans
            for f in planner._plans.values()
            if f.plans and isinstance(f.plans[0].effects[0], PadColumns)
        ]
        assert len(pads) == (1 if mode == "plans" else 8), mode


@pytest.mark.parametrize("mode", ["checked-plans", "capture"])
def test_a_batch_that_waits_for_its_table_before_reading_it_runs_its_plan(
    groups: dict[Communicator, dist.ProcessGroup], mode: str
) -> None:
    def run(interp: TorchInterpreter) -> list[object]:
        seen: list[object] = []
        for i in range(12):
            tag, table = Tag(step=i, op=Op.AGREE), BufferRef(f"step{i}.table")
            work = WorkRef(f"step{i}.agree")
            contribution = np.full((5, 1), i, dtype=np.int32)
            start = AllReduce(
                **tag, contribution=contribution, result=table, comm=Communicator.DP_CPU, work=work
            )
            interp.perform((start,))
            finish = (
                WaitWork(**tag, work=work),
                pad(i, table, out(i), 2),
                Release(**tag, buffer=table),
            )
            seen.append((outcome(interp, finish), env_of(interp)))
            interp.perform((Release(**tag, buffer=out(i)),))
        return seen

    made = captured_like_eager(run, groups, modes=(mode,))
    planner = made[mode].planner
    assert planner is not None
    (finish,) = [
        f.plans for f in planner._plans.values() if f.plans and len(f.plans[0].effects) == 3
    ]
    assert len(finish) == 1  # one layout, one plan
    assert planner.eager <= 3  # the first meeting of each structure, no more
