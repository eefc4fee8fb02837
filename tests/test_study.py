"""The study command (recipe/tools/study.py): its plan, a whole tiny study end to end, and its bad settings."""

from __future__ import annotations

import re

import pytest

from recipe.tools.study import StudyConf, main, plan, target_cer
from tests.conftest import TINY

TINY_MODEL = [o for o in TINY if o.startswith(("model.", "optim."))]


def test_the_plan_runs_every_setting_once_and_shares_the_base_runs():
    runs = plan(StudyConf())
    names = [r["name"] for r in runs]
    # strategies at 4 and 8 learners; SYNC and ADPSGD x (5 batch sizes + 2 slowdowns); LOCALSGD x 2 slowdowns
    assert len(runs) == 2 * 4 + 2 * (5 + 2) + 2
    # part 1's one-node runs at 4 learners, the 32-utterance batch and the 1x slowdown are one run per strategy
    assert len(set(names)) == len(runs) - 3 - 2
    assert [r["name"] for r in runs if r["strategy"] == "localsgd"] == ["base-localsgd", "strategy-localsgd-8learners",
                                                                        "base-localsgd", "straggler2x-localsgd"]
    assert {r["part"] for r in runs if r["name"] == "base-adpsgd"} == {"strategies", "batch", "stragglers"}
    for name in set(names):  # a run in several parts has the same settings in each
        same = [{k: v for k, v in r.items() if k not in ("part", "slowdown")} for r in runs if r["name"] == name]
        assert all(settings == same[0] for settings in same), name
    assert next(r for r in runs if r["name"] == "strategy-hybrid")["comm"] == {"link": {"bandwidth_gbps": 1.0,
                                                                                        "latency_ms": 0.5}}
    # one global batch for part 1 at every learner count
    assert {(r["learners"], r["engine"]["train_micro_batch_size_per_gpu"]) for r in runs
            if r["part"] == "strategies"} == {(4, 8), (8, 4)}
    assert [r["engine"]["train_micro_batch_size_per_gpu"] for r in runs if r["part"] == "batch"] == [4, 8, 16, 32,
                                                                                                     64] * 2
    assert next(r for r in runs if r["name"] == "straggler2x-sync")["comm"] == {"debug": {"slowdown": {"1": 2.0}}}


def test_the_target_is_a_multiple_of_syncs_cer_but_never_below_the_held_out_sets_resolution():
    conf, sync = StudyConf(), {"name": "strategy-sync", "metrics": {"cer": 7 / 1708}}
    assert target_cer(sync, conf, chars=1708) == (pytest.approx(1.5 * 7 / 1708), "1.5 x strategy-sync's final 0.41%")
    sync["metrics"]["cer"] = 1 / 1708  # one error: 1.5 x its CER is still one error, which no other run may match
    target, why = target_cer(sync, conf, chars=1708)
    assert target == 10 / 1708 and why.startswith("10 character errors of the held-out 1,708: 1.5 x strategy-sync's")


@pytest.mark.slow
def test_a_tiny_study_writes_every_table_and_plot_and_resumes(tmp_path, capsys):
    args = [f"exp={tmp_path / 'study'}", "utterances=64", "epochs=1", "learners=2", "strategy_learners=[2]",
            "nodes=2", "global_batch=16", "batch_sweep=[16,32]", "slowdowns=[2]", "localsgd_slowdowns=[2]",
            f"overrides=[{','.join(TINY_MODEL)}]"]
    assert main(args) == 0
    report = (tmp_path / "study" / "report.md").read_text()
    for title in ("## 1. Strategies", "## 2. Global batch", "## 3. Learner 1 slowed"):
        assert title in report
    assert re.search(r"- SYNC: final CER against the 16-utterance batch's .*largest batch within 10%: (16|32)", report)
    # 64 utterances, 1 epoch: 4 updates at a global batch of 16, 2 at 32; SYNC's square-root rule: sqrt(2) x the rate
    lr16, lr32 = (float(re.search(rf"^\| {b} \| SYNC \| {n} \| (\S+) \|", report, re.M)[1])
                  for b, n in ((16, 4), (32, 2)))
    assert lr32 == pytest.approx(2 ** 0.5 * lr16, rel=5e-3)  # printed to 3 digits
    parts = report.split("## 4. Time to target")
    assert parts[0].count("| SYNC |") == 1 + 2 + 1 and parts[0].count("| HYBRID |") == 1
    assert parts[0].count("| LOCALSGD |") == 1 + 1  # part 1 and its 2x straggler
    assert parts[1].count("| SYNC |") == 1 + 1 + 1  # every run once more (base, 2x batch, 2x slower), with its time
    rows = [line for line in parts[1].splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 4 + 2 * 2 + 1 and all(line.endswith(("| reached |", "| not reached |", "at the end |"))
                                          for line in rows)  # 1 epoch of 64 utterances: no learning, and said so
    for plot in ("loss_vs_time.png", "cer_vs_time.png", "loss_vs_epoch.png", "cer_vs_batch.png",
                 "throughput_vs_straggler.png"):
        assert (tmp_path / "study" / plot).stat().st_size > 5_000
    runs_done = re.compile(r"^study: \S+ done in", re.M)
    # part 1 (SYNC's, ADPSGD's and LOCALSGD's runs are the base runs); 2x batch, 2x slower; LOCALSGD 2x slower
    assert len(runs_done.findall(capsys.readouterr().out)) == 4 + 2 * 2 + 1
    assert main(args) == 0  # every run is done: only the report is written again
    assert not runs_done.findall(capsys.readouterr().out)


@pytest.mark.parametrize("args, message", [(["learners=3"], "must be at least 2 and split into nodes=2"),
                                           (["strategy_learners=[6]"], "global_batch=32 does not split over 6"),
                                           (["batch_sweep=[16,18]"], "batch_sweep [18] does not split"),
                                           (["epoch=3"], "epoch")])
def test_bad_settings_are_refused_before_any_run(args, message, capsys):
    assert main(args) == 2
    assert message in capsys.readouterr().err
