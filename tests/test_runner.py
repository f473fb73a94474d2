"""The research runner: toy model, scheduler, parity verdict, whole runs over gloo, and
the per-rank loop on workloads small enough to follow step by step."""

from __future__ import annotations

import functools
import json
import re
import time
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from purepp.effects.checker import check_logs
from purepp.effects.logmodel import LogHeader
from purepp.effects.recorder import Recorder
from purepp.effects.torch_interpreter import TorchInterpreter, build_communicators
from purepp.effects.vocabulary import AllReduce
from purepp.errors import ConfigError
from purepp.layout import Layout
from purepp.runner.cli import launch
from purepp.runner.loop import RankLoop
from purepp.runner.parity import check_parity
from purepp.runner.results import PlanCounts, RankResult
from purepp.runner.scheduler import Scheduler, SchedulerConfig
from purepp.runner.settings import MAX_SPECULATIVE_STEPS, MAX_TIMEOUT_S, RunSettings
from purepp.runner.summary import summarise
from purepp.runner.toy_model import (
    ForwardPlan,
    ToyStage,
    layers_of_stage,
    next_token_rule,
    propose_drafts,
    reference_generate,
)
from purepp.runner.workload import Request, Workload, WorkloadConfig, make_workload
from tests._dist import RankContext, run_ranks

VOCAB = 1000


def _generate_with_stages(
    prompt: tuple[int, ...], max_tokens: int, pp: int, num_layers: int, chunk: int
) -> list[int]:
    """Decode one request through `pp` ToyStages, prefilling in chunks."""
    cpu = torch.device("cpu")
    stages = [ToyStage(layers_of_stage(s, pp, num_layers), 2, 128, cpu) for s in range(pp)]
    history = list(prompt)
    outputs: list[int] = []
    position = 0
    while len(outputs) < max_tokens:
        size = min(chunk, len(history) - position)
        plan = ForwardPlan.build(16, [1], [position], [history[position : position + size]])
        hidden: torch.Tensor | None = None
        for stage in stages:
            hidden = stage.forward(plan, hidden)
        assert hidden is not None
        position += size
        if position == len(history):
            last = torch.from_numpy(plan.last_rows)
            token = next_token_rule(hidden[last], torch.from_numpy(plan.token_ids)[last], VOCAB)
            history.append(int(token[0]))
            outputs.append(int(token[0]))
    return outputs


@pytest.mark.parametrize("pp", [1, 2, 3, 5])
@pytest.mark.parametrize("chunk", [1, 4])
def test_pipeline_stages_compute_the_single_stage_model(pp: int, chunk: int) -> None:
    prompt = (5, 17, 900, 3, 3, 41)
    expected = reference_generate(prompt, 10, num_layers=5, vocab_size=VOCAB)
    assert _generate_with_stages(prompt, 10, pp, num_layers=5, chunk=chunk) == expected


def test_layers_are_split_contiguously_and_completely() -> None:
    for pp in range(1, 9):
        layers = [list(layers_of_stage(s, pp, 8)) for s in range(pp)]
        assert [layer for stage in layers for layer in stage] == list(range(8))
        assert max(map(len, layers)) - min(map(len, layers)) <= 1


def test_recomputing_positions_gives_what_the_history_gives() -> None:
    """A rejected draft is corrected by computing its position again: a position's value
    depends on its request's tokens alone, never on what the cache held there before."""
    cpu = torch.device("cpu")
    stage = ToyStage(range(3), 2, 16, cpu)
    prompt = ForwardPlan.build(8, [1], [0], [[5, 17, 900]])
    first = stage.forward(prompt, None)
    assert torch.equal(stage.forward(prompt, None), first)  # position 0 included
    stage.forward(ForwardPlan.build(8, [1], [2], [[901]]), None)  # a draft at 2, rejected
    again = stage.forward(ForwardPlan.build(8, [1], [2], [[900]]), None)
    assert int(again[0]) == int(first[2])


def test_drafts_count_up_from_the_last_token_and_a_corrupt_one_is_wrong_first() -> None:
    assert propose_drafts(7, 3, VOCAB, corrupt=False) == [8, 9, 10]
    assert propose_drafts(VOCAB - 2, 3, VOCAB, corrupt=False) == [VOCAB - 1, 0, 1]
    for last in (7, VOCAB - 1):
        right = propose_drafts(last, 3, VOCAB, corrupt=False)
        wrong = propose_drafts(last, 3, VOCAB, corrupt=True)
        assert wrong[0] != right[0]
        assert 0 <= wrong[0] < VOCAB
        assert wrong[1:] == right[1:]  # only the first guess is forced wrong
    assert propose_drafts(7, 0, VOCAB, corrupt=True) == []  # nothing to corrupt


