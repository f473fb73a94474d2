"""The relay's opt-in validated header: [step, request count] sent first, checked by receivers.

Off (the default) the relay's effects are the seed's, call for call (tests/test_relay.py
and the golden logs pin them). On, the last stage's first broadcast of a step is a
fixed [2] int32 header and every receiver checks it on its relay stream before the
step's other receives. The field failures it names are in tests/test_field_failures.py.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
from pathlib import Path
from typing import Any, TypedDict

import attrs
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from purepp.batch import BatchFacts, need_sampled_mask
from purepp.effects.checker import check_log_dir
from purepp.effects.log import dump_logs, load_logs
from purepp.effects.matching import match_collectives
from purepp.effects.numpy_interpreter import NumpyInterpreter
from purepp.effects.vocabulary import (
    Alias,
    Allocate,
    Broadcast,
    BufferRef,
    CheckHeader,
    Communicator,
    CopyHostToDevice,
    DType,
    Effect,
    Op,
    PadColumns,
    RecordEvent,
    RecordStream,
    Release,
    Section,
    StackRows,
    Stream,
    TensorSpec,
    Unpack,
    WaitStream,
)
from purepp.errors import (
    CollectiveMismatchError,
    ConfigError,
    HeaderMismatchError,
    InterpreterError,
    InvalidInputError,
)
from purepp.relay import (
    HEADER_SHAPE,
    PendingReceive,
    RelayConfig,
    RelayState,
    broadcast_sampled,
    consume_previous_step,
    end_step,
    init_relay,
    receive,
    relay_header,
)
from purepp.runner.settings import RunSettings
from purepp.runner.worker import add_run_options, settings_from_args
from purepp.testing import (
    ScheduleConfig,
    make_schedule,
    record_scripted_logs,
    scripted_header,
    simulate_schedule,
)
from tests.strategies import DECODE, PARTIAL, batch_facts, relay_configs


class Tag(TypedDict):
    step: int
    op: Op


class Wire(TypedDict):
    src: int
    comm: Communicator
    stream: Stream


INPUTS = RelayConfig.for_stage(pp_size=1, stage=0, max_num_reqs=1).inputs  # default name


def stage(
    *, pp_size: int = 3, stage: int = 0, spec: int = 0, validate_header: bool = True
) -> RelayConfig:
    return RelayConfig.for_stage(
        pp_size=pp_size,
        stage=stage,
        max_num_reqs=8,
        num_speculative_steps=spec,
        validate_header=validate_header,
    )


def make_batch(slots: list[int], rows: list[tuple[int, int, int]] | None = None) -> BatchFacts:
    columns = np.array([DECODE] * len(slots) if rows is None else rows, dtype=np.int32)
    columns = columns.reshape(len(slots), 3)
    return BatchFacts(
        idx_mapping=np.array(slots, dtype=np.int32),
        num_computed_tokens=columns[:, 0],
        num_scheduled_tokens=columns[:, 1],
        prefill_len=columns[:, 2],
    )


def at_step(config: RelayConfig, step: int) -> RelayState:
    """A fresh state whose counter reads `step`, ready for this step's receive."""
    state = attrs.evolve(init_relay(config), step=step)
    return consume_previous_step(config, state).state


def header_effects(effects: tuple[Effect, ...]) -> list[Effect]:
    """The effects that exist only because of the header (its buffer is named *header)."""
    found: list[Effect] = []
    for effect in effects:
        named = getattr(effect, "buffer", None)
        if isinstance(named, BufferRef) and named.name.endswith("header"):
            found.append(effect)
    return found


# --- the header's values -------------------------------------------------------------------------


def test_relay_header_is_step_and_request_count_as_read_only_int32() -> None:
    header = relay_header(7, 3)
    assert header.dtype == np.int32
    assert header.shape == HEADER_SHAPE
    assert header.tolist() == [7, 3]
    assert not header.flags.writeable


@pytest.mark.parametrize(
    ("step", "wire_step"), [(2**31 - 1, 2**31 - 1), (2**31, 0), (2**31 + 5, 5), (2**33 + 9, 9)]
)
def test_relay_header_step_wraps_to_stay_int32(step: int, wire_step: int) -> None:
    # A server may run past 2**31 steps; the header must not overflow its wire dtype.
    assert relay_header(step, 4).tolist() == [wire_step, 4]


