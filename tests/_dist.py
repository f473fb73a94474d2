"""Spawn N real processes joined by torch.distributed, for multi-process tests.

Each rank is a fresh `spawn`ed Python process that initialises the default process
group (gloo over loopback, or NCCL with one GPU per rank) through a file rendezvous
in a private temporary directory, runs `worker(context)` and sends back what it
returned, or its traceback. Use it from any test module:

    def worker(ctx: RankContext) -> list[int]:    # module level: spawn pickles it by name
        ...
    values = run_ranks(worker, world_size=3)          # every rank must succeed
    outcomes = spawn_ranks(worker, world_size=2)      # when a rank is meant to fail or exit

Extra arguments travel with `functools.partial(worker, arg, ...)`; arguments and
return values must be picklable (numpy arrays, attrs values, plain data).
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import queue
import shutil
import tempfile
import time
import traceback
import typing
from collections.abc import Callable
from typing import Generic, TypeVar

import attrs
import torch
import torch.distributed as dist

from purepp.effects.torch_interpreter import Backend, init_distributed

__all__ = [
    "RankContext",
    "RankError",
    "RankOutcome",
    "RanksFailedError",
    "describe_outcomes",
    "run_ranks",
    "spawn_ranks",
]

T = TypeVar("T")

# How often the parent looks for results while the ranks run.
_POLL_S = 0.05


@attrs.frozen
class RankContext:
    """What a worker learns about its place in the world."""

    rank: int  # this process's global rank
    world_size: int  # number of processes
    backend: Backend  # backend of the default group
    timeout: datetime.timedelta  # collective timeout the default group was initialised with

    @property
    def device(self) -> torch.device:
        """cpu for gloo; cuda:<rank> for NCCL (one GPU per rank)."""
        if self.backend == "nccl":
            return torch.device("cuda", self.rank)
        return torch.device("cpu")


@attrs.frozen
class RankError:
    """An exception raised in a rank, carried back as text (exceptions may not pickle)."""

    type_name: str  # the exception's class name, e.g. "PeerFailureError"
    message: str  # str(exception)
    traceback: str  # the formatted traceback, chained causes included


@attrs.frozen
class RankOutcome(Generic[T]):
    """How one rank ended."""

    rank: int  # global rank
    returned: bool  # the worker returned (its value is `value`)
    value: T | None  # what the worker returned, None unless `returned`
    error: RankError | None  # what the worker (or the rendezvous) raised
    exitcode: int | None  # the process's exit code; None when it was killed at the deadline

    @property
    def ok(self) -> bool:
        return self.returned and self.error is None and self.exitcode == 0


class RanksFailedError(AssertionError):
    """A multi-process run where some rank failed, exited early or hung past the deadline."""


def _child_main(
    worker: Callable[[RankContext], object],
    context: RankContext,
    init_method: str,
    results: multiprocessing.Queue[tuple[int, bool, object]],
) -> None:
    # Loopback keeps gloo off whatever interface the hostname resolves to; one thread
    # per rank keeps several ranks from fighting over the few CI cores.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        if context.backend == "nccl":
            torch.cuda.set_device(context.rank)
        init_distributed(
            backend=context.backend,
            init_method=init_method,
            rank=context.rank,
            world_size=context.world_size,
            timeout=context.timeout,
        )
        value = worker(context)
    except BaseException as error:
        text = "".join(traceback.format_exception(error))
        results.put((context.rank, False, RankError(type(error).__name__, str(error), text)))
    else:
        results.put((context.rank, True, value))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(
    worker: Callable[[RankContext], T],
    world_size: int,
    *,
    backend: Backend = "gloo",
    timeout: datetime.timedelta = datetime.timedelta(seconds=10),
    deadline_s: float = 60.0,
) -> tuple[RankOutcome[T], ...]:
    """Run `worker` on `world_size` fresh processes; return every rank's outcome.

    `timeout` is the collective timeout of the default group; `deadline_s` bounds the
    whole run: ranks still alive then are killed (their outcome has exitcode None).
    """
    if world_size < 1:
        raise ValueError(f"spawn_ranks: world_size={world_size}; pass 1 or more")
    context = multiprocessing.get_context("forkserver")
    # The fork server imports torch once; every rank then forks from it instead of paying
    # a fresh torch import (seconds per process on a small CI machine).
    context.set_forkserver_preload(["torch", "torch.distributed", "tests._dist"])
    results: multiprocessing.Queue[tuple[int, bool, object]] = context.Queue()
    rendezvous_dir = tempfile.mkdtemp(prefix="purepp-dist-")
    init_method = f"file://{os.path.join(rendezvous_dir, 'rendezvous')}"
    processes = [
        context.Process(
            target=_child_main,
            args=(worker, RankContext(rank, world_size, backend, timeout), init_method, results),
            name=f"purepp-rank{rank}",
        )
        for rank in range(world_size)
    ]
    received: dict[int, tuple[bool, object]] = {}
    killed: set[int] = set()
    try:
        for process in processes:
            process.start()
        deadline = time.monotonic() + deadline_s
        # Drain results while the ranks run: a child cannot exit while its queue
        # feeder still holds unread data.
        while time.monotonic() < deadline and len(received) < world_size:
            try:
                rank, returned, payload = results.get(timeout=_POLL_S)
            except queue.Empty:
                if not any(process.is_alive() for process in processes):
                    break
                continue
            received[rank] = (returned, payload)
        for rank, process in enumerate(processes):
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                killed.add(rank)
                process.kill()
                process.join()
        while True:
            try:
                rank, returned, payload = results.get_nowait()
            except queue.Empty:
                break
            received[rank] = (returned, payload)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
        results.close()
        shutil.rmtree(rendezvous_dir, ignore_errors=True)
    return tuple(
        _outcome(rank, received.get(rank), None if rank in killed else process.exitcode)
        for rank, process in enumerate(processes)
    )


def _outcome(
    rank: int, message: tuple[bool, object] | None, exitcode: int | None
) -> RankOutcome[T]:
    if message is None:
        return RankOutcome(rank, returned=False, value=None, error=None, exitcode=exitcode)
    returned, payload = message
    if returned:
        return RankOutcome(
            rank, returned=True, value=typing.cast(T, payload), error=None, exitcode=exitcode
        )
    error = payload if isinstance(payload, RankError) else RankError("?", repr(payload), "")
    return RankOutcome(rank, returned=False, value=None, error=error, exitcode=exitcode)


def describe_outcomes(outcomes: tuple[RankOutcome[T], ...]) -> str:
    """A readable report of every rank's end, tracebacks included."""
    lines: list[str] = []
    for outcome in outcomes:
        if outcome.exitcode is None:
            end = "killed at the deadline (hung)"
        else:
            end = f"exit code {outcome.exitcode}"
        if outcome.error is not None:
            lines.append(f"rank {outcome.rank}: raised ({end}):\n{outcome.error.traceback}")
        elif not outcome.returned:
            lines.append(f"rank {outcome.rank}: returned nothing ({end})")
        else:
            lines.append(f"rank {outcome.rank}: returned ({end})")
    return "\n".join(lines)


def run_ranks(
    worker: Callable[[RankContext], T],
    world_size: int,
    *,
    backend: Backend = "gloo",
    timeout: datetime.timedelta = datetime.timedelta(seconds=10),
    deadline_s: float = 60.0,
) -> list[T]:
    """Run `worker` on `world_size` processes; every rank's value, in rank order.

    Raises RanksFailedError, with every rank's traceback, unless all ranks returned
    and exited cleanly.
    """
    outcomes = spawn_ranks(
        worker, world_size, backend=backend, timeout=timeout, deadline_s=deadline_s
    )
    if not all(outcome.ok for outcome in outcomes):
        raise RanksFailedError(
            f"{world_size}-process {backend} run failed:\n{describe_outcomes(outcomes)}"
        )
    return [typing.cast(T, outcome.value) for outcome in outcomes]
