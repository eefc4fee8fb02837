"""ADPSGD: asynchronous decentralized parallel SGD (Lian et al. 2018), as in Zhang et al. 2019.

Every learner keeps its own weights and steps on its own gradients: DeepSpeed is given a data-parallel group
of one learner (through `mpu`), so it reduces nothing (and its fp16 overflow check stays local: DESIGN.md
trap 5). Beside the compute thread a gossip thread keeps averaging the weights with one neighbour at a time
(comm/gossip.py), paired by a bipartite schedule (comm/topology.py). At the end of an epoch the learners stop
gossip at an agreed round and average their weights over the world: that consensus model is evaluated and
checkpointed, and every learner continues from it; gossip starts again with the next epoch's first step.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from comm.base import Strategy, collective_device
from comm.gossip import EXCHANGE_DTYPES, GossipThread, flatten
from comm.topology import PairingSchedule


class GroupMPU:
    """What DeepSpeed's `mpu` argument needs. Data-parallel groups of `unit` consecutive ranks (1: every
    learner alone, ADPSGD; the learners of a node, HYBRID); the model-parallel group is the learner alone."""

    def __init__(self, layout, unit: int):
        # new_group is collective: every learner creates every group, in the same order
        singles = [dist.new_group([r]) for r in range(layout.world_size)]
        units = singles if unit == 1 else [dist.new_group(list(range(u * unit, (u + 1) * unit)))
                                           for u in range(layout.world_size // unit)]
        self.model_group = singles[layout.rank]
        self.data_group = units[layout.rank // unit]
        self.data_rank, self.data_size = layout.rank % unit, unit

    def get_data_parallel_group(self):
        return self.data_group

    def get_data_parallel_rank(self) -> int:
        return self.data_rank

    def get_data_parallel_world_size(self) -> int:
        return self.data_size

    def get_model_parallel_group(self):
        return self.model_group

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1


class ADPSGDStrategy(Strategy):
    name = "adpsgd"
    options = {
        **Strategy.options,
        "schedule": "ring",  # ring | exponential (comm/topology.py)
        "period": 1,  # optimizer steps between gossip rounds; 0 = continuously
        "exchange_dtype": "fp32",  # fp32 | bf16 | fp16: bf16/fp16 halve the bytes on the wire
    }
    independent_sampling = True

    def __init__(self, layout, options, units: int | None = None):
        """units: what gossip pairs, the learners here (HYBRID: the nodes)."""
        super().__init__(layout, options)
        self.schedule = PairingSchedule(units or layout.world_size, self.conf["schedule"])
        if self.conf["exchange_dtype"] not in EXCHANGE_DTYPES:
            raise ValueError(f"comm.exchange_dtype={self.conf['exchange_dtype']!r}; "
                             f"valid: {', '.join(EXCHANGE_DTYPES)}")
        if not isinstance(self.conf["period"], int) or self.conf["period"] < 0:
            raise ValueError(f"comm.period must be an integer >= 0, got {self.conf['period']!r}")
        self.step_lock = threading.Lock()
        self._mpu = None
        self._group = None
        self._thread: GossipThread | None = None
        self._params: list[torch.Tensor] = []
        self.rounds = 0
        self.bytes_sent = 0
        self.exchange_seconds = 0.0
        self.merges_skipped = 0  # peer weights that were not finite, never merged

    @property
    def data_parallel_size(self) -> int:
        return 1

    def mpu(self):
        if self._mpu is None:
            self._mpu = GroupMPU(self.layout, self.data_parallel_size)
        return self._mpu

    def attach(self, engine) -> None:
        super().attach(engine)
        self._params = [p for p in engine.module.parameters()]
        # DeepSpeed broadcast inside a group of one: make every learner start from rank 0's weights (trap 2)
        with torch.no_grad():
            for p in self._params:
                dist.broadcast(p.data, src=0)
        # gossip's own communicator (trap 6); new_group is collective, so every learner creates it
        self._group = dist.new_group(ranks=self._gossip_ranks(), backend="gloo")

    def _gossip_ranks(self) -> list[int] | None:
        return None  # all learners gossip

    def _peer(self, round_: int) -> int:
        return self.schedule.peer(self.layout.rank, round_)

    def _start_gossip(self) -> None:
        local = self.layout.local_size
        self._thread = GossipThread(self._params, self._peer, self._group, self.step_lock, self.conf["period"],
                                    self.conf["exchange_dtype"], first_round=self.rounds, link=self.link,
                                    crosses_boundary=lambda peer: peer // local != self.layout.node_rank).start()

    def step_lock_context(self):
        return self.step_lock

    def after_step(self, engine) -> None:
        if self._thread is None:  # started by the first step of an epoch: nothing moves the weights in between
            self._start_gossip()
        self._merge()
        self._thread.step_done()

    def _merge(self) -> None:
        """Add what the gossip thread received to the weights; at a step boundary or once it has stopped."""
        self._thread.apply_pending()

    def _stop_gossip(self) -> None:
        """Agree on the last round over the world and let every gossip thread run to it (collective)."""
        if self._thread is None:  # no step this epoch (a very slow learner): it still owes its peers rounds
            self._start_gossip()
        started = torch.tensor([self._thread.pause()], dtype=torch.int64, device=collective_device())
        dist.all_reduce(started, op=dist.ReduceOp.MAX)
        self._thread.stop(int(started))
        self._merge()
        self.rounds = int(started)
        self.bytes_sent += self._thread.bytes_sent
        self.exchange_seconds += self._thread.exchange_seconds
        self.boundary_bytes += self._thread.boundary_bytes
        self.merges_skipped += self._thread.merges_skipped
        self._thread = None

    def end_epoch(self, engine) -> dict:
        """Stop gossip, average the weights over the world; -> the consensus distance before averaging."""
        self._stop_gossip()
        with torch.no_grad():
            device = collective_device()
            flat = flatten(self._params, torch.float64).to(device)
            mean = flat.clone()
            dist.all_reduce(mean)
            mean /= self.layout.world_size
            # relative distance of this learner from the mean; averaged over learners below
            stats = ((flat - mean).norm() / mean.norm().clamp(min=1e-12)) ** 2
            stats = torch.stack([stats, torch.tensor(float(self.merges_skipped), dtype=stats.dtype, device=device)])
            dist.all_reduce(stats)  # [sum of squared distances, merges skipped by all learners]
            offset = 0
            for p in self._params:
                p.copy_(mean[offset: offset + p.numel()].view_as(p).to(p.dtype))
                offset += p.numel()
        return {"consensus_distance": float(stats[0].sqrt()) / self.layout.world_size ** 0.5,
                "gossip_merges_skipped": int(stats[1]),
                "gossip_rounds": self.rounds, "gossip_bytes_sent": self.bytes_sent,
                "gossip_exchange_s": self.exchange_seconds, **super().end_epoch(engine)}

    def close(self) -> None:
        self._stop_gossip()
