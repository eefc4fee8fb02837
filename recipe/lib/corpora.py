"""Public corpora in their distribution layouts -> Kaldi data dirs (train, test), chosen by name.

Each preparer reads a local folder as the corpus's owners distribute it and writes `train/` and `test/` data
dirs (wav.scp, text, utt2spk) that stage 1 then checks like any user's data dir. Nothing is downloaded here:
preparation always works from a local folder. Utterance ids start with the speaker id (Kaldi's convention,
so sorting by utterance also sorts by speaker). Transcripts are lowercased where the corpus writes them in
upper case: the recipe's character tokens are built from the training text.

    data.corpus=fsdd data.corpus_dir=/data/free-spoken-digit-dataset [data.heldout_speakers=[theo]]
    data.corpus=librispeech data.corpus_dir=/data/LibriSpeech data.train_sets=[train-clean-100] \\
        data.test_sets=[test-clean]
    data.corpus=an4 data.corpus_dir=/data/an4

A setting a corpus has no use for (data.train_sets for fsdd, data.heldout_speakers for librispeech, any of the
three for an4, whose splits are fixed by its etc/ files) is an error rather than silently ignored.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Callable

import soundfile

from recipe.lib.datadir import Utterance, write_data_dir
from recipe.lib.tables import DataError

log = logging.getLogger(__name__)


def refuse_unused(data, corpus: str, why: str, *options: str) -> None:
    """A split setting the corpus ignores would silently train on something else than the user asked for."""
    given = [f"data.{o}={list(getattr(data, o))}" for o in options if getattr(data, o)]
    if given:
        raise DataError(f"data.corpus={corpus} does not use {', '.join(given)}: {why}")


def check_new(seen: dict[str, str], utt: str, where: str) -> None:
    """A repeated id would only surface later, in the written data dir; name the source line instead."""
    if utt in seen:
        raise DataError(f"{where}: utterance id {utt} repeats {seen[utt]}")
    seen[utt] = where


def write_splits(corpus_dir: Path, splits: dict[str, list[Utterance]], out: Path, context: str) -> None:
    for split, utts in splits.items():
        if not utts:
            raise DataError(f"{corpus_dir}: the {split} split is empty ({context})")
    for split, utts in splits.items():
        write_data_dir(sorted(utts, key=lambda u: u.utt), out / split)


# --- Free Spoken Digit Dataset ---------------------------------------------------------------------------------

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
FSDD_NAME = re.compile(r"^(?P<digit>[0-9])_(?P<speaker>[A-Za-z0-9]+)_(?P<take>[0-9]+)\.wav$")
FSDD_TEST_TAKES = 5  # the dataset's own test split: takes 0-4 of every speaker


def prepare_fsdd(corpus_dir: Path, out: Path, data) -> None:
    """Free Spoken Digit Dataset: `recordings/{digit}_{speaker}_{take}.wav` (8 kHz), a digit word each.

    Test set: the held-out speakers' recordings, all of them (speaker-independent), or with no speaker held
    out, the dataset's own split (takes 0-4 of every speaker)."""
    refuse_unused(data, "fsdd", "its split is by speaker (data.heldout_speakers) or by take", "train_sets", "test_sets",
                  "dev_sets")
    heldout_speakers = list(data.heldout_speakers)
    recordings = corpus_dir / "recordings"
    if not recordings.is_dir():
        raise DataError(f"{corpus_dir}: no recordings/ folder (the FSDD layout is recordings/{{digit}}_"
                        f"{{speaker}}_{{take}}.wav)")
    splits: dict[str, list[Utterance]] = {"train": [], "test": []}
    for path in sorted(recordings.iterdir()):
        m = FSDD_NAME.match(path.name)
        if m is None:
            raise DataError(f"{path}: not an FSDD recording name ({{digit}}_{{speaker}}_{{take}}.wav)")
        speaker, take = m["speaker"], int(m["take"])
        held_out = speaker in heldout_speakers if heldout_speakers else take < FSDD_TEST_TAKES
        utt = f"{speaker}-{m['digit']}_{take:02d}"
        splits["test" if held_out else "train"].append(
            Utterance(utt, speaker, str(path.resolve()), DIGIT_WORDS[int(m["digit"])]))
    speakers = sorted({u.speaker for s in splits.values() for u in s})
    unknown = sorted(set(heldout_speakers) - set(speakers))
    if unknown:
        raise DataError(f"{corpus_dir}: held-out speakers {unknown} have no recordings; speakers: "
                        f"{', '.join(speakers)}")
    write_splits(corpus_dir, splits, out,
                 f"held out: {heldout_speakers or 'takes 0-4'}; speakers: {', '.join(speakers)}")


# --- LibriSpeech ------------------------------------------------------------------------------------------------

LIBRISPEECH_DEFAULT_SETS = {"train": ["train-clean-100"], "test": ["test-clean"], "dev": ["dev-clean"]}
LIBRISPEECH_LINE = re.compile(r"^(?P<chapter>(?P<speaker>[0-9]+)-[0-9]+)-[0-9]+ +(?P<text>\S.*)$")


