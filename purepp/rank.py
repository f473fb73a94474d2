"""One rank's decode step as one program: the only place its order is written.

A decode step on a rank of a PP x DP world is, in this order:

1. `begin`: consume the relay entry received `ring_depth` steps ago (non-last stages),
   handing the caller its tokens, counts and slot mapping;
2. (the caller applies those outputs, frees finished or aborted slots, schedules)
3. `agree`: bump the generations of the freed slots, then agree the batch shape across
   the DP group (every rank, idle or not), and let the drafter reuse that agreement;
4. (the caller runs its forward at the agreed shape; the last stage samples and drafts)
5. `finish`: post this step's receives (non-last stages) or broadcast the sampled tokens
   and drafts (last stage), then end the relay's step.

The phases hand each other typed values (`Begun`, `Agreed`), so a step cannot skip the
agreement or forget to end: each phase takes only what the one before it returned. Each
phase is a generator of effect tuples: the caller's driver performs every tuple before
resuming it. `RankDriver` performs them at once on an interpreter (torch on CUDA or
gloo, numpy, a recorder); the simulator's rank programs `yield from` the same phases.
The phases are pure, so a value may be passed twice (a test replays a step that way);
a `RankDriver`, which performs the effects, takes each value once and refuses a stale or
reused one before issuing anything (a second `finish` would issue broadcasts no peer
matches). Tensors cross through a small seam, `StepIO`: bind the caller's tensors under
the relay's own input names (shapes and dtypes are read from what is bound), and read
the reduced DP table.

`agree` is two halves that may be pulled apart: `start_agreement_phase` issues the
all-reduce (asynchronously by default) and `settle` waits for it and decides. A runner
that knows the next step's batch early starts that step's agreement during this step's
forward (`start_next_agreement`, recorded on `Agreed.ahead`, carried by `RankState` and
`Begun`) and settles it at the top of the next step, so the wait hides behind the
forward. The lanes travel inside those values: a second start while one is in flight is
a `dp.LaneBusyError`, raised before anything is issued. (Such a step issues step T + 1's
asynchronous all-reduce among step T's effects; the simulator and `purepp check` take
that one effect out of step order.)
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from types import GeneratorType
from typing import Any, Generic, Protocol, TypeVar, cast

import attrs
import numpy as np

from purepp import dp
from purepp._checks import INT32_MAX, check_instance, check_interpreter
from purepp._text import a_type
from purepp._trusted import trusted
from purepp.batch import BatchFacts
from purepp.cudagraph import BatchExecutionDescriptor, CudaGraphDispatcher, Dispatcher
from purepp.effects.arrays import IntArray
from purepp.effects.interpreter import Interpreter
from purepp.effects.vocabulary import BufferRef, DType, Effect, TensorSpec
from purepp.errors import ConfigError, InterpreterError, InvalidInputError, PureppError
from purepp.relay import (
    ConsumedOutputs,
    RelayConfig,
    RelayState,
    SlotsLike,
    Wire,
    broadcast_drafts,
    broadcast_sampled,
    check_batch,
    check_drafts,
    check_sampled_tokens,
    check_state,
    consume_previous_step,
    end_step,
    free_request_slots,
    init_relay,
    receive,
)
from purepp.step import Step

__all__ = [
    "Agreed",
    "Agreeing",
    "Begun",
    "BroadcastSampledStep",
    "ConsumeStep",
    "RankConfig",
    "RankDriver",
    "RankState",
    "RankSteps",
    "Sampled",
    "ShapeFacts",
    "StartAgreementStep",
    "StepIO",
    "StepPhase",
    "agree",
    "begin",
    "finish",
    "init_rank",
    "perform_phase",
    "settle",
    "start_agreement_phase",
    "start_next_agreement",
]

T = TypeVar("T")
R = TypeVar("R")
P = TypeVar("P", "RankState", "Begun", "Agreed")

# A phase: the effect tuples to perform, in order (never an empty one), then its answer.
StepPhase = Generator[tuple[Effect, ...], None, R]


class StepIO(Protocol[T]):
    """The tensor seam between a phase and an interpreter's environment."""

    def bind(self, ref: BufferRef, value: T, /) -> None:
        """Bind the caller's tensor `value` under `ref`."""

    def spec(self, ref: BufferRef, /) -> TensorSpec:
        """Shape and dtype of the tensor bound under `ref`."""

    def upload(self, values: IntArray, /) -> T:
        """A new device tensor holding the host int32 array `values`."""

    def host_table(self, ref: BufferRef, /) -> IntArray:
        """The reduced DP agreement table bound under `ref`, on the host."""


class ConsumeStep(Protocol):
    """A `RankSteps.consume`: `relay.consume_previous_step`'s signature, as `begin` calls it."""

    def __call__(
        self, config: RelayConfig, state: RelayState, /, *, update_drafts: bool
    ) -> Step[RelayState, ConsumedOutputs | None]:
        """Pop the oldest ring entry and hand out what is still wanted."""
        ...


class StartAgreementStep(Protocol):
    """A `RankSteps.start_agreement`: `dp.start_agreement`'s signature, as the phases call it."""

    def __call__(
        self,
        lanes: dp.AgreementLanes,
        group: dp.AgreementGroup,
        dispatcher: Dispatcher | None,
        batch: dp.RankBatch,
        /,
        *,
        step: int,
        lane: dp.Lane = ...,
        asynchronous: bool = ...,
    ) -> dp.AgreementStarted:
        """Start agreeing this rank's batch shape across `group` on `lane`."""
        ...


class BroadcastSampledStep(Protocol):
    """A `RankSteps.broadcast_sampled`: `relay.broadcast_sampled`'s signature, as `finish`
    calls it (`drafts` is passed on the packed wires only)."""

    def __call__(
        self,
        config: RelayConfig,
        state: RelayState,
        batch: BatchFacts,
        sampled: TensorSpec,
        drafts: TensorSpec | None = None,
        /,
    ) -> Step[RelayState, bool]:
        """Send this step's sampled tokens and counts to every other stage."""
        ...


