"""ADPSGD: asynchronous decentralized parallel SGD (Lian et al. 2018), as in Zhang et al. 2019.

Every learner keeps its own weights and steps on its own gradients: DeepSpeed is given a data-parallel group
of one learner (through `mpu`), so it reduces nothing (and its fp16 overflow check stays local: DESIGN.md
§9.5). Beside the compute thread a gossip thread keeps averaging the weights with one neighbour at a time
(comm/gossip.py), paired by a bipartite schedule (comm/topology.py). At the end of an epoch the learners stop
gossip at an agreed round and average their weights over the world: that consensus model is evaluated and
checkpointed, and every learner continues from it; gossip starts again with the next epoch's first step.

A learner that dies (comm.on_lost_learner = "continue", the default): its gossip partners' exchanges fail,
the heartbeat confirms it is gone (comm/health.py), and their rounds with it are skipped from then on; at the
epoch's end the survivors check in, agree on who is left, and run the consensus, the evaluation and the
checkpoint over a gloo group of themselves. Learner 0 cannot be lost: its process serves the rendezvous store.
"""

from __future__ import annotations

import math
import threading
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist

from comm.base import Strategy
from comm.distributed import collective_timeout, store
from comm.gossip import EXCHANGE_DTYPES, GossipStats, GossipThread, flatten
from comm.membership import Membership
from comm.staging import Staging
from comm.topology import PairingSchedule
from comm.weights import Weights


