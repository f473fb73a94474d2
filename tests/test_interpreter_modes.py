"""Every way of performing effects gives the same outputs, the same names and the same errors.

The numpy interpreter is the reference; the torch interpreter runs fast (the default),
checked, with plans, and checked with plans, on a one-rank gloo world. A relay-like
program (tests/_interpreter_programs.py) is compared after every batch: every bound
buffer's contents and every bound name. Then bindings that do not fit a plan (buffers,
events and work in flight): the plan falls back to eager and raises eager's error,
leaving eager's environment.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
import torch.distributed as dist

from purepp.effects import plan
from purepp.effects.keyed import KeyedEffects
from purepp.effects.numpy_interpreter import NumpyInterpreter
from purepp.effects.plan import abstract
from purepp.effects.torch_interpreter import TorchInterpreter
from purepp.effects.vocabulary import (
    Alias,
    AllReduce,
    BufferRef,
    Communicator,
    Effect,
    EventRef,
    Op,
    RecordEvent,
    Release,
    Stream,
    WaitEvent,
    WaitWork,
    WorkRef,
)
from purepp.errors import InterpreterError
from tests import _interpreter_programs as programs

CPU = torch.device("cpu")
STEPS = 16
MODES = ("fast", "checked", "plans", "checked-plans")

Snapshot = tuple[frozenset[BufferRef | EventRef | WorkRef], dict[str, list[Any]]]


def torch_interp(groups: dict[Communicator, dist.ProcessGroup], mode: str) -> TorchInterpreter:
    return TorchInterpreter(
        device=CPU, groups=groups, rank=0, checked="checked" in mode, plans="plans" in mode
    )


def bind_torch(interp: TorchInterpreter) -> programs.Bind:
    def bind(ref: BufferRef, values: npt.NDArray[np.int64] | npt.NDArray[np.int32]) -> None:
        interp.bind(ref, torch.from_numpy(np.array(values, copy=True)))

    return bind


def snapshot_torch(interp: TorchInterpreter) -> Snapshot:
    names = interp.bound_refs()
    pending = interp.env.pending_results  # an all-reduce's table: unreadable until waited
    values = {
        ref.name: ["in flight"] if ref in pending else interp.tensor(ref).tolist()
        for ref in names
        if isinstance(ref, BufferRef)
    }
    return names, values


def snapshot_numpy(interp: NumpyInterpreter) -> Snapshot:
    names = interp.bound_refs()
    values = {ref.name: interp.tensor(ref).tolist() for ref in names if isinstance(ref, BufferRef)}
    return names, values


def run_numpy(steps: int) -> list[Snapshot]:
    interp = NumpyInterpreter(rank=0)
    seen = []
    for batch in programs.program(steps, interp.bind):
        interp.perform(batch)
        seen.append(snapshot_numpy(interp))
    return seen


def run_torch(interp: TorchInterpreter, steps: int) -> list[Snapshot]:
    seen = []
    for batch in programs.program(steps, bind_torch(interp)):
        interp.perform(batch)
        seen.append(snapshot_torch(interp))
    return seen


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_matches_the_numpy_reference_after_every_batch(
    groups: dict[Communicator, dist.ProcessGroup], mode: str
) -> None:
    reference = run_numpy(STEPS)
    interp = torch_interp(groups, mode)
    seen = run_torch(interp, STEPS)
    assert len(seen) == len(reference)
    for batch, (got, want) in enumerate(zip(seen, reference, strict=True)):
        assert got[0] == want[0], batch
        assert got[1] == want[1], batch
    planner = interp.planner
    if "plans" in mode:
        assert planner is not None
        # Steady steps run their plans; first meetings (new structures or input layouts)
        # run eagerly, and each lowers a plan.
        assert planner.planned > planner.eager
        assert planner.lowered == planner.eager
    else:
        assert planner is None


def test_steps_with_other_names_share_one_structure() -> None:
    first, first_names = abstract(programs.send(5, 5))
    second, second_names = abstract(programs.send(6, 5))
    assert first == second
    assert first_names != second_names
    assert abstract(programs.send(6, 7))[0] != first  # another row count: another structure


def test_host_data_is_a_binding_and_its_shape_is_structure() -> None:
    one, _ = abstract(programs.consume(3, 5))
    other, _ = abstract(programs.consume(7, 5))  # other idx mapping values, same shape
    assert one == other
    assert abstract(programs.consume(7, 7))[0] != one


def _run_until(interp: TorchInterpreter, steps: int) -> None:
    """Perform every batch of `steps` steps, then bind step `steps`'s inputs."""
    bind = bind_torch(interp)
    for batch in programs.program(steps, bind):
        interp.perform(batch)


