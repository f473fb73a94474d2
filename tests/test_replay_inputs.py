"""Replay with the caller's inputs: `replay(..., before_step=)` and `placeholder_inputs`.

A log holds no caller tensors. `before_step` lets a caller bind each step's inputs;
`placeholder_inputs(log)` binds zeros of the layouts the log's records require. The
golden logs run to the end with it: on numpy ranks under the simulator, and on real
gloo processes through `replay` into a `Recorder` around a `TorchInterpreter`, which
records the golden log again.
"""

from __future__ import annotations

import datetime
import functools
import itertools
from collections.abc import Iterator
from typing import TypedDict

import numpy as np
import pytest
import torch

from purepp.effects.interpreter import Interpreter
from purepp.effects.log import (
    EffectLog,
    LogHeader,
    Recorder,
    assert_logs_equal,
    load_log,
    load_logs,
    replay,
)
from purepp.effects.numpy_interpreter import NumpyInterpreter
from purepp.effects.replay import InputShapeError, placeholder_inputs
from purepp.effects.simulator import RankContext as SimContext
from purepp.effects.simulator import simulate
from purepp.effects.torch_interpreter import TorchInterpreter, build_communicators
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
    GatherRows,
    Op,
    Pack,
    PadColumns,
    Release,
    ScatterRows,
    Section,
    StackRows,
    Stream,
    TensorSpec,
)
from purepp.errors import InterpreterError, InvalidInputError
from purepp.layout import Layout
from tests._dist import RankContext, run_ranks
from tests.regen_golden import GOLDEN_CASES, GOLDEN_DIR

CASES = sorted(GOLDEN_CASES)
HEADER = LogHeader(rank=0, world=Layout(pp=1, dp=1))

TOKENS = BufferRef("input.tokens")  # [n, k <= width] int64
NUM_SAMPLED = BufferRef("input.num_sampled")  # [n] int32
NUM_REJECTED = BufferRef("input.num_rejected")  # [n] int32
IDX = BufferRef("input.idx_mapping")  # [n] int32
TABLE = BufferRef("input.draft_table")  # [rows, spec] int64


class Tag(TypedDict):
    step: int
    op: Op


# -- step 0's effects on the main stream, as the tests below build them ---------------------


def host_copy(values: list[int], buffer: BufferRef, op: Op = Op.CONSUME) -> CopyHostToDevice:
    return CopyHostToDevice(step=0, op=op, source=values, buffer=buffer, stream=Stream.MAIN)


def allocated(
    buffer: BufferRef, shape: tuple[int, ...], dtype: DType = DType.INT32, op: Op = Op.CONSUME
) -> Allocate:
    return Allocate(step=0, op=op, buffer=buffer, shape=shape, dtype=dtype, stream=Stream.MAIN)


def gathered(
    index: BufferRef, out: BufferRef, source: BufferRef = TABLE, op: Op = Op.CONSUME
) -> GatherRows:
    return GatherRows(step=0, op=op, source=source, index=index, out=out, stream=Stream.MAIN)


def stacked(sources: tuple[BufferRef, ...], out: BufferRef, op: Op = Op.CONSUME) -> StackRows:
    return StackRows(step=0, op=op, sources=sources, out=out, stream=Stream.MAIN)


def golden(name: str) -> tuple[EffectLog, ...]:
    return load_logs(GOLDEN_DIR / name, expect_world=GOLDEN_CASES[name].world)


def batches(log: EffectLog) -> Iterator[tuple[int, tuple[Effect, ...]]]:
    """The log's batches as replay performs them: runs of records of one step."""
    for step, group in itertools.groupby(log.records, key=lambda record: record.effect.step):
        yield step, tuple(record.effect for record in group)


# -- a local program with every kind of read (no collectives: one rank performs it) ------


