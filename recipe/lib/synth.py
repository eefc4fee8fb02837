"""Built-in default corpus: small-vocabulary English speech synthesized with espeak-ng.

Why it is built this way:
* It needs no download: espeak-ng's library and voice data ship in the `espeakng-loader` wheel, and we drive
  the C library directly through ctypes (no espeak binary, no temp files): ~10-20 ms of CPU per utterance.
* The vocabulary (connected digits, spelled letters, a few command words) is the classic small-vocabulary
  ASR task: tiny enough for an LSTM to learn in minutes, yet letters like b/d/e/p/t/v are truly confusable.
* A "speaker" is a (voice variant, rate, pitch) combination. The test speakers are combinations never seen in
  training, while every variant is still seen in training with other settings, so held-out accuracy measures
  generalization to new speakers rather than memorization (or a completely unknown voice).
* Noise at a random SNR and random leading/trailing silence keep the task from being trivially clean.
* Everything derives from (seed, split, utterance index), so output is byte-identical for any worker count.
* Exact phone timings come for free: espeak reports each phoneme with its sample position in the audio it
  generates, so every split also gets phones.ctm (whole utterance covered, silence as `sil`), with the phone
  table phones.txt in the corpus root: frame-level targets for a cross-entropy objective, no aligner needed.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import multiprocessing as mp
import os
import pickle
import sys
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn

from recipe.lib.progress import progress_bar

DIGITS = ["zero", "oh", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
LETTERS = list("abcdefghijklmnopqrstuvwxyz")
COMMANDS = ["yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go",
            "start", "open", "close", "play", "next", "back"]
VOCABULARY = DIGITS + LETTERS + COMMANDS
LANGUAGE = "en-us"
VARIANTS = ["m1", "m2", "m3", "m4", "m5", "m6", "m7", "f1", "f2", "f3", "f4", "f5", "klatt", "croak"]
RATES = [130, 150, 170, 190, 210]         # words per minute
PITCHES = [30, 40, 50, 60, 70]            # espeak pitch, 0-100 (50 = voice default)
PITCH_RANGE = (30, 70)                    # espeak intonation range, drawn once per speaker
UTTS_PER_SPEAKER = 25
MIN_SPEAKERS = 4                          # tiny corpora still get a few voices
SNR_DB = (15.0, 35.0)
PAD_SECONDS = (0.05, 0.3)
PEAK = 0.9
SPLIT_CODES = {"train": 0, "test": 1, "dev": 2}
SIL = "sil"                               # every pause phoneme and all leading/trailing/inter-word silence

# espeak-ng speak_lib.h constants
AUDIO_OUTPUT_SYNCHRONOUS = 2
POS_CHARACTER = 1
espeakCHARS_UTF8, espeakSSML = 0x1, 0x10
espeakRATE, espeakPITCH, espeakRANGE = 1, 3, 4
espeakEVENT_LIST_TERMINATED, espeakEVENT_PHONEME = 0, 7


class EspeakEventId(ctypes.Union):
    _fields_ = [("number", ctypes.c_int), ("name", ctypes.c_char_p), ("string", ctypes.c_char * 8)]


class EspeakEvent(ctypes.Structure):
    """speak_lib.h espeak_EVENT. `sample` is the event's position in the synthesized audio (samples at espeak's
    rate, counted from the start of the espeak_Synth call); a phoneme event's name is in id.string."""
    _fields_ = [("type", ctypes.c_int), ("unique_identifier", ctypes.c_uint), ("text_position", ctypes.c_int),
                ("length", ctypes.c_int), ("audio_position", ctypes.c_int), ("sample", ctypes.c_int),
                ("user_data", ctypes.c_void_p), ("id", EspeakEventId)]


SYNTH_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int,
                                  ctypes.POINTER(EspeakEvent))


def phone_label(mnemonic: str) -> str:
    """espeak phoneme mnemonic -> our phone label. We use espeak's own ASCII mnemonics, not its IPA: they name
    exactly the phoneme the synthesizer played (IPA merges some, e.g. t and the unaspirated t2 of "stop"), are
    safe tokens for a Kaldi symbol table, and give the pauses names (IPA gives them none). Stress marks (' and ,)
    are dropped: they depend on the neighbouring words (a word's stress is demoted next to another one), and a
    frame classifier should learn the phone, not sentence prosody. All pauses (_ _: _! ...) are silence."""
    name = mnemonic.lstrip("',%=")
    return SIL if name.startswith("_") else name


