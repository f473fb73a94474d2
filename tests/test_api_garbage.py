"""The public entry points outside `purepp.dp` and `purepp.relay` take no garbage either.

`tests/test_dp_garbage.py` and `tests/test_relay_input.py` cover the agreement, the
relay and the rank phases `begin`, `agree`, `finish`. This file covers the rest a
user calls with their own values: the other rank phases and `RankDriver`, the tensor
seams, both interpreters, the effect logs, the checker, the simulator, `Layout`, the
scripted schedules and the dispatcher's LoRA rounding. Each bad call raises a typed
`PureppError` naming the call, the value and the fix (never a raw TypeError,
AttributeError, KeyError or AssertionError, never a silent acceptance), and leaves
the state or the file it was given as it was.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from purepp.batch import BatchFacts, need_sampled_mask
from purepp.cudagraph import CaptureMode, CudaGraphDispatcher
from purepp.dp import RankBatch, agree_across_ranks
from purepp.effects.checker import check_log_dir, check_logs
from purepp.effects.io import NumpyIO, TorchIO
from purepp.effects.keyed import KeyedEffects
from purepp.effects.log import (
    EffectLog,
    LogHeader,
    LogStream,
    Recorder,
    assert_logs_equal,
    config_digest,
    diff_logs,
    dump_log,
    dump_logs,
    header_json,
    kind_of,
    load_log,
    load_logs,
    log_file_name,
    record_json,
    replay,
)
from purepp.effects.numpy_interpreter import NumpyInterpreter, describe_effect
from purepp.effects.simulator import simulate
from purepp.effects.torch_interpreter import TorchInterpreter
from purepp.effects.vocabulary import (
    Allocate,
    BufferRef,
    Communicator,
    DType,
    Effect,
    Op,
    Release,
    Stream,
)
from purepp.errors import ConfigError, InvalidInputError, LogFormatError, PureppError
from purepp.layout import Layout
from purepp.rank import (
    Agreed,
    Begun,
    RankConfig,
    RankDriver,
    RankSteps,
    Sampled,
    ShapeFacts,
    agree,
    begin,
    finish,
    init_rank,
    perform_phase,
    settle,
    start_agreement_phase,
    start_next_agreement,
)
from purepp.relay import RelayConfig
from purepp.testing import (
    RecordingTensors,
    ScheduleConfig,
    TorchTensors,
    assert_effect_sequence,
    drive,
    make_schedule,
    rank_config,
    record_scripted_logs,
    record_scripted_rank,
    reduced_agreement_table,
    scripted_header,
    scripted_program,
    scripted_rank_effects,
    simulate_schedule,
)
from tests.strategies import UNREADABLE_ARRAYS

CONFIG = RelayConfig.for_stage(pp_size=2, stage=0, max_num_reqs=4, num_speculative_steps=1)
RANK = RankConfig(relay=CONFIG)
SOLO = RelayConfig.for_stage(pp_size=1, stage=0, max_num_reqs=4, first_rank=0)  # a lone rank
BATCH = BatchFacts(
    idx_mapping=[0, 2], num_computed_tokens=[4, 0], num_scheduled_tokens=[1, 2], prefill_len=[4, 8]
)
SHAPE = ShapeFacts(num_tokens=3, need_eager=True)  # no dispatcher: a profile run
STATE = init_rank(RANK)
SCHEDULE = make_schedule(ScheduleConfig(pp=2, dp=1, spec=1, steps=3, seed=0))
DP_SCHEDULE = make_schedule(ScheduleConfig(pp=1, dp=2, spec=0, steps=2, seed=0))
LOGS = record_scripted_logs(SCHEDULE)
HEADER = LOGS[0].header
CPU = torch.device("cpu")
REF = BufferRef("probe")
STEP_ONE = Allocate(
    step=0,
    op=Op.RECEIVE,
    stream=Stream.MAIN,
    buffer=BufferRef("made"),
    shape=(2,),
    dtype=DType.INT32,
)


def interpreter() -> NumpyInterpreter:
    made = NumpyInterpreter()
    made.bind(CONFIG.inputs.draft_table, np.zeros((4, 1), np.int64))
    return made


def io() -> NumpyIO:
    return NumpyIO(interpreter())  # a stage-0 caller binds its draft table first


def run(phase: Any) -> Any:
    return perform_phase(phase, interpreter())


BEGUN = run(begin(RANK, STATE))
STARTED = run(start_agreement_phase(RANK, BEGUN, BATCH, SHAPE))
AGREED = run(agree(RANK, BEGUN, BATCH, SHAPE, io()))


def torch_interpreter(**kwargs: Any) -> TorchInterpreter:
    return TorchInterpreter(**{"device": CPU, "groups": {}, "rank": 0, **kwargs})


DISPATCHER = CudaGraphDispatcher(
    capture_sizes=(1, 2, 4),
    capture_mode=CaptureMode.FULL,
    max_num_reqs=4,
    lora_capture_cases=(0, 2, 4),
)

DP_BATCH = RankBatch(num_reqs=1, num_tokens=1)

CYCLIC: dict[str, object] = {}
CYCLIC["self"] = CYCLIC
CYCLIC_LIST: list[object] = []
CYCLIC_LIST.append(CYCLIC_LIST)
DEEP: dict[str, object] = {}
_level = DEEP
for _ in range(5000):
    _level["a"] = _level = {}

# (the bad call, the typed error it raises, a fragment of its message naming the value)
Case = tuple[Callable[[], object], type[PureppError], str]

CASES: dict[str, Case] = {
    # -- the rank step ---------------------------------------------------------------------
    "RankSteps field": (
        lambda: RankSteps(receive="receive"),  # type: ignore[arg-type]
        ConfigError,
        "RankSteps: receive='receive' is not callable",
    ),
    "need_sampled_mask batch": (
        lambda: need_sampled_mask([0, 1]),  # type: ignore[arg-type]
        InvalidInputError,
        "need_sampled_mask: batch is a list",
    ),
    "describe_effect effect": (
        lambda: describe_effect("allocate"),  # type: ignore[arg-type]
        InvalidInputError,
        "describe_effect: effect is a str",
    ),
    "agree_across_ranks live_ranks outside": (
        lambda: agree_across_ranks(DISPATCHER, [DP_BATCH, DP_BATCH], live_ranks=[1, 5]),
        ConfigError,
        "live_ranks=[1, 5] names 5, not a rank of 0..1",
    ),
    "agree_across_ranks live_ranks empty": (
        lambda: agree_across_ranks(DISPATCHER, [DP_BATCH, DP_BATCH], live_ranks=[]),
        ConfigError,
        "agree_across_ranks: live_ranks is empty",
    ),
    "RankConfig dispatcher": (
        lambda: RankConfig(relay=CONFIG, dispatcher="graphs"),  # type: ignore[arg-type]
        InvalidInputError,
        "RankConfig: dispatcher is a str, which has no dispatch",
    ),
    "RankConfig drafter_dispatcher": (
        lambda: RankConfig(relay=CONFIG, drafter_dispatcher=3),  # type: ignore[arg-type]
        InvalidInputError,
        "drafter_dispatcher is an int",
    ),
    "settle begun": (
        lambda: run(settle(RANK, "begun", io())),  # type: ignore[arg-type]
        InvalidInputError,
        "settle: begun is a str",
    ),
    "settle config": (
        lambda: run(settle("config", STARTED, io())),  # type: ignore[arg-type]
        InvalidInputError,
        "settle: config is a str",
    ),
    "settle io": (
        lambda: run(settle(RANK, STARTED, "io")),  # type: ignore[arg-type]
        InvalidInputError,
        "settle: io is a str",
    ),
    "begin steps": (
        lambda: run(begin(RANK, STATE, "steps")),  # type: ignore[arg-type]
        InvalidInputError,
        "begin: steps is a str",
    ),
    "agree steps": (
        lambda: run(agree(RANK, BEGUN, BATCH, SHAPE, io(), steps=None)),  # type: ignore[arg-type]
        InvalidInputError,
        "agree: steps is a NoneType",
    ),
    "start_agreement_phase steps": (
        lambda: run(start_agreement_phase(RANK, BEGUN, BATCH, SHAPE, steps=1)),  # type: ignore[arg-type]
        InvalidInputError,
        "start_agreement_phase: steps is an int",
    ),
    "start_next_agreement steps": (
        lambda: run(start_next_agreement(RANK, AGREED, BATCH, SHAPE, steps=1)),  # type: ignore[arg-type]
        InvalidInputError,
        "start_next_agreement: steps is an int",
    ),
    "settle steps": (
        lambda: run(settle(RANK, STARTED, io(), steps="x")),  # type: ignore[arg-type]
        InvalidInputError,
        "settle: steps is a str",
    ),
    "finish steps": (
        lambda: run(finish(RANK, AGREED, io(), None, 3)),  # type: ignore[arg-type]
        InvalidInputError,
        "finish: steps is an int",
    ),
    "perform_phase phase": (
        lambda: perform_phase("phase", interpreter()),  # type: ignore[arg-type]
        InvalidInputError,
        "perform_phase: phase is a str, not a generator",
    ),
    "perform_phase interpreter": (
        lambda: perform_phase(finish(RANK, AGREED, io()), "interpreter"),  # type: ignore[arg-type]
        InvalidInputError,
        "perform_phase: interpreter is a str",
    ),
    "RankDriver interpreter": (
        lambda: RankDriver(RANK, "interpreter", io()),  # type: ignore[arg-type]
        InvalidInputError,
        "RankDriver: interpreter is a str, which has no perform",
    ),
    "RankDriver config": (
        lambda: RankDriver("config", interpreter(), io()),  # type: ignore[arg-type]
        InvalidInputError,
        "RankDriver: config is a str",
    ),
    "RankDriver io": (
        lambda: RankDriver(RANK, interpreter(), None),  # type: ignore[arg-type]
        InvalidInputError,
        "RankDriver: io is a NoneType",
    ),
    "RankDriver steps": (
        lambda: RankDriver(RANK, interpreter(), io(), steps="x"),  # type: ignore[arg-type]
        InvalidInputError,
        "RankDriver: steps is a str",
    ),
    # -- the tensor seams ------------------------------------------------------------------
    "NumpyIO interpreter": (
        lambda: NumpyIO("interpreter"),  # type: ignore[arg-type]
        InvalidInputError,
        "NumpyIO: interpreter is a str",
    ),
    "NumpyIO.upload str": (
        lambda: io().upload("abc"),  # type: ignore[arg-type]
        InvalidInputError,
        "NumpyIO.upload: values is a str, not an int32 array",
    ),
    "NumpyIO.upload float": (
        lambda: io().upload(np.zeros(2)),  # type: ignore[arg-type]
        InvalidInputError,
        "values is a float64 array, not an int32 array",
    ),
    "NumpyIO.upload int64": (
        lambda: io().upload(np.zeros(2, np.int64)),
        InvalidInputError,
        "NumpyIO.upload: values is an int64 array, not an int32 array",
    ),
    "TorchIO interpreter": (
        lambda: TorchIO(NumpyInterpreter()),  # type: ignore[arg-type]
        InvalidInputError,
        "TorchIO: interpreter is a NumpyInterpreter",
    ),
    "TorchIO.upload str": (
        lambda: TorchIO(torch_interpreter()).upload(np.array(["a"])),
        InvalidInputError,
        "TorchIO.upload: values is a <U1",
    ),
    # -- the numpy interpreter -------------------------------------------------------------
    "NumpyInterpreter rank": (
        lambda: NumpyInterpreter(rank="0"),  # type: ignore[arg-type]
        ConfigError,
        "NumpyInterpreter: rank='0' is a str",
    ),
    "NumpyInterpreter negative rank": (
        lambda: NumpyInterpreter(rank=-1),
        ConfigError,
        "rank=-1 is outside",
    ),
    "NumpyInterpreter fill": (
        lambda: NumpyInterpreter(fill=1.5),  # type: ignore[arg-type]
        ConfigError,
        "fill=1.5 is a float",
    ),
    "NumpyInterpreter fill past int32": (
        lambda: NumpyInterpreter(fill=2**40),
        ConfigError,
        f"fill={2**40} is outside",
    ),
    "NumpyInterpreter port": (
        lambda: NumpyInterpreter(port="port"),  # type: ignore[arg-type]
        ConfigError,
        "port is a str, not a CollectivePort",
    ),
    "NumpyInterpreter.bind None": (
        lambda: NumpyInterpreter().bind(None, np.zeros(2, np.int64)),  # type: ignore[arg-type]
        InvalidInputError,
        "NumpyInterpreter.bind: the name None is a NoneType, not a BufferRef",
    ),
    "NumpyInterpreter.bind plain str": (
        lambda: NumpyInterpreter().bind("x", np.zeros(2, np.int64)),  # type: ignore[arg-type]
        InvalidInputError,
        "the name 'x' is a str, not a BufferRef",
    ),
    "NumpyInterpreter.bind ragged": (
        lambda: NumpyInterpreter().bind(REF, [[1], [1, 2]]),
        InvalidInputError,
        "NumpyInterpreter.bind: the value for 'probe' is a list that numpy cannot read",
    ),
    "NumpyInterpreter.tensor str": (
        lambda: NumpyInterpreter().tensor("nope"),  # type: ignore[arg-type]
        InvalidInputError,
        "NumpyInterpreter.tensor: the name 'nope' is a str",
    ),
    "NumpyInterpreter.host_array int": (
        lambda: NumpyInterpreter().host_array(3),  # type: ignore[arg-type]
        InvalidInputError,
        "the name 3 is an int",
    ),
    "NumpyInterpreter.host_array list": (
        lambda: NumpyInterpreter().host_array([1]),  # type: ignore[arg-type]
        InvalidInputError,
        "the name [1] is a list",
    ),
    "NumpyInterpreter.event_completed str": (
        lambda: NumpyInterpreter().event_completed("e"),  # type: ignore[arg-type]
        InvalidInputError,
        "the name 'e' is a str, not an EventRef",
    ),
    "NumpyInterpreter.perform int": (
        lambda: NumpyInterpreter().perform(3),  # type: ignore[arg-type]
        InvalidInputError,
        "NumpyInterpreter.perform: effects is an int",
    ),
    "NumpyInterpreter.perform a non-effect": (
        lambda: NumpyInterpreter().perform((None,)),  # type: ignore[arg-type]
        InvalidInputError,
        "NumpyInterpreter.perform: effects[0] is None, a NoneType",
    ),
    "NumpyInterpreter.perform a str": (
        lambda: NumpyInterpreter().perform("ab"),  # type: ignore[arg-type]
        InvalidInputError,
        "effects is a str",
    ),
    "NumpyInterpreter.issue a str": (
        lambda: NumpyInterpreter().issue("x"),  # type: ignore[arg-type]
        InvalidInputError,
        "NumpyInterpreter.issue: 'x' is a str, not an effect",
    ),
    # -- the torch interpreter (CPU) -------------------------------------------------------
    "TorchInterpreter device str": (
        lambda: torch_interpreter(device="cpu"),
        ConfigError,
        "TorchInterpreter: device='cpu' is a str",
    ),
    "TorchInterpreter groups None": (
        lambda: torch_interpreter(groups=None),
        ConfigError,
        "groups is a NoneType",
    ),
    "TorchInterpreter groups of strings": (
        lambda: torch_interpreter(groups={Communicator.DP_CPU: "group"}),
        ConfigError,
        "groups maps <Communicator.DP_CPU",
    ),
    "TorchInterpreter rank str": (
        lambda: torch_interpreter(rank="0"),
        ConfigError,
        "rank='0' is a str",
    ),
    "TorchInterpreter rank float": (
        lambda: torch_interpreter(rank=1.5),
        ConfigError,
        "rank=1.5 is a float",
    ),
    "TorchInterpreter checked": (
        lambda: torch_interpreter(checked="no"),
        ConfigError,
        "checked='no' is a str",
    ),
    "TorchInterpreter plans": (
        lambda: torch_interpreter(plans=1),
        ConfigError,
        "plans=1 is an int",
    ),
    "TorchInterpreter capture_copies str": (
        lambda: torch_interpreter(capture_copies="3"),
        ConfigError,
        "capture_copies='3' is a str",
    ),
    "TorchInterpreter capture_copies bool": (
        lambda: torch_interpreter(capture_copies=True),
        ConfigError,
        "capture_copies=True is a bool",
    ),
    "TorchInterpreter.bind a numpy array": (
        lambda: torch_interpreter().bind(REF, np.zeros(2, np.int64)),  # type: ignore[arg-type]
        InvalidInputError,
        "TorchInterpreter.bind: 'probe' got a ndarray, not a torch.Tensor",
    ),
    "TorchInterpreter.bind str ref": (
        lambda: torch_interpreter().bind("x", torch.zeros(2)),  # type: ignore[arg-type]
        InvalidInputError,
        "the name 'x' is a str, not a BufferRef",
    ),
    "TorchInterpreter.tensor str": (
        lambda: torch_interpreter().tensor("x"),  # type: ignore[arg-type]
        InvalidInputError,
        "TorchInterpreter.tensor: the name 'x' is a str",
    ),
    "TorchInterpreter.replace_dp_groups None": (
        lambda: torch_interpreter().replace_dp_groups(None),  # type: ignore[arg-type]
        ConfigError,
        "TorchInterpreter.replace_dp_groups: groups is a NoneType",
    ),
    "TorchInterpreter.replace_dp_groups a relay communicator": (
        lambda: torch_interpreter().replace_dp_groups({Communicator.PP_RELAY: None}),  # type: ignore[dict-item]
        ConfigError,
        "groups maps ['pp_relay'], not exactly dp_cpu and dp_drafter_cpu",
    ),
    "TorchInterpreter.replace_dp_groups strings": (
        lambda: torch_interpreter().replace_dp_groups(
            {Communicator.DP_CPU: "g", Communicator.DP_DRAFTER_CPU: "g"}  # type: ignore[dict-item]
        ),
        ConfigError,
        "groups maps dp_cpu to a str",
    ),
    "TorchInterpreter.perform int": (
        lambda: torch_interpreter().perform(3),  # type: ignore[arg-type]
        InvalidInputError,
        "effects is an int",
    ),
    "TorchInterpreter.perform a non-effect": (
        lambda: torch_interpreter().perform((None,)),  # type: ignore[arg-type]
        InvalidInputError,
        "effects[0] is None, a NoneType, not an effect",
    ),
    "TorchInterpreter.perform a str": (
        lambda: torch_interpreter().perform("ab"),  # type: ignore[arg-type]
        InvalidInputError,
        "effects is a str",
    ),
    "TorchInterpreter.perform checked": (
        lambda: torch_interpreter(checked=True).perform((3,)),  # type: ignore[arg-type]
        InvalidInputError,
        "TorchInterpreter.perform: effects[0] is 3, an int, not an effect",
    ),
    "TorchInterpreter.perform a keyed batch": (
        lambda: torch_interpreter().perform(KeyedEffects((3,), "k")),  # type: ignore[arg-type]
        InvalidInputError,
        "TorchInterpreter.perform: effects[0] is 3, an int, not an effect",
    ),
    "TorchInterpreter.perform plans": (
        lambda: torch_interpreter(plans=True).perform((STEP_ONE, "x")),  # type: ignore[arg-type]
        InvalidInputError,
        "effects[1] is 'x', a str, not an effect",
    ),
    # -- effect logs -------------------------------------------------------------------------
    "load_log None": (
        lambda: load_log(None),  # type: ignore[arg-type]
        InvalidInputError,
        "load_log: path=None is a NoneType, not a path",
    ),
    "load_log expect_world": (
        lambda: load_log("x.jsonl", expect_world="pp=2"),  # type: ignore[arg-type]
        InvalidInputError,
        "load_log: expect_world is a str",
    ),
    "load_logs int": (
        lambda: load_logs(3),  # type: ignore[arg-type]
        InvalidInputError,
        "load_logs: directory=3 is an int",
    ),
    "load_logs expect_world": (
        lambda: load_logs(".", expect_world=2),  # type: ignore[arg-type]
        InvalidInputError,
        "load_logs: expect_world is an int",
    ),
    "dump_log None": (
        lambda: dump_log(LOGS[0], None),  # type: ignore[arg-type]
        InvalidInputError,
        "dump_log: path=None",
    ),
    "dump_logs str": (
        lambda: dump_logs("logs", "unused"),  # type: ignore[arg-type]
        InvalidInputError,
        "dump_logs: logs is a str",
    ),
    "dump_logs one log": (
        lambda: dump_logs(LOGS[0], "unused"),  # type: ignore[arg-type]
        InvalidInputError,
        "dump_logs: logs is an EffectLog",
    ),
    "dump_logs a None among them": (
        lambda: dump_logs([LOGS[0], None], "unused"),  # type: ignore[list-item]
        InvalidInputError,
        "logs[1] is a NoneType",
    ),
    "dump_logs directory None": (
        lambda: dump_logs(LOGS, None),  # type: ignore[arg-type]
        InvalidInputError,
        "directory=None",
    ),
    "replay interpreter": (
        lambda: replay(LOGS[0], "interpreter"),  # type: ignore[arg-type]
        InvalidInputError,
        "replay: interpreter is a str",
    ),
    "diff_logs str": (
        lambda: diff_logs("a", LOGS[0]),  # type: ignore[arg-type]
        InvalidInputError,
        "diff_logs: expected is a str",
    ),
    "assert_logs_equal str": (
        lambda: assert_logs_equal(LOGS[0], "b"),  # type: ignore[arg-type]
        InvalidInputError,
        "diff_logs: actual is a str",
    ),
    "diff_logs context": (
        lambda: diff_logs(LOGS[0], LOGS[1], context="3"),  # type: ignore[arg-type]
        InvalidInputError,
        "context='3' is a str",
    ),
    "diff_logs negative context": (
        lambda: diff_logs(LOGS[0], LOGS[1], context=-1),
        InvalidInputError,
        "context=-1 is outside",
    ),
    "LogHeader world": (
        lambda: LogHeader(rank=0, world="pp=1"),  # type: ignore[arg-type]
        ConfigError,
        "LogHeader: world is a str",
    ),
    "EffectLog header": (
        lambda: EffectLog("header", ()),  # type: ignore[arg-type]
        InvalidInputError,
        "EffectLog: header is a str",
    ),
    "EffectLog records": (
        lambda: EffectLog(HEADER, 3),  # type: ignore[arg-type]
        InvalidInputError,
        "EffectLog: records is an int",
    ),
    "EffectLog.from_effects effects": (
        lambda: EffectLog.from_effects(HEADER, 3),  # type: ignore[arg-type]
        InvalidInputError,
        "EffectLog.from_effects: effects is an int",
    ),
    "Recorder inner": (
        lambda: Recorder(HEADER, "inner"),  # type: ignore[arg-type]
        InvalidInputError,
        "Recorder: inner is a str",
    ),
    "Recorder path": (
        lambda: Recorder(HEADER, path=3),  # type: ignore[arg-type]
        InvalidInputError,
        "Recorder: path=3 is an int",
    ),
    "Recorder.perform int": (
        lambda: Recorder(HEADER).perform(3),  # type: ignore[arg-type]
        InvalidInputError,
        "Recorder.perform: effects is an int",
    ),
    "log_file_name str": (
        lambda: log_file_name("0"),  # type: ignore[arg-type]
        InvalidInputError,
        "log_file_name: rank='0' is a str",
    ),
    "log_file_name negative": (
        lambda: log_file_name(-1),
        InvalidInputError,
        "rank=-1 is outside",
    ),
    "header_json": (
        lambda: header_json("header"),  # type: ignore[arg-type]
        InvalidInputError,
        "header_json: header is a str",
    ),
    "record_json": (
        lambda: record_json(None),  # type: ignore[arg-type]
        InvalidInputError,
        "record_json: record is a NoneType",
    ),
    "load_log a NUL in the path": (
        lambda: load_log("rank\x00.jsonl"),
        LogFormatError,
        "cannot be read (embedded null byte)",
    ),
    "load_logs a name too long": (
        lambda: load_logs("x" * 5000),
        LogFormatError,
        "cannot be read (File name too long)",
    ),
    "dump_log a NUL in the path": (
        lambda: dump_log(LOGS[0], "rank\x00.jsonl"),
        InvalidInputError,
        "cannot be written (embedded null byte)",
    ),
    "dump_log a name too long": (
        lambda: dump_log(LOGS[0], "x" * 5000),
        InvalidInputError,
        "cannot be written (File name too long)",
    ),
    "dump_log an empty path": (
        lambda: dump_log(LOGS[0], ""),
        InvalidInputError,
        "dump_log: '.' is a folder, not a file path",
    ),
    "dump_logs a NUL in the path": (
        lambda: dump_logs(LOGS, "logs\x00"),
        InvalidInputError,
        "cannot be made (embedded null byte)",
    ),
    "Recorder a NUL in the path": (
        lambda: Recorder(HEADER, path="rank\x00.jsonl"),
        InvalidInputError,
        "cannot be written (embedded null byte)",
    ),
    "LogHeader a config holding itself": (
        lambda: LogHeader(rank=0, world=Layout(1, 1), config=CYCLIC),
        InvalidInputError,
        "LogHeader: config is nested too deeply, or holds itself",
    ),
    "config_digest a config nested too deeply": (
        lambda: config_digest(DEEP),
        InvalidInputError,
        "config_digest: config is nested too deeply",
    ),
    "LogHeader an integer too long to write": (
        lambda: LogHeader(rank=0, world=Layout(1, 1), config={"seed": 10**5000}),
        InvalidInputError,
        "config.seed holds an integer of 16610 bits",
    ),
    "NumpyInterpreter.resolve a list holding itself": (
        lambda: NumpyInterpreter().resolve(CYCLIC_LIST),
        InvalidInputError,
        "NumpyInterpreter.resolve: the list is nested too deeply, or holds itself",
    ),
    "kind_of": (
        lambda: kind_of("broadcast"),  # type: ignore[arg-type]
        InvalidInputError,
        "kind_of: 'broadcast' is a str, not an effect",
    ),
    "LogStream allow_cut_end": (
        lambda: LogStream("rank.jsonl", allow_cut_end="yes"),  # type: ignore[arg-type]
        InvalidInputError,
        "LogStream: allow_cut_end='yes' is a str",
    ),
    "check_log_dir out": (
        lambda: check_log_dir(".", out="stdout"),  # type: ignore[arg-type]
        InvalidInputError,
        "check_log_dir: out is a str, not a text stream",
    ),
    "SimulationResult.interpreter past the world": (
        lambda: simulate(Layout(1, 1), lambda context: iter(())).interpreter(1),
        InvalidInputError,
        "SimulationResult.interpreter: rank=1 is outside 0..0",
    ),
    "SimulationResult.interpreter negative": (
        lambda: simulate(Layout(1, 1), lambda context: iter(())).interpreter(-1),
        InvalidInputError,
        "rank=-1 is outside 0..0",
    ),
    "check_logs None": (
        lambda: check_logs(None),  # type: ignore[arg-type]
        InvalidInputError,
        "check_logs: directory=None",
    ),
    # -- the simulator and the layout --------------------------------------------------------
    "simulate world": (
        lambda: simulate("pp=1", lambda context: iter(())),  # type: ignore[arg-type]
        ConfigError,
        "simulate: world is a str",
    ),
    "simulate program": (
        lambda: simulate(Layout(1, 1), "program"),  # type: ignore[arg-type]
        InvalidInputError,
        "simulate: program is a str, not callable",
    ),
    "simulate program's answer": (
        lambda: simulate(Layout(1, 1), lambda context: None),  # type: ignore[arg-type,return-value]
        InvalidInputError,
        "the program returned a NoneType for rank 0",
    ),
    "simulate max_steps_in_flight": (
        lambda: simulate(Layout(1, 1), lambda c: iter(()), max_steps_in_flight="2"),  # type: ignore[arg-type]
        ConfigError,
        "max_steps_in_flight='2' is a str",
    ),
    "simulate max_steps_in_flight float": (
        lambda: simulate(Layout(1, 1), lambda c: iter(()), max_steps_in_flight=1.5),  # type: ignore[arg-type]
        ConfigError,
        "max_steps_in_flight=1.5 is a float",
    ),
    "simulate fill": (
        lambda: simulate(Layout(1, 1), lambda c: iter(()), fill="poison"),  # type: ignore[arg-type]
        ConfigError,
        "simulate: fill='poison' is a str",
    ),
    "simulate compare_steps": (
        lambda: simulate(Layout(1, 1), lambda c: iter(()), compare_steps="no"),  # type: ignore[arg-type]
        ConfigError,
        "compare_steps='no' is a str",
    ),
    "Layout too large": (
        lambda: Layout(2**40, 1),
        ConfigError,
        f"Layout: pp={2**40} is past",
    ),
    "Layout.pp_stage str": (
        lambda: Layout(2, 2).pp_stage("1"),  # type: ignore[arg-type]
        ConfigError,
        "Layout.pp_stage: rank='1' is a str",
    ),
    "Layout.dp_index float": (
        lambda: Layout(2, 2).dp_index(2.0),  # type: ignore[arg-type]
        ConfigError,
        "Layout.dp_index: rank=2.0 is a float",
    ),
    "Layout.pp_stage bool": (
        lambda: Layout(2, 2).pp_stage(True),
        ConfigError,
        "rank=True is a bool",
    ),
    "Layout.rank_of float": (
        lambda: Layout(2, 2).rank_of(pp_stage=0.5, dp_index=0),  # type: ignore[arg-type]
        ConfigError,
        "Layout.rank_of: pp_stage=0.5 is a float",
    ),
    "Layout.pipeline float": (
        lambda: Layout(2, 2).pipeline(1.0),  # type: ignore[arg-type]
        ConfigError,
        "Layout.pipeline: dp_index=1.0 is a float",
    ),
    "Layout.replicas None": (
        lambda: Layout(2, 2).replicas(None),  # type: ignore[arg-type]
        ConfigError,
        "Layout.replicas: pp_stage=None",
    ),
    "Layout.pipeline past the replicas": (
        lambda: Layout(2, 2).pipeline(5),
        ConfigError,
        "Layout.pipeline: dp_index=5 is outside 0..1",
    ),
    "Layout.replicas negative": (
        lambda: Layout(2, 3).replicas(-1),
        ConfigError,
        "Layout.replicas: pp_stage=-1 is outside 0..1",
    ),
    # -- scripted schedules ------------------------------------------------------------------
    "ScheduleConfig seed": (
        lambda: ScheduleConfig(pp=1, dp=1, spec=0, steps=1, seed=1.5),  # type: ignore[arg-type]
        ConfigError,
        "ScheduleConfig: seed=1.5",
    ),
    "ScheduleConfig max_prompt_len": (
        lambda: ScheduleConfig(pp=1, dp=1, spec=0, steps=1, seed=0, max_prompt_len="9"),  # type: ignore[arg-type]
        ConfigError,
        "max_prompt_len='9'",
    ),
    "ScheduleConfig wire": (
        lambda: ScheduleConfig(pp=1, dp=1, spec=0, steps=1, seed=0, wire="seed"),  # type: ignore[arg-type]
        ConfigError,
        "wire='seed'",
    ),
    "ScheduleConfig microbatch": (
        lambda: ScheduleConfig(pp=1, dp=1, spec=0, steps=1, seed=0, microbatch=1),  # type: ignore[arg-type]
        ConfigError,
        "microbatch=1",
    ),
    "ScheduleConfig steps past int32": (
        lambda: ScheduleConfig(pp=1, dp=1, spec=0, steps=2**40, seed=0),
        ConfigError,
        f"steps={2**40}",
    ),
    "make_schedule": (
        lambda: make_schedule("config"),  # type: ignore[arg-type]
        InvalidInputError,
        "make_schedule: config is a str",
    ),
    "simulate_schedule": (
        lambda: simulate_schedule("schedule"),  # type: ignore[arg-type]
        InvalidInputError,
        "simulate_schedule: schedule is a str",
    ),
    "simulate_schedule steps_for": (
        lambda: simulate_schedule(SCHEDULE, steps_for="steps"),  # type: ignore[arg-type]
        InvalidInputError,
        "simulate_schedule: steps_for is a str, not callable",
    ),
    "simulate_schedule max_steps_in_flight": (
        lambda: simulate_schedule(SCHEDULE, max_steps_in_flight="2"),  # type: ignore[arg-type]
        ConfigError,
        "max_steps_in_flight='2'",
    ),
    "record_scripted_logs": (
        lambda: record_scripted_logs(None),  # type: ignore[arg-type]
        InvalidInputError,
        "record_scripted_logs: schedule is a NoneType",
    ),
    "record_scripted_logs steps_for's answer": (
        lambda: record_scripted_logs(SCHEDULE, steps_for=lambda rank: 3),  # type: ignore[arg-type,return-value]
        InvalidInputError,
        "record_scripted_logs: steps_for returned an int for rank 0",
    ),
    "record_scripted_rank": (
        lambda: record_scripted_rank("schedule", 0),  # type: ignore[arg-type]
        InvalidInputError,
        "record_scripted_rank: schedule is a str",
    ),
    "scripted_program": (
        lambda: scripted_program("schedule"),  # type: ignore[arg-type]
        InvalidInputError,
        "scripted_program: schedule is a str",
    ),
    "scripted_rank_effects io": (
        lambda: scripted_rank_effects(SCHEDULE, 0, "io"),  # type: ignore[arg-type]
        InvalidInputError,
        "scripted_rank_effects: io is a str",
    ),
    "scripted_rank_effects io without read": (
        lambda: scripted_rank_effects(SCHEDULE, 0, io()),  # type: ignore[arg-type]
        InvalidInputError,
        "io is a NumpyIO, which has no read method",
    ),
    "rank_config rank": (
        lambda: rank_config(SCHEDULE, "0"),  # type: ignore[arg-type]
        ConfigError,
        "rank='0' is a str",
    ),
    "reduced_agreement_table step past the schedule": (
        lambda: reduced_agreement_table(DP_SCHEDULE, 99),
        InvalidInputError,
        "Schedule.at: step=99 is outside 0..1",
    ),
    "reduced_agreement_table step str": (
        lambda: reduced_agreement_table(DP_SCHEDULE, "0"),  # type: ignore[arg-type]
        InvalidInputError,
        "step='0' is a str",
    ),
    "Schedule.at negative step": (
        lambda: SCHEDULE.at(-1, 0),
        InvalidInputError,
        "Schedule.at: step=-1 is outside 0..2",
    ),
    "Schedule.at replica": (
        lambda: SCHEDULE.at(0, 1),
        InvalidInputError,
        "Schedule.at: replica=1 is outside 0..0",
    ),
    "scripted_header": (
        lambda: scripted_header("schedule", 0),  # type: ignore[arg-type]
        InvalidInputError,
        "scripted_header: schedule is a str",
    ),
    "TorchTensors": (
        lambda: TorchTensors(NumpyInterpreter()),  # type: ignore[arg-type]
        InvalidInputError,
        "TorchTensors: interpreter is a NumpyInterpreter",
    ),
    "RecordingTensors": (
        lambda: RecordingTensors(None),  # type: ignore[arg-type]
        InvalidInputError,
        "RecordingTensors: schedule is a NoneType",
    ),
    "drive": (
        lambda: drive("program", interpreter()),  # type: ignore[arg-type]
        InvalidInputError,
        "perform_phase: phase is a str",
    ),
    "assert_effect_sequence": (
        lambda: assert_effect_sequence(3, [STEP_ONE]),  # type: ignore[arg-type]
        InvalidInputError,
        "assert_effect_sequence: actual is an int",
    ),
    # -- the dispatcher's LoRA rounding ------------------------------------------------------
    "effective_loras str": (
        lambda: DISPATCHER.effective_loras("2"),  # type: ignore[arg-type]
        InvalidInputError,
        "CudaGraphDispatcher.effective_loras: num_active_loras='2' is a str",
    ),
    "effective_loras float": (
        lambda: DISPATCHER.effective_loras(1.5),  # type: ignore[arg-type]
        InvalidInputError,
        "num_active_loras=1.5 is a float",
    ),
    "effective_loras negative": (
        lambda: DISPATCHER.effective_loras(-1),
        InvalidInputError,
        "num_active_loras=-1 is outside",
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_bad_call_raises_a_typed_error_naming_the_call_the_value_and_the_fix(name: str) -> None:
    call, error, fragment = CASES[name]
    with pytest.raises(error, match=re.escape(fragment)) as raised:
        call()
    assert str(raised.value).startswith(f"{raised.value.call}: ")
    assert raised.value.fix


# -- nothing changes before the error -----------------------------------------------------------


def test_a_refused_phase_leaves_the_driver_as_it_was() -> None:
    driver = RankDriver(RANK, interpreter(), io())
    begun = driver.begin(init_rank(RANK))
    for bad in ("begun", None, begun.relay):
        with pytest.raises(InvalidInputError):
            driver.settle(bad)  # type: ignore[arg-type]
    # The driver still takes the value it handed out last, and agrees the step.
    assert driver.agree(begun, BATCH, SHAPE).batch is BATCH


def test_a_refused_finish_leaves_the_step_to_finish_again() -> None:
    """The last stage's outputs are checked before anything is issued: the same Agreed
    finishes once the caller passes good outputs (what it bound is bound again)."""
    relay = RelayConfig.for_stage(pp_size=1, stage=0, max_num_reqs=4, num_speculative_steps=1)
    last = RankConfig(relay=relay)
    made = NumpyInterpreter()
    driver = RankDriver(last, made, NumpyIO(made))
    agreed = driver.agree(driver.begin(init_rank(last)), BATCH, SHAPE)
    tokens, counts = np.zeros((2, 2), np.int64), np.ones(2, np.int32)
    table = np.zeros((4, 1), np.int64)
    refused: tuple[Sampled[Any], ...] = (
        Sampled(tokens=tokens, num_sampled=counts, num_rejected=counts - 1),  # no table
        Sampled(tokens=tokens, num_sampled=[1, 1], num_rejected=counts - 1, draft_table=table),
        Sampled(tokens="tokens", num_sampled=counts, num_rejected=counts - 1, draft_table=table),
    )
    for bad in refused:
        with pytest.raises(InvalidInputError, match=r"^(finish|NumpyInterpreter\.bind): "):
            driver.finish(agreed, bad)
    good: Sampled[Any] = Sampled(
        tokens=tokens, num_sampled=counts, num_rejected=counts - 1, draft_table=table
    )
    assert driver.finish(agreed, good).step == 1


def test_refused_binds_and_effects_leave_the_numpy_interpreter_as_it_was() -> None:
    made = NumpyInterpreter()
    made.bind(REF, np.arange(3, dtype=np.int64))
    before = made.bound_refs()
    bad_calls: tuple[Callable[[], None], ...] = (
        lambda: made.bind(None, np.zeros(2, np.int64)),  # type: ignore[arg-type]
        lambda: made.bind(REF, [[1], [1, 2]]),
        lambda: made.perform((STEP_ONE, None)),  # type: ignore[arg-type]
        lambda: made.perform(7),  # type: ignore[arg-type]
    )
    for bad in bad_calls:
        with pytest.raises(InvalidInputError):
            bad()
    assert made.bound_refs() == before
    assert made.tensor(REF).tolist() == [0, 1, 2]
    assert made.idle()


@pytest.mark.parametrize("shape", [tuple, list, iter])
@pytest.mark.parametrize("mode", [{}, {"checked": True}, {"plans": True}])
def test_a_non_effect_is_refused_before_the_torch_interpreter_performs_anything(
    mode: dict[str, bool], shape: Callable[[list[object]], Iterable[object]]
) -> None:
    """Every mode checks a caller's batch whole first, so no effect of it ran."""
    made = torch_interpreter(**mode)
    with pytest.raises(InvalidInputError, match=r"effects\[1\] is None, a NoneType"):
        made.perform(shape([STEP_ONE, None]))  # type: ignore[arg-type]
    assert made.bound_refs() == frozenset()
    made.perform((STEP_ONE,))  # and the interpreter still works
    assert made.tensor(BufferRef("made")).shape == (2,)


