"""One rank's run on torch.distributed: the part of a rank process that needs torch.

`python -m purepp.runner.worker` imports this only after its heartbeat beats, so a
rank frozen while torch loads is still seen (and named) by `purepp run`.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Callable
from pathlib import Path

import attrs
import torch
import torch.distributed as dist

from purepp.effects.interpreter import Interpreter
from purepp.effects.log import LogHeader, Recorder, log_file_name
from purepp.effects.torch_interpreter import (
    TorchInterpreter,
    build_communicators,
    init_distributed,
)
from purepp.layout import Layout
from purepp.runner.loop import RankLoop
from purepp.runner.results import RankResult, write_results
from purepp.runner.settings import RunSettings
from purepp.runner.trace import TraceEvent, Tracer, partial_trace
from purepp.runner.workload import make_workload

__all__ = ["run_rank"]


def run_rank(
    settings: RunSettings,
    *,
    rank: int,
    local_rank: int,
    init_method: str,
    out_dir: str | None,
    log_dir: str | None,
    trace_path: str | None,
    on_step: Callable[[int], None] = lambda step: None,
    on_loop_end: Callable[[int], None] = lambda steps: None,
    abort_requests: bool = True,
    run_id: str | None = None,
) -> tuple[RankResult, ...] | None:
    """Run one rank to the end. Rank 0 gathers every rank's result, writes them to
    `out_dir` (and the merged trace to `trace_path`) and returns them; others return
    None. `on_step(step)` is called after each step and `on_loop_end(steps)` after the last;
    `run_id` goes in the log header."""
    timeout = datetime.timedelta(seconds=settings.timeout_s)
    if settings.backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    init_distributed(
        backend="nccl" if settings.backend == "nccl" else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=settings.world_size,
        timeout=timeout,
    )
    world = Layout(pp=settings.pp, dp=settings.dp)
    groups = build_communicators(
        pp_groups=world.pp_groups,
        dp_groups=world.dp_groups,
        relay_backend="nccl" if settings.backend == "nccl" else "gloo",
        timeout=timeout,
    )
    results_group = dist.new_group(backend="gloo", timeout=timeout)
    mode = settings.interpreter
    env = TorchInterpreter(
        device=device,
        groups=groups,
        rank=rank,
        checked=mode == "checked",
        plans=mode in ("plan", "captured"),
        capture=mode == "captured",
        # A receive's outputs are held for the ring's depth (pp) and a step more.
        capture_copies=settings.pp + 1,
    )
    tracer = Tracer(rank=rank, inner=env) if trace_path else None
    perform: Interpreter = env if tracer is None else tracer
    if log_dir is not None:
        config = json.loads(json.dumps(attrs.asdict(settings)))
        header = (
            LogHeader(rank=rank, world=world, config=config)
            if run_id is None
            else LogHeader.for_run(rank=rank, world=world, config=config, run_id=run_id)
        )
        perform = Recorder(header, perform, path=Path(log_dir) / log_file_name(rank))
    workload_config = settings.workload
    if not abort_requests:
        workload_config = attrs.evolve(workload_config, abort_fraction=0.0)
    loop = RankLoop(
        settings,
        make_workload(workload_config),
        rank=rank,
        env=env,
        perform=perform,
        activation_group=None,
        progress=on_step,
    )
    result = loop.run()
    on_loop_end(result.steps)
    gathered: list[object] | None = [None] * settings.world_size if rank == 0 else None
    payload = (result, [] if tracer is None else tracer.events)
    dist.gather_object(payload, gathered, dst=0, group=results_group)
    outputs = None if gathered is None else _write_outputs(gathered, out_dir, trace_path)
    # Only a rank that succeeded tears its groups down: a failing one exits at once,
    # rather than wait on the peer that failed (holding the interpreter meanwhile).
    dist.destroy_process_group()
    return outputs


def _write_outputs(
    gathered: list[object], out_dir: str | None, trace_path: str | None
) -> tuple[RankResult, ...]:
    results: list[RankResult] = []
    events: list[TraceEvent] = []
    for item in gathered:
        match item:
            case (RankResult() as result, list() as trace):
                results.append(result)
                events.extend(trace)
            case _:
                raise RuntimeError(f"gathered {type(item).__name__}, not a rank's result")
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        write_results(Path(out_dir) / "results.json", results)
    if trace_path is not None:
        path = Path(trace_path)
        partial = partial_trace(path)
        partial.write_text(
            json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}), encoding="utf-8"
        )
        os.replace(partial, path)
    return tuple(results)
