"""Recipe stage 3: train the acoustic model on every learner, around one DeepSpeed engine.

Started once per learner by the deepspeed launcher (run.sh builds the command):

    deepspeed --num_gpus N --module recipe.train --exp EXP --ds-config ds_configs/sync.json [--conf FILE] [k=v ...]

The distributed strategy is chosen by the JSON's "comm" section and reached only through its interface
(comm/base.py), so this loop is the same for SYNC, ADPSGD, HYBRID and LOCALSGD. Every epoch ends with an evaluation
on the dev set (sharded over the learners, totals summed; the test set is never read here: the decode stage scores
it once, at the end) and an atomic checkpoint that carries the TrainState;
--resume continues from the latest one and, for SYNC, reproduces an uninterrupted run bit for bit: batches and
dropout masks are pure functions of (seed, epoch, rank), and the learning rate a pure function of global
progress.

run.sh first checks a launch without starting it (the JSON, the strategy against the layout):

    python -m recipe.train --check --ds-config FILE --world-size N [--nodes M]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from recipe.supervisor import is_supervised, launched, supervise

if __name__ == "__main__" and launched() and not is_supervised():  # the learner runs in a child (supervisor.py)
    sys.exit(supervise([sys.executable, "-m", "recipe.train", *sys.argv[1:]]))

import numpy as np
import torch
from omegaconf import OmegaConf
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn

from comm import FaultInjector, ProcessLayout, build_strategy, init_distributed, shutdown_distributed
from comm.health import RESTART_EXIT, Heartbeat, LearnerLost, LeftBehind
from model.lstm import count_parameters
from recipe.evaluate import evaluate, rates
from recipe.lib.board import Board
from recipe.lib.config import ConfigError, for_strategy, load_config, overridden
from recipe.lib.dataset import BucketBatchSampler
from recipe.lib.ds_config import load_ds_config
from recipe.lib.engine import experiment_engine, threads_per_learner, train_step
from recipe.lib.experiment import Experiment
from recipe.lib.progress import progress_bar
from recipe.lib.schedule import fixed_anneal_start, learning_rate, newbob, plan_epochs, resumed_plan
from recipe.supervisor import declare_goes_on  # noqa: E402 - after the supervisor's exit

log = logging.getLogger("recipe.train")
SCORE_KEYS = ("cer", "wer", "frame_acc")  # dev scores of CTC and of CE (an epoch record's "held-out" set)


class NonFiniteTraining(RuntimeError):
    pass


class SkippedSteps:
    """Optimizer steps skipped for a non-finite loss or gradient (engine.train_step): counted, and `limit` of
    them in a row stop the run rather than let a diverged model spend more hours."""

    def __init__(self, limit: int):
        self.limit, self.in_row, self.count = limit, 0, 0

    def record(self, loss: float, applied: bool | None, fp16: bool, where: Callable[[], str]) -> None:
        if applied is None:  # between gradient accumulation boundaries: no step was decided
            return
        if applied or (fp16 and math.isfinite(loss)):  # an fp16 skip with a finite loss: a loss-scale probe
            self.in_row = 0 if applied else self.in_row
            return
        self.in_row, self.count = self.in_row + 1, self.count + 1
        if self.in_row >= self.limit:
            raise NonFiniteTraining(f"{self.in_row} optimizer steps in a row had a non-finite loss or gradient "
                                    f"{where()}; stopping. Those steps left the weights as they were. Lower "
                                    f"optim.lr, check the features, or raise train.max_bad_steps")


@dataclass
class TrainState:
    """Where training stands, besides the weights: saved in every checkpoint, restored by --resume."""

    epoch: int = 0  # epochs completed
    wall_s: float = 0.0  # training time so far (each epoch's steps and consensus; evaluation excluded)
    frames: int = 0  # frames trained, all learners together
    skipped_steps: int = 0
    history: list[dict] = field(default_factory=list)  # the training log's records, one per epoch
    anneal_from: int | None = None  # the schedule's first annealed epoch, once decided
    planned_epochs: int | None = None  # the plan's epochs (EpochPlan), kept by a resume with another layout
    stop: str | None = None  # why training ended early (newbob, train.max_minutes)

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


@dataclass
class EpochTotals:
    """One learner's own count of an epoch, before the sums over the learners."""

    frames: int = 0
    loss_sum: float = 0.0
    finite_losses: int = 0
    micro_steps: int = 0
    lr: float = 0.0

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / max(self.finite_losses, 1)


