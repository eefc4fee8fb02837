"""SpecAugment, time warp and speed perturbation: shapes, what is masked, determinism under a seed."""

from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf

from recipe.lib.augment import SpecAugment, source_utt, speed_perturbed, time_warp
from recipe.lib.config import AugmentConf, ConfigError, FeatureConf, load_config
from recipe.lib.features import load_audio
from tests.test_features import tone_utterance

MASKS = OmegaConf.merge(OmegaConf.structured(AugmentConf),
                        {"freq_masks": 2, "freq_mask_width": 5, "time_masks": 2, "time_mask_width": 10})


def features(frames: int = 100, n_mels: int = 8) -> np.ndarray:
    """(frames, 3 n_mels) with no zero anywhere, so every zero afterwards is a mask."""
    return np.random.default_rng(1).uniform(1.0, 2.0, (frames, 3 * n_mels)).astype(np.float32)


def test_masks_keep_the_shape_and_blank_the_same_band_in_every_delta_block():
    x = features()
    y = SpecAugment(MASKS, block=8)(x, np.random.default_rng(0))
    assert y.shape == x.shape and y.dtype == x.dtype
    assert (x > 0).all()  # the input is untouched
    masked_columns = (y == 0).all(axis=0)
    mel, delta, delta2 = masked_columns.reshape(3, 8)
    assert mel.any() and (mel == delta).all() and (mel == delta2).all()
    assert mel.sum() <= 2 * 5  # 2 bands of at most 5 channels
    masked_rows = (y == 0).all(axis=1)
    assert 0 < masked_rows.sum() <= 2 * 10  # 2 spans of at most 10 frames (20% of 100 frames = 20)
    # outside the masks nothing changed
    keep = ~masked_rows[:, None] & ~masked_columns[None, :]
    np.testing.assert_array_equal(y[keep], np.broadcast_to(x, y.shape)[keep])


def test_a_time_mask_never_takes_more_than_its_ratio_of_a_short_utterance():
    conf = OmegaConf.merge(MASKS, {"freq_masks": 0, "time_masks": 1, "time_mask_width": 50, "time_mask_ratio": 0.1})
    aug = SpecAugment(conf, block=8)
    for seed in range(50):
        y = aug(features(frames=30), np.random.default_rng(seed))
        assert (y == 0).all(axis=1).sum() <= 3  # 10% of 30 frames


def test_the_same_generator_seed_draws_the_same_masks_and_another_seed_others():
    x, aug = features(), SpecAugment(OmegaConf.merge(MASKS, {"time_warp": 5}), block=8)
    a = aug(x, np.random.default_rng([0, 3, 1, 7]))
    np.testing.assert_array_equal(a, aug(x, np.random.default_rng([0, 3, 1, 7])))
    assert not np.array_equal(a, aug(x, np.random.default_rng([0, 3, 1, 8])))


def test_time_warp_keeps_the_length_and_the_ends_and_moves_a_point():
    ramp = np.arange(50, dtype=np.float32)[:, None].repeat(4, axis=1)  # frame t holds the value t
    warped = time_warp(ramp, 5, np.random.default_rng(3))
    assert warped.shape == ramp.shape
    assert warped[0, 0] == 0.0 and warped[-1, 0] == 49.0
    assert np.all(np.diff(warped[:, 0]) > 0)  # still monotonic: stretched and squeezed, never reordered
    assert not np.allclose(warped, ramp)
    np.testing.assert_array_equal(time_warp(ramp[:8], 5, np.random.default_rng(3)), ramp[:8])  # too short


def test_disabled_augmentation_says_so():
    assert not SpecAugment(OmegaConf.structured(AugmentConf), block=40).enabled
    assert SpecAugment(MASKS, block=40).enabled


def test_speed_perturbation_names_copies_kaldi_style_and_changes_the_length(tmp_path):
    copies = speed_perturbed([tone_utterance(tmp_path, 16000, "spk1-u1", "spk1")], [0.9, 1.0, 1.1])
    assert [(u.utt, u.speaker, u.speed) for u in copies] == [
        ("sp0.9-spk1-u1", "sp0.9-spk1", 0.9), ("spk1-u1", "spk1", 1.0), ("sp1.1-spk1-u1", "sp1.1-spk1", 1.1)]
    assert [source_utt(u.utt) for u in copies] == ["spk1-u1"] * 3
    slow, fast = load_audio(copies[0], 16000), load_audio(copies[2], 16000)
    assert len(slow) == pytest.approx(16000 / 0.9, abs=2) and len(fast) == pytest.approx(16000 / 1.1, abs=2)
    spectrum = np.abs(np.fft.rfft(fast))  # faster is higher: 440 Hz x 1.1
    assert abs(np.argmax(spectrum) * 16000 / len(fast) - 484) < 3


def test_bad_augmentation_settings_are_refused_by_name():
    with pytest.raises(ConfigError, match="augment.speed_perturb"):
        load_config(None, ["augment.speed_perturb=[1.0,1.0]"])
    with pytest.raises(ConfigError, match="augment.freq_mask_width"):
        load_config(None, [f"augment.freq_mask_width={OmegaConf.structured(FeatureConf).n_mels + 1}"])
    with pytest.raises(ConfigError, match="decode.average_best"):
        load_config(None, ["decode.average_best=5", "train.keep_checkpoints=3"])
    with pytest.raises(ConfigError, match="needs a beam search"):
        load_config(None, ["decode.beam=0", "decode.lm_order=3"])
    for bad in (["decode.oov_penalty=-1"], ["decode.oov_penalty=10", "decode.lm_order=0"]):
        with pytest.raises(ConfigError, match="decode.oov_penalty"):
            load_config(None, bad)


def test_unset_augmentation_follows_the_corpus_and_a_setting_wins(tmp_path):
    synth, recorded = load_config(None, []).augment, load_config(None, ["data.corpus=fsdd"]).augment
    assert (list(synth.speed_perturb), synth.freq_masks, synth.time_masks, synth.time_warp) == ([1.0], 0, 0, 0)
    assert (list(recorded.speed_perturb), recorded.freq_masks, recorded.time_masks, recorded.time_warp) == (
        [0.9, 1.0, 1.1], 2, 2, 5)
    mine = load_config(None, ["data.corpus=fsdd", "augment.time_warp=0", "augment.speed_perturb=[1.0]"]).augment
    assert (list(mine.speed_perturb), mine.freq_masks, mine.time_warp) == ([1.0], 2, 0)
    assert load_config(None, ["augment.freq_masks=3"]).augment.freq_masks == 3  # the built-in corpus too
    # frame CE's alignments and a data dir's own Kaldi features: nothing that moves frames or needs audio
    ce = load_config(None, ["data.corpus=fsdd", "train.objective=ce", "model.stack=1"]).augment
    assert (list(ce.speed_perturb), ce.time_warp, ce.freq_masks) == ([1.0], 0, 2)
    (tmp_path / "feats.scp").write_text("u1 feats.ark:5\n")
    kaldi = load_config(None, ["data.corpus=kaldi", f"data.train_dir={tmp_path}", f"data.test_dir={tmp_path}"])
    assert list(kaldi.augment.speed_perturb) == [1.0] and kaldi.augment.time_warp == 5
