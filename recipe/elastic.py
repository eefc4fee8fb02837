"""Stage 3's elastic agent: the deepspeed launcher starts the learners, and this starts them again from the last
checkpoint when a learner is lost, as torchrun's elastic agent does (`--max-restarts`).

    python -m recipe.elastic --exp EXP --ds-config FILE [--learners N | --hostfile FILE [--node-rank K
        --master-addr HOST]] [--nodes M] [--master-port P] [--resume] [--conf FILE] [key=value ...]

run.sh's stage 3 runs this. A learner that is killed (SIGKILL, the OOM killer, its machine gone) or frozen past
comm.lost_after_s stops the run: its supervisor exits 128 + the signal, the others exit RESTART_EXIT once their
collective fails or their heartbeat finds it still (comm/health.py), and the launcher stops everyone. Any other
failure (exit 1: a bug, a bad file, a diverged model) would fail the same way again and ends the stage. Where
the learners say a learner was lost, the agent launches them all again with --resume, up to train.max_restarts
times: on a machine that is still there the launcher provides a replacement for the lost learner, so the world
size, the global batch and the learning rate stay as configured, and only the epoch that was running is trained
again. ADPSGD and HYBRID (comm.on_lost_learner=continue) do not stop for a lost learner and never restart.

Each restart is said on the terminal and recorded in EXP/metrics.json ("restarts": who was lost, the exit status,
the checkpoint resumed from, the seconds from the loss to training again). A run that loses learners more than
train.max_restarts times ends naming them and the checkpoint to resume from.

Not done: going on with fewer learners when the launcher cannot replace one (a host of a hostfile that is gone:
leave it out of the hostfile and run.sh --resume), and coordinating the restarts of several launchers (--node-rank:
each node's agent restarts its own launcher; they meet again at the rendezvous as long as every node restarts).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from comm.faults import ATTEMPT_ENV
from comm.health import RESTART_EXIT
from recipe.lib.config import load_config
from recipe.lib.experiment import Experiment

LOST = re.compile(r"LearnerLost: lost learner\(s\) \[([\d, ]*)\] of \d+")
KILLED = re.compile(r"learner (\d+) \(pid \d+\) was killed by (\w+); the run stops")
RESUMED = re.compile(r"resumed from (\S+) \(epoch (\d+)\)")
TRAINING = re.compile(r"\] INFO strategy=")  # Trainer.log_start: the first step is next


@dataclass
class Attempt:
    """One launch of the learners, as its output told it."""

    number: int
    started_at: float
    lost: list[int] = field(default_factory=list)
    lost_at: float | None = None  # when the output first said a learner was lost
    killed_by: str | None = None
    training_at: float | None = None  # when training started (after the resume)
    resumed_from: str | None = None

    def read(self, line: str) -> None:
        now = time.time()
        if (m := LOST.search(line)) or (m := KILLED.search(line)):
            self.lost = sorted(set(self.lost) | {int(r) for r in m[1].split(",") if r.strip()})
            self.lost_at = self.lost_at or now
            if m.re is KILLED:
                self.killed_by = m[2]
        elif m := RESUMED.search(line):
            self.resumed_from = m[1]
        elif TRAINING.search(line) and self.training_at is None:
            self.training_at = now


def launch_command(args, attempt: int) -> list[str]:
    """The deepspeed launcher's command, as run.sh built it before (--resume from the first restart on)."""
    launch = [str(Path(sys.executable).parent / "deepspeed"), "--master_port", str(args.master_port)]
    launch += ["--hostfile", args.hostfile] if args.hostfile else ["--num_gpus", str(args.learners)]
    if args.node_rank is not None:
        launch += ["--no_ssh", "--node_rank", str(args.node_rank), "--master_addr", args.master_addr]
    train = ["--module", "recipe.train", "--exp", args.exp, "--ds-config", args.ds_config, "--nodes", str(args.nodes)]
    train += (["--conf", args.conf] if args.conf else []) + args.overrides
    if args.resume or attempt > 0:
        train.append("--resume")
    return [*launch, *train, "--launch-command", shlex.join([*launch, *train])]


