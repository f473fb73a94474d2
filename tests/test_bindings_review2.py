"""A second review of what a caller binds: unusual but plausible tensors and arrays.

Each test states one behaviour. The right outcome for a caller's input is the seed's
result (the same tokens and drafts delivered) or a typed `PureppError` naming the call,
the value and the fix, in every interpreter mode (numpy, torch eager, torch checked) and
on every wire: never silently other values, never a raw torch error. The tests that
fail on the code as reviewed are bugs the review found; their docstrings say what is
correct and why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
import torch.distributed as dist

from purepp.batch import BatchFacts
from purepp.effects.io import NumpyIO, TorchIO
from purepp.effects.numpy_interpreter import NumpyInterpreter
from purepp.effects.torch_interpreter import TorchInterpreter
from purepp.effects.vocabulary import BufferRef, Communicator, DType, TensorSpec
from purepp.errors import PureppError
from purepp.rank import RankConfig, RankDriver, ShapeFacts, init_rank
from purepp.relay import (
    PendingReceive,
    RelayConfig,
    Wire,
    broadcast_drafts,
    broadcast_sampled,
    init_relay,
)

CPU = torch.device("cpu")
Array = npt.NDArray[Any]
Groups = dict[Communicator, dist.ProcessGroup]
Interp = NumpyInterpreter | TorchInterpreter
Inputs = dict[str, torch.Tensor]
Spoil = Callable[[Inputs], Inputs]
MODES = ["numpy", "eager", "checked"]
SLOTS = 4  # max_num_reqs
SPEC = 2  # draft tokens per request


def make_interpreter(mode: str, groups: Groups) -> Interp:
    if mode == "numpy":
        return NumpyInterpreter(rank=0)
    return TorchInterpreter(device=CPU, groups=groups, rank=0, checked=mode == "checked")


def bind(interp: Interp, ref: BufferRef, tensor: torch.Tensor) -> None:
    """Bind `tensor` (a numpy interpreter gets the same values as an array)."""
    if isinstance(interp, NumpyInterpreter):
        interp.bind(ref, tensor.numpy())
    else:
        interp.bind(ref, tensor)


def decode_batch(slots: list[int]) -> BatchFacts:
    """A batch of decode rows (every row samples) on `slots`."""
    n = len(slots)
    return BatchFacts(
        idx_mapping=np.array(slots, dtype=np.int32),
        num_computed_tokens=np.full(n, 10, dtype=np.int32),
        num_scheduled_tokens=np.ones(n, dtype=np.int32),
        prefill_len=np.full(n, 4, dtype=np.int32),
    )


# ---- the last stage: what it binds for a send ------------------------------------------------


def sender(wire: Wire, spec: int) -> RelayConfig:
    """The last stage on global rank 0 of a one-rank world: only the sender is observed."""
    buckets = (1, 2, 4) if wire is Wire.FIXED else ()
    return RelayConfig(
        pp_size=2,
        stage=1,
        last_rank=0,
        max_num_reqs=SLOTS,
        num_speculative_steps=spec,
        wire=wire,
        buckets=buckets,
    )


def good_inputs(spec: int) -> Inputs:
    """A 3-row step's sampler outputs, the draft table and the slot mapping, as the relay
    expects them: tokens int64 [3, spec + 1], counts int32 [3], drafts int64 [4, spec]."""
    return {
        "tokens": torch.arange(3 * (spec + 1), dtype=torch.int64).reshape(3, spec + 1) + 100,
        "num_sampled": torch.tensor([1, 2, 3], dtype=torch.int32),
        "num_rejected": torch.tensor([0, 1, 0], dtype=torch.int32),
        "draft_table": torch.arange(SLOTS * spec, dtype=torch.int64).reshape(SLOTS, spec) + 500,
        "idx_mapping": torch.tensor([0, 1, 2], dtype=torch.int32),
    }


def send(interp: Interp, wire: Wire, spec: int, inputs: Inputs) -> None:
    """Bind `inputs` and perform one step's send of a 3-row batch. The specs the pure step
    gets describe the relay's own shapes (int64 [3, spec + 1], [4, spec]), as a caller
    that passes its batch's shapes would."""
    config = sender(wire, spec)
    names = config.inputs
    for key, ref in (
        ("tokens", names.sampled_tokens),
        ("num_sampled", names.num_sampled),
        ("num_rejected", names.num_rejected),
    ):
        bind(interp, ref, inputs[key])
    if spec:
        bind(interp, names.draft_table, inputs["draft_table"])
        bind(interp, names.idx_mapping, inputs["idx_mapping"])
    batch = decode_batch([0, 1, 2])
    tokens = TensorSpec((3, spec + 1), DType.INT64)
    drafts = TensorSpec((SLOTS, spec), DType.INT64) if spec else None
    if wire is Wire.SEED:
        sent = broadcast_sampled(config, init_relay(config), batch, tokens)
        interp.perform(sent.effects)
        if drafts is not None:
            interp.perform(broadcast_drafts(config, sent.state, batch, drafts).effects)
    else:
        interp.perform(broadcast_sampled(config, init_relay(config), batch, tokens, drafts).effects)


