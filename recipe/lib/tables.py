"""Kaldi text tables (`key rest-of-line`) and rxfilenames, and the error every input check raises.

The lowest layer of the data library: kaldi_io.py (archives, pipes) and datadir.py (data dirs) build on it.
"""

from __future__ import annotations

from pathlib import Path


class DataError(ValueError):
    """Input data that cannot be used; the message names the file, line and utterance."""


def absolute_rxfilename(entry: str) -> tuple[Path, str]:
    """A Kaldi rxfilename, `archive.ark:offset` or a plain file, relative to the working directory -> (absolute
    archive path, ':offset' or ''), so that a scp entry still points at its archive from the experiment folder."""
    path, colon, offset = entry.rpartition(":")
    return Path(path if colon else entry).resolve(), colon + offset


def read_table(path: Path) -> dict[str, tuple[str, int]]:
    """``key rest-of-line`` per line -> {key: (rest, line number)}; duplicate keys are errors."""
    table: dict[str, tuple[str, int]] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        key, _, rest = line.strip().partition(" ")
        if key in table:
            raise DataError(f"{path}:{lineno}: duplicate id {key!r} (first on line {table[key][1]})")
        table[key] = (rest.strip(), lineno)
    return table
