"""Elastic SYNC and LOCALSGD (recipe/elastic.py): a learner killed or frozen mid-run, through run.sh and the real
deepspeed launcher; the run starts again from its last checkpoint by itself and ends with a decoded result."""

from __future__ import annotations

import json
import re
import shutil
import signal
from types import SimpleNamespace

import pytest

from comm.health import RESTART_EXIT
from recipe.elastic import Agent, Attempt, launch_command, restartable
from tests.conftest import REPO, TINY, run_recipe, train_log


def test_the_agent_reads_who_was_lost_and_when_training_started_again():
    attempt = Attempt(1, 0.0)
    attempt.read("learner 3 (pid 123) was killed by SIGKILL; the run stops")
    attempt.read("LearnerLost: lost learner(s) [1, 3] of 4, found on learner 0 in epoch 2 (last checkpoint: x)")
    attempt.read("learner 2 (pid 9) was killed by SIGKILL; the others go on without it (comm.on_lost_learner=...)")
    assert attempt.lost == [1, 3] and attempt.killed_by == "SIGKILL" and attempt.training_at is None
    attempt.read("02:16:57 [rank 0] INFO resumed from /e/checkpoints/epoch-001.pt (epoch 1)")
    attempt.read("02:16:57 [rank 0] INFO strategy=sync learners=4 nodes=1 device=cpu global_batch=32")
    assert attempt.resumed_from == "/e/checkpoints/epoch-001.pt" and attempt.training_at >= attempt.lost_at


def test_only_a_lost_learner_restarts_the_run():
    # 75: a survivor's LearnerLost; 137: a learner SIGKILLed (its supervisor's 128 + 9); 247: a supervisor
    # killed (the launcher's sys.exit(-9)); 1: an error, which would fail the same way again; 2: a bad option
    assert [restartable(c) for c in (RESTART_EXIT, 137, 247, 1, 2)] == [True, True, True, False, False]


def test_a_restart_resumes_the_same_launch():
    args = SimpleNamespace(master_port=29500, hostfile=None, learners=4, node_rank=None, master_addr=None,
                           exp="exp/x", ds_config="ds.json", nodes=1, conf="c.yaml", overrides=["train.epochs=3"],
                           resume=False)
    first, again = launch_command(args, 0), launch_command(args, 1)
    assert first[1:5] == ["--master_port", "29500", "--num_gpus", "4"] and "--resume" not in first
    assert again[:-2] == first[:-2] + ["--resume"] and again[-1].endswith("train.epochs=3 --resume")
    args.hostfile, args.node_rank, args.master_addr = "hosts", 1, "10.0.0.1"
    assert launch_command(args, 0)[3:10] == ["--hostfile", "hosts", "--no_ssh", "--node_rank", "1", "--master_addr",
                                             "10.0.0.1"]


class ScriptedAgent(Agent):
    """The agent with a launcher that ends with the given exit statuses, one per launch."""

    def __init__(self, tmp_path, codes: list[int], *overrides: str):
        super().__init__(SimpleNamespace(exp=str(tmp_path), conf=None, overrides=list(overrides)))
        self.codes, self.launched = list(codes), 0

    def launch(self, attempt: Attempt) -> int:
        self.launched += 1
        attempt.read(f"LearnerLost: lost learner(s) [{attempt.number}] of 4, found on learner 0 in epoch 2")
        return self.codes.pop(0)


def test_the_agent_restarts_up_to_max_restarts_then_names_the_lost_learners(tmp_path, capsys):
    handler = signal.getsignal(signal.SIGINT)
    agent = ScriptedAgent(tmp_path, [137, RESTART_EXIT, 137], "train.max_restarts=2")
    assert agent.run() == 137 and agent.launched == 3
    assert signal.getsignal(signal.SIGINT) is handler  # the agent's own handlers are gone with it
    out = capsys.readouterr().out
    assert "restart 1 of at most 2" in out and "restart 2 of at most 2" in out
    assert "learner(s) [0, 1, 2] lost 3 time(s), more than train.max_restarts=2; the run stops" in out
    # an error (1) ends at once; a success records the restarts before it in metrics.json
    assert ScriptedAgent(tmp_path, [1], "train.max_restarts=2").run() == 1
    (tmp_path / "metrics.json").write_text('{"epochs": 3}')
    agent = ScriptedAgent(tmp_path, [137, 0])
    assert agent.run() == 0 and agent.launched == 2
    restarts = json.loads((tmp_path / "metrics.json").read_text())["restarts"]
    assert [(r["restart"], r["lost_learners"]) for r in restarts] == [(1, [0])]