def test_a_failed_dump_leaves_no_file_behind(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    for target in (tmp_path / "taken", tmp_path / "missing" / "rank.jsonl"):
        with pytest.raises(InvalidInputError, match=r"dump_log: .* cannot be written"):
            dump_log(LOGS[0], target)
    # No half-written ".partial" file next to the target, and the target untouched.
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert list((tmp_path / "taken").iterdir()) == []


def test_refused_dump_logs_write_nothing(tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("kept")
    with pytest.raises(InvalidInputError, match=r"dump_logs: directory .* cannot be made"):
        dump_logs(LOGS, tmp_path / "a_file")
    with pytest.raises(InvalidInputError, match="cannot be made"):
        dump_logs(LOGS, tmp_path / "a_file" / "below")
    with pytest.raises(InvalidInputError, match=r"logs\[1\] is a str"):
        dump_logs([LOGS[0], "log"], tmp_path / "new")  # type: ignore[list-item]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
    assert (tmp_path / "a_file").read_text() == "kept"


def test_a_recorder_records_every_effect_of_a_generator_and_nothing_of_garbage() -> None:
    effects = LOGS[0].effects[:5]
    recorder = Recorder(HEADER)
    with pytest.raises(InvalidInputError):
        recorder.perform(iter([*effects[:2], None]))  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        recorder.perform(11)  # type: ignore[arg-type]
    assert recorder.log.records == ()
    recorder.perform(e for e in effects)  # type: ignore[arg-type]  # read twice inside
    assert recorder.log.effects == effects


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (-1, "nested too deeply"),  # a record past the JSON parser's recursion limit
        (0, "nested too deeply"),  # the header
        (-1, "a number too long to read"),  # past Python's int() digit limit
        (-2, "a number too long to read"),  # the same, where the checker's fast path reads
    ],
)
def test_a_corrupted_log_is_a_format_error_for_load_log_and_a_report_for_check(
    tmp_path: Path, line: int, problem: str
) -> None:
    long = record_scripted_logs(make_schedule(ScheduleConfig(pp=2, dp=1, spec=1, steps=6, seed=0)))
    dump_logs(long, tmp_path)
    path = tmp_path / log_file_name(0)
    lines = path.read_text().splitlines()
    if problem == "nested too deeply":
        lines[line] = lines[line].replace("{", "[" * 100_000 + "]" * 100_000 + ", {", 1)
    else:
        lines[line] = re.sub(r'"step": \d+', '"step": ' + "9" * 5000, lines[line], count=1)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(LogFormatError, match=re.escape(problem)):
        load_log(path)
    with pytest.raises(LogFormatError, match=re.escape(problem)):
        load_logs(tmp_path)
    report = check_logs(tmp_path)
    assert report.exit_code == 2
    assert problem in report.text


