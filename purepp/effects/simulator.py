"""Every rank of a PP x DP world in one process: collectives matched, data moved, hangs named.

Each rank runs a *program*: a generator that yields tuples of effects in step order
(one per decode step, or several, e.g. to read a step's outputs through its
interpreter before the step's releases). Between yields it may bind inputs and
read outputs: when it resumes, everything it yielded has been issued, the host is
not blocked and the main stream has run its work (a host read waits for it, as a
`.cpu()` copy does). Within a tuple the host runs past a main-stream wait, as on
CUDA: only a CPU all-reduce, `WaitWork`, `Synchronize` or a gloo broadcast holds
it. Progress is measured by the `step` the effects carry. The
simulator issues each rank's effects on that rank's `NumpyInterpreter` and acts
as every communicator:

- A collective completes once every member of its communicator instance has
  posted its matching op (same op number in issue order) and the op has reached
  the head of its stream on every member. Then the data moves: a broadcast copies
  the source's buffer into the others'; an all-reduce sums the contributions into
  every member's table. A gloo broadcast instead lets its members go one by one, as
  gloo's tree does (`purepp.effects.scheduler.BroadcastTree`): a member receives the
  data once every member above it has joined, and goes on once the members it sends
  to have joined too.
- Posts are compared as they arrive (`check_posts`): a member that disagrees on
  kind, source, step, shape or dtype stops the run with a `MismatchReport`. The step
  is a label the wire never carries: with `compare_steps=False` posts are matched as
  NCCL and gloo match them, and only what the data says (the relay's opt-in header,
  checked by `CheckHeader`) can tell that two ranks paired different steps.
- Ranks run greedily, lowest rank first: each issues effects until its host
  blocks, its program ends, or its next effect belongs to step s while a stage of
  its pipeline has not yet issued all of step s - `max_steps_in_flight`. Steps never
  go back, with one exception: an asynchronous all-reduce of a later step (the next
  step's agreement, started during this step's forward by
  `purepp.rank.start_next_agreement`) may come before this step's remaining effects.
  It starts no step: it is never held back, and the rank stays at its step. That is
  the adversarial schedule for a receiver: it consumes as early as the steps in
  flight allow. If the host (or, at its next yield, the main stream it waits for)
  then waits on a relay event (or stream) whose broadcast a peer has not posted
  yet, the receiver has outrun the ring: the run stops with a `RingOverrunReport`.
  With a ring as deep as the steps in flight this cannot happen, because every peer
  has completed the receive's step.
- When no rank can move and no collective can complete, the run stops with a
  `DeadlockReport` naming every stuck rank and stream, the op it waits at, and
  the collective it comes down to. On gloo (`backend='gloo'`) a broadcast blocks
  its host as a CPU all-reduce does; on NCCL it holds only its stream.
- The stages of one replica agree their batch shape in separate DP groups, so
  their columns are compared too: the first agreement (by step, then replica) to
  which they contributed different columns stops the run with a
  `StageDivergenceReport` (field failure 7), before any deadlock or overrun.
- Each rank's noted decisions (`NoteDecision`) are compared: the first agreement (by
  step) that ranks of one group decided differently stops the run with a
  `DecisionDivergenceReport` once every rank has noted it (field failure 17); stages
  that decided apart are reported when the run ends (field failure 7).

All five reports are raised in a `CollectiveReportError` (a
`CollectiveMismatchError`) whose message is the report's rendering. A received relay
header that differs from the receiver's own stops the run with `HeaderMismatchError`
(also a `CollectiveMismatchError`), raised by that rank's interpreter.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import TypeAlias

import attrs

from purepp._checks import INT32_MAX, check_bool, check_int
from purepp._text import a_type
from purepp.effects.matching import (
    CollectiveReportError,
    DeadlockReport,
    RingOverrunReport,
    WaitEdge,
    Waiter,
    comm_group,
    find_wait_cycle,
)
from purepp.effects.numpy_interpreter import (
    POISON,
    NumpyInterpreter,
    Stall,
    describe_effect,
)
from purepp.effects.scheduler import CollectiveHub, started_ahead, waiting_at
from purepp.effects.vocabulary import (
    AllReduce,
    Backend,
    Communicator,
    Effect,
    NoteDecision,
    Stream,
    Synchronize,
    WaitEvent,
    WaitStream,
    check_backend,
)
from purepp.errors import ConfigError, InvalidInputError
from purepp.layout import Layout

# CollectiveReportError: what `simulate` raises, importable beside it.
__all__ = ["CollectiveReportError", "RankContext", "RankProgram", "SimulationResult", "simulate"]

_CALL = "simulate"


@attrs.frozen(kw_only=True, eq=False)
class RankContext:
    """What a rank's program sees: who it is, and its interpreter (bind inputs, read outputs)."""

    rank: int  # global rank
    stage: int  # pipeline stage, 0..pp-1
    replica: int  # data-parallel replica, 0..dp-1
    world: Layout  # the whole world's layout
    interpreter: NumpyInterpreter  # this rank's interpreter


