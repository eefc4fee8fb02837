"""The gossip thread: averages this learner's weights with one peer per round, beside the compute thread.

One round: take a snapshot of the weights (only its device-side copy under the step lock, so never half an
optimizer step, and the copy to the host outside it: comm/staging.py), exchange snapshots with the round's peer
over a gloo group of its own (never a second NCCL communicator beside DeepSpeed's: DESIGN.md §9.6), and hand
the compute thread  delta = (w_peer - w_snapshot) / 2 , which it adds at its next step boundary
(apply_pending). The merge cannot happen at any other time: forward and backward hold references to the
weights, and autograd rejects weights changed in place under it. Adding the difference rather than overwriting
keeps every optimizer step taken while the exchange was in flight (DESIGN.md §9.7); the two sides of an exchange
add opposite deltas, so the sum of all weights is preserved exactly.

Stopping (DESIGN.md §9.8): every thread runs rounds 0, 1, 2, ... in order and its peer in a round is fixed by the
schedule, so two threads never wait on each other across different rounds. To stop, the learners pause
(no new round starts), agree on R = the largest number of rounds any of them has started, and every thread
runs on to exactly R rounds. Each exchange then has its partner, whoever was fast or slow.

Every message is preceded by a header (round, sender, length) that the receiver checks against what it
expects: a peer in another round or with another model is a GossipProtocolError, never a silent merge of the
wrong weights.

A lost peer (ADPSGD with comm.on_lost_learner = "continue"): an exchange that fails asks `confirm_lost(peer)`
(comm/health.py); a peer confirmed lost joins `lost_peers`, and every round paired with it is skipped from
then on: no exchange, no merge. The survivors' weights still sum to what they did.
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass, fields
from typing import Callable

import torch
import torch.distributed as dist

from comm.link import EmulatedLink
from comm.staging import Staging

EXCHANGE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class GossipProtocolError(RuntimeError):
    pass


class PeerGone(Exception):
    """The peer of a waiting exchange is gone (its heartbeat stood still): the round is skipped."""


@dataclass
class GossipStats:
    """What a learner's gossip did; adds up over threads (one per epoch)."""

    bytes_sent: int = 0
    exchange_seconds: float = 0.0
    boundary_bytes: int = 0  # sent across a node boundary (counted with an emulated link only)
    merges_skipped: int = 0  # peer weights that were not finite, never merged
    rounds_skipped: int = 0  # paired with a lost peer

    def __iadd__(self, other: "GossipStats") -> "GossipStats":
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self


def _watched(exchange: Callable[[], None], gone: Callable[[], bool] | None, peer: int,
             check_every_s: float = 0.5) -> None:
    """Run an exchange, asking gone() now and then whether the peer is still there. A blocked gloo wait cannot
    be interrupted, so the exchange runs in a thread of its own, left behind (blocked on a peer dropped for
    good, whose pair is never used again) when the peer is gone."""
    if gone is None:
        exchange()
        return
    failed: list[BaseException] = []

    def run() -> None:
        try:
            exchange()
        except BaseException as err:  # raised below, on the gossip thread
            failed.append(err)

    thread = threading.Thread(target=run, name="gossip-exchange", daemon=True)
    thread.start()
    while True:
        thread.join(check_every_s)
        if not thread.is_alive():
            break
        if gone():
            raise PeerGone(peer)
    if failed:
        raise failed[0]


def flatten(params: list[torch.Tensor], dtype=torch.float32) -> torch.Tensor:
    """A CPU copy of all params as one vector."""
    return torch.cat([p.detach().reshape(-1).to("cpu", dtype) for p in params])


