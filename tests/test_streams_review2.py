"""Review of stream and event semantics: the numpy model, the simulator, the checker, torch.

Each test states one behaviour where the three models agree with each other and with
what CUDA, NCCL or gloo would do. (The review's three disagreements are in the README's
list of what is known and left.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from purepp.effects.checker import CheckReport, check_logs
from purepp.effects.log import LogHeader, Recorder, dump_logs
from purepp.effects.matching import CollectiveReportError, DeadlockReport, Report
from purepp.effects.numpy_interpreter import NumpyInterpreter
from purepp.effects.simulator import RankContext, simulate
from purepp.effects.torch_interpreter import TorchInterpreter
from purepp.effects.vocabulary import (
    Allocate,
    AllReduce,
    Broadcast,
    BufferRef,
    Communicator,
    CopyHostToDevice,
    DType,
    Effect,
    EventRef,
    ForgetEvent,
    GatherRows,
    Op,
    RecordEvent,
    Release,
    Stream,
    Synchronize,
    WaitEvent,
    WaitWork,
    WorkRef,
)
from purepp.errors import InterpreterError
from purepp.layout import Layout

Program = list[list[tuple[Effect, ...]]]  # per rank, its effect batches in order

WORLD = Layout(pp=2, dp=1)  # two stages of one replica: PP_RELAY and PP_CPU span both
CPU = torch.device("cpu")


# -- helpers -----------------------------------------------------------------------------


def wire(step: int, src: int, *, stream: Stream = Stream.RELAY) -> tuple[Allocate, Broadcast]:
    """A fresh int64 [3] buffer on `stream`, broadcast from `src` over PP_RELAY."""
    buffer = BufferRef(f"wire.{step}")
    return (
        Allocate(
            step=step, op=Op.RECEIVE, buffer=buffer, shape=(3,), dtype=DType.INT64, stream=stream
        ),
        Broadcast(
            step=step,
            op=Op.RECEIVE,
            buffer=buffer,
            shape=(3,),
            dtype=DType.INT64,
            src=src,
            comm=Communicator.PP_RELAY,
            stream=stream,
        ),
    )


def agree(step: int, *, work: str | None = None) -> AllReduce:
    """An all-reduce of a zero 2 x 2 table over PP_CPU (a gloo group), sync unless `work`."""
    return AllReduce(
        step=step,
        op=Op.AGREE,
        contribution=np.zeros((2, 2), dtype=np.int32),
        result=BufferRef(f"table.{step}"),
        comm=Communicator.PP_CPU,
        work=None if work is None else WorkRef(work),
    )


def simulated(program: Program) -> Report | None:
    """The simulator's report on `program` over WORLD, None when every rank completes."""

    def run(context: RankContext) -> Iterator[tuple[Effect, ...]]:
        yield from program[context.rank]

    try:
        simulate(WORLD, run)
    except CollectiveReportError as error:
        return error.report
    return None


def checked(directory: Path, program: Program, *, backend: str = "nccl") -> CheckReport:
    """`purepp check` over the logs a `Recorder` (no inner interpreter) per rank writes,
    each batch recorded after the one before it was performed (as a run records)."""
    recorders = [
        Recorder(LogHeader(rank=rank, world=WORLD, config={"backend": backend}))
        for rank in range(WORLD.world_size)
    ]
    for recorder, batches in zip(recorders, program, strict=True):
        for batch in batches:
            recorder.perform(batch)
    dump_logs([recorder.log for recorder in recorders], directory)
    return check_logs(directory)


def event_effects(name: str) -> tuple[RecordEvent, WaitEvent, ForgetEvent]:
    event = EventRef(name)
    return (
        RecordEvent(step=0, op=Op.RECEIVE, stream=Stream.RELAY, event=event),
        WaitEvent(step=0, op=Op.CONSUME, stream=Stream.MAIN, event=event),
        ForgetEvent(step=0, op=Op.CONSUME, event=event),
    )


# -- buffer lifetimes: the caching allocator's rule, not the model's schedule ------------


def test_a_use_on_the_home_stream_needs_no_record_stream() -> None:
    """A buffer read only on the stream that made it is reclaimed in stream order: fine."""
    interp = NumpyInterpreter()
    source, index, out = BufferRef("source"), BufferRef("index"), BufferRef("out")
    relay = Stream.RELAY
    interp.perform(
        (
            CopyHostToDevice(
                step=0, op=Op.RECEIVE, source=np.array([[1, 2]]), buffer=source, stream=relay
            ),
            CopyHostToDevice(
                step=0, op=Op.RECEIVE, source=np.array([0]), buffer=index, stream=relay
            ),
            GatherRows(step=0, op=Op.RECEIVE, source=source, index=index, out=out, stream=relay),
            Release(step=0, op=Op.RECEIVE, buffer=source),
        )
    )
    assert interp.lifetime_violations == ()