@attrs.frozen(kw_only=True)
class RankSteps:
    """The pure steps the rank step calls. A research runner (or a test reproducing a
    field failure) swaps one for its own; the order they are called in stays this module's.
    Each field is typed with the real step's signature, so a replacement of another
    shape is a type error, not a `TypeError` mid-step. `free` is called only for a step
    that frees slots (a `freed` other than the empty tuple)."""

    consume: ConsumeStep = consume_previous_step
    free: Callable[[RelayConfig, RelayState, SlotsLike], Step[RelayState, None]] = (
        free_request_slots
    )
    start_agreement: StartAgreementStep = dp.start_agreement
    receive: Callable[[RelayConfig, RelayState, BatchFacts], Step[RelayState, bool]] = receive
    broadcast_sampled: BroadcastSampledStep = broadcast_sampled
    broadcast_drafts: Callable[
        [RelayConfig, RelayState, BatchFacts, TensorSpec], Step[RelayState, bool]
    ] = broadcast_drafts
    end_step: Callable[[RelayConfig, RelayState], Step[RelayState, None]] = end_step

    def __attrs_post_init__(self) -> None:
        # The annotations hold only under a type checker: a step that is no function
        # would otherwise fail mid-step, after some of the step's effects were issued.
        for field in attrs.fields(RankSteps):
            step = getattr(self, field.name)
            if not callable(step):
                raise ConfigError(
                    "RankSteps",
                    f"{field.name}={step!r} is not callable",
                    f"pass a function with the signature of the real {field.name} step",
                )


REAL_STEPS = RankSteps()


_SOLO = dp.AgreementGroup(dp_size=1, dp_rank=0)
_FREE_LANES = dp.AgreementLanes()


@attrs.frozen(kw_only=True)
class RankConfig:
    """Static configuration of one rank's decode step."""

    relay: RelayConfig  # this rank's relay
    group: dp.AgreementGroup = _SOLO  # the DP group this rank agrees batch shapes with
    dispatcher: Dispatcher | None = None  # the target model's CUDA graphs
    # the drafter's CUDA graphs; it reuses the target's agreement (no second collective)
    drafter_dispatcher: Dispatcher | None = None

    def __attrs_post_init__(self) -> None:
        _expect("RankConfig", "relay", self.relay, RelayConfig)
        _expect("RankConfig", "group", self.group, dp.AgreementGroup)
        for name in ("dispatcher", "drafter_dispatcher"):
            value = getattr(self, name)
            if value is not None and not callable(getattr(value, "dispatch", None)):
                raise InvalidInputError(
                    "RankConfig",
                    f"{name} is {a_type(value)}, which has no dispatch method",
                    f"pass {name} as a CudaGraphDispatcher (or any Dispatcher), or None",
                )
        target, spec = self.dispatcher, self.relay.num_speculative_steps
        # The target's uniform decode graphs hold 1 + drafts tokens per request: sized
        # for another draft count, a speculative step would miss them without a word.
        if isinstance(target, CudaGraphDispatcher) and target.num_speculative_tokens != spec:
            raise ConfigError(
                "RankConfig",
                f"dispatcher.num_speculative_tokens={target.num_speculative_tokens} but "
                f"relay.num_speculative_steps={spec}",
                f"build the dispatcher with num_speculative_tokens={spec}, as the relay's",
            )

    @property
    def is_last_stage(self) -> bool:
        return self.relay.is_last_stage

    @property
    def updates_drafts(self) -> bool:
        """Non-last stages keep a draft table the consume writes the kept drafts into."""
        return not self.relay.is_last_stage and self.relay.num_speculative_steps > 0


@attrs.frozen(kw_only=True)
class Agreeing:
    """A step's target agreement in flight: `settle` completes it at the top of that step."""

    step: int  # the decode step whose batch shape it agrees
    batch: BatchFacts  # that step's batch
    facts: dp.RankBatch  # this rank's facts, which the drafter's agreement reuses
    pending: dp.PendingAgreement  # the target lane's started agreement

    def __attrs_post_init__(self) -> None:
        _check_fields(self, Agreeing)  # not for the phases' own: built by trusted constructors


@attrs.frozen(kw_only=True)
class RankState:
    """Between steps: the relay's state, the agreement lanes, and the next step's
    agreement when it was started during the step before (its lane is then busy)."""

    relay: RelayState
    lanes: dp.AgreementLanes = _FREE_LANES
    agreeing: Agreeing | None = None  # the step about to begin's agreement, started early

    def __attrs_post_init__(self) -> None:
        _check_fields(self, RankState)  # not for the phases' own: built by trusted constructors

    @property
    def step(self) -> int:
        return self.relay.step


@attrs.frozen(kw_only=True)
class ShapeFacts:
    """This rank's batch shape, for the DP agreement (tokens already padded by the caller)."""

    num_tokens: int  # tokens scheduled on this rank
    uniform_token_count: int | None = None  # tokens per request of a uniform decode batch
    max_query_len: int | None = None  # per-request query-length bound, None: not tracked
    need_eager: bool = False  # force eager (a profile run)
    num_active_loras: int = 0  # active LoRA adapters on this rank (picks the graph; not agreed)

    def __attrs_post_init__(self) -> None:
        _check_shape(self)


def _check_shape(shape: ShapeFacts) -> None:
    """Checked once, at the boundary: a float or a bool would reach the DP table."""
    # The DP table writes an optional count's None as 0 (or -1): given, it is 1 or more.
    for name, low in (
        ("num_tokens", 0),
        ("uniform_token_count", 1),
        ("max_query_len", 1),
        ("num_active_loras", 0),
    ):
        value = getattr(shape, name)
        if value is None and low:
            continue
        if type(value) is not int or not low <= value <= INT32_MAX:
            unknown = ", or None when not known" if low else ""
            raise InvalidInputError(
                "ShapeFacts",
                f"{name}={value!r}",
                f"pass {name} as an int in {low}..{INT32_MAX}{unknown}",
            )
    if type(shape.need_eager) is not bool:
        raise InvalidInputError("ShapeFacts", f"need_eager={shape.need_eager!r}", "pass a bool")


