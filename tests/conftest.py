"""Fixtures shared by test modules."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from benchmarks.one_rank import one_rank_world
from purepp.effects.vocabulary import Communicator


@pytest.fixture(scope="module")
def groups() -> Iterator[dict[Communicator, dist.ProcessGroup]]:
    """A single-rank gloo world with every communicator, for the whole module."""
    if dist.is_initialized():
        pytest.fail("another test left a default process group initialised")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with one_rank_world("cpu") as (_, made):
        yield made
