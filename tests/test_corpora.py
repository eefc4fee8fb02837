"""Public corpora from their distribution layouts (recipe/lib/corpora.py), on fixtures the tests write."""

from __future__ import annotations

import json
import numpy as np
import pytest
import soundfile
from omegaconf import OmegaConf

from recipe.lib.config import DataConf
from recipe.lib.corpora import prepare_corpus
from recipe.lib.datadir import load_data_dir
from recipe.lib.tables import DataError
from recipe.prepare import main as prepare


def data(corpus_dir, **settings):
    """The recipe's data section, as stage 1 hands it to prepare_corpus."""
    return OmegaConf.structured(DataConf(corpus_dir=corpus_dir and str(corpus_dir), **settings))


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
    dirs = prepare_corpus("fsdd", data(corpus, heldout_speakers=["theo"]), tmp_path / "out")
    train, _ = load_data_dir(dirs["train"])
    test, _ = load_data_dir(dirs["test"])
    assert {u.speaker for u in train} == {"jackson"} and {u.speaker for u in test} == {"theo"}
    assert len(train) == len(test) == 12
    by_id = {u.utt: u for u in test}
    assert by_id["theo-7_03"].text == "seven" and by_id["theo-7_03"].audio.endswith("recordings/7_theo_3.wav")
    assert (tmp_path / "out" / ".done").is_file()


def test_fsdd_own_split_is_takes_0_to_4_of_every_speaker(tmp_path):
    dirs = prepare_corpus("fsdd", data(make_fsdd(tmp_path / "fsdd")), tmp_path / "out")
    test, _ = load_data_dir(dirs["test"])
    train, _ = load_data_dir(dirs["train"])
    assert len(test) == 2 * 2 * 5 and len(train) == 2 * 2 * 1
    assert {u.utt.split("_")[-1] for u in train} == {"05"}


def test_fsdd_bad_input_is_named(tmp_path):
    corpus = make_fsdd(tmp_path / "fsdd")
    with pytest.raises(DataError, match=r"held-out speakers \['bob'\] have no recordings; speakers: jackson, theo"):
        prepare_corpus("fsdd", data(corpus, heldout_speakers=["bob"]), tmp_path / "a")
    with pytest.raises(DataError, match="the train split is empty"):
        prepare_corpus("fsdd", data(corpus, heldout_speakers=["jackson", "theo"]), tmp_path / "b")
    (corpus / "recordings" / "notes.wav").write_bytes(b"")
    with pytest.raises(DataError, match=r"notes.wav: not an FSDD recording name"):
        prepare_corpus("fsdd", data(corpus, heldout_speakers=["theo"]), tmp_path / "c")
    with pytest.raises(DataError, match="no recordings/ folder"):
        prepare_corpus("fsdd", data(tmp_path), tmp_path / "d")
    with pytest.raises(DataError, match="needs data.corpus_dir"):
        prepare_corpus("fsdd", data(None), tmp_path / "e")
    with pytest.raises(DataError, match=r"data.corpus=fsdd does not use data.test_sets=\['test-clean'\]"):
        prepare_corpus("fsdd", data(corpus, test_sets=["test-clean"]), tmp_path / "f")
    with pytest.raises(DataError, match="unknown corpus 'timit'; valid: fsdd, librispeech, an4"):
        prepare_corpus("timit", data(corpus), tmp_path / "g")


def test_stage_1_prepares_fsdd_from_the_config(tmp_path):
    corpus = make_fsdd(tmp_path / "fsdd")
    exp = tmp_path / "exp"
    assert prepare(["data", "--exp", str(exp), "data.corpus=fsdd", f"data.corpus_dir={corpus}",
                    "data.heldout_speakers=[theo]", "data.sample_rate=8000"]) == 0
    assert (exp / "data" / "tokens.txt").read_text().split("\n")[1:-1] == sorted(set("threeseven"))
    assert len((exp / "data" / "test" / "text").read_text().splitlines()) == 12
    assert prepare(["data", "--exp", str(exp), "data.corpus=fsdd", f"data.corpus_dir={tmp_path / 'none'}"]) == 2


def test_a_training_subset_is_evenly_spaced_in_id_order(tmp_path):
    corpus = make_fsdd(tmp_path / "fsdd", takes=5)  # jackson's 10 utterances train
    exp = tmp_path / "exp"
    assert prepare(["data", "--exp", str(exp), "data.corpus=fsdd", f"data.corpus_dir={corpus}",
                    "data.heldout_speakers=[theo]", "data.sample_rate=8000", "data.train_utterances=4"]) == 0
    ids = [line.split()[0] for line in (exp / "data" / "train" / "text").read_text().splitlines()]
    assert ids == ["jackson-3_00", "jackson-3_02", "jackson-7_00", "jackson-7_02"]  # 0, 2, 5, 7 of 10
    assert len((exp / "data" / "test" / "text").read_text().splitlines()) == 10  # the held-out set: all


