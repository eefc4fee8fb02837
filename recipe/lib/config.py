"""The recipe's YAML configuration: a typed schema, a file, and command-line overrides, in that order.

Everything about data, features, model and schedule lives here; everything the engine and the distributed
strategy do lives in the DeepSpeed JSON (see ``recipe/lib/ds_config.py``). No setting lives in both places.
Unknown keys are errors (omegaconf struct mode), so a typo in an override never silently does nothing.
"""

from __future__ import annotations

import copy
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import yaml  # omegaconf's YAML parser (PyYAML): its errors name the line
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from recipe.lib.corpora import PREPARERS


class ConfigError(ValueError):
    """A configuration file or override that cannot be used."""


@dataclass
class DataConf:
    # synth: the built-in espeak-ng corpus; kaldi: train_dir/test_dir given by the user; a public corpus by
    # name (recipe/lib/corpora.py: fsdd, librispeech, an4) prepared from its local folder corpus_dir
    corpus: str = "synth"
    train_dir: Optional[str] = None  # Kaldi data dirs (wav.scp, text, optional utt2spk, segments)
    test_dir: Optional[str] = None
    # the dev set: every decision of training and decoding is made on it, and the test set is decoded once, at
    # the end. A Kaldi data dir; else the corpus's own (synth: voices of its own; librispeech: data.dev_sets);
    # else carved out of the training data (recipe/lib/splits.py): whole speakers where the training set has at
    # least 10, else utterances, dev_share of them but at least dev_min_utterances (never over 2 x dev_share)
    dev_dir: Optional[str] = None
    dev_share: float = 0.05
    dev_min_utterances: int = 100
    corpus_dir: Optional[str] = None  # a public corpus's local folder, in its distribution layout
    heldout_speakers: List[str] = field(default_factory=list)  # fsdd: their recordings are the test set
    train_sets: List[str] = field(default_factory=list)  # librispeech: subsets for training (train-clean-100)
    test_sets: List[str] = field(default_factory=list)  # ... and for the test set (test-clean)
    dev_sets: List[str] = field(default_factory=list)  # ... and for the dev set (dev-clean where the folder has it)
    # frame targets for the CE objective (train.objective=ce): Kaldi alignments (`ali-to-pdf` text, or .scp/.ark);
    # unset: the data dir's phones.ctm with its phones.txt (the built-in corpus writes them from espeak-ng's
    # phoneme timings)
    train_ali: Optional[str] = None
    test_ali: Optional[str] = None
    dev_ali: Optional[str] = None  # unset: train_ali's (it covers a dev set carved out of the training data)
    ali_tolerance: int = 2  # frames an alignment may differ from its features (cut or last target repeated)
    # speaker vectors (Kaldi i-vectors, .scp/.ark or text), keyed by utterance or by speaker, appended to every frame
    train_ivectors: Optional[str] = None
    test_ivectors: Optional[str] = None
    dev_ivectors: Optional[str] = None  # unset: train_ivectors'
    chunk_frames: int = 21  # CE trains and scores non-overlapping chunks of this many frames (the paper's 21)
    states_per_phone: int = 1  # CE from a phone CTM: 3 = phone-position states (begin/middle/end), as HMM states
    on_bad_utterance: str = "error"  # error: stop before training, naming it; skip: leave it out and count it
    mix_synth: int = 0  # synthesized utterances (the built-in corpus's voices) added to a real training set
    sample_rate: int = 16000  # audio is resampled to this rate
    synth_train: int = 3000  # utterances in the synthesized training set
    synth_test: int = 300  # utterances in the synthesized test set
    synth_dev: int = 200  # utterances in the synthesized dev set (voices neither train nor test has)
    synth_seed: int = 0
    max_utt_seconds: float = 30.0  # longer utterances are skipped with a warning (memory of a padded batch)
    # 0: all; N: N training utterances, evenly spaced in id order (Kaldi's utils/subset_data_dir.sh)
    train_utterances: int = 0