def _outcome(interp: TorchInterpreter, batch: tuple[Effect, ...]) -> tuple[str, Snapshot]:
    try:
        interp.perform(batch)
    except InterpreterError as error:
        return str(error), snapshot_torch(interp)
    return "performed", snapshot_torch(interp)


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "fast"])
@pytest.mark.parametrize(
    "bad",
    [
        "too-wide",
        "unbound-input",
        "made-name-bound",
        "non-contiguous-input",
        "input-pending",
        "made-name-pending",
    ],
)
def test_bindings_that_do_not_fit_a_plan_get_eagers_outcome(
    groups: dict[Communicator, dist.ProcessGroup], checked: bool, bad: str
) -> None:
    outcomes = []
    for plans in (False, True):
        interp = TorchInterpreter(device=CPU, groups=groups, rank=0, checked=checked, plans=plans)
        _run_until(interp, 8)  # steps 0..7: the plans are made and running
        step, n = 8, programs.n_at(8)
        interp.perform(programs.consume(step, programs.n_at(7)))
        interp.perform(programs.agree(step))
        bind = bind_torch(interp)
        bind(programs.NUM_SAMPLED, np.full(n, 3, dtype=np.int32))
        bind(programs.NUM_REJECTED, np.zeros(n, dtype=np.int32))
        if bad == "too-wide":
            bind(programs.SAMPLED, np.ones((n, programs.WIDTH + 1), dtype=np.int64))
        elif bad == "unbound-input":
            bind(programs.SAMPLED, np.ones((n, 3), dtype=np.int64))
            interp.perform((programs.send(step, n)[0],))  # a harmless effect, then unbind:
            interp.env.buffers.pop(programs.SAMPLED)
        elif bad == "non-contiguous-input":  # the plan was lowered over a contiguous one
            wide = torch.ones((n, 6), dtype=torch.int64)
            interp.bind(programs.SAMPLED, wide[:, :3])  # rows 6 apart: not contiguous
        elif bad in ("input-pending", "made-name-pending"):
            # The name is the result of an all-reduce still in flight (nobody waited).
            name = programs.SAMPLED if bad == "input-pending" else programs.ref(step, "counts")
            interp.env.buffers.pop(name, None)
            if bad == "made-name-pending":
                bind(programs.SAMPLED, np.ones((n, 3), dtype=np.int64))
            table = AllReduce(
                step=step,
                op=Op.AGREE,
                contribution=programs.contribution(step),
                result=name,
                comm=Communicator.DP_CPU,
                work=WorkRef("in-flight"),
            )
            interp.perform((table,))
        else:
            bind(programs.SAMPLED, np.ones((n, 3), dtype=np.int64))
            bind(programs.ref(step, "counts"), np.zeros((2, n), dtype=np.int32))
        outcomes.append(_outcome(interp, programs.send(step, n)))
        if plans:
            assert interp.planner is not None
            assert interp.planner.planned > 0
    (eager_message, eager_env), (plan_message, plan_env) = outcomes
    assert plan_message == eager_message
    assert plan_env == eager_env
    if bad == "non-contiguous-input":  # sent as a strided copy: fits eager, not the plan
        assert eager_message == "performed"
    elif checked or bad != "too-wide":
        assert eager_message != "performed"


def test_a_structure_past_its_plan_variants_still_runs_every_batch() -> None:
    # Checked plans guard their input layouts: each new layout of one structure is a new
    # plan, up to a bound; past it the batch runs eagerly, and is still performed.
    interp = TorchInterpreter(device=CPU, groups={}, rank=0, checked=True, plans=True)
    planner = interp.planner
    assert planner is not None
    source, out = BufferRef("caller.rows"), BufferRef("relay.kept_rows")
    layouts = plan._VARIANTS + 3
    for width in range(1, layouts + 1):
        rows = torch.arange(width, dtype=torch.int32)
        interp.bind(source, rows)
        interp.perform((Alias(step=width, op=Op.CONSUME, source=source, out=out),))
        assert interp.tensor(out) is rows
        interp.perform((Release(step=width, op=Op.END_STEP, buffer=out),))
    # Both batches read a buffer of the new layout: each has as many plans as allowed,
    # lowered at their first meetings, and runs the layouts past them eagerly.
    assert planner.lowered == 2 * plan._VARIANTS
    assert planner.eager == 2 * layouts


