"""Host-side request bookkeeping and scheduling, replicated on every rank of a replica.

Every stage of a pipeline keeps the same table: it changes only at step
boundaries, from facts every stage has (the workload, and the sampled outputs
that reach every stage exactly `pp_size` steps after the step that made them).
So every stage schedules the same batch, and the relay's receive and broadcast
masks agree without any extra communication.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import attrs
import numpy as np

from purepp.batch import BatchFacts
from purepp.runner.workload import Request

__all__ = ["RequestState", "ScheduledRow", "ScheduledStep", "Scheduler", "SchedulerConfig"]


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    """Limits of one replica's batches."""

    max_num_reqs: int  # request slots
    max_num_batched_tokens: int  # token budget of one step
    chunk_size: int  # longest prefill chunk
    num_speculative_steps: int  # drafts verified per decode step
    pp_size: int  # a request scheduled at step T is in flight until T + pp_size


@attrs.define(kw_only=True)
class RequestState:
    """A request that holds a slot."""

    request: Request  # what the workload asked for
    tokens: list[int]  # prompt, then every output token so far
    num_computed: int = 0  # positions whose cache entries are final
    drafts: list[int] = attrs.Factory(list)  # proposals to verify at the next decode
    in_flight_until: int = 0  # first step at which it may be scheduled again
    first_decode_step: int | None = None  # when it first decoded (aborts count from here)

    @property
    def num_outputs(self) -> int:
        return len(self.tokens) - len(self.request.prompt)

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.request.prompt)


@attrs.frozen(kw_only=True)
class ScheduledRow:
    """One request's share of a step."""

    slot: int  # request slot
    request_id: int  # the request in the slot when scheduled
    start: int  # position of the first scheduled token
    token_ids: tuple[int, ...]  # scheduled tokens: a prefill chunk, or last token + drafts
    num_drafts: int  # drafts among token_ids (decode rows)
    decode: bool  # a decode row (last token + drafts), not a prefill chunk
    samples: bool  # whether this row produces a token (not a non-final prefill chunk)


@attrs.frozen(kw_only=True)
class ScheduledStep:
    """What a replica runs at one step: identical on each of its stages."""

    step: int  # decode step
    rows: tuple[ScheduledRow, ...]  # batch rows in order
    batch: BatchFacts  # the facts the relay steps read

    @property
    def num_tokens(self) -> int:
        return sum(len(row.token_ids) for row in self.rows)

    @property
    def uniform_token_count(self) -> int | None:
        """The per-request token count when every row decodes alike, else None."""
        counts = {len(row.token_ids) for row in self.rows}
        if len(counts) != 1 or not all(row.decode for row in self.rows):
            return None
        return counts.pop()

    @property
    def max_query_len(self) -> int | None:
        return max((len(row.token_ids) for row in self.rows), default=None)


