"""Faults injected into real multi-learner training runs: non-finite values and a learner that dies (the
ds config's comm.debug.die_at_step), under our own process starter and under the real deepspeed launcher."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, TINY, run_learners, run_recipe, train_log

pytestmark = pytest.mark.slow  # learner processes: not in the fast tier


def weights_digest(module) -> str:
    """A learner's weights, bit for bit: the replicas of SYNC, and the learners after a consensus, must agree
    (their dev scores are sums over all learners, the same whatever each holds)."""
    return hashlib.sha1(b"".join(p.detach().cpu().numpy().tobytes() for p in module.parameters())).hexdigest()


def faulty_learner(rank: int, world: int, argv: list[str], fault: dict):
    """Train with the recipe, learner fault["rank"] faulty -> the metrics, or the error text (a LearnerLost's
    ends with whether the run may restart). Its micro batches fault["nan_steps"] (counted over the whole run) have
    NaN features; at its micro batch fault["hang_at_step"] it freezes (SIGSTOP, as a learner on a stalled machine)
    until it is killed fault["frozen_s"] (15) s later; at fault["raise_at_step"] it fails with a ValueError of its
    own; after its micro batch fault["nan_weights_at_step"] its weights are NaN; in fault["idle_epochs"] it gets
    no batch. With fault["clock"] (a folder), the time it froze and the times the others failed are written there."""
    import recipe.train as recipe_train
    from comm.adpsgd import ADPSGDStrategy
    from comm.health import LearnerLost

    real_step, real_batches, steps = recipe_train.train_step, ADPSGDStrategy.batches, [0]
    here = rank == fault["rank"]

    def train_step(engine, strategy, batch):
        steps[0] += 1
        if here and steps[0] in fault.get("nan_steps", ()):
            batch = {**batch, "feats": torch.full_like(batch["feats"], float("nan"))}
        if here and steps[0] == fault.get("hang_at_step"):
            subprocess.Popen(["sh", "-c", f"sleep {fault.get('frozen_s', 15)}; kill -KILL {os.getpid()}"])
            if "clock" in fault:
                (Path(fault["clock"]) / "frozen").write_text(str(time.time()))
                (Path(fault["clock"]) / "frozen-pid").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        if here and steps[0] == fault.get("raise_at_step"):
            raise ValueError("utterance u-17 has no frames")
        out = real_step(engine, strategy, batch)
        if here and steps[0] == fault.get("nan_weights_at_step"):
            with torch.no_grad():
                next(engine.module.parameters()).fill_(float("nan"))
        return out

    def batches(strategy, sampler, epoch, accumulation):
        if here and epoch in fault.get("idle_epochs", ()):
            return iter(())
        return real_batches(strategy, sampler, epoch, accumulation)

    recipe_train.train_step = train_step
    ADPSGDStrategy.batches = batches
    try:
        trainer = recipe_train.Trainer(recipe_train.parse_args(argv))
        metrics = trainer.train()
        end_the_frozen_learner(fault)
        return {**metrics, "weights": weights_digest(trainer.engine.module)}
    except (RuntimeError, FloatingPointError) as err:
        if "clock" in fault:
            (Path(fault["clock"]) / f"failed-{rank}").write_text(str(time.time()))
        end_the_frozen_learner(fault)
        restart = f" (restartable={err.restartable})" if isinstance(err, LearnerLost) else ""
        return f"{type(err).__name__}: {err}{restart}"


def end_the_frozen_learner(fault: dict) -> None:
    """A survivor done with its run kills the frozen learner rather than wait for its kill at frozen_s: the test
    is then as long as the survivors take, and a broken wait (up to frozen_s) shows in their times."""
    frozen = Path(fault.get("clock", "/nonexistent")) / "frozen-pid"
    if frozen.exists():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(frozen.read_text()), signal.SIGKILL)


def prepare(tiny_exp, tmp_path, ds: str, die_at_step: dict | None = None, **comm):
    """-> (a copy of the tiny experiment, a ds config from ds_configs/ with learners to kill and these comm
    options)."""
    exp = tmp_path / "exp"
    shutil.copytree(tiny_exp, exp)
    config = json.loads((REPO / "ds_configs" / ds).read_text())
    config["comm"].update(debug={"die_at_step": die_at_step or {}}, **comm)
    (tmp_path / "ds.json").write_text(json.dumps(config))
    return exp, tmp_path / "ds.json"


def run(tiny_exp, tmp_path, world: int, fault: dict, *overrides: str, ds: str = "sync.json",
        die_at_step: dict | None = None, **comm):
    exp, ds_path = prepare(tiny_exp, tmp_path, ds, die_at_step, **comm)
    argv = ["--exp", str(exp), "--ds-config", str(ds_path), *TINY, "train.epochs=2", *overrides]
    return exp, run_learners(faulty_learner, world, argv, fault, timeout=300, allow_failures=True)


def test_sync_skips_non_finite_steps_alike_on_every_learner(tiny_exp, tmp_path):
    # 96 utterances / (8 x 2 learners) = 6 steps an epoch; learner 1's steps 2 and 3 of epoch 1 go NaN
    exp, (a, b) = run(tiny_exp, tmp_path, 2, {"rank": 1, "nan_steps": [2, 3]})
    assert isinstance(a, dict) and isinstance(b, dict), (a, b)
    log = train_log(exp)
    assert [r["skipped_steps"] for r in log] == [4, 0]  # 2 steps skipped, by both learners (the NaN is reduced)
    assert all(torch.isfinite(v).all() for v in torch.load(exp / "checkpoints" / "epoch-002.pt",
                                                           weights_only=True)["model"].values())
    assert log[1]["heldout_loss"] < log[0]["heldout_loss"] and a["weights"] == b["weights"]


def test_non_finite_steps_in_a_row_stop_the_run_with_the_checkpoint_named(tiny_exp, tmp_path):
    exp, out = run(tiny_exp, tmp_path, 2, {"rank": 0, "nan_steps": range(8, 20)}, "train.max_bad_steps=3")
    for text in out:  # both learners stop at the same step: the NaN gradients were reduced to both
        assert text.startswith("NonFiniteTraining: 3 optimizer steps in a row"), text
        assert "epoch 2" in text and str(exp / "checkpoints" / "epoch-001.pt") in text
    assert torch.load(exp / "checkpoints" / "epoch-001.pt", weights_only=True)["epoch"] == 1


def never_waited_again(log: list[dict], lost_in: int, lost_after_s: float = 5.0) -> bool:
    """The epochs after the one that lost a learner do not wait lost_after_s for it again: each is shorter than
    that epoch by more than half of it (the same work, less the wait; compared with each other, not with a fixed
    time, which a loaded machine stretches)."""
    return all(r["epoch_wall_s"] < log[lost_in]["epoch_wall_s"] - lost_after_s / 2 for r in log[lost_in + 1:])


@pytest.mark.parametrize("ds, world, comm", [("sync.json", 3, {}), ("adpsgd.json", 4, {"on_lost_learner": "stop"})],
                         ids=["sync-3", "adpsgd-stop-4"])
def test_a_dead_learner_is_named_by_the_others_at_once(tiny_exp, tmp_path, capfd, ds, world, comm):
    # SYNC deals 4 batches an epoch to each of 3 learners: the 6th is in epoch 2. ADPSGD learners take batches
    # at their own pace (2 to 5 of an epoch's 12 here, depending on who starts first): 3 epochs make sure
    # learner 1 reaches its 6th, in whichever epoch
    _, out = run(tiny_exp, tmp_path, world, {"rank": 1}, "train.epochs=3", ds=ds, die_at_step={"1": 6}, **comm)
    assert out[1] is None
    # a survivor raises LearnerLost from its failed collective, or, left waiting in a collective on a survivor
    # that gave up, its heartbeat watchdog prints the same diagnosis and ends it (comm/health.py)
    stderr = [line for line in capfd.readouterr().err.splitlines() if line.startswith("LearnerLost: ")]
    messages = [text for text in out if text is not None] + stderr
    assert len(messages) == world - 1, messages
    for text in messages:
        assert text.startswith(f"LearnerLost: lost learner(s) [1] of {world}, found on learner "), text
        epoch = int(re.search(r" in epoch (\d+) ", text)[1])
        assert (f"epoch-{epoch - 1:03d}.pt" if epoch > 1 else "last checkpoint: none yet") in text, text
        if ds == "sync.json":
            assert epoch == 2, text


def test_a_frozen_learner_is_named_once_the_collective_timeout_expires(tiny_exp, tmp_path):
    # its process is alive and its connections open, so nothing fails until train.collective_timeout_s (8 s); the
    # heartbeat would find it only after lost_after_s (60 s) and it is killed only at 30 s, so the message must
    # come from the timeout, 8 s after the freeze (a broken timeout would wait for the kill: a reset connection)
    fault = {"rank": 1, "hang_at_step": 3, "frozen_s": 30, "clock": str(tmp_path)}
    _, out = run(tiny_exp, tmp_path, 2, fault, "train.collective_timeout_s=8", lost_after_s=60)
    assert out[1] is None
    assert out[0].startswith("LearnerLost: lost learner(s) [1] of 2, found on learner 0 in epoch 1"), out[0]
    assert "last checkpoint: none yet" in out[0] and "timed out" in out[0].lower(), out[0]
    waited = float((tmp_path / "failed-0").read_text()) - float((tmp_path / "frozen").read_text())
    assert 8 <= waited < 25, waited


def test_a_frozen_learner_stops_the_others_once_its_heartbeat_stands_still(tiny_exp, tmp_path, capfd):
    # SYNC, learner 1 frozen at its 3rd batch and killed at 20 s; the collective timeout is 600 s. Learner 0's
    # heartbeat finds it still for lost_after_s (5 s) and ends learner 0 (RESTART_EXIT) wherever it waits; the
    # elastic agent would start the run again (test_elastic.py). Without that watch, the kill at 20 s would end
    # the wait with a reset connection and another message
    _, out = run(tiny_exp, tmp_path, 2, {"rank": 1, "hang_at_step": 3, "frozen_s": 20})
    assert out == [None, None], out
    err = capfd.readouterr().err
    assert ("LearnerLost: lost learner(s) [1] of 2, found on learner 0 in epoch 1 (last checkpoint: none yet); "
            "heartbeat still for 5 s (frozen, or its machine gone)") in err, err[-3000:]


def test_a_learner_that_fails_on_its_own_is_not_taken_for_lost(tiny_exp, tmp_path):
    # learner 1 raises at its 3rd batch (a bug, a bad file): starting again would fail the same way, so the
    # others say what it failed with and must not ask for a restart
    _, out = run(tiny_exp, tmp_path, 2, {"rank": 1, "raise_at_step": 3})
    assert out[1] is None, out
    assert out[0].startswith("LearnerLost: lost learner(s) [1] of 2, found on learner 0 in epoch 1"), out[0]
    assert out[0].endswith("; learner 1 failed with ValueError: utterance u-17 has no frames (see its own output): "
                           "not restarted (restartable=False)"), out[0]


def test_a_learner_with_no_batch_in_an_epoch_still_ends_it(tiny_exp, tmp_path):
    # as a very slow ADPSGD learner may, when the others took the epoch's 12 batches before its first one
    exp, out = run(tiny_exp, tmp_path, 2, {"rank": 1, "idle_epochs": [1]}, "train.epochs=2", ds="adpsgd.json")
    assert all(isinstance(m, dict) for m in out), out
    log = train_log(exp)
    assert log[0]["learner_micro_steps"] == [12, 0] and sum(log[1]["learner_micro_steps"]) == 12


def test_non_finite_weights_stop_the_consensus_naming_the_learner(tiny_exp, tmp_path):
    # at learner 1's first batch (a fast learner 0 may take a whole epoch's batches before it gets one); its
    # steps are skipped from then on, and it does not stop itself before the epoch's end (max_bad_steps)
    _, out = run(tiny_exp, tmp_path, 2, {"rank": 1, "nan_weights_at_step": 1}, "train.max_bad_steps=1000",
                 ds="adpsgd.json")
    assert all(isinstance(text, str) for text in out), out
    for text in out:  # its gossip partner never merged them (checked on both sides); the average would be NaN
        assert re.match(r"FloatingPointError: learner\(s\) \[1\] hold non-finite weights at the end of epoch [12]",
                        text), text


def test_adpsgd_goes_on_without_a_frozen_gossip_peer(tiny_exp, tmp_path, capfd):
    # learner 2 freezes (SIGSTOP: no connection reset, as a node lost to a power cut or a partition) at its 2nd
    # batch; its gossip partners stop waiting once its heartbeat has stood still for lost_after_s (5 s), not
    # after the group's timeout, and the survivors finish both epochs long before it would be killed (120 s; they
    # kill it when done). Its 2nd batch falls in epoch 2 when the others took all but one of epoch 1's 12 batches
    fault = {"rank": 2, "hang_at_step": 2, "frozen_s": 120, "clock": str(tmp_path)}  # killed once the others end
    exp, out = run(tiny_exp, tmp_path, 4, fault, ds="adpsgd.json")
    assert out[2] is None and all(isinstance(m, dict) for m in out[:2] + out[3:]), out
    log = train_log(exp)
    lost = [r.get("lost_learners") for r in log]
    frozen = lost.index([2])  # the epoch it froze in, and lost from then on
    assert lost[frozen:] == [[2]] * (len(log) - frozen) and log[frozen]["gossip_rounds_skipped"] > 0, log
    # not the collective timeout's 600 s (gloo's own default is 30 minutes); bounds loose enough for a loaded machine
    assert log[frozen]["epoch_wall_s"] < 60 and log[-1]["wall_s"] < 90, [r["epoch_wall_s"] for r in log]
    assert "LearnerLost: learner 2 of 4 is gone (heartbeat still for 5 s)" in capfd.readouterr().err


def test_adpsgd_goes_on_without_a_dead_learner(tiny_exp, tmp_path, capfd):
    # 4 learners, learner 2 dies after its first batch (96 utterances / 8 = 12 batches an epoch, drawn by all):
    # in epoch 1, unless it started so late that the others had taken all 12 (the epoch is found, not assumed)
    exp, out = run(tiny_exp, tmp_path, 4, {"rank": 1}, "train.epochs=3", ds="adpsgd.json", die_at_step={"2": 1})
    assert out[2] is None and all(isinstance(m, dict) for m in out[:2] + out[3:]), out
    assert out[0]["lost_learners"] == [2] and out[0]["weights"] == out[1]["weights"] == out[3]["weights"]
    log = train_log(exp)
    died = next(i for i, r in enumerate(log) if r["lost_learners"])
    assert died < 2 and [r["lost_learners"] for r in log] == [[]] * died + [[2]] * (3 - died)
    assert [r["learner_micro_steps"][2] for r in log] == [0] * 3  # its batch was counted by nobody
    assert sum(log[died]["learner_micro_steps"]) == 11  # the survivors took the epoch's other batches
    assert log[died]["gossip_rounds_skipped"] > 0 and log[2]["heldout_loss"] < log[0]["heldout_loss"]
    assert torch.load(exp / "checkpoints" / "epoch-003.pt", weights_only=True)["epoch"] == 3
    # said once, by the learner that found it, and never waited for again (lost_after_s is 5 s); learner 0's
    # log says it in the epoch it happened
    err = capfd.readouterr().err
    assert err.count("LearnerLost: learner 2 of 4 is gone") == 1 and err.count("learner(s) [2] lost in epoch") == 1
    assert never_waited_again(log, died), [r["epoch_wall_s"] for r in log]


def test_hybrid_goes_on_without_the_node_of_a_dead_learner(tiny_exp, tmp_path, capfd):
    # 2 nodes of 2 learners; learner 3 dies at its 2nd batch: its node mate 2 cannot step without it and leaves,
    # node 0 goes on alone and from epoch 2 takes all the batches (12 an epoch, 6 per learner)
    exp, out = run(tiny_exp, tmp_path, 4, {"rank": 1}, "--nodes", "2", "train.epochs=3", ds="hybrid.json",
                   die_at_step={"3": 2})
    assert out[3] is None and out[2].startswith("LeftBehind: learner(s) [3] gone, found on learner 2 in epoch 1"), out
    assert out[0]["lost_learners"] == [2, 3] and out[0]["weights"] == out[1]["weights"]
    log = train_log(exp)
    assert [r["lost_learners"] for r in log] == [[2, 3]] * 3
    assert [r["learner_micro_steps"] for r in log[1:]] == [[6, 6, 0, 0]] * 2
    assert log[2]["heldout_loss"] < log[0]["heldout_loss"]
    assert torch.load(exp / "checkpoints" / "epoch-003.pt", weights_only=True)["epoch"] == 3


def test_adpsgd_under_the_launcher_goes_on_without_a_dead_learner(tiny_exp, tmp_path):
    # the launcher stops everyone when a learner exits non-zero; recipe/supervisor.py keeps that from happening
    exp, ds = prepare(tiny_exp, tmp_path, "adpsgd.json", die_at_step={"2": 1})
    out = run_recipe("--stage", "3", "--stop-stage", "5", "--exp", str(exp), "--learners", "4", "--ds-config",
                     str(ds), *TINY, "train.epochs=3", timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert "learner 2 (pid " in text and "was killed by SIGKILL; the others go on" in text, text[-3000:]
    # its loss said once by the learner that dropped it, once in learner 0's log; no later epoch waits for it
    assert text.count("LearnerLost: learner 2 of 4 is gone") == 1 and text.count("[2] lost in epoch") == 1, text
    log = train_log(exp)
    died = next(i for i, r in enumerate(log) if r["lost_learners"])
    assert never_waited_again(log, died), [r["epoch_wall_s"] for r in log]
    assert json.loads((exp / "metrics.json").read_text())["lost_learners"] == [2]
    assert (exp / ".done" / "stage-3").exists() and (exp / "checkpoints" / "epoch-003.pt").exists()
    assert "lost learners" in text and "[2] in epoch 1; 3 went on" in text  # stage 5's report says so


def test_hybrid_goes_on_without_the_node_of_a_frozen_learner(tiny_exp, tmp_path, capfd):
    # learner 3 freezes at its 2nd batch: its node mate 2 waits in a node allreduce that a frozen peer never fails
    # (as NCCL's never fails for a dead one) and leaves once 3's heartbeat has stood still for 2 x 5 s, not after
    # the collective timeout (600 s); node 0 goes on alone, long before 3 would be killed (120 s; node 0 kills it
    # when done)
    fault = {"rank": 3, "hang_at_step": 2, "frozen_s": 120, "clock": str(tmp_path)}  # killed once the others end
    exp, out = run(tiny_exp, tmp_path, 4, fault, "--nodes", "2", ds="hybrid.json")
    assert out[2] is None and out[3] is None and all(isinstance(m, dict) for m in out[:2]), out
    assert out[0]["lost_learners"] == [2, 3]
    log = train_log(exp)
    assert log[-1]["lost_learners"] == [2, 3] and log[-1]["wall_s"] < 90, [r["epoch_wall_s"] for r in log]
    err = capfd.readouterr().err
    assert "LeftBehind: learner(s) [3] gone (heartbeat still for 10 s), found on learner 2 in epoch" in err, err


def test_hybrid_under_the_launcher_goes_on_without_the_node_of_a_dead_learner(tiny_exp, tmp_path):
    # learner 3 killed at its 2nd batch: its supervisor exits 0 (the run goes on), its node mate 2 leaves with
    # LeftBehind and exit 0, node 0 finishes; the launcher, which stops everyone at the first non-zero exit,
    # sees none, and run.sh ends with stage 3 done
    exp, ds = prepare(tiny_exp, tmp_path, "hybrid.json", die_at_step={"3": 2})
    out = run_recipe("--stage", "3", "--stop-stage", "3", "--exp", str(exp), "--learners", "4", "--nodes", "2",
                     "--ds-config", str(ds), *TINY, "train.epochs=2", timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "learner 3 (pid " in text and "was killed by SIGKILL; the others go on" in text, text[-4000:]
    assert "LeftBehind: learner(s) [3] gone" in text and "elastic:" not in text, text[-4000:]
    assert json.loads((exp / "metrics.json").read_text())["lost_learners"] == [2, 3]
    assert (exp / ".done" / "stage-3").exists() and (exp / "checkpoints" / "epoch-002.pt").exists()


def test_an_adpsgd_learner_back_from_a_stall_leaves_with_exit_0_under_the_launcher(tiny_exp, tmp_path):
    # learner 2 stands still 7 s from its 2nd batch (SIGSTOP, then SIGCONT): the others drop it after 5 s and
    # finish the run meanwhile (the tiny run is that short), taking learner 0's store with them. Back, it finds
    # its calls failing; it knows it stood still past lost_after_s, so it leaves (LeftBehind, exit 0) rather
    # than take learner 0 for lost, exit 75 and have the elastic agent start a finished run again (until stop 41)
    exp, ds = prepare(tiny_exp, tmp_path, "adpsgd.json")
    config = json.loads(ds.read_text())
    config["comm"]["debug"] = {"freeze_at_step": {"2": 2}, "freeze_s": {"2": 7}}
    ds.write_text(json.dumps(config))
    out = run_recipe("--stage", "3", "--stop-stage", "3", "--exp", str(exp), "--learners", "4", "--ds-config",
                     str(ds), *TINY, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "elastic:" not in text, text[-4000:]
    assert "LearnerLost: learner 2 of 4 is gone (heartbeat still for 5 s)" in text, text[-4000:]
    assert re.search(r"LeftBehind: learner 2 stood still for \d+ s \(more than 5 s: the others dropped it and went "
                     r"on\)", text), text[-4000:]
    assert json.loads((exp / "metrics.json").read_text())["lost_learners"] == [2]
