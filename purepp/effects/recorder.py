"""The recorder: an interpreter that writes a flight-recorder log of what it is asked to do."""

from __future__ import annotations

import os

from purepp._checks import check_interpreter
from purepp._text import a_type
from purepp.effects.interpreter import Interpreter
from purepp.effects.logfile import as_path, header_json, load_log, os_reason, record_lines
from purepp.effects.logmodel import EffectLog, LogHeader, LogRecord, Numbering
from purepp.effects.vocabulary import Effect, effect_batch
from purepp.errors import InvalidInputError

__all__ = ["Recorder"]


class Recorder:
    """An interpreter that numbers and records every effect, then forwards it to `inner`.

    Effects are recorded (and, with `path`, written and flushed) *before* `inner`
    performs them, so when a run fails or hangs inside `inner` the log still ends
    with the effects it was attempting: the flight-recorder reading of a hang.
    With no `inner` it only records. With `path`, the file is at every moment a
    valid log of what has been recorded, byte for byte what `dump_log(recorder.log)`
    would write (a kill mid-write leaves a cut last line, which `purepp check` reads
    up to the cut), and the records live there only: memory stays flat over a long run,
    and `log` reads the file back.
    """

    def __init__(
        self,
        header: LogHeader,
        inner: Interpreter | None = None,
        *,
        path: str | os.PathLike[str] | None = None,
    ) -> None:
        if not isinstance(header, LogHeader):
            raise InvalidInputError("Recorder", f"header is {a_type(header)}", "pass a LogHeader")
        if inner is not None:
            check_interpreter(
                "Recorder",
                "inner",
                inner,
                fix="pass an Interpreter to forward the effects to, or None to only record",
            )
        self._header = header
        self._inner = inner
        self._path = None if path is None else as_path("Recorder", "path", path)
        self._numbering = Numbering()
        # Held in memory only without a path; with one, the file holds them.
        self._records: list[LogRecord] = []
        self._count = 0  # records recorded, the next one's index
        if self._path is not None:
            try:
                self._path.write_text(header_json(header) + "\n", encoding="ascii")
            except (OSError, ValueError) as error:  # ValueError: a NUL in the path
                raise InvalidInputError(
                    "Recorder",
                    f"path={str(path)!r} cannot be written ({os_reason(error)})",
                    "pass a file path in an existing folder this process may write to",
                ) from error

    @property
    def header(self) -> LogHeader:
        return self._header

    @property
    def log(self) -> EffectLog:
        """Everything recorded so far (read back from the file, when writing one)."""
        if self._path is not None:
            return load_log(self._path)
        return EffectLog(self._header, tuple(self._records))

    def perform(self, effects: tuple[Effect, ...], /) -> None:
        """Record `effects` in order, then have the inner interpreter perform them."""
        effects = effect_batch("Recorder.perform", effects)  # read twice: a generator too
        # Numbered on a copy first, so a failure leaves the recorder as it was.
        numbering = self._numbering.copy()
        new_records = [numbering.number(effect) for effect in effects]
        if self._path is not None:
            lines = record_lines("Recorder.perform", new_records, self._count)
            with self._path.open("a", encoding="ascii") as file:
                file.write("".join(lines))
        else:
            self._records.extend(new_records)
        self._numbering = numbering
        self._count += len(new_records)
        if self._inner is not None:
            self._inner.perform(effects)
