"""The `purepp` command: `purepp run` drives a PP x DP decode loop; `purepp check`
matches the collectives of per-rank effect logs.

Exit codes: 0 ok; 1 parity mismatch, nothing compared, or `check` found a problem;
2 refused before anything started (a bad option, path or log folder); 3 a rank or
the reference process crashed, froze or timed out; 128 + the signal's number when
interrupted (130 Ctrl-C, 129 SIGHUP, 143 SIGTERM), after stopping every process.
"""

from __future__ import annotations

import argparse
import io
import os
import shlex
import signal
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from purepp.errors import PureppError
from purepp.runner.exit_codes import Exit, interrupted
from purepp.runner.options import (
    CLI,
    LAUNCH,
    OptionParser,
    Spelling,
    UsageError,
    add_run_options,
    settings_from_args,
)

if TYPE_CHECKING:
    from purepp.runner.settings import RunSettings
    from purepp.runner.summary import RunSummary

__all__ = ["launch", "main"]


def launch(
    settings: RunSettings,
    *,
    log_dir: str | os.PathLike[str] | None = None,
    trace: str | os.PathLike[str] | None = None,
    run_id: str | None = None,
    progress: bool = True,
    spelling: Spelling = LAUNCH,
) -> RunSummary:
    """`purepp.runner.supervise.launch`, imported when a run starts (`--help` stays fast).

    Its errors name `launch` and its arguments; `purepp run`'s name its flags."""
    from purepp.runner.supervise import launch as start

    return start(
        settings,
        log_dir=log_dir,
        trace=trace,
        run_id=run_id,
        progress=progress,
        spelling=spelling,
    )


def _run(args: argparse.Namespace) -> int:
    from purepp.runner.supervise import Interrupted, RankFailure

    run_id = uuid.uuid4().hex
    try:
        settings = settings_from_args(args)
        summary = launch(
            settings, log_dir=args.log_dir, trace=args.trace, run_id=run_id, spelling=CLI
        )
    except UsageError as error:
        print(error, file=sys.stderr)
        return Exit.USAGE
    except RankFailure as failure:
        print(f"purepp run: {failure}", file=sys.stderr)
        return Exit.RANK_FAILED
    except PureppError as error:  # a rank's own report reached us: the run failed
        print(f"purepp run: {error}", file=sys.stderr)
        return Exit.RANK_FAILED
    except Interrupted as stop:
        _stop_taking_interrupts(args)
        print(
            f"\npurepp run: interrupted by {stop}; every rank and the reference were stopped",
            file=sys.stderr,
        )
        return interrupted(stop.signum)
    except KeyboardInterrupt:  # Ctrl-C before the run's own handler was in place, or after
        _stop_taking_interrupts(args)
        print("\npurepp run: interrupted; nothing was left running", file=sys.stderr)
        return interrupted(signal.SIGINT)
    print(summary.render())
    print(f"  run id           {run_id}")
    if args.log_dir is not None:
        command = f"purepp check {shlex.quote(args.log_dir)}"
        print(f"  effect logs      {args.log_dir} (check them with: {command})")
    if args.trace is not None:
        print(f"  trace            {args.trace} (open it in the Perfetto UI)")
    return Exit.OK if summary.verdict.ok else Exit.FAILED


def _check(args: argparse.Namespace) -> int:
    folder = Path(args.log_dir)
    try:
        if not args.log_dir.strip():
            what = "is empty"
        elif folder.is_dir():
            what = ""
        else:
            what = "is not a folder" if folder.exists() else "does not exist"
    except (OSError, ValueError) as error:  # a name too long, a NUL in it
        what = f"cannot be read ({getattr(error, 'strerror', None) or error})"
    if what:
        raise UsageError(
            "purepp check",
            f"{args.log_dir!r} {what}",
            "pass the folder given to `purepp run --log-dir`",
        )
    from purepp.effects.checker import check_log_dir  # the log reader, only when needed

    # The checker prints a finding (exit 1) or "ok" (exit 0) for stdout, and a log it
    # cannot read (exit 2) as an error: that goes to stderr.
    report = io.StringIO()
    code = check_log_dir(folder, out=report, backend=args.backend)
    text = report.getvalue()
    if code == Exit.USAGE:
        sys.stderr.write(text)
    else:
        sys.stdout.write(text)
    return code


def _parser() -> OptionParser:
    parser = OptionParser(prog="purepp", description=__doc__, formatter_class=_Formatter)
    # The installed distribution's version (pyproject.toml's), read only when asked.
    parser.add_argument("--version", action=_Version, nargs=0, help="print the version and exit")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OptionParser)
    run = commands.add_parser("run", help="run a PP x DP decode loop, checked against PP=1")
    add_run_options(run)
    run.set_defaults(handler=_run)
    check = commands.add_parser("check", help="match the collectives of per-rank effect logs")
    check.add_argument("log_dir", help="a folder of per-rank logs (purepp run --log-dir)")
    check.add_argument(
        "--backend",
        choices=("nccl", "gloo"),
        help="what the logs ran on, for logs whose header does not say (a scripted run's; "
        "default: judged as nccl, with gloo's verdict added where it differs)",
    )
    check.set_defaults(handler=_check)
    return parser


class _Version(argparse.Action):
    """`purepp --version`: the installed distribution's version."""

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            text = version("purepp")
        except PackageNotFoundError:  # run from a checkout that was never installed
            text = "(not installed)"
        print(f"purepp {text}")
        parser.exit()


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's lines (the exit-code table) as written."""


def _stop_taking_interrupts(args: argparse.Namespace) -> None:
    """The program is ending on an interrupt: a further Ctrl-C (a key held down) must not
    kill it before it has said why and exited 130. Not when main is called in-process."""
    if args.program:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def main(argv: Sequence[str] | None = None) -> int:
    """The `purepp` command (`argv` None: the program's own arguments); its exit code."""
    try:
        args = _parser().parse_args(argv)
        args.program = argv is None
        try:
            code: int = args.handler(args)
        except KeyboardInterrupt:  # a second Ctrl-C while the first was being reported
            _stop_taking_interrupts(args)
            return interrupted(signal.SIGINT)
    except UsageError as error:
        print(error, file=sys.stderr)
        return Exit.USAGE
    return code


if __name__ == "__main__":
    sys.exit(main())
