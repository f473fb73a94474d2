"""One rank's process: torchrun-compatible.

`purepp run` starts one of these per rank with torchrun's environment variables
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); across machines, start
them with torchrun itself:

    torchrun --nnodes 2 --nproc-per-node 2 ... -m purepp.runner.worker --pp 2 --dp 2 --out DIR

Rank 0 gathers every rank's result (and trace) and writes `DIR/results.json`.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
from collections.abc import Callable, Sequence
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
from purepp.errors import PeerFailureError, PureppError
from purepp.layout import Layout
from purepp.runner.exit_codes import Exit, RankExit
from purepp.runner.loop import RankLoop
from purepp.runner.options import (
    OptionParser,
    UsageError,
    add_run_options,
    settings_from_args,
)
from purepp.runner.progress import KILL_RANK_ENV, PARENT_PID_ENV, STOP_RANK_ENV, Heartbeat
from purepp.runner.results import RankResult, write_results
from purepp.runner.settings import RunSettings
from purepp.runner.supervise import summarise_against_reference, without_source_paths
from purepp.runner.trace import TraceEvent, Tracer
from purepp.runner.workload import make_workload

__all__ = [
    "KILL_RANK_ENV",
    "STOP_RANK_ENV",
    "add_run_options",
    "main",
    "run_rank",
    "settings_from_args",
]


def _fault_step(variable: str, who: str) -> int | None:
    """The step after which fault `variable` ("WHO@STEP") strikes `who`, if it names it."""
    value = os.environ.get(variable, "")
    return int(value.split("@")[1]) if value.startswith(f"{who}@") else None


def _on_step(who: str, heartbeat: Heartbeat | None) -> Callable[[int], None]:
    kill_step = _fault_step(KILL_RANK_ENV, who)
    stop_step = _fault_step(STOP_RANK_ENV, who)

    def step_done(step: int) -> None:
        if heartbeat is not None:
            heartbeat.step_done(step + 1)
        if step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == stop_step:
            os.kill(os.getpid(), signal.SIGSTOP)

    return step_done


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
    abort_requests: bool = True,
    run_id: str | None = None,
) -> tuple[RankResult, ...] | None:
    """Run one rank to the end. Rank 0 gathers every rank's result, writes them to
    `out_dir` (and the merged trace to `trace_path`) and returns them; others return
    None. `on_step(step)` is called after each step; `run_id` goes in the log header."""
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
    try:
        world = Layout(pp=settings.pp, dp=settings.dp)
        groups = build_communicators(
            pp_groups=world.pp_groups,
            dp_groups=world.dp_groups,
            relay_backend="nccl" if settings.backend == "nccl" else "gloo",
            timeout=timeout,
        )
        results_group = dist.new_group(backend="gloo", timeout=timeout)
        env = TorchInterpreter(device=device, groups=groups, rank=rank)
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
        gathered: list[object] | None = [None] * settings.world_size if rank == 0 else None
        payload = (result, [] if tracer is None else tracer.events)
        dist.gather_object(payload, gathered, dst=0, group=results_group)
        if gathered is None:
            return None
        return _write_outputs(gathered, out_dir, trace_path)
    finally:
        dist.destroy_process_group()


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
        partial = path.with_name(path.name + ".partial")
        partial.write_text(
            json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}), encoding="utf-8"
        )
        os.replace(partial, path)
    return tuple(results)


_PEER_SIGNS = ("timed out", "connection closed", "connection reset", "broken pipe", "peer")


def _is_peer_failure(error: Exception) -> bool:
    """torch.distributed's way of saying a peer died or went silent (activations, gather)."""
    if isinstance(error, ConnectionError | dist.DistError):
        return True
    text = str(error).lower()
    return any(sign in text for sign in _PEER_SIGNS)


def _print_verdict(settings: RunSettings, results: tuple[RankResult, ...] | None) -> int:
    if results is None:
        raise RuntimeError("only rank 0 gathers the results")  # caller checks rank 0
    summary = summarise_against_reference(settings, results)
    print(summary.render())
    return Exit.OK if summary.verdict.ok else Exit.FAILED


def main(argv: Sequence[str] | None = None) -> int:
    parser = OptionParser(prog="python -m purepp.runner.worker")
    add_run_options(parser)
    parser.add_argument("--out", default=None, help="rank 0 writes results.json here")
    parser.add_argument("--progress-dir", default=None, help="each rank's heartbeat file here")
    parser.add_argument(
        "--verdict",
        action="store_true",
        help="rank 0 then runs the single-stage reference and prints the parity summary",
    )
    parser.add_argument(
        "--reference",
        action="store_true",
        help="this is the single-stage reference: no request is aborted",
    )
    parser.add_argument("--run-id", default=None, help="the run's id, for the log headers")
    rank = int(os.environ.get("RANK", "0"))
    try:
        args = parser.parse_args(argv)
        settings = settings_from_args(args, call=parser.prog)
    except UsageError as error:
        print(error, file=sys.stderr)
        return Exit.USAGE
    parent = os.environ.get(PARENT_PID_ENV)
    heartbeat = Heartbeat(
        None if args.progress_dir is None else Path(args.progress_dir) / f"rank{rank}",
        total=settings.total_steps,
        parent_pid=int(parent) if parent and parent.isdigit() else None,
    ).start()
    try:
        gathered = run_rank(
            settings,
            rank=rank,
            local_rank=int(os.environ.get("LOCAL_RANK", str(rank))),
            init_method="env://",
            out_dir=args.out,
            log_dir=args.log_dir,
            trace_path=args.trace,
            on_step=_on_step("reference" if args.reference else str(rank), heartbeat),
            abort_requests=not args.reference,
            run_id=args.run_id,
        )
        if args.verdict and rank == 0:
            return _print_verdict(settings, gathered)
    except PeerFailureError as error:
        print(f"purepp: rank {rank}: {error}", file=sys.stderr)
        return RankExit.PEER_FAILURE
    except PureppError as error:
        print(f"purepp: rank {rank}: {error}", file=sys.stderr)
        return RankExit.PUREPP_ERROR
    except (RuntimeError, ConnectionError) as error:
        if not _is_peer_failure(error):
            raise  # a bug, not a peer: the traceback is the report
        text = str(error).strip()
        first_line = without_source_paths(text.splitlines()[0]) if text else repr(error)
        print(f"purepp: rank {rank}: a peer failed or timed out: {first_line}", file=sys.stderr)
        return RankExit.PEER_FAILURE
    return RankExit.OK


if __name__ == "__main__":
    sys.exit(main())
