"""The settings of a run, validated before any process starts."""

from __future__ import annotations

import math

import attrs

from purepp._checks import INT32_MAX, check_int, store_ints
from purepp._text import a_type
from purepp.cudagraph import CaptureMode, CudaGraphDispatcher
from purepp.errors import ConfigError
from purepp.relay import Wire
from purepp.runner.workload import WorkloadConfig

__all__ = [
    "COUNT_LIMITS",
    "INTERPRETER_MODES",
    "MAX_SPECULATIVE_STEPS",
    "MAX_TIMEOUT_S",
    "MIN_TIMEOUT_S",
    "RunSettings",
]

MAX_SPECULATIVE_STEPS = 7  # the toy drafter's longest useful proposal
MAX_TIMEOUT_S = 86_400.0  # a day; beyond it a "timeout" is a hang (and overflows gloo's)
MIN_TIMEOUT_S = 0.001  # a millisecond: the ranks' process groups count whole milliseconds
# The torch interpreter's modes (purepp.effects.torch_interpreter): the fast eager
# default, every effect validated, repeated batches run as plans, plans captured into
# CUDA graphs (nccl only).
INTERPRETER_MODES = ("eager", "checked", "plan", "captured")


@attrs.frozen(kw_only=True)
class RunSettings:
    """Everything a rank needs to run its part; equal on every rank."""

    pp: int = 2  # pipeline stages per replica
    dp: int = 2  # data-parallel replicas
    steps: int = 0  # decode steps; 0 picks enough for every request to finish
    requests: int = 24  # requests in the workload
    spec: int = 2  # speculative (draft) tokens per decode step
    seed: int = 0  # workload seed
    backend: str = "gloo"  # gloo (CPU) or nccl (one GPU per rank)
    timeout_s: float = 60.0  # a peer silent this long is reported dead
    num_layers: int = 8  # layers of the toy model, split across stages
    max_num_reqs: int = 8  # request slots per replica
    max_num_batched_tokens: int = 32  # token budget per step
    chunk_size: int = 8  # longest prefill chunk
    capture_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32)  # CUDA-graph token sizes
    validate_header: bool = False  # the relay's opt-in [step, n] header, checked by receivers
    wire: str = "seed"  # the relay's wire format: seed, packed or fixed (purepp.relay.Wire)
    overlap_agreement: bool = False  # start each step's DP agreement during the forward before
    interpreter: str = "eager"  # the torch interpreter's mode (INTERPRETER_MODES)

    def __attrs_post_init__(self) -> None:
        _check(self)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    @property
    def workload(self) -> WorkloadConfig:
        return WorkloadConfig(num_requests=self.requests, dp_size=self.dp, seed=self.seed)

    @property
    def max_model_len(self) -> int:
        w = self.workload
        return w.max_prompt + w.max_output + self.spec + 1

    @property
    def total_steps(self) -> int:
        """`steps`, or enough for every request of the workload to finish."""
        if self.steps:
            return self.steps
        w = self.workload
        # A request's next row waits for its last row's outputs: pp steps, one more when
        # the agreement runs a step ahead. It takes a row per prefill chunk and per token
        # (every draft rejected, at worst).
        latency = self.pp + (1 if self.overlap_agreement else 0)
        budget = self.max_num_batched_tokens
        chunk = min(self.chunk_size, budget)
        rounds = -(-w.max_prompt // chunk) + w.max_output
        # How many requests advance together: the slots, and the rows the budget holds
        # over one round trip.
        row = max(chunk, 1 + self.spec)
        together = max(1, min(self.max_num_reqs, latency * budget // row))
        per_replica = -(-self.requests // self.dp)
        waves = -(-per_replica // together)
        return w.arrival_span + waves * rounds * latency + 2 * latency


# Each count with its least and most values (`purepp run` checks its options by these).
# A run compares its tokens with the reference's: it needs a request at least.
COUNT_LIMITS: dict[str, tuple[int, int]] = {
    "pp": (1, INT32_MAX),
    "dp": (1, INT32_MAX),
    "steps": (0, INT32_MAX),
    "requests": (1, INT32_MAX),
    "spec": (0, MAX_SPECULATIVE_STEPS),
    "seed": (0, INT32_MAX),
    "num_layers": (1, INT32_MAX),
    "max_num_reqs": (1, INT32_MAX),
    "max_num_batched_tokens": (1, INT32_MAX),
    "chunk_size": (1, INT32_MAX),
}
_WIRES = tuple(wire.value for wire in Wire)


def _check(settings: RunSettings) -> None:
    """Every field's type and range, once, when the settings are built: a research runner
    that builds them by hand gets the error here, not from a rank process after launch.
    (`purepp run` checks its options first, naming its flags.)"""
    call = "RunSettings"

    def refuse(field: str, problem: str, fix: str) -> ConfigError:
        return ConfigError(call, f"{field}={getattr(settings, field)!r} {problem}", fix)

    for field, (low, high) in COUNT_LIMITS.items():  # stored as Python ints: numpy's wrap
        store_ints(
            settings,
            **{field: check_int(call, field, getattr(settings, field), low, high, config=True)},
        )
    if settings.max_num_batched_tokens < 1 + settings.spec:
        raise refuse(
            "max_num_batched_tokens",
            f"is below a decode row of 1 + spec={settings.spec} tokens",
            f"use a budget of {1 + settings.spec} tokens or more (or fewer speculative steps)",
        )
    if settings.pp > settings.num_layers:
        raise refuse(
            "pp", f"with num_layers={settings.num_layers}", "use at most one stage per layer"
        )
    timeout = settings.timeout_s
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise refuse("timeout_s", f"is {a_type(timeout)}", "pass a number of seconds")
    if not (math.isfinite(timeout) and MIN_TIMEOUT_S <= timeout <= MAX_TIMEOUT_S):
        fix = f"use a timeout of {MIN_TIMEOUT_S:g} to {MAX_TIMEOUT_S:g} s (a day)"
        raise refuse("timeout_s", "is out of range", fix)
    for field in ("validate_header", "overlap_agreement"):
        if type(getattr(settings, field)) is not bool:
            raise refuse(field, "is not a bool", "pass True or False")
    if settings.backend not in ("gloo", "nccl"):
        raise refuse("backend", "is not a backend", "use 'gloo' or 'nccl'")
    if settings.wire not in _WIRES:
        raise refuse("wire", "is not a wire format", f"use one of {', '.join(map(repr, _WIRES))}")
    if settings.interpreter not in INTERPRETER_MODES:
        fix = f"use one of {', '.join(map(repr, INTERPRETER_MODES))}"
        raise refuse("interpreter", "is not an interpreter mode", fix)
    if settings.interpreter == "captured" and settings.backend != "nccl":
        fix = "capture CUDA graphs with backend='nccl' (one GPU per rank), or use 'plan'"
        raise refuse("interpreter", f"with backend={settings.backend!r}", fix)
    # The rank's own dispatcher, built once here: its checks of the capture sizes.
    CudaGraphDispatcher(
        capture_sizes=settings.capture_sizes,
        capture_mode=CaptureMode.FULL_AND_PIECEWISE,
        max_num_reqs=settings.max_num_reqs,
        num_speculative_tokens=settings.spec,
    )
