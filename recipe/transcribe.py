"""Transcribe recordings with a trained experiment, or with the one-file model it exports.

    python -m recipe.transcribe --exp EXP a.wav b.flac [more.scp | list.txt ...]
    python -m recipe.transcribe --model EXP/decode/model.pt a.wav
    python -m recipe.transcribe --exp EXP --export model.pt

Every input is an audio file (anything libsndfile reads), a Kaldi wav.scp (`utt path` or `utt command |` lines;
an utt2spk beside it names the speakers) or a list of audio paths, one a line. One line a recording goes to stdout,
`name transcript`; the real-time factor goes to stderr at the end. A recording that cannot be transcribed (a
missing file, a format libsndfile cannot read, one shorter than a frame) gets a message naming it on stderr and
the others are still transcribed; the exit status is then 1. Another sample rate is resampled (and said so); a
silent recording is said so and transcribed (to nothing, normally).

The model, features, normalization and decoder are the decode stage's: the weights it averaged, the decoder and
LM weight it chose on the dev set, the features and CMVN of training. Per-speaker CMVN needs a speaker's statistics:
a recording of a speaker the experiment knows (any of its data dirs' recordings, or a wav.scp whose utt2spk names
such a speaker) takes them as the decode stage did, so the held-out set's hypotheses come out exactly; any other
recording is normalized by its own statistics (per-utterance CMVN, what per-speaker CMVN is for a speaker heard
once), or with --unknown-speaker train by the training set's. The model runs on packed sequences, so a recording's
output does not depend on the batch it is decoded in.

The export (written by the decode stage as EXP/decode/model.pt) is one TorchScript file: the averaged model, and
as its extra files the feature settings, token table, decode settings, CMVN statistics and the word LM (ARPA); it
needs this recipe's code for features and decoding, not the experiment folder. From Python:

    from recipe.transcribe import Transcriber
    t = Transcriber.from_experiment("exp/sync")        # or Transcriber.load("exp/sync/decode/model.pt")
    t.transcribe([waveform], sample_rate=16000)        # -> ["one two three"]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soxr
import torch
from omegaconf import OmegaConf

from recipe.evaluate import beam_decoder, greedy_decode
from recipe.lib.datadir import Utterance
from recipe.lib.features import cmvn_stats, compute_features, load_audio, utterance_cmvn
from recipe.lib.ngram import NgramLM
from recipe.lib.tables import DataError, read_table

SETTINGS, LM, STATS = "recipe.json", "lm.arpa", "cmvn.npz"  # the export's extra files
# TorchScript is deprecated in torch 2.13 in favour of torch.export, whose dynamic shapes an LSTM over padded
# batches of any length does not yet take without rewriting the model; it still works, and says so at every call
warnings.filterwarnings("ignore", message=r"`torch\.jit\.(script|save|load)` is deprecated",
                        category=DeprecationWarning)


@dataclass
class Recording:
    name: str  # as printed: the utterance id of a wav.scp, else the path as given
    audio: str  # a path, or a wav.scp pipe command ending in "|"
    speaker: str | None = None


class Transcriber:
    """A model with its features, normalization and decoder: waveforms in, transcripts out."""

    def __init__(self, model: torch.nn.Module, settings: dict, stats: dict[str, np.ndarray], arpa: str | None):
        self.model, self.settings = model.eval(), settings
        self.features = OmegaConf.create(settings["features"])
        self.sample_rate, self.tokens, self.cmvn = settings["sample_rate"], settings["tokens"], settings["cmvn"]
        self.speakers = {str(s): (m, d) for s, m, d in zip(stats["speakers"], stats["means"], stats["stds"])}
        self.train_stats = (stats["train_mean"], stats["train_std"])
        self.recordings = settings["recordings"]  # audio path -> speaker, of the experiment's own data dirs
        self.arpa = arpa
        self.decode = self._decoder()

    # -- building -----------------------------------------------------------------------------------------------
    @classmethod
    def from_experiment(cls, root: str | Path, decoded: str = "decode",
                        model: torch.nn.Module | None = None) -> "Transcriber":
        """The model and decoder of the experiment's decode stage (its results in EXP/<decoded>; `model`: the
        weights it averaged, when the caller has them already)."""
        from recipe.lib.experiment import Experiment

        exp = Experiment(root)
        conf, scores_path = exp.conf, exp.root / decoded / "scores.json"
        if conf.train.objective != "ctc":
            raise SystemExit(f"{exp.root}: trained with train.objective={conf.train.objective}: its frame scores are "
                             f"for Kaldi's decoder (EXP/decode/loglikes.scp); transcribe needs a CTC model")
        if not scores_path.is_file():
            raise SystemExit(f"{scores_path}: no decode stage yet; it chooses the decoder (run.sh --stage 4)")
        if any((exp.root / "vectors" / f"{split}.npz").is_file() for split in ("train", "dev", "test")):
            raise SystemExit(f"{exp.root}: its features carry speaker vectors (i-vectors), which transcribe cannot "
                             f"compute for a new recording")
        scores = json.loads(scores_path.read_text())
        if model is None:
            model, _ = exp.load_model(None, conf.decode.average_best, conf.decode.average_within)
        model.packed = True
        arpa = exp.root / decoded / "lm.arpa" if not conf.decode.lm_arpa else Path(conf.decode.lm_arpa)
        settings = {"features": OmegaConf.to_container(conf.features), "sample_rate": conf.data.sample_rate,
                    "cmvn": conf.features.cmvn, "stack": conf.model.stack, "tokens": exp.tokens,
                    "decoder": scores["decoder"],
                    "decode": scores["decode"], "recordings": known_recordings(exp)}
        return cls(model, settings, experiment_stats(exp), arpa.read_text() if scores["lm"] else None)

    @classmethod
    def load(cls, path: str | Path) -> "Transcriber":
        """The export: one TorchScript file with its settings, statistics and LM as extra files."""
        extra = {SETTINGS: "", LM: "", STATS: ""}
        try:
            model = torch.jit.load(str(path), map_location="cpu", _extra_files=extra)
        except (RuntimeError, ValueError, OSError) as err:
            raise SystemExit(f"{path}: not a model this recipe exported ({err})") from None
        stats = dict(np.load(io.BytesIO(extra[STATS]), allow_pickle=False))
        return cls(model, json.loads(extra[SETTINGS]), stats, extra[LM].decode() or None)

    def export(self, path: str | Path) -> None:
        model = torch.jit.script(self.model)
        stats = io.BytesIO()
        speakers = sorted(self.speakers)
        np.savez(stats, speakers=np.array(speakers, dtype=str),
                 means=np.array([self.speakers[s][0] for s in speakers], np.float32).reshape(len(speakers), -1),
                 stds=np.array([self.speakers[s][1] for s in speakers], np.float32).reshape(len(speakers), -1),
                 train_mean=self.train_stats[0], train_std=self.train_stats[1])
        torch.jit.save(model, str(path), _extra_files={SETTINGS: json.dumps(self.settings), STATS: stats.getvalue(),
                                                       LM: (self.arpa or "").encode()})

    def _decoder(self):
        if self.settings["decoder"] == "greedy":
            return greedy_decode
        d = OmegaConf.create(self.settings["decode"])
        lm, path = None, ""
        if self.arpa:
            with tempfile.NamedTemporaryFile("w", suffix=".arpa", delete=False) as f:
                f.write(self.arpa)
            lm, path = NgramLM.load_arpa(f.name), f.name
            if d.backend != "flashlight":  # only flashlight's decoder reads the file again, when it is built
                os.unlink(f.name)
        return beam_decoder(d, lm, path, self.tokens, d.lm_weight or 0.0, d.word_bonus or 0.0)

    # -- transcribing -------------------------------------------------------------------------------------------
    def normalized(self, x: np.ndarray, speaker: str | None, unknown: str = "utterance") -> np.ndarray:
        """CMVN as in training; a speaker the experiment does not know: its own statistics, or the training set's."""
        if self.cmvn == "none":
            return x
        if self.cmvn == "global" or (self.cmvn == "speaker" and speaker not in self.speakers and unknown == "train"):
            mean, std = self.train_stats
        elif self.cmvn == "speaker" and speaker in self.speakers:
            mean, std = self.speakers[speaker]
        else:
            mean, std = utterance_cmvn(x)
        return (x - mean) / std

    @torch.no_grad()
    def decode_features(self, feats: list[np.ndarray]) -> list[str]:
        lengths = torch.tensor([len(x) for x in feats])
        padded = torch.nn.utils.rnn.pad_sequence([torch.from_numpy(np.ascontiguousarray(x)) for x in feats],
                                                 batch_first=True)
        logits, out_lengths = self.model(padded, lengths)
        return self.decode(logits.float(), out_lengths, self.tokens)

    def inputs(self, wave: np.ndarray, name: str, speaker: str | None, unknown: str = "utterance") -> np.ndarray:
        """Samples at the model's rate -> the model's normalized input rows; too short for one output step: an
        error naming the recording."""
        x = compute_features(wave, self.sample_rate, self.features)
        if len(x) < self.settings["stack"]:
            raise DataError(f"{name}: {len(wave) / self.sample_rate:.3f} s of audio is too short for one output "
                            f"step of the model")
        return self.normalized(x, speaker, unknown)

    def transcribe(self, waves: list[np.ndarray], sample_rate: int, speakers: list[str | None] | None = None,
                   unknown: str = "utterance") -> list[str]:
        """Mono float waveforms at sample_rate -> their transcripts (the Python API)."""
        feats = []
        for k, wave in enumerate(waves):
            wave = np.asarray(wave, dtype=np.float32)
            if sample_rate != self.sample_rate:
                wave = soxr.resample(wave, sample_rate, self.sample_rate).astype(np.float32)
            feats.append(self.inputs(wave, f"waveform {k}", speakers[k] if speakers else None, unknown))
        return self.decode_features(feats)