# -- host blocking: gloo and NCCL ---------------------------------------------------------


def test_a_host_synchronize_on_an_unmatched_relay_broadcast_deadlocks_in_both_tools(
    tmp_path: Path,
) -> None:
    """`Synchronize(RELAY)` really blocks the host (cudaStreamSynchronize) until the relay
    broadcast is matched; rank 1 waits in the all-reduce rank 0 never reaches. A true
    deadlock on every backend: the simulator and the checker both report it, with the
    same wait-for cycle."""
    program: Program = [
        [(*wire(0, 0), Synchronize(step=0, op=Op.BROADCAST, stream=Stream.RELAY), agree(0))],
        [(agree(0), *wire(0, 0))],
    ]
    simulated_report = simulated(program)
    assert isinstance(simulated_report, DeadlockReport)
    assert simulated_report.cycle is not None
    report = checked(tmp_path, program)
    assert isinstance(report.finding, DeadlockReport), report.text
    assert report.finding.cycle == simulated_report.cycle


# -- events: recorded once, consumed by their one wait ------------------------------------


def interpreters() -> list[NumpyInterpreter | TorchInterpreter]:
    return [NumpyInterpreter(), TorchInterpreter(device=CPU, groups={}, rank=0)]


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_an_event_recorded_twice_unwaited_is_a_typed_error_naming_it(kind: str) -> None:
    """Both interpreters refuse the second record of an unwaited event, naming the call,
    the event and the fix (CUDA would silently move the event; the vocabulary records an
    event once)."""
    interp = interpreters()[0 if kind == "numpy" else 1]
    record, _, _ = event_effects("e")
    interp.perform((record,))
    with pytest.raises(InterpreterError) as raised:
        interp.perform((record,))
    assert "RecordEvent" in raised.value.call
    assert "'e'" in raised.value.problem
    assert raised.value.fix


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("first", ["never recorded", "forgotten", "waited"])
def test_a_wait_on_an_event_not_recorded_now_is_a_typed_error(kind: str, first: str) -> None:
    """A WaitEvent on an event never recorded, forgotten, or already waited on is refused
    in both interpreters with an InterpreterError naming the call and the event."""
    interp = interpreters()[0 if kind == "numpy" else 1]
    record, wait, forget = event_effects("e")
    if first == "forgotten":
        interp.perform((record, forget))
    elif first == "waited":
        interp.perform((record, wait))
    with pytest.raises(InterpreterError) as raised:
        interp.perform((wait,))
    assert "WaitEvent" in raised.value.call
    assert "'e'" in raised.value.problem


# -- asynchronous work ----------------------------------------------------------------------


def test_a_work_waited_twice_is_a_typed_error_naming_it() -> None:
    """WaitWork consumes its handle: a second wait on it is an InterpreterError naming the
    call and the work (torch's environment raises the same)."""
    interp = NumpyInterpreter()
    table = AllReduce(
        step=0,
        op=Op.AGREE,
        contribution=np.zeros((2, 1), dtype=np.int32),
        result=BufferRef("table"),
        comm=Communicator.DP_CPU,
        work=WorkRef("w"),
    )
    wait = WaitWork(step=0, op=Op.AGREE, work=WorkRef("w"))
    interp.perform((table, wait))
    with pytest.raises(InterpreterError) as raised:
        interp.perform((wait,))
    assert "WaitWork" in raised.value.call
    assert "'w'" in raised.value.problem


def test_an_async_all_reduce_never_waited_on_is_named_by_both_tools(tmp_path: Path) -> None:
    """Every rank posts an asynchronous all-reduce and none waits on it: the simulator and
    the checker both stop with a DeadlockReport naming each unwaited all-reduce."""
    program: Program = [[(agree(0, work="w"),)], [(agree(0, work="w"),)]]
    simulated_report = simulated(program)
    assert isinstance(simulated_report, DeadlockReport)
    report = checked(tmp_path, program)
    assert isinstance(report.finding, DeadlockReport), report.text
    assert [rank for rank, _ in report.finding.unwaited] == [0, 1]
    assert [rank for rank, _ in simulated_report.unwaited] == [0, 1]
