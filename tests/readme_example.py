"""The README's embedding example, run and type-checked by tests/test_readme.py."""

import datetime
import multiprocessing
import tempfile
from multiprocessing.queues import Queue

import torch
import torch.distributed as dist

from purepp import AgreementGroup, BatchFacts, CaptureMode, CudaGraphDispatcher, RelayConfig
from purepp.effects.io import TorchIO
from purepp.effects.torch_interpreter import TorchInterpreter, build_communicators, init_distributed
from purepp.rank import RankConfig, RankDriver, Sampled, ShapeFacts, init_rank


def run_stage(stage: int, rendezvous: str, agreed_shapes: "Queue[str]") -> None:
    """One process per pipeline stage. The two stages also agree their batch shape with
    each other: an agreement may run over any group (field failure 7)."""
    timeout = datetime.timedelta(seconds=30)
    init_distributed(
        backend="gloo", init_method=rendezvous, rank=stage, world_size=2, timeout=timeout
    )
    groups = build_communicators(
        pp_groups=[[0, 1]], dp_groups=[[0, 1]], relay_backend="gloo", timeout=timeout
    )
    interpreter = TorchInterpreter(device=torch.device("cpu"), groups=groups, rank=stage)
    config = RankConfig(
        relay=RelayConfig.for_stage(pp_size=2, stage=stage, max_num_reqs=8),
        group=AgreementGroup(dp_size=2, dp_rank=stage),
        dispatcher=CudaGraphDispatcher(
            capture_sizes=(1, 2, 4, 8), capture_mode=CaptureMode.FULL, max_num_reqs=8
        ),
    )
    driver = RankDriver(config, interpreter, TorchIO(interpreter))
    state = init_rank(config)
    descriptor = None  # the last step's agreed shape
    for step in range(4):
        begun = driver.begin(state)  # stage 0: the tokens stage 1 sampled 2 steps ago
        if begun.consumed is not None:
            tokens = interpreter.tensor(begun.consumed.sampled_tokens)[:, 0].tolist()
            got = begun.consumed.received_at_step
            print(f"step {step}: stage 0 got {tokens} from step {got}", flush=True)
        batch = BatchFacts(
            idx_mapping=[0, 1],
            num_computed_tokens=[4 + step, 9 + step],
            num_scheduled_tokens=[1, 1],
            prefill_len=[4, 4],
        )
        agreed = driver.agree(begun, batch, ShapeFacts(num_tokens=2, uniform_token_count=1))
        sampled = None  # ...the forward runs at agreed.descriptor; the last stage samples:
        if config.is_last_stage:
            sampled = Sampled(
                tokens=torch.tensor([[100 + step], [200 + step]]),
                num_sampled=torch.ones(2, dtype=torch.int32),
                num_rejected=torch.zeros(2, dtype=torch.int32),
            )
        state = driver.finish(agreed, sampled)  # relay the tokens, end the step
        descriptor = agreed.descriptor
    agreed_shapes.put(repr(descriptor))
    dist.destroy_process_group()


if __name__ == "__main__":
    rendezvous = f"file://{tempfile.mkdtemp()}/rendezvous"
    spawn = multiprocessing.get_context("spawn")
    shapes: "Queue[str]" = spawn.Queue()
    stages = [spawn.Process(target=run_stage, args=(s, rendezvous, shapes)) for s in (0, 1)]
    for process in stages:
        process.start()
    last = [shapes.get(timeout=60) for _ in stages]  # each stage's last agreed shape
    for process in stages:
        process.join()
    if any(process.exitcode != 0 for process in stages):
        raise SystemExit("a stage failed")
    print(f"both stages agreed {last[0]}" if last[0] == last[1] else f"disagreed: {last}")