def _scheduler(spec: int = 0, pp: int = 2) -> Scheduler:
    request = Request(
        request_id=7,
        replica=0,
        arrival_step=0,
        prompt=(1, 2, 3, 4, 5),
        max_tokens=2,
        abort_after_steps=None,
    )
    config = SchedulerConfig(
        max_num_reqs=2,
        max_num_batched_tokens=16,
        chunk_size=3,
        num_speculative_steps=spec,
        pp_size=pp,
    )
    return Scheduler(config, [request])


def test_prefill_is_chunked_and_only_the_final_chunk_samples() -> None:
    scheduler = _scheduler()
    assert scheduler.admit(0) == [0]
    first = scheduler.schedule(0)
    assert [r.token_ids for r in first.rows] == [(1, 2, 3)]
    assert not first.rows[0].samples
    assert scheduler.schedule(1).rows == ()  # in flight until step 0 + pp_size
    second = scheduler.schedule(2)
    assert [r.token_ids for r in second.rows] == [(4, 5)]
    assert second.rows[0].samples
    assert second.batch.num_computed_tokens.tolist() == [3]
    assert second.batch.prefill_len.tolist() == [5]


def test_request_finishes_exactly_at_max_tokens_and_frees_its_slot() -> None:
    scheduler = _scheduler(spec=2)
    scheduler.admit(0)
    state = scheduler.slots[0]
    assert state is not None
    state.num_computed, state.tokens = 5, [*state.tokens, 8]  # prefilled, first token out
    row = scheduler.schedule(0).rows[0]
    # Three tokens arrive for a request that wants two: it stops at exactly two.
    assert scheduler.apply_outputs(row, 0, [9, 10], num_rejected=0, drafts=[])
    assert scheduler.outputs[7] == [8, 9]
    assert scheduler.finished == {7}
    assert scheduler.slots == [None, None]


def test_uniform_token_count_only_for_alike_decode_rows() -> None:
    scheduler = _scheduler(spec=2)
    scheduler.admit(0)
    state = scheduler.slots[0]
    assert state is not None
    assert scheduler.schedule(0).uniform_token_count is None  # a prefill chunk
    state.num_computed, state.tokens, state.drafts = 5, [*state.tokens, 6], [7, 8]
    state.in_flight_until = 0
    assert scheduler.schedule(2).uniform_token_count == 3


def test_parity_verdict_reports_the_first_difference() -> None:
    reference = {0: [1, 2, 3], 1: [4, 5, 6]}
    ok = check_parity({0: [1, 2, 3], 1: [4, 5]}, frozenset({0}), reference)
    assert ok.ok
    assert (ok.exact, ok.prefixes) == (1, 1)
    assert ok.render() == (
        "OK: 5 tokens compared; 1 request finished in both runs matches token for token; "
        "1 aborted or unfinished one agrees as far as both got"
    )
    bad = check_parity({0: [1, 2, 3], 1: [4, 9]}, frozenset({0}), reference)
    assert bad.mismatch is not None
    assert (bad.mismatch.request_id, bad.mismatch.position) == (1, 1)
    assert (bad.mismatch.expected, bad.mismatch.actual) == (5, 9)
    assert "request 1, output position 1: expected 5, got 9" in bad.render()
    short = check_parity({0: [1, 2]}, frozenset({0}), {0: [1, 2, 3]})
    assert short.mismatch is not None
    assert short.mismatch.why == "finished early"


