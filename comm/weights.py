"""The weights a strategy mixes: the ones the optimizer steps (DESIGN.md §9.15).

Under bf16 or fp16 DeepSpeed's optimizer wrapper keeps an fp32 master copy of the weights, steps it, and copies
it over the module's parameters after every step. A gossip merge, the start-up broadcast or the consensus
average written into the module's parameters alone would be erased by the next step, and the learners would
train apart. So ADPSGD and HYBRID read and write the master copy, and `publish()` copies it over the module's
parameters. In fp32 the master copy is the parameters themselves and publish() does nothing.
"""

from __future__ import annotations

import itertools

import torch
from torch._utils import _unflatten_dense_tensors


class UnsupportedPrecision(ValueError):
    pass


def master_weights(engine) -> list[torch.Tensor]:
    """For each of the module's parameters, in order, the tensor the optimizer steps."""
    params = list(engine.module.parameters())
    if not (engine.fp16_enabled() or engine.bfloat16_enabled()):
        return params
    optimizer = engine.optimizer
    low = getattr(optimizer, "fp16_groups", None)  # DeepSpeed's names, for bf16 as for fp16
    if engine.zero_optimization() or low is None:
        raise UnsupportedPrecision(
            f"ADPSGD, HYBRID and LOCALSGD mix the fp32 master weights of DeepSpeed's fp16/bf16 optimizer without ZeRO; "
            f"this engine's optimizer is {type(optimizer).__name__}"
            f"{' with ZeRO' if engine.zero_optimization() else ''}: remove zero_optimization from the JSON")
    if hasattr(optimizer, "fp32_groups"):  # FP16_UnfusedOptimizer: an fp32 tensor per parameter
        masters = itertools.chain.from_iterable(optimizer.fp32_groups)
    else:  # FP16_Optimizer (fused): one flat fp32 tensor per group; views of it
        masters = itertools.chain.from_iterable(
            _unflatten_dense_tensors(flat, group) for flat, group in zip(optimizer.fp32_groups_flat, low))
    by_param = {id(p): m for p, m in zip(itertools.chain.from_iterable(low), masters)}
    return [by_param.get(id(p), p) for p in params]  # a frozen parameter is its own master


class Weights:
    """The module's parameters and their masters, side by side."""

    def __init__(self, engine):
        self.params = list(engine.module.parameters())
        self.masters = master_weights(engine)
        self._copies = [(m, p) for m, p in zip(self.masters, self.params) if m is not p]

    def publish(self) -> None:
        """The masters over the module's parameters (after anything wrote the masters)."""
        with torch.no_grad():
            for master, param in self._copies:
                param.copy_(master)
