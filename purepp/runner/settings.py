"""The settings of a run, validated before any process starts."""

from __future__ import annotations

import math

import attrs

from purepp.errors import ConfigError
from purepp.runner.workload import WorkloadConfig

__all__ = ["INTERPRETER_MODES", "MAX_SPECULATIVE_STEPS", "RunSettings"]

MAX_SPECULATIVE_STEPS = 7  # the toy drafter's longest useful proposal
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
        # The library's own guard; `purepp run` checks its options first, naming them.
        checks = (
            (self.pp >= 1, f"pp={self.pp}", "use at least 1 pipeline stage"),
            (self.dp >= 1, f"dp={self.dp}", "use at least 1 replica"),
            (
                self.pp <= self.num_layers,
                f"pp={self.pp} with num_layers={self.num_layers}",
                "use at most one stage per layer",
            ),
            (self.steps >= 0, f"steps={self.steps}", "use 0 (automatic) or more steps"),
            (self.requests >= 0, f"requests={self.requests}", "use 0 or more requests"),
            (
                0 <= self.spec <= MAX_SPECULATIVE_STEPS,
                f"spec={self.spec}",
                f"use 0..{MAX_SPECULATIVE_STEPS} speculative steps",
            ),
            (self.seed >= 0, f"seed={self.seed}", "use a seed of 0 or more"),
            (self.backend in ("gloo", "nccl"), f"backend={self.backend!r}", "use gloo or nccl"),
            (
                self.interpreter in INTERPRETER_MODES,
                f"interpreter={self.interpreter!r}",
                f"use one of {', '.join(INTERPRETER_MODES)}",
            ),
            (
                self.interpreter != "captured" or self.backend == "nccl",
                f"interpreter='captured' with backend={self.backend!r}",
                "capture CUDA graphs with the nccl backend (one GPU per rank)",
            ),
            (
                math.isfinite(self.timeout_s) and self.timeout_s > 0,
                f"timeout_s={self.timeout_s}",
                "use a finite, positive timeout",
            ),
        )
        for ok, value, fix in checks:
            if not ok:
                raise ConfigError("purepp run", f"{value} is out of range", fix)

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
        per_replica = -(-self.requests // self.dp)
        waves = -(-per_replica // self.max_num_reqs)
        per_request = (-(-w.max_prompt // self.chunk_size) + w.max_output) * self.pp
        return w.arrival_span + waves * per_request + 2 * self.pp
