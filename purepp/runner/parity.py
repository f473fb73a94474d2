"""The parity verdict: a PP x DP run must produce the tokens of a single-stage run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

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

    exact: int  # completed requests whose tokens equal the reference's
    prefixes: int  # aborted or unfinished requests whose tokens are a prefix of it
    mismatch: Mismatch | None  # the first disagreement, if any

    @property
    def ok(self) -> bool:
        return self.mismatch is None

    def render(self) -> str:
        if self.mismatch is not None:
            return f"MISMATCH: {self.mismatch.render()}"
        return (
            f"OK: {self.exact} completed requests match the single-stage run token for token; "
            f"{self.prefixes} aborted or unfinished ones are prefixes of it"
        )


def _first_difference(expected: Sequence[int], actual: Sequence[int]) -> int | None:
    for position, (want, got) in enumerate(zip(expected, actual, strict=False)):
        if want != got:
            return position
    if len(actual) > len(expected):
        return len(expected)
    return None


def check_parity(
    outputs: Mapping[int, Sequence[int]],
    finished: frozenset[int],
    reference: Mapping[int, Sequence[int]],
) -> ParityVerdict:
    """Compare the run's `outputs` with the `reference` run's (which ran every request
    to completion, without aborts). Requests in `finished` must match exactly;
    the others (aborted or cut off by the step limit) must be prefixes."""
    exact = prefixes = 0
    for request_id in sorted(reference):
        expected = list(reference[request_id])
        actual = list(outputs.get(request_id, ()))
        position = _first_difference(expected, actual)
        complete = request_id in finished
        if position is None and complete and len(actual) < len(expected):
            position = len(actual)
        if position is not None:
            why = "finished early" if position == len(actual) else "different token"
            return ParityVerdict(
                exact=exact,
                prefixes=prefixes,
                mismatch=Mismatch(
                    request_id=request_id,
                    position=position,
                    expected=expected[position] if position < len(expected) else None,
                    actual=actual[position] if position < len(actual) else None,
                    why=why,
                ),
            )
        if complete:
            exact += 1
        else:
            prefixes += 1
    return ParityVerdict(exact=exact, prefixes=prefixes, mismatch=None)
