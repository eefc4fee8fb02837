"""Log-mel filterbank features, extracted in parallel worker processes and cached on disk.

Two backends (``features.backend``): librosa's log-mel (Slaney mel scale, Hann window, no pre-emphasis, deltas
over 9 frames), and Kaldi's ``compute-fbank-feats`` + ``add-deltas`` exactly, through kaldi-native-fbank (HTK
mel scale, Povey window, pre-emphasis 0.97, DC removal; deltas over 5 frames, double deltas over 9), so a model
trained here sees the features a Kaldi recipe makes.

The cache of a data dir lives in ``<feat_root>/<name>-<key>/``, where the key hashes the feature config, the
sample rate and the data dir's audio entries: a rerun with the same inputs finds it and computes nothing, and
any change makes a new one. The features of a split are float32 rows in shards of about 1 GiB
(``feats-NNNNN.f32``) plus ``index.tsv`` (utt, speaker, shard, offset, frames) and ``stats.npz`` (per-speaker
sums for CMVN). Learners read the rows they need with pread() (FeatureCache), so memory does not grow with the
corpus. Normalization (CMVN) is applied when batches are built, so one cache serves every normalization mode.
"""

from __future__ import annotations

import errno
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import kaldi_native_fbank as knf
import librosa
import numpy as np
import soundfile
import soxr
from omegaconf import DictConfig, OmegaConf
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn

from recipe.lib.datadir import Utterance
from recipe.lib.kaldi_io import FeatsScp, pipe_command, read_cmvn_stats, read_pipe_audio
from recipe.lib.progress import progress_bar
from recipe.lib.tables import DataError


def feature_dim(conf: DictConfig) -> int:
    return conf.n_mels * (3 if conf.deltas else 1)


_LAST_PIPE: tuple[str, np.ndarray, int] | None = None  # segments of one recording follow each other: run it once


def load_audio(u: Utterance, sample_rate: int) -> np.ndarray:
    """Mono float32 samples of an utterance at sample_rate."""
    global _LAST_PIPE
    command = pipe_command(u.audio)
    try:
        if command is not None:
            if _LAST_PIPE is None or _LAST_PIPE[0] != command:
                _LAST_PIPE = (command, *read_pipe_audio(command, f"utterance {u.utt} ({u.audio})"))
            _, samples, rate = _LAST_PIPE
            wave = samples[int(round(u.start * rate)): None if u.end is None else int(round(u.end * rate))]
        else:
            info = soundfile.info(u.audio)
            start = int(round(u.start * info.samplerate))
            stop = None if u.end is None else int(round(u.end * info.samplerate))
            wave, rate = soundfile.read(u.audio, start=start, stop=stop, dtype="float32", always_2d=True)
    except DataError:
        raise
    except Exception as err:
        raise DataError(f"utterance {u.utt}: cannot read audio {u.audio}: {err}") from None
    wave = wave.mean(axis=1)
    if rate != sample_rate:
        wave = soxr.resample(wave, rate, sample_rate).astype(np.float32)
    if u.speed != 1.0:  # sox's `speed`: played u.speed times faster, pitch and tempo together
        wave = soxr.resample(wave, sample_rate * u.speed, sample_rate).astype(np.float32)
    return wave


def compute_features(wave: np.ndarray, sample_rate: int, conf: DictConfig) -> np.ndarray:
    """Samples -> (frames, dims) float32: log-mel (+ deltas + double deltas), by conf.backend. Frames as Kaldi's
    snip-edges: 1 + (samples - window) // shift, so nothing is invented past the ends."""
    win = int(round(sample_rate * conf.win_ms / 1000))
    if len(wave) < win:
        return np.zeros((0, feature_dim(conf)), np.float32)
    if conf.backend == "kaldi":
        logmel = kaldi_fbank(wave, sample_rate, conf)
        x = kaldi_deltas(logmel) if conf.deltas else logmel
    else:
        x = librosa_features(wave, sample_rate, conf)
    return np.ascontiguousarray(x, dtype=np.float32)


def librosa_features(wave: np.ndarray, sample_rate: int, conf: DictConfig) -> np.ndarray:
    win = int(round(sample_rate * conf.win_ms / 1000))
    hop = int(round(sample_rate * conf.hop_ms / 1000))
    # n_fft = window: every frame is exactly one window of samples (a power-of-two n_fft would make librosa
    # frame n_fft samples and lose frames at the end)
    mel = librosa.feature.melspectrogram(y=wave, sr=sample_rate, n_fft=win, hop_length=hop, win_length=win,
                                         center=False, n_mels=conf.n_mels, power=2.0)
    logmel = np.log(np.maximum(mel, 1e-10))  # (n_mels, frames)
    if conf.deltas:
        # 'nearest' edges: librosa's default 'interp' fails on utterances shorter than the 9-frame window
        d1 = librosa.feature.delta(logmel, width=9, order=1, mode="nearest")
        d2 = librosa.feature.delta(logmel, width=9, order=2, mode="nearest")
        logmel = np.concatenate([logmel, d1, d2])
    return logmel.T


