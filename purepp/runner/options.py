"""The options of `purepp run` (and of the rank processes it starts), checked before
any process starts.

Every check names the option, the value as typed, what is wrong and the fix, in one
line. Numbers are parsed here rather than by argparse, so a bad one gets that line
too instead of argparse's usage block. No torch here.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import shlex
from pathlib import Path
from typing import NoReturn

import attrs

from purepp._checks import INT32_MAX, as_int
from purepp.errors import ConfigError
from purepp.relay import Wire
from purepp.runner.settings import (
    COUNT_LIMITS,
    INTERPRETER_MODES,
    MAX_SPECULATIVE_STEPS,
    MAX_TIMEOUT_S,
    MIN_TIMEOUT_S,
    RunSettings,
)
from purepp.runner.trace import partial_trace

__all__ = [
    "CLI",
    "LAUNCH",
    "MAX_TIMEOUT_S",
    "OptionParser",
    "Spelling",
    "UsageError",
    "add_run_options",
    "check_log_dir",
    "check_trace",
    "settings_from_args",
]


class UsageError(ConfigError):
    """An option or argument that cannot work; nothing was started."""


def _shown(value: object) -> str:
    """The value as the user would have typed it: `''` for an empty string."""
    return shlex.quote(value) if isinstance(value, str) else str(value)


@attrs.frozen
class Spelling:
    """How an error names the call and its settings: as `purepp run`'s flags, or as the
    keyword arguments of `launch` when a research runner calls it from Python."""

    call: str  # "purepp run", a rank process's program, or "launch"
    flags: bool  # --log-dir logs (True) or log_dir='logs' (False)

    def name(self, setting: str) -> str:
        """`log_dir` as `--log-dir`, or as itself."""
        return f"--{setting.replace('_', '-')}" if self.flags else setting

    def given(self, setting: str, value: object) -> str:
        """A setting with its value, as the user gave it."""
        if self.flags:
            return f"{self.name(setting)} {_shown(value)}"
        return f"{setting}={value!r}"

    def refuse(self, setting: str, value: object, problem: str, fix: str) -> UsageError:
        """The error refusing `setting`'s `value`, for `problem`."""
        return UsageError(self.call, f"{self.given(setting, value)} {problem}", fix)


CLI = Spelling("purepp run", flags=True)
LAUNCH = Spelling("launch", flags=False)

_WIRES = tuple(wire.value for wire in Wire)


class OptionParser(argparse.ArgumentParser):
    """argparse, but a mistake is one UsageError line instead of a usage block and exit."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(self.prog, message, f"see `{self.prog} --help`")


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options `purepp run` and the rank processes share (parsed by settings_from_args)."""
    d = RunSettings()
    add = parser.add_argument
    add("--pp", default=d.pp, help=f"pipeline stages, 1..--num-layers (default {d.pp})")
    add("--dp", default=d.dp, help=f"data-parallel replicas, 1 or more (default {d.dp})")
    add("--steps", default=d.steps, help="decode steps, for the reference too (0: until done)")
    add("--requests", default=d.requests, help=f"requests, 1 or more (default {d.requests})")
    add(
        "--spec",
        default=d.spec,
        help=f"speculative steps, 0..{MAX_SPECULATIVE_STEPS} (default {d.spec})",
    )
    add("--seed", default=d.seed, help=f"workload seed, 0 or more (default {d.seed})")
    add(
        "--backend",
        default=d.backend,
        help=f"gloo (CPU) or nccl, a GPU per rank (default {d.backend})",
    )
    add(
        "--timeout",
        default=d.timeout_s,
        help=f"seconds before a silent peer is reported (default {d.timeout_s:g})",
    )
    add(
        "--validate-header",
        action="store_true",
        help="send a [step, requests] header first each relay step; receivers check it",
    )
    add(
        "--wire",
        default=d.wire,
        help="the relay's wire: seed (the seed's broadcasts), packed (one aligned broadcast "
        "per step) or fixed (packed, rows padded to a bucket, sent every step)",
    )
    add(
        "--overlap-agreement",
        action="store_true",
        help="schedule one step ahead and run its DP agreement during this step's forward",
    )
    add(
        "--interpreter",
        default=d.interpreter,
        help="how effects run: eager (default), checked (every effect validated), plan "
        "(repeated batches run as lowered plans) or captured (plans replayed as CUDA "
        "graphs; --backend nccl)",
    )
    add("--num-layers", default=d.num_layers, help=f"toy model layers (default {d.num_layers})")
    add(
        "--max-num-reqs",
        default=d.max_num_reqs,
        help=f"request slots per replica (default {d.max_num_reqs})",
    )
    add(
        "--max-num-batched-tokens",
        default=d.max_num_batched_tokens,
        help=f"token budget per step (default {d.max_num_batched_tokens})",
    )
    add(
        "--chunk-size", default=d.chunk_size, help=f"longest prefill chunk (default {d.chunk_size})"
    )
    add(
        "--capture-sizes",
        default=",".join(map(str, d.capture_sizes)),
        help="CUDA-graph token sizes, increasing, comma-separated (default "
        f"{','.join(map(str, d.capture_sizes))})",
    )
    add("--log-dir", default=None, help="write one effect log per rank here (replacing old ones)")
    add("--trace", default=None, help="write a Chrome/Perfetto trace to this file")