def known_recordings(exp) -> dict[str, str]:
    """{audio path: speaker} of the experiment's data dirs (whole recordings only: a segment is not a file)."""
    found = {}
    for split in ("train", "dev", "test"):
        d = exp.data_dir(split)
        if (d / "wav.scp").is_file() and not (d / "segments").is_file():
            utt2spk = speakers_of(d)
            found.update({entry: utt2spk.get(utt, utt) for utt, (entry, _) in read_table(d / "wav.scp").items()})
    return found


def speakers_of(folder: Path) -> dict[str, str]:
    """{utterance: speaker} of the utt2spk in a folder ({} without one)."""
    path = folder / "utt2spk"
    return {utt: spk for utt, (spk, _) in read_table(path).items()} if path.is_file() else {}


def experiment_stats(exp) -> dict[str, np.ndarray]:
    """Per-speaker CMVN statistics of every split's cache, as training and the decode stage computed them, and
    the training set's global ones."""
    speakers = {}
    for split in ("train", "dev", "test"):
        speakers.update(cmvn_stats(exp.cache(split), "speaker"))
    mean, std = cmvn_stats(exp.cache("train"), "global")["*"]
    names = sorted(speakers)
    return {"speakers": np.array(names, dtype=str), "means": np.array([speakers[s][0] for s in names]),
            "stds": np.array([speakers[s][1] for s in names]), "train_mean": mean, "train_std": std}