def kaldi_fbank(wave: np.ndarray, sample_rate: int, conf: DictConfig) -> np.ndarray:
    """Kaldi's compute-fbank-feats with its defaults (Povey window, pre-emphasis 0.97, DC offset removed, FFT
    of the window rounded up to a power of two, HTK mel triangles from 20 Hz to Nyquist, log floored at float
    epsilon, snip-edges) -> (frames, n_mels). Dither off: Kaldi's default adds random noise, and a cache must be
    a pure function of its key."""
    opts = knf.FbankOptions()
    opts.frame_opts.samp_freq = sample_rate
    opts.frame_opts.frame_length_ms = conf.win_ms
    opts.frame_opts.frame_shift_ms = conf.hop_ms
    opts.frame_opts.dither = 0.0
    opts.mel_opts.num_bins = conf.n_mels
    fbank = knf.OnlineFbank(opts)
    # Kaldi reads 16-bit samples as they are (+-32768), librosa's floats are +-1: scaled so that the log-mels
    # are Kaldi's own values (a constant offset of ln(32768^2) = 20.8 otherwise, and a different floor)
    fbank.accept_waveform(sample_rate, np.asarray(wave, dtype=np.float32) * 32768)
    fbank.input_finished()
    return np.array([fbank.get_frame(t) for t in range(fbank.num_frames_ready)]).reshape(-1, conf.n_mels)


def kaldi_deltas(x: np.ndarray, order: int = 2, window: int = 2) -> np.ndarray:
    """Kaldi's add-deltas (DeltaFeatures in src/feat/feature-functions.cc): (frames, dim) -> (frames,
    dim x (order + 1)), [x, deltas, double deltas]. Order 1 is the regression sum_{n=-2..2} n x[t+n] / 10; order
    i is the order i-1 filter convolved with it (9 taps for order 2), and every filter reads the static features
    with frame indices clamped to the utterance. In the middle that equals applying the delta twice; within 4
    frames of an end it does not (the edge frames are replicated once, not at each pass)."""
    if not len(x):
        return np.zeros((0, x.shape[1] * (order + 1)))
    regression = np.arange(-window, window + 1) / float(2 * sum(n * n for n in range(1, window + 1)))
    filters = [np.ones(1)]
    for _ in range(order):
        filters.append(np.convolve(filters[-1], regression))
    frames = len(x)
    out = []
    for taps in filters:
        reach = len(taps) // 2
        padded = np.pad(x.astype(np.float64), ((reach, reach), (0, 0)), mode="edge")  # clamped indices
        out.append(sum(c * padded[k: k + frames] for k, c in enumerate(taps)))
    return np.concatenate(out, axis=1)


CACHE_FORMAT = 2  # in the key: a cache written in an older layout is never read as the new one
SHARD_BYTES = 1 << 30  # features are split into files of about this size (a 2000-hour corpus: ~750 of them)


def cache_key(utts: list[Utterance], conf: DictConfig, sample_rate: int) -> str:
    settings = OmegaConf.to_container(conf)
    if settings.get("backend") == "librosa":  # so the librosa caches written before the choice existed stay valid
        del settings["backend"]
    h = hashlib.sha1(json.dumps(settings, sort_keys=True).encode())
    h.update(f"{sample_rate} format{CACHE_FORMAT}".encode())
    for u in utts:
        h.update(f"{u.utt} {u.audio} {u.start} {u.end} {u.speed}\n".encode())
    return h.hexdigest()[:12]


