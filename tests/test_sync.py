"""SYNC on real processes: DeepSpeed engines on gloo over localhost keep the learners bit-identical."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.conftest import run_learners

pytestmark = pytest.mark.slow  # learner processes: not in the fast tier


def sync_steps(rank: int, world: int, steps: int):
    import deepspeed

    from comm import ProcessLayout, build_strategy, init_distributed
    from model.lstm import LSTMAcousticModel, ctc_loss

    init_distributed()
    strategy = build_strategy({"strategy": "sync"}, ProcessLayout.from_env())
    torch.manual_seed(100 + rank)  # different initial weights on purpose: initialize must broadcast rank 0's
    model = LSTMAcousticModel(input_dim=12, output_dim=6, layers=2, hidden=16, dropout=0.0, stack=2)
    initial = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, mpu=strategy.mpu(),
                                      config={"train_micro_batch_size_per_gpu": 3, "gradient_clipping": 1.0})
    strategy.attach(engine)
    start = torch.cat([p.detach().flatten().clone() for p in engine.module.parameters()])
    g = torch.Generator().manual_seed(rank)  # every learner sees different data
    losses = []
    for _ in range(steps):
        feats = torch.randn(3, 20, 12, generator=g)
        targets = torch.randint(1, 6, (6,), generator=g)
        logits, out_lengths = engine(feats, torch.tensor([20, 18, 16]))
        loss = ctc_loss(logits, out_lengths, targets, torch.tensor([2, 2, 2]))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    final = torch.cat([p.detach().flatten().clone() for p in engine.module.parameters()])
    return {"initial": initial, "start": start, "final": final, "losses": losses, "listening": listening()}


def listening() -> set[str]:
    """The addresses this process accepts TCP connections on."""
    import psutil  # a DeepSpeed dependency

    return {c.laddr.ip for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN}


def deepspeed_shm_buffers() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")}


def test_two_learners_stay_bit_identical_under_sync():
    shm_before = deepspeed_shm_buffers()
    a, b = run_learners(sync_steps, 2, 6)
    assert deepspeed_shm_buffers() <= shm_before  # DeepSpeed's CPU shm op left no RAM behind (comm/base.py)
    assert not torch.equal(a["initial"], b["initial"])  # they did start apart
    assert torch.equal(a["start"], b["start"])  # ... and were made equal at initialize
    assert not torch.equal(a["start"], a["final"])  # training moved the weights
    assert torch.equal(a["final"], b["final"])  # bit-identical after several steps on different data
    assert a["losses"] != b["losses"]  # the data really differed
    # every learner on this machine: the store (learner 0) and gloo listen on loopback only (comm/base.py)
    assert a["listening"] == b["listening"] == {"127.0.0.1"}


def fail_or_wait(rank: int, world: int):
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("learner 1 fails before joining the process group")
    dist.init_process_group("gloo")  # would wait for learner 1 until the rendezvous timeout (10 min)


def test_one_failing_learner_stops_the_others_at_once():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"exit codes \[None, 1\]"):
        run_learners(fail_or_wait, 2)
    assert time.monotonic() - t0 < 60
