"""Everything the recipe reads from Kaldi or writes for it: alignments, i-vectors, features, CMVN stats, network
outputs for Kaldi's decoders, and audio from ``wav.scp`` pipe commands.

Archives (``read_alignments``, ``read_vectors``, ``read_cmvn_stats``) are told apart like this: a name ending in
``.scp`` is a script file (``key file.ark:offset`` per line, each entry read through kaldiio); anything else is an
archive, gzipped or not (by its magic bytes), binary if the bytes after the first key are Kaldi's binary marker
``\\0B``, else text (``key 1 2 3``, ``key [ 0.1 0.2 ]`` or a ``[ ... ]`` matrix over several lines, as Kaldi and
kaldiio write them). Text is parsed here rather than by kaldiio so that errors can name the line.

Every bad input raises ``DataError`` with a message that starts with where the problem is: ``file:line: key`` for
text and script files, ``file: key`` for binary archives, which have no lines.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import signal
import struct
import subprocess
import zlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import BinaryIO

import kaldiio
import kaldiio.matio
import numpy as np
import soundfile

from recipe.lib.tables import DataError, read_table

INT32_MAX = np.iinfo(np.int32).max


# ---------------------------------------------------------------------------------------------------------------
# Public readers and writers


def read_alignments(path: str | Path) -> dict[str, np.ndarray]:
    """Frame-level pdf ids per utterance -> {utt: int32 1-D array} (all in memory: iter_alignments streams)."""
    return dict(iter_alignments(path))


def iter_alignments(path: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    """(utt, int32 1-D array of pdf ids) per utterance, in file order, one at a time.

    Accepts the text of ``ali-to-pdf final.mdl ark:ali.1.gz ark,t:-`` (``utt 12 12 40 ...``, plain or gzipped),
    a binary ark of int vectors, or an scp pointing into one. Note that Kaldi's own ``ali.N.gz`` hold transition
    ids, not pdf ids: convert them with ``ali-to-pdf`` first (the two cannot be told apart from the numbers).
    """
    for utt, where, array in _entries(path, np.int64):
        if not _is_array(array, 1, "iu"):
            raise DataError(f"{where}: not an integer vector ({_describe(array)}); expected pdf ids per frame")
        if not array.size:
            raise DataError(f"{where}: empty alignment")
        if array.min() < 0:
            raise DataError(f"{where}: negative pdf id {array.min()} at frame {array.argmin()}")
        if array.max() > INT32_MAX:
            raise DataError(f"{where}: pdf id {array.max()} at frame {array.argmax()} does not fit in int32")
        yield utt, array.astype(np.int32)


def read_vectors(path: str | Path) -> dict[str, np.ndarray]:
    """Speaker vectors or i-vectors per utterance or speaker -> {key: float32 1-D array}, all of one dimension.

    Accepts ``ivectors_utt.scp`` / ``ivectors_spk.scp`` (or any scp of vectors), a binary ark, or a text ark.
    A one-row matrix counts as a vector.
    """
    vectors: dict[str, np.ndarray] = {}
    first: tuple[str, int] | None = None  # (key, dim) of the first vector: all must match it
    for key, where, array in _entries(path, np.float64):
        if _is_array(array, 2, "fiu") and len(array) == 1:
            array = array[0]  # a one-row matrix
        if _is_array(array, 2, "fiu") and len(array) > 1:
            raise DataError(f"{where}: a {array.shape[0]} x {array.shape[1]} matrix, not a vector: online "
                            "i-vectors (one row per 10 frames, ivector_online.scp) are not supported; give "
                            "per-utterance or per-speaker vectors (ivectors_utt.scp / ivectors_spk.scp)")
        if not _is_array(array, 1, "fiu"):
            raise DataError(f"{where}: not a vector ({_describe(array)})")
        if not array.size:
            raise DataError(f"{where}: empty vector")
        _check_finite(where, array)
        first = first or (key, len(array))
        _check_dim(where, len(array), first)
        vectors[key] = array.astype(np.float32)
    return vectors


def read_cmvn_stats(path: str | Path) -> dict[str, tuple[float, np.ndarray, np.ndarray]]:
    """Kaldi's ``cmvn.scp`` (``compute-cmvn-stats``, usually per speaker) -> {key: (count, sum, sumsq)}.

    Each entry is a 2 x (D+1) matrix: row 0 holds the per-dimension sums and then the frame count, row 1 the
    per-dimension sums of squares (its last column unused). ``sum`` and ``sumsq`` are float64 arrays of size D.
    """
    stats = {}
    first: tuple[str, int] | None = None
    for key, where, array in _entries(path, np.float64):
        if not _is_array(array, 2, "fiu") or array.shape[0] != 2 or array.shape[1] < 2:
            raise DataError(f"{where}: CMVN stats must be a 2 x (dim+1) matrix, got {_describe(array)}")
        _check_finite(where, array)
        count = float(array[0, -1])
        if count <= 0:
            raise DataError(f"{where}: CMVN stats with frame count {count:g} (must be > 0)")
        first = first or (key, array.shape[1] - 1)
        _check_dim(where, array.shape[1] - 1, first)
        stats[key] = (count, array[0, :-1].astype(np.float64), array[1, :-1].astype(np.float64))
    return stats


class FeatsScp(Mapping):
    """Kaldi features read lazily: ``feats.scp`` (``utt file.ark:offset`` per line) or a plain ``.ark``.

    Keys are in file order; ``feats[utt]`` reads one float32 (frames, dim) matrix through kaldiio. Every read
    opens its ark afresh: no file handles are kept, so the object pickles into DataLoader workers, and forked
    workers cannot move each other's file offsets. A plain ``.ark`` is read through once here, to index it.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if self.path.suffix == ".scp":
            self._index = _read_scp(self.path)
        else:
            self._index = _index_ark(self.path)

    def __getitem__(self, utt: str) -> np.ndarray:
        rxspec, where = self._index[utt]
        matrix = _load(rxspec, where)
        if not _is_array(matrix, 2, "fiu"):
            raise DataError(f"{where}: features must be a matrix, got {_describe(matrix)}")
        _check_finite(where, matrix)
        return matrix.astype(np.float32, copy=False)

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def num_frames(self, utt: str) -> int:
        """Frame count of ``utt`` from the few header bytes of a binary matrix (plain or compressed); entries
        that are text, pipes or row ranges (``ark:offset[0:99]``) are read in full instead."""
        rxspec, _ = self._index[utt]
        ark, _, offset = rxspec.rpartition(":")
        if offset.isdigit() and not rxspec.rstrip().endswith("|"):
            with contextlib.suppress(OSError):  # a missing ark is reported by the full read below
                with open(ark, "rb") as fd:
                    fd.seek(int(offset))
                    rows = _binary_matrix_rows(fd.read(24))
                if rows is not None and rows >= 0:
                    return rows
        return len(self[utt])