@dataclass
class FeatureConf:
    # librosa: librosa's log-mel (Slaney mel scale, no pre-emphasis) and deltas over 9 frames; kaldi: Kaldi's
    # compute-fbank-feats (dither 0) and add-deltas exactly, through kaldi-native-fbank (ACCURACY.md section 7)
    backend: str = "librosa"
    n_mels: int = 40
    win_ms: float = 25.0
    hop_ms: float = 10.0
    deltas: bool = True  # append deltas and double deltas: 3 x n_mels dims
    cmvn: str = "speaker"  # global | speaker | utterance | none
    num_workers: int = 2  # parallel extraction processes


@dataclass
class AugmentConf:
    """recipe/lib/augment.py. SpecAugment masks training batches; speed perturbation extracts the training set
    again at each factor (1.0: the originals). Left unset (null), the four switches take AUTO_AUGMENT's values
    for the corpus: recorded speech is augmented, the built-in synthesized corpus is not."""
    speed_perturb: Optional[List[float]] = None  # e.g. [0.9, 1.0, 1.1]: 3x the data, 3x the training time
    freq_masks: Optional[int] = None  # per utterance
    freq_mask_width: int = 8  # at most this many mel channels each
    time_masks: Optional[int] = None
    time_mask_width: int = 10  # at most this many frames each ...
    time_mask_ratio: float = 0.2  # ... and at most this fraction of the utterance
    time_warp: Optional[int] = None  # frames a random point may move; 0 = no warp


# What an unset augment.* switch becomes (ACCURACY.md sections 1, 2 and 6): on recorded speech (FSDD, a small
# real corpus) speed perturbation, SpecAugment and time warp each lowered the WER; on the built-in corpus's
# clean, varied synthetic voices SpecAugment and time warp cost accuracy, and speed perturbation triples a
# demo's time. The frame-level CE objective's alignments are of the original audio: nothing moves its frames;
# and a Kaldi data dir's own features (feats.scp) have no audio to perturb.
AUTO_AUGMENT = {
    "recorded": {"speed_perturb": [0.9, 1.0, 1.1], "freq_masks": 2, "time_masks": 2, "time_warp": 5},
    "synth": {"speed_perturb": [1.0], "freq_masks": 0, "time_masks": 0, "time_warp": 0},
}
FRAME_MOVING = {"speed_perturb": [1.0], "time_warp": 0}


def resolve_augment(cfg: DictConfig) -> None:
    """Fills the unset augment.* switches for the corpus and objective (the resolved values are what
    EXP/conf.yaml records)."""
    auto = dict(AUTO_AUGMENT["synth" if cfg.data.corpus == "synth" else "recorded"])
    if cfg.train.objective == "ce":
        auto.update(FRAME_MOVING)
    if cfg.data.corpus == "kaldi" and cfg.data.train_dir and (Path(cfg.data.train_dir) / "feats.scp").is_file():
        auto["speed_perturb"] = [1.0]
    for key, value in auto.items():
        if cfg.augment[key] is None:
            cfg.augment[key] = value


# What optim.batch_scaling=auto becomes for Adam and AdamW, by strategy, as measured in ACCURACY.md section 8.
# Under gossip every learner (HYBRID: node) steps on its own gradients, and the average of their Adam steps,
# each normalized by the noisier statistics of its share of the batch, moves the consensus less than SYNC's
# step on the whole batch does: sqrt_replicas restores it. SYNC keeps the square root it was tuned with (the
# square-root rule of adaptive optimizers, Malladi et al. 2022), and so does LOCALSGD, whose learners average
# every 4 steps after a synchronous start (the linear rule measured worse for it).
AUTO_BATCH_SCALING = {"sync": "sqrt", "localsgd": "sqrt", "adpsgd": "sqrt_replicas", "hybrid": "sqrt_replicas"}
# SGD's step is the gradient itself, not normalized: the average of the learners' steps is the step of their
# average gradient, so every strategy takes the linear rule (Goyal et al. 2017; paper.yaml names it). Not
# measured here: every measurement of section 8 is with Adam.
AUTO_BATCH_SCALING_SGD = "linear"