# A rank's program: tuples of effects in step order (a step may span several tuples).
RankProgram: TypeAlias = Callable[[RankContext], Iterator[tuple[Effect, ...]]]


@attrs.frozen(kw_only=True, eq=False)
class SimulationResult:
    """A completed run: every rank's interpreter and the effects it issued."""

    world: Layout  # the layout that ran
    interpreters: tuple[NumpyInterpreter, ...]  # by global rank, in their final state
    effects: tuple[tuple[Effect, ...], ...]  # by global rank, every effect issued, in order

    def interpreter(self, rank: int) -> NumpyInterpreter:
        last = len(self.interpreters) - 1
        return self.interpreters[check_int("SimulationResult.interpreter", "rank", rank, 0, last)]


class _Rank:
    """The simulator's view of one rank: its program, interpreter and progress."""

    def __init__(self, context: RankContext, program: Iterator[tuple[Effect, ...]]) -> None:
        self.context = context
        self.interpreter = context.interpreter
        # its pipeline's stages, which it may run at most `max_steps_in_flight` ahead of
        self.pipeline = comm_group(context.world, context.rank, Communicator.PP_CPU)
        self.program = program
        self.pending: deque[Effect] = deque()  # effects yielded and not yet issued
        self.yields = 0  # tuples the program has yielded
        self.finished = False  # the program is exhausted
        self.issued: list[Effect] = []  # every effect issued, in order
        # the step of the last effect issued that was not an agreement started ahead
        self.order_step: int | None = None
        # steps up to this one may be issued without checking the pipeline again: its
        # stages only move forward, so a step once allowed stays allowed
        self.allowed_step = -1

    def ahead(self, effect: Effect) -> bool:
        """Whether `effect` is a later step's agreement started within this step."""
        return started_ahead(effect, self.order_step)

    def at_step(self) -> int | None:
        """The step this rank is working on (every earlier step is fully issued); None
        once its program has ended and everything it yielded is issued."""
        if self.interpreter.host_blocked() or (
            not self.pending and not self.interpreter.main_idle()
        ):
            return _waiting(self.interpreter).effect.step
        if self.pending:
            return self.pending[0].step
        if self.finished:
            return None
        # Between yields: the next tuple may still belong to the last issued step.
        return 0 if self.order_step is None else self.order_step


_END = object()  # what `next` returns for an exhausted program