def write_matrices(ark_path: str | Path, scp_path: str | Path, items: Iterable[tuple[str, np.ndarray]]) -> int:
    """Write (key, matrix) pairs as binary float32 matrices to an ark and its scp -> the number written.

    This is what ``nnet-forward`` writes, so e.g. ``latgen-faster-mapped ... ark:loglikes.ark`` can decode it.
    The scp names the ark by ``ark_path`` as given (a relative path is relative to where Kaldi runs). If
    anything fails, both files are removed: a partial ark would otherwise decode as if it were complete.
    """
    ark_path, scp_path = str(ark_path), str(scp_path)
    if "," in ark_path:  # kaldiio splits 'ark,scp:ARK,SCP' at the first comma after the colon
        raise ValueError(f"{ark_path}: an ark path with a comma cannot be given to kaldiio's ark,scp writer")
    written: set[str] = set()
    try:
        with kaldiio.WriteHelper(f"ark,scp:{ark_path},{scp_path}") as writer:
            for key, matrix in items:
                matrix = np.asarray(matrix, dtype=np.float32)
                if not key or key.split() != [key]:
                    raise ValueError(f"{ark_path}: key {key!r} must be non-empty and without whitespace")
                if key in written:
                    raise ValueError(f"{ark_path}: key {key!r} written twice")
                if matrix.ndim != 2:
                    raise ValueError(f"{ark_path}: {key}: expected a matrix, got shape {matrix.shape}")
                writer(key, matrix)
                written.add(key)
    except BaseException:
        for leftover in (ark_path, scp_path):
            Path(leftover).unlink(missing_ok=True)
        raise
    return len(written)


