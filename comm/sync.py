"""SYNC: synchronous data-parallel SGD. DeepSpeed allreduces the gradients of every step over the whole world;
its initialize() broadcasts rank 0's weights, so the learners stay identical and there is nothing to add,
except, with an emulated inter-node link, the time the allreduce would spend crossing the node boundaries."""

import time

from comm.base import Strategy


class SyncStrategy(Strategy):
    name = "sync"

    def after_step(self, engine) -> None:
        if not self.link.enabled or self.layout.nodes < 2:
            return
        # A ring allreduce over W learners runs 2 (W - 1) phases, each passing model_bytes / W along every
        # link of the ring; `nodes` of those links cross a node boundary, and the slowest link sets the pace.
        w = self.layout.world_size
        per_link = 2 * (w - 1) / w * self.model_bytes
        time.sleep(self.link.transfer_seconds(per_link, messages=2 * (w - 1)))
        self.boundary_bytes += per_link * self.layout.nodes / w  # this learner's share of the crossing bytes
