"""Benchmark: the recipe's SYNC training path against a plain hand-written PyTorch DDP loop, side by side.

    python -m recipe.bench --exp exp/sync [--learners 2] [--steps 60] [--rounds 3]

Both arms train the same model on the same batches (the experiment's features, batches from its sampler)
with the same learners, threads per learner, optimizer and gradient clipping; they alternate (DDP, recipe,
DDP, recipe, ...) so that drift in this shared machine's speed hits both. Each arm is a fresh set of learner
processes on gloo over localhost; the first few steps of each are warm-up and are not timed. The printed
ratio is recipe frames/s over DDP frames/s (target >= 0.95). Also measures feature extraction's real-time
factor on the held-out set with 1 and 2 workers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from omegaconf import OmegaConf

WARMUP_STEPS = 5


def learner(rank: int, world: int, port: int, arm: str, args: dict, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))
    import torch.distributed as dist

    from comm import ProcessLayout, build_strategy
    from model.lstm import ctc_loss
    from recipe.dataset import BucketBatchSampler
    from recipe.ds_config import load_ds_config
    from recipe.experiment import Experiment
    from recipe.train import build_engine, make_optimizer, threads_per_learner, train_step

    exp = Experiment(args["exp"])
    conf = exp.conf
    engine_conf, comm_conf = load_ds_config(args["ds_config"])
    torch.set_num_threads(threads_per_learner(conf.train.num_threads, world))
    data = exp.dataset("train")
    micro = engine_conf["train_micro_batch_size_per_gpu"]
    batches = BucketBatchSampler(data.lengths, micro, rank, world, conf.train.seed).rank_batches(1)
    batches = batches[: WARMUP_STEPS + args["steps"]]
    collated = [data.collate(b) for b in batches]  # outside the timed loop, the same for both arms

    if arm == "recipe":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        strategy = build_strategy(comm_conf, ProcessLayout.from_env())
        engine = build_engine(exp, conf, engine_conf, strategy, data.cache.dim, micro * world)

        def step(b):
            train_step(engine, strategy, b)
    else:
        dist.init_process_group("gloo")
        torch.manual_seed(conf.train.seed)
        model = torch.nn.parallel.DistributedDataParallel(exp.build_model(data.cache.dim))
        optimizer = make_optimizer(conf.optim, model.parameters(), conf.optim.lr)
        clip = engine_conf.get("gradient_clipping", 0.0)

        def step(b):
            logits, out_lengths = model(b["feats"], b["lengths"])
            loss = ctc_loss(logits, out_lengths, b["targets"], b["target_lengths"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            loss.item()

    for b in collated[:WARMUP_STEPS]:
        step(b)
    dist.barrier()
    t0 = time.perf_counter()
    for b in collated[WARMUP_STEPS:]:
        step(b)
    dist.barrier()
    wall = time.perf_counter() - t0
    frames = torch.tensor([float(sum(int(b["lengths"].sum()) for b in collated[WARMUP_STEPS:]))])
    dist.all_reduce(frames)
    results[rank] = {"frames_per_s": frames.item() / wall, "wall_s": wall}
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_arm(arm: str, learners: int, args: dict) -> dict:
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=learner, args=(r, learners, port, arm, args, results)) for r in range(learners)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"{arm}: a learner failed (exit codes {[p.exitcode for p in procs]})")
        return dict(results[0])


def feature_rtf(exp_dir: str, workers: int) -> float:
    from recipe.data import load_data_dir
    from recipe.experiment import Experiment
    from recipe.features import extract_features

    exp = Experiment(exp_dir)
    utts, _ = load_data_dir(exp.data_dir("test"))
    tmp = Path(tempfile.mkdtemp(prefix="bench-feats-"))
    try:
        conf = OmegaConf.merge(OmegaConf.to_container(exp.conf.features), {"num_workers": workers})
        folder = extract_features(utts, tmp, "test", conf, exp.conf.data.sample_rate, progress=False)
        return json.loads((folder / "meta.json").read_text())["real_time_factor"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--exp", default="exp/sync", help="a trained or prepared experiment (stages 1-3)")
    p.add_argument("--ds-config", default="ds_configs/sync.json")
    p.add_argument("--learners", type=int, default=2)
    p.add_argument("--steps", type=int, default=60, help="timed steps per arm and round")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    args = {"exp": a.exp, "ds_config": a.ds_config, "steps": a.steps}
    print(f"training throughput, {a.learners} learners, {a.steps} timed steps per arm, {a.rounds} rounds")
    ratios = []
    for r in range(1, a.rounds + 1):
        ddp = run_arm("ddp", a.learners, args)
        recipe = run_arm("recipe", a.learners, args)
        ratios.append(recipe["frames_per_s"] / ddp["frames_per_s"])
        print(f"round {r}: DDP {ddp['frames_per_s']:8.0f} frames/s   recipe SYNC {recipe['frames_per_s']:8.0f} "
              f"frames/s   ratio {ratios[-1]:.3f}")
    print(f"recipe / DDP throughput ratio: median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
    for workers in (1, 2):
        print(f"feature extraction real-time factor, {workers} worker(s): {feature_rtf(a.exp, workers):.5f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