def prepare(tiny_exp, tmp_path, ds: str, **comm):
    exp = tmp_path / "exp"
    shutil.copytree(tiny_exp, exp)
    config = json.loads((REPO / "ds_configs" / ds).read_text())
    config["comm"].update(comm)
    (tmp_path / "ds.json").write_text(json.dumps(config))
    return exp, tmp_path / "ds.json"


@pytest.mark.slow
@pytest.mark.parametrize("ds, fault, comm", [  # the other two pairs run the same code (measured, RELIABILITY.md)
    ("sync.json", "die_at_step", {}),
    ("localsgd.json", "freeze_at_step", {"period": 2, "warmup_steps": 2})],
    ids=["sync-killed", "localsgd-frozen"])
def test_a_lost_learner_restarts_the_run_from_its_last_checkpoint(tiny_exp, tmp_path, ds, fault, comm):
    # 4 learners, 3 micro batches each an epoch (96 utterances, micro batch 8): learner 3's 5th is in epoch 2
    exp, ds_path = prepare(tiny_exp, tmp_path, ds, debug={fault: {"3": 5}}, **comm)
    out = run_recipe("--stage", "3", "--stop-stage", "4", "--exp", str(exp), "--learners", "4", "--ds-config",
                     str(ds_path), *TINY, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    restarts = json.loads((exp / "metrics.json").read_text())["restarts"]
    assert len(restarts) == 1 and restarts[0]["lost_learners"] == [3], restarts
    assert restarts[0]["resumed_from"] == str(exp / "checkpoints" / "epoch-001.pt")
    assert restarts[0]["killed_by"] == ("SIGKILL" if fault == "die_at_step" else None)
    assert restarts[0]["seconds_to_training"] < 60, restarts
    if fault == "freeze_at_step":  # found by the heartbeat (lost_after_s, 5 s), not by the collective timeout
        assert "heartbeat still for 5 s (frozen, or its machine gone)" in text, text[-4000:]
    # epoch 1, before the checkpoint, was trained once; epoch 2 again, from it
    assert len(re.findall(r"INFO epoch 1 done", text)) == 1 and len(re.findall(r"INFO epoch 2 done", text)) == 1
    assert [r["epoch"] for r in train_log(exp)] == [1, 2, 3]
    assert json.loads((exp / "decode" / "scores.json").read_text())["utterances"] == 16


@pytest.mark.slow
def test_a_learner_lost_with_no_restart_allowed_ends_the_run_naming_it(tiny_exp, tmp_path):
    # learner 1 dies at its 6th micro batch (3 learners x 4 an epoch: epoch 2); train.max_restarts=0, the
    # behaviour before the agent (the counting itself: test_the_agent_restarts_up_to_max_restarts_...)
    exp, ds_path = prepare(tiny_exp, tmp_path, "sync.json", debug={"die_at_step": {"1": 6}})
    out = run_recipe("--stage", "3", "--stop-stage", "3", "--exp", str(exp), "--learners", "3", "--ds-config",
                     str(ds_path), *TINY, "train.max_restarts=0", timeout=300)
    text = out.stdout + out.stderr
    # the launcher exits with the status of the first learner it finds ended: the killed one's supervisor (137) or a
    # survivor that named it (RESTART_EXIT), whichever its once-a-second poll sees first
    assert out.returncode in (137, RESTART_EXIT), text[-4000:]
    assert "LearnerLost: lost learner(s) [1] of 3" in text and "restart 1" not in text, text[-4000:]
    checkpoint = exp / "checkpoints" / "epoch-001.pt"
    assert (f"elastic: learner(s) [1] lost 1 time(s), more than train.max_restarts=0; the run stops. Its last "
            f"checkpoint: {checkpoint}; go on from it with ./run.sh --stage 3 --resume") in text
    assert not (exp / ".done" / "stage-3").exists()