def test_check_logs_reports_a_bad_max_steps_in_flight_as_an_unusable_run(tmp_path: Path) -> None:
    dump_logs(LOGS, tmp_path)
    for bad in ("2", 1.5, True, 0):
        report = check_logs(tmp_path, max_steps_in_flight=bad)  # type: ignore[arg-type]
        assert report.exit_code == 2
        assert "max_steps_in_flight" in report.text
    assert check_logs(tmp_path, max_steps_in_flight=2).exit_code == 0


# -- scalars, fuzzed ------------------------------------------------------------------------------

SCALARS = st.one_of(
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False),
    st.booleans(),
    st.none(),
    st.text(max_size=2),
    st.sampled_from([np.int64(1), np.int32(0), np.float64(1.0), np.bool_(True), (0,), [1]]),
    UNREADABLE_ARRAYS,
)


def accepted(call: Callable[[], object]) -> object | None:
    """The call's answer, or None when it raised a PureppError (anything else escapes)."""
    try:
        return call()
    except PureppError:
        return None


def is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


@settings(max_examples=150, deadline=None)
@given(value=SCALARS, method=st.sampled_from(["pp_stage", "dp_index", "pipeline", "replicas"]))
def test_layout_lookups_take_ints_only(value: object, method: str) -> None:
    answer = accepted(lambda: getattr(Layout(2, 3), method)(value))
    if answer is not None:
        assert is_int(value)
        assert all(type(a) is int for a in (answer if isinstance(answer, tuple) else (answer,)))