def sends(step: int, rows: int, width: int) -> list[Effect]:
    """A step like the relay's last stage: pad, stack, gather and pack the caller's inputs.

    The packed sections stand in for the wire (a lone rank broadcasts to no one): each
    output fits its section, as a broadcast's buffer fits the wire.
    """
    tag = Tag(step=step, op=Op.BROADCAST)
    padded, counts, drafts = (BufferRef(f"s{step}.{name}") for name in ("pad", "cnt", "drf"))
    spec = 2
    sections = (
        Section(buffer=padded, offset=0, shape=(rows, width), dtype=DType.INT64),
        Section(buffer=counts, offset=16 * 8, shape=(2, rows), dtype=DType.INT32),
        Section(buffer=drafts, offset=16 * 16, shape=(rows, spec), dtype=DType.INT64),
    )
    wire = BufferRef(f"s{step}.wire")
    return [
        PadColumns(**tag, source=TOKENS, out=padded, width=width, fill=0, stream=Stream.MAIN),
        StackRows(**tag, sources=(NUM_SAMPLED, NUM_REJECTED), out=counts, stream=Stream.MAIN),
        GatherRows(**tag, source=TABLE, index=IDX, out=drafts, stream=Stream.MAIN),
        Pack(**tag, sections=sections, out=wire, nbytes=16 * 32, stream=Stream.MAIN),
        *(Release(**tag, buffer=name) for name in (padded, counts, drafts, wire)),
    ]


def local_log() -> EffectLog:
    effects: list[Effect] = []
    for step, rows in enumerate((3, 1, 4)):
        effects += sends(step, rows, width=3)
    return EffectLog.from_effects(HEADER, effects)


def test_the_binder_derives_each_steps_inputs_from_what_reads_them() -> None:
    binder = placeholder_inputs(local_log())
    for step, rows in enumerate((3, 1, 4)):
        assert binder.specs(step) == {
            # PadColumns: rows from the packed output, columns as wide as the pad allows.
            TOKENS: TensorSpec((rows, 3), DType.INT64),
            # StackRows: the stacked [2, rows] int32 section.
            NUM_SAMPLED: TensorSpec((rows,), DType.INT32),
            NUM_REJECTED: TensorSpec((rows,), DType.INT32),
            # GatherRows: the index as long as the gathered rows; the table's columns
            # and dtype from its section, one row (the placeholder index is all zeros).
            IDX: TensorSpec((rows,), DType.INT32),
            TABLE: TensorSpec((1, 2), DType.INT64),
        }
    assert binder.specs(7) == {}  # a step the log does not hold reads nothing


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_local_log_replays_to_the_end_with_placeholder_inputs(kind: str) -> None:
    log = local_log()
    inner: NumpyInterpreter | TorchInterpreter = (
        NumpyInterpreter()
        if kind == "numpy"
        # checked: every effect's layouts are validated, so a wrong placeholder fails
        else TorchInterpreter(device=torch.device("cpu"), groups={}, rank=0, checked=True)
    )
    recorder = Recorder(log.header, inner)
    replay(log, recorder, before_step=placeholder_inputs(log, into=inner))
    assert_logs_equal(log, recorder.log)
    # What is left bound is the last step's placeholders, as the binder made them.
    assert inner.bound_refs() == {TOKENS, NUM_SAMPLED, NUM_REJECTED, IDX, TABLE}
    assert np.asarray(inner.tensor(TOKENS)).shape == (4, 3)
    assert not np.asarray(inner.tensor(TOKENS)).any()


def test_without_inputs_the_same_replay_stops_at_the_first_one() -> None:
    with pytest.raises(InterpreterError, match=r"'input\.tokens' is not bound") as caught:
        replay(local_log(), NumpyInterpreter())
    assert caught.value.__notes__[0].startswith("in replay: step 0 of rank 0's log")


