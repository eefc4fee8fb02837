"""recipe/tools/gpu_check.py, the script kept for a lent GPU, run on the CPU so it keeps working between loans."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow  # learner processes: not in the fast tier


def test_gpu_check_runs_its_whole_path_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    cmd = [sys.executable, "-m", "recipe.tools.gpu_check", "--size", "tiny", "--steps", "2", "--warmup", "1",
           "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["backend"] == "gloo" and result["dtype"] == "torch.bfloat16"  # the bf16 JSON took effect
    assert result["params"] == 84804 and result["train_steps"] == 2
    assert result["train_frames_per_s"] > 0 and result["staging_ms_per_exchange"] > 0
    assert math.isfinite(result["loss_first"]) and math.isfinite(result["loss_last"])
    assert '"train_frames_per_s"' in done.stdout  # printed as well as written
    # a gossip merge into the bf16 engine's fp32 masters survives the next step, and the module computes with it
    assert result["merge_kept_max_error"] == 0 and result["module_vs_masters_max_error"] == 0
