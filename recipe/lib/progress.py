"""Progress bars that reach the terminal while run.sh tees each stage's output into EXP/log/.

run.sh sets RECIPE_TTY=1 when its own stderr is a terminal; the bars then draw on /dev/tty directly, and the
log files get the plain log lines only. With no terminal (CI, nohup, tests) the bars are off.
"""

from __future__ import annotations

import os

from rich.console import Console
from rich.progress import Progress


def live_console() -> Console | None:
    if os.environ.get("RECIPE_TTY"):
        try:
            return Console(file=open("/dev/tty", "w"))  # noqa: SIM115 - lives as long as the process
        except OSError:
            return None
    console = Console(stderr=True)
    return console if console.is_terminal else None


def progress_bar(*columns, enabled: bool = True) -> Progress:
    console = live_console() if enabled else None
    return Progress(*columns, console=console or Console(quiet=True), disable=console is None, transient=True)
