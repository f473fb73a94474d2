"""Regenerate the golden effect logs in tests/data/golden/ (one JSONL per rank).

Run from the repository root, after a deliberate change to the effect sequence
(a new effect in the vocabulary, a reordered step, a renamed buffer):

    python -m tests.regen_golden

Then review `git diff tests/data/golden` (each changed line is one effect of one
rank) and commit the logs with the change that caused them. tests/test_golden_logs.py
records the same scripted runs in memory and fails with a readable diff whenever
they no longer equal these files, so an unintended change cannot slip through.

Each case is a `ScheduleConfig` of `purepp.testing`: a seeded PP x DP
schedule (frees at every ring offset, slots reused at once, idle replicas, prefill
chunks that do and do not sample, decodes) run by the real pure steps, recorded by a
`Recorder` with nothing behind it.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from purepp.effects.log import dump_logs
from purepp.relay import Wire
from purepp.testing import ScheduleConfig, make_schedule, record_scripted_logs

__all__ = ["GOLDEN_CASES", "GOLDEN_DIR", "regenerate"]

GOLDEN_DIR = Path(__file__).parent / "data" / "golden"

_STEPS = 12
_SEED = 2024

# Directory name -> the schedule recorded there.
GOLDEN_CASES: dict[str, ScheduleConfig] = {
    **{
        f"pp{pp}_spec{spec}": ScheduleConfig(pp=pp, dp=1, spec=spec, steps=_STEPS, seed=_SEED)
        for pp in (2, 3, 4)
        for spec in (0, 2)
    },
    "dp2": ScheduleConfig(pp=2, dp=2, spec=1, steps=_STEPS, seed=_SEED),
    "dp4": ScheduleConfig(pp=1, dp=4, spec=0, steps=_STEPS, seed=_SEED),
    # The opt-in wires: one aligned int64 broadcast per step; fixed pads to a bucket.
    "pp2_spec2_packed": ScheduleConfig(
        pp=2, dp=1, spec=2, steps=_STEPS, seed=_SEED, wire=Wire.PACKED
    ),
    "pp3_spec2_fixed": ScheduleConfig(
        pp=3, dp=1, spec=2, steps=_STEPS, seed=_SEED, wire=Wire.FIXED
    ),
    "dp2_fixed": ScheduleConfig(pp=2, dp=2, spec=1, steps=_STEPS, seed=_SEED, wire=Wire.FIXED),
    "dp2_microbatch": ScheduleConfig(pp=2, dp=2, spec=1, steps=_STEPS, seed=_SEED, microbatch=True),
}


def regenerate(root: Path = GOLDEN_DIR) -> list[Path]:
    """Rewrite every case's directory under `root`; return the files written."""
    written: list[Path] = []
    for name, config in GOLDEN_CASES.items():
        directory = root / name
        shutil.rmtree(directory, ignore_errors=True)  # drop logs of ranks that no longer exist
        written += dump_logs(record_scripted_logs(make_schedule(config)), directory)
    return written


if __name__ == "__main__":
    # No options; parsing still answers --help (and refuses a stray argument) before
    # anything is rewritten.
    argparse.ArgumentParser(
        prog="python -m tests.regen_golden", description=__doc__.splitlines()[0]
    ).parse_args()
    for path in regenerate():
        print(f"wrote {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")
    sys.exit(0)
