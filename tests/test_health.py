"""The heartbeat on its own, over a real rendezvous store on loopback: it rides out store errors, and a learner
the others dropped leaves the run cleanly."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

import comm.distributed
from comm.health import DROPPED, Heartbeat, LeftBehind
from tests.conftest import free_port


class FlakyStore:
    """A store whose next `failures` set() calls fail, as during a network hiccup; the rest passes through."""

    def __init__(self, store, failures: int):
        self.store, self.failures = store, failures

    def set(self, key, value):
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("connection reset by peer")
        return self.store.set(key, value)

    def __getattr__(self, name):
        return getattr(self.store, name)


@pytest.fixture
def heartbeat(monkeypatch):
    monkeypatch.setattr(comm.distributed, "_store", dist.TCPStore("127.0.0.1", free_port(), 1, True))
    hb = Heartbeat(0, 2, interval_s=0.05, grace_s=2.0)
    yield hb
    hb.close()


def wait_for(condition, timeout: float = 20.0) -> bool:
    """Poll until condition() (a loaded machine runs the heartbeat thread late, not never)."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_the_heartbeat_rides_out_store_errors(heartbeat):
    heartbeat.store = FlakyStore(heartbeat.store, failures=10)  # half a second of errors at 0.05 s a beat
    assert wait_for(lambda: heartbeat.store.failures == 0 and heartbeat.store.check(["heartbeat/0"]))
    beat = int(heartbeat.store.get("heartbeat/0"))
    # still beating after them (it gives up only after grace_s of errors): the others do not take it for lost
    assert wait_for(lambda: int(heartbeat.store.get("heartbeat/0")) > beat + 2)


def test_a_learner_the_others_dropped_leaves_cleanly(heartbeat):
    heartbeat.store.compare_set("members/epoch-end-1/0", "", DROPPED)  # as the others do when it stood still
    with pytest.raises(LeftBehind, match="reached epoch-end-1 after the others had dropped it"):
        heartbeat.check_in("epoch-end-1", stall_s=5.0)


def test_a_learner_dropped_mid_epoch_leaves_even_if_it_checks_in_first(heartbeat):
    heartbeat.store.set("dropped/0", "by 1")  # a gossip peer found it standing still and dropped it
    with pytest.raises(LeftBehind, match="after the others had dropped it"):
        heartbeat.check_in("epoch-end-2", stall_s=5.0)
