"""Recipe stages 1 and 2: prepare the data dirs, then extract features.

    python -m recipe.prepare data     --exp EXP [--conf FILE] [key=value ...]
    python -m recipe.prepare features --exp EXP [--conf FILE] [key=value ...]

Stage 1 synthesizes the built-in corpus (or reads the user's Kaldi data dirs, or prepares a public corpus from
its local folder: recipe/lib/corpora.py), checks every utterance, writes clean data dirs and the token set into
EXP/data. Stage 2 fills (or finds) the feature caches, the training set at every speed-perturbation factor (or
copies the user's Kaldi features into one), resolves speaker vectors by utterance, and for the CE objective
checks the frame targets against the features and stores them (recipe/lib/targets.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import sys
from pathlib import Path

import numpy as np

from recipe.lib.augment import source_utt, speed_perturbed
from recipe.lib.config import ConfigError, load_config
from recipe.lib.corpora import prepare_corpus
from recipe.lib.datadir import build_tokens, check_tokens, load_data_dir, write_data_dir, write_tokens
from recipe.lib.features import FeatureCache, extract_features, import_kaldi_features
from recipe.lib.kaldi_io import iter_alignments, read_vectors
from recipe.lib.splits import carve_dev
from recipe.lib.tables import DataError, absolute_rxfilename, read_table
from recipe.lib.targets import ctm_alignments, read_phone_table, write_targets

log = logging.getLogger("recipe.prepare")
SPLITS = ("train", "dev", "test")


def synthesized(conf, work: Path, n_train: int, n_test: int, n_dev: int = 0) -> Path:
    """The built-in corpus of that size (synthesized once, then found by its name)."""
    from recipe.lib.synth import synthesize_corpus

    d = conf.data
    corpus = work / f"synth-v3-{n_train}-{n_dev}-{n_test}-seed{d.synth_seed}-{d.sample_rate}"
    if not (corpus / ".done").is_file():
        synthesize_corpus(corpus, n_train=n_train, n_test=n_test, n_dev=n_dev, seed=d.synth_seed,
                          sample_rate=d.sample_rate, num_workers=conf.features.num_workers)
        (corpus / ".done").touch()
    return corpus


def data_sources(conf, work: Path) -> dict[str, Path]:
    """The data dirs of train and test, and of dev where the user or the corpus gives one."""
    d = conf.data
    if d.corpus == "synth":
        corpus = synthesized(conf, work, d.synth_train, d.synth_test, d.synth_dev)
        sources = {split: corpus / split for split in SPLITS}
    elif d.corpus == "kaldi":
        sources = {"train": Path(d.train_dir), "test": Path(d.test_dir)}
    else:  # a public corpus from its local folder: prepared once per folder and choice of splits
        splits = [sorted(d.heldout_speakers), sorted(d.train_sets), sorted(d.test_sets), sorted(d.dev_sets)]
        key = hashlib.sha1(f"{Path(d.corpus_dir or '').resolve()}|{splits}".encode()).hexdigest()
        sources = prepare_corpus(d.corpus, d, work / f"{d.corpus}-{key[:10]}")
    if d.dev_dir:
        sources["dev"] = Path(d.dev_dir)
    return sources


def prepare_data(conf, exp: Path, work: Path) -> dict:
    d = conf.data
    sources = data_sources(conf, work)
    summary, utts = {}, {}
    for split, src in sources.items():
        utts[split], skipped = load_data_dir(src, d.max_utt_seconds, d.on_bad_utterance)
        summary[split] = {"source": str(src), "utterances": len(utts[split]), "skipped": dict(skipped)}
    if "dev" not in sources:  # before the subset and the mixing: the dev set is of the user's own speech
        utts["train"], utts["dev"], how = carve_dev(utts["train"], d.dev_share, d.dev_min_utterances)
        sources["dev"] = sources["train"]
        summary["dev"] = {"source": f"{sources['train']}: {how}", "utterances": len(utts["dev"]), "skipped": {}}
        summary["train"]["held_out_for_dev"] = len(utts["dev"])
        log.info("dev set: %s", how)
    if 0 < d.train_utterances < len(utts["train"]):  # every k-th in id order, as Kaldi's subset_data_dir.sh
        step = len(utts["train"]) / d.train_utterances
        utts["train"] = [utts["train"][int(i * step)] for i in range(d.train_utterances)]
        summary["train"]["subset"] = d.train_utterances
    if d.mix_synth:  # the built-in corpus's many voices added to a real corpus's training set
        mixed, _ = load_data_dir(synthesized(conf, work, d.mix_synth, 0) / "train", d.max_utt_seconds)
        clash = sorted({u.utt for u in mixed} & {u.utt for split in utts.values() for u in split})
        if clash:
            raise DataError(f"data.mix_synth: utterance ids {clash[:3]} are both synthesized and in your corpus")
        utts["train"] = sorted(utts["train"] + mixed, key=lambda u: u.utt)
        summary["train"]["mixed_synth"] = len(mixed)
    check_disjoint(utts, sources)
    tokens = build_tokens(utts["train"])
    for split in ("dev", "test"):
        check_tokens(utts[split], tokens, sources[split] / "text")
    for split in SPLITS:
        write_data_dir(utts[split], exp / "data" / split)
        copy_side_files(sources[split], exp / "data", split, {u.utt for u in utts[split]})
    write_tokens(tokens, exp / "data" / "tokens.txt")
    summary["tokens"] = len(tokens)
    (exp / "data" / "prep.json").write_text(json.dumps(summary, indent=1))
    return summary


def check_disjoint(utts: dict[str, list], sources: dict[str, Path]) -> None:
    """An utterance in two splits would score the model on what it trained on (or tune on the test set)."""
    for a, b in (("train", "dev"), ("train", "test"), ("dev", "test")):
        shared = sorted({u.utt for u in utts[a]} & {u.utt for u in utts[b]})
        if shared:
            raise DataError(f"{sources[a]} and {sources[b]} share {len(shared)} utterance ids (first: {shared[0]}): "
                            f"the {b} set must be held out from the {a} set")


def copy_side_files(src: Path, data: Path, split: str, kept: set[str]) -> None:
    """Kaldi's cmvn.scp (archive paths made absolute) and a phone CTM with its phone table, when the source data
    dir has them: the CE objective's targets can come from the CTM (the built-in corpus writes one)."""
    out = data / split
    if (src / "cmvn.scp").is_file():
        lines = []
        for spk, (entry, _) in read_table(src / "cmvn.scp").items():
            path, offset = absolute_rxfilename(entry)
            lines.append(f"{spk} {path}{offset}\n")
        (out / "cmvn.scp").write_text("".join(lines))
    if (src / "phones.ctm").is_file():
        with open(src / "phones.ctm") as f, open(out / "phones.ctm", "w") as ctm:
            ctm.writelines(line for line in f if line.split(maxsplit=1)[0] in kept)
        table = next((p / "phones.txt" for p in (src, src.parent) if (p / "phones.txt").is_file()), None)
        if table is None:
            raise DataError(f"{src}/phones.ctm: no phones.txt beside it or in {src.parent}")
        shutil.copyfile(table, data / "phones.txt")