@attrs.frozen(kw_only=True)
class Begun:
    """A step whose relay entry was consumed: pass it to `agree` (or, once its agreement
    is started, to `settle`)."""

    relay: RelayState  # the relay after the consume
    lanes: dp.AgreementLanes  # the agreement lanes
    consumed: ConsumedOutputs | None  # what the entry still holds for the caller, if anything
    agreeing: Agreeing | None = None  # this step's agreement, once started: `settle` it

    def __attrs_post_init__(self) -> None:
        _check_fields(self, Begun)  # not for the phases' own: built by trusted constructors


@attrs.frozen(kw_only=True)
class Agreed:
    """A step whose shape the DP group agreed: run the forward, then pass it to `finish`."""

    relay: RelayState  # the relay after the frees
    lanes: dp.AgreementLanes  # the agreement lanes, free again
    batch: BatchFacts  # the step's batch, replicated on the pipeline's stages
    target: dp.DispatchOutcome  # the target model's descriptor and agreement
    drafter: dp.DispatchOutcome | None  # the drafter's, reusing the target's agreement
    ahead: Agreeing | None = None  # the next step's agreement, started during this forward

    def __attrs_post_init__(self) -> None:
        _check_fields(self, Agreed)  # not for the phases' own: built by trusted constructors

    @property
    def descriptor(self) -> BatchExecutionDescriptor:
        return self.target.descriptor


@attrs.frozen(kw_only=True)
class Sampled(Generic[T]):
    """The last stage's outputs of a step, as the caller's tensors."""

    tokens: T  # [n, k] int64, k <= spec + 1
    num_sampled: T  # [n] int32
    num_rejected: T  # [n] int32
    draft_table: T | None = None  # [max_num_reqs, spec] int64 by slot, when speculating


# The phases build their values from values they have checked (purepp._trusted).
_Agreeing = trusted(Agreeing)
_RankState = trusted(RankState)
_Begun = trusted(Begun)
_Agreed = trusted(Agreed)
_RankBatch = trusted(dp.RankBatch)
_TARGET, _DRAFTER = dp.Lane.TARGET, dp.Lane.DRAFTER


def _expect(call: str, name: str, value: object, kind: type) -> None:
    """The phases' boundary check: each takes only the value the one before returned.

    A type check alone: a phase value's fields were checked when it was built (the
    phases build theirs from values they checked; `_check_fields` checks any other)."""
    if not isinstance(value, kind):  # the fix's text is built only for the error
        check_instance(call, name, value, kind, fix=f"pass the {kind.__name__} it expects")


def _check_fields(value: object, kind: type) -> None:
    """A phase value built by hand (a restored RankState, an attrs.evolve of a Begun)
    holds the types the phases read: a type check per field of its phase class `kind`
    when it is built, so a wrong one fails there, naming the field, and not halfway
    through a later phase."""
    for field, kinds in _FIELDS[kind]:
        inner = getattr(value, field)
        if type(inner) not in kinds:
            allowed = " or ".join("None" if k is _NONE else k.__name__ for k in kinds)
            raise InvalidInputError(
                kind.__name__,
                f"{field} has type {type(inner).__name__}, not {allowed}",
                f"pass {field} as {allowed} (attrs.evolve the {kind.__name__} a phase "
                "returned, keeping the types of its fields)",
            )


_NONE = type(None)

_FIELDS: dict[type, tuple[tuple[str, tuple[type, ...]], ...]] = {
    Agreeing: (
        ("step", (int,)),
        ("batch", (BatchFacts,)),
        ("facts", (dp.RankBatch,)),
        ("pending", (dp.PendingAgreement,)),
    ),
    RankState: (
        ("relay", (RelayState,)),
        ("lanes", (dp.AgreementLanes,)),
        ("agreeing", (Agreeing, _NONE)),
    ),
    Begun: (
        ("relay", (RelayState,)),
        ("lanes", (dp.AgreementLanes,)),
        ("consumed", (ConsumedOutputs, _NONE)),
        ("agreeing", (Agreeing, _NONE)),
    ),
    Agreed: (
        ("relay", (RelayState,)),
        ("lanes", (dp.AgreementLanes,)),
        ("batch", (BatchFacts,)),
        ("target", (dp.DispatchOutcome,)),
        ("drafter", (dp.DispatchOutcome, _NONE)),
        ("ahead", (Agreeing, _NONE)),
    ),
}


_SUM = np.add.reduce  # a step's scheduled tokens, without ndarray.sum's Python wrapper


def _check_agree(
    call: str,
    config: RankConfig,
    phase: tuple[str, object, type],
    batch: BatchFacts,
    shape: ShapeFacts,
) -> None:
    """The checks of a phase that starts an agreement; `phase` names the value it takes."""
    _expect(call, "config", config, RankConfig)
    _expect(call, *phase)
    _expect(call, "batch", batch, BatchFacts)
    _expect(call, "shape", shape, ShapeFacts)
    given = cast(Begun | Agreed, phase[1])
    step = given.relay.step + (type(given) is Agreed)  # start_next agrees the next step
    if step > INT32_MAX:  # the relay's steps run on; the DP lanes take int32 steps
        raise InvalidInputError(
            call,
            f"the agreement of step {step} is past the DP agreement's steps (0..{INT32_MAX})",
            "start a new RankState (init_rank) on every rank before 2**31 steps",
        )
    # The batch is relayed at finish, after the all-reduce: refused now, not then.
    check_batch(call, config.relay, batch)
    scheduled = int(_SUM(batch.num_scheduled_tokens))
    if shape.num_tokens < max(scheduled, batch.num_reqs):
        raise InvalidInputError(
            call,
            f"ShapeFacts.num_tokens={shape.num_tokens} is below the batch's {scheduled} "
            f"scheduled tokens ({batch.num_reqs} rows)",
            "pass the step's scheduled tokens (after padding) as num_tokens",
        )
    uniform = shape.uniform_token_count
    if uniform is not None and uniform * batch.num_reqs > shape.num_tokens:
        raise InvalidInputError(
            call,
            f"ShapeFacts.uniform_token_count={uniform} x {batch.num_reqs} rows exceeds "
            f"ShapeFacts.num_tokens={shape.num_tokens}",
            "pass the tokens per request of a uniform decode batch, else None",
        )
    drafter = config.drafter_dispatcher
    if type(drafter) is CudaGraphDispatcher and batch.num_reqs > drafter.max_num_reqs:
        # The drafter dispatches its reuse after the target's all-reduce: refused then,
        # this rank would be one collective ahead of a group that retries the step.
        raise InvalidInputError(
            call,
            f"the batch has {batch.num_reqs} rows but RankConfig.drafter_dispatcher has "
            f"max_num_reqs={drafter.max_num_reqs}",
            "build the drafter's dispatcher with the target's max_num_reqs, or schedule fewer",
        )
    if config.dispatcher is None and not shape.need_eager:
        # dp.start_agreement refuses it too, but would name itself and not the config.
        raise InvalidInputError(
            call,
            "RankConfig.dispatcher is None but ShapeFacts.need_eager is False",
            "pass RankConfig(dispatcher=...) (a CudaGraphDispatcher); only a profile run "
            "with ShapeFacts(need_eager=True) may go without one",
        )