class _Simulation:
    def __init__(
        self,
        world: Layout,
        program: RankProgram,
        *,
        max_steps_in_flight: int,
        fill: int,
        compare_steps: bool,
        backend: Backend,
    ) -> None:
        self._world = world
        self._in_flight = max_steps_in_flight
        self._backend = backend
        self._hub = CollectiveHub(world, call=_CALL, compare_steps=compare_steps, backend=backend)
        self._ranks: list[_Rank] = []
        for rank in range(world.world_size):
            interpreter = NumpyInterpreter(rank=rank, port=self._hub, fill=fill, backend=backend)
            context = RankContext(
                rank=rank,
                stage=world.pp_stage(rank),
                replica=world.dp_index(rank),
                world=world,
                interpreter=interpreter,
            )
            made = program(context)
            try:
                steps = iter(made)
            except TypeError:
                raise InvalidInputError(
                    _CALL,
                    f"the program returned {a_type(made)} for rank {rank}",
                    "return an iterator of effect tuples (write the program as a generator)",
                ) from None
            self._ranks.append(_Rank(context, steps))
        self._advancers = [r.interpreter.advance for r in self._ranks]

    def run(self) -> SimulationResult:
        while not self._done():
            progressed = False
            for rank in self._ranks:
                progressed |= self._advance(rank)
            if not progressed:
                self._hub.raise_held()  # a divergence found before the run stopped comes first
                raise CollectiveReportError.from_report(_CALL, self._deadlock())
        self._hub.raise_held()
        return SimulationResult(
            world=self._world,
            interpreters=tuple(r.interpreter for r in self._ranks),
            effects=tuple(tuple(r.issued) for r in self._ranks),
        )

    def _done(self) -> bool:
        return (
            all(
                r.finished
                and not r.pending
                and r.interpreter.idle()
                and not r.interpreter.unfinished_works()
                for r in self._ranks
            )
            and not self._hub.incomplete()
        )

    def _advance(self, rank: _Rank) -> bool:
        """Issue `rank`'s effects until it blocks, ends or would run too far ahead."""
        progressed = False
        while not rank.interpreter.host_blocked():
            if not rank.pending:
                if rank.finished:
                    return progressed
                if not rank.interpreter.main_idle():
                    # Between yields the program may read what it yielded wrote, which
                    # waits for the main stream (as a `.cpu()` copy does).
                    self._check_overrun(rank)
                    return progressed
                step = next(rank.program, _END)
                progressed = True
                if step is _END:
                    rank.finished = True
                    return progressed
                rank.pending.extend(_checked_step(rank.context.rank, rank.yields, step))
                rank.yields += 1
                continue
            effect = rank.pending[0]
            ahead = rank.ahead(effect)
            if not ahead and effect.step > rank.allowed_step:
                if self._held_back_by(rank, effect.step):
                    if not rank.interpreter.main_idle():
                        # Stopped here, it waits for its main stream as at a yield.
                        self._check_overrun(rank)
                    return progressed
                rank.allowed_step = effect.step
            _check_order(rank, effect, ahead)
            rank.pending.popleft()
            rank.issued.append(effect)
            rank.interpreter.issue(effect)
            if type(effect) is NoteDecision:
                self._hub.note(rank.context.rank, effect)
            self._hub.run_completed(self._advancers)
            progressed = True
            if rank.interpreter.host_blocked():
                self._check_overrun(rank)
        return progressed

    def _held_back_by(self, rank: _Rank, step: int) -> tuple[int, ...]:
        """Pipeline peers too far behind for `rank` to issue an effect of `step`."""
        peers = rank.pipeline
        # Step s may start once every stage has issued all of step s - max_steps_in_flight.
        limit = step - self._in_flight
        held_back_by: list[int] = []
        for peer in peers:
            at_step = self._ranks[peer].at_step()
            if peer != rank.context.rank and at_step is not None and at_step <= limit:
                held_back_by.append(peer)
        return tuple(held_back_by)

    def _check_overrun(self, rank: _Rank) -> None:
        """A wait of the host (or of the main stream its program waits for between yields)
        on an earlier step's collective that a live peer has not even posted is a ring
        overrun: the consumer is ahead of the producer's broadcasts."""
        main = _waiting(rank.interpreter)
        effect = main.effect
        if not isinstance(effect, WaitEvent | WaitStream | Synchronize) or main.culprit is None:
            return
        awaited = self._hub.awaited(main.culprit)
        live = [r for r in awaited.missing if not self._ranks[r].finished]
        # A wait within the step that posted the collective is a plain synchronous wait,
        # and a peer that has ended will never post: that is a deadlock, reported later.
        # Only a receiver can outrun the ring; a sender waiting for its own broadcast
        # waits for receivers that merely have not run yet.
        if (
            effect.step <= awaited.signature.step
            or not live
            or len(live) < len(awaited.missing)
            or awaited.signature.src == rank.context.rank
        ):
            return
        report = RingOverrunReport(
            rank=rank.context.rank,
            step=effect.step,
            op=effect.op,
            event=effect.event if isinstance(effect, WaitEvent) else None,
            awaited=awaited,
            ring_depth=effect.step - awaited.signature.step,
            max_steps_in_flight=self._in_flight,
            peers_at=tuple((r, self._ranks[r].at_step()) for r in live),
        )
        self._hub.raise_held()
        raise CollectiveReportError.from_report(_CALL, report)

    def _waiter(self, rank: _Rank, stall: Stall) -> Waiter:
        culprit = stall.culprit
        return Waiter(
            rank=rank.context.rank,
            stream=stall.stream,
            step=stall.effect.step,
            op=stall.effect.op,
            waiting_at=waiting_at(stall.effect, self._backend),
            awaited=None if culprit is None else self._hub.awaited(culprit),
            host=stall.host,
        )

    def _deadlock(self) -> DeadlockReport:
        waiters: list[Waiter] = []
        for rank in self._ranks:
            waiters += [self._waiter(rank, stall) for stall in rank.interpreter.stalls()]
            if rank.interpreter.host_blocked() or not rank.pending:
                continue
            effect = rank.pending[0]
            waiters.append(
                Waiter(
                    rank=rank.context.rank,
                    stream=None,
                    step=effect.step,
                    op=effect.op,
                    waiting_at=f"{describe_effect(effect)}, not yet issued"
                    f" (max_steps_in_flight={self._in_flight})",
                    awaited=None,
                    held_back_by=self._held_back_by(rank, effect.step),
                )
            )
        return DeadlockReport(
            waiters=tuple(waiters),
            pending=self._hub.incomplete(),
            finished=tuple(r.context.rank for r in self._ranks if r.finished and not r.pending),
            at_steps=tuple(r.at_step() for r in self._ranks),
            cycle=find_wait_cycle(self._wait_edges(waiters)),
            unwaited=tuple(
                (r.context.rank, posted.effect)
                for r in self._ranks
                for posted in r.interpreter.unfinished_works()
                if isinstance(posted.effect, AllReduce)
            ),
        )

    def _wait_edges(self, waiters: list[Waiter]) -> list[WaitEdge]:
        """The wait-for graph: each stuck stream's collective to the members it waits for,
        and each held-back rank to the peers it may not run ahead of."""
        edges: list[WaitEdge] = []
        for rank in self._ranks:
            for stall in rank.interpreter.stalls():
                if stall.culprit is not None:
                    edges += self._hub.waits_for(stall.culprit)
        for waiter in waiters:
            edges += [
                WaitEdge(rank=waiter.rank, via=None, seq=None, peer=peer)
                for peer in waiter.held_back_by
            ]
        return edges


