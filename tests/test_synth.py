"""Fast checks of the espeak-ng default corpus (recipe/synth.py) on a tiny corpus."""
import re
from pathlib import Path

import pytest
import soundfile as sf

from recipe.synth import VARIANTS, make_speakers, synthesize_corpus

N_TRAIN, N_TEST, SR = 12, 4, 16000


def read_map(path: Path) -> dict[str, str]:
    return dict(line.rstrip("\n").split(" ", 1) for line in path.read_text().splitlines(keepends=True))


def combo(speaker: str) -> tuple:
    variant, rate, pitch = re.fullmatch(r"(.+)-r(\d{3})-p(\d{2})", speaker).groups()
    return variant, int(rate), int(pitch)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("synth")
    run = lambda name, seed, workers: synthesize_corpus(  # noqa: E731
        root / name, N_TRAIN, N_TEST, seed=seed, sample_rate=SR, num_workers=workers, progress=False)
    return {"a": (root / "a", run("a", 0, 2)), "b": (root / "b", run("b", 0, 1)), "c": (root / "c", run("c", 1, 1))}


def test_kaldi_dirs_and_audio(corpora):
    out, summary = corpora["a"]
    assert summary["train"]["utterances"] == N_TRAIN and summary["test"]["utterances"] == N_TEST
    for split, n in (("train", N_TRAIN), ("test", N_TEST)):
        d = out / split
        wav_scp, text, utt2spk = (read_map(d / f) for f in ("wav.scp", "text", "utt2spk"))
        for f in ("wav.scp", "text", "utt2spk", "spk2utt"):
            keys = [line.split(" ", 1)[0] for line in (d / f).read_text().splitlines()]
            assert keys == sorted(keys), f"{split}/{f} not sorted"
        assert len(wav_scp) == n and wav_scp.keys() == text.keys() == utt2spk.keys()
        spk2utt = read_map(d / "spk2utt")
        assert sorted(u for us in spk2utt.values() for u in us.split()) == sorted(utt2spk)
        for utt, path in wav_scp.items():
            assert utt.startswith(utt2spk[utt] + "-")
            assert Path(path).is_absolute() and Path(path).is_file()
            info = sf.info(path)
            assert info.samplerate == SR and info.channels == 1 and info.subtype == "PCM_16"
            words = text[utt].split(" ")
            assert re.fullmatch(r"[a-z' ]+", text[utt]) and 3 <= len(words) <= 7 and "" not in words
            # letters/digits/commands take roughly 0.2-0.8 s each; padding adds 0.1-0.6 s
            assert 0.1 + 0.15 * len(words) <= info.duration <= 0.6 + 1.0 * len(words), (utt, info.duration)
            audio, _ = sf.read(path)
            assert 0.5 < abs(audio).max() < 1.0  # peak-normalized, not clipped


def test_held_out_speakers(corpora):
    out, _ = corpora["a"]
    train = {combo(s) for s in read_map(out / "train" / "utt2spk").values()}
    test = {combo(s) for s in read_map(out / "test" / "utt2spk").values()}
    assert train and test and not train & test
    # at full size every variant is also seen in training, with other rate/pitch settings
    spk = make_speakers(0, 3000, 300)
    train, test = {s[:3] for s in spk["train"]}, {s[:3] for s in spk["test"]}
    assert not train & test and len(spk["test"]) == 12 and len(spk["train"]) == 120
    assert {s[0] for s in train} == set(VARIANTS) and {s[0] for s in test} <= set(VARIANTS)


def test_deterministic_regardless_of_workers(corpora):
    (a, _), (b, _), (c, _) = corpora["a"], corpora["b"], corpora["c"]
    for split in ("train", "test"):
        assert (a / split / "text").read_text() == (b / split / "text").read_text()
        assert (a / split / "text").read_text() != (c / split / "text").read_text()
        wavs_a = sorted((a / "wav" / split).glob("*.wav"))
        assert [w.name for w in wavs_a] == sorted(w.name for w in (b / "wav" / split).glob("*.wav"))
        for w in wavs_a:
            assert w.read_bytes() == (b / "wav" / split / w.name).read_bytes(), w.name
