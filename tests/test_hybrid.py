"""HYBRID on real processes: node layouts, bit-identical replicas inside a node, gossip between nodes."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
import torch

from comm import ProcessLayout, build_strategy, init_distributed
from comm.layout import LayoutError
from tests.conftest import REPO, TINY, free_port, run_learners, run_recipe, train_log


def test_layouts_are_validated_with_every_factor():
    env = {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_SIZE": "4", "LOCAL_RANK": "3"}
    layout = ProcessLayout.from_env(env, emulated_nodes=2)
    assert (layout.nodes, layout.local_size, layout.node_rank, layout.local_rank) == (2, 2, 1, 1)
    with pytest.raises(LayoutError, match=r"world_size=6 learners into nodes=4 \(local_size would be 1.5\)"):
        ProcessLayout.from_env({"WORLD_SIZE": "6", "LOCAL_SIZE": "6"}, emulated_nodes=4)
    with pytest.raises(LayoutError, match="hybrid needs at least 2 nodes.*nodes=1 x local_size=4"):
        build_strategy({"strategy": "hybrid"}, ProcessLayout(world_size=4, local_size=4))
    with pytest.raises(ValueError, match="even number of them, at least 2; got 3"):
        build_strategy({"strategy": "hybrid"}, ProcessLayout(world_size=6, local_size=2, nodes=3))


def hybrid_steps(rank: int, world: int, steps: int):
    import deepspeed

    from model.lstm import LSTMAcousticModel, ctc_loss

    init_distributed()
    layout = ProcessLayout.from_env(emulated_nodes=2)
    strategy = build_strategy({"strategy": "hybrid", "period": 1}, layout)
    torch.manual_seed(0)
    model = LSTMAcousticModel(input_dim=12, output_dim=6, layers=1, hidden=16, stack=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # only gossip moves the weights
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, mpu=strategy.mpu(),
                                      config={"train_micro_batch_size_per_gpu": 2})
    strategy.attach(engine)
    with torch.no_grad():  # the two nodes start apart; the learners of a node start together
        for p in engine.module.parameters():
            p.add_(float(layout.node_rank))
    flat = lambda: torch.cat([p.detach().flatten().clone() for p in engine.module.parameters()])  # noqa: E731
    before = flat()
    g = torch.Generator().manual_seed(rank)
    snapshots = []
    for _ in range(steps):
        logits, out_lengths = engine(torch.randn(2, 10, 12, generator=g), torch.tensor([10, 8]))
        loss = ctc_loss(logits, out_lengths, torch.randint(1, 6, (4,), generator=g), torch.tensor([2, 2]))
        engine.backward(loss)
        with strategy.step_lock():
            engine.step()
        strategy.after_step(engine)
        snapshots.append(flat())
    strategy._stop_gossip()  # as at an epoch's end: no exchange in flight, every learner holds every merge
    return {"before": before, "snapshots": snapshots, "final": flat(), "leader_bytes": strategy.stats.bytes_sent}


@pytest.mark.slow
def test_replicas_stay_identical_and_nodes_converge_preserving_the_sum():
    out = run_learners(hybrid_steps, 4, 30)
    for a, b in ((0, 1), (2, 3)):  # learners of one node: bit-identical after every step and merge
        assert len(out[a]["snapshots"]) == 30
        for sa, sb in zip(out[a]["snapshots"], out[b]["snapshots"]):
            assert torch.equal(sa, sb)
        assert torch.equal(out[a]["final"], out[b]["final"])  # ... and after the last rounds at the stop
    leaders = (0, 2)  # one replica per node
    gap_before = (out[0]["before"] - out[2]["before"]).abs().max()
    gap_after = (out[0]["final"] - out[2]["final"]).abs().max()
    assert gap_after < 0.05 * gap_before  # the two nodes approached each other ...
    sum_before = sum(out[r]["before"] for r in leaders)
    sum_after = sum(out[r]["final"] for r in leaders)
    torch.testing.assert_close(sum_after, sum_before, rtol=1e-5, atol=1e-4)  # ... keeping the global sum
    assert out[0]["leader_bytes"] > 0 and out[1]["leader_bytes"] == 0  # only leaders cross the node boundary


@pytest.mark.slow
def test_hybrid_end_to_end_through_the_launcher(tmp_path):
    exp = tmp_path / "exp"
    out = run_recipe("--stage", "1", "--exp", str(exp), "--learners", "4", "--nodes", "2", "--ds-config",
                     str(REPO / "ds_configs" / "hybrid.json"), *TINY, "train.epochs=4")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    log = train_log(exp)
    assert log[-1]["train_loss"] < 0.7 * log[0]["train_loss"]
    assert log[-1]["heldout_loss"] < log[0]["heldout_loss"]
    metrics = json.loads((exp / "metrics.json").read_text())
    assert metrics["strategy"] == "hybrid" and metrics["nodes"] == 2 and metrics["node_batch"] == 16
    assert len((exp / "decode" / "hyp.txt").read_text().splitlines()) == 16


def test_emulated_link_figures():
    from comm.link import EmulatedLink

    link = EmulatedLink({"bandwidth_gbps": 8.0, "latency_ms": 2.0})  # 1e9 bytes/s
    assert link.transfer_seconds(5e8, messages=3) == pytest.approx(0.006 + 0.5)
    assert EmulatedLink({}).transfer_seconds(1e12) == 0.0 and not EmulatedLink({}).enabled
    with pytest.raises(ValueError, match=r"\"comm.link\" options \['bandwidth'\] are unknown"):
        build_strategy({"strategy": "sync", "link": {"bandwidth": 1}}, ProcessLayout())


@pytest.mark.slow
def test_one_launcher_per_node_without_ssh(tmp_path):
    """As SLURM's srun or Kubernetes start them: run.sh --node-rank K on each node, a two-host hostfile (here two
    names for this machine), each node with a disk of its own. The node layout comes from the launchers."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# one line per node\nlocalhost slots=2\n\n127.0.0.1 slots=2\n# 10.0.0.9 slots=2\n")
    exps = [tmp_path / f"node{k}" / "exp" for k in (0, 1)]
    for exp in exps:  # each node prepares its own data
        out = run_recipe("--stage", "1", "--stop-stage", "2", "--exp", str(exp), *TINY)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    common = ["--stage", "3", "--hostfile", str(hostfile), "--master-addr", "127.0.0.1", "--master-port",
              str(free_port()), "--ds-config", str(REPO / "ds_configs" / "hybrid.json"), *TINY, "train.epochs=2"]
    nodes = [subprocess.Popen([str(REPO / "run.sh"), *common, "--exp", str(exp), "--node-rank", str(k)],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
             for k, exp in enumerate(exps)]
    try:
        outs = [node.communicate(timeout=600)[0] for node in nodes]
    finally:  # a hung node: kill everything its run.sh started (its session), not only run.sh
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    assert [node.returncode for node in nodes] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    metrics = json.loads((exps[0] / "metrics.json").read_text())
    assert (metrics["strategy"], metrics["learners"], metrics["nodes"]) == ("hybrid", 4, 2)
    assert metrics["node_batch"] == 2 * metrics["micro_batch"] and metrics["global_batch"] == 4 * metrics["micro_batch"]
    assert all(r["gossip_rounds"] > 0 for r in train_log(exps[0]))
    assert (exps[0] / "decode" / "scores.json").is_file()  # node 0 decodes; node 1 has no checkpoint to
    assert not (exps[1] / "checkpoints").exists() and "stages 4-5 run on node 0" in outs[1]
