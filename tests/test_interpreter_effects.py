"""Synchronize, Pack and Unpack: the same meaning in the numpy and torch interpreters.

Pack copies each source into the top-left corner of its section of a new zeroed int64
buffer; Unpack binds views of the packed bytes (no copy); Synchronize makes the host
wait for a stream (a no-op on torch CPU; the numpy model blocks the host until the
stream has run what it holds). The checks on sections are the shared environment's,
so both interpreters name the same problems with the same words. Then the shared
environment's other refusals, and the numpy reference's own caller-side calls.
"""

from __future__ import annotations

import typing
from typing import Any, TypedDict

import numpy as np
import numpy.typing as npt
import pytest
import torch

from purepp.effects.numpy_interpreter import NumpyInterpreter, PostedCollective, describe_effect
from purepp.effects.torch_interpreter import TorchInterpreter
from purepp.effects.vocabulary import (
    Alias,
    Allocate,
    AllReduce,
    Broadcast,
    BufferRef,
    CheckHeader,
    Communicator,
    CopyHostToDevice,
    DType,
    Effect,
    EventRef,
    ForgetEvent,
    GatherRows,
    NoteDecision,
    Op,
    Pack,
    PadColumns,
    RecordEvent,
    RecordStream,
    Release,
    ScatterRows,
    Section,
    StackRows,
    Stream,
    Synchronize,
    Unpack,
    WaitEvent,
    WaitStream,
    WaitWork,
    WorkRef,
)
from purepp.errors import InterpreterError

CPU = torch.device("cpu")


class Tag(TypedDict):
    step: int
    op: Op


TAG = Tag(step=3, op=Op.RECEIVE)
TOKENS, COUNTS, WIRE = BufferRef("tokens"), BufferRef("counts"), BufferRef("wire")
SEEN_TOKENS, SEEN_COUNTS = BufferRef("seen.tokens"), BufferRef("seen.counts")

TOKENS_VALUES = np.arange(1, 7, dtype=np.int64).reshape(3, 2)  # smaller than its [4, 3] section
COUNTS_VALUES = np.array([[1, 2, 3], [0, 1, 0]], dtype=np.int32)
SECTIONS = (
    Section(buffer=TOKENS, offset=0, shape=(4, 3), dtype=DType.INT64),  # 96 bytes
    Section(buffer=COUNTS, offset=96, shape=(2, 3), dtype=DType.INT32),  # 24 bytes
)
NBYTES = 128
VIEWS = (
    Section(buffer=SEEN_TOKENS, offset=0, shape=(4, 3), dtype=DType.INT64),
    Section(buffer=SEEN_COUNTS, offset=96, shape=(2, 3), dtype=DType.INT32),
)


def pack(sections: tuple[Section, ...] = SECTIONS, nbytes: int = NBYTES) -> Pack:
    return Pack(**TAG, sections=sections, out=WIRE, nbytes=nbytes, stream=Stream.RELAY)


def unpack(sections: tuple[Section, ...] = VIEWS) -> Unpack:
    return Unpack(**TAG, source=WIRE, sections=sections, stream=Stream.RELAY)


