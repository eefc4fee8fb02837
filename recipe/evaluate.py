"""Held-out evaluation: CTC loss, greedy decoding, CER and WER (jiwer), summable across learners.

Used after every epoch by the training loop (each learner scores a share of the held-out set and the totals
are summed over the world) and by the recipe's evaluation stage on the final model (one process, all of it,
with per-utterance hypotheses written out).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jiwer
import torch

from model.lstm import ctc_loss
from recipe.dataset import BucketBatchSampler, CTCDataset

TOTAL_KEYS = ("loss_sum", "tokens", "char_errors", "chars", "word_errors", "words", "utterances")


def greedy_decode(logits: torch.Tensor, lengths: torch.Tensor, tokens: list[str]) -> list[str]:
    """Best path: argmax per step, merge repeats, drop blanks (index 0)."""
    best = logits.argmax(-1)  # (B, T)
    out = []
    for b in range(len(best)):
        path = best[b, : int(lengths[b])].tolist()
        chars = [tokens[t] for i, t in enumerate(path) if t != 0 and (i == 0 or t != path[i - 1])]
        out.append(" ".join("".join(chars).split()))
    return out


def error_counts(refs: list[str], hyps: list[str]) -> dict[str, int]:
    """Edit-distance counts that add up over shards (rates are computed only at the end)."""
    c = jiwer.process_characters(refs, hyps)
    w = jiwer.process_words(refs, hyps)
    return {"char_errors": c.substitutions + c.deletions + c.insertions,
            "chars": c.substitutions + c.deletions + c.hits,
            "word_errors": w.substitutions + w.deletions + w.insertions,
            "words": w.substitutions + w.deletions + w.hits}


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: CTCDataset, batches: list[list[int]], tokens: list[str]):
    """-> (totals summable over shards, [(utt, ref, hyp)])."""
    was_training = model.training
    model.eval()
    totals = dict.fromkeys(TOTAL_KEYS, 0.0)
    decoded = []
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    for batch in batches:
        b = data.collate(batch)
        logits, out_lengths = model(b["feats"].to(device, dtype), b["lengths"].to(device))
        losses = ctc_loss(logits, out_lengths, b["targets"].to(device), b["target_lengths"].to(device),
                          reduction="none")
        scorable = torch.tensor([data.scorable[k] for k in batch])  # too short for CTC: decoded, not scored
        totals["loss_sum"] += float(losses.cpu()[scorable].sum())
        totals["tokens"] += int(b["target_lengths"][scorable].sum())
        hyps = greedy_decode(logits.float().cpu(), out_lengths.cpu(), tokens)
        refs = [data.texts[k] for k in batch]
        for key, value in error_counts(refs, hyps).items():
            totals[key] += value
        totals["utterances"] += len(batch)
        decoded += [(data.utt(k), r, h) for k, r, h in zip(batch, refs, hyps)]
    model.train(was_training)
    return totals, decoded


def rates(totals: dict) -> dict[str, float]:
    return {"heldout_loss": totals["loss_sum"] / max(totals["tokens"], 1),
            "cer": totals["char_errors"] / max(totals["chars"], 1),
            "wer": totals["word_errors"] / max(totals["words"], 1)}


def main(argv=None) -> int:
    """Recipe stage: decode the held-out set with the final checkpoint; write hypotheses and scores."""
    from recipe.experiment import Experiment

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--exp", required=True)
    p.add_argument("--checkpoint", default=None, help="default: the latest in EXP/checkpoints")
    args = p.parse_args(argv)
    exp = Experiment(args.exp)
    model, meta = exp.load_model(args.checkpoint, average_last=exp.conf.decode.average_last)
    data = exp.dataset("test")
    batches = BucketBatchSampler(data.lengths, 16, shuffle=False).epoch_batches(0)
    totals, decoded = evaluate(model, data, batches, exp.tokens)
    scores = rates(totals)
    out = Path(args.exp) / "decode"
    out.mkdir(exist_ok=True)
    decoded.sort()
    (out / "hyp.txt").write_text("".join(f"{u} {h}\n" for u, _, h in decoded))
    (out / "ref.txt").write_text("".join(f"{u} {r}\n" for u, r, _ in decoded))
    result = {"checkpoint": meta["path"], "epoch": meta["epoch"], "averaged": meta.get("averaged", []),
              "utterances": len(decoded), **scores}
    (out / "scores.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