def test_synthesized_voices_can_be_mixed_into_a_real_training_set_only(tmp_path):
    corpus = make_fsdd(tmp_path / "fsdd")
    exp = tmp_path / "exp"
    assert prepare(["data", "--exp", str(exp), "data.corpus=fsdd", f"data.corpus_dir={corpus}",
                    "data.heldout_speakers=[theo]", "data.sample_rate=8000", "data.mix_synth=6"]) == 0
    train, _ = load_data_dir(exp / "data" / "train")
    test, _ = load_data_dir(exp / "data" / "test")
    dev, _ = load_data_dir(exp / "data" / "dev")
    synthesized = [u for u in train if "-train0000" in u.utt]
    # the dev set (carved out of the 12 real training recordings: 1) and the test set stay real
    assert len(dev) == 1 and len(train) == 11 + 6 and len(synthesized) == 6 and len(test) == 12
    assert not any("-train0000" in u.utt for u in dev)
    assert [u.utt for u in train] == sorted(u.utt for u in train)
    assert prepare(["data", "--exp", str(tmp_path / "e2"), "data.mix_synth=6"]) == 2  # synth into synth: refused


def test_a_carved_dev_set_has_no_speed_perturbed_copy_in_training(tmp_path):
    """Stage 1 carves the dev set before stage 2 perturbs the speed of what training keeps: no copy of a dev
    utterance (sp0.9-<utt>, sp1.1-<utt>) trains."""
    from recipe.lib.augment import source_utt
    from recipe.lib.features import FeatureCache

    corpus = make_fsdd(tmp_path / "fsdd", speakers=("jackson", "lucas", "theo"), takes=10)
    exp = tmp_path / "exp"
    settings = ["data.corpus=fsdd", f"data.corpus_dir={corpus}", "data.heldout_speakers=[theo]",
                "data.sample_rate=8000", "features.num_workers=1"]
    for stage in ("data", "features"):
        assert prepare([stage, "--exp", str(exp), *settings]) == 0
    dev = {u.utt for u in load_data_dir(exp / "data" / "dev")[0]}
    train = FeatureCache(json.loads((exp / "features.json").read_text())["train"]).utts
    assert len(dev) == 4 and len(train) == 3 * (40 - 4)  # 10% of 40 recordings; 3 speeds of the other 36
    assert {u.split("-", 1)[0] for u in train} == {"sp0.9", "sp1.1", "jackson", "lucas"}
    assert not {source_utt(u) for u in train} & dev


def noise(seed: int, n: int = 1600) -> np.ndarray:
    """0.1 s of 16-bit noise: every sample differs, so a byte-order or offset slip shows."""
    return np.random.default_rng(seed).integers(-8000, 8000, n).astype(np.int16)


def append(path, text):
    with open(path, "a") as f:
        f.write(text)


def replace_in(path, old, new):
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new))


# speaker-chapter -> transcripts, per subset, as LibriSpeech writes them (upper case, apostrophes kept)
LIBRISPEECH = {"train-clean-100": {"19-198": ["NORTHANGER ABBEY", "HE'S  GONE"], "26-495": ["YES IT IS"]},
               "test-clean": {"1089-134686": ["THE THIN BOY SAT"]},  # only characters the training text has
               "dev-clean": {"84-121123": ["SHE IS ON THE BOAT"]}}


def make_librispeech(root):
    for seed, (subset, chapters) in enumerate(LIBRISPEECH.items()):
        for chapter, texts in chapters.items():
            folder = root / subset / chapter.replace("-", "/")
            folder.mkdir(parents=True)
            for n, text in enumerate(texts):
                soundfile.write(folder / f"{chapter}-{n:04d}.flac", noise(seed + n), 16000, subtype="PCM_16")
                append(folder / f"{chapter}.trans.txt", f"{chapter}-{n:04d} {text}\n")
    return root


def test_librispeech_default_subsets(tmp_path, caplog):
    corpus = make_librispeech(tmp_path / "LibriSpeech")
    soundfile.write(corpus / "train-clean-100/19/198/19-198-0007.flac", noise(9), 16000)  # no transcript line
    dirs = prepare_corpus("librispeech", data(corpus), tmp_path / "out")
    train, _ = load_data_dir(dirs["train"])
    test, _ = load_data_dir(dirs["test"])
    assert [(u.utt, u.speaker, u.text) for u in train] == [
        ("19-198-0000", "19", "northanger abbey"), ("19-198-0001", "19", "he's gone"),
        ("26-495-0000", "26", "yes it is")]
    assert [(u.utt, u.speaker) for u in test] == [("1089-134686-0000", "1089")]
    assert train[0].audio == str((corpus / "train-clean-100/19/198/19-198-0000.flac").resolve())
    assert "train-clean-100: 1 flac files have no transcript line: skipped" in caplog.text


