"""Review of a7d777d (declared rows: `Section.source_rows`, `ScatterRows.target_rows`).

Each test states the correct behaviour and fails on a7d777d for the reason its
docstring gives.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from purepp.batch import BatchFacts
from purepp.effects.log import EffectLog, LogHeader, dump_log, load_log
from purepp.effects.torch_interpreter import TorchInterpreter
from purepp.effects.vocabulary import (
    BufferRef,
    DType,
    Effect,
    Op,
    Pack,
    ScatterRows,
    Section,
    Stream,
    TensorSpec,
)
from purepp.errors import InterpreterError, LogFormatError
from purepp.layout import Layout
from purepp.relay import RelayConfig, Wire, broadcast_sampled, default_buckets, init_relay

CPU = torch.device("cpu")
HEADER = LogHeader(rank=0, world=Layout(pp=1, dp=1))
# Nineteen digits, within int64, and nineteen digits past it: the reader's template key
# blanks digits 1-9 alike, so a line holding the second shares the first's key.
IN_RANGE = 1_111_111_111_111_111_111
PAST_INT64 = "9999999999999999999"


def _scatter(step: int, rows: int) -> ScatterRows:
    return ScatterRows(
        step=step,
        op=Op.CONSUME,
        source=BufferRef("source"),
        index=BufferRef("index"),
        target=BufferRef("table"),
        stream=Stream.MAIN,
        target_rows=rows,
    )


def _pack(step: int, rows: int) -> Pack:
    section = Section(
        buffer=BufferRef("source"), offset=0, shape=(4, 2), dtype=DType.INT64, source_rows=rows
    )
    return Pack(
        step=step,
        op=Op.BROADCAST,
        sections=(section,),
        out=BufferRef("wire"),
        nbytes=64,
        stream=Stream.MAIN,
    )


@pytest.mark.parametrize(
    ("make", "field"),
    [(_scatter, "target_rows"), (_pack, "source_rows")],
    ids=["target_rows", "source_rows"],
)
def test_a_declared_bound_past_int64_is_refused_on_every_line_of_a_log(
    tmp_path: Path, make: Callable[[int, int], Effect], field: str
) -> None:
    """What is wrong: a declared bound past int64 (`9999999999999999999`) is refused
    (LogFormatError) on a log's first line of its shape, but accepted silently on a
    later line whose only difference from a validated one is its digits: the reader's
    fast path (logfile.py `_from_template` -> `_converter.build_checked_effect`, whose
    `_fast_attrs_builder` trusts ints) never range-checks it, and the template key
    (logfile.py `_BLANK_DIGITS`) makes every 19-digit number without zeros one key. So
    `load_log` returns a ScatterRows/Section holding a value no valid log holds.
    (The mechanism predates a7d777d and reaches every int field; the new fields
    inherit it.)

    Correct: the reader refuses the bad value as LogFormatError wherever it appears,
    exactly as it does when the same line is read first."""
    effects: tuple[Effect, ...] = (make(0, IN_RANGE), make(1, IN_RANGE))
    path = tmp_path / "rank-0000.jsonl"
    dump_log(EffectLog.from_effects(HEADER, effects), path)
    lines = path.read_text().splitlines(keepends=True)
    spelled = f'"{field}": {IN_RANGE}'
    assert spelled in lines[2]
    # The control: the same value on the first line of its shape is refused.
    first = tmp_path / "first" / "rank-0000.jsonl"
    first.parent.mkdir()
    first.write_text(lines[0] + lines[1].replace(spelled, f'"{field}": {PAST_INT64}'))
    with pytest.raises(LogFormatError, match=field):
        load_log(first)
    # The finding: on the second line it reads back as a value past int64.
    lines[2] = lines[2].replace(spelled, f'"{field}": {PAST_INT64}')
    path.write_text("".join(lines))
    with pytest.raises(LogFormatError, match=field):
        load_log(path)


def test_a_short_slot_mapping_is_named_as_the_input_to_fix() -> None:
    """What is wrong: on the packed and fixed wires, a sender whose slot mapping
    (`config.inputs.idx_mapping`) is a row short of the batch is refused (good), but the
    error names the relay's own gathered buffer `relay.step0.send_draft_tokens` and its
    fix says to "bind 'relay.step0.send_draft_tokens' with 3 rows": a buffer the relay
    makes (GatherRows) and the caller cannot bind. The short input is never named.
    Cause: relay.py `_send_packed` declares `source_rows=n` on the gathered drafts'
    section, and `_environment.check_pack` names that section's buffer.

    Correct: the error names the caller's input that is short, `relay.input.idx_mapping`
    (e.g. "bind 'relay.input.idx_mapping' with 3 entries, one per batch row")."""
    slots = [5, 1, 6]
    n, spec, max_reqs = len(slots), 1, 8
    config = RelayConfig(
        pp_size=2,
        stage=1,
        last_rank=0,
        max_num_reqs=max_reqs,
        num_speculative_steps=spec,
        wire=Wire.FIXED,
        buckets=default_buckets(max_reqs),
    )
    names = config.inputs
    batch = BatchFacts(
        idx_mapping=np.array(slots, dtype=np.int32),
        num_computed_tokens=np.full(n, 10, dtype=np.int32),
        num_scheduled_tokens=np.ones(n, dtype=np.int32),
        prefill_len=np.full(n, 4, dtype=np.int32),
    )
    interp = TorchInterpreter(device=CPU, groups={}, rank=0)
    interp.bind(names.sampled_tokens, torch.ones((n, spec + 1), dtype=torch.int64))
    interp.bind(names.num_sampled, torch.ones(n, dtype=torch.int32))
    interp.bind(names.num_rejected, torch.zeros(n, dtype=torch.int32))
    interp.bind(names.idx_mapping, torch.tensor(slots[:-1], dtype=torch.int32))  # short
    interp.bind(names.draft_table, torch.zeros((max_reqs, spec), dtype=torch.int64))
    sent = broadcast_sampled(
        config,
        init_relay(config),
        batch,
        TensorSpec((n, spec + 1), DType.INT64),
        TensorSpec((max_reqs, spec), DType.INT64),
    )
    with pytest.raises(InterpreterError) as raised:
        interp.perform(sent.effects)
    assert names.idx_mapping.name in str(raised.value)
