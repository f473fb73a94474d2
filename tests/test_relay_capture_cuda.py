"""On a GPU: the relay's keyed batches replay from CUDA graphs and give eager's names
and values (the CPU emulation of the same is in tests/test_plan_capture.py).

A one-rank NCCL world: both relays are rank 0, so a receive "receives" its own buffer;
what the receiver made is compared by name, everything else by value too. Skipped
without CUDA.

Run on a GPU host:
    NCCL_NVLS_ENABLE=0 python -m pytest -q tests/test_relay_capture_cuda.py -p no:cacheprovider
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from benchmarks.one_rank import one_rank_world
from purepp.effects.torch_interpreter import TorchInterpreter
from purepp.effects.vocabulary import Communicator
from purepp.relay import Wire
from tests.test_keyed_effects import keyed_relay_program

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def groups() -> Iterator[dict[Communicator, dist.ProcessGroup]]:
    if dist.is_initialized():
        pytest.fail("another test left a default process group initialised")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with one_rank_world("cuda") as (_, groups):
        yield groups


@pytest.mark.parametrize("wire", list(Wire), ids=[w.value for w in Wire])
@pytest.mark.parametrize("spec", [0, 2])
def test_relay_replays_match_eager(
    groups: dict[Communicator, dist.ProcessGroup], wire: Wire, spec: int
) -> None:
    device = torch.device("cuda", 0)
    eager = TorchInterpreter(device=device, groups=groups, rank=0)
    captured = TorchInterpreter(
        device=device, groups=groups, rank=0, capture=True, capture_copies=3
    )

    def rows(step: int) -> int:
        return 2 if step < 20 else 1 + step % 3

    want = keyed_relay_program(eager, spec, wire, rows=rows)
    got = keyed_relay_program(captured, spec, wire, rows=rows)
    assert got == want
    planner = captured.planner
    assert planner is not None
    assert planner.replayed >= 2 * 30 - 12, (planner.replayed, planner.planned)