def test_workload_aborts_land_at_every_ring_offset_and_respect_seed() -> None:
    workload = make_workload(WorkloadConfig(num_requests=40, dp_size=2, seed=3))
    assert workload == make_workload(WorkloadConfig(num_requests=40, dp_size=2, seed=3))
    offsets = {r.abort_after_steps for r in workload.requests} - {None}
    assert offsets >= {0, 1, 2, 3}
    assert {r.replica for r in workload.requests} == {0, 1}


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        (dict(pp=0), "pp=0 is outside 1.."),
        (dict(dp=0), "dp=0 is outside 1.."),
        (dict(spec=99), "spec=99 is outside 0..7"),
        (dict(backend="mpi"), "backend='mpi' is not a backend"),
        (dict(timeout_s=0), "timeout_s=0 is out of range"),
        (dict(timeout_s=float("inf")), "timeout_s=inf is out of range"),
        (dict(timeout_s=2 * MAX_TIMEOUT_S), "timeout_s=172800.0 is out of range"),
        (dict(interpreter="jit"), "interpreter='jit' is not an interpreter mode"),
        # CUDA graphs need the nccl backend
        (dict(interpreter="captured"), "interpreter='captured' with backend='gloo'"),
        # A research runner builds these by hand: a bool is no count, a float no step.
        (dict(steps=True), "steps=True is a bool, not an int"),
        (dict(requests=2.5), "requests=2.5 is a float, not an int"),
        (dict(timeout_s=True), "timeout_s=True is a bool"),
        (dict(timeout_s="60"), "timeout_s='60' is a str"),
        (dict(validate_header=1), "validate_header=1 is not a bool"),
        (dict(overlap_agreement="yes"), "overlap_agreement='yes' is not a bool"),
        (dict(wire="bogus"), "wire='bogus' is not a wire format. Fix: use one of 'seed', "),
        (dict(max_num_reqs=0), "max_num_reqs=0 is outside 1.."),
        (dict(chunk_size=0), "chunk_size=0 is outside 1.."),
    ],
)
def test_settings_refuse_a_bad_value_when_built(bad: dict[str, Any], said: str) -> None:
    """Every field is checked when the settings are built, so `launch` never starts rank
    processes that would refuse them (each rank failing with exit 2)."""
    with pytest.raises(ConfigError, match=rf"^RunSettings: {re.escape(said)}"):
        RunSettings(**bad)


def test_settings_refuse_capture_sizes_the_dispatcher_refuses() -> None:
    with pytest.raises(ConfigError, match=r"^CudaGraphDispatcher: capture_sizes=\[4, 2\]"):
        RunSettings(capture_sizes=(4, 2))


def test_settings_accept_each_bound() -> None:
    """The library's own bounds, at their edges (a run compares a request at least)."""
    RunSettings(pp=1, dp=1, steps=0, requests=1, spec=0, seed=0, timeout_s=0.001)
    RunSettings(pp=8, num_layers=8, spec=MAX_SPECULATIVE_STEPS)
    refused: list[dict[str, Any]] = [
        dict(pp=9, num_layers=8),
        dict(steps=-1),
        dict(requests=0),
        dict(timeout_s=0.0009),
        dict(spec=-1),
    ]
    for bad in refused:
        with pytest.raises(ConfigError, match=r"^RunSettings: "):
            RunSettings(**bad)


@pytest.mark.parametrize("spec", [0, 1, MAX_SPECULATIVE_STEPS])
def test_the_longest_request_fits_the_model_length_with_every_draft_rejected(spec: int) -> None:
    """The longest prompt and output of the workload, its drafts always rejected, so it
    decodes one token a step with all its drafts past the end: every position the
    scheduler asks the toy model for lies within `max_model_len`."""
    settings = RunSettings(pp=1, dp=1, spec=spec)
    workload = settings.workload
    request = Request(
        request_id=0,
        replica=0,
        arrival_step=0,
        prompt=tuple(range(1, workload.max_prompt + 1)),
        max_tokens=workload.max_output,
        abort_after_steps=None,
    )
    config = SchedulerConfig(
        max_num_reqs=1,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        chunk_size=settings.chunk_size,
        num_speculative_steps=spec,
        pp_size=1,
    )
    scheduler = Scheduler(config, [request])
    stage = ToyStage(range(1), 1, settings.max_model_len, torch.device("cpu"))
    step = 0
    while 0 not in scheduler.finished:
        scheduler.admit(step)
        for row in scheduler.schedule(step).rows:
            plan = ForwardPlan.build(64, [row.slot], [row.start], [list(row.token_ids)])
            stage.forward(plan, None)  # an IndexError past the cache's end
            assert row.start + len(row.token_ids) <= settings.max_model_len
            if row.samples:
                drafts = [VOCAB - 1] * spec  # never the token sampled next
                scheduler.apply_outputs(row, row.slot, [step % 7], row.num_drafts, drafts)
        step += 1
    assert len(scheduler.outputs[0]) == workload.max_output


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("pp", "dp", "spec"),
    [(2, 2, 2), (3, 1, 1), (1, 2, 0)],
)
def test_pp_dp_run_matches_single_stage_run(pp: int, dp: int, spec: int) -> None:
    summary = launch(RunSettings(pp=pp, dp=dp, spec=spec, requests=10, timeout_s=30))
    assert summary.verdict.ok, summary.verdict.render()
    assert summary.verdict.exact > 0
    # Every request not aborted ran to its end in both runs: none is left a mere prefix.
    assert summary.verdict.exact == summary.requests - summary.aborted
    assert summary.verdict.prefixes == summary.aborted > 0
    assert summary.tokens > 0
    if spec:
        assert 0 < summary.drafts_accepted < summary.drafts_proposed  # some drafts rejected


