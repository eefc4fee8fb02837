"""Kaldi-style data dirs: read, check and write them.

A data dir holds ``wav.scp`` (``utt path``, or ``recording path`` with ``segments``; a path or a Kaldi pipe
command ``recording sph2pipe -f wav -p -c 1 /x/sw02001.sph |``), ``text`` (``utt words``), and optionally
``utt2spk``, ``segments`` (``utt recording start end``, seconds), and Kaldi's own features ``feats.scp`` (with
``cmvn.scp``): with feats.scp the recipe trains on those features and never reads the audio.

Everything a user can get wrong is found here, before features are extracted and hours of training are spent:
hard errors name the file, line and utterance; mismatches Kaldi's ``fix_data_dir.sh`` would drop are skipped
with a warning and counted.
"""

from __future__ import annotations

import logging
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import soundfile

from recipe.lib.kaldi_io import FeatsScp, pipe_command, read_pipe_audio
from recipe.lib.tables import DataError, absolute_rxfilename, read_table

log = logging.getLogger(__name__)

BLANK = "<blank>"


@dataclass(frozen=True)
class Utterance:
    utt: str
    speaker: str
    audio: str  # path to a wav/flac file readable by libsndfile, or a Kaldi pipe command ending in "|"
    text: str
    start: float = 0.0  # seconds into the audio file (segments)
    end: Optional[float] = None  # None: to the end of the file
    speed: float = 1.0  # speed perturbation factor applied when the audio is loaded (recipe/lib/augment.py)
    feats: Optional[str] = None  # Kaldi features (feats.scp's `ark:offset`): used instead of the audio
    # Length before speed perturbation, where the reader measured it (load_data_dir runs every pipe command once
    # for it), so that writing utt2dur need not run them again. Not part of what the utterance is: compare=False.
    seconds: Optional[float] = field(default=None, compare=False)


def load_data_dir(data_dir: str | Path, max_seconds: float = float("inf"),
                  on_bad: str = "error") -> tuple[list[Utterance], Counter]:
    """Read and check a data dir -> (utterances sorted by id, counts of what was skipped and why).
    on_bad="skip" (data.on_bad_utterance): an unreadable recording (a failing pipe command, a corrupt file) or a
    segment outside its recording is left out, with a warning, and counted, instead of stopping the run."""
    d = Path(data_dir)
    if (d / "feats.scp").is_file():
        return _load_feats_dir(d)
    for required in ("wav.scp", "text"):
        if not (d / required).is_file():
            raise DataError(f"{d}: missing {required} (a Kaldi data dir needs wav.scp, or feats.scp, and text)")
    wav_scp = read_table(d / "wav.scp")
    text = read_table(d / "text")
    utt2spk = read_table(d / "utt2spk") if (d / "utt2spk").is_file() else {}
    skips = _Skips(on_bad)
    recordings = {rec: _audio_path(d / "wav.scp", lineno, rec, entry) for rec, (entry, lineno) in wav_scp.items()}
    with ThreadPoolExecutor(8) as pool:  # pipe commands run to learn their length: several at once
        durations = dict(zip(recordings, pool.map(
            lambda rec: skips.checked("unreadable_audio", _duration, f"{d / 'wav.scp'}:{wav_scp[rec][1]}: {rec}",
                                      recordings[rec]), recordings)))
    durations = {rec: seconds for rec, seconds in durations.items() if seconds is not None}
    if (d / "segments").is_file():
        audio = _segments(d, set(recordings) - set(durations), durations, skips)
    else:
        audio = {utt: (utt, 0.0, None) for utt in durations}

    utts = []
    for utt in sorted(set(audio) | set(text)):
        seconds = _usable_seconds(d, utt, text, audio, durations, max_seconds, skips)
        if seconds is not None:
            rec, start, end = audio[utt]
            speaker = utt2spk[utt][0] if utt in utt2spk else utt
            utts.append(Utterance(utt, speaker, recordings[rec], " ".join(text[utt][0].split()), start, end,
                                  seconds=seconds))
    if not utts:
        raise DataError(f"{d}: no usable utterances ({dict(+skips.counts) or 'empty wav.scp/text'})")
    return utts, +skips.counts


class _Skips:
    """What was skipped, by kind; with on_bad="error" a DataError stops the run instead."""

    def __init__(self, on_bad: str):
        self.on_bad, self.counts = on_bad, Counter()

    def checked(self, kind: str, check, *args):
        """check(*args), or None (counted under kind) for a DataError when bad utterances are skipped."""
        try:
            return check(*args)
        except DataError as err:
            if self.on_bad == "error":
                raise
            log.warning("%s: skipped", err)
            self.counts[kind] += 1
            return None

    def skip(self, kind: str, message: str, *args) -> None:
        """A mismatch Kaldi's fix_data_dir.sh would drop: always skipped with a warning, and counted."""
        log.warning(message + ": skipped", *args)
        self.counts[kind] += 1