def test_an_alias_ties_an_input_to_what_later_steps_read_of_it() -> None:
    # A non-last stage keeps idx_mapping past its step (an Alias) and scatters received
    # drafts with it two steps later: the input's length is the received rows'.
    kept, drafts = BufferRef("r0.idx"), BufferRef("r0.drafts")
    effects: list[Effect] = [
        Alias(step=0, op=Op.RECEIVE, source=IDX, out=kept),
        allocated(drafts, (5, 2), DType.INT64, op=Op.RECEIVE),
        Alias(step=1, op=Op.RECEIVE, source=IDX, out=BufferRef("r1.idx")),
        Release(step=1, op=Op.END_STEP, buffer=BufferRef("r1.idx")),
        ScatterRows(
            step=2,
            op=Op.CONSUME,
            source=drafts,
            index=kept,
            target=TABLE,
            stream=Stream.MAIN,
            skips=False,
        ),
        Release(step=2, op=Op.END_STEP, buffer=kept),
        Release(step=2, op=Op.END_STEP, buffer=drafts),
    ]
    log = EffectLog.from_effects(HEADER, effects)
    binder = placeholder_inputs(log)
    assert binder.specs(0) == {IDX: TensorSpec((5,), DType.INT32)}
    # Only aliased and released: nothing reads its layout, so it is an empty vector.
    assert binder.specs(1) == {IDX: TensorSpec((0,), DType.INT32)}
    # The table's rows reach the scattered indices (zeros); its rows are the drafts'.
    assert binder.specs(2) == {TABLE: TensorSpec((1, 2), DType.INT64)}
    interpreter = NumpyInterpreter()
    replay(log, interpreter, before_step=binder)
    assert interpreter.bound_refs() == {IDX, TABLE}


def test_a_table_indexed_by_copied_values_gets_rows_past_the_largest() -> None:
    index = BufferRef("s0.slots")
    effects: list[Effect] = [
        host_copy([-1, 6, 2], index),
        Allocate(
            step=0,
            op=Op.CONSUME,
            buffer=BufferRef("s0.rows"),
            shape=(3, 2),
            dtype=DType.INT64,
            stream=Stream.MAIN,
        ),
        ScatterRows(
            step=0,
            op=Op.CONSUME,
            source=BufferRef("s0.rows"),
            index=index,
            target=TABLE,
            stream=Stream.MAIN,
        ),
    ]
    log = EffectLog.from_effects(HEADER, effects)
    assert placeholder_inputs(log).specs(0) == {TABLE: TensorSpec((7, 2), DType.INT64)}
    replay(log, NumpyInterpreter(), before_step=placeholder_inputs(log))


def received_index_log(*, copied: bool = False) -> EffectLog:
    """A gather from the caller's table by an index that arrives over a broadcast.

    `copied`: the receive buffer is first filled from the host, not allocated (the
    broadcast still overwrites the copied values with the sender's).
    """
    index = BufferRef("s0.index")
    made: Effect = (
        host_copy([0, 0], index, op=Op.RECEIVE) if copied else allocated(index, (2,), op=Op.RECEIVE)
    )
    effects: list[Effect] = [
        made,
        Broadcast(
            step=0,
            op=Op.RECEIVE,
            buffer=index,
            shape=(2,),
            dtype=DType.INT32,
            src=1,
            comm=Communicator.PP_RELAY,
            stream=Stream.MAIN,
        ),
        gathered(index, BufferRef("s0.rows")),
    ]
    return EffectLog.from_effects(LogHeader(rank=0, world=Layout(pp=2, dp=1)), effects)


@pytest.mark.parametrize("copied", [False, True])
def test_a_shape_the_log_does_not_give_is_a_typed_error_naming_the_buffer(copied: bool) -> None:
    binder = placeholder_inputs(received_index_log(copied=copied))
    with pytest.raises(InputShapeError) as caught:
        binder.specs(0)
    assert caught.value.buffer == TABLE
    message = str(caught.value)
    assert message.startswith("placeholder_inputs: rank 0's log does not give the shape of ")
    assert "'input.draft_table' at step 0: record #2 (GatherRows) indexes its rows with " in message
    assert "'s0.index', whose values the log does not hold" in message
    assert "bind 'input.draft_table' yourself before step 0" in message
    # In a replay it is raised before the step, with the step named.
    interpreter = NumpyInterpreter()
    with pytest.raises(InputShapeError) as raised:
        replay(received_index_log(copied=copied), interpreter, before_step=binder)
    assert raised.value.__notes__ == [
        "in replay: before_step, before step 0 of rank 0's log, records #0 to #2 "
        "(file lines 2 to 4)"
    ]
    assert interpreter.bound_refs() == frozenset()  # nothing was performed