def pipe_command(entry: str) -> str | None:
    """The shell command of a ``wav.scp`` entry that is a pipe (``sox x.flac -t wav - |``), else None."""
    entry = entry.strip()
    return entry[:-1].strip() if entry.endswith("|") else None


def read_pipe_audio(command: str, where: str, timeout: float = 600.0) -> tuple[np.ndarray, int]:
    """Run a ``wav.scp`` pipe command -> (float32 samples (frames, channels), sample rate).

    The command runs under ``/bin/sh -c`` with stdin from /dev/null in the current directory, like Kaldi runs
    it; its stdout must be a wav or flac stream. ``where`` (e.g. ``data/train/wav.scp:12: sw02001-A``) starts
    every error message. Only the exit status of the last command of a pipeline is seen, as in Kaldi.
    """
    # A new session makes the whole pipeline one process group, so a timeout kills sox/sph2pipe too and not
    # just the shell (their open stdout would otherwise keep us waiting).
    proc = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise DataError(f"{where}: command still running after {timeout:g} s, killed: {command}") from None
    if proc.returncode != 0:
        status = (f"was killed by signal {-proc.returncode}" if proc.returncode < 0
                  else f"exited with status {proc.returncode}")
        raise DataError(f"{where}: command {status}: {command}{_stderr_tail(err)}")
    if not out:
        raise DataError(f"{where}: command wrote nothing to stdout: {command}{_stderr_tail(err)}")
    try:
        samples, rate = soundfile.read(io.BytesIO(_fix_wav_sizes(out)), dtype="float32", always_2d=True)
    except Exception as error:  # libsndfile raises several types for data it cannot parse
        raise DataError(f"{where}: the output of {command!r} is not audio libsndfile can read "
                        f"({len(out)} bytes, starting {out[:12]!r}): {error}") from None
    if not len(samples):
        raise DataError(f"{where}: the output of {command!r} holds no samples")
    return samples, rate


# ---------------------------------------------------------------------------------------------------------------
# Archives: scp, binary ark, text ark


def _entries(path: str | Path, dtype: type) -> Iterator[tuple[str, str, object]]:
    """(key, where, value) for each entry of an archive; ``dtype`` is what text values are parsed as. A key that
    repeats and an archive without entries are DataErrors."""
    path = Path(path)
    seen: dict[str, str] = {}
    for key, where, value in _raw_entries(path, dtype):
        if key in seen:
            first = f" (first at {seen[key]})" if seen[key] != where else ""  # binary arks have no lines to name
            raise DataError(f"{where}: duplicate key{first}")
        seen[key] = where
        yield key, where, value
    if not seen:
        raise DataError(f"{path}: no entries")


def _raw_entries(path: Path, dtype: type) -> Iterator[tuple[str, str, object]]:
    if path.suffix == ".scp":
        for key, (rxspec, where) in _read_scp(path).items():
            yield key, where, _load(rxspec, where)
        return
    with _open_archive(path) as fd:
        if _is_binary_ark(fd):
            for key, where, _, value in _kaldiio_ark_entries(fd, path):
                yield key, where, value
        else:
            yield from _text_ark_entries(fd, path, dtype)


def _read_scp(path: Path) -> dict[str, tuple[str, str]]:
    """An scp file -> {key: (rxspecifier, where)} in file order."""
    try:
        table = read_table(path)  # also rejects repeated keys, naming both lines
    except OSError as err:
        raise DataError(f"{path}: cannot read: {err.strerror}") from None
    index = {}
    for key, (rxspec, lineno) in table.items():
        where = f"{path}:{lineno}: {key}"
        if not rxspec:
            raise DataError(f"{where}: no archive position (expected 'key file.ark:offset')")
        index[key] = (rxspec, where)
    if not index:
        raise DataError(f"{path}: no entries")
    return index


def _load(rxspec: str, where: str) -> object:
    """One scp entry (``file.ark:offset``, maybe a pipe or a range) read by kaldiio."""
    try:
        return kaldiio.load_mat(rxspec)
    except Exception as err:  # kaldiio raises OSError, AssertionError, ValueError, struct.error... on bad arks
        raise DataError(f"{where}: cannot read {rxspec}: {_reason(err)}") from None


