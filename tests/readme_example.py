"""The README's embedding example, run and type-checked by tests/test_readme.py."""

import datetime
import tempfile

import torch
import torch.distributed as dist

from purepp import BatchFacts, CaptureMode, CudaGraphDispatcher, RelayConfig
from purepp.effects.io import TorchIO
from purepp.effects.torch_interpreter import TorchInterpreter, build_communicators, init_distributed
from purepp.rank import RankConfig, RankDriver, Sampled, ShapeFacts, init_rank

# A one-rank world on CPU (gloo): the last (and only) stage of a pipeline and a DP group.
timeout = datetime.timedelta(seconds=30)
rendezvous = f"file://{tempfile.mkdtemp()}/rendezvous"
init_distributed(backend="gloo", init_method=rendezvous, rank=0, world_size=1, timeout=timeout)
groups = build_communicators(
    pp_groups=[[0]], dp_groups=[[0]], relay_backend="gloo", timeout=timeout
)
interpreter = TorchInterpreter(device=torch.device("cpu"), groups=groups, rank=0)

config = RankConfig(
    relay=RelayConfig.for_stage(pp_size=1, stage=0, max_num_reqs=8),
    dispatcher=CudaGraphDispatcher(
        capture_sizes=(1, 2, 4, 8), capture_mode=CaptureMode.FULL, max_num_reqs=8
    ),
)
driver = RankDriver(config, interpreter, TorchIO(interpreter))
state = init_rank(config)
for step in range(3):
    begun = driver.begin(state)  # begun.consumed: the tokens relayed ring_depth steps ago
    batch = BatchFacts(
        idx_mapping=[0, 1],
        num_computed_tokens=[4 + step, 9 + step],
        num_scheduled_tokens=[1, 1],
        prefill_len=[4, 4],
    )
    agreed = driver.agree(begun, batch, ShapeFacts(num_tokens=2, uniform_token_count=1))
    print(f"step {step}: run the forward as {agreed.descriptor}")
    sampled = Sampled(  # the forward's sampled tokens, relayed to the other stages
        tokens=torch.tensor([[100 + step], [200 + step]]),
        num_sampled=torch.ones(2, dtype=torch.int32),
        num_rejected=torch.zeros(2, dtype=torch.int32),
    )
    state = driver.finish(agreed, sampled)
dist.destroy_process_group()