def test_records_that_disagree_on_an_input_are_a_typed_error() -> None:
    effects: list[Effect] = [
        stacked((NUM_SAMPLED, TOKENS), BufferRef("s0.counts"), op=Op.BROADCAST),
        PadColumns(  # tokens are 2-D here, 1-D to StackRows above
            step=0,
            op=Op.BROADCAST,
            source=TOKENS,
            out=BufferRef("s0.tokens"),
            width=2,
            fill=0,
            stream=Stream.MAIN,
        ),
    ]
    binder = placeholder_inputs(EffectLog.from_effects(HEADER, effects))
    with pytest.raises(InputShapeError, match=r"record #1 \(PadColumns\) needs a dimension more"):
        binder.specs(0)


def test_the_callers_own_bindings_are_left_alone() -> None:
    log = received_index_log()
    binder = placeholder_inputs(log)
    interpreter = NumpyInterpreter()
    mine = np.arange(12, dtype=np.int64).reshape(6, 2)
    interpreter.bind(TABLE, mine)
    binder(0, interpreter)  # no error: the caller bound the table the log cannot size
    assert interpreter.tensor(TABLE) is mine


def test_placeholders_are_fresh_zeros_at_every_step() -> None:
    log = local_log()
    binder = placeholder_inputs(log)
    interpreter = NumpyInterpreter()
    binder(0, interpreter)
    first = interpreter.tensor(TOKENS)
    first[...] = 5  # what a step's in-place effects could leave behind
    binder(0, interpreter)
    again = interpreter.tensor(TOKENS)
    assert again is not first
    assert again.shape == (3, 3)
    assert not again.any()
    binder(1, interpreter)
    assert interpreter.tensor(TOKENS).shape == (1, 3)


def test_into_names_the_interpreter_a_recorder_wraps() -> None:
    log = local_log()
    recorder = Recorder(log.header, NumpyInterpreter())
    with pytest.raises(InvalidInputError, match="the interpreter to bind into is a Recorder") as e:
        replay(log, recorder, before_step=placeholder_inputs(log))
    assert "pass into= the NumpyInterpreter or TorchInterpreter" in str(e.value)
    assert e.value.__notes__[0].startswith("in replay: before_step, before step 0")
    assert recorder.log.records == ()  # refused before the first step was performed
    with pytest.raises(InvalidInputError, match="placeholder_inputs: the interpreter to bind"):
        placeholder_inputs(log, into=recorder)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="placeholder_inputs: log is a str"):
        placeholder_inputs("rank-0000.jsonl")  # type: ignore[arg-type]


def test_a_table_read_by_two_indices_has_rows_past_the_larger() -> None:
    # The first index reaches row 5, the second row 2: the table needs 6 rows.
    wide, narrow = BufferRef("s0.wide"), BufferRef("s0.narrow")
    effects: list[Effect] = [
        host_copy([5], wide),
        host_copy([2], narrow),
        *(gathered(index, BufferRef(f"s0.rows{n}")) for n, index in enumerate((wide, narrow))),
    ]
    log = EffectLog.from_effects(HEADER, effects)
    assert placeholder_inputs(log).specs(0) == {TABLE: TensorSpec((6,), DType.INT32)}
    replay(log, NumpyInterpreter(), before_step=placeholder_inputs(log))


@pytest.mark.parametrize("sizes", [(2, 4), (4, 2)])
def test_an_input_packed_twice_fits_the_smaller_region(sizes: tuple[int, int]) -> None:
    # Packed into a 2-element section and a 4-element one: 2 elements fit both.
    effects: list[Effect] = [
        Pack(
            step=0,
            op=Op.BROADCAST,
            sections=(Section(buffer=NUM_SAMPLED, offset=0, shape=(size,), dtype=DType.INT32),),
            out=BufferRef(f"s0.wire{size}"),
            nbytes=16,
            stream=Stream.MAIN,
        )
        for size in sizes
    ]
    log = EffectLog.from_effects(HEADER, effects)
    assert placeholder_inputs(log).specs(0) == {NUM_SAMPLED: TensorSpec((2,), DType.INT32)}
    replay(log, NumpyInterpreter(), before_step=placeholder_inputs(log))


