"""Step plans: a batch of effects lowered once, then run with new bindings.

A batch (the tuple `perform` receives) with its names abstracted to positions is a
*structure*: the kinds, shapes, dtypes, streams, communicators, sources, widths and
section layouts of its effects, and where each name recurs. `relay.step7.tokens` and
`relay.step8.tokens` occupy the same position, so steps differ only in their
*bindings*: the names, the step number and the host data (copied arrays, expected
headers, all-reduce contributions; their shapes are structure).

The first time `Planner` meets a structure it performs the batch eagerly, which
validates it and raises what eager raises, and then lowers it into a `Plan`:

- every position gets a role from its first use: an *input* (a buffer, event or work
  bound before the batch) or *made* by the batch;
- the layouts of the input buffers are recorded, and later runs are guarded on them
  (with the roles) before anything changes: a batch whose bindings differ (an input
  unbound or of another shape, a made name already bound) falls back to eager, which
  performs it or raises exactly what eager raises;
- each effect becomes a closure over what was resolved once (stream, process group,
  broadcast options, dtype, shape) that performs it with no checks, on the names of
  the run.

A plan changes the environment effect by effect, as eager does, so a collective that
fails half-way leaves the same environment behind. Streams are switched through the
interpreter (once per run of effects on a stream). Buffers come from the caching
allocator, which frees them stream-safely after each `Release`; `capture=True` (CUDA,
purepp.effects.capture) makes them static graph memory instead.

A structure has up to `_VARIANTS` plans, one per layout of its inputs; past that, new
layouts run eagerly.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

from purepp.effects._environment import Environment
from purepp.effects.vocabulary import (
    Alias,
    Allocate,
    AllReduce,
    Broadcast,
    BufferRef,
    CheckHeader,
    CopyHostToDevice,
    Effect,
    EventRef,
    ForgetEvent,
    GatherRows,
    Pack,
    PadColumns,
    RecordEvent,
    RecordStream,
    Release,
    ScatterRows,
    Section,
    StackRows,
    Synchronize,
    Unpack,
    WaitEvent,
    WaitStream,
    WaitWork,
    WorkRef,
)

if TYPE_CHECKING:
    from purepp.effects.torch_interpreter import TorchInterpreter

__all__ = ["Layout", "Name", "Plan", "Planner", "Role", "Structure", "abstract", "layout", "roles"]

Name: TypeAlias = BufferRef | EventRef | WorkRef
Structure: TypeAlias = tuple[Hashable, ...]

# Most input layouts planned per structure.
_VARIANTS = 8


class Role:
    """How a position is first used in its batch (what a guard checks before a run)."""

    READ = 0  # a buffer bound before the batch (read, written in place, or released)
    MAKE = 1  # a buffer the batch binds first: must be unbound
    EVENT_IN = 2  # an event recorded before the batch
    EVENT_MAKE = 3  # an event the batch records
    WORK_IN = 4  # work in flight before the batch
    WORK_MAKE = 5  # work the batch starts


def abstract(effects: tuple[Effect, ...]) -> tuple[Structure, list[Name]]:
    """The batch's structure, and its names by position (the bindings of this run)."""
    positions: dict[Name, int] = {}
    structure = tuple([_part(effect, positions) for effect in effects])
    return structure, list(positions)


