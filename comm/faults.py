"""Fault injection for experiments and fault tests, from the JSON's "comm": {"debug": {...}} section.

    "debug": {"slowdown": {"1": 2.0}}     learner 1 becomes a straggler: each of its steps takes 2x as long
    "debug": {"die_at_step": {"2": 5}}    learner 2 is SIGKILLed at its 5th micro batch

Kept out of the strategies: the training loop calls after_micro_batch() and nothing here talks to anyone.
"""

from __future__ import annotations

import os
import signal
import time

KEYS = ("slowdown", "die_at_step")


class FaultInjector:
    def __init__(self, debug: dict, rank: int):
        unknown = sorted(set(debug) - set(KEYS))
        if unknown:
            raise ValueError(f'"comm.debug" options {unknown} are unknown; valid: {", ".join(sorted(KEYS))}')
        self.slowdown = float(debug.get("slowdown", {}).get(str(rank), 1.0))
        if self.slowdown < 1.0:
            raise ValueError(f"comm.debug.slowdown for rank {rank} must be >= 1, got {self.slowdown}")
        self.die_at_step = int(debug.get("die_at_step", {}).get(str(rank), 0))
        self._micro_steps = 0

    def after_micro_batch(self, step_seconds: float) -> None:
        if self.slowdown > 1.0:
            time.sleep((self.slowdown - 1.0) * step_seconds)
        self._micro_steps += 1
        if self._micro_steps == self.die_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
