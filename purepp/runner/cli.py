"""The `purepp` command: `purepp run` drives a PP x DP decode loop; `purepp check`
matches the collectives of per-rank effect logs."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import attrs

from purepp.errors import PureppError
from purepp.runner.parity import ParityVerdict, check_parity
from purepp.runner.settings import RunSettings
from purepp.runner.worker import add_run_options, settings_from_args

__all__ = ["RunSummary", "launch", "main", "summarise_against_reference"]


@attrs.frozen(kw_only=True)
class RunSummary:
    """What `purepp run` reports."""

    settings: RunSettings  # the run's settings
    steps: int  # steps each rank ran
    requests: int  # requests in the workload
    tokens: int  # output tokens produced
    seconds: float  # wall time of the slowest rank's loop
    aborted: int  # requests aborted in flight
    drafts_proposed: int  # drafts verified by the last stages
    drafts_accepted: int  # of which accepted
    padded_tokens: int  # tokens the last stages ran beyond their batches (agreed shapes)
    eager_steps: int  # steps a DP group agreed to run eager, summed over the last stages
    verdict: ParityVerdict  # against the single-stage run

    def render(self) -> str:
        s = self.settings
        rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
        accepted = (
            f"{self.drafts_accepted}/{self.drafts_proposed}" if self.drafts_proposed else "none"
        )
        return "\n".join(
            [
                f"purepp run: pp={s.pp} x dp={s.dp} on {s.backend}, spec={s.spec}, seed={s.seed}"
                + (", relay header validated" if s.validate_header else ""),
                f"  steps            {self.steps}",
                f"  requests         {self.requests} ({self.aborted} aborted in flight)",
                f"  tokens           {self.tokens} in {self.seconds:.2f} s ({rate:.1f} tokens/s)",
                f"  drafts accepted  {accepted}",
                f"  batch shapes     {self.padded_tokens} tokens of CUDA-graph padding, "
                f"{self.eager_steps} steps agreed eager across DP",
                f"  parity           {self.verdict.render()}",
            ]
        )


_PUREPP_ERROR_EXIT = 3  # a worker that stopped on a PureppError naming its cause
_PEER_FAILURE_EXIT = 4  # a worker that stopped because a peer failed


def _blame_order(code: int) -> int:
    """Which failure to report first: a named cause, a rank killed by a signal, any
    other crash, and last the peers that failed because of it."""
    if code == _PUREPP_ERROR_EXIT:
        return 0
    if code < 0:
        return 1
    return 3 if code == _PEER_FAILURE_EXIT else 2


class _Failure(Exception):
    """A run that cannot finish: the message is for the user."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _check_before_start(settings: RunSettings, log_dir: str | None, trace: str | None) -> None:
    """Every check that can fail before a process starts."""
    if settings.backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise _Failure("--backend nccl needs CUDA, and none is available: use --backend gloo")
        if torch.cuda.device_count() < settings.world_size:
            raise _Failure(
                f"--backend nccl with pp={settings.pp} x dp={settings.dp} needs "
                f"{settings.world_size} GPUs, found {torch.cuda.device_count()}"
            )
    for what, path in (("--log-dir", log_dir), ("--trace", trace)):
        if path is None:
            continue
        folder = Path(path) if what == "--log-dir" else Path(path).parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / ".purepp-write-test"
            probe.write_text("")
            probe.unlink()
        except OSError as error:
            raise _Failure(f"{what} {path} is not writable: {error.strerror}") from error


def _own_environment() -> dict[str, str]:
    """This process's environment without a launcher's rendezvous settings: under
    torchrun, TORCHELASTIC_* would make a new world join torchrun's store."""
    return {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}


