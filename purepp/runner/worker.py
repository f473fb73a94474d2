"""One rank's process: torchrun-compatible.

`purepp run` starts one of these per rank with torchrun's environment variables
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); across machines, start
them with torchrun itself:

    torchrun --nnodes 2 --nproc-per-node 2 ... -m purepp.runner.worker --pp 2 --dp 2 --out DIR

Rank 0 gathers every rank's result (and trace) and writes `DIR/results.json`.
"""

from __future__ import annotations

import argparse
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
from purepp.effects.log import Layout, LogHeader, Recorder, log_file_name
from purepp.effects.torch_interpreter import (
    TorchInterpreter,
    build_communicators,
    init_distributed,
)
from purepp.errors import PeerFailureError, PureppError
from purepp.runner.loop import RankLoop
from purepp.runner.settings import RunSettings
from purepp.runner.trace import Tracer
from purepp.runner.workload import make_workload

__all__ = ["KILL_RANK_ENV", "add_run_options", "main", "run_rank", "settings_from_args"]


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options `purepp run` and the worker share."""
    defaults = RunSettings()
    parser.add_argument("--pp", type=int, default=defaults.pp, help="pipeline stages")
    parser.add_argument("--dp", type=int, default=defaults.dp, help="data-parallel replicas")
    parser.add_argument("--steps", type=int, default=0, help="decode steps (0: until done)")
    parser.add_argument("--requests", type=int, default=defaults.requests, help="requests")
    parser.add_argument("--spec", type=int, default=defaults.spec, help="speculative steps")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="workload seed")
    parser.add_argument("--backend", default=defaults.backend, help="gloo (CPU) or nccl (GPUs)")
    parser.add_argument(
        "--timeout", type=float, default=defaults.timeout_s, help="seconds before a peer is dead"
    )
    parser.add_argument(
        "--validate-header",
        action="store_true",
        help="send a [step, requests] header first each relay step; receivers check it",
    )
    parser.add_argument(
        "--log-dir", default=None, help="write one effect log per rank here (replacing old ones)"
    )
    parser.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace here")


def settings_from_args(args: argparse.Namespace, **overrides: object) -> RunSettings:
    values: dict[str, object] = dict(
        pp=args.pp,
        dp=args.dp,
        steps=args.steps,
        requests=args.requests,
        spec=args.spec,
        seed=args.seed,
        backend=args.backend,
        timeout_s=args.timeout,
        validate_header=args.validate_header,
    )
    values.update(overrides)
    return RunSettings(**values)  # type: ignore[arg-type]


# Fault injection for tests: "RANK@STEP" kills that rank abruptly after that step.
KILL_RANK_ENV = "PUREPP_FAULT_KILL_RANK"


def _progress_writer(progress_dir: str | None, rank: int, total: int) -> Callable[[int], None]:
    path = None if progress_dir is None else Path(progress_dir) / f"rank{rank}"
    kill_at = os.environ.get(KILL_RANK_ENV, "")
    kill_step = int(kill_at.split("@")[1]) if kill_at.startswith(f"{rank}@") else None

    def write(step: int) -> None:
        if path is not None and (step % 4 == 0 or step + 1 == total):
            path.write_text(f"{step + 1} {total}\n", encoding="ascii")
        if step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)

    return write


def run_rank(
    settings: RunSettings,
    *,
    rank: int,
    local_rank: int,
    init_method: str,
    out_dir: str | None,
    log_dir: str | None,
    trace_path: str | None,
    progress_dir: str | None = None,
    abort_requests: bool = True,
) -> list[dict[str, object]] | None:
    """Run one rank to the end. Rank 0 gathers every rank's result, writes them to
    `out_dir` (and the merged trace to `trace_path`) and returns them; others return None."""
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
            header = LogHeader(
                rank=rank,
                world=world,
                config=json.loads(json.dumps(attrs.asdict(settings))),
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
            progress=_progress_writer(progress_dir, rank, settings.total_steps),
        )
        result = loop.run()
        gathered: list[object] | None = [None] * settings.world_size if rank == 0 else None
        payload = (attrs.asdict(result), [] if tracer is None else tracer.events)
        dist.gather_object(payload, gathered, dst=0, group=results_group)
        if gathered is None:
            return None
        return _write_outputs(gathered, out_dir, trace_path)
    finally:
        dist.destroy_process_group()


def _write_outputs(
    gathered: list[object], out_dir: str | None, trace_path: str | None
) -> list[dict[str, object]]:
    results: list[dict[str, object]] = [item[0] for item in gathered]  # type: ignore[index]
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "results.json").write_text(json.dumps(results), encoding="utf-8")
    if trace_path is not None:
        events = [event for item in gathered for event in item[1]]  # type: ignore[index]
        Path(trace_path).write_text(
            json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}), encoding="utf-8"
        )
    return results


def _print_verdict(settings: RunSettings, results: list[dict[str, object]] | None) -> int:
    from purepp.runner.cli import summarise_against_reference

    if results is None:
        raise RuntimeError("only rank 0 gathers the results")  # caller checks rank 0
    summary = summarise_against_reference(settings, results)
    print(summary.render())
    return 0 if summary.verdict.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m purepp.runner.worker")
    add_run_options(parser)
    parser.add_argument("--out", default=None, help="rank 0 writes results.json here")
    parser.add_argument("--progress-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--verdict",
        action="store_true",
        help="rank 0 then runs the single-stage reference and prints the parity summary",
    )
    parser.add_argument("--no-aborts", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        settings = settings_from_args(args)
        gathered = run_rank(
            settings,
            rank=rank,
            local_rank=int(os.environ.get("LOCAL_RANK", str(rank))),
            init_method="env://",
            out_dir=args.out,
            log_dir=args.log_dir,
            trace_path=args.trace,
            progress_dir=args.progress_dir,
            abort_requests=not args.no_aborts,
        )
        if args.verdict and rank == 0:
            return _print_verdict(settings, gathered)
    except PeerFailureError as error:
        print(f"purepp: rank {rank}: {error}", file=sys.stderr)
        return 4
    except PureppError as error:
        print(f"purepp: rank {rank}: {error}", file=sys.stderr)
        return 3
    except (RuntimeError, ConnectionError) as error:
        # torch.distributed reports a dead or silent peer this way (activations, gather).
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        print(f"purepp: rank {rank}: a peer failed or timed out: {first_line}", file=sys.stderr)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