def test_rows_of_unknown_index_stay_unknown_when_tied_to_another_input() -> None:
    # The table's rows are indexed by received values, then stacked with the counts:
    # one length, which the log does not give (the counts' own length is not said).
    log = received_index_log()
    effects: list[Effect] = [
        *(record.effect for record in log.records),
        stacked((NUM_SAMPLED, TABLE), BufferRef("s0.stacked")),
    ]
    binder = placeholder_inputs(EffectLog.from_effects(log.header, effects))
    with pytest.raises(InputShapeError, match=r"'s0\.index', whose values the log does not hold"):
        binder.specs(0)


def scattered_index_log(*, known: bool) -> EffectLog:
    """A gather from the table by an index a scatter wrote: rows of values the log
    holds (`known`), or of an allocated buffer's, which it does not."""
    slots, index, rows = BufferRef("s0.slots"), BufferRef("s0.index"), BufferRef("s0.rows")
    source: Effect = host_copy([7], rows) if known else allocated(rows, (1,))
    effects: list[Effect] = [
        host_copy([1], slots),
        host_copy([0, 0], index),
        source,
        ScatterRows(
            step=0, op=Op.CONSUME, source=rows, index=slots, target=index, stream=Stream.MAIN
        ),
        gathered(index, BufferRef("s0.drafts")),
    ]
    return EffectLog.from_effects(HEADER, effects)


def test_an_index_a_scatter_wrote_reaches_the_scattered_values() -> None:
    log = scattered_index_log(known=True)
    assert placeholder_inputs(log).specs(0) == {TABLE: TensorSpec((8,), DType.INT32)}
    replay(log, NumpyInterpreter(), before_step=placeholder_inputs(log))


def test_an_index_a_scatter_wrote_with_unknown_values_has_unknown_values() -> None:
    binder = placeholder_inputs(scattered_index_log(known=False))
    with pytest.raises(InputShapeError, match=r"'s0\.index', whose values the log does not hold"):
        binder.specs(0)


def test_a_table_indexed_by_no_rows_needs_none() -> None:
    index = BufferRef("s0.none")
    effects: list[Effect] = [
        host_copy([], index),
        gathered(index, BufferRef("s0.rows")),
    ]
    log = EffectLog.from_effects(HEADER, effects)
    assert placeholder_inputs(log).specs(0) == {TABLE: TensorSpec((0,), DType.INT32)}
    replay(log, NumpyInterpreter(), before_step=placeholder_inputs(log))


def test_a_table_of_fewer_rows_than_its_index_reaches_is_a_typed_error() -> None:
    # The gather reaches row 3; stacked with a 3-element buffer, the table has 3 rows.
    index, three = BufferRef("s0.index"), BufferRef("s0.three")
    effects: list[Effect] = [
        host_copy([3], index),
        allocated(three, (3,)),
        gathered(index, BufferRef("s0.rows")),
        stacked((three, TABLE), BufferRef("s0.stacked")),
    ]
    binder = placeholder_inputs(EffectLog.from_effects(HEADER, effects))
    with pytest.raises(InputShapeError, match="a dimension of size 3 is indexed up to row 3"):
        binder.specs(0)


def test_an_input_of_many_dimensions_keeps_them_all() -> None:
    shape = (1, 2, 1, 3, 1, 2)
    section = Section(buffer=TOKENS, offset=0, shape=shape, dtype=DType.INT64)
    pack = Pack(
        step=0,
        op=Op.BROADCAST,
        sections=(section,),
        out=BufferRef("s0.wire"),
        nbytes=16 * 8,
        stream=Stream.MAIN,
    )
    log = EffectLog.from_effects(HEADER, [pack])
    assert placeholder_inputs(log).specs(0) == {TOKENS: TensorSpec(shape, DType.INT64)}