def espeak_paths() -> tuple[str, str]:
    """(library, data dir) from the espeakng-loader wheel, with a clear error if anything is missing."""
    try:
        import espeakng_loader
        lib, data = espeakng_loader.get_library_path(), espeakng_loader.get_data_path()
    except Exception as e:  # noqa: BLE001 - any failure here means the same thing to the user
        raise RuntimeError(f"cannot locate espeak-ng via espeakng_loader ({e}); pip install espeakng-loader") from e
    if not Path(lib).is_file() or not (Path(data) / "phontab").is_file():
        raise RuntimeError(f"espeak-ng library or data missing: library={lib} data={data}")
    # espeak silently ignores an unknown "+variant", so check the variant files ourselves.
    missing = [v for v in VARIANTS if not (Path(data) / "voices" / "!v" / v).is_file()]
    if missing:
        raise RuntimeError(f"espeak-ng voice variants not found in {data}/voices/!v: {missing}")
    return lib, data


class Espeak:
    """One espeak-ng instance. The library keeps global state and is not thread-safe: one per process.

    espeak-ng is also not reproducible call to call: static wavegen state (pitch flutter phase, filter memories,
    noise generators) carries over from one utterance to the next, and espeak_Terminate/Initialize does not reset
    it, so the same call gives slightly different audio (even a different length) depending on history. We
    therefore never synthesize in this process: each utterance runs in a fork() of the pristine, just-initialized
    state, with fixed random seeds, and the child sends its result back through a pipe (~7 ms per fork)."""

    def __init__(self):
        lib_path, data_path = espeak_paths()
        try:
            self.lib = lib = ctypes.CDLL(lib_path)
        except OSError as e:
            raise RuntimeError(f"cannot load espeak-ng library {lib_path}: {e}") from e
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_ng_SetRandSeed.argtypes = [ctypes.c_long]
        lib.espeak_ng_SetPhonemeEvents.argtypes = [ctypes.c_int, ctypes.c_int]
        lib.espeak_Synth.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int,
                                     ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
        self.sample_rate = lib.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, 0, data_path.encode(), 0)
        if self.sample_rate <= 0:
            raise RuntimeError(f"espeak_Initialize failed (returned {self.sample_rate}) with data path {data_path}")
        if lib.espeak_ng_SetPhonemeEvents(1, 0) != 0:  # enable phoneme events, names as mnemonics (ipa=0)
            raise RuntimeError("espeak_ng_SetPhonemeEvents failed")
        self._chunks: list[np.ndarray] = []
        self._phones: list[tuple[int, str]] = []
        self._callback = SYNTH_CALLBACK(self._collect)  # keep a reference, or ctypes frees it under espeak
        lib.espeak_SetSynthCallback(self._callback)
        self.libc = ctypes.CDLL(None)  # espeak's wavegen also draws from libc rand()

    def _collect(self, wav, n, events) -> int:
        if n > 0:
            self._chunks.append(np.frombuffer(ctypes.string_at(wav, 2 * n), dtype=np.int16))  # copies
        i = 0
        while events and events[i].type != espeakEVENT_LIST_TERMINATED:
            if events[i].type == espeakEVENT_PHONEME:
                self._phones.append((events[i].sample, phone_label(events[i].id.string.decode())))
            i += 1
        return 0  # 0 = continue synthesis

    def synth(self, ssml: str, variant: str, rate: int, pitch: int, pitch_range: int,
              seed: int) -> tuple[np.ndarray, list[tuple[int, str]]]:
        """(int16 samples at self.sample_rate, phones), identical for identical arguments (see class docstring).
        phones: (onset sample, label) in time order; each phone lasts until the next onset, the last one until
        the end of the samples."""
        samples, phones = self._in_child(self._synth_here, ssml, variant, rate, pitch, pitch_range, seed)
        if not len(samples):
            raise RuntimeError(f"espeak-ng produced no audio for {ssml!r} ({LANGUAGE}+{variant})")
        return samples, phones

    def phone_set(self, ssml_texts: list[str]) -> set[str]:
        """Every phone label espeak uses to speak these texts (default voice: the phonemes depend on the language
        and the words, not on voice variant, rate or pitch)."""
        return self._in_child(self._phone_set_here, ssml_texts)

    def _in_child(self, fn, *args):
        """fn(*args) run in a fork() of this process (which stays pristine); its result comes back pickled."""
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: run, send the result, exit without running any Python cleanup
            try:
                os.close(read_fd)
                with os.fdopen(write_fd, "wb") as pipe:
                    pickle.dump(fn(*args), pipe, protocol=pickle.HIGHEST_PROTOCOL)
                os._exit(0)
            except BaseException as e:  # noqa: BLE001 - report, then never return into the caller's code
                sys.stderr.write(f"espeak-ng child process: {e!r}\n")
            finally:
                os._exit(1)
        os.close(write_fd)
        with os.fdopen(read_fd, "rb") as pipe:
            data = pipe.read()  # read to EOF before waiting: the audio is larger than a pipe buffer
        if os.waitpid(pid, 0)[1] != 0 or not data:
            raise RuntimeError(f"espeak-ng synthesis failed: {fn.__name__}{args[:2]} ({LANGUAGE})")
        return pickle.loads(data)

    def _synth_here(self, ssml: str, variant: str, rate: int, pitch: int, pitch_range: int, seed: int):
        self.lib.espeak_ng_SetRandSeed(seed)
        self.libc.srand(seed)
        if self.lib.espeak_SetVoiceByName(f"{LANGUAGE}+{variant}".encode()) != 0:
            raise RuntimeError(f"espeak_SetVoiceByName failed for {LANGUAGE}+{variant}")
        for param, value in ((espeakRATE, rate), (espeakPITCH, pitch), (espeakRANGE, pitch_range)):
            self.lib.espeak_SetParameter(param, value, 0)
        return self._speak(ssml)

    def _phone_set_here(self, ssml_texts: list[str]) -> set[str]:
        if self.lib.espeak_SetVoiceByName(LANGUAGE.encode()) != 0:
            raise RuntimeError(f"espeak_SetVoiceByName failed for {LANGUAGE}")
        # Fast speech is less audio to generate: 2.5x quicker than the default rate, same phonemes (checked
        # from 80 to 600 wpm); above 449 espeak switches to its slower sonic speed-up.
        self.lib.espeak_SetParameter(espeakRATE, 400, 0)
        return {label for text in ssml_texts for _, label in self._speak(text)[1]}

    def _speak(self, ssml: str) -> tuple[np.ndarray, list[tuple[int, str]]]:
        self._chunks, self._phones = [], []
        text = ssml.encode() + b"\0"
        err = self.lib.espeak_Synth(text, len(text), 0, POS_CHARACTER, 0, espeakCHARS_UTF8 | espeakSSML, None, None)
        if err != 0 or self.lib.espeak_Synchronize() != 0:
            raise RuntimeError(f"espeak_Synth failed ({err}) for {ssml!r}")
        if any(a[0] > b[0] for a, b in zip(self._phones, self._phones[1:])):
            raise RuntimeError(f"espeak-ng phoneme events out of order for {ssml!r}: {self._phones}")
        samples = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int16)
        return samples, self._phones