def _check_not_started(call: str, begun: Begun) -> None:
    """A step whose agreement is in flight settles it: starting another is refused by the
    lane too, but naming dp's calls and not the rank step's."""
    agreeing = begun.agreeing
    if agreeing is not None:
        raise dp.LaneBusyError(
            call,
            f"step {begun.relay.step} already has step {agreeing.step}'s agreement in flight "
            "(started by start_agreement_phase, or by start_next_agreement the step before)",
            "settle it: settle(config, begun, io, freed=...) (RankDriver.settle) in place of "
            "agree or another start",
        )


def _expect_steps(call: str, steps: object) -> None:
    # isinstance, not type(): a research runner may pass a subclass of RankSteps.
    if not isinstance(steps, RankSteps):
        raise InvalidInputError(
            call,
            f"steps is {a_type(steps)}",
            "pass a RankSteps (attrs.evolve(REAL_STEPS, ...) to swap one step), or leave it out",
        )


_IO_METHODS = ("bind", "spec", "upload", "host_table")
# Classes that have the StepIO methods themselves, so every instance has them: every
# phase given an io checks it, and for these that is one set lookup.
_IO_CLASSES: set[type] = set()


def _expect_io(call: str, io: object) -> None:
    kind = type(io)
    if kind in _IO_CLASSES:
        return
    if all(callable(getattr(kind, method, None)) for method in _IO_METHODS):
        _IO_CLASSES.add(kind)
    elif not all(callable(getattr(io, method, None)) for method in _IO_METHODS):
        raise InvalidInputError(
            call, f"io is {a_type(io)}", "pass a StepIO (e.g. NumpyIO or TorchIO)"
        )


def init_rank(config: RankConfig) -> RankState:
    """The state before step 0."""
    _expect("init_rank", "config", config, RankConfig)
    return RankState(relay=init_relay(config.relay))


def begin(config: RankConfig, state: RankState, steps: RankSteps = REAL_STEPS) -> StepPhase[Begun]:
    """Phase 1: consume the relay entry from `ring_depth` steps ago (non-last stages)."""
    _expect("begin", "config", config, RankConfig)
    _expect("begin", "state", state, RankState)
    _expect_steps("begin", steps)
    if config.is_last_stage:
        # Nothing consumed, so nothing checked the state: a state of another stage here
        # would pass the agreement and fail only at the step's broadcast.
        check_state("begin", config.relay, state.relay)
        return _Begun(relay=state.relay, lanes=state.lanes, consumed=None, agreeing=state.agreeing)
    try:
        taken = steps.consume(config.relay, state.relay, update_drafts=config.updates_drafts)
    except InvalidInputError as error:  # the phase the caller called, not the relay step
        if error.call != "consume_previous_step":
            raise
        raise InvalidInputError("begin", error.problem, error.fix) from error
    if taken.effects:
        yield taken.effects
    return _Begun(
        relay=taken.state, lanes=state.lanes, consumed=taken.result, agreeing=state.agreeing
    )


def agree(
    config: RankConfig,
    begun: Begun,
    batch: BatchFacts,
    shape: ShapeFacts,
    io: StepIO[T],
    *,
    freed: SlotsLike = (),
    steps: RankSteps = REAL_STEPS,
) -> StepPhase[Agreed]:
    """Phase 2: free `freed` slots, then agree `batch`'s shape across the DP group.

    Every rank takes part, idle or not: a rank that skipped the all-reduce would leave
    the group one collective apart. The drafter reuses the agreement (no collective).
    The start and the settle at once, with a synchronous all-reduce (no work handle).
    """
    _check_agree("agree", config, ("begun", begun, Begun), batch, shape)
    _expect_io("agree", io)
    _expect_steps("agree", steps)
    _check_not_started("agree", begun)
    begun = _freed("agree", config, begun, freed, steps)
    if config.group.dp_size == 1 and steps.start_agreement is dp.start_agreement:
        return _agreed_alone(config, begun, batch, shape)  # a runner's own start runs as given
    begun = yield from _started(config, begun, batch, shape, asynchronous=False, steps=steps)
    return (yield from _settled(config, begun, io, steps))


def start_agreement_phase(
    config: RankConfig,
    begun: Begun,
    batch: BatchFacts,
    shape: ShapeFacts,
    *,
    asynchronous: bool = True,
    steps: RankSteps = REAL_STEPS,
) -> StepPhase[Begun]:
    """Phase 2a: start agreeing this step's `batch` shape; `settle` it later in the step.

    With `asynchronous` the all-reduce carries a work handle, so work issued before the
    settle overlaps it. Raises `dp.LaneBusyError` when this step's agreement is already
    in flight (started by `start_next_agreement` during the step before): settle that one.
    """
    _check_agree("start_agreement_phase", config, ("begun", begun, Begun), batch, shape)
    _expect_steps("start_agreement_phase", steps)
    _check_not_started("start_agreement_phase", begun)
    return (
        yield from _started(config, begun, batch, shape, asynchronous=asynchronous, steps=steps)
    )