@pytest.mark.multiprocess
def test_steps_given_are_all_run_though_every_request_finished_sooner() -> None:
    """`--steps N` runs N decode steps (the run and the reference): without it, a run
    without DP stops once every request finished, well before its step bound."""
    steps = RunSettings(pp=2, dp=1, requests=2).total_steps
    summary = launch(RunSettings(pp=2, dp=1, requests=2, steps=steps, timeout_s=30))
    assert (summary.steps, summary.reference_steps) == (steps, steps)
    assert summary.verdict.ok, summary.verdict.render()
    assert summary.verdict.exact == summary.requests - summary.aborted
    unbounded = launch(RunSettings(pp=2, dp=1, requests=2, timeout_s=30))
    assert unbounded.steps < steps
    assert unbounded.tokens == summary.tokens


def _agreed_ahead(logs: Path) -> dict[str, int]:
    """Per rank log, the steps T whose relay effects come after step T + 1's all-reduce:
    the steps during which the next step's agreement was started."""
    ahead = {}
    for name, lines in _records(logs).items():
        effects = [json.loads(line)["effect"] for line in lines]
        started = set()  # steps whose agreement was issued so far
        overlapped = set()
        for effect in effects:
            if effect["kind"] == "all_reduce":
                started.add(effect["step"])
            elif effect["op"] in {"receive", "broadcast"} and effect["step"] + 1 in started:
                overlapped.add(effect["step"])
        ahead[name] = len(overlapped)
    return ahead


@pytest.mark.multiprocess
def test_an_overlapped_run_matches_the_single_stage_run_and_agrees_a_step_ahead(
    tmp_path: Path,
) -> None:
    """`--overlap-agreement`: each step's agreement is started during the step before,
    and the tokens are still the single-stage run's, token for token."""
    for overlap in (True, False):
        logs = tmp_path / str(overlap)
        settings = RunSettings(
            pp=2, dp=2, spec=1, requests=10, timeout_s=30, overlap_agreement=overlap
        )
        started = time.monotonic()
        summary = launch(settings, log_dir=str(logs))
        assert 0 < summary.seconds < time.monotonic() - started  # the loops', inside the run
        assert summary.verdict.ok, summary.verdict.render()
        assert summary.verdict.exact == summary.requests - summary.aborted
        assert summary.verdict.prefixes == summary.aborted > 0
        assert 0 < summary.drafts_accepted < summary.drafts_proposed
        assert check_logs(logs).ok
        ahead = _agreed_ahead(logs)
        assert len(ahead) == 4
        if overlap:
            # Every rank relayed during steps whose successor's all-reduce was already out.
            assert all(count > 0 for count in ahead.values()), ahead
        else:
            assert set(ahead.values()) == {0}, ahead


def _records(logs: Path) -> dict[str, list[str]]:
    """Each rank's log records, its header (which names the run and its settings) aside."""
    return {p.name: p.read_text().splitlines()[1:] for p in sorted(logs.glob("rank-*.jsonl"))}


@pytest.mark.multiprocess
def test_every_interpreter_mode_logs_the_records_eager_logs(tmp_path: Path) -> None:
    """A 2 x 2 run with speculation on the fixed wire, eagerly, checked and with plans:
    each matches the single-stage run token for token, and all three log the very same
    effects; with plans, steady batches ran as plans."""
    records = {}
    for mode in ("eager", "checked", "plan"):
        settings = RunSettings(
            pp=2, dp=2, spec=2, requests=10, timeout_s=60, wire="fixed", interpreter=mode
        )
        summary = launch(settings, log_dir=str(tmp_path / mode))
        assert summary.verdict.ok, (mode, summary.verdict.render())
        assert summary.tokens > 0
        records[mode] = _records(tmp_path / mode)
        plans = summary.plans
        if mode == "plan":
            assert plans.lowered > 0
            assert plans.planned > 5 * plans.lowered, plans
            assert plans.replayed == 0
        else:
            assert plans == PlanCounts()
        assert f"interpreter      {mode}" in summary.render()
    assert len(records["eager"]) == 4
    assert records["checked"] == records["eager"]
    assert records["plan"] == records["eager"]