def prepare_librispeech(corpus_dir: Path, out: Path, data) -> None:
    """LibriSpeech: `<subset>/<speaker>/<chapter>/<speaker>-<chapter>-<nnnn>.flac`, the chapter's transcripts in
    `<speaker>-<chapter>.trans.txt` (`<utterance id> TRANSCRIPT`). Splits: the subsets data.train_sets,
    data.test_sets and data.dev_sets name (default train-clean-100, test-clean, and dev-clean where the folder
    has it: without a dev subset, stage 1 carves the dev set out of training)."""
    refuse_unused(data, "librispeech", "its splits are subsets (data.train_sets, data.test_sets, data.dev_sets)",
                  "heldout_speakers")
    present = sorted(p.name for p in corpus_dir.iterdir() if p.is_dir())
    sets = {"train": list(data.train_sets) or LIBRISPEECH_DEFAULT_SETS["train"],
            "test": list(data.test_sets) or LIBRISPEECH_DEFAULT_SETS["test"]}
    taken = sets["train"] + sets["test"]
    sets["dev"] = list(data.dev_sets) or [s for s in LIBRISPEECH_DEFAULT_SETS["dev"] if s in present and s not in taken]
    if not sets["dev"]:
        del sets["dev"]
    for a, b in (("train", "test"), ("train", "dev"), ("test", "dev")):
        shared = sorted(set(sets[a]) & set(sets.get(b, [])))
        if shared:
            raise DataError(f"data.{a}_sets and data.{b}_sets share {shared}: the {b} set must be held out")
    for subset in [s for subsets in sets.values() for s in subsets]:
        if not (corpus_dir / subset).is_dir():
            raise DataError(f"{corpus_dir}: no subset folder {subset}/; subsets present: "
                            f"{', '.join(present) or 'none'}")
    seen: dict[str, str] = {}
    splits = {split: [u for subset in dict.fromkeys(subsets) for u in librispeech_subset(corpus_dir / subset, seen)]
              for split, subsets in sets.items()}
    write_splits(corpus_dir, splits, out, "; ".join(f"{split}: {', '.join(names)}" for split, names in sets.items()))