TAG = programs.Tag(step=3, op=Op.AGREE)
EVENT, WORK = EventRef("received"), WorkRef("agree")
INPUT = BufferRef("caller.table")  # bound by the caller: int32 [5, 1], an all-reduce's layout
TABLE, OTHER_TABLE = BufferRef("agree.table"), BufferRef("agree.other_table")


def agree(result: BufferRef) -> AllReduce:
    return AllReduce(
        **TAG,
        contribution=programs.contribution(3),
        result=result,
        comm=Communicator.DP_CPU,
        work=WORK,
    )


RECORD = RecordEvent(**TAG, stream=Stream.RELAY, event=EVENT)
WAIT = WaitEvent(**TAG, stream=Stream.MAIN, event=EVENT)
WAIT_WORK = WaitWork(**TAG, work=WORK)
# Each case: what runs before the batch, the batch (its first meeting succeeds and
# lowers a plan), what runs between, the batch of the same structure met again (now
# not fitting: the plan's guard refuses it), and what eager names then.
Misfit = tuple[tuple[Effect, ...], tuple[Effect, ...], tuple[Effect, ...], tuple[Effect, ...], str]
MISFITS: dict[str, Misfit] = {
    "event-not-recorded": ((RECORD,), (WAIT,), (), (WAIT,), "event 'received' is not recorded"),
    "event-still-recorded": ((), (RECORD,), (), (RECORD,), "event 'received' is already"),
    "work-not-in-flight": (
        (agree(TABLE),),
        (WAIT_WORK,),
        (),
        (WAIT_WORK,),
        "work 'agree' is not in flight",
    ),
    "work-still-in-flight": (
        (),
        (agree(TABLE),),
        (),
        (agree(OTHER_TABLE),),
        "work 'agree' is already in flight",
    ),
    "input-being-all-reduced": (
        (),
        (Release(**TAG, buffer=INPUT),),
        (agree(INPUT),),
        (Release(**TAG, buffer=INPUT),),
        "'caller.table' is the result of all-reduce 'agree', which has not been waited on",
    ),
}


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "fast"])
@pytest.mark.parametrize("case", sorted(MISFITS))
def test_events_and_work_that_do_not_fit_a_plan_get_eagers_outcome(
    groups: dict[Communicator, dist.ProcessGroup], checked: bool, case: str
) -> None:
    before, batch, between, again, problem = MISFITS[case]
    outcomes = []
    for plans in (False, True):
        interp = TorchInterpreter(device=CPU, groups=groups, rank=0, checked=checked, plans=plans)
        interp.bind(INPUT, torch.zeros((5, 1), dtype=torch.int32))
        for effects in (before, batch, between):
            if effects:
                interp.perform(effects)
        outcomes.append(_outcome(interp, again))
        planner = interp.planner
        if planner is not None:
            # A checked plan checks its names before it runs: the batch it refuses runs
            # eagerly. (A fast plan runs eager's own handlers, which raise the same.)
            refused = 1 if checked else 0
            assert planner.planned == 1 - refused
            assert planner.eager == planner.lowered + refused
    (eager_message, eager_env), (plan_message, plan_env) = outcomes
    assert problem in eager_message
    assert plan_message == eager_message
    assert plan_env == eager_env


def test_a_keyed_batch_whose_first_meeting_failed_is_planned_from_its_next() -> None:
    # The failed first meeting leaves its structure's family without a plan: the next
    # meeting reads its names and lowers one.
    interp = TorchInterpreter(device=CPU, groups={}, rank=0, checked=True, plans=True)
    planner = interp.planner
    assert planner is not None
    batch = KeyedEffects((Release(**TAG, buffer=INPUT),), structure=("release", 1))
    with pytest.raises(InterpreterError, match=r"Release step=3.*'caller\.table' is not bound"):
        interp.perform(batch)
    assert (planner.eager, planner.lowered) == (1, 0)
    for _ in range(2):
        interp.bind(INPUT, torch.zeros(2, dtype=torch.int32))
        interp.perform(batch)
        assert interp.bound_refs() == frozenset()
    assert (planner.eager, planner.lowered, planner.planned) == (2, 1, 1)
