"""Data augmentation: SpecAugment on training batches, speed perturbation at feature extraction.

SpecAugment (Park et al. 2019) masks bands of mel channels and spans of frames of every training utterance,
after normalization (a masked value is 0: the mean), with an optional time warp first. Masks are drawn from a
generator the training loop seeds with (seed, epoch, learner, step), so a run is reproducible and a resumed
run draws the same masks as an uninterrupted one. With deltas the feature vector is [mel | delta | delta^2];
a frequency mask blanks the same mel band in each of the three blocks.

Speed perturbation (Ko et al. 2015; Kaldi's `perturb_data_dir_speed.sh`): the training set is extracted again
at each factor (0.9: 10% slower, longer and lower), as utterances `sp0.9-<utt>` of speakers `sp0.9-<spk>`,
Kaldi's naming, so per-speaker normalization treats each speed as its own speaker.
"""

from __future__ import annotations

import re

import numpy as np
from omegaconf import DictConfig

from recipe.lib.datadir import Utterance

SPEED_PREFIX = re.compile(r"^sp(?P<factor>[0-9.]+)-")


class SpecAugment:
    def __init__(self, conf: DictConfig, block: int):
        """block: mel channels per block of the feature vector (n_mels; the deltas repeat the layout)."""
        self.conf = conf
        self.block = block

    @property
    def enabled(self) -> bool:
        c = self.conf
        return bool(c.time_warp or (c.freq_masks and c.freq_mask_width) or (c.time_masks and c.time_mask_width))

    def __call__(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """x (T, D) normalized features -> a masked copy (T, D)."""
        c = self.conf
        x = time_warp(x, c.time_warp, rng) if c.time_warp else x.copy()
        frames = len(x)
        for _ in range(c.freq_masks):
            width = int(rng.integers(0, c.freq_mask_width + 1))
            start = int(rng.integers(0, self.block - width + 1))
            for offset in range(0, x.shape[1], self.block):  # the same band of mel, delta, delta^2
                x[:, offset + start: offset + start + width] = 0.0
        # a time mask never covers more than time_mask_ratio of the utterance (short utterances keep speech)
        longest = min(c.time_mask_width, int(c.time_mask_ratio * frames))
        for _ in range(c.time_masks):
            width = int(rng.integers(0, longest + 1))
            start = int(rng.integers(0, frames - width + 1))
            x[start: start + width] = 0.0
        return x


def time_warp(x: np.ndarray, window: int, rng: np.random.Generator) -> np.ndarray:
    """Move a random point c of the time axis to c + w (|w| <= window), stretching one side and squeezing
    the other linearly (SpecAugment's warp, as ESPnet does it, without the image-warping library)."""
    frames = len(x)
    if frames <= 2 * window + 1:
        return x.copy()
    c = int(rng.integers(window + 1, frames - window))
    target = c + int(rng.integers(-window, window + 1))
    # where each output frame samples the input: [0, target) <- [0, c), [target, T) <- [c, T)
    src = np.concatenate([np.linspace(0, c, target, endpoint=False),
                          np.linspace(c, frames - 1, frames - target)])
    low = np.floor(src).astype(int)
    high = np.minimum(low + 1, frames - 1)
    frac = (src - low)[:, None].astype(x.dtype)
    return x[low] * (1 - frac) + x[high] * frac


def speed_perturbed(utts: list[Utterance], factors: list[float]) -> list[Utterance]:
    """The utterances at every speed factor (1.0 keeps the originals, unprefixed)."""
    out = []
    for f in factors:
        out += utts if f == 1.0 else [Utterance(f"sp{f}-{u.utt}", f"sp{f}-{u.speaker}", u.audio, u.text, u.start,
                                                u.end, speed=f) for u in utts]
    return out


def source_utt(utt: str) -> str:
    """The utterance a speed-perturbed copy was made from (itself for an original)."""
    return SPEED_PREFIX.sub("", utt, count=1)
