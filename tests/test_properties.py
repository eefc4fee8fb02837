"""Property-based tests (hypothesis) over the readers of user input: random and malformed content either
loads or fails with the documented error (DataError / ConfigError naming the file and line), never another
exception."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import numpy as np
import soundfile
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recipe.lib.config import ConfigError, load_config
from recipe.lib.datadir import load_data_dir, read_tokens
from recipe.lib.tables import DataError

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

ids = st.sampled_from(["a", "b", "c", "utt-1", "a b", ""])
numbers = st.sampled_from(["0", "0.5", "-1", "1e9", "nan", "inf", "-0.0", "x", "0.25", "2"])
# lines that are almost right: the shapes real files get wrong
noise = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)


def table_line(values: st.SearchStrategy) -> st.SearchStrategy:
    return st.builds(lambda key, sep, rest: f"{key}{sep}{rest}", ids, st.sampled_from([" ", "\t", "  ", ""]),
                     values)


def scp_entries(audio: str, broken: str) -> st.SearchStrategy:
    # pipe commands are run by the shell: working and failing ones, never random text ending in "|"
    return st.sampled_from([audio, broken, "/no/such.wav", f"cat {audio} |", f"cat {broken} |", "exit 3 |", "",
                            "relative.wav"]) | noise.filter(lambda s: not s.rstrip().endswith("|"))


def file_content(lines: st.SearchStrategy) -> st.SearchStrategy:
    text = st.lists(lines, max_size=6).map("\n".join)
    return text.map(str.encode) | st.binary(max_size=40)  # sometimes not even UTF-8


@st.composite
def sound_data_dirs(draw, audio: str) -> dict[str, bytes | None]:
    """Well-formed dirs (random ids, transcripts, with or without utt2spk): without them the random files
    below almost never load, and the property would test the error path alone."""
    utts = draw(st.lists(st.sampled_from(["a", "b", "utt-1", "spk2-x"]), min_size=1, max_size=3, unique=True))
    words = st.text(alphabet="abc ", min_size=1, max_size=8).filter(str.strip)
    return {"wav.scp": "".join(f"{u} {audio}\n" for u in utts).encode(),
            "text": "".join(f"{u} {draw(words)}\n" for u in utts).encode(),
            "utt2spk": draw(st.none() | st.just("".join(f"{u} spk\n" for u in utts).encode())),
            "segments": None}


@st.composite
def data_dirs(draw, audio: str, broken: str) -> dict[str, bytes | None]:
    if draw(st.integers(0, 3)) == 0:
        return draw(sound_data_dirs(audio))
    return {
        "wav.scp": draw(file_content(table_line(scp_entries(audio, broken)))),
        "text": draw(file_content(table_line(noise))),
        "utt2spk": draw(st.none() | file_content(table_line(ids))),
        "segments": draw(st.none() | file_content(table_line(
            st.builds(lambda *f: " ".join(f), ids, numbers, numbers) | noise))),
    }


def load_drawn_data_dir(data) -> str:
    """Draw a data dir from data_dirs, write it and load it -> "loaded", or "error" (after checking that the
    DataError names the data dir, and the utterances loaded are sound)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        audio, broken = root / "one.wav", root / "broken.wav"
        soundfile.write(audio, np.zeros(1600, dtype=np.float32), 16000)
        broken.write_bytes(b"RIFF\x00\x00garbage")  # a truncated, corrupt file
        files = data.draw(data_dirs(str(audio), str(broken)))
        d = root / "data"
        d.mkdir()
        for name, content in files.items():
            if content is not None:
                (d / name).write_bytes(content)
        cwd = os.getcwd()
        os.chdir(root)  # a random line that happens to be a pipe command runs here, not in the repo
        try:
            utts, skipped = load_data_dir(d)
        except DataError as err:
            assert str(err).startswith(str(d)), err  # every message names the file (and line) it is about
            return "error"
        finally:
            os.chdir(cwd)
        assert utts and all(u.text and u.text == " ".join(u.text.split()) for u in utts)
        assert all(u.end is None or 0 <= u.start < u.end for u in utts)
        return "loaded"


@SETTINGS
@given(data=st.data())
def test_any_data_dir_loads_or_fails_with_a_data_error(data):
    load_drawn_data_dir(data)


@SETTINGS
@given(content=file_content(noise))
def test_any_tokens_file_reads_or_fails_with_a_data_error(content):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokens.txt"
        path.write_bytes(content)
        try:
            read_tokens(path)
        except DataError as err:
            message = str(err)
            assert message.startswith(f"{path}:"), message
            if "UTF-8" not in message:  # a fault on a line: its number follows the file name
                assert re.match(rf"{re.escape(str(path))}:\d+: ", message), message


SETTING = re.compile(r"\b(data|features|model|optim|train|decode)\.\w+")  # a setting's dotted key
keys = st.sampled_from(["model.hidden", "model.layers", "model.dropout", "optim.lr", "optim.name", "train.epochs",
                        "features.cmvn", "data.corpus", "model.nope", "train", "optim.batch_scaling", "x.y.z"])
values = st.sampled_from(["1", "0", "-3", "0.5", "1e-3", "adam", "sgd", "abc", "", "[1, 2]", "{a: 1}", "null",
                          "true", "nan"])


@SETTINGS
@given(overrides=st.lists(st.builds(lambda k, v: f"{k}={v}", keys, values) | noise, max_size=4),
       yaml=st.none() | noise | st.builds(lambda k, v: f"{k.split('.')[0]}:\n  {k.split('.')[-1]}: {v}\n",
                                           keys, values))
def test_any_config_loads_or_fails_with_a_config_error(overrides, yaml):
    with tempfile.TemporaryDirectory() as tmp:
        path = None
        if yaml is not None:
            path = Path(tmp) / "conf.yaml"
            path.write_text(yaml)
        try:
            cfg = load_config(path, overrides)
        except ConfigError as err:  # it names where the bad value came from: the file (and line), the
            message = str(err)      # command line, or the key it set
            sources = ([str(path)] if path else []) + ["command-line override"]
            assert any(source in message for source in sources) or SETTING.search(message), message
            return
        assert cfg.model.hidden >= 1 and 0 <= cfg.model.dropout < 1


def test_the_data_dir_strategy_reaches_both_outcomes():
    """The property above is only worth something if the dirs it draws both load and fail."""
    outcomes = set()

    @settings(max_examples=150, deadline=None)
    @given(data=st.data())
    def probe(data):
        outcomes.add(load_drawn_data_dir(data))

    probe()
    assert outcomes == {"loaded", "error"}