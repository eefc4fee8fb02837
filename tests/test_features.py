"""Feature shapes, resampling, normalization and the on-disk cache; the Kaldi backend against Kaldi's algorithm."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile
from omegaconf import OmegaConf

from model.lstm import LSTMAcousticModel
from recipe.evaluate import evaluate
from recipe.lib.config import FeatureConf
from recipe.lib.datadir import load_data_dir
from recipe.lib.dataset import BucketBatchSampler, CTCDataset, FeatureReader
from recipe.lib.features import (FeatureCache, cache_key, cmvn_stats, compute_features, extract_features, kaldi_deltas,
                                 load_audio)
from tests.test_data import make_dir

CONF = OmegaConf.structured(FeatureConf)
KALDI = OmegaConf.merge(CONF, {"backend": "kaldi"})


@pytest.mark.parametrize("backend", ["librosa", "kaldi"])
def test_shapes_follow_window_and_shift(backend):
    conf = OmegaConf.merge(CONF, {"backend": backend})
    wave = np.random.default_rng(0).standard_normal(16000).astype(np.float32)
    x = compute_features(wave, 16000, conf)
    assert x.shape == (1 + (16000 - 400) // 160, 120) and x.dtype == np.float32
    assert np.isfinite(x).all()
    no_deltas = compute_features(wave, 16000, OmegaConf.merge(conf, {"deltas": False}))
    np.testing.assert_array_equal(no_deltas, x[:, :40])  # deltas are appended after the static log-mels
    assert compute_features(wave[:399], 16000, conf).shape == (0, 120)  # shorter than one window


def tone_utterance(root, rate: int, utt: str = "u", speaker: str | None = None):
    """One second of a 440 Hz tone at `rate`, as the only utterance of a data dir -> its Utterance."""
    t = np.arange(rate) / rate
    soundfile.write(root / "tone.wav", 0.3 * np.sin(2 * np.pi * 440 * t), rate)
    (root / "d").mkdir()
    (root / "d" / "wav.scp").write_text(f"{utt} {root / 'tone.wav'}\n")
    (root / "d" / "text").write_text(f"{utt} la\n")
    if speaker:
        (root / "d" / "utt2spk").write_text(f"{utt} {speaker}\n")
    return load_data_dir(root / "d")[0][0]


def test_audio_at_any_rate_is_resampled(tmp_path):
    utt = tone_utterance(tmp_path, 8000)
    wave = load_audio(utt, 16000)
    assert len(wave) == 16000
    spectrum = np.abs(np.fft.rfft(wave))
    assert abs(np.argmax(spectrum) * 16000 / len(wave) - 440) < 2  # still a 440 Hz tone


def test_cache_is_reused_and_keyed_by_config(tmp_path):
    utts, _ = load_data_dir(make_dir(tmp_path, {f"s{i % 2}-u{i}": "a b" for i in range(6)}))
    first = extract_features(utts, tmp_path / "feats", "train", CONF, 16000, progress=False)
    stamp = (first / "feats-00000.f32").stat().st_mtime_ns
    again = extract_features(utts, tmp_path / "feats", "train", CONF, 16000, progress=False)
    assert again == first and (first / "feats-00000.f32").stat().st_mtime_ns == stamp  # found, not recomputed
    other = extract_features(utts, tmp_path / "feats", "train", OmegaConf.merge(CONF, {"n_mels": 24}), 16000,
                             progress=False)
    assert other != first and FeatureCache(other).dim == 72
    kaldi = extract_features(utts, tmp_path / "feats", "train", KALDI, 16000, progress=False)
    assert kaldi not in (first, other)  # one backend's cache is never read as the other's
    assert not np.allclose(FeatureCache(kaldi)[0], FeatureCache(first)[0], atol=1.0)
    one_worker = extract_features(utts, tmp_path / "feats1", "train", OmegaConf.merge(CONF, {"num_workers": 1}),
                                  16000, progress=False)
    cache, cache1 = FeatureCache(first), FeatureCache(one_worker)
    assert cache.utts == [u.utt for u in utts] and len(cache) == 6
    for i in range(len(cache)):  # same bytes whatever the number of workers
        np.testing.assert_array_equal(cache[i], cache1[i])


def test_shards_and_ranges_read_what_was_written(tmp_path):
    """Tiny shards: every utterance lands whole in one shard, ranges read the right rows, and the per-speaker
    sums gathered while writing equal the features' own."""
    utts, _ = load_data_dir(make_dir(tmp_path, {f"s{i % 2}-u{i}": "a b" for i in range(6)}))
    whole = FeatureCache(extract_features(utts, tmp_path / "one", "train", CONF, 16000, progress=False))
    sharded = FeatureCache(extract_features(utts, tmp_path / "many", "train", CONF, 16000, progress=False,
                                            shard_bytes=whole.dim * 4 * 150))
    assert len(set(sharded.shards.tolist())) > 2 and len(set(whole.shards.tolist())) == 1
    for i in range(len(whole)):
        np.testing.assert_array_equal(sharded[i], whole[i])
        np.testing.assert_array_equal(sharded.read(i, 5, 17), whole[i][5:17])
    assert sharded.read(0, 90, 10_000).shape == (whole.frames[0] - 90, whole.dim)  # stop is clipped
    for speaker, (n, s1, s2) in sharded.speaker_sums().items():
        x = np.concatenate([whole[i] for i in range(len(whole)) if whole.speakers[i] == speaker]).astype(np.float64)
        assert n == len(x)
        np.testing.assert_allclose(s1, x.sum(0), rtol=1e-9)
        np.testing.assert_allclose(s2, (x * x).sum(0), rtol=1e-9)