class CacheWriter:
    """Writes a cache folder: features in shards of float32 rows, their index, and per-speaker sums for CMVN
    (gathered while writing, so no learner ever reads the whole corpus to normalize it)."""

    def __init__(self, folder: Path, dim: int, shard_bytes: int = SHARD_BYTES):
        self.folder, self.dim, self.shard_bytes = folder, dim, shard_bytes
        self.index = open(folder / "index.tsv", "w")
        self.shard, self.offset, self.frames = -1, 0, 0
        self.file = None
        self.sums: dict[str, list] = {}  # speaker -> [frames, sum, sum of squares] (float64)

    def add(self, utt: str, speaker: str, x: np.ndarray) -> None:
        if x.shape[1:] != (self.dim,):
            raise DataError(f"utterance {utt}: features of shape {x.shape}, expected (frames, {self.dim})")
        if self.file is None or self.offset * self.dim * 4 >= self.shard_bytes:
            self._next_shard()
        self.file.write(np.ascontiguousarray(x, dtype=np.float32).tobytes())
        self.index.write(f"{utt}\t{speaker}\t{self.shard}\t{self.offset}\t{len(x)}\n")
        self.offset += len(x)
        self.frames += len(x)
        s = self.sums.setdefault(speaker, [0, np.zeros(self.dim), np.zeros(self.dim)])
        x64 = x.astype(np.float64)
        s[0] += len(x)
        s[1] += x64.sum(0)
        s[2] += (x64 * x64).sum(0)

    def _next_shard(self) -> None:
        if self.file is not None:
            self.file.close()
        self.shard, self.offset = self.shard + 1, 0
        self.file = open(self.folder / f"feats-{self.shard:05d}.f32", "wb")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        self.index.close()
        speakers = sorted(self.sums)
        np.savez(self.folder / "stats.npz", speakers=np.array(speakers, dtype=str),
                 counts=np.array([self.sums[k][0] for k in speakers], dtype=np.float64).reshape(-1),
                 sums=np.array([self.sums[k][1] for k in speakers]).reshape(-1, self.dim),
                 sumsqs=np.array([self.sums[k][2] for k in speakers]).reshape(-1, self.dim))


@dataclass(frozen=True)
class _Job:
    utt: Utterance
    sample_rate: int
    conf: dict


def _extract_one(job: _Job) -> tuple[np.ndarray, float]:
    wave = load_audio(job.utt, job.sample_rate)
    return compute_features(wave, job.sample_rate, SimpleNamespace(**job.conf)), len(wave) / job.sample_rate


def _write_cache(writer: CacheWriter, jobs: list[_Job], name: str, workers: int, progress: bool) -> float:
    """Features of the jobs' utterances into the writer -> audio seconds."""
    t0 = time.perf_counter()
    audio_seconds = 0.0
    columns = [TextColumn(f"features {name}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[fps]:>8.0f} frames/s"), TimeRemainingColumn()]
    with mp.get_context("fork").Pool(max(1, workers)) as pool, progress_bar(*columns, enabled=progress) as bar:
        task = bar.add_task("", total=len(jobs), fps=0.0)
        # imap keeps utterance order, so the cache is identical whatever the number of workers
        for job, (x, seconds) in zip(jobs, pool.imap(_extract_one, jobs, chunksize=8)):
            writer.add(job.utt.utt, job.utt.speaker, x)
            audio_seconds += seconds
            bar.update(task, advance=1, fps=writer.frames / (time.perf_counter() - t0))
    return audio_seconds


