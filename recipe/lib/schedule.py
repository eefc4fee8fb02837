"""Learning rate as a pure function of global progress (epochs done, fractional), so that a resumed run and
a run with a different number of learners follow the same curve."""

from __future__ import annotations

import math


def scaled_lr(optim, global_batch: int) -> float:
    """Peak lr for a global batch: the batch-size scaling rule (linear: Goyal et al. 2017; sqrt: Krizhevsky 2014)."""
    ratio = global_batch / optim.base_batch
    return optim.lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[optim.batch_scaling]


def learning_rate(optim, global_batch: int, progress: float) -> float:
    """progress: epochs completed so far, e.g. 2.5 halfway through the third epoch."""
    lr = scaled_lr(optim, global_batch)
    if progress < optim.warmup_epochs:
        lr *= progress / optim.warmup_epochs
    epoch = math.floor(progress) + 1  # 1-based epoch being trained
    if epoch >= optim.anneal_start_epoch:
        lr *= optim.anneal_factor ** (epoch - optim.anneal_start_epoch + 1)
    return lr
