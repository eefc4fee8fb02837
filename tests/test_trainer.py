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
    from recipe.report import schedule_summary

    assert schedule_summary({"epochs": 4, "schedule": "fixed"}) == "4"
    assert schedule_summary({"epochs": 9, "schedule": "newbob", "anneal_from": 6,
                             "stop": "no new best held-out loss in the last 2 annealed epochs"}) == \
        "9 (newbob: annealed from epoch 6; no new best held-out loss in the last 2 annealed epochs)"
    assert schedule_summary({"epochs": 40, "schedule": "newbob", "anneal_from": None, "stop": None}) == \
        "40 (newbob: never annealed; train.max_epochs reached)"