def _started(
    config: RankConfig,
    begun: Begun,
    batch: BatchFacts,
    shape: ShapeFacts,
    *,
    asynchronous: bool,
    steps: RankSteps,
) -> StepPhase[Begun]:
    """`begun` with its agreement started (the checks are its callers')."""
    lanes, agreeing = yield from _start(
        config,
        begun.lanes,
        step=begun.relay.step,
        batch=batch,
        shape=shape,
        asynchronous=asynchronous,
        steps=steps,
    )
    return _Begun(relay=begun.relay, lanes=lanes, consumed=begun.consumed, agreeing=agreeing)


def start_next_agreement(
    config: RankConfig,
    agreed: Agreed,
    batch: BatchFacts,
    shape: ShapeFacts,
    *,
    steps: RankSteps = REAL_STEPS,
) -> StepPhase[Agreed]:
    """Start agreeing the NEXT step's `batch` shape now, asynchronously, so the all-reduce
    runs while this step's forward does; `finish` carries it into the next step, whose
    `settle` completes it.

    Every rank of the group must start it at the same point of the same step (the
    collectives pair in issue order). Raises `dp.LaneBusyError` when the next step's
    agreement is already in flight.
    """
    _check_agree("start_next_agreement", config, ("agreed", agreed, Agreed), batch, shape)
    _expect_steps("start_next_agreement", steps)
    if agreed.ahead is not None:  # the lane would refuse it too, naming dp's calls
        raise dp.LaneBusyError(
            "start_next_agreement",
            f"step {agreed.relay.step} already started step {agreed.ahead.step}'s agreement",
            "start the next step's agreement once a step: finish this step, then settle "
            "the one in flight at the top of the next",
        )
    lanes, agreeing = yield from _start(
        config,
        agreed.lanes,
        step=agreed.relay.step + 1,
        batch=batch,
        shape=shape,
        asynchronous=True,
        steps=steps,
    )
    return _Agreed(
        relay=agreed.relay,
        lanes=lanes,
        batch=agreed.batch,
        target=agreed.target,
        drafter=agreed.drafter,
        ahead=agreeing,
    )


def _start(
    config: RankConfig,
    lanes: dp.AgreementLanes,
    *,
    step: int,
    batch: BatchFacts,
    shape: ShapeFacts,
    asynchronous: bool,
    steps: RankSteps,
) -> StepPhase[tuple[dp.AgreementLanes, Agreeing]]:
    facts = _facts(batch, shape)
    started = steps.start_agreement(
        lanes, config.group, config.dispatcher, facts, step=step, asynchronous=asynchronous
    )
    if started.effects:
        yield started.effects
    agreeing = _Agreeing(step=step, batch=batch, facts=facts, pending=started.result)
    return started.state, agreeing


def _facts(batch: BatchFacts, shape: ShapeFacts) -> dp.RankBatch:
    """The agreement's facts of this rank's batch, from values `_check_agree` checked."""
    return _RankBatch(
        num_reqs=batch.num_reqs,
        num_tokens=shape.num_tokens,
        uniform_token_count=shape.uniform_token_count,
        max_query_len=shape.max_query_len,
        need_eager=shape.need_eager,
        num_active_loras=shape.num_active_loras,
        dp_sync=None,
    )


def _agreed_alone(config: RankConfig, begun: Begun, batch: BatchFacts, shape: ShapeFacts) -> Agreed:
    """`agree` in a group of one rank: each dispatcher decides alone, with no collective.

    What the start, the wait and the finish decide there, checked and refused as the
    start would, without building them: the drafter reuses no sync (a lone rank has
    none), so it dispatches the same facts.
    """
    facts = _facts(batch, shape)
    lanes, group, step = begun.lanes, config.group, begun.relay.step
    target = dp.decide_alone(lanes, group, config.dispatcher, facts, step=step, lane=_TARGET)
    drafter = None
    if config.drafter_dispatcher is not None:
        drafter = dp.decide_alone(
            lanes, group, config.drafter_dispatcher, facts, step=step, lane=_DRAFTER
        )
    return _Agreed(
        relay=begun.relay,
        lanes=begun.lanes,
        batch=batch,
        target=target,
        drafter=drafter,
        ahead=None,
    )


def settle(
    config: RankConfig,
    begun: Begun,
    io: StepIO[T],
    *,
    freed: SlotsLike = (),
    steps: RankSteps = REAL_STEPS,
) -> StepPhase[Agreed]:
    """Phase 2b: free `freed` slots, then complete this step's agreement (`begun.agreeing`).

    Waits for the all-reduce, decides from the reduced table, then lets the drafter
    reuse that decision. Raises InvalidInputError when no agreement of this step is in
    flight.
    """
    _expect("settle", "config", config, RankConfig)
    _expect("settle", "begun", begun, Begun)
    _expect_io("settle", io)
    _expect_steps("settle", steps)
    agreeing = begun.agreeing
    step = begun.relay.step
    if agreeing is None or agreeing.step != step:
        started = "no agreement" if agreeing is None else f"step {agreeing.step}'s agreement"
        raise InvalidInputError(
            "settle",
            f"step {step} has {started} in flight, not its own",
            "start this step's agreement first (start_agreement_phase, or "
            "start_next_agreement during the step before)",
        )
    pending = agreeing.pending
    if begun.lanes.in_flight(pending.lane) != pending.step:
        raise InvalidInputError(
            "settle",
            f"begun.lanes has step {begun.lanes.in_flight(pending.lane)} in flight on the "
            f"{pending.lane.value} lane, not its agreement's step {pending.step}",
            "pass the Begun the phase that started the agreement returned",
        )
    begun = _freed("settle", config, begun, freed, steps)
    return (yield from _settled(config, begun, io, steps))


