"""Batches: normalized features with character targets (CTC) or frame targets on fixed-length chunks (CE),
bucketed by length, sharded by rank.

The sampler works on the GLOBAL rank and world size, never on DeepSpeed's data-parallel group (DESIGN.md
§9.4: with node groups every node would otherwise read the same data). Batches hold utterances of similar
length so padding stays small (DESIGN.md §9.13), and every rank gets the same number of batches so a synchronous
allreduce never waits on a rank that has run out.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np
import torch

from recipe.lib.features import FeatureCache, cmvn_stats, utterance_cmvn

if TYPE_CHECKING:
    from recipe.lib.targets import FrameTargets

log = logging.getLogger(__name__)


def ctc_min_steps(target: list[int]) -> int:
    """Fewest output steps CTC needs: one per token plus a blank between equal neighbours."""
    return len(target) + sum(a == b for a, b in zip(target, target[1:]))


class FeatureReader:
    """Normalized input rows of a feature cache: CMVN by the configured mode, then the utterance's speaker
    vector (i-vector), if any, appended to every frame as the paper does."""

    def __init__(self, cache: FeatureCache, cmvn: str, global_stats: Optional[tuple[np.ndarray, np.ndarray]] = None,
                 vectors: Optional[dict[str, np.ndarray]] = None):
        self.cache, self.cmvn, self.vectors = cache, cmvn, vectors
        self.stats = {"*": global_stats} if cmvn == "global" and global_stats is not None else cmvn_stats(cache, cmvn)
        self.dim = cache.dim + (len(next(iter(vectors.values()))) if vectors else 0)

    def usable(self, i: int) -> bool:
        """False for an utterance left without its speaker vector (data.on_bad_utterance=skip)."""
        return self.vectors is None or self.cache.utts[i] in self.vectors

    def read(self, i: int, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
        """Frames start..stop of cache row i -> (frames, dim) float32."""
        if self.cmvn == "utterance":  # its statistics need the whole utterance
            whole = self.cache.read(i)
            mean, std = utterance_cmvn(whole)
            x = (whole[start:stop] - mean) / std
        else:
            x = self.cache.read(i, start, stop)
            if self.cmvn == "none":
                x = np.array(x)
            else:
                mean, std = self.stats["*" if self.cmvn == "global" else self.cache.speakers[i]]
                x = (x - mean) / std
        if self.vectors:
            vector = self.vectors[self.cache.utts[i]]
            x = np.concatenate([x, np.broadcast_to(vector, (len(x), len(vector)))], axis=1)
        return x


def pad_features(feats: list[np.ndarray], dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> features padded with zeros (B, T, D), lengths (B,)."""
    lengths = torch.tensor([len(x) for x in feats])
    padded = torch.zeros(len(feats), int(lengths.max()), dim)
    for b, x in enumerate(feats):
        padded[b, : len(x)] = torch.from_numpy(x)
    return padded, lengths


class CTCDataset:
    """Utterances of a feature cache with their token targets. An utterance too short for CTC to align its
    transcript at the model's frame rate is dropped from training and counted; a held-out set keeps it
    (keep_too_short), so it is decoded and counted in the error rates though the loss cannot score it."""

    def __init__(self, reader: FeatureReader, texts: dict[str, str], tokens: list[str], stack: int,
                 keep_too_short: bool = False,
                 augment: Optional[Callable[[np.ndarray, np.random.Generator], np.ndarray]] = None):
        self.reader = reader
        self.cache = reader.cache
        self.dim = reader.dim
        self.augment = augment  # applied by collate() when given a generator (training batches)
        index = {t: i for i, t in enumerate(tokens)}
        self.skipped: Counter = Counter()
        self.items: list[int] = []
        self.targets: list[list[int]] = []
        self.texts: list[str] = []
        self.scorable: list[bool] = []  # the CTC loss can align the transcript
        for i, utt in enumerate(self.cache.utts):
            if not reader.usable(i):
                self.skipped["no_speaker_vector"] += 1
                continue
            target = [index[c] for c in texts[utt]]
            scorable = self.cache.frames[i] // stack >= ctc_min_steps(target)
            if not scorable:
                log.warning("utterance %s: %d frames are too few for its %d-token transcript at stack %d: %s",
                            utt, self.cache.frames[i], len(target), stack,
                            "decoded, not in the loss" if keep_too_short else "skipped")
                if not keep_too_short:
                    self.skipped["too_short_for_ctc"] += 1
                    continue
            self.items.append(i)
            self.targets.append(target)
            self.texts.append(texts[utt])
            self.scorable.append(scorable)
        self.lengths = self.cache.frames[self.items]

    def __len__(self) -> int:
        return len(self.items)

    @property
    def num_utterances(self) -> int:
        return len(self.items)

    def utt(self, k: int) -> str:
        return self.cache.utts[self.items[k]]

    def features(self, k: int) -> np.ndarray:
        return self.reader.read(self.items[k])

    def collate(self, batch: list[int], rng: Optional[np.random.Generator] = None) -> dict[str, torch.Tensor]:
        """Indices -> padded features (B, T, D), lengths (B,), concatenated targets (sum L,), target lengths.
        With a generator, the dataset's augmentation is applied to every utterance."""
        feats = [self.features(k) for k in batch]
        if rng is not None and self.augment is not None:
            feats = [self.augment(x, rng) for x in feats]
        padded, lengths = pad_features(feats, self.dim)
        targets = [self.targets[k] for k in batch]
        return {"feats": padded, "lengths": lengths,
                "targets": torch.tensor([t for tt in targets for t in tt], dtype=torch.long),
                "target_lengths": torch.tensor([len(t) for t in targets])}


