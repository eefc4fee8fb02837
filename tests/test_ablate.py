"""The ablation arms are valid settings: a typo in one would waste the minutes of every arm before it."""

from __future__ import annotations

import json

import pytest

from comm import ProcessLayout, build_strategy
from recipe.lib.config import load_config
from recipe.tools.ablate import ARMS, NODES
from tests.conftest import REPO


@pytest.mark.parametrize("name", sorted(ARMS))
def test_every_arm_builds_its_strategy_and_config(name):
    json_path, comm, engine, overrides = ARMS[name]
    conf = json.loads((REPO / json_path).read_text())
    assert set(engine) <= set(conf)  # changes only what the JSON has
    nodes = NODES.get(name, 1)
    build_strategy({**conf["comm"], **comm}, ProcessLayout(rank=0, world_size=4, local_size=4 // nodes, nodes=nodes))
    load_config(REPO / "recipe" / "conf" / "default.yaml", overrides)
