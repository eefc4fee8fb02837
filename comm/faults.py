"""Fault injection for experiments and fault tests, from the JSON's "comm": {"debug": {...}} section.

    "debug": {"slowdown": {"1": 2.0}}     learner 1 becomes a straggler: each of its steps takes 2x as long
    "debug": {"die_at_step": {"2": 5}}    learner 2 is SIGKILLed at its 5th micro batch
    "debug": {"freeze_at_step": {"2": 5}} learner 2 stops (SIGSTOP) at its 5th micro batch, as on a stalled machine
    "debug": {"freeze_s": {"2": 12}}      ... and goes on (SIGCONT) 12 s later, as after a long stall
    "debug": {"fault_attempts": [0, 1]}   the attempts of the run (recipe/elastic.py restarts) the faults happen
                                          in; by default the first only, so a restarted run does not die again

Kept out of the strategies: the training loop calls after_micro_batch() and nothing here talks to anyone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

KEYS = ("slowdown", "die_at_step", "freeze_at_step", "freeze_s", "fault_attempts")
ATTEMPT_ENV = "RECIPE_ATTEMPT"  # set by the elastic agent: 0 for the run's first launch, 1 after one restart...


class FaultInjector:
    def __init__(self, debug: dict, rank: int):
        unknown = sorted(set(debug) - set(KEYS))
        if unknown:
            raise ValueError(f'"comm.debug" options {unknown} are unknown; valid: {", ".join(sorted(KEYS))}')
        self.slowdown = float(debug.get("slowdown", {}).get(str(rank), 1.0))
        if self.slowdown < 1.0:
            raise ValueError(f"comm.debug.slowdown for rank {rank} must be >= 1, got {self.slowdown}")
        attempt = int(os.environ.get(ATTEMPT_ENV, 0))
        active = attempt in debug.get("fault_attempts", [0])
        self.die_at_step = int(debug.get("die_at_step", {}).get(str(rank), 0)) if active else 0
        self.freeze_at_step = int(debug.get("freeze_at_step", {}).get(str(rank), 0)) if active else 0
        self.freeze_s = debug.get("freeze_s", {}).get(str(rank))  # None: frozen until killed
        self._micro_steps = 0

    def after_micro_batch(self, step_seconds: float) -> None:
        if self.slowdown > 1.0:
            time.sleep((self.slowdown - 1.0) * step_seconds)
        self._micro_steps += 1
        if self._micro_steps == self.die_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if self._micro_steps == self.freeze_at_step:
            if self.freeze_s is not None:  # a process of its own wakes it: a frozen one cannot
                subprocess.Popen(["sh", "-c", f"sleep {float(self.freeze_s)}; kill -CONT {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)
