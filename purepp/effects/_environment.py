"""The environment both interpreters keep, and the checks both make: written once.

An interpreter's environment maps names to what the effects made: buffers (a torch
tensor, or the numpy interpreter's buffer record), recorded events, asynchronous work
in flight and the all-reduce tables that work is still writing. The lifecycle rules
are the same for every interpreter:

- an effect that creates a binding refuses a name already bound (names come from the
  step counter, so a clash means a buffer was never released); the caller's `bind`
  replaces;
- an event is recorded once and consumed by its one wait (or forgotten);
- a work handle is in flight from its AllReduce to its WaitWork, and its table is
  unreadable until then.

`Environment` holds the maps and raises the typed errors; the `check_*` methods are
the layout checks on the row moves, pack and unpack, the wire and the header, over
plain shapes and the interpreter's own dtype objects. Error text is built only when
raising: callers pass the effect (or the public call's name), never a description.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, NoReturn, TypeVar

import attrs
import numpy.typing as npt

from purepp._text import a_type, with_article
from purepp.effects.vocabulary import (
    BufferRef,
    DType,
    Effect,
    EventRef,
    GatherRows,
    Pack,
    ScatterRows,
    Section,
    Unpack,
    WorkRef,
)
from purepp.errors import InterpreterError, InvalidInputError

__all__ = ["Call", "Environment", "Shape", "effect_call", "itemsize", "shown"]

B = TypeVar("B")  # a bound buffer: torch.Tensor, or the numpy interpreter's record
E = TypeVar("E")  # a recorded event
W = TypeVar("W")  # an asynchronous work handle
D = TypeVar("D")  # an interpreter's dtype object (torch.dtype, numpy dtype)
V = TypeVar("V")  # what `resolve` returns per buffer

Shape = tuple[int, ...]
# Where an error happened: the effect being performed, or a public call's name.
Call = Effect | str


def effect_call(owner: str, effect: Effect) -> str:
    """The call an error about `effect` names: `Owner.perform(Kind step=S op=O)`."""
    return f"{owner}.perform({type(effect).__name__} step={effect.step} op={effect.op.value})"


# How many bound names an "is not bound" error lists, so the message stays readable.
_NAMES_SHOWN = 8


def itemsize(dtype: DType) -> int:
    """Bytes per element of a vocabulary dtype."""
    match dtype:
        case DType.INT64:
            return 8
        case DType.INT32:
            return 4
        case _:
            typing.assert_never(dtype)


def shown(names: Iterable[str]) -> str:
    """Sorted names, the first few quoted, the rest counted."""
    ordered = sorted(names)
    more = len(ordered) - _NAMES_SHOWN
    listed = ", ".join(repr(name) for name in ordered[:_NAMES_SHOWN])
    return f"[{listed}{f', ... {more} more' if more > 0 else ''}]"


class Environment(Generic[B, E, W]):
    """Names -> buffers, events and work in flight, with the lifecycle rules and their errors.

    The maps are public so an interpreter's hot path may read them directly; every
    change that can fail goes through a method, which raises `InterpreterError`.
    """

    __slots__ = ("buffers", "events", "owner", "pending_results", "works")

    def __init__(self, owner: str) -> None:
        self.owner = owner  # the interpreter's class name, for error messages
        self.buffers: dict[BufferRef, B] = {}
        self.events: dict[EventRef, E] = {}
        self.works: dict[WorkRef, tuple[W, BufferRef]] = {}  # handle, and the table it writes
        # Tables an async all-reduce is still writing: reading one is an error.
        self.pending_results: dict[BufferRef, WorkRef] = {}

    # ---- naming calls ----------------------------------------------------------------

    def describe(self, call: Call) -> str:
        """The call an error names: `Owner.perform(Kind step=S op=O)`, or the call's name."""
        if isinstance(call, str):
            return call
        return effect_call(self.owner, call)

    def fail(self, call: Call, what: str, fix: str) -> NoReturn:
        raise InterpreterError(self.describe(call), what, fix)

    # ---- buffers -----------------------------------------------------------------------

    def check_ref(self, call: Call, ref: object, kind: type[BufferRef | EventRef]) -> None:
        """Refuse a caller's name that is not a `kind` (a plain str, None, an int)."""
        if not isinstance(ref, kind):
            raise InvalidInputError(
                self.describe(call),
                f"the name {ref!r} is {a_type(ref)}, not {with_article(kind.__name__)}",
                f"pass {with_article(kind.__name__)}, e.g. one of the relay config's inputs",
            )

    def lookup(self, call: Call, ref: BufferRef) -> B:
        """The buffer bound to `ref`; an error if unbound or still being all-reduced."""
        try:
            if self.pending_results and ref in self.pending_results:
                self.fail(
                    call,
                    f"buffer {ref.name!r} is the result of all-reduce "
                    f"{self.pending_results[ref].name!r}, which has not been waited on",
                    "perform its WaitWork before reading or releasing the table",
                )
            return self.buffers[ref]
        except (KeyError, TypeError):  # the error path only: no cost on a found name
            self.check_ref(call, ref, BufferRef)
            self.fail(
                call,
                f"buffer {ref.name!r} is not bound; bound: {shown(b.name for b in self.buffers)}",
                "allocate or bind it before its first use and release it after its last",
            )

    def check_unbound(self, call: Call, ref: BufferRef) -> None:
        """Refuse a new binding of a name that is already bound."""
        if ref in self.buffers or ref in self.pending_results:
            self.fail(
                call,
                f"buffer {ref.name!r} is already bound",
                "if a step ran twice, pass begin (or a relay step) the state the last finish "
                "(or end_step) returned; else release the old buffer first, or name new "
                "buffers from the step counter",
            )

    def check_views_unbound(self, effect: Unpack) -> None:
        """Refuse an Unpack binding a name already bound, or one name in two sections (the
        second view would silently replace the first)."""
        sections = effect.sections
        for section in sections:
            self.check_unbound(effect, section.buffer)
        if len(sections) > 1 and len({section.buffer for section in sections}) < len(sections):
            seen: set[BufferRef] = set()
            for section in sections:
                if section.buffer in seen:
                    self.fail(
                        effect,
                        f"buffer {section.buffer.name!r} is bound by two sections of the unpack",
                        "name each section's buffer once",
                    )
                seen.add(section.buffer)

    def check_rebindable(self, call: Call, ref: BufferRef) -> None:
        """The caller's `bind` may replace a binding, except a table being all-reduced."""
        self.check_ref(call, ref, BufferRef)
        if ref in self.pending_results:
            self.fail(
                call,
                f"buffer {ref.name!r} is being written by all-reduce "
                f"{self.pending_results[ref].name!r}",
                "perform its WaitWork before rebinding the name",
            )

    def release(self, call: Call, ref: BufferRef) -> B:
        """Unbind `ref` (which must be bound and readable); the buffer it held."""
        buffer = self.lookup(call, ref)
        del self.buffers[ref]
        return buffer

    def bound_refs(self) -> frozenset[BufferRef | EventRef | WorkRef]:
        """Every name the environment holds now."""
        return frozenset((*self.buffers, *self.events, *self.works))

    def resolve(self, value: object, read: Callable[[B], V]) -> dict[str, V]:
        """Every BufferRef inside `value`, by attribute path, read through `read`.

        Walks attrs instances, tuples and lists; a bare BufferRef is the path "".
        """
        found: dict[str, V] = {}
        call = f"{self.owner}.resolve"

        def collect(item: object, path: str) -> None:
            if isinstance(item, BufferRef):
                found[path] = read(self.lookup(call, item))
                return
            if isinstance(item, tuple | list):
                for i, element in enumerate(item):
                    collect(element, f"{path}[{i}]")
                return
            cls = type(item)
            if attrs.has(cls):
                for field in attrs.fields(cls):
                    collect(
                        getattr(item, field.name), f"{path}.{field.name}" if path else field.name
                    )

        try:
            collect(value, "")
        except RecursionError:
            raise InvalidInputError(
                call,
                f"the {type(value).__name__} is nested too deeply, or holds itself",
                "pass a state, a result or a tuple of them (what the pure steps return)",
            ) from None
        return found

    # ---- events ------------------------------------------------------------------------

    def record_event(self, call: Call, ref: EventRef, event: E) -> None:
        if ref in self.events:
            self.fail(
                call,
                f"event {ref.name!r} is already recorded and not yet waited on",
                "record each event once under a fresh name (WaitEvent consumes it)",
            )
        self.events[ref] = event

    def check_recordable(self, call: Call, ref: EventRef) -> None:
        if ref in self.events:
            self.record_event(call, ref, self.events[ref])  # raises the one message

    def take_event(self, call: Call, ref: EventRef) -> E:
        """Consume `ref` for its one wait."""
        try:
            return self.events.pop(ref)
        except KeyError:
            self.fail(
                call,
                f"event {ref.name!r} is not recorded (or was already waited on: "
                f"WaitEvent consumes its event); recorded: {shown(e.name for e in self.events)}",
                "record the event before waiting on it, and wait on it once",
            )

    def forget_event(self, call: Call, ref: EventRef) -> None:
        if self.events.pop(ref, None) is None:
            self.fail(
                call,
                f"event {ref.name!r} is not recorded (or was already waited on)",
                "forget only an event that was recorded and never waited on",
            )

    def recorded_event(self, call: Call, ref: EventRef) -> E:
        """The event recorded under `ref`, without consuming it."""
        self.check_ref(call, ref, EventRef)
        event = self.events.get(ref)
        if event is None:
            self.fail(
                call,
                f"event {ref.name!r} is not recorded (or was already waited on)",
                "ask about an event that is recorded and not yet consumed",
            )
        return event

    # ---- work in flight ----------------------------------------------------------------

    def check_work_free(self, call: Call, ref: WorkRef) -> None:
        if ref in self.works:
            self.fail(
                call,
                f"work {ref.name!r} is already in flight",
                "wait on it before reusing its name",
            )

    def start_work(self, ref: WorkRef, handle: W, result: BufferRef) -> None:
        """`handle` now writes `result`: unreadable until `end_work`."""
        self.works[ref] = (handle, result)
        self.pending_results[result] = ref

    def work(self, call: Call, ref: WorkRef) -> tuple[W, BufferRef]:
        """The handle in flight under `ref`, and the table it writes."""
        entry = self.works.get(ref)
        if entry is None:
            self.fail(
                call,
                f"work {ref.name!r} is not in flight (or was already waited on: "
                f"WaitWork consumes its handle); in flight: {shown(w.name for w in self.works)}",
                "issue an AllReduce with this work name first, and wait on it once",
            )
        return entry

    def end_work(self, ref: WorkRef) -> None:
        """The wait on `ref` is done (or issued): its table becomes readable."""
        _, result = self.works.pop(ref)
        del self.pending_results[result]

    # ---- layout checks (shapes and dtypes of what the effects move) ----------------------

    def check_sizes(self, call: Call, ref: BufferRef, shape: Shape) -> None:
        if any(size < 0 for size in shape):
            self.fail(call, f"shape {shape} of {ref.name!r}", "use sizes >= 0")

    def check_wire(
        self, call: Call, *, ref: BufferRef, shape: Shape, dtype: D, wire: Shape, wire_dtype: D
    ) -> None:
        # NCCL does not check sizes: a wrong shape would hang every rank, so check here.
        if shape != wire or dtype != wire_dtype:
            self.fail(
                call,
                f"buffer {ref.name!r} is {dtype} {shape} but the wire is {wire_dtype} {wire}",
                "bind a buffer of the declared wire shape and dtype",
            )

    def check_contiguous(self, call: Call, ref: BufferRef, contiguous: bool) -> None:
        if not contiguous:
            self.fail(
                call,
                f"buffer {ref.name!r} is not contiguous",
                "broadcast a contiguous tensor (make a snapshot with PadColumns or GatherRows)",
            )

    def check_header(
        self, call: Call, *, ref: BufferRef, shape: Shape, dtype: D, expected: Shape, int32: D
    ) -> None:
        if shape != expected or dtype != int32 or len(expected) != 1:
            self.fail(
                call,
                f"header {ref.name!r} is {dtype} {shape} but the expected header is "
                f"{int32} {expected}",
                "check a 1-D int32 header of the expected length",
            )

    def check_pad(self, call: Call, ref: BufferRef, shape: Shape, width: int) -> None:
        if len(shape) != 2 or shape[1] > width:
            self.fail(
                call,
                f"buffer {ref.name!r} has shape {shape}, cannot pad to width {width}",
                "pad a 2-D buffer at most `width` columns wide",
            )

    def check_stack(
        self, call: Call, refs: Sequence[BufferRef], layouts: Sequence[tuple[Shape, D]]
    ) -> None:
        if not layouts or len(set(layouts)) != 1 or len(layouts[0][0]) != 1:
            shapes = [f"{dtype} {shape}" for shape, dtype in layouts]
            self.fail(
                call,
                f"sources {[r.name for r in refs]} are {shapes}",
                "stack one or more 1-D buffers of equal length and dtype",
            )

    def check_index(self, call: Call, *, ref: BufferRef, shape: Shape, dtype: D, ok: bool) -> None:
        """`ok`: whether `dtype` is int32 or int64 (each interpreter knows its own)."""
        if len(shape) != 1 or not ok:
            self.fail(
                call, f"index {ref.name!r} is {dtype} {shape}", "pass a 1-D int32 or int64 index"
            )

    def check_gather(self, call: Call, ref: BufferRef, shape: Shape) -> None:
        if not shape:
            self.fail(call, f"source {ref.name!r} is a scalar", "gather from a 1-D+ buffer")

    def check_rows(
        self, effect: GatherRows | ScatterRows, slots: npt.NDArray[Any], rows: int
    ) -> None:
        """Every entry of the index `slots` names a row 0..rows-1 of the gather's source or
        the scatter's target; a skipping scatter's may also be -1. (A device kernel would
        fault, or write a row it was not given: callers read host indices only.)"""
        outside = (slots < 0) | (slots >= rows)
        skips = isinstance(effect, ScatterRows) and effect.skips
        if skips:
            outside &= slots != -1
        bad = slots[outside]
        if not bad.size:
            return
        if isinstance(effect, GatherRows):
            self.fail(
                effect,
                f"index {effect.index.name!r} holds row {int(bad[0])} of a "
                f"{rows}-row source {effect.source.name!r}",
                "gather rows 0..rows-1 only (a device kernel would fault)",
            )
        self.fail(
            effect,
            f"index {effect.index.name!r} holds row {int(bad[0])} of a "
            f"{rows}-row target {effect.target.name!r}",
            "scatter to rows 0..rows-1, or -1 to skip a row"
            if skips
            else "scatter to rows 0..rows-1 (this scatter skips no rows: skips=False)",
        )

    def check_scatter(
        self,
        call: Call,
        *,
        source_ref: BufferRef,
        target_ref: BufferRef,
        source: tuple[Shape, D],
        index: Shape,
        target: tuple[Shape, D],
    ) -> None:
        (s, s_dtype), (t, t_dtype) = source, target
        if (
            not s
            or not t  # a 0-d target has no rows to scatter into
            or len(index) != 1
            or s[0] != index[0]
            or s[1:] != t[1:]
            or s_dtype != t_dtype
        ):
            self.fail(
                call,
                f"source {source_ref.name!r} {s_dtype} {s}, index {index}, target "
                f"{target_ref.name!r} {t_dtype} {t}",
                "pass one source row per index entry, with the target's row shape and dtype",
            )

    def check_scatter_target(
        self, call: Call, ref: BufferRef, shape: Shape, strides: Sequence[int], writable: bool
    ) -> None:
        """A scatter's target can take each row apart: writable, and no element shares its
        memory with another (an expansion's stride of 0 would let one row's write land
        in every row)."""
        if not writable or any(
            stride == 0 and size > 1 for stride, size in zip(strides, shape, strict=True)
        ):
            self.fail(
                call,
                f"target {ref.name!r} cannot take rows apart "
                f"({'read-only' if not writable else f'an expansion, strides {tuple(strides)}'})",
                "bind a writable tensor or array with memory of its own (e.g. .clone())",
            )

    def check_sections(self, call: Pack | Unpack, sections: Sequence[Section], nbytes: int) -> None:
        """Every section lies inside `nbytes`, aligned to its element size; a Pack
        section's declared source rows fit its region, and an Unpack's declare none."""
        for section in sections:
            size = itemsize(section.dtype)
            end = section.offset + math.prod(section.shape) * size
            if (
                section.offset < 0
                or section.offset % size
                or end > nbytes
                or any(n < 0 for n in section.shape)
            ):
                self.fail(
                    call,
                    f"section {section.buffer.name!r} at byte {section.offset} of shape "
                    f"{section.shape} ({section.dtype.value}) does not fit aligned in "
                    f"{nbytes} bytes",
                    "place each section inside the packed buffer at a multiple of its element size",
                )
            rows = section.source_rows
            if rows is None:
                continue
            if isinstance(call, Unpack):
                self.fail(
                    call,
                    f"section {section.buffer.name!r} declares source_rows={rows}",
                    "leave source_rows None in an Unpack: its views have the section's shape",
                )
            if not section.shape or not 0 <= rows <= section.shape[0]:
                self.fail(
                    call,
                    f"section {section.buffer.name!r} of shape {section.shape} declares "
                    f"source_rows={rows}",
                    "declare at most the section's own rows (None: any up to them)",
                )

    def check_index_rows(self, effect: GatherRows, shape: Shape) -> None:
        """The index has the entries the gather declares (one per batch row)."""
        rows = effect.index_rows
        if rows is not None and tuple(shape) != (rows,):
            self.fail(
                effect,
                f"index {effect.index.name!r} has shape {tuple(shape)} where the gather "
                f"declares {rows} entries",
                f"bind {effect.index.name!r} with {rows} entries, one per batch row",
            )

    def check_target_rows(self, effect: ScatterRows, shape: Shape) -> None:
        """The target has the rows the scatter declares its index stays below."""
        rows = effect.target_rows
        if rows is None:
            return
        if rows < 0:
            self.fail(
                effect, f"target_rows={rows}", "declare a bound of 0 or more (None: no bound)"
            )
        if not shape or shape[0] < rows:
            self.fail(
                effect,
                f"target {effect.target.name!r} has shape {shape}, fewer than the "
                f"{rows} rows the scatter's index may name",
                f"bind a target of at least {rows} rows (the table the index was built for)",
            )

    def check_pack(
        self,
        effect: Pack,
        sources: Sequence[tuple[Shape, D]],
        wanted: Sequence[D],
    ) -> None:
        """Each source fits the top-left corner of its section, in the section's dtype."""
        if effect.nbytes < 0 or effect.nbytes % 16:
            self.fail(
                effect,
                f"packed buffer {effect.out.name!r} of {effect.nbytes} bytes",
                "pack into a whole number of 16-byte units",
            )
        self.check_sections(effect, effect.sections, effect.nbytes)
        for section, (shape, dtype), want in zip(effect.sections, sources, wanted, strict=True):
            if (
                dtype != want
                or len(shape) != len(section.shape)
                or any(have > room for have, room in zip(shape, section.shape, strict=True))
            ):
                self.fail(
                    effect,
                    f"source {section.buffer.name!r} is {dtype} {shape}, which does not fit "
                    f"section {want} {section.shape}",
                    "pack a source of the section's dtype and rank, no larger than the section",
                )
            rows = section.source_rows
            if rows is not None and shape[0] != rows:
                self.fail(
                    effect,
                    f"source {section.buffer.name!r} has {shape[0]} rows where the section "
                    f"declares {rows}",
                    f"bind {section.buffer.name!r} with {rows} rows, one per batch row (the "
                    "rows it lacks would be packed as zeros)",
                )

    def check_unpack(self, effect: Unpack, nbytes: int, contiguous: bool, offset: int = 0) -> None:
        """The source is one contiguous run of `nbytes` bytes holding every section, that
        starts `offset` bytes into its memory, aligned for every section's dtype."""
        if not contiguous:
            self.fail(
                effect,
                f"packed buffer {effect.source.name!r} is not contiguous",
                "unpack a contiguous buffer (the received wire)",
            )
        widest = max((itemsize(section.dtype) for section in effect.sections), default=1)
        if offset % widest:
            self.fail(
                effect,
                f"packed buffer {effect.source.name!r} starts {offset} bytes into its memory, "
                f"not a multiple of {widest}",
                "unpack a buffer of its own (the received wire), not a view at an odd offset",
            )
        self.check_sections(effect, effect.sections, nbytes)