def for_strategy(cfg: DictConfig, strategy: str) -> DictConfig:
    """The config with what depends on the strategy resolved: EXP/conf.yaml records the rule that was used."""
    if cfg.optim.batch_scaling != "auto":
        return cfg
    cfg = copy.deepcopy(cfg)
    OmegaConf.set_readonly(cfg, False)
    cfg.optim.batch_scaling = AUTO_BATCH_SCALING_SGD if cfg.optim.name == "sgd" else AUTO_BATCH_SCALING[strategy]
    OmegaConf.set_readonly(cfg, True)
    return cfg


@dataclass
class ModelConf:
    input_dim: int = 0  # 0: taken from the features; otherwise must match them
    output_dim: int = 0  # 0: taken from the token set (CTC); otherwise must match it
    layers: int = 3
    hidden: int = 192  # cells per direction
    bidirectional: bool = True
    bottleneck: int = 0  # linear bottleneck before the output layer; 0 = none
    dropout: float = 0.1
    # frames stacked into one LSTM step (CTC frame-rate reduction); 1 = 10 ms steps. Not 4: a short "three"
    # needs 6 output steps, too many for 4 stacked frames of a 0.2 s take (ACCURACY.md)
    stack: int = 2
    packed: bool = False  # pack_padded_sequence: fast with cuDNN, slow on CPU (DESIGN.md §9.13)


@dataclass
class OptimConf:
    name: str = "adam"  # sgd | adam | adamw
    lr: float = 2.0e-3  # at base_batch utterances per global step
    momentum: float = 0.9  # sgd only
    weight_decay: float = 0.0
    base_batch: int = 16  # global batch that lr refers to
    # none | linear | sqrt: lr scaled by (global_batch / base_batch)**p; sqrt_replicas: the square root of that
    # ratio times the model copies stepping on their own (recipe/lib/schedule.py); auto: by the optimizer and
    # the strategy (AUTO_BATCH_SCALING)
    batch_scaling: str = "auto"
    # linear warm-up from 0 over this many epochs of global progress (1: 0.3 left 4 learners, every strategy, at
    # 2-3x the CER after 4 epochs; ACCURACY.md section 8)
    warmup_epochs: float = 1.0
    anneal_factor: float = 0.7071067811865476  # lr *= this every annealed epoch (1/sqrt(2), as in the paper)
    # when annealing starts and training ends (recipe/lib/schedule.py): fixed: the planned epochs (train.epochs,
    # train.min_updates), annealed over their second half; newbob: the peak lr while the dev loss improves,
    # then annealing, and the end when it no longer improves (at most train.max_epochs)
    schedule: str = "newbob"
    # fixed: the first annealed epoch (1-based); null: the epoch after the first half (3 of 4, 6 of 10). newbob
    # never anneals before that epoch either
    anneal_start_epoch: Optional[int] = None
    # newbob anneals after an epoch whose dev loss is not this fraction below the best before it; 0.1:
    # the built-in corpus anneals at epoch 6 instead of spiking at the peak lr in epoch 8 (ACCURACY.md section 6)
    newbob_margin: float = 0.1
    # training ends after this many annealed epochs in a row that gain less than a tenth of the margin on the best
    # loss since annealing started (never before the planned epochs) ...
    newbob_patience: int = 2
    newbob_anneal_epochs: int = 6  # ... or after this many annealed epochs (lr down to 1/8 of the peak)
    # a dev loss gain below this (nats a token or frame) is no gain for either test, whatever the margins: near
    # a loss of 0 their fractions ask for gains no dev set resolves (ACCURACY.md section 6)
    newbob_min_gain: float = 0.001


