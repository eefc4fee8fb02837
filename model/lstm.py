"""LSTM acoustic model of Zhang et al. (ICASSP 2019): stacked (B)LSTM -> optional linear bottleneck -> output.

Shapes use B = batch, T = input frames, D = feature dims, S = stack factor, H = cells per direction, V = outputs.
Frame stacking (ESPnet's BLSTMP idea) concatenates S neighbouring frames into one LSTM step: T/S steps make
the LSTM S times cheaper, which matters for CTC on CPUs; the paper's frame-level CE keeps S = 1.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class LSTMAcousticModel(nn.Module):
    def __init__(self, input_dim: int, output_dim: int, layers: int = 3, hidden: int = 256,
                 bidirectional: bool = True, bottleneck: int = 0, dropout: float = 0.0, stack: int = 1,
                 packed: bool = False):
        super().__init__()
        self.stack = stack
        self.packed = packed
        self.lstm = nn.LSTM(input_dim * stack, hidden, num_layers=layers, bidirectional=bidirectional,
                            dropout=dropout if layers > 1 else 0.0, batch_first=True)
        width = hidden * (2 if bidirectional else 1)
        self.dropout = nn.Dropout(dropout)
        # The paper's 256-unit linear bottleneck: cuts the 32,000-way output layer's weights by 4x.
        self.bottleneck = nn.Linear(width, bottleneck) if bottleneck > 0 else None
        self.output = nn.Linear(bottleneck if bottleneck > 0 else width, output_dim)

    def output_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        return torch.div(lengths, self.stack, rounding_mode="floor")

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """feats (B, T, D), lengths (B,) -> logits (B, T/S, V), output lengths (B,)."""
        B, T, D = feats.shape
        steps = T // self.stack
        x = feats[:, : steps * self.stack].reshape(B, steps, D * self.stack)  # (B, T/S, S*D)
        out_lengths = self.output_lengths(lengths)
        if self.packed:  # names of their own: TorchScript (recipe.transcribe's export) types every name once
            packed = nn.utils.rnn.pack_padded_sequence(x, out_lengths.cpu(), batch_first=True, enforce_sorted=False)
            packed_h, _ = self.lstm(packed)
            h, _ = nn.utils.rnn.pad_packed_sequence(packed_h, batch_first=True, total_length=steps)
        else:
            # Padded batch: the backward direction starts in the padding; batches of similar length keep that
            # short (the sampler buckets by length), and CTC ignores outputs past each length.
            h, _ = self.lstm(x)  # (B, T/S, H * directions)
        h = self.dropout(h)
        if self.bottleneck is not None:
            h = self.bottleneck(h)  # (B, T/S, bottleneck)
        return self.output(h), out_lengths  # (B, T/S, V)


def ctc_loss(logits: torch.Tensor, out_lengths: torch.Tensor, targets: torch.Tensor,
             target_lengths: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """CTC with blank = 0. reduction 'mean': summed loss / summed target tokens, so every token weighs the same
    however the batch is cut; 'sum': the summed loss; 'none': per utterance (B,) (exact held-out totals)."""
    log_probs = F.log_softmax(logits.float(), dim=-1).transpose(0, 1)  # (T/S, B, V)
    if reduction == "none":
        return F.ctc_loss(log_probs, targets, out_lengths, target_lengths, blank=0, reduction="none",
                          zero_infinity=True)
    total = F.ctc_loss(log_probs, targets, out_lengths, target_lengths, blank=0, reduction="sum",
                       zero_infinity=True)
    return total / target_lengths.sum().clamp(min=1) if reduction == "mean" else total


def frame_ce_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """The paper's frame-level cross entropy: logits (B, T, V), targets (B, T) with -100 on padding.
    'mean': per target frame; 'sum': summed."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction=reduction)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
