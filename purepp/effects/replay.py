"""Replay: feed a recorded log back through any interpreter, one decode step at a time.

A log holds no caller tensors: the relay's inputs (`RelayConfig.inputs`: idx_mapping,
sampled tokens, counts, the draft table) are read by a step's effects but bound by the
caller. `replay`'s `before_step` lets a caller bind them before each step;
`placeholder_inputs(log)` is a stock `before_step` that binds zeros of the shape and
dtype the log's own records require.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import numpy as np

from purepp._checks import check_interpreter
from purepp._text import a_type
from purepp.effects.interpreter import Interpreter
from purepp.effects.logmodel import EffectLog, LogRecord
from purepp.effects.numpy_interpreter import NumpyInterpreter, numpy_dtype
from purepp.effects.vocabulary import (
    Alias,
    Allocate,
    AllReduce,
    Broadcast,
    BufferRef,
    CheckHeader,
    CopyHostToDevice,
    DType,
    Effect,
    GatherRows,
    Pack,
    PadColumns,
    Release,
    ScatterRows,
    StackRows,
    TensorSpec,
    Unpack,
)
from purepp.errors import InvalidInputError

if TYPE_CHECKING:
    from purepp.effects.torch_interpreter import TorchInterpreter

__all__ = ["InputShapeError", "PlaceholderInputs", "placeholder_inputs", "replay"]

BeforeStep = Callable[[int, Interpreter], None]

_BEFORE_STEP_FIX = (
    "pass a function (step, interpreter) -> None that binds the step's inputs (e.g. "
    "placeholder_inputs(log)), or leave before_step out"
)


def replay(
    log: EffectLog, interpreter: Interpreter, *, before_step: BeforeStep | None = None
) -> None:
    """Feed `log`'s effects through `interpreter`, one `perform` call per decode step.

    A step is a run of consecutive records with the same `effect.step`, the batch a
    pure step function returned. Replaying into a `Recorder` reproduces `log`.
    `before_step(step, interpreter)` runs before each step's batch is performed, to bind
    the inputs that batch reads (a step whose records are split in two runs, like an
    overlapped agreement, gets a call before each run).
    """
    if not isinstance(log, EffectLog):
        raise InvalidInputError(
            "replay", f"log is {a_type(log)}", "pass an EffectLog (e.g. from load_log)"
        )
    check_interpreter(
        "replay",
        "interpreter",
        interpreter,
        fix="pass an Interpreter (e.g. a NumpyInterpreter, a TorchInterpreter or a Recorder)",
    )
    if before_step is not None and not callable(before_step):
        raise InvalidInputError(
            "replay",
            f"before_step={before_step!r} is {a_type(before_step)}, not callable",
            _BEFORE_STEP_FIX,
        )
    for step, group in itertools.groupby(log.records, key=lambda record: record.effect.step):
        records = tuple(group)
        if before_step is not None:
            try:
                before_step(step, interpreter)
            except Exception as error:  # the caller's own: its type kept, its step named
                error.add_note(f"in replay: before_step, before {_where(log, step, records)}")
                raise
        try:
            interpreter.perform(tuple(record.effect for record in records))
        except Exception as error:  # its type kept; where in the log it was, noted
            error.add_note(f"in replay: {_where(log, step, records)}")
            raise


def _where(log: EffectLog, step: int, records: tuple[LogRecord, ...]) -> str:
    """Where in the log a batch is, for an error's note (built only on an error)."""
    first, last = records[0].seq, records[-1].seq
    return (
        f"step {step} of rank {log.header.rank}'s log, records #{first} to #{last} "
        f"(file lines {first + 2} to {last + 2})"
    )


# -- placeholder inputs ---------------------------------------------------------------


class InputShapeError(InvalidInputError):
    """The log's records do not fix the shape or dtype of an input a step reads."""

    def __init__(self, call: str, problem: str, fix: str, *, buffer: BufferRef) -> None:
        self.buffer = buffer  # the input whose shape the log does not give
        super().__init__(call, problem, fix)