@dataclass
class TrainConf:
    objective: str = "ctc"  # ctc: character targets, whole utterances; ce: frame targets (alignments), chunks
    epochs: int = 4  # at least this many, and ...
    # ... enough epochs for this many optimizer updates: a small corpus or a large global batch gets the updates
    # CTC needs to leave its all-blank plateau (700: the built-in corpus's 4 epochs make 748; ACCURACY.md sec. 5)
    min_updates: int = 700
    max_epochs: int = 40  # ... but no more than this many (recipe/lib/schedule.py plan_epochs)
    max_minutes: Optional[float] = None  # either schedule: no epoch starts after this much training time
    seed: int = 0
    num_threads: int = 0  # torch threads per learner; 0 = cores / learners on this node
    log_interval: int = 20  # steps between progress lines
    keep_checkpoints: int = 3  # the best by dev loss, besides the latest (which --resume continues)
    # a learner that hangs fails the others' collectives after this long (a dead one fails them at once)
    collective_timeout_s: float = 600.0
    max_bad_steps: int = 5  # optimizer steps in a row with a non-finite loss or gradient before the run stops
    # SYNC, LOCALSGD: times stage 3 starts the learners again from the last checkpoint after a lost learner
    # (recipe/elastic.py); 0: a lost learner ends the run
    max_restarts: int = 3


@dataclass
class DecodeConf:
    """The decode stage (recipe/evaluate.py); the per-epoch dev scores during training stay greedy."""
    # average the weights of the N checkpoints of lowest dev loss (1: the latest alone) ...
    average_best: int = 3
    # ... those of them whose dev loss is at most (1 + average_within) x the best (null: all): an epoch still
    # far from converged pulls the average off (ACCURACY.md section 5: better on 6 runs of 6)
    average_within: Optional[float] = 0.2
    beam: int = 8  # CTC prefix beam search of this width (recipe/lib/decode.py); 0 = greedy
    lm_order: int = 3  # word n-gram LM from the training transcripts, fused in the beam search; 0 = none
    # or your own word LM, an ARPA file (e.g. a Switchboard 4-gram with <unk>), used instead of training one
    lm_arpa: Optional[str] = None
    # LM log-probability weight (shallow fusion) and a bonus added per word, which offsets the LM's cost per word
    # (else words get dropped); null: the pair of lowest dev WER over the grid lm_weights x word_bonuses (ties:
    # the grid's middle); a value set here is used as it is
    lm_weight: Optional[float] = None
    word_bonus: Optional[float] = None
    lm_weights: List[float] = field(default_factory=lambda: [0.25, 0.5, 0.75])
    word_bonuses: List[float] = field(default_factory=lambda: [1.0, 2.0, 3.0])
    oov_penalty: float = 0.0  # per word outside the LM's vocabulary, charged as its spelling leaves it
    # the beam search with the LM: numpy (recipe/lib/decode.py), or flashlight: flashlight-text's C++ lexicon
    # decoder over the LM's vocabulary (recipe/lib/decode_flashlight.py; optional: pip install flashlight-text),
    # which never hypothesises a word outside it (oov_penalty has nothing to charge there)
    backend: str = "numpy"


@dataclass
class RecipeConf:
    data: DataConf = field(default_factory=DataConf)
    features: FeatureConf = field(default_factory=FeatureConf)
    augment: AugmentConf = field(default_factory=AugmentConf)
    model: ModelConf = field(default_factory=ModelConf)
    optim: OptimConf = field(default_factory=OptimConf)
    train: TrainConf = field(default_factory=TrainConf)
    decode: DecodeConf = field(default_factory=DecodeConf)


CHOICES = {
    "data.corpus": ("synth", "kaldi", *PREPARERS),
    "data.on_bad_utterance": ("error", "skip"),
    "train.objective": ("ctc", "ce"),
    "features.cmvn": ("global", "speaker", "utterance", "none"),
    "features.backend": ("librosa", "kaldi"),
    "decode.backend": ("numpy", "flashlight"),
    "optim.name": ("sgd", "adam", "adamw"),
    "optim.batch_scaling": ("auto", "none", "linear", "sqrt", "sqrt_replicas"),
    "optim.schedule": ("fixed", "newbob"),
}

OVERRIDE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*=")


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Schema defaults <- YAML file <- ``key=value`` overrides; raises ConfigError naming the bad key."""
    for override in overrides:  # omegaconf's own parser fails on some (`[`: IndexError) with no useful message
        if not OVERRIDE.match(override):
            raise ConfigError(f"command-line override {override!r} is not key=value with a dotted key, "
                              f"e.g. model.stack=2")
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
    resolve_augment(cfg)
    validate(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def overridden(overrides: list[str] | tuple[str, ...], key: str) -> bool:
    """Whether the command line's key=value overrides set `key` (a value the user gave, to honor as given)."""
    return any(o.split("=", 1)[0].strip() == key for o in overrides)


