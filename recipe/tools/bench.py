"""Benchmarks, each printing ratios measured side by side in one run (this machine is shared and noisy).

    python -m recipe.tools.bench sync   [--exp exp/sync] [--learners 2] [--steps 60] [--rounds 3]
    python -m recipe.tools.bench adpsgd [--work exp/bench] [--learners 2] [--utterances 1000] [--rounds 2]
    python -m recipe.tools.bench strategies [--work exp/bench] [--nodes 2] [--per-node 2] [--epochs 2]

sync: the recipe's SYNC training path (DeepSpeed engine, train_step of recipe/train.py) against a plain
hand-written PyTorch DistributedDataParallel loop: same model, same batches, same learners and threads per
learner, same optimizer and gradient clipping. The arms alternate (DDP, recipe, DDP, ...) so drift in the
machine's speed hits both; the first steps of each arm are warm-up. Prints recipe/DDP frames/s (target
>= 0.95), how far apart the arms' weights end (0: the same updates), and feature extraction's real-time factor
with 1 and 2 workers.

adpsgd: one epoch of recipe/train.py per arm on a corpus subset, arms interleaved: SYNC, ADPSGD, ADPSGD with
gossip off, with fp16 exchanges, with a round every other step, and each strategy with learner 1 slowed 2x
(comm.debug.slowdown). Prints ADPSGD's gossip overhead and how much of its own throughput each strategy keeps
with the straggler.

strategies: SYNC, ADPSGD, HYBRID and LOCALSGD on 2 emulated nodes x 2 learners, same model, data and epochs, with the
inter-node link emulated slow (comm/link.py): time per epoch, aggregate frames/s, bytes across the node
boundary per epoch, held-out CER.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from recipe.tools.local_learners import run_learners, train_learner

WARMUP_STEPS = 5


def throughput_learner(rank: int, world: int, arm: str, args: dict) -> dict:
    import torch.distributed as dist

    from comm import ProcessLayout, build_strategy, init_distributed
    from recipe.lib.dataset import BucketBatchSampler
    from recipe.lib.ds_config import load_ds_config
    from recipe.lib.engine import (batch_loss, experiment_engine, initial_learning_rate, make_optimizer,
                                   threads_per_learner, train_step)
    from recipe.lib.experiment import Experiment

    exp = Experiment(args["exp"])
    conf = exp.conf
    engine_conf, comm_conf = load_ds_config(args["ds_config"])
    torch.set_num_threads(threads_per_learner(conf.train.num_threads, world))
    data = exp.dataset("train")
    micro = engine_conf["train_micro_batch_size_per_gpu"]
    batches = BucketBatchSampler(data.lengths, micro, rank, world, conf.train.seed).rank_batches(1)
    collated = [data.collate(b) for b in batches[: WARMUP_STEPS + args["steps"]]]  # untimed, same for both

    if arm == "recipe":
        init_distributed()
        strategy = build_strategy(comm_conf, ProcessLayout.from_env())
        engine = experiment_engine(exp, engine_conf, strategy, data.dim, micro * world)
        model = engine.module

        def step(b):
            train_step(engine, strategy, b)
    else:
        dist.init_process_group("gloo")
        torch.manual_seed(conf.train.seed)
        model = torch.nn.parallel.DistributedDataParallel(exp.build_model(data.dim))
        lr = initial_learning_rate(conf, "sync", 1, micro * world)  # the recipe's engine's (until stop 41: optim.lr)
        optimizer = make_optimizer(conf.optim, model.parameters(), lr)
        clip = engine_conf.get("gradient_clipping", 0.0)

        def step(b):
            logits, out_lengths = model(b["feats"], b["lengths"])
            loss = batch_loss(logits, out_lengths, b)
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
    dist.destroy_process_group()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])  # the arms must train alike
    return {"frames_per_s": frames.item() / wall, "wall_s": wall, "weights": weights}


def feature_rtf(exp_dir: str, workers: int) -> float:
    from recipe.lib.datadir import load_data_dir
    from recipe.lib.experiment import Experiment
    from recipe.lib.features import extract_features

    exp = Experiment(exp_dir)
    utts, _ = load_data_dir(exp.data_dir("test"))
    conf = OmegaConf.merge(OmegaConf.to_container(exp.conf.features), {"num_workers": workers})
    tmp = Path(tempfile.mkdtemp(prefix="bench-feats-"))
    try:
        folder = extract_features(utts, tmp, "test", conf, exp.conf.data.sample_rate, progress=False)
        return json.loads((folder / "meta.json").read_text())["real_time_factor"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bench_sync(a) -> None:
    args = {"exp": a.exp, "ds_config": a.ds_config, "steps": a.steps}
    print(f"SYNC vs DDP: {a.learners} learners, {a.steps} timed steps per arm, {a.rounds} rounds, exp {a.exp}")
    ratios = []
    for r in range(1, a.rounds + 1):
        ddp = run_learners(throughput_learner, a.learners, "ddp", args)[0]
        recipe = run_learners(throughput_learner, a.learners, "recipe", args)[0]
        ratios.append(recipe["frames_per_s"] / ddp["frames_per_s"])
        apart = (ddp["weights"] - recipe["weights"]).abs().max().item()  # like for like: the same updates
        print(f"round {r}: DDP {ddp['frames_per_s']:8.0f} frames/s   recipe SYNC {recipe['frames_per_s']:8.0f} "
              f"frames/s   ratio {ratios[-1]:.3f}   weights apart by {apart:.1e}")
    print(f"recipe / DDP throughput ratio: median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
    for workers in (1, 2):
        print(f"feature extraction real-time factor, {workers} worker(s): {feature_rtf(a.exp, workers):.5f}")


ADPSGD_ARMS = {  # name -> (base JSON, comm overrides)
    "sync": ("ds_configs/sync.json", {}),
    "adpsgd": ("ds_configs/adpsgd.json", {}),
    "adpsgd-gossip-off": ("ds_configs/adpsgd.json", {"period": 10 ** 9}),  # the thread never starts a round
    "adpsgd-fp16": ("ds_configs/adpsgd.json", {"exchange_dtype": "fp16"}),  # half the bytes per exchange
    "adpsgd-period2": ("ds_configs/adpsgd.json", {"period": 2}),  # a round every other step
    "sync-straggler": ("ds_configs/sync.json", {"debug": {"slowdown": {"1": 2.0}}}),
    "adpsgd-straggler": ("ds_configs/adpsgd.json", {"debug": {"slowdown": {"1": 2.0}}}),
}
SLOW_LINK = {"bandwidth_gbps": 1.0, "latency_ms": 0.5}  # emulated inter-node network (comm/link.py)
STRATEGY_ARMS = {name: (f"ds_configs/{name}.json", {"link": SLOW_LINK})
                 for name in ("sync", "adpsgd", "hybrid", "localsgd")}


def prepare_subset(work: Path, utterances: int, epochs: int, test: int = 100) -> tuple[Path, list[str]]:
    """A prepared experiment on a synthesized corpus of `utterances` for training and `test` each in the dev and
    test sets (shared by all arms; the per-epoch scores are the dev set's). The speakers are dealt to the held-out
    sets first: another `test` is another corpus."""
    from recipe.prepare import main as prepare

    base = work / f"base-v2-{utterances}-{test}"  # v2: with a dev set (a base of before has none)
    # exactly `epochs` (the fixed schedule, min_updates 0): the arms and the study compare strategies after the
    # same epochs
    subset = [f"data.synth_train={utterances}", f"data.synth_test={test}", f"data.synth_dev={test}",
              f"train.epochs={epochs}", "train.min_updates=0", "optim.schedule=fixed"]
    if not (base / "features.json").is_file():
        for stage in ("data", "features"):
            assert prepare([stage, "--exp", str(base), "--work", str(work), *subset]) == 0
    return base, subset


def run_arm(work: Path, base: Path, name: str, arm: tuple[str, dict], overrides: list[str], learners: int,
            nodes: int = 1, engine: dict | None = None) -> dict:
    """One training run of recipe/train.py with the arm's JSON (its comm section updated by the arm's dict,
    its engine settings by `engine`), in a copy of the prepared experiment."""
    exp = work / name
    shutil.rmtree(exp, ignore_errors=True)
    shutil.copytree(base, exp, ignore=shutil.ignore_patterns("checkpoints", "*.jsonl", "metrics.json"))
    json_path, comm = arm
    ds = {**json.loads(Path(json_path).read_text()), **(engine or {})}
    ds["comm"] = {**ds["comm"], **copy.deepcopy(comm)}
    (exp / "ds.json").write_text(json.dumps(ds))
    argv = ["--exp", str(exp), "--ds-config", str(exp / "ds.json"), "--nodes", str(nodes), *overrides]
    return run_learners(train_learner, learners, argv, timeout=None)[0]


def bench_adpsgd(a) -> None:
    work = Path(a.work).resolve()
    base, subset = prepare_subset(work, a.utterances, epochs=1)
    print(f"ADPSGD: {a.learners} learners ({a.learners} cores), 1 epoch of {a.utterances} utterances per arm, "
          f"{a.rounds} rounds; the straggler is learner 1, slowed 2x")
    results: dict[str, list[dict]] = {name: [] for name in ADPSGD_ARMS}
    for r in range(1, a.rounds + 1):
        for name, arm in ADPSGD_ARMS.items():
            m = run_arm(work, base, f"{name}-{r}", arm, subset, a.learners)
            results[name].append(m)
            extra = f"  gossip: {m['gossip_rounds']} rounds, {m['gossip_bytes_sent'] / 2 ** 20:.0f} MiB sent by " \
                    f"learner 0" if "gossip_rounds" in m else ""
            print(f"round {r} {name:>18}: {m['train_frames_per_s']:7.0f} frames/s  epoch {m['wall_s']:5.1f} s  "
                  f"held-out CER {100 * m['cer']:5.1f}%{extra}", flush=True)
    fps = {name: statistics.median(m["train_frames_per_s"] for m in ms) for name, ms in results.items()}
    off = fps["adpsgd-gossip-off"]
    print(f"gossip overhead: ADPSGD / ADPSGD-gossip-off throughput = {fps['adpsgd'] / off:.3f} (fp32 exchange), "
          f"{fps['adpsgd-fp16'] / off:.3f} (fp16 exchange), {fps['adpsgd-period2'] / off:.3f} (period 2)")
    print(f"with a 2x straggler, SYNC keeps {fps['sync-straggler'] / fps['sync']:.3f} of its throughput, "
          f"ADPSGD keeps {fps['adpsgd-straggler'] / fps['adpsgd']:.3f} (ideal with {a.learners} learners: "
          f"{(a.learners - 0.5) / a.learners:.3f})")
    print(f"ADPSGD / SYNC throughput, no straggler: {fps['adpsgd'] / fps['sync']:.3f}")


def bench_strategies(a) -> None:
    work = Path(a.work).resolve()
    base, subset = prepare_subset(work, a.utterances, epochs=a.epochs)
    learners = a.nodes * a.per_node
    print(f"strategies: {a.nodes} emulated nodes x {a.per_node} learners on {learners} processes (2 cores), "
          f"{a.epochs} epochs of {a.utterances} utterances, inter-node link EMULATED at "
          f"{SLOW_LINK['bandwidth_gbps']} Gbit/s and {SLOW_LINK['latency_ms']} ms")
    print(f"{'':>8} {'s/epoch':>8} {'frames/s':>9} {'MiB across nodes/epoch':>23} {'held-out CER':>13} "
          f"{'loss':>6}")
    for name, arm in STRATEGY_ARMS.items():
        m = run_arm(work, base, f"strategies-{name}", arm, subset, learners, a.nodes)
        print(f"{name:>8} {m['wall_s'] / a.epochs:8.1f} {m['train_frames_per_s']:9.0f} "
              f"{m['boundary_bytes_emulated_link'] / a.epochs / 2 ** 20:23.0f} {100 * m['cer']:12.2f}% "
              f"{m['heldout_loss']:6.3f}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="bench", required=True)
    s = sub.add_parser("sync", help="recipe SYNC against a plain DDP loop; feature extraction speed")
    s.add_argument("--exp", default="exp/sync", help="a prepared experiment (run.sh stages 1-2)")
    s.add_argument("--ds-config", default="ds_configs/sync.json")
    s.add_argument("--steps", type=int, default=60, help="timed steps per arm and round")
    s.add_argument("--rounds", type=int, default=3)
    d = sub.add_parser("adpsgd", help="gossip overhead and stragglers, ADPSGD against SYNC")
    d.add_argument("--utterances", type=int, default=1000)
    d.add_argument("--rounds", type=int, default=2)
    t = sub.add_parser("strategies", help="SYNC, ADPSGD, HYBRID, LOCALSGD on emulated nodes with a slow emulated link")
    t.add_argument("--utterances", type=int, default=1000)
    t.add_argument("--epochs", type=int, default=2)
    t.add_argument("--nodes", type=int, default=2)
    t.add_argument("--per-node", type=int, default=2)
    for parser in (s, d):
        parser.add_argument("--learners", type=int, default=2)
    for parser in (d, t):
        parser.add_argument("--work", default="exp/bench", help="folder for the subset corpus and the arms' runs")
    a = p.parse_args(argv)
    {"sync": bench_sync, "adpsgd": bench_adpsgd, "strategies": bench_strategies}[a.bench](a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
