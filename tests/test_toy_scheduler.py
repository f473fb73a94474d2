"""The toy runner's scheduler on its own: when a request finishes, when it is aborted,
which slots wait a step, and how rows fill the token budget.

The runs in tests/test_runner.py compare every rank with a single-stage run that uses
this same scheduler, so a timing shared by both sides would pass there unnoticed;
these tests pin the timings themselves.
"""

from __future__ import annotations

import attrs

from purepp.runner.scheduler import Scheduler, SchedulerConfig
from purepp.runner.workload import Request

PROMPT = (1, 2, 3)


def scheduler(
    *, max_tokens: int = 3, abort_after_steps: int | None = None, budget: int = 16, spec: int = 0
) -> Scheduler:
    requests = [
        Request(
            request_id=slot,
            replica=0,
            arrival_step=0,
            prompt=PROMPT,
            max_tokens=max_tokens,
            abort_after_steps=abort_after_steps,
        )
        for slot in range(2)
    ]
    config = SchedulerConfig(
        max_num_reqs=2,
        max_num_batched_tokens=budget,
        chunk_size=8,
        num_speculative_steps=spec,
        pp_size=2,
    )
    out = Scheduler(config, requests)
    assert out.admit(0) == [0, 1]
    return out


def test_a_request_finishes_when_its_outputs_reach_max_tokens_and_not_before() -> None:
    table = scheduler(max_tokens=2)
    first = table.schedule(0).rows[0]  # the whole prompt: it samples the first token
    assert not table.apply_outputs(first, 0, [7], num_rejected=0, drafts=[])
    assert table.finished == set()
    assert table.slots[0] is not None
    decode = table.schedule(2).rows[0]
    assert decode.decode
    assert table.apply_outputs(decode, 0, [8], num_rejected=0, drafts=[])  # exactly two
    assert table.finished == {0}
    assert table.aborted == set()
    assert table.outputs[0] == [7, 8]
    assert table.slots[0] is None


def test_an_abort_lands_the_given_steps_after_the_first_decode() -> None:
    table = scheduler(max_tokens=100, abort_after_steps=2)
    rows = table.schedule(0).rows
    for row in rows:
        table.apply_outputs(row, row.slot, [7], num_rejected=0, drafts=[])
    assert table.abort_due(5) == []  # no decode yet: nothing counts
    table.schedule(2)  # the first decode of both requests
    assert table.abort_due(3) == []
    assert table.abort_due(4, spare={1}) == [0]  # slot 1's row is running: it waits
    assert table.aborted == {0}
    assert table.outputs[0] == [7]
    assert table.abort_due(5) == [1]
    assert table.aborted == {0, 1}
    assert table.finished == set()


def test_rows_fill_the_token_budget_and_none_is_left_empty() -> None:
    # Prefill: the second prompt gets what is left of the budget, or no row at all.
    assert [len(r.token_ids) for r in scheduler(budget=4).schedule(0).rows] == [3, 1]
    assert [len(r.token_ids) for r in scheduler(budget=3).schedule(0).rows] == [3]
    # Decode with two drafts: a row of three tokens, which a budget of three fits.
    for budget, decoded in ((6, [0, 1]), (5, [0]), (3, [0]), (2, [])):
        table = scheduler(spec=2)
        for row in table.schedule(0).rows:
            table.apply_outputs(row, row.slot, [7], num_rejected=0, drafts=[8, 9])
        # Prefilled under the default budget; the decode step runs under `budget`.
        table.config = attrs.evolve(table.config, max_num_batched_tokens=budget)
        rows = table.schedule(2).rows
        assert [r.slot for r in rows] == decoded, budget
        assert all(r.token_ids == (7, 8, 9) for r in rows)
