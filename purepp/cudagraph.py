"""CUDA-graph modes, batch descriptors and a pure dispatcher over a captured-graph table.

The dispatcher is a frozen value: built once from static configuration (capture sizes,
capture mode, request limit, speculative length, LoRA cases), it answers
`dispatch(...)` with the descriptor of the graph a batch replays, or eager. It models
the V2 runner's `CudaGraphManager` table: which graphs exist, which batches each one
can serve, and how a batch is padded up to one. Nothing here captures or replays.

Three kinds of graph live in the table:

- **mixed** graphs serve any batch up to their token count. A FULL mixed graph pads
  requests to `min(num_tokens, max_num_reqs)`; a PIECEWISE one leaves attention
  outside the graph, so it never pads requests (`num_reqs` None).
- **uniform-decode** graphs (FULL) serve only batches whose every request carries
  exactly `uniform_decode_query_len = 1 + num_speculative_tokens` tokens. Their token
  count is a capture size rounded up to a multiple of that length, and they pad
  requests to `num_tokens // uniform_decode_query_len`.
- **varlen-decode** graphs (FULL, opt-in with `varlen_decode=True`) serve decode
  batches whose requests each carry between 1 and `uniform_decode_query_len` tokens
  (speculative decoding with per-request draft lengths). They carry the bound as
  `max_query_len` and pad requests to `min(num_tokens, max_num_reqs)`. A caller that
  does not state `max_query_len` (None) never gets one: it may hold a prefill.
  With `varlen_decode` the uniform-decode graphs are not captured.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable
from typing import Any, Protocol, cast

import attrs

from purepp._checks import (
    INT32_MAX,
    check_bool,
    check_int,
    check_optional_int,
    check_requests_fit,
    store_ints,
)
from purepp._text import a_type
from purepp.errors import ConfigError, InvalidInputError

__all__ = [
    "BatchExecutionDescriptor",
    "CUDAGraphMode",
    "CaptureMode",
    "CudaGraphDispatcher",
    "Dispatcher",
]


class CUDAGraphMode(enum.IntEnum):
    """How one batch runs. Ordered: the DP agreement takes the minimum across ranks."""

    NONE = 0  # eager
    PIECEWISE = 1  # graphs around everything but attention
    FULL = 2  # one graph for the whole forward


class CaptureMode(enum.Enum):
    """Which graphs to capture (the `cudagraph_mode` setting), as (decode, mixed) modes.

    FULL_DECODE_ONLY and FULL_AND_PIECEWISE run decode batches through a separate
    routine (uniform- or varlen-decode FULL graphs); the others use one kind of graph
    for every batch.
    """

    NONE = "none"
    PIECEWISE = "piecewise"
    FULL = "full"
    FULL_DECODE_ONLY = "full_decode_only"
    FULL_AND_PIECEWISE = "full_and_piecewise"

    @property
    def separate_decode_routine(self) -> bool:
        """Whether decode batches get their own FULL graphs."""
        return self in (CaptureMode.FULL_DECODE_ONLY, CaptureMode.FULL_AND_PIECEWISE)

    @property
    def decode_mode(self) -> CUDAGraphMode:
        """The runtime mode of the decode-only graphs (FULL when separate)."""
        return _DECODE_MIXED[self][0]

    @property
    def mixed_mode(self) -> CUDAGraphMode:
        """The runtime mode of the graphs that serve any batch."""
        return _DECODE_MIXED[self][1]


_DECODE_MIXED: dict[CaptureMode, tuple[CUDAGraphMode, CUDAGraphMode]] = {
    CaptureMode.NONE: (CUDAGraphMode.NONE, CUDAGraphMode.NONE),
    CaptureMode.PIECEWISE: (CUDAGraphMode.PIECEWISE, CUDAGraphMode.PIECEWISE),
    CaptureMode.FULL: (CUDAGraphMode.FULL, CUDAGraphMode.FULL),
    CaptureMode.FULL_DECODE_ONLY: (CUDAGraphMode.FULL, CUDAGraphMode.NONE),
    CaptureMode.FULL_AND_PIECEWISE: (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE),
}


def _check_descriptor(instance: BatchExecutionDescriptor) -> None:
    call = "BatchExecutionDescriptor"
    if not isinstance(instance.cg_mode, CUDAGraphMode):
        raise InvalidInputError(
            call, f"cg_mode={instance.cg_mode!r} is not a CUDAGraphMode", "pass CUDAGraphMode.X"
        )
    store_ints(
        instance,
        num_tokens=check_int(call, "num_tokens", instance.num_tokens, 0),
        num_reqs=check_optional_int(call, "num_reqs", instance.num_reqs, 0),
        num_active_loras=check_int(call, "num_active_loras", instance.num_active_loras, 0),
        num_ubatches=check_int(
            call, "num_ubatches", instance.num_ubatches, 1, fix="pass 1 unless microbatched"
        ),
        uniform_token_count=check_optional_int(
            call,
            "uniform_token_count",
            instance.uniform_token_count,
            1,
            fix="pass None for no uniform_token_count",
        ),
        max_query_len=check_optional_int(
            call, "max_query_len", instance.max_query_len, 1, fix="pass None for no max_query_len"
        ),
    )


@attrs.frozen(kw_only=True)
class BatchExecutionDescriptor:
    """The shape a batch runs at: a captured graph's shape, or the eager batch's own."""

    cg_mode: CUDAGraphMode  # how the batch runs
    num_tokens: int  # tokens after padding (the graph's size; the batch's own when eager)
    num_reqs: int | None  # requests after padding; None: the graph does not pad requests
    uniform_token_count: int | None = None  # tokens per request a uniform-decode graph needs
    max_query_len: int | None = None  # per-request token bound of a varlen-decode graph
    num_active_loras: int = 0  # LoRA case the graph was captured for
    num_ubatches: int = 1  # microbatches the step is split into (1: not microbatched)

    def __attrs_post_init__(self) -> None:
        _check_descriptor(self)


class Dispatcher(Protocol):
    """Any CUDA-graph manager the DP agreement can ask for a batch's graph.

    `CudaGraphDispatcher` satisfies it structurally; a runner's own manager with the
    same `dispatch` plugs in without subclassing. Every rank of a DP group must answer
    the same arguments with the same descriptor, since the agreement dispatches the
    agreed values on every rank and relies on the answers matching. The first three are
    passed by position, so a manager may name them as it likes.
    """

    def dispatch(
        self,
        num_reqs: int,
        num_tokens: int,
        uniform_token_count: int | None,
        /,
        *,
        num_active_loras: int = ...,
        max_query_len: int | None = ...,
    ) -> BatchExecutionDescriptor:
        """The descriptor of the graph serving this batch, or an eager one."""
        ...


def _sizes(values: Iterable[int]) -> tuple[int, ...]:
    # Never int(v): a size of 3.7 is refused by the check below, not truncated to 3.
    try:
        return tuple(values)
    except TypeError:
        return cast(tuple[int, ...], values)  # not iterable: the check below names it


_DispatchKey = tuple[int, int, int | None, int, int | None]
_MAX_ANSWERS = 4096  # a bound on the memo: token counts above every graph are unbounded


def _check_dispatcher(instance: CudaGraphDispatcher) -> None:
    call = "CudaGraphDispatcher"
    if not isinstance(instance.capture_mode, CaptureMode):
        raise ConfigError(
            call,
            f"capture_mode={instance.capture_mode!r} is {a_type(instance.capture_mode)}",
            "pass a CaptureMode, e.g. CaptureMode.FULL (or CaptureMode('full') from a string)",
        )
    for name, values in (
        ("capture_sizes", instance.capture_sizes),
        ("lora_capture_cases", instance.lora_capture_cases),
    ):
        if not isinstance(values, tuple):
            raise ConfigError(
                call, f"{name}={values!r} is not a sequence", f"pass {name} as a tuple of ints"
            )
        ints = tuple(
            check_int(call, f"{name} entry", v, 0, fix=f"pass {name} as ints", config=True)
            for v in values
        )
        object.__setattr__(instance, name, ints)
    store_ints(
        instance,
        max_num_reqs=check_int(call, "max_num_reqs", instance.max_num_reqs, 1, config=True),
        num_speculative_tokens=check_int(
            # 1 + spec is a decode length and a query-length bound: it must fit int32.
            call,
            "num_speculative_tokens",
            instance.num_speculative_tokens,
            0,
            INT32_MAX - 1,
            config=True,
        ),
    )
    varlen = check_bool(call, "varlen_decode", instance.varlen_decode, config=True)
    object.__setattr__(instance, "varlen_decode", varlen)
    sizes = instance.capture_sizes
    if not sizes and instance.capture_mode is not CaptureMode.NONE:
        raise ConfigError(
            call,
            f"capture_sizes is empty with capture_mode={instance.capture_mode.name}",
            "pass the token counts to capture, or capture_mode=CaptureMode.NONE",
        )
    if any(s < 1 for s in sizes) or any(a >= b for a, b in itertools.pairwise(sizes)):
        raise ConfigError(
            call,
            f"capture_sizes={list(sizes)} is not strictly increasing positive token counts",
            "pass sorted, distinct sizes >= 1, e.g. sorted(set(sizes))",
        )
    cases = instance.lora_capture_cases
    if not cases or cases[0] < 0 or any(a >= b for a, b in itertools.pairwise(cases)):
        raise ConfigError(
            call,
            f"lora_capture_cases={list(cases)} is not strictly increasing counts >= 0",
            "pass (0,) without LoRA, else sorted distinct active-LoRA counts",
        )
    if instance.varlen_decode and not instance.capture_mode.separate_decode_routine:
        raise ConfigError(
            call,
            f"varlen_decode with capture_mode={instance.capture_mode.name}",
            "varlen-decode graphs need FULL_DECODE_ONLY or FULL_AND_PIECEWISE",
        )


@attrs.frozen(kw_only=True)
class CudaGraphDispatcher:
    """The captured-graph table of one model, and the pure choice of a graph per batch.

    Every rank of a DP group must build it from the same configuration: the agreement
    relies on every rank answering the same agreed values with the same graph.
    """

    capture_sizes: tuple[int, ...] = attrs.field(converter=_sizes)  # token counts, ascending
    capture_mode: CaptureMode  # which graphs exist
    max_num_reqs: int  # most requests the scheduler puts in one batch
    num_speculative_tokens: int = 0  # draft tokens per request; decode length is 1 + this
    lora_capture_cases: tuple[int, ...] = attrs.field(default=(0,), converter=_sizes)
    # ^ active-LoRA counts graphs were captured for, ascending
    varlen_decode: bool = False  # capture varlen-decode graphs instead of uniform-decode
    graphs: tuple[BatchExecutionDescriptor, ...] = attrs.field(init=False, repr=False)
    # ^ the captured graphs, derived from the fields above
    _answers: dict[_DispatchKey, BatchExecutionDescriptor] = attrs.field(
        init=False, repr=False, eq=False, hash=False
    )
    # ^ answers already given: dispatch is a pure function of its arguments, and a
    #   decode loop asks the same few questions every step

    def __attrs_post_init__(self) -> None:
        _check_dispatcher(self)
        object.__setattr__(self, "graphs", self._build_graphs())
        object.__setattr__(self, "_answers", {})

    @property
    def uniform_decode_query_len(self) -> int:
        """Tokens per request in a uniform decode batch: the sampled token plus the drafts."""
        return 1 + self.num_speculative_tokens

    def _build_graphs(self) -> tuple[BatchExecutionDescriptor, ...]:
        graphs: list[BatchExecutionDescriptor] = []
        if self.capture_mode is CaptureMode.NONE:
            return ()
        for loras in self.lora_capture_cases:
            for size in self.capture_sizes:
                if self.capture_mode.separate_decode_routine:
                    graphs.extend(self._decode_graph(size, loras))
                if self.capture_mode.mixed_mode is not CUDAGraphMode.NONE:
                    graphs.append(self._mixed_graph(size, loras))
        # Rounding two capture sizes up to one decode length yields the same graph twice.
        return tuple(dict.fromkeys(graphs))

    def _decode_graph(self, size: int, loras: int) -> tuple[BatchExecutionDescriptor, ...]:
        q = self.uniform_decode_query_len
        max_decode_tokens = self.max_num_reqs * q
        if self.varlen_decode:
            if size > max_decode_tokens:
                return ()
            # Worst case one token per request, so pad requests as a mixed FULL graph does.
            return (
                BatchExecutionDescriptor(
                    cg_mode=CUDAGraphMode.FULL,
                    num_tokens=size,
                    num_reqs=min(size, self.max_num_reqs),
                    max_query_len=q,
                    num_active_loras=loras,
                ),
            )
        rounded = -(-size // q) * q
        if rounded > max_decode_tokens or rounded > self.capture_sizes[-1]:
            return ()
        return (
            BatchExecutionDescriptor(
                cg_mode=CUDAGraphMode.FULL,
                num_tokens=rounded,
                num_reqs=rounded // q,
                uniform_token_count=q,
                num_active_loras=loras,
            ),
        )

    def _mixed_graph(self, size: int, loras: int) -> BatchExecutionDescriptor:
        mode = self.capture_mode.mixed_mode
        # PIECEWISE graphs leave attention eager, so any request count replays them.
        num_reqs = min(size, self.max_num_reqs) if mode is CUDAGraphMode.FULL else None
        return BatchExecutionDescriptor(
            cg_mode=mode, num_tokens=size, num_reqs=num_reqs, num_active_loras=loras
        )

    def effective_loras(self, num_active_loras: int) -> int:
        """The captured LoRA case serving `num_active_loras` active adapters.

        Rounds up to the smallest captured case with at least that many, clamps above
        the largest; counts with no LoRA case captured (or 0) stay as they are, and a
        count no graph was captured for runs eager.
        """
        active = check_int(
            "CudaGraphDispatcher.effective_loras",
            "num_active_loras",
            num_active_loras,
            0,
            fix="pass the count of active LoRA adapters, an int >= 0",
        )
        return self._effective_loras(active)

    def _effective_loras(self, num_active_loras: int) -> int:
        """`effective_loras` of a count `dispatch` checked already."""
        with_lora = [c for c in self.lora_capture_cases if c > 0]
        if num_active_loras <= 0 or not with_lora:
            return num_active_loras
        return next((c for c in with_lora if c >= num_active_loras), with_lora[-1])

    def dispatch(
        self,
        num_reqs: int,
        num_tokens: int,
        uniform_token_count: int | None,
        num_active_loras: int = 0,
        max_query_len: int | None = None,
    ) -> BatchExecutionDescriptor:
        """The descriptor of the smallest captured graph that serves this batch, else eager.

        FULL graphs are preferred to PIECEWISE ones (they keep attention in the graph);
        within a mode the graph with the fewest tokens wins. A graph serves the batch
        when it has at least `num_tokens` tokens, pads to at least `num_reqs` requests
        (or does not pad), was captured for the batch's LoRA case, its uniform count
        (if any) equals `uniform_token_count`, and its query-length bound (if any) is
        at least `max_query_len`. Eager keeps the batch's own counts; zero tokens and
        batches above the largest graph run eager.
        """
        key = (num_reqs, num_tokens, uniform_token_count, num_active_loras, max_query_len)
        # Exact types before the memo: True and 1.0 hash like 1 and must be refused.
        exact = (
            type(num_reqs) is int
            and type(num_tokens) is int
            and type(num_active_loras) is int
            and (uniform_token_count is None or type(uniform_token_count) is int)
            and (max_query_len is None or type(max_query_len) is int)
        )
        if exact:
            known = self._answers.get(key)
            if known is not None:
                return known
        key = self._check_dispatch(*key)
        answer = self._dispatch(*key)
        if len(self._answers) >= _MAX_ANSWERS:
            self._answers.clear()
        self._answers[key] = answer
        return answer

    def _dispatch(
        self,
        num_reqs: int,
        num_tokens: int,
        uniform_token_count: int | None,
        num_active_loras: int,
        max_query_len: int | None,
    ) -> BatchExecutionDescriptor:
        loras = self._effective_loras(num_active_loras)
        if num_tokens > 0:
            for mode in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE):
                fitting = [
                    g
                    for g in self.graphs
                    if g.cg_mode is mode
                    and _serves(
                        g,
                        num_reqs=num_reqs,
                        num_tokens=num_tokens,
                        uniform_token_count=uniform_token_count,
                        loras=loras,
                        max_query_len=max_query_len,
                    )
                ]
                if fitting:
                    return min(fitting, key=lambda g: g.num_tokens)
        return BatchExecutionDescriptor(
            cg_mode=CUDAGraphMode.NONE,
            num_tokens=num_tokens,
            num_reqs=num_reqs,
            num_active_loras=loras,
        )

    def _check_dispatch(
        self,
        num_reqs: Any,
        num_tokens: Any,
        uniform_token_count: Any,
        loras: Any,
        max_query_len: Any,
    ) -> _DispatchKey:
        call = "CudaGraphDispatcher.dispatch"
        reqs = check_int(call, "num_reqs", num_reqs, 0, fix="counts are ints >= 0")
        tokens = check_int(call, "num_tokens", num_tokens, 0, fix="counts are ints >= 0")
        active = check_int(call, "num_active_loras", loras, 0, fix="counts are ints >= 0")
        if reqs > self.max_num_reqs:
            raise InvalidInputError(
                call,
                f"num_reqs={reqs} exceeds max_num_reqs={self.max_num_reqs}",
                "schedule at most max_num_reqs requests, or build the dispatcher with more",
            )
        uniform = check_optional_int(
            call,
            "uniform_token_count",
            uniform_token_count,
            1,
            fix="pass None when the batch is not a uniform decode",
        )
        query_len = check_optional_int(
            call,
            "max_query_len",
            max_query_len,
            1,
            fix="pass None when the batch has no query-length bound",
        )
        # A graph is looked for among the sizes at or above the tokens; a batch whose
        # requests need more tokens than it has would be padded past every graph vLLM
        # considers.
        check_requests_fit(call, reqs, tokens, uniform)
        return reqs, tokens, uniform, active, query_len


def _serves(
    graph: BatchExecutionDescriptor,
    *,
    num_reqs: int,
    num_tokens: int,
    uniform_token_count: int | None,
    loras: int,
    max_query_len: int | None,
) -> bool:
    return (
        graph.num_tokens >= num_tokens
        and (graph.num_reqs is None or graph.num_reqs >= num_reqs)
        and graph.num_active_loras == loras
        and (graph.uniform_token_count is None or graph.uniform_token_count == uniform_token_count)
        and (
            graph.max_query_len is None
            or (max_query_len is not None and max_query_len <= graph.max_query_len)
        )
    )