def _part(effect: Effect, positions: dict[Name, int]) -> Hashable:
    """One effect's share of the structure: its kind, static fields and name positions.

    Runs on every batch, so it is written for speed: the commonest kinds first, each
    name's position by one `setdefault` (first use numbers it), enums by their values.
    """
    at = positions.setdefault
    match effect:
        case Release():
            return (11, at(effect.buffer, len(positions)))
        case Broadcast():
            buffer = at(effect.buffer, len(positions))
            comm, stream = effect.comm._value_, effect.stream._value_
            return (6, buffer, effect.shape, effect.dtype._value_, effect.src, comm, stream)
        case Allocate():
            buffer = at(effect.buffer, len(positions))
            return (4, buffer, effect.shape, effect.dtype._value_, effect.stream._value_)
        case RecordStream():
            return (10, at(effect.buffer, len(positions)), effect.stream._value_)
        case WaitStream():
            return (0, effect.stream._value_, effect.waits_for._value_)
        case RecordEvent():
            return (1, effect.stream._value_, at(effect.event, len(positions)))
        case WaitEvent():
            return (2, effect.stream._value_, at(effect.event, len(positions)))
        case ForgetEvent():
            return (3, at(effect.event, len(positions)))
        case CopyHostToDevice():
            buffer = at(effect.buffer, len(positions))
            return (5, effect.source.shape, buffer, effect.stream._value_)
        case CheckHeader():
            buffer = at(effect.buffer, len(positions))
            return (7, buffer, effect.expected.shape, effect.stream._value_)
        case AllReduce():
            result = at(effect.result, len(positions))
            work = None if effect.work is None else at(effect.work, len(positions))
            return (8, effect.contribution.shape, result, effect.comm._value_, work)
        case WaitWork():
            return (9, at(effect.work, len(positions)))
        case Alias():
            source = at(effect.source, len(positions))
            return (12, source, at(effect.out, len(positions)))
        case PadColumns():
            source = at(effect.source, len(positions))
            out = at(effect.out, len(positions))
            return (13, source, out, effect.width, effect.fill, effect.stream._value_)
        case StackRows():
            sources = tuple([at(ref, len(positions)) for ref in effect.sources])
            return (14, sources, at(effect.out, len(positions)), effect.stream._value_)
        case GatherRows():
            source, index = at(effect.source, len(positions)), at(effect.index, len(positions))
            return (15, source, index, at(effect.out, len(positions)), effect.stream._value_)
        case ScatterRows():
            source, index = at(effect.source, len(positions)), at(effect.index, len(positions))
            return (16, source, index, at(effect.target, len(positions)), effect.stream._value_)
        case Synchronize():
            return (17, effect.stream._value_)
        case Pack():
            sections = _sections(effect.sections, positions)
            out = at(effect.out, len(positions))
            return (18, sections, out, effect.nbytes, effect.stream._value_)
        case Unpack():
            source = at(effect.source, len(positions))
            return (19, source, _sections(effect.sections, positions), effect.stream._value_)
        case _:
            typing.assert_never(effect)


def _sections(sections: tuple[Section, ...], positions: dict[Name, int]) -> Hashable:
    at = positions.setdefault
    return tuple(
        [(at(s.buffer, len(positions)), s.offset, s.shape, s.dtype._value_) for s in sections]
    )


def _uses(effect: Effect) -> tuple[tuple[Name, int], ...]:
    """The names `effect` uses, in order, each with the role it would have if first."""
    read, make = Role.READ, Role.MAKE
    match effect:
        case WaitStream() | Synchronize():
            return ()
        case RecordEvent():
            return ((effect.event, Role.EVENT_MAKE),)
        case WaitEvent() | ForgetEvent():
            return ((effect.event, Role.EVENT_IN),)
        case Allocate() | CopyHostToDevice():
            return ((effect.buffer, make),)
        case Broadcast() | CheckHeader() | RecordStream() | Release():
            return ((effect.buffer, read),)
        case AllReduce():
            work = () if effect.work is None else ((effect.work, Role.WORK_MAKE),)
            return ((effect.result, make), *work)
        case WaitWork():
            return ((effect.work, Role.WORK_IN),)
        case Alias() | PadColumns():
            return ((effect.source, read), (effect.out, make))
        case StackRows():
            return (*((ref, read) for ref in effect.sources), (effect.out, make))
        case GatherRows():
            return ((effect.source, read), (effect.index, read), (effect.out, make))
        case ScatterRows():
            return ((effect.source, read), (effect.index, read), (effect.target, read))
        case Pack():
            return (*((s.buffer, read) for s in effect.sections), (effect.out, make))
        case Unpack():
            return ((effect.source, read), *((s.buffer, make) for s in effect.sections))
        case _:
            typing.assert_never(effect)


def roles(effects: tuple[Effect, ...], names: list[Name]) -> list[int]:
    """Each position's role: how its name is first used in the batch."""
    found: dict[Name, int] = {}
    for effect in effects:
        for name, role in _uses(effect):
            found.setdefault(name, role)
    return [found[name] for name in names]


Layout: TypeAlias = tuple[tuple[int, ...], torch.dtype, bool]  # shape, dtype, contiguous


def layout(tensor: torch.Tensor) -> Layout:
    """What a plan assumes of an input buffer: shape, dtype and contiguity."""
    return tuple(tensor.shape), tensor.dtype, tensor.is_contiguous()


