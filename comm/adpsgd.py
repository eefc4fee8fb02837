"""ADPSGD: asynchronous decentralized parallel SGD (Lian et al. 2018), as in Zhang et al. 2019.

Every learner keeps its own weights and steps on its own gradients: DeepSpeed is given a data-parallel group
of one learner (through `mpu`), so it reduces nothing (and its fp16 overflow check stays local: DESIGN.md
trap 5). Beside the compute thread a gossip thread keeps averaging the weights with one neighbour at a time
(comm/gossip.py), paired by a bipartite schedule (comm/topology.py). At the end of an epoch the learners stop
gossip at an agreed round and average their weights over the world: that consensus model is evaluated and
checkpointed, and every learner continues from it; gossip starts again with the next epoch's first step.

A learner that dies (comm.on_lost_learner = "continue", the default): its gossip partners' exchanges fail,
the heartbeat confirms it is gone (comm/health.py), and their rounds with it are skipped from then on; at the
epoch's end the survivors check in, agree on who is left, and run the consensus, the evaluation and the
checkpoint over a gloo group of themselves. Learner 0 cannot be lost: its process serves the rendezvous store.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from comm.base import LiveGroup, Strategy
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
        "on_lost_learner": "continue",  # continue: the others go on without it | stop: the run stops, naming it
        "lost_after_s": 5.0,  # a learner whose heartbeat stands still this long is gone
    }
    ON_LOST_LEARNER = ("continue", "stop")
    independent_sampling = True

    def __init__(self, layout, options, heartbeat=None, units: int | None = None):
        """units: what gossip pairs, the learners here (HYBRID: the nodes)."""
        super().__init__(layout, options, heartbeat)
        self.schedule = PairingSchedule(units or layout.world_size, self.conf["schedule"])
        if self.conf["exchange_dtype"] not in EXCHANGE_DTYPES:
            raise ValueError(f"comm.exchange_dtype={self.conf['exchange_dtype']!r}; "
                             f"valid: {', '.join(EXCHANGE_DTYPES)}")
        if not isinstance(self.conf["period"], int) or self.conf["period"] < 0:
            raise ValueError(f"comm.period must be an integer >= 0, got {self.conf['period']!r}")
        if self.conf["on_lost_learner"] not in self.ON_LOST_LEARNER:
            raise ValueError(f"comm.on_lost_learner={self.conf['on_lost_learner']!r}; "
                             f"valid: {', '.join(self.ON_LOST_LEARNER)}")
        # without a heartbeat (benchmarks, unit tests) nobody can tell a lost learner: every failure stops
        self.goes_on = self.conf["on_lost_learner"] == "continue" and heartbeat is not None
        self.step_lock = threading.Lock()
        self._mpu = None
        self._group = None
        self._thread: GossipThread | None = None
        self._params: list[torch.Tensor] = []
        self.rounds = 0
        self.bytes_sent = 0
        self.exchange_seconds = 0.0
        self.merges_skipped = 0  # peer weights that were not finite, never merged
        self.rounds_skipped = 0  # paired with a lost learner
        self._epochs_ended = 0

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
                                    crosses_boundary=lambda peer: peer // local != self.layout.node_rank,
                                    lost_peers=set(range(self.layout.world_size)) - set(self.live),
                                    confirm_lost=self._confirm_lost if self.goes_on else None).start()

    def _confirm_lost(self, peer: int) -> bool:
        return self.heartbeat.confirm_lost(peer, self.conf["lost_after_s"])

    def _check_in(self) -> None:
        """At an epoch's end, before its collectives: agree on the learners still running (comm/health.py)
        and, when one was lost, run the collectives from now on over a gloo group of the survivors."""
        self._epochs_ended += 1
        if not self.goes_on:
            return
        tag = f"epoch-end-{self._epochs_ended}"
        live = self.heartbeat.check_in(tag, self.conf["lost_after_s"])
        if live != self.live:  # a group of the survivors alone: the lost learners are not waited for
            self.live, self.live_group = live, LiveGroup(live, self.layout.rank, tag)

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

    def _stop_gossip(self, epoch_end: bool = False) -> None:
        """Agree on the last round over the learners still running and let every gossip thread run to it
        (collective); at an epoch's end the learners first check in."""
        if self._thread is None:  # no step this epoch (a very slow learner): it still owes its peers rounds
            self._start_gossip()
        started = self._thread.pause()
        if epoch_end:
            self._check_in()
        started = self.reduce_live(torch.tensor([started], dtype=torch.int64), op=dist.ReduceOp.MAX)
        self._thread.stop(int(started))
        self._merge()
        self.rounds = int(started)
        self.bytes_sent += self._thread.bytes_sent
        self.exchange_seconds += self._thread.exchange_seconds
        self.boundary_bytes += self._thread.boundary_bytes
        self.merges_skipped += self._thread.merges_skipped
        self.rounds_skipped += self._thread.rounds_skipped
        self._thread = None

    def end_epoch(self, engine) -> dict:
        """Stop gossip, average the weights over the learners still running; -> the consensus distance
        before averaging, and who was lost."""
        self._stop_gossip(epoch_end=True)
        with torch.no_grad():
            flat = flatten(self._params, torch.float64)
            mean = self.reduce_live(flat.clone()).cpu() / len(self.live)
            # relative distance of this learner from the mean; averaged over learners below
            distance = ((flat - mean).norm() / mean.norm().clamp(min=1e-12)) ** 2
            # [sum of squared distances, merges skipped, rounds skipped (paired with a lost learner)]
            stats = self.reduce_live(torch.tensor([float(distance), self.merges_skipped, self.rounds_skipped],
                                                  dtype=torch.float64))
            offset = 0
            for p in self._params:
                p.copy_(mean[offset: offset + p.numel()].view_as(p).to(p.dtype))
                offset += p.numel()
        lost = sorted(set(range(self.layout.world_size)) - set(self.live))
        return {"consensus_distance": float(stats[0].sqrt()) / len(self.live) ** 0.5,
                "gossip_merges_skipped": int(stats[1]), **({"lost_learners": lost} if lost else {}),
                "gossip_rounds_skipped": int(stats[2]),
                "gossip_rounds": self.rounds, "gossip_bytes_sent": self.bytes_sent,
                "gossip_exchange_s": self.exchange_seconds, **super().end_epoch(engine)}

    def close(self) -> None:
        self._stop_gossip()
