"""Shared fixtures: a tiny synthesized corpus prepared once per test session; several learners as real
processes talking gloo over localhost come from recipe/tools/local_learners.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from recipe.tools.local_learners import free_port, run_learners, train_learner  # noqa: F401 - used by the tests

REPO = Path(__file__).resolve().parent.parent

# A model and corpus small enough for seconds of CPU time, big enough that the loss measurably falls.
TINY = ["data.synth_train=96", "data.synth_test=16", "data.synth_dev=16", "data.synth_seed=7", "model.layers=1", "model.hidden=48",
        "model.dropout=0.1", "model.stack=3", "features.num_workers=2", "optim.lr=3e-3", "optim.warmup_epochs=0.5",
        "train.epochs=3", "train.min_updates=0", "optim.schedule=fixed", "optim.anneal_start_epoch=3",
        "train.log_interval=1000"]


@pytest.fixture(scope="session")
def tiny_exp(tmp_path_factory) -> Path:
    """A prepared experiment folder (stages 1-2) on a tiny synthesized corpus."""
    from recipe.prepare import main as prepare

    root = tmp_path_factory.mktemp("tiny")
    exp = root / "exp"
    for stage in ("data", "features"):
        assert prepare([stage, "--exp", str(exp), *TINY]) == 0
    return exp


def run_session(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run a command in a session of its own from the repository, output captured. Past the timeout, everything it
    started (run.sh's agent, launcher and learners: one process group) is killed, so that a hung run does not go on
    loading the machine under the next tests."""
    with subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def run_recipe(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """./run.sh with these arguments (a rendezvous port of its own unless given), output captured."""
    port = [] if "--master-port" in args else ["--master-port", str(free_port())]
    return run_session([str(REPO / "run.sh"), *port, *args], timeout)


def train_log(exp: Path) -> list[dict]:
    """EXP/train_log.jsonl: one record per epoch."""
    return [json.loads(line) for line in (exp / "train_log.jsonl").read_text().splitlines()]