def packed(buffer: BufferRef, shape: tuple[int, ...], dtype: DType, wire: str) -> Pack:
    """`buffer` packed alone into `wire`, as a section of `shape` and `dtype`."""
    section = Section(buffer=buffer, offset=0, shape=shape, dtype=dtype)
    return Pack(
        step=0,
        op=Op.BROADCAST,
        sections=(section,),
        out=BufferRef(wire),
        nbytes=64,
        stream=Stream.MAIN,
    )


def test_an_input_of_more_dimensions_than_an_array_may_have_is_a_typed_error() -> None:
    # numpy and torch hold at most 64 dimensions: no placeholder can be made.
    log = EffectLog.from_effects(HEADER, [packed(TOKENS, (1,) * 65, DType.INT64, "s0.wire")])
    with pytest.raises(InputShapeError, match="the records give it more than 64 dimensions") as e:
        placeholder_inputs(log).specs(0)
    assert e.value.buffer == TOKENS
    sixty_four = EffectLog.from_effects(HEADER, [packed(TOKENS, (1,) * 64, DType.INT64, "s0.w")])
    assert placeholder_inputs(sixty_four).specs(0)[TOKENS].shape == (1,) * 64


def test_an_input_stacked_with_a_wire_is_as_long_as_its_words() -> None:
    section = Section(buffer=NUM_SAMPLED, offset=0, shape=(2,), dtype=DType.INT32)
    wire = BufferRef("s0.wire")
    effects: list[Effect] = [
        Pack(
            step=0,
            op=Op.BROADCAST,
            sections=(section,),
            out=wire,
            nbytes=4 * 8,
            stream=Stream.MAIN,
        ),
        stacked((wire, TOKENS), BufferRef("s0.both"), op=Op.BROADCAST),
    ]
    log = EffectLog.from_effects(HEADER, effects)
    assert placeholder_inputs(log).specs(0)[TOKENS] == TensorSpec((4,), DType.INT64)
    replay(log, NumpyInterpreter(), before_step=placeholder_inputs(log))


def test_two_runs_of_a_step_that_disagree_on_an_input_are_a_typed_error() -> None:
    # Step 0 in two runs (as an overlapped agreement splits it), stacking the counts
    # with 2 and then 3 elements: no one placeholder fits both.
    effects: list[Effect] = []
    for run, (step, length) in enumerate(((0, 2), (1, 1), (0, 3))):
        made = BufferRef(f"run{run}.made")
        effects += [
            Allocate(
                step=step,
                op=Op.BROADCAST,
                buffer=made,
                shape=(length,),
                dtype=DType.INT32,
                stream=Stream.MAIN,
            ),
            StackRows(
                step=step,
                op=Op.BROADCAST,
                sources=(made, NUM_SAMPLED),
                out=BufferRef(f"run{run}.stacked"),
                stream=Stream.MAIN,
            ),
        ]
    binder = placeholder_inputs(EffectLog.from_effects(HEADER, effects))
    assert binder.specs(1) == {NUM_SAMPLED: TensorSpec((1,), DType.INT32)}
    with pytest.raises(InputShapeError, match="two batches of step 0 need") as caught:
        binder.specs(0)
    assert caught.value.buffer == NUM_SAMPLED


def test_records_that_disagree_on_an_inputs_dimensions_are_a_typed_error() -> None:
    # Packed as 2-D, then stacked with a 1-D buffer: no one shape is both.
    made = BufferRef("s0.made")
    section = Section(buffer=TOKENS, offset=0, shape=(2, 3), dtype=DType.INT32)
    effects: list[Effect] = [
        Pack(
            step=0,
            op=Op.BROADCAST,
            sections=(section,),
            out=BufferRef("s0.wire"),
            nbytes=32,
            stream=Stream.MAIN,
        ),
        allocated(made, (2,), op=Op.BROADCAST),
        stacked((made, TOKENS), BufferRef("s0.stacked"), op=Op.BROADCAST),
    ]
    binder = placeholder_inputs(EffectLog.from_effects(HEADER, effects))
    with pytest.raises(
        InputShapeError,
        match=r"record #2 \(StackRows\) needs another number of dimensions than another record",
    ):
        binder.specs(0)