def test_normalization_modes(tmp_path):
    utts, _ = load_data_dir(make_dir(tmp_path, {f"s{i % 2}-u{i}": "a b" for i in range(6)}, seconds=0.5))
    cache = FeatureCache(extract_features(utts, tmp_path / "f", "train", CONF, 16000, progress=False))
    tokens = ["<blank>", " ", "a", "b"]
    texts = {u.utt: u.text for u in utts}
    for mode, group_of in (("global", lambda u: "*"), ("speaker", lambda u: u.split("-")[0]),
                           ("utterance", lambda u: u)):
        data = CTCDataset(FeatureReader(cache, mode), texts, tokens, stack=1)
        groups: dict[str, list] = {}
        for k in range(len(data)):
            groups.setdefault(group_of(data.utt(k)), []).append(data.features(k))
        for x in groups.values():
            x = np.concatenate(x)
            np.testing.assert_allclose(x.mean(0), 0, atol=1e-3)
            np.testing.assert_allclose(x.std(0), 1, atol=1e-2)
    raw = CTCDataset(FeatureReader(cache, "none"), texts, tokens, stack=1)
    np.testing.assert_array_equal(raw.features(0), cache[0])
    assert set(cmvn_stats(cache, "speaker")) == {"s0", "s1"}


def test_too_short_for_ctc_is_skipped_and_counted(tmp_path):
    utts, _ = load_data_dir(make_dir(tmp_path, {"s-a": "a b a", "s-b": "aaaa aaaa aaaa"}, seconds=0.1))
    cache = FeatureCache(extract_features(utts, tmp_path / "f", "x", CONF, 16000, progress=False))
    data = CTCDataset(FeatureReader(cache, "none"), {u.utt: u.text for u in utts}, ["<blank>", " ", "a", "b"], stack=1)
    # 8 frames: enough for 5 tokens, not for 14 tokens with 6 repeats needing blanks in between
    assert [data.utt(k) for k in range(len(data))] == ["s-a"] and data.skipped == {"too_short_for_ctc": 1}
    # a held-out set keeps it: decoded and counted in the error rates, left out of the loss
    tokens = ["<blank>", " ", "a", "b"]
    held_out = CTCDataset(FeatureReader(cache, "none"), {u.utt: u.text for u in utts}, tokens, stack=1,
                          keep_too_short=True)
    assert len(held_out) == 2 and held_out.scorable == [True, False] and not held_out.skipped
    model = LSTMAcousticModel(cache.dim, len(tokens), layers=1, hidden=8)
    both, decoded = evaluate(model, held_out, [[0, 1]], tokens)
    alone, _ = evaluate(model, held_out, [[0]], tokens)
    assert both["loss_sum"] == pytest.approx(alone["loss_sum"]) and both["tokens"] == alone["tokens"] == 5
    assert both["utterances"] == 2 and both["words"] == 6 and len(decoded) == 2


