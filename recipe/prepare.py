"""Recipe stages 1 and 2: prepare the data dirs, then extract features.

    python -m recipe.prepare data     --exp EXP [--conf FILE] [key=value ...]
    python -m recipe.prepare features --exp EXP [--conf FILE] [key=value ...]

Stage 1 synthesizes the built-in corpus (or reads the user's Kaldi data dirs, or prepares a public corpus from
its local folder: recipe/corpora.py), checks every utterance, writes clean data dirs and the token set into
EXP/data. Stage 2 fills (or finds) the feature caches, the training set at every speed-perturbation factor.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
from pathlib import Path

from comm import ProcessLayout, build_strategy
from recipe.augment import speed_perturbed
from recipe.config import ConfigError, load_config
from recipe.corpora import prepare_corpus
from recipe.data import DataError, build_tokens, check_tokens, load_data_dir, write_data_dir, write_tokens
from recipe.ds_config import load_ds_config
from recipe.features import extract_features

log = logging.getLogger("recipe.prepare")


def synthesized(conf, work: Path, n_train: int, n_test: int) -> Path:
    """The built-in corpus of that size (synthesized once, then found by its name)."""
    from recipe.synth import synthesize_corpus

    d = conf.data
    corpus = work / f"synth-v2-{n_train}-{n_test}-seed{d.synth_seed}-{d.sample_rate}"
    if not (corpus / ".done").is_file():
        synthesize_corpus(corpus, n_train=n_train, n_test=n_test, seed=d.synth_seed, sample_rate=d.sample_rate,
                          num_workers=conf.features.num_workers)
        (corpus / ".done").touch()
    return corpus


def prepare_data(conf, exp: Path, work: Path) -> dict:
    d = conf.data
    if d.corpus == "synth":
        corpus = synthesized(conf, work, d.synth_train, d.synth_test)
        sources = {"train": corpus / "train", "test": corpus / "test"}
    elif d.corpus == "kaldi":
        sources = {"train": Path(d.train_dir), "test": Path(d.test_dir)}
    else:  # a public corpus from its local folder: prepared once per folder and held-out speakers
        key = hashlib.sha1(f"{Path(d.corpus_dir or '').resolve()}|{sorted(d.heldout_speakers)}".encode()).hexdigest()
        sources = prepare_corpus(d.corpus, d.corpus_dir, work / f"{d.corpus}-{key[:10]}", d.heldout_speakers)
    summary, utts = {}, {}
    for split, src in sources.items():
        utts[split], skipped = load_data_dir(src, d.max_utt_seconds)
        summary[split] = {"source": str(src), "utterances": len(utts[split]), "skipped": dict(skipped)}
    if d.mix_synth:  # the built-in corpus's many voices added to a real corpus's training set
        mixed, _ = load_data_dir(synthesized(conf, work, d.mix_synth, 0) / "train", d.max_utt_seconds)
        clash = sorted({u.utt for u in mixed} & {u.utt for u in utts["train"]})
        if clash:
            raise DataError(f"data.mix_synth: utterance ids {clash[:3]} are both synthesized and in {sources['train']}")
        utts["train"] = sorted(utts["train"] + mixed, key=lambda u: u.utt)
        summary["train"]["mixed_synth"] = len(mixed)
    tokens = build_tokens(utts["train"])
    check_tokens(utts["test"], tokens, sources["test"] / "text")
    for split in sources:
        write_data_dir(utts[split], exp / "data" / split)
    write_tokens(tokens, exp / "data" / "tokens.txt")
    summary["tokens"] = len(tokens)
    (exp / "data" / "prep.json").write_text(json.dumps(summary, indent=1))
    return summary


def prepare_features(conf, exp: Path, work: Path) -> dict:
    where = {}
    for split in ("train", "test"):
        utts, _ = load_data_dir(exp / "data" / split)
        if split == "train":
            utts = speed_perturbed(utts, list(conf.augment.speed_perturb))
        where[split] = str(extract_features(utts, work, split, conf.features, conf.data.sample_rate))
    (exp / "features.json").write_text(json.dumps(where, indent=1))
    return {split: json.loads((Path(p) / "meta.json").read_text()) for split, p in where.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=("data", "features"))
    p.add_argument("--exp", required=True, help="experiment folder")
    p.add_argument("--conf", default=None, help="recipe YAML (default: the schema's defaults)")
    p.add_argument("--ds-config", default=None, help="checked here too, so a bad strategy or JSON fails before "
                                                     "hours of preparation rather than after")
    p.add_argument("--world-size", type=int, default=1, help="learners the strategy will be checked against")
    p.add_argument("--nodes", type=int, default=1, help="... on this many nodes")
    p.add_argument("--work", default=None, help="shared folder for corpora and feature caches "
                                                "(default: the experiment folder's parent)")
    p.add_argument("overrides", nargs="*", help="key=value settings over the YAML")
    args = p.parse_intermixed_args(argv)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    exp = Path(args.exp).resolve()
    work = Path(args.work).resolve() if args.work else exp.parent
    exp.mkdir(parents=True, exist_ok=True)
    try:
        conf = load_config(args.conf, args.overrides)
        if args.ds_config:
            env = {"WORLD_SIZE": args.world_size, "LOCAL_SIZE": args.world_size}
            build_strategy(load_ds_config(args.ds_config)[1], ProcessLayout.from_env(env, args.nodes))
        if args.stage == "data":
            summary = prepare_data(conf, exp, work / "corpus")
        else:
            summary = prepare_features(conf, exp, work / "features")
    except (ConfigError, DataError, ValueError) as err:  # LayoutError is a ValueError
        log.error("%s", err)
        return 2
    print(json.dumps(summary, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