def test_records_that_disagree_on_an_inputs_length_are_a_typed_error() -> None:
    # Stacked with a 2-element buffer, then with a 3-element one: no one length is both.
    two, three = BufferRef("s0.two"), BufferRef("s0.three")
    effects: list[Effect] = [
        allocated(two, (2,)),
        allocated(three, (3,)),
        stacked((two, NUM_SAMPLED), BufferRef("s0.with_two")),
        stacked((three, NUM_SAMPLED), BufferRef("s0.with_three")),
    ]
    binder = placeholder_inputs(EffectLog.from_effects(HEADER, effects))
    with pytest.raises(InputShapeError) as caught:
        binder.specs(0)
    assert caught.value.buffer == NUM_SAMPLED
    assert str(caught.value).startswith(
        "placeholder_inputs: rank 0's log does not give the shape of input 'input.num_sampled' "
        "at step 0: record #3 (StackRows) needs size 2 where another record needs 3"
    )


def test_an_inputs_dtype_disagreement_is_a_typed_error_for_every_input_tied_to_it() -> None:
    # Packed as int32 and as int64; then stacked with the counts, which share its dtype:
    # the disagreement is the counts' too (it moves with the input when the two are tied).
    effects: list[Effect] = [
        packed(TOKENS, (2,), DType.INT32, "s0.wire32"),
        packed(TOKENS, (2,), DType.INT64, "s0.wire64"),
        stacked((NUM_SAMPLED, TOKENS), BufferRef("s0.stacked"), op=Op.BROADCAST),
    ]
    binder = placeholder_inputs(EffectLog.from_effects(HEADER, effects))
    with pytest.raises(InputShapeError) as caught:
        binder.specs(0)
    assert caught.value.buffer == TOKENS
    assert "record #1 (Pack) needs dtype int64 where another needs int32" in str(caught.value)
    # With the tokens bound by the caller, the counts are still refused.
    interpreter = NumpyInterpreter()
    interpreter.bind(TOKENS, np.zeros(2, np.int32))
    with pytest.raises(InputShapeError, match="needs dtype int64 where another needs int32") as e:
        binder(0, interpreter)
    assert e.value.buffer == NUM_SAMPLED


def test_an_input_longer_than_a_region_it_is_packed_into_is_a_typed_error() -> None:
    # Packed into a 2-element section, but stacked with a 3-element buffer.
    three = BufferRef("s0.three")
    effects: list[Effect] = [
        packed(NUM_SAMPLED, (2,), DType.INT32, "s0.wire"),
        allocated(three, (3,), op=Op.BROADCAST),
        stacked((three, NUM_SAMPLED), BufferRef("s0.stacked"), op=Op.BROADCAST),
    ]
    binder = placeholder_inputs(EffectLog.from_effects(HEADER, effects))
    with pytest.raises(InputShapeError, match="a dimension of size 3 must fit in 2") as caught:
        binder.specs(0)
    assert caught.value.buffer == NUM_SAMPLED


def test_a_header_check_gives_the_header_it_reads_the_expected_ones_layout() -> None:
    # A receiver checks the relay header it is given: [step, requests], int32.
    header = BufferRef("input.header")
    check = CheckHeader(step=0, op=Op.RECEIVE, buffer=header, expected=[0, 0], stream=Stream.MAIN)
    log = EffectLog.from_effects(HEADER, [check])
    assert placeholder_inputs(log).specs(0) == {header: TensorSpec((2,), DType.INT32)}
    replay(log, NumpyInterpreter(), before_step=placeholder_inputs(log))  # zeros: as expected


# -- replay's before_step --------------------------------------------------------------


