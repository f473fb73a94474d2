"""The rows an effect declares: a packed section's source rows, a scatter's target rows.

On the packed and fixed wires a sender's counts, tokens or slot mapping bound with fewer
rows than the batch packed as zeros, in every mode: `Pack` fills the top-left corner of
each region (a fixed wire's region has its bucket's rows, more than the batch's), and the
pure step never sees those inputs' rows. On the fixed wire a draft table one row short
lost its last slot's drafts in eager mode: the skipping scatter's spare row is where that
slot's index lands. The relay now declares both bounds in its effects
(`Section.source_rows`, `ScatterRows.target_rows`), and every mode refuses a binding
short of them, with checked mode's typed error.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from purepp.effects.log import EffectLog, LogHeader, dump_log, load_log
from purepp.effects.numpy_interpreter import NumpyInterpreter
from purepp.effects.torch_interpreter import TorchInterpreter, build_communicators
from purepp.effects.vocabulary import (
    Allocate,
    BufferRef,
    Communicator,
    DType,
    Effect,
    Op,
    Pack,
    ScatterRows,
    Section,
    Stream,
    TensorSpec,
    Unpack,
)
from purepp.errors import InterpreterError, LogFormatError
from purepp.layout import Layout
from purepp.relay import (
    RelayConfig,
    RelayState,
    Wire,
    broadcast_drafts,
    broadcast_sampled,
    consume_previous_step,
    default_buckets,
    end_step,
    init_relay,
    receive,
)
from tests._dist import RankContext, run_ranks
from tests.test_relay_review2 import decode_batch

CPU = torch.device("cpu")
SLOTS = 8
SPEC = 1
BATCH = [5, 1, 6]  # three requests; a fixed wire sends them on its 4-row bucket


def sender_config(wire: Wire) -> RelayConfig:
    # The last stage on global rank 0 of a one-rank world: only the sender is observed.
    return RelayConfig(
        pp_size=2,
        stage=1,
        last_rank=0,
        max_num_reqs=SLOTS,
        num_speculative_steps=SPEC,
        wire=wire,
        buckets=default_buckets(SLOTS) if wire is Wire.FIXED else (),
    )


def sender_inputs(short: str | None) -> dict[str, torch.Tensor]:
    """The sender's inputs for BATCH, with the one named by `short` a row short."""
    n = len(BATCH)
    inputs = {
        "sampled_tokens": torch.arange(n * (SPEC + 1), dtype=torch.int64).reshape(n, SPEC + 1),
        "num_sampled": torch.ones(n, dtype=torch.int32),
        "num_rejected": torch.zeros(n, dtype=torch.int32),
        "idx_mapping": torch.tensor(BATCH, dtype=torch.int32),
    }
    if short is not None:
        inputs[short] = inputs[short][: n - 1]
    return inputs


def send_steps(interp: TorchInterpreter, wire: Wire, shorts: list[str | None]) -> list[list[int]]:
    """One send per entry of `shorts`, each with that input a row short (or none): what
    each step put on the wire (the packed wires' one buffer, the seed wire's drafts)."""
    config = sender_config(wire)
    names = config.inputs
    state = init_relay(config)
    batch = decode_batch(BATCH)
    table = torch.arange(SLOTS * SPEC, dtype=torch.int64).reshape(SLOTS, SPEC)
    table_spec = TensorSpec((SLOTS, SPEC), DType.INT64)
    packed = wire is not Wire.SEED
    sent_wires = []
    for short in shorts:
        for field, tensor in sender_inputs(short).items():
            interp.bind(getattr(names, field), tensor)
        interp.bind(names.draft_table, table)
        tokens = TensorSpec((len(BATCH), SPEC + 1), DType.INT64)
        sent = broadcast_sampled(config, state, batch, tokens, table_spec if packed else None)
        interp.perform(sent.effects)
        step, state = state.step, sent.state
        if not packed:
            drafted = broadcast_drafts(config, state, batch, table_spec)
            interp.perform(drafted.effects)
            state = drafted.state
        sent_name = "send_wire" if packed else "send_draft_tokens"
        sent_wires.append(interp.tensor(BufferRef(f"relay.step{step}.{sent_name}")).tolist())
        ended = end_step(config, state)
        interp.perform(ended.effects)
        state = ended.state
    return sent_wires