_CALL = "placeholder_inputs"
_INTO_FIX = (
    "pass into= the NumpyInterpreter or TorchInterpreter that performs the effects (a "
    "Recorder only records: bind into the interpreter it wraps)"
)


@attrs.define(eq=False)
class _Tensor:
    """A buffer of the log: its shape and dtype (terms of `_Terms`), and its values' top."""

    shape: int  # a shape term
    dtype: int  # a dtype term
    top: int | None  # the largest value it can hold, where the log says (index bounds)


class _Terms:
    """Unification over the shapes and dtypes the records constrain.

    A shape is a list term: unbound (nothing said), "no more dimensions", or a first
    dimension and the rest. A dimension is an exact size, or bounds: at most (a padded
    or packed source fits its region) and at least (a table's rows exceed every index).
    What two records say of one term and cannot both hold is a problem of that term.
    """

    def __init__(self) -> None:
        self._parent: list[int] = []
        self.size: dict[int, int] = {}
        self.at_least: dict[int, int] = {}
        self.at_most: dict[int, int] = {}
        self.unbounded: dict[int, str] = {}  # rows that an index of unknown values reads
        self.dtype: dict[int, DType] = {}
        self.shape: dict[int, tuple[int, int] | None] = {}  # None: no more dimensions
        self.problems: dict[int, list[str]] = {}

    def new(self) -> int:
        self._parent.append(len(self._parent))
        return len(self._parent) - 1

    def find(self, term: int) -> int:
        parent = self._parent
        while parent[term] != term:
            parent[term] = parent[parent[term]]
            term = parent[term]
        return term

    def problem(self, term: int, text: str) -> None:
        self.problems.setdefault(self.find(term), []).append(text)

    def _link(self, child: int, root: int) -> None:
        self._parent[child] = root
        if child in self.problems:
            self.problems.setdefault(root, []).extend(self.problems.pop(child))

    # ---- dimensions and dtypes ---------------------------------------------------------

    def dim(self, size: int | None = None) -> int:
        term = self.new()
        if size is not None:
            self.size[term] = size
        return term

    def fix_size(self, term: int, size: int, where: str) -> None:
        root = self.find(term)
        have = self.size.setdefault(root, size)
        if have != size:
            self.problem(root, f"{where} needs size {size} where another record needs {have}")

    def bound(self, term: int, *, at_least: int | None = None, at_most: int | None = None) -> None:
        root = self.find(term)
        if at_least is not None:
            self.at_least[root] = max(self.at_least.get(root, 0), at_least)
        if at_most is not None:
            self.at_most[root] = min(self.at_most.get(root, at_most), at_most)

    def same_dim(self, a: int, b: int, where: str) -> None:
        a, b = self.find(a), self.find(b)
        if a == b:
            return
        self._link(a, b)
        if a in self.size:
            self.fix_size(b, self.size.pop(a), where)
        low, high = self.at_least.pop(a, None), self.at_most.pop(a, None)
        self.bound(b, at_least=low, at_most=high)
        if a in self.unbounded:
            self.unbounded.setdefault(b, self.unbounded.pop(a))

    def dtype_of(self, dtype: DType | None = None) -> int:
        term = self.new()
        if dtype is not None:
            self.dtype[term] = dtype
        return term

    def fix_dtype(self, term: int, dtype: DType, where: str) -> None:
        root = self.find(term)
        have = self.dtype.setdefault(root, dtype)
        if have is not dtype:
            self.problem(
                root, f"{where} needs dtype {dtype.value} where another needs {have.value}"
            )

    def same_dtype(self, a: int, b: int, where: str) -> None:
        a, b = self.find(a), self.find(b)
        if a != b:
            self._link(a, b)
            if a in self.dtype:
                self.fix_dtype(b, self.dtype.pop(a), where)

    # ---- shapes ------------------------------------------------------------------------

    def nil(self) -> int:
        term = self.new()
        self.shape[term] = None
        return term

    def cons(self, first: int, rest: int) -> int:
        term = self.new()
        self.shape[term] = (first, rest)
        return term

    def exact(self, sizes: tuple[int, ...]) -> int:
        term = self.nil()
        for size in reversed(sizes):
            term = self.cons(self.dim(size), term)
        return term

    def same_shape(self, a: int, b: int, where: str) -> None:
        a, b = self.find(a), self.find(b)
        if a == b:
            return
        if a not in self.shape:
            self._link(a, b)
            return
        if b not in self.shape:
            self._link(b, a)
            return
        left, right = self.shape[a], self.shape[b]
        self._link(a, b)
        if left is None and right is None:
            return
        if left is None or right is None:
            self.problem(b, f"{where} needs another number of dimensions than another record")
            return
        self.same_dim(left[0], right[0], where)
        self.same_shape(left[1], right[1], where)

    def split(self, shape: int, where: str) -> tuple[int, int]:
        """The first dimension of `shape` and the rest, made up if nothing said them."""
        root = self.find(shape)
        if root not in self.shape:
            self.shape[root] = (self.dim(), self.new())
        parts = self.shape[root]
        if parts is None:
            self.problem(root, f"{where} needs a dimension more than another record")
            return self.dim(), self.new()
        return parts

    def vector(self, shape: int, where: str) -> int:
        """The one dimension of a 1-D `shape`."""
        first, rest = self.split(shape, where)
        self.same_shape(rest, self.nil(), where)
        return first

    # ---- reading a term back -----------------------------------------------------------

    def resolve(self, tensor: _Tensor) -> TensorSpec | list[str]:
        """The placeholder's layout, or the problems that keep the log from saying it.

        Whatever no record constrains takes the least choice: no further dimension, the
        fewest rows the indices allow (0 if none), int32. A buffer no record reads a
        layout from at all (it is only aliased, recorded on a stream or released) is
        an empty int32 vector.
        """
        problems: list[str] = []
        sizes: list[int] = []
        term = self.find(tensor.shape)
        if term not in self.shape:
            sizes.append(0)
        while term in self.shape and len(sizes) <= 64:
            problems += self.problems.get(term, [])
            parts = self.shape[term]
            if parts is None:
                break
            sizes.append(self._size(parts[0], problems))
            term = self.find(parts[1])
        if len(sizes) > 64:  # past numpy's and torch's limit (the walk stops there: cycles too)
            problems.append("the records give it more than 64 dimensions")
        dtype = self.find(tensor.dtype)
        problems += self.problems.get(dtype, [])
        if problems:
            return problems
        return TensorSpec(shape=tuple(sizes), dtype=self.dtype.get(dtype, DType.INT32))

    def _size(self, term: int, problems: list[str]) -> int:
        root = self.find(term)
        problems += self.problems.get(root, [])
        low, high = self.at_least.get(root, 0), self.at_most.get(root)
        size = self.size.get(root, high)
        if size is None:
            if root in self.unbounded:
                problems.append(self.unbounded[root])
                return 0
            return low
        if size < low:
            problems.append(f"a dimension of size {size} is indexed up to row {low - 1}")
        if high is not None and size > high:
            problems.append(f"a dimension of size {size} must fit in {high}")
        return size


