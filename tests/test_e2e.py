"""End to end: run.sh stages 1-5 on a tiny synthesized corpus, learners started by the real deepspeed launcher."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY, free_port, run_recipe, train_log

pytestmark = pytest.mark.slow  # learner processes: not in the fast tier


def test_run_sh_trains_and_reports(tmp_path):
    exp = tmp_path / "exp"
    args = ["--stage", "1", "--exp", str(exp), "--learners", "2", "--master-port", str(free_port()), *TINY,
            "train.epochs=4", "decode.average_best=2", "decode.average_within=null"]
    out = run_recipe(*args, "--stop-stage", "2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # training never reads the test set: its data dir and features are out of reach until the decode stage
    test_sets = [exp / "data" / "test", Path(json.loads((exp / "features.json").read_text())["test"])]
    for path in test_sets:
        path.rename(path.with_name(path.name + ".hidden"))
    train = run_recipe(*args[2:], "--stage", "3", "--stop-stage", "3")
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    for path in test_sets:
        path.with_name(path.name + ".hidden").rename(path)
    out = run_recipe(*args[2:], "--stage", "4")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    log = train_log(exp)
    assert [r["epoch"] for r in log] == [1, 2, 3, 4]
    # the start line states the plan: the epochs given on the command line, exactly (TINY's fixed schedule)
    assert "plan: 6 updates an epoch; epochs: exactly 4, by train.epochs=4 as given; fixed schedule" in train.stdout
    assert log[-1]["train_loss"] < 0.7 * log[0]["train_loss"]  # the loss falls
    assert log[-1]["heldout_loss"] < log[0]["heldout_loss"]
    metrics = json.loads((exp / "metrics.json").read_text())
    assert metrics["learners"] == 2 and metrics["strategy"] == "sync" and metrics["train_frames_per_s"] > 0
    scores = json.loads((exp / "decode" / "scores.json").read_text())
    assert len((exp / "decode" / "hyp.txt").read_text().splitlines()) == scores["utterances"] == 16
    assert len((exp / "decode" / "dev" / "hyp.txt").read_text().splitlines()) == metrics["dev_utterances"] == 16
    best = sorted(log, key=lambda r: r["heldout_loss"])[:2]  # the decode stage averages the two of lowest loss
    assert scores["averaged"] == [f"epoch-{r['epoch']:03d}.pt" for r in sorted(best, key=lambda r: r["epoch"])]
    # beam search with the word LM of the training transcripts, beside the greedy scores
    assert scores["decode"]["beam"] > 0 and scores["decode"]["lm_order"] > 0 and "greedy_wer" in scores
    # the LM weight and word bonus were chosen on dev: the best dev WER of the grid, and no worse than greedy
    grid = scores["dev"]["grid"]
    assert len(grid) == 9 and scores["dev"]["wer"] == min(min(r["wer"] for r in grid), scores["dev"]["greedy_wer"])
    assert (exp / "decode" / "lm.arpa").read_text().startswith("\\data\\")
    # decode settings change after training without retraining; nothing else does
    evaluate = [str(REPO / ".venv" / "bin" / "python"), "-m", "recipe.evaluate", "--exp", str(exp), "--out", "w2"]
    assert subprocess.run(evaluate + ["decode.lm_weight=2.0"], cwd=REPO, capture_output=True).returncode == 0
    assert json.loads((exp / "w2" / "scores.json").read_text())["decode"]["lm_weight"] == 2.0
    refused = subprocess.run(evaluate + ["train.epochs=3"], cwd=REPO, capture_output=True, text=True)
    assert refused.returncode != 0 and "only decode.* settings" in refused.stderr
    assert (exp / "report.png").stat().st_size > 10_000
    assert "test CER / WER, decoded once" in out.stdout and "dev CER / WER, decoded" in out.stdout  # the report
    for n in range(1, 5):
        assert (exp / ".done" / f"stage-{n}").is_file()
    launch = (exp / "launch.txt").read_text()
    assert "deepspeed" in launch and "--num_gpus 2" in launch

    # a rerun without --stage skips what is done (stage 0 only checks the environment) and redraws the report
    again = run_recipe(*[a for a in args if a not in ("--stage", "1")], timeout=120)
    assert again.returncode == 0 and again.stdout.count("done before, skipped") == 4, again.stdout[-2000:]
    assert "test CER / WER, decoded once" in again.stdout


def test_run_sh_rejects_bad_options_before_doing_work(tmp_path):
    out = run_recipe("--stage", "1", "--exp", str(tmp_path / "e"), "--bogus")
    assert out.returncode == 2 and "unknown option '--bogus'" in out.stderr
    out = run_recipe("--stage", "1", "--exp", str(tmp_path / "e"), "model.hiden=3")
    assert out.returncode != 0 and "model.hiden" in out.stdout + out.stderr
    (tmp_path / "bad.json").write_text('{"train_micro_batch_size_per_gpu": 4, "comm": {"strategy": "gossip"}}')
    out = run_recipe("--stage", "1", "--exp", str(tmp_path / "e"), "--ds-config", str(tmp_path / "bad.json"))
    assert out.returncode != 0 and "unknown strategy 'gossip'" in out.stdout + out.stderr
    assert not (tmp_path / "corpus").exists()  # failed before synthesizing anything
    # the hostfile is read as DeepSpeed reads it: a commented-out host is not a node
    (tmp_path / "hostfile").write_text("localhost slots=2\n# 127.0.0.1 slots=2\n")
    out = run_recipe("--stage", "1", "--exp", str(tmp_path / "e"), "--hostfile", str(tmp_path / "hostfile"),
                     "--ds-config", str(REPO / "ds_configs" / "hybrid.json"))
    assert out.returncode != 0 and "hybrid needs at least 2 nodes" in out.stderr and "world_size=2" in out.stderr
    (tmp_path / "hostfile").write_text("localhost slots=3\n127.0.0.1 slots=1\n")  # nodes of unequal size
    out = run_recipe("--stage", "1", "--exp", str(tmp_path / "e"), "--hostfile", str(tmp_path / "hostfile"))
    assert out.returncode != 0 and "the hosts have different slot counts" in out.stderr
    out = run_recipe("--stage", "3", "--exp", str(tmp_path / "e"), "--node-rank", "1")
    assert out.returncode == 2 and "--node-rank and --master-addr go together, with --hostfile" in out.stderr
    assert "--ds-config FILE" in run_recipe("--help").stdout


def test_run_sh_trains_the_papers_ce_objective_on_the_built_in_corpus(tmp_path):
    """recipe/conf/ce.yaml: frame targets from espeak-ng's phone timings, 21-frame chunks, frame accuracy per
    epoch, and the decode stage's scaled log-likelihoods for Kaldi."""
    import kaldiio

    exp = tmp_path / "exp"
    out = run_recipe("--stage", "1", "--exp", str(exp), "--learners", "2", "--conf", "recipe/conf/ce.yaml", *TINY,
                     "model.stack=1", "train.epochs=3",
                     "optim.base_batch=16")  # sync.json's 8 chunks a learner: enough steps on the tiny corpus
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    log = train_log(exp)
    targets = json.loads((exp / "targets" / "train" / "meta.json").read_text())
    majority = max(targets["counts"]) / sum(targets["counts"])  # always guessing the commonest phone (sil)
    assert log[-1]["heldout_loss"] < log[0]["heldout_loss"] and log[-1]["frame_acc"] > majority + 0.1
    scores = json.loads((exp / "decode" / "scores.json").read_text())
    loglikes = dict(kaldiio.load_scp(scores["loglikes"]))
    test_frames = json.loads((exp / "targets" / "test" / "meta.json").read_text())["frames"]
    assert sum(len(v) for v in loglikes.values()) == test_frames and scores["frame_acc"] > majority
    assert "dev frame acc" in out.stdout and "decode stage test frame accuracy" in out.stdout  # the report table
