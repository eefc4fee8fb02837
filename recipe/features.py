"""Log-mel filterbank features with librosa, extracted in parallel worker processes and cached on disk.

The cache of a data dir lives in ``<feat_root>/<name>-<key>/``, where the key hashes the feature config, the
sample rate and the data dir's audio entries: a rerun with the same inputs finds it and computes nothing, and
any change makes a new one. The features of a split are one flat float32 file (``feats.f32``, memory-mapped by
every learner, so the page cache holds one copy) plus ``index.tsv`` (utt, speaker, offset, frames).
Normalization (CMVN) is applied when batches are built, so one cache serves every normalization mode.
"""

from __future__ import annotations

import errno
import hashlib
import json
import multiprocessing as mp
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import librosa
import numpy as np
import soundfile
import soxr
from omegaconf import DictConfig, OmegaConf
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn

from recipe.data import DataError, Utterance
from recipe.progress import progress_bar


def feature_dim(conf: DictConfig) -> int:
    return conf.n_mels * (3 if conf.deltas else 1)


def load_audio(u: Utterance, sample_rate: int) -> np.ndarray:
    """Mono float32 samples of an utterance at sample_rate."""
    try:
        info = soundfile.info(u.audio)
        start = int(round(u.start * info.samplerate))
        stop = None if u.end is None else int(round(u.end * info.samplerate))
        wave, rate = soundfile.read(u.audio, start=start, stop=stop, dtype="float32", always_2d=True)
    except Exception as err:
        raise DataError(f"utterance {u.utt}: cannot read audio {u.audio}: {err}") from None
    wave = wave.mean(axis=1)
    if rate != sample_rate:
        wave = soxr.resample(wave, rate, sample_rate).astype(np.float32)
    if u.speed != 1.0:  # sox's `speed`: played u.speed times faster, pitch and tempo together
        wave = soxr.resample(wave, sample_rate * u.speed, sample_rate).astype(np.float32)
    return wave


def compute_features(wave: np.ndarray, sample_rate: int, conf: DictConfig) -> np.ndarray:
    """Samples -> (frames, dims) float32: log-mel (+ deltas + double deltas). Frames as Kaldi's snip-edges:
    1 + (samples - window) // shift, so nothing is invented past the ends."""
    win = int(round(sample_rate * conf.win_ms / 1000))
    hop = int(round(sample_rate * conf.hop_ms / 1000))
    if len(wave) < win:
        return np.zeros((0, feature_dim(conf)), np.float32)
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
    return np.ascontiguousarray(logmel.T, dtype=np.float32)


def cache_key(utts: list[Utterance], conf: DictConfig, sample_rate: int) -> str:
    h = hashlib.sha1(json.dumps(OmegaConf.to_container(conf), sort_keys=True).encode())
    h.update(str(sample_rate).encode())
    for u in utts:
        h.update(f"{u.utt} {u.audio} {u.start} {u.end} {u.speed}\n".encode())
    return h.hexdigest()[:12]


@dataclass(frozen=True)
class _Job:
    utt: Utterance
    sample_rate: int
    conf: dict


def _extract_one(job: _Job) -> tuple[np.ndarray, float]:
    wave = load_audio(job.utt, job.sample_rate)
    return compute_features(wave, job.sample_rate, SimpleNamespace(**job.conf)), len(wave) / job.sample_rate


def _write_cache(tmp: Path, jobs: list[_Job], name: str, workers: int, progress: bool) -> tuple[int, float]:
    """Features of the jobs' utterances into tmp/feats.f32 and tmp/index.tsv -> (frames, audio seconds)."""
    t0 = time.perf_counter()
    offset, audio_seconds = 0, 0.0
    columns = [TextColumn(f"features {name}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[fps]:>8.0f} frames/s"), TimeRemainingColumn()]
    with open(tmp / "feats.f32", "wb") as feats, open(tmp / "index.tsv", "w") as index, \
            mp.get_context("fork").Pool(max(1, workers)) as pool, progress_bar(*columns, enabled=progress) as bar:
        task = bar.add_task("", total=len(jobs), fps=0.0)
        # imap keeps utterance order, so the cache is identical whatever the number of workers
        for job, (x, seconds) in zip(jobs, pool.imap(_extract_one, jobs, chunksize=8)):
            feats.write(x.tobytes())
            index.write(f"{job.utt.utt}\t{job.utt.speaker}\t{offset}\t{len(x)}\n")
            offset += len(x)
            audio_seconds += seconds
            bar.update(task, advance=1, fps=offset / (time.perf_counter() - t0))
    return offset, audio_seconds


def extract_features(utts: list[Utterance], feat_root: str | Path, name: str, conf: DictConfig,
                     sample_rate: int, progress: bool = True) -> Path:
    """Features of utts into the cache -> the cache folder. Reuses an existing cache with the same key."""
    out = Path(feat_root) / f"{name}-{cache_key(utts, conf, sample_rate)}"
    if (out / "meta.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    jobs = [_Job(u, sample_rate, OmegaConf.to_container(conf)) for u in utts]
    t0 = time.perf_counter()
    try:
        offset, audio_seconds = _write_cache(tmp, jobs, name, conf.num_workers, progress)
    except BaseException as err:  # give the space back; a half-written cache is never reused anyway
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OSError(err.errno, f"{out}: features of {name} not written ({err.strerror}); nothing was "
                                     f"cached: free some space and rerun the features stage") from err
        raise
    wall = time.perf_counter() - t0
    meta = {"utterances": len(utts), "frames": offset, "dim": feature_dim(conf), "audio_seconds": audio_seconds,
            "wall_seconds": wall, "real_time_factor": wall / max(audio_seconds, 1e-9),
            "config": OmegaConf.to_container(conf), "sample_rate": sample_rate}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # the cache appears whole or not at all
    return out


class FeatureCache:
    """Read side of a cache folder: memory-mapped features by utterance."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.meta = json.loads((self.folder / "meta.json").read_text())
        self.dim = self.meta["dim"]
        rows = [line.split("\t") for line in (self.folder / "index.tsv").read_text().splitlines()]
        self.utts = [r[0] for r in rows]
        self.speakers = [r[1] for r in rows]
        self.offsets = np.array([int(r[2]) for r in rows], dtype=np.int64)
        self.frames = np.array([int(r[3]) for r in rows], dtype=np.int64)
        total = int(self.frames.sum())
        self.data = np.memmap(self.folder / "feats.f32", dtype=np.float32, mode="r", shape=(total, self.dim)) \
            if total else np.zeros((0, self.dim), np.float32)

    def __len__(self) -> int:
        return len(self.utts)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.data[self.offsets[i]: self.offsets[i] + self.frames[i]]


def cmvn_stats(cache: FeatureCache, mode: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{group: (mean, std)}: one group '*' for global, one per speaker or per utterance; {} for none."""
    if mode == "none":
        return {}
    groups = {"global": lambda i: "*", "speaker": lambda i: cache.speakers[i],
              "utterance": lambda i: cache.utts[i]}[mode]
    sums: dict[str, list] = {}
    for i in range(len(cache)):
        x = cache[i].astype(np.float64)
        s = sums.setdefault(groups(i), [0, np.zeros(cache.dim), np.zeros(cache.dim)])
        s[0] += len(x)
        s[1] += x.sum(0)
        s[2] += (x * x).sum(0)
    stats = {}
    for key, (n, s1, s2) in sums.items():
        mean = s1 / max(n, 1)
        std = np.sqrt(np.maximum(s2 / max(n, 1) - mean * mean, 1e-8))
        stats[key] = (mean.astype(np.float32), std.astype(np.float32))
    return stats
