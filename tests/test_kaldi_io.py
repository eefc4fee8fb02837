"""Kaldi's files in and out: every format a reader accepts round-trips, and every bad input is a DataError that
names the file, the utterance and (for text) the line. Binary fixtures are written with kaldiio, text ones by
hand as Kaldi writes them."""

from __future__ import annotations

import gzip
import io
import shlex
import struct
import sys
import time

import kaldiio
import numpy as np
import pytest
import soundfile

from recipe.lib.kaldi_io import (
    FeatsScp,
    pipe_command,
    read_alignments,
    read_cmvn_stats,
    read_pipe_audio,
    read_vectors,
    write_matrices,
)
from recipe.lib.tables import DataError

ALIGNMENTS = {"utt-b": np.array([12, 12, 12, 40, 40, 7], dtype=np.int32), "utt-a": np.array([0, 3], dtype=np.int32)}


def write_ark(tmp_path, items: dict, name: str, text: bool = False, **kwargs) -> tuple:
    """items written with kaldiio -> (ark path, scp path)."""
    ark, scp = tmp_path / f"{name}.ark", tmp_path / f"{name}.scp"
    with kaldiio.WriteHelper(f"ark{',t' if text else ''},scp:{ark},{scp}", **kwargs) as writer:
        for key, array in items.items():
            writer(key, array)
    return ark, scp


def assert_same(got: dict, want: dict, dtype) -> None:
    assert list(got) == list(want)
    for key in want:
        assert got[key].dtype == dtype
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6)


# ----- alignments


def alignment_file(tmp_path, form: str):
    if form in ("text", "gz"):
        text = "".join(f"{utt} {' '.join(map(str, ali))}\n" for utt, ali in ALIGNMENTS.items())
        if form == "text":
            (tmp_path / "pdf.txt").write_text(text)
            return tmp_path / "pdf.txt"
        (tmp_path / "pdf.1.gz").write_bytes(gzip.compress(text.encode()))
        return tmp_path / "pdf.1.gz"
    ark, scp = write_ark(tmp_path, ALIGNMENTS, "ali", text=form == "kaldiio-text")
    if form == "binary-gz":  # as Kaldi writes ali.N.gz (of transition ids, but the format is the same)
        (tmp_path / "ali.1.gz").write_bytes(gzip.compress(ark.read_bytes()))
        return tmp_path / "ali.1.gz"
    return scp if form == "scp" else ark


@pytest.mark.parametrize("form", ["text", "gz", "kaldiio-text", "binary", "binary-gz", "scp"])
def test_alignments_round_trip(tmp_path, form):
    assert_same(read_alignments(alignment_file(tmp_path, form)), ALIGNMENTS, np.int32)


@pytest.mark.parametrize("line, message", [("u2 3 4.5 6", "'4.5' is not an integer"),
                                           ("u2 3 x 6", "'x' is not an integer"),
                                           ("u2 3 -4 6", "negative pdf id -4 at frame 1"),
                                           ("u2", "empty alignment"),
                                           ("u1 5 5", "duplicate key")])
def test_bad_text_alignments_name_file_line_and_utterance(tmp_path, line, message):
    path = tmp_path / "pdf.txt"
    path.write_text(f"u1 1 2 3\n\n{line}\n")
    with pytest.raises(DataError, match=rf"pdf\.txt:3: u[12]: .*{message}"):
        read_alignments(path)


def test_bad_binary_alignments_name_file_and_utterance(tmp_path):
    ark, _ = write_ark(tmp_path, {"u1": np.array([1, -2], dtype=np.int32)}, "neg")
    with pytest.raises(DataError, match=r"neg\.ark: u1: negative pdf id -2"):
        read_alignments(ark)
    ark, _ = write_ark(tmp_path, {"u1": np.ones((2, 3), dtype=np.float32)}, "feats")
    with pytest.raises(DataError, match=r"feats\.ark: u1: not an integer vector"):
        read_alignments(ark)
    ark, _ = write_ark(tmp_path, ALIGNMENTS, "cut")
    ark.write_bytes(ark.read_bytes()[:-3])
    with pytest.raises(DataError, match=r"cut\.ark: utt-a: corrupt entry"):
        read_alignments(ark)


