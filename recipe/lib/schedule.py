"""Learning rate as a pure function of global progress (epochs done, fractional), so that a resumed run and
a run with a different number of learners follow the same curve."""

from __future__ import annotations

import math


def scaled_lr(optim, global_batch: int) -> float:
    """Peak lr for a global batch: the batch-size scaling rule (linear: Goyal et al. 2017; sqrt: Krizhevsky 2014)."""
    ratio = global_batch / optim.base_batch
    return optim.lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[optim.batch_scaling]


def learning_rate(optim, global_batch: int, progress: float, epochs: int) -> float:
    """progress: epochs completed so far, e.g. 2.5 halfway through the third epoch, of `epochs` in all."""
    lr = scaled_lr(optim, global_batch)
    if progress < optim.warmup_epochs:
        lr *= progress / optim.warmup_epochs
    epoch = math.floor(progress) + 1  # 1-based epoch being trained
    anneal_start = optim.anneal_start_epoch if optim.anneal_start_epoch is not None else epochs // 2 + 1
    if epoch >= anneal_start:
        lr *= optim.anneal_factor ** (epoch - anneal_start + 1)
    return lr


def planned_epochs(train, updates_per_epoch: int) -> int:
    """train.epochs, or more when that many epochs make fewer than train.min_updates optimizer updates (a small
    corpus, a large global batch: CTC needs a number of updates to leave its all-blank plateau), at most
    train.max_epochs."""
    needed = math.ceil(train.min_updates / max(updates_per_epoch, 1))
    return max(train.epochs, min(train.max_epochs, needed))