def validate(cfg: DictConfig) -> None:
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of: {', '.join(allowed)}")
    if cfg.data.mix_synth and cfg.data.corpus == "synth":
        raise ConfigError("data.mix_synth adds synthesized speech to a real corpus; data.corpus is synth already")
    if cfg.data.corpus == "kaldi" and not (cfg.data.train_dir and cfg.data.test_dir):
        raise ConfigError("data.corpus=kaldi needs data.train_dir and data.test_dir (run.sh --train-dir/--test-dir)")
    for key in ("model.layers", "model.hidden", "model.stack", "train.epochs", "features.n_mels", "optim.base_batch"):
        if OmegaConf.select(cfg, key) < 1:
            raise ConfigError(f"{key} must be >= 1, got {OmegaConf.select(cfg, key)}")
    if cfg.train.max_restarts < 0:
        raise ConfigError(f"train.max_restarts={cfg.train.max_restarts} must be >= 0 (0: a lost learner ends the run)")
    if cfg.train.max_epochs < cfg.train.epochs or cfg.train.min_updates < 0:
        raise ConfigError(f"train.max_epochs={cfg.train.max_epochs} must be >= train.epochs={cfg.train.epochs}, "
                          f"and train.min_updates={cfg.train.min_updates} >= 0")
    if cfg.optim.anneal_start_epoch is not None and cfg.optim.anneal_start_epoch < 1:
        raise ConfigError(f"optim.anneal_start_epoch={cfg.optim.anneal_start_epoch} must be >= 1 (or null: after "
                          "the first half of training)")
    if cfg.decode.average_within is not None and not cfg.decode.average_within >= 0:
        raise ConfigError(f"decode.average_within={cfg.decode.average_within} must be >= 0 (or null: no filter)")
    if not 1 <= cfg.decode.average_best <= cfg.train.keep_checkpoints:
        raise ConfigError(f"decode.average_best={cfg.decode.average_best} must be in [1, train.keep_checkpoints="
                          f"{cfg.train.keep_checkpoints}]: only that many checkpoints are kept")
    if not 0 <= cfg.optim.newbob_margin < 1 or min(cfg.optim.newbob_patience, cfg.optim.newbob_anneal_epochs) < 1 \
            or not cfg.optim.newbob_min_gain >= 0:
        raise ConfigError(f"optim.newbob_margin={cfg.optim.newbob_margin} must be in [0, 1), "
                          f"optim.newbob_min_gain={cfg.optim.newbob_min_gain} >= 0, and "
                          f"optim.newbob_patience={cfg.optim.newbob_patience} and optim.newbob_anneal_epochs="
                          f"{cfg.optim.newbob_anneal_epochs} >= 1")
    if not 0 < cfg.data.dev_share < 0.5 or cfg.data.dev_min_utterances < 1 or cfg.data.synth_dev < 1:
        raise ConfigError(f"data.dev_share={cfg.data.dev_share} must be in (0, 0.5), data.dev_min_utterances="
                          f"{cfg.data.dev_min_utterances} and data.synth_dev={cfg.data.synth_dev} >= 1")
    if cfg.train.max_minutes is not None and cfg.train.max_minutes <= 0 or cfg.data.train_utterances < 0:
        raise ConfigError(f"train.max_minutes={cfg.train.max_minutes} must be > 0 (or null) and "
                          f"data.train_utterances={cfg.data.train_utterances} >= 0")
    _check_decode(cfg.decode)
    _check_augment(cfg.augment, cfg.features.n_mels)
    if cfg.train.objective == "ce":
        _check_ce(cfg)
    if not 0.0 <= cfg.model.dropout < 1.0:
        raise ConfigError(f"model.dropout must be in [0, 1), got {cfg.model.dropout}")


