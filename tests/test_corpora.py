"""Public corpora from their distribution layouts (recipe/corpora.py), on fixtures the tests write."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile

from recipe.corpora import prepare_corpus
from recipe.data import DataError, load_data_dir
from recipe.prepare import main as prepare


def make_fsdd(root, speakers=("jackson", "theo"), digits=(3, 7), takes=6):
    rec = root / "recordings"
    rec.mkdir(parents=True)
    for s, speaker in enumerate(speakers):
        for digit in digits:
            for take in range(takes):
                t = np.arange(4000) / 8000
                soundfile.write(rec / f"{digit}_{speaker}_{take}.wav",
                                0.2 * np.sin(2 * np.pi * (300 + 40 * digit + 10 * s) * t), 8000, subtype="PCM_16")
    return root


def test_fsdd_with_a_speaker_held_out(tmp_path):
    corpus = make_fsdd(tmp_path / "fsdd")
    dirs = prepare_corpus("fsdd", str(corpus), tmp_path / "out", ["theo"])
    train, _ = load_data_dir(dirs["train"])
    test, _ = load_data_dir(dirs["test"])
    assert {u.speaker for u in train} == {"jackson"} and {u.speaker for u in test} == {"theo"}
    assert len(train) == len(test) == 12
    by_id = {u.utt: u for u in test}
    assert by_id["theo-7_03"].text == "seven" and by_id["theo-7_03"].audio.endswith("recordings/7_theo_3.wav")
    assert (tmp_path / "out" / ".done").is_file()


def test_fsdd_own_split_is_takes_0_to_4_of_every_speaker(tmp_path):
    dirs = prepare_corpus("fsdd", str(make_fsdd(tmp_path / "fsdd")), tmp_path / "out", [])
    test, _ = load_data_dir(dirs["test"])
    train, _ = load_data_dir(dirs["train"])
    assert len(test) == 2 * 2 * 5 and len(train) == 2 * 2 * 1
    assert {u.utt.split("_")[-1] for u in train} == {"05"}


def test_fsdd_bad_input_is_named(tmp_path):
    corpus = make_fsdd(tmp_path / "fsdd")
    with pytest.raises(DataError, match=r"held-out speakers \['bob'\] have no recordings; speakers: jackson, theo"):
        prepare_corpus("fsdd", str(corpus), tmp_path / "a", ["bob"])
    with pytest.raises(DataError, match="the train split is empty"):
        prepare_corpus("fsdd", str(corpus), tmp_path / "b", ["jackson", "theo"])
    (corpus / "recordings" / "notes.wav").write_bytes(b"")
    with pytest.raises(DataError, match=r"notes.wav: not an FSDD recording name"):
        prepare_corpus("fsdd", str(corpus), tmp_path / "c", ["theo"])
    with pytest.raises(DataError, match="no recordings/ folder"):
        prepare_corpus("fsdd", str(tmp_path), tmp_path / "d", [])
    with pytest.raises(DataError, match="needs data.corpus_dir"):
        prepare_corpus("fsdd", None, tmp_path / "e", [])
    with pytest.raises(DataError, match="unknown corpus 'timit'; valid: fsdd"):
        prepare_corpus("timit", str(corpus), tmp_path / "f", [])


def test_stage_1_prepares_fsdd_from_the_config(tmp_path):
    corpus = make_fsdd(tmp_path / "fsdd")
    exp = tmp_path / "exp"
    assert prepare(["data", "--exp", str(exp), "data.corpus=fsdd", f"data.corpus_dir={corpus}",
                    "data.heldout_speakers=[theo]", "data.sample_rate=8000"]) == 0
    assert (exp / "data" / "tokens.txt").read_text().split("\n")[1:-1] == sorted(set("threeseven"))
    assert len((exp / "data" / "test" / "text").read_text().splitlines()) == 12
    assert prepare(["data", "--exp", str(exp), "data.corpus=fsdd", f"data.corpus_dir={tmp_path / 'none'}"]) == 2


def test_synthesized_voices_can_be_mixed_into_a_real_training_set_only(tmp_path):
    corpus = make_fsdd(tmp_path / "fsdd")
    exp = tmp_path / "exp"
    assert prepare(["data", "--exp", str(exp), "data.corpus=fsdd", f"data.corpus_dir={corpus}",
                    "data.heldout_speakers=[theo]", "data.sample_rate=8000", "data.mix_synth=6"]) == 0
    train, _ = load_data_dir(exp / "data" / "train")
    test, _ = load_data_dir(exp / "data" / "test")
    synthesized = [u for u in train if "-train0000" in u.utt]
    assert len(train) == 12 + 6 and len(synthesized) == 6 and len(test) == 12  # the test set stays real
    assert [u.utt for u in train] == sorted(u.utt for u in train)
    assert prepare(["data", "--exp", str(tmp_path / "e2"), "data.mix_synth=6"]) == 2  # synth into synth: refused
