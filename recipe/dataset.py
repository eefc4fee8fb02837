"""Batches for CTC training: normalized features and character targets, bucketed by length, sharded by rank.

The sampler works on the GLOBAL rank and world size, never on DeepSpeed's data-parallel group (DESIGN.md
trap 4: with node groups every node would otherwise read the same data). Batches hold utterances of similar
length so padding stays small (trap 13), and every rank gets the same number of batches so a synchronous
allreduce never waits on a rank that has run out.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from typing import Callable, Optional

import numpy as np
import torch

from recipe.features import FeatureCache, cmvn_stats

log = logging.getLogger(__name__)


def ctc_min_steps(target: list[int]) -> int:
    """Fewest output steps CTC needs: one per token plus a blank between equal neighbours."""
    return len(target) + sum(a == b for a, b in zip(target, target[1:]))


class CTCDataset:
    """Utterances of a feature cache with their token targets. An utterance too short for CTC to align its
    transcript at the model's frame rate is dropped from training and counted; a held-out set keeps it
    (keep_too_short), so it is decoded and counted in the error rates though the loss cannot score it."""

    def __init__(self, cache: FeatureCache, texts: dict[str, str], tokens: list[str], cmvn: str, stack: int,
                 global_stats: Optional[tuple[np.ndarray, np.ndarray]] = None, keep_too_short: bool = False,
                 augment: Optional[Callable[[np.ndarray, np.random.Generator], np.ndarray]] = None):
        self.cache = cache
        self.augment = augment  # applied by collate() when given a generator (training batches)
        index = {t: i for i, t in enumerate(tokens)}
        self.cmvn = cmvn
        self.stats = cmvn_stats(cache, cmvn) if cmvn != "global" or global_stats is None else {"*": global_stats}
        self.skipped: Counter = Counter()
        self.items: list[int] = []
        self.targets: list[list[int]] = []
        self.texts: list[str] = []
        self.scorable: list[bool] = []  # the CTC loss can align the transcript
        for i, utt in enumerate(cache.utts):
            target = [index[c] for c in texts[utt]]
            scorable = cache.frames[i] // stack >= ctc_min_steps(target)
            if not scorable:
                log.warning("utterance %s: %d frames are too few for its %d-token transcript at stack %d: %s",
                            utt, cache.frames[i], len(target), stack,
                            "decoded, not in the loss" if keep_too_short else "skipped")
                if not keep_too_short:
                    self.skipped["too_short_for_ctc"] += 1
                    continue
            self.items.append(i)
            self.targets.append(target)
            self.texts.append(texts[utt])
            self.scorable.append(scorable)
        self.lengths = cache.frames[self.items]

    def __len__(self) -> int:
        return len(self.items)

    def utt(self, k: int) -> str:
        return self.cache.utts[self.items[k]]

    def features(self, k: int) -> np.ndarray:
        i = self.items[k]
        x = self.cache[i]
        if self.cmvn == "none":
            return np.array(x)
        key = {"global": "*", "speaker": self.cache.speakers[i], "utterance": self.cache.utts[i]}[self.cmvn]
        mean, std = self.stats[key]
        return (x - mean) / std

    def collate(self, batch: list[int], rng: Optional[np.random.Generator] = None) -> dict[str, torch.Tensor]:
        """Indices -> padded features (B, T, D), lengths (B,), concatenated targets (sum L,), target lengths.
        With a generator, the dataset's augmentation is applied to every utterance."""
        feats = [self.features(k) for k in batch]
        if rng is not None and self.augment is not None:
            feats = [self.augment(x, rng) for x in feats]
        lengths = torch.tensor([len(x) for x in feats])
        padded = torch.zeros(len(batch), int(lengths.max()), self.cache.dim)
        for b, x in enumerate(feats):
            padded[b, : len(x)] = torch.from_numpy(x)
        targets = [self.targets[k] for k in batch]
        return {"feats": padded, "lengths": lengths,
                "targets": torch.tensor([t for tt in targets for t in tt], dtype=torch.long),
                "target_lengths": torch.tensor([len(t) for t in targets])}


class BucketBatchSampler:
    """Per-epoch batches of similar-length utterances, shuffled, dealt round-robin to the global ranks.

    The batch list of an epoch is a pure function of (seed, epoch), so every rank computes the same one without
    communicating and a resumed run sees exactly the batches the interrupted run would have.
    """

    def __init__(self, lengths: np.ndarray, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 shuffle: bool = True):
        self.lengths = np.asarray(lengths)
        self.batch_size = batch_size
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle = seed, shuffle
        total = math.ceil(len(self.lengths) / batch_size)
        # training drops the last few batches so every rank runs the same number of steps
        self.steps = total // world_size if shuffle else math.ceil(total / world_size)
        if shuffle and self.steps == 0:
            raise ValueError(f"{len(self.lengths)} utterances make {total} batches of {batch_size}: fewer than "
                             f"the {world_size} learners; lower the batch size or use fewer learners")

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """All batches of an epoch, for all ranks (rank r takes every world_size-th)."""
        if not self.shuffle:
            order = np.argsort(self.lengths, kind="stable")
            return [order[i: i + self.batch_size].tolist() for i in range(0, len(order), self.batch_size)]
        rng = np.random.default_rng([self.seed, epoch])
        # jitter lengths by up to +-10% so bucket membership changes from epoch to epoch
        keys = self.lengths * np.exp(rng.uniform(-0.1, 0.1, len(self.lengths)))
        order = np.argsort(keys, kind="stable")
        batches = [order[i: i + self.batch_size].tolist() for i in range(0, len(order), self.batch_size)]
        return [batches[j] for j in rng.permutation(len(batches))][: self.steps * self.world_size]

    def rank_batches(self, epoch: int) -> list[list[int]]:
        return self.epoch_batches(epoch)[self.rank:: self.world_size]

    def __len__(self) -> int:
        return self.steps