def _segments(d: Path, unreadable: set[str], durations: dict[str, float], skips: _Skips) -> dict:
    """segments -> {utt: (recording, start, end)}, each checked against its recording's duration."""
    audio = {}
    for utt, (entry, lineno) in read_table(d / "segments").items():
        if entry.split()[:1] and entry.split()[0] in unreadable:
            continue  # of an unreadable recording, skipped and counted already
        segment = skips.checked("bad_segment", _segment, d / "segments", lineno, utt, entry, durations)
        if segment is not None:
            audio[utt] = segment
    skips.counts["recording_without_segments"] = len(set(durations) - {a[0] for a in audio.values()})
    return audio


def _usable_seconds(d: Path, utt: str, text: dict, audio: dict, durations: dict[str, float], max_seconds: float,
                    skips: _Skips) -> float | None:
    """The utterance's length, or None when it is skipped (and counted) for a mismatch or its length."""
    if utt not in text:
        return skips.skip("audio_without_text", "%s: utterance %s has audio but no transcript in text", d, utt)
    if utt not in audio:
        return skips.skip("text_without_audio", "%s/text:%d: utterance %s has no audio", d, text[utt][1], utt)
    if not text[utt][0]:
        return skips.skip("empty_transcript", "%s/text:%d: utterance %s has an empty transcript", d, text[utt][1],
                          utt)
    rec, start, end = audio[utt]
    seconds = (end if end is not None else durations[rec]) - start
    if seconds <= 0.0:
        return skips.skip("zero_length_audio", "%s: utterance %s has no audio samples", d, utt)
    if seconds > max_seconds:
        return skips.skip("too_long", "%s: utterance %s is %.1f s long (> data.max_utt_seconds)", d, utt, seconds)
    return seconds


def _load_feats_dir(d: Path) -> tuple[list[Utterance], Counter]:
    """A data dir with Kaldi features: the utterances of feats.scp that have a transcript."""
    if not (d / "text").is_file():
        raise DataError(f"{d}: missing text (a Kaldi data dir needs wav.scp, or feats.scp, and text)")
    feats, text = read_table(d / "feats.scp"), read_table(d / "text")
    utt2spk = read_table(d / "utt2spk") if (d / "utt2spk").is_file() else {}
    skipped: Counter = Counter()
    utts = []
    for utt in sorted(set(feats) | set(text)):
        if utt not in text or not text[utt][0]:
            log.warning("%s: utterance %s has features but no transcript: skipped", d, utt)
            skipped["audio_without_text"] += 1
        elif utt not in feats:
            log.warning("%s/text:%d: utterance %s has no features in feats.scp: skipped", d, text[utt][1], utt)
            skipped["text_without_audio"] += 1
        else:
            entry, lineno = feats[utt]
            path, offset = absolute_rxfilename(entry)
            if not path.is_file():
                raise DataError(f"{d / 'feats.scp'}:{lineno}: {utt}: feature archive not found: {entry}")
            utts.append(Utterance(utt, utt2spk[utt][0] if utt in utt2spk else utt, "", " ".join(text[utt][0].split()),
                                  feats=f"{path}{offset}"))
    if not utts:
        raise DataError(f"{d}: no usable utterances ({dict(+skipped) or 'empty feats.scp/text'})")
    return utts, +skipped


def _audio_path(scp: Path, lineno: int, rec: str, entry: str) -> str:
    if entry.endswith("|"):
        return entry  # run when its audio is needed (recipe/lib/kaldi_io.py)
    if not entry:
        raise DataError(f"{scp}:{lineno}: {rec}: no audio path")
    path = Path(entry)
    if not path.is_absolute():
        path = Path.cwd() / path  # Kaldi convention: relative to where the recipe runs
    if not path.is_file():
        raise DataError(f"{scp}:{lineno}: {rec}: audio file not found: {entry}")
    return str(path.resolve())


def _duration(where: str, path: str) -> float:
    """Seconds of audio in a file or a pipe command's output; where: `file:line: recording`, for errors."""
    command = pipe_command(path)
    if command is not None:  # a failing command stops the run here, before any feature is extracted
        samples, rate = read_pipe_audio(command, where)
        return len(samples) / rate
    try:
        info = soundfile.info(path)
    except Exception as err:  # libsndfile raises several types for corrupt or foreign files
        raise DataError(f"{where}: cannot read audio {path}: {err}") from None
    return info.frames / info.samplerate


def _segment(path: Path, lineno: int, utt: str, entry: str, durations: dict[str, float]):
    fields = entry.split()
    try:
        rec, start, end = fields[0], float(fields[1]), float(fields[2])
    except (IndexError, ValueError):
        raise DataError(f"{path}:{lineno}: {utt}: expected 'utt recording start end', got {entry!r}") from None
    if rec not in durations:
        raise DataError(f"{path}:{lineno}: {utt}: recording {rec!r} is not in wav.scp")
    if end < 0:  # Kaldi: an end of -1 means the end of the recording
        end = durations[rec]
    if not 0.0 <= start < end:
        raise DataError(f"{path}:{lineno}: {utt}: bad time range {start}..{end}")
    if start >= durations[rec]:
        raise DataError(f"{path}:{lineno}: {utt}: starts at {start} s, past the end of {rec} ({durations[rec]:.2f} s)")
    return rec, start, min(end, durations[rec])


