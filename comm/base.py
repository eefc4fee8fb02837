"""The strategy interface: the few hooks the training loop calls around one DeepSpeed engine.

The loop knows nothing else about how learners communicate. SYNC needs almost none of the hooks (DeepSpeed's
own allreduce does the work); ADPSGD and HYBRID use all of them (DESIGN.md section 3).
"""

from __future__ import annotations

import torch.nn as nn

from comm.layout import ProcessLayout


class Strategy:
    name = "base"
    options: dict = {}  # the keys this strategy accepts in the JSON "comm" section, with their defaults

    def __init__(self, layout: ProcessLayout, options: dict):
        self.layout = layout
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise ValueError(f'"comm" options {unknown} are unknown to strategy {self.name!r}; '
                             f"valid: {sorted(self.options) or 'none'}")
        self.conf = {**self.options, **options}

    def mpu(self):
        """What DeepSpeed treats as its data-parallel group; None means the whole world."""
        return None

    @property
    def data_parallel_size(self) -> int:
        """Learners whose gradients DeepSpeed averages: its train_batch_size counts their micro batches."""
        return self.layout.world_size

    def attach(self, engine) -> None:
        """After deepspeed.initialize: every learner must start from the same weights."""

    def after_step(self, engine) -> None:
        """At every optimizer-step boundary."""

    def consensus(self, engine) -> nn.Module:
        """The model to evaluate and checkpoint: the same on every learner."""
        return engine.module

    def close(self) -> None:
        """Stop any background communication without deadlock."""
