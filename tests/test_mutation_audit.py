"""Tests added by a mutation audit of purepp's guards: each fails under a small
deliberate change to the guard it names that no earlier test caught."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import pytest

from purepp.cudagraph import CaptureMode, CudaGraphDispatcher
from purepp.dp import (
    ROW_NUM_TOKENS,
    TABLE_ROWS,
    AgreementGroup,
    AgreementLanes,
    AgreementStarted,
    RankBatch,
    finish_agreement,
    start_agreement,
)
from purepp.effects.matching import Decisions
from purepp.effects.torch_interpreter import TorchInterpreter
from purepp.effects.vocabulary import (
    GatherRows,
    Op,
    RecordStream,
    Release,
    Stream,
    WaitStream,
)
from purepp.errors import InvalidInputError
from purepp.layout import Layout
from tests.test_capture_static_uses import (
    INDEX,
    SOURCE,
    bind_inputs,
    expected_rows,
    gathered,
    planner_of,
)
from tests.test_decisions import note_of
from tests.test_plan_capture import capturing
from tests.test_plans_review import Tag

MAIN, RELAY = Stream.MAIN, Stream.RELAY


# ---- capture: only a wait of the graph's own stream orders it after another ------------------


@pytest.mark.parametrize("ordered", [False, True], ids=["a-self-wait-of-main", "relay-waits-main"])
def test_only_a_wait_of_the_graphs_own_stream_orders_it_after_a_static_use(
    monkeypatch: pytest.MonkeyPatch, ordered: bool
) -> None:
    """A relay-stream graph whose output is recorded on main is captured only when the
    prefix makes the relay stream (S) wait for main. A WaitStream of another stream (here
    main waiting for itself) orders nothing on S: the next replay could rewrite the
    output under main's use, so the plan must not be captured."""
    captured: TorchInterpreter = capturing(monkeypatch)
    waiting = RELAY if ordered else MAIN  # the stream the prefix's WaitStream holds
    for step in range(6):
        tag = Tag(step=step, op=Op.RECEIVE)
        bind_inputs(captured, step)
        captured.perform(
            (
                WaitStream(**tag, stream=waiting, waits_for=MAIN),
                GatherRows(**tag, source=SOURCE, index=INDEX, out=gathered(step), stream=RELAY),
                RecordStream(**tag, buffer=gathered(step), stream=MAIN),
            )
        )
        assert captured.tensor(gathered(step)).tolist() == expected_rows(step).tolist()
        captured.perform((Release(step=step, op=Op.END_STEP, buffer=gathered(step)),))
    assert planner_of(captured).replayed == (5 if ordered else 0)


# ---- finish_agreement: this rank's own column is checked in every group shape -----------------


def _started_and_table(
    dp_size: int, live: frozenset[int] | None
) -> tuple[list[AgreementStarted], npt.NDArray[np.int32]]:
    """Every live rank's start (each a different busy batch) and the true reduced table."""
    ranks = sorted(range(dp_size) if live is None else live)
    started = [
        start_agreement(
            AgreementLanes(),
            AgreementGroup(dp_size=dp_size, dp_rank=rank, live_ranks=live),
            _DISPATCHER,
            RankBatch(num_reqs=1 + rank % 3, num_tokens=3 + rank % 5, uniform_token_count=None),
            step=3,
        )
        for rank in ranks
    ]
    table = np.zeros((TABLE_ROWS, dp_size), dtype=np.int32)
    for begun in started:
        assert begun.result.contribution is not None
        table += begun.result.contribution
    return started, table


_DISPATCHER = CudaGraphDispatcher(
    capture_sizes=(1, 2, 4, 8, 16), capture_mode=CaptureMode.FULL_AND_PIECEWISE, max_num_reqs=8
)


@pytest.mark.parametrize(
    ("dp_size", "live"),
    [
        (4, frozenset({0, 1, 3})),  # a dead rank: the column is read alone
        (17, None),  # past the list-sort limit
        (257, None),  # past the numpy-sort limit
    ],
    ids=["a-dead-rank", "17-ranks", "257-ranks"],
)
def test_a_table_whose_own_column_is_not_this_ranks_contribution_is_refused_in_any_group(
    dp_size: int, live: frozenset[int] | None
) -> None:
    """FF17: the reduced table must hold this rank's own contribution in its column. The
    check has a fast path (every rank live, at most 16); the others must check it too."""
    started, table = _started_and_table(dp_size, live)
    for begun in started[:3]:
        rank = begun.result.group.dp_rank
        # The true table decides; one more token in this rank's own cell is refused.
        finish_agreement(begun.state, begun.result, table)
        corrupted = table.copy()
        corrupted[ROW_NUM_TOKENS, rank] += 1
        with pytest.raises(InvalidInputError, match=rf"column {rank} is "):
            finish_agreement(begun.state, begun.result, corrupted)


# ---- FF17: every decided value is compared between the ranks' notes ---------------------------


@pytest.mark.parametrize(
    ("field", "other"),
    [
        ("cg_mode", "PIECEWISE"),
        ("num_ubatches", 2),
        ("num_tokens_across_dp", np.array([3, 3], dtype=np.int32)),
        ("uniform_token_count", 2),
        ("eager", True),
        ("num_reqs", 5),
        ("max_query_len", 4),
    ],
)
def test_notes_that_differ_in_any_one_decided_value_are_a_divergence(
    field: str, other: object
) -> None:
    """Ranks decide from one reduced table, so every value that shapes a step must match;
    the checker names the one that differs, whichever it is."""
    world = Layout(pp=1, dp=2)
    decisions = Decisions(world)
    decisions.note(0, note_of(world, 0))
    changes: dict[str, Any] = {field: other}
    decisions.note(1, attrs.evolve(note_of(world, 1), **changes))
    report = decisions.ready()
    assert report is not None
    assert report.within_group
    assert report.differing == (field,)
    assert [d.ranks for d in report.decisions] == [(0,), (1,)]