def test_an_scp_entry_that_cannot_be_read_names_the_scp_line(tmp_path):
    ark, scp = write_ark(tmp_path, ALIGNMENTS, "ali")
    ark.unlink()
    with pytest.raises(DataError, match=r"ali\.scp:1: utt-b: cannot read .*ali\.ark"):
        read_alignments(scp)


def test_binary_bytes_in_a_text_archive_name_the_line(tmp_path):
    (tmp_path / "pdf.txt").write_bytes(b"u1 1 2\nu2 \xff\xfe 4\n")
    with pytest.raises(DataError, match=r"pdf\.txt:2: not UTF-8 text"):
        read_alignments(tmp_path / "pdf.txt")


def test_empty_and_missing_archives_are_data_errors(tmp_path):
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(DataError, match="empty.txt: no entries"):
        read_alignments(tmp_path / "empty.txt")
    with pytest.raises(DataError, match="missing.txt: cannot open"):
        read_alignments(tmp_path / "missing.txt")


# ----- vectors


VECTORS = {"spk1": np.array([0.1, -0.2, 0.3], dtype=np.float32), "spk2": np.array([1.5, 2, -3e-4], dtype=np.float32)}


@pytest.mark.parametrize("form", ["scp", "binary", "kaldiio-text", "text", "one-row-matrix", "text-one-row"])
def test_vectors_round_trip(tmp_path, form):
    if form == "text":
        path = tmp_path / "ivectors.txt"
        path.write_text("".join(f"{k}  [ {' '.join(map(repr, map(float, v)))} ]\n" for k, v in VECTORS.items()))
    elif form == "text-one-row":  # Kaldi's text form of a 1 x D matrix
        path = tmp_path / "ivectors.txt"
        path.write_text("".join(f"{k}  [\n  {' '.join(map(repr, map(float, v)))} ]\n" for k, v in VECTORS.items()))
    elif form == "one-row-matrix":
        path, _ = write_ark(tmp_path, {k: v[None] for k, v in VECTORS.items()}, "ivectors")
    else:
        ark, scp = write_ark(tmp_path, VECTORS, "ivectors_utt", text=form == "kaldiio-text")
        path = scp if form == "scp" else ark
    assert_same(read_vectors(path), VECTORS, np.float32)


def test_online_ivectors_are_refused_with_advice(tmp_path):
    _, scp = write_ark(tmp_path, {"u1": np.zeros((7, 3), dtype=np.float32)}, "ivector_online")
    with pytest.raises(DataError, match=r"ivector_online\.scp:1: u1: a 7 x 3 matrix.*ivectors_utt\.scp / "
                                        r"ivectors_spk\.scp"):
        read_vectors(scp)


def test_vectors_must_share_a_dimension(tmp_path):
    path = tmp_path / "ivectors.txt"
    path.write_text("a [ 1 2 3 ]\nb [ 1 2 3 ]\nc [ 1 2 ]\nd [ 1 ]\n")
    with pytest.raises(DataError, match=r"ivectors\.txt:3: c: dimension 2, but the first entry \(a\) has "
                                        r"dimension 3"):
        read_vectors(path)


@pytest.mark.parametrize("text, message", [("a [ 1 nan 3 ]\n", r":1: a: 1 non-finite values, the first nan at index 1"),
                                           ("a [ 1 2\n", r":1: a: no closing"),
                                           ("a [\n 1 2\n 3 ]\n", r":3: a: a matrix row of 1 values"),
                                           ("a [ 1 two ]\n", r":1: a: 'two' is not a number"),
                                           ("a [ ]\n", r":1: a: empty vector")])
def test_bad_text_vectors(tmp_path, text, message):
    path = tmp_path / "ivectors.txt"
    path.write_text(text)
    with pytest.raises(DataError, match=r"ivectors\.txt" + message):
        read_vectors(path)


# ----- features


def test_feats_scp_reads_lazily_in_file_order(tmp_path):
    rng = np.random.default_rng(0)
    feats = {utt: rng.standard_normal((n, 5)).astype(np.float32) for utt, n in [("z", 7), ("a", 3), ("m", 11)]}
    ark, scp = write_ark(tmp_path, feats, "raw_mfcc")
    for source in (scp, ark):
        table = FeatsScp(source)
        assert list(table) == ["z", "a", "m"] and len(table) == 3 and "a" in table and "q" not in table
        for utt, want in feats.items():
            np.testing.assert_array_equal(table[utt], want)
            assert table.num_frames(utt) == len(want)


