"""Who gossips with whom in which round: a bipartite pairing schedule, testable without any process group.

Units (learners for ADPSGD, nodes for HYBRID) are split into two sides, even-numbered units active and
odd-numbered passive (Lian et al. 2018): every exchange joins one active and one passive unit, so no two
exchanges can wait on each other in a cycle. In round r, active unit a (its index on its side) pairs with the
passive unit at offset shift(r) from it: each round is a perfect matching between the sides, and the offset
rotates so that over a window every unit meets many distinct neighbours.
  ring:        shift(r) = r mod n                    (all n neighbours every n rounds)
  exponential: shift(r) = 2^(r mod log) - 1 mod n    (distances 0, 1, 3, 7, ...; mixes in O(log n) rounds)

How well a schedule mixes (`disagreement_left`): with 4 units both average exactly every 2 rounds; with 8 the
ring leaves 0.35 of the learners' disagreement after 4 rounds and 16 keep 0.79 of it, where the exponential
pairings average 2^k units exactly in k rounds. Measured at 8 learners in ACCURACY.md section 8.
"""

from __future__ import annotations

import math

import numpy as np

SCHEDULES = ("ring", "exponential")


class PairingSchedule:
    def __init__(self, units: int, schedule: str = "ring"):
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown pairing schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
        if units < 2 or units % 2:
            raise ValueError(f"gossip pairs the units (learners or nodes) of two equal sides, so it needs an even "
                             f"number of them, at least 2; got {units}")
        self.units = units
        self.side = units // 2
        self.schedule = schedule

    def shift(self, round_: int) -> int:
        if self.schedule == "ring":
            return round_ % self.side
        period = max(1, math.ceil(math.log2(self.side)) + 1) if self.side > 1 else 1
        return (2 ** (round_ % period) - 1) % self.side

    def is_active(self, unit: int) -> bool:
        return unit % 2 == 0

    def peer(self, unit: int, round_: int) -> int:
        """The unit that `unit` exchanges with in round `round_`."""
        index = unit // 2
        if self.is_active(unit):
            return 2 * ((index + self.shift(round_)) % self.side) + 1
        return 2 * ((index - self.shift(round_)) % self.side)

    def matching(self, round_: int) -> list[tuple[int, int]]:
        """(active, passive) pairs of a round."""
        return [(a, self.peer(a, round_)) for a in range(0, self.units, 2)]

    def disagreement_left(self, rounds: int) -> float:
        """The fraction of the units' disagreement (their deviation from the mean, in the worst direction) that
        `rounds` rounds of pairwise averaging leave, with no steps in between: 0 = exact average."""
        left = np.eye(self.units) - 1.0 / self.units
        for r in range(rounds):
            mix = np.eye(self.units)
            for a, p in self.matching(r):
                mix[[a, a, p, p], [a, p, a, p]] = 0.5
            left = mix @ left
        return float(np.linalg.norm(left, 2))