def _check_decode(decode: DictConfig) -> None:
    """The beam search, its LM and the OOV penalty."""
    if decode.beam < 0 or decode.lm_order < 0:
        raise ConfigError(f"decode.beam and decode.lm_order must be >= 0, got {decode.beam}, {decode.lm_order}")
    has_lm = bool(decode.lm_order or decode.lm_arpa)
    grid = [decode.lm_weight, decode.word_bonus, *decode.lm_weights, *decode.word_bonuses]
    if any(v is not None and not v >= 0 for v in grid) or not (decode.lm_weights and decode.word_bonuses):
        raise ConfigError(f"decode.lm_weight, word_bonus, lm_weights and word_bonuses must be >= 0 and the lists not "
                          f"empty, got {decode.lm_weight}, {decode.word_bonus}, {list(decode.lm_weights)}, "
                          f"{list(decode.word_bonuses)}")
    if decode.oov_penalty < 0 or (decode.oov_penalty and not has_lm):
        raise ConfigError(f"decode.oov_penalty={decode.oov_penalty} must be >= 0 and needs the LM's vocabulary "
                          f"(decode.lm_order > 0, got {decode.lm_order}, or decode.lm_arpa)")
    if has_lm and not decode.beam:
        raise ConfigError(f"decode.lm_order={decode.lm_order} / decode.lm_arpa={decode.lm_arpa} needs a beam "
                          "search: set decode.beam (e.g. 8)")
    if decode.backend == "flashlight":
        _check_flashlight(decode, has_lm)
    if decode.lm_arpa and not Path(decode.lm_arpa).is_file():
        raise ConfigError(f"decode.lm_arpa: {decode.lm_arpa}: no such file")


def _check_augment(a: DictConfig, n_mels: int) -> None:
    """SpecAugment and speed perturbation."""
    if not a.speed_perturb or any(f <= 0 for f in a.speed_perturb) or len(set(a.speed_perturb)) < len(a.speed_perturb):
        raise ConfigError(f"augment.speed_perturb must be distinct factors > 0, got {list(a.speed_perturb)}")
    if not 0 <= a.freq_mask_width <= n_mels:
        raise ConfigError(f"augment.freq_mask_width must be in [0, features.n_mels={n_mels}], "
                          f"got {a.freq_mask_width}")
    for key in ("freq_masks", "time_masks", "time_mask_width", "time_warp"):
        if a[key] < 0:
            raise ConfigError(f"augment.{key} must be >= 0, got {a[key]}")
    if not 0.0 <= a.time_mask_ratio <= 1.0:
        raise ConfigError(f"augment.time_mask_ratio must be in [0, 1], got {a.time_mask_ratio}")


def _check_ce(cfg: DictConfig) -> None:
    """The paper's frame CE objective: 10 ms frames, alignments of the original audio, chunks of states."""
    if cfg.model.stack != 1:
        raise ConfigError(f"train.objective=ce scores every 10 ms frame: model.stack must be 1, got "
                          f"{cfg.model.stack}")
    if list(cfg.augment.speed_perturb) != [1.0]:
        raise ConfigError(f"train.objective=ce: alignments are of the original audio; augment.speed_perturb must "
                          f"be [1.0], got {list(cfg.augment.speed_perturb)}")
    for key in ("chunk_frames", "states_per_phone"):
        if cfg.data[key] < 1:
            raise ConfigError(f"data.{key} must be >= 1, got {cfg.data[key]}")


def _check_flashlight(decode: DictConfig, has_lm: bool) -> None:
    """Before any work: flashlight's lexicon decoder needs a word LM (its lexicon is the LM's vocabulary), and
    flashlight-text itself, which the recipe does not install."""
    if not (decode.beam and has_lm):
        raise ConfigError("decode.backend=flashlight decodes with a word LM: set decode.beam and decode.lm_order "
                          "(or decode.lm_arpa)")
    try:
        found = importlib.util.find_spec("flashlight.lib.text.decoder") is not None
    except ImportError:  # the parent package is missing
        found = False
    if not found:
        raise ConfigError("decode.backend=flashlight needs flashlight-text, which the recipe does not install: "
                          "pip install flashlight-text")
