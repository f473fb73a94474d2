"""The effect log's values: a header, numbered records, and one rank's whole log.

A record is numbered twice: `seq` counts this rank's effects from 0; `comm_seq`
counts the collectives (`COLLECTIVES`: broadcasts and all-reduces) issued on the
effect's communicator from 0, and is None for every other effect. Ranks of one
communicator must agree on what each `comm_seq` is, so lining up the ranks' logs by
(communicator, comm_seq) shows at once which collective diverged and at which step
(the NCCL flight recorder's ids do not line up across ranks; these do by construction).
`Numbering` is the one rule the writer and every reader use to hand those out.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Final

import attrs

from purepp._text import a_type
from purepp.effects._converter import (
    EFFECT_CLASSES,
    JSONObject,
    canonical_json,
    freeze_json_object,
    kind_of,
)
from purepp.effects.vocabulary import COLLECTIVES, Communicator, Effect
from purepp.errors import ConfigError, InvalidInputError
from purepp.layout import Layout

__all__ = [
    "SCHEMA",
    "EffectLog",
    "LogHeader",
    "LogRecord",
    "Numbering",
    "communicator_of",
    "config_digest",
    "numbering_problem",
]

# The format version this package writes and the only one it reads.
SCHEMA: Final = "purepp.effects/2"


def config_digest(config: JSONObject) -> str:
    """A stable digest of a header's config: equal configs (as JSON) give equal digests.

    Written in the header beside the config, so a log whose config was edited after
    the run, or logs of differently configured runs mixed in one folder, are caught.
    """
    text = canonical_json(freeze_json_object(config, call="config_digest"))
    return "sha256:" + hashlib.sha256(text.encode("ascii")).hexdigest()[:16]


def _freeze_config(config: JSONObject) -> JSONObject:
    return freeze_json_object(config)


def _same_json(a: JSONObject, b: JSONObject) -> bool:
    return canonical_json(a) == canonical_json(b)


def _optional_text(instance: object, attribute: attrs.Attribute[str | None], value: object) -> None:
    if value is not None and (type(value) is not str or not value):
        raise ConfigError(
            "LogHeader", f"{attribute.name} is {value!r}", "pass a non-empty string or None"
        )


@attrs.frozen(kw_only=True)
class LogHeader:
    """Who wrote a log, in which world, under which configuration, in which run."""

    rank: int  # global rank that wrote the log (see Layout for the numbering)
    world: Layout  # the run's PP x DP layout
    # free-form run configuration; compared as JSON, so equal headers dump identically
    config: JSONObject = attrs.field(
        factory=dict,
        converter=_freeze_config,
        eq=attrs.cmp_using(eq=_same_json),
        hash=False,
    )
    # the run's id, equal in every rank's header; None in logs written before run ids
    run_id: str | None = attrs.field(default=None, validator=_optional_text)
    # config_digest(config) when the log was written; None when not recorded
    config_digest: str | None = attrs.field(default=None, validator=_optional_text)

    def __attrs_post_init__(self) -> None:
        digest = self.config_digest
        if digest is not None and digest != config_digest(self.config):
            # Written, it would never read back: the reader takes it for an edited config.
            raise ConfigError(
                "LogHeader",
                f"config_digest={digest!r} is not its config's digest "
                f"({config_digest(self.config)!r})",
                "leave config_digest out, or build the header with LogHeader.for_run",
            )
        if not isinstance(self.world, Layout):
            raise ConfigError(
                "LogHeader",
                f"world is {a_type(self.world)}",
                "pass the run's Layout(pp=..., dp=...)",
            )
        if type(self.rank) is not int:  # a bool or a numpy integer is no rank of a header
            raise ConfigError(
                "LogHeader",
                f"rank {self.rank!r} is {a_type(self.rank)}, not an int",
                f"pass the global rank as an int in 0..{self.world.world_size - 1} "
                "(int(rank) for a numpy integer)",
            )
        if not 0 <= self.rank < self.world.world_size:
            raise ConfigError(
                "LogHeader",
                f"rank {self.rank!r} is outside a world of {self.world.world_size} "
                f"(pp={self.world.pp}, dp={self.world.dp})",
                f"pass a global rank in 0..{self.world.world_size - 1}",
            )

    @classmethod
    def for_run(cls, *, rank: int, world: Layout, config: JSONObject, run_id: str) -> LogHeader:
        """A header carrying `run_id` and the digest of `config` (what a run writes)."""
        return cls(
            rank=rank,
            world=world,
            config=config,
            run_id=run_id,
            config_digest=config_digest(config),
        )

    @property
    def pp_stage(self) -> int:
        return self.world.pp_stage(self.rank)

    @property
    def dp_index(self) -> int:
        return self.world.dp_index(self.rank)


@attrs.frozen(kw_only=True)
class LogRecord:
    """One performed effect with its place in the rank's and the communicator's order."""

    seq: int  # index among this rank's effects, from 0
    comm_seq: int | None  # index among the collectives on the effect's communicator, or None
    effect: Effect  # the effect itself (it carries its step and op)


def communicator_of(effect: Effect) -> Communicator | None:
    """The communicator a collective runs over; None for every other effect."""
    return effect.comm if isinstance(effect, COLLECTIVES) else None


class Numbering:
    """Hands out (seq, comm_seq) in issue order; the one rule both writer and reader use."""

    def __init__(
        self, next_seq: int = 0, next_comm_seq: dict[Communicator, int] | None = None
    ) -> None:
        self._next_seq = next_seq
        self._next_comm_seq = {} if next_comm_seq is None else dict(next_comm_seq)

    def copy(self) -> Numbering:
        return Numbering(self._next_seq, self._next_comm_seq)

    @property
    def next_seq(self) -> int:
        """The `seq` the next record gets."""
        return self._next_seq

    def expect(self, effect: Effect) -> tuple[int, int | None]:
        """(seq, comm_seq) for `effect` as the next record, as `number` gives (no record)."""
        seq = self._next_seq
        self._next_seq = seq + 1
        if not isinstance(effect, COLLECTIVES):
            return seq, None
        comm_seq = self._next_comm_seq.get(effect.comm, 0)
        self._next_comm_seq[effect.comm] = comm_seq + 1
        return seq, comm_seq

    def skip_local(self) -> None:
        """Count one record that is not a collective, without building it."""
        self._next_seq += 1

    def number(self, effect: Effect) -> LogRecord:
        """`effect` as the next record."""
        seq, comm_seq = self.expect(effect)
        return LogRecord(seq=seq, comm_seq=comm_seq, effect=effect)


def numbering_problem(record: LogRecord, expected: LogRecord) -> str | None:
    """Why `record`'s numbers are not the ones issue order gives, or None."""
    if record.seq != expected.seq:
        return (
            f"seq is {json.dumps(record.seq)}, expected {expected.seq}: records count up from 0 "
            "without gaps (a record is missing, repeated or out of order)"
        )
    if record.comm_seq == expected.comm_seq and type(record.comm_seq) is type(expected.comm_seq):
        return None
    comm = communicator_of(record.effect)
    if comm is None:
        return (
            f"comm_seq is {json.dumps(record.comm_seq)}, expected null: "
            f"a {kind_of(record.effect)} effect is not a collective"
        )
    return (
        f"comm_seq is {json.dumps(record.comm_seq)}, expected {expected.comm_seq}: "
        f"this is collective number {expected.comm_seq} (from 0) on communicator {comm.value}"
    )