class Either:
    """One interpreter of either kind, bound and read through numpy arrays."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.numpy = NumpyInterpreter(rank=0) if kind == "numpy" else None
        self.torch = (
            None
            if kind == "numpy"
            else TorchInterpreter(device=CPU, groups={}, rank=0, checked=kind == "checked")
        )

    def bind(self, ref: BufferRef, values: npt.NDArray[Any]) -> None:
        if self.numpy is not None:
            self.numpy.bind(ref, values)
        else:
            assert self.torch is not None
            self.torch.bind(ref, torch.from_numpy(np.array(values, copy=True)))

    def perform(self, effects: tuple[Effect, ...]) -> None:
        if self.numpy is not None:
            self.numpy.perform(effects)
        else:
            assert self.torch is not None
            self.torch.perform(effects)

    def read(self, ref: BufferRef) -> npt.NDArray[Any]:
        if self.numpy is not None:
            return np.array(self.numpy.tensor(ref))
        assert self.torch is not None
        return np.array(self.torch.tensor(ref).numpy())

    def bound_refs(self) -> frozenset[BufferRef | EventRef | WorkRef]:
        made = self.numpy if self.numpy is not None else self.torch
        assert made is not None
        return made.bound_refs()

    def write(self, ref: BufferRef, values: npt.NDArray[Any]) -> None:
        """Overwrite the live buffer in place (as a later broadcast would)."""
        if self.numpy is not None:
            self.numpy.tensor(ref)[...] = values
        else:
            assert self.torch is not None
            self.torch.tensor(ref).copy_(torch.from_numpy(values))


KINDS = ("numpy", "fast", "checked")


@pytest.fixture(params=KINDS)
def either(request: pytest.FixtureRequest) -> Either:
    kind: str = request.param
    made = Either(kind)
    made.bind(TOKENS, TOKENS_VALUES)
    made.bind(COUNTS, COUNTS_VALUES)
    return made


def expected_wire() -> npt.NDArray[np.int64]:
    wire = np.zeros(NBYTES // 8, dtype=np.int64)
    raw = wire.view(np.uint8)
    tokens = raw[:96].view(np.int64).reshape(4, 3)
    tokens[:3, :2] = TOKENS_VALUES
    raw[96:120].view(np.int32).reshape(2, 3)[...] = COUNTS_VALUES
    return wire


def test_pack_fills_the_top_left_corner_of_each_section_and_zeroes_the_rest(
    either: Either,
) -> None:
    either.perform((pack(),))
    np.testing.assert_array_equal(either.read(WIRE), expected_wire())
    assert either.read(WIRE).dtype == np.int64


def test_unpack_binds_views_of_the_packed_bytes(either: Either) -> None:
    either.perform((pack(), unpack()))
    padded = np.zeros((4, 3), dtype=np.int64)
    padded[:3, :2] = TOKENS_VALUES
    np.testing.assert_array_equal(either.read(SEEN_TOKENS), padded)
    np.testing.assert_array_equal(either.read(SEEN_COUNTS), COUNTS_VALUES)
    assert either.read(SEEN_COUNTS).dtype == np.int32
    # Views, not copies: a later write to the wire (a receive) shows through.
    changed = expected_wire()
    changed[0] = 99
    either.write(WIRE, changed)
    assert either.read(SEEN_TOKENS)[0, 0] == 99


def test_views_keep_their_memory_after_the_source_is_released(either: Either) -> None:
    either.perform((pack(), unpack(), Release(**TAG, buffer=WIRE)))
    np.testing.assert_array_equal(either.read(SEEN_COUNTS), COUNTS_VALUES)
    if either.numpy is not None:
        assert either.numpy.lifetime_violations == ()


def test_unpack_refuses_a_name_already_bound(either: Either) -> None:
    either.perform((pack(),))
    either.bind(SEEN_COUNTS, COUNTS_VALUES)
    with pytest.raises(InterpreterError, match=r"Unpack step=3.*'seen\.counts' is already bound"):
        either.perform((unpack(),))


BAD_PACKS = {
    "misaligned": (
        (Section(buffer=COUNTS, offset=2, shape=(2, 3), dtype=DType.INT32),),
        NBYTES,
        "does not fit aligned in 128 bytes",
    ),
    "past-the-end": (
        (Section(buffer=TOKENS, offset=64, shape=(4, 3), dtype=DType.INT64),),
        NBYTES,
        "does not fit aligned in 128 bytes",
    ),
    "source-too-big": (
        (Section(buffer=TOKENS, offset=0, shape=(2, 2), dtype=DType.INT64),),
        NBYTES,
        r"source 'tokens' is .*int64 \(3, 2\), which does not fit section",
    ),
    "dtype": (
        (Section(buffer=COUNTS, offset=0, shape=(2, 3), dtype=DType.INT64),),
        NBYTES,
        "which does not fit section",
    ),
    "not-16-bytes": (SECTIONS, 120, "pack into a whole number of 16-byte units"),
}


@pytest.mark.parametrize("kind", ["numpy", "checked"])
@pytest.mark.parametrize("case", sorted(BAD_PACKS))
def test_a_pack_that_does_not_fit_is_refused_before_anything_changes(kind: str, case: str) -> None:
    either = Either(kind)
    either.bind(TOKENS, TOKENS_VALUES)
    either.bind(COUNTS, COUNTS_VALUES)
    sections, nbytes, message = BAD_PACKS[case]
    with pytest.raises(InterpreterError, match=message):
        either.perform((pack(sections, nbytes),))
    with pytest.raises(InterpreterError, match="'wire' is not bound"):
        either.read(WIRE)


def test_a_two_dimensional_source_is_unpacked_by_its_bytes(either: Either) -> None:
    either.bind(WIRE, expected_wire().reshape(4, 4))  # the same bytes, as [4, 4] int64
    either.perform((unpack(),))
    np.testing.assert_array_equal(either.read(SEEN_COUNTS), COUNTS_VALUES)


@pytest.mark.parametrize("kind", ["numpy", "checked"])
def test_an_unpack_past_the_source_is_refused(kind: str) -> None:
    either = Either(kind)
    either.bind(WIRE, np.zeros(4, dtype=np.int64))  # 32 bytes
    with pytest.raises(InterpreterError, match="does not fit aligned in 32 bytes"):
        either.perform((unpack(),))


def test_checked_torch_refuses_to_unpack_a_strided_wire() -> None:
    # Views of a strided buffer's bytes are not its elements. (The numpy reference copies
    # a strided array when it is bound, so its wires are always contiguous.)
    interp = TorchInterpreter(device=CPU, groups={}, rank=0, checked=True)
    interp.bind(WIRE, torch.from_numpy(np.repeat(expected_wire(), 2))[::2])
    with pytest.raises(InterpreterError, match=r"Unpack step=3.*'wire' is not contiguous") as e:
        interp.perform((unpack(),))
    assert "unpack a contiguous buffer" in str(e.value)
    assert interp.bound_refs() == frozenset({WIRE})  # no view was bound


def test_synchronize_on_torch_cpu_has_nothing_to_wait_for() -> None:
    interp = TorchInterpreter(device=CPU, groups={}, rank=0, checked=True)
    interp.perform(
        (Synchronize(**TAG, stream=Stream.RELAY), Synchronize(**TAG, stream=Stream.MAIN))
    )
    assert interp.bound_refs() == frozenset()


class _NeverPort:
    """A peer that never answers: collectives stay pending."""

    def post(self, posted: PostedCollective, /) -> None:
        pass

    def reach_head(self, posted: PostedCollective, /) -> None:
        pass


RECEIVE = Broadcast(
    **TAG,
    buffer=WIRE,
    shape=(2,),
    dtype=DType.INT64,
    src=1,
    comm=Communicator.PP_RELAY,
    stream=Stream.RELAY,
)


def host_waiting_on_a_receive() -> NumpyInterpreter:
    """A numpy host blocked by a Synchronize of the relay stream, whose receive never lands."""
    interp = NumpyInterpreter(rank=0, port=_NeverPort())
    allocate = Allocate(**TAG, buffer=WIRE, shape=(2,), dtype=DType.INT64, stream=Stream.RELAY)
    interp.perform((allocate, RECEIVE))
    assert not interp.host_blocked()  # the relay stream waits, the host runs on
    with pytest.raises(InterpreterError, match=r"the host waits on synchronize\(relay\)"):
        interp.perform((Synchronize(**TAG, stream=Stream.RELAY),))
    return interp


def test_synchronize_makes_the_numpy_host_wait_for_the_stream() -> None:
    interp = host_waiting_on_a_receive()
    assert interp.host_blocked()
    main = next(stall for stall in interp.stalls() if stall.stream is Stream.MAIN)
    assert main.culprit is not None
    assert main.culprit.effect == RECEIVE  # what the host really waits for


def test_a_blocked_numpy_host_issues_nothing_more() -> None:
    # A real host would be stuck in the Synchronize: nothing after it can be issued.
    interp = host_waiting_on_a_receive()
    later = Allocate(**TAG, buffer=TOKENS, shape=(2,), dtype=DType.INT64, stream=Stream.MAIN)
    with pytest.raises(
        InterpreterError, match=r"Allocate step=3.*still waiting on synchronize\(relay\)"
    ) as raised:
        interp.perform((later,))
    assert "see host_blocked()" in str(raised.value)
    assert interp.bound_refs() == frozenset({WIRE})


# ---- the shared environment's refusals, in every interpreter ------------------------------


def test_an_event_is_recorded_once_and_only_a_recorded_one_is_forgotten(either: Either) -> None:
    event = EventRef("received")
    record = RecordEvent(**TAG, stream=Stream.RELAY, event=event)
    either.perform((record,))
    with pytest.raises(InterpreterError, match=r"RecordEvent step=3.*'received' is already"):
        either.perform((record,))
    assert event in either.bound_refs()  # the first record stands
    forget = ForgetEvent(**TAG, event=EventRef("never"))
    with pytest.raises(InterpreterError, match=r"ForgetEvent step=3.*'never' is not recorded") as e:
        either.perform((forget,))
    assert "forget only an event that was recorded" in str(e.value)
    assert event in either.bound_refs()


@pytest.mark.parametrize("kind", ["numpy", "checked"])
def test_an_allocation_of_a_negative_size_is_refused(kind: str) -> None:
    either = Either(kind)
    allocate = Allocate(**TAG, buffer=WIRE, shape=(2, -1), dtype=DType.INT64, stream=Stream.MAIN)
    with pytest.raises(InterpreterError, match=r"Allocate step=3.*shape \(2, -1\) of 'wire'") as e:
        either.perform((allocate,))
    assert "use sizes >= 0" in str(e.value)
    assert either.bound_refs() == frozenset()


@pytest.mark.parametrize("kind", ["numpy", "checked"])
def test_a_gather_from_a_scalar_is_refused(kind: str) -> None:
    either = Either(kind)
    either.bind(TOKENS, np.array(5, dtype=np.int64))
    either.bind(COUNTS, np.array([0], dtype=np.int32))
    gather = GatherRows(**TAG, source=TOKENS, index=COUNTS, out=WIRE, stream=Stream.MAIN)
    with pytest.raises(InterpreterError, match=r"GatherRows step=3.*'tokens' is a scalar") as e:
        either.perform((gather,))
    assert "gather from a 1-D+ buffer" in str(e.value)
    assert WIRE not in either.bound_refs()


# ---- the numpy reference's caller-side calls ----------------------------------------------


def test_the_numpy_reference_scatters_into_a_strided_array_in_place() -> None:
    # The caller's array is bound itself, whatever its strides: a scatter writes the
    # caller's memory, as the torch interpreter writes a strided tensor in place.
    caller = np.zeros((4, 6), dtype=np.int64)
    target = caller[:, ::2]  # every other column: not contiguous
    interp = NumpyInterpreter(rank=0)
    interp.bind(TOKENS, np.ones((2, 3), dtype=np.int64))
    interp.bind(COUNTS, np.array([0, 2], dtype=np.int32))
    interp.bind(WIRE, target)
    scatter = ScatterRows(**TAG, source=TOKENS, index=COUNTS, target=WIRE, stream=Stream.MAIN)
    interp.perform((scatter,))
    assert interp.tensor(WIRE) is target
    assert target.tolist() == [[1, 1, 1], [0, 0, 0], [1, 1, 1], [0, 0, 0]]
    assert caller[:, 1::2].sum() == 0  # the columns between are the caller's own still


def test_the_numpy_reference_refuses_to_scatter_into_a_read_only_array() -> None:
    # A scatter into a copy would leave the caller's array as it was, silently.
    caller = np.zeros((4, 3), dtype=np.int64)
    caller.flags.writeable = False
    interp = NumpyInterpreter(rank=0)
    interp.bind(TOKENS, np.ones((2, 3), dtype=np.int64))
    interp.bind(COUNTS, np.array([0, 2], dtype=np.int32))
    interp.bind(WIRE, caller)
    scatter = ScatterRows(**TAG, source=TOKENS, index=COUNTS, target=WIRE, stream=Stream.MAIN)
    with pytest.raises(InterpreterError, match=r"cannot take rows apart \(read-only\)"):
        interp.perform((scatter,))
    assert not caller.any()


def test_the_numpy_reference_resolves_refs_by_attribute_path_to_live_arrays() -> None:
    interp = NumpyInterpreter(rank=0)
    tokens, counts = TOKENS_VALUES.copy(), COUNTS_VALUES.copy()
    interp.bind(TOKENS, tokens)
    interp.bind(COUNTS, counts)
    resolved = interp.resolve((TOKENS, [COUNTS, 7]))
    assert set(resolved) == {"[0]", "[1][0]"}
    assert resolved["[0]"] is tokens  # the live arrays: in-place effects show through
    assert resolved["[1][0]"] is counts


def test_event_completed_names_an_event_that_is_not_recorded() -> None:
    interp = NumpyInterpreter(rank=0)
    with pytest.raises(
        InterpreterError, match=r"^NumpyInterpreter\.event_completed: event 'ghost' is not"
    ) as raised:
        interp.event_completed(EventRef("ghost"))
    assert "ask about an event that is recorded" in str(raised.value)


WORK = WorkRef("agree")
# One effect of every kind, and how reports describe it.
DESCRIBED: list[tuple[Effect, str]] = [
    (
        WaitStream(**TAG, stream=Stream.RELAY, waits_for=Stream.MAIN),
        "wait_stream(relay waits for main)",
    ),
    (
        RecordEvent(**TAG, stream=Stream.RELAY, event=EventRef("e")),
        "record_event('e' on relay)",
    ),
    (WaitEvent(**TAG, stream=Stream.MAIN, event=EventRef("e")), "wait_event('e' on main)"),
    (ForgetEvent(**TAG, event=EventRef("e")), "forget_event('e')"),
    (
        Allocate(**TAG, buffer=WIRE, shape=(2,), dtype=DType.INT64, stream=Stream.RELAY),
        "allocate('wire')",
    ),
    (
        CopyHostToDevice(**TAG, source=np.zeros(2, np.int32), buffer=WIRE, stream=Stream.MAIN),
        "copy_host_to_device('wire')",
    ),
    (RECEIVE, "broadcast('wire' over pp_relay)"),
    (
        CheckHeader(**TAG, buffer=WIRE, expected=np.array([3, 2], np.int32), stream=Stream.RELAY),
        "check_header('wire' == [3, 2])",
    ),
    (
        AllReduce(
            **TAG,
            contribution=np.zeros((5, 1), np.int32),
            result=COUNTS,
            comm=Communicator.DP_CPU,
            work=WORK,
        ),
        "all_reduce('counts' over dp_cpu, work 'agree')",
    ),
    (WaitWork(**TAG, work=WORK), "wait_work('agree')"),
    (
        NoteDecision(
            **TAG,
            table=COUNTS,
            comm=Communicator.DP_CPU,
            cg_mode="PIECEWISE",
            num_ubatches=1,
            num_tokens_across_dp=np.array([4, 4], np.int32),
            uniform_token_count=None,
            eager=False,
            num_reqs=2,
            max_query_len=None,
        ),
        "note_decision('counts': PIECEWISE)",
    ),
    (RecordStream(**TAG, buffer=WIRE, stream=Stream.MAIN), "record_stream('wire' on main)"),
    (Release(**TAG, buffer=WIRE), "release('wire')"),
    (Alias(**TAG, source=TOKENS, out=WIRE), "alias('tokens' as 'wire')"),
    (
        PadColumns(**TAG, source=TOKENS, out=WIRE, width=4, fill=0, stream=Stream.RELAY),
        "pad_columns('tokens' -> 'wire')",
    ),
    (
        StackRows(**TAG, sources=(TOKENS, COUNTS), out=WIRE, stream=Stream.RELAY),
        "stack_rows(-> 'wire')",
    ),
    (
        GatherRows(**TAG, source=TOKENS, index=COUNTS, out=WIRE, stream=Stream.MAIN),
        "gather_rows('tokens' -> 'wire')",
    ),
    (
        ScatterRows(**TAG, source=TOKENS, index=COUNTS, target=WIRE, stream=Stream.MAIN),
        "scatter_rows('tokens' -> 'wire')",
    ),
    (Synchronize(**TAG, stream=Stream.RELAY), "synchronize(relay)"),
    (pack(), "pack('tokens', 'counts' -> 'wire')"),
    (unpack(), "unpack('wire' -> 'seen.tokens', 'seen.counts')"),
]


def test_describe_effect_names_every_kind_and_the_names_it_involves() -> None:
    # What stall, deadlock and divergence reports show for an effect.
    assert {type(effect) for effect, _ in DESCRIBED} == set(typing.get_args(Effect))
    for effect, described in DESCRIBED:
        assert describe_effect(effect) == described
