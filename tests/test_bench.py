"""recipe/tools/bench.py, which produces BENCHMARKS.md section 2, on the tiny corpus: both arms run, train alike,
and the ratio is what the arms measured."""

from __future__ import annotations

import re
import shutil

import pytest
from omegaconf import OmegaConf

from recipe.lib.config import load_config
from recipe.tools.bench import main as bench
from tests.conftest import REPO, TINY

pytestmark = pytest.mark.slow  # learner processes


def test_the_sync_benchmark_compares_like_with_like(tiny_exp, tmp_path, capsys):
    # 96 utterances, micro batch 8, 2 learners: 6 batches each, 5 of them warm-up and 1 timed; the benchmark
    # reads the experiment's resolved config, as a training run leaves it
    exp = tmp_path / "exp"
    shutil.copytree(tiny_exp, exp)
    OmegaConf.save(load_config(None, TINY), exp / "conf.yaml")
    assert bench(["sync", "--exp", str(exp), "--ds-config", str(REPO / "ds_configs" / "sync.json"),
                  "--steps", "1", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    round_1 = re.search(r"round 1: DDP +(\d+) frames/s   recipe SYNC +(\d+) frames/s   ratio ([\d.]+)   "
                        r"weights apart by ([\d.e+-]+)", out)
    assert round_1, out
    ddp, recipe, ratio, apart = (float(x) for x in round_1.groups())
    assert ratio == pytest.approx(recipe / ddp, abs=2e-3)  # printed figures, rounded
    # the same model, batches, learning rate, clipping and gradient average: bit for bit the same weights (until
    # stop 41 the DDP arm stepped at optim.lr and the recipe at the warm-up's first rate)
    assert apart == 0.0, out
    assert re.search(r"recipe / DDP throughput ratio: median [\d.]+ \(min [\d.]+, max [\d.]+\)", out), out
    for workers in (1, 2):
        rtf = re.search(rf"feature extraction real-time factor, {workers} worker\(s\): ([\d.]+)", out)
        assert rtf and 0 < float(rtf[1]) < 1, out
