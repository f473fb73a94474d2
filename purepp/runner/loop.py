"""One rank's decode loop with purepp inside: what a research serving loop looks like.

Each step, on every rank of a replica (all stages keep the same request table):
1. apply the sampled outputs of the step `pp_size` steps ago (non-last stages
   consume them from the relay's ring; the last stage kept its own), finish
   requests that reached their max tokens, abort those due, admit arrivals into
   the freed slots at once;
2. schedule the batch and agree its shape across the DP group (every rank, idle
   or not, takes part), padding to the dispatched CUDA-graph size;
3. run the toy model's stage, passing activations to the next stage;
4. the last stage samples (verifying drafts), broadcasts sampled tokens, counts
   and new drafts; the other stages post the matching receives;
5. end the relay's step.
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

from purepp import dp
from purepp.batch import need_sampled_mask
from purepp.cudagraph import CaptureMode, CudaGraphDispatcher
from purepp.effects.interpreter import Interpreter
from purepp.effects.torch_interpreter import TorchInterpreter
from purepp.effects.vocabulary import BufferRef, DType, TensorSpec
from purepp.errors import StaleTokenError
from purepp.layout import Layout
from purepp.relay import (
    DRAFT_TOKENS,
    IDX_MAPPING,
    NUM_REJECTED,
    NUM_SAMPLED,
    SAMPLED_TOKENS,
    RelayConfig,
    broadcast_drafts,
    broadcast_sampled,
    consume_previous_step,
    end_step,
    free_request_slots,
    init_relay,
    receive,
)
from purepp.runner.results import RankResult
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

__all__ = ["DRAFTS_TO_UPDATE", "RankLoop", "RankResult"]

# Non-last stages: the [max_num_reqs, spec] draft table the relay scatters drafts into.
DRAFTS_TO_UPDATE = BufferRef("input.drafts_to_update")


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
        )
        self.relay = init_relay(self.relay_config)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_reqs=settings.max_num_reqs,
                max_num_batched_tokens=settings.max_num_batched_tokens,
                chunk_size=settings.chunk_size,
                num_speculative_steps=settings.spec,
                pp_size=settings.pp,
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
        self.in_flight: deque[_InFlight] = deque()
        self.steps_run = 0
        self.drafts_proposed = 0
        self.drafts_accepted = 0
        self.padded_tokens = 0
        self.eager_steps = 0
        if not self.is_last and self.spec:
            env.bind(DRAFTS_TO_UPDATE, self._zeros((settings.max_num_reqs, self.spec)))

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
        self._apply_previous(step)
        freed = self.scheduler.abort_due(step)
        self._free(freed)
        for slot in self.scheduler.admit(step):
            self.model.reset_slot(slot)
        scheduled = self.scheduler.schedule(step)
        num_tokens = self._agree(step, scheduled)
        sampled = self._forward(scheduled, num_tokens)
        self._relay(scheduled, sampled)
        self.in_flight.append(_InFlight(scheduled=scheduled, sampled=sampled))
        ended = end_step(self.relay_config, self.relay)
        self.interpreter.perform(ended.effects)
        self.relay = ended.state

    def _all_done(self) -> bool:
        """Stop early only without DP: replicas cannot see each other's work, but the
        stages of one replica share its table and stop at the same step."""
        if self.settings.dp > 1 or self.settings.steps:
            return False
        scheduler = self.scheduler
        pending = any(entry.scheduled.rows for entry in self.in_flight)
        return not (scheduler.waiting or pending or any(scheduler.slots))

    def _free(self, slots: list[int]) -> None:
        if slots:
            self.relay = free_request_slots(self.relay_config, self.relay, slots).state

    # -- 1. outputs of the step pp_size ago ---------------------------------------------------

    def _apply_previous(self, step: int) -> None:
        consumed = None
        if not self.is_last:
            target = DRAFTS_TO_UPDATE if self.spec else None
            taken = consume_previous_step(self.relay_config, self.relay, target)
            self.interpreter.perform(taken.effects)
            self.relay = taken.state
            consumed = taken.result
        if not self.in_flight or self.in_flight[0].scheduled.step != step - self.settings.pp:
            return
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
            tensors = self.env.resolve(consumed)
            tokens = tensors["sampled_tokens"].cpu().numpy()
            counts = tensors["counts"].cpu().numpy()
            drafts = self.env.tensor(DRAFTS_TO_UPDATE).cpu().numpy() if self.spec else None
            for i, slot in enumerate(consumed.idx_mapping_np.tolist()):
                if slot < 0:
                    continue  # freed since, or produced no token: the relay dropped it
                self._check_not_stale(step, rows[i], slot)
                count = int(counts[0, i])
                if self.scheduler.apply_outputs(
                    rows[i],
                    slot,
                    tokens[i, :count].tolist(),
                    int(counts[1, i]),
                    [] if drafts is None else drafts[slot].tolist(),
                ):
                    finished.append(slot)
        self._free(finished)

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

    # -- 2. the DP agreement -----------------------------------------------------------------

    def _agree(self, step: int, scheduled: ScheduledStep) -> int:
        """Agree the padded token count across replicas; every rank takes part."""
        started = dp.start_agreement(
            self.dispatcher,
            step=step,
            num_reqs=scheduled.batch.num_reqs,
            num_tokens=scheduled.num_tokens,
            uniform_token_count=scheduled.uniform_token_count,
            dp_size=self.settings.dp,
            dp_rank=self.replica,
            max_query_len=scheduled.max_query_len,
        )
        if started.state is None:
            outcome = started.result
        else:
            self.interpreter.perform(started.effects)
            waited = dp.wait_for_agreement(started.state)
            self.interpreter.perform(waited.effects)
            table = self.env.host_array(waited.result)
            finished = dp.finish_agreement(started.state, table)
            self.interpreter.perform(finished.effects)
            outcome = finished.result
        if outcome is None:
            raise RuntimeError("an agreement decided nothing")  # start/finish contract
        descriptor = outcome.descriptor
        self.padded_tokens += descriptor.num_tokens - scheduled.num_tokens
        self.eager_steps += int(outcome.sync is not None and outcome.sync.eager)
        return descriptor.num_tokens

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

    # -- 4. the relay --------------------------------------------------------------------------

    def _relay(self, scheduled: ScheduledStep, sampled: _Sampled | None) -> None:
        batch = scheduled.batch
        # A fresh tensor each step: the ring keeps this one until it is consumed.
        self.env.bind(IDX_MAPPING, self._to_device(batch.idx_mapping))
        if not self.is_last:
            posted = receive(self.relay_config, self.relay, batch)
            self.interpreter.perform(posted.effects)
            self.relay = posted.state
            return
        if sampled is None:
            if need_sampled_mask(batch) is not None:
                raise RuntimeError("rows need a sample but the model did not run")
            return
        self.env.bind(SAMPLED_TOKENS, self._to_device(sampled.tokens))
        self.env.bind(NUM_SAMPLED, self._to_device(sampled.num_sampled))
        self.env.bind(NUM_REJECTED, self._to_device(sampled.num_rejected))
        sent = broadcast_sampled(
            self.relay_config,
            self.relay,
            batch,
            TensorSpec(shape=sampled.tokens.shape, dtype=DType.INT64),
        )
        self.interpreter.perform(sent.effects)
        self.relay = sent.state
        if not self.spec:
            return
        table = np.zeros((self.settings.max_num_reqs, self.spec), dtype=np.int64)
        table[batch.idx_mapping] = sampled.drafts
        self.env.bind(DRAFT_TOKENS, self._to_device(table))
        sent = broadcast_drafts(
            self.relay_config, self.relay, batch, TensorSpec(shape=table.shape, dtype=DType.INT64)
        )
        self.interpreter.perform(sent.effects)
        self.relay = sent.state

    # -- the report --------------------------------------------------------------------------

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
        )