def librispeech_subset(subset: Path, seen: dict[str, str]) -> list[Utterance]:
    utts = []
    for trans in sorted(subset.glob("*/*/*.trans.txt")):
        chapter = trans.name.removesuffix(".trans.txt")
        for lineno, line in enumerate(trans.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            m = LIBRISPEECH_LINE.match(line.strip())
            if m is None or m["chapter"] != chapter:
                raise DataError(f"{trans}:{lineno}: expected '{chapter}-<nnnn> TRANSCRIPT', got {line!r}")
            utt = line.split()[0]
            flac = trans.parent / f"{utt}.flac"
            if not flac.is_file():
                raise DataError(f"{trans}:{lineno}: utterance {utt} has no audio: {flac} not found")
            check_new(seen, utt, f"{trans}:{lineno}")
            utts.append(Utterance(utt, m["speaker"], str(flac.resolve()), " ".join(m["text"].lower().split())))
    # Like Kaldi's fix_data_dir.sh: audio nobody transcribed is dropped, counted, not fatal
    transcribed = {u.utt for u in utts}
    untranscribed = sorted(f for f in subset.glob("*/*/*.flac") if f.stem not in transcribed)
    if untranscribed:
        log.warning("%s: %d flac files have no transcript line: skipped (first: %s)", subset, len(untranscribed),
                    untranscribed[0])
    return utts


# --- CMU AN4 ----------------------------------------------------------------------------------------------------

AN4_LINE = re.compile(r"^(?P<words>.*?)\s*\((?P<id>[^()\s]+)\)$")
AN4_RATE = 16000  # the .raw files: headerless big-endian 16-bit mono at 16 kHz


def prepare_an4(corpus_dir: Path, out: Path, data) -> None:
    """CMU AN4 as distributed (`an4/`, or the folder holding it): `etc/an4_{train,test}.fileids` list the
    audio (`an4_clstk/<speaker>/<name>`, relative to `wav/`, no extension), `etc/an4_{train,test}.transcription`
    the words on the same lines (`<s> WORDS </s> (<name>)`). Audio is `.sph` (NIST SPHERE, used as it is) or
    `.raw` (headerless, converted to WAV under `out/wav/<split>/`, since the recipe reads audio with libsndfile,
    which cannot guess a headerless file's format)."""
    refuse_unused(data, "an4", "its splits are fixed by etc/an4_{train,test}.fileids",
                  "heldout_speakers", "train_sets", "test_sets", "dev_sets")
    root = corpus_dir if (corpus_dir / "etc").is_dir() else corpus_dir / "an4"
    if not (root / "etc").is_dir():
        raise DataError(f"{corpus_dir}: no etc/ or an4/etc/ folder (the AN4 layout is an4/etc/an4_train.fileids, "
                        f"an4/wav/an4_clstk/<speaker>/<name>.raw or .sph, ...)")
    seen: dict[str, str] = {}
    splits = {split: an4_split(root, split, out / "wav" / split, seen) for split in ("train", "test")}
    write_splits(corpus_dir, splits, out, f"{root / 'etc'}/an4_{{train,test}}.fileids")


def an4_split(root: Path, split: str, wav_out: Path, seen: dict[str, str]) -> list[Utterance]:
    fileids, transcription = (root / "etc" / f"an4_{split}.{ext}" for ext in ("fileids", "transcription"))
    for path in (fileids, transcription):
        if not path.is_file():
            raise DataError(f"{path}: not found (AN4 lists each split's audio in etc/an4_<split>.fileids and its "
                            f"words in etc/an4_<split>.transcription)")
    ids, lines = nonblank_lines(fileids), nonblank_lines(transcription)
    if len(ids) != len(lines):
        raise DataError(f"{fileids} has {len(ids)} lines but {transcription} has {len(lines)}: they must match "
                        f"line by line")
    utts = []
    for (id_lineno, fileid), (lineno, line) in zip(ids, lines):
        listed = f"{fileids}:{id_lineno}"
        rel = Path(fileid)
        if len(rel.parts) < 2:
            raise DataError(f"{listed}: expected '<folder>/<speaker>/<name>', got {fileid!r}")
        m = AN4_LINE.match(line)
        if m is None:
            raise DataError(f"{transcription}:{lineno}: expected '<s> WORDS </s> (<name>)', got {line!r}")
        if m["id"] != rel.name:
            raise DataError(f"{transcription}:{lineno}: ({m['id']}) does not match {listed}: {fileid}")
        words = m["words"].split()
        if words[:1] == ["<s>"]:  # the sentence markers: the training file has them, the test file may not
            words = words[1:]
        if words[-1:] == ["</s>"]:
            words = words[:-1]
        speaker = rel.parent.name
        # an251-fash-b -> fash-an251-b: the speaker first, once (the id ESPnet's an4 recipe uses)
        utt = f"{speaker}-{rel.name.replace(f'-{speaker}-', '-')}"
        check_new(seen, utt, listed)
        audio = an4_audio(root / "wav" / rel, wav_out / f"{utt}.wav", listed)
        utts.append(Utterance(utt, speaker, audio, " ".join(words).lower()))
    return utts


def nonblank_lines(path: Path) -> list[tuple[int, str]]:
    return [(n, line.strip()) for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if line.strip()]


def an4_audio(stem: Path, wav: Path, where: str) -> str:
    """-> a path libsndfile opens by itself: the .sph as it is, or the .raw written out as a WAV."""
    sph, raw = stem.with_name(stem.name + ".sph"), stem.with_name(stem.name + ".raw")
    if sph.is_file():
        try:
            soundfile.info(str(sph))
        except Exception as err:  # libsndfile raises several types for files it cannot open
            with open(sph, "rb") as f:
                if b"shorten" in f.read(1024):  # the SPHERE header names the sample coding
                    raise DataError(f"{where}: {sph} is shorten-compressed NIST SPHERE, which libsndfile cannot "
                                    f"read; decompress it first (sph2pipe -f wav) or use CMU's an4_raw.bigendian "
                                    f"distribution") from None
            raise DataError(f"{where}: cannot read audio {sph}: {err}") from None
        return str(sph.resolve())
    if raw.is_file():
        # int16 in and out: the conversion is bit-exact
        samples, _ = soundfile.read(str(raw), format="RAW", subtype="PCM_16", endian="BIG", samplerate=AN4_RATE,
                                    channels=1, dtype="int16")
        wav.parent.mkdir(parents=True, exist_ok=True)
        soundfile.write(str(wav), samples, AN4_RATE, subtype="PCM_16")
        return str(wav.resolve())
    raise DataError(f"{where}: no audio: neither {sph} nor {raw} exists")


PREPARERS: dict[str, Callable[[Path, Path, object], None]] = {
    "fsdd": prepare_fsdd, "librispeech": prepare_librispeech, "an4": prepare_an4}


def prepare_corpus(name: str, data, out: Path) -> dict[str, Path]:
    """-> {"train": data dir, "test": data dir[, "dev": data dir where the corpus has its own]}, written under
    `out` (skipped when done before). `data` is the recipe's data section: data.corpus_dir, and the split settings
    the corpus uses."""
    if name not in PREPARERS:
        raise DataError(f"unknown corpus {name!r}; valid: {', '.join(PREPARERS)}")
    if not data.corpus_dir:
        raise DataError(f"data.corpus={name} needs data.corpus_dir: the corpus's local folder")
    folder = Path(data.corpus_dir)
    if not folder.is_dir():
        raise DataError(f"data.corpus_dir={data.corpus_dir}: not a folder")
    if not (out / ".done").is_file():
        PREPARERS[name](folder, out, data)
        (out / ".done").touch()
    return {split: out / split for split in ("train", "test", "dev") if (out / split).is_dir()}
