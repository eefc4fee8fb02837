"""The gossip thread in one process, its peer simulated: the step never waits for a round's copy to the host,
and the last step before a stop reaches the peers."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from comm.gossip import GossipThread
from comm.staging import Staging


class EchoGossip(GossipThread):
    """A gossip thread whose peer answers at once with its weights plus one: no process group needed."""

    def _send_receive(self, r, peer, outgoing, incoming):
        incoming.copy_(outgoing + 1)


def test_the_step_never_waits_for_the_copy_to_the_host(monkeypatch):
    slow_s = 0.3
    to_host = Staging.to_host

    def slow_to_host(self):  # a slow device-to-host copy (the paper's model: 173 MB a round)
        time.sleep(slow_s)
        return to_host(self)

    monkeypatch.setattr(Staging, "to_host", slow_to_host)
    weights, lock = [torch.zeros(1000)], threading.Lock()
    thread = EchoGossip(weights, lambda r: 1, None, lock, period=0).start()
    waits, merges, end = [], 0, time.perf_counter() + 4 * slow_s
    while time.perf_counter() < end:  # the compute thread: an optimizer step under the lock, then the merge
        t0 = time.perf_counter()
        with lock:
            waits.append(time.perf_counter() - t0)
            weights[0].mul_(1.0)
        merges += thread.apply_pending()
        thread.step_done()
        time.sleep(0.002)
    thread.stop(thread.pause(), timeout=5)
    thread.apply_pending()
    assert thread.rounds_started >= 3 and merges >= 2  # the rounds ran, each through the slow copy
    assert max(waits) < slow_s / 4, f"the step waited {max(waits):.3f} s for the lock"  # was at least slow_s
    assert float(weights[0][0]) == pytest.approx(0.5 * thread.rounds_started)  # every round's delta merged


class SlowEchoGossip(EchoGossip):
    def _send_receive(self, r, peer, outgoing, incoming):
        time.sleep(0.2)
        super()._send_receive(r, peer, outgoing, incoming)


def test_a_step_after_the_last_round_started_gets_a_round_of_its_own():
    weights, lock = [torch.zeros(10)], threading.Lock()
    thread = SlowEchoGossip(weights, lambda r: 1, None, lock, period=1).start()
    weights[0].add_(1.0)
    thread.step_done()  # the first step lets the first round start ...
    deadline = time.monotonic() + 5
    while thread.rounds_started == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    for _ in range(2):  # ... and two more come while its exchange is in flight
        weights[0].add_(1.0)
        thread.step_done()
    last = thread.pause()
    assert last == 2, last  # was 1: the round started before those steps, and they reached no peer
    thread.stop(last, timeout=5)
    assert thread.rounds_started == last
