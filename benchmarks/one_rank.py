"""The one-rank world the benchmarks run in: gloo on CPU, NCCL on one GPU.

Its collectives are real calls into torch.distributed with nothing on the wire, so
a benchmark measures the host cost of issuing the work.
"""

from __future__ import annotations

import contextlib
import datetime
import tempfile
from collections.abc import Iterator

import torch
import torch.distributed as dist

from purepp.effects.torch_interpreter import Backend, build_communicators, init_distributed
from purepp.effects.vocabulary import Communicator

TIMEOUT = datetime.timedelta(seconds=60)


@contextlib.contextmanager
def one_rank_world(
    device_kind: str,
) -> Iterator[tuple[torch.device, dict[Communicator, dist.ProcessGroup]]]:
    """Yield this rank's device and communicators; tear the world down afterwards."""
    cuda = device_kind == "cuda"
    backend: Backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(0)
    with tempfile.NamedTemporaryFile() as store:
        init_distributed(
            backend=backend,
            init_method=f"file://{store.name}",
            rank=0,
            world_size=1,
            timeout=TIMEOUT,
        )
        try:
            groups = build_communicators(
                pp_groups=[[0]], dp_groups=[[0]], relay_backend=backend, timeout=TIMEOUT
            )
            yield (torch.device("cuda", 0) if cuda else torch.device("cpu")), groups
        finally:
            dist.destroy_process_group()
