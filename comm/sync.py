"""SYNC: synchronous data-parallel SGD. DeepSpeed allreduces the gradients of every step over the whole world;
its initialize() broadcasts rank 0's weights, so the learners stay identical and there is nothing to add,
except, with an emulated inter-node link, the time the allreduce would spend crossing the node boundaries."""

import time

from comm.base import Strategy


def emulate_ring_allreduce(strategy: Strategy) -> None:
    """With an emulated inter-node link (comm/link.py), the time a ring allreduce of the model over the world
    would spend crossing the node boundaries, slept; the bytes counted. SYNC after every step, LOCALSGD after
    every average."""
    if not strategy.link.enabled or strategy.layout.nodes < 2:
        return
    # A ring allreduce over W learners runs 2 (W - 1) phases, each passing model_bytes / W along every
    # link of the ring; `nodes` of those links cross a node boundary, and the slowest link sets the pace.
    w = strategy.layout.world_size
    per_link = 2 * (w - 1) / w * strategy.model_bytes
    time.sleep(strategy.link.transfer_seconds(per_link, messages=2 * (w - 1)))
    strategy.boundary_bytes += per_link * strategy.layout.nodes / w  # this learner's share of the crossing bytes


class SyncStrategy(Strategy):
    name = "sync"

    def after_step(self, engine) -> None:
        emulate_ring_allreduce(self)
