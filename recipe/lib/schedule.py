"""The learning rate and the length of training.

The rate is a function of global progress (epochs done, fractional) and of the epoch annealing starts from, so
that a resumed run and a run with a different number of learners follow the same curve. Two schedules decide
that epoch and when training ends (`optim.schedule`):

- fixed: `plan_epochs` epochs, annealing over their second half (the paper's study compares strategies at a
  fixed number of epochs);
- newbob (Kaldi nnet1's schedule, with patience): the peak rate for as long as the held-out loss improves,
  then annealing every epoch, and the end once it has stopped improving; how long that takes follows from the
  corpus, not from an epoch count tuned on another one.

A `train.epochs` given on the command line is what trains, under either schedule (newbob then decides only
when to anneal); the start line states the plan in numbers (`EpochPlan.describe`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


def scaled_lr(optim, global_batch: int, replicas: int = 1) -> float:
    """Peak lr for a global batch: the batch-size scaling rule (linear: Goyal et al. 2017; sqrt: Krizhevsky 2014;
    sqrt_replicas: the square root of the batch times the model copies that step on their own, comm's
    Strategy.replicas: each copy's Adam step is normalized by the statistics of its share of the batch alone,
    `replicas` times noisier than the whole batch's, and so shorter by the square root; ACCURACY.md section 8)."""
    if optim.batch_scaling == "auto":
        raise ValueError("optim.batch_scaling=auto depends on the strategy: resolve it first "
                         "(recipe.lib.config.for_strategy)")
    ratio = global_batch / optim.base_batch
    return optim.lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio),
                       "sqrt_replicas": math.sqrt(ratio * replicas)}[optim.batch_scaling]


def learning_rate(optim, global_batch: int, epoch: int, done: float, anneal_from: int | None,
                  replicas: int = 1) -> float:
    """The lr in epoch `epoch` (1-based) once the fraction `done` of it is trained (1.0: its last step, still
    this epoch's rate); anneal_from: the first annealed epoch, None while the schedule has not annealed;
    replicas: see scaled_lr."""
    lr = scaled_lr(optim, global_batch, replicas)
    progress = epoch - 1 + done  # epochs of global progress
    if progress < optim.warmup_epochs:
        lr *= progress / optim.warmup_epochs
    if anneal_from is not None and epoch >= anneal_from:
        lr *= optim.anneal_factor ** (epoch - anneal_from + 1)
    return lr


@dataclass
class EpochPlan:
    """How long training runs, and why: the start line says it in these numbers."""

    epochs: int  # fixed: exactly this many; newbob: never fewer
    max_epochs: int  # newbob's cap (fixed: epochs)
    updates_per_epoch: int
    reason: str  # the setting that decided `epochs`
    warning: str | None = None  # a budget given that is likely too short, said once at the start

    def describe(self, schedule: str) -> str:
        length = f"exactly {self.epochs}" if self.max_epochs == self.epochs else \
            f"at least {self.epochs}, at most {self.max_epochs} (train.max_epochs)"
        how = "fixed schedule" if schedule == "fixed" else "newbob ends it when the dev loss stops improving"
        return (f"{self.updates_per_epoch} updates an epoch; epochs: {length}, by {self.reason}; {how}")


def plan_epochs(train, schedule: str, updates_per_epoch: int, epochs_given: bool = False) -> EpochPlan:
    """train.epochs, or more when that many epochs make fewer than train.min_updates optimizer updates (a small
    corpus, a large global batch: CTC needs a number of updates to leave its all-blank plateau), at most
    train.max_epochs; newbob may go on to train.max_epochs. A train.epochs the user gave on the command line
    (epochs_given) is what trains, under either schedule: min_updates then only warns."""
    epochs, updates = train.epochs, max(updates_per_epoch, 1)
    if epochs_given:
        warning = None
        if epochs * updates < train.min_updates:
            warning = (f"train.epochs={epochs} makes {epochs * updates} optimizer updates, fewer than "
                       f"train.min_updates={train.min_updates} (CTC may not leave its all-blank plateau); it trains "
                       f"{epochs} as given (train.min_updates=0 silences this)")
        return EpochPlan(epochs, epochs, updates, f"train.epochs={epochs} as given", warning)
    needed = min(train.max_epochs, math.ceil(train.min_updates / updates))
    reason = f"train.epochs={epochs}"
    if needed > epochs:
        reason = (f"train.min_updates={train.min_updates} (train.epochs={epochs} would make {epochs * updates} "
                  f"updates{'; capped by train.max_epochs' if needed == train.max_epochs else ''})")
    planned = max(epochs, needed)
    return EpochPlan(planned, planned if schedule == "fixed" else train.max_epochs, updates, reason)