def test_relay_header_takes_an_empty_batch_and_the_largest_count_and_refuses_the_rest() -> None:
    assert relay_header(0, 0).tolist() == [0, 0]
    assert relay_header(1, 2**31 - 1).tolist() == [1, 2**31 - 1]
    bad: list[tuple[object, object]] = [(-1, 0), (0, -1), (0, 2**31), (True, 0), (0, 1.0)]
    for step, num_reqs in bad:
        with pytest.raises(InvalidInputError, match=r"^relay_header: step="):
            relay_header(step, num_reqs)  # type: ignore[arg-type]


def test_validate_header_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match="validate_header=1"):
        RelayConfig(
            pp_size=2,
            stage=0,
            last_rank=1,
            max_num_reqs=4,
            num_speculative_steps=0,
            validate_header=1,  # type: ignore[arg-type]
        )
    with pytest.raises(ConfigError, match="validate_header='yes'"):
        ScheduleConfig(pp=2, dp=1, spec=0, steps=2, seed=0, validate_header="yes")  # type: ignore[arg-type]
    assert not RelayConfig.for_stage(pp_size=2, stage=0, max_num_reqs=4).validate_header


# --- exact effect sequences with the flag on ---------------------------------------------------


@pytest.mark.parametrize("spec", [0, 2])
def test_receive_posts_and_checks_the_header_before_the_seed_receives(spec: int) -> None:
    config = stage(pp_size=3, stage=1, spec=spec)
    state = at_step(config, 5)
    got = receive(config, state, make_batch([4, 0, 2]))
    tag = Tag(step=5, op=Op.RECEIVE)
    wire = Wire(src=2, comm=Communicator.PP_RELAY, stream=Stream.RELAY)
    header = BufferRef("relay.step5.header")
    entry = got.state.ring[-1]
    assert entry is not None
    sampled, counts = entry.sampled_tokens, BufferRef("relay.step5.counts")
    expected: list[Effect] = [
        WaitStream(**tag, stream=Stream.RELAY, waits_for=Stream.MAIN),
        Allocate(**tag, buffer=header, shape=(2,), dtype=DType.INT32, stream=Stream.RELAY),
        Broadcast(**tag, **wire, buffer=header, shape=(2,), dtype=DType.INT32),
        CheckHeader(**tag, buffer=header, expected=[5, 3], stream=Stream.RELAY),
        Allocate(
            **tag, buffer=sampled, shape=(3, spec + 1), dtype=DType.INT64, stream=Stream.RELAY
        ),
        Allocate(**tag, buffer=counts, shape=(2, 3), dtype=DType.INT32, stream=Stream.RELAY),
        Broadcast(**tag, **wire, buffer=sampled, shape=(3, spec + 1), dtype=DType.INT64),
        Broadcast(**tag, **wire, buffer=counts, shape=(2, 3), dtype=DType.INT32),
    ]
    received = [sampled, counts]
    if spec:
        drafts = entry.draft_tokens
        assert drafts is not None
        expected += [
            Allocate(**tag, buffer=drafts, shape=(3, spec), dtype=DType.INT64, stream=Stream.RELAY),
            Broadcast(**tag, **wire, buffer=drafts, shape=(3, spec), dtype=DType.INT64),
        ]
        received.append(drafts)
    expected.append(RecordEvent(**tag, stream=Stream.RELAY, event=entry.event))
    rows = (
        Section(buffer=entry.num_sampled, offset=0, shape=(3,), dtype=DType.INT32),
        Section(buffer=entry.num_rejected, offset=12, shape=(3,), dtype=DType.INT32),
    )
    expected.append(Unpack(**tag, source=counts, stream=Stream.MAIN, sections=rows))
    # The header is used on the relay stream alone: no record_stream for it.
    expected += [RecordStream(**tag, buffer=b, stream=Stream.MAIN) for b in received]
    assert entry.idx_mapping is not None
    expected.append(Alias(**tag, source=INPUTS.idx_mapping, out=entry.idx_mapping))
    assert list(got.effects) == expected
    # The ring entry carries it with the step's other buffers, released at consume.
    assert got.state.to_release == ()
    assert header in entry.buffers


