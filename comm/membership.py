"""Who is still in the run, and the collectives over them (DESIGN.md §7).

Every learner starts in; only a strategy that goes on without a lost learner (ADPSGD and HYBRID with
comm.on_lost_learner = "continue") ever narrows the members, at an epoch's end, once the survivors have agreed
on who is left (comm/health.py check_in). From then on the reductions and barriers of the training loop and of
the strategy run over a gloo group of the survivors alone (LiveGroup), so nobody waits for a lost learner.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from comm.distributed import LiveGroup, collective_device


class Membership:
    def __init__(self, rank: int, world_size: int, goes_on: bool = False,
                 needed: Callable[[], list[int]] = list):
        """goes_on: the others go on without a lost learner. needed() -> the lost learners without which this
        one cannot step while the others can (HYBRID: its node mates); [] makes a failure fatal."""
        self.rank, self.world_size = rank, world_size
        self.goes_on = goes_on
        self.lost_needed = needed
        self.live = list(range(world_size))
        self._group: LiveGroup | None = None  # None: the whole world

    @property
    def lost(self) -> list[int]:
        return sorted(set(range(self.world_size)) - set(self.live))

    def index(self) -> int:
        """This learner's place among the live ones (to deal batches and evaluation shards)."""
        return self.live.index(self.rank)

    def narrow(self, live: list[int], tag: str) -> None:
        """The survivors agreed on `live` at the point `tag`: collectives run over them from now on."""
        if live != self.live:
            self.live, self._group = live, LiveGroup(live, self.rank, tag)

    def reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """All-reduce over the live learners (collective over them); -> the result, on the device the collective
        ran on (the accelerator's for the world, CPU for gloo's group of survivors)."""
        if self._group is None:
            tensor = tensor.to(collective_device())
            dist.all_reduce(tensor, op=op)
        else:
            tensor = tensor.cpu()
            self._group.all_reduce(tensor, op)
        return tensor

    def sum(self, values: list[float]) -> list[float]:
        """Python numbers summed over the live learners."""
        return self.reduce(torch.tensor(values, dtype=torch.float64)).tolist()

    def share(self, obj, src: int = 0):
        """Learner src's picklable object, on every learner (collective over the world, before anyone is lost)."""
        if self._group is not None:
            raise RuntimeError("share() is for the start of a run, before any learner was lost")
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        if self._group is None:
            dist.barrier()
        else:
            self._group.barrier()
