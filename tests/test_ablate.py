"""The ablation arms are valid settings: a typo in one would waste the minutes of every arm before it."""

from __future__ import annotations

import json

import pytest

from comm import ProcessLayout, build_strategy
from recipe.lib.config import load_config
from recipe.tools.ablate import ARMS, NODES
from tests.conftest import REPO, TINY


@pytest.mark.parametrize("name", sorted(ARMS))
def test_every_arm_builds_its_strategy_and_config(name):
    json_path, comm, engine, overrides = ARMS[name]
    conf = json.loads((REPO / json_path).read_text())
    assert set(engine) <= set(conf)  # changes only what the JSON has
    nodes = NODES.get(name, 1)
    build_strategy({**conf["comm"], **comm}, ProcessLayout(rank=0, world_size=4, local_size=4 // nodes, nodes=nodes))
    load_config(REPO / "recipe" / "conf" / "default.yaml", overrides)


def test_mixing_reports_gossip_rounds_per_step_and_the_last_consensus_distance():
    from recipe.tools.ablate import mixing

    log = [{"learner_micro_steps": [90, 100], "gossip_rounds": 76, "consensus_distance": 0.02},
           {"learner_micro_steps": [95, 95], "gossip_rounds": 152, "consensus_distance": 0.0062}]
    assert mixing(log) == "  gossip rounds per step 0.80, consensus distance 0.0062"
    assert mixing([{"learner_micro_steps": [93, 93]}]) == ""  # SYNC: nothing to say


def test_the_summary_compares_every_arm_with_the_first_sync_arm(capsys):
    from recipe.tools.ablate import summary

    def runs(*cers):
        return [{"metrics": {"cer": c, "heldout_loss": 0.02}} for c in cers]

    summary({"sync-warmup1": runs(0.004, 0.002), "adpsgd-sqrt-replicas-warmup1": runs(0.006, 0.003)})
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[1:3] == ["0.30%", "1.00"] and lines[2].split()[1:3] == ["0.45%", "1.50"], lines


def test_gradient_noise_measures_a_learner_step_against_the_global_one(tiny_exp):
    from recipe.lib.experiment import Experiment
    from recipe.tools.gradient_noise import measure

    exp = Experiment(tiny_exp, load_config(None, TINY))
    alone = measure(exp, learners=1, micro=8, at=[0.5], probes=4)
    assert alone[0]["factor"] == pytest.approx(1.0) and alone[0]["median"] == pytest.approx(1.0)  # one share is all
    rows = measure(exp, learners=4, micro=2, at=[0, 1], probes=4)
    assert [r["epochs"] for r in rows] == [0, 1]
    for r in rows:  # a mean's square never exceeds the mean of the squares: the factor is at least 1
        assert 1.0 <= r["factor"] < 4 and 1.0 <= r["median"] < 4 and r["noise_scale"] > 0, r
