"""The recipe's YAML configuration: a typed schema, a file, and command-line overrides, in that order.

Everything about data, features, model and schedule lives here; everything the engine and the distributed
strategy do lives in the DeepSpeed JSON (see ``recipe/ds_config.py``). No setting lives in both places.
Unknown keys are errors (omegaconf struct mode), so a typo in an override never silently does nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml  # omegaconf's YAML parser (PyYAML): its errors name the line
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A configuration file or override that cannot be used."""


@dataclass
class DataConf:
    corpus: str = "synth"  # synth: the built-in espeak-ng corpus; kaldi: train_dir/test_dir given by the user
    train_dir: Optional[str] = None  # Kaldi data dirs (wav.scp, text, optional utt2spk, segments)
    test_dir: Optional[str] = None
    sample_rate: int = 16000  # audio is resampled to this rate
    synth_train: int = 3000  # utterances in the synthesized training set
    synth_test: int = 300  # utterances in the synthesized held-out set
    synth_seed: int = 0
    max_utt_seconds: float = 30.0  # longer utterances are skipped with a warning (memory of a padded batch)


@dataclass
class FeatureConf:
    n_mels: int = 40
    win_ms: float = 25.0
    hop_ms: float = 10.0
    deltas: bool = True  # append deltas and double deltas: 3 x n_mels dims
    cmvn: str = "speaker"  # global | speaker | utterance | none
    num_workers: int = 2  # parallel extraction processes


@dataclass
class ModelConf:
    input_dim: int = 0  # 0: taken from the features; otherwise must match them
    output_dim: int = 0  # 0: taken from the token set (CTC); otherwise must match it
    layers: int = 3
    hidden: int = 192  # cells per direction
    bidirectional: bool = True
    bottleneck: int = 0  # linear bottleneck before the output layer; 0 = none
    dropout: float = 0.1
    stack: int = 4  # frames stacked into one LSTM step (CTC frame-rate reduction); 1 = 10 ms steps
    packed: bool = False  # pack_padded_sequence: fast with cuDNN, slow on CPU (DESIGN.md trap 13)


@dataclass
class OptimConf:
    name: str = "adam"  # sgd | adam | adamw
    lr: float = 2.0e-3  # at base_batch utterances per global step
    momentum: float = 0.9  # sgd only
    weight_decay: float = 0.0
    base_batch: int = 16  # global batch that lr refers to
    batch_scaling: str = "sqrt"  # none | linear | sqrt: lr scaled by (global_batch / base_batch)**p
    warmup_epochs: float = 0.3  # linear warm-up from 0 over this many epochs of global progress
    anneal_start_epoch: int = 4  # from this epoch on (1-based), lr *= anneal_factor every epoch
    anneal_factor: float = 0.7071067811865476  # 1/sqrt(2), as in the paper


@dataclass
class TrainConf:
    epochs: int = 6
    seed: int = 0
    num_threads: int = 0  # torch threads per learner; 0 = cores / learners on this node
    log_interval: int = 20  # steps between progress lines
    keep_checkpoints: int = 3
    # a learner that hangs fails the others' collectives after this long (a dead one fails them at once)
    collective_timeout_s: float = 600.0
    max_bad_steps: int = 5  # optimizer steps in a row with a non-finite loss or gradient before the run stops


@dataclass
class RecipeConf:
    data: DataConf = field(default_factory=DataConf)
    features: FeatureConf = field(default_factory=FeatureConf)
    model: ModelConf = field(default_factory=ModelConf)
    optim: OptimConf = field(default_factory=OptimConf)
    train: TrainConf = field(default_factory=TrainConf)


CHOICES = {
    "data.corpus": ("synth", "kaldi"),
    "features.cmvn": ("global", "speaker", "utterance", "none"),
    "optim.name": ("sgd", "adam", "adamw"),
    "optim.batch_scaling": ("none", "linear", "sqrt"),
}


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Schema defaults <- YAML file <- ``key=value`` overrides; raises ConfigError naming the bad key."""
    cfg = OmegaConf.structured(RecipeConf)
    try:
        if path is not None:
            cfg = OmegaConf.merge(cfg, OmegaConf.load(path))
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
    except (OmegaConfBaseException, yaml.YAMLError, OSError, ValueError) as err:
        # OSError and YAMLError: the file is not a YAML mapping (omegaconf raises the former for a lone scalar)
        where = f"{path}" if path else "command-line overrides"
        if isinstance(err, yaml.MarkedYAMLError) and err.problem_mark is not None:
            where = f"{where}:{err.problem_mark.line + 1}"
        key = getattr(err, "full_key", None)
        reason = getattr(err, "problem", None) or (str(err).splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"{where}: {key}: {reason}" if key else f"{where}: {reason}") from None
    validate(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def validate(cfg: DictConfig) -> None:
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of: {', '.join(allowed)}")
    if cfg.data.corpus == "kaldi" and not (cfg.data.train_dir and cfg.data.test_dir):
        raise ConfigError("data.corpus=kaldi needs data.train_dir and data.test_dir (run.sh --train-dir/--test-dir)")
    for key in ("model.layers", "model.hidden", "model.stack", "train.epochs", "features.n_mels", "optim.base_batch"):
        if OmegaConf.select(cfg, key) < 1:
            raise ConfigError(f"{key} must be >= 1, got {OmegaConf.select(cfg, key)}")
    if not 0.0 <= cfg.model.dropout < 1.0:
        raise ConfigError(f"model.dropout must be in [0, 1), got {cfg.model.dropout}")
