"""The CPU benchmarks still run against the library they measure (no timing asserted).

A benchmark that patches the library (`pure_breakdown --no-effects` replaces the relay's
effect constructors) goes void silently when the library changes how it builds them;
each is run briefly here, so such a change fails CI instead of the next measurement.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "arguments",
    [
        ["benchmarks.pure_breakdown", "--calls", "5", "--rounds", "1", "--rows", "8"],
        [
            "benchmarks.pure_breakdown",
            "--calls",
            "5",
            "--rounds",
            "1",
            "--rows",
            "8",
            "--no-effects",
        ],
        ["benchmarks.dp_agreement", "--rounds", "1", "--iters", "5", "--no-collective"],
        [
            "benchmarks.relay_host_cost",
            *("--steps", "5", "--rounds", "1", "--warmup", "3", "--rows", "8", "--spec", "0"),
            "--drain",
        ],
    ],
    ids=["pure_breakdown", "pure_breakdown_no_effects", "dp_agreement", "relay_host_cost_drain"],
)
def test_a_cpu_benchmark_runs_to_its_table(arguments: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", *arguments],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith(("| ", "dp="))]
    assert any("receiver" in row or "eager" in row for row in rows), result.stdout
    assert any("sender" in row or "graph" in row for row in rows), result.stdout


OVERLAP_ARGUMENTS = ["--steps", "12", "--rounds", "1", "--ratios", "1.0", "--forward", "spin"]


def test_the_overlap_benchmark_runs_both_ways_on_two_gloo_ranks() -> None:
    """`dp_overlap` drives a `RankDriver` per run, in both ways (a driver takes only the
    states it handed out, so one reused across runs from step 0 is refused)."""
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.dp_overlap", *OVERLAP_ARGUMENTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "sync: exposed" in result.stdout, result.stdout
    assert any(line.lstrip().startswith("1.0 L") for line in result.stdout.splitlines())