def write_data_dir(utts: list[Utterance], out_dir: str | Path) -> None:
    """Write a clean data dir that Kaldi's utils/validate_data_dir.sh accepts: every file sorted by its key (C
    locale: Python's own string order), absolute audio paths, utt2spk, spk2utt and utt2dur always, segments
    where the input had them."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    utts = sorted(utts, key=lambda u: u.utt)
    for stale in ("feats.scp", "wav.scp", "segments"):  # an earlier run's file left here would be read as this dir's
        (d / stale).unlink(missing_ok=True)
    if all(u.feats for u in utts):  # Kaldi features: they stand for the audio
        (d / "feats.scp").write_text("".join(f"{u.utt} {u.feats}\n" for u in utts))
    with_segments = any(u.start > 0.0 or u.end is not None for u in utts)
    recordings: dict[str, str] = {}  # audio path -> recording id
    with open(d / "text", "w") as text, open(d / "utt2spk", "w") as u2s:
        segments = []
        for u in utts:
            text.write(f"{u.utt} {u.text}\n")
            u2s.write(f"{u.utt} {u.speaker}\n")
            if with_segments:
                rec = recordings.setdefault(u.audio, f"rec{len(recordings):06d}")
                segments.append(f"{u.utt} {rec} {u.start:.3f} {-1 if u.end is None else round(u.end, 3)}\n")
            elif u.audio:
                recordings[u.audio] = u.utt
    if recordings:  # none for Kaldi features: a wav.scp without their utterances would fail Kaldi's validation
        (d / "wav.scp").write_text("".join(sorted(f"{rec} {path}\n" for path, rec in recordings.items())))
    if with_segments:
        (d / "segments").write_text("".join(segments))
    spk2utt: dict[str, list[str]] = {}  # Kaldi's utils/utt2spk_to_spk2utt.pl: utterances in utt2spk's order
    for u in utts:
        spk2utt.setdefault(u.speaker, []).append(u.utt)
    (d / "spk2utt").write_text("".join(f"{spk} {' '.join(spk2utt[spk])}\n" for spk in sorted(spk2utt)))
    # %g: six significant digits, as Kaldi's wav-to-duration prints them
    (d / "utt2dur").write_text("".join(f"{u.utt} {seconds:g}\n" for u, seconds in zip(utts, _utt_seconds(utts, d))))


def _utt_seconds(utts: list[Utterance], d: Path) -> list[float]:
    """Each utterance's length for utt2dur: what the reader measured, else its segment's length, else its audio
    (a file's header; a pipe command is run once more), or for Kaldi features the frames at 10 ms, as Kaldi's
    utils/data/get_utt2dur.sh counts them. A speed-perturbed copy lasts 1/speed as long."""
    feats = FeatsScp(d / "feats.scp") if (d / "feats.scp").is_file() else None
    audio_seconds: dict[str, float] = {}  # a recording that several utterances share is measured once
    lengths = []
    for u in utts:
        if u.seconds is not None:
            seconds = u.seconds
        elif u.end is not None:
            seconds = u.end - u.start
        elif u.feats and feats is not None:
            seconds = feats.num_frames(u.utt) * 0.01
        else:
            if u.audio not in audio_seconds:
                audio_seconds[u.audio] = _duration(f"{d / 'utt2dur'}: {u.utt}", u.audio)
            seconds = audio_seconds[u.audio] - u.start
        lengths.append(seconds / u.speed)
    return lengths


def build_tokens(utts: list[Utterance]) -> list[str]:
    """Character token set of the training transcripts; index 0 is the CTC blank."""
    return [BLANK] + sorted({c for u in utts for c in u.text})


def check_tokens(utts: list[Utterance], tokens: list[str], text_path: str | Path) -> None:
    known = set(tokens)
    for u in utts:
        unknown = sorted(set(u.text) - known)
        if unknown:
            raise DataError(f"{text_path}: utterance {u.utt}: characters {unknown} are not in the training "
                            f"token set (built from the training transcripts)")


SPACE = "<space>"  # how the space character is written in tokens.txt


def write_tokens(tokens: list[str], path: str | Path) -> None:
    Path(path).write_text("".join(f"{SPACE if t == ' ' else t}\n" for t in tokens), encoding="utf-8")


def read_tokens(path: str | Path) -> list[str]:
    """tokens.txt (one token a line, the CTC blank first) -> tokens; a damaged file is a DataError."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    if lines[-1] == "":
        lines.pop()  # the final newline
    if not lines or lines[0] != BLANK:
        raise DataError(f"{path}:1: the first token must be the CTC blank {BLANK!r}")
    first_seen: dict[str, int] = {}
    for lineno, token in enumerate(lines, 1):
        if not token:
            raise DataError(f"{path}:{lineno}: empty token")
        if token in first_seen:
            raise DataError(f"{path}:{lineno}: token {token!r} repeats line {first_seen[token]}")
        first_seen[token] = lineno
    return [" " if t == SPACE else t for t in lines]
