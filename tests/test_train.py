"""The training entry point on two learners: resume equals uninterrupted training; metrics are complete."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.conftest import REPO, TINY, run_learners, train_learner, train_log

pytestmark = pytest.mark.slow  # learner processes: not in the fast tier


def train_run(exp, *extra, learner=train_learner):
    argv = ["--exp", str(exp), "--ds-config", str(REPO / "ds_configs" / "sync.json"), *TINY, *extra]
    return run_learners(learner, 2, argv)


def learner_on_another_disk(rank: int, world: int, argv: list[str]) -> dict:
    """Learner 1 as on another host: its disk holds none of learner 0's checkpoints."""
    from recipe.lib.experiment import Experiment

    if rank != 0:
        Experiment.checkpoints = lambda self: []
    return train_learner(rank, world, argv)


def log_without_times(exp):
    rows = train_log(exp)
    return [{k: v for k, v in r.items() if "wall" not in k and "per_s" not in k} for r in rows]


def test_resume_equals_uninterrupted(tiny_exp, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for exp in (straight, resumed):
        shutil.copytree(tiny_exp, exp)
    # the interruption is emulated by a run of 1 epoch; the annealing must not depend on the epochs then (by
    # default it starts after the first half of train.epochs, and a real resume keeps train.epochs)
    anneal = "optim.anneal_start_epoch=2"
    metrics, _ = train_run(straight, "train.epochs=2", anneal, "train.log_interval=2")  # log interval: TensorBoard
    train_run(resumed, "train.epochs=1", anneal)
    assert [p.name for p in (resumed / "checkpoints").iterdir()] == ["epoch-001.pt"]
    train_run(resumed, "train.epochs=2", anneal, "--resume", learner=learner_on_another_disk)  # learner 0 shares it

    a = torch.load(straight / "checkpoints" / "epoch-002.pt", weights_only=True)
    b = torch.load(resumed / "checkpoints" / "epoch-002.pt", weights_only=True)
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    assert log_without_times(straight) == log_without_times(resumed)

    for key in ("strategy", "learners", "nodes", "global_batch", "epochs", "params", "wall_s",
                "train_frames_per_s", "heldout_loss", "cer", "wer"):
        assert key in metrics, key
    assert metrics["strategy"] == "sync" and metrics["learners"] == 2 and metrics["global_batch"] == 16
    assert json.loads((straight / "metrics.json").read_text())["cer"] == metrics["cer"]
    # TensorBoard: learner 0's events, per epoch and per logged step, against global progress in updates
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(straight / "tensorboard"))
    board.Reload()
    cer = board.Scalars("dev/cer")
    assert [e.step for e in cer] == [6, 12] and [e.value for e in cer] == pytest.approx(
        [r["cer"] for r in train_log(straight)], rel=1e-6)  # 96 utterances / (8 x 2 learners): 6 updates an epoch
    assert {"train/loss", "train/lr", "train/grad_norm", "train/frames_per_s", "dev/loss", "dev/wer",
            "train/skipped_steps", "comm/lost_learners"} <= set(board.Tags()["scalars"])
    assert all(e.value > 0 for e in board.Scalars("train/grad_norm"))


def test_newbob_anneals_stops_and_resumes_across_its_annealing_start(tiny_exp, tmp_path):
    # The default schedule inside the loop (the shared settings pin optim.schedule=fixed and train.epochs, which
    # newbob then only trains). Micro batches of 4 at lr 1e-2, so the tiny model leaves the all-blank plateau
    # in a few epochs (newbob does not anneal before that); a margin of 50%, so the first epoch after that
    # starts annealing, and 2 annealed epochs end the run. The resumed run is interrupted (train.max_epochs)
    # once annealing is decided and before it starts, and must reproduce the uninterrupted run bit for bit.
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for exp in (straight, resumed):
        shutil.copytree(tiny_exp, exp)
    ds = json.loads((REPO / "ds_configs" / "sync.json").read_text())
    ds["train_micro_batch_size_per_gpu"] = 4
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    tiny = [a for a in TINY if not a.startswith("train.epochs=")]
    newbob = [*tiny, "optim.schedule=newbob", "optim.lr=1e-2", "optim.newbob_margin=0.5",
              "optim.newbob_anneal_epochs=2"]

    def run(exp, *extra):
        return run_learners(train_learner, 2, ["--exp", str(exp), "--ds-config", str(tmp_path / "ds.json"),
                                               *newbob, *extra])

    metrics, _ = run(straight, "train.max_epochs=12")
    log, start = train_log(straight), metrics["anneal_from"]
    assert start is not None and 3 <= start <= 10 and metrics["epochs"] == len(log) == start + 1, (metrics, log)
    assert metrics["stop"] == "2 annealed epochs (optim.newbob_anneal_epochs)"
    lrs = [r["lr"] for r in log]
    assert len(set(lrs[: start - 1])) == 1 and lrs[start - 2] > lrs[start - 1] > lrs[start], lrs  # peak, then down

    run(resumed, f"train.max_epochs={start - 1}")
    assert train_log(resumed)[-1]["epoch"] == start - 1
    run(resumed, "train.max_epochs=12", "--resume")
    assert log_without_times(resumed) == log_without_times(straight)
    last = f"epoch-{start + 1:03d}.pt"
    a, b = (torch.load(exp / "checkpoints" / last, weights_only=True)["model"] for exp in (straight, resumed))
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_a_run_that_does_not_learn_says_so(tiny_exp, tmp_path, capsys):
    """A learning rate too small to leave CTC's all-blank plateau: the log, metrics.json and the report say so."""
    from recipe.report import main as report

    exp = tmp_path / "exp"
    shutil.copytree(tiny_exp, exp)
    # newbob never anneals on the plateau (where the loss stalls before anything is learnt): it runs to the end
    metrics, _ = train_run(exp, "optim.lr=1e-7", "train.epochs=2", "optim.schedule=newbob", "train.max_epochs=2")
    assert metrics["epochs"] == 2 and metrics["anneal_from"] is None and metrics["stop"] is None
    assert metrics["warning"].startswith("no learning yet after epoch 2 (12 optimizer updates): the dev CER is")
    assert "Try more updates (train.epochs" in metrics["warning"] and train_log(exp)[-1]["cer"] > 0.9
    assert report(["--exp", str(exp)]) == 0 and "WARNING: no learning yet after epoch 2" in capsys.readouterr().out


def test_training_stops_at_its_time_limit(tiny_exp, tmp_path):
    exp = tmp_path / "exp"
    shutil.copytree(tiny_exp, exp)
    metrics, _ = train_run(exp, "train.max_minutes=0.0001", "train.epochs=3")
    assert metrics["epochs"] == 1 and metrics["stop"].startswith("train.max_minutes=0.0001 reached after")
    assert len(train_log(exp)) == 1
