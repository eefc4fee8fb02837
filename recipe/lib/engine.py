"""The engine a learner trains: the model and its optimizer in DeepSpeed, the strategy attached, and one
training step. Used by the training stage (recipe/train.py), the benchmarks and the GPU check alike.
"""

from __future__ import annotations

import logging
import math
import os
from types import SimpleNamespace
from typing import NamedTuple

import torch

from comm.distributed import learner_device
from comm.weights import Weights
from model.lstm import ctc_loss, frame_ce_loss
from recipe.lib.config import for_strategy
from recipe.lib.schedule import learning_rate

log = logging.getLogger("recipe.engine")


def threads_per_learner(requested: int, local_size: int) -> int:
    """Cores / learners on this node (DESIGN.md §9.1: oversubscribed threads ran 8x slower)."""
    if requested > 0:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // local_size)


class SkippableStep:
    """Mixed into the recipe's optimizers: skip_next_step() makes the next step() leave the weights and the
    optimizer's state as they are, while DeepSpeed's step() around it still clips, zeroes the gradients and
    keeps its counters."""

    _skip = False
    skips = 0  # steps skipped so far (train_step compares it around engine.step())

    def skip_next_step(self) -> None:
        self._skip = True

    def step(self, closure=None):
        if self._skip:
            self._skip, self.skips = False, self.skips + 1
            return None
        return super().step(closure)


class SGD(SkippableStep, torch.optim.SGD):
    pass


class Adam(SkippableStep, torch.optim.Adam):
    pass


class AdamW(SkippableStep, torch.optim.AdamW):
    pass


def make_optimizer(optim, params, lr: float) -> torch.optim.Optimizer:
    """torch's fused kernels on GPUs (one kernel for all parameters: apex's FusedAdam, without apex). On CPU the
    default for-each kernels: fused CPU kernels round differently, and the CPU figures were measured without."""
    fused = True if torch.cuda.is_available() else None
    if optim.name == "sgd":
        return SGD(params, lr=lr, momentum=optim.momentum, weight_decay=optim.weight_decay, fused=fused)
    cls = Adam if optim.name == "adam" else AdamW
    return cls(params, lr=lr, weight_decay=optim.weight_decay, fused=fused)


def build_engine(model: torch.nn.Module, optimizer: torch.optim.Optimizer, engine_conf: dict, strategy):
    """-> the DeepSpeed engine, its data-parallel group the strategy's, the strategy attached to it (learners
    in step). The same initial weights on every learner are the caller's seed; attach() makes sure of them."""
    import deepspeed

    initial = [p.detach().clone() for p in model.parameters()]  # fp32, before DeepSpeed casts the module
    on = SimpleNamespace(device_rank=learner_device())  # DeepSpeed's choice (the local rank), unless GPUs are shared
    engine, *_ = deepspeed.initialize(args=on, model=model, optimizer=optimizer, config=engine_conf,
                                      mpu=strategy.mpu())
    undo_hidden_step(engine, initial)
    pack_rnn_weights(engine)
    strategy.attach(engine)
    return engine


def undo_hidden_step(engine, initial: list[torch.Tensor]) -> None:
    """DeepSpeed's fp16/bf16 optimizers without ZeRO (FP16_UnfusedOptimizer, FP16_Optimizer) take one optimizer
    step on zero gradients while they are built (initialize_optimizer_states, to allocate the state). Under Adam
    the first real update is then bias-corrected as the second (about 0.74x fp32's first), and with weight decay
    every weight moves before training starts. Undone: the optimizer's state dropped (rebuilt at the first real
    step, as in fp32), the masters back to the initial fp32 weights, and those published to the module."""
    if not (engine.fp16_enabled() or engine.bfloat16_enabled()) or engine.zero_optimization():
        return
    engine.optimizer.optimizer.state.clear()
    weights = Weights(engine)
    with torch.no_grad():
        for master, value in zip(weights.masters, initial):
            master.copy_(value)
    weights.publish()


def pack_rnn_weights(engine) -> int:
    """Pack every LSTM's weights into the one contiguous buffer cuDNN wants, in bf16 too; -> how many were packed.

    torch's flatten_parameters() packs them only for the dtypes in torch.backends.cudnn.CUDNN_TENSOR_DTYPES (half,
    float, double), so under DeepSpeed's bf16 cast it returns at once, and cuDNN, which does run bf16 LSTMs,
    copies the scattered weights into a buffer of its own at every call (its warning "RNN module weights are
    not part of single contiguous chunk of memory", BENCHMARKS.md §10). Packing moves the parameters' storage
    once, here, before the strategy holds any view of them. DeepSpeed's unfused fp16/bf16 optimizer (any torch
    optimizer gets it) copies its masters into the parameters in place, so they stay packed; its fused one
    keeps the parameters as views of its own flat buffer, which packing would cut off, so they are left as
    they are. On the CPU there is nothing to pack; where cuDNN refuses, the unpacked weights still work."""
    import torch.backends.cudnn as cudnn

    rnns = [m for m in engine.module.modules() if isinstance(m, torch.nn.RNNBase)]
    on_gpu = rnns and all(p.is_cuda for m in rnns for p in m.parameters()) and cudnn.is_available()
    if not on_gpu or hasattr(engine.optimizer, "fp32_groups_flat"):
        return 0
    extra = {torch.bfloat16} - cudnn.CUDNN_TENSOR_DTYPES
    cudnn.CUDNN_TENSOR_DTYPES |= extra  # for flatten_parameters' own check, for as long as it runs
    try:
        for rnn in rnns:
            rnn.flatten_parameters()
    except RuntimeError as err:
        log.warning("the LSTM weights stay unpacked (cuDNN copies them at every call): %s", err)
        return 0
    finally:
        cudnn.CUDNN_TENSOR_DTYPES -= extra
    return len(rnns)


