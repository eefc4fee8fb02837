"""The scaling model (recipe/simulate.py) calibrated on this machine: measure its inputs here, predict the
multi-learner runs, run them, compare.

Inputs, measured: the compute rate of a learner while the machine is full, from `cores` single-thread learners
training side by side with no communication (ADPSGD with gossip off: no round ever starts); the loopback link,
from gloo allreduces of 4 bytes (latency) and of the model's bytes between 2 learners; the cost of one gossip
merge (snapshot + adding a delta) of the model. W learners of t threads on this machine then run at that rate
x min(1, cores / (W t)) apiece. Predicted and then measured: SYNC and ADPSGD on 2 and 4 learners, HYBRID on 2
emulated nodes of 2 (one epoch of recipe/train.py each, the same subset corpus). Printed: predicted and
measured aggregate frames/s.

Why the full machine, not one learner alone: one learner with 1 thread ran 5,825 frames/s and with 2 threads
7,846, but 2 single-thread learners together ran 9,000; learners compete for memory bandwidth and caches and
an LSTM at batch 8 uses a second thread poorly, so neither "cores are independent" (up to 30% too fast) nor
"the learners share one learner's 2-thread rate" (up to 18% too slow) predicted well.

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
    from recipe.config import load_config
    from recipe.experiment import Experiment

    base, subset = prepare_subset(work, utterances, epochs=1)
    exp = Experiment(str(base), load_config(None, subset))
    train_set = exp.dataset("train")
    micro = 8  # ds_configs/*.json
    model = exp.build_model(train_set.cache.dim)
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    frames_per_step = float(train_set.lengths.mean()) * micro
    cores = len(os.sched_getaffinity(0))
    print(f"calibration on {cores} cores: {len(train_set)} utterances, {n_params:,} parameters "
          f"({4 * n_params / 2 ** 20:.1f} MiB), {frames_per_step:.0f} frames per step of {micro} utterances")

    def full_machine_rate() -> float:  # per learner: `cores` learners computing side by side, no communication
        arm = ("ds_configs/adpsgd.json", {"period": 10 ** 9})
        return run_arm(work, base, "cal-compute", arm, subset, cores)["train_frames_per_s"] / cores

    # the machine drifts: the compute input is measured before and after the runs it predicts, averaged
    rate_before = full_machine_rate()
    timings = run_learners(link_learner, 2, 4 * n_params)[0]
    # a ring allreduce over 2 learners: 2 phases of (latency + M / 2 / bandwidth)
    latency_s = timings["small"] / 2
    bytes_per_s = (4 * n_params / 2) / (timings["model"] / 2 - latency_s)
    loopback = Link(bandwidth_gbps=bytes_per_s * 8 / 1e9, latency_us=latency_s * 1e6)
    merge_s = merge_seconds(params)
    print(f"inputs: loopback link {loopback.bandwidth_gbps:.2f} Gbit/s, {loopback.latency_us:.0f} us (gloo "
          f"allreduce, 2 learners); gossip merge {1000 * merge_s:.1f} ms")

    runs = [("sync", 2, 1), ("sync", 4, 1), ("adpsgd", 2, 1), ("adpsgd", 4, 1), ("hybrid", 4, 2)]
    measured = {run: run_arm(work, base, f"cal-{run[0]}-{run[1]}", (f"ds_configs/{run[0]}.json", {}), subset,
                             run[1], run[2])["train_frames_per_s"] for run in runs}
    rate_after = full_machine_rate()
    rate = (rate_before + rate_after) / 2
    print(f"inputs: a learner computes {rate:.0f} frames/s while {cores} learners fill the machine "
          f"({rate_before:.0f} before the runs, {rate_after:.0f} after)")

    print(f"{'strategy':>8} {'learners':>9} {'predicted frames/s':>19} {'measured':>9} {'predicted/measured':>19}")
    errors = []
    for (strategy, learners, nodes), got in measured.items():
        threads = max(1, cores // learners)  # recipe/train.py's threads_per_learner
        per_learner = rate * min(1.0, cores / (learners * threads))
        cluster = Cluster(learners, learners // nodes, per_learner, loopback, loopback,
                          merge_s=merge_s if strategy != "sync" else 0.0)
        work_ = Workload(params=n_params, frames_per_step=frames_per_step, frames_per_epoch=train_set.lengths.sum())
        predicted = estimate(strategy, cluster, work_).frames_per_s
        errors.append(predicted / got - 1)
        print(f"{strategy:>8} {learners:>9} {predicted:19.0f} {got:9.0f} {predicted / got:19.3f}")
    print(f"largest disagreement: {100 * max(map(abs, errors)):.0f}% (target: within 20%)")
