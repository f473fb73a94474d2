"""Golden effect logs: the scripted runs' effect sequences, pinned byte for byte.

Each directory under tests/data/golden/ holds one JSONL log per rank of a scripted
PP x DP run (see tests/regen_golden.py). The same run recorded now must equal it;
when it does not, the failure shows the first differing record with its context. If
the change is intended, regenerate with `python -m tests.regen_golden` and review
the diff.
"""

from __future__ import annotations

import io

import pytest

from purepp.effects.checker import check_log_dir
from purepp.effects.log import EffectLog, Recorder, assert_logs_equal, load_logs, replay
from purepp.testing import make_schedule, record_scripted_logs, simulate_schedule
from tests.regen_golden import GOLDEN_CASES, GOLDEN_DIR

CASES = sorted(GOLDEN_CASES)

REGENERATE = "intended? regenerate with `python -m tests.regen_golden` and review the diff"


def golden(name: str) -> tuple[EffectLog, ...]:
    return load_logs(GOLDEN_DIR / name, expect_world=GOLDEN_CASES[name].world)


def test_every_golden_directory_is_a_case() -> None:
    on_disk = sorted(path.name for path in GOLDEN_DIR.iterdir() if path.is_dir())
    assert on_disk == CASES, REGENERATE


@pytest.mark.parametrize("name", CASES)
def test_recording_the_scripted_run_again_gives_the_golden_logs(name: str) -> None:
    expected = golden(name)
    actual = record_scripted_logs(make_schedule(GOLDEN_CASES[name]))
    assert len(actual) == len(expected), REGENERATE
    for want, got in zip(expected, actual, strict=True):
        try:
            assert_logs_equal(want, got)
        except AssertionError as difference:
            message = f"{name}, rank {want.header.rank}: {difference}\n{REGENERATE}"
            raise AssertionError(message) from None


@pytest.mark.parametrize("name", CASES)
def test_a_replayed_golden_log_equals_itself(name: str) -> None:
    for log in golden(name):
        recorder = Recorder(log.header)
        replay(log, recorder)
        assert_logs_equal(log, recorder.log)


@pytest.mark.parametrize("name", CASES)
def test_purepp_check_accepts_every_golden_directory(name: str) -> None:
    out = io.StringIO()
    assert check_log_dir(GOLDEN_DIR / name, out) == 0, out.getvalue()
    ranks = GOLDEN_CASES[name].world.world_size
    assert out.getvalue().startswith(f"ok: {ranks} ranks, ")


@pytest.mark.parametrize("name", CASES)
def test_the_golden_logs_are_what_a_matched_simulated_run_issues(name: str) -> None:
    run = simulate_schedule(make_schedule(GOLDEN_CASES[name]))
    for rank, log in enumerate(golden(name)):
        assert_logs_equal(log, EffectLog.from_effects(log.header, run.simulation.effects[rank]))
