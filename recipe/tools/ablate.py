"""Why ADPSGD trails SYNC beyond 2 learners: each hypothesis an arm, the same data, learners, epochs and seed.

    python -m recipe.tools.ablate [--work exp/ablate] [--learners 4] [--utterances 1500] [--test 100]
                                  [--epochs 4] [--seeds 0] [--micro-batch 8] [--arms sync adpsgd ...]

Every arm trains recipe/train.py on the same subset of the built-in corpus for the same epochs (the fixed
schedule) and prints its held-out greedy CER after every epoch and its final held-out loss, so an arm that
closes the gap shows where it opens. The arms (ARMS below) change one thing each against plain ADPSGD (or
HYBRID, on 2 emulated nodes). 100 held-out utterances are about 1,700 characters, one error 0.06 points of
CER: a difference of 10% between converged arms needs --test 1000 or more.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from recipe.tools.bench import prepare_subset, run_arm

# name -> (DeepSpeed JSON, its "comm" changes, its engine changes, recipe YAML overrides). Every arm pins its lr
# rule and warm-up, the square root and 0.3 epochs (the defaults until stop 18) unless its name says otherwise
# (a later override wins), so that an arm means what it meant when it was measured; the ADPSGD arms measured
# before stop 31 pin the sampling they were measured with (each learner its own shuffle) as well.
SHORT_WARMUP = "optim.warmup_epochs=0.3"
SQRT, LINEAR, REPLICAS = (["optim.batch_scaling=sqrt", SHORT_WARMUP], ["optim.batch_scaling=linear", SHORT_WARMUP],
                          ["optim.batch_scaling=sqrt_replicas", SHORT_WARMUP])
OWN = {"sampling": "independent"}
ARMS = {
    "sync": ("ds_configs/sync.json", {}, {}, SQRT),
    "adpsgd": ("ds_configs/adpsgd.json", OWN, {}, SQRT),
    # clipping at 5 acts on a learner's own gradient of 8 utterances under ADPSGD, whose norm is larger than
    # that of SYNC's average over all learners: it may clip where SYNC does not
    "adpsgd-noclip": ("ds_configs/adpsgd.json", OWN, {"gradient_clipping": 0.0}, SQRT),
    "sync-noclip": ("ds_configs/sync.json", {}, {"gradient_clipping": 0.0}, SQRT),
    # Adam normalizes each learner's noisy small-batch gradient: averaging the normalized steps of 4 learners
    # moves the consensus less than one normalized step of their average gradient does
    "adpsgd-linear-lr": ("ds_configs/adpsgd.json", OWN, {}, LINEAR),
    "sync-linear-lr": ("ds_configs/sync.json", {}, {}, LINEAR),  # the same lr for SYNC
    "sync-warmup1": ("ds_configs/sync.json", {}, {}, [*SQRT, "optim.warmup_epochs=1"]),  # SYNC's defaults now
    # a large batch at a fixed number of epochs is few updates: does SYNC want Goyal et al.'s linear rule there?
    "sync-linear-warmup1": ("ds_configs/sync.json", {}, {}, [*LINEAR, "optim.warmup_epochs=1"]),
    "adpsgd-exponential": ("ds_configs/adpsgd.json", {"schedule": "exponential", **OWN}, {}, SQRT),
    "adpsgd-period0": ("ds_configs/adpsgd.json", {"period": 0, **OWN}, {}, SQRT),  # rounds back to back, not per step
    # at 8 learners the linear rule's rate (8x the base) is reached within 0.3 epochs = 14 updates: a longer ramp
    "adpsgd-linear-warmup1": ("ds_configs/adpsgd.json", OWN, {}, [*LINEAR, "optim.warmup_epochs=1"]),
    "adpsgd-linear-period0": ("ds_configs/adpsgd.json", {"period": 0, **OWN}, {}, LINEAR),
    # the square root of the batch times that of the learners: each learner's Adam step is normalized by the
    # statistics of 1/learners of the batch (recipe/lib/schedule.py); with the warm-up of 1: ADPSGD's defaults now
    "adpsgd-sqrt-replicas": ("ds_configs/adpsgd.json", OWN, {}, REPLICAS),
    "adpsgd-sqrt-replicas-warmup1": ("ds_configs/adpsgd.json", OWN, {}, [*REPLICAS, "optim.warmup_epochs=1"]),
    # the ring's pairings average 4 learners exactly every 2 rounds but 8 only by 0.7x a round; the exponential
    # ones average 8 (and 16) exactly every 4 rounds (comm/topology.py)
    "adpsgd-sqrt-replicas-warmup1-exponential": ("ds_configs/adpsgd.json", {"schedule": "exponential", **OWN}, {},
                                                 [*REPLICAS, "optim.warmup_epochs=1"]),
    # each learner walked its own shuffle of all batches, so about a third of the utterances went unseen in an
    # epoch (and a quarter were seen twice or more); dealing one shuffle out among them shows each once, as
    # SYNC does: ADPSGD's defaults since stop 31
    "adpsgd-sqrt-replicas-warmup1-shared": ("ds_configs/adpsgd.json", {"sampling": "shared"}, {},
                                            [*REPLICAS, "optim.warmup_epochs=1"]),
    # HYBRID on 2 emulated nodes: allreduce inside a node, gossip between the nodes' averages
    "hybrid": ("ds_configs/hybrid.json", {}, {}, SQRT),
    "hybrid-linear-lr": ("ds_configs/hybrid.json", {}, {}, LINEAR),
    "hybrid-sqrt-replicas-warmup1": ("ds_configs/hybrid.json", {}, {}, [*REPLICAS, "optim.warmup_epochs=1"]),
    # torch's post-local SGD (periodic model averaging): learners also step on their own gradients between averages
    "localsgd": ("ds_configs/localsgd.json", {}, {}, SQRT),
    "localsgd-linear-lr": ("ds_configs/localsgd.json", {}, {}, LINEAR),
}
NODES = {name: 2 for name in ARMS if name.startswith("hybrid")}  # emulated nodes of the arms that have more than one


def run(a) -> dict[str, list[dict]]:
    work = Path(a.work).resolve()
    base, subset = prepare_subset(work, a.utterances, a.epochs, a.test)
    results: dict[str, list[dict]] = {}
    for seed in a.seeds:
        for name in a.arms:
            json_path, comm, engine, overrides = ARMS[name]
            run_name = f"{name}-seed{seed}"
            settings = [*subset, *a.overrides, *overrides, f"train.seed={seed}"]
            micro = {"train_micro_batch_size_per_gpu": a.micro_batch} if a.micro_batch else {}
            m = run_arm(work, base, run_name, (json_path, comm), settings, a.learners, nodes=NODES.get(name, 1),
                        engine={**engine, **micro})
            log = [json.loads(line) for line in (work / run_name / "train_log.jsonl").read_text().splitlines()]
            results.setdefault(name, []).append({"metrics": m, "log": log})
            curve = " ".join(f"{100 * r['cer']:5.1f}" for r in log)
            print(f"seed {seed} {name:>20}: greedy CER per epoch {curve} %  held-out loss {m['heldout_loss']:.3f}  "
                  f"{m['wall_s'] / a.epochs:.0f} s/epoch{mixing(log)}", flush=True)
    return results


def mixing(log: list[dict]) -> str:
    """How well gossip kept up (ADPSGD, HYBRID): rounds per learner micro step, and the consensus distance
    before the last epoch's average. On shared cores the gossip thread falls behind the steps and the learners
    drift further apart (ACCURACY.md section 8)."""
    if "gossip_rounds" not in log[-1]:
        return ""
    steps = sum(statistics.mean(r["learner_micro_steps"]) for r in log)
    return (f"  gossip rounds per step {log[-1]['gossip_rounds'] / steps:.2f}, "
            f"consensus distance {log[-1]['consensus_distance']:.4f}")


def summary(results: dict[str, list[dict]]) -> None:
    reference = next((name for name in results if name.startswith("sync")), None)  # the first SYNC arm
    sync = statistics.mean(r["metrics"]["cer"] for r in results[reference]) if reference else None
    print(f"{'arm':>20} {'mean final CER':>15} {'vs SYNC':>8} {'mean held-out loss':>19}")
    for name, runs in results.items():
        cer = statistics.mean(r["metrics"]["cer"] for r in runs)
        loss = statistics.mean(r["metrics"]["heldout_loss"] for r in runs)
        ratio = f"{cer / sync:8.2f}" if sync else f"{'':>8}"
        print(f"{name:>20} {100 * cer:14.2f}% {ratio} {loss:19.3f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="exp/ablate")
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--utterances", type=int, default=1500)
    p.add_argument("--test", type=int, default=100, help="held-out utterances (another number, another corpus)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--micro-batch", type=int, default=0, help="utterances per learner per step (0: the JSON's 8)")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("overrides", nargs="*", help="recipe YAML overrides for every arm, e.g. model.stack=4")
    a = p.parse_args(argv)
    print(f"ablation: {a.learners} learners, {a.utterances} utterances ({a.test} held out), {a.epochs} epochs "
          f"(fixed schedule), seeds {a.seeds}", flush=True)
    summary(run(a))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
