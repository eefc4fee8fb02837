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

ADPSGD can go on without a lost learner (comm.on_lost_learner = "continue"). Then nothing above is used:
a gossip exchange that fails asks `confirm_lost(peer)` (the peer's heartbeat stood still for `stall_s`: it is
marked dropped, for good, in the store), and at every epoch's end the learners `check_in`: a learner that has
not checked in and whose heartbeat stands still is dropped instead. Every learner's fate is settled by one
compare-and-set in the store, so all survivors see the same members and run their collectives over them.

Every other strategy (SYNC, LOCALSGD; ADPSGD with on_lost_learner = "stop") stops the run when a learner is
lost, so that the elastic agent (recipe/elastic.py) starts it again from its last checkpoint. A dead learner fails
the others' next collective at once on gloo; a frozen one (or any learner on NCCL) would hold them there until the
collective timeout. So from the first epoch on, the heartbeat thread watches every learner (`stop_without`): once
one has stood still for `stall_s`, this learner publishes it as lost and exits with RESTART_EXIT. A learner that
failed with an error of its own (a bug, a bad file) marks itself `failed/<rank>` first: the others then say so and
exit 1, since starting again would fail the same way.

HYBRID's node mates cannot step without each other. On gloo a dead mate fails the node's next collective at
once; a frozen one (or any mate on NCCL) leaves it blocked until the collective timeout, and its heartbeat
would keep the node alive to the others meanwhile. So the heartbeat thread also watches the learners named by
`leave_without`: once one of them has stood still for twice `stall_s` (the failed collective's own path,
which waits `stall_s`, decides first where there is one), this learner leaves the run wherever it is.
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

from comm.distributed import store

LOST_KEY, ANSWERED_KEY = "heartbeat/lost", "heartbeat/answered"
IN, DROPPED = b"in", b"dropped"
# The exit status of a learner that stopped because another was lost: the run can go on from its last
# checkpoint (EX_TEMPFAIL, "try again"); the elastic agent restarts on it. Any other failure exits 1.
RESTART_EXIT = 75


class LearnerLost(RuntimeError):
    def __init__(self, message: str, restartable: bool = True):
        super().__init__(message)
        self.restartable = restartable  # False: a lost learner failed with an error of its own


class LeftBehind(RuntimeError):
    """This learner cannot go on without a lost one, but the others can (a HYBRID node that lost a learner):
    it leaves the run, which is not an error."""