def make_sentence(rng: np.random.Generator) -> list[str]:
    """3-7 words: a digit string, a letter string, commands + digits, or command + letters + digits."""
    kind = rng.integers(4)
    pick = lambda vocab, k: [vocab[i] for i in rng.integers(len(vocab), size=k)]  # noqa: E731
    if kind == 0:
        return pick(DIGITS, rng.integers(3, 8))
    if kind == 1:
        return pick(LETTERS, rng.integers(3, 7))
    if kind == 2:
        return pick(COMMANDS, rng.integers(1, 3)) + pick(DIGITS, rng.integers(2, 5))
    return pick(COMMANDS, 1) + pick(LETTERS, rng.integers(1, 3)) + pick(DIGITS, rng.integers(1, 4))


def to_ssml(words: list[str]) -> str:
    """Letters are wrapped in say-as so espeak speaks the letter NAME: plain "a" comes out as the article
    (schwa), while the transcript keeps the single lowercase letter."""
    spoken = (f'<say-as interpret-as="characters">{w}</say-as>' if len(w) == 1 else w for w in words)
    return "<speak>" + " ".join(spoken) + "</speak>"


def make_speakers(seed: int, n_train: int, n_test: int, n_dev: int = 0) -> dict[str, list[tuple]]:
    """Split the (variant, rate, pitch) grid into disjoint train/dev/test speakers. Speakers are dealt round-robin
    over variants, so training covers every variant (given >= len(VARIANTS) training speakers)."""
    rng = np.random.default_rng([seed, 1000])
    per_variant = {v: [(v, r, p) for r in RATES for p in PITCHES] for v in VARIANTS}
    for combos in per_variant.values():
        rng.shuffle(combos)
    order = list(rng.permutation(VARIANTS))
    grid_size = len(VARIANTS) * len(RATES) * len(PITCHES)
    n_spk = {split: max(math.ceil(n / UTTS_PER_SPEAKER), min(n, MIN_SPEAKERS)) for split, n in
             (("train", n_train), ("test", n_test), ("dev", n_dev))}
    # huge corpora: more utterances per speaker
    n_spk["train"] = min(n_spk["train"], grid_size - n_spk["test"] - n_spk["dev"])
    speakers = {}
    for split in ("test", "dev", "train"):  # held-out sets first, so they never run out of unseen combinations
        chosen = []
        for i in range(n_spk[split]):
            for j in range(len(order)):  # next variant (round-robin) that still has unused combinations
                variant = order[(i + j) % len(order)]
                if per_variant[variant]:
                    break
            chosen.append(per_variant[variant].pop() + (int(rng.integers(PITCH_RANGE[0], PITCH_RANGE[1] + 1)),))
        speakers[split] = chosen
    return speakers