def resumed_plan(plan: EpochPlan, planned_before: int | None, epochs_given: bool) -> EpochPlan:
    """The plan of a resumed run: the one of the run it continues (`planned_before`, from the checkpoint), which
    set where annealing starts, unless the user gave train.epochs now. A resume with another number of learners
    changes the updates an epoch and so what train.min_updates alone would plan: until stop 34 it moved the
    annealing."""
    if planned_before is None or epochs_given or planned_before == plan.epochs:
        return plan
    fixed = plan.max_epochs == plan.epochs
    return replace(plan, epochs=planned_before,
                   max_epochs=planned_before if fixed else max(planned_before, plan.max_epochs),
                   reason=f"the run resumed ({planned_before} epochs; this layout alone would plan {plan.epochs} "
                          f"by {plan.reason})")


def fixed_anneal_start(optim, epochs: int) -> int:
    """optim.anneal_start_epoch, or the epoch after the first half of `epochs`."""
    return optim.anneal_start_epoch if optim.anneal_start_epoch is not None else epochs // 2 + 1


@dataclass
class Plan:
    """What the schedule decided after an epoch."""

    anneal_from: int | None  # the first annealed epoch; None: not annealing yet
    stop: str | None  # why training ends after this epoch; None: it goes on


def _gains(loss: float, best: float, margin: float, floor: float) -> bool:
    """Whether `loss` is a gain on `best`: below it by the fraction `margin` of it and by `floor` (nats a token or
    frame; near 0, a fraction of the loss is a gain no held-out set resolves, and chasing it kept the built-in
    corpus's runs going for 3-5 epochs at a CER that no longer moved: ACCURACY.md section 6)."""
    if not math.isfinite(best):
        return math.isfinite(loss)
    return loss < best - max(margin * best, floor)


def _best(losses: list[float]) -> float:
    """The lowest finite loss (a diverged epoch's is inf or nan), inf if none."""
    return min((x for x in losses if math.isfinite(x)), default=math.inf)


def newbob(losses: list[float], anneal_from: int | None, earliest: int, learning: bool, optim,
           planned: int = 0) -> Plan:
    """After the epochs whose held-out losses are `losses` (the last one just trained). Annealing starts after
    the first epoch whose loss is not below (1 - optim.newbob_margin) x the best before it, once `earliest`
    epochs are done and the model is `learning` (off CTC's all-blank plateau, where the loss stalls before
    anything is learnt). Training ends after optim.newbob_patience annealed epochs in a row that do not improve
    by a tenth of that margin on the best loss since the epoch that started annealing (Kaldi's end threshold is
    a tenth of its start one: a single bad epoch of a noisy small corpus, or a gain below the margin, does not
    end it; and a loss that jumped at the peak rate, as one unseen speaker's does, is not a bar that annealing
    must clear before it counts as gaining), or after optim.newbob_anneal_epochs annealed epochs (a loss that
    keeps falling by a margin of itself as it nears 0, on an easy corpus, would keep training for little); in
    either case not before the `planned` epochs (train.epochs, train.min_updates). Neither test counts a gain
    below optim.newbob_min_gain (`_gains`)."""
    epoch = len(losses)
    if anneal_from is None:
        stalled = not _gains(losses[-1], _best(losses[:-1]), optim.newbob_margin, optim.newbob_min_gain)
        if epoch >= earliest and learning and stalled:
            return Plan(epoch + 1, None)
        return Plan(None, None)
    if epoch < planned:
        return Plan(anneal_from, None)
    since = anneal_from - 2  # the epoch that started annealing (0-based)
    gains = [_gains(losses[i], _best(losses[since:i]), optim.newbob_margin / 10, optim.newbob_min_gain)
             for i in range(anneal_from - 1, epoch)]
    stalled = len(gains) - max((i + 1 for i, gain in enumerate(gains) if gain), default=0)
    if stalled >= optim.newbob_patience:
        return Plan(anneal_from, f"the dev loss gained less than {optim.newbob_margin / 10:.1%} of its best "
                                 f"or {optim.newbob_min_gain:g} in the last {stalled} annealed epochs")
    if len(gains) >= optim.newbob_anneal_epochs:
        return Plan(anneal_from, f"{len(gains)} annealed epochs (optim.newbob_anneal_epochs)")
    return Plan(anneal_from, None)
