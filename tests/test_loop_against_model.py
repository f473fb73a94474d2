"""The toy runner's in-process logic: the decode loop over the rank step, the scheduler,
the toy model's split across stages, and the `steps=0` promise.

`purepp run` compares a PP x DP run with a single-stage run of the very same loop and
scheduler, so a mistake they share never shows in its verdict. These tests compare the
loop's tokens with `reference_generate` (plain integers on the host, one token at a
time) instead, and check that `steps=0` ("enough for every request to finish") really
is enough, on the single-stage configuration the reference itself runs (it was not:
the bound ignored the token budget and the overlapped schedule, and a budget below one
decode row let no request decode, all under an OK verdict).
"""

from __future__ import annotations

import functools

import attrs
import pytest
import torch

from purepp.effects.torch_interpreter import TorchInterpreter, build_communicators
from purepp.errors import ConfigError
from purepp.layout import Layout
from purepp.runner.loop import RankLoop
from purepp.runner.results import RankResult
from purepp.runner.settings import RunSettings
from purepp.runner.toy_model import reference_generate
from purepp.runner.workload import Workload, make_workload
from tests._dist import RankContext, run_ranks


@attrs.frozen(kw_only=True)
class _Ran:
    """One rank's loop over one workload: what it reported and what it left behind."""

    settings: RunSettings
    workload: Workload
    result: RankResult
    is_last: bool  # the rank is its replica's last stage (its outputs are the run's)
    agreeing_after: int | None  # the step whose agreement was still in flight at the end


def _run_loops(all_settings: tuple[RunSettings, ...], aborts: bool, ctx: RankContext) -> list[_Ran]:
    """Run one rank's loop for each of `all_settings` (same world), one after another;
    without `aborts`, on the workload the single-stage reference runs (none aborted)."""
    first = all_settings[0]
    world = Layout(pp=first.pp, dp=first.dp)
    groups = build_communicators(
        pp_groups=world.pp_groups,
        dp_groups=world.dp_groups,
        relay_backend="gloo",
        timeout=ctx.timeout,
    )
    ran = []
    for settings in all_settings:
        env = TorchInterpreter(device=torch.device("cpu"), groups=groups, rank=ctx.rank)
        config = settings.workload
        workload = make_workload(config if aborts else attrs.evolve(config, abort_fraction=0.0))
        loop = RankLoop(
            settings, workload, rank=ctx.rank, env=env, perform=env, activation_group=None
        )
        result = loop.run()
        agreeing = loop.state.agreeing
        ran.append(
            _Ran(
                settings=settings,
                workload=workload,
                result=result,
                is_last=loop.is_last,
                agreeing_after=None if agreeing is None else agreeing.step,
            )
        )
    return ran


def _run(*all_settings: RunSettings, aborts: bool = True) -> list[list[_Ran]]:
    """Every rank's runs, in rank order (each rank a process of its own)."""
    worker = functools.partial(_run_loops, all_settings, aborts)
    return run_ranks(worker, all_settings[0].world_size, deadline_s=120.0)


def _unfinished(ran: _Ran) -> list[int]:
    """The rank's replica's requests that neither finished nor were aborted."""
    result = ran.result
    left = set(result.finished) | set(result.aborted)
    requests = ran.workload.for_replica(result.replica)
    return [r.request_id for r in requests if r.request_id not in left]


def _wrong_tokens(ran: _Ran) -> list[str]:
    """Where the run's outputs differ from the host reference model: each output must be
    a prefix of the reference's, and a finished request's must equal it."""
    wrong = []
    for request in ran.workload.for_replica(ran.result.replica):
        rid = request.request_id
        expected = reference_generate(
            request.prompt, request.max_tokens, ran.settings.num_layers, ran.workload.vocab_size
        )
        actual = ran.result.outputs.get(rid, [])
        finished = rid in ran.result.finished
        if actual != expected[: len(actual)] or (finished and actual != expected):
            wrong.append(f"{ran.settings!r}: request {rid}: {actual} vs {expected}")
    return wrong


# -- the tokens, against the host reference model ----------------------------------------

# One rank (pp 1 x dp 1): drafts from none to the most, budgets below, at and above a
# chunk, one slot (reused at once after every abort and finish), the overlapped schedule,
# and a run cut short by --steps.
_SINGLE_RANK = (
    RunSettings(pp=1, dp=1, spec=0, requests=8, seed=3, num_layers=1),
    RunSettings(pp=1, dp=1, spec=1, requests=8, seed=4, max_num_reqs=1, chunk_size=3),
    RunSettings(pp=1, dp=1, spec=3, requests=10, seed=5, max_num_batched_tokens=9),
    RunSettings(pp=1, dp=1, spec=7, requests=8, seed=6, chunk_size=40, max_num_batched_tokens=64),
    RunSettings(pp=1, dp=1, spec=2, requests=8, seed=7, max_num_reqs=2, overlap_agreement=True),
    RunSettings(pp=1, dp=1, spec=2, requests=8, seed=8, steps=17),
)