class Journal:
    """An interpreter noting each batch it performs, beside a before_step noting its calls."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def perform(self, effects: tuple[Effect, ...], /) -> None:
        self.events.append(("perform", effects[0].step))

    def before(self, step: int, interpreter: Interpreter) -> None:
        assert interpreter is self
        self.events.append(("before", step))


def test_before_step_runs_before_each_batch_with_its_step() -> None:
    steps = [0, 0, 1, 1, 1, 0]  # step 0 in two runs: a call before each
    effects = [Release(step=step, op=Op.END_STEP, buffer=TOKENS) for step in steps]
    journal = Journal()
    replay(EffectLog.from_effects(HEADER, effects), journal, before_step=journal.before)
    assert journal.events == [
        ("before", 0),
        ("perform", 0),
        ("before", 1),
        ("perform", 1),
        ("before", 0),
        ("perform", 0),
    ]


@pytest.mark.parametrize("bad", [3, "bind", [print]])
def test_a_before_step_that_is_not_callable_is_refused_before_anything_runs(bad: object) -> None:
    journal = Journal()
    with pytest.raises(InvalidInputError) as caught:
        replay(local_log(), journal, before_step=bad)  # type: ignore[arg-type]
    assert str(caught.value).startswith(f"replay: before_step={bad!r} is ")
    assert "not callable" in str(caught.value)
    assert "Fix: pass a function (step, interpreter) -> None" in str(caught.value)
    assert journal.events == []


def test_replay_refuses_what_is_not_an_effect_log_before_anything_runs() -> None:
    journal = Journal()
    with pytest.raises(InvalidInputError) as caught:
        replay(local_log().records, journal)  # type: ignore[arg-type]
    assert (caught.value.call, caught.value.problem) == ("replay", "log is a tuple")
    assert caught.value.fix == "pass an EffectLog (e.g. from load_log)"
    assert journal.events == []


def test_an_error_in_before_step_keeps_its_type_and_names_the_step() -> None:
    def before(step: int, interpreter: Interpreter) -> None:
        if step == 1:
            raise KeyError("no tokens for this step")

    journal = Journal()
    with pytest.raises(KeyError) as caught:
        replay(local_log(), journal, before_step=before)
    assert caught.value.__notes__ == [
        "in replay: before_step, before step 1 of rank 0's log, records #8 to #15 "
        "(file lines 10 to 17)"
    ]
    assert journal.events == [("perform", 0)]  # step 1 was not performed


# -- the golden logs ---------------------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_golden_logs_run_to_the_end_on_simulated_numpy_ranks(name: str) -> None:
    logs = golden(name)
    binders = [placeholder_inputs(log) for log in logs]

    def program(ctx: SimContext) -> Iterator[tuple[Effect, ...]]:
        for step, effects in batches(logs[ctx.rank]):
            binders[ctx.rank](step, ctx.interpreter)
            yield effects

    run = simulate(GOLDEN_CASES[name].world, program)
    for log, effects, interpreter in zip(logs, run.effects, run.interpreters, strict=True):
        assert_logs_equal(log, EffectLog.from_effects(log.header, effects))
        assert interpreter.lifetime_violations == ()


def replay_rank(name: str, ctx: RankContext) -> tuple[Effect, ...]:
    """This rank's golden log replayed on a checked TorchInterpreter, as recorded."""
    log = load_log(GOLDEN_DIR / name / f"rank-{ctx.rank:04d}.jsonl")
    groups = build_communicators(
        pp_groups=log.header.world.pp_groups,
        dp_groups=log.header.world.dp_groups,
        relay_backend=ctx.backend,
        timeout=ctx.timeout,
    )
    interpreter = TorchInterpreter(device=ctx.device, groups=groups, rank=ctx.rank, checked=True)
    recorder = Recorder(log.header, interpreter)
    replay(log, recorder, before_step=placeholder_inputs(log, into=interpreter))
    return recorder.log.effects


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", CASES)
def test_golden_logs_replay_on_real_gloo_ranks_and_record_themselves(name: str) -> None:
    logs = golden(name)
    recorded = run_ranks(
        functools.partial(replay_rank, name),
        len(logs),
        timeout=datetime.timedelta(seconds=30),
        deadline_s=120.0,
    )
    for log, effects in zip(logs, recorded, strict=True):
        assert_logs_equal(log, EffectLog.from_effects(log.header, effects), ignore_run_id=True)
