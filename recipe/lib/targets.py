"""Frame targets for the paper's cross-entropy objective: alignments checked against the features, stored beside
them, and the class priors a hybrid decoder divides by.

Targets come from Kaldi alignments (pdf ids per frame, `ali-to-pdf` output: recipe/lib/kaldi_io.py) or from a phone
CTM (`utt channel start duration phone`, as the built-in corpus writes from espeak-ng's phoneme events, or as
Kaldi's `ali-to-phones --ctm-output` writes). Stage 2 checks every utterance before training: an alignment
missing, longer or shorter than its features by more than `data.ali_tolerance` frames, or holding an id beyond
the output layer stops the run naming the file and utterance (or, with data.on_bad_utterance=skip, is left out
and counted). The alignments are streamed, one utterance at a time, into one int32 file at the feature cache's
row offsets (targets.i32 + index.tsv + meta.json), read by range like the features.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import numpy as np

from recipe.lib.features import FeatureCache
from recipe.lib.tables import DataError, read_table

log = logging.getLogger(__name__)


def read_phone_table(path: Path) -> dict[str, int]:
    """Kaldi symbol table `phone id` -> {phone: id}; ids must be 0..n-1."""
    table = {}
    for phone, (rest, lineno) in read_table(path).items():
        if not rest.isdigit():
            raise DataError(f"{path}:{lineno}: expected 'phone id', got {phone!r} {rest!r}")
        table[phone] = int(rest)
    if sorted(table.values()) != list(range(len(table))):
        raise DataError(f"{path}: phone ids must be 0..{len(table) - 1}, each once")
    return table


def ctm_alignments(ctm: Path, phones: dict[str, int], frames: Mapping[str, int], shift_s: float,
                   window_s: float, states: int = 1) -> Iterator[tuple[str, np.ndarray]]:
    """Phone CTM -> (utt, per-frame targets) for the utterances in `frames`: a frame takes the phone under its
    window's centre (frames as the features cut them: frame i covers [i * shift, i * shift + window)). With
    states > 1, phone-position states as in a left-to-right HMM: each phone's time split in `states` equal
    parts, target phone * states + part. The CTM is read one utterance at a time (its lines grouped by
    utterance, as Kaldi writes them)."""
    def targets(utt: str, segs: list[tuple[float, float, int]]) -> np.ndarray:
        segs.sort()
        starts, ends = np.array([b for b, _, _ in segs]), np.array([e for _, e, _ in segs])
        ids = np.array([p for _, _, p in segs], dtype=np.int32)
        centres = np.arange(frames[utt]) * shift_s + window_s / 2
        k = np.minimum(np.searchsorted(ends, centres, side="right"), len(ids) - 1)  # the segment of each frame
        part = np.clip((states * (centres - starts[k]) / np.maximum(ends[k] - starts[k], 1e-9)).astype(np.int32),
                       0, states - 1)
        return ids[k] * states + part

    utt, segs, done = None, [], set()
    with open(ctm, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            fields = line.split()
            if not fields:
                continue
            try:
                key, start, duration, phone = fields[0], float(fields[2]), float(fields[3]), fields[4]
            except (IndexError, ValueError):
                raise DataError(f"{ctm}:{lineno}: expected 'utt channel start duration phone', got {line.strip()!r}")
            if phone not in phones:
                raise DataError(f"{ctm}:{lineno}: {key}: phone {phone!r} is not in the phone table")
            if key != utt:
                if utt in frames:
                    yield utt, targets(utt, segs)
                if key in done:
                    raise DataError(f"{ctm}:{lineno}: {key}: its lines are not together (sort the CTM by utterance)")
                done.add(key)
                utt, segs = key, []
            segs.append((start, start + duration, phones[phone]))
    if utt in frames:
        yield utt, targets(utt, segs)


def write_targets(cache: FeatureCache, alignments: Iterable[tuple[str, np.ndarray]], source: str, out: Path,
                  num_targets: int | None, tolerance: int, on_bad: str) -> dict:
    """Check the alignments (streamed: one utterance in memory at a time) against the cache's utterances and
    write them in its row order -> meta, with the per-class frame counts for priors. num_targets None: the
    largest id + 1 (Kaldi's pdf ids count from 0). `source` names the alignment file in errors."""
    out.mkdir(parents=True, exist_ok=True)
    skipped: Counter = Counter()
    row_of = {utt: i for i, utt in enumerate(cache.utts)}
    offsets = np.concatenate([[0], np.cumsum(cache.frames)])  # frame offset of every row in targets.i32
    found, written = np.zeros(len(cache), dtype=bool), np.zeros(len(cache), dtype=bool)
    counts = np.zeros(num_targets or 1, dtype=np.int64)

    def bad(kind: str, message: str) -> None:
        if on_bad == "error":
            raise DataError(f"{source}: {message} (data.on_bad_utterance=skip leaves such utterances out)")
        log.warning("%s: %s: skipped", source, message)
        skipped[kind] += 1

    fd = os.open(out / "targets.i32.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, int(offsets[-1]) * 4)
        for utt, ali in alignments:
            i = row_of.get(utt)
            if i is None:
                continue  # an utterance of another split, or one stage 1 left out
            found[i] = True
            frames = int(cache.frames[i])
            if abs(len(ali) - frames) > tolerance:
                bad("alignment_length", f"utterance {utt}: alignment of {len(ali)} frames, features of {frames} "
                                        f"(data.ali_tolerance={tolerance})")
                continue
            if num_targets is not None and len(ali) and ali.max() >= num_targets:
                bad("target_out_of_range", f"utterance {utt}: target id {int(ali.max())} is beyond the output "
                                           f"layer's {num_targets} classes")
                continue
            # within tolerance: cut, or repeat the last target (Kaldi and our framing differ at the edges)
            ali = np.concatenate([ali[:frames], np.full(max(frames - len(ali), 0), ali[-1] if len(ali) else 0)])
            os.pwrite(fd, ali.astype(np.int32).tobytes(), int(offsets[i]) * 4)
            written[i] = True
            seen = np.bincount(ali, minlength=len(counts))
            counts = np.concatenate([counts, np.zeros(len(seen) - len(counts), np.int64)]) + seen
    finally:
        os.close(fd)
    for i in np.flatnonzero(~found):
        bad("no_alignment", f"utterance {cache.utts[i]} has no alignment")
    with open(out / "index.tsv.tmp", "w") as index:
        index.writelines(f"{cache.utts[i]}\t{offsets[i]}\t{cache.frames[i]}\n" for i in np.flatnonzero(written))
    for name in ("targets.i32", "index.tsv"):
        os.replace(out / f"{name}.tmp", out / name)
    num_targets = num_targets or len(counts)
    meta = {"source": source, "num_targets": num_targets, "frames": int(cache.frames[written].sum()),
            "skipped": dict(skipped), "counts": np.pad(counts, (0, num_targets - len(counts))).tolist()}
    (out / "meta.json").write_text(json.dumps(meta))
    return meta


class FrameTargets:
    """Read side of write_targets' folder."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        meta = json.loads((self.folder / "meta.json").read_text())
        self.num_targets, self.skipped = meta["num_targets"], Counter(meta["skipped"])
        self.counts = np.array(meta["counts"], dtype=np.int64)
        self.index = {}
        with open(self.folder / "index.tsv") as f:
            for line in f:
                utt, offset, frames = line.split("\t")
                self.index[utt] = (int(offset), int(frames))
        self._fd = None

    def has(self, utt: str) -> bool:
        return utt in self.index

    def read(self, utt: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        offset, frames = self.index[utt]
        stop = frames if stop is None else min(stop, frames)
        if self._fd is None:
            self._fd = os.open(self.folder / "targets.i32", os.O_RDONLY)
        data = os.pread(self._fd, (stop - start) * 4, (offset + start) * 4)
        return np.frombuffer(data, dtype=np.int32)

    def __getstate__(self):  # file descriptors do not travel to other processes
        return {**self.__dict__, "_fd": None}


def log_priors(counts: np.ndarray, floor: float = 1e-10) -> np.ndarray:
    """log p(class) from the training alignments' frame counts; classes never seen get the floor (Kaldi's
    nnet prior: a class with no frames must not turn into -inf after the division)."""
    p = counts / max(counts.sum(), 1)
    return np.log(np.maximum(p, floor)).astype(np.float32)