def _index_ark(path: Path) -> dict[str, tuple[str, str]]:
    """A plain ark -> {key: ('path:offset', where)}, read through once so entries can be loaded one by one."""
    index: dict[str, tuple[str, str]] = {}
    try:
        fd = open(path, "rb")
    except OSError as err:
        raise DataError(f"{path}: cannot open: {err.strerror}") from None
    with fd:
        for key, where, offset, _ in _kaldiio_ark_entries(fd, path):
            if key in index:
                raise DataError(f"{where}: duplicate key")
            index[key] = (f"{path}:{offset}", where)
    if not index:
        raise DataError(f"{path}: no entries")
    return index


def _open_archive(path: Path) -> BinaryIO:
    """The archive as a seekable binary file; a gzipped one is decompressed into memory, because kaldiio seeks
    backwards and gzip emulates that by decompressing again from the start."""
    try:
        fd = open(path, "rb")
    except OSError as err:
        raise DataError(f"{path}: cannot open: {err.strerror}") from None
    if fd.peek(2)[:2] != b"\x1f\x8b":
        return fd
    with fd:
        try:
            return io.BytesIO(gzip.decompress(fd.read()))
        except (OSError, EOFError, zlib.error) as err:
            raise DataError(f"{path}: corrupt gzip file: {_reason(err)}") from None


def _is_binary_ark(fd: BinaryIO) -> bool:
    """True if the first key is followed by Kaldi's binary marker ``\\0B``."""
    head = fd.read(4096)
    fd.seek(0)
    end = head.find(b" ")
    return end > 0 and head[end + 1:end + 3] == b"\0B"


def _kaldiio_ark_entries(fd: BinaryIO, path: Path) -> Iterator[tuple[str, str, int, object]]:
    """(key, where, offset of the value, value) for each entry of an ark, parsed by kaldiio."""
    while True:
        try:
            key = kaldiio.matio.read_token(fd)
        except UnicodeDecodeError:
            raise DataError(f"{path}: corrupt archive: a key at byte {fd.tell()} is not UTF-8") from None
        if key is None:
            return
        offset, where = fd.tell(), f"{path}: {key}"
        try:
            value = kaldiio.matio.read_kaldi(fd)
        except Exception as err:  # a truncated or foreign entry fails in many ways inside kaldiio
            raise DataError(f"{where}: corrupt entry at byte {offset}: {_reason(err)}") from None
        yield key, where, offset, value


def _text_ark_entries(fd: BinaryIO, path: Path, dtype: type) -> Iterator[tuple[str, str, np.ndarray]]:
    """(key, where, array) for each entry of a text ark: ``key 1 2 3`` (Kaldi's text integer vectors),
    ``key [ 1 2 3 ]`` (a vector) or ``key [`` followed by matrix rows, one a line, the last ending in ``]``."""
    lines = _text_lines(fd, path)
    for lineno, line in lines:
        if not line.strip():
            continue
        key, *rest = line.split(maxsplit=1)
        where = f"{path}:{lineno}: {key}"
        tokens = _tokens(rest[0] if rest else "")
        if tokens[:1] != ["["]:
            yield key, where, _parse_rows(path, key, [(lineno, tokens)], dtype)[0]
            continue
        rows = [(lineno, tokens[1:])]
        while rows[-1][1][-1:] != ["]"]:
            lineno, line = next(lines, (lineno, None))
            if line is None:
                raise DataError(f"{where}: no closing ']' before the end of the file")
            rows.append((lineno, _tokens(line)))
        rows[-1][1].pop()
        if len(rows) == 1:  # opened and closed on the key line: a vector
            yield key, where, _parse_rows(path, key, rows, dtype)[0]
        else:
            yield key, where, _parse_rows(path, key, [row for row in rows if row[1]], dtype)


