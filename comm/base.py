"""The strategy interface: what the training loop asks of a strategy around one DeepSpeed engine (DESIGN.md §4).

    mpu()                    what DeepSpeed treats as its data-parallel group
    attach(engine)           after deepspeed.initialize: learners start from the same weights
    batches(sampler, epoch, accumulation)  this learner's micro batches of an epoch, with the epoch's progress
    step_lock()              held around the optimizer step
    after_step(engine)       at every optimizer-step boundary
    end_epoch(engine)        collective at an epoch's end; -> statistics for the training log
    consensus(engine)        the model to evaluate and checkpoint, the same on every learner
    members                  who is live, and reductions and barriers over them (comm/membership.py)
    close()                  stop background communication without deadlock

The loop knows nothing else about how learners communicate. SYNC needs almost none of the hooks (DeepSpeed's
own allreduce does the work); ADPSGD and HYBRID use all of them.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
import torch
import torch.nn as nn

from comm.distributed import GroupMPU, ProcessGroups
from comm.layout import ProcessLayout
from comm.link import EmulatedLink
from comm.membership import Membership


def dealt_batches(members: Membership, sampler, epoch: int, accumulation: int):
    """The epoch's batches dealt over the live learners in turn: equal counts, whole optimizer steps only."""
    batches, live = sampler.epoch_batches(epoch), members.live
    steps = len(batches) // len(live) // accumulation
    for i, batch in enumerate(batches[members.index():: len(live)][: steps * accumulation]):
        yield batch, (i // accumulation + 1) / steps


class Strategy:
    name = "base"
    # the keys this strategy accepts in the JSON "comm" section, with their defaults; debug is read by
    # comm/faults.py, link is an emulated inter-node network (comm/link.py)
    options: dict = {"debug": {}, "link": {},
                     "lost_after_s": 5.0}  # a learner whose heartbeat stands still this long is lost (comm/health.py)
    # the options among them that take one of a closed set of values: checked here, naming the valid ones
    choices: dict = {}

    def __init__(self, layout: ProcessLayout, options: dict, heartbeat=None):
        """heartbeat: the learner's comm.health.Heartbeat, through which a strategy that goes on without a
        lost learner finds it (None: a lost learner stops the run)."""
        self.layout = layout
        self.heartbeat = heartbeat
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise ValueError(f'"comm" options {unknown} are unknown to strategy {self.name!r}; '
                             f"valid: {sorted(self.options) or 'none'}")
        self.conf = {**self.options, **options}
        for key, valid in self.choices.items():
            if key in self.options and self.conf[key] not in valid:
                raise ValueError(f"comm.{key}={self.conf[key]!r}; valid: {', '.join(valid)}")
        self.link = EmulatedLink(self.conf["link"])
        self.members = Membership(layout.rank, layout.world_size)
        self.boundary_bytes = 0.0  # bytes this learner sent across a node boundary (counted with a link only)
        self._groups: ProcessGroups | None = None
        self._mpu: GroupMPU | None = None

    # -- the process groups: every one built at once, from the layout (comm/distributed.py) ---------------------
    @property
    def data_parallel_size(self) -> int:
        """Learners whose gradients DeepSpeed averages: its train_batch_size counts their micro batches."""
        return self.layout.world_size

    @property
    def replicas(self) -> int:
        """Model copies that step on their own gradients (SYNC: 1; ADPSGD, LOCALSGD: every learner; HYBRID:
        every node): the learning-rate rule sqrt_replicas scales with them (recipe/lib/schedule.py)."""
        return self.layout.world_size // self.data_parallel_size

    def gossip_ranks(self) -> list[int] | None:
        """The learners that gossip (None: no gossip)."""
        return None

    @property
    def groups(self) -> ProcessGroups:
        if self._groups is None:  # collective: every learner builds them at the same point (mpu or attach)
            self._groups = ProcessGroups.build(self.layout, self.data_parallel_size, self.gossip_ranks())
        return self._groups

    def mpu(self):
        """What DeepSpeed treats as its groups: ours, built with train.collective_timeout_s (ProcessGroups)."""
        if self._mpu is None:
            self._mpu = GroupMPU(self.groups, self.layout.rank, self.data_parallel_size)
        return self._mpu

    # -- the hooks ------------------------------------------------------------------------------------------------
    def attach(self, engine) -> None:
        """After deepspeed.initialize: every learner must start from the same weights."""
        self.groups  # noqa: B018 - built here at the latest, by every learner
        self.model_bytes = sum(p.numel() * p.element_size() for p in engine.module.parameters())

    def batches(self, sampler, epoch: int, accumulation: int) -> Iterator[tuple[np.ndarray, float]]:
        """This learner's micro batches of the epoch -> (batch, fraction of the epoch the learners together have
        done once it is trained)."""
        return dealt_batches(self.members, sampler, epoch, accumulation)

    def step_lock(self):
        """Held around the optimizer step (ADPSGD: the gossip merge takes the same lock)."""
        return contextlib.nullcontext()

    def after_step(self, engine) -> None:
        """At every optimizer-step boundary."""

    def end_epoch(self, engine) -> dict:
        """At the end of an epoch, on every learner (collective); -> statistics for the training log."""
        if not self.link.enabled:
            return {}
        total = self.members.reduce(torch.tensor([self.boundary_bytes], dtype=torch.float64))
        return {"boundary_bytes_emulated_link": total.item()}

    def state_dict(self) -> dict:
        """What --resume restores besides the weights and the optimizer: counters that decide when to
        communicate (saved by learner 0, the same on every learner where it matters)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """After attach(), from a checkpoint's state_dict()."""

    def consensus(self, engine) -> nn.Module:
        """The model to evaluate and checkpoint: the same on every learner."""
        return engine.module

    def close(self) -> None:
        """Stop any background communication without deadlock."""
