"""Recipe stage 3: train the acoustic model on every learner, around one DeepSpeed engine.

Started once per learner by the deepspeed launcher (run.sh builds the command):

    deepspeed --num_gpus N recipe/train.py --exp EXP --ds-config ds_configs/sync.json [--conf FILE] [k=v ...]

The distributed strategy is chosen by the JSON's "comm" section and reached only through its hooks
(comm/base.py), so this loop is the same for SYNC, ADPSGD and HYBRID. Every epoch ends with a held-out
evaluation (sharded over the learners, totals summed) and an atomic checkpoint; --resume continues from the
latest one and, for SYNC, reproduces an uninterrupted run bit for bit: batches and dropout masks are pure
functions of (seed, epoch, rank), and the learning rate a pure function of global progress.
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
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):  # run as a script by the deepspeed launcher: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from recipe.supervisor import is_supervised, supervise

    if __name__ == "__main__" and not is_supervised():  # the learner runs in a child (recipe/supervisor.py)
        sys.exit(supervise(sys.argv))

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn

from comm import ProcessLayout, build_strategy, init_distributed
from comm.health import Heartbeat, LeftBehind
from model.lstm import count_parameters
from recipe.config import load_config
from recipe.dataset import BucketBatchSampler
from recipe.ds_config import load_ds_config
from recipe.evaluate import batch_loss, evaluate, rates
from recipe.experiment import Experiment
from recipe.progress import progress_bar
from recipe.schedule import learning_rate
from recipe.supervisor import declare_goes_on

log = logging.getLogger("recipe.train")
SCORE_KEYS = ("cer", "wer", "frame_acc")  # held-out scores of CTC and of CE


class NonFiniteTraining(RuntimeError):
    pass


class SkippedSteps:
    """Optimizer steps skipped for a non-finite loss or gradient (train_step): counted, and `limit` of them in
    a row stop the run rather than let a diverged model spend more hours."""

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


def threads_per_learner(requested: int, local_size: int) -> int:
    """Cores / learners on this node (DESIGN.md trap 1: oversubscribed threads ran 8x slower)."""
    if requested > 0:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // local_size)


def make_optimizer(optim, params, lr: float) -> torch.optim.Optimizer:
    if optim.name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=optim.momentum, weight_decay=optim.weight_decay)
    cls = torch.optim.Adam if optim.name == "adam" else torch.optim.AdamW
    return cls(params, lr=lr, weight_decay=optim.weight_decay)


def live_sum(strategy, values: list[float]) -> list[float]:
    """Sums over the learners still running: all of them, unless ADPSGD went on without a lost one."""
    return strategy.reduce_live(torch.tensor(values, dtype=torch.float64)).tolist()


def train(args) -> dict:
    layout = ProcessLayout.from_env(emulated_nodes=args.nodes)
    conf = load_config(args.conf, args.overrides)
    engine_conf, comm_conf = load_ds_config(args.ds_config)
    learners_here = int(os.environ.get("LOCAL_SIZE", layout.local_size))  # real processes on this machine
    torch.set_num_threads(threads_per_learner(conf.train.num_threads, learners_here))
    init_distributed(conf.train.collective_timeout_s)
    heartbeat = Heartbeat(layout.rank, layout.world_size)  # finds lost learners (comm/health.py)
    strategy = build_strategy(comm_conf, layout, heartbeat)
    if strategy.goes_on:  # without a lost learner: the launcher must not stop the others when it dies
        declare_goes_on()
    exp = Experiment(args.exp, conf)
    is_main = layout.rank == 0
    if is_main:
        OmegaConf.save(conf, exp.root / "conf.yaml")
        (exp.root / "ds_config.json").write_text(json.dumps({**engine_conf, "comm": comm_conf}, indent=1))
        (exp.root / "launch.txt").write_text(f"{args.launch_command or shlex.join(sys.argv)}\n"
                                             f"# world_size={layout.world_size} nodes={layout.nodes}\n")

    train_set, test_set = exp.dataset("train"), exp.dataset("test")
    micro = engine_conf["train_micro_batch_size_per_gpu"]
    accum = engine_conf.get("gradient_accumulation_steps", 1)
    global_batch = micro * accum * layout.world_size  # utterances per optimizer step, all learners together
    node_batch = micro * accum * layout.local_size
    sampler = BucketBatchSampler(train_set.lengths, micro, layout.rank, layout.world_size, conf.train.seed)
    test_batches = BucketBatchSampler(test_set.lengths, micro, shuffle=False).epoch_batches(0)
    steps_per_epoch = len(sampler) // accum  # optimizer steps
    if steps_per_epoch == 0:
        raise ValueError(f"{len(sampler)} micro batches per learner cannot make one step of {accum} accumulations")

    engine = build_engine(exp, conf, engine_conf, strategy, train_set.dim, global_batch)

    def epoch_batches(epoch: int):
        """-> (micro batch, fraction of the epoch done by all learners together once it is trained)."""
        if not strategy.independent_sampling:  # dealt over the learners still running, equal counts
            batches, live = sampler.epoch_batches(epoch), strategy.live
            steps = len(batches) // len(live) // accum
            for i, batch in enumerate(batches[live.index(layout.rank):: len(live)][: steps * accum]):
                yield batch, (i // accum + 1) / steps
            return
        # Every learner walks its own shuffle of ALL batches; the epoch ends once the learners together have
        # taken as many utterances as the training set has. The default store's add() is an atomic global
        # counter, so a fast learner simply takes more batches than a slow one (DESIGN.md trap 9).
        store = dist.distributed_c10d._get_default_store()
        own = BucketBatchSampler(train_set.lengths, micro, seed=conf.train.seed * 100_003 + layout.rank + 1)
        key, total = f"epoch-{epoch}-utterances", len(train_set)
        while True:
            for batch in own.epoch_batches(epoch):
                taken = store.add(key, len(batch))
                if taken - len(batch) >= total:
                    return
                yield batch, min(1.0, taken / total)

    first_epoch, history = 1, []
    prior = {"train_wall_s": 0.0, "train_frames": 0}
    if args.resume and exp.checkpoints():
        state = exp.load_checkpoint()
        engine.module.load_state_dict(state["model"])
        engine.optimizer.load_state_dict(state["optimizer"])
        first_epoch = state["epoch"] + 1
        prior = {"train_wall_s": state["train_wall_s"], "train_frames": state["train_frames"]}
        history = [json.loads(line) for line in (exp.root / "train_log.jsonl").read_text().splitlines()
                   if json.loads(line)["epoch"] <= state["epoch"]]
        log.info("resumed from %s (epoch %d)", state["path"], state["epoch"])
    if is_main:  # the log holds exactly the epochs of the checkpoint being continued
        (exp.root / "train_log.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
        log.info("strategy=%s learners=%d nodes=%d global_batch=%d node_batch=%d steps/epoch=%d params=%d "
                 "threads=%d", strategy.name, layout.world_size, layout.nodes, global_batch, node_batch,
                 steps_per_epoch, count_parameters(engine.module), torch.get_num_threads())

    train_wall, train_frames = prior["train_wall_s"], prior["train_frames"]
    skipped = SkippedSteps(conf.train.max_bad_steps)
    bar = progress_bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                       TextColumn("loss {task.fields[loss]:.3f}"), TextColumn("{task.fields[fps]:>7.0f} frames/s"),
                       TimeRemainingColumn(), enabled=is_main)
    task = bar.add_task("", total=1, loss=0.0, fps=0.0)
    bar.start()
    epoch = first_epoch

    def where() -> str:
        return (f"on learner {layout.rank} in epoch {epoch} (last checkpoint: "
                f"{exp.checkpoints()[-1] if exp.checkpoints() else 'none yet'})")

    with heartbeat.watch(where, strategy.lost_node_mates):
        for epoch in range(first_epoch, conf.train.epochs + 1):
            torch.manual_seed(conf.train.seed * 1_000_003 + epoch * 1009 + layout.rank)  # dropout masks
            engine.train()
            t0, frames, loss_sum, finite_losses, skipped.count = time.perf_counter(), 0, 0.0, 0, 0
            bar.reset(task, total=steps_per_epoch * accum, description=f"epoch {epoch}/{conf.train.epochs}")
            micro_step = -1  # a slow ADPSGD learner may get no batch at all
            for micro_step, (batch, progress) in enumerate(epoch_batches(epoch)):
                lr = learning_rate(conf.optim, global_batch, epoch - 1 + progress)
                for group in engine.optimizer.param_groups:
                    group["lr"] = lr
                # augmentation drawn from (seed, epoch, learner, step): reproducible, and the same after a resume
                b = train_set.collate(batch, np.random.default_rng([conf.train.seed, epoch, layout.rank, micro_step]))
                t_step = time.perf_counter()
                loss, applied = train_step(engine, strategy, b)
                strategy.straggle(time.perf_counter() - t_step)
                if math.isfinite(loss):
                    loss_sum, finite_losses = loss_sum + loss, finite_losses + 1
                skipped.record(loss, applied, engine.fp16_enabled(), where)
                frames += int(b["lengths"].sum())
                bar.update(task, advance=1, loss=loss_sum / max(finite_losses, 1),
                           fps=frames * layout.world_size / (time.perf_counter() - t0))
                if is_main and (micro_step + 1) % conf.train.log_interval == 0:
                    elapsed = time.perf_counter() - t0
                    log.info("epoch %d %.0f%% loss %.3f lr %.2e  %.0f frames/s per learner", epoch, 100 * progress,
                             loss_sum / max(finite_losses, 1), lr, frames / elapsed)
            strategy_stats = strategy.end_epoch(engine)  # ADPSGD/HYBRID: the consensus is part of the epoch's time
            epoch_wall = time.perf_counter() - t0
            epoch_frames, train_loss, skipped_steps = live_sum(strategy, [frames, loss_sum / max(finite_losses, 1),
                                                                          skipped.count])
            one_hot = [micro_step + 1 if r == layout.rank else 0 for r in range(layout.world_size)]
            micro_steps = [int(n) for n in live_sum(strategy, one_hot)]  # every learner's step count this epoch
            train_wall += epoch_wall
            train_frames += int(epoch_frames)

            shard = test_batches[strategy.live.index(layout.rank):: len(strategy.live)]
            totals, _ = evaluate(strategy.consensus(engine), test_set, shard, exp.tokens)
            totals = dict(zip(sorted(totals), live_sum(strategy, [totals[k] for k in sorted(totals)])))
            record = {"epoch": epoch, "train_loss": train_loss / len(strategy.live), "lr": lr,
                      "epoch_wall_s": epoch_wall, "wall_s": train_wall, "train_frames_per_s": epoch_frames / epoch_wall,
                      "learner_micro_steps": micro_steps, "skipped_steps": int(skipped_steps), **rates(totals),
                      **strategy_stats}
            if is_main:
                exp.save_checkpoint({"model": strategy.consensus(engine).state_dict(),
                                     "optimizer": engine.optimizer.state_dict(), "epoch": epoch,
                                     "train_wall_s": train_wall, "train_frames": train_frames},
                                    epoch, conf.train.keep_checkpoints)
                with open(exp.root / "train_log.jsonl", "a") as f:
                    f.write(json.dumps(record) + "\n")
                scores = "  ".join(f"{k.replace('_', ' ')} {100 * record[k]:.2f}%" for k in SCORE_KEYS if k in record)
                log.info("epoch %d done: train loss %.3f  held-out loss %.3f  %s  %.0f frames/s  %.0f s", epoch,
                         record["train_loss"], record["heldout_loss"], scores, record["train_frames_per_s"], epoch_wall)
                if record.get("lost_learners"):
                    log.warning("learner(s) %s lost; %d of %d learners go on", record["lost_learners"],
                                len(strategy.live), layout.world_size)
            history.append(record)
            strategy.barrier_live()  # nobody goes on (or exits) while the checkpoint is written

    bar.stop()
    strategy.close()
    heartbeat.close()
    last = history[-1]
    metrics = {"strategy": strategy.name, "learners": layout.world_size, "nodes": layout.nodes,
               "micro_batch": micro, "gradient_accumulation_steps": accum, "global_batch": global_batch,
               "node_batch": node_batch, "epochs": conf.train.epochs, "params": count_parameters(engine.module),
               "wall_s": train_wall, "train_frames_per_s": train_frames / max(train_wall, 1e-9),
               "objective": conf.train.objective, "heldout_loss": last["heldout_loss"],
               **{k: last[k] for k in SCORE_KEYS if k in last},
               "train_utterances": train_set.num_utterances, "test_utterances": test_set.num_utterances,
               "skipped": {"train": dict(train_set.skipped), "test": dict(test_set.skipped)},
               **{k: v for k, v in last.items() if k.startswith(("gossip_", "boundary_", "consensus_", "lost_"))},
               "precision": "bf16" if engine_conf.get("bf16", {}).get("enabled") else
                            "fp16" if engine_conf.get("fp16", {}).get("enabled") else "fp32"}
    if is_main:
        (exp.root / "metrics.json").write_text(json.dumps(metrics, indent=1))
    return metrics


def build_engine(exp: Experiment, conf, engine_conf: dict, strategy, input_dim: int, global_batch: int):
    """Model + optimizer -> DeepSpeed engine, data-parallel group from the strategy, learners in step."""
    import deepspeed

    torch.manual_seed(conf.train.seed)  # same initial weights everywhere; attach() makes sure of it
    model = exp.build_model(input_dim)
    optimizer = make_optimizer(conf.optim, model.parameters(), learning_rate(conf.optim, global_batch, 0.0))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=engine_conf, mpu=strategy.mpu())
    strategy.attach(engine)
    return engine


def gradients_finite(model: torch.nn.Module) -> bool:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return not grads or bool(torch.stack(torch._foreach_norm(grads)).isfinite().all())


def train_step(engine, strategy, batch: dict) -> tuple[float, bool | None]:
    """One micro batch: forward, loss (CTC or frame CE), backward (DeepSpeed reduces as its group says), step, hooks.
    -> (loss, applied): applied is None between gradient accumulation boundaries, else whether the optimizer
    step changed the weights. A step with non-finite gradients is skipped: in fp32 here, in bf16 and fp16 by
    DeepSpeed's optimizer (fp16 also skips its loss-scale overflows). The gradients are checked after
    DeepSpeed's reduction, so every learner of a data-parallel group skips alike and replicas stay equal."""
    dtype = next(engine.module.parameters()).dtype
    logits, out_lengths = engine(batch["feats"].to(engine.device, dtype), batch["lengths"].to(engine.device))
    loss = batch_loss(logits, out_lengths, batch)
    engine.backward(loss)
    boundary = engine.is_gradient_accumulation_boundary()  # asked before step(), which moves to the next one
    skipped_before = engine.skipped_steps
    mixed = engine.fp16_enabled() or engine.bfloat16_enabled()
    skip_here = boundary and not mixed and not gradients_finite(engine.module)
    if skip_here:  # DeepSpeed's step() still runs (its counters, clipping, zero_grad) but the update does not
        engine.optimizer.step = lambda *args, **kwargs: None
    try:
        with strategy.step_lock_context():
            engine.step()
    finally:
        if skip_here:
            del engine.optimizer.step  # the class's step() again
    if not boundary:
        return loss.item(), None
    strategy.after_step(engine)
    return loss.item(), not (skip_here or engine.skipped_steps > skipped_before)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--exp", required=True, help="experiment folder (prepared by stages 1-2)")
    p.add_argument("--ds-config", required=True, help="DeepSpeed JSON with the strategy's comm section")
    p.add_argument("--conf", default=None, help="recipe YAML")
    p.add_argument("--nodes", type=int, default=1, help="emulate this many nodes with this machine's learners "
                                                        "(HYBRID on one machine)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in EXP")
    p.add_argument("--launch-command", default=None, help="recorded in EXP/launch.txt (set by run.sh)")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # added by the launcher
    p.add_argument("overrides", nargs="*", help="key=value settings over the YAML")
    return p.parse_intermixed_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(stream=sys.stdout, level=logging.WARNING,
                        format=f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", datefmt="%H:%M:%S")
    # our log lines from rank 0 only (every rank reads the same data); other libraries stay at warnings
    logging.getLogger("recipe").setLevel(logging.INFO if rank == 0 else logging.ERROR)
    try:
        train(args)
    except LeftBehind as err:  # a HYBRID node that lost a learner: the other nodes go on
        print(f"LeftBehind: {err}", file=sys.stderr, flush=True)
        os._exit(0)  # its gossip thread may be waiting on a peer: no clean interpreter shutdown to wait for
    return 0


if __name__ == "__main__":
    sys.exit(main())