@pytest.mark.gpu
@pytest.mark.multiprocess
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("wire", ["seed", "fixed"])
def test_a_captured_run_replays_graphs_and_matches_the_single_stage_run(wire: str) -> None:
    """One GPU, one rank: the relay's batches and the agreement run as CUDA-graph replays
    of their plans, and the tokens match the single-stage run on CPU."""
    settings = RunSettings(
        pp=1, dp=1, spec=3, requests=10, backend="nccl", wire=wire, interpreter="captured"
    )
    summary = launch(settings)
    assert summary.verdict.ok, summary.verdict.render()
    assert summary.verdict.exact > 0
    assert summary.plans.replayed > summary.plans.lowered, summary.plans


@pytest.mark.multiprocess
def test_launch_draws_progress_on_stderr_unless_told_not_to(
    capfd: pytest.CaptureFixture[str],
) -> None:
    settings = RunSettings(pp=1, dp=1, requests=2, timeout_s=30)
    assert launch(settings).verdict.ok
    assert "step" in capfd.readouterr().err  # a line per tenth of the run (not a terminal)
    assert launch(settings, progress=False).verdict.ok
    assert capfd.readouterr().err == ""


# -- the loop itself, one process per rank, on workloads small enough to follow by hand ----


def _request(
    request_id: int, replica: int, prompt_len: int, max_tokens: int, abort_after: int | None = None
) -> Request:
    """A request arriving at step 0, with a prompt of its own."""
    first = 10 * request_id + 1
    return Request(
        request_id=request_id,
        replica=replica,
        arrival_step=0,
        prompt=tuple(range(first, first + prompt_len)),
        max_tokens=max_tokens,
        abort_after_steps=abort_after,
    )


@attrs.frozen(kw_only=True)
class _LoopRun:
    """What one rank's loop reported, and what it held between steps."""

    result: RankResult
    ahead: tuple[int | None, ...]  # after each step: the step whose agreement is in flight
    all_reduces: tuple[int, ...]  # the steps of the agreement all-reduces, in issue order
    left_ahead: bool  # the loop kept a batch scheduled ahead past its last step


def _run_loop(settings: RunSettings, requests: tuple[Request, ...], ctx: RankContext) -> _LoopRun:
    world = Layout(pp=settings.pp, dp=settings.dp)
    groups = build_communicators(
        pp_groups=world.pp_groups,
        dp_groups=world.dp_groups,
        relay_backend="gloo",
        timeout=ctx.timeout,
    )
    env = TorchInterpreter(device=torch.device("cpu"), groups=groups, rank=ctx.rank)
    recorder = Recorder(LogHeader(rank=ctx.rank, world=world), env)
    ahead: list[int | None] = []

    def step_done(step: int) -> None:
        agreeing = loop.state.agreeing
        ahead.append(None if agreeing is None else agreeing.step)

    loop = RankLoop(
        settings,
        Workload(vocab_size=VOCAB, requests=requests),
        rank=ctx.rank,
        env=env,
        perform=recorder,
        activation_group=None,
        progress=step_done,
    )
    result = loop.run()
    return _LoopRun(
        result=result,
        ahead=tuple(ahead),
        all_reduces=tuple(
            r.effect.step for r in recorder.log.records if isinstance(r.effect, AllReduce)
        ),
        left_ahead=loop.scheduled_ahead is not None,
    )


def _reference(requests: tuple[Request, ...], settings: RunSettings) -> dict[int, list[int]]:
    return {
        r.request_id: reference_generate(r.prompt, r.max_tokens, settings.num_layers, VOCAB)
        for r in requests
    }


