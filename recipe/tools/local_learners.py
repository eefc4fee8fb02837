"""Start several learners on this machine as spawned processes with the launcher's environment (gloo over
localhost). Used by the benchmarks and the multi-process tests; real runs use the deepspeed launcher."""

from __future__ import annotations

import os
import socket
import time

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _learner(rank: int, world: int, port: int, fn, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))
    import torch

    torch.set_num_threads(1)
    results[rank] = fn(rank, world, *args)


def run_learners(fn, world: int, *args, timeout: float | None = 600.0, allow_failures: bool = False) -> list:
    """fn(rank, world, *args) in `world` processes -> its results by rank. fn must be importable (module
    level) and return something picklable; a learner that fails or outlives `timeout` is an error, and the
    others are then stopped at once rather than left waiting on it in a rendezvous or collective.
    allow_failures (fault tests): let every learner run to its end; a failed one's result is None."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with ctx.Manager() as manager:
        results = manager.dict()
        procs = [ctx.Process(target=_learner, args=(r, world, port, fn, args, results)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        while any(p.is_alive() for p in procs) and (allow_failures or not any(p.exitcode for p in procs)):
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(0.2)
        codes = [p.exitcode for p in procs]  # read before the kill: None marks a learner still running
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if None in codes or (codes != [0] * world and not allow_failures):
            raise RuntimeError(f"learner exit codes {codes} (0 = success, None = still running)")
        return [results.get(r) for r in range(world)]


def train_learner(rank: int, world: int, argv: list[str]) -> dict:
    """recipe/train.py with these arguments, in a learner started by run_learners -> its metrics."""
    from comm import shutdown_distributed
    from recipe.train import Trainer, parse_args

    metrics = Trainer(parse_args(argv)).train()
    shutdown_distributed()
    return metrics
