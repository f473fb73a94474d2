"""What a run's ranks report, and how it crosses processes: attrs values written and
read through the effect log's one cattrs converter, so a results file is checked as
strictly as a log (an integer written as `"3"` is an error, never coerced).

No torch here: `purepp run` reads results without importing it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import attrs
import cattrs

from purepp.effects._converter import CONVERTER, describe_structure_error
from purepp.errors import PureppError

__all__ = ["PlanCounts", "RankResult", "ResultsError", "read_results", "write_results"]


@attrs.frozen(kw_only=True)
class PlanCounts:
    """How a rank's batches of effects ran (all zero unless the interpreter plans)."""

    lowered: int = 0  # plans made
    planned: int = 0  # batches run by a plan
    replayed: int = 0  # batches run by a CUDA-graph replay of a plan
    eager: int = 0  # batches run eagerly: a plan's first meeting, or bindings that did not fit

    def __add__(self, other: PlanCounts) -> PlanCounts:
        return PlanCounts(
            lowered=self.lowered + other.lowered,
            planned=self.planned + other.planned,
            replayed=self.replayed + other.replayed,
            eager=self.eager + other.eager,
        )


@attrs.frozen(kw_only=True)
class RankResult:
    """What one rank reports when its loop ends."""

    rank: int  # global rank
    stage: int  # pipeline stage
    replica: int  # DP replica
    steps: int  # steps run
    seconds: float  # wall time of the loop
    outputs: dict[int, list[int]]  # request id -> output tokens (requests that left or are live)
    finished: tuple[int, ...]  # request ids that reached their max tokens
    aborted: tuple[int, ...]  # request ids aborted in flight
    drafts_proposed: int  # drafts the last stage verified
    drafts_accepted: int  # of which accepted
    padded_tokens: int  # tokens added by padding to agreed shapes
    eager_steps: int  # steps the DP group agreed to run eager
    plans: PlanCounts = PlanCounts()  # how the interpreter ran its batches


class ResultsError(PureppError):
    """A results file is missing, truncated or not what a rank writes."""


# JSON object keys are strings, and the converter reads integers strictly; so the
# request -> tokens map travels as [request_id, tokens] pairs, integers both.
_OUTPUTS = dict[int, list[int]]
_PAIRS = list[tuple[int, list[int]]]


def _unstructure_outputs(outputs: _OUTPUTS) -> list[list[object]]:
    return [[request_id, list(tokens)] for request_id, tokens in sorted(outputs.items())]


def _structure_outputs(value: object, _: type) -> _OUTPUTS:
    pairs: _PAIRS = CONVERTER.structure(value, _PAIRS)
    outputs = dict(pairs)
    if len(outputs) != len(pairs):
        raise ValueError("a request id appears twice in outputs")
    return outputs


CONVERTER.register_unstructure_hook_func(lambda tp: tp == _OUTPUTS, _unstructure_outputs)
CONVERTER.register_structure_hook_func(lambda tp: tp == _OUTPUTS, _structure_outputs)


def write_results(path: str | os.PathLike[str], results: Sequence[RankResult]) -> None:
    """Write `results` (one per rank) to `path` atomically: a reader sees all or nothing."""
    path = Path(path)
    text = json.dumps(CONVERTER.unstructure(tuple(results), tuple[RankResult, ...]))
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)


def read_results(path: str | os.PathLike[str]) -> tuple[RankResult, ...]:
    """The results `write_results` wrote. Raises ResultsError naming the bad value."""
    call = "read_results"
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ResultsError(
            call, f"{path} cannot be read as JSON: {error}", "let rank 0 finish writing it"
        ) from error
    try:
        results: tuple[RankResult, ...] = CONVERTER.structure(raw, tuple[RankResult, ...])
    except (cattrs.BaseValidationError, ValueError, TypeError) as error:
        raise ResultsError(
            call,
            f"{path} is not a results file: {describe_structure_error(error, 'results')}",
            "read a file written by write_results",
        ) from error
    return results
