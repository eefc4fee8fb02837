"""recipe/tools/gpu_check.sh, the check kept for a lent GPU, run on the CPU with --smoke so that it keeps working
between loans: every part of it (the throughput table, gossip's cost, the merge through a bf16 step, the
recipe end to end for one learner and for HYBRID's two nodes) on tiny models."""

from __future__ import annotations

import json
import math

import pytest

from recipe.tools.gpu_check import MODELS, training_flops_per_frame
from tests.conftest import run_session


def test_the_model_flops_are_counted_as_the_paper_model_has_them():
    dims = MODELS["paper"][0]
    # 6 BLSTM layers x 2 directions x 4 gates x 512 x (input + 512), the 1,024 -> 256 bottleneck, 256 -> 32,000:
    # multiply-adds per frame, x2 FLOPs, x3 for forward and backward
    macs = 2 * 4 * 512 * ((260 + 512) + 5 * (1024 + 512)) + 1024 * 256 + 256 * 32000
    assert training_flops_per_frame(dims) == 3 * 2 * macs
    # two frames stacked into one LSTM step of twice the input: the work of one step, per two frames
    stacked = 2 * 4 * 512 * ((520 + 512) + 5 * (1024 + 512)) + 1024 * 256 + 256 * 32000
    assert training_flops_per_frame({**dims, "stack": 2}) == 3 * 2 * stacked / 2


@pytest.mark.slow  # learner processes and two runs of run.sh
def test_gpu_check_runs_its_whole_path_on_the_cpu(tmp_path):
    done = run_session(["bash", "recipe/tools/gpu_check.sh", "--smoke", str(tmp_path)], timeout=400)
    assert done.returncode == 0, done.stdout[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["backend"] == "gloo" and result["smoke"]
    rows = result["throughput"]
    assert [(r["model"], r["precision"]) for r in rows[::2]] == [("paper", "fp32"), ("paper", "bf16"),
                                                                ("default", "fp32"), ("default", "bf16")]
    for row in rows:
        assert "error" not in row, row
        assert row["frames_per_s"] > 0 and row["model_tflops"] > 0 and math.isfinite(row["loss_last"])
        assert row["lstm_packed"] is False  # nothing to pack on the CPU
    gossip = result["gossip"]
    assert gossip["rounds"] >= 2 and gossip["step_ms_gossip_on"] > 0 and gossip["step_ms_gossip_off"] > 0
    # a gossip merge into the bf16 engine's fp32 masters survives the next step, and the module computes with it
    assert result["merge"] == {"merge_kept_max_error": 0.0, "module_vs_masters_max_error": 0.0}
    assert "H200 compute rate measured: " in (tmp_path / "projection.txt").read_text()
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in summary] == ["sync, 1 learner(s)", "hybrid, 2 learner(s)"]
    assert all("exit 0 CER" in line and "device=cpu" in line for line in summary), summary