def test_sampler_shards_by_global_rank():
    lengths = np.random.default_rng(0).integers(50, 500, size=103)
    samplers = [BucketBatchSampler(lengths, 4, rank=r, world_size=3, seed=1) for r in range(3)]
    per_rank = [s.rank_batches(2) for s in samplers]
    assert len({len(b) for b in per_rank}) == 1 == len({len(s) for s in samplers})  # equal step counts
    seen = [i for batches in per_rank for b in batches for i in b]
    assert len(seen) == len(set(seen)) >= 103 - 3 * 4  # disjoint, at most a few batches dropped
    as_lists = lambda batches: [b.tolist() for b in batches]  # noqa: E731
    assert as_lists(samplers[0].rank_batches(2)) == as_lists(per_rank[0])  # a pure function of (seed, epoch)
    assert as_lists(samplers[0].rank_batches(3)) != as_lists(per_rank[0])  # reshuffled every epoch
    spread = [np.ptp(lengths[b]) / lengths[b].mean() for batches in per_rank for b in batches]
    assert np.median(spread) < 0.3  # bucketed: similar lengths in a batch
    whole = [s.whole().epoch_batches(2) for s in samplers]  # what ADPSGD's learners deal out among themselves
    assert as_lists(whole[0]) == as_lists(whole[2])  # the same list on every rank ...
    assert sorted(i for b in whole[0] for i in b) == list(range(103))  # ... with every utterance once


def test_a_full_disk_while_writing_features_is_a_clear_error_and_leaves_nothing(tmp_path, monkeypatch):
    import errno

    import pytest

    import recipe.lib.features as features

    utts, _ = load_data_dir(make_dir(tmp_path, {f"s{i % 2}-u{i}": "a b" for i in range(4)}))
    real_open = open

    class FullDisk:
        def __init__(self, f):
            self.f, self.written = f, 0

        def write(self, data):
            self.written += len(data)
            if self.written > 1000:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(features, "open", lambda *a, **k: FullDisk(real_open(*a, **k)), raising=False)
    with pytest.raises(OSError, match=r"features of train not written \(No space left on device\); nothing was "
                                      r"cached: free some space and rerun the features stage"):
        extract_features(utts, tmp_path / "feats", "train", CONF, 16000, progress=False)
    assert list((tmp_path / "feats").iterdir()) == []  # no half-written cache, no temporary folder


def test_a_truncated_shard_is_named(tmp_path):
    import pytest

    from recipe.lib.tables import DataError

    utts, _ = load_data_dir(make_dir(tmp_path, {f"s0-u{i}": "a b" for i in range(2)}))
    folder = extract_features(utts, tmp_path / "f", "train", CONF, 16000, progress=False)
    shard = folder / "feats-00000.f32"
    shard.write_bytes(shard.read_bytes()[:-4])
    with pytest.raises(DataError, match=r"feats-00000\.f32 is truncated \(utterance s0-u1\)"):
        FeatureCache(folder)[1]


def test_librosa_caches_from_before_the_backend_choice_keep_their_key(tmp_path):
    utts, _ = load_data_dir(make_dir(tmp_path, {"s-u": "a"}))
    before = OmegaConf.create({k: v for k, v in OmegaConf.to_container(CONF).items() if k != "backend"})
    assert cache_key(utts, CONF, 16000) == cache_key(utts, before, 16000)
    assert cache_key(utts, KALDI, 16000) != cache_key(utts, CONF, 16000)


def kaldi_mel(hz):
    return 1127.0 * np.log(1.0 + hz / 700.0)  # HTK's mel scale, as Kaldi's MelScale