@pytest.mark.parametrize("kind", ["compressed", "float64", "text"])
def test_feature_frame_counts_of_other_matrix_forms(tmp_path, kind):
    feats = {"u1": np.linspace(0, 1, 40, dtype=np.float32).reshape(8, 5)}
    if kind == "float64":
        feats = {"u1": feats["u1"].astype(np.float64)}
    _, scp = write_ark(tmp_path, feats, "feats", text=kind == "text", compression_method=2 if kind == "compressed"
                       else None)
    table = FeatsScp(scp)
    assert table.num_frames("u1") == 8
    assert table["u1"].dtype == np.float32 and table["u1"].shape == (8, 5)


def test_an_unreadable_feature_entry_names_the_scp_line(tmp_path):
    ark, scp = write_ark(tmp_path, {"u1": np.ones((4, 2), np.float32), "u2": np.ones((4, 2), np.float32)}, "f")
    ark.write_bytes(ark.read_bytes()[:-8])
    table = FeatsScp(scp)  # lazy: nothing read yet
    np.testing.assert_array_equal(table["u1"], np.ones((4, 2)))
    with pytest.raises(DataError, match=r"f\.scp:2: u2: cannot read"):
        table["u2"]
    ark.unlink()
    with pytest.raises(DataError, match=r"f\.scp:1: u1: cannot read .*No such file"):
        table["u1"]
    with pytest.raises(DataError, match=r"f\.scp:1: u1: cannot read"):
        table.num_frames("u1")


def test_a_duplicate_feature_entry_names_both_lines(tmp_path):
    (tmp_path / "feats.scp").write_text("u1 a.ark:5\nu2 a.ark:50\nu1 a.ark:90\n")
    with pytest.raises(DataError, match=r"feats\.scp:3: duplicate id 'u1' \(first on line 1\)"):
        FeatsScp(tmp_path / "feats.scp")


# ----- CMVN stats


def test_cmvn_stats_round_trip(tmp_path):
    feats = np.random.default_rng(1).standard_normal((50, 4))
    stats = np.zeros((2, 5))
    stats[0, :4], stats[0, 4], stats[1, :4] = feats.sum(0), len(feats), (feats ** 2).sum(0)
    _, scp = write_ark(tmp_path, {"spk1": stats}, "cmvn")
    count, total, squares = read_cmvn_stats(scp)["spk1"]
    assert count == 50.0 and total.dtype == squares.dtype == np.float64
    np.testing.assert_allclose(total / count, feats.mean(0))
    np.testing.assert_allclose(squares / count - (total / count) ** 2, feats.var(0))


@pytest.mark.parametrize("stats, message", [(np.zeros((3, 5)), "must be a 2 x \\(dim\\+1\\) matrix"),
                                            (np.zeros(5), "must be a 2 x \\(dim\\+1\\) matrix"),
                                            (np.zeros((2, 5)), "frame count 0")])
def test_bad_cmvn_stats(tmp_path, stats, message):
    _, scp = write_ark(tmp_path, {"spk9": stats}, "cmvn")
    with pytest.raises(DataError, match=rf"cmvn\.scp:1: spk9: .*{message}"):
        read_cmvn_stats(scp)


# ----- network outputs for Kaldi


def test_write_matrices_round_trip(tmp_path):
    rng = np.random.default_rng(2)
    outputs = [("u2", rng.standard_normal((6, 3))), ("u1", rng.standard_normal((2, 3)).astype(np.float32))]
    ark, scp = tmp_path / "loglikes.ark", tmp_path / "loglikes.scp"
    assert write_matrices(ark, scp, iter(outputs)) == 2
    assert ark.read_bytes().startswith(b"u2 \0BFM ")  # binary float32 matrices, as Kaldi's nnet-forward writes
    loaded = kaldiio.load_scp(str(scp))
    assert list(loaded) == ["u2", "u1"]
    for key, matrix in outputs:
        assert loaded[key].dtype == np.float32
        np.testing.assert_allclose(loaded[key], matrix, rtol=1e-6)


