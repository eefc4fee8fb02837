"""Configuration: one source of truth per setting, unknown names rejected with the valid ones listed."""

from __future__ import annotations

import json

import pytest

from comm import ProcessLayout, build_strategy
from comm.layout import LayoutError
from recipe.lib.config import ConfigError, for_strategy, load_config, overridden
from recipe.lib.ds_config import load_ds_config
from recipe.lib.schedule import fixed_anneal_start, learning_rate, newbob, plan_epochs, resumed_plan
from tests.conftest import REPO


def test_defaults_file_and_overrides_in_that_order(tmp_path):
    (tmp_path / "c.yaml").write_text("model:\n  hidden: 64\n  layers: 2\n")
    conf = load_config(tmp_path / "c.yaml", ["model.layers=5"])
    assert (conf.model.hidden, conf.model.layers, conf.model.stack) == (64, 5, 2)  # stack: the default


def test_unknown_keys_and_values_are_errors(tmp_path):
    with pytest.raises(ConfigError, match="model.hiden"):
        load_config(None, ["model.hiden=3"])
    for override in ("[", "model.stack", "model..stack=2", "=2"):  # "[": an IndexError inside omegaconf
        with pytest.raises(ConfigError, match="is not key=value"):
            load_config(None, [override])
    (tmp_path / "c.yaml").write_text("optim:\n  nme: sgd\n")
    with pytest.raises(ConfigError, match=r"c\.yaml.*nme"):
        load_config(tmp_path / "c.yaml")
    with pytest.raises(ConfigError, match="features.cmvn='speakr' is not one of: global, speaker, utterance"):
        load_config(None, ["features.cmvn=speakr"])
    with pytest.raises(ConfigError, match="needs data.train_dir and data.test_dir"):
        load_config(None, ["data.corpus=kaldi"])
    with pytest.raises(ConfigError, match=r"optim.newbob_min_gain=-0.1 >= 0"):
        load_config(None, ["optim.newbob_min_gain=-0.1"])
    with pytest.raises(ConfigError, match=r"data.dev_share=0.5 must be in \(0, 0.5\)"):
        load_config(None, ["data.dev_share=0.5"])
    with pytest.raises(ConfigError, match=r"must be >= 0 and the lists not empty, got None, None, \[\], "):
        load_config(None, ["decode.lm_weights=[]"])
    with pytest.raises(ConfigError, match=r"got -1.0, None"):
        load_config(None, ["decode.lm_weight=-1.0"])


def test_every_shipped_config_loads():
    for yaml in (REPO / "recipe" / "conf").glob("*.yaml"):
        load_config(yaml)
    for path in (REPO / "ds_configs").rglob("*.json"):
        engine, comm = load_ds_config(path)
        build_strategy(comm, ProcessLayout(world_size=4, local_size=2, nodes=2))
        assert "comm" not in engine


def test_replicas_are_the_model_copies_that_step_on_their_own():
    layout = ProcessLayout(world_size=8, local_size=4, nodes=2)
    replicas = {name: build_strategy({"strategy": name}, layout).replicas
                for name in ("sync", "adpsgd", "hybrid", "localsgd")}
    assert replicas == {"sync": 1, "adpsgd": 8, "hybrid": 2, "localsgd": 8}


def test_strategy_registry_rejects_unknown_names_and_options():
    with pytest.raises(ValueError, match="unknown strategy 'asgd'.*valid: adpsgd, hybrid, localsgd, sync"):
        build_strategy({"strategy": "asgd"}, ProcessLayout())
    with pytest.raises(ValueError, match=r"options \['period'\] are unknown to strategy 'sync'"):
        build_strategy({"strategy": "sync", "period": 2}, ProcessLayout())
    with pytest.raises(ValueError, match=r"comm.sampling='random'; valid: shared, independent"):
        build_strategy({"strategy": "adpsgd", "sampling": "random"}, ProcessLayout(world_size=2, local_size=2))
    with pytest.raises(ValueError, match=r"options \['sampling'\] are unknown to strategy 'hybrid'"):
        build_strategy({"strategy": "hybrid", "sampling": "shared"}, ProcessLayout(world_size=4, local_size=2, nodes=2))


