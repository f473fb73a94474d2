"""Type-only tests: mypy checks this file (it is under tests/), pytest never runs it.

They pin the public API's types, so a change that loosens a signature fails the
type check (see tests/test_tooling.py).
"""

from __future__ import annotations

from typing import Any, assert_type

import numpy as np
import numpy.typing as npt

import purepp
from purepp import dp, rank
from purepp.effects import BufferRef, DType, Effect, Interpreter, TensorSpec
from purepp.effects.arrays import BoolArray, IntArray
from purepp.effects.log import EffectLog, Recorder, placeholder_inputs, replay
from purepp.effects.numpy_interpreter import NumpyInterpreter
from purepp.relay import relay_header


def _relay_steps(config: purepp.RelayConfig, batch: purepp.BatchFacts) -> None:
    state = purepp.init_relay(config)
    assert_type(state, purepp.RelayState)
    consumed = purepp.consume_previous_step(config, state, update_drafts=True)
    assert_type(consumed, purepp.Step[purepp.RelayState, purepp.ConsumedOutputs | None])
    assert_type(consumed.effects, tuple[Effect, ...])
    received = purepp.receive(config, consumed.state, batch)
    assert_type(received, purepp.Step[purepp.RelayState, bool])
    sent = purepp.broadcast_sampled(
        config, state, batch, TensorSpec(shape=(2, 1), dtype=DType.INT64)
    )
    assert_type(sent.result, bool)
    freed = purepp.free_request_slots(config, state, [0, 1])
    assert_type(freed, purepp.Step[purepp.RelayState, None])
    ended = purepp.end_step(config, received.state)
    assert_type(ended.state, purepp.RelayState)
    assert_type(purepp.need_sampled_mask(batch), BoolArray | None)
    merged = purepp.relay_aux_hidden_states(config, {"aux": 1.5}, {"hidden": 2.5})
    assert_type(merged, dict[str, float])
    assert_type(relay_header(3, 2), IntArray)


def _agreement(dispatcher: purepp.CudaGraphDispatcher) -> None:
    # The DP agreement's own types are pinned in tests/typecheck_dp.py.
    group = dp.AgreementGroup(dp_size=2, dp_rank=0)
    facts = dp.RankBatch(num_reqs=2, num_tokens=2, uniform_token_count=1)
    started = purepp.start_agreement(dp.AgreementLanes(), group, dispatcher, facts, step=0)
    assert_type(started.result, purepp.PendingAgreement)
    waited = purepp.wait_for_agreement(started.result)
    assert_type(waited.result, BufferRef | None)
    table = np.zeros((5, 2), dtype=np.int32)
    decided = purepp.finish_agreement(started.state, started.result, table)
    assert_type(decided.result, purepp.DispatchOutcome)
    assert_type(decided.result.descriptor, purepp.BatchExecutionDescriptor)
    assert_type(decided.result.sync, purepp.DPSyncState | None)
    assert_type(decided.result.descriptor.cg_mode, purepp.CUDAGraphMode)


def _rank_step_phases(
    *,
    config: rank.RankConfig,
    state: rank.RankState,
    begun: rank.Begun,
    agreed: rank.Agreed,
    batch: purepp.BatchFacts,
    io: rank.StepIO[object],
) -> None:
    # Each phase takes only what the one before it returned, so the order is typed.
    shape = rank.ShapeFacts(num_tokens=2)
    assert_type(rank.begin(config, state), rank.StepPhase[rank.Begun])
    assert_type(rank.agree(config, begun, batch, shape, io), rank.StepPhase[rank.Agreed])
    assert_type(rank.finish(config, agreed, io), rank.StepPhase[rank.RankState])
    # Out of order: each is a type error (strict mypy reports an ignore it does not need).
    rank.agree(config, state, batch, shape, io)  # type: ignore[arg-type]
    rank.agree(config, agreed, batch, shape, io)  # type: ignore[arg-type]
    rank.finish(config, begun, io)  # type: ignore[arg-type]
    rank.begin(config, agreed)  # type: ignore[arg-type]


def _driver(
    driver: rank.RankDriver[object], state: rank.RankState, batch: purepp.BatchFacts
) -> None:
    begun = driver.begin(state)
    assert_type(begun, rank.Begun)
    assert_type(begun.consumed, purepp.ConsumedOutputs | None)
    agreed = driver.agree(begun, batch, rank.ShapeFacts(num_tokens=2), freed=[1])
    assert_type(agreed.descriptor, purepp.BatchExecutionDescriptor)
    assert_type(driver.finish(agreed), rank.RankState)
    driver.finish(begun)  # type: ignore[arg-type]
    driver.agree(agreed, batch, rank.ShapeFacts(num_tokens=2))  # type: ignore[arg-type]
    driver.begin(agreed)  # type: ignore[arg-type]


