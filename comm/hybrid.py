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
broken), so its node mates find it gone when their next node collective fails and leave the run
(LeftBehind, comm/health.py); to the other nodes the whole node is then lost, and ADPSGD's machinery drops it.
The node of learner 0, which serves the rendezvous store, cannot be lost.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from comm.adpsgd import ADPSGDStrategy
from comm.base import collective_device
from comm.gossip import add_flat
from comm.layout import LayoutError


class HybridStrategy(ADPSGDStrategy):
    name = "hybrid"
    independent_sampling = False  # the learners of a node step together; nodes read different shards

    def __init__(self, layout, options, heartbeat=None):
        if layout.nodes < 2:
            raise LayoutError(f"hybrid needs at least 2 nodes (gossip runs between nodes); got nodes="
                              f"{layout.nodes} x local_size={layout.local_size} = world_size={layout.world_size}. "
                              "On one machine, emulate nodes with run.sh --nodes M")
        super().__init__(layout, options, heartbeat, units=layout.nodes)
        self.is_leader = layout.local_rank == 0

    @property
    def data_parallel_size(self) -> int:
        return self.layout.local_size  # DeepSpeed's group (the mpu's): the node

    def _gossip_ranks(self) -> list[int]:
        return [n * self.layout.local_size for n in range(self.layout.nodes)]  # the node leaders

    def _peer(self, round_: int) -> int:
        return self.schedule.peer(self.layout.node_rank, round_) * self.layout.local_size

    def lost_node_mates(self) -> list[int]:
        """After a node collective failed: the learners of this node that are gone ([]: a real error)."""
        if not self.goes_on:
            return []
        first = self.layout.node_rank * self.layout.local_size
        mates = [r for r in range(first, first + self.layout.local_size) if r != self.layout.rank]
        return [r for r in mates if self._confirm_lost(r)]

    def _start_gossip(self) -> None:
        if self.is_leader:
            super()._start_gossip()
        else:
            self._thread = _Follower(self.rounds)

    def _merge(self) -> None:
        """Every learner of the node adds the same delta at the same step boundary."""
        group = self.mpu().get_data_parallel_group()
        device = collective_device()  # DeepSpeed's node group: NCCL on GPUs
        delta = self._thread.take_pending() if self.is_leader else None
        flag = torch.tensor([0 if delta is None else 1], device=device)
        leader = self.layout.node_rank * self.layout.local_size
        dist.broadcast(flag, src=leader, group=group)
        if flag.item():
            delta = torch.empty(sum(p.numel() for p in self._params), device=device) if delta is None \
                else delta.to(device)
            dist.broadcast(delta, src=leader, group=group)
            with self.step_lock:
                add_flat(self._params, delta)


class _Follower:
    """A non-leader's stand-in for the gossip thread: it exchanges nothing and merges only what its leader
    broadcasts, but takes part in agreeing on the last round."""

    def __init__(self, rounds: int):
        self.rounds_started = rounds
        self.bytes_sent = self.boundary_bytes = self.merges_skipped = self.rounds_skipped = 0
        self.exchange_seconds = 0.0

    def step_done(self) -> None:
        pass

    def take_pending(self):
        return None

    def pause(self) -> int:
        return self.rounds_started

    def stop(self, last_round: int, timeout: float | None = None) -> None:
        self.rounds_started = last_round