LIBRISPEECH_TRANS = "train-clean-100/19/198/19-198.trans.txt"


@pytest.mark.parametrize("edit, settings, message", [
    (lambda c: (c / "train-clean-100/19/198/19-198-0001.flac").unlink(), {},
     r"19-198\.trans\.txt:2: utterance 19-198-0001 has no audio: .*19-198-0001\.flac not found"),
    (lambda c: append(c / LIBRISPEECH_TRANS, "19-198-0002\n"), {},
     r"19-198\.trans\.txt:3: expected '19-198-<nnnn> TRANSCRIPT', got '19-198-0002'"),
    (lambda c: append(c / LIBRISPEECH_TRANS, "26-495-0000 YES IT IS\n"), {},  # another chapter's line
     r"19-198\.trans\.txt:3: expected '19-198-<nnnn> TRANSCRIPT'"),
    (None, {"test_sets": ["test-other"]},
     r"no subset folder test-other/; subsets present: dev-clean, test-clean, train-clean-100"),
    (None, {"train_sets": ["dev-clean"], "test_sets": ["dev-clean"]}, r"data.train_sets and data.test_sets share"),
    (None, {"heldout_speakers": ["19"]}, r"data.corpus=librispeech does not use data.heldout_speakers=\['19'\]"),
], ids=["text-without-audio", "no-transcript", "other-chapter", "missing-subset", "shared-subset", "heldout"])
def test_librispeech_bad_input_is_named(tmp_path, edit, settings, message):
    corpus = make_librispeech(tmp_path / "LibriSpeech")
    if edit:
        edit(corpus)
    with pytest.raises(DataError, match=message):
        prepare_corpus("librispeech", data(corpus, **settings), tmp_path / "out")


# fileid (relative to wav/, no extension) -> transcript line's words, per split; the test file has no <s> </s>
AN4 = {"train": {"an4_clstk/fash/an251-fash-b": "<s> YES </s>", "an4_clstk/fash/an253-fash-b": "<s> RUBOUT G M E </s>",
                 "an4_clstk/fbbh/an76-fbbh-b": "<s> ENTER SIX TWO </s>"},
       "test": {"an4test_clstk/fcaw/cen1-fcaw-b": "GO"}}
AN4_IDS = {"train": ["fash-an251-b", "fash-an253-b", "fbbh-an76-b"], "test": ["fcaw-cen1-b"]}


def make_an4(root, ext: str) -> dict[str, np.ndarray]:
    """CMU's an4/ folder under root, audio as big-endian headerless .raw or NIST .sph -> samples by fileid."""
    etc = root / "an4" / "etc"
    etc.mkdir(parents=True)
    samples = {}
    for split, lines in AN4.items():
        for fileid, words in lines.items():
            append(etc / f"an4_{split}.fileids", f"{fileid}\n")
            append(etc / f"an4_{split}.transcription", f"{words} ({fileid.split('/')[-1]})\n")
            samples[fileid] = x = noise(len(samples))
            audio = root / "an4" / "wav" / f"{fileid}.{ext}"
            audio.parent.mkdir(parents=True, exist_ok=True)
            if ext == "raw":
                x.astype(">i2").tofile(audio)
            else:
                soundfile.write(audio, x, 16000, format="NIST", subtype="PCM_16", endian="BIG")
    return samples


def test_an4_raw_audio_is_converted_sample_for_sample(tmp_path):
    samples = make_an4(tmp_path, "raw")
    dirs = prepare_corpus("an4", data(tmp_path / "an4"), tmp_path / "out")
    for split, fileids in AN4.items():
        utts, _ = load_data_dir(dirs[split])
        assert [u.utt for u in utts] == AN4_IDS[split]
        assert [u.speaker for u in utts] == [f.split("/")[1] for f in fileids]
        assert [u.text for u in utts] == [w.replace("<s> ", "").replace(" </s>", "").lower() for w in fileids.values()]
        for u, fileid in zip(utts, fileids):
            assert u.audio == str(tmp_path / "out" / "wav" / split / f"{u.utt}.wav")
            wave, rate = soundfile.read(u.audio, dtype="int16")
            assert rate == 16000 and np.abs(wave.astype(int) - samples[fileid]).max() <= 1


def test_an4_sph_audio_is_used_as_it_is_from_the_folder_holding_an4(tmp_path):
    make_an4(tmp_path, "sph")
    dirs = prepare_corpus("an4", data(tmp_path), tmp_path / "out")
    test, _ = load_data_dir(dirs["test"])
    assert [(u.utt, u.text) for u in test] == [("fcaw-cen1-b", "go")]
    assert test[0].audio == str(tmp_path / "an4/wav/an4test_clstk/fcaw/cen1-fcaw-b.sph")
    assert not (tmp_path / "out" / "wav").exists()