def _numpy_sampled(driver: rank.RankDriver[npt.NDArray[Any]], agreed: rank.Agreed) -> None:
    # int64 tokens and int32 counts: mypy infers Sampled[object], which finish takes...
    sampled = rank.Sampled(
        tokens=np.zeros((2, 1), np.int64),
        num_sampled=np.ones(2, np.int32),
        num_rejected=np.zeros(2, np.int32),
    )
    assert_type(sampled, rank.Sampled[object])
    assert_type(driver.finish(agreed, sampled), rank.RankState)
    # ...while a Sampled of another tensor type is still refused.
    text = rank.Sampled(tokens="t", num_sampled="s", num_rejected="r")
    driver.finish(agreed, text)  # type: ignore[arg-type]


def _swapped_steps(config: purepp.RelayConfig, state: purepp.RelayState) -> None:
    # Each swappable step is typed with the real step's signature: the real steps and a
    # broken variant of the same shape are taken (README, field failures)...
    def unpadded(
        config: purepp.RelayConfig,
        state: purepp.RelayState,
        batch: purepp.BatchFacts,
        sampled: TensorSpec,
        drafts: TensorSpec | None = None,
    ) -> purepp.Step[purepp.RelayState, bool]:
        return purepp.broadcast_sampled(config, state, batch, sampled, drafts)

    steps = rank.RankSteps(
        consume=purepp.consume_previous_step,
        start_agreement=purepp.start_agreement,
        broadcast_sampled=unpadded,
    )
    assert_type(
        steps.consume(config, state, update_drafts=False),
        purepp.Step[purepp.RelayState, purepp.ConsumedOutputs | None],
    )
    assert_type(steps.broadcast_sampled, rank.BroadcastSampledStep)

    # ...and one of another shape is a type error, not a TypeError mid-step.
    def one_argument(config: purepp.RelayConfig) -> purepp.Step[purepp.RelayState, bool]:
        raise NotImplementedError

    rank.RankSteps(broadcast_sampled=one_argument)  # type: ignore[arg-type]
    rank.RankSteps(consume=purepp.end_step)  # type: ignore[arg-type]
    rank.RankSteps(start_agreement=purepp.finish_agreement)  # type: ignore[arg-type]


def _placeholders(log: EffectLog, numpy_rank: NumpyInterpreter) -> None:
    # into= is the interpreter inputs are bound into, a numpy or torch one: a Recorder
    # (which binds nothing) is a type error, as it is refused at run time.
    binder = placeholder_inputs(log, into=numpy_rank)
    replay(log, Recorder(log.header, numpy_rank), before_step=binder)
    assert_type(binder.specs(0), dict[BufferRef, TensorSpec])
    placeholder_inputs(log, into=Recorder(log.header, numpy_rank))  # type: ignore[arg-type]


def _before_step(log: EffectLog, numpy_rank: NumpyInterpreter) -> None:
    # A before_step of the caller's own is typed with the protocol purepp.effects exports.
    def bind(step: int, interpreter: Interpreter) -> None:
        assert_type(step, int)

    replay(log, numpy_rank, before_step=bind)

    def bind_numpy(step: int, interpreter: NumpyInterpreter) -> None: ...

    replay(log, numpy_rank, before_step=bind_numpy)  # type: ignore[arg-type]


class _OwnNames:
    """A CUDA-graph manager naming dispatch's positional parameters its own way."""

    def dispatch(
        self,
        reqs: int,
        tokens: int,
        uniform_decode_len: int | None,
        /,
        *,
        num_active_loras: int = 0,
        max_query_len: int | None = None,
    ) -> purepp.BatchExecutionDescriptor:
        raise NotImplementedError


def _dispatchers(dispatcher: purepp.CudaGraphDispatcher) -> None:
    # The agreement passes the first three by position: any names (or positional-only
    # parameters) plug in, as CudaGraphDispatcher's own do.
    mine: purepp.Dispatcher = _OwnNames()
    theirs: purepp.Dispatcher = dispatcher
    assert_type(mine.dispatch(1, 1, None), purepp.BatchExecutionDescriptor)
    assert_type(theirs.dispatch(1, 1, 1, max_query_len=1), purepp.BatchExecutionDescriptor)


def _covariant_steps(state: purepp.RelayState) -> None:
    # A Step is immutable, so one answering None is one whose answer may be None: a
    # swapped-in consume that never hands anything out plugs in as it is typed.
    def consume_nothing(
        config: purepp.RelayConfig, state: purepp.RelayState, *, update_drafts: bool
    ) -> purepp.Step[purepp.RelayState, None]:
        return purepp.Step(state, (), None)

    rank.RankSteps(consume=consume_nothing)
    nothing: purepp.Step[purepp.RelayState, None] = purepp.Step(state, (), None)
    wider: purepp.Step[purepp.RelayState, purepp.ConsumedOutputs | None] = nothing
    assert_type(wider.result, purepp.ConsumedOutputs | None)
    _answer: purepp.Step[purepp.RelayState, bool] = nothing  # type: ignore[assignment]