@pytest.mark.multiprocess
def test_padding_and_eager_steps_are_counted_from_the_agreed_shapes() -> None:
    """pp 1 x dp 2, no drafts, graphs of 1, 2, 4, 8, ... tokens. Rank 0 prefills a
    3-token prompt and decodes once; rank 1 prefills a 5-token one and decodes twice.

    - step 0: prefills of 3 and 5 tokens, padded to the graph for the most, 8: rank 0
      pads 5 (alone it would have run the 4-token graph), rank 1 pads 3;
    - step 1: a 1-token decode on each runs the 1-token graph: no padding;
    - step 2: rank 0 idle (an idle rank runs eager) while rank 1 decodes, so the group
      agrees to run eager, each rank its own count: no padding, an eager step on each;
    - step 3: both idle: nothing agreed eager, nothing padded."""
    settings = RunSettings(pp=1, dp=2, spec=0, steps=4, requests=2)
    requests = (
        _request(0, 0, prompt_len=3, max_tokens=2),
        _request(1, 1, prompt_len=5, max_tokens=3),
    )
    runs = run_ranks(functools.partial(_run_loop, settings, requests), settings.world_size)
    results = [run.result for run in runs]
    assert [(r.padded_tokens, r.eager_steps) for r in results] == [(5, 1), (3, 1)]
    summary = summarise(settings, results, [])
    assert (summary.padded_tokens, summary.eager_steps) == (8, 2)
    line = "  batch shapes     8 tokens of CUDA-graph padding, 2 steps agreed eager across DP"
    assert line in summary.render().splitlines()
    assert [r.finished for r in results] == [(0,), (1,)]
    # The padded rows change no token.
    outputs = results[0].outputs | results[1].outputs
    verdict = check_parity(outputs, frozenset({0, 1}), _reference(requests, settings))
    assert verdict.ok, verdict.render()
    assert (verdict.exact, verdict.compared) == (2, 5)


# Rank 0's three requests, due to abort 1, 2 and 3 steps after their first decode,
# beside rank 1's request that finishes.
_ABORTING = (
    _request(0, 0, prompt_len=2, max_tokens=10, abort_after=1),
    _request(1, 1, prompt_len=2, max_tokens=3),
    _request(2, 0, prompt_len=2, max_tokens=10, abort_after=2),
    _request(3, 0, prompt_len=2, max_tokens=10, abort_after=3),
)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("overlap", "lengths", "ahead", "padding"),
    [
        (False, {0: 2, 2: 3, 3: 4}, (None,) * 8, [(3, 1), (10, 1)]),
        (True, {0: 2, 2: 2, 3: 3}, (1, 2, 3, 4, 5, 6, 7, None), [(3, 0), (9, 0)]),
    ],
    ids=["plain", "overlapped"],
)
def test_aborts_land_at_their_step_and_no_agreement_outlives_the_run(
    overlap: bool,
    lengths: dict[int, int],
    ahead: tuple[int | None, ...],
    padding: list[tuple[int, int]],
) -> None:
    """pp 1 x dp 2, 2-token prompts, 8 steps: every request prefills at step 0. An
    aborted request keeps the tokens applied before its abort (parity sees only a prefix).

    Plain: in flight one step, each request first decodes at step 1 and its outputs are
    applied a step after they are made; at step s the loop aborts what is due by s, so
    the three abort at steps 2, 3, 4 with 2, 3, 4 tokens. Rank 0 pads 2 (its 6 prefill
    tokens to 8, for rank 1's 2) and 1 (3 decodes to 4); rank 1 pads 6, 3 and, at step 2,
    1 (its decode to rank 0's 2); at step 3 rank 1 is idle, so the group runs eager.

    Overlapped (`--overlap-agreement`): in flight two steps, the requests first decode
    at step 2 and outputs are applied at steps 1, 3, 5. At step s the loop settles step
    s's agreement, then aborts what is due by s + 1 (the step it schedules next), sparing
    step s's rows: due by 3, spared at 2, aborted at 3 with 2 tokens; due by 4, aborted
    at 3 with 2; due by 5, spared at 4, aborted at 5 with 3. Padding: 6 and 2 prefill
    tokens to 8, 3 and 1 decodes to 4. After each step but the last, the next step's
    agreement is in flight; after the last, none is.

    Either way one all-reduce per step, in step order, and none past the run."""
    settings = RunSettings(pp=1, dp=2, spec=0, steps=8, requests=4, overlap_agreement=overlap)
    runs = run_ranks(functools.partial(_run_loop, settings, _ABORTING), settings.world_size)
    aborts, finishes = runs[0].result, runs[1].result
    assert {r: len(tokens) for r, tokens in aborts.outputs.items()} == lengths
    assert (aborts.aborted, aborts.finished) == ((0, 2, 3), ())
    assert (finishes.aborted, finishes.finished) == ((), (1,))
    outputs = aborts.outputs | finishes.outputs
    verdict = check_parity(outputs, frozenset({1}), _reference(_ABORTING, settings))
    assert verdict.ok, verdict.render()
    for run in runs:
        assert run.ahead == ahead
        assert run.all_reduces == tuple(range(8))
        assert not run.left_ahead
    assert [(run.result.padded_tokens, run.result.eager_steps) for run in runs] == padding