def test_ds_json_may_not_hold_what_the_yaml_owns(tmp_path):
    base = json.loads((REPO / "ds_configs" / "sync.json").read_text())
    for key in ("optimizer", "scheduler", "train_batch_size"):
        (tmp_path / "x.json").write_text(json.dumps({**base, key: {}}))
        with pytest.raises(ConfigError, match=f"'{key}' is not set in the DeepSpeed JSON"):
            load_ds_config(tmp_path / "x.json")
    (tmp_path / "x.json").write_text('{"train_micro_batch_size_per_gpu": 4,\n "comm": }')
    with pytest.raises(ConfigError, match=r"x\.json:2:\d+: invalid JSON"):
        load_ds_config(tmp_path / "x.json")
    (tmp_path / "x.json").write_text('{"train_micro_batch_size_per_gpu": 4}')
    with pytest.raises(ConfigError, match='needs a "comm" section'):
        load_ds_config(tmp_path / "x.json")


def test_layout_validation_prints_every_factor():
    assert ProcessLayout.from_env({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_SIZE": "2",
                                   "CROSS_RANK": "1", "CROSS_SIZE": "2"}).node_rank == 1
    with pytest.raises(LayoutError, match=r"3 x 2 != world_size \(world_size=5 .*local_size=2"):
        ProcessLayout(rank=0, world_size=5, local_size=2, nodes=3)


def test_learning_rate_schedule():
    optim = load_config(None, ["optim.lr=0.1", "optim.base_batch=256", "optim.warmup_epochs=1",
                               "optim.batch_scaling=linear"]).optim
    assert learning_rate(optim, 256, 1, 0.5, 3) == pytest.approx(0.05)  # halfway through warm-up
    assert learning_rate(optim, 256, 2, 0.5, 3) == pytest.approx(0.1)
    assert learning_rate(optim, 1024, 2, 0.5, 3) == pytest.approx(0.4)  # linear scaling with the global batch
    assert learning_rate(optim, 256, 2, 1.0, 3) == pytest.approx(0.1)  # an epoch's last step: still its rate
    assert learning_rate(optim, 256, 3, 0.5, 3) == pytest.approx(0.1 / 2 ** 0.5)  # epoch 3: first anneal
    assert learning_rate(optim, 256, 4, 0.5, 3) == pytest.approx(0.05)  # epoch 4: (1/sqrt 2)^2
    assert learning_rate(optim, 256, 4, 0.5, None) == pytest.approx(0.1)  # newbob, not annealing yet
    sqrt = load_config(None, ["optim.lr=0.1", "optim.base_batch=256", "optim.warmup_epochs=0",
                              "optim.batch_scaling=sqrt"]).optim
    assert learning_rate(sqrt, 1024, 1, 0.5, None) == pytest.approx(0.2)
    replicas = load_config(None, ["optim.lr=0.1", "optim.base_batch=256", "optim.warmup_epochs=0",
                                  "optim.batch_scaling=sqrt_replicas"]).optim
    assert learning_rate(replicas, 1024, 1, 0.5, None, replicas=1) == pytest.approx(0.2)  # one copy: sqrt
    assert learning_rate(replicas, 1024, 1, 0.5, None, replicas=4) == pytest.approx(0.4)  # sqrt(4 x 4)
    # the fixed schedule anneals from anneal_start_epoch, unset: after the first half, 3 of 4, 16 of 30
    assert fixed_anneal_start(sqrt, 4) == 3 and fixed_anneal_start(sqrt, 30) == 16
    assert fixed_anneal_start(load_config(None, ["optim.anneal_start_epoch=6"]).optim, 30) == 6


def test_batch_scaling_auto_is_resolved_by_the_optimizer_and_the_strategy():
    conf = load_config(None, ["optim.lr=0.1", "optim.base_batch=16", "optim.warmup_epochs=0"])
    assert conf.optim.batch_scaling == "auto"  # the default
    with pytest.raises(ValueError, match="depends on the strategy"):  # never silently one of the rules
        learning_rate(conf.optim, 64, 1, 0.5, None)
    for averaged in ("sync", "localsgd"):
        assert learning_rate(for_strategy(conf, averaged).optim, 64, 1, 0.5, None, replicas=4) == pytest.approx(0.2)
    for gossip in ("adpsgd", "hybrid"):  # sqrt(4 x 4)
        assert learning_rate(for_strategy(conf, gossip).optim, 64, 1, 0.5, None, replicas=4) == pytest.approx(0.4)
    assert conf.optim.batch_scaling == "auto"  # resolved in a copy
    from comm import STRATEGIES
    from recipe.lib.config import AUTO_BATCH_SCALING

    assert set(AUTO_BATCH_SCALING) == set(STRATEGIES)  # a new strategy needs its rule decided
    sgd = load_config(None, ["optim.name=sgd", "optim.lr=0.1", "optim.base_batch=16", "optim.warmup_epochs=0"])
    for strategy in STRATEGIES:  # SGD's steps are not normalized: the linear rule under every strategy
        assert learning_rate(for_strategy(sgd, strategy).optim, 64, 1, 0.5, None, replicas=4) == pytest.approx(0.4)
    given = load_config(None, ["optim.batch_scaling=sqrt"])
    assert for_strategy(given, "adpsgd").optim.batch_scaling == "sqrt"  # a rule the user names wins