def _text_lines(fd: BinaryIO, path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) for each line; decoded one by one so that bad bytes are reported on their line."""
    for lineno, raw in enumerate(fd, 1):
        try:
            yield lineno, raw.decode("utf-8")
        except UnicodeDecodeError:
            raise DataError(f"{path}:{lineno}: not UTF-8 text (binary data in a text archive?)") from None


def _tokens(text: str) -> list[str]:
    """Whitespace-separated values, with brackets as tokens of their own even where Kaldi writes ``1.5]``."""
    return text.replace("[", " [ ").replace("]", " ] ").split()


def _parse_rows(path: Path, key: str, rows: list[tuple[int, list[str]]], dtype: type) -> np.ndarray:
    """Rows of text values (with their line numbers) -> a 2-D array of ``dtype``; a bad value names its line."""
    parsed = []
    for lineno, tokens in rows:
        try:
            parsed.append(np.array(tokens, dtype=dtype))
        except (ValueError, OverflowError):
            bad = next(token for token in tokens if not _parses(token, dtype))
            kind = "an integer" if dtype is np.int64 else "a number"
            raise DataError(f"{path}:{lineno}: {key}: {bad!r} is not {kind}") from None
        if len(parsed[-1]) != len(parsed[0]):
            raise DataError(f"{path}:{lineno}: {key}: a matrix row of {len(parsed[-1])} values, "
                            f"the first row has {len(parsed[0])}")
    return np.stack(parsed) if parsed else np.zeros((0, 0), dtype=dtype)


def _parses(token: str, dtype: type) -> bool:
    try:
        np.array([token], dtype=dtype)
        return True
    except (ValueError, OverflowError):
        return False


def _binary_matrix_rows(head: bytes) -> int | None:
    """Rows of the binary Kaldi matrix whose header starts ``head``; None if it is no such matrix."""
    if head[:2] != b"\0B":
        return None
    kind, _, rest = head[2:].partition(b" ")
    if kind in (b"FM", b"DM") and rest[:1] == b"\4" and len(rest) >= 5:  # \4, int32 rows, \4, int32 cols
        return struct.unpack("<i", rest[1:5])[0]
    if kind in (b"CM", b"CM2", b"CM3") and len(rest) >= 12:  # float32 min, float32 range, int32 rows, ...
        return struct.unpack("<i", rest[8:12])[0]
    return None


# ---------------------------------------------------------------------------------------------------------------
# Small checks and helpers


def _is_array(value: object, ndim: int, kinds: str) -> bool:
    """``value`` is a numpy array of ``ndim`` dimensions whose dtype kind is one of ``kinds`` (e.g. "iu")."""
    return isinstance(value, np.ndarray) and value.ndim == ndim and value.dtype.kind in kinds


def _describe(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype} array of shape {value.shape}"
    return f"a {type(value).__name__}"  # kaldiio returns (rate, samples) tuples for audio entries


def _check_finite(where: str, array: np.ndarray) -> None:
    bad = np.flatnonzero(~np.isfinite(array))
    if bad.size:
        index = np.unravel_index(bad[0], array.shape)
        raise DataError(f"{where}: {bad.size} non-finite values, the first {array[index]} at index "
                        f"{tuple(int(i) for i in index) if array.ndim > 1 else int(index[0])}")


def _check_dim(where: str, dim: int, first: tuple[str, int]) -> None:
    if dim != first[1]:
        raise DataError(f"{where}: dimension {dim}, but the first entry ({first[0]}) has dimension {first[1]}")


def _reason(err: BaseException) -> str:
    return str(err) or type(err).__name__  # kaldiio's failed asserts have no message


def _stderr_tail(stderr: bytes, lines: int = 5) -> str:
    tail = stderr.decode(errors="replace").strip().splitlines()[-lines:]
    return "; its stderr ends:\n  " + "\n  ".join(tail) if tail else " (nothing on stderr)"


def _fix_wav_sizes(data: bytes) -> bytes:
    """Set the RIFF and data chunk sizes of a piped WAV from the bytes actually there.

    A writer on a pipe cannot seek back to fill in the sizes, so sox and others may leave 0 (or 0xFFFFFFFF).
    libsndfile reads a data size of 0 as "no samples", silently; a size beyond the end it reads to the end.
    Anything that is not a RIFF/WAVE stream (flac, ...) is returned as it is.
    """
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return data
    pos = 12
    while pos + 8 <= len(data):
        chunk, size = data[pos:pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        if chunk == b"data":
            there = len(data) - pos - 8
            if 0 < size <= there:  # a true size; chunks may follow the samples
                return data
            fixed = bytearray(data)
            struct.pack_into("<I", fixed, 4, min(len(data) - 8, 0xFFFFFFFF))
            struct.pack_into("<I", fixed, pos + 4, min(there, 0xFFFFFFFF))
            return bytes(fixed)
        pos += 8 + size + (size & 1)  # chunks are padded to an even size
    return data
