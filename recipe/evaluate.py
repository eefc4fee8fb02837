"""Held-out evaluation, summable across learners: CTC loss, decoding, CER and WER (jiwer); or, for the CE
objective, frame cross entropy and frame accuracy on the chunks (and scaled log-likelihoods for Kaldi).

Used after every epoch by the training loop (greedy decoding; each learner scores a share of the held-out set
and the totals are summed over the world) and by the recipe's decode stage on the final model (one process,
all of it, the weights averaged over the last epochs if configured, greedy and then the configured beam search
with its word LM; per-utterance hypotheses written out):

    python -m recipe.evaluate --exp EXP [--out decode] [decode.key=value ...]

The overrides change the decode settings of EXP/conf.yaml for this call only: an LM weight sweep needs no
retraining (each setting to its own --out folder).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable

import jiwer
import numpy as np
import torch
from omegaconf import OmegaConf

from model.lstm import ctc_loss, frame_ce_loss
from recipe.lib.config import load_config
from recipe.lib.dataset import BucketBatchSampler, ChunkDataset, CTCDataset
from recipe.lib.decode import beam_decode
from recipe.lib.kaldi_io import write_matrices
from recipe.lib.ngram import NgramLM
from recipe.lib.tables import read_table
from recipe.lib.targets import log_priors


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


def batch_loss(logits: torch.Tensor, out_lengths: torch.Tensor, batch: dict) -> torch.Tensor:
    """The training loss of a batch: frame cross entropy if it has frame targets (CE), else CTC."""
    device = logits.device
    if "frame_targets" in batch:
        return frame_ce_loss(logits, batch["frame_targets"].to(device))
    return ctc_loss(logits, out_lengths, batch["targets"].to(device), batch["target_lengths"].to(device))


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: CTCDataset | ChunkDataset, batches: list[list[int]], tokens: list[str],
             decode: Callable[[torch.Tensor, torch.Tensor, list[str]], list[str]] = greedy_decode):
    """-> (totals summable over shards, [(utt, ref, hyp)]). decode(logits, lengths, tokens) -> hypotheses.
    For chunks (CE): frame loss and accuracy totals, and no hypotheses."""
    if isinstance(data, ChunkDataset):
        return evaluate_frames(model, data, batches), []
    was_training = model.training
    model.eval()
    totals = dict.fromkeys(("loss_sum", "tokens", "char_errors", "chars", "word_errors", "words", "utterances"), 0.0)
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
        hyps = decode(logits.float().cpu(), out_lengths.cpu(), tokens)
        refs = [data.texts[k] for k in batch]
        for key, value in error_counts(refs, hyps).items():
            totals[key] += value
        totals["utterances"] += len(batch)
        decoded += [(data.utt(k), r, h) for k, r, h in zip(batch, refs, hyps)]
    model.train(was_training)
    return totals, decoded


@torch.no_grad()
def evaluate_frames(model: torch.nn.Module, data: ChunkDataset, batches: list[list[int]],
                    log_priors: torch.Tensor | None = None, outputs: dict | None = None) -> dict[str, float]:
    """Frame cross entropy and accuracy totals over the chunks. With `outputs` (a dict), also gathers every
    utterance's per-frame log posteriors, minus log_priors if given (scaled log-likelihoods): {row: (T, V)}."""
    was_training = model.training
    model.eval()
    totals = {"loss_sum": 0.0, "frames": 0, "correct": 0}
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    for batch in batches:
        b = data.collate(batch)
        logits, _ = model(b["feats"].to(device, dtype), b["lengths"].to(device))
        targets = b["frame_targets"].to(device)
        real = targets != -100
        totals["loss_sum"] += float(frame_ce_loss(logits, targets, reduction="sum"))
        totals["frames"] += int(real.sum())
        totals["correct"] += int(((logits.argmax(-1) == targets) & real).sum())
        if outputs is not None:
            scores = torch.log_softmax(logits.float(), -1).cpu()
            if log_priors is not None:
                scores -= log_priors
            for k, row, start, n in zip(range(len(batch)), b["rows"].tolist(), b["starts"].tolist(),
                                        b["lengths"].tolist()):
                out = outputs.setdefault(row, np.zeros((int(data.cache.frames[row]), scores.shape[-1]), np.float32))
                out[start: start + n] = scores[k, :n].numpy()
    model.train(was_training)
    return totals