def write_shorten_sph(path):
    """A SPHERE header announcing shorten compression, as LDC's and some AN4 distributions ship it."""
    header = (b"NIST_1A\n   1024\nchannel_count -i 1\nsample_rate -i 16000\nsample_n_bytes -i 2\n"
              b"sample_byte_format -s2 10\nsample_coding -s26 pcm,embedded-shorten-v2.00\nend_head\n")
    path.write_bytes(header.ljust(1024, b" ") + bytes(range(256)))


@pytest.mark.parametrize("edit, settings, message", [
    (lambda r: replace_in(r / "an4/etc/an4_train.transcription", "(an253-fash-b)", "(an999-fash-b)"), {},
     r"an4_train\.transcription:2: \(an999-fash-b\) does not match .*an4_train\.fileids:2: "
     r"an4_clstk/fash/an253-fash-b"),
    (lambda r: replace_in(r / "an4/etc/an4_test.transcription", "GO (cen1-fcaw-b)", "GO cen1-fcaw-b"), {},
     r"an4_test\.transcription:1: expected '<s> WORDS </s> \(<name>\)', got 'GO cen1-fcaw-b'"),
    (lambda r: append(r / "an4/etc/an4_train.fileids", "an4_clstk/fash/an254-fash-b\n"), {},
     r"an4_train\.fileids has 4 lines but .*an4_train\.transcription has 3"),
    (lambda r: (r / "an4/wav/an4_clstk/fbbh/an76-fbbh-b.raw").unlink(), {},
     r"an4_train\.fileids:3: no audio: neither .*an76-fbbh-b\.sph nor .*an76-fbbh-b\.raw exists"),
    (lambda r: write_shorten_sph(r / "an4/wav/an4test_clstk/fcaw/cen1-fcaw-b.sph"), {},
     r"an4_test\.fileids:1: .*cen1-fcaw-b\.sph is shorten-compressed NIST SPHERE, which libsndfile cannot read"),
    (lambda r: (r / "an4/etc/an4_test.transcription").unlink(), {}, r"an4_test\.transcription: not found"),
    (lambda r: replace_in(r / "an4/etc/an4_train.fileids", "an4_clstk/fash/an251-fash-b", "an251-fash-b"), {},
     r"an4_train\.fileids:1: expected '<folder>/<speaker>/<name>', got 'an251-fash-b'"),
    (None, {"train_sets": ["an4_clstk"]}, r"data.corpus=an4 does not use data.train_sets=\['an4_clstk'\]"),
], ids=["id-mismatch", "no-id", "line-count", "no-audio", "shorten-sph", "no-transcription", "bad-fileid", "sets"])
def test_an4_bad_input_is_named(tmp_path, edit, settings, message):
    make_an4(tmp_path, "raw")
    if edit:
        edit(tmp_path)
    with pytest.raises(DataError, match=message):
        prepare_corpus("an4", data(tmp_path, **settings), tmp_path / "out")


def test_an4_needs_its_etc_folder(tmp_path):
    with pytest.raises(DataError, match=r"no etc/ or an4/etc/ folder"):
        prepare_corpus("an4", data(tmp_path), tmp_path / "out")


def test_stage_1_prepares_librispeech_subsets_from_the_config(tmp_path):
    corpus = make_librispeech(tmp_path / "LibriSpeech")
    exp = tmp_path / "exp"
    assert prepare(["data", "--exp", str(exp), "data.corpus=librispeech", f"data.corpus_dir={corpus}"]) == 0
    assert (exp / "data" / "test" / "text").read_text() == "1089-134686-0000 the thin boy sat\n"
    assert (exp / "data" / "dev" / "text").read_text() == "84-121123-0000 she is on the boat\n"  # its own dev-clean
    assert "'" in (exp / "data" / "tokens.txt").read_text().split("\n")
    # another choice of subsets is prepared anew, not found under the first one's folder
    assert prepare(["data", "--exp", str(exp), "data.corpus=librispeech", f"data.corpus_dir={corpus}",
                    "data.test_sets=[dev-clean]", "data.dev_sets=[test-clean]"]) == 0
    assert (exp / "data" / "test" / "text").read_text() == "84-121123-0000 she is on the boat\n"
    assert (exp / "data" / "dev" / "text").read_text() == "1089-134686-0000 the thin boy sat\n"
    # a subset in two splits is refused, naming both settings
    assert prepare(["data", "--exp", str(exp), "data.corpus=librispeech", f"data.corpus_dir={corpus}",
                    "data.dev_sets=[test-clean]"]) == 2
