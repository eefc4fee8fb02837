"""HYBRID (H-ADPSGD): synchronous allreduce inside a node, ADPSGD gossip between nodes.

The learners of a node form a "super learner": DeepSpeed's data-parallel group (through `mpu`) is the node,
so DeepSpeed allreduces gradients over the fast intra-node link only. Between nodes, each node's leader
(local rank 0) runs the ADPSGD gossip thread (comm/gossip.py, the same machinery, paired by the same
schedule over nodes) against the leader of a peer node. The merge must reach every learner of the node at
the same step boundary, or the replicas would drift apart: after every step the leader broadcasts what it
received (a one-element flag, then the delta when there is one) over the node group, and every learner of
the node adds the same delta. The replicas stay bit-identical.

With an emulated inter-node link (comm/link.py) every leader exchange lasts as long as on that link.

A lost learner (comm.on_lost_learner = "continue"): its node cannot step without it (DeepSpeed's group is
broken), so its node mates leave the run (LeftBehind, comm/health.py): at once when their next node collective
fails (gloo, a dead mate), or once its heartbeat has stood still for 2 x comm.lost_after_s where the collective
would block instead (a frozen mate; NCCL). To the other nodes the whole node is then lost, and ADPSGD's
machinery drops it.
The node of learner 0, which serves the rendezvous store, cannot be lost.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from comm.adpsgd import ADPSGDStrategy
from comm.base import dealt_batches
from comm.distributed import collective_device
from comm.staging import add_flat
from comm.layout import LayoutError


class HybridStrategy(ADPSGDStrategy):
    name = "hybrid"
    # a node's learners step together, so they take equal shards (batches): no comm.sampling
    options = {key: value for key, value in ADPSGDStrategy.options.items() if key != "sampling"}

    def __init__(self, layout, options, heartbeat=None):
        if layout.nodes < 2:
            raise LayoutError(f"hybrid needs at least 2 nodes (gossip runs between nodes); got nodes="
                              f"{layout.nodes} x local_size={layout.local_size} = world_size={layout.world_size}. "
                              "On one machine, emulate nodes with run.sh --nodes M")
        super().__init__(layout, options, heartbeat, units=layout.nodes)
        self.gossips = layout.local_rank == 0  # the node's leader; its mates merge what it broadcasts

    @property
    def data_parallel_size(self) -> int:
        return self.layout.local_size  # DeepSpeed's group (the mpu's): the node

    def gossip_ranks(self) -> list[int] | None:
        return [n * self.layout.local_size for n in range(self.layout.nodes)]  # the node leaders

    def batches(self, sampler, epoch: int, accumulation: int):
        """Dealt by rank, as SYNC's: the learners of a node step together, so they take equal counts."""
        return dealt_batches(self.members, sampler, epoch, accumulation)

    def _peer(self, round_: int) -> int:
        return self.schedule.peer(self.layout.node_rank, round_) * self.layout.local_size

    def _mates(self) -> list[int]:
        first = self.layout.node_rank * self.layout.local_size
        return [r for r in range(first, first + self.layout.local_size) if r != self.layout.rank]

    def attach(self, engine) -> None:
        super().attach(engine)
        if self.members.goes_on:  # a frozen mate, or any lost mate on NCCL, blocks a node collective: leave anyway
            self.heartbeat.leave_without(self._mates(), self.conf["lost_after_s"])

    def _lost_needed(self) -> list[int]:
        """After a node collective failed: the learners of this node that are gone ([]: a real error)."""
        if not self.members.goes_on:
            return []
        return [r for r in self._mates() if self._confirm_lost(r)]

    def _merge(self) -> None:
        """Every learner of the node adds the same delta at the same step boundary."""
        group = self.groups.data  # DeepSpeed's node group: NCCL on GPUs
        device = collective_device()
        delta = self._thread.take_pending() if self._thread is not None else None
        flag = torch.tensor([0 if delta is None else 1], device=device)
        leader = self.layout.node_rank * self.layout.local_size
        dist.broadcast(flag, src=leader, group=group)
        if flag.item():
            delta = torch.empty(sum(w.numel() for w in self.weights.masters), device=device) if delta is None \
                else delta.to(device)
            dist.broadcast(delta, src=leader, group=group)
            with self.lock:
                add_flat(self.weights.masters, delta)
                self.weights.publish()
