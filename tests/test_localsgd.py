"""LOCALSGD (torch's periodic model averaging) on real processes (gloo over localhost): the learners part between
averages and are equal after each and after an epoch; with period 1 it is SYNC for plain SGD; its warm-up is SYNC
for any optimizer; bad options are refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from comm import ProcessLayout, build_strategy
from tests.conftest import REPO, TINY, run_learners, train_learner, train_log


@pytest.mark.parametrize("comm, message", [
    ({"perod": 4}, r"options \['perod'\] are unknown to strategy 'localsgd'"),
    ({"period": 0}, r"comm\.period must be an integer >= 1, got 0"),
    ({"period": 2.5}, r"comm\.period must be an integer >= 1, got 2\.5"),
    ({"warmup_steps": -1}, r"comm\.warmup_steps must be an integer >= 0, got -1"),
])
def test_bad_options_are_refused_naming_the_key(comm, message):
    with pytest.raises(ValueError, match=message):
        build_strategy({"strategy": "localsgd", **comm}, ProcessLayout(world_size=4, local_size=4))


def runs_of(rank: int, world: int, runs: list[tuple]) -> list[dict]:
    """Each of `runs` (steps_of's arguments) in turn, in one learner process (one start-up for them all)."""
    from comm import init_distributed

    init_distributed()
    return [steps_of(*run) for run in runs]


def steps_of(comm: dict, steps: int, optim: str, clip: float) -> dict:
    """`steps` optimizer steps of recipe/lib/engine.py's train_step under the strategy `comm`, each learner on
    its own batches (the same ones whatever the strategy) -> the weights after each step, and after end_epoch."""
    import torch.distributed as dist

    from comm import ProcessLayout, build_strategy
    from model.lstm import LSTMAcousticModel
    from recipe.lib.engine import SGD, Adam, build_engine, train_step

    rank = dist.get_rank()
    strategy = build_strategy(comm, ProcessLayout.from_env())
    torch.manual_seed(0)
    model = LSTMAcousticModel(input_dim=12, output_dim=6, layers=1, hidden=16, dropout=0.0, stack=2)
    optimizer = SGD(model.parameters(), lr=0.1) if optim == "sgd" else Adam(model.parameters(), lr=0.01)
    engine = build_engine(model, optimizer, {"train_micro_batch_size_per_gpu": 3, "gradient_clipping": clip},
                          strategy)

    def flat():
        return torch.cat([p.detach().flatten().clone() for p in engine.module.parameters()])

    g = torch.Generator().manual_seed(rank)  # every learner its own data
    after = []
    for _ in range(steps):
        batch = {"feats": torch.randn(3, 20, 12, generator=g), "lengths": torch.tensor([20, 18, 16]),
                 "targets": torch.randint(1, 6, (6,), generator=g), "target_lengths": torch.tensor([2, 2, 2])}
        assert train_step(engine, strategy, batch).applied
        after.append(flat())
    stats = strategy.end_epoch(engine)
    strategy.close()
    return {"after": after, "end": flat(), "stats": stats}


@pytest.mark.slow
def test_learners_part_between_averages_and_agree_after_each_and_after_the_epoch():
    # warm-up 1: step 0 is synchronous; then torch's averager averages after steps 1 and 4 (1 + k x 3)
    out = [o[0] for o in run_learners(runs_of, 2, [({"strategy": "localsgd", "period": 3, "warmup_steps": 1}, 6,
                                                      "adam", 5.0)])]
    same = [torch.equal(out[0]["after"][i], out[1]["after"][i]) for i in range(6)]
    assert same == [True, True, False, False, True, False], same
    assert torch.equal(out[0]["end"], out[1]["end"])  # the epoch's average: one model
    assert not torch.equal(out[0]["end"], out[0]["after"][-1])  # ... that moved the weights
    for o in out:
        stats = o["stats"]
        assert 0 < stats["consensus_distance"] < 0.05, stats  # apart after step 5, by a little
        assert (stats["averaging_rounds"], stats["averaging_grad_allreduces"]) == (3, 1)  # 2 periodic + the epoch's


@pytest.mark.slow
def test_with_period_1_plain_sgd_is_sync_and_the_warm_up_is_sync_for_adam_with_clipping():
    """Averaging the weights after a plain SGD step from equal weights averages the gradients: period 1 (no
    clipping: each learner would clip its own gradient, SYNC clips their average) is SYNC up to rounding. The
    warm-up averages the gradients before the step, so it is SYNC for any optimizer, clipping included."""
    sgd, adam = ("sgd", 0.0), ("adam", 0.05)  # a clip this small acts at every step
    # SYNC first: an engine given an mpu leaves it in DeepSpeed's module globals (deepspeed.utils.groups.mpu),
    # where a later engine without one in the same process finds it and reduces over a group of one
    runs = [({"strategy": "sync"}, 3, *sgd), ({"strategy": "sync"}, 3, *adam),
            ({"strategy": "localsgd", "period": 1, "warmup_steps": 0}, 3, *sgd),
            ({"strategy": "localsgd", "period": 4, "warmup_steps": 3}, 3, *adam)]
    out = run_learners(runs_of, 2, runs)
    sync_sgd, sync_adam, local_sgd, warm_up = out[0]
    for i in range(3):  # measured: up to 2e-7 apart (weights up to 0.6): the same sums, rounded in another order
        torch.testing.assert_close(local_sgd["after"][i], sync_sgd["after"][i], rtol=0, atol=1e-6)
        assert torch.equal(warm_up["after"][i], sync_adam["after"][i])  # the same allreduce, clip and step: bits
        assert torch.equal(local_sgd["after"][i], out[1][2]["after"][i])
        assert torch.equal(sync_sgd["after"][i], out[1][0]["after"][i])
    assert warm_up["stats"]["averaging_grad_allreduces"] == 3 and local_sgd["stats"]["averaging_rounds"] == 4


@pytest.mark.slow
def test_localsgd_trains_through_the_recipe(tiny_exp, tmp_path):
    exp = tmp_path / "exp"
    shutil.copytree(tiny_exp, exp)
    ds = json.loads((REPO / "ds_configs" / "localsgd.json").read_text())
    ds["comm"].update(period=2, warmup_steps=2)
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    out = run_learners(train_learner, 2, ["--exp", str(exp), "--ds-config", str(tmp_path / "ds.json"), *TINY,
                                          "train.epochs=2"])
    log = train_log(exp)
    steps = log[0]["learner_micro_steps"]
    assert steps[0] == steps[1] and all(r["learner_micro_steps"] == steps for r in log)  # dealt by rank
    averages, done = 0, 0
    for record in log:  # torch's schedule: after steps 2, 4, 6, ... (warm-up 2, period 2), and at each epoch's end
        averaged = [s >= 2 and (s - 2) % 2 == 0 for s in range(done, done + steps[0])]
        averages, done = averages + sum(averaged) + 1, done + steps[0]
        assert record["averaging_rounds"] == averages and record["averaging_grad_allreduces"] == 2, record
        assert (record["consensus_distance"] == 0) == averaged[-1], record  # apart unless the last step averaged
    assert log[-1]["train_loss"] < log[0]["train_loss"]
    assert out[0]["strategy"] == "localsgd" and out[0]["averaging_rounds"] == averages
    resumed = tmp_path / "resumed"  # one epoch, then --resume: the averager goes on counting where it stopped
    shutil.copytree(tiny_exp, resumed)
    for extra in (["train.epochs=1"], ["train.epochs=2", "--resume"]):
        run_learners(train_learner, 2, ["--exp", str(resumed), "--ds-config", str(tmp_path / "ds.json"), *TINY,
                                        *extra])

    def schedule(records):  # what the averager did, epoch by epoch
        return [(r["averaging_rounds"], r["averaging_grad_allreduces"], r["consensus_distance"] == 0) for r in records]

    assert schedule(train_log(resumed)) == schedule(log)


def test_the_emulated_link_counts_one_ring_allreduce_per_sync_step_and_per_localsgd_average():
    from comm.sync import emulate_ring_allreduce

    layout, link = ProcessLayout(world_size=4, local_size=2, nodes=2), {"bandwidth_gbps": 8000.0, "latency_ms": 0.0}
    sync = build_strategy({"strategy": "sync", "link": link}, layout)
    local = build_strategy({"strategy": "localsgd", "link": link}, layout)
    for strategy in (sync, local):
        strategy.model_bytes = 1000.0
    sync.after_step(None)
    emulate_ring_allreduce(local)
    # 2 (W - 1) / W of the model along each link, `nodes` of W links cross: this learner's share is 1/W of that
    assert sync.boundary_bytes == local.boundary_bytes == 2 * 3 / 4 * 1000.0 * 2 / 4


def warm_up_step_with_one_bad_learner(rank: int, world: int) -> dict:
    """One warm-up step of LOCALSGD where learner 1's batch is NaN: learner 0's own gradient is finite, their
    average is not -> what train_step says of the step on each learner, and whether the weights moved."""
    from comm import ProcessLayout, build_strategy, init_distributed
    from model.lstm import LSTMAcousticModel
    from recipe.lib.engine import SGD, build_engine, train_step

    init_distributed()
    strategy = build_strategy({"strategy": "localsgd", "warmup_steps": 3}, ProcessLayout.from_env())
    torch.manual_seed(0)
    model = LSTMAcousticModel(input_dim=12, output_dim=6, layers=1, hidden=16, stack=2)
    engine = build_engine(model, SGD(model.parameters(), lr=0.1), {"train_micro_batch_size_per_gpu": 3}, strategy)
    before = torch.cat([p.detach().flatten().clone() for p in engine.module.parameters()])
    feats = torch.full((3, 20, 12), float("nan")) if rank == 1 else torch.randn(3, 20, 12)
    batch = {"feats": feats, "lengths": torch.tensor([20, 18, 16]), "targets": torch.randint(1, 6, (6,)),
             "target_lengths": torch.tensor([2, 2, 2])}
    step = train_step(engine, strategy, batch)
    after = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
    strategy.close()
    return {"applied": step.applied, "moved": not torch.equal(before, after)}


@pytest.mark.slow
def test_a_warm_up_step_skipped_for_another_learners_gradient_counts_as_skipped():
    # until stop 34, learner 0 reported the step applied (its own gradient was finite): skipped_steps undercounted
    assert run_learners(warm_up_step_with_one_bad_learner, 2) == [{"applied": False, "moved": False}] * 2