def kaldi_fbank_frame(samples: np.ndarray, rate: int, n_mels: int) -> np.ndarray:
    """One frame of Kaldi's compute-fbank-feats (defaults, dither 0) written out from its algorithm: samples as
    Kaldi reads them (16-bit scale) -> n_mels log energies."""
    x = samples.astype(np.float64) - samples.mean()  # DC offset removed first
    x = np.concatenate([[x[0] - 0.97 * x[0]], x[1:] - 0.97 * x[:-1]])  # pre-emphasis; the first sample against itself
    n = len(x)
    x *= (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / (n - 1))) ** 0.85  # Povey window
    fft = 1 << (n - 1).bit_length()  # zero-padded to a power of two: 400 -> 512
    power = np.abs(np.fft.rfft(x, fft))[: fft // 2] ** 2  # Kaldi's banks use the bins below Nyquist
    edges = kaldi_mel(20.0) + np.arange(n_mels + 2) * (kaldi_mel(rate / 2) - kaldi_mel(20.0)) / (n_mels + 1)
    left, centre, right = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    mel = kaldi_mel(np.arange(fft // 2) * rate / fft)[None, :]
    rising = np.where((mel > left) & (mel <= centre), (mel - left) / (centre - left), 0.0)
    falling = np.where((mel > centre) & (mel < right), (right - mel) / (right - centre), 0.0)
    return np.log(np.maximum((rising + falling) @ power, np.finfo(np.float32).eps))


def test_kaldi_fbank_is_kaldis_algorithm():
    """A tone at the centre frequency of mel bin 10, with a little noise so every bin has energy: each frame
    matches the hand computation, and bin 10 holds the most energy."""
    rate, n_mels = 16000, 40
    lo, hi = kaldi_mel(20.0), kaldi_mel(rate / 2)
    tone = 700.0 * (np.exp((lo + 11 * (hi - lo) / (n_mels + 1)) / 1127.0) - 1.0)  # centre of bin 10 (0-based)
    t = np.arange(rate // 4) / rate
    noise = np.random.default_rng(0).standard_normal(len(t))
    wave = (0.5 * np.sin(2 * np.pi * tone * t) + 0.01 * noise).astype(np.float32)
    x = compute_features(wave, rate, OmegaConf.merge(KALDI, {"deltas": False}))
    assert x.shape == (1 + (len(wave) - 400) // 160, n_mels)
    for frame in (0, 7, len(x) - 1):
        by_hand = kaldi_fbank_frame(wave[frame * 160: frame * 160 + 400] * 32768.0, rate, n_mels)
        np.testing.assert_allclose(x[frame], by_hand, atol=1e-3)
    assert (x.argmax(axis=1) == 10).all()


def test_kaldi_fbank_of_silence_is_the_log_floor_and_deterministic():
    """Dither is off: digital silence gives ln(float epsilon) in every bin, every time (Kaldi's default dither
    would add noise), and its deltas are zero."""
    x = compute_features(np.zeros(1600, np.float32), 16000, KALDI)
    np.testing.assert_allclose(x[:, :40], np.log(np.finfo(np.float32).eps), rtol=1e-6)
    np.testing.assert_allclose(x[:, 40:], 0.0, atol=1e-5)  # rounding of the taps (2/10 is inexact)
    wave = np.random.default_rng(1).standard_normal(4000).astype(np.float32)
    np.testing.assert_array_equal(compute_features(wave, 16000, KALDI), compute_features(wave, 16000, KALDI))


def test_kaldi_deltas_of_a_ramp():
    """x[t] = t. Deltas: sum_{n=-2..2} n x[clamp(t+n)] / 10, so 1 in the middle and (1 + 2*2) / 10 = 0.5,
    (2 + 2*3) / 10 = 0.8 at the first frames (indices clamped). Double deltas: the 9-tap filter Kaldi convolves,
    [4, 4, 1, -4, -10, -4, 1, 4, 4] / 100, over the clamped ramp: 0 in the middle, (-4*1 + 1*2 + 4*3 + 4*4) / 100
    = 0.26 at frame 0, then 0.21, 0.12, 0.04; the end mirrors the start with the opposite sign."""
    ramp = np.arange(12, dtype=np.float64)[:, None]
    out = kaldi_deltas(ramp)
    np.testing.assert_allclose(out[:, 0], ramp[:, 0])
    np.testing.assert_allclose(out[:, 1], [0.5, 0.8] + [1.0] * 8 + [0.8, 0.5], atol=1e-12)
    np.testing.assert_allclose(out[:, 2], [0.26, 0.21, 0.12, 0.04] + [0.0] * 4 + [-0.04, -0.12, -0.21, -0.26],
                               atol=1e-12)
    assert kaldi_deltas(np.zeros((0, 4))).shape == (0, 12)  # no frames: no edge to replicate


def test_kaldi_double_deltas_equal_deltas_twice_only_away_from_the_ends():
    """The convolved filter is the delta applied twice wherever no index is clamped (4 frames from each end);
    at the ends, applying it twice would replicate the deltas' edge frames instead of the features' (0.13, not
    0.26, at frame 0 of a ramp)."""
    x = np.random.default_rng(2).standard_normal((20, 3))
    once = kaldi_deltas(x, order=1)[:, 3:]
    twice = kaldi_deltas(once, order=1)[:, 3:]
    double = kaldi_deltas(x)[:, 6:]
    np.testing.assert_allclose(double[4:-4], twice[4:-4], atol=1e-12)
    ramp = np.arange(12, dtype=np.float64)[:, None]
    assert kaldi_deltas(kaldi_deltas(ramp, order=1)[:, 1:], order=1)[0, 1] == pytest.approx(0.13)
    assert kaldi_deltas(ramp)[0, 2] == pytest.approx(0.26)