def prepare_features(conf, exp: Path, work: Path) -> dict:
    where = {}
    for split in SPLITS:
        data = exp / "data" / split
        utts, _ = load_data_dir(data)
        if (data / "feats.scp").is_file():  # the user's Kaldi features stand for the audio
            if list(conf.augment.speed_perturb) != [1.0]:
                raise ConfigError(f"{data}/feats.scp: Kaldi features cannot be speed-perturbed; set "
                                  f"augment.speed_perturb=[1.0] (or perturb in Kaldi: utils/perturb_data_dir_speed.sh)")
            cmvn = data / "cmvn.scp" if (data / "cmvn.scp").is_file() else None
            where[split] = str(import_kaldi_features(utts, work, split, data / "feats.scp", cmvn))
            continue
        if split == "train":
            utts = speed_perturbed(utts, list(conf.augment.speed_perturb))
        where[split] = str(extract_features(utts, work, split, conf.features, conf.data.sample_rate))
    (exp / "features.json").write_text(json.dumps(where, indent=1))
    caches = {split: FeatureCache(path) for split, path in where.items()}
    summary = {split: cache.meta for split, cache in caches.items()}
    for split, cache in caches.items():
        path = split_setting(conf.data, "ivectors", split)
        if path:
            summary[split]["speaker_vectors"] = write_vectors(Path(path), cache, exp / "vectors" / f"{split}.npz",
                                                              conf.data.on_bad_utterance)
    if conf.train.objective == "ce":
        num_targets = conf.model.output_dim or None
        for split, cache in caches.items():  # train first: its alignments fix the number of classes
            alignments, source, num_targets = frame_alignments(conf, exp, split, cache, num_targets)
            meta = write_targets(cache, alignments, source, exp / "targets" / split, num_targets,
                                 conf.data.ali_tolerance, conf.data.on_bad_utterance)
            num_targets = meta["num_targets"]
            summary[split]["targets"] = {k: meta[k] for k in ("source", "num_targets", "frames", "skipped")}
    return summary