class Plan:
    """A lowered batch: the guards on its bindings, and its effects' handlers, resolved."""

    def __init__(
        self,
        effects: tuple[Effect, ...],
        names: list[Name],
        positions: list[int],
        inputs: dict[int, Layout],
        handlers: list[Callable[[Any], None]],
        *,
        checked: bool,
    ) -> None:
        self.effects = effects  # the batch it was lowered from (capture reads its layout)
        self.names = names  # that batch's names by position
        self.roles = positions  # each position's role
        self.inputs = inputs  # the layouts of the READ positions
        self.handlers = handlers  # one per effect: the interpreter's, without validation
        # The guards, by role. Contiguity is guarded only where `checked` checks it.
        self._reads = [
            (p, shape, dtype, contiguous if checked else None)
            for p, (shape, dtype, contiguous) in sorted(inputs.items())
        ]
        by_role: dict[int, list[int]] = {role: [] for role in range(6)}
        for p, role in enumerate(positions):
            by_role[role].append(p)
        self._makes = by_role[Role.MAKE]
        self._events_in, self._events_made = by_role[Role.EVENT_IN], by_role[Role.EVENT_MAKE]
        self._works_in, self._works_made = by_role[Role.WORK_IN], by_role[Role.WORK_MAKE]
        # CUDA graphs of this plan (purepp.effects.capture), made on its first replay.
        self.capture: Any = None
        self.uncapturable = False  # set once capture found the plan cannot be captured

    def admits(self, env: Environment[torch.Tensor, Any, Any], names: list[Name]) -> bool:
        """Whether this run's bindings fit: every position's role, every input's layout."""
        buffers, pending = env.buffers, env.pending_results
        for position, shape, dtype, contiguous in self._reads:
            tensor = buffers.get(names[position])  # type: ignore[arg-type]
            if (
                tensor is None
                or tensor.shape != shape
                or tensor.dtype is not dtype
                or (contiguous is not None and tensor.is_contiguous() is not contiguous)
            ):
                return False
        if pending and any(names[p] in pending for p, _, _, _ in self._reads):
            return False
        for position in self._makes:
            name = names[position]
            if name in buffers or name in pending:
                return False
        events, works = env.events, env.works
        return (
            all(names[p] in events for p in self._events_in)
            and not any(names[p] in events for p in self._events_made)
            and all(names[p] in works for p in self._works_in)
            and not any(names[p] in works for p in self._works_made)
        )


class Planner:
    """The plan cache of one `TorchInterpreter`: structure -> plans, one per input layout."""

    def __init__(self, interp: TorchInterpreter, *, capture: bool, copies: int) -> None:
        self._interp = interp
        self._plans: dict[Structure, list[Plan]] = {}
        self._capture = capture
        self._copies = copies
        self.lowered = 0  # plans made
        self.planned = 0  # batches run by a plan (not replayed)
        self.eager = 0  # batches run eagerly: first meetings, bindings that did not fit
        self.replayed = 0  # batches run by a CUDA-graph replay

    def perform(self, effects: tuple[Effect, ...]) -> bool:
        """Perform `effects` by a plan, lowering one if new; False: the caller runs eager."""
        interp = self._interp
        structure, names = abstract(effects)
        variants = self._plans.get(structure)
        if variants is not None:
            for plan in variants:
                if plan.admits(interp.env, names):
                    self._run(plan, effects, names)
                    return True
            if len(variants) >= _VARIANTS:
                self.eager += 1
                return False
        positions = roles(effects, names)
        buffers = interp.env.buffers
        inputs = {
            position: layout(buffers[typing.cast(BufferRef, names[position])])
            for position, role in enumerate(positions)
            if role == Role.READ and names[position] in buffers
        }
        # The first meeting runs eagerly: that validates the batch and raises eager's errors.
        self.eager += 1
        interp.perform_eager(effects)
        handlers = [interp.handler(e) for e in effects]
        plan = Plan(effects, names, positions, inputs, handlers, checked=interp.checked)
        self._plans.setdefault(structure, []).append(plan)
        self.lowered += 1
        return True

    def _run(self, plan: Plan, effects: tuple[Effect, ...], names: list[Name]) -> None:
        interp = self._interp
        if self._capture and not plan.uncapturable:
            from purepp.effects.capture import replay  # CUDA only

            if replay(interp, plan, effects, names, copies=self._copies):
                self.replayed += 1
                return
        self.planned += 1
        interp.run_handlers(plan.handlers, effects)
