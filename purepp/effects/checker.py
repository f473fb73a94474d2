"""`purepp check LOGDIR`: match the collectives of per-rank effect logs recorded on
real hardware, with the same matcher the simulator uses."""

from __future__ import annotations

import os
import sys
from typing import TextIO

import attrs

from purepp.effects.log import EffectLog, load_logs
from purepp.effects.matching import MismatchReport, match_collectives
from purepp.effects.vocabulary import COLLECTIVES
from purepp.errors import PureppError

__all__ = ["CheckResult", "check_log_dir", "check_logs"]


@attrs.frozen(kw_only=True)
class CheckResult:
    """The outcome of matching one run's logs."""

    ranks: int  # logs read, one per rank
    collectives: int  # collectives issued, all ranks together
    steps: int  # distinct decode steps seen
    report: MismatchReport | None  # the first problem, or None when everything matches

    def summary(self) -> str:
        if self.report is not None:
            return self.report.render()
        return (
            f"ok: {self.ranks} ranks, {self.collectives} collectives over {self.steps} steps, "
            "every communicator matches"
        )


def check_logs(logs: tuple[EffectLog, ...]) -> CheckResult:
    """Match the collectives of `logs` (one per rank of one world, as `load_logs` gives)."""
    world = logs[0].header.world
    per_rank = {log.header.rank: log.effects for log in logs}
    effects = [effect for log in logs for effect in log.effects]
    return CheckResult(
        ranks=len(logs),
        collectives=sum(isinstance(effect, COLLECTIVES) for effect in effects),
        steps=len({effect.step for effect in effects}),
        report=match_collectives(per_rank, world),
    )


def check_log_dir(directory: str | os.PathLike[str], out: TextIO | None = None) -> int:
    """Print a one-line summary (exit 0) or the mismatch report (exit 1); a log that
    cannot be read is exit 2."""
    stream = sys.stdout if out is None else out
    try:
        result = check_logs(load_logs(directory))
    except PureppError as error:
        print(f"purepp check: {error}", file=stream)
        return 2
    print(result.summary(), file=stream)
    return 0 if result.report is None else 1
