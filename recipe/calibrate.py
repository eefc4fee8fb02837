"""The scaling model (recipe/simulate.py) calibrated on this machine: measure its inputs here, predict the
multi-learner runs, run them, compare.

Inputs, measured: one learner's training throughput alone with 1 and with 2 torch threads (one epoch of
recipe/train.py each); the loopback link, from gloo allreduces of 4 bytes (latency) and of the model's bytes
between 2 learners; the cost of one gossip merge (snapshot + adding a delta) of the model. Several learners
on this machine's cores share them: each learner of W, with t threads, runs at rate(t) x min(1, cores / (W t)).
Predicted and then measured: SYNC, ADPSGD on 2 and 4 learners, HYBRID on 2 emulated nodes of 2 (one epoch of
recipe/train.py each, the same subset corpus). Printed: predicted and measured aggregate frames/s.

    python -m recipe.simulate calibrate [--work exp/bench] [--utterances 600]
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from recipe.bench import prepare_subset, run_arm
from recipe.local_learners import run_learners
from recipe.simulate import Cluster, Link, Workload, estimate

REPEATS = 20


def link_learner(rank: int, world: int, model_bytes: int) -> dict:
    import torch.distributed as dist

    from comm import init_distributed

    torch.set_num_threads(1)
    init_distributed()
    timings = {}
    for name, numel in (("small", 1), ("model", model_bytes // 4)):
        t = torch.ones(numel)
        dist.all_reduce(t)  # warm-up
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(REPEATS):
            dist.all_reduce(t)
        timings[name] = (time.perf_counter() - t0) / REPEATS
    return timings


def merge_seconds(params: list[torch.Tensor]) -> float:
    from comm.gossip import add_flat, flatten

    delta = flatten(params)
    t0 = time.perf_counter()
    for _ in range(REPEATS):
        add_flat(params, flatten(params).sub_(delta))  # a snapshot and a merge, as one gossip round costs
    return (time.perf_counter() - t0) / REPEATS


def calibrate(work: Path, utterances: int) -> None:
    from recipe.experiment import Experiment

    base, subset = prepare_subset(work, utterances, epochs=1)
    exp = Experiment(str(base))
    train_set = exp.dataset("train")
    micro = 8  # ds_configs/*.json
    model = exp.build_model(train_set.cache.dim)
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    frames_per_step = float(train_set.lengths.mean()) * micro
    cores = len(os.sched_getaffinity(0))
    print(f"calibration on {cores} cores: {len(train_set)} utterances, {n_params:,} parameters "
          f"({4 * n_params / 2 ** 20:.1f} MiB), {frames_per_step:.0f} frames per step of {micro} utterances")

    sync_arm = ("ds_configs/sync.json", {})
    rate = {t: run_arm(work, base, f"cal-1x{t}", sync_arm, [*subset, f"train.num_threads={t}"], 1)
            ["train_frames_per_s"] for t in (1, 2)}
    timings = run_learners(link_learner, 2, 4 * n_params)[0]
    # a ring allreduce over 2 learners: 2 phases of (latency + M / 2 / bandwidth)
    latency_s = timings["small"] / 2
    bytes_per_s = (4 * n_params / 2) / (timings["model"] / 2 - latency_s)
    loopback = Link(bandwidth_gbps=bytes_per_s * 8 / 1e9, latency_us=latency_s * 1e6)
    merge_s = merge_seconds(params)
    print(f"inputs: one learner alone {rate[1]:.0f} frames/s (1 thread), {rate[2]:.0f} (2 threads); loopback "
          f"link {loopback.bandwidth_gbps:.2f} Gbit/s, {loopback.latency_us:.0f} us (gloo allreduce, 2 learners); "
          f"gossip merge {1000 * merge_s:.1f} ms")

    print(f"{'strategy':>8} {'learners':>9} {'predicted frames/s':>19} {'measured':>9} {'predicted/measured':>19}")
    runs = [("sync", 2, 1), ("sync", 4, 1), ("adpsgd", 2, 1), ("adpsgd", 4, 1), ("hybrid", 4, 2)]
    errors = []
    for strategy, learners, nodes in runs:
        threads = max(1, cores // learners)
        per_learner = rate[min(threads, 2)] * min(1.0, cores / (learners * threads))
        cluster = Cluster(learners, learners // nodes, per_learner, loopback, loopback,
                          merge_s=merge_s if strategy != "sync" else 0.0)
        work_ = Workload(params=n_params, frames_per_step=frames_per_step, frames_per_epoch=train_set.lengths.sum())
        predicted = estimate(strategy, cluster, work_).frames_per_s
        measured = run_arm(work, base, f"cal-{strategy}-{learners}", (f"ds_configs/{strategy}.json", {}), subset,
                           learners, nodes)["train_frames_per_s"]
        errors.append(predicted / measured - 1)
        print(f"{strategy:>8} {learners:>9} {predicted:19.0f} {measured:9.0f} {predicted / measured:19.3f}",
              flush=True)
    print(f"largest disagreement: {100 * max(map(abs, errors)):.0f}% (target: within 20%)")