def _decimal(text: str) -> int:
    """A whole number written in ASCII decimal digits (int() also takes "1_0" and other
    scripts' digits, which no one means on a command line)."""
    digits = text.strip().lstrip("+-")
    if not (digits.isascii() and digits.isdigit()):
        raise ValueError(text)
    return int(text)


def _whole(
    spelling: Spelling, setting: str, value: object, *, low: int, high: int | None, fix: str
) -> int:
    if isinstance(value, bool):
        raise spelling.refuse(setting, value, "is not a whole number", fix)
    if isinstance(value, int):
        number = value
    else:
        try:
            number = _decimal(str(value))
        except ValueError:
            raise spelling.refuse(setting, value, "is not a whole number", fix) from None
    if number < low:
        raise spelling.refuse(setting, value, f"is below {low}", fix)
    if high is not None and number > high:
        raise spelling.refuse(setting, value, f"is above {high}", fix)
    return number


def _timeout(spelling: Spelling, value: object) -> float:
    example = spelling.given("timeout", 60)
    fix = f"pass {MIN_TIMEOUT_S:g} to {MAX_TIMEOUT_S:g} seconds, e.g. {example}"
    if isinstance(value, bool):
        raise spelling.refuse("timeout", value, "is not a number", fix)
    try:
        seconds = float(value) if isinstance(value, int | float) else float(str(value).strip())
    except ValueError:
        raise spelling.refuse("timeout", value, "is not a number", fix) from None
    if not math.isfinite(seconds):
        raise spelling.refuse("timeout", value, "is not finite", fix)
    if seconds <= 0:
        raise spelling.refuse("timeout", value, "is not above 0", fix)
    if seconds < MIN_TIMEOUT_S:  # the ranks' process groups count whole milliseconds
        raise spelling.refuse("timeout", value, f"is below {MIN_TIMEOUT_S:g} s", fix)
    if seconds > MAX_TIMEOUT_S:
        raise spelling.refuse("timeout", value, f"is above {MAX_TIMEOUT_S:g} s (a day)", fix)
    return seconds


def settings_from_args(
    args: argparse.Namespace, *, call: str = "purepp run", **overrides: object
) -> RunSettings:
    """The run's settings from parsed options (`add_run_options`), each checked.

    `overrides` replace options by RunSettings field name (e.g. `steps=0`); they are
    checked the same way. Raises UsageError naming the first bad option.
    """
    raw: dict[str, object] = {
        "pp": args.pp,
        "dp": args.dp,
        "steps": args.steps,
        "requests": args.requests,
        "spec": args.spec,
        "seed": args.seed,
        "backend": args.backend,
        "timeout_s": args.timeout,
        "validate_header": args.validate_header,
        "overlap_agreement": args.overlap_agreement,
        "wire": args.wire,
        "interpreter": args.interpreter,
        "num_layers": args.num_layers,
        "max_num_reqs": args.max_num_reqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "chunk_size": args.chunk_size,
        "capture_sizes": args.capture_sizes,
    }
    raw.update(overrides)
    spelling = Spelling(call, flags=True)
    backend = raw["backend"]
    if backend not in ("gloo", "nccl"):
        fix = "use --backend gloo or --backend nccl"
        raise spelling.refuse("backend", backend, "is not a backend", fix)
    validate_header = raw["validate_header"]
    if not isinstance(validate_header, bool):
        raise spelling.refuse("validate_header", validate_header, "is not a flag", "omit a value")
    wire = raw["wire"]
    if wire not in _WIRES:
        fix = f"use --wire {' or '.join(_WIRES)}"
        raise spelling.refuse("wire", wire, "is not a wire format", fix)
    interpreter = raw["interpreter"]
    if interpreter not in INTERPRETER_MODES:
        fix = f"use --interpreter {' or '.join(INTERPRETER_MODES)}"
        raise spelling.refuse("interpreter", interpreter, "is not an interpreter mode", fix)
    if interpreter == "captured" and backend != "nccl":
        fix = "add --backend nccl (CUDA graphs), or use --interpreter plan"
        raise spelling.refuse("interpreter", interpreter, "needs --backend nccl", fix)
    overlap = raw["overlap_agreement"]
    if not isinstance(overlap, bool):
        raise spelling.refuse("overlap_agreement", overlap, "is not a flag", "omit a value")

    def whole(setting: str, what: str, high: int | None = None) -> int:
        low, most = COUNT_LIMITS[setting]
        high = most if high is None else high
        fix = f"use {low}..{high} {what}"
        return _whole(spelling, setting, raw[setting], low=low, high=high, fix=fix)

    num_layers = whole("num_layers", "layers")
    counts = {
        "num_layers": num_layers,
        "pp": whole(
            "pp", "stages (one layer each at least)", min(num_layers, COUNT_LIMITS["pp"][1])
        ),
        "dp": whole("dp", "replicas"),
        "steps": whole("steps", "steps (0: until every request is done)"),
        "requests": whole("requests", "requests to compare"),
        "spec": whole("spec", "speculative steps"),
        "seed": whole("seed", "as the seed"),
        "max_num_reqs": whole("max_num_reqs", "request slots"),
        "max_num_batched_tokens": whole("max_num_batched_tokens", "tokens"),
        "chunk_size": whole("chunk_size", "tokens"),
    }
    row = 1 + counts["spec"]
    if counts["max_num_batched_tokens"] < row:
        raise spelling.refuse(
            "max_num_batched_tokens",
            raw["max_num_batched_tokens"],
            f"is below a decode row of 1 + {spelling.given('spec', counts['spec'])} tokens",
            f"use a budget of {row} tokens or more (or fewer speculative steps)",
        )
    try:
        return RunSettings(
            **counts,
            backend="nccl" if backend == "nccl" else "gloo",
            timeout_s=_timeout(spelling, raw["timeout_s"]),
            validate_header=validate_header,
            overlap_agreement=overlap,
            wire=str(wire),
            interpreter=str(interpreter),
            capture_sizes=_capture_sizes(spelling, raw["capture_sizes"]),
        )
    except ConfigError as error:  # any check the options above do not make themselves
        raise UsageError(spelling.call, error.problem, error.fix) from None