@pytest.mark.parametrize(("pp", "dp"), [(1, 1), (2, 3), (3, 2), (4, 1)])
def test_layout_groups_agree_with_rank_of(pp: int, dp: int) -> None:
    world = Layout(pp=pp, dp=dp)
    for replica in range(dp):
        expected = tuple(world.rank_of(pp_stage=s, dp_index=replica) for s in range(pp))
        assert world.pipeline(replica) == expected
        assert {world.dp_index(r) for r in expected} == {replica}
    for stage in range(pp):
        expected = tuple(world.rank_of(pp_stage=stage, dp_index=d) for d in range(dp))
        assert world.replicas(stage) == expected
        assert {world.pp_stage(r) for r in expected} == {stage}


@settings(max_examples=150, deadline=None)
@given(
    value=SCALARS,
    name=st.sampled_from(
        ["seed", "steps", "spec", "max_num_reqs", "max_prompt_len", "microbatch", "wire"]
    ),
)
def test_schedule_configs_take_ints_and_bools_of_their_own_type_only(
    value: object, name: str
) -> None:
    kwargs: dict[str, Any] = {"pp": 1, "dp": 1, "spec": 0, "steps": 1, "seed": 0, name: value}
    made = accepted(lambda: ScheduleConfig(**kwargs))
    if made is not None:
        stored = getattr(made, name)
        assert type(stored) is (bool if name == "microbatch" else int)
        assert stored == value