def rates(totals: dict) -> dict[str, float]:
    if "frames" in totals:  # CE
        return {"heldout_loss": totals["loss_sum"] / max(totals["frames"], 1),
                "frame_acc": totals["correct"] / max(totals["frames"], 1)}
    return {"heldout_loss": totals["loss_sum"] / max(totals["tokens"], 1),
            "cer": totals["char_errors"] / max(totals["chars"], 1),
            "wer": totals["word_errors"] / max(totals["words"], 1)}


def beam_decoder(conf, train_text: Path, out: Path) -> Callable | None:
    """The configured beam search (None: greedy); its LM, trained on the training transcripts, saved as ARPA."""
    if not conf.beam:
        return None
    lm = None
    if conf.lm_order:
        texts = [text for text, _ in read_table(train_text).values()]
        lm = NgramLM.train(texts, order=conf.lm_order)
        lm.save_arpa(out / "lm.arpa")  # for inspection, or for the user's own decoder
    return partial(beam_decode, beam=conf.beam, lm=lm, lm_weight=conf.lm_weight, word_bonus=conf.word_bonus,
                   oov_penalty=conf.oov_penalty)


def export_loglikes(model: torch.nn.Module, data: ChunkDataset, batches: list[list[int]], counts: np.ndarray,
                    out: Path) -> dict:
    """CE: frame accuracy of the held-out set, and its scaled log-likelihoods (log posterior - log prior, the
    priors from the training alignments) as a Kaldi ark/scp, for the user's own graph:
    latgen-faster-mapped ... final.mdl HCLG.fst ark:OUT/loglikes.ark ark:lat.ark"""
    priors = log_priors(counts)
    outputs: dict[int, np.ndarray] = {}
    totals = evaluate_frames(model, data, batches, torch.from_numpy(priors), outputs)
    write_matrices(out / "loglikes.ark", out / "loglikes.scp",
                   ((data.cache.utts[row], outputs[row]) for row in sorted(outputs, key=lambda r: data.cache.utts[r])))
    (out / "priors.txt").write_text("[ " + " ".join(f"{p:.6g}" for p in np.exp(priors)) + " ]\n")  # Kaldi vector
    return {"utterances": len(outputs), **rates(totals), "loglikes": str(out / "loglikes.scp")}


def main(argv=None) -> int:
    """Recipe stage: decode the held-out set with the final model; write hypotheses and scores."""
    from recipe.lib.experiment import Experiment

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--exp", required=True)
    p.add_argument("--checkpoint", default=None, help="default: the latest in EXP/checkpoints (averaged over the "
                                                      "last decode.average_last)")
    p.add_argument("--out", default="decode", help="folder under EXP for the results (default: decode)")
    p.add_argument("overrides", nargs="*", help="decode.key=value over EXP/conf.yaml's decode section")
    args = p.parse_args(argv)
    exp = Experiment(args.exp)
    bad = [o for o in args.overrides if not o.startswith("decode.")]
    if bad:
        raise SystemExit(f"evaluate: only decode.* settings can change after training, not {bad}")
    conf = load_config(exp.root / "conf.yaml", args.overrides)
    out = (exp.root / args.out).resolve()  # the loglikes scp names its ark by this path
    out.mkdir(exist_ok=True)
    model, meta = exp.load_model(args.checkpoint, average_last=conf.decode.average_last)
    data = exp.dataset("test")
    batches = BucketBatchSampler(data.lengths, 16, shuffle=False).epoch_batches(0)
    about = {"checkpoint": meta["path"], "epoch": meta["epoch"], "averaged": meta.get("averaged", [])}
    if isinstance(data, ChunkDataset):
        result = {**about, **export_loglikes(model, data, batches, exp.targets("train").counts, out)}
        (out / "scores.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result))
        return 0
    totals, decoded = evaluate(model, data, batches, exp.tokens)
    result = {**about, "utterances": len(decoded), **{f"greedy_{k}": v for k, v in rates(totals).items()},
              "decode": OmegaConf.to_container(conf.decode)}
    beam = beam_decoder(conf.decode, exp.data_dir("train") / "text", out)
    if beam is not None:
        t0 = time.perf_counter()
        totals, decoded = evaluate(model, data, batches, exp.tokens, decode=beam)
        result["beam_seconds"] = time.perf_counter() - t0
    result.update(rates(totals))  # the configured decoder's scores
    decoded.sort()
    (out / "hyp.txt").write_text("".join(f"{u} {h}\n" for u, _, h in decoded))
    (out / "ref.txt").write_text("".join(f"{u} {r}\n" for u, r, _ in decoded))
    (out / "scores.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
