"""Replay: feed a recorded log back through any interpreter, one decode step at a time."""

from __future__ import annotations

import itertools

from purepp._checks import check_interpreter
from purepp._text import a_type
from purepp.effects.interpreter import Interpreter
from purepp.effects.logmodel import EffectLog
from purepp.errors import InvalidInputError, PureppError

__all__ = ["replay"]


def replay(log: EffectLog, interpreter: Interpreter) -> None:
    """Feed `log`'s effects through `interpreter`, one `perform` call per decode step.

    A step is a run of consecutive records with the same `effect.step`, the batch a
    pure step function returned. Replaying into a `Recorder` reproduces `log`.
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
    for step, group in itertools.groupby(log.records, key=lambda record: record.effect.step):
        records = tuple(group)
        try:
            interpreter.perform(tuple(record.effect for record in records))
        except PureppError as error:
            # The interpreter names its own call; say where in the log it was.
            first, last = records[0].seq, records[-1].seq
            error.add_note(
                f"in replay: step {step} of rank {log.header.rank}'s log, records #{first} to "
                f"#{last} (file lines {first + 2} to {last + 2})"
            )
            raise