def _waiting(interpreter: NumpyInterpreter) -> Stall:
    """What a rank that cannot go on waits at: its host's wait, else (between yields)
    its main stream's."""
    return next(s for s in interpreter.stalls() if s.host or s.stream is Stream.MAIN)


def _check_order(rank: _Rank, effect: Effect, ahead: bool) -> None:
    last = rank.order_step
    if last is not None and effect.step < last:
        raise InvalidInputError(
            _CALL,
            f"rank {rank.context.rank} issues a step-{effect.step} {type(effect).__name__}"
            f" after a step-{last} effect",
            "yield each rank's effects in step order (steps never go back; only the next "
            "step's agreement may start early, as an asynchronous all-reduce)",
        )
    if not ahead:
        rank.order_step = effect.step


def _checked_step(rank: int, index: int, step: object) -> tuple[Effect, ...]:
    if not isinstance(step, tuple):
        raise InvalidInputError(
            _CALL,
            f"rank {rank}'s program yielded {type(step).__name__} as step #{index}",
            "yield one tuple of effects per step",
        )
    strangers = [type(item).__name__ for item in step if not isinstance(item, Effect)]
    if strangers:
        raise InvalidInputError(
            _CALL,
            f"rank {rank}'s step #{index} holds {strangers[0]}, which is not an effect",
            "yield only effects from purepp.effects.vocabulary",
        )
    return step


def simulate(
    world: Layout,
    program: RankProgram,
    *,
    max_steps_in_flight: int | None = None,
    fill: int = POISON,
    compare_steps: bool = True,
    backend: Backend = "nccl",
) -> SimulationResult:
    """Run `program` on every rank of `world` until every rank's program ends.

    `program(context)` is called once per rank and returns that rank's iterator of
    per-step effect tuples. `max_steps_in_flight` bounds how many steps a stage
    may run ahead of the slowest stage of its pipeline (default: `world.pp`, the
    ring depth the relay uses). `fill` is the contents of fresh buffers.
    `compare_steps=False` matches collectives as the wire does, ignoring the step
    labels (kind, source, shape and dtype must still agree): what a real run of a
    program that pairs different steps would do. `backend` is what the relay's
    broadcasts run on: 'nccl' queues each on its stream; 'gloo' (`purepp run`'s
    default) blocks the issuing host until gloo's tree lets it go (the data has come
    down to it, and the members it sends to have joined), so a broadcast and a CPU
    all-reduce taken in crossed orders can deadlock there.

    Raises `CollectiveReportError` (a `CollectiveMismatchError`) carrying a
    `MismatchReport`, `RingOverrunReport`, `DeadlockReport`, `StageDivergenceReport` or
    `DecisionDivergenceReport`, or `HeaderMismatchError` when a relay header check fails.
    """
    if not isinstance(world, Layout):
        raise ConfigError(_CALL, f"world is {a_type(world)}", "pass a Layout(pp=..., dp=...)")
    if not callable(program):
        raise InvalidInputError(
            _CALL,
            f"program is {a_type(program)}, not callable",
            "pass a function of a RankContext that returns the rank's effect tuples",
        )
    in_flight = check_int(
        _CALL,
        "max_steps_in_flight",
        world.pp if max_steps_in_flight is None else max_steps_in_flight,
        1,
        fix="allow at least one step in flight (an int)",
        config=True,
    )
    fill = check_int(_CALL, "fill", fill, -INT32_MAX - 1, config=True)
    compare_steps = check_bool(_CALL, "compare_steps", compare_steps, config=True)
    return _Simulation(
        world,
        program,
        max_steps_in_flight=in_flight,
        fill=fill,
        compare_steps=compare_steps,
        backend=check_backend(_CALL, "backend", backend),
    ).run()
