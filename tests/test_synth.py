"""Fast checks of the espeak-ng default corpus (recipe/lib/synth.py) on a tiny corpus."""
import multiprocessing as mp
import re
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from recipe.lib.synth import SIL, VARIANTS, make_speakers, phone_segments, synth_utterance, synthesize_corpus

N_TRAIN, N_TEST, SR = 12, 4, 16000
VOWELS = {"0", "@", "A@", "E", "I", "O2", "V", "a", "aI", "aU", "eI", "i:", "i@", "o@", "oU", "u:"}


def read_map(path: Path) -> dict[str, str]:
    return dict(line.rstrip("\n").split(" ", 1) for line in path.read_text().splitlines(keepends=True))


def read_ctm(path: Path) -> dict[str, list[tuple[int, int, str]]]:
    """phones.ctm -> {utt: [(start ms, end ms, phone)]} in file order, checking the line format."""
    segments: dict[str, list[tuple[int, int, str]]] = {}
    for line in path.read_text().splitlines():
        utt, channel, start, duration, phone = line.split(" ")
        assert channel == "1" and re.fullmatch(r"\d+\.\d{3}", start) and re.fullmatch(r"\d+\.\d{3}", duration), line
        a = round(float(start) * 1000)
        segments.setdefault(utt, []).append((a, a + round(float(duration) * 1000), phone))
    return segments