def test_newbob_anneals_once_the_held_out_loss_stalls_and_stops_when_annealing_no_longer_helps():
    optim = load_config(None, ["optim.newbob_margin=0.01", "optim.newbob_patience=2",
                               "optim.newbob_anneal_epochs=4"]).optim  # annealed epochs must gain 0.1%

    def run(losses, earliest=2, learning=True, conf=None):
        """Replays the schedule's decisions epoch by epoch, as training makes them (under `conf`, else `optim`)."""
        anneal_from = None
        for epoch in range(1, len(losses) + 1):
            plan = newbob(losses[:epoch], anneal_from, earliest, learning, conf or optim)
            anneal_from = plan.anneal_from
            if plan.stop:
                return anneal_from, epoch
        return anneal_from, None

    assert run([3.0, 1.0, 0.5, 0.3, 0.2]) == (None, None)  # improving: the peak lr, no end
    # epoch 4 improves by less than 1%: annealing from 5; 6 improves; 7 and 8 do not: the end after 8
    assert run([3.0, 1.0, 0.5, 0.498, 0.3, 0.2, 0.25, 0.21, 0.1]) == (5, 8)
    # FSDD's noisy held-out loss (ACCURACY.md section 1's seed 0, fixed schedule): a bad epoch at the peak lr
    # starts annealing, one bad annealed epoch does not end training
    assert run([0.294, 0.221, 0.427, 0.274, 0.134, 0.167, 0.270, 0.137]) == (4, 7)
    assert run([3.0, 3.1, 3.2, 3.2], earliest=1) == (3, 4)  # annealing not before `earliest` ...
    assert run([3.0, 3.1, 3.2, 3.0], earliest=3) == (4, None)
    assert run([2.9, 2.9, 2.9, 2.9], learning=False) == (None, None)  # ... nor on the all-blank plateau
    assert run([float("nan"), 2.0, 2.1, 2.2, 2.3]) == (4, 5)  # a non-finite loss is never the best
    # a loss that keeps falling: at most 4 annealed epochs
    assert run([3.0, 1.0, 0.5, 0.498, 0.3, 0.2, 0.1, 0.05, 0.02]) == (5, 8)
    # the margin starts annealing; a tenth of it keeps it going (FSDD, 1,000 utterances: 0.178, 0.229, 0.250,
    # 0.165: 7% better than the best annealed, below the margin of 10%); the built-in corpus's 1% gains end it
    optim = load_config(None, ["optim.newbob_margin=0.1", "optim.newbob_patience=2"]).optim
    assert run([0.770, 0.412, 0.246, 0.178, 0.229, 0.250, 0.165]) == (6, None)
    assert run([1.72, 0.088, 0.0196, 0.0088, 0.0081, 0.0083, 0.0070, 0.00695, 0.0069]) == (6, 9)
    # near a loss of 0, a gain below optim.newbob_min_gain (0.001) is none: `./run.sh` on the built-in corpus
    # (ACCURACY.md section 6) ends after epoch 8; without it a gain of 1% of 0.0054 (0.00005) keeps it going
    builtin = [1.899, 0.0662, 0.0237, 0.00813, 0.0508, 0.00537, 0.00542, 0.00523]
    assert run(builtin) == (6, 8)
    floorless = load_config(None, ["optim.newbob_margin=0.1", "optim.newbob_patience=2",
                                   "optim.newbob_min_gain=0"]).optim
    assert run(builtin, conf=floorless) == (6, None)
    # FSDD's losses are a hundred times that floor: the same decisions with it and without it
    fsdd = [0.770, 0.412, 0.246, 0.178, 0.229, 0.250, 0.165, 0.160, 0.1599, 0.1598]
    assert run(fsdd) == run(fsdd, conf=floorless) == (6, 10)