def fewer_counts(inputs: Inputs) -> Inputs:
    """Both counts for 2 of the batch's 3 rows (a persistent buffer sliced to n - 1)."""
    counts = {key: inputs[key][:2] for key in ("num_sampled", "num_rejected")}
    return {**inputs, **counts}


def fewer_slots(inputs: Inputs) -> Inputs:
    """A slot mapping for 2 of the batch's 3 rows: the drafts are gathered for 2 rows."""
    return {**inputs, "idx_mapping": inputs["idx_mapping"][:2]}


SHORT_INPUTS: dict[str, tuple[int, Spoil]] = {
    "counts for n-1 rows": (0, fewer_counts),
    "a slot mapping of n-1 rows": (SPEC, fewer_slots),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("short", list(SHORT_INPUTS))
def test_the_seed_wire_refuses_inputs_with_fewer_rows_than_the_batch(
    groups: Groups, mode: str, short: str
) -> None:
    """The control of the test below: on the seed's wire, counts (or a slot mapping) for
    fewer rows than the batch are refused with a typed error, in every mode: the counts
    by the broadcast's wire check, the slot mapping by the gather that declares its
    entries, naming it."""
    spec, shorten = SHORT_INPUTS[short]
    says = "relay.input.idx_mapping' has shape" if short.startswith("a slot") else "wire"
    with pytest.raises(PureppError, match=says):
        send(make_interpreter(mode, groups), Wire.SEED, spec, shorten(good_inputs(spec)))


def _too_wide(inputs: Inputs) -> Inputs:
    tokens = inputs["tokens"]
    return {**inputs, "tokens": torch.cat([tokens, tokens[:, :1] + 50], dim=1)}


@pytest.mark.parametrize("spec", [0, SPEC])
def test_eager_refuses_sampled_tokens_wider_than_the_wire_as_checked_and_numpy_do(
    groups: Groups, spec: int
) -> None:
    """Behaviour: a seed-wire send of sampled tokens bound spec + 2 wide (one column past
    the wire) is refused by eager mode, as checked mode and numpy refuse it
    ("cannot pad to width"), and as the packed wires refuse it in every mode.

    Eager's PadColumns is `F.pad(source, (0, width - k))`: with k > width the pad is
    negative and crops the last column, so eager sends a batch whose last token column
    is silently gone while the other modes raise. Fix: in `pad_columns` (or the eager
    PadColumns handler) refuse `source.dim() != 2 or source.shape[1] > width` with
    `check_pad`'s error, a host-side shape check that costs no sync."""
    for mode in ("checked", "numpy"):  # the modes that refuse, as the eager one should
        with pytest.raises(PureppError, match="cannot pad"):
            send(make_interpreter(mode, groups), Wire.SEED, spec, _too_wide(good_inputs(spec)))
    with pytest.raises(PureppError, match="cannot pad"):
        send(make_interpreter("eager", groups), Wire.SEED, spec, _too_wide(good_inputs(spec)))


RAW_IN_EAGER: dict[str, tuple[int, Spoil]] = {
    # torch.stack: "stack expects each tensor to be equal size"
    "num_sampled of n-1 rows": (0, lambda d: {**d, "num_sampled": d["num_sampled"][:2]}),
    # pad_columns reads source.shape[1]: IndexError
    "1-D sampled tokens": (0, lambda d: {**d, "tokens": d["tokens"][:, 0].contiguous()}),
    # index_select: "index out of range in self"
    "a slot past the draft table": (
        SPEC,
        lambda d: {**d, "idx_mapping": torch.tensor([0, 1, SLOTS], dtype=torch.int32)},
    ),
    # index_select: "Expected dtype int32 or int64 for index"
    "a uint8 slot mapping": (
        SPEC,
        lambda d: {**d, "idx_mapping": d["idx_mapping"].to(torch.uint8)},
    ),
}


@pytest.mark.parametrize("case", list(RAW_IN_EAGER))
def test_eager_refuses_a_bad_caller_input_with_checked_modes_typed_error(
    groups: Groups, case: str
) -> None:
    """Behaviour: a caller's input that checked mode refuses with a typed error (counts of
    unequal lengths, 1-D tokens, a slot outside a host draft table, a uint8 slot mapping)
    is refused by eager mode with a PureppError too, not a raw torch error.

    Eager trusts the layouts of the buffers the pure steps made, and lets torch raise on
    an impossible one; but these are the caller's tensors, which no pure step described
    (DESIGN.md, "Errors are typed"; the last review fixed the same gap in eager Pack).
    Fix: in the eager handlers of StackRows, PadColumns and GatherRows, catch torch's
    RuntimeError/IndexError and re-raise checked mode's error (`_validate(effect)`), as
    `_pack` now does; the happy path costs nothing."""
    spec, spoil = RAW_IN_EAGER[case]
    with pytest.raises(PureppError):
        send(make_interpreter("checked", groups), Wire.SEED, spec, spoil(good_inputs(spec)))
    with pytest.raises(PureppError):
        send(make_interpreter("eager", groups), Wire.SEED, spec, spoil(good_inputs(spec)))


# ---- the other stages: the draft table the consume writes into --------------------------------

ROW_SLOTS = [2, 0, 3]  # the received batch's rows -> slots
DRAFTS = [[1000, 1001], [1010, 1011], [1020, 1021]]  # drafts received for those rows


def receiver(wire: Wire) -> RelayConfig:
    """Stage 0 on global rank 0, its last stage also rank 0: a one-rank world, where a
    receive is a broadcast from itself and the test writes what came into the buffers."""
    buckets = (1, 2, 4) if wire is Wire.FIXED else ()
    return RelayConfig(
        pp_size=2,
        stage=0,
        last_rank=0,
        max_num_reqs=SLOTS,
        num_speculative_steps=SPEC,
        wire=wire,
        buckets=buckets,
    )


def put(interp: Interp, ref: BufferRef, values: list[Any]) -> None:
    """Write `values` into the received buffer `ref` (what the last stage would have sent)."""
    if isinstance(interp, NumpyInterpreter):
        array = interp.tensor(ref)
        array[...] = np.asarray(values, dtype=array.dtype).reshape(array.shape)
    else:
        tensor = interp.tensor(ref)
        tensor.copy_(torch.tensor(values, dtype=tensor.dtype).reshape(*tensor.shape))


def fill_received(interp: Interp, entry: PendingReceive) -> None:
    """Step 0's entry holds tokens, counts and DRAFTS for its rows (fixed wire: padding 0)."""
    pad = entry.rows - len(DRAFTS)
    assert entry.draft_tokens is not None
    put(interp, entry.draft_tokens, DRAFTS + [[0] * SPEC] * pad)
    put(interp, entry.sampled_tokens, [[7] * (SPEC + 1)] * entry.rows)
    put(interp, entry.num_sampled, [1] * entry.rows)
    put(interp, entry.num_rejected, [0] * entry.rows)


def expected_table(freed: tuple[int, ...]) -> list[list[int]]:
    """The draft table after the consume: each kept row's drafts at its slot."""
    table = [[0] * SPEC for _ in range(SLOTS)]
    for slot, drafts in zip(ROW_SLOTS, DRAFTS, strict=True):
        if slot not in freed:
            table[slot] = drafts
    return table


def drive_receiver(
    interp: Interp, table: torch.Tensor | Array, wire: Wire, freed: tuple[int, ...] = ()
) -> None:
    """Three steps of a stage-0 `RankDriver` (ring depth 2): step 0 receives ROW_SLOTS,
    step 1 frees `freed`, step 2 consumes step 0's entry into the bound draft table."""
    relay = receiver(wire)
    config = RankConfig(relay=relay)
    if isinstance(interp, NumpyInterpreter):
        assert isinstance(table, np.ndarray)
        interp.bind(relay.inputs.draft_table, table)
        driver: RankDriver[Any] = RankDriver(config, interp, NumpyIO(interp))
    else:
        assert isinstance(table, torch.Tensor)
        interp.bind(relay.inputs.draft_table, table)
        driver = RankDriver(config, interp, TorchIO(interp))
    state = init_rank(config)
    shape = ShapeFacts(num_tokens=len(ROW_SLOTS), need_eager=True)
    for step in range(3):
        begun = driver.begin(state)
        frees = list(freed) if step == 1 else []
        state = driver.finish(driver.agree(begun, decode_batch(ROW_SLOTS), shape, freed=frees))
        if step == 0:
            entry = state.relay.ring[-1]
            assert entry is not None
            fill_received(interp, entry)


def test_a_contiguous_draft_table_receives_the_kept_drafts_in_every_mode(groups: Groups) -> None:
    """The control of the tests below: a C-contiguous zeroed int64 [4, 2] draft table
    holds each kept row's drafts at its slot after the consume, in every mode."""
    for mode in MODES:
        interp = make_interpreter(mode, groups)
        if isinstance(interp, NumpyInterpreter):
            array = np.zeros((SLOTS, SPEC), dtype=np.int64)
            drive_receiver(interp, array, Wire.SEED)
            assert array.tolist() == expected_table(())
        else:
            tensor = torch.zeros((SLOTS, SPEC), dtype=torch.int64)
            drive_receiver(interp, tensor, Wire.SEED)
            assert tensor.tolist() == expected_table(())


NUMPY_TABLES: dict[str, Callable[[], Array]] = {
    "transposed (writable, Fortran order)": lambda: np.zeros((SPEC, SLOTS), dtype=np.int64).T,
    "a column slice": lambda: np.zeros((SLOTS, 2 * SPEC), dtype=np.int64)[:, :SPEC],
    "read-only": lambda: np.zeros((SLOTS, SPEC), dtype=np.int64).view(),
}


@pytest.mark.parametrize("kind", list(NUMPY_TABLES))
def test_a_strided_or_read_only_numpy_draft_table_gets_the_drafts_or_a_typed_error(
    kind: str,
) -> None:
    """Behaviour: a stage that binds its numpy draft table strided (transposed, or a column
    slice) or read-only either finds the kept drafts in that array after the consume, as
    the torch interpreter writes them into a strided tensor in place, or gets a typed
    error saying the table cannot be written.

    README: bind the table under `draft_table`; "the consume writes the kept rows'
    drafts into" it, and the caller embeds from it. `NumpyInterpreter.bind` binds a copy
    of any array that is not writable and C-contiguous, so the ScatterRows writes into
    that private copy: the caller's table stays zeros and the stage embeds token 0 as
    every draft (FF2), silently, where the torch interpreter delivers. Fix: bind a
    writable strided array itself (numpy's indexed assignment writes strided views in
    place); refuse a read-only one as a ScatterRows target (or at bind) with a typed
    error."""
    table = NUMPY_TABLES[kind]()
    if kind == "read-only":
        table.flags.writeable = False
    interp = NumpyInterpreter(rank=0)
    try:
        drive_receiver(interp, table, Wire.SEED)
    except PureppError:
        return
    assert table.tolist() == expected_table(())


# torch only warns (a deprecation) before writing through the stride 0: production sees
# no error at all, so neither does this test.
@pytest.mark.filterwarnings("ignore:Use of index_put_ on expanded tensors:UserWarning")
@pytest.mark.parametrize("mode", ["eager", "checked"])
@pytest.mark.parametrize(
    ("wire", "freed"),
    [(Wire.SEED, ()), (Wire.SEED, (0,)), (Wire.FIXED, ())],
    ids=["seed", "seed, a slot freed", "fixed"],
)
def test_an_expanded_torch_draft_table_is_refused_with_a_typed_error(
    groups: Groups, mode: str, wire: Wire, freed: tuple[int, ...]
) -> None:
    """Behaviour: a torch draft table bound as a stride-0 expansion (`torch.zeros(1, 2).
    expand(4, 2)`: shape and dtype right, one row of memory) is refused with a typed
    error before the consume writes into it.

    `finish` checks only its shape and dtype. Without a skipped row the scatter is one
    `index_put_`, which writes every slot's drafts into the one shared row: the table
    then reads [1020, 1021] for every slot (drafts of one request handed to all, with
    only a torch deprecation warning). With a skipped row (a freed slot, or the fixed
    wire's padding rows) `target.copy_` raises a raw RuntimeError mid-consume, after the
    step's event was consumed. Checked mode checks neither. Fix: refuse a draft table
    with internal overlap (a stride 0 on a dimension of size > 1) in `finish`'s
    `_check_draft_table` and in ScatterRows' check (eager: before the write)."""
    interp = make_interpreter(mode, groups)
    table = torch.zeros(SPEC, dtype=torch.int64).as_strided((SLOTS, SPEC), (0, 1), 0)
    with pytest.raises(PureppError):
        drive_receiver(interp, table, wire, freed)