MODES: dict[str, dict[str, bool]] = {
    "eager": {},
    "checked": {"checked": True},
    "plan": {"plans": True},
    "checked plan": {"plans": True, "checked": True},
}
SHORT_INPUTS = ["sampled_tokens", "num_sampled", "num_rejected", "idx_mapping"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("short", SHORT_INPUTS)
@pytest.mark.parametrize("wire", [Wire.PACKED, Wire.FIXED], ids=["packed", "fixed"])
def test_a_packed_send_refuses_an_input_a_row_short_in_every_mode(
    groups: dict[Communicator, dist.ProcessGroup], wire: Wire, short: str, mode: str
) -> None:
    """Behaviour: a sender's tokens, counts or slot mapping bound with one row fewer than
    the batch is refused with a typed error naming that input, in eager, checked and
    plan modes, also after steps whose inputs fit were lowered into a plan. (The slot
    mapping is the index of the gather of the drafts it sends.)

    Before, each packed as zeros in every mode: the receivers got a request whose count
    or tokens were zero, or drafts of slot 0, with no error."""
    interp = TorchInterpreter(device=CPU, groups=groups, rank=0, **MODES[mode])
    send_steps(interp, wire, [None, None])  # what fits sends, and a plan is lowered
    name = getattr(sender_config(wire).inputs, short).name
    says = (
        rf"index '{name}' has shape \(2,\) where the gather declares 3 entries"
        if short == "idx_mapping"
        else f"source '{name}' has 2 rows where the section declares 3"
    )
    with pytest.raises(InterpreterError, match=says):
        send_steps(interp, wire, [short])


@pytest.mark.parametrize("mode", MODES)
def test_a_seed_wire_draft_send_names_a_short_slot_mapping(
    groups: dict[Communicator, dist.ProcessGroup], mode: str
) -> None:
    """On the seed wire too, a slot mapping a row short is named at the gather of the
    drafts (before, the error named the relay's own gathered buffer at its broadcast)."""
    interp = TorchInterpreter(device=CPU, groups=groups, rank=0, **MODES[mode])
    send_steps(interp, Wire.SEED, [None, None])
    with pytest.raises(InterpreterError, match=r"bind 'relay.input.idx_mapping' with 3 entries"):
        send_steps(interp, Wire.SEED, ["idx_mapping"])


@pytest.mark.parametrize("wire", list(Wire), ids=lambda wire: wire.value)
def test_a_send_with_fitting_inputs_sends_them_in_each_mode_alike(
    groups: dict[Communicator, dist.ProcessGroup], wire: Wire
) -> None:
    """The control of the tests above: inputs of the batch's rows send, and every mode
    sends the same values (the fixed wire's padding row stays zero)."""
    wires = []
    for mode in MODES.values():
        interp = TorchInterpreter(device=CPU, groups=groups, rank=0, **mode)
        wires.append(send_steps(interp, wire, [None, None, None]))
    assert all(each == wires[0] for each in wires)
    assert all(any(step) for step in wires[0])


# ---- the effects alone, on every interpreter ----------------------------------------------

TAG: dict[str, Any] = {"step": 0, "op": Op.BROADCAST}
SOURCE, INDEX, TABLE, WIRE = (BufferRef(n) for n in ("source", "index", "table", "wire"))


def pack_of(source_rows: int | None) -> Pack:
    section = Section(
        buffer=SOURCE, offset=0, shape=(4, 2), dtype=DType.INT64, source_rows=source_rows
    )
    return Pack(**TAG, sections=(section,), out=WIRE, nbytes=64, stream=Stream.MAIN)


def scatter_of(target_rows: int | None) -> ScatterRows:
    return ScatterRows(
        **TAG, source=SOURCE, index=INDEX, target=TABLE, stream=Stream.MAIN, target_rows=target_rows
    )


Interp = TorchInterpreter | NumpyInterpreter


def interpreters(groups: dict[Communicator, dist.ProcessGroup]) -> dict[str, Interp]:
    made: dict[str, Interp] = {
        name: TorchInterpreter(device=CPU, groups=groups, rank=0, **mode)
        for name, mode in MODES.items()
    }
    made["numpy"] = NumpyInterpreter(rank=0)
    return made


def bind(interp: Interp, ref: BufferRef, values: list[Any]) -> None:
    array = np.array(values, dtype=np.int64)
    if isinstance(interp, TorchInterpreter):
        interp.bind(ref, torch.from_numpy(array))
    else:
        interp.bind(ref, array)


def read(interp: Interp, ref: BufferRef) -> list[Any]:
    got = interp.tensor(ref)
    values: list[Any] = got.tolist() if isinstance(got, torch.Tensor) else np.asarray(got).tolist()
    return values


@pytest.mark.parametrize("rows", [3, 2], ids=["as declared", "a row short"])
def test_a_pack_source_must_have_the_rows_its_section_declares(
    groups: dict[Communicator, dist.ProcessGroup], rows: int
) -> None:
    """Behaviour: a section declaring `source_rows=3` packs a 3-row source into the top
    of its 4-row region (the row past it stays zero) and refuses a 2-row one, in every
    mode, naming the source and the rows it must have."""
    for name, interp in interpreters(groups).items():
        bind(interp, SOURCE, [[1, 2], [3, 4], [5, 6]][:rows])
        if rows == 3:
            interp.perform((pack_of(3),))
            assert read(interp, WIRE) == [1, 2, 3, 4, 5, 6, 0, 0], name
            continue
        with pytest.raises(InterpreterError, match="bind 'source' with 3 rows"):
            interp.perform((pack_of(3),))
        assert WIRE not in interp.bound_refs(), name


def test_a_pack_section_without_declared_rows_takes_any_up_to_its_region(
    groups: dict[Communicator, dist.ProcessGroup],
) -> None:
    """`source_rows=None` keeps the top-left corner's old meaning for hand-written programs."""
    for name, interp in interpreters(groups).items():
        bind(interp, SOURCE, [[1, 2]])
        interp.perform((pack_of(None),))
        assert read(interp, WIRE) == [1, 2, 0, 0, 0, 0, 0, 0], name


@pytest.mark.parametrize(
    ("effect", "says"),
    [
        (pack_of(5), "declares source_rows=5"),
        (pack_of(-1), "declares source_rows=-1"),
        (scatter_of(-1), "target_rows=-1"),
    ],
    ids=["more rows than the region", "negative rows", "a negative target bound"],
)
def test_a_declared_bound_out_of_range_is_refused(
    groups: dict[Communicator, dist.ProcessGroup], effect: Effect, says: str
) -> None:
    interps = interpreters(groups)
    for name in ("checked", "numpy"):
        interp = interps[name]
        bind(interp, SOURCE, [[1, 2], [3, 4]])
        bind(interp, INDEX, [0, 1])
        bind(interp, TABLE, [[0, 0], [0, 0]])
        with pytest.raises(InterpreterError, match=says):
            interp.perform((effect,))


def test_an_unpack_section_declares_no_source_rows(
    groups: dict[Communicator, dist.ProcessGroup],
) -> None:
    section = Section(buffer=SOURCE, offset=0, shape=(2,), dtype=DType.INT64, source_rows=2)
    unpack = Unpack(**TAG, source=WIRE, sections=(section,), stream=Stream.MAIN)
    for name in ("checked", "numpy"):
        interp = interpreters(groups)[name]
        bind(interp, WIRE, [1, 2])
        with pytest.raises(InterpreterError, match="leave source_rows None in an Unpack"):
            interp.perform((unpack,))


@pytest.mark.parametrize("skips", [True, False], ids=["skipping", "plain"])
def test_a_scatter_refuses_a_target_short_of_its_declared_rows_in_every_mode(
    groups: dict[Communicator, dist.ProcessGroup], skips: bool
) -> None:
    """Behaviour: a scatter declaring `target_rows=3` refuses a 2-row table before it
    writes, in every mode, even where the index is not read on the host (eager and plans
    never read it); a table of 3 or more rows takes the rows.

    Before, a skipping scatter in eager mode wrote index 2 into its spare row (a
    2-row table's row `rows`) and dropped it: a fixed-wire draft table one row short lost
    its last slot's drafts silently."""
    for name, interp in interpreters(groups).items():
        scatter = ScatterRows(
            **TAG,
            source=SOURCE,
            index=INDEX,
            target=TABLE,
            stream=Stream.MAIN,
            skips=skips,
            target_rows=3,
        )
        bind(interp, SOURCE, [[7, 7], [8, 8]])
        bind(interp, INDEX, [2, -1] if skips else [2, 0])
        bind(interp, TABLE, [[0, 0], [0, 0]])
        with pytest.raises(InterpreterError, match="fewer than the 3 rows"):
            interp.perform((scatter,))
        assert read(interp, TABLE) == [[0, 0], [0, 0]], name
        bind(interp, TABLE, [[0, 0], [0, 0], [0, 0]])
        interp.perform((scatter,))
        assert read(interp, TABLE) == (
            [[0, 0], [0, 0], [7, 7]] if skips else [[8, 8], [0, 0], [7, 7]]
        )


# ---- the relay declares them ----------------------------------------------------------------


def test_the_relays_consume_declares_its_draft_tables_rows() -> None:
    """The relay's scatter of received drafts declares `max_num_reqs` (every slot is
    below it), on every wire."""
    for wire in Wire:
        config = RelayConfig(
            pp_size=2,
            stage=0,
            last_rank=1,
            max_num_reqs=SLOTS,
            num_speculative_steps=SPEC,
            wire=wire,
            buckets=default_buckets(SLOTS) if wire is Wire.FIXED else (),
        )
        state = init_relay(config)
        batch = decode_batch(BATCH)
        scatters: list[ScatterRows] = []
        for _ in range(config.ring_depth + 1):
            taken = consume_previous_step(config, state, update_drafts=True)
            scatters += [e for e in taken.effects if isinstance(e, ScatterRows)]
            state = end_step(config, receive(config, taken.state, batch).state).state
        assert scatters, wire
        assert {s.target_rows for s in scatters} == {SLOTS}, wire


def _fixed_wire_drafts(ctx: RankContext, table_rows: int) -> list[list[int]] | str:
    """Rank 1 (last stage) sends drafts for slots [5, 1, 7] on the fixed wire at steps 0
    and 1; rank 0 consumes step 0's at step 2 into a draft table of `table_rows` rows: the
    table it got, or the error it raised."""
    groups = build_communicators(
        pp_groups=[[0, 1]],
        dp_groups=[[0], [1]],
        relay_backend="gloo",
        timeout=datetime.timedelta(seconds=20),
    )
    interp = TorchInterpreter(device=ctx.device, groups=groups, rank=ctx.rank)
    config = RelayConfig.for_stage(
        pp_size=2,
        stage=ctx.rank,
        max_num_reqs=SLOTS,
        num_speculative_steps=SPEC,
        wire=Wire.FIXED,
        buckets=default_buckets(SLOTS),
    )
    inputs = config.inputs
    slots = [5, 1, SLOTS - 1]
    batch = decode_batch(slots)
    state: RelayState = init_relay(config)
    table = torch.zeros((table_rows, SPEC), dtype=torch.int64)
    interp.bind(inputs.draft_table, table)
    perform: Callable[[tuple[Effect, ...]], None] = interp.perform
    for _ in range(config.ring_depth):  # steps 0 and 1: a send and its receive
        interp.bind(inputs.idx_mapping, torch.tensor(slots, dtype=torch.int32))
        if config.is_last_stage:
            interp.bind(inputs.sampled_tokens, torch.ones((3, SPEC + 1), dtype=torch.int64))
            interp.bind(inputs.num_sampled, torch.ones(3, dtype=torch.int32))
            interp.bind(inputs.num_rejected, torch.zeros(3, dtype=torch.int32))
            drafts = torch.arange(1, SLOTS + 1, dtype=torch.int64).reshape(SLOTS, SPEC) * 10
            interp.bind(inputs.draft_table, drafts)
            sent = broadcast_sampled(
                config,
                state,
                batch,
                TensorSpec((3, SPEC + 1), DType.INT64),
                TensorSpec((SLOTS, SPEC), DType.INT64),
            )
            perform(sent.effects)
            state = sent.state
        else:
            taken = consume_previous_step(config, state, update_drafts=True)
            perform(taken.effects)
            posted = receive(config, taken.state, batch)
            perform(posted.effects)
            state = posted.state
        ended = end_step(config, state)
        perform(ended.effects)
        state = ended.state
    if config.is_last_stage:
        return []
    # Step 2 consumes step 0's entry (and issues no collective, so the ranks part here).
    try:
        perform(consume_previous_step(config, state, update_drafts=True).effects)
    except InterpreterError as error:
        return str(error)
    return [[int(v) for v in row] for row in table.tolist()]


def _full_table(ctx: RankContext) -> list[list[int]] | str:
    return _fixed_wire_drafts(ctx, SLOTS)


def _short_table(ctx: RankContext) -> list[list[int]] | str:
    return _fixed_wire_drafts(ctx, SLOTS - 1)


@pytest.mark.multiprocess
def test_a_fixed_wire_receiver_refuses_a_draft_table_a_row_short_over_gloo() -> None:
    """Behaviour: over two real gloo ranks on the fixed wire, a receiver whose draft table
    is one row short of `max_num_reqs` gets a typed error at the consume; with the whole
    table, every slot's drafts arrive, the last slot's too.

    Before, eager mode wrote the last slot's drafts into the skipping scatter's spare
    row, the short table's row `rows`, and dropped them with no error."""
    full = run_ranks(_full_table, 2, deadline_s=90.0)[0]
    assert full == [[0], [20], [0], [0], [0], [60], [0], [80]]
    short = run_ranks(_short_table, 2, deadline_s=90.0)[0]
    assert isinstance(short, str)
    assert "fewer than the 8 rows" in short


# ---- the log ------------------------------------------------------------------------------


def test_the_declared_rows_round_trip_through_a_log_and_a_negative_one_is_corrupt(
    tmp_path: Any,
) -> None:
    header = LogHeader(rank=0, world=Layout(pp=1, dp=1))
    effects = (
        Allocate(**TAG, buffer=SOURCE, shape=(3, 2), dtype=DType.INT64, stream=Stream.MAIN),
        pack_of(3),
        scatter_of(8),
    )
    log = EffectLog.from_effects(header, effects)
    path = tmp_path / "rank-0000.jsonl"
    dump_log(log, path)
    assert load_log(path) == log
    text = path.read_text()
    assert '"source_rows": 3' in text
    assert '"target_rows": 8' in text
    path.write_text(text.replace('"source_rows": 3', '"source_rows": -3'))
    with pytest.raises(LogFormatError):
        load_log(path)
