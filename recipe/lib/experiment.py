"""An experiment folder and everything the stages read from and write into it.

    EXP/conf.yaml            resolved recipe config used for training (schema <- --conf <- overrides)
    EXP/ds_config.json       the DeepSpeed JSON used for training;  EXP/launch.txt  the launch command
    EXP/data/{train,dev,test}/  clean Kaldi data dirs;  EXP/data/tokens.txt;  EXP/data/prep.json (how the dev
                             set was chosen, what was skipped)
    EXP/features.json        where the feature caches of train, dev and test are
    EXP/targets/{train,dev,test}/  frame targets of the CE objective (recipe/lib/targets.py)
    EXP/vectors/{train,dev,test}.npz  speaker vectors by utterance, when the data has them
    EXP/checkpoints/         epoch-NNN.pt (atomic, pruned);  EXP/train_log.jsonl;  EXP/metrics.json
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np
import torch

from model.lstm import LSTMAcousticModel
from recipe.lib.augment import SpecAugment, source_utt
from recipe.lib.config import ConfigError, load_config
from recipe.lib.datadir import read_tokens
from recipe.lib.dataset import ChunkDataset, CTCDataset, FeatureReader
from recipe.lib.features import FeatureCache, cmvn_stats
from recipe.lib.tables import read_table
from recipe.lib.targets import FrameTargets


class Experiment:
    def __init__(self, root: str | Path, conf=None):
        self.root = Path(root)
        self._conf = conf

    @property
    def conf(self):
        if self._conf is None:
            self._conf = load_config(self.root / "conf.yaml")
        return self._conf

    # ---- data and features -------------------------------------------------------------------------------
    def data_dir(self, split: str) -> Path:
        return self.root / "data" / split

    @property
    def tokens(self) -> list[str]:
        return read_tokens(self.root / "data" / "tokens.txt")

    def cache(self, split: str) -> FeatureCache:
        where = self.root / "features.json"
        if not where.is_file():
            raise FileNotFoundError(f"{where}: no features yet; run the feature stage (run.sh --stage 2)")
        return FeatureCache(json.loads(where.read_text())[split])

    def vectors(self, split: str) -> dict[str, np.ndarray] | None:
        """Speaker vectors by utterance (stage 2 resolved them), or None when the data has none."""
        path = self.root / "vectors" / f"{split}.npz"
        if not path.is_file():
            return None
        z = np.load(path)
        return dict(zip(z["utts"].tolist(), z["vectors"]))

    def reader(self, split: str) -> FeatureReader:
        cmvn = self.conf.features.cmvn
        # global normalization uses the training set's statistics for every split
        global_stats = cmvn_stats(self.cache("train"), "global")["*"] if cmvn == "global" else None
        return FeatureReader(self.cache(split), cmvn, global_stats, self.vectors(split))

    def targets(self, split: str) -> FrameTargets:
        return FrameTargets(self.root / "targets" / split)

    def dataset(self, split: str) -> CTCDataset | ChunkDataset:
        reader = self.reader(split)
        augment = SpecAugment(self.conf.augment, self.conf.features.n_mels) if split == "train" else None
        augment = augment if augment and augment.enabled else None
        if self.conf.train.objective == "ce":
            return ChunkDataset(reader, self.targets(split), self.conf.data.chunk_frames, augment=augment)
        texts = {utt: text for utt, (text, _) in read_table(self.data_dir(split) / "text").items()}
        texts = {utt: texts[source_utt(utt)] for utt in reader.cache.utts}  # speed-perturbed copies: their source's
        return CTCDataset(reader, texts, self.tokens, self.conf.model.stack,
                          keep_too_short=split != "train",  # held-out error rates count every utterance
                          augment=augment)

    @property
    def input_dim(self) -> int:
        return self.reader("train").dim  # features, plus speaker vectors when there are any

    @property
    def output_dim(self) -> int:
        """Classes of the output layer: CTC's tokens, or the CE targets' classes."""
        return self.targets("train").num_targets if self.conf.train.objective == "ce" else len(self.tokens)

    # ---- model and checkpoints ---------------------------------------------------------------------------
    def build_model(self, input_dim: int) -> LSTMAcousticModel:
        return build_model(self.conf.model, input_dim, self.output_dim)

    @property
    def checkpoint_dir(self) -> Path:
        return self.root / "checkpoints"

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first (a save is complete once renamed to its final name)."""
        found = [p for p in self.checkpoint_dir.glob("epoch-*.pt") if re.fullmatch(r"epoch-\d+\.pt", p.name)]
        return sorted(found)

    def save_checkpoint(self, state: dict, epoch: int, keep: int, losses: dict[int, float] | None = None) -> Path:
        """Writes epoch's checkpoint; keeps the latest (for --resume) and the `keep` best by dev loss
        (`losses`: epoch -> loss; without them, the latest `keep`)."""
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        path = self.checkpoint_dir / f"epoch-{epoch:03d}.pt"
        tmp = path.with_name(path.name + ".tmp")
        try:
            torch.save(state, tmp)
            os.replace(tmp, path)  # a crash mid-save leaves the previous checkpoints intact
        except (OSError, RuntimeError) as err:  # a full disk surfaces from torch.save as either
            tmp.unlink(missing_ok=True)
            raise OSError(f"{path}: checkpoint not written ({err}); the previous checkpoints are intact: "
                          f"{', '.join(p.name for p in self.checkpoints()) or 'none'}") from err
        found = self.checkpoints()
        kept = set(found[-1:]) | set(best_by_loss(found, [(losses or {}).get(epoch_of(p)) for p in found], keep))
        for old in found:
            if old not in kept:
                old.unlink()
        return path

    def load_checkpoint(self, path: str | Path | None = None) -> dict:
        if path is None:
            found = self.checkpoints()
            if not found:
                raise FileNotFoundError(f"{self.checkpoint_dir}: no checkpoint")
            path = found[-1]
        # weights_only: tensors and plain containers only, never arbitrary pickled objects
        state = torch.load(path, map_location="cpu", weights_only=True)
        state["path"] = str(path)
        return state

    def load_model(self, path: str | Path | None = None, average: int = 1,
                   within: float | None = None) -> tuple[LSTMAcousticModel, dict]:
        """The model of a checkpoint (default: the latest), or the average of the weights of the `average`
        checkpoints of lowest dev loss, or of all there are if fewer (ESPnet's practice: it smooths the
        epoch-to-epoch swings of a small corpus). within: of those, only the ones whose dev loss is at most
        (1 + within) x the best are averaged; an epoch far from the others (training not converged yet) would
        pull the average off (None: all of them)."""
        state = self.load_checkpoint(path)
        model = self.build_model(self.input_dim)
        if path is None and average > 1:
            found = [self.load_checkpoint(p) for p in self.checkpoints()]
            best = best_by_loss(found, [heldout_loss(c) for c in found], average)
            chosen = close_to_the_best(best, within) if within is not None else best
            state = chosen[-1]  # the latest of them: its path and epoch describe the model
            if len(chosen) > 1:
                state["model"] = average_weights([s["model"] for s in chosen])
                state["averaged"] = [Path(s["path"]).name for s in chosen]
        model.load_state_dict(state["model"])
        return model, state


