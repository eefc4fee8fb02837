"""The gossip pairing schedule, with no process group."""

from __future__ import annotations

import pytest

from comm.topology import PairingSchedule


@pytest.mark.parametrize("units", [2, 4, 6, 8, 16, 32])
@pytest.mark.parametrize("schedule", ["ring", "exponential"])
def test_every_round_is_a_perfect_matching_between_the_sides(units, schedule):
    s = PairingSchedule(units, schedule)
    for r in range(64):
        pairs = s.matching(r)
        actives = [a for a, _ in pairs]
        passives = [p for _, p in pairs]
        assert sorted(actives) == list(range(0, units, 2)) and sorted(passives) == list(range(1, units, 2))
        for a, p in pairs:
            assert s.peer(p, r) == a  # symmetric: the passive side agrees on its partner


@pytest.mark.parametrize("schedule", ["ring", "exponential"])
def test_learners_meet_several_distinct_neighbours(schedule):
    s = PairingSchedule(16, schedule)
    window = 8
    for unit in range(16):
        met = {s.peer(unit, r) for r in range(window)}
        assert len(met) >= (8 if schedule == "ring" else 4)
    ring = PairingSchedule(16, "ring")
    assert {ring.peer(0, r) for r in range(8)} == set(range(1, 16, 2))  # all of the other side


def test_exponential_pairings_average_any_power_of_two_exactly_where_the_ring_does_not():
    for k in (1, 2, 3, 4, 5):
        units = 2 ** k
        assert PairingSchedule(units, "exponential").disagreement_left(k) == pytest.approx(0, abs=1e-9)
        assert PairingSchedule(units, "exponential").disagreement_left(k - 1) > 0.5  # and not sooner
    assert PairingSchedule(4, "ring").disagreement_left(2) == pytest.approx(0, abs=1e-9)  # 4 units: the same
    assert PairingSchedule(8, "ring").disagreement_left(4) == pytest.approx(0.354, abs=1e-3)
    assert PairingSchedule(16, "ring").disagreement_left(8) > 0.5


@pytest.mark.parametrize("units", [0, 1, 3, 5])
def test_odd_counts_are_rejected_clearly(units):
    with pytest.raises(ValueError, match=f"even number of them, at least 2; got {units}"):
        PairingSchedule(units)


def test_unknown_schedule():
    with pytest.raises(ValueError, match="unknown pairing schedule 'star'; valid: ring, exponential"):
        PairingSchedule(4, "star")
