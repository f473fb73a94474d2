"""Effect logs, one import path: the log's values, its files, the recorder, replay and diffs.

A log is a flight recorder: one JSON Lines file per rank, a header and then one
numbered record per effect. Each job lives in its own small module, re-exported here:

- `purepp.effects.logmodel`: `LogHeader`, `LogRecord`, `EffectLog`, `config_digest`;
- `purepp.effects.logfile`: `dump_log(s)`, `load_log(s)`, `LogStream` (the file format);
- `purepp.effects.recorder`: `Recorder`;
- `purepp.effects.replay`: `replay`, `placeholder_inputs`, `InputShapeError`;
- `purepp.effects.logdiff`: `diff_logs`, `assert_logs_equal`.

The world's `Layout` lives in `purepp.layout` and is re-exported here for old imports.
"""

from __future__ import annotations

from purepp.effects._converter import EFFECT_KINDS, kind_of
from purepp.effects.logdiff import assert_logs_equal, diff_logs
from purepp.effects.logfile import (
    LogStream,
    dump_log,
    dump_logs,
    header_json,
    load_log,
    load_logs,
    log_file_name,
    record_json,
)
from purepp.effects.logmodel import SCHEMA, EffectLog, LogHeader, LogRecord, config_digest
from purepp.effects.recorder import Recorder
from purepp.effects.replay import InputShapeError, placeholder_inputs, replay
from purepp.layout import Layout

__all__ = [
    "EFFECT_KINDS",
    "SCHEMA",
    "EffectLog",
    "InputShapeError",
    "Layout",
    "LogHeader",
    "LogRecord",
    "LogStream",
    "Recorder",
    "assert_logs_equal",
    "config_digest",
    "diff_logs",
    "dump_log",
    "dump_logs",
    "header_json",
    "kind_of",
    "load_log",
    "load_logs",
    "log_file_name",
    "placeholder_inputs",
    "record_json",
    "replay",
]