class ADPSGDStrategy(Strategy):
    name = "adpsgd"
    options = {
        **Strategy.options,
        "schedule": "ring",  # ring | exponential (comm/topology.py)
        "period": 1,  # optimizer steps between gossip rounds; 0 = continuously
        "exchange_dtype": "fp32",  # fp32 | bf16 | fp16: bf16/fp16 halve the bytes on the wire
        "on_lost_learner": "continue",  # continue: the others go on without it | stop: the run stops, naming it
        # shared: the learners deal one shuffle of the epoch's batches out as each asks for the next (every
        # utterance once an epoch, as under SYNC) | independent: each walks its own shuffle of all of them
        # (about a third of the utterances unseen in an epoch, others seen twice; DESIGN.md §9.9)
        "sampling": "shared",
    }
    choices = {"exchange_dtype": tuple(EXCHANGE_DTYPES), "on_lost_learner": ("continue", "stop"),
               "sampling": ("shared", "independent")}

    def __init__(self, layout, options, heartbeat=None, units: int | None = None):
        """units: what gossip pairs, the learners here (HYBRID: the nodes)."""
        super().__init__(layout, options, heartbeat)
        self.schedule = PairingSchedule(units or layout.world_size, self.conf["schedule"])
        if not isinstance(self.conf["period"], int) or self.conf["period"] < 0:
            raise ValueError(f"comm.period must be an integer >= 0, got {self.conf['period']!r}")
        # without a heartbeat (benchmarks, unit tests) nobody can tell a lost learner: every failure stops
        goes_on = self.conf["on_lost_learner"] == "continue" and heartbeat is not None
        self.members = Membership(layout.rank, layout.world_size, goes_on, self._lost_needed)
        self.gossips = True  # this learner runs a gossip thread (HYBRID: the node leaders only)
        self.lock = threading.Lock()
        self._thread: GossipThread | None = None
        self.weights: Weights | None = None  # what gossip mixes: the optimizer's (fp32 master) weights
        self.staging: Staging | None = None  # its buffers to the host and back, made once (comm/staging.py)
        self.rounds = 0
        self.stats = GossipStats()  # over the epochs' finished gossip threads
        self._epochs_ended = 0

    @property
    def data_parallel_size(self) -> int:
        return 1

    def gossip_ranks(self) -> list[int] | None:
        return list(range(self.layout.world_size))  # all learners gossip

    def _lost_needed(self) -> list[int]:
        return []  # any learner can be lost without stopping this one

    def attach(self, engine) -> None:
        super().attach(engine)
        self.weights = Weights(engine)
        # DeepSpeed broadcast inside a group of one: make every learner start from rank 0's weights (DESIGN.md §9.2)
        with torch.no_grad():
            for w in self.weights.masters:
                dist.broadcast(w.data, src=0)
        self.weights.publish()

    def batches(self, sampler, epoch: int, accumulation: int) -> Iterator[tuple[np.ndarray, float]]:
        """The learners take batches as they are ready for them and the epoch ends once they together have
        taken the training set: the store's add() is an atomic global counter, so a fast learner simply takes
        more batches than a slow one (DESIGN.md §9.9). They take whole optimizer steps (`accumulation` micro
        batches at a time), so no accumulation window straddles the epoch's end and its consensus. Which
        batches: comm.sampling."""
        take = self._dealt_batches if self.conf["sampling"] == "shared" else self._own_shuffle_batches
        return take(sampler, epoch, accumulation)

    def _dealt_batches(self, sampler, epoch: int, accumulation: int) -> Iterator[tuple[np.ndarray, float]]:
        """The next step's batches of the epoch's one shuffle (the same list on every learner) by the global
        count of steps taken; the last micro batches that make no whole step are left out, as SYNC's are."""
        counter, batches = store("batches/"), sampler.whole().epoch_batches(epoch)
        steps, key = len(batches) // accumulation, f"epoch-{epoch}-steps"
        while (taken := counter.add(key, 1)) <= steps:
            for i in range((taken - 1) * accumulation, taken * accumulation):
                yield batches[i], (i + 1) / (steps * accumulation)

    def _own_shuffle_batches(self, sampler, epoch: int, accumulation: int) -> Iterator[tuple[np.ndarray, float]]:
        """Whole steps of this learner's own shuffle of all the batches, until the learners together have taken
        as many utterances as the training set has."""
        counter, total = store("batches/"), len(sampler.lengths)
        key = f"epoch-{epoch}-utterances"
        while True:
            batches = sampler.learner_shuffle(self.layout.rank).epoch_batches(epoch)
            for start in range(0, len(batches) - accumulation + 1, accumulation):
                window = batches[start: start + accumulation]
                size = sum(len(b) for b in window)
                taken = counter.add(key, size)
                done = taken - size
                if done >= total:
                    return
                for batch in window:
                    done += len(batch)
                    yield batch, min(1.0, done / total)

    def _peer(self, round_: int) -> int:
        return self.schedule.peer(self.layout.rank, round_)

    def _start_gossip(self) -> None:
        local = self.layout.local_size
        self.staging = self.staging or Staging(self.weights.masters)
        self._thread = GossipThread(self.weights.masters, self._peer, self.groups.gossip, self.lock,
                                    self.conf["period"], self.conf["exchange_dtype"], first_round=self.rounds,
                                    link=self.link,
                                    crosses_boundary=lambda peer: peer // local != self.layout.node_rank,
                                    lost_peers=set(self.members.lost),
                                    confirm_lost=self._confirm_lost if self.members.goes_on else None,
                                    watch_peer=self._watch_peer if self.members.goes_on else None,
                                    staging=self.staging).start()

    def _confirm_lost(self, peer: int) -> bool:
        return self.heartbeat.confirm_lost(peer, self.conf["lost_after_s"])

    def _watch_peer(self, peer: int):
        return self.heartbeat.watch_peer(peer, self.conf["lost_after_s"])

    def _check_in(self) -> None:
        """At an epoch's end, before its collectives: agree on the learners still running (comm/health.py)
        and, when one was lost, run the collectives from now on over the survivors alone."""
        self._epochs_ended += 1
        if self.members.goes_on:
            tag = f"epoch-end-{self._epochs_ended}"
            self.members.narrow(self.heartbeat.check_in(tag, self.conf["lost_after_s"]), tag)

    def step_lock(self):
        return self.lock

    def after_step(self, engine) -> None:
        if self.gossips and self._thread is None:  # started by an epoch's first step: nothing moved the weights
            self._start_gossip()
        self._merge()
        if self._thread is not None:
            self._thread.step_done()

    def _merge(self) -> None:
        """Add what the gossip thread received to the weights; at a step boundary or once it has stopped."""
        if self._thread.apply_pending():
            self.weights.publish()

    def _stop_gossip(self, epoch_end: bool = False) -> None:
        """Agree on the last round over the learners still running and let every gossip thread run to it
        (collective); at an epoch's end the learners first check in."""
        if self.gossips and self._thread is None:  # no step this epoch (a slow learner): it still owes rounds
            self._start_gossip()
        started = self._thread.pause() if self._thread is not None else self.rounds
        if epoch_end:
            self._check_in()
        last = int(self.members.reduce(torch.tensor([started], dtype=torch.int64), op=dist.ReduceOp.MAX))
        if self._thread is not None:  # every round's peer answers or is found gone: a bound, never a hang
            self._thread.stop(last, timeout=collective_timeout().total_seconds())
        self._merge()
        self.rounds = last
        if self._thread is not None:
            self.stats += self._thread.stats
            self.boundary_bytes = self.stats.boundary_bytes
            self._thread = None

    def state_dict(self) -> dict:
        """The rounds run so far (agreed by all learners at each epoch's end): a resumed run goes on with the
        next round of the pairing schedule, as the uninterrupted one would have, and its log counts on."""
        return {"rounds": self.rounds}

    def load_state_dict(self, state: dict) -> None:
        self.rounds = state.get("rounds", 0)  # absent from checkpoints before stop 24

    def end_epoch(self, engine) -> dict:
        """Stop gossip, average the weights over the learners still running; -> the consensus distance
        before averaging, and who was lost."""
        self._stop_gossip(epoch_end=True)
        live = len(self.members.live)
        with torch.no_grad():
            flat = flatten(self.weights.masters, torch.float64)
            mean = self.members.reduce(flat.clone()).cpu() / live
            if not torch.isfinite(mean).all():  # every learner sees it: they all ask who, then stop
                own = [float(r == self.layout.rank and not torch.isfinite(flat).all())
                       for r in range(self.layout.world_size)]
                bad = [r for r, n in enumerate(self.members.sum(own)) if n]
                raise FloatingPointError(f"learner(s) {bad} hold non-finite weights at the end of epoch "
                                         f"{self._epochs_ended}: their average would be too; lower optim.lr")
            # relative distance of this learner from the mean; averaged over learners below
            distance = ((flat - mean).norm() / mean.norm().clamp(min=1e-12)) ** 2
            # [sum of squared distances, merges skipped, rounds skipped (paired with a lost learner)]
            summed = self.members.sum([float(distance), self.stats.merges_skipped, self.stats.rounds_skipped])
            offset = 0
            for w in self.weights.masters:
                w.copy_(mean[offset: offset + w.numel()].view_as(w).to(w.dtype))
                offset += w.numel()
        self.weights.publish()
        lost = self.members.lost
        return {"consensus_distance": math.sqrt(summed[0]) / math.sqrt(live),
                "gossip_merges_skipped": int(summed[1]), **({"lost_learners": lost} if lost else {}),
                "gossip_rounds_skipped": int(summed[2]),
                "gossip_rounds": self.rounds, "gossip_bytes_sent": self.stats.bytes_sent,
                "gossip_exchange_s": self.stats.exchange_seconds, **super().end_epoch(engine)}

    def close(self) -> None:
        self._stop_gossip()