def write_cache(out: Path, name: str, dim: int, fill: Callable[[CacheWriter], dict],
                shard_bytes: int = SHARD_BYTES) -> Path:
    """Build the cache folder `out` of split `name` with fill(writer) -> extra meta; it appears whole or not
    at all."""
    if (out / "meta.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    writer = CacheWriter(tmp, dim, shard_bytes)
    try:
        extra = fill(writer)
        writer.close()
    except BaseException as err:  # give the space back; a half-written cache is never reused anyway
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OSError(err.errno, f"{out}: features of {name} not written ({err.strerror}); nothing was "
                                     f"cached: free some space and rerun the features stage") from err
        raise
    meta = {"utterances": sum(1 for _ in open(tmp / "index.tsv")), "frames": writer.frames, "dim": dim,
            "wall_seconds": time.perf_counter() - t0, **extra}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def extract_features(utts: list[Utterance], feat_root: str | Path, name: str, conf: DictConfig,
                     sample_rate: int, progress: bool = True, shard_bytes: int = SHARD_BYTES) -> Path:
    """Features of utts into the cache -> the cache folder. Reuses an existing cache with the same key."""
    jobs = [_Job(u, sample_rate, OmegaConf.to_container(conf)) for u in utts]

    def fill(writer: CacheWriter) -> dict:
        t0 = time.perf_counter()
        audio_seconds = _write_cache(writer, jobs, name, conf.num_workers, progress)
        return {"audio_seconds": audio_seconds,
                "real_time_factor": (time.perf_counter() - t0) / max(audio_seconds, 1e-9),
                "config": OmegaConf.to_container(conf), "sample_rate": sample_rate}

    out = Path(feat_root) / f"{name}-{cache_key(utts, conf, sample_rate)}"
    return write_cache(out, name, feature_dim(conf), fill, shard_bytes)


def import_kaldi_features(utts: list[Utterance], feat_root: str | Path, name: str, feats_scp: Path,
                          cmvn_scp: Path | None = None, shard_bytes: int = SHARD_BYTES) -> Path:
    """Kaldi features (feats.scp, e.g. the paper's 40 fbank + deltas, FMLLR) copied into a cache, so training
    reads them like its own. With Kaldi's cmvn.scp (per speaker), its statistics replace the cache's sums."""
    h = hashlib.sha1(f"kaldi format{CACHE_FORMAT}".encode())
    for u in utts:
        h.update(f"{u.utt} {u.speaker} {u.feats}\n".encode())
    for path in (feats_scp, cmvn_scp):
        if path is not None:
            st = path.stat()
            h.update(f"{path.resolve()} {st.st_size} {st.st_mtime_ns}\n".encode())
    source = FeatsScp(feats_scp)
    first = source[utts[0].utt]

    def fill(writer: CacheWriter) -> dict:
        for u in utts:
            writer.add(u.utt, u.speaker, source[u.utt])
        if cmvn_scp is not None:
            stats = read_cmvn_stats(cmvn_scp)
            missing = sorted(set(writer.sums) - set(stats))
            if missing:
                raise DataError(f"{cmvn_scp}: no statistics for speaker(s) {missing[:5]} (utt2spk names them)")
            spk, (_, s1, _) = next(iter(stats.items()))
            if len(s1) != writer.dim:
                raise DataError(f"{cmvn_scp}: {spk}: statistics of {len(s1)} dims for features of {writer.dim}")
            writer.sums = {spk: list(stats[spk]) for spk in writer.sums}
        return {"source": str(feats_scp), "cmvn": str(cmvn_scp) if cmvn_scp else None}

    return write_cache(Path(feat_root) / f"{name}-{h.hexdigest()[:12]}", name, first.shape[1], fill, shard_bytes)


class FeatureCache:
    """Read side of a cache folder. Rows are read with pread(), not memory-mapped: the page cache still holds
    one copy for all learners, but a learner's resident memory stays the size of its batches however large the
    corpus (a mapping's touched pages count in its RSS until the kernel reclaims them)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.meta = json.loads((self.folder / "meta.json").read_text())
        self.dim = self.meta["dim"]
        utts, speakers, shards, offsets, frames = [], [], [], [], []
        with open(self.folder / "index.tsv") as index:
            for line in index:
                utt, speaker, shard, offset, n = line.rstrip("\n").split("\t")
                utts.append(utt)
                speakers.append(speaker)
                shards.append(int(shard))
                offsets.append(int(offset))
                frames.append(int(n))
        self.utts, self.speakers = utts, speakers
        self.shards = np.array(shards, dtype=np.int32)
        self.offsets = np.array(offsets, dtype=np.int64)
        self.frames = np.array(frames, dtype=np.int64)
        self._files: dict[int, int] = {}  # shard -> file descriptor, opened on first read

    def __len__(self) -> int:
        return len(self.utts)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.read(i)

    def read(self, i: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Frames start..stop of utterance i -> (frames, dim) float32 (read-only)."""
        stop = int(self.frames[i]) if stop is None else min(stop, int(self.frames[i]))
        shard = int(self.shards[i])
        if shard not in self._files:
            self._files[shard] = os.open(self.folder / f"feats-{shard:05d}.f32", os.O_RDONLY)
        row_bytes = self.dim * 4
        n = max(stop - start, 0) * row_bytes
        data = os.pread(self._files[shard], n, int(self.offsets[i] + start) * row_bytes)
        if len(data) != n:
            raise DataError(f"{self.folder}: feats-{shard:05d}.f32 is truncated (utterance {self.utts[i]}): "
                            f"delete the folder and rerun the features stage")
        return np.frombuffer(data, dtype=np.float32).reshape(-1, self.dim)

    def speaker_sums(self) -> dict[str, tuple[float, np.ndarray, np.ndarray]]:
        """{speaker: (frames, sum, sum of squares)} as gathered when the cache was written."""
        z = np.load(self.folder / "stats.npz")
        return {str(k): (float(n), s, q) for k, n, s, q in zip(z["speakers"], z["counts"], z["sums"], z["sumsqs"])}

    def __getstate__(self):  # file descriptors do not travel to other processes
        return {**self.__dict__, "_files": {}}


def cmvn_stats(cache: FeatureCache, mode: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{group: (mean, std)}: one group '*' for global, one per speaker; {} for none. Per-utterance statistics
    are computed from the utterance itself when it is read (utterance_cmvn)."""
    if mode in ("none", "utterance"):
        return {}
    sums = cache.speaker_sums()
    if mode == "global":
        sums = {"*": tuple(sum(v[j] for v in sums.values()) for j in range(3))}
    return {key: _mean_std(n, s1, s2) for key, (n, s1, s2) in sums.items()}


def _mean_std(n: float, s1: np.ndarray, s2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mean = s1 / max(n, 1)
    std = np.sqrt(np.maximum(s2 / max(n, 1) - mean * mean, 1e-8))
    return mean.astype(np.float32), std.astype(np.float32)


def utterance_cmvn(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x64 = x.astype(np.float64)
    return _mean_std(len(x), x64.sum(0), (x64 * x64).sum(0))