def no_learning(record: dict, updates: int) -> str | None:
    """What to tell the user when the dev output is (nearly) all blank or the CER above 90%: CTC's all-blank
    plateau, which a small corpus or a large batch may not leave in the updates it gets; None when all is well."""
    empty, cer = record.get("empty_output", 0.0), record.get("cer", 0.0)
    if empty < 0.9 and cer <= 0.9:
        return None
    what = f"{100 * empty:.0f}% of the dev outputs are empty (CTC's all-blank plateau)" if empty >= 0.9 else \
        f"the dev CER is {100 * cer:.1f}%"
    return (f"no learning yet after epoch {record['epoch']} ({updates} optimizer updates): {what}. Try more updates "
            f"(train.epochs, or a smaller train_micro_batch_size_per_gpu in the JSON: more updates an epoch), a lower "
            f"model.stack, and check the transcripts against EXP/data/tokens.txt")


class Trainer:
    def __init__(self, args):
        self.args = args
        self.layout = ProcessLayout.from_env(emulated_nodes=args.nodes)
        self.conf = load_config(args.conf, args.overrides)
        self.engine_conf, comm_conf = load_ds_config(args.ds_config)
        learners_here = int(os.environ.get("LOCAL_SIZE", self.layout.local_size))  # processes on this machine
        torch.set_num_threads(threads_per_learner(self.conf.train.num_threads, learners_here))
        init_distributed(self.conf.train.collective_timeout_s)
        self.heartbeat = Heartbeat(self.layout.rank, self.layout.world_size)  # finds lost learners
        self.strategy = build_strategy(comm_conf, self.layout, self.heartbeat)
        self.conf = for_strategy(self.conf, self.strategy.name)  # optim.batch_scaling=auto
        self.faults = FaultInjector(comm_conf.get("debug", {}), self.layout.rank)
        if self.strategy.members.goes_on:  # without a lost learner: the launcher must not stop the others
            declare_goes_on()
        self.exp = Experiment(args.exp, self.conf)
        self.is_main = self.layout.rank == 0
        if self.is_main:
            self.write_artifacts(comm_conf)
        self.build_data()
        # before the engine's collectives: its import (seconds) must not make learner 0 start the epoch late
        self.board = Board(self.exp.root / "tensorboard", self.steps_per_epoch) if self.is_main else None
        self.engine = experiment_engine(self.exp, self.engine_conf, self.strategy, self.train_set.dim,
                                        self.global_batch)
        self.state = TrainState()
        self.epoch = 1  # the epoch being trained
        self.skipped = SkippedSteps(self.conf.train.max_bad_steps)

    def write_artifacts(self, comm_conf: dict) -> None:
        """The resolved YAML, the JSON and the launch command, into the experiment folder."""
        root = self.exp.root
        OmegaConf.save(self.conf, root / "conf.yaml")
        (root / "ds_config.json").write_text(json.dumps({**self.engine_conf, "comm": comm_conf}, indent=1))
        (root / "launch.txt").write_text(f"{self.args.launch_command or shlex.join(sys.argv)}\n"
                                         f"# world_size={self.layout.world_size} nodes={self.layout.nodes}\n")

    def build_data(self) -> None:
        """Datasets, samplers and the batch arithmetic (DESIGN.md §9.3: the global batch, reported)."""
        self.train_set, self.dev_set = self.exp.dataset("train"), self.exp.dataset("dev")
        self.micro = self.engine_conf["train_micro_batch_size_per_gpu"]
        self.accum = self.engine_conf.get("gradient_accumulation_steps", 1)
        world, seed = self.layout.world_size, self.conf.train.seed
        self.global_batch = self.micro * self.accum * world  # utterances per optimizer step, all learners
        self.node_batch = self.micro * self.accum * self.layout.local_size
        self.sampler = BucketBatchSampler(self.train_set.lengths, self.micro, self.layout.rank, world, seed)
        self.dev_batches = BucketBatchSampler(self.dev_set.lengths, self.micro, shuffle=False).epoch_batches(0)
        self.steps_per_epoch = len(self.sampler) // self.accum  # optimizer steps
        if self.steps_per_epoch == 0:
            raise ValueError(f"{len(self.sampler)} micro batches per learner cannot make one step of "
                             f"{self.accum} accumulations")
        self.epochs_given = overridden(self.args.overrides, "train.epochs")  # honored as given, resumed or not
        self.plan = plan_epochs(self.conf.train, self.conf.optim.schedule, self.steps_per_epoch, self.epochs_given)
        self.epochs, self.max_epochs = self.plan.epochs, self.plan.max_epochs  # newbob: anneals no earlier

    # -- state ---------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """A checkpoint: the consensus model, this learner's optimizer, the TrainState."""
        return {"model": self.strategy.consensus(self.engine).state_dict(),
                "optimizer": self.engine.optimizer.state_dict(), "epoch": self.state.epoch,
                "train_state": self.state.state_dict(), "strategy": self.strategy.state_dict()}

    def load_state_dict(self, checkpoint: dict) -> None:
        self.engine.module.load_state_dict(checkpoint["model"])
        self.engine.optimizer.load_state_dict(checkpoint["optimizer"])
        self.state.load_state_dict(checkpoint["train_state"])
        self.strategy.load_state_dict(checkpoint.get("strategy", {}))  # absent from checkpoints before stop 18

    def resume(self) -> None:
        """--resume: learner 0 reads its latest checkpoint and sends it to all, so that no learner depends on a
        disk shared with learner 0 (each reads only its own features)."""
        if self.args.resume:
            found = self.exp.checkpoints() if self.is_main else []
            checkpoint = self.strategy.members.share(self.exp.load_checkpoint() if found else None)
            if checkpoint is not None:
                self.load_state_dict(checkpoint)
                self.epoch = self.state.epoch + 1
                log.info("resumed from %s (epoch %d)", checkpoint["path"], self.state.epoch)
                self.plan = resumed_plan(self.plan, self.state.planned_epochs, self.epochs_given)
                self.epochs, self.max_epochs = self.plan.epochs, self.plan.max_epochs
        self.state.planned_epochs = self.epochs
        if self.conf.optim.schedule == "fixed":  # from the config, also when a resumed run has other epochs
            self.state.anneal_from = fixed_anneal_start(self.conf.optim, self.epochs)
        if self.is_main:  # the log holds exactly the epochs of the checkpoint being continued
            (self.exp.root / "train_log.jsonl").write_text("".join(json.dumps(h) + "\n" for h in self.state.history))

    def where(self) -> str:
        """Where the run stands, for error messages."""
        checkpoints = self.exp.checkpoints()
        return (f"on learner {self.layout.rank} in epoch {self.epoch} (last checkpoint: "
                f"{checkpoints[-1] if checkpoints else 'none yet'})")

    # -- the loop ------------------------------------------------------------------------------------------------
    def train(self) -> dict:
        """Every epoch from the TrainState's on; -> the run's metrics (also EXP/metrics.json)."""
        self.resume()
        self.log_start()
        bar = progress_bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                           TextColumn("loss {task.fields[loss]:.3f}"),
                           TextColumn("{task.fields[fps]:>7.0f} frames/s"), TimeRemainingColumn(),
                           enabled=self.is_main)
        lost_after_s = self.strategy.conf["lost_after_s"]
        if self.strategy.members.goes_on:  # back from a stall the others dropped it for: it leaves
            self.heartbeat.dropped_if_still(lost_after_s)
        else:  # a frozen learner stops the run within seconds (comm/health.py)
            self.heartbeat.stop_without(lost_after_s)
        with bar, self.heartbeat.watch(self.where, self.strategy.members.lost_needed):
            for epoch in range(self.state.epoch + 1, self.max_epochs + 1):
                if self.state.stop:
                    break
                self.epoch, t0 = epoch, time.perf_counter()
                totals = self.train_one_epoch(epoch, bar)
                stats = self.strategy.end_epoch(self.engine)  # ADPSGD/HYBRID: the consensus is part of the epoch
                self.end_epoch(epoch, totals, stats, time.perf_counter() - t0)
        self.strategy.close()
        self.heartbeat.close()
        if self.is_main:
            self.board.close()
        metrics = self.metrics()
        if self.is_main:
            (self.exp.root / "metrics.json").write_text(json.dumps(metrics, indent=1))
        return metrics

    def train_one_epoch(self, epoch: int, bar) -> EpochTotals:
        torch.manual_seed(self.conf.train.seed * 1_000_003 + epoch * 1009 + self.layout.rank)  # dropout masks
        self.engine.train()
        t0, totals, self.skipped.count = time.perf_counter(), EpochTotals(), 0
        of = f"{self.max_epochs}" if self.conf.optim.schedule == "fixed" else f"at most {self.max_epochs}"
        task = bar.add_task(f"epoch {epoch} of {of}", total=self.steps_per_epoch * self.accum,
                            loss=0.0, fps=0.0)
        for micro_step, (batch, progress) in enumerate(self.strategy.batches(self.sampler, epoch, self.accum)):
            totals.lr = learning_rate(self.conf.optim, self.global_batch, epoch, progress, self.state.anneal_from,
                                      self.strategy.replicas)
            for group in self.engine.optimizer.param_groups:
                group["lr"] = totals.lr
            # augmentation drawn from (seed, epoch, learner, step): reproducible, and the same after a resume
            rng = np.random.default_rng([self.conf.train.seed, epoch, self.layout.rank, micro_step])
            b = self.train_set.collate(batch, rng)
            t_step = time.perf_counter()
            step = train_step(self.engine, self.strategy, b)
            self.faults.after_micro_batch(time.perf_counter() - t_step)
            if math.isfinite(step.loss):
                totals.loss_sum, totals.finite_losses = totals.loss_sum + step.loss, totals.finite_losses + 1
            self.skipped.record(step.loss, step.applied, self.engine.fp16_enabled(), self.where)
            totals.frames += int(b["lengths"].sum())
            totals.micro_steps = micro_step + 1
            elapsed = time.perf_counter() - t0
            bar.update(task, advance=1, loss=totals.mean_loss, fps=totals.frames * self.layout.world_size / elapsed)
            if self.is_main and (micro_step + 1) % self.conf.train.log_interval == 0:
                self.log_step(epoch, progress, totals, step, totals.frames / elapsed)
        bar.remove_task(task)
        return totals

    def compute_validation(self) -> dict:
        """Dev scores of the consensus model, each live learner scoring a share, totals summed."""
        members = self.strategy.members
        shard = self.dev_batches[members.index():: len(members.live)]
        totals, _ = evaluate(self.strategy.consensus(self.engine), self.dev_set, shard, self.exp.tokens)
        return rates(dict(zip(sorted(totals), members.sum([totals[k] for k in sorted(totals)]))))

    def end_epoch(self, epoch: int, totals: EpochTotals, strategy_stats: dict, epoch_wall: float) -> None:
        """Sums over the learners, dev scores, the checkpoint and the training log."""
        members = self.strategy.members
        frames, train_loss, skipped = members.sum([totals.frames, totals.mean_loss, self.skipped.count])
        one_hot = [totals.micro_steps if r == self.layout.rank else 0 for r in range(self.layout.world_size)]
        micro_steps = [int(n) for n in members.sum(one_hot)]  # every learner's step count this epoch
        self.state.wall_s += epoch_wall
        self.state.frames += int(frames)
        self.state.skipped_steps += int(skipped)
        record = {"epoch": epoch, "train_loss": train_loss / len(members.live), "lr": totals.lr,
                  "epoch_wall_s": epoch_wall, "wall_s": self.state.wall_s, "train_frames_per_s": frames / epoch_wall,
                  "learner_micro_steps": micro_steps, "skipped_steps": int(skipped), **self.compute_validation(),
                  **strategy_stats}
        self.state.epoch = epoch
        self.state.history.append(record)
        self.plan_next_epoch()
        if self.is_main:
            losses = {h["epoch"]: h["heldout_loss"] for h in self.state.history}
            self.exp.save_checkpoint(self.state_dict(), epoch, self.conf.train.keep_checkpoints, losses)
            with open(self.exp.root / "train_log.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            self.log_epoch(record)
        members.barrier()  # nobody goes on (or exits) while the checkpoint is written

    def plan_next_epoch(self) -> None:
        """The schedule's decision after an epoch: the same on every learner, whose dev scores are sums over
        all of them."""
        optim, history, state = self.conf.optim, self.state.history, self.state
        if optim.schedule == "newbob":
            annealing = state.anneal_from
            learning = no_learning(history[-1], 0) is None
            plan = newbob([h["heldout_loss"] for h in history], state.anneal_from,
                          fixed_anneal_start(optim, self.epochs) - 1, learning, optim, planned=self.epochs)
            state.anneal_from, state.stop = plan.anneal_from, plan.stop
            if annealing is None and state.anneal_from is not None and self.is_main:
                log.info("newbob: the dev loss stopped improving; annealing from epoch %d", state.anneal_from)
        limit = self.conf.train.max_minutes
        if not state.stop and limit is not None and state.wall_s >= 60 * limit:
            state.stop = f"train.max_minutes={limit} reached after {state.wall_s / 60:.1f} minutes"
        if state.stop and self.is_main:
            log.info("training ends after epoch %d: %s", state.epoch, state.stop)

    # -- reporting -----------------------------------------------------------------------------------------------
    def log_start(self) -> None:
        log.info("strategy=%s learners=%d nodes=%d device=%s global_batch=%d node_batch=%d params=%d threads=%d",
                 self.strategy.name, self.layout.world_size, self.layout.nodes, self.engine.device,
                 self.global_batch, self.node_batch, count_parameters(self.engine.module), torch.get_num_threads())
        log.info("plan: %s", self.plan.describe(self.conf.optim.schedule))
        if self.plan.warning:
            log.warning("%s", self.plan.warning)

    def log_step(self, epoch: int, progress: float, totals: EpochTotals, step, frames_per_s: float) -> None:
        """Every train.log_interval micro batches, learner 0: a log line and the TensorBoard curves."""
        log.info("epoch %d %.0f%% loss %.3f lr %.2e  %.0f frames/s per learner", epoch, 100 * progress,
                 totals.mean_loss, totals.lr, frames_per_s)
        self.board.step(epoch - 1 + progress, totals.mean_loss, totals.lr, step.grad_norm,
                        frames_per_s * self.layout.world_size)

    def log_epoch(self, record: dict) -> None:
        scores = "  ".join(f"{k.replace('_', ' ')} {100 * record[k]:.2f}%" for k in SCORE_KEYS if k in record)
        log.info("epoch %d done: train loss %.3f  dev loss %.3f  %s  %.0f frames/s  %.0f s", record["epoch"],
                 record["train_loss"], record["heldout_loss"], scores, record["train_frames_per_s"],
                 record["epoch_wall_s"])
        self.board.epoch(record)
        warning = no_learning(record, record["epoch"] * self.steps_per_epoch)
        if warning and record["epoch"] > self.conf.optim.warmup_epochs:  # during the warm-up, no news
            log.warning("%s", warning)
        before = self.state.history[-2].get("lost_learners", []) if len(self.state.history) > 1 else []
        if record.get("lost_learners", []) != before:  # said in the epoch it happened, not every epoch after
            log.warning("learner(s) %s lost in epoch %d; %d of %d learners go on", record["lost_learners"],
                        record["epoch"], len(self.strategy.members.live), self.layout.world_size)

    def metrics(self) -> dict:
        last, engine_conf = self.state.history[-1], self.engine_conf
        warning = no_learning(last, self.state.epoch * self.steps_per_epoch)  # the run ended on the plateau
        return {"strategy": self.strategy.name, "learners": self.layout.world_size, "nodes": self.layout.nodes,
                "micro_batch": self.micro, "gradient_accumulation_steps": self.accum,
                "global_batch": self.global_batch, "node_batch": self.node_batch, "epochs": self.state.epoch,
                "schedule": self.conf.optim.schedule, "anneal_from": self.state.anneal_from, "stop": self.state.stop,
                "params": count_parameters(self.engine.module), "wall_s": self.state.wall_s,
                "train_frames_per_s": self.state.frames / max(self.state.wall_s, 1e-9),
                "objective": self.conf.train.objective, "heldout_loss": last["heldout_loss"],
                **{k: last[k] for k in SCORE_KEYS if k in last},
                "heldout_set": "dev", "train_utterances": self.train_set.num_utterances,
                "dev_utterances": self.dev_set.num_utterances,
                "skipped": {"train": dict(self.train_set.skipped), "dev": dict(self.dev_set.skipped)},
                **{k: v for k, v in last.items()
                   if k.startswith(("gossip_", "boundary_", "consensus_", "lost_", "averaging_"))},
                "precision": "bf16" if engine_conf.get("bf16", {}).get("enabled") else
                             "fp16" if engine_conf.get("fp16", {}).get("enabled") else "fp32",
                **({"warning": warning} if warning else {})}


def check_launch(args) -> int:
    """The JSON and its strategy against the layout it will run on, before any work (run.sh calls this)."""
    try:
        load_config(args.conf, args.overrides)
        env = {"WORLD_SIZE": args.world_size, "LOCAL_SIZE": args.world_size}
        build_strategy(load_ds_config(args.ds_config)[1], ProcessLayout.from_env(env, args.nodes))
    except (ConfigError, ValueError) as err:  # LayoutError is a ValueError
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--exp", help="experiment folder (prepared by stages 1-2); required unless --check")
    p.add_argument("--ds-config", required=True, help="DeepSpeed JSON with the strategy's comm section")
    p.add_argument("--conf", default=None, help="recipe YAML")
    p.add_argument("--nodes", type=int, default=1, help="emulate this many nodes with this machine's learners "
                                                        "(HYBRID on one machine)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in EXP")
    p.add_argument("--launch-command", default=None, help="recorded in EXP/launch.txt (set by run.sh)")
    p.add_argument("--check", action="store_true", help="only check the launch: JSON, strategy and layout")
    p.add_argument("--world-size", type=int, default=1, help="with --check: learners in all")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # added by the launcher
    p.add_argument("overrides", nargs="*", help="key=value settings over the YAML")
    args = p.parse_intermixed_args(argv)
    if not args.check and not args.exp:
        p.error("--exp is required")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.check:
        return check_launch(args)
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(stream=sys.stdout, level=logging.WARNING,
                        format=f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", datefmt="%H:%M:%S")
    # our log lines from rank 0 only (every rank reads the same data); other libraries stay at warnings
    logging.getLogger("recipe").setLevel(logging.INFO if rank == 0 else logging.ERROR)
    try:
        Trainer(args).train()
        shutdown_distributed()
    except LeftBehind as err:  # a HYBRID node that lost a learner, a learner back from a stall: the others go on
        print(f"LeftBehind: {err}", file=sys.stderr, flush=True)
        os._exit(0)  # its gossip thread may be waiting on a peer: no clean interpreter shutdown to wait for
    except LearnerLost as err:  # the run stops; the elastic agent (recipe/elastic.py) starts it again
        print(f"LearnerLost: {err}", file=sys.stderr, flush=True)
        return RESTART_EXIT if err.restartable else 1
    return 0


if __name__ == "__main__":
    code = main()
    # A learner whose run ended well has written all it writes and left its process groups; it leaves without the
    # interpreter's teardown, in which gloo's threads still aborted a learner now and then after all of that
    # ("terminate called without an active exception", pytorch/pytorch#190489: 1 fresh-clone test run in 2 at stop
    # 29), turning a finished run into a failed one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