def epoch_of(checkpoint: Path) -> int:
    return int(checkpoint.stem.split("-")[1])


def heldout_loss(checkpoint: dict) -> float | None:
    """The dev loss of the epoch a checkpoint ends, from the training state it carries."""
    return checkpoint.get("train_state", {}).get("history", [{}])[-1].get("heldout_loss")


def best_by_loss(items: list, losses: list[float | None], n: int) -> list:
    """The n items of lowest loss, in their order; a missing or non-finite loss counts as the worst, and of
    equal losses the later item is preferred."""
    def rank(i: int) -> tuple[float, int]:
        loss = losses[i]
        return (loss if loss is not None and math.isfinite(loss) else math.inf, -i)
    return [items[i] for i in sorted(sorted(range(len(items)), key=rank)[:n])]


def close_to_the_best(checkpoints: list[dict], within: float) -> list[dict]:
    """The checkpoints whose epoch's dev loss is at most (1 + within) x the lowest finite one; one without a
    recorded loss is kept, and all are when none is finite."""
    losses = [heldout_loss(c) for c in checkpoints]
    best = min((loss for loss in losses if loss is not None and math.isfinite(loss)), default=None)
    return [c for c, loss in zip(checkpoints, losses) if best is None or loss is None or loss <= (1 + within) * best]


def build_model(model_conf, input_dim: int, output_dim: int) -> LSTMAcousticModel:
    """The acoustic model of a model config; dims fixed in the config must match the data."""
    for key, actual in (("input_dim", input_dim), ("output_dim", output_dim)):
        if model_conf[key] and model_conf[key] != actual:
            raise ConfigError(f"model.{key}={model_conf[key]} but the data gives {actual} (set 0 to take it)")
    return LSTMAcousticModel(input_dim, output_dim, layers=model_conf.layers, hidden=model_conf.hidden,
                             bidirectional=model_conf.bidirectional, bottleneck=model_conf.bottleneck,
                             dropout=model_conf.dropout, stack=model_conf.stack, packed=model_conf.packed)


def average_weights(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Element-wise mean of state dicts (floating tensors; others, such as counters, from the last)."""
    out = {}
    for key, last in states[-1].items():
        if last.is_floating_point():
            out[key] = (sum(s[key].double() for s in states) / len(states)).to(last.dtype)
        else:
            out[key] = last.clone()
    return out