def _freed(
    call: str,
    config: RankConfig,
    begun: Begun,
    freed: SlotsLike,
    steps: RankSteps,
) -> Begun:
    """`begun` with `freed` slots freed in its relay; a bad slot is refused as `call`'s."""
    if type(freed) is tuple and not freed:  # the default, and most steps: nothing to free
        return begun
    try:
        relay = steps.free(config.relay, begun.relay, freed).state
    except InvalidInputError as error:  # the phase the caller called, not the relay step
        raise InvalidInputError(call, f"freed: {error.problem}", error.fix) from error
    return _Begun(relay=relay, lanes=begun.lanes, consumed=begun.consumed, agreeing=begun.agreeing)


def _settled(
    config: RankConfig, begun: Begun, io: StepIO[T], steps: RankSteps
) -> StepPhase[Agreed]:
    """The settle after the frees: the target's decision, then the drafter's reuse of it."""
    agreeing = begun.agreeing
    if agreeing is None:  # unreachable: both callers start or check it first
        raise InvalidInputError("settle", "no agreement in flight", "start one first")
    lanes, target = yield from _complete(begun.lanes, agreeing.pending, io)
    drafter = None
    if config.drafter_dispatcher is not None and target.sync is None and config.group.dp_size > 1:
        # No rank has work: every rank's target decided to run nothing, and so does its
        # drafter, with no second collective (there is no sync to reuse).
        drafter = target
    elif config.drafter_dispatcher is not None:
        sync = target.sync
        reuse = attrs.evolve(agreeing.facts, dp_sync=sync)
        if sync is not None:
            # The sync holds the count this rank runs (padded, unless eager): reuse it at that.
            agreed_tokens = int(sync.num_tokens_across_dp[config.group.dp_rank])
            reuse = attrs.evolve(reuse, num_tokens=agreed_tokens)
        started = steps.start_agreement(
            lanes,
            config.group,
            config.drafter_dispatcher,
            reuse,
            step=agreeing.step,
            lane=dp.Lane.DRAFTER,
        )
        if started.effects:
            yield started.effects
        lanes, drafter = yield from _complete(started.state, started.result, io)
    return _Agreed(
        relay=begun.relay,
        lanes=lanes,
        batch=agreeing.batch,
        target=target,
        drafter=drafter,
        ahead=None,
    )


def _complete(
    lanes: dp.AgreementLanes, pending: dp.PendingAgreement, io: StepIO[T]
) -> StepPhase[tuple[dp.AgreementLanes, dp.DispatchOutcome]]:
    """Wait for a started agreement's all-reduce and decide from its table."""
    waited = dp.wait_for_agreement(pending)
    if waited.effects:
        yield waited.effects
    table = None if waited.result is None else io.host_table(waited.result)
    finished = dp.finish_agreement(lanes, pending, table)
    if finished.effects:
        yield finished.effects
    return finished.state, finished.result


def finish(
    config: RankConfig,
    agreed: Agreed,
    io: StepIO[T],
    sampled: Sampled[T] | Sampled[object] | None = None,
    steps: RankSteps = REAL_STEPS,
) -> StepPhase[RankState]:
    """Phase 3: receive (non-last stages) or broadcast (last stage), then end the step.

    `sampled` is the last stage's outputs, None when its forward produced nothing (an
    idle step). A fresh slot mapping is bound each step: the ring keeps it until consumed.
    A `Sampled[object]` is taken too: mypy infers one for numpy arrays of int64 tokens
    and int32 counts (it joins the two array types to object), and a caller's mistake
    there is a typed error at bind; a `Sampled` of another tensor type is still refused.
    """
    call = "finish"
    _expect(call, "config", config, RankConfig)
    _expect(call, "agreed", agreed, Agreed)
    _expect_io(call, io)
    _expect_steps(call, steps)
    if sampled is not None:
        _expect(call, "sampled", sampled, Sampled)
    relay_config = config.relay
    inputs = relay_config.inputs
    batch = agreed.batch
    relay = agreed.relay
    if config.updates_drafts and relay.step < relay_config.ring_depth:
        _check_draft_table(relay_config, io)
    if relay_config.reads_idx_mapping:  # else a host-to-device copy nothing would read
        io.bind(inputs.idx_mapping, io.upload(batch.idx_mapping))
    if not config.is_last_stage:
        posted = steps.receive(relay_config, relay, batch)
        if posted.effects:
            yield posted.effects
        relay = posted.state
    elif sampled is not None:
        relay = yield from _broadcast(
            relay_config, relay, batch=batch, io=io, sampled=sampled, steps=steps
        )
    elif relay_config.wire is Wire.FIXED and batch.num_reqs == 0:
        # The fixed wire sends every step; an empty batch reads no caller tensor.
        sent = steps.broadcast_sampled(
            relay_config, relay, batch, _NO_ROWS, _drafts_of(relay_config)
        )
        if sent.effects:
            yield sent.effects
        relay = sent.state
    elif batch.sampled_mask is not None or relay_config.wire is Wire.FIXED:
        raise InvalidInputError(
            "finish",
            f"the last stage passed no sampled outputs at step {relay.step} "
            f"but the batch has {batch.num_reqs} rows to relay",
            "pass the step's Sampled outputs to finish on the last stage",
        )
    ended = steps.end_step(relay_config, relay)
    if ended.effects:
        yield ended.effects
    return _RankState(relay=ended.state, lanes=agreed.lanes, agreeing=agreed.ahead)


_NO_ROWS = TensorSpec(shape=(0, 1), dtype=DType.INT64)  # an empty batch's sampled tokens


def _drafts_of(config: RelayConfig) -> TensorSpec | None:
    """The draft table's spec the packed wires require when speculating (not read at n=0)."""
    if not config.num_speculative_steps:
        return None
    return TensorSpec(shape=(config.max_num_reqs, config.num_speculative_steps), dtype=DType.INT64)