def _capture_sizes(spelling: Spelling, value: object) -> tuple[int, ...]:
    """`--capture-sizes 1,2,4` (or launch's tuple) as a tuple of strictly increasing
    token counts in 1..INT32_MAX, refused as given."""
    example = "1,2,4,8" if spelling.flags else (1, 2, 4, 8)
    fix = f"pass increasing token counts, e.g. {spelling.given('capture_sizes', example)}"
    if isinstance(value, tuple):
        sizes: tuple[object, ...] = value
    else:
        try:
            sizes = tuple(_decimal(size) for size in str(value).split(","))
        except ValueError:
            raise spelling.refuse(
                "capture_sizes", value, "is not a list of whole numbers", fix
            ) from None
    ints = [size for size in map(as_int, sizes) if size is not None and 1 <= size <= INT32_MAX]
    if len(ints) != len(sizes) or any(a >= b for a, b in itertools.pairwise(ints)):
        problem = f"is not strictly increasing token counts in 1..{INT32_MAX}"
        raise spelling.refuse("capture_sizes", value, problem, fix)
    return tuple(ints)


def _probe_folder(
    setting: str, value: str, folder: Path, fix: str, spelling: Spelling, *, length: int = 0
) -> None:
    """Create `folder` if needed and write a file in it, its name this process's own and
    at least `length` bytes long (so that a name that long fits); refuse with the OS's
    reason."""
    try:
        for above in (folder, *folder.parents):
            if above.exists():
                if not above.is_dir():
                    problem = f"cannot be written: {above} is a file, not a folder"
                    raise spelling.refuse(setting, value, problem, fix)
                break
        folder.mkdir(parents=True, exist_ok=True)
        # Each process its own name: the ranks of a run probe the same folder at once.
        name = f".purepp-write-test-{os.getpid()}"
        written = folder / name.ljust(length, "x")
        written.write_bytes(b"")
        written.unlink()
    except OSError as error:
        problem = f"is not writable ({error.strerror or error})"
        raise spelling.refuse(setting, value, problem, fix) from error


def check_log_dir(value: str, *, spelling: Spelling = CLI) -> Path:
    """The log folder (`--log-dir`, `launch(log_dir=...)`), created and known to be writable."""
    fix = f"name a folder you can write to, e.g. {spelling.given('log_dir', 'logs')}"
    if not value.strip():
        raise spelling.refuse("log_dir", value, "is empty", fix)
    folder = Path(value)
    _probe_folder("log_dir", value, folder, fix, spelling)
    return folder


def check_trace(value: str, *, spelling: Spelling = CLI) -> Path:
    """The trace file (`--trace`, `launch(trace=...)`): not a folder, in a folder that
    exists (or is created) and is writable. An existing trace is replaced at the end of
    the run."""
    fix = f"name a file you can write to, e.g. {spelling.given('trace', 'trace.json')}"
    if not value.strip():
        raise spelling.refuse("trace", value, "is empty", fix)
    path = Path(value)
    try:
        if value.endswith(os.sep) or path.is_dir():
            raise spelling.refuse("trace", value, "is a folder, but a trace is one file", fix)
        if path.exists() and not path.is_file():
            raise spelling.refuse("trace", value, "is not a regular file", fix)
    except OSError as error:  # a name too long for the file system, say
        problem = f"cannot be written ({error.strerror or error})"
        raise spelling.refuse("trace", value, problem, fix) from error
    # Probed with a name as long as the one the trace is first written under.
    length = len(os.fsencode(partial_trace(path).name))
    _probe_folder("trace", value, path.parent, fix, spelling, length=length)
    if path.exists() and not os.access(path, os.W_OK):
        raise spelling.refuse("trace", value, "is not writable", fix)
    return path
