"""Which learner was lost: a heartbeat per learner in the rendezvous store, read when a collective fails.

When a learner dies, gloo fails the collectives that were exchanging data with it at once ("Connection reset
by peer"), and NCCL or a hung learner fail them after the process-group timeout (train.collective_timeout_s);
neither says which learner is gone. Every learner therefore stamps a counter in the default store a few times
a second. The first learner whose collective fails looks for the counters that stopped moving and publishes
the answer in the store; the others read it there.

A survivor can be left waiting in a collective on another survivor that has already given up (a ring
allreduce waits on its neighbour, not on the dead learner), until the timeout. Its heartbeat thread sees the
published answer and, after a short grace, ends the process with the same message. The store is served by
learner 0's process: when it cannot be reached, learner 0 is the one lost; while alive, learner 0 stays up
(at most `linger_s`) until every survivor has its answer.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from typing import Callable

import torch.distributed as dist

LOST_KEY, ANSWERED_KEY = "heartbeat/lost", "heartbeat/answered"


class LearnerLost(RuntimeError):
    pass


class Heartbeat:
    def __init__(self, rank: int, world_size: int, interval_s: float = 0.25, grace_s: float = 5.0,
                 linger_s: float = 30.0):
        self.rank, self.world_size = rank, world_size
        self.interval_s, self.grace_s, self.linger_s = interval_s, grace_s, linger_s
        self.store = dist.distributed_c10d._get_default_store()
        self._where: Callable[[], str] = lambda: f"on learner {rank}"
        self._diagnosing = threading.Event()  # the main thread is on it: the watchdog stands aside
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        beats, lost_seen_at = 0, None
        while not self._stop.wait(self.interval_s):
            try:
                self.store.set(f"heartbeat/{self.rank}", str(beats))
                beats += 1
                if lost_seen_at is None and self.store.check([LOST_KEY]):
                    lost_seen_at = time.monotonic()
            except Exception:  # the store went away with learner 0; a collective on it fails by itself
                return
            if lost_seen_at is not None and time.monotonic() - lost_seen_at > self.grace_s:
                if not self._diagnosing.is_set():  # stuck in a collective on a survivor that gave up
                    print(f"LearnerLost: {self._message(self._read_lost(), 'while waiting in a collective')}",
                          file=sys.stderr, flush=True)
                    with contextlib.suppress(Exception):
                        self.store.add(ANSWERED_KEY, 1)
                    os._exit(1)

    def _beats(self) -> list[bytes | None]:
        keys = [f"heartbeat/{r}" for r in range(self.world_size)]
        return [self.store.get(k) if self.store.check([k]) else None for k in keys]

    def _read_lost(self) -> list[int]:
        return json.loads(self.store.get(LOST_KEY))

    def _message(self, lost: list[int], failure: str) -> str:
        return f"lost learner(s) {lost} of {self.world_size}, found {self._where()}; {failure}"

    def lost_learners(self) -> list[int]:
        """The learners whose heartbeat stood still for three intervals (or the answer another learner already
        published), asked after a failed collective. The caller raises either way, so a SIGTERM meanwhile (the
        launcher stopping everyone) is ignored until then: the answer gets printed."""
        self._diagnosing.set()
        in_main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN) if in_main else None
        try:
            if self.store.check([LOST_KEY]):
                lost = self._read_lost()
            else:
                before = self._beats()
                time.sleep(3 * self.interval_s)
                after = self._beats()
                lost = [r for r in range(self.world_size) if r != self.rank and before[r] == after[r]]
                if lost:
                    self.store.set(LOST_KEY, json.dumps(lost))
            answered = self.store.add(ANSWERED_KEY, 1)
            deadline = time.monotonic() + self.linger_s
            while self.rank == 0 and lost and answered < self.world_size - len(lost) and time.monotonic() < deadline:
                time.sleep(self.interval_s)  # the store lives in this process: keep it up for the others
                answered = self.store.add(ANSWERED_KEY, 0)
            return lost
        except Exception:  # the store is gone, and learner 0's process with it
            return [0]
        finally:
            if in_main:
                signal.signal(signal.SIGTERM, previous)

    @contextlib.contextmanager
    def watch(self, where: Callable[[], str]):
        """Turn a failed collective inside the block into a LearnerLost that names the learners that are gone
        and says where the run stood (where() -> text); other errors pass through unchanged."""
        self._where = where
        try:
            yield
        except RuntimeError as err:
            lost = self.lost_learners()
            if not lost:
                raise
            raise LearnerLost(self._message(lost, f"the failed call said: {str(err).splitlines()[0]}")) from err

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
