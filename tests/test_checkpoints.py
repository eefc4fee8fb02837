"""Checkpoints: atomic under a kill mid-save, a clear error on a full disk, pruned, loaded safely."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from recipe.lib.experiment import Experiment, average_weights, close_to_the_best


def state(epoch: int) -> dict:
    return {"model": {"w": torch.full((1000,), float(epoch))}, "epoch": epoch}


def save_and_die_halfway(root: str) -> None:
    """Write epoch 2's checkpoint, but the process is SIGKILLed after half of the bytes hit the disk."""
    real_save = torch.save

    def dying_save(obj, f):
        real_save(obj, f)
        size = os.path.getsize(f)
        os.truncate(f, size // 2)
        os.kill(os.getpid(), 9)

    torch.save = dying_save
    Experiment(root).save_checkpoint(state(2), 2, keep=3)


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    exp = Experiment(tmp_path)
    exp.save_checkpoint(state(1), 1, keep=3)
    proc = mp.get_context("spawn").Process(target=save_and_die_halfway, args=(str(tmp_path),))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -9
    assert (tmp_path / "checkpoints" / "epoch-002.pt.tmp").exists()  # the torn write is there ...
    assert [p.name for p in exp.checkpoints()] == ["epoch-001.pt"]  # ... and never taken for a checkpoint
    assert exp.load_checkpoint()["epoch"] == 1
    exp.save_checkpoint(state(2), 2, keep=3)  # the next save simply replaces the torn file
    assert exp.load_checkpoint()["epoch"] == 2


def test_a_full_disk_is_a_clear_error_and_keeps_the_previous_checkpoints(tmp_path, monkeypatch):
    exp = Experiment(tmp_path)
    exp.save_checkpoint(state(1), 1, keep=3)

    def full_disk(obj, f):
        with open(f, "wb") as out:
            out.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match=r"epoch-002\.pt: checkpoint not written .*No space left on device.*"
                                      r"previous checkpoints are intact: epoch-001\.pt"):
        exp.save_checkpoint(state(2), 2, keep=3)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["epoch-001.pt"]  # no litter


def test_old_checkpoints_are_pruned_to_the_configured_count(tmp_path):
    exp = Experiment(tmp_path)
    for epoch in range(1, 6):
        exp.save_checkpoint(state(epoch), epoch, keep=2)
    assert [p.name for p in exp.checkpoints()] == ["epoch-004.pt", "epoch-005.pt"]


def test_the_best_checkpoints_by_held_out_loss_are_kept_and_averaged(tmp_path, monkeypatch):
    """A noisy small corpus: the best epochs are not the last ones. The latest stays for --resume."""
    exp = Experiment(tmp_path)
    monkeypatch.setattr(Experiment, "input_dim", 2)  # no data: a linear model, its weights [epoch, epoch]
    exp.build_model = lambda input_dim: torch.nn.Linear(input_dim, 1, bias=False)
    losses = {1: 0.29, 2: 0.22, 3: 0.43, 4: 0.27, 5: 0.13, 6: 0.17, 7: 0.27}
    for epoch, loss in losses.items():
        history = [{"epoch": e, "heldout_loss": losses[e]} for e in range(1, epoch + 1)]
        checkpoint = {"model": {"weight": torch.full((1, 2), float(epoch))}, "epoch": epoch,
                      "train_state": {"history": history}}
        exp.save_checkpoint(checkpoint, epoch, keep=3, losses={e: losses[e] for e in range(1, epoch + 1)})
    assert [p.name for p in exp.checkpoints()] == ["epoch-002.pt", "epoch-005.pt", "epoch-006.pt", "epoch-007.pt"]
    model, meta = exp.load_model(average=3, within=None)  # epochs 2, 5 and 6
    assert meta["averaged"] == ["epoch-002.pt", "epoch-005.pt", "epoch-006.pt"]
    assert model.weight.flatten().tolist() == pytest.approx([13 / 3, 13 / 3])
    model, meta = exp.load_model(average=3, within=0.5)  # 0.22 > 1.5 x 0.13: epoch 2 left out
    assert meta["averaged"] == ["epoch-005.pt", "epoch-006.pt"] and model.weight.tolist() == [[5.5, 5.5]]
    assert exp.load_model(average=1)[1]["epoch"] == 7  # the latest alone


def test_checkpoints_never_unpickle_arbitrary_objects(tmp_path):
    exp = Experiment(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    torch.save({"epoch": 1, "evil": Experiment}, tmp_path / "checkpoints" / "epoch-001.pt")  # a class: pickled code
    with pytest.raises(Exception, match="Weights only load failed"):
        exp.load_checkpoint()


def test_averaging_takes_the_element_wise_mean_of_float_weights_and_the_last_counters():
    states = [{"w": torch.tensor([1.0, 10.0]), "steps": torch.tensor(5)},
              {"w": torch.tensor([2.0, 20.0]), "steps": torch.tensor(6)},
              {"w": torch.tensor([6.0, 30.0]), "steps": torch.tensor(7)}]
    avg = average_weights(states)
    assert torch.equal(avg["w"], torch.tensor([3.0, 20.0])) and avg["w"].dtype == torch.float32
    assert int(avg["steps"]) == 7
    half = average_weights([{"w": torch.tensor([1.0], dtype=torch.bfloat16)}, {"w": torch.tensor([2.0],
                                                                                dtype=torch.bfloat16)}])
    assert half["w"].dtype == torch.bfloat16 and float(half["w"]) == 1.5  # summed in float64, stored as saved


def test_only_checkpoints_close_to_the_best_held_out_loss_are_averaged():
    def checkpoint(loss):
        return {"train_state": {"history": [{"heldout_loss": loss}]}} if loss is not None else {}

    def losses(chosen):
        return [c.get("train_state", {}).get("history", [{}])[-1].get("heldout_loss") for c in chosen]

    # the built-in corpus's last 3 epochs: still falling fast, so only the last is taken
    assert losses(close_to_the_best([checkpoint(x) for x in (0.0871, 0.0248, 0.0095)], 0.5)) == [0.0095]
    # a plateau (a small corpus late in training): all are averaged
    plateau = [checkpoint(x) for x in (0.31, 0.29, 0.30)]
    assert losses(close_to_the_best(plateau, 0.1)) == [0.31, 0.29, 0.30]
    # the best may be an earlier epoch (the last one overfit); a checkpoint without a recorded loss is kept
    assert losses(close_to_the_best([checkpoint(x) for x in (0.2, 0.5, None)], 0.1)) == [0.2, None]
    # a diverged epoch (NaN loss) is never the best
    assert losses(close_to_the_best([checkpoint(x) for x in (float("nan"), 1.0, 1.1)], 0.2)) == [1.0, 1.1]
    assert len(close_to_the_best([checkpoint(float("nan"))] * 2, 0.2)) == 2  # nothing to judge by: as without
