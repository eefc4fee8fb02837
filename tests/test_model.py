"""Model shapes and the paper-sized configuration."""

from __future__ import annotations

import torch

from model.lstm import LSTMAcousticModel, count_parameters, ctc_loss
from recipe.lib.config import load_config
from recipe.lib.experiment import build_model
from tests.conftest import REPO


def lstm_params(inputs: int, hidden: int, directions: int = 2) -> int:
    return directions * 4 * hidden * (inputs + hidden + 2)  # weights W_ih, W_hh and two bias vectors per gate


def test_paper_config_size_and_a_training_step_on_cpu():
    conf = load_config(REPO / "recipe" / "conf" / "paper.yaml")
    model = build_model(conf.model, input_dim=260, output_dim=32000)
    expected = (lstm_params(260, 512) + 5 * lstm_params(1024, 512)  # 6 BLSTM layers, 512 per direction
                + (1024 * 256 + 256) + (256 * 32000 + 32000))  # 256 bottleneck, 32,000 outputs
    assert count_parameters(model) == expected
    assert 42e6 < expected < 44e6  # the paper's "about 43M"
    feats = torch.randn(2, 21, 260)  # two of the paper's 21-frame chunks
    logits, lengths = model(feats, torch.tensor([21, 21]))
    assert logits.shape == (2, 21, 32000) and lengths.tolist() == [21, 21]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 32000), torch.randint(0, 32000, (42,)))
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_frame_stacking_and_ctc_shapes():
    model = LSTMAcousticModel(input_dim=120, output_dim=30, layers=2, hidden=32, stack=3)
    logits, out_lengths = model(torch.randn(4, 100, 120), torch.tensor([100, 90, 61, 30]))
    assert logits.shape == (4, 33, 30) and out_lengths.tolist() == [33, 30, 20, 10]
    loss = ctc_loss(logits, out_lengths, torch.randint(1, 30, (20,)), torch.tensor([5, 5, 5, 5]))
    assert loss.ndim == 0 and torch.isfinite(loss)


def test_packed_and_padded_agree_on_a_full_length_batch():
    torch.manual_seed(0)
    padded = LSTMAcousticModel(input_dim=8, output_dim=5, layers=1, hidden=8, stack=1)
    packed = LSTMAcousticModel(input_dim=8, output_dim=5, layers=1, hidden=8, stack=1, packed=True)
    packed.load_state_dict(padded.state_dict())
    x, lengths = torch.randn(2, 10, 8), torch.tensor([10, 10])
    torch.testing.assert_close(padded(x, lengths)[0], packed(x, lengths)[0])


def test_dims_fixed_in_the_config_must_match_the_data():
    conf = load_config(REPO / "recipe" / "conf" / "paper.yaml")
    try:
        build_model(conf.model, input_dim=120, output_dim=32000)
    except ValueError as err:
        assert "model.input_dim=260 but the data gives 120" in str(err)
    else:
        raise AssertionError("a mismatched input_dim was accepted")