class _World:
    """The worker processes of one run, started like torchrun starts them."""

    def __init__(self, name: str, size: int, argv: list[str], work: Path) -> None:
        self.name = name
        self.work = work
        self.progress = work / "progress"
        self.progress.mkdir(parents=True)
        port = _free_port()
        self.processes: list[subprocess.Popen[bytes]] = []
        self.stderr_paths: list[Path] = []
        for rank in range(size):
            env = dict(
                _own_environment(),
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(size),
                LOCAL_WORLD_SIZE=str(size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            stderr_path = work / f"rank{rank}.stderr"
            self.stderr_paths.append(stderr_path)
            command = [sys.executable, "-m", "purepp.runner.worker", *argv]
            command += ["--out", str(work), "--progress-dir", str(self.progress)]
            with stderr_path.open("wb") as stderr:
                self.processes.append(
                    subprocess.Popen(
                        command,
                        env=env,
                        stdout=subprocess.DEVNULL,
                        stderr=stderr,
                        start_new_session=True,  # Ctrl-C reaches us; we stop them
                    )
                )

    def step_reached(self) -> tuple[int, int]:
        """The slowest rank's step and the step count."""
        reached, total = [], 0
        for rank in range(len(self.processes)):
            try:
                done, total_text = (self.progress / f"rank{rank}").read_text().split()
            except (OSError, ValueError):
                reached.append(0)
                continue
            reached.append(int(done))
            total = int(total_text)
        return min(reached, default=0), total

    def failed(self) -> str | None:
        """A message naming the rank whose error started a failure, else None.

        One rank's error makes its peers fail too (connection closed); after a
        moment for them to exit, a rank that reported a purepp error, which names
        the cause, is preferred over those.
        """
        if all(process.poll() in (None, 0) for process in self.processes):
            return None
        time.sleep(1.0)
        failures = [
            (rank, code)
            for rank, process in enumerate(self.processes)
            if (code := process.poll()) not in (None, 0)
        ]
        rank, code = min(failures, key=lambda item: (_blame_order(item[1]), item[0]))
        if code < 0:
            return f"{self.name} rank {rank} was killed by {signal.Signals(-code).name}"
        lines = self.stderr_paths[rank].read_text(errors="replace").strip().splitlines()
        last = lines[-1] if lines else "(no message)"
        return f"{self.name} rank {rank} exited with code {code}: {last}"

    def done(self) -> bool:
        return all(process.poll() == 0 for process in self.processes)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for process in self.processes:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)

    def results(self) -> list[dict[str, object]]:
        loaded: list[dict[str, object]] = json.loads((self.work / "results.json").read_text())
        return loaded


def _show_progress(world: _World, last_shown: list[int]) -> None:
    reached, total = world.step_reached()
    if not total or reached == last_shown[0]:
        return
    last_shown[0] = reached
    bar = "#" * (30 * reached // total)
    line = f"\r  step {reached:>5}/{total} [{bar:<30}]"
    if sys.stderr.isatty():
        print(line, end="", file=sys.stderr, flush=True)
    elif reached == total or reached % max(total // 10, 1) < 4:
        print(line.strip(), file=sys.stderr, flush=True)


def _wait(worlds: list[_World], timeout_s: float, show: _World) -> None:
    """Wait for every world; stop them all when a rank fails or nothing moves."""
    last_shown = [-1]
    last_move = time.monotonic()
    last_state: tuple[int, int] = (0, 0)
    while not all(world.done() for world in worlds):
        for world in worlds:
            message = world.failed()
            if message is not None:
                raise _Failure(message)
        state = show.step_reached()
        if state != last_state:
            last_state, last_move = state, time.monotonic()
        elif time.monotonic() - last_move > timeout_s + 30:
            raise _Failure(f"no rank made progress for {timeout_s + 30:.0f} s (a hang)")
        _show_progress(show, last_shown)
        time.sleep(0.1)
    _show_progress(show, last_shown)
    if sys.stderr.isatty():
        print(file=sys.stderr)


def _summarise(
    settings: RunSettings, results: list[dict[str, object]], reference: list[dict[str, object]]
) -> RunSummary:
    last_stages = [r for r in results if r["stage"] == settings.pp - 1]
    outputs: dict[int, list[int]] = {}
    finished: set[int] = set()
    aborted: set[int] = set()
    for result in last_stages:
        outputs |= {int(k): v for k, v in result["outputs"].items()}  # type: ignore[attr-defined]
        finished |= set(result["finished"])  # type: ignore[call-overload]
        aborted |= set(result["aborted"])  # type: ignore[call-overload]
    reference_outputs = {int(k): v for k, v in reference[0]["outputs"].items()}  # type: ignore[attr-defined]
    verdict = check_parity(outputs, frozenset(finished), reference_outputs)
    return RunSummary(
        settings=settings,
        steps=int(results[0]["steps"]),  # type: ignore[call-overload]
        requests=settings.requests,
        tokens=sum(len(tokens) for tokens in outputs.values()),
        seconds=max(float(r["seconds"]) for r in results),  # type: ignore[arg-type]
        aborted=len(aborted),
        drafts_proposed=sum(int(r["drafts_proposed"]) for r in last_stages),  # type: ignore[call-overload]
        drafts_accepted=sum(int(r["drafts_accepted"]) for r in last_stages),  # type: ignore[call-overload]
        padded_tokens=sum(int(r["padded_tokens"]) for r in last_stages),  # type: ignore[call-overload]
        eager_steps=sum(int(r["eager_steps"]) for r in last_stages),  # type: ignore[call-overload]
        verdict=verdict,
    )


def _worker_argv(settings: RunSettings, log_dir: str | None, trace: str | None) -> list[str]:
    argv = [
        f"--pp={settings.pp}",
        f"--dp={settings.dp}",
        f"--steps={settings.steps}",
        f"--requests={settings.requests}",
        f"--spec={settings.spec}",
        f"--seed={settings.seed}",
        f"--backend={settings.backend}",
        f"--timeout={settings.timeout_s}",
    ]
    if settings.validate_header:
        argv.append("--validate-header")
    if log_dir is not None:
        argv.append(f"--log-dir={log_dir}")
    if trace is not None:
        argv.append(f"--trace={trace}")
    return argv


def _reference_world(settings: RunSettings, work: Path) -> _World:
    """The single-stage run of the same workload, without aborts, on CPU."""
    reference = attrs.evolve(settings, pp=1, dp=1, steps=0, backend="gloo")
    return _World("reference", 1, [*_worker_argv(reference, None, None), "--no-aborts"], work)


def _wait_or_stop(worlds: list[_World], timeout_s: float, show: _World) -> None:
    try:
        _wait(worlds, timeout_s, show=show)
    except BaseException:
        for each in worlds:
            each.stop()
        raise


def launch(
    settings: RunSettings, *, log_dir: str | None = None, trace: str | None = None
) -> RunSummary:
    """Run the world and the single-stage reference side by side; summarise both."""
    _check_before_start(settings, log_dir, trace)
    if log_dir is not None:
        # The folder must hold this run's logs only: `purepp check` reads every one.
        for old_log in Path(log_dir).glob("rank-*.jsonl"):
            old_log.unlink()
    with tempfile.TemporaryDirectory(prefix="purepp-run-") as tmp:
        argv = _worker_argv(settings, log_dir, trace)
        world = _World("run", settings.world_size, argv, Path(tmp) / "run")
        reference = _reference_world(settings, Path(tmp) / "ref")
        _wait_or_stop([world, reference], settings.timeout_s, show=world)
        return _summarise(settings, world.results(), reference.results())


def summarise_against_reference(
    settings: RunSettings, results: list[dict[str, object]]
) -> RunSummary:
    """Run the single-stage reference here and summarise `results` (the gathered
    results of a world started elsewhere, e.g. by torchrun) against it."""
    with tempfile.TemporaryDirectory(prefix="purepp-ref-") as tmp:
        reference = _reference_world(settings, Path(tmp) / "ref")
        _wait_or_stop([reference], settings.timeout_s, show=reference)
        return _summarise(settings, results, reference.results())


def _run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
        summary = launch(settings, log_dir=args.log_dir, trace=args.trace)
    except PureppError as error:
        print(f"purepp run: {error}", file=sys.stderr)
        return 2
    except _Failure as failure:
        print(f"purepp run: {failure}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\npurepp run: interrupted; every rank was stopped", file=sys.stderr)
        return 130
    print(summary.render())
    if args.log_dir is not None:
        print(f"  effect logs      {args.log_dir} (check them with: purepp check {args.log_dir})")
    if args.trace is not None:
        print(f"  trace            {args.trace} (open it in the Perfetto UI)")
    return 0 if summary.verdict.ok else 1


def _check(args: argparse.Namespace) -> int:
    from purepp.effects.checker import check_log_dir

    return check_log_dir(args.log_dir)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="purepp", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a PP x DP decode loop, checked against PP=1")
    add_run_options(run)
    run.set_defaults(handler=_run)
    check = commands.add_parser("check", help="match the collectives of per-rank effect logs")
    check.add_argument("log_dir", help="a folder of per-rank logs (purepp run --log-dir)")
    check.set_defaults(handler=_check)
    args = parser.parse_args(argv)
    code: int = args.handler(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
