"""How much shorter a gossip learner's Adam step is than SYNC's, on your corpus and batch.

    python -m recipe.tools.gradient_noise --exp EXP [--conf YAML] [--learners 4] [--micro-batch 8]
                                          [--at 0,0.5,1,2,4] [key=value ...]

Under ADPSGD every learner (HYBRID: node) normalizes its Adam step by the second moment of its own share of
the global batch. For n shares of b utterances, E[g_b^2] = G^2 + s^2 / b per coordinate: where the noise s^2
dominates, a learner's second moment is n times SYNC's and its step sqrt(n) times shorter, which is what
`optim.batch_scaling=sqrt_replicas` makes up for (recipe/lib/schedule.py); where the gradient G dominates, the
two are equal and the linear or square-root rule already matches SYNC's step. This tool trains the model of a
prepared experiment (stages 1-2; the same --conf and overrides as for them) as SYNC would, on one process (the n shares of every step accumulated), and at
the given epochs of progress measures, over --probes global batches:

- the step factor sqrt(E[g_b^2] / E[g_nb^2]): summed over coordinates, and the median of the coordinates;
- the noise scale B = tr(s^2) / |G|^2 in utterances (McCandlish et al. 2018): a batch much smaller than B is
  noise-dominated.

A factor near sqrt(n) says the corpus is in the regime `sqrt_replicas` assumes (ACCURACY.md section 8).
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch

from recipe.lib.config import for_strategy, load_config
from recipe.lib.dataset import BucketBatchSampler
from recipe.lib.engine import batch_loss, make_optimizer
from recipe.lib.experiment import Experiment
from recipe.lib.schedule import learning_rate


def flat_gradient(model: torch.nn.Module, dataset, batch: np.ndarray, rng: np.random.Generator) -> torch.Tensor:
    """The gradient of one micro batch's loss (training mode: dropout and augmentation as in training)."""
    model.zero_grad()
    b = dataset.collate(batch, rng)
    logits, out_lengths = model(b["feats"], b["lengths"])
    batch_loss(logits, out_lengths, b).backward()
    return torch.cat([p.grad.detach().reshape(-1) for p in model.parameters()])


def noise(model, dataset, shares: list[list[np.ndarray]], rng) -> dict:
    """Step factor and noise scale from global batches, each given as its n micro batches of b."""
    n, b = len(shares[0]), len(shares[0][0])
    local = glob = 0.0
    for global_batch in shares:
        g = torch.stack([flat_gradient(model, dataset, m, rng) for m in global_batch]).double()
        local = local + (g ** 2).mean(0)  # E[g_b^2], per coordinate
        glob = glob + g.mean(0) ** 2  # E[g_nb^2]
    local, glob = local / len(shares), glob / len(shares)
    per_coordinate = (local / glob.clamp(min=1e-300)).sqrt()
    factors = {"factor": float((local.sum() / glob.sum()).sqrt()), "median": float(per_coordinate.median())}
    if n == 1:  # one share is the global batch: no second batch size to tell noise from signal
        return {**factors, "noise_scale": math.nan}
    trace = (local.sum() - glob.sum()) / (1 / b - 1 / (n * b))  # tr(s^2)
    signal = glob.sum() - trace / (n * b)  # |G|^2
    return {**factors, "noise_scale": float(trace / signal) if signal > 0 else math.inf}


def measure(exp: Experiment, learners: int, micro: int, at: list[float], probes: int = 24, seed: int = 0,
            clip: float = 5.0) -> list[dict]:
    """Train as SYNC on `learners` x `micro` utterances a step (one process) and measure at each progress in `at`."""
    conf = for_strategy(exp.conf, "sync")
    torch.manual_seed(seed)
    dataset = exp.dataset("train")
    model = exp.build_model(dataset.dim)
    optimizer = make_optimizer(conf.optim, model.parameters(), lr=0.0)  # the recipe's, as SYNC would train
    sampler = BucketBatchSampler(dataset.lengths, micro, seed=seed)
    steps_per_epoch = len(sampler.epoch_batches(1)) // learners
    if steps_per_epoch < 1 or len(sampler.epoch_batches(0)) < probes * learners:
        raise ValueError(f"{len(dataset.lengths)} utterances are too few for {learners} x {micro} per step and "
                         f"{probes} probes")
    rows, step = [], 0
    for progress in sorted(at):
        while step < round(progress * steps_per_epoch):
            epoch, index = divmod(step, steps_per_epoch)
            batches = sampler.epoch_batches(epoch + 1)[index * learners: (index + 1) * learners]
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(conf.optim, learners * micro, epoch + 1,
                                            (index + 1) / steps_per_epoch, None)
            rng = np.random.default_rng([seed, epoch, index])
            total = sum(flat_gradient(model, dataset, m, rng) for m in batches) / learners
            offset = 0
            for p in model.parameters():
                p.grad = total[offset: offset + p.numel()].view_as(p).clone()
                offset += p.numel()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            step += 1
        probe_batches = sampler.epoch_batches(0)[: probes * learners]  # the same probes at every point
        shares = [probe_batches[i * learners: (i + 1) * learners] for i in range(probes)]
        rows.append({"epochs": progress, **noise(model, dataset, shares, np.random.default_rng(seed))})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--exp", required=True, help="an experiment folder with stages 1-2 done")
    p.add_argument("--conf", default=None, help="recipe YAML (default: the schema's defaults)")
    p.add_argument("--learners", type=int, default=4, help="n: shares of the global batch (ADPSGD's learners)")
    p.add_argument("--micro-batch", type=int, default=8, help="b: utterances per share")
    p.add_argument("--at", default="0,0.5,1,2,4", help="epochs of progress to measure at")
    p.add_argument("--probes", type=int, default=24, help="global batches per measurement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("overrides", nargs="*", help="key=value settings over the YAML")
    args = p.parse_args(argv)
    rows = measure(Experiment(args.exp, load_config(args.conf, args.overrides)), args.learners, args.micro_batch, [float(x) for x in args.at.split(",")],
                   args.probes, args.seed)
    print(f"{args.learners} x {args.micro_batch} utterances; noise-dominated limit sqrt({args.learners}) = "
          f"{math.sqrt(args.learners):.2f}")
    print("| epochs | step factor | median coordinate | noise scale (utterances) |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['epochs']:g} | {r['factor']:.2f} | {r['median']:.2f} | {r['noise_scale']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
