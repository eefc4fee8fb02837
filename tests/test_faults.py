"""Faults injected into real multi-learner training runs: non-finite values and a learner that dies."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.conftest import REPO, TINY, run_learners


def faulty_learner(rank: int, world: int, argv: list[str], fault: dict):
    """Train with the recipe, after patching in `fault` for learner fault["rank"]:
    {"nan_steps": [i, ...]} makes the features of its i-th micro batches NaN (counted over the whole run);
    {"kill_at_step": i} SIGKILLs it at its i-th micro batch. -> the metrics, or the error text."""
    import os
    import signal

    import recipe.train as recipe_train

    real_step, steps = recipe_train.train_step, [0]

    def train_step(engine, strategy, batch):
        steps[0] += 1
        if rank == fault["rank"] and steps[0] in fault.get("nan_steps", ()):
            batch = {**batch, "feats": torch.full_like(batch["feats"], float("nan"))}
        if rank == fault["rank"] and steps[0] == fault.get("kill_at_step"):
            os.kill(os.getpid(), signal.SIGKILL)
        return real_step(engine, strategy, batch)

    recipe_train.train_step = train_step
    try:
        return recipe_train.train(recipe_train.parse_args(argv))
    except RuntimeError as err:
        return f"{type(err).__name__}: {err}"


def run(tiny_exp, tmp_path, world: int, fault: dict, *overrides: str, ds: str = "sync.json"):
    exp = tmp_path / "exp"
    shutil.copytree(tiny_exp, exp)
    argv = ["--exp", str(exp), "--ds-config", str(REPO / "ds_configs" / ds), *TINY, "train.epochs=2", *overrides]
    return exp, run_learners(faulty_learner, world, argv, fault, timeout=300, allow_failures=True)


def test_sync_skips_non_finite_steps_alike_on_every_learner(tiny_exp, tmp_path):
    # 96 utterances / (8 x 2 learners) = 6 steps an epoch; learner 1's steps 2 and 3 of epoch 1 go NaN
    exp, (a, b) = run(tiny_exp, tmp_path, 2, {"rank": 1, "nan_steps": [2, 3]})
    assert isinstance(a, dict) and isinstance(b, dict), (a, b)
    log = [json.loads(line) for line in (exp / "train_log.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in log] == [4, 0]  # 2 steps skipped, by both learners (the NaN is reduced)
    assert all(torch.isfinite(v).all() for v in torch.load(exp / "checkpoints" / "epoch-002.pt",
                                                           weights_only=True)["model"].values())
    assert log[1]["heldout_loss"] < log[0]["heldout_loss"] and a["cer"] == b["cer"]


def test_non_finite_steps_in_a_row_stop_the_run_with_the_checkpoint_named(tiny_exp, tmp_path):
    exp, out = run(tiny_exp, tmp_path, 2, {"rank": 0, "nan_steps": range(8, 20)}, "train.max_bad_steps=3")
    for text in out:  # both learners stop at the same step: the NaN gradients were reduced to both
        assert text.startswith("NonFiniteTraining: 3 optimizer steps in a row"), text
        assert "epoch 2" in text and str(exp / "checkpoints" / "epoch-001.pt") in text
    assert torch.load(exp / "checkpoints" / "epoch-001.pt", weights_only=True)["epoch"] == 1


@pytest.mark.parametrize("ds, world", [("sync.json", 3), ("adpsgd.json", 4)])
def test_a_dead_learner_is_named_by_the_others_at_once(tiny_exp, tmp_path, capfd, ds, world):
    _, out = run(tiny_exp, tmp_path, world, {"rank": 1, "kill_at_step": 6}, ds=ds)
    assert out[1] is None
    # a survivor raises LearnerLost from its failed collective, or, left waiting in a collective on a survivor
    # that gave up, its heartbeat watchdog prints the same diagnosis and ends it (comm/health.py)
    stderr = [line for line in capfd.readouterr().err.splitlines() if line.startswith("LearnerLost: ")]
    messages = [text for text in out if text is not None] + stderr
    assert len(messages) == world - 1, messages
    for text in messages:
        assert text.startswith(f"LearnerLost: lost learner(s) [1] of {world}, found on learner "), text
        assert "in epoch 2" in text and "epoch-001.pt" in text