def _check_records(
    instance: EffectLog,
    attribute: attrs.Attribute[tuple[LogRecord, ...]],
    records: tuple[LogRecord, ...],
) -> None:
    numbering = Numbering()
    for index, record in enumerate(records):
        if not isinstance(record, LogRecord) or not isinstance(record.effect, EFFECT_CLASSES):
            raise InvalidInputError(
                "EffectLog", f"record {index} is {record!r}", "pass LogRecords of effects"
            )
        problem = numbering_problem(record, numbering.number(record.effect))
        if problem is not None:
            raise InvalidInputError(
                "EffectLog",
                f"record {index}: {problem}",
                "build logs with EffectLog.from_effects or a Recorder",
            )


def _to_records(records: Iterable[LogRecord]) -> tuple[LogRecord, ...]:
    if not isinstance(records, Iterable):
        raise InvalidInputError(
            "EffectLog", f"records is {a_type(records)}", "pass a tuple of LogRecords"
        )
    return tuple(records)


def _check_header(instance: object, attribute: attrs.Attribute[LogHeader], value: object) -> None:
    if not isinstance(value, LogHeader):
        raise InvalidInputError(
            "EffectLog", f"header is {a_type(value)}", "pass the rank's LogHeader"
        )


@attrs.frozen
class EffectLog:
    """One rank's header and effects, numbered in issue order (checked on construction)."""

    header: LogHeader = attrs.field(validator=_check_header)  # who wrote it, in which world
    records: tuple[LogRecord, ...] = attrs.field(converter=_to_records, validator=_check_records)

    @classmethod
    def from_effects(cls, header: LogHeader, effects: Iterable[Effect]) -> EffectLog:
        """The log of performing `effects` in order (what a Recorder would record)."""
        numbering = Numbering()
        if not isinstance(effects, Iterable):
            raise InvalidInputError(
                "EffectLog.from_effects",
                f"effects is {a_type(effects)}",
                "pass a tuple of effects from purepp.effects.vocabulary",
            )
        return cls(header, tuple(numbering.number(effect) for effect in effects))

    @property
    def effects(self) -> tuple[Effect, ...]:
        return tuple(record.effect for record in self.records)