def recordings(inputs: list[str], known: dict[str, str]) -> list[Recording]:
    """The command line's inputs -> recordings: audio files, wav.scp files (utt2spk beside them), lists."""
    out = []
    for given in inputs:
        path = Path(given)
        if path.name.endswith(".scp"):
            spk = speakers_of(path.parent)
            out += [Recording(utt, entry, spk.get(utt)) for utt, (entry, _) in read_table(path).items()]
        elif path.suffix in (".txt", ".list", ".lst"):
            out += [Recording(line.strip(), line.strip()) for line in path.read_text().splitlines() if line.strip()]
        else:
            out.append(Recording(given, given))
    for r in out:
        if r.speaker is None:
            r.speaker = known.get(str(Path(r.audio).resolve())) if not r.audio.endswith("|") else None
    return out


def run(t: Transcriber, recs: list[Recording], batch: int, unknown: str) -> int:
    """Transcribe, batch by batch, printing as it goes -> the number of recordings that failed."""
    failed, audio_s, t0 = 0, 0.0, time.perf_counter()
    ready: list[tuple[Recording, np.ndarray]] = []

    def flush():
        for (r, _), text in zip(ready, t.decode_features([x for _, x in ready])):
            print(f"{r.name} {text}", flush=True)
        ready.clear()

    for r in recs:
        try:
            wave = read_recording(r, t.sample_rate)
            x = t.inputs(wave, r.name, r.speaker, unknown)
        except DataError as err:
            print(f"transcribe: {err}", file=sys.stderr)
            failed += 1
            continue
        audio_s += len(wave) / t.sample_rate
        ready.append((r, x))
        if len(ready) == batch:
            flush()
    flush()
    seconds = time.perf_counter() - t0
    print(f"transcribe: {len(recs) - failed} of {len(recs)} recordings, {audio_s:.1f} s of audio in {seconds:.1f} s: "
          f"real-time factor {seconds / max(audio_s, 1e-9):.3f}", file=sys.stderr)
    return failed


