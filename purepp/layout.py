"""The world of a run: how global ranks map onto pipeline stages and DP replicas.

It sits at the bottom with the vocabulary and the errors, so the matcher, the
simulator and the runner loop can name ranks without importing the effect log.
"""

from __future__ import annotations

import attrs

from purepp._checks import INT32_MAX, as_int
from purepp._text import a_type
from purepp.errors import ConfigError

__all__ = ["Layout"]


# Ranks are int32 everywhere downstream (headers, torch.distributed): a larger size is a typo.
_MAX_SIZE = INT32_MAX


def _at_least_one(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if type(value) is not int or value < 1:
        raise ConfigError(
            "Layout", f"{attribute.name} must be an integer >= 1, got {value!r}", "pass a size >= 1"
        )
    if value > _MAX_SIZE:
        raise ConfigError(
            "Layout",
            f"{attribute.name}={value} is past {_MAX_SIZE}",
            f"pass {attribute.name} in 1..{_MAX_SIZE}",
        )


def _index(call: str, name: str, value: object) -> int:
    """`value` when it is an int (a numpy integer too); a float or a bool is refused."""
    if type(value) is int:  # the common case first: the matcher asks per collective
        return value
    exact = as_int(value)  # a numpy integer
    if exact is not None:
        return exact
    raise ConfigError(
        call, f"{name}={value!r} is {a_type(value)}, not an int", f"pass {name} as an int"
    )


def _index_below(call: str, name: str, value: object, size: int) -> int:
    """`value` as an index in 0..size-1 (see `_index`)."""
    index = _index(call, name, value)
    if not 0 <= index < size:
        raise ConfigError(
            call, f"{name}={index} is outside 0..{size - 1}", f"pass {name} in 0..{size - 1}"
        )
    return index


@attrs.frozen
class Layout:
    """The world of a run: `dp` data-parallel replicas of a `pp`-stage pipeline.

    Global rank = dp_index * pp + pp_stage: a replica's stages are consecutive ranks,
    so rank 5 of pp=2, dp=4 is stage 1 of replica 2.
    """

    pp: int = attrs.field(validator=_at_least_one)  # pipeline stages per replica
    dp: int = attrs.field(validator=_at_least_one)  # data-parallel replicas

    def __attrs_post_init__(self) -> None:
        if self.pp * self.dp - 1 > _MAX_SIZE:  # the last global rank must be an int32 too
            raise ConfigError(
                "Layout",
                f"pp={self.pp} x dp={self.dp} ranks are past {_MAX_SIZE + 1}",
                f"pass a world of at most {_MAX_SIZE + 1} ranks",
            )

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    def pp_stage(self, rank: int) -> int:
        """The pipeline stage global `rank` runs (0 is the first stage)."""
        return self._check_rank("Layout.pp_stage", rank) % self.pp

    def dp_index(self, rank: int) -> int:
        """The data-parallel replica global `rank` belongs to."""
        return self._check_rank("Layout.dp_index", rank) // self.pp

    def rank_of(self, *, pp_stage: int, dp_index: int) -> int:
        """The global rank of stage `pp_stage` of replica `dp_index`."""
        pp_stage = _index("Layout.rank_of", "pp_stage", pp_stage)
        dp_index = _index("Layout.rank_of", "dp_index", dp_index)
        if not (0 <= pp_stage < self.pp and 0 <= dp_index < self.dp):
            raise ConfigError(
                "Layout.rank_of",
                f"pp_stage={pp_stage}, dp_index={dp_index} is outside pp={self.pp}, dp={self.dp}",
                f"pass 0 <= pp_stage < {self.pp} and 0 <= dp_index < {self.dp}",
            )
        return dp_index * self.pp + pp_stage

    def pipeline(self, dp_index: int) -> tuple[int, ...]:
        """Global ranks of replica `dp_index`'s stages, first stage first (PP groups)."""
        dp_index = _index_below("Layout.pipeline", "dp_index", dp_index, self.dp)
        return tuple(dp_index * self.pp + s for s in range(self.pp))

    def replicas(self, pp_stage: int) -> tuple[int, ...]:
        """Global ranks running stage `pp_stage` in every replica (DP groups)."""
        pp_stage = _index_below("Layout.replicas", "pp_stage", pp_stage, self.pp)
        return tuple(d * self.pp + pp_stage for d in range(self.dp))

    @property
    def pp_groups(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.pipeline(d) for d in range(self.dp))

    @property
    def dp_groups(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.replicas(s) for s in range(self.pp))

    def _check_rank(self, call: str, rank: int) -> int:
        rank = _index(call, "rank", rank)
        if not 0 <= rank < self.world_size:
            raise ConfigError(
                call,
                f"rank {rank} is outside a world of {self.world_size} (pp={self.pp}, dp={self.dp})",
                f"pass a global rank in 0..{self.world_size - 1}",
            )
        return rank