def restartable(code: int) -> bool:
    """A launcher's exit status that says a learner was lost: another one's RESTART_EXIT, or a learner (or its
    supervisor) killed by a signal (128 + the signal; the launcher reports a killed supervisor as 256 - signal)."""
    return code == RESTART_EXIT or code >= 128


class Agent:
    def __init__(self, args):
        self.args = args
        self.exp = Path(args.exp)
        self.max_restarts = load_config(args.conf, args.overrides).train.max_restarts
        self.attempts: list[Attempt] = []
        self.process: subprocess.Popen | None = None  # the launcher of the attempt running
        self.stopping = False  # SIGINT/SIGTERM from the user: passed on, never restarted

    def run(self) -> int:
        before = {signum: signal.signal(signum, self._stop) for signum in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._attempts()
        finally:
            for signum, handler in before.items():
                signal.signal(signum, handler)

    def _attempts(self) -> int:
        """Launch, and launch again while learners are lost and restarts are left -> the last exit status."""
        while True:
            attempt = Attempt(len(self.attempts), time.time())
            self.attempts.append(attempt)
            code = self.launch(attempt)
            if code == 0:
                self.record_restarts()
                return 0
            if self.stopping or not restartable(code):
                return code
            if attempt.number >= self.max_restarts:
                self.say(f"learner(s) {self.lost_so_far()} lost {attempt.number + 1} time(s), more than "
                         f"train.max_restarts={self.max_restarts}; the run stops. Its last checkpoint: "
                         f"{self.last_checkpoint() or 'none yet'}; go on from it with ./run.sh --stage 3 --resume "
                         "(and the same options)")
                return code
            self.say(f"learner(s) {attempt.lost or '?'} lost (exit status {code}); restart {attempt.number + 1} of "
                     f"at most {self.max_restarts}, from {self.last_checkpoint() or 'the start (no checkpoint yet)'}")

    def launch(self, attempt: Attempt) -> int:
        """Run the launcher, its output passed through as it comes and read line by line -> its exit status."""
        env = {**os.environ, ATTEMPT_ENV: str(attempt.number)}
        self.process = subprocess.Popen(launch_command(self.args, attempt.number), env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT)
        pending = b""
        while chunk := os.read(self.process.stdout.fileno(), 65536):
            sys.stdout.buffer.write(chunk)  # progress bars redraw with \r: passed on at once, not by the line
            sys.stdout.buffer.flush()
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                attempt.read(line.decode(errors="replace"))
        return self.process.wait()

    def _stop(self, signum, _frame) -> None:
        self.stopping = True
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)

    def last_checkpoint(self) -> str | None:
        found = Experiment(self.exp).checkpoints()  # complete ones only, as --resume takes them
        return str(found[-1]) if found else None

    def lost_so_far(self) -> list[int]:
        return sorted({r for a in self.attempts for r in a.lost})

    def restarts(self) -> list[dict]:
        """What metrics.json says of each restart: why the attempt before it ended, and how soon it trained again."""
        out = []
        for before, after in zip(self.attempts, self.attempts[1:]):
            lost_at = before.lost_at or after.started_at
            out.append({"restart": after.number, "lost_learners": before.lost, "killed_by": before.killed_by,
                        "resumed_from": after.resumed_from,
                        "seconds_to_training": None if after.training_at is None else after.training_at - lost_at})
        return out

    def record_restarts(self) -> None:
        metrics = self.exp / "metrics.json"
        if metrics.exists():  # learner 0's node only (--node-rank: the others have none)
            metrics.write_text(json.dumps({**json.loads(metrics.read_text()), "restarts": self.restarts()}, indent=1))

    def say(self, text: str) -> None:
        print(f"elastic: {text}", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--exp", required=True)
    p.add_argument("--ds-config", required=True)
    p.add_argument("--conf", default=None)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--learners", type=int, default=1, help="learners on this machine (no hostfile)")
    p.add_argument("--hostfile", default=None)
    p.add_argument("--node-rank", type=int, default=None)
    p.add_argument("--master-addr", default=None)
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--resume", action="store_true", help="the first launch too continues from the last checkpoint")
    p.add_argument("overrides", nargs="*", help="key=value settings over the YAML")
    return p.parse_intermixed_args(argv)


if __name__ == "__main__":
    sys.exit(Agent(parse_args()).run())
