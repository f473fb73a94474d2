"""One rank's decode loop with purepp inside: what a research serving loop looks like.

Each step runs the library's rank step (`purepp.rank`: begin, agree, finish) with this
runner's work in between, on every rank of a replica (all stages keep the same request
table):
1. `begin` consumes the sampled outputs of the step `pp_size` steps ago (non-last
   stages; the last stage kept its own); the runner applies them, finishes requests
   that reached their max tokens, aborts those due, admits arrivals into the freed slots;
2. `agree` frees those slots in the relay and agrees the batch shape across the DP
   group (every rank, idle or not, takes part), padding to the dispatched graph size;
3. the toy model's stage runs, passing activations to the next stage; the last stage
   samples (verifying drafts) and proposes new drafts;
4. `finish` broadcasts sampled tokens, counts and drafts (last stage) or posts the
   matching receives, and ends the relay's step.

With `--overlap-agreement` the runner schedules one step ahead, as vLLM's asynchronous
scheduling does: a request is in flight for pp + 1 steps instead of pp, so step T + 1's
batch is known from facts every rank has before step T's forward. Its agreement is
started (asynchronous all-reduce) just before that forward and settled at the top of
step T + 1; aborts of a request in step T's batch wait a step, so its relay rows are
recorded before its slot is freed. The schedule changes, the tokens do not (parity).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import attrs
import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist

from purepp.cudagraph import CaptureMode, CudaGraphDispatcher
from purepp.dp import AgreementGroup
from purepp.effects.interpreter import Interpreter
from purepp.effects.io import TorchIO
from purepp.effects.torch_interpreter import TorchInterpreter
from purepp.errors import StaleTokenError
from purepp.layout import Layout
from purepp.rank import Agreed, Begun, RankConfig, RankDriver, Sampled, ShapeFacts, init_rank
from purepp.relay import ConsumedOutputs, RelayConfig, Wire
from purepp.runner.results import PlanCounts, RankResult
from purepp.runner.scheduler import ScheduledRow, ScheduledStep, Scheduler, SchedulerConfig
from purepp.runner.settings import RunSettings
from purepp.runner.toy_model import (
    ForwardPlan,
    ToyStage,
    layers_of_stage,
    next_token_rule,
    propose_drafts,
)
from purepp.runner.workload import Workload

__all__ = ["RankLoop", "RankResult"]


@attrs.frozen(kw_only=True)
class _Sampled:
    """The last stage's own copy of one step's outputs, applied `pp_size` steps later."""

    tokens: npt.NDArray[np.int64]  # [n, width]
    num_sampled: npt.NDArray[np.int32]  # [n]
    num_rejected: npt.NDArray[np.int32]  # [n]
    drafts: npt.NDArray[np.int64]  # [n, spec] proposals for each row's next step


@attrs.frozen(kw_only=True)
class _InFlight:
    scheduled: ScheduledStep
    sampled: _Sampled | None  # last stage only


def _shape(scheduled: ScheduledStep) -> ShapeFacts:
    """The batch's shape facts for the DP agreement."""
    return ShapeFacts(
        num_tokens=scheduled.num_tokens,
        uniform_token_count=scheduled.uniform_token_count,
        max_query_len=scheduled.max_query_len,
    )