def initial_learning_rate(conf, strategy_name: str, replicas: int, global_batch: int) -> float:
    """The rate the optimizer is built with: the schedule's at the start of training (the loop sets it at every
    step)."""
    optim = for_strategy(conf, strategy_name).optim  # optim.batch_scaling=auto
    return learning_rate(optim, global_batch, 1, 0.0, None, replicas)


def experiment_engine(exp, engine_conf: dict, strategy, input_dim: int, global_batch: int):
    """The engine of an experiment's model and optimizer (EXP's config), the same initial weights everywhere."""
    torch.manual_seed(exp.conf.train.seed)
    model = exp.build_model(input_dim)
    lr = initial_learning_rate(exp.conf, strategy.name, strategy.replicas, global_batch)
    optimizer = make_optimizer(exp.conf.optim, model.parameters(), lr)
    return build_engine(model, optimizer, engine_conf, strategy)


def batch_loss(logits: torch.Tensor, out_lengths: torch.Tensor, batch: dict) -> torch.Tensor:
    """The training loss of a batch: frame cross entropy if it has frame targets (CE), else CTC."""
    device = logits.device
    if "frame_targets" in batch:
        return frame_ce_loss(logits, batch["frame_targets"].to(device))
    return ctc_loss(logits, out_lengths, batch["targets"].to(device), batch["target_lengths"].to(device))


def gradient_norm(model: torch.nn.Module) -> float:
    """The global L2 norm of the gradients (after DeepSpeed's reduction); 0 when there are none."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.stack(torch._foreach_norm(grads)).norm()) if grads else 0.0


class Step(NamedTuple):
    loss: float
    applied: bool | None  # None between gradient accumulation boundaries, else whether the weights changed
    grad_norm: float | None  # at a boundary, before clipping (None: not known, e.g. DeepSpeed's mixed precision)


def backward(engine, loss: torch.Tensor) -> None:
    """engine.backward(loss), with fp16's loss scale applied where DeepSpeed forgets it. DeepSpeed 0.19.8 scales
    the loss for ZeRO's optimizers only, while its fp16 optimizers without ZeRO still divide the gradients by the
    loss scale in step(): every update came out 65,536x too small and fp16 did not learn (first seen on an H200,
    BENCHMARKS.md §10; deepspeedai/DeepSpeed#8393). tests/test_precision.py fails once DeepSpeed scales itself."""
    if engine.fp16_enabled() and not engine.zero_optimization():
        loss = loss * engine.optimizer.loss_scale
    engine.backward(loss)


def grads_scale(engine) -> float:
    """What DeepSpeed's gradient norm is to be divided by: the loss scale of the step about to be taken where
    the optimizer reports the norm of the scaled gradients (the unfused fp16 one), else 1."""
    unfused = engine.fp16_enabled() and type(engine.optimizer).__name__ == "FP16_UnfusedOptimizer"
    return float(engine.optimizer.loss_scale) if unfused else 1.0


def skips(engine) -> tuple[int, int]:
    """Steps skipped so far: by DeepSpeed's mixed-precision optimizer, and by the recipe's (SkippableStep)."""
    return engine.skipped_steps, getattr(engine.optimizer, "skips", 0)


def train_step(engine, strategy, batch: dict) -> Step:
    """One micro batch: forward, loss (CTC or frame CE), backward (DeepSpeed reduces as its group says), then
    the optimizer step or its skip, and the strategy's hook. A step with a non-finite gradient is skipped: in
    fp32 here, in bf16 and fp16 by DeepSpeed's optimizer (fp16 also skips its loss-scale overflows). In fp32 the
    gradients are checked after DeepSpeed's reduction, so every learner of a data-parallel group decides alike
    and replicas stay equal."""
    dtype = next(engine.module.parameters()).dtype
    logits, out_lengths = engine(batch["feats"].to(engine.device, dtype), batch["lengths"].to(engine.device))
    loss = batch_loss(logits, out_lengths, batch)
    backward(engine, loss)
    boundary = engine.is_gradient_accumulation_boundary()  # asked before step(), which moves to the next one
    skips_before = skips(engine)
    scale = grads_scale(engine)  # before step() changes it
    mixed = engine.fp16_enabled() or engine.bfloat16_enabled()
    norm = gradient_norm(engine.module) if boundary and not mixed else None
    if norm is not None and not math.isfinite(norm):  # DeepSpeed's step() still runs (clipping, zero_grad,
        engine.optimizer.skip_next_step()  # counters); the update does not
    with strategy.step_lock():  # LOCALSGD's warm-up may skip it too: the average of the gradients is not finite
        engine.step()
    if not boundary:
        return Step(loss.item(), None, None)
    strategy.after_step(engine)
    if norm is None and engine.get_global_grad_norm() is not None:
        norm = engine.get_global_grad_norm() / scale
    skipped = skips(engine) != skips_before
    return Step(loss.item(), not skipped, None if norm is None else float(norm))
