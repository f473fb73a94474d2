"""An integrator's review: a research runner built from the README under `mypy --strict`.

What a new user hit that the library got wrong: the world set-up calls of the README's
example took a wrong value with a raw exception (or blamed a rendezvous for it), and
`finish` named a `Sampled` field of the wrong dtype by the relay's buffer, under the
seam's call, with a fix that the next check refused.
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
import torch.distributed as dist

from purepp.dp import LaneBusyError
from purepp.effects.io import NumpyIO, TorchIO
from purepp.effects.log import Recorder
from purepp.effects.numpy_interpreter import NumpyInterpreter
from purepp.effects.torch_interpreter import (
    TorchInterpreter,
    build_communicators,
    init_distributed,
)
from purepp.effects.vocabulary import Communicator
from purepp.errors import ConfigError, InvalidInputError
from purepp.rank import Agreed, RankDriver, Sampled, ShapeFacts, StepIO, init_rank
from purepp.relay import Wire
from purepp.testing import ScheduleConfig, make_schedule, rank_config, scripted_header

SECOND = datetime.timedelta(seconds=1)

# --- init_distributed and build_communicators ----------------------------------------------


@pytest.mark.parametrize(
    ("wrong", "named"),
    [
        ({"world_size": "2"}, "world_size='2' is a str"),
        ({"rank": True}, "rank=True is a bool"),
        ({"rank": 1.0}, "rank=1.0 is a float"),  # was a PeerFailureError: "could not rendezvous"
        ({"timeout": 30}, "timeout=30 is an int"),
        ({"init_method": None}, "init_method=None"),
        ({"backend": "mpi"}, "backend is 'mpi'"),  # was a PeerFailureError too
    ],
)
def test_init_distributed_refuses_a_wrong_value_before_any_rendezvous(
    tmp_path: Path, wrong: dict[str, object], named: str
) -> None:
    assert not dist.is_initialized()
    arguments: dict[str, Any] = {
        "backend": "gloo",
        "init_method": f"file://{tmp_path}/rendezvous",
        "rank": 1,
        "world_size": 2,
        "timeout": SECOND,
    }
    with pytest.raises(ConfigError, match=rf"^init_distributed: {re.escape(named)}"):
        init_distributed(**(arguments | wrong))
    assert not dist.is_initialized()


@pytest.mark.skipif(dist.is_nccl_available(), reason="this torch has NCCL")
def test_init_distributed_on_nccl_without_nccl_says_so_and_blames_no_rendezvous(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match=r"^init_distributed: backend='nccl' but") as caught:
        init_distributed(
            backend="nccl",
            init_method=f"file://{tmp_path}/rendezvous",
            rank=0,
            world_size=1,
            timeout=SECOND,
        )
    assert "use backend='gloo'" in str(caught.value)
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("wrong", "named"),
    [
        # a float rank passed the range check and failed inside torch's new_group
        ({"pp_groups": [[0.0]]}, "PP group (0.0,) holds 0.0, a float"),
        ({"dp_groups": [[True]]}, "DP group (True,) holds True, a bool"),
        ({"pp_groups": [["0"]]}, "PP group ('0',) holds '0', a str"),
        ({"pp_groups": [0]}, "PP group 0 is an int"),
        ({"dp_groups": None}, "dp_groups is a NoneType"),
        ({"pp_groups": "01"}, "pp_groups is a str"),
        ({"timeout": 5}, "timeout=5 is an int"),
        ({"timeout": None}, "timeout=None is a NoneType"),
    ],
)
def test_build_communicators_refuses_a_wrong_value_before_making_a_group(
    groups: dict[Communicator, dist.ProcessGroup], wrong: dict[str, object], named: str
) -> None:
    arguments: dict[str, Any] = {
        "pp_groups": [[0]],
        "dp_groups": [[0]],
        "relay_backend": "gloo",
        "timeout": SECOND,
    }
    with pytest.raises(ConfigError, match=rf"^build_communicators: {re.escape(named)}"):
        build_communicators(**(arguments | wrong))
    # Nothing was made: the world goes on with the groups it had.
    made = build_communicators(**arguments)
    assert dist.get_process_group_ranks(made[Communicator.PP_RELAY]) == [0]


# --- finish: the last stage's Sampled fields ------------------------------------------------

SPEC = 2


def _lone_last_stage(
    wire: Wire, io_of: str
) -> tuple[RankDriver[Any], Agreed, Recorder, StepIO[Any], dict[str, npt.NDArray[Any]]]:
    """A one-rank world (the last stage, speculating) at a step that samples, agreed."""
    schedule = make_schedule(ScheduleConfig(pp=1, dp=1, spec=SPEC, steps=6, seed=3, wire=wire))
    config = rank_config(schedule, 0)
    io: StepIO[Any]
    if io_of == "numpy":
        numpy = NumpyInterpreter()
        recorder = Recorder(scripted_header(schedule, 0), numpy)
        io = NumpyIO(numpy)
    else:
        # One rank decides alone, and finish refuses before it issues: no communicator.
        torch_interpreter = TorchInterpreter(device=torch.device("cpu"), groups={}, rank=0)
        recorder = Recorder(scripted_header(schedule, 0), torch_interpreter)
        io = TorchIO(torch_interpreter)
    driver: RankDriver[Any] = RankDriver(config, recorder, io)
    state = init_rank(config)
    for step in range(schedule.config.steps):
        planned = schedule.at(step, 0)
        shape = ShapeFacts(
            num_tokens=planned.num_tokens, uniform_token_count=planned.uniform_token_count
        )
        agreed = driver.agree(driver.begin(state), planned.batch, shape, freed=planned.freed)
        if planned.samples:
            break
        state = driver.finish(agreed)  # no row samples: nothing is sent
    else:
        raise AssertionError("no step of the schedule samples")
    arrays: dict[str, npt.NDArray[Any]] = {
        "tokens": np.array(planned.sampled_tokens, dtype=np.int64),
        "num_sampled": np.array(planned.num_sampled, dtype=np.int32),
        "num_rejected": np.array(planned.num_rejected, dtype=np.int32),
        "draft_table": np.zeros((schedule.config.max_num_reqs, SPEC), dtype=np.int64),
    }
    return driver, agreed, recorder, io, arrays


@pytest.mark.parametrize("io_of", ["numpy", "torch"])
@pytest.mark.parametrize("wire", [Wire.SEED, Wire.PACKED])
@pytest.mark.parametrize(
    ("field", "dtype", "expected"),
    [
        ("tokens", np.float32, r"pass tokens as int64 \[\d+, k\]"),
        ("draft_table", np.float32, r"pass draft_table as int64 \[max_num_reqs=\d+, 2\]"),
        # was "pass draft tokens as a 2-D int64 tensor's TensorSpec", on the packed wires
        # under broadcast_sampled's name
        ("draft_table", np.int32, r"pass draft_table as int64 \[max_num_reqs=\d+, 2\]"),
        ("num_sampled", np.float32, r"pass num_sampled as an int32 tensor of shape \[\d+\]"),
    ],
)
def test_finish_names_a_sampled_field_of_a_wrong_dtype_as_the_caller_passed_it(
    io_of: str, wire: Wire, field: str, dtype: type[np.generic], expected: str
) -> None:
    """Named by finish and the field, with a fix the next check takes: the seams named their
    own call and the relay's buffer, and told the caller that int32 tokens would do."""
    driver, agreed, recorder, _, arrays = _lone_last_stage(wire, io_of)
    arrays[field] = arrays[field].astype(dtype)
    wrap = torch.from_numpy if io_of == "torch" else np.asarray
    sampled = Sampled(**{name: wrap(array) for name, array in arrays.items()})
    issued = len(recorder.log.records)
    with pytest.raises(InvalidInputError, match=rf"^finish: Sampled\.{field}") as caught:
        driver.finish(agreed, sampled)
    assert re.search(expected, caught.value.fix), caught.value.fix
    assert "relay.input" not in caught.value.fix
    assert len(recorder.log.records) == issued


def test_a_driver_refusal_says_which_driver_method_ran_the_phase_it_names() -> None:
    """The message names the phase function (start_agreement_phase), which a RankDriver
    user never calls; a note names the driver's method and how the names map."""
    schedule = make_schedule(ScheduleConfig(pp=1, dp=1, spec=SPEC, steps=2, seed=3))
    config = rank_config(schedule, 0)
    numpy = NumpyInterpreter()
    driver: RankDriver[Any] = RankDriver(config, numpy, NumpyIO(numpy))
    planned = schedule.at(0, 0)
    shape = ShapeFacts(num_tokens=planned.num_tokens)
    started = driver.start(driver.begin(init_rank(config)), planned.batch, shape)
    with pytest.raises(LaneBusyError, match=r"^start_agreement_phase: ") as caught:
        driver.start(started, planned.batch, shape)  # started already: settle it
    notes = getattr(caught.value, "__notes__", [])
    assert any("RankDriver.start, which runs the phase start_agreement_phase" in n for n in notes)