def power_db(audio: np.ndarray, start_ms: int, end_ms: int) -> float:
    return 10 * np.log10(np.mean(audio[start_ms * SR // 1000:end_ms * SR // 1000] ** 2))


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
    # the dev set's voices are its own: neither training nor the test set has them; the test set keeps its voices
    spk = make_speakers(0, 3000, 300, 200)
    dev = {s[:3] for s in spk["dev"]}
    assert len(dev) == 8 and not dev & {s[:3] for s in spk["train"]} and not dev & test
    assert {s[:3] for s in spk["test"]} == test


def test_deterministic_regardless_of_workers(corpora):
    (a, _), (b, _), (c, _) = corpora["a"], corpora["b"], corpora["c"]
    for split in ("train", "test"):
        assert (a / split / "text").read_text() == (b / split / "text").read_text()
        assert (a / split / "text").read_text() != (c / split / "text").read_text()
        wavs_a = sorted((a / "wav" / split).glob("*.wav"))
        assert [w.name for w in wavs_a] == sorted(w.name for w in (b / "wav" / split).glob("*.wav"))
        for w in wavs_a:
            assert w.read_bytes() == (b / "wav" / split / w.name).read_bytes(), w.name
    for name in ("phones.txt", "train/phones.ctm", "test/phones.ctm"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "phones.txt").read_bytes() == (c / "phones.txt").read_bytes()  # from the vocabulary, not the data


def test_phone_ctm_covers_each_utterance(corpora):
    out, summary = corpora["a"]
    table = [line.split(" ") for line in (out / "phones.txt").read_text().splitlines()]
    assert table[0] == [SIL, "0"] and [int(i) for _, i in table] == list(range(len(table)))
    phones = [p for p, _ in table]
    assert phones[1:] == sorted(phones[1:]) and len(phones) == summary["phones"]
    assert {"w", "V", "n", "T", "r", "i:", ";"} <= set(phones) and 35 <= len(phones) <= 45
    for split in ("train", "test"):
        wav_scp = read_map(out / split / "wav.scp")
        ctm = read_ctm(out / split / "phones.ctm")
        keys = [line.split(" ", 1)[0] for line in (out / split / "phones.ctm").read_text().splitlines()]
        assert keys == sorted(keys) and ctm.keys() == wav_scp.keys()
        for utt, segments in ctm.items():
            assert segments[0][0] == 0 and segments[0][2] == SIL and segments[-1][2] == SIL  # padded both ends
            assert all(prev[1] == seg[0] for prev, seg in zip(segments, segments[1:])), utt  # no gaps or overlaps
            assert all(end > start for start, end, _ in segments), utt
            assert all(not (prev[2] == seg[2] == SIL) for prev, seg in zip(segments, segments[1:])), utt
            assert {p for *_, p in segments} <= set(phones)
            assert abs(segments[-1][1] - 1000 * sf.info(wav_scp[utt]).duration) <= 1, utt
            assert 50 <= segments[0][1] - segments[0][0] and 50 <= segments[-1][1] - segments[-1][0]  # pads >= 50 ms
        assert summary[split]["phone_segments"] == sum(p != SIL for segs in ctm.values() for *_, p in segs)


def test_phone_segments_arithmetic():
    # espeak at 2 samples per output sample; 100 samples of espeak's own leading silence trimmed; 800 samples of
    # leading pad; at 1000 Hz one output sample is one millisecond.
    phones = [(0, SIL), (100, "w"), (1100, "V"), (2100, "n"), (3100, SIL)]
    assert phone_segments(phones, 100, 0.5, 800, 1500, 3000, 1000) == [
        (0, 800, SIL), (800, 1300, "w"), (1300, 1800, "V"), (1800, 2300, "n"), (2300, 3000, SIL)]
    # trimmed into the first phone and cut inside the last one: both shortened; the kept speech ends the last phone
    assert phone_segments(phones, 600, 0.5, 800, 1000, 3000, 1000) == [
        (0, 800, SIL), (800, 1050, "w"), (1050, 1550, "V"), (1550, 1800, "n"), (1800, 3000, SIL)]
    # a phone entirely in the trimmed part is left out; at 16 kHz, boundaries round to the nearest millisecond
    assert phone_segments([(0, "p"), (50, "V")], 60, 1.0, 0, 100, 100, 1000) == [(0, 100, "V")]
    assert phone_segments([(0, "V")], 0, 1.0, 24, 808, 1600, 16000) == [(0, 2, SIL), (2, 52, "V"), (52, 100, SIL)]


@pytest.fixture(scope="module")
def words(tmp_path_factory):
    """A few known word sequences, synthesized exactly like corpus utterances -> {text: (audio, segments)}."""
    root = tmp_path_factory.mktemp("words")
    texts = ["one", "three eight", "b stop", "oh nine", "eight a one"]
    jobs = [(str(root / f"{i}.wav"), text.split(), ("m1", 170, 50, 50), [7, 2, i, 1], SR)
            for i, text in enumerate(texts)]
    with mp.get_context("spawn").Pool(1) as pool:
        results = pool.map(synth_utterance, jobs)
    return {text: (sf.read(job[0])[0], segments) for text, job, (_, segments) in zip(texts, jobs, results)}


def test_phones_of_known_words(words):
    labels = {text: [p for *_, p in segments] for text, (_, segments) in words.items()}
    assert labels["one"] == [SIL, "w", "V", "n", SIL]
    assert labels["three eight"] == [SIL, "T", "r", "i:", ";", "eI", "t", SIL]  # ";": espeak's link between vowels
    assert labels["b stop"] == [SIL, "b", "i:", SIL, "s", "t2", "0", "p", SIL]  # a pause after a spelled letter


def test_phone_timings_match_the_audio(corpora, words):
    """Silence segments hold only noise, vowels are loud, and speech energy starts where the CTM says."""
    utterances = list(words.values())
    out, _ = corpora["a"]
    for split in ("train", "test"):
        wav_scp = read_map(out / split / "wav.scp")
        utterances += [(sf.read(wav_scp[u])[0], segs) for u, segs in read_ctm(out / split / "phones.ctm").items()]
    for audio, segments in utterances:
        (_, speech_start, _), (speech_end, _, _) = segments[0], segments[-1]
        noise = max(power_db(audio, 0, speech_start), power_db(audio, speech_end, segments[-1][1]))
        inner = [(a + 10, b - 10, p) for a, b, p in segments[1:-1] if b - a > 40]  # away from the boundaries
        vowels = np.mean([power_db(audio, a, b) for a, b, p in inner if p in VOWELS])
        assert vowels > noise + 12
        assert all(power_db(audio, a, b) < vowels - 10 for a, b, p in inner if p == SIL)
        # first 5 ms frame 10 dB above the leading noise: never before the first phone (weak initial consonants
        # like th or s may hide in the noise, so it can come later)
        frames = 10 * np.log10(np.mean(audio[:len(audio) // 80 * 80].reshape(-1, 80) ** 2, axis=1))
        onset = 5 * np.argmax(frames > power_db(audio, 0, speech_start) + 10)
        assert onset >= speech_start - 5
    # where the speech starts and ends with a vowel or a sonorant, the energy edges match the CTM closely
    for text in ("oh nine", "eight a one"):
        audio, segments = words[text]
        frames = 10 * np.log10(np.mean(audio[:len(audio) // 80 * 80].reshape(-1, 80) ** 2, axis=1))
        loud = np.nonzero(frames > power_db(audio, 0, segments[0][1]) + 10)[0]
        assert abs(5 * loud[0] - segments[0][1]) <= 20 and abs(5 * (loud[-1] + 1) - segments[-1][0]) <= 20, text
