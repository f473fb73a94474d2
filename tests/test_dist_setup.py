"""Setting up a world: what init_distributed and build_communicators say before any world
exists. A module of its own, with no world fixture: under pytest-xdist a worker tears a
module's world down before it runs another module's tests."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch.distributed as dist

from purepp.effects.torch_interpreter import build_communicators, init_distributed
from purepp.errors import ConfigError, PeerFailureError


def test_build_communicators_needs_an_initialised_world() -> None:
    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match=r"^build_communicators: no default process group") as e:
        build_communicators(
            pp_groups=[[0]],
            dp_groups=[[0]],
            relay_backend="gloo",
            timeout=datetime.timedelta(seconds=1),
        )
    assert "call init_distributed first" in str(e.value)


def test_a_rendezvous_nobody_answers_is_a_peer_failure_leaving_no_world() -> None:
    assert not dist.is_initialized()
    with socket.socket() as taken:  # a port bound here, where nobody listens
        taken.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(
            PeerFailureError, match=r"^init_distributed: rank 1 of 2 could not"
        ) as e:
            init_distributed(
                backend="gloo",
                init_method=address,
                rank=1,
                world_size=2,
                timeout=datetime.timedelta(seconds=1),
            )
    assert repr(address) in str(e.value)
    assert "same init_method and world_size within the timeout" in str(e.value)
    assert not dist.is_initialized()


def test_build_communicators_refuses_a_relay_backend_it_cannot_make() -> None:
    # Checked before any group is made (each new_group is a collective over the world).
    with pytest.raises(ConfigError, match=r"^build_communicators: relay_backend='mpi'"):
        build_communicators(
            pp_groups=[[0]],
            dp_groups=[[0]],
            relay_backend="mpi",  # type: ignore[arg-type]
            timeout=datetime.timedelta(seconds=1),
        )


@pytest.mark.skipif(dist.is_nccl_available(), reason="this torch has NCCL")
def test_an_nccl_relay_on_a_torch_without_nccl_says_so() -> None:
    # Was a PeerFailureError telling the user to read the other ranks' logs.
    with pytest.raises(ConfigError, match=r"this build of torch has no NCCL") as caught:
        build_communicators(
            pp_groups=[[0]],
            dp_groups=[[0]],
            relay_backend="nccl",
            timeout=datetime.timedelta(seconds=1),
        )
    assert "use relay_backend='gloo'" in str(caught.value)