@pytest.mark.parametrize("width", [1, 3])
def test_broadcast_sampled_sends_the_header_first(width: int) -> None:
    config = stage(pp_size=4, stage=3, spec=2)
    state = attrs.evolve(init_relay(config), step=7)
    facts = make_batch([2, 5], [DECODE, PARTIAL])
    got = broadcast_sampled(config, state, facts, TensorSpec((2, width), DType.INT64))
    assert got.result is True
    tag = Tag(step=7, op=Op.BROADCAST)
    wire = Wire(src=3, comm=Communicator.PP_RELAY, stream=Stream.RELAY)
    header = BufferRef("relay.step7.send_header")
    tokens = BufferRef("relay.step7.send_sampled_tokens")
    counts = BufferRef("relay.step7.send_counts")
    assert list(got.effects) == [
        WaitStream(**tag, stream=Stream.RELAY, waits_for=Stream.MAIN),
        # The header goes to the device on the relay stream, so it needs no record_stream.
        CopyHostToDevice(**tag, source=[7, 2], buffer=header, stream=Stream.RELAY),
        Broadcast(**tag, **wire, buffer=header, shape=(2,), dtype=DType.INT32),
        PadColumns(
            **tag, source=INPUTS.sampled_tokens, out=tokens, width=3, fill=0, stream=Stream.RELAY
        ),
        Broadcast(**tag, **wire, buffer=tokens, shape=(2, 3), dtype=DType.INT64),
        StackRows(
            **tag,
            sources=(INPUTS.num_sampled, INPUTS.num_rejected),
            out=counts,
            stream=Stream.RELAY,
        ),
        Broadcast(**tag, **wire, buffer=counts, shape=(2, 2), dtype=DType.INT32),
        RecordStream(**tag, buffer=INPUTS.sampled_tokens, stream=Stream.RELAY),
        RecordStream(**tag, buffer=INPUTS.num_sampled, stream=Stream.RELAY),
        RecordStream(**tag, buffer=INPUTS.num_rejected, stream=Stream.RELAY),
    ]
    assert got.state.to_release == (header, tokens, counts)
    released = end_step(config, got.state).effects
    assert [e.buffer for e in released if isinstance(e, Release)] == [header, tokens, counts]


def test_no_header_on_a_step_where_nothing_samples() -> None:
    # The same gate as every relay broadcast: receivers post nothing either.
    facts = make_batch([0, 1], [PARTIAL, PARTIAL])
    sender = stage(pp_size=2, stage=1)
    receiver = stage(pp_size=2, stage=0)
    sent = broadcast_sampled(sender, init_relay(sender), facts, TensorSpec((2, 1), DType.INT64))
    posted = receive(receiver, at_step(receiver, 0), facts)
    assert (sent.effects, posted.effects) == ((), ())


def without_header(
    ring: tuple[PendingReceive | None, ...],
) -> tuple[PendingReceive | None, ...]:
    """The ring with the header dropped from each entry's buffers (released at consume)."""
    return tuple(
        None
        if entry is None
        else attrs.evolve(
            entry, buffers=tuple(b for b in entry.buffers if not b.name.endswith("header"))
        )
        for entry in ring
    )


def broadcasts(effects: tuple[Effect, ...]) -> list[tuple[tuple[int, ...], DType, int]]:
    return [(e.shape, e.dtype, e.src) for e in effects if isinstance(e, Broadcast)]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), config=relay_configs(non_last=True), step=st.integers(0, 2**40))