def _broadcast(
    config: RelayConfig,
    relay: RelayState,
    *,
    batch: BatchFacts,
    io: StepIO[T],
    sampled: Sampled[Any],  # checked by the caller: T, or object (see finish)
    steps: RankSteps,
) -> StepPhase[RelayState]:
    inputs = config.inputs
    rows = batch.num_reqs
    # A seam refuses a value of no relay dtype in its own name and the relay buffer's
    # (`bind`, or `spec` for a torch tensor): refused as finish's instead, naming the
    # caller's field (`field` tracks it, so a step that binds pays no extra call).
    field = "tokens"
    try:
        io.bind(inputs.sampled_tokens, sampled.tokens)
        field = "num_sampled"
        io.bind(inputs.num_sampled, sampled.num_sampled)
        field = "num_rejected"
        io.bind(inputs.num_rejected, sampled.num_rejected)
    except InvalidInputError as error:
        raise _refused(config, rows, field, error) from error
    _check_counts(config, batch, io)
    drafts = None
    if config.num_speculative_steps:
        if sampled.draft_table is None:
            raise InvalidInputError(
                "finish",
                "no draft table with num_speculative_steps > 0",
                "pass Sampled(draft_table=...) on the last stage when speculating",
            )
        try:
            io.bind(inputs.draft_table, sampled.draft_table)
            drafts = io.spec(inputs.draft_table)
        except (InvalidInputError, InterpreterError) as error:
            raise _refused(config, rows, "draft_table", error) from error
        # Checked before the tokens go out, on every wire: peers would wait for the drafts.
        check_drafts(
            "finish", config, drafts, shown_as="Sampled.draft_table", passed_as="draft_table"
        )
    try:
        tokens = io.spec(inputs.sampled_tokens)
    except InterpreterError as error:
        raise _refused(config, rows, "tokens", error) from error
    # Named here, where the caller passed it, and not by the relay step it feeds.
    check_sampled_tokens(
        "finish", config, rows, tokens, shown_as="Sampled.tokens", passed_as="tokens"
    )
    if config.wire is Wire.SEED:
        sent = steps.broadcast_sampled(config, relay, batch, tokens)
        if sent.effects:
            yield sent.effects
        relay = sent.state
        if drafts is not None:
            sent = steps.broadcast_drafts(config, relay, batch, drafts)
            if sent.effects:
                yield sent.effects
            relay = sent.state
        return relay
    sent = steps.broadcast_sampled(config, relay, batch, tokens, drafts)
    if sent.effects:
        yield sent.effects
    return sent.state


def _check_counts(config: RelayConfig, batch: BatchFacts, io: StepIO[T]) -> None:
    """The counts just bound are [n] int32, checked before anything is issued: the pure
    step describes only the tokens, and the interpreter would find out halfway through."""
    rows = batch.num_reqs
    for field, ref in (
        ("num_sampled", config.inputs.num_sampled),
        ("num_rejected", config.inputs.num_rejected),
    ):
        shown = _unlike(io, ref, (rows,), DType.INT32)
        if shown is None:
            continue
        raise InvalidInputError(
            "finish",
            f"Sampled.{field} is not int32[{rows}] for a batch of {rows} rows: {shown}",
            _sampled_fix(config, rows, field),
        )


def _sampled_fix(config: RelayConfig, rows: int, field: str) -> str:
    """What finish tells a caller whose `Sampled.<field>` it refuses."""
    if field == "tokens":
        spec_plus_one = config.max_sample_len
        return f"pass tokens as int64 [{rows}, k] with 1 <= k <= spec + 1 = {spec_plus_one}"
    if field == "draft_table":
        shape = f"[max_num_reqs={config.max_num_reqs}, {config.num_speculative_steps}]"
        return f"pass draft_table as int64 {shape}"
    return f"pass {field} as an int32 tensor of shape [{rows}], one count per batch row"


def _refused(
    config: RelayConfig, rows: int, field: str, error: InvalidInputError | InterpreterError
) -> InvalidInputError:
    """finish's refusal of the caller's `Sampled.<field>`, which a seam refused first."""
    problem = f"Sampled.{field}: {error.problem}"
    return InvalidInputError("finish", problem, _sampled_fix(config, rows, field))


def _unlike(io: StepIO[T], ref: BufferRef, shape: tuple[int, ...], dtype: DType) -> str | None:
    """None when the tensor bound to `ref` has `shape` and `dtype`, else what it is (or
    why there is none): the caller's error names its own field and fix."""
    try:
        spec = io.spec(ref)
    except InterpreterError as error:
        return error.problem
    if spec.shape == shape and spec.dtype is dtype:
        return None
    return f"it is {spec.dtype.value}{list(spec.shape)}"


def _check_draft_table(config: RelayConfig, io: StepIO[T]) -> None:
    """A speculating non-last stage's draft table, which the consume scatters the kept
    drafts into, is bound by the caller. Checked on the steps before the first consume,
    so one forgotten is named at step 0 and not mid-consume `ring_depth` steps later
    (checking every step would cost an `io.spec` per step)."""
    ref = config.inputs.draft_table
    expected = [config.max_num_reqs, config.num_speculative_steps]
    shown = _unlike(io, ref, tuple(expected), DType.INT64)
    if shown is None:
        return
    raise InvalidInputError(
        "finish",
        f"the draft table {ref.name!r} of a non-last stage with num_speculative_steps="
        f"{config.num_speculative_steps} is not int64{expected}: {shown}",
        f"bind an int64 tensor of shape {expected} (zeros) under config.relay.inputs."
        "draft_table before the first step: the consume writes the kept drafts into it",
    )


def perform_phase(phase: StepPhase[R], interpreter: Interpreter) -> R:
    """Perform every effect tuple `phase` yields on `interpreter`; return its answer.

    `phase` must be fresh: one that ran (or failed) would answer nothing, or resume past
    the effects that failed, so it is refused."""
    return _performed(phase, interpreter, [])