def test_newbob_does_not_end_a_run_whose_loss_jumped_at_the_peak_rate_and_is_falling_again():
    optim = load_config(None, ["optim.newbob_margin=0.1", "optim.newbob_patience=2"]).optim

    def run(losses, planned=0):
        anneal_from = None
        for epoch in range(1, len(losses) + 1):
            plan = newbob(losses[:epoch], anneal_from, 2, True, optim, planned)
            anneal_from = plan.anneal_from
            if plan.stop:
                return anneal_from, epoch
        return anneal_from, None

    # FSDD, `nicolas` held out (ACCURACY.md section 6): the loss was best after epoch 1 and jumped in epoch 2;
    # annealing is judged against the jump, not against epoch 1, and it is gaining
    assert run([0.704, 0.979, 0.828, 0.790]) == (3, None)
    assert run([0.704, 0.979, 0.828, 0.790, 0.789, 0.795]) == (3, 6)  # and ends once it no longer gains
    # never before the planned epochs (train.min_updates): a corpus that needs more updates gets them
    assert run([0.704, 0.979, 0.990, 0.995]) == (3, 4)
    assert run([0.704, 0.979, 0.990, 0.995, 0.999, 1.0], planned=6) == (3, 6)


def test_a_small_corpus_or_a_large_batch_gets_enough_updates():
    train = load_config(None, ["train.min_updates=700", "train.max_epochs=30"]).train
    assert plan_epochs(train, "fixed", 187).epochs == 4  # the built-in corpus, 3,000 utterances, global batch 16
    assert plan_epochs(train, "fixed", 59).epochs == 12  # 948 utterances
    assert plan_epochs(train, "fixed", 12).epochs == 30  # at most max_epochs
    assert plan_epochs(load_config(None, ["train.epochs=6", "train.min_updates=0"]).train, "fixed", 59).epochs == 6


def test_the_start_line_states_the_plan_and_honors_an_epoch_count_given():
    train = load_config(None, []).train  # the defaults: 4 epochs, 700 updates, at most 40
    default = plan_epochs(train, "newbob", 187)  # the built-in corpus
    assert default.describe("newbob") == ("187 updates an epoch; epochs: at least 4, at most 40 (train.max_epochs), "
                                          "by train.epochs=4; newbob ends it when the dev loss stops improving")
    small = plan_epochs(train, "newbob", 25)  # 400 utterances: min_updates raises the epochs, and says so
    assert (small.epochs, small.max_epochs, small.warning) == (28, 40, None)
    assert "by train.min_updates=700 (train.epochs=4 would make 100 updates)" in small.describe("newbob")
    given = plan_epochs(load_config(None, ["train.epochs=1"]).train, "newbob", 25, epochs_given=True)
    assert (given.epochs, given.max_epochs) == (1, 1)  # exactly as given, under newbob too
    assert given.describe("newbob").startswith("25 updates an epoch; epochs: exactly 1, by train.epochs=1 as given")
    assert given.warning.startswith("train.epochs=1 makes 25 optimizer updates, fewer than train.min_updates=700")
    assert overridden(["model.hidden=8", "train.epochs=1"], "train.epochs")
    assert not overridden(["train.epochs_x=1"], "train.epochs")


def test_a_resume_with_another_layout_keeps_the_plan_it_continues():
    train = load_config(None, []).train
    before = plan_epochs(train, "fixed", 25)  # 28 epochs at 25 updates an epoch (min_updates)
    now = plan_epochs(train, "fixed", 12)  # resumed with twice the learners: 40 (min_updates, capped)
    kept = resumed_plan(now, before.epochs, epochs_given=False)
    assert (kept.epochs, kept.max_epochs) == (28, 28) and "the run resumed (28 epochs; this layout" in kept.reason
    assert resumed_plan(now, None, False) == now  # a checkpoint from before stop 34: as planned now
    given = plan_epochs(load_config(None, ["train.epochs=30"]).train, "fixed", 12, epochs_given=True)
    assert resumed_plan(given, 28, epochs_given=True) == given  # the user's train.epochs wins

