"""A learner's supervisor, so that the deepspeed launcher lets ADPSGD go on without a lost learner.

The launcher stops every learner as soon as one exits non-zero (deepspeed/launcher/launch.py), which would
undo comm.on_lost_learner = "continue". So `python -m recipe.train`, started by the launcher, runs the learner
as a child of this small process (it imports no torch) and waits for it. When the learner is killed by a signal
the supervisor did not send (SIGKILL, the OOM killer, a segfault), the supervisor says so; if the learner had
declared that its run goes on without lost learners (declare_goes_on), it exits 0: the launcher leaves the
others alone, and they drop the lost learner (comm/health.py). Otherwise it exits 128 + the signal, as a shell
would, and the launcher stops the run, which the elastic agent (recipe/elastic.py) starts again. Every other
ending passes through unchanged. SIGTERM/SIGINT from the launcher are passed on to the learner, with a SIGCONT:
a frozen (SIGSTOPped) learner would otherwise hold its signal, and the launcher would wait 30 s to kill it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD_ENV = "RECIPE_SUPERVISED_NOTE"  # set in the learner: where it declares that the run goes on without it


def launched() -> bool:
    """Started by the deepspeed launcher (it sets LOCAL_RANK); not by hand, a test, or run.sh's --check."""
    return "LOCAL_RANK" in os.environ and "--check" not in sys.argv


def supervise(command: list[str]) -> int:
    """Run `command` as the supervised learner; -> the exit status for the launcher."""
    forwarded: list[int] = []
    with tempfile.TemporaryDirectory(prefix="learner-") as tmp:
        note = Path(tmp) / "goes-on"
        child = subprocess.Popen(command, env={**os.environ, CHILD_ENV: str(note)})

        def forward(signum, _frame):
            forwarded.append(signum)
            child.send_signal(signum)
            child.send_signal(signal.SIGCONT)

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, forward)
        code = child.wait()
        if code >= 0:
            return code
        if forwarded:
            return 128 - code  # as a shell reports a learner killed by a signal
        said = f"learner {os.environ.get('RANK', '?')} (pid {child.pid}) was killed by {signal.Signals(-code).name}"
        if note.exists():
            print(f"{said}; the others go on without it (comm.on_lost_learner=continue)", file=sys.stderr, flush=True)
            return 0
        print(f"{said}; the run stops", file=sys.stderr, flush=True)
        return 128 - code


def is_supervised() -> bool:
    return CHILD_ENV in os.environ


def declare_goes_on() -> None:
    """Called by the learner once its strategy is known to go on without lost learners."""
    if is_supervised():
        Path(os.environ[CHILD_ENV]).touch()