def test_with_the_flag_the_header_is_the_first_broadcast_on_both_sides_and_only_addition(
    data: st.DataObject, config: RelayConfig, step: int
) -> None:
    facts = data.draw(batch_facts(config.max_num_reqs, min_rows=1))
    sender_off = attrs.evolve(config, stage=config.pp_size - 1)
    sender_on = attrs.evolve(sender_off, validate_header=True)
    receiver_on = attrs.evolve(config, validate_header=True)
    width = data.draw(st.integers(1, config.max_sample_len))
    tokens = TensorSpec((facts.num_reqs, width), DType.INT64)

    posted_off = receive(config, at_step(config, step), facts)
    posted_on = receive(receiver_on, at_step(receiver_on, step), facts)
    sent_off = broadcast_sampled(
        sender_off, attrs.evolve(init_relay(sender_off), step=step), facts, tokens
    )
    sent_on = broadcast_sampled(
        sender_on, attrs.evolve(init_relay(sender_on), step=step), facts, tokens
    )

    if need_sampled_mask(facts) is None:
        assert posted_on.effects == posted_off.effects == sent_on.effects == ()
        return
    # Without the header's own effects, the flag changes nothing, state included.
    for on, off in ((posted_on, posted_off), (sent_on, sent_off)):
        extra = header_effects(on.effects)
        assert [e for e in on.effects if e not in extra] == list(off.effects)
        assert without_header(on.state.ring) == off.state.ring
        assert [b for b in on.state.to_release if not b.name.endswith("header")] == list(
            off.state.to_release
        )
    # Sender and receivers: the same wire (drafts follow separately), header first, with
    # the same header values.
    sent_wire = broadcasts(sent_on.effects)
    assert broadcasts(posted_on.effects)[: len(sent_wire)] == sent_wire
    assert broadcasts(posted_on.effects)[0] == ((2,), DType.INT32, config.last_rank)
    (check,) = [e for e in posted_on.effects if isinstance(e, CheckHeader)]
    (copy,) = [e for e in sent_on.effects if isinstance(e, CopyHostToDevice)]
    assert check.expected.tolist() == copy.source.tolist() == [step % 2**31, facts.num_reqs]


# --- the numpy interpreter's check ---------------------------------------------------------------


def check_header(buffer: BufferRef, expected: list[int], step: int = 3) -> CheckHeader:
    return CheckHeader(
        step=step, op=Op.RECEIVE, buffer=buffer, expected=expected, stream=Stream.RELAY
    )


def test_numpy_interpreter_passes_a_matching_header() -> None:
    interpreter = NumpyInterpreter(rank=2)
    header = BufferRef("h")
    interpreter.bind(header, np.array([3, 4], dtype=np.int32))
    interpreter.perform((check_header(header, [3, 4]),))
    assert interpreter.idle()


@pytest.mark.parametrize(
    ("received", "why", "fix"),
    [
        ([4, 4], "sent at another step", "end_step once per step"),
        ([3, 5], "different batches", "same replicated batch"),
    ],
)
def test_numpy_interpreter_names_rank_step_and_both_headers_on_a_mismatch(
    received: list[int], why: str, fix: str
) -> None:
    interpreter = NumpyInterpreter(rank=2)
    header = BufferRef("h")
    interpreter.bind(header, np.array(received, dtype=np.int32))
    with pytest.raises(HeaderMismatchError) as caught:
        interpreter.perform((check_header(header, [3, 4]),))
    error = caught.value
    assert isinstance(error, CollectiveMismatchError)
    assert (error.rank, error.step, error.expected, error.received) == (
        2,
        3,
        (3, 4),
        tuple(received),
    )
    assert error.call == "NumpyInterpreter.perform(CheckHeader step=3 op=receive)"
    assert (
        f"rank 2 received relay header [step {received[0]}, {received[1]} requests] at step 3"
        in str(error)
    )
    assert "but expected [step 3, 4 requests]" in str(error)
    assert why in error.problem
    assert fix in error.fix


@pytest.mark.parametrize(
    "bound", [np.array([3, 4, 0], dtype=np.int32), np.array([3, 4], dtype=np.int64)]
)
def test_numpy_interpreter_refuses_a_header_of_another_layout(
    bound: npt.NDArray[np.integer[Any]],
) -> None:
    interpreter = NumpyInterpreter()
    header = BufferRef("h")
    interpreter.bind(header, bound)
    with pytest.raises(InterpreterError, match="but the expected header is int32 \\(2,\\)"):
        interpreter.perform((check_header(header, [3, 4]),))


