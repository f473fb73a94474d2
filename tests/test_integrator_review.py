"""An integrator's review: a research runner built from the README under `mypy --strict`.

What a new user hit that the library got wrong: the world set-up calls of the README's
example took a wrong value with a raw exception (or blamed a rendezvous for it).
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from purepp.effects.torch_interpreter import build_communicators, init_distributed
from purepp.effects.vocabulary import Communicator
from purepp.errors import ConfigError

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
