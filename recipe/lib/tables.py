"""Kaldi text tables (`key rest-of-line`) and rxfilenames, and the error every input check raises.

The lowest layer of the data library: kaldi_io.py (archives, pipes) and datadir.py (data dirs) build on it.
"""

from __future__ import annotations

import re
from pathlib import Path

# Kaldi's whitespace (its text utilities split on these): ASCII only, so a no-break or ideographic space inside a
# transcript stays part of its word, as it does for Kaldi, and never ends a key or a line.
KALDI_WHITESPACE = " \t\n\r\f\v"
_WHITESPACE_RUN = re.compile(f"[{KALDI_WHITESPACE}]+")


class DataError(ValueError):
    """Input data that cannot be used; the message names the file, line and utterance."""


def absolute_rxfilename(entry: str) -> tuple[Path, str]:
    """A Kaldi rxfilename, `archive.ark:offset` or a plain file, relative to the working directory -> (absolute
    archive path, ':offset' or ''), so that a scp entry still points at its archive from the experiment folder."""
    path, colon, offset = entry.rpartition(":")
    return Path(path if colon else entry).resolve(), colon + offset


def split_on_first_space(line: str) -> tuple[str, str]:
    """Kaldi's SplitStringOnFirstSpace, as kaldiio reads scp files too: the key ends at the first run of
    whitespace, spaces and tabs alike, and the rest is stripped -> (key, rest)."""
    parts = _WHITESPACE_RUN.split(line.strip(KALDI_WHITESPACE), maxsplit=1)
    return parts[0], parts[1] if len(parts) > 1 else ""


def read_table(path: Path) -> dict[str, tuple[str, int]]:
    """``key rest-of-line`` per line -> {key: (rest, line number)}; duplicate keys are errors. A line ends at a
    newline only (a carriage return before it is whitespace): no other character starts a line for Kaldi."""
    table: dict[str, tuple[str, int]] = {}
    try:
        lines = path.read_bytes().decode("utf-8").split("\n")  # read_text would also end lines at a lone "\r"
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip(KALDI_WHITESPACE):
            continue
        key, rest = split_on_first_space(line)
        if key in table:
            raise DataError(f"{path}:{lineno}: duplicate id {key!r} (first on line {table[key][1]})")
        table[key] = (rest, lineno)
    return table
