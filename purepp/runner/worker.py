"""One rank's process: torchrun-compatible.

`purepp run` starts one of these per rank with torchrun's environment variables
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); across machines, start
them with torchrun itself:

    torchrun --nnodes 2 --nproc-per-node 2 ... -m purepp.runner.worker --pp 2 --dp 2 --out DIR

Rank 0 gathers every rank's result (and trace) and writes `DIR/results.json`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from purepp.errors import PeerFailureError, PureppError
from purepp.runner.exit_codes import Exit, RankExit
from purepp.runner.options import (
    OptionParser,
    Spelling,
    UsageError,
    add_run_options,
    check_log_dir,
    check_trace,
    settings_from_args,
)
from purepp.runner.progress import (
    KILL_RANK_ENV,
    PARENT_PID_ENV,
    STOP_RANK_ENV,
    STUCK_RANK_ENV,
    Heartbeat,
)
from purepp.runner.results import RankResult
from purepp.runner.settings import RunSettings
from purepp.runner.supervise import summarise_against_reference, without_source_paths

__all__ = [
    "KILL_RANK_ENV",
    "STOP_RANK_ENV",
    "add_run_options",
    "main",
    "settings_from_args",
]


def _fault_step(variable: str, who: str) -> int | None:
    """The step after which fault `variable` ("WHO@STEP") strikes `who`, if it names it."""
    value = os.environ.get(variable, "")
    return int(value.split("@")[1]) if value.startswith(f"{who}@") else None


def _on_step(who: str, heartbeat: Heartbeat | None) -> Callable[[int], None]:
    kill_step = _fault_step(KILL_RANK_ENV, who)
    stop_step = _fault_step(STOP_RANK_ENV, who)
    stuck_step = _fault_step(STUCK_RANK_ENV, who)

    def step_done(step: int) -> None:
        if heartbeat is not None:
            heartbeat.step_done(step + 1)
        if step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == stop_step:
            os.kill(os.getpid(), signal.SIGSTOP)
        while step == stuck_step:
            time.sleep(1.0)

    return step_done


_PEER_SIGNS = ("timed out", "connection closed", "connection reset", "broken pipe", "peer")


def _is_peer_failure(error: Exception) -> bool:
    """torch.distributed's way of saying a peer died or went silent (activations, gather):
    a DistError, a ConnectionError, or a RuntimeError saying so."""
    if isinstance(error, ConnectionError):
        return True
    if any(cls.__name__ == "DistError" for cls in type(error).__mro__):
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
        # Under torchrun no launcher made or probed these: each rank does (idempotent).
        if args.log_dir is not None:
            check_log_dir(args.log_dir, spelling=Spelling(parser.prog, flags=True))
        if args.trace is not None:
            check_trace(args.trace, spelling=Spelling(parser.prog, flags=True))
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
        return _run(args, settings, rank, heartbeat)
    finally:
        # Done or failed, the process exits now: the silence of its shutdown (torch's
        # teardown can hold the interpreter for a second) is no freeze.
        heartbeat.leaving()


def _run(args: argparse.Namespace, settings: RunSettings, rank: int, heartbeat: Heartbeat) -> int:
    """Run this rank; a failure becomes one line on stderr and a RankExit code."""
    try:
        # torch loads only now, so the launcher sees this rank beat while it does.
        from purepp.runner.rank_run import run_rank

        gathered = run_rank(
            settings,
            rank=rank,
            local_rank=int(os.environ.get("LOCAL_RANK", str(rank))),
            init_method="env://",
            out_dir=args.out,
            log_dir=args.log_dir,
            trace_path=args.trace,
            on_step=_on_step("reference" if args.reference else str(rank), heartbeat),
            on_loop_end=heartbeat.loop_ended,
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
