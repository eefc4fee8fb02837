"""The scaling model (recipe/tools/simulate.py) calibrated on this machine: measure its inputs here, predict the
multi-learner runs, run them, compare.

Inputs, measured:
  - compute: the rate of a learner while W learners (W = 2 and 4, the sizes predicted) train side by side
    with no communication (ADPSGD whose gossip never starts a round), before and after the runs it predicts,
    averaged (the machine drifts). The sharing of cores, caches and memory bandwidth is in it: on 2 cores,
    4 learners compute-only ran 22% fewer frames/s in all than 2 (2026-12-03);
  - uneven steps: the spread of frames per batch in the sampler's batches of the training set (sigma of
    their log), the jitter that makes SYNC wait for the slowest learner each step;
  - the loopback link: gloo allreduces of 4 bytes (latency) and of the model's bytes between 2 learners;
  - one gossip merge (snapshot + adding a delta) of the model.
The cluster is a shared host of this machine's cores (Cluster.host_cores): communication runs on the cores
that compute. Predicted and then measured: SYNC and ADPSGD on 2 and 4 learners, HYBRID on 2 emulated nodes of
2 (one epoch of recipe/train.py each, the same subset corpus). Printed: predicted and measured aggregate
frames/s. The 1-learner rates are inputs, not predictions.

How the inputs came to be these (each was measured against the runs): treating cores as independent (one
learner's rate x cores) was up to 30% too fast, and sharing one learner's 2-thread rate up to 18% too slow;
one compute rate for all W (the full machine's, scaled by cores / W) left 4 learners 28-61% too fast, and
overlapping the gossip exchange with the compute (true on a GPU, whose gossip thread has a core to itself)
left ADPSGD 19% too fast on 2 learners.

    python -m recipe.tools.calibrate [--work exp/bench] [--utterances 600]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch

from recipe.lib.dataset import BucketBatchSampler
from recipe.tools.bench import prepare_subset, run_arm
from recipe.tools.local_learners import run_learners
from recipe.tools.simulate import Cluster, Link, Workload, estimate

REPEATS = 20
SIZES = (2, 4)  # learner counts predicted


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
    from comm.gossip import flatten
    from comm.staging import add_flat

    delta = flatten(params)
    t0 = time.perf_counter()
    for _ in range(REPEATS):
        add_flat(params, flatten(params).sub_(delta))  # a snapshot and a merge, as one gossip round costs
    return (time.perf_counter() - t0) / REPEATS


def calibrate(work: Path, utterances: int) -> None:
    from recipe.lib.config import load_config
    from recipe.lib.experiment import Experiment

    base, subset = prepare_subset(work, utterances, epochs=1)
    exp = Experiment(str(base), load_config(None, subset))
    train_set = exp.dataset("train")
    micro = 8  # ds_configs/*.json
    model = exp.build_model(train_set.dim)
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    frames_per_step = float(train_set.lengths.mean()) * micro
    cores = len(os.sched_getaffinity(0))
    print(f"calibration on {cores} cores: {len(train_set)} utterances, {n_params:,} parameters "
          f"({4 * n_params / 2 ** 20:.1f} MiB), {frames_per_step:.0f} frames per step of {micro} utterances")

    def compute_rates() -> dict[int, float]:  # per learner: W learners side by side, no communication
        arm = ("ds_configs/adpsgd.json", {"period": 10 ** 9})
        return {w: run_arm(work, base, f"cal-compute-{w}", arm, subset, w)["train_frames_per_s"] / w
                for w in SIZES}

    rates_before = compute_rates()
    timings = run_learners(link_learner, 2, 4 * n_params)[0]
    # a ring allreduce over 2 learners: 2 phases of (latency + M / 2 / bandwidth)
    latency_s = timings["small"] / 2
    bytes_per_s = (4 * n_params / 2) / (timings["model"] / 2 - latency_s)
    loopback = Link(bandwidth_gbps=bytes_per_s * 8 / 1e9, latency_us=latency_s * 1e6)
    merge_s = merge_seconds(params)
    batch_frames = np.array([train_set.lengths[b].sum() for b in
                             BucketBatchSampler(train_set.lengths, micro).epoch_batches(1)], dtype=float)
    jitter = float(np.log(batch_frames).std())
    print(f"inputs: loopback link {loopback.bandwidth_gbps:.2f} Gbit/s, {loopback.latency_us:.0f} us (gloo "
          f"allreduce, 2 learners); gossip merge {1000 * merge_s:.1f} ms; frames per batch {batch_frames.mean():.0f}"
          f" (sigma of log {jitter:.2f})")

    runs = [("sync", 2, 1), ("sync", 4, 1), ("adpsgd", 2, 1), ("adpsgd", 4, 1), ("hybrid", 4, 2)]
    measured = {run: run_arm(work, base, f"cal-{run[0]}-{run[1]}", (f"ds_configs/{run[0]}.json", {}), subset,
                             run[1], run[2])["train_frames_per_s"] for run in runs}
    rates_after = compute_rates()
    rates = {w: (rates_before[w] + rates_after[w]) / 2 for w in SIZES}
    for w in SIZES:
        print(f"inputs: {w} learners side by side compute {rates[w]:.0f} frames/s each "
              f"({rates_before[w]:.0f} before the runs, {rates_after[w]:.0f} after)")

    print(f"{'strategy':>8} {'learners':>9} {'predicted frames/s':>19} {'measured':>9} {'predicted/measured':>19}")
    errors = []
    work_ = Workload(params=n_params, frames_per_step=frames_per_step, frames_per_epoch=train_set.lengths.sum())
    for (strategy, learners, nodes), got in measured.items():
        cluster = Cluster(learners, learners // nodes, rates[learners], loopback, loopback, jitter=jitter,
                          merge_s=merge_s if strategy != "sync" else 0.0, host_cores=cores,
                          threads=max(1, cores // learners))  # recipe/train.py's threads per learner
        predicted = estimate(strategy, cluster, work_).frames_per_s
        errors.append(predicted / got - 1)
        print(f"{strategy:>8} {learners:>9} {predicted:19.0f} {got:9.0f} {predicted / got:19.3f}")
    print(f"largest disagreement: {100 * max(map(abs, errors)):.0f}% (target: within 20%)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="exp/bench", help="folder for the benchmark corpus and runs")
    p.add_argument("--utterances", type=int, default=600, help="synthesized training utterances")
    a = p.parse_args(argv)
    calibrate(Path(a.work).resolve(), a.utterances)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
