"""Shared fixtures: a tiny synthesized corpus prepared once per test session, and a runner that starts
several learners as real processes talking gloo over localhost."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# A model and corpus small enough for seconds of CPU time, big enough that the loss measurably falls.
TINY = ["data.synth_train=96", "data.synth_test=16", "data.synth_seed=7", "model.layers=1", "model.hidden=48",
        "model.dropout=0.1", "model.stack=3", "features.num_workers=2", "optim.lr=3e-3", "optim.warmup_epochs=0.5",
        "train.epochs=3", "train.log_interval=1000"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _learner(rank: int, world: int, port: int, fn, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))
    import torch

    torch.set_num_threads(1)
    results[rank] = fn(rank, world, *args)


def run_learners(fn, world: int, *args, timeout: float = 300.0) -> list:
    """fn(rank, world, *args) in `world` spawned processes with the launcher's environment; -> results by rank.
    fn must be importable (module level) and return something picklable."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with ctx.Manager() as manager:
        results = manager.dict()
        procs = [ctx.Process(target=_learner, args=(r, world, port, fn, args, results)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
        codes = [p.exitcode for p in procs]
        assert codes == [0] * world, f"learner exit codes {codes}"
        return [results[r] for r in range(world)]


@pytest.fixture(scope="session")
def tiny_exp(tmp_path_factory) -> Path:
    """A prepared experiment folder (stages 1-2) on a tiny synthesized corpus."""
    from recipe.prepare import main as prepare

    root = tmp_path_factory.mktemp("tiny")
    exp = root / "exp"
    for stage in ("data", "features"):
        assert prepare([stage, "--exp", str(exp), *TINY]) == 0
    return exp
