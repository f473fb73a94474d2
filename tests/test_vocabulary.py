"""The names and enums every effect carries: what interpreters key their dicts by."""

from __future__ import annotations

import enum
import pickle
from pathlib import Path

import attrs
import pytest
from hypothesis import given

import purepp.effects
from purepp.effects import vocabulary
from purepp.effects._converter import CONVERTER
from purepp.effects.log import load_log
from purepp.effects.vocabulary import (
    BufferRef,
    Communicator,
    DType,
    Effect,
    EventRef,
    Op,
    Release,
    ScatterRows,
    Stream,
    WorkRef,
)
from tests.strategies import any_effect


def test_a_buffer_ref_is_its_name_and_no_other_kind_of_ref() -> None:
    ref = BufferRef("relay.step3.wire")
    assert ref == BufferRef("relay.step3.wire")
    assert hash(ref) == hash(BufferRef(ref.name))
    assert ref != BufferRef("relay.step4.wire")
    # One dict may hold buffers, events and works (a plan numbers them together).
    positions = {ref: 0, EventRef(ref.name): 1, WorkRef(ref.name): 2}
    assert len(positions) == 3
    assert positions[BufferRef(ref.name)] == 0
    event: object = EventRef(ref.name)  # another kind of ref: never equal
    assert ref != event
    assert event != ref
    assert type(ref.name) is str
    assert ref.name == "relay.step3.wire"
    assert repr(ref) == "BufferRef(name='relay.step3.wire')"
    match ref:
        case BufferRef(name=name):
            assert name == ref.name


def test_a_buffer_ref_survives_pickling_and_the_log_converter() -> None:
    ref = BufferRef("relay.input.idx_mapping")
    again = pickle.loads(pickle.dumps(ref))
    assert type(again) is BufferRef
    assert again == ref
    release = Release(step=2, op=Op.END_STEP, buffer=ref)
    raw = CONVERTER.unstructure(release)
    assert raw["buffer"] == ref.name
    assert type(raw["buffer"]) is str
    assert CONVERTER.structure(raw, Release) == release


@pytest.mark.parametrize("name", [None, 3, b"relay.x", ("relay", "x")])
def test_a_buffer_ref_of_anything_but_a_str_is_refused(name: object) -> None:
    with pytest.raises(TypeError, match="pass the buffer's name as a str"):
        BufferRef(name)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", [Stream, Communicator, DType, Op])
def test_enum_members_hash_consistently_with_equality(kind: type[enum.Enum]) -> None:
    members = list(kind)
    table = {member: index for index, member in enumerate(members)}
    for index, member in enumerate(members):
        same = kind(member.value)  # looked up by value, as the log reader does
        assert same is member
        assert table[same] == index
        assert hash(same) == hash(member)
        assert pickle.loads(pickle.dumps(member)) is member


def test_a_log_written_before_scatter_rows_had_skips_loads_with_the_old_meaning(
    tmp_path: Path,
) -> None:
    # Older logs have no "skips" field: their scatters skipped -1 rows, as skips=True does.
    golden = Path(__file__).parent / "data" / "golden" / "pp2_spec2" / "rank-0000.jsonl"
    text = golden.read_text()
    assert '"skips": false' in text
    old = tmp_path / "rank-0000.jsonl"
    old.write_text(text.replace(', "skips": false', "").replace(', "skips": true', ""))
    now = [record.effect for record in load_log(golden).records]
    then = [record.effect for record in load_log(old).records]
    scatters = [i for i, effect in enumerate(now) if isinstance(effect, ScatterRows)]
    assert scatters
    for index, (effect, earlier) in enumerate(zip(now, then, strict=True)):
        if index in scatters:
            assert isinstance(earlier, ScatterRows)
            assert isinstance(effect, ScatterRows)
            assert earlier.skips
            assert attrs.evolve(earlier, skips=effect.skips) == effect
        else:
            assert earlier == effect


@given(any_effect)
def test_every_effect_is_a_hashable_value_equal_to_its_copy(effect: Effect) -> None:
    # Effects are frozen values a caller may put in sets or use as keys: their arrays
    # compare by value but stay out of the hash, which must agree with equality.
    copy = pickle.loads(pickle.dumps(effect))
    assert copy == effect
    assert hash(copy) == hash(effect)
    assert len({effect, copy}) == 1


def test_the_effects_package_re_exports_the_whole_vocabulary() -> None:
    # The README's table names Pack, Unpack and Synchronize; an embedder imports every
    # effect from purepp.effects, as mypy --strict allows only names in its __all__.
    # Beside the vocabulary it exports the protocol every interpreter satisfies.
    assert set(purepp.effects.__all__) == {*vocabulary.__all__, "Interpreter"}
    assert all(
        getattr(purepp.effects, name) is getattr(vocabulary, name) for name in vocabulary.__all__
    )
