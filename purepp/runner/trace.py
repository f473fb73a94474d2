"""A Chrome/Perfetto trace of a run: one process per rank, one track per stream.

Each effect becomes a slice on the track of the stream it runs on (host for
effects with no stream), named by its kind; collectives show their communicator,
sequence number, shape, dtype and source in the slice's arguments. On CPU the
slices time the work itself; on CUDA they time its issue from the host.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import assert_never

from purepp.effects.interpreter import Interpreter
from purepp.effects.vocabulary import (
    COLLECTIVES,
    Alias,
    Allocate,
    AllReduce,
    Broadcast,
    CheckHeader,
    CopyHostToDevice,
    Effect,
    ForgetEvent,
    GatherRows,
    NoteDecision,
    Pack,
    PadColumns,
    RecordEvent,
    RecordStream,
    Release,
    ScatterRows,
    StackRows,
    Synchronize,
    Unpack,
    WaitEvent,
    WaitStream,
    WaitWork,
)

__all__ = ["TraceEvent", "Tracer", "partial_trace"]

TraceEvent = dict[str, object]

_TRACKS = {"main": 1, "relay": 2, "host": 3}


def _track(effect: Effect) -> str:
    """The stream an effect runs on; host work (and the host's waits) on the host track."""
    match effect:
        case (
            WaitStream()
            | RecordEvent()
            | WaitEvent()
            | Allocate()
            | CopyHostToDevice()
            | Broadcast()
            | CheckHeader()
            | RecordStream()
            | PadColumns()
            | StackRows()
            | GatherRows()
            | ScatterRows()
            | Synchronize()
            | Pack()
            | Unpack()
        ):
            return effect.stream.value
        case ForgetEvent() | AllReduce() | WaitWork() | NoteDecision() | Release() | Alias():
            return "host"
        case _:
            assert_never(effect)


def partial_trace(path: Path) -> Path:
    """Where a trace is written before it is renamed into place, so that a run stopped
    while writing leaves no half trace under the trace's own name."""
    return path.with_name(path.name + ".partial")


class Tracer:
    """An interpreter that times every effect `inner` performs and keeps the slices."""

    def __init__(self, *, rank: int, inner: Interpreter) -> None:
        self.rank = rank
        self.inner = inner
        self.events: list[TraceEvent] = [
            {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}},
            *(
                {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}}
                for name, tid in _TRACKS.items()
            ),
        ]
        self._sequence: dict[str, int] = {}

    def perform(self, effects: tuple[Effect, ...], /) -> None:
        for effect in effects:
            start = time.time_ns()
            self.inner.perform((effect,))
            end = time.time_ns()
            self.events.append(self._slice(effect, start, end))

    def _slice(self, effect: Effect, start_ns: int, end_ns: int) -> TraceEvent:
        args: dict[str, object] = {"step": effect.step, "op": effect.op.value}
        if isinstance(effect, COLLECTIVES):
            comm = effect.comm.value
            self._sequence[comm] = self._sequence.get(comm, -1) + 1
            args |= {"comm": comm, "comm_seq": self._sequence[comm]}
            if isinstance(effect, Broadcast):
                args |= {
                    "shape": list(effect.shape),
                    "dtype": effect.dtype.value,
                    "src": effect.src,
                }
        elif isinstance(effect, NoteDecision):  # what the agreement decided, at a glance
            args |= {
                "cg_mode": effect.cg_mode,
                "num_tokens_across_dp": effect.num_tokens_across_dp.tolist(),
                "num_ubatches": effect.num_ubatches,
            }
        return {
            "ph": "X",
            "name": type(effect).__name__,
            "cat": effect.op.value,
            "pid": self.rank,
            "tid": _TRACKS[_track(effect)],
            "ts": start_ns / 1000,
            "dur": max((end_ns - start_ns) / 1000, 0.001),
            "args": args,
        }
