"""The training loop's pieces that need no learner processes: the TrainState and the no-learning warning."""

from __future__ import annotations

from recipe.train import TrainState, no_learning


def test_train_state_round_trips_through_a_checkpoint():
    state = TrainState(epoch=2, wall_s=12.5, frames=1000, skipped_steps=1, history=[{"epoch": 1}, {"epoch": 2}])
    again = TrainState()
    again.load_state_dict(state.state_dict())
    assert again == state


def test_a_blank_or_wrong_model_is_never_silent():
    learned = {"epoch": 3, "cer": 0.02, "empty_output": 0.0}
    assert no_learning(learned, 300) is None
    blank = no_learning({"epoch": 4, "cer": 1.0, "empty_output": 0.97}, 240)
    assert blank.startswith("no learning yet after epoch 4 (240 optimizer updates): 97% of the dev outputs are "
                            "empty (CTC's all-blank plateau). Try more updates")
    assert "model.stack" in blank and "tokens.txt" in blank
    assert "the dev CER is 95.0%" in no_learning({"epoch": 1, "cer": 0.95, "empty_output": 0.1}, 60)
    assert no_learning({"epoch": 1, "frame_acc": 0.3, "heldout_loss": 2.0}, 60) is None  # CE: no CER to judge


def test_the_report_says_how_long_newbob_trained_and_why():
    # the stop reasons are the ones newbob() gives (not made up here): a run that stalled, and one that
    # annealed for newbob_anneal_epochs
    from recipe.lib.config import load_config
    from recipe.lib.schedule import newbob
    from recipe.report import schedule_summary

    optim = load_config().optim
    stalled = newbob([5.0, 4.0, 3.9, 3.9, 3.9, 3.9, 3.9], 4, 2, True, optim)
    assert stalled.stop and stalled.stop.startswith("the dev loss gained less than"), stalled
    assert schedule_summary({"epochs": 7, "schedule": "newbob", "anneal_from": 4, "stop": stalled.stop}) == \
        f"7 (newbob: annealed from epoch 4; {stalled.stop})"
    falling = [10.0 * 0.5 ** i for i in range(2 + optim.newbob_anneal_epochs)]  # annealed from epoch 3 on
    long = newbob(falling, 3, 2, True, optim)
    assert long.stop == f"{optim.newbob_anneal_epochs} annealed epochs (optim.newbob_anneal_epochs)", long
    assert schedule_summary({"epochs": 4, "schedule": "fixed"}) == "4"
    assert schedule_summary({"epochs": 40, "schedule": "newbob", "anneal_from": None, "stop": None}) == \
        "40 (newbob: never annealed; train.max_epochs reached)"