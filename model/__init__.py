"""The acoustic model and its losses. No distributed code lives here."""

from model.lstm import LSTMAcousticModel, ctc_loss

__all__ = ["LSTMAcousticModel", "ctc_loss"]
