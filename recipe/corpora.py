"""Public corpora in their distribution layouts -> Kaldi data dirs (train, test), chosen by name.

Each preparer reads a local folder as the corpus's owners distribute it and writes `train/` and `test/` data
dirs (wav.scp, text, utt2spk) that stage 1 then checks like any user's data dir. Nothing is downloaded here:
preparation always works from a local folder. Utterance ids start with the speaker id (Kaldi's convention,
so sorting by utterance also sorts by speaker).

    data.corpus=fsdd data.corpus_dir=/path/to/free-spoken-digit-dataset [data.heldout_speakers=[theo]]
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from recipe.data import DataError, Utterance, write_data_dir

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
FSDD_NAME = re.compile(r"^(?P<digit>[0-9])_(?P<speaker>[A-Za-z0-9]+)_(?P<take>[0-9]+)\.wav$")
FSDD_TEST_TAKES = 5  # the dataset's own test split: takes 0-4 of every speaker


def prepare_fsdd(corpus_dir: Path, out: Path, heldout_speakers: list[str]) -> None:
    """Free Spoken Digit Dataset: `recordings/{digit}_{speaker}_{take}.wav` (8 kHz), a digit word each.

    Test set: the held-out speakers' recordings, all of them (speaker-independent), or with no speaker held
    out, the dataset's own split (takes 0-4 of every speaker)."""
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
    for split, utts in splits.items():
        if not utts:
            raise DataError(f"{corpus_dir}: the {split} split is empty (held out: {heldout_speakers or 'takes 0-4'};"
                            f" speakers: {', '.join(speakers)})")
        write_data_dir(sorted(utts, key=lambda u: u.utt), out / split)


PREPARERS: dict[str, Callable[[Path, Path, list[str]], None]] = {"fsdd": prepare_fsdd}


def prepare_corpus(name: str, corpus_dir: str | None, out: Path, heldout_speakers: list[str]) -> dict[str, Path]:
    """-> {"train": data dir, "test": data dir}, written under `out` (skipped when done before)."""
    if name not in PREPARERS:
        raise DataError(f"unknown corpus {name!r}; valid: {', '.join(PREPARERS)}")
    if not corpus_dir:
        raise DataError(f"data.corpus={name} needs data.corpus_dir: the corpus's local folder")
    folder = Path(corpus_dir)
    if not folder.is_dir():
        raise DataError(f"data.corpus_dir={corpus_dir}: not a folder")
    if not (out / ".done").is_file():
        PREPARERS[name](folder, out, list(heldout_speakers))
        (out / ".done").touch()
    return {"train": out / "train", "test": out / "test"}
