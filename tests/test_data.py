"""Bad input is found before training, with an error naming the file, line and utterance (or skipped and
counted where Kaldi's fix_data_dir.sh would drop it)."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile

from recipe.lib.datadir import build_tokens, check_tokens, load_data_dir, read_tokens, write_data_dir, write_tokens
from recipe.lib.tables import DataError

SR = 16000


def make_dir(root, utts: dict[str, str], seconds: float = 1.0, extra_wav: dict[str, str] | None = None):
    """A data dir with one tone in noise per utterance; utts: utt -> transcript."""
    d = root / "data"
    (root / "wav").mkdir(parents=True, exist_ok=True)
    d.mkdir(parents=True, exist_ok=True)
    scp = []
    for i, utt in enumerate(sorted(utts)):
        path = root / "wav" / f"{utt}.wav"
        t = np.arange(int(seconds * SR)) / SR
        noise = np.random.default_rng(i).standard_normal(len(t))
        soundfile.write(path, 0.1 * np.sin(2 * np.pi * (200 + 50 * i) * t) + 0.01 * noise, SR)
        scp.append(f"{utt} {path}")
    scp += [f"{k} {v}" for k, v in (extra_wav or {}).items()]
    (d / "wav.scp").write_text("\n".join(scp) + "\n")
    (d / "text").write_text("".join(f"{u} {t}\n" for u, t in sorted(utts.items())))
    (d / "utt2spk").write_text("".join(f"{u} {u.split('-')[0]}\n" for u in sorted(utts)))
    return d


def test_a_good_dir_loads_and_round_trips(tmp_path):
    d = make_dir(tmp_path, {"s1-a": "one two", "s1-b": "three", "s2-a": "four  five "})
    utts, skipped = load_data_dir(d)
    assert [u.utt for u in utts] == ["s1-a", "s1-b", "s2-a"] and not skipped
    assert utts[2].text == "four five" and utts[2].speaker == "s2"
    write_data_dir(utts, tmp_path / "copy")
    again, _ = load_data_dir(tmp_path / "copy")
    assert again == utts


def test_missing_audio_names_file_line_and_utterance(tmp_path):
    d = make_dir(tmp_path, {"s1-a": "one"}, extra_wav={"s1-b": str(tmp_path / "nowhere.wav")})
    (d / "text").write_text("s1-a one\ns1-b two\n")
    with pytest.raises(DataError, match=r"wav\.scp:2: s1-b: audio file not found"):
        load_data_dir(d)


def test_unreadable_audio(tmp_path):
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"RIFF\x00\x00garbage" * 10)
    d = make_dir(tmp_path, {"s1-a": "one"}, extra_wav={"s1-b": str(bad)})
    (d / "text").write_text("s1-a one\ns1-b two\n")
    with pytest.raises(DataError, match=r"wav\.scp:2: s1-b: cannot read audio"):
        load_data_dir(d)


def test_duplicate_ids(tmp_path):
    d = make_dir(tmp_path, {"s1-a": "one", "s1-b": "two"})
    (d / "text").write_text("s1-a one\ns1-b two\ns1-a three\n")
    with pytest.raises(DataError, match=r"text:3: duplicate id 's1-a' \(first on line 1\)"):
        load_data_dir(d)


def test_mismatches_and_empty_transcripts_are_skipped_and_counted(tmp_path):
    d = make_dir(tmp_path, {"s1-a": "one", "s1-b": "two", "s1-c": "three"})
    (d / "text").write_text("s1-a one\ns1-b\ns1-z ghost\n")  # s1-b empty, s1-c no text, s1-z no audio
    utts, skipped = load_data_dir(d)
    assert [u.utt for u in utts] == ["s1-a"]
    assert skipped == {"empty_transcript": 1, "audio_without_text": 1, "text_without_audio": 1}


def test_zero_length_audio_is_skipped(tmp_path):
    d = make_dir(tmp_path, {"s1-a": "one"})
    empty = tmp_path / "empty.wav"
    soundfile.write(empty, np.zeros(0), SR)
    (d / "wav.scp").write_text((d / "wav.scp").read_text() + f"s1-b {empty}\n")
    (d / "text").write_text("s1-a one\ns1-b two\n")
    utts, skipped = load_data_dir(d)
    assert [u.utt for u in utts] == ["s1-a"] and skipped == {"zero_length_audio": 1}


def test_nothing_usable_is_an_error(tmp_path):
    d = make_dir(tmp_path, {"s1-a": "one"})
    (d / "text").write_text("s1-a\n")
    with pytest.raises(DataError, match="no usable utterances"):
        load_data_dir(d)


def test_non_utf8_text(tmp_path):
    d = make_dir(tmp_path, {"s1-a": "one"})
    (d / "text").write_bytes(b"s1-a caf\xe9\n")
    with pytest.raises(DataError, match=r"text: not UTF-8"):
        load_data_dir(d)


def test_pipe_commands_with_segments_read_the_piped_audio(tmp_path):
    """Kaldi's Switchboard form: a recording produced by a command, cut into utterances by segments. The
    features of each segment equal those of the same samples read from the file."""
    from omegaconf import OmegaConf

    from recipe.lib.config import FeatureConf
    from recipe.lib.features import compute_features, load_audio

    d = make_dir(tmp_path, {"rec1": "x"}, seconds=3.0)
    wav = tmp_path / "wav" / "rec1.wav"
    (d / "wav.scp").write_text(f"rec1 cat {wav} |\n")
    (d / "segments").write_text("sw-u1 rec1 0.0 1.0\nsw-u2 rec1 1.5 -1\n")
    (d / "text").write_text("sw-u1 one\nsw-u2 two\n")
    (d / "utt2spk").write_text("sw-u1 sw\nsw-u2 sw\n")
    utts, _ = load_data_dir(d)
    assert [(u.start, u.end) for u in utts] == [(0.0, 1.0), (1.5, 3.0)] and utts[0].audio.endswith("|")
    samples, _ = soundfile.read(wav, dtype="float32")
    conf = OmegaConf.merge(OmegaConf.structured(FeatureConf), {"n_mels": 20, "deltas": False})
    for u, (a, b) in zip(utts, ((0, SR), (int(1.5 * SR), None))):
        np.testing.assert_array_equal(compute_features(load_audio(u, SR), SR, conf),
                                      compute_features(samples[a:b], SR, conf))


def test_a_failing_pipe_command_is_found_before_training(tmp_path):
    d = make_dir(tmp_path, {"s1-a": "one", "s1-b": "two"})
    (d / "wav.scp").write_text(f"s1-a {tmp_path}/wav/s1-a.wav\ns1-b sph2pipe -f wav /no/such.sph |\n")
    with pytest.raises(DataError, match=r"wav\.scp:2: s1-b: command exited with status 127"):
        load_data_dir(d)


def test_bad_recordings_and_segments_can_be_skipped_and_counted(tmp_path):
    d = make_dir(tmp_path, {"r1": "x", "r2": "x"}, seconds=2.0)
    (d / "wav.scp").write_text(f"r1 {tmp_path}/wav/r1.wav\nr2 sh -c 'exit 3' |\nr3 {tmp_path}/wav/r2.wav\n")
    (d / "segments").write_text("a-1 r1 0.0 1.0\na-2 r1 5.0 6.0\nb-1 r2 0.0 1.0\nc-1 r3 0.5 1.5\n")
    (d / "text").write_text("a-1 one\na-2 two\nb-1 three\nc-1 four\n")
    (d / "utt2spk").unlink()
    with pytest.raises(DataError, match=r"wav\.scp:2: r2: command exited with status 3"):
        load_data_dir(d)
    utts, skipped = load_data_dir(d, on_bad="skip")
    assert [u.utt for u in utts] == ["a-1", "c-1"]
    assert skipped["unreadable_audio"] == 1 and skipped["bad_segment"] == 1 and skipped["text_without_audio"] == 2


def test_segments(tmp_path):
    d = make_dir(tmp_path, {"rec1": "x"}, seconds=3.0)
    (d / "segments").write_text("u1 rec1 0.0 1.0\nu2 rec1 1.5 -1\n")
    (d / "text").write_text("u1 one\nu2 two\n")
    (d / "utt2spk").write_text("u1 s\nu2 s\n")
    utts, _ = load_data_dir(d)
    assert [(u.utt, u.start, u.end) for u in utts] == [("u1", 0.0, 1.0), ("u2", 1.5, 3.0)]
    write_data_dir(utts, tmp_path / "copy")
    assert load_data_dir(tmp_path / "copy")[0] == utts
    (d / "segments").write_text("u1 rec1 0.0 1.0\nu2 rec1 2.0 1.0\n")
    with pytest.raises(DataError, match=r"segments:2: u2: bad time range"):
        load_data_dir(d)
    (d / "segments").write_text("u1 rec9 0.0 1.0\n")
    with pytest.raises(DataError, match=r"segments:1: u1: recording 'rec9' is not in wav.scp"):
        load_data_dir(d)


def test_characters_outside_the_token_set(tmp_path):
    train, _ = load_data_dir(make_dir(tmp_path / "tr", {"s-a": "abc", "s-b": "b a"}))
    test, _ = load_data_dir(make_dir(tmp_path / "te", {"s-c": "ab", "s-d": "abz!"}))
    tokens = build_tokens(train)
    assert tokens == ["<blank>", " ", "a", "b", "c"]
    with pytest.raises(DataError, match=r"text: utterance s-d: characters \['!', 'z'\]"):
        check_tokens(test, tokens, tmp_path / "te" / "data" / "text")
    write_tokens(tokens, tmp_path / "tokens.txt")
    assert read_tokens(tmp_path / "tokens.txt") == tokens


def test_tables_split_the_key_off_at_the_first_run_of_whitespace_as_kaldi_does(tmp_path):
    """Kaldi's SplitStringOnFirstSpace: a tab separates the key as a space does, the rest is stripped; only ASCII
    whitespace counts, and only a newline ends a line."""
    from recipe.lib.tables import read_table

    d = make_dir(tmp_path, {"s1-a": "x", "s1-b": "x"})
    wav = tmp_path / "wav"
    (d / "wav.scp").write_text(f"s1-a\t{wav}/s1-a.wav\ns1-b \t {wav}/s1-b.wav\t\r\n")
    (d / "text").write_text("s1-a\thello world\ns1-b\t\tcaf\u00e9\u00a0au lait\u2028noir  \n")
    (d / "utt2spk").write_text("s1-a\ts1\ns1-b   s1\n")
    utts, skipped = load_data_dir(d)
    assert not skipped and [(u.utt, u.speaker, u.text) for u in utts] == [
        ("s1-a", "s1", "hello world"), ("s1-b", "s1", "caf\u00e9 au lait noir")]  # the transcript's own cleanup
    table = read_table(d / "text")
    assert table["s1-b"] == ("caf\u00e9\u00a0au lait\u2028noir", 2)  # a no-break space is no separator for Kaldi
    assert read_table(d / "wav.scp")["s1-b"] == (f"{wav}/s1-b.wav", 2)
    (d / "text").write_text("s1-a\thello\n\ns1-a world\n")
    with pytest.raises(DataError, match=r"text:3: duplicate id 's1-a' \(first on line 1\)"):
        load_data_dir(d)


def kaldi_validate(d) -> dict[str, dict[str, str]]:
    """The checks Kaldi's utils/validate_data_dir.sh makes on a data dir's tables (-> the tables): each file's
    keys unique and sorted in the C locale (Python's own string order), spk2utt and utt2spk each other's
    inverse both ways (utt2spk_to_spk2utt.pl and spk2utt_to_utt2spk.pl), text, utt2spk, utt2dur and segments
    (else wav.scp, else feats.scp) over the same utterances, every segment's recording in wav.scp, durations
    positive."""
    tables = {}
    for name in ("text", "utt2spk", "spk2utt", "utt2dur", "wav.scp", "segments", "feats.scp"):
        if (d / name).is_file():
            lines = (d / name).read_text().splitlines()
            keys = [line.split(" ", 1)[0] for line in lines]
            assert keys == sorted(set(keys)), f"{name}: keys not sorted and unique"
            tables[name] = dict(line.split(" ", 1) for line in lines)
    utt2spk = tables["utt2spk"]
    inverted: dict[str, list[str]] = {}
    for utt, spk in utt2spk.items():
        inverted.setdefault(spk, []).append(utt)
    assert tables["spk2utt"] == {spk: " ".join(utts) for spk, utts in inverted.items()}
    assert [(utt, spk) for spk in tables["spk2utt"] for utt in tables["spk2utt"][spk].split()] == list(utt2spk.items())
    audio = next(tables[name] for name in ("segments", "wav.scp", "feats.scp") if name in tables)
    assert set(tables["text"]) == set(utt2spk) == set(tables["utt2dur"]) == set(audio)
    if "segments" in tables:
        assert {entry.split()[0] for entry in tables["segments"].values()} <= set(tables["wav.scp"])
    assert all(float(seconds) > 0 for seconds in tables["utt2dur"].values())
    return tables


def test_written_dirs_have_spk2utt_and_utt2dur_and_pass_kaldi_validation(tmp_path):
    from dataclasses import replace

    d = make_dir(tmp_path, {"s1-a": "one", "s1-b": "two", "S2-a": "three", "s1_c": "four"}, seconds=1.0)
    (d / "utt2spk").write_text("s1-a s1\ns1-b s1\nS2-a S2\ns1_c s1_c\n")
    utts, _ = load_data_dir(d)
    write_data_dir(list(reversed(utts)), tmp_path / "whole")  # sorted when written, whatever the order given
    tables = kaldi_validate(tmp_path / "whole")
    assert list(tables["spk2utt"].items()) == [("S2", "S2-a"), ("s1", "s1-a s1-b"), ("s1_c", "s1_c")]
    assert tables["utt2dur"] == dict.fromkeys(["S2-a", "s1-a", "s1-b", "s1_c"], "1")
    # what callers that did not measure the audio give (recipe/lib/corpora.py): a file, a pipe, a sped-up copy
    fresh = [replace(utts[0], seconds=None), replace(utts[1], seconds=None, audio=f"cat {utts[1].audio} |"),
             replace(utts[2], seconds=None, utt="s1-f", speed=1.25)]
    write_data_dir(fresh, tmp_path / "fresh")
    assert kaldi_validate(tmp_path / "fresh")["utt2dur"] == {"S2-a": "1", "s1-a": "1", "s1-f": "0.8"}


def test_written_segments_and_kaldi_features_have_utt2dur(tmp_path):
    import kaldiio

    d = make_dir(tmp_path, {"rec1": "x"}, seconds=3.0)
    (d / "segments").write_text("sw-u1 rec1 0.0 1.0\nsw-u2 rec1 1.5 -1\n")
    (d / "text").write_text("sw-u1 one\nsw-u2 two\n")
    (d / "utt2spk").write_text("sw-u1 sw\nsw-u2 sw\n")
    utts, _ = load_data_dir(d)
    write_data_dir(utts, tmp_path / "segmented")
    tables = kaldi_validate(tmp_path / "segmented")
    assert tables["utt2dur"] == {"sw-u1": "1", "sw-u2": "1.5"} and tables["spk2utt"] == {"sw": "sw-u1 sw-u2"}
    k = tmp_path / "kaldi"
    k.mkdir()
    feats = {"s-a": np.zeros((37, 3), np.float32), "s-b": np.zeros((120, 3), np.float32)}
    kaldiio.save_ark(str(k / "feats.ark"), feats, scp=str(k / "feats.scp"))
    (k / "text").write_text("s-a one\ns-b two\n")
    utts, _ = load_data_dir(k)
    write_data_dir(utts, tmp_path / "segmented")  # over the audio dir written before: none of its files stay
    tables = kaldi_validate(tmp_path / "segmented")
    assert tables["utt2dur"] == {"s-a": "0.37", "s-b": "1.2"}  # frames x 10 ms, as Kaldi's get_utt2dur.sh counts
    assert not (tmp_path / "segmented" / "wav.scp").exists() and not (tmp_path / "segmented" / "segments").exists()