@attrs.frozen
class _Step:
    """One batch of the log (a run of records of one step) and the inputs it reads."""

    step: int
    inputs: dict[BufferRef, _Tensor]  # names read before anything in the log binds them


def _top(*tensors: _Tensor) -> int | None:
    """The largest value any of `tensors` holds, if the log says for each."""
    tops = [tensor.top for tensor in tensors]
    known = [top for top in tops if top is not None]
    return max(known) if len(known) == len(tops) else None


class _Analysis:
    """Walks a log once, batch by batch, saying what each record requires of each buffer."""

    def __init__(self, log: EffectLog) -> None:
        from purepp.effects.plan import Role, abstract, roles  # imports torch: only when used

        self.terms = _Terms()
        self.rank = log.header.rank
        self.live: dict[BufferRef, _Tensor] = {}  # the names the log's own effects bound
        self.inputs: dict[BufferRef, _Tensor] = {}  # this batch's inputs
        self.where = ""  # the record being read, for problems
        self.batches: list[_Step] = []
        for step, group in itertools.groupby(log.records, key=lambda record: record.effect.step):
            records = tuple(group)
            effects = tuple(record.effect for record in records)
            names = abstract(effects)[1]
            # Placeholders hold zeros: as indices they need one row.
            self.inputs = {
                name: self.tensor(top=0)
                for name, role in zip(names, roles(effects, names), strict=True)
                if role == Role.READ and isinstance(name, BufferRef) and name not in self.live
            }
            self.batches.append(_Step(step=step, inputs=self.inputs))
            for record in records:
                self.where = f"record #{record.seq} ({type(record.effect).__name__})"
                self.constrain(record.effect)

    def tensor(
        self, shape: int | None = None, dtype: DType | None = None, top: int | None = None
    ) -> _Tensor:
        terms = self.terms
        return _Tensor(terms.new() if shape is None else shape, terms.dtype_of(dtype), top)

    def get(self, name: BufferRef) -> _Tensor:
        found = self.live.get(name) or self.inputs.get(name)
        # A name released earlier in its batch: the replay itself will say so.
        return found or self.tensor()

    def rows_for(self, rows: int, index: _Tensor, name: BufferRef) -> None:
        """`rows` exceed every value of `index` (a gather's or scatter's table)."""
        if index.top is not None:
            self.terms.bound(rows, at_least=index.top + 1)
        else:
            self.terms.unbounded.setdefault(
                self.terms.find(rows),
                f"{self.where} indexes its rows with {name.name!r}, whose values the log "
                "does not hold (they arrive at run time)",
            )

    def constrain(self, effect: Effect) -> None:
        terms, where, live = self.terms, self.where, self.live
        match effect:
            case Allocate():
                live[effect.buffer] = self.tensor(terms.exact(effect.shape), effect.dtype)
            case CopyHostToDevice():
                values = effect.source
                top = int(values.max()) if values.size else -1
                live[effect.buffer] = self.tensor(terms.exact(values.shape), DType.INT32, top)
            case Broadcast():
                tensor = self.get(effect.buffer)
                terms.same_shape(tensor.shape, terms.exact(effect.shape), where)
                terms.fix_dtype(tensor.dtype, effect.dtype, where)
                if effect.src != self.rank:  # received: the sender's values
                    tensor.top = None
            case CheckHeader():
                tensor = self.get(effect.buffer)
                terms.same_shape(tensor.shape, terms.exact(effect.expected.shape), where)
                terms.fix_dtype(tensor.dtype, DType.INT32, where)
            case AllReduce():
                shape = terms.exact(effect.contribution.shape)
                live[effect.result] = self.tensor(shape, DType.INT32)
            case Release():
                live.pop(effect.buffer, None)
            case Alias():
                live[effect.out] = self.get(effect.source)  # one tensor, a second name
            case PadColumns():
                self.pad_columns(effect)
            case StackRows():
                self.stack_rows(effect)
            case GatherRows():
                self.gather_rows(effect)
            case ScatterRows():
                self.scatter_rows(effect)
            case Pack():
                self.pack(effect)
            case Unpack():
                for section in effect.sections:
                    shape = terms.exact(section.shape)
                    live[section.buffer] = self.tensor(shape, section.dtype)
            case _:  # streams, events, works: no buffer layouts
                pass

    def pad_columns(self, effect: PadColumns) -> None:
        terms, source = self.terms, self.get(effect.source)
        rows, rest = terms.split(source.shape, self.where)
        terms.bound(terms.vector(rest, self.where), at_most=effect.width)
        shape = terms.cons(rows, terms.cons(terms.dim(effect.width), terms.nil()))
        top = None if source.top is None else max(source.top, effect.fill)
        self.live[effect.out] = _Tensor(shape, source.dtype, top)

    def stack_rows(self, effect: StackRows) -> None:
        terms, sources = self.terms, [self.get(name) for name in effect.sources]
        if not sources:
            raise InvalidInputError(
                _CALL,
                f"{self.where}: a StackRows of no sources",
                "stack one 1-D buffer or more (a log the relay wrote never holds this)",
            )
        length = terms.vector(sources[0].shape, self.where)
        for other in sources[1:]:
            terms.same_shape(other.shape, sources[0].shape, self.where)
            terms.same_dtype(other.dtype, sources[0].dtype, self.where)
        shape = terms.cons(terms.dim(len(sources)), terms.cons(length, terms.nil()))
        self.live[effect.out] = _Tensor(shape, sources[0].dtype, _top(*sources))

    def gather_rows(self, effect: GatherRows) -> None:
        terms, source, index = self.terms, self.get(effect.source), self.get(effect.index)
        count = terms.vector(index.shape, self.where)
        if effect.index_rows is not None:  # the entries it declares
            terms.fix_size(count, effect.index_rows, self.where)
        rows, rest = terms.split(source.shape, self.where)
        self.rows_for(rows, index, effect.index)
        self.live[effect.out] = _Tensor(terms.cons(count, rest), source.dtype, source.top)

    def scatter_rows(self, effect: ScatterRows) -> None:
        terms, source, index = self.terms, self.get(effect.source), self.get(effect.index)
        target = self.get(effect.target)
        count = terms.vector(index.shape, self.where)
        rows, rest = terms.split(target.shape, self.where)
        terms.same_shape(source.shape, terms.cons(count, rest), self.where)
        terms.same_dtype(source.dtype, target.dtype, self.where)
        if effect.target_rows is None or index.top is not None:
            self.rows_for(rows, index, effect.index)
        if effect.target_rows is not None:  # the bound its index stays below, declared
            terms.bound(rows, at_least=effect.target_rows)
        target.top = _top(source, target)

    def pack(self, effect: Pack) -> None:
        terms = self.terms
        for section in effect.sections:
            tensor = self.get(section.buffer)
            dims = [terms.dim() for _ in section.shape]
            for dim, size in zip(dims, section.shape, strict=True):
                terms.bound(dim, at_most=size)  # a source fits its region's corner
            if dims and section.source_rows is not None:  # with the rows it declares
                terms.fix_size(dims[0], section.source_rows, self.where)
            region = terms.nil()
            for dim in reversed(dims):
                region = terms.cons(dim, region)
            terms.same_shape(tensor.shape, region, self.where)
            terms.fix_dtype(tensor.dtype, section.dtype, self.where)
        self.live[effect.out] = self.tensor(terms.exact((effect.nbytes // 8,)), DType.INT64)


class PlaceholderInputs:
    """A `before_step` for `replay` that binds each step's inputs as zeros.

    Made by `placeholder_inputs(log)`. An input of a step is a buffer its records read
    before the log's own effects bind it (the relay's `RelayConfig.inputs`); its shape
    and dtype are what the records that read it require, following aliases to later
    steps. Before every run of a step's records it binds fresh zeros to each input that
    run reads and is unbound or holds a placeholder it bound itself; a name the caller
    bound is left alone.
    """

    def __init__(
        self, log: EffectLog, *, into: NumpyInterpreter | TorchInterpreter | None = None
    ) -> None:
        if not isinstance(log, EffectLog):
            raise InvalidInputError(
                _CALL, f"log is {a_type(log)}", "pass the EffectLog you replay (from load_log)"
            )
        if into is not None:
            _target(into)  # refused now, before any replay
        self._into = into
        analysis = _Analysis(log)
        terms = analysis.terms
        # Each step's runs (a step's records split in two, as by an overlapped agreement,
        # are two runs, with a `before_step` call each), and the inputs each run reads.
        runs: dict[int, list[dict[BufferRef, TensorSpec | str]]] = {}
        for batch in analysis.batches:
            run: dict[BufferRef, TensorSpec | str] = {}
            for name, tensor in batch.inputs.items():
                spec = terms.resolve(tensor)
                run[name] = spec if isinstance(spec, TensorSpec) else "; ".join(spec)
            runs.setdefault(batch.step, []).append(run)
        self._runs = runs
        self._calls: dict[int, int] = {}  # `before_step` calls so far, by step
        self._rank = log.header.rank
        self._bound: dict[BufferRef, object] = {}  # the placeholder last bound to each name

    def specs(self, step: int) -> dict[BufferRef, TensorSpec]:
        """The inputs of `step` and their layouts; `InputShapeError` if the log lacks one
        (or its runs need two)."""
        needs: dict[BufferRef, TensorSpec | str] = {}
        for run in self._runs.get(step, ()):
            for name, need in run.items():
                if needs.setdefault(name, need) != need:  # two runs of one step disagree
                    needs[name] = f"two batches of step {step} need {needs[name]} and {need}"
        return {name: self._spec(step, name, need) for name, need in needs.items()}

    def _spec(self, step: int, name: BufferRef, need: TensorSpec | str) -> TensorSpec:
        if isinstance(need, TensorSpec):
            return need
        raise InputShapeError(
            _CALL,
            f"rank {self._rank}'s log does not give the shape of input {name.name!r} at step "
            f"{step}: {need}",
            f"bind {name.name!r} yourself before step {step} (in your before_step, before "
            "calling this one): names you bind are left alone",
            buffer=name,
        )

    def __call__(self, step: int, interpreter: Interpreter) -> None:
        target = _target(interpreter if self._into is None else self._into)
        runs = self._runs.get(step)
        if not runs:
            return
        # The k-th call for a step comes before its k-th run (modulo: a replay again).
        calls = self._calls.get(step, 0)
        bound = target.bound_refs()
        # Every input's layout is found, and every placeholder made, before any state
        # changes: a refused call (InputShapeError) binds nothing and counts as no call.
        made: list[tuple[BufferRef, object]] = []
        for name, need in runs[calls % len(runs)].items():
            if name in bound and target.tensor(name) is not self._bound.get(name):
                continue  # the caller's own
            spec = self._spec(step, name, need)
            if isinstance(target, NumpyInterpreter):
                made.append((name, np.zeros(spec.shape, numpy_dtype(spec.dtype))))
            else:
                import torch

                from purepp.effects.torch_kernels import torch_dtype

                dtype = torch_dtype(spec.dtype)
                made.append((name, torch.zeros(spec.shape, dtype=dtype, device=target.device)))
        self._calls[step] = calls + 1
        for name, placeholder in made:
            target.bind(name, placeholder)  # type: ignore[arg-type]
            self._bound[name] = target.tensor(name)  # what it holds now, to know it again


def placeholder_inputs(
    log: EffectLog, *, into: NumpyInterpreter | TorchInterpreter | None = None
) -> PlaceholderInputs:
    """A `before_step` for `replay(log, ...)` binding zeros to every input each step reads.

    `into`: the interpreter to bind into, when the one replay performs through is a
    `Recorder` wrapping it; by default, the interpreter replay passes. Binds numpy
    arrays into a `NumpyInterpreter`, tensors on its device into a `TorchInterpreter`.
    """
    return PlaceholderInputs(log, into=into)


def _target(value: object) -> NumpyInterpreter | TorchInterpreter:
    """`value` if inputs can be bound into it; else the typed error naming it."""
    if isinstance(value, NumpyInterpreter):
        return value
    from purepp.effects.torch_interpreter import TorchInterpreter  # imports torch

    if isinstance(value, TorchInterpreter):
        return value
    raise InvalidInputError(_CALL, f"the interpreter to bind into is {a_type(value)}", _INTO_FIX)