def _performed(phase: StepPhase[R], interpreter: Interpreter, handed: list[object]) -> R:
    """`perform_phase`, noting in `handed` each effect tuple handed to the interpreter."""
    if type(phase) is not GeneratorType and not isinstance(phase, Generator):
        raise InvalidInputError(
            "perform_phase",
            f"phase is {a_type(phase)}, not a generator",
            "pass what a phase returns, e.g. perform_phase(begin(config, state), interpreter)",
        )
    if type(phase) is GeneratorType and (phase.gi_frame is None or phase.gi_suspended):
        raise InvalidInputError(
            "perform_phase",
            f"phase {phase.__name__} was run already (it ended, failed, or stopped midway)",
            "call the phase function again for a fresh phase, from the value it takes",
        )
    try:
        effects = next(phase)
        while True:
            if effects:
                handed.append(effects)
                try:
                    interpreter.perform(effects)
                except AttributeError:  # the error path only: no cost per step
                    check_interpreter("perform_phase", "interpreter", interpreter)
                    raise
            effects = phase.send(None)
    except StopIteration as done:
        answer: R = done.value
        return answer


class RankDriver(Generic[T]):
    """Runs the rank-step phases at once on one interpreter. An embedder's loop:

    begun = driver.begin(state)              # read begun.consumed through the interpreter
    agreed = driver.agree(begun, batch, shape, freed=slots)
    ...forward at agreed.descriptor...
    state = driver.finish(agreed, sampled)   # Sampled(...) on the last stage, else None

    Overlapped, with the next step's batch known before this step's forward:

    begun = driver.begin(state)
    if begun.agreeing is None:               # the first step: nothing was started ahead
        begun = driver.start(begun, batch, shape)
    agreed = driver.settle(begun, freed=slots)
    agreed = driver.start_next(agreed, next_batch, next_shape)
    ...forward at agreed.descriptor...
    state = driver.finish(agreed, sampled)
    """

    def __init__(
        self,
        config: RankConfig,
        interpreter: Interpreter,
        io: StepIO[T],
        steps: RankSteps = REAL_STEPS,
    ) -> None:
        # Checked here, so a wrong one fails at construction and not mid-step.
        _expect("RankDriver", "config", config, RankConfig)
        check_interpreter("RankDriver", "interpreter", interpreter)
        _expect_io("RankDriver", io)
        _expect_steps("RankDriver", steps)
        self.config = config
        self.interpreter = interpreter
        self.io = io
        self.steps = steps
        # The value the last phase returned: the only one the next phase may take (None
        # before the first phase, which takes any value).
        self._handed_out: RankState | Begun | Agreed | None = None
        self._failed: str | None = None  # the call whose phase failed after issuing effects

    def _perform(self, call: str, given: object, phase: StepPhase[P]) -> P:
        """Perform `phase`, whose input `given` must be the value the last phase returned."""
        last = self._handed_out
        if last is not None and given is not last:
            raise InvalidInputError(
                f"RankDriver.{call}",
                f"{_described(given)} is not the value this driver last returned "
                f"({_described(last)}): it was used already, or is stale",
                "pass each phase the value the phase before it returned, once: next, "
                f"{_NEXT_CALLS[type(last)]} that {type(last).__name__}",
            )
        if self._failed is not None:
            raise InvalidInputError(
                f"RankDriver.{call}",
                f"this driver's {self._failed} failed after issuing effects, so this rank "
                "may be a collective ahead of its group",
                "stop the step on every rank and build new interpreters and drivers, then "
                "run the step again from the RankState before it; after a dead DP replica, "
                "replace the DP groups (TorchInterpreter.replace_dp_groups) and run agree "
                "again from this step's Begun on a new RankDriver whose group marks it dead",
            )
        handed: list[object] = []
        try:
            answer = _performed(phase, self.interpreter, handed)
        except BaseException as error:
            if handed:  # a refusal before any effect leaves the driver as it was
                self._failed = call
            if isinstance(error, PureppError):  # its message names the phase function
                error.add_note(_driver_note(call))
            raise
        self._handed_out = answer
        return answer

    def begin(self, state: RankState) -> Begun:
        return self._perform("begin", state, begin(self.config, state, self.steps))

    def agree(
        self,
        begun: Begun,
        batch: BatchFacts,
        shape: ShapeFacts,
        *,
        freed: SlotsLike = (),
    ) -> Agreed:
        phase = agree(self.config, begun, batch, shape, self.io, freed=freed, steps=self.steps)
        return self._perform("agree", begun, phase)

    def start(self, begun: Begun, batch: BatchFacts, shape: ShapeFacts) -> Begun:
        phase = start_agreement_phase(self.config, begun, batch, shape, steps=self.steps)
        return self._perform("start", begun, phase)

    def start_next(self, agreed: Agreed, batch: BatchFacts, shape: ShapeFacts) -> Agreed:
        phase = start_next_agreement(self.config, agreed, batch, shape, steps=self.steps)
        return self._perform("start_next", agreed, phase)

    def settle(self, begun: Begun, *, freed: SlotsLike = ()) -> Agreed:
        phase = settle(self.config, begun, self.io, freed=freed, steps=self.steps)
        return self._perform("settle", begun, phase)

    def finish(
        self, agreed: Agreed, sampled: Sampled[T] | Sampled[object] | None = None
    ) -> RankState:
        phase = finish(self.config, agreed, self.io, sampled, self.steps)
        return self._perform("finish", agreed, phase)


# The phase each driver method runs, where its name is not the method's.
_DRIVER_PHASES = {"start": "start_agreement_phase", "start_next": "start_next_agreement"}


def _driver_note(call: str) -> str:
    phase = _DRIVER_PHASES.get(call, call)
    return (
        f"raised in RankDriver.{call}, which runs the phase {phase}: where the message "
        "names a phase function, call the driver's method that runs it (start runs "
        "start_agreement_phase, start_next runs start_next_agreement, the others their "
        "own names), leaving out the config, io and steps the driver holds"
    )


# What a driver takes next, by the type of the value it last returned.
_NEXT_CALLS: dict[type, str] = {
    RankState: "begin",
    Begun: "agree, start or settle",
    Agreed: "start_next or finish",
}


def _described(value: object) -> str:
    """A phase value as an error names it: its type and its relay step."""
    relay = getattr(value, "relay", None)
    if isinstance(relay, RelayState):
        return f"the {type(value).__name__} of step {relay.step}"
    return f"a value of type {type(value).__name__}"
