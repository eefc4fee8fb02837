"""The CE objective's inputs: frame targets from CTMs and Kaldi alignments, checked against the features; chunks;
Kaldi features with cmvn.scp; speaker vectors; priors and the scaled log-likelihoods written for Kaldi."""

from __future__ import annotations

import kaldiio
import numpy as np
import pytest
import torch

from model.lstm import LSTMAcousticModel, frame_ce_loss
from recipe.evaluate import evaluate_frames, export_loglikes
from recipe.lib.datadir import Utterance
from recipe.lib.dataset import IGNORE, BucketBatchSampler, ChunkDataset, FeatureReader
from recipe.lib.features import CacheWriter, FeatureCache, import_kaldi_features, write_cache
from recipe.lib.tables import DataError
from recipe.lib.targets import FrameTargets, ctm_alignments, log_priors, write_targets

FRAMES = {"s1-a": 50, "s1-b": 23, "s2-a": 21}


def make_cache(tmp_path, frames=FRAMES, dim=3) -> FeatureCache:
    """Features whose first column is the frame index and second the utterance number: reads are checkable."""
    def fill(writer: CacheWriter) -> dict:
        for n, (utt, t) in enumerate(sorted(frames.items())):
            x = np.zeros((t, dim), np.float32)
            x[:, 0], x[:, 1] = np.arange(t), n
            writer.add(utt, utt.split("-")[0], x)
        return {}
    return FeatureCache(write_cache(tmp_path / "cache", "train", dim, fill))


def frame_index_targets(frames=FRAMES, classes=5) -> dict[str, np.ndarray]:
    return {utt: (np.arange(t) % classes).astype(np.int32) for utt, t in frames.items()}


def test_ctm_to_frames_takes_the_phone_under_each_frame_centre(tmp_path):
    ctm = tmp_path / "phones.ctm"
    # 0-0.1 s sil, 0.1-0.25 w, 0.25-0.4 ah; frames of 25 ms every 10 ms: centres at 12.5, 22.5, ... ms
    ctm.write_text("u 1 0.000 0.100 sil\nu 1 0.100 0.150 w\nu 1 0.250 0.150 ah\n")
    ali = dict(ctm_alignments(ctm, {"sil": 0, "ah": 1, "w": 2}, {"u": 38}, 0.010, 0.025))["u"]
    centres = np.arange(38) * 10 + 12.5
    assert ali.tolist() == [0 if c < 100 else 2 if c < 250 else 1 for c in centres]
    # phone-position states: each phone's time in thirds, target = phone * 3 + third (worked by hand: sil's
    # thirds end at 33.3 and 66.7 ms, w's at 150 and 200, ah's at 300 and 350)
    states = dict(ctm_alignments(ctm, {"sil": 0, "ah": 1, "w": 2}, {"u": 38}, 0.010, 0.025, states=3))["u"]
    assert states.tolist() == [0] * 3 + [1] * 3 + [2] * 3 + [6] * 5 + [7] * 5 + [8] * 5 + [3] * 5 + [4] * 5 + [5] * 4
    (tmp_path / "split.ctm").write_text("u 1 0 0.1 sil\nv 1 0 0.1 sil\nu 1 0.1 0.1 w\n")  # read as a stream
    with pytest.raises(DataError, match=r"split\.ctm:3: u: its lines are not together"):
        dict(ctm_alignments(tmp_path / "split.ctm", {"sil": 0, "w": 1}, {"u": 20, "v": 9}, 0.010, 0.025))
    with pytest.raises(DataError, match=r"phones\.ctm:1: u: phone 'sil' is not in the phone table"):
        dict(ctm_alignments(ctm, {"w": 0, "ah": 1}, {"u": 38}, 0.010, 0.025))