def read_recording(r: Recording, sample_rate: int) -> np.ndarray:
    """The samples at the model's rate; the reasons a file cannot be used, named."""
    import soundfile

    if not r.audio.endswith("|"):
        if not Path(r.audio).is_file():
            raise DataError(f"{r.name}: no such file")
        try:
            rate = soundfile.info(r.audio).samplerate
        except Exception as err:  # libsndfile's own reason: not audio, a format it does not read
            raise DataError(f"{r.name}: not audio libsndfile can read ({err})") from None
        if rate != sample_rate:
            print(f"transcribe: {r.name}: {rate} Hz resampled to the model's {sample_rate} Hz", file=sys.stderr)
    wave = load_audio(Utterance(r.name, r.speaker or r.name, r.audio, ""), sample_rate)
    if not np.any(wave):
        print(f"transcribe: {r.name}: silent (every sample is 0)", file=sys.stderr)
    return wave


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--exp", help="an experiment folder whose decode stage has run")
    source.add_argument("--model", help="a model exported by the decode stage (EXP/decode/model.pt)")
    p.add_argument("--export", default=None, help="write the one-file model here and exit")
    p.add_argument("--batch", type=int, default=16, help="recordings a forward pass (default 16)")
    p.add_argument("--unknown-speaker", choices=("utterance", "train"), default="utterance",
                   help="per-speaker CMVN for a speaker the experiment does not know: the recording's own "
                        "statistics (default) or the training set's")
    p.add_argument("inputs", nargs="*", help="audio files, wav.scp files, or lists of audio paths")
    args = p.parse_args(argv)
    t = Transcriber.from_experiment(args.exp) if args.exp else Transcriber.load(args.model)
    if args.export:
        t.export(args.export)
        print(f"transcribe: wrote {args.export}", file=sys.stderr)
        return 0
    if not args.inputs:
        p.error("give recordings to transcribe (or --export FILE)")
    try:
        recs = recordings(args.inputs, t.recordings)
    except (DataError, OSError) as err:
        print(f"transcribe: {err}", file=sys.stderr)
        return 2
    return 1 if run(t, recs, args.batch, args.unknown_speaker) else 0


if __name__ == "__main__":
    sys.exit(main())
