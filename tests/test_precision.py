"""fp16 without ZeRO, the recipe's path through DeepSpeed's FP16_UnfusedOptimizer, run on the CPU.

DeepSpeed refuses fp16 on its CPU accelerator; the learner here declares it supported, which is all it takes:
the optimizer's logic (fp32 masters, loss scaling, the copy back to fp16 weights) is the same on a GPU. On an
H200 (BENCHMARKS.md §10) fp16 did not learn: DeepSpeed 0.19.8 does not scale the loss for it in backward() but
divides the gradients by the loss scale in step(). recipe.lib.engine.backward() scales it.
"""

from __future__ import annotations

import pytest
import torch

from recipe.tools.local_learners import run_learners

pytestmark = pytest.mark.slow  # a learner process: not in the fast tier

FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}


def one_step(rank: int, world: int, precision: str, recipe_backward: bool) -> dict:
    """One SGD step from the same weights and batch -> the weights the optimizer stepped, before and after."""
    from deepspeed.accelerator import get_accelerator

    from comm import ProcessLayout, build_strategy, init_distributed
    from comm.weights import master_weights
    from model.lstm import LSTMAcousticModel, ctc_loss
    from recipe.lib.engine import backward, build_engine, gradient_norm, grads_scale

    accelerator = get_accelerator()  # fp16 on the CPU: see the module's docstring
    supported = accelerator.supported_dtypes()
    accelerator.is_fp16_supported = lambda: True
    accelerator.supported_dtypes = lambda: [*supported, torch.float16]
    init_distributed()
    torch.manual_seed(0)
    model = LSTMAcousticModel(input_dim=12, output_dim=6, layers=1, hidden=16, stack=2)
    config = {"train_micro_batch_size_per_gpu": 2, **({"fp16": FP16} if precision == "fp16" else {})}
    engine = build_engine(model, torch.optim.SGD(model.parameters(), lr=0.5), config,
                          build_strategy({"strategy": "sync"}, ProcessLayout.from_env()))
    before = torch.cat([w.detach().float().flatten().clone() for w in master_weights(engine)])
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(2, 10, 12, generator=g).to(next(engine.module.parameters()).dtype)
    logits, out_lengths = engine(feats, torch.tensor([10, 8]))
    loss = ctc_loss(logits, out_lengths, torch.randint(1, 6, (4,), generator=g), torch.tensor([2, 2]))
    if recipe_backward:
        backward(engine, loss)
    else:
        engine.backward(loss)
    scale, fp32_norm = grads_scale(engine), gradient_norm(engine.module)  # the latter: fp32's (unscaled) norm
    engine.step()
    after = torch.cat([w.detach().float().flatten() for w in master_weights(engine)])
    return {"update": after - before, "optimizer": type(engine.optimizer).__name__,
            "grad_norm": fp32_norm if precision == "fp32" else engine.get_global_grad_norm() / scale}


def test_fp16_steps_as_fp32_does():
    fp32, fp16, unscaled = (run_learners(one_step, 1, precision, recipe)[0]
                            for precision, recipe in (("fp32", True), ("fp16", True), ("fp16", False)))
    assert fp16["optimizer"] == "FP16_UnfusedOptimizer"
    # the recipe's backward: the same update as fp32, to fp16's precision, and the same gradient norm
    torch.testing.assert_close(fp16["update"], fp32["update"], rtol=0.02, atol=2e-4)
    assert fp16["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=0.02)
    # DeepSpeed's own backward still leaves the loss unscaled: an update about 2^-16 of fp32's (fp16 rounds the
    # tiny gradients: measured 1.9e-5). When this fails, DeepSpeed scales fp16 itself and
    # recipe.lib.engine.backward() must stop doing it.
    assert unscaled["update"].norm() / fp32["update"].norm() < 1e-4


def built(rank: int, world: int, precision: str) -> dict:
    """An engine built with Adam and weight decay, no step taken -> its optimizer's state and how far its
    masters moved from the initial weights."""
    from comm import ProcessLayout, build_strategy, init_distributed
    from comm.weights import master_weights
    from model.lstm import LSTMAcousticModel
    from recipe.lib.engine import build_engine

    init_distributed()
    torch.manual_seed(0)
    model = LSTMAcousticModel(input_dim=12, output_dim=6, layers=1, hidden=16, stack=2)
    initial = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": precision == "bf16"}}
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1, weight_decay=0.5)
    engine = build_engine(model, optimizer, config, build_strategy({"strategy": "sync"}, ProcessLayout.from_env()))
    masters = torch.cat([w.detach().float().flatten() for w in master_weights(engine)])
    return {"optimizer": type(engine.optimizer).__name__, "state": len(optimizer.state),
            "moved": float((masters - initial).abs().max())}


def test_a_bf16_engine_starts_as_an_fp32_one_with_no_optimizer_step_taken():
    # DeepSpeed's initialize_optimizer_states steps Adam once on zero gradients: with weight decay every weight
    # moved and Adam's step count started at 1 (recipe.lib.engine.undo_hidden_step)
    fp32, bf16 = (run_learners(built, 1, precision)[0] for precision in ("fp32", "bf16"))
    assert bf16["optimizer"] == "FP16_UnfusedOptimizer"
    assert fp32["state"] == bf16["state"] == 0
    assert fp32["moved"] == bf16["moved"] == 0  # the masters are the fp32 initial weights, not bf16-rounded