class Scheduler:
    """The request table of one replica, and the scheduling policy."""

    def __init__(self, config: SchedulerConfig, requests: Sequence[Request]) -> None:
        self.config = config
        self.waiting = sorted(requests, key=lambda r: (r.arrival_step, r.request_id))
        self.slots: list[RequestState | None] = [None] * config.max_num_reqs
        self.outputs: dict[int, list[int]] = {}  # request id -> output tokens, when it left
        self.aborted: set[int] = set()
        self.finished: set[int] = set()

    # -- changes at the start of a step -------------------------------------------------

    def apply_outputs(
        self,
        row: ScheduledRow,
        slot: int,
        sampled: Sequence[int],
        num_rejected: int,
        drafts: Sequence[int],
    ) -> bool:
        """Apply one row's sampled tokens to whatever request holds `slot` now.

        The relay has already dropped rows whose slot was freed; a stale row that
        slipped through would corrupt the new request, which the parity check
        against a single-stage run catches. Returns True if the request finished.
        """
        state = self.slots[slot]
        if state is None:
            return False
        # Rejected drafts' positions are recomputed later, overwriting their cache entries.
        state.num_computed = row.start + len(row.token_ids) - num_rejected
        state.tokens.extend(int(t) for t in sampled)
        state.drafts = [int(d) for d in drafts]
        if state.num_outputs < state.request.max_tokens:
            return False
        self._leave(slot, finished=True)
        return True

    def abort_due(self, step: int, spare: Collection[int] = ()) -> list[int]:
        """Abort the requests whose abort time has come; returns their slots.

        Slots in `spare` wait a step: their request is in the batch running now, whose
        relay rows must be recorded before the slot's generation moves on.
        """
        freed = []
        for slot, state in enumerate(self.slots):
            if state is None or state.first_decode_step is None or slot in spare:
                continue
            delay = state.request.abort_after_steps
            if delay is not None and step >= state.first_decode_step + delay:
                self._leave(slot, finished=False)
                freed.append(slot)
        return freed

    def admit(self, step: int) -> list[int]:
        """Give arrived requests the lowest free slots (a freed slot is reused at once)."""
        admitted = []
        while self.waiting and self.waiting[0].arrival_step <= step and None in self.slots:
            request = self.waiting.pop(0)
            slot = self.slots.index(None)
            self.slots[slot] = RequestState(request=request, tokens=list(request.prompt))
            admitted.append(slot)
        return admitted

    def _leave(self, slot: int, *, finished: bool) -> None:
        state = self.slots[slot]
        if state is None:
            return
        request = state.request
        self.outputs[request.request_id] = state.tokens[len(request.prompt) :][: request.max_tokens]
        (self.finished if finished else self.aborted).add(request.request_id)
        self.slots[slot] = None

    # -- the batch ------------------------------------------------------------------------

    def schedule(self, step: int) -> ScheduledStep:
        """Pick this step's rows: requests not in flight, in slot order, within budget."""
        config = self.config
        budget = config.max_num_batched_tokens
        rows: list[ScheduledRow] = []
        for slot, state in enumerate(self.slots):
            if state is None or state.in_flight_until > step:
                continue
            row = self._row(slot, state, budget)
            if row is None:
                continue
            rows.append(row)
            budget -= len(row.token_ids)
            state.in_flight_until = step + config.pp_size
            if row.decode and state.first_decode_step is None:
                state.first_decode_step = step
            if not row.samples:
                # A non-final prefill chunk produces no token: its cache entries are final now.
                state.num_computed += len(row.token_ids)
        batch = BatchFacts(
            idx_mapping=np.array([row.slot for row in rows], dtype=np.int32),
            num_computed_tokens=np.array([row.start for row in rows], dtype=np.int32),
            num_scheduled_tokens=np.array([len(row.token_ids) for row in rows], dtype=np.int32),
            prefill_len=np.array(
                [len(self._state(row.slot).request.prompt) for row in rows], dtype=np.int32
            ),
        )
        return ScheduledStep(step=step, rows=tuple(rows), batch=batch)

    def _state(self, slot: int) -> RequestState:
        state = self.slots[slot]
        if state is None:
            raise RuntimeError(f"slot {slot} is empty")  # scheduling invariant, not input
        return state

    def _row(self, slot: int, state: RequestState, budget: int) -> ScheduledRow | None:
        prompt_len = len(state.request.prompt)
        start = state.num_computed
        if state.prefilling:
            size = min(self.config.chunk_size, prompt_len - start, budget)
            if size <= 0:
                return None
            tokens = tuple(state.tokens[start : start + size])
            return ScheduledRow(
                slot=slot,
                request_id=state.request.request_id,
                start=start,
                token_ids=tokens,
                num_drafts=0,
                decode=False,
                samples=start + size >= prompt_len,
            )
        drafts = state.drafts[: self.config.num_speculative_steps]
        if 1 + len(drafts) > budget:
            return None
        return ScheduledRow(
            slot=slot,
            request_id=state.request.request_id,
            start=start,
            token_ids=(state.tokens[start], *drafts),
            num_drafts=len(drafts),
            decode=True,
            samples=True,
        )
