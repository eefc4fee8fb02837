"""Start several learners on this machine as spawned processes with the launcher's environment (gloo over
localhost). Used by the benchmarks and the multi-process tests; real runs use the deepspeed launcher."""

from __future__ import annotations

import os
import socket

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


def run_learners(fn, world: int, *args, timeout: float | None = 600.0) -> list:
    """fn(rank, world, *args) in `world` processes -> its results by rank. fn must be importable (module
    level) and return something picklable; a learner that fails or outlives `timeout` is an error."""
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
        if codes != [0] * world:
            raise RuntimeError(f"learner exit codes {codes} (0 = success)")
        return [results[r] for r in range(world)]
