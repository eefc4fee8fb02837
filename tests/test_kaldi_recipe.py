"""A Kaldi user's setup, as the README describes it: data dirs with feats.scp and cmvn.scp (no audio), pdf
alignments as `ali-to-pdf` writes them, per-speaker i-vectors; the recipe trains the paper's CE objective on
them with two learners and writes scaled log-likelihoods for Kaldi's decoder."""

from __future__ import annotations

import json

import kaldiio
import numpy as np
import pytest

from recipe.evaluate import main as evaluate
from recipe.lib.tables import DataError
from recipe.prepare import main as prepare
from tests.conftest import REPO, run_learners, train_learner, train_log

DIM, CLASSES = 13, 4


def kaldi_dir(root, name: str, speakers: list[str], seed: int):
    """Features whose frame class is the argmax of their first CLASSES dims (learnable), Kaldi's files."""
    rng = np.random.default_rng(seed)
    d = root / name
    d.mkdir(parents=True)
    feats, ali, text, utt2spk = {}, [], [], []
    for spk in speakers:
        for u in range(6):
            utt = f"{spk}-{name}{u:02d}"
            x = rng.normal(0.0, 1.0, (rng.integers(30, 80), DIM)).astype(np.float32) + 3.0  # CMVN takes the 3 off
            feats[utt] = x
            ali.append(f"{utt} {' '.join(map(str, x[:, :CLASSES].argmax(1)))}\n")
            text.append(f"{utt} some words\n")
            utt2spk.append(f"{utt} {spk}\n")
    kaldiio.save_ark(str(d / "feats.ark"), feats, scp=str(d / "feats.scp"))
    stats = {}
    for spk in speakers:  # compute-cmvn-stats: sums and count, then sums of squares
        x = np.concatenate([v for k, v in feats.items() if k.startswith(spk)]).astype(np.float64)
        stats[spk] = np.stack([np.append(x.sum(0), len(x)), np.append((x * x).sum(0), 0.0)])
    kaldiio.save_ark(str(d / "cmvn.ark"), stats, scp=str(d / "cmvn.scp"))
    (d / "text").write_text("".join(text))
    (d / "utt2spk").write_text("".join(utt2spk))
    (root / f"{name}_ali.txt").write_text("".join(ali))
    (root / f"{name}_ivectors_spk.txt").write_text("".join(f"{spk} [ {seed} 0.5 -0.5 ]\n" for spk in speakers))
    return d


def settings(root) -> list[str]:
    return ["data.corpus=kaldi", f"data.train_dir={root / 'train'}", f"data.test_dir={root / 'test'}",
            f"data.train_ali={root / 'train_ali.txt'}", f"data.test_ali={root / 'test_ali.txt'}",
            f"data.train_ivectors={root / 'train_ivectors_spk.txt'}",
            f"data.test_ivectors={root / 'test_ivectors_spk.txt'}", f"data.dev_dir={root / 'dev'}",
            f"data.dev_ali={root / 'dev_ali.txt'}", f"data.dev_ivectors={root / 'dev_ivectors_spk.txt'}",
            "train.objective=ce", "model.stack=1",
            "model.layers=1", "model.hidden=32", "data.chunk_frames=21", "train.epochs=3", "optim.lr=1e-2",
            "optim.base_batch=8", "train.min_updates=0", "optim.schedule=fixed", "train.log_interval=1000"]


@pytest.fixture
def kaldi_setup(tmp_path):
    kaldi_dir(tmp_path, "train", ["spkA", "spkB", "spkC"], 1)
    kaldi_dir(tmp_path, "test", ["spkD"], 2)
    kaldi_dir(tmp_path, "dev", ["spkE"], 3)
    return tmp_path


@pytest.mark.slow
def test_kaldi_features_alignments_and_ivectors_train_with_ce(kaldi_setup):
    root, exp = kaldi_setup, kaldi_setup / "exp"
    for stage in ("data", "features"):
        assert prepare([stage, "--exp", str(exp), *settings(root)]) == 0
    argv = ["--exp", str(exp), "--ds-config", str(REPO / "ds_configs" / "sync.json"), *settings(root)]
    metrics, _ = run_learners(train_learner, 2, argv)
    log = train_log(exp)
    assert metrics["objective"] == "ce" and metrics["train_utterances"] == 18 and metrics["dev_utterances"] == 6
    assert log[-1]["heldout_loss"] < log[0]["heldout_loss"]
    assert metrics["frame_acc"] > 0.6  # 4 classes: chance is about 0.25
    # input = 13 Kaldi feature dims + the 3-dim i-vector on every frame
    assert evaluate(["--exp", str(exp), "decode.average_best=1"]) == 0  # the last epoch's model, as in metrics
    scores = json.loads((exp / "decode" / "scores.json").read_text())
    loglikes = dict(kaldiio.load_scp(scores["loglikes"]))
    assert scores["utterances"] == 6 and sorted(loglikes) == [f"spkD-test{u:02d}" for u in range(6)]
    # the dev set, with its own alignments and i-vectors (data.dev_ali, dev_ivectors), scored by the decode stage
    # as training scored it after the last epoch
    assert scores["dev"]["frame_acc"] == pytest.approx(metrics["frame_acc"])
    assert all(v.shape[1] == CLASSES for v in loglikes.values())


def edit(path, old: str, new: str) -> None:
    path.write_text(path.read_text().replace(old, new))


@pytest.mark.parametrize("damage, message", [
    (lambda root: edit(root / "train_ali.txt", "spkA-train01 ", "spkA-train01 0 0 0 0 0 0 0 0 "),
     r"train_ali\.txt: utterance spkA-train01: alignment of \d+ frames, features of \d+"),
    (lambda root: edit(root / "test_ali.txt", "spkD-test03 ", "spkD-test03 7 "),  # one frame more: tolerated
     r"test_ali\.txt: utterance spkD-test03: target id 7 is beyond the output layer's 4 classes"),
    (lambda root: (root / "train_ivectors_spk.txt").write_text("spkA [ 1 0.5 -0.5 ]\n"),
     r"train_ivectors_spk\.txt: no vector for utterance spkB-train00 or its speaker spkB"),
])
def test_bad_kaldi_inputs_stop_before_training(kaldi_setup, damage, message):
    root, exp = kaldi_setup, kaldi_setup / "exp"
    damage(root)
    assert prepare(["data", "--exp", str(exp), *settings(root)]) == 0
    with pytest.raises(DataError, match=message):
        from recipe.lib.config import load_config
        from recipe.prepare import prepare_features

        prepare_features(load_config(None, settings(root)), exp, root / "work")
    assert not (exp / "checkpoints").exists()
