"""Where this learner sits: global rank and world, and its node. Read once from the launcher, validated once.

The deepspeed launcher sets RANK/WORLD_SIZE and LOCAL_RANK/LOCAL_SIZE, and, for multi-node runs, CROSS_RANK
(the node index) and CROSS_SIZE (the node count). A world that does not split into equal nodes is rejected
with every factor printed, before any process group is built.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


class LayoutError(ValueError):
    """A process layout that the strategies cannot use."""


@dataclass(frozen=True)
class ProcessLayout:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_size: int = 1  # learners on this node
    node_rank: int = 0
    nodes: int = 1

    def __post_init__(self):
        factors = (f"world_size={self.world_size} rank={self.rank} nodes={self.nodes} node_rank={self.node_rank} "
                   f"local_size={self.local_size} local_rank={self.local_rank}")
        if self.nodes * self.local_size != self.world_size:
            raise LayoutError(f"the world does not split into equal nodes: nodes x local_size = "
                              f"{self.nodes} x {self.local_size} != world_size ({factors})")
        if not (0 <= self.rank < self.world_size and 0 <= self.local_rank < self.local_size
                and 0 <= self.node_rank < self.nodes):
            raise LayoutError(f"a rank is out of range ({factors})")
        if self.rank != self.node_rank * self.local_size + self.local_rank:
            raise LayoutError(f"rank != node_rank x local_size + local_rank ({factors})")

    @classmethod
    def from_env(cls, env=os.environ, emulated_nodes: int = 1) -> "ProcessLayout":
        """The launcher's layout; emulated_nodes > 1 splits one machine's learners into that many nodes."""
        world = int(env.get("WORLD_SIZE", 1))
        rank = int(env.get("RANK", 0))
        local_size = int(env.get("LOCAL_SIZE", env.get("LOCAL_WORLD_SIZE", world)))
        nodes = int(env.get("CROSS_SIZE", max(1, world // max(local_size, 1))))
        if emulated_nodes > 1:
            if nodes > 1:
                raise LayoutError(f"--nodes {emulated_nodes} emulates nodes on one machine, but the launcher "
                                  f"already runs {nodes} real nodes (world_size={world})")
            if world % emulated_nodes:
                raise LayoutError(f"the world does not split into equal nodes: world_size={world} learners "
                                  f"into nodes={emulated_nodes} (local_size would be {world / emulated_nodes:g})")
            local_size = world // emulated_nodes
            return cls(rank=rank, world_size=world, local_rank=rank % local_size, local_size=local_size,
                       node_rank=rank // local_size, nodes=emulated_nodes)
        return cls(rank=rank, world_size=world, local_rank=int(env.get("LOCAL_RANK", 0)),
                   local_size=local_size, node_rank=int(env.get("CROSS_RANK", 0)), nodes=nodes)
