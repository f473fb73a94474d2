"""Synchronize, Pack and Unpack: the same meaning in the numpy and torch interpreters.

Pack copies each source into the top-left corner of its section of a new zeroed int64
buffer; Unpack binds views of the packed bytes (no copy); Synchronize makes the host
wait for a stream (a no-op on torch CPU; the numpy model blocks the host until the
stream has run what it holds). The checks on sections are the shared environment's,
so both interpreters name the same problems with the same words.
"""

from __future__ import annotations

from typing import Any, TypedDict

import numpy as np
import numpy.typing as npt
import pytest
import torch

from purepp.effects.numpy_interpreter import NumpyInterpreter, PostedCollective
from purepp.effects.torch_interpreter import TorchInterpreter
from purepp.effects.vocabulary import (
    Allocate,
    Broadcast,
    BufferRef,
    Communicator,
    DType,
    Effect,
    Op,
    Pack,
    Release,
    Section,
    Stream,
    Synchronize,
    Unpack,
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


def test_synchronize_makes_the_numpy_host_wait_for_the_stream() -> None:
    wire = Broadcast(
        **TAG,
        buffer=WIRE,
        shape=(2,),
        dtype=DType.INT64,
        src=1,
        comm=Communicator.PP_RELAY,
        stream=Stream.RELAY,
    )
    interp = NumpyInterpreter(rank=0, port=_NeverPort())
    allocate = Allocate(**TAG, buffer=WIRE, shape=(2,), dtype=DType.INT64, stream=Stream.RELAY)
    interp.perform((allocate, wire))
    assert not interp.host_blocked()  # the relay stream waits, the host runs on
    with pytest.raises(InterpreterError, match=r"the host waits on synchronize\(relay\)"):
        interp.perform((Synchronize(**TAG, stream=Stream.RELAY),))
    assert interp.host_blocked()
    main = next(stall for stall in interp.stalls() if stall.stream is Stream.MAIN)
    assert main.culprit is not None
    assert main.culprit.effect == wire  # what the host really waits for
