"""The measurements of a lent GPU, in one process: what the hardware gives the recipe's models, and what gossip
costs the step.

    python -m recipe.tools.gpu_check [--smoke] [--seconds 2] [--out gpu_check.json]

As a world of one learner (NCCL on CUDA; gloo where there is no GPU), each in a DeepSpeed engine built as the
recipe builds it (recipe/lib/engine.py: the recipe's fused optimizer, bf16 LSTM weights packed for cuDNN):
  1. throughput: training frames/s and model FLOP utilization (MFU: the model's matrix FLOPs, 3x the forward's,
     over the device's dense peak for the precision) of
       - the paper's model (recipe/conf/paper.yaml, 43M parameters): frame CE on 21-frame chunks of 260 dims,
         64, 256 and 1,024 chunks a step (the follow-up trained 768 a learner),
       - the default model (recipe/conf/default.yaml): CTC on 3-second utterances of 120 dims, 8, 32 and 128 a
         step,
     in fp32, TF32, bf16 and fp16, with whether the LSTM's weights were packed (one cuDNN buffer);
  2. gossip on the step's path: the paper's model in bf16 trained with a gossip thread that runs a round after
     every step against a peer answering at once (the staging, copies to the host and back and the merge of
     comm/staging.py, without the network), against the same steps without gossip: ms per step both ways and
     per round;
  3. a gossip merge into the bf16 engine's fp32 masters survives the next optimizer step and reaches the module
     (DESIGN.md §9.15).
Prints one JSON object and writes it to --out. --smoke runs every part on tiny models in seconds, on the CPU
too (fp32 and bf16 there: DeepSpeed refuses fp16 on the CPU and TF32 is a GPU mode); tests/test_gpu_check.py
runs it that way so the script cannot rot between GPU loans. recipe/tools/gpu_check.sh runs it on a bare GPU
machine together with the recipe end to end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

from comm.gossip import GossipThread, flatten
from comm.weights import Weights

CHUNK = 21  # frames per chunk of the paper's frame CE
UTTERANCE = 300  # frames per utterance for CTC (3 s)
MODELS = {  # name -> model settings, objective, micro batches (chunks or utterances)
    "paper": ({"input_dim": 260, "output_dim": 32000, "layers": 6, "hidden": 512, "bottleneck": 256}, "ce",
              (64, 256, 1024)),
    "default": ({"input_dim": 120, "output_dim": 32, "layers": 3, "hidden": 192, "stack": 2}, "ctc", (8, 32, 128)),
}
SMOKE = {
    "paper": ({"input_dim": 260, "output_dim": 500, "layers": 1, "hidden": 32, "bottleneck": 16}, "ce", (4, 8)),
    "default": ({"input_dim": 120, "output_dim": 32, "layers": 1, "hidden": 16, "stack": 2}, "ctc", (2, 4)),
}
PRECISIONS = {  # name -> DeepSpeed settings, TF32 allowed
    "fp32": ({}, False),
    "tf32": ({}, True),
    "bf16": ({"bf16": {"enabled": True}}, True),
    "fp16": ({"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}}, True),
}
PEAK_TFLOPS = {  # dense peaks of the SXM parts by precision (NVIDIA's data sheets; sparsity not counted)
    "H100": {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
    "H200": {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
}


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def training_flops_per_frame(dims: dict) -> float:
    """Matrix FLOPs of one input frame, forward and backward (3x the forward's multiply-adds x 2)."""
    hidden, stack, directions = dims["hidden"], dims.get("stack", 1), 2
    forward, width = 0.0, dims["input_dim"] * stack
    for _ in range(dims["layers"]):
        forward += directions * 2 * 4 * hidden * (width + hidden) / stack  # one LSTM step covers `stack` frames
        width = directions * hidden
    if dims.get("bottleneck"):
        forward += 2 * width * dims["bottleneck"] / stack
        width = dims["bottleneck"]
    forward += 2 * width * dims["output_dim"] / stack
    return 3 * forward


def make_batch(objective: str, micro: int, dims: dict, device) -> tuple[dict, int]:
    """A random batch of the objective's shape -> (batch for train_step, input frames)."""
    g = torch.Generator().manual_seed(0)
    frames = CHUNK if objective == "ce" else UTTERANCE
    batch = {"feats": torch.randn(micro, frames, dims["input_dim"], generator=g),
             "lengths": torch.full((micro,), frames)}
    if objective == "ce":
        batch["frame_targets"] = torch.randint(0, dims["output_dim"], (micro, frames), generator=g)
    else:
        tokens = 30
        batch["targets"] = torch.randint(1, dims["output_dim"], (micro * tokens,), generator=g)
        batch["target_lengths"] = torch.full((micro,), tokens)
    return {k: v.to(device) for k, v in batch.items()}, micro * frames


def build(dims: dict, micro: int, precision: str):
    """The recipe's engine (SYNC, a world of one) for a model and precision -> (engine, its strategy)."""
    from omegaconf import OmegaConf

    from comm import ProcessLayout, build_strategy
    from model.lstm import LSTMAcousticModel
    from recipe.lib.engine import build_engine, make_optimizer

    settings, tf32 = PRECISIONS[precision]
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    torch.manual_seed(0)
    model = LSTMAcousticModel(**dims)
    optim = OmegaConf.create({"name": "adam", "weight_decay": 0.0, "momentum": 0.0})
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": 5.0, **settings}
    strategy = build_strategy({"strategy": "sync"}, ProcessLayout.from_env())
    return build_engine(model, make_optimizer(optim, model.parameters(), 1e-3), config, strategy), strategy


def lstm_packed(engine) -> bool:
    """Whether the LSTM's weights share one buffer (what cuDNN runs on without copying them at every call)."""
    lstm = engine.module.lstm
    storages = {w.untyped_storage().data_ptr() for w in lstm._flat_weights}
    return len(storages) == 1


def timed_steps(engine, strategy, batch: dict, seconds: float, least: int, warmup: int) -> dict:
    """Train steps on one batch for about `seconds` after `warmup` -> steps, ms per step, first and last loss."""
    from recipe.lib.engine import train_step

    losses = [train_step(engine, strategy, batch).loss for _ in range(warmup)]
    synchronize()
    t0, steps = time.perf_counter(), 0
    while steps < least or time.perf_counter() - t0 < seconds:
        losses.append(train_step(engine, strategy, batch).loss)
        steps += 1
    synchronize()
    wall = time.perf_counter() - t0
    return {"steps": steps, "step_ms": 1000 * wall / steps, "loss_first": losses[0], "loss_last": losses[-1]}


def throughput(models: dict, precisions: list[str], seconds: float, least: int, warmup: int, peak: dict | None):
    rows = []
    for name, (dims, objective, micros) in models.items():
        for precision in precisions:
            for micro in micros:
                row = {"model": name, "objective": objective, "precision": precision, "micro_batch": micro}
                try:
                    engine, sync = build(dims, micro, precision)
                    batch, frames = make_batch(objective, micro, dims, engine.device)
                    timing = timed_steps(engine, sync, batch, seconds, least, warmup)
                    fps = frames / (timing["step_ms"] / 1000)
                    tflops = fps * training_flops_per_frame(dims) / 1e12
                    row.update(timing, frames_per_s=fps, model_tflops=tflops, lstm_packed=lstm_packed(engine),
                               mfu=tflops / peak[precision] if peak else None)
                    del engine, batch
                except Exception as err:  # one configuration that fails (memory, a kernel) is reported, not fatal
                    row["error"] = f"{type(err).__name__}: {err}"[:500]
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


class LoopbackGossip(GossipThread):
    """A gossip thread whose peer answers at once with the weights it was sent: each round stages the weights
    to the host, 'exchanges' them and merges a (zero) delta, as a real round does, without the network."""

    def _send_receive(self, r, peer, outgoing, incoming):
        incoming.copy_(outgoing)


class GossipStrategy:
    """train_step's two hooks with a LoopbackGossip thread behind them, as ADPSGD's."""

    def __init__(self, engine):
        self.lock = threading.Lock()
        self.thread = LoopbackGossip(Weights(engine).masters, lambda r: 0, None, self.lock, period=1).start()

    def step_lock(self):
        return self.lock

    def after_step(self, engine) -> None:
        self.thread.apply_pending()
        self.thread.step_done()

    def close(self) -> dict:
        self.thread.stop(self.thread.pause(), timeout=60)
        return {"rounds": self.thread.rounds_started, "round_ms": 1000 * self.thread.stats.exchange_seconds /
                max(self.thread.rounds_started, 1)}


def gossip_cost(dims: dict, micro: int, precision: str, seconds: float, least: int, warmup: int) -> dict:
    """The same steps without gossip and with a round after every step, arms interleaved twice."""
    engine, sync = build(dims, micro, precision)
    batch, _ = make_batch("ce", micro, dims, engine.device)
    arms = {"off": [], "on": []}
    rounds = {}
    for _ in range(2):
        arms["off"].append(timed_steps(engine, sync, batch, seconds, least, warmup)["step_ms"])
        gossip = GossipStrategy(engine)
        arms["on"].append(timed_steps(engine, gossip, batch, seconds, least, warmup)["step_ms"])
        rounds = gossip.close()
    off, on = min(arms["off"]), min(arms["on"])
    return {"precision": precision, "micro_batch": micro, "step_ms_gossip_off": off, "step_ms_gossip_on": on,
            "gossip_on_over_off": on / off, **rounds}


def merge_survives_a_step(dims: dict, micro: int) -> dict:
    """A peer's delta merged into the bf16 engine's masters, then one optimizer step at lr 0: -> how far the
    masters are from the merged weights (0: kept) and the module's parameters from the masters (bf16 rounding)."""
    from comm.staging import Staging

    engine, sync = build(dims, micro, "bf16")
    weights = Weights(engine)
    merged = flatten(weights.masters) + 0.5
    Staging(weights.masters).add(torch.full_like(merged, 0.5))
    weights.publish()
    for group in engine.optimizer.param_groups:
        group["lr"] = 0.0
    batch, _ = make_batch("ce", micro, dims, engine.device)
    timed_steps(engine, sync, batch, 0.0, 1, 0)
    masters, module = flatten(weights.masters), flatten(weights.params)
    return {"merge_kept_max_error": float((masters - merged).abs().max()),
            "module_vs_masters_max_error": float((module - masters.bfloat16().float()).abs().max())}


def environment() -> dict:
    import deepspeed

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "device_name": name, "torch": torch.__version__,
            "deepspeed": deepspeed.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny models, a few steps: the whole path in seconds")
    p.add_argument("--seconds", type=float, default=2.0, help="timed seconds per configuration")
    p.add_argument("--out", default="gpu_check.json")
    a = p.parse_args(argv)
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        from recipe.tools.local_learners import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    import torch.distributed as dist

    from comm import init_distributed

    init_distributed()
    gpu = torch.cuda.is_available()
    models = SMOKE if a.smoke else MODELS
    seconds, least, warmup = (0.0, 2, 1) if a.smoke else (a.seconds, 5, 3)
    env = environment()
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in env["device_name"]), None)
    precisions = list(PRECISIONS) if gpu else ["fp32", "bf16"]
    result = {**env, "backend": dist.get_backend(), "smoke": a.smoke, "peak_tflops": peak,
              "throughput": throughput(models, precisions, seconds, least, warmup, peak)}
    dims, _, micros = models["paper"]
    result["gossip"] = gossip_cost(dims, micros[0], "bf16", seconds, least, warmup)
    result["merge"] = merge_survives_a_step(dims, micros[0])
    if gpu:
        result["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    print(json.dumps(result, indent=1))
    Path(a.out).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