def test_targets_are_stored_by_utterance_and_read_by_range(tmp_path):
    cache = make_cache(tmp_path)
    alignments = frame_index_targets()
    alignments["s1-b"] = alignments["s1-b"][:-2]  # 2 frames short: within tolerance, the last target repeated
    meta = write_targets(cache, alignments.items(), "ali.txt", tmp_path / "t", 5, tolerance=2, on_bad="error")
    targets = FrameTargets(tmp_path / "t")
    assert meta["frames"] == sum(FRAMES.values()) and targets.num_targets == 5
    np.testing.assert_array_equal(targets.read("s1-a", 7, 12), np.arange(7, 12) % 5)
    assert targets.read("s1-b").tolist() == (np.arange(21) % 5).tolist() + [0, 0]
    assert targets.counts.sum() == sum(FRAMES.values())


@pytest.mark.parametrize("damage, message", [
    (lambda a: a.pop("s2-a"), r"ali\.txt: utterance s2-a has no alignment"),
    (lambda a: a.update({"s1-a": a["s1-a"][:40]}), r"ali\.txt: utterance s1-a: alignment of 40 frames, features "
                                                   r"of 50 \(data\.ali_tolerance=2\)"),
    (lambda a: a["s1-b"].__setitem__(3, 9), r"ali\.txt: utterance s1-b: target id 9 is beyond the output "
                                            r"layer's 5 classes"),
])
def test_bad_alignments_stop_before_training_or_are_skipped_and_counted(tmp_path, damage, message):
    cache = make_cache(tmp_path)
    alignments = frame_index_targets()
    damage(alignments)
    with pytest.raises(DataError, match=message):
        write_targets(cache, alignments.items(), "ali.txt", tmp_path / "t", 5, tolerance=2, on_bad="error")
    meta = write_targets(cache, alignments.items(), "ali.txt", tmp_path / "t", 5, tolerance=2, on_bad="skip")
    assert sum(meta["skipped"].values()) == 1
    data = ChunkDataset(FeatureReader(cache, "none"), FrameTargets(tmp_path / "t"), chunk=21)
    assert data.num_utterances == 2 and sum(data.skipped.values()) == 1


def test_chunks_cover_every_frame_once_and_pad_the_last(tmp_path):
    cache = make_cache(tmp_path)
    write_targets(cache, frame_index_targets().items(), "ali", tmp_path / "t", 5, 0, "error")
    data = ChunkDataset(FeatureReader(cache, "none"), FrameTargets(tmp_path / "t"), chunk=21)
    # 50 frames -> 21 + 21 + 8; 23 -> 21 + 2; 21 -> 21
    assert sorted(data.lengths.tolist()) == sorted([21, 21, 8, 21, 2, 21])
    batch = data.collate(list(range(len(data))))
    assert batch["feats"].shape == (6, 21, 3) and batch["frame_targets"].shape == (6, 21)
    seen = {}
    for b in range(6):
        n = int(batch["lengths"][b])
        frame = batch["feats"][b, :n, 0].long()
        assert (batch["frame_targets"][b, :n] == frame % 5).all()  # targets travel with their frames
        assert (batch["frame_targets"][b, n:] == IGNORE).all() and (batch["feats"][b, n:] == 0).all()
        seen.setdefault(int(batch["feats"][b, 0, 1]), []).extend(frame.tolist())
    assert {k: sorted(v) for k, v in seen.items()} == {n: list(range(t)) for n, t in enumerate(FRAMES.values())}


def test_speaker_vectors_are_appended_to_every_frame(tmp_path):
    cache = make_cache(tmp_path)
    vectors = {"s1-a": np.array([7.0, 8.0], np.float32), "s1-b": np.array([1.0, 2.0], np.float32),
               "s2-a": np.array([3.0, 4.0], np.float32)}
    reader = FeatureReader(cache, "none", vectors=vectors)
    assert reader.dim == 5
    x = reader.read(0, 3, 6)
    np.testing.assert_array_equal(x[:, 3:], [[7, 8]] * 3)
    np.testing.assert_array_equal(x[:, 0], [3, 4, 5])


