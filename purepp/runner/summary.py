"""What `purepp run` reports: the ranks' results against the single-stage reference."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from purepp._text import counted
from purepp.runner.parity import ParityVerdict, check_parity
from purepp.runner.results import PlanCounts, RankResult
from purepp.runner.settings import RunSettings

__all__ = ["RunSummary", "summarise"]


@attrs.frozen(kw_only=True)
class RunSummary:
    """What `purepp run` reports."""

    settings: RunSettings  # the run's settings
    steps: int  # steps each rank ran
    reference_steps: int  # steps the single-stage reference ran (bounded by --steps too)
    requests: int  # requests in the workload
    tokens: int  # output tokens produced
    seconds: float  # wall time of the slowest rank's loop
    aborted: int  # requests aborted in flight
    drafts_proposed: int  # drafts verified by the last stages
    drafts_accepted: int  # of which accepted
    padded_tokens: int  # tokens the last stages ran beyond their batches (agreed shapes)
    eager_steps: int  # steps a DP group agreed to run eager, summed over the last stages
    plans: PlanCounts  # how the ranks' interpreters ran their batches, summed over ranks
    verdict: ParityVerdict  # against the single-stage run

    def render(self) -> str:
        s = self.settings
        rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
        accepted = (
            f"{self.drafts_accepted}/{self.drafts_proposed}" if self.drafts_proposed else "none"
        )
        p = self.plans
        lowered = counted(p.lowered, "plan")
        interpreter = {
            "eager": "eager",
            "checked": "checked: every effect validated",
            "plan": f"plan: {lowered} lowered; batches run {p.planned} by a plan, "
            f"{p.eager} eagerly",
            "captured": f"captured: {lowered} lowered; batches run {p.replayed} by "
            f"a CUDA-graph replay, {p.planned} by a plan, {p.eager} eagerly",
        }[s.interpreter]
        return "\n".join(
            [
                f"purepp run: pp={s.pp} x dp={s.dp} on {s.backend}, spec={s.spec}, seed={s.seed}"
                + (", relay header validated" if s.validate_header else ""),
                f"  interpreter      {interpreter}",
                f"  steps            {self.steps} (the single-stage reference: "
                f"{self.reference_steps})",
                f"  requests         {self.requests} ({self.aborted} aborted in flight)",
                f"  tokens           {self.tokens} in {self.seconds:.2f} s ({rate:.1f} tokens/s)",
                f"  drafts accepted  {accepted}",
                f"  batch shapes     {counted(self.padded_tokens, 'token')} of CUDA-graph padding, "
                f"{counted(self.eager_steps, 'step')} agreed eager across DP",
                f"  parity           {self.verdict.render()}",
            ]
        )


def summarise(
    settings: RunSettings, results: Sequence[RankResult], reference: Sequence[RankResult]
) -> RunSummary:
    """The run's `results` (one per rank) against the single-stage `reference`'s."""
    last_stages = [r for r in results if r.stage == settings.pp - 1]
    outputs: dict[int, list[int]] = {}
    finished: set[int] = set()
    aborted: set[int] = set()
    for result in last_stages:
        outputs |= result.outputs
        finished |= set(result.finished)
        aborted |= set(result.aborted)
    reference_outputs: dict[int, list[int]] = {}
    reference_finished: set[int] = set()
    for result in reference:
        reference_outputs |= result.outputs
        reference_finished |= set(result.finished)
    verdict = check_parity(
        outputs, frozenset(finished), reference_outputs, frozenset(reference_finished)
    )
    return RunSummary(
        settings=settings,
        steps=max((r.steps for r in results), default=0),
        reference_steps=max((r.steps for r in reference), default=0),
        requests=settings.requests,
        tokens=sum(len(tokens) for tokens in outputs.values()),
        seconds=max((r.seconds for r in results), default=0.0),
        aborted=len(aborted),
        drafts_proposed=sum(r.drafts_proposed for r in last_stages),
        drafts_accepted=sum(r.drafts_accepted for r in last_stages),
        padded_tokens=sum(r.padded_tokens for r in last_stages),
        eager_steps=sum(r.eager_steps for r in last_stages),
        plans=sum((r.plans for r in results), PlanCounts()),
        verdict=verdict,
    )