IGNORE = -100  # frame target of padding: left out of the cross entropy (torch's default ignore_index)


class ChunkDataset:
    """The paper's training examples: every utterance cut into non-overlapping chunks of `chunk` frames, each
    with its frame targets (recipe/lib/targets.py). An utterance's last chunk is shorter; its padding is ignored by
    the loss. Only the rows of a batch's chunks are read, so a learner reads what it trains on and no more."""

    def __init__(self, reader: FeatureReader, targets: "FrameTargets", chunk: int,
                 augment: Optional[Callable[[np.ndarray, np.random.Generator], np.ndarray]] = None):
        self.reader, self.targets, self.chunk = reader, targets, chunk
        self.cache = reader.cache
        self.dim = reader.dim
        self.augment = augment
        rows = np.array([i for i, utt in enumerate(self.cache.utts) if targets.has(utt) and reader.usable(i)],
                        dtype=np.int64)
        self.skipped: Counter = +Counter(targets.skipped)
        self.skipped["no_speaker_vector"] += sum(targets.has(utt) and not reader.usable(i)
                                                 for i, utt in enumerate(self.cache.utts))
        self.skipped = +self.skipped
        # int32 per chunk: a 2000-hour corpus has ~34 million chunks (BENCHMARKS.md, features larger than memory)
        counts = -(-self.cache.frames[rows] // chunk)  # chunks per utterance (ceil)
        self.rows = np.repeat(rows, counts).astype(np.int32)  # cache row of every chunk
        firsts = np.cumsum(counts) - counts
        self.starts = ((np.arange(len(self.rows)) - np.repeat(firsts, counts)) * chunk).astype(np.int32)
        self.lengths = np.minimum(self.cache.frames[self.rows] - self.starts, chunk).astype(np.int32)
        self.num_utterances = len(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def utt(self, k: int) -> str:
        return self.cache.utts[self.rows[k]]

    def collate(self, batch: list[int], rng: Optional[np.random.Generator] = None) -> dict[str, torch.Tensor]:
        """Chunk indices -> padded features (B, chunk, D), lengths (B,), frame targets (B, chunk), IGNORE past
        each length; the chunk's utterance and first frame (for writing per-utterance outputs)."""
        feats, targets = [], torch.full((len(batch), self.chunk), IGNORE, dtype=torch.long)
        for b, k in enumerate(batch):
            i, start, n = int(self.rows[k]), int(self.starts[k]), int(self.lengths[k])
            x = self.reader.read(i, start, start + n)
            feats.append(self.augment(x, rng) if rng is not None and self.augment is not None else x)
            targets[b, :n] = torch.from_numpy(self.targets.read(self.cache.utts[i], start, start + n).astype(np.int64))
        padded, lengths = pad_features(feats, self.dim)
        return {"feats": padded, "lengths": lengths, "frame_targets": targets[:, : padded.shape[1]],
                "rows": torch.tensor([int(self.rows[k]) for k in batch]),
                "starts": torch.tensor([int(self.starts[k]) for k in batch])}


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

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """All batches of an epoch, for all ranks (rank r takes every world_size-th). Each batch is a view of one
        index array: Python lists of every index cost ~1.5 GB per learner at 2000 hours (BENCHMARKS.md)."""
        if not self.shuffle:
            order = np.argsort(self.lengths, kind="stable")
            return [order[i: i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        rng = np.random.default_rng([self.seed, epoch])
        # jitter lengths by up to +-10% so bucket membership changes from epoch to epoch
        keys = self.lengths * np.exp(rng.uniform(-0.1, 0.1, len(self.lengths)))
        order = np.argsort(keys, kind="stable")
        batches = [order[i: i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        return [batches[j] for j in rng.permutation(len(batches))][: self.steps * self.world_size]

    def learner_shuffle(self, rank: int) -> "BucketBatchSampler":
        """All the batches, in a shuffle of learner `rank`'s own (ADPSGD's independent sampling)."""
        return BucketBatchSampler(self.lengths, self.batch_size, seed=self.seed * 100_003 + rank + 1)

    def whole(self) -> "BucketBatchSampler":
        """All the batches of this sampler's shuffle as one rank's list, the same on every rank (ADPSGD's
        learners deal it out among themselves)."""
        return BucketBatchSampler(self.lengths, self.batch_size, seed=self.seed)

    def rank_batches(self, epoch: int) -> list[np.ndarray]:
        return self.epoch_batches(epoch)[self.rank:: self.world_size]

    def __len__(self) -> int:
        return self.steps
