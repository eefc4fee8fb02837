"""An emulated inter-node link, for studying the strategies' runtime trade-off on one machine.

Learners on one machine talk over shared memory or loopback, far faster than the network between real
nodes. With `"link": {"bandwidth_gbps": B, "latency_ms": L}` in the JSON's comm section (and nodes emulated
with run.sh --nodes), traffic that would cross a node boundary is made to take as long as it would on that
link: a gossip exchange lasts at least L + bytes / B; SYNC's ring allreduce, whose ring crosses the node
boundaries, is followed by the extra time its 2 (W - 1) phases would take there. Every figure measured this
way is an emulation and is reported as one. Empty (the default): nothing is emulated, nothing is counted.
"""

from __future__ import annotations

import time


class EmulatedLink:
    KEYS = ("bandwidth_gbps", "latency_ms")

    def __init__(self, conf: dict):
        unknown = sorted(set(conf) - set(self.KEYS))
        if unknown:
            raise ValueError(f'"comm.link" options {unknown} are unknown; valid: {", ".join(self.KEYS)}')
        self.enabled = bool(conf)
        self.bytes_per_s = float(conf.get("bandwidth_gbps", 0.0)) * 1e9 / 8  # 0: unlimited bandwidth
        self.latency_s = float(conf.get("latency_ms", 0.0)) / 1000
        if self.enabled and (self.bytes_per_s < 0 or self.latency_s < 0):
            raise ValueError(f"comm.link figures must be >= 0, got {conf}")

    def transfer_seconds(self, nbytes: float, messages: int = 1) -> float:
        """How long `messages` sequential messages carrying nbytes in all take on the link."""
        if not self.enabled:
            return 0.0
        return messages * self.latency_s + (nbytes / self.bytes_per_s if self.bytes_per_s > 0 else 0.0)

    def wait_out(self, started: float, nbytes: float, messages: int = 1) -> None:
        """Sleep until a transfer begun at `started` (perf_counter) has taken as long as on the link."""
        remaining = self.transfer_seconds(nbytes, messages) - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)