@settings(max_examples=150, deadline=None)
@given(data=st.data(), name=st.sampled_from(["rank", "fill", "capture_copies"]))
def test_interpreter_constructors_take_ints_only(data: st.DataObject, name: str) -> None:
    value = data.draw(SCALARS)
    if name != "capture_copies":
        made = accepted(lambda: NumpyInterpreter(**{name: value}))
        if isinstance(made, NumpyInterpreter):
            assert is_int(value)
            if name == "rank":
                assert type(made.rank) is int
                assert made.rank == value
    torch_made = accepted(lambda: torch_interpreter(**{name: value}) if name != "fill" else None)
    if torch_made is not None:
        assert is_int(value)


DISPATCHED = RankConfig(relay=SOLO, dispatcher=DISPATCHER, drafter_dispatcher=DISPATCHER)
SOLO_SHAPE = ShapeFacts(num_tokens=3)
SOLO_BEGUN = run(begin(DISPATCHED, init_rank(DISPATCHED)))
SOLO_STARTED = run(start_agreement_phase(DISPATCHED, SOLO_BEGUN, BATCH, SOLO_SHAPE))
SOLO_AGREED = run(settle(DISPATCHED, SOLO_STARTED, io()))
PHASES: dict[str, tuple[Callable[..., Any], dict[str, object]]] = {
    "settle": (settle, {"config": DISPATCHED, "begun": SOLO_STARTED, "io": io(), "freed": [1]}),
    "start_agreement_phase": (
        start_agreement_phase,
        {"config": DISPATCHED, "begun": SOLO_BEGUN, "batch": BATCH, "shape": SOLO_SHAPE},
    ),
    "start_next_agreement": (
        start_next_agreement,
        {"config": DISPATCHED, "agreed": SOLO_AGREED, "batch": BATCH, "shape": SOLO_SHAPE},
    ),
}


