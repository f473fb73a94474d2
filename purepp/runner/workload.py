"""A seeded workload: requests that arrive over time, prefill in chunks, decode,
speculate, finish exactly at their max tokens or are aborted mid-flight."""

from __future__ import annotations

import attrs
import numpy as np

from purepp._checks import check_int, store_ints
from purepp.errors import ConfigError

__all__ = ["Request", "Workload", "WorkloadConfig", "make_workload"]


@attrs.frozen(kw_only=True)
class Request:
    """One request of the workload."""

    request_id: int  # unique, also the order of admission at equal arrival steps
    replica: int  # the DP replica that serves it
    arrival_step: int  # first step at which it may be scheduled
    prompt: tuple[int, ...]  # prompt token ids
    max_tokens: int  # output tokens after which it finishes (exactly)
    abort_after_steps: int | None  # abort this many steps after its first decode, or never


@attrs.frozen(kw_only=True)
class WorkloadConfig:
    """What the generator varies."""

    num_requests: int = 24  # requests in all
    dp_size: int = 1  # replicas the requests are spread over
    vocab_size: int = 1000  # token ids are in 0..vocab_size-1
    min_prompt: int = 3  # shortest prompt
    max_prompt: int = 40  # longest prompt (prefills in several chunks)
    min_output: int = 1  # fewest output tokens
    max_output: int = 24  # most output tokens
    arrival_span: int = 12  # arrivals spread over steps 0..arrival_span-1
    abort_fraction: float = 0.25  # share of requests aborted while in flight
    seed: int = 0  # everything above is drawn from this

    def __attrs_post_init__(self) -> None:
        call = "WorkloadConfig"
        for name, low in _COUNTS:  # stored as Python ints: numpy's would wrap
            store_ints(self, **{name: check_int(call, name, getattr(self, name), low, config=True)})
        if self.min_prompt > self.max_prompt or self.min_output > self.max_output:
            raise ConfigError(
                call,
                f"prompt {self.min_prompt}..{self.max_prompt}, "
                f"output {self.min_output}..{self.max_output}",
                "use 1 <= min <= max for prompt and output lengths",
            )
        share = self.abort_fraction
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 1:
            raise ConfigError(call, f"abort_fraction={share!r}", "pass a share in 0..1")


# Each count with its least value (a workload of no requests is a workload).
_COUNTS = (
    ("num_requests", 0),
    ("dp_size", 1),
    ("vocab_size", 1),
    ("min_prompt", 1),
    ("max_prompt", 1),
    ("min_output", 1),
    ("max_output", 1),
    ("arrival_span", 1),
    ("seed", 0),
)


@attrs.frozen(kw_only=True)
class Workload:
    """The requests of one run, replicated on every rank."""

    vocab_size: int  # token ids are in 0..vocab_size-1
    requests: tuple[Request, ...]  # ordered by request_id

    def for_replica(self, replica: int) -> tuple[Request, ...]:
        return tuple(r for r in self.requests if r.replica == replica)


def make_workload(config: WorkloadConfig) -> Workload:
    """Draw a workload. Aborts land at every offset inside the ring (0, 1, 2, ...
    steps after a decode), so a freed slot is reused while a receive for its old
    request may still be pending."""
    rng = np.random.default_rng(config.seed)
    requests = []
    for request_id in range(config.num_requests):
        prompt_len = int(rng.integers(config.min_prompt, config.max_prompt + 1))
        aborted = rng.random() < config.abort_fraction
        requests.append(
            Request(
                request_id=request_id,
                replica=request_id % config.dp_size,
                arrival_step=int(rng.integers(0, config.arrival_span)),
                prompt=tuple(int(t) for t in rng.integers(0, config.vocab_size, prompt_len)),
                max_tokens=int(rng.integers(config.min_output, config.max_output + 1)),
                abort_after_steps=request_id % 5 if aborted else None,
            )
        )
    return Workload(vocab_size=config.vocab_size, requests=tuple(requests))