class Heartbeat:
    def __init__(self, rank: int, world_size: int, interval_s: float = 0.25, grace_s: float = 5.0,
                 linger_s: float = 30.0):
        self.rank, self.world_size = rank, world_size
        self.interval_s, self.grace_s, self.linger_s = interval_s, grace_s, linger_s
        self.store = store("health/")
        self._where: Callable[[], str] = lambda: f"on learner {rank}"
        self._diagnosing = threading.Event()  # the main thread is on it: the watchdog stands aside
        # leave_without() / stop_without(): the learners watched, how long they may stand still, and what then
        self._watched: tuple[list[int], float, str] = ([], 0.0, "")
        self._reported: set[int] = set()  # the learners this one dropped and said so
        self.longest_stall_s = 0.0  # the longest this learner itself stood still (a gap between its beats)
        self._dropped_after_s: float | None = None  # dropped_if_still()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        beats, lost_seen_at, failing_since = 0, None, None
        needed_seen: dict[int, tuple[bytes | None, float]] = {}  # rank -> (last beat, when it last changed)
        last = time.monotonic()
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            self.longest_stall_s, last = max(self.longest_stall_s, now - last - self.interval_s), now
            try:
                self.store.set(f"heartbeat/{self.rank}", str(beats))
                beats += 1
                if lost_seen_at is None and self.store.check([LOST_KEY]):
                    lost_seen_at = time.monotonic()
                self._check_watched(needed_seen)
                failing_since = None
            except Exception:  # a store hiccup: keep beating, or the others would take this learner for lost
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > self.grace_s:
                    return  # the store went away with learner 0; a collective on it fails by itself
                continue
            if lost_seen_at is not None and time.monotonic() - lost_seen_at > self.grace_s:
                if not self._diagnosing.is_set():  # stuck in a collective on a survivor that gave up
                    self._exit_lost(self._read_lost(), "while waiting in a collective")

    def _exit_lost(self, lost: list[int], failure: str) -> None:
        """From the heartbeat thread, wherever the main thread is: say which learners are lost and end the
        process (RESTART_EXIT, or 1 where one of them failed with an error of its own). Learner 0, whose process
        serves the store, first lingers until the other survivors have their answer (at most grace_s)."""
        failed = self._failed(lost)
        print(f"LearnerLost: {self._message(lost, failure, failed)}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            answered = self.store.add(ANSWERED_KEY, 1)
            deadline = time.monotonic() + self.grace_s
            while self.rank == 0 and answered < self.world_size - len(lost) and time.monotonic() < deadline:
                time.sleep(self.interval_s)
                answered = self.store.add(ANSWERED_KEY, 0)
        os._exit(1 if failed else RESTART_EXIT)

    def leave_without(self, ranks: list[int], stall_s: float) -> None:
        """From now on, leave the run (exit 0, LeftBehind) once one of `ranks` has stood still for 2 x stall_s."""
        self._watched = (list(ranks), 2 * stall_s, "leave")

    def dropped_if_still(self, stall_s: float) -> None:
        """For a run that goes on without lost learners: once this learner has itself stood still for stall_s
        (a stalled machine, SIGSTOP), the others have dropped it and may even have finished; a failure after
        that makes it leave (LeftBehind, exit 0), not stop the run for a learner it takes for lost."""
        self._dropped_after_s = stall_s

    def stop_without(self, stall_s: float) -> None:
        """From now on, stop this learner (LearnerLost, RESTART_EXIT) once any other has stood still for stall_s,
        wherever the main thread waits: a frozen learner would hold a collective until its timeout."""
        others = [r for r in range(self.world_size) if r != self.rank]
        self._watched = (others, stall_s, "stop")

    def _check_watched(self, seen: dict[int, tuple[bytes | None, float]]) -> None:
        ranks, limit, then = self._watched
        now, gone = time.monotonic(), []
        for r in ranks:
            beat = self._beat_of(r)
            if r not in seen or seen[r][0] != beat or self.store.check([f"done/{r}"]):
                seen[r] = (beat, now)  # a learner that closed its heartbeat has finished, not frozen
            elif now - seen[r][1] > limit:
                gone.append(r)
        if not gone:
            return
        if then == "stop":
            if self._diagnosing.is_set():  # the main thread's failed collective is naming them already
                return
            self.store.compare_set(LOST_KEY, "", json.dumps(gone))  # the first learner to see it names them
            self._exit_lost(self._read_lost(), f"heartbeat still for {limit:.0f} s (frozen, or its machine gone)")
        for r in gone:
            self._drop(r, limit)
        print(f"LeftBehind: learner(s) {gone} gone (heartbeat still for {limit:.0f} s), found {self._where()}; "
              f"learner {self.rank} cannot step without them and leaves the run; the others go on",
              file=sys.stderr, flush=True)
        os._exit(0)  # wherever the main thread is: a collective with the gone learner would block it

    def _beat_of(self, rank: int) -> bytes | None:
        key = f"heartbeat/{rank}"
        return self.store.get(key) if self.store.check([key]) else None

    def _beats(self) -> list[bytes | None]:
        return [self._beat_of(r) for r in range(self.world_size)]

    # -- going on without lost learners -----------------------------------------------------------------------

    def dropped(self) -> set[int]:
        """The learners dropped from the run so far (by any learner)."""
        return {r for r in range(self.world_size) if self.store.check([f"dropped/{r}"])}

    def _drop(self, rank: int, stall_s: float) -> None:
        """Mark `rank` dropped for good; the learner that marks it first says so, once (later check-ins find it
        again every epoch: until stop 34 they said it again)."""
        mark = f"by {self.rank}".encode()
        if rank in self._reported or self.store.compare_set(f"dropped/{rank}", "", mark) != mark:
            return  # said already, or another learner dropped it first and said so
        self._reported.add(rank)
        print(f"LearnerLost: learner {rank} of {self.world_size} is gone (heartbeat still for {stall_s:.0f} s), "
              f"found {self._where()}; the others go on without it", file=sys.stderr, flush=True)

    def confirm_lost(self, rank: int, stall_s: float, patience: float = 4.0) -> bool:
        """After an exchange with `rank` failed: True (and `rank` dropped for good) once its heartbeat stands
        still for stall_s, or another learner already dropped it; False when it keeps beating for patience x
        stall_s (it is alive: a real error). The patience lets a learner that is on its way out (a HYBRID node
        leaving) finish leaving."""
        gone, start = self.watch_peer(rank, stall_s), time.monotonic()
        while not gone():
            if time.monotonic() - start > patience * stall_s:
                return False
            time.sleep(self.interval_s)
        return True

    def watch_peer(self, rank: int, stall_s: float):
        """-> gone(): a test that does not block, asked while waiting on `rank`: True once its heartbeat has
        stood still for stall_s (it is then dropped for good) or another learner dropped it."""
        last = {"beat": self._beat_of(rank), "since": time.monotonic()}

        def gone() -> bool:
            if self.store.check([f"dropped/{rank}"]):
                return True
            beat, now = self._beat_of(rank), time.monotonic()
            if beat != last["beat"]:
                last.update(beat=beat, since=now)
            elif now - last["since"] > stall_s:
                self._drop(rank, stall_s)
                return True
            return False

        return gone

    def check_in(self, tag: str, stall_s: float) -> list[int]:
        """Collective over the learners still running: check in at the agreed point `tag` (an epoch's end) and
        wait until every learner has checked in or been dropped (already dropped, or its heartbeat stood still
        for stall_s while the others waited). -> the ranks checked in, the same list on every learner."""
        def key(r: int) -> str:
            return f"members/{tag}/{r}"

        if self.store.check([f"dropped/{self.rank}"]) or self.store.compare_set(key(self.rank), "", IN) != IN:
            # the others gave this learner up (it stood still, mid-epoch or here) and go on
            raise LeftBehind(f"learner {self.rank} reached {tag} after the others had dropped it (its heartbeat "
                             f"stood still for {stall_s:.0f} s); it leaves the run, the others go on")
        seen: dict[int, tuple[bytes | None, float]] = {}  # rank -> (last beat, when it last changed)
        while waiting := [r for r in range(self.world_size) if not self.store.check([key(r)])]:
            dropped, now = self.dropped(), time.monotonic()
            for r in waiting:
                beat = self._beat_of(r)
                if r not in seen or seen[r][0] != beat:
                    seen[r] = (beat, now)
                if (r in dropped or now - seen[r][1] > stall_s) and \
                        self.store.compare_set(key(r), "", DROPPED) == DROPPED:
                    self._drop(r, stall_s)
            time.sleep(0.02)  # the learners arrive within moments of each other, usually
        return [r for r in range(self.world_size) if self.store.get(key(r)) == IN]

    def _read_lost(self) -> list[int]:
        return json.loads(self.store.get(LOST_KEY))

    def _failed(self, lost: list[int]) -> dict[int, str]:
        """The lost learners that marked an error of their own (mark_failed) -> rank: the error."""
        with contextlib.suppress(Exception):
            return {r: self.store.get(f"failed/{r}").decode() for r in lost if self.store.check([f"failed/{r}"])}
        return {}

    def mark_failed(self, err: BaseException) -> None:
        """This learner ends with an error of its own: the others must not take it for lost and start again."""
        first_line = (str(err).splitlines() or [""])[0]
        with contextlib.suppress(Exception):
            self.store.set(f"failed/{self.rank}", f"{type(err).__name__}: {first_line}")

    def _message(self, lost: list[int], failure: str, failed: dict[int, str] | None = None) -> str:
        text = f"lost learner(s) {lost} of {self.world_size}, found {self._where()}; {failure}"
        for r, error in (failed or {}).items():
            text += f"; learner {r} failed with {error} (see its own output): not restarted"
        return text

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
    def watch(self, where: Callable[[], str], cannot_go_on_without: Callable[[], list[int]] = list):
        """Turn a failed collective inside the block into a LearnerLost that names the learners that are gone
        and says where the run stood (where() -> text); other errors pass through unchanged.
        cannot_go_on_without() -> the lost learners without which this one cannot go on while the others can
        (HYBRID: its node mates); when there are some, LeftBehind instead, and the others are left alone."""
        self._where = where
        try:
            yield
        except RuntimeError as err:
            if isinstance(err, (LearnerLost, LeftBehind)):
                raise
            if gone := cannot_go_on_without():
                raise LeftBehind(f"learner(s) {gone} gone, found {where()}; learner {self.rank} cannot step without "
                                 "them and leaves the run; the others go on") from err
            if self._dropped_after_s is not None and self.longest_stall_s > self._dropped_after_s:
                raise LeftBehind(f"learner {self.rank} stood still for {self.longest_stall_s:.0f} s (more than "
                                 f"{self._dropped_after_s:.0f} s: the others dropped it and went on), found "
                                 f"{where()}; it leaves the run") from err
            lost = self.lost_learners()
            if not lost:
                self.mark_failed(err)
                raise
            failed = self._failed(lost)
            raise LearnerLost(self._message(lost, f"the failed call said: {str(err).splitlines()[0]}", failed),
                              restartable=not failed) from err
        except Exception as err:  # an error of this learner's own (not a failed collective)
            self.mark_failed(err)
            raise

    def close(self) -> None:
        """After a run that ended well: the watchers take this learner's still heartbeat for finished, not lost."""
        with contextlib.suppress(Exception):
            self.store.set(f"done/{self.rank}", "1")
        self._stop.set()
        self._thread.join(timeout=self.grace_s + 1)  # a store call that hangs must not hold the learner's exit