@settings(max_examples=200, deadline=None)
@given(data=st.data(), name=st.sampled_from(sorted(PHASES)))
def test_the_other_rank_phases_raise_a_pureppError_or_answer(
    data: st.DataObject, name: str
) -> None:
    """settle and the two starts, each argument in turn garbage (begin, agree and finish
    are fuzzed in test_relay_input)."""
    function, good = PHASES[name]
    parameter = data.draw(st.sampled_from(sorted(good)), label="parameter")
    value = data.draw(st.one_of(SCALARS, st.sampled_from([STATE, BEGUN, AGREED, RANK])))
    answer = accepted(lambda: run(function(**{**good, parameter: value})))
    assert answer is None or type(answer) is (Begun if name == "start_agreement_phase" else Agreed)


def _phase_fields() -> Iterator[tuple[Any, str, str]]:
    """(a good phase value, one of its fields, the class) for every field of every phase
    value a caller hands back: RankState, Begun, Agreed and the Agreeing inside a Begun."""
    assert STARTED.agreeing is not None
    for good in (STATE, STARTED, AGREED, STARTED.agreeing):
        for field in attrs.fields_dict(type(good)):
            yield good, field, type(good).__name__


@pytest.mark.parametrize(
    ("good", "field"),
    [(good, field) for good, field, _ in _phase_fields()],
    ids=[f"{kind}.{field}" for _, field, kind in _phase_fields()],
)
def test_a_phase_value_built_by_hand_is_checked_field_by_field(good: Any, field: str) -> None:
    """A RankState, Begun, Agreed or Agreeing built by hand (attrs.evolve, a restore) with
    a wrong field is refused when built, naming the class and the field, never an
    AttributeError halfway through a later phase. (The phases build theirs from values
    they checked, with trusted constructors, and only check a value's type.)"""
    kind = type(good).__name__
    with pytest.raises(InvalidInputError, match=re.escape(f"{kind}: {field} has type str")):
        attrs.evolve(good, **{field: "garbage"})