def speaker_id(variant: str, rate: int, pitch: int) -> str:
    # Fixed-width numeric fields: no speaker id is a prefix of another, so utterance ids sort with speakers.
    return f"{variant}-r{rate:03d}-p{pitch:02d}"


def add_noise_and_pad(speech: np.ndarray, rate: int, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """Random leading/trailing silence, white or pink noise at a random SNR, then peak normalization.
    Returns (audio, length of the leading silence in samples): where the speech starts."""
    lead, trail = (int(rng.uniform(*PAD_SECONDS) * rate) for _ in range(2))
    x = np.concatenate([np.zeros(lead), speech, np.zeros(trail)])
    noise = rng.standard_normal(len(x))
    if rng.random() < 0.5:  # pink: shape white noise by 1/sqrt(f) in the frequency domain
        n_fft = 1 << (len(x) - 1).bit_length()  # power of two: arbitrary (e.g. prime) lengths are ~10x slower
        spec = np.fft.rfft(noise, n=n_fft)
        f = np.arange(len(spec), dtype=np.float64)
        f[0] = 1.0
        noise = np.fft.irfft(spec / np.sqrt(f), n=n_fft)[:len(x)]
    snr = rng.uniform(*SNR_DB)
    noise *= math.sqrt(np.mean(speech ** 2) / (np.mean(noise ** 2) * 10 ** (snr / 10)))
    x = x + noise
    return x * (PEAK / max(np.max(np.abs(x)), 1e-9)), lead


def phone_segments(phones: list[tuple[int, str]], trim_start: int, ratio: float, lead: int, speech_len: int,
                   n_out: int, rate: int) -> list[tuple[int, int, str]]:
    """espeak's phone onsets -> contiguous (start ms, end ms, label) covering the written audio [0, n_out).

    The written audio is: `lead` samples of padding, then espeak's audio from sample trim_start on, resampled by
    `ratio` (soxr compensates its filter delay, so espeak sample t lands at (t - trim_start) * ratio) and cut to
    speech_len samples, then more padding up to n_out. A phone lasts from its onset to the next one's, the last
    until the kept speech ends; anything outside the kept speech is silence. Boundaries are rounded to whole
    milliseconds once, so segments stay contiguous; a phone that rounds to nothing (cut away with espeak's
    silence) is left out, and adjacent silences merge."""
    to_out = lambda t: lead + min(max(round((t - trim_start) * ratio), 0), speech_len)  # noqa: E731
    speech_end = lead + speech_len
    onsets = [0] + [to_out(sample) for sample, _ in phones] + [speech_end]
    labels = [SIL] + [label for _, label in phones] + [SIL]
    ms = [round(s * 1000 / rate) for s in onsets[1:] + [n_out]]
    segments: list[tuple[int, int, str]] = []
    for start, end, label in zip([0] + ms[:-1], ms, labels):
        if end <= start:
            continue
        if segments and label == SIL == segments[-1][2]:
            segments[-1] = (segments[-1][0], end, SIL)
        else:
            segments.append((start, end, label))
    return segments


_ESPEAK: Espeak | None = None  # one pristine instance per pool worker; synthesis itself runs in its forks


def worker_espeak() -> Espeak:
    global _ESPEAK
    if _ESPEAK is None:
        _ESPEAK = Espeak()
    return _ESPEAK


def synth_utterance(job: tuple) -> tuple[float, list[tuple[int, int, str]]]:
    """Synthesize one utterance to a 16-bit WAV; returns (duration in seconds, phone segments in ms)."""
    espeak = worker_espeak()
    wav_path, words, (variant, rate, pitch, pitch_range), noise_seed, sample_rate = job
    rng = np.random.default_rng(noise_seed)
    espeak_seed = int(rng.integers(2**31))
    samples, phones = espeak.synth(to_ssml(words), variant, rate, pitch, pitch_range, espeak_seed)
    raw = samples.astype(np.float64) / 32768.0
    loud = np.nonzero(np.abs(raw) > 0.01 * np.max(np.abs(raw)))[0]  # trim espeak's own silence; we add ours
    raw = raw[loud[0]:loud[-1] + 1]
    speech = soxr.resample(raw, espeak.sample_rate, sample_rate, quality="HQ")
    audio, lead = add_noise_and_pad(speech, sample_rate, rng)
    sf.write(wav_path, np.round(audio * 32767).astype(np.int16), sample_rate, subtype="PCM_16")
    segments = phone_segments(phones, int(loud[0]), sample_rate / espeak.sample_rate, lead, len(speech), len(audio),
                              sample_rate)
    return len(audio) / sample_rate, segments


def vocabulary_phones(word: str) -> set[str]:
    """The phones of `word` alone and before every vocabulary word: cross-word effects add phones no word has
    alone ("three eight" links i: and eI with `;`). Pairs are enough: longer contexts added nothing in a
    3300-utterance corpus (synthesize_corpus checks every utterance anyway). All pairs take ~1 s of CPU."""
    return worker_espeak().phone_set([to_ssml([word])] + [to_ssml([word, w]) for w in VOCABULARY])


_PHONE_SET: frozenset[str] | None = None  # the vocabulary's phones (without sil), once per process


def phone_set(pool) -> frozenset[str]:
    """Every phone the vocabulary can produce, computed with the pool's workers the first time. It comes from the
    vocabulary, not from the utterances, so it is the same for train and test and every corpus size and seed."""
    global _PHONE_SET
    if _PHONE_SET is None:
        _PHONE_SET = frozenset(set().union(*pool.map(vocabulary_phones, VOCABULARY)) - {SIL})
    return _PHONE_SET


def write_kaldi_dir(data_dir: Path, utts: list[tuple[str, str, str, str, list]]) -> None:
    """utts: (utt_id, speaker, wav_path, transcript, phone segments in ms), written sorted by utterance id;
    phones.ctm: `utt 1 start duration phone` (seconds, 3 decimals), the segments of each utterance in order."""
    data_dir.mkdir(parents=True, exist_ok=True)
    utts = sorted(utts)
    spk2utt: dict[str, list[str]] = {}
    for utt, spk, *_ in utts:
        spk2utt.setdefault(spk, []).append(utt)
    (data_dir / "wav.scp").write_text("".join(f"{u} {w}\n" for u, _, w, _, _ in utts))
    (data_dir / "text").write_text("".join(f"{u} {t}\n" for u, _, _, t, _ in utts))
    (data_dir / "utt2spk").write_text("".join(f"{u} {s}\n" for u, s, _, _, _ in utts))
    (data_dir / "spk2utt").write_text("".join(f"{s} {' '.join(us)}\n" for s, us in sorted(spk2utt.items())))
    (data_dir / "phones.ctm").write_text("".join(f"{u} 1 {a / 1000:.3f} {(b - a) / 1000:.3f} {phone}\n"
                                                 for u, *_, segments in utts for a, b, phone in segments))


def synthesize_corpus(out_dir: str | Path, n_train: int = 3000, n_test: int = 300, seed: int = 0,
                      sample_rate: int = 16000, num_workers: int = 2, progress: bool = True, n_dev: int = 0) -> dict:
    """Writes out_dir/train, out_dir/test (and out_dir/dev, with n_dev) as Kaldi data dirs (wav.scp, text,
    utt2spk, spk2utt, all sorted by utterance id, utterance ids prefixed by speaker id so sorting is consistent),
    audio as 16-bit PCM WAV under out_dir/wav/<split>/<utt>.wav with ABSOLUTE paths in wav.scp, phone timings as phones.ctm in each data dir
    and their symbol table as out_dir/phones.txt (sil = 0, the others sorted). Returns a summary dict (counts,
    hours of audio, voices and phone segments per split; size of the phone table)."""
    espeak_paths()  # fail fast, in this process, with a clear message
    out_dir = Path(out_dir).resolve()
    start = time.time()
    speakers = make_speakers(seed, n_train, n_test, n_dev)
    sizes = {"train": n_train, "test": n_test, **({"dev": n_dev} if n_dev else {})}
    jobs, entries = [], []
    for split, n in sizes.items():
        (out_dir / "wav" / split).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            spk = speakers[split][i % len(speakers[split])]
            utt = f"{speaker_id(*spk[:3])}-{split}{i:06d}"
            words = make_sentence(np.random.default_rng([seed, SPLIT_CODES[split], i, 0]))
            wav = str(out_dir / "wav" / split / f"{utt}.wav")
            jobs.append((wav, words, spk, [seed, SPLIT_CODES[split], i, 1], sample_rate))
            entries.append((split, utt, speaker_id(*spk[:3]), wav, " ".join(words), spk[0]))

    # Processes, not threads: espeak-ng is not thread-safe. Always a spawned pool, even for one worker: the workers
    # fork per utterance, which must not happen in the caller's (possibly large, multi-threaded) process.
    chunksize = max(1, min(16, len(jobs) // (4 * max(1, num_workers))))  # small corpora still use every worker
    columns = (TextColumn("synthesizing (espeak-ng)"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with mp.get_context("spawn").Pool(max(1, num_workers)) as pool, progress_bar(*columns, enabled=progress) as bar:
        inventory = phone_set(pool)
        task = bar.add_task("", total=len(jobs))
        results = []
        for result in pool.imap(synth_utterance, jobs, chunksize=chunksize):
            results.append(result)
            bar.advance(task)

    unknown = {phone for _, segments in results for *_, phone in segments} - inventory - {SIL}
    if unknown:  # a context the vocabulary pass did not cover: the table would not describe the data
        raise RuntimeError(f"espeak-ng used phones {sorted(unknown)} that are not in the vocabulary's phone set")
    (out_dir / "phones.txt").write_text("".join(f"{p} {i}\n" for i, p in enumerate([SIL] + sorted(inventory))))
    summary: dict = {"out_dir": str(out_dir), "seed": seed, "sample_rate": sample_rate,
                     "phones": len(inventory) + 1}
    for split in sizes:
        rows = [(e, r) for e, r in zip(entries, results) if e[0] == split]
        write_kaldi_dir(out_dir / split, [e[1:5] + (segments,) for e, (_, segments) in rows])
        summary[split] = {"utterances": len(rows), "speakers": len({e[2] for e, _ in rows}),
                          "hours": round(sum(d for _, (d, _) in rows) / 3600, 4),
                          "variants": sorted({e[5] for e, _ in rows}),
                          "phone_segments": sum(p != SIL for _, (_, segments) in rows for *_, p in segments)}
    summary["seconds"] = round(time.time() - start, 1)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description="Synthesize the default espeak-ng digits/letters/commands corpus.")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--n-train", type=int, default=3000)
    ap.add_argument("--n-test", type=int, default=300)
    ap.add_argument("--n-dev", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample-rate", type=int, default=16000)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    print(json.dumps(synthesize_corpus(args.out, args.n_train, args.n_test, args.seed, args.sample_rate,
                                       args.workers, n_dev=args.n_dev), indent=2))


if __name__ == "__main__":
    main()