def test_write_matrices_leaves_nothing_behind_on_error(tmp_path):
    ark, scp = tmp_path / "loglikes.ark", tmp_path / "loglikes.scp"
    with pytest.raises(ValueError, match="written twice"):
        write_matrices(ark, scp, [("u1", np.zeros((2, 2))), ("u1", np.zeros((2, 2)))])
    assert not ark.exists() and not scp.exists()


# ----- audio from wav.scp pipes


SR = 8000
SAMPLES = (np.sin(np.arange(4000) / 5.0) * 0.5 * 32767).astype(np.int16)
WHERE = "data/train/wav.scp:12: sw02001-A"


def wav_header(data_size: int, riff_size: int, extra_chunk: bytes = b"") -> bytes:
    """A mono 16-bit PCM WAV header as a streaming writer leaves it, with the sizes it could not know."""
    fmt = struct.pack("<HHIIHH", 1, 1, SR, SR * 2, 2, 16)
    return (b"RIFF" + struct.pack("<I", riff_size) + b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
            + extra_chunk + b"data" + struct.pack("<I", data_size))


def test_pipe_command():
    assert pipe_command("sph2pipe -f wav -p -c 1 /x/sw02001.sph |") == "sph2pipe -f wav -p -c 1 /x/sw02001.sph"
    assert pipe_command("  sox x.flac -t wav - |  ") == "sox x.flac -t wav -"
    assert pipe_command("/x/a.wav") is None


@pytest.mark.parametrize("fmt", ["WAV", "FLAC"])
def test_a_pipe_that_cats_a_file(tmp_path, fmt):
    path = tmp_path / f"a.{fmt.lower()}"
    soundfile.write(path, np.stack([SAMPLES, SAMPLES // 2], 1), SR, format=fmt, subtype="PCM_16")
    samples, rate = read_pipe_audio(pipe_command(f"cat {path} |"), WHERE)
    assert rate == SR and samples.dtype == np.float32 and samples.shape == (len(SAMPLES), 2)
    np.testing.assert_allclose(samples[:, 0], SAMPLES / 32768.0)


@pytest.mark.parametrize("data_size, riff_size, extra_chunk", [(0, 0, b""), (0xFFFFFFFF, 0xFFFFFFFF, b""),
                                                               (0, 36, b"LIST\x04\x00\x00\x00abcd")])
def test_a_streamed_wav_header_without_sizes(tmp_path, data_size, riff_size, extra_chunk):
    stream = wav_header(data_size, riff_size, extra_chunk) + SAMPLES.tobytes()
    if data_size == 0:  # why the header is fixed up: libsndfile silently reads no samples at all
        assert len(soundfile.read(io.BytesIO(stream))[0]) == 0
    path = tmp_path / "stream.bin"
    path.write_bytes(stream)
    code = f"import sys; sys.stdout.buffer.write(open({str(path)!r}, 'rb').read())"
    samples, rate = read_pipe_audio(f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}", WHERE)
    assert rate == SR and samples.shape == (len(SAMPLES), 1)
    np.testing.assert_allclose(samples[:, 0], SAMPLES / 32768.0)


@pytest.mark.parametrize("entry, message", [
    ("false |", r"exited with status 1: false \(nothing on stderr\)"),
    ("sh -c 'echo one >&2; echo oops >&2; exit 3' |", r"exited with status 3: .*stderr ends:\n  one\n  oops"),
    ("true |", "wrote nothing to stdout"),
    ("echo garbage garbage garbage |", r"not audio libsndfile can read \(24 bytes, starting b'garbage garb'\)"),
    ("kill -9 $$ |", "was killed by signal 9"),
])
def test_failing_pipes(entry, message):
    with pytest.raises(DataError, match=rf"^{WHERE}: .*{message}"):
        read_pipe_audio(pipe_command(entry), WHERE)


def test_a_pipe_that_hangs_is_killed_with_its_children():
    start = time.monotonic()
    with pytest.raises(DataError, match=rf"^{WHERE}: command still running after 0.5 s, killed"):
        read_pipe_audio("sleep 30 | cat", WHERE, timeout=0.5)
    assert time.monotonic() - start < 10  # the orphaned `sleep` would keep the pipe open for 30 s