def test_a_wrong_field_is_named_with_the_types_it_takes() -> None:
    with pytest.raises(InvalidInputError) as caught:
        attrs.evolve(STARTED, agreeing="garbage")
    assert str(caught.value) == (
        "Begun: agreeing has type str, not Agreeing or None. Fix: pass agreeing as Agreeing "
        "or None (attrs.evolve the Begun a phase returned, keeping the types of its fields)"
    )


def test_a_subclass_of_a_phase_value_is_checked_as_its_phase_class() -> None:
    """The phases take subclasses (isinstance): one builds, and its fields are checked."""

    class Annotated(Begun):
        pass

    fields = {field: getattr(STARTED, field) for field in attrs.fields_dict(Begun)}
    assert type(Annotated(**fields)) is Annotated
    with pytest.raises(InvalidInputError, match=re.escape("Begun: lanes has type str")):
        Annotated(**{**fields, "lanes": "garbage"})


def test_good_values_still_work() -> None:
    """What the checks let through: numpy ints, str refs found by name, int32 uploads."""
    assert Layout(2, 2).pp_stage(np.int64(3)) == 1  # type: ignore[arg-type]
    assert NumpyInterpreter(rank=np.int32(2)).rank == 2  # type: ignore[arg-type]
    made = NumpyInterpreter()
    made.bind(REF, np.zeros(2, np.int64))
    assert made.tensor("probe").shape == (2,)  # type: ignore[arg-type]  # a ref equals its name
    assert io().upload(np.arange(2, dtype=np.int32)).dtype == np.int32
    assert DISPATCHER.effective_loras(np.int64(1)) == 2  # type: ignore[arg-type]
    assert SCHEDULE.at(2, 0).step == 2
    released = Release(step=0, op=Op.RECEIVE, buffer=BufferRef("made"))
    batch: list[Effect] = [STEP_ONE, released]
    made.perform(iter(batch))  # any iterable of effects
    assert BufferRef("made") not in made.bound_refs()
    assert check_logs(Path("no-such-folder")).exit_code == 2  # an unusable folder: a report