def test_the_check_waits_for_its_broadcast_in_the_simulator() -> None:
    # The received header arrives with the broadcast: a check queued behind it compares
    # the sender's values, not the poisoned fresh buffer.
    schedule = make_schedule(
        ScheduleConfig(pp=2, dp=1, spec=1, steps=8, seed=0, validate_header=True)
    )
    run = simulate_schedule(schedule)
    checks = [e for e in run.simulation.effects[0] if isinstance(e, CheckHeader)]
    assert checks
    assert all(i.lifetime_violations == () for i in run.simulation.interpreters)
    # Every header is released: sent ones at their step's end, received ones when their
    # entry is consumed; only the entries still in the ring (the last 2 steps) hold one.
    for interpreter in run.simulation.interpreters:
        held = {
            ref.name
            for ref in interpreter.bound_refs()
            if isinstance(ref, BufferRef) and ref.name.endswith("header")
        }
        assert held <= {"relay.step6.header", "relay.step7.header"}


# --- scripted runs: the same outputs, a matched wire, logs ---------------------------------------


@pytest.mark.parametrize(("pp", "dp", "spec"), [(2, 1, 0), (3, 1, 2), (2, 2, 1), (4, 1, 1)])
def test_a_scripted_run_with_the_header_consumes_what_it_consumes_without(
    pp: int, dp: int, spec: int
) -> None:
    plain = ScheduleConfig(pp=pp, dp=dp, spec=spec, steps=16, seed=7)
    checked = attrs.evolve(plain, validate_header=True)
    off, on = simulate_schedule(make_schedule(plain)), simulate_schedule(make_schedule(checked))
    assert on.outputs == off.outputs
    world = checked.world
    assert match_collectives(dict(enumerate(on.simulation.effects)), world) is None
    for rank in range(world.world_size):
        extra = header_effects(on.simulation.effects[rank])
        assert [e for e in on.simulation.effects[rank] if e not in extra] == list(
            off.simulation.effects[rank]
        )
        if world.pp_stage(rank) < pp - 1:
            receives = {e.step for e in off.simulation.effects[rank] if e.op is Op.RECEIVE}
            checks = {e.step for e in extra if isinstance(e, CheckHeader)}
            assert checks == receives, f"rank {rank}: a receive step without a header check"


def test_the_log_header_names_the_switch_only_when_it_is_on() -> None:
    plain = ScheduleConfig(pp=2, dp=1, spec=0, steps=2, seed=0)
    off = scripted_header(make_schedule(plain), 0).config["scripted"]
    on = scripted_header(make_schedule(attrs.evolve(plain, validate_header=True)), 0)
    assert "validate_header" not in off  # type: ignore[operator]
    assert on.config["scripted"]["validate_header"] is True  # type: ignore[index]


def test_logs_with_the_header_round_trip_and_pass_purepp_check(tmp_path: Path) -> None:
    schedule = make_schedule(
        ScheduleConfig(pp=3, dp=2, spec=1, steps=10, seed=3, validate_header=True)
    )
    logs = record_scripted_logs(schedule)
    dump_logs(logs, tmp_path)
    assert tuple(load_logs(tmp_path)) == logs
    out = io.StringIO()
    assert check_log_dir(tmp_path, out) == 0, out.getvalue()


# --- the runner ------------------------------------------------------------------------------


def test_the_run_option_reaches_the_settings() -> None:
    parser = argparse.ArgumentParser()
    add_run_options(parser)
    assert settings_from_args(parser.parse_args([])).validate_header is False
    assert settings_from_args(parser.parse_args(["--validate-header"])).validate_header is True
    assert RunSettings().validate_header is False


@pytest.mark.multiprocess
def test_purepp_run_with_the_header_keeps_parity_and_logs_the_checks(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "purepp.runner.cli",
            "run",
            "--validate-header",
            "--pp=3",
            "--dp=1",
            "--requests=8",
            "--seed=4",
            f"--log-dir={logs}",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "relay header validated" in result.stdout
    assert "parity           OK" in result.stdout
    loaded = load_logs(logs)
    for log in loaded[:2]:  # stages 0 and 1 receive
        assert any(isinstance(e, CheckHeader) for e in log.effects)
    assert check_log_dir(logs, io.StringIO()) == 0