class GossipThread:
    def __init__(self, params: list[torch.Tensor], peer_of_round: Callable[[int], int], group,
                 step_lock: threading.Lock, period: int = 1, exchange_dtype: str = "fp32", first_round: int = 0,
                 link: EmulatedLink | None = None, crosses_boundary: Callable[[int], bool] = lambda peer: True,
                 lost_peers: set[int] | None = None, confirm_lost: Callable[[int], bool] | None = None,
                 watch_peer: Callable[[int], Callable[[], bool]] | None = None, staging: Staging | None = None):
        """peer_of_round(r) -> the global rank to exchange with in round r. period: optimizer steps between
        the starts of two rounds; 0 = back to back, continuously. link: an emulated inter-node link; an
        exchange with a peer for which crosses_boundary(peer) is true lasts at least as long as on it.
        lost_peers: peers known to be gone (their rounds are skipped); confirm_lost(peer), after an exchange
        failed: True if the peer is gone for good, so the run goes on without it (None: every failure is
        an error). watch_peer(peer) -> gone(), asked while an exchange waits on the peer: True once it is gone
        (a frozen or unreachable peer fails nothing; without it the wait lasts the group's whole timeout).
        staging: the buffers between the weights and the host (comm/staging.py), kept by the strategy from one
        epoch's thread to the next (None: new ones)."""
        self.params = params
        self.peer_of_round = peer_of_round
        self.group = group
        self.step_lock = step_lock
        self.period = period
        self.dtype = EXCHANGE_DTYPES[exchange_dtype]
        self.rounds_started = first_round
        self.stats = GossipStats()
        self.link = link or EmulatedLink({})
        self.crosses_boundary = crosses_boundary
        self.lost_peers = set(lost_peers or ())
        self.confirm_lost = confirm_lost
        self.watch_peer = watch_peer
        self.staging = staging or Staging(params)
        self._steps = 0
        self._pending: torch.Tensor | None = None  # received, not yet added to the weights
        self._taken = False  # handed to the compute thread, added by the time it calls step_done()
        self._stop_at: int | None = None
        self._paused = False
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gossip", daemon=True)

    @functools.cached_property
    def rank(self) -> int:
        """The sender this learner's headers name (read at the first exchange: tests fake the exchange)."""
        return dist.get_rank()

    def start(self) -> "GossipThread":
        self._thread.start()
        return self

    def step_done(self) -> None:
        """Called by the compute thread after every optimizer step and after adding what take_pending() gave:
        paces the rounds. A failed exchange surfaces here, at the next step, not at the epoch's end."""
        if self._error is not None:
            raise RuntimeError(f"gossip thread failed: {self._error!r}") from self._error
        with self._cond:
            self._steps += 1
            self._taken = False
            self._cond.notify()

    def take_pending(self) -> torch.Tensor | None:
        """The received deltas not yet merged (flat fp32), or None. The next round starts only after the next
        step_done(), so its snapshot never misses a delta taken but not yet added."""
        with self._cond:
            delta, self._pending = self._pending, None
            self._taken = self._taken or delta is not None
        return delta

    def apply_pending(self) -> bool:
        """Add the received deltas to the weights; only the compute thread calls this, between steps.
        -> whether there were any."""
        delta = self.take_pending()
        if delta is not None:
            with self.step_lock:
                self.staging.add(delta)
        return delta is not None

    def _next_round(self) -> int | None:
        """Block until the next round may start; None when the agreed last round is done."""
        with self._cond:
            while True:
                r = self.rounds_started
                if self._stop_at is not None:
                    if r >= self._stop_at:
                        return None
                    break
                merged = self._pending is None and not self._taken  # one exchange at a time, on fresh weights
                if not self._paused and merged and (self.period == 0 or self._steps >= self.period):
                    self._steps = 0
                    break
                self._cond.wait()
            self.rounds_started = r + 1
            return r

    def _run(self) -> None:
        try:
            while (r := self._next_round()) is not None:
                peer = self.peer_of_round(r)
                if peer not in self.lost_peers:
                    self._exchange(r, peer)
                if peer in self.lost_peers:  # known lost before the round, or found lost by its exchange
                    self.stats.rounds_skipped += 1
        except BaseException as err:  # reported by stop() on the compute thread
            self._error = err

    def _exchange(self, r: int, peer: int) -> None:
        t0 = time.perf_counter()
        with self.step_lock:  # only a device-side copy: the step never waits for a transfer
            self.staging.capture()
        snapshot = self.staging.to_host()  # reused round after round: a scratch buffer until the next capture
        with self._cond:  # only this thread sets _pending, and a round starts with it None unless stopping:
            pending = self._pending
        if pending is not None:  # while stopping, rounds run on before the compute thread merges: exchange
            snapshot += pending  # the weights as they will be, not as they were
        outgoing = snapshot.to(self.dtype)
        incoming = torch.empty_like(outgoing)
        try:
            gone = self.watch_peer(peer) if self.watch_peer is not None else None
            _watched(lambda: self._send_receive(r, peer, outgoing, incoming), gone, peer)
        except GossipProtocolError:
            raise
        except PeerGone:  # frozen or unreachable: its heartbeat stood still
            self.lost_peers.add(peer)
            return
        except RuntimeError:  # gloo fails the exchange at once when the peer's process is gone
            if self.confirm_lost is None or not self.confirm_lost(peer):
                raise
            self.lost_peers.add(peer)
            return
        nbytes = outgoing.numel() * outgoing.element_size()
        self.stats.bytes_sent += nbytes
        if self.link.enabled and self.crosses_boundary(peer):
            self.link.wait_out(t0, nbytes)  # both directions at once: one message's worth of time
            self.stats.boundary_bytes += nbytes
        if self.dtype != torch.float32:
            # both sides take the difference of the same two rounded vectors, so the deltas stay opposite
            # and the sum of the weights is still preserved exactly
            snapshot = outgoing.to(torch.float32)
        incoming = incoming.to(torch.float32)
        # either side's weights not finite (diverged, or beyond fp16's 65504 on the wire): both sides skip alike
        if not (torch.isfinite(incoming).all() and torch.isfinite(snapshot).all()):
            self.stats.merges_skipped += 1
        else:
            delta = self.staging.pinned((incoming - snapshot).mul_(0.5))
            with self._cond:  # while stopping, rounds run on without the compute thread: deltas add up
                self._pending = delta if self._pending is None else self._pending.add_(delta)
        self.stats.exchange_seconds += time.perf_counter() - t0

    def _send_receive(self, r: int, peer: int, outgoing: torch.Tensor, incoming: torch.Tensor) -> None:
        header = torch.tensor([r, self.rank, outgoing.numel()])
        peer_header = torch.empty_like(header)
        sent_header = dist.isend(header, peer, group=self.group)
        dist.irecv(peer_header, peer, group=self.group).wait()
        if peer_header.tolist() != [r, peer, outgoing.numel()]:
            got_round, got_sender, got_length = peer_header.tolist()
            raise GossipProtocolError(
                f"learner {self.rank}, round {r}: expected {outgoing.numel()} weights from learner {peer}, "
                f"got a header for round {got_round} from learner {got_sender} with {got_length} weights")
        requests = [sent_header, dist.isend(outgoing, peer, group=self.group),
                    dist.irecv(incoming, peer, group=self.group)]
        for req in requests:
            req.wait()

    def pause(self) -> int:
        """No new round starts after this; -> the rounds this thread needs (to agree on the last one): those
        started so far, and one more when a step came after the last one started. Without it that step's
        update reached no peer (the last snapshot missed it, or the compute thread paused before this thread
        started the round the step allowed), and the learner ended the epoch half a step from the others."""
        with self._cond:
            self._paused = True
            return self.rounds_started + (1 if self._steps > 0 else 0)

    def stop(self, last_round: int, timeout: float | None = None) -> None:
        """Run on to exactly `last_round` rounds (agreed by all learners) and end the thread; what arrived is
        then pending, for the strategy to merge (take_pending / apply_pending)."""
        with self._cond:
            self._stop_at = last_round
            self._cond.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"gossip thread did not finish round {last_round} in {timeout} s")
        if self._error is not None:
            raise RuntimeError(f"gossip thread failed: {self._error!r}") from self._error
