"""One short, prepared check for a lent GPU: the CUDA/NCCL path and the paper-sized model's throughput.

    python -m recipe.tools.gpu_check [--size paper] [--steps 300] [--out gpu_check.json]

In one call, as a world of one learner (NCCL on CUDA; gloo where there is no GPU):
  1. SYNC: the paper-sized model (recipe/conf/paper.yaml: 6 x 512 BLSTM, 256 bottleneck, 32,000 outputs)
     in a DeepSpeed engine configured by ds_configs/tuning/sync_bf16.json, trained with frame-level cross
     entropy on random 21-frame chunks of 260-dim input (the paper's shape; 64 chunks per micro batch from the
     JSON): loss at the start and the end, and training frames/s after warm-up;
  2. the ADPSGD gossip staging path: a snapshot of the fp32 master weights to pinned host memory and a delta
     added back on the device, as every gossip round does (comm/gossip.py HostStaging): milliseconds per
     exchange and GB/s (before 2026-12-04 it timed a plain pageable copy of the module's weights instead);
  3. a gossip merge on the bf16 engine, from a simulated peer (NCCL refuses two learners on one GPU): added to
     DeepSpeed's fp32 master weights as comm/weights.py does, it must survive the next optimizer step (at
     learning rate 0) and be what the module computes with (DESIGN.md §9.15).
Prints one JSON object and writes it to --out. Without a GPU the same code runs on the CPU (--size tiny keeps
it to seconds); tests/test_gpu_check.py runs it that way so the script cannot rot between GPU loans.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from comm.weights import Weights

REPO = Path(__file__).resolve().parents[2]
SIZES = {  # model settings: the paper's, and a tiny one for the CPU test
    "paper": {"input_dim": 260, "output_dim": 32000, "layers": 6, "hidden": 512, "bottleneck": 256},
    "tiny": {"input_dim": 260, "output_dim": 500, "layers": 1, "hidden": 32, "bottleneck": 16},
}
CHUNK = 21  # frames per training chunk (the paper's)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def train_throughput(engine, steps: int, warmup: int, micro: int, dims: dict) -> dict:
    from recipe.lib.engine import backward

    device, dtype = engine.device, next(engine.module.parameters()).dtype
    g = torch.Generator(device="cpu").manual_seed(0)
    feats = torch.randn(micro, CHUNK, dims["input_dim"], generator=g).to(device, dtype)
    targets = torch.randint(0, dims["output_dim"], (micro, CHUNK), generator=g).to(device)
    lengths = torch.full((micro,), CHUNK, device=device)
    losses = []
    for step in range(warmup + steps):
        if step == warmup:
            synchronize()
            t0 = time.perf_counter()
        logits, _ = engine(feats, lengths)  # (B, 21, V)
        loss = F.cross_entropy(logits.float().reshape(-1, dims["output_dim"]), targets.reshape(-1))
        backward(engine, loss)  # fp16's loss scale as the recipe applies it
        engine.step()
        if step in (0, warmup + steps - 1):
            losses.append(loss.item())
    synchronize()
    wall = time.perf_counter() - t0
    return {"train_steps": steps, "micro_batch_chunks": micro, "train_frames_per_s": steps * micro * CHUNK / wall,
            "step_ms": 1000 * wall / steps, "loss_first": losses[0], "loss_last": losses[-1]}


def staging_cost(masters: list[torch.Tensor], repeats: int = 10) -> dict:
    """The gossip thread's staging path itself (comm/gossip.py HostStaging, on the fp32 master weights it
    mixes): a snapshot into pinned host memory on its own stream, and a pinned delta added back."""
    from comm.gossip import HostStaging, add_flat

    staging = HostStaging(masters)
    delta = staging.to_pinned(torch.zeros(sum(p.numel() for p in masters)))
    synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        snapshot = staging.snapshot()  # device -> host, fp32
        add_flat(masters, delta)  # host -> device, added in place
    synchronize()
    seconds = (time.perf_counter() - t0) / repeats
    return {"staging_ms_per_exchange": 1000 * seconds,
            "staging_gb_per_s": 2 * snapshot.numel() * 4 / seconds / 1e9}  # both directions


def merge_survives_a_step(engine, dims: dict, micro: int) -> dict:
    """A peer's delta merged into the master weights, then one optimizer step at lr 0: -> how far the masters
    are from the merged weights (0: kept) and the module's parameters from the masters (bf16 rounding)."""
    from comm.gossip import add_flat, flatten

    weights = Weights(engine)
    merged = flatten(weights.masters) + 0.5
    add_flat(weights.masters, torch.full_like(merged, 0.5))
    weights.publish()
    for group in engine.optimizer.param_groups:
        group["lr"] = 0.0
    train_throughput(engine, steps=1, warmup=0, micro=micro, dims=dims)
    masters = flatten(weights.masters)
    module = flatten(weights.params)
    dtype = next(engine.module.parameters()).dtype
    return {"merge_kept_max_error": float((masters - merged).abs().max()),
            "module_vs_masters_max_error": float((module - masters.to(dtype).float()).abs().max())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="paper")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--ds-config", default=str(REPO / "ds_configs" / "tuning" / "sync_bf16.json"))
    p.add_argument("--out", default="gpu_check.json")
    a = p.parse_args(argv)
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        from recipe.tools.local_learners import free_port

        os.environ["MASTER_PORT"] = str(free_port())

    import deepspeed
    import torch.distributed as dist

    from comm import ProcessLayout, build_strategy, init_distributed
    from model.lstm import LSTMAcousticModel, count_parameters
    from recipe.lib.ds_config import load_ds_config
    from recipe.lib.engine import build_engine

    init_distributed()
    engine_conf, comm_conf = load_ds_config(a.ds_config)
    strategy = build_strategy(comm_conf, ProcessLayout.from_env())
    dims = SIZES[a.size]
    torch.manual_seed(0)
    model = LSTMAcousticModel(**dims)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    engine = build_engine(model, optimizer, engine_conf, strategy)
    result = {"date": time.strftime("%Y-%m-%d"), "device": str(engine.device),
              "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "backend": dist.get_backend(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
              "size": a.size, "params": count_parameters(engine.module),
              "dtype": str(next(engine.module.parameters()).dtype),
              **train_throughput(engine, a.steps, a.warmup, engine_conf["train_micro_batch_size_per_gpu"], dims),
              **staging_cost(Weights(engine).masters),
              **merge_survives_a_step(engine, dims, engine_conf["train_micro_batch_size_per_gpu"])}
    if torch.cuda.is_available():
        result["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    print(json.dumps(result, indent=1))
    Path(a.out).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
