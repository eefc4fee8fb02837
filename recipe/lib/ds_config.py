"""The DeepSpeed JSON: engine settings plus the strategy's "comm" section, in one file per experiment.

Swapping this file is how a user runs an ablation (ds_configs/, ds_configs/tuning/). The optimizer and
learning-rate schedule are the YAML's (section optim), so a JSON that also sets them is rejected rather than
letting two files disagree; train_batch_size likewise follows from the micro batch, the accumulation steps
and the strategy's data-parallel group (DESIGN.md §9.3), so it is not written by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

from recipe.lib.config import ConfigError

OWNED_BY_YAML = {"optimizer": "optim", "scheduler": "optim", "train_batch_size": "(derived)"}


def load_ds_config(path: str | Path) -> tuple[dict, dict]:
    """-> (engine settings for deepspeed.initialize, the "comm" section)."""
    path = Path(path)
    try:
        conf = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: DeepSpeed config not found") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}:{err.lineno}:{err.colno}: invalid JSON: {err.msg}") from None
    if not isinstance(conf, dict) or "comm" not in conf:
        raise ConfigError(f'{path}: needs a "comm" section naming the strategy, e.g. "comm": {{"strategy": "sync"}}')
    for key, owner in OWNED_BY_YAML.items():
        if key in conf:
            raise ConfigError(f"{path}: {key!r} is not set in the DeepSpeed JSON here; "
                              f"it comes from the recipe YAML {owner}")
    if "train_micro_batch_size_per_gpu" not in conf:
        raise ConfigError(f"{path}: needs train_micro_batch_size_per_gpu (utterances per learner per step)")
    comm = conf.pop("comm")
    if conf.get("bf16", {}).get("enabled"):
        # DeepSpeed reduces bf16 gradients in bf16 unless told otherwise: 8 bits of mantissa summed over every
        # learner. fp32 costs twice the bytes of a reduction that is a small share of an LSTM's step.
        conf.setdefault("communication_data_type", "fp32")
    return conf, comm