def test_kaldi_features_with_cmvn_scp_are_imported(tmp_path):
    rng = np.random.default_rng(0)
    feats = {f"spk{u % 2}-u{u}": rng.normal(5.0, 2.0, (30 + u, 4)).astype(np.float32) for u in range(4)}
    kaldiio.save_ark(str(tmp_path / "feats.ark"), feats, scp=str(tmp_path / "feats.scp"))
    # Kaldi's compute-cmvn-stats: 2 x (D + 1), sums and count, then sums of squares; deliberately not the
    # features' own (a user's CMVN grouping is kept)
    stats = {spk: np.array([[1.0, 2.0, 3.0, 4.0, 10.0], [10.0, 20.0, 30.0, 40.0, 0.0]]) for spk in ("spk0", "spk1")}
    kaldiio.save_ark(str(tmp_path / "cmvn.ark"), stats, scp=str(tmp_path / "cmvn.scp"))
    utts = [Utterance(utt, utt.split("-")[0], "", "x", feats=f"{tmp_path}/feats.ark") for utt in sorted(feats)]
    cache = FeatureCache(import_kaldi_features(utts, tmp_path / "c", "train", tmp_path / "feats.scp",
                                               tmp_path / "cmvn.scp"))
    for i, utt in enumerate(cache.utts):
        np.testing.assert_array_equal(cache[i], feats[utt])
    mean, std = FeatureReader(cache, "speaker").stats["spk1"]
    np.testing.assert_allclose(mean, [0.1, 0.2, 0.3, 0.4], rtol=1e-6)
    np.testing.assert_allclose(std, np.sqrt([1.0, 2.0, 3.0, 4.0] - mean.astype(np.float64) ** 2), rtol=1e-6)
    without = FeatureCache(import_kaldi_features(utts, tmp_path / "c", "train", tmp_path / "feats.scp"))
    x = np.concatenate([feats[u] for u in sorted(feats) if u.startswith("spk0")])
    np.testing.assert_allclose(FeatureReader(without, "speaker").stats["spk0"][0], x.mean(0), rtol=1e-5)


def test_frame_scores_and_kaldi_loglikes(tmp_path):
    """Accuracy and loss totals equal a direct computation; the ark holds log posterior - log prior for every
    frame of every utterance, readable by kaldiio (as latgen-faster-mapped reads it)."""
    cache = make_cache(tmp_path)
    write_targets(cache, frame_index_targets().items(), "ali", tmp_path / "t", 5, 0, "error")
    targets = FrameTargets(tmp_path / "t")
    data = ChunkDataset(FeatureReader(cache, "none"), targets, chunk=21)
    torch.manual_seed(0)
    model = LSTMAcousticModel(3, 5, layers=1, hidden=8)
    batches = BucketBatchSampler(data.lengths, 4, shuffle=False).epoch_batches(0)
    totals = evaluate_frames(model, data, batches)
    b = data.collate(list(range(len(data))))
    with torch.no_grad():
        logits, _ = model(b["feats"], b["lengths"])
    real = b["frame_targets"] != IGNORE
    assert totals["frames"] == sum(FRAMES.values())
    assert totals["correct"] == int(((logits.argmax(-1) == b["frame_targets"]) & real).sum())
    assert totals["loss_sum"] == pytest.approx(float(frame_ce_loss(logits, b["frame_targets"], "sum")), rel=1e-5)

    (tmp_path / "out").mkdir()
    result = export_loglikes(model, data, batches, targets.counts, tmp_path / "out")
    loglikes = dict(kaldiio.load_scp(str(tmp_path / "out" / "loglikes.scp")))
    assert sorted(loglikes) == sorted(FRAMES) and result["utterances"] == 3
    priors = log_priors(targets.counts)
    for utt, scores in loglikes.items():
        i = cache.utts.index(utt)
        with torch.no_grad():
            whole, _ = model(torch.from_numpy(np.array(cache[i][:21]))[None], torch.tensor([21]))
        expected = torch.log_softmax(whole[0], -1).numpy() - priors
        assert scores.shape == (FRAMES[utt], 5)
        np.testing.assert_allclose(scores[:21], expected, atol=1e-5)  # first chunk: the model on those 21 frames
    assert result["frame_acc"] == pytest.approx(totals["correct"] / totals["frames"])