def frame_alignments(conf, exp: Path, split: str, cache: FeatureCache, num_targets: int | None):
    """-> ((utt, frame targets) pairs, streamed; where they came from; number of classes or None): the
    configured Kaldi alignments, else the data dir's phone CTM."""
    path = split_setting(conf.data, "ali", split)
    if path:
        return iter_alignments(Path(path)), path, num_targets  # None for train: its largest id + 1
    ctm = exp / "data" / split / "phones.ctm"
    if not ctm.is_file():
        raise DataError(f"train.objective=ce needs frame targets for {split}: set data.{split}_ali to Kaldi "
                        f"alignments (ali-to-pdf output) or give a phones.ctm and phones.txt with the data dir")
    phones = read_phone_table(exp / "data" / "phones.txt")
    f, states = conf.features, conf.data.states_per_phone
    alignments = ctm_alignments(ctm, phones, dict(zip(cache.utts, cache.frames.tolist())), f.hop_ms / 1000,
                                f.win_ms / 1000, states)
    return alignments, str(ctm), num_targets or len(phones) * states


def split_setting(data, name: str, split: str) -> str | None:
    """data.{split}_{name}; the dev set's falls back to the training set's, which covers a dev set carved out of
    the training data (a dev set of its own without one fails naming the utterance the file lacks)."""
    return data[f"{split}_{name}"] or (data[f"train_{name}"] if split == "dev" else None)


def write_vectors(path: Path, cache: FeatureCache, out: Path, on_bad: str) -> dict:
    """Speaker vectors (i-vectors) by utterance, looked up by utterance id and else by speaker (speed-perturbed
    copies take their source's) -> counts. An utterance with neither stops the run, or is left out (skip)."""
    vectors = read_vectors(path)
    utts, rows, missing = [], [], []
    for utt, speaker in zip(cache.utts, cache.speakers):
        key = next((k for k in (utt, source_utt(utt), speaker, source_utt(speaker)) if k in vectors), None)
        if key is None:
            if on_bad == "error":
                raise DataError(f"{path}: no vector for utterance {utt} or its speaker {speaker} "
                                f"(data.on_bad_utterance=skip leaves such utterances out)")
            log.warning("%s: no vector for utterance %s or its speaker %s: skipped", path, utt, speaker)
            missing.append(utt)
            continue
        utts.append(utt)
        rows.append(vectors[key])
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(out, utts=np.array(utts, dtype=str), vectors=np.array(rows, dtype=np.float32))
    return {"source": str(path), "utterances": len(utts), "dim": len(rows[0]) if rows else 0,
            "skipped": {"no_speaker_vector": len(missing)} if missing else {}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=("data", "features"))
    p.add_argument("--exp", required=True, help="experiment folder")
    p.add_argument("--conf", default=None, help="recipe YAML (default: the schema's defaults)")
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
        if args.stage == "data":
            summary = prepare_data(conf, exp, work / "corpus")
        else:
            summary = prepare_features(conf, exp, work / "features")
    except (ConfigError, DataError, ValueError) as err:
        log.error("%s", err)
        return 2
    print(json.dumps(summary, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