class RankLoop:
    """The decode loop of one rank. `perform` runs effects (the interpreter, possibly
    wrapped by a recorder or tracer); `env` binds and reads the tensors."""

    def __init__(
        self,
        settings: RunSettings,
        workload: Workload,
        *,
        rank: int,
        env: TorchInterpreter,
        perform: Interpreter,
        activation_group: dist.ProcessGroup | None,
        progress: Callable[[int], None] = lambda step: None,
    ) -> None:
        self.settings = settings
        self.rank = rank
        world = Layout(pp=settings.pp, dp=settings.dp)
        self.stage = world.pp_stage(rank)
        self.replica = world.dp_index(rank)
        self.env = env
        self.interpreter = perform
        self.activation_group = activation_group
        self.progress = progress
        self.device = env.device
        self.spec = settings.spec
        self.relay_config = RelayConfig.for_stage(
            pp_size=settings.pp,
            stage=self.stage,
            max_num_reqs=settings.max_num_reqs,
            num_speculative_steps=settings.spec,
            first_rank=self.replica * settings.pp,
            validate_header=settings.validate_header,
            wire=Wire(settings.wire),
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_reqs=settings.max_num_reqs,
                max_num_batched_tokens=settings.max_num_batched_tokens,
                chunk_size=settings.chunk_size,
                num_speculative_steps=settings.spec,
                # Scheduling one step ahead keeps each request out one step longer.
                pp_size=settings.pp + int(settings.overlap_agreement),
            ),
            workload.for_replica(self.replica),
        )
        self.vocab_size = workload.vocab_size
        self.dispatcher = CudaGraphDispatcher(
            capture_sizes=settings.capture_sizes,
            capture_mode=CaptureMode.FULL_AND_PIECEWISE,
            max_num_reqs=settings.max_num_reqs,
            num_speculative_tokens=settings.spec,
        )
        self.model = ToyStage(
            layers_of_stage(self.stage, settings.pp, settings.num_layers),
            settings.max_num_reqs,
            settings.max_model_len,
            self.device,
        )
        self.config = RankConfig(
            relay=self.relay_config,
            group=AgreementGroup(dp_size=settings.dp, dp_rank=self.replica),
            dispatcher=self.dispatcher,
        )
        self.state = init_rank(self.config)
        self.driver = RankDriver(self.config, perform, TorchIO(env))
        self.in_flight: deque[_InFlight] = deque()
        self.scheduled_ahead: ScheduledStep | None = None  # overlap: the next step's batch
        self.steps_run = 0
        self.drafts_proposed = 0
        self.drafts_accepted = 0
        self.padded_tokens = 0
        self.eager_steps = 0
        if self.config.updates_drafts:
            table = self._zeros((settings.max_num_reqs, self.spec))
            env.bind(self.relay_config.inputs.draft_table, table)

    @property
    def is_last(self) -> bool:
        return self.relay_config.is_last_stage

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.int64, device=self.device)

    def _to_device(self, array: npt.NDArray[np.generic]) -> torch.Tensor:
        return torch.from_numpy(np.array(array, copy=True)).to(self.device)

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> RankResult:
        start = time.perf_counter()
        for step in range(self.settings.total_steps):
            self.run_step(step)
            self.steps_run = step + 1
            self.progress(step)
            if self._all_done():
                break
        seconds = time.perf_counter() - start
        return self._result(seconds)

    def run_step(self, step: int) -> None:
        """One decode step: the library's rank step, with this runner's work in between."""
        begun = self.driver.begin(self.state)
        freed = self._apply_previous(step, begun.consumed)
        if self.settings.overlap_agreement:
            self._run_overlapped(step, begun, freed)
            return
        freed += self.scheduler.abort_due(step)
        scheduled = self._schedule(step)
        self._run_forward(scheduled, self.agree(begun, scheduled, freed))

    def agree(self, begun: Begun, scheduled: ScheduledStep, freed: list[int]) -> Agreed:
        """The step's agreement (`RankDriver.agree`), once the step is begun and scheduled.

        A loop that recovers from a dead DP replica overrides this: when the all-reduce
        fails it replaces the DP groups and agrees again from the same `begun`, batch and
        frees (tests/test_dead_replica_gloo.py), as the README's "Dead ranks" says.
        """
        return self.driver.agree(begun, scheduled.batch, _shape(scheduled), freed=freed)

    def _run_overlapped(self, step: int, begun: Begun, freed: list[int]) -> None:
        """The step's agreement was started during the step before; settle it, schedule
        the next step and start its agreement, then run this step's forward."""
        scheduled = self.scheduled_ahead
        if scheduled is None or begun.agreeing is None:  # the first step: nothing started
            freed += self.scheduler.abort_due(step)
            scheduled = self._schedule(step)
            begun = self.driver.start(begun, scheduled.batch, _shape(scheduled))
        # Frees reach the relay at this settle, before this step's rows are recorded.
        freed += self.scheduler.abort_due(step + 1, spare={row.slot for row in scheduled.rows})
        agreed = self.driver.settle(begun, freed=freed)
        self.scheduled_ahead = None
        # The last step starts nothing more: the last of the run, or the step after which
        # the loop stops early (this one runs no row and nothing is left).
        last = step + 1 >= self.settings.total_steps or (not scheduled.rows and self._all_done())
        if not last:
            ahead = self._schedule(step + 1)
            agreed = self.driver.start_next(agreed, ahead.batch, _shape(ahead))
            self.scheduled_ahead = ahead
        self._run_forward(scheduled, agreed)

    def _schedule(self, step: int) -> ScheduledStep:
        for slot in self.scheduler.admit(step):
            self.model.reset_slot(slot)
        return self.scheduler.schedule(step)

    def _run_forward(self, scheduled: ScheduledStep, agreed: Agreed) -> None:
        self._count_padding(scheduled, agreed)
        sampled = self._forward(scheduled, agreed.descriptor.num_tokens)
        self.state = self.driver.finish(agreed, self._relayed(sampled, scheduled))
        self.in_flight.append(_InFlight(scheduled=scheduled, sampled=sampled))

    def _all_done(self) -> bool:
        """Stop early only without DP: replicas cannot see each other's work, but the
        stages of one replica share its table and stop at the same step."""
        if self.settings.dp > 1 or self.settings.steps:
            return False
        scheduler = self.scheduler
        pending = any(entry.scheduled.rows for entry in self.in_flight)
        return not (scheduler.waiting or pending or any(scheduler.slots))

    # -- 1. outputs of the step pp_size ago -----------------------------------------------

    def _apply_previous(self, step: int, consumed: ConsumedOutputs | None) -> list[int]:
        """Apply the outputs of the step pp_size ago; the slots of finished requests."""
        if not self.in_flight or self.in_flight[0].scheduled.step != step - self.settings.pp:
            return []
        entry = self.in_flight.popleft()
        rows = entry.scheduled.rows
        finished: list[int] = []
        if entry.sampled is not None:  # last stage: its own outputs, same filter as the ring
            for i, row in enumerate(rows):
                state = self.scheduler.slots[row.slot]
                if not row.samples or state is None or state.request.request_id != row.request_id:
                    continue
                count = int(entry.sampled.num_sampled[i])
                if self.scheduler.apply_outputs(
                    row,
                    row.slot,
                    entry.sampled.tokens[i, :count].tolist(),
                    int(entry.sampled.num_rejected[i]),
                    entry.sampled.drafts[i].tolist(),
                ):
                    finished.append(row.slot)
        elif consumed is not None:
            if consumed.received_at_step != entry.scheduled.step:
                raise RuntimeError(
                    f"rank {self.rank}: consumed step {consumed.received_at_step}, "
                    f"expected {entry.scheduled.step}"
                )
            env = self.env
            tokens = env.tensor(consumed.sampled_tokens).cpu().numpy()
            num_sampled = env.tensor(consumed.num_sampled).cpu().numpy()
            num_rejected = env.tensor(consumed.num_rejected).cpu().numpy()
            table = self.relay_config.inputs.draft_table
            drafts = env.tensor(table).cpu().numpy() if self.spec else None
            for i, slot in enumerate(consumed.idx_mapping_np.tolist()):
                if slot < 0:
                    continue  # freed since, or produced no token: the relay dropped it
                self._check_not_stale(step, rows[i], slot)
                count = int(num_sampled[i])
                if self.scheduler.apply_outputs(
                    rows[i],
                    slot,
                    tokens[i, :count].tolist(),
                    int(num_rejected[i]),
                    [] if drafts is None else drafts[slot].tolist(),
                ):
                    finished.append(slot)
        return finished

    def _check_not_stale(self, step: int, row: ScheduledRow, slot: int) -> None:
        """The relay must drop rows whose slot was freed and reused; say so loudly if not."""
        state = self.scheduler.slots[slot]
        holder = None if state is None else state.request.request_id
        if holder != row.request_id:
            raise StaleTokenError(
                "consume_previous_step",
                f"at step {step} the relay handed rank {self.rank} a token of request "
                f"{row.request_id} for slot {slot}, which now holds request {holder}",
                "bump the slot's generation on every free path (free_request_slot)",
            )

    # -- 2. the DP agreement (in the rank step) --------------------------------------------

    def _count_padding(self, scheduled: ScheduledStep, agreed: Agreed) -> None:
        self.padded_tokens += agreed.descriptor.num_tokens - scheduled.num_tokens
        sync = agreed.target.sync
        self.eager_steps += int(sync is not None and sync.eager)

    # -- 3. the model ------------------------------------------------------------------------

    def _forward(self, scheduled: ScheduledStep, num_tokens: int) -> _Sampled | None:
        if num_tokens == 0:
            return None
        rows = scheduled.rows
        plan = ForwardPlan.build(
            num_tokens,
            [row.slot for row in rows],
            [row.start for row in rows],
            [list(row.token_ids) for row in rows],
        )
        inputs = None
        if self.stage > 0:
            inputs = self._zeros((num_tokens,))
            dist.recv(inputs, src=self.rank - 1, group=self.activation_group)
        outputs = self.model.forward(plan, inputs)
        if not self.is_last:
            dist.send(outputs, dst=self.rank + 1, group=self.activation_group)
            return None
        return self._sample(scheduled, plan, outputs)

    def _sample(
        self, scheduled: ScheduledStep, plan: ForwardPlan, hidden: torch.Tensor
    ) -> _Sampled:
        """Greedy tokens at every row; drafts accepted while they match, as a verifier does."""
        n = len(scheduled.rows)
        real = hidden[: plan.num_real_rows]
        predicted = next_token_rule(real, self._to_device(plan.token_ids), self.vocab_size)
        predicted_np = predicted.cpu().numpy()
        width = 1 + max((row.num_drafts for row in scheduled.rows), default=0)
        tokens = np.zeros((n, width), dtype=np.int64)
        num_sampled = np.zeros(n, dtype=np.int32)
        num_rejected = np.zeros(n, dtype=np.int32)
        drafts = np.zeros((n, self.spec), dtype=np.int64)
        row_start = 0
        for i, row in enumerate(scheduled.rows):
            outputs = predicted_np[row_start : row_start + len(row.token_ids)]
            row_start += len(row.token_ids)
            if not row.samples:
                continue
            proposals = row.token_ids[1:] if row.decode else ()
            accepted = 0
            while accepted < len(proposals) and proposals[accepted] == outputs[accepted]:
                accepted += 1
            new_tokens = outputs[len(outputs) - 1 :] if not row.decode else outputs[: accepted + 1]
            tokens[i, : len(new_tokens)] = new_tokens
            num_sampled[i] = len(new_tokens)
            num_rejected[i] = len(proposals) - accepted
            self.drafts_proposed += len(proposals)
            self.drafts_accepted += accepted
            state = self.scheduler.slots[row.slot]
            request_id = -1 if state is None else state.request.request_id
            history = 0 if state is None else len(state.tokens)
            drafts[i] = propose_drafts(
                int(new_tokens[-1]),
                self.spec,
                self.vocab_size,
                corrupt=(request_id + history) % 5 == 0,
            )
        return _Sampled(
            tokens=tokens, num_sampled=num_sampled, num_rejected=num_rejected, drafts=drafts
        )

    # -- 4. the relay (in the rank step) ---------------------------------------------------

    def _relayed(
        self, sampled: _Sampled | None, scheduled: ScheduledStep
    ) -> Sampled[torch.Tensor] | None:
        """The last stage's outputs as device tensors for the relay to send."""
        if sampled is None:
            return None
        table = None
        if self.spec:
            drafts = np.zeros((self.settings.max_num_reqs, self.spec), dtype=np.int64)
            drafts[scheduled.batch.idx_mapping] = sampled.drafts
            table = self._to_device(drafts)
        return Sampled(
            tokens=self._to_device(sampled.tokens),
            num_sampled=self._to_device(sampled.num_sampled),
            num_rejected=self._to_device(sampled.num_rejected),
            draft_table=table,
        )

    # -- the report --------------------------------------------------------------------------

    def _plan_counts(self) -> PlanCounts:
        planner = self.env.planner
        if planner is None:
            return PlanCounts()
        return PlanCounts(
            lowered=planner.lowered,
            planned=planner.planned,
            replayed=planner.replayed,
            eager=planner.eager,
        )

    def _result(self, seconds: float) -> RankResult:
        scheduler = self.scheduler
        outputs = dict(scheduler.outputs)
        for state in scheduler.slots:
            if state is not None:
                outputs[state.request.request_id] = state.tokens[len(state.request.prompt) :]
        return RankResult(
            rank=self.rank,
            stage=self.stage,
            replica=self.replica,
            steps=self.steps_run,
            seconds=seconds,
            outputs=outputs,
            finished=tuple(sorted(scheduler.finished)),
            aborted=tuple(sorted(scheduler.aborted)),
            drafts_proposed=self.drafts_proposed,
            drafts_accepted=self.drafts_accepted,
            padded_tokens=self.padded_tokens,
            eager_steps=self.eager_steps,
            plans=self._plan_counts(),
        )