@pytest.mark.multiprocess
def test_a_single_rank_loop_decodes_what_the_host_reference_model_decodes() -> None:
    """Whatever the drafts, budget, chunking or slot count, every request's outputs are
    a prefix of the host reference model's greedy tokens (aborted, or cut by --steps),
    and every finished request's are exactly its tokens: the loop-based reference of
    `purepp run` shares the loop's scheduler, so it could not see a shared mistake."""
    (runs,) = _run(*_SINGLE_RANK)
    wrong = [line for ran in runs for line in _wrong_tokens(ran)]
    assert wrong == []
    assert all(ran.result.finished for ran in runs)  # something was compared in full
    assert any(ran.result.drafts_accepted < ran.result.drafts_proposed for ran in runs)


# Two stages of 3 layers (an uneven split: 2 + 1), with drafts, so the earlier stage
# applies drafts it only learns from the relay's draft table; then the overlapped
# schedule on the same world.
_TWO_STAGES = (
    RunSettings(pp=2, dp=1, spec=2, requests=6, seed=11, num_layers=3),
    RunSettings(pp=2, dp=1, spec=3, requests=6, seed=12, num_layers=3, overlap_agreement=True),
)


@pytest.mark.multiprocess
def test_two_uneven_stages_decode_what_the_host_reference_model_decodes() -> None:
    """pp 2 over 3 layers: the last stage's outputs are the host reference model's tokens
    (every layer run once, in order, across the split), and the first stage, which learns
    tokens and drafts only through the relay, holds the very same outputs."""
    first, last = _run(*_TWO_STAGES)
    assert [ran.is_last for ran in (*first, *last)] == [False, False, True, True]
    wrong = [line for ran in last for line in _wrong_tokens(ran)]
    assert wrong == []
    for early, late in zip(first, last, strict=True):
        assert late.result.finished
        assert early.result.outputs == late.result.outputs
        assert early.result.finished == late.result.finished
        assert late.result.drafts_accepted < late.result.drafts_proposed


# -- steps=0: enough steps for every request to finish ----------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "settings",
    [
        pytest.param(RunSettings(pp=1, dp=1), id="defaults"),
        pytest.param(RunSettings(pp=1, dp=1, spec=0, max_num_reqs=2, seed=2), id="two-slots"),
        pytest.param(
            RunSettings(pp=1, dp=1, spec=0, max_num_reqs=32),
            id="many-slots-share-the-budget",
        ),
        pytest.param(
            RunSettings(pp=1, dp=1, spec=0, requests=1, seed=1, max_num_batched_tokens=1),
            id="budget-below-a-chunk",
        ),
        pytest.param(
            RunSettings(pp=1, dp=1, spec=0, requests=1, seed=1, overlap_agreement=True),
            id="overlapped",
        ),
    ],
)
def test_steps_0_runs_every_request_of_the_reference_configuration_to_its_end(
    settings: RunSettings,
) -> None:
    """`steps=0 picks enough for every request to finish`: the single-stage reference of
    `purepp run` (one rank, no aborts, stopping once all is done) finishes every request
    of the workload within `total_steps`, so the verdict compares whole requests rather
    than silently accepting prefixes of the unfinished ones."""
    assert settings.steps == 0
    ((ran,),) = _run(settings, aborts=False)
    assert ran.result.aborted == ()
    assert ran.result.steps <= settings.total_steps
    assert _unfinished(ran) == []
    assert _wrong_tokens(ran) == []


@pytest.mark.multiprocess
def test_a_budget_below_a_draft_row_still_decodes_or_is_refused() -> None:
    """A token budget smaller than one decode row (the last token and `spec` drafts) is
    either refused when the settings are built, or the requests still decode (fewer
    drafts) and finish: never a run that silently stops at every request's first token."""
    try:
        settings = RunSettings(pp=1, dp=1, spec=2, max_num_batched_tokens=2, requests=2)
    except ConfigError:
        return
    ((ran,),) = _run(settings)
    assert _unfinished(ran) == []


@pytest.mark.multiprocess
def test_an_overlapped_run_that_stops_early_leaves_no_agreement_in_flight() -> None:
    """With `overlap_agreement` each step starts the next step's agreement; the last step
    the loop runs starts none, also when it stops early because every request is done."""
    settings = RunSettings(pp=1, dp=1, spec=1, requests=2, overlap_agreement=True)
    ((ran,),) = _run(settings)
    assert ran.result.steps < settings.total_steps  # it stopped early
    assert _unfinished(ran) == []
    assert ran.agreeing_after is None
