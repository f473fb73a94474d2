"""The parity verdict: a PP x DP run must produce the tokens of a single-stage run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from purepp._text import counted

__all__ = ["Mismatch", "ParityVerdict", "check_parity"]


@attrs.frozen(kw_only=True)
class Mismatch:
    """The first place the run and the reference disagree."""

    request_id: int  # the request
    position: int  # index into its output tokens
    expected: int | None  # the reference's token there (None: the reference ended)
    actual: int | None  # the run's token there (None: the run ended early)
    why: str  # which check failed

    def render(self) -> str:
        return (
            f"request {self.request_id}, output position {self.position}: "
            f"expected {self.expected}, got {self.actual} ({self.why})"
        )


@attrs.frozen(kw_only=True)
class ParityVerdict:
    """How the run compares with the reference, request by request."""

    exact: int  # requests both runs finished, with equal tokens
    prefixes: int  # requests one run left unfinished (aborted, step limit), agreeing so far
    mismatch: Mismatch | None  # the first disagreement, if any
    compared: int = 0  # output tokens present in both runs, compared one by one

    @property
    def nothing_compared(self) -> bool:
        """No token was in both runs: the verdict says nothing (too few steps or requests)."""
        return self.mismatch is None and self.compared == 0

    @property
    def ok(self) -> bool:
        """Tokens were compared, and all of them agree."""
        return self.mismatch is None and self.compared > 0

    def render(self) -> str:
        if self.mismatch is not None:
            return f"MISMATCH: {self.mismatch.render()}"
        if self.compared == 0:
            return (
                "NOTHING COMPARED: no request has an output token in both runs, so parity "
                "is unknown; raise --steps (0 runs every request to the end) or --requests"
            )
        exact = "matches" if self.exact == 1 else "match"
        prefixes = "one agrees" if self.prefixes == 1 else "ones agree"
        return (
            f"OK: {counted(self.compared, 'token')} compared; "
            f"{counted(self.exact, 'request')} finished in both runs {exact} token for token; "
            f"{self.prefixes} aborted or unfinished {prefixes} as far as both got"
        )


def _first_difference(expected: Sequence[int], actual: Sequence[int]) -> int | None:
    for position, (want, got) in enumerate(zip(expected, actual, strict=False)):
        if want != got:
            return position
    return None


def _length_mismatch(
    expected: Sequence[int], actual: Sequence[int], run_done: bool, reference_done: bool
) -> tuple[int, str] | None:
    """Equal so far; a run that finished must be exactly as long as a finished
    reference, and no shorter than an unfinished one (nor the other way round)."""
    if run_done and len(actual) < len(expected):
        return len(actual), "finished early"
    if reference_done and len(actual) > len(expected):
        return len(expected), "ran past the reference's end"
    return None


def check_parity(
    outputs: Mapping[int, Sequence[int]],
    finished: frozenset[int],
    reference: Mapping[int, Sequence[int]],
    reference_finished: frozenset[int] | None = None,
) -> ParityVerdict:
    """Compare the run's `outputs` with the `reference` run's (no aborts).

    Requests in both `finished` and `reference_finished` must match exactly; where
    either run left a request unfinished (aborted, or cut off by the step limit),
    the two must agree as far as both got. `reference_finished` None: the reference
    ran every request to completion.
    """
    done_in_reference = frozenset(reference) if reference_finished is None else reference_finished
    exact = prefixes = compared = 0
    for request_id in sorted(reference):
        expected = list(reference[request_id])
        actual = list(outputs.get(request_id, ()))
        run_done = request_id in finished
        reference_done = request_id in done_in_reference
        position = _first_difference(expected, actual)
        why = "different token"
        if position is None:
            length = _length_mismatch(expected, actual, run_done, reference_done)
            if length is not None:
                position, why = length
        if position is not None:
            return ParityVerdict(
                exact=exact,
                prefixes=prefixes,
                compared=compared + position,
                mismatch=Mismatch(
                    request_id=request_id,
                    position=position,
                    expected=expected[position] if position < len(expected) else None,
                    actual=actual[position] if position < len(actual) else None,
                    why=why,
                ),
            )
        compared += min(len(expected), len(actual))
        if run_done and reference_done:
            exact += 1
        else:
            prefixes += 1
    return ParityVerdict(exact=exact, prefixes=prefixes, mismatch=None, compared=compared)
