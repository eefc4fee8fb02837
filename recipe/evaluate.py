"""Held-out evaluation, summable across learners: CTC loss, decoding, CER and WER (jiwer); or, for the CE
objective, frame cross entropy and frame accuracy on the chunks (and scaled log-likelihoods for Kaldi).

Used after every epoch by the training loop (greedy decoding; each learner scores a share of the held-out set
and the totals are summed over the world) and by the recipe's decode stage on the final model (one process,
all of it, the weights averaged over the last epochs if configured, greedy and then the configured beam search
with its word LM; per-utterance hypotheses written out, and errs.txt: every utterance's reference aligned with
its hypothesis, the worst first, as icefall's errs-*.txt):

    python -m recipe.evaluate --exp EXP [--out decode] [decode.key=value ...]

The overrides change the decode settings of EXP/conf.yaml for this call only: an LM weight sweep needs no
retraining (each setting to its own --out folder).
"""

from __future__ import annotations

import argparse
import itertools
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
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn

from model.lstm import ctc_loss, frame_ce_loss
from recipe.lib.config import load_config
from recipe.lib.dataset import BucketBatchSampler, ChunkDataset, CTCDataset
from recipe.lib.decode import beam_decode
from recipe.lib.kaldi_io import write_matrices
from recipe.lib.ngram import NgramLM
from recipe.lib.progress import progress_bar
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


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: CTCDataset | ChunkDataset, batches: list[list[int]], tokens: list[str],
             decode: Callable[[torch.Tensor, torch.Tensor, list[str]], list[str]] = greedy_decode,
             on_batch: Callable[[list[int]], None] | None = None):
    """-> (totals summable over shards, [(utt, ref, hyp)]). decode(logits, lengths, tokens) -> hypotheses;
    on_batch(batch) after each batch (the decode stage's progress bar). For chunks (CE): frame loss and accuracy
    totals, and no hypotheses."""
    if isinstance(data, ChunkDataset):
        return evaluate_frames(model, data, batches, on_batch=on_batch), []
    was_training = model.training
    model.eval()
    totals = dict.fromkeys(("loss_sum", "tokens", "char_errors", "chars", "word_errors", "words", "utterances",
                            "empty_hyps"), 0.0)
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
        totals["empty_hyps"] += sum(not h for h in hyps)  # all blank: CTC's plateau (recipe/train.py warns)
        decoded += [(data.utt(k), r, h) for k, r, h in zip(batch, refs, hyps)]
        if on_batch is not None:
            on_batch(batch)
    model.train(was_training)
    return totals, decoded


@torch.no_grad()
def evaluate_frames(model: torch.nn.Module, data: ChunkDataset, batches: list[list[int]],
                    log_priors: torch.Tensor | None = None, outputs: dict | None = None,
                    on_batch: Callable[[list[int]], None] | None = None) -> dict[str, float]:
    """Frame cross entropy and accuracy totals over the chunks. With `outputs` (a dict), also gathers every
    utterance's per-frame log posteriors, minus log_priors if given (scaled log-likelihoods): {row: (T, V)}.
    on_batch(batch) after each batch."""
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
        if on_batch is not None:
            on_batch(batch)
    model.train(was_training)
    return totals


def rates(totals: dict) -> dict[str, float]:
    if "frames" in totals:  # CE
        return {"heldout_loss": totals["loss_sum"] / max(totals["frames"], 1),
                "frame_acc": totals["correct"] / max(totals["frames"], 1)}
    return {"heldout_loss": totals["loss_sum"] / max(totals["tokens"], 1),
            "cer": totals["char_errors"] / max(totals["chars"], 1),
            "wer": totals["word_errors"] / max(totals["words"], 1),
            "empty_output": totals["empty_hyps"] / max(totals["utterances"], 1)}


def lm_used(conf) -> str | None:
    """The beam search's LM as scores.json records it (decode.lm_order does not apply once lm_arpa is given)."""
    if not conf.beam:
        return None
    if conf.lm_arpa:
        return str(conf.lm_arpa)
    return f"{conf.lm_order}-gram of the training transcripts (lm.arpa)" if conf.lm_order else None


def decode_settings(conf) -> dict:
    """The decode section as scores.json records it: without decode.lm_order where decode.lm_arpa replaced the
    recipe's own LM (the file's order applies, not that setting)."""
    settings = OmegaConf.to_container(conf)
    if conf.lm_arpa:
        settings["lm_order"] = None
    return settings


def beam_decoder(conf, train_text: Path, out: Path, tokens: list[str]) -> Callable | None:
    """The configured beam search (None: greedy) over the tokens; its LM: the user's ARPA file, or one trained on
    the training transcripts and saved as ARPA."""
    if not conf.beam:
        return None
    lm = None
    if conf.lm_arpa:
        try:
            lm = NgramLM.load_arpa(conf.lm_arpa)
        except ValueError as err:  # a malformed line, or no <unk> (a closed-vocabulary LM)
            raise SystemExit(f"decode.lm_arpa: {conf.lm_arpa}: {err}") from None
    elif conf.lm_order:
        texts = [text for text, _ in read_table(train_text).values()]
        lm = NgramLM.train(texts, order=conf.lm_order)
        lm.save_arpa(out / "lm.arpa")  # for inspection, or for the user's own decoder
    if conf.backend == "flashlight":  # the same ARPA file, read by flashlight's KenLM
        from recipe.lib.decode_flashlight import FlashlightDecoder
        return FlashlightDecoder(conf.lm_arpa or out / "lm.arpa", tokens, beam=conf.beam, lm_weight=conf.lm_weight,
                                 word_bonus=conf.word_bonus)
    return partial(beam_decode, beam=conf.beam, lm=lm, lm_weight=conf.lm_weight, word_bonus=conf.word_bonus,
                   oov_penalty=conf.oov_penalty)


def export_loglikes(model: torch.nn.Module, data: ChunkDataset, batches: list[list[int]], counts: np.ndarray,
                    out: Path, on_batch: Callable[[list[int]], None] | None = None) -> dict:
    """CE: frame accuracy of the held-out set, and its scaled log-likelihoods (log posterior - log prior, the
    priors from the training alignments) as a Kaldi ark/scp, for the user's own graph:
    latgen-faster-mapped ... final.mdl HCLG.fst ark:OUT/loglikes.ark ark:lat.ark"""
    priors = log_priors(counts)
    outputs: dict[int, np.ndarray] = {}
    totals = evaluate_frames(model, data, batches, torch.from_numpy(priors), outputs, on_batch)
    write_matrices(out / "loglikes.ark", out / "loglikes.scp",
                   ((data.cache.utts[row], outputs[row]) for row in sorted(outputs, key=lambda r: data.cache.utts[r])))
    (out / "priors.txt").write_text("[ " + " ".join(f"{p:.6g}" for p in np.exp(priors)) + " ]\n")  # Kaldi vector
    return {"utterances": len(outputs), **rates(totals), "loglikes": str(out / "loglikes.scp")}


ERRS_HEADER = """\
# The held-out utterances as the decode stage's decoder got them, the most word errors first. Each line: the
# utterance id, its word errors / reference words, then its reference aligned with the hypothesis word by word
# in icefall's errs-*.txt notation: a correct word as it is, (ref->hyp) a substitution, (ref->*) a deletion,
# (*->hyp) an insertion.
"""


def aligned_words(ref: list[str], hyp: list[str], chunks: list) -> tuple[str, int]:
    """One utterance's word alignment (jiwer's chunks over its word lists) in icefall's notation -> (the line,
    its word errors). A substitution chunk pairs its words one to one; a deletion or insertion has one side."""
    words, errors = [], 0
    for c in chunks:
        r, h = ref[c.ref_start_idx:c.ref_end_idx], hyp[c.hyp_start_idx:c.hyp_end_idx]
        if c.type == "equal":
            words += r
        else:
            words += [f"({a}->{b})" for a, b in itertools.zip_longest(r, h, fillvalue="*")]
            errors += max(len(r), len(h))
    return " ".join(words), errors


def error_report(decoded: list[tuple[str, str, str]]) -> tuple[str, dict]:
    """[(utt, ref, hyp)] -> (the text of errs.txt, the word and character error breakdown for scores.json)."""
    refs, hyps = [r for _, r, _ in decoded], [h for _, _, h in decoded]
    w, c = jiwer.process_words(refs, hyps), jiwer.process_characters(refs, hyps)
    breakdown = {f"{unit}_errors": {"substitutions": o.substitutions, "deletions": o.deletions,
                                    "insertions": o.insertions} for unit, o in (("word", w), ("char", c))}
    lines = []
    for (utt, _, _), ref, hyp, chunks in zip(decoded, w.references, w.hypotheses, w.alignments):
        line, errors = aligned_words(ref, hyp, chunks)
        lines.append((-errors, utt, f"{utt}\t{errors}/{len(ref)}\t{line}\n"))
    totals = "".join(f"# {o.substitutions} substitutions, {o.deletions} deletions, {o.insertions} insertions over "
                     f"{o.substitutions + o.deletions + o.hits} reference {unit}\n"
                     for unit, o in (("words", w), ("characters", c)))
    return ERRS_HEADER + totals + "".join(line for *_, line in sorted(lines)), breakdown


def advancer(bar, name: str, batches: list[list[int]]) -> Callable[[list[int]], None]:
    """A task on the decode stage's progress bar, counted in utterances (chunks for CE) -> its on_batch."""
    task = bar.add_task(name, total=sum(map(len, batches)))
    return lambda batch: bar.update(task, advance=len(batch))


def decode_heldout(model: torch.nn.Module, data: CTCDataset, batches: list[list[int]], exp, conf, out: Path,
                   bar) -> dict:
    """CTC: greedy, then the configured beam search (conf: the decode section); writes hyp.txt, ref.txt and
    errs.txt of the configured decoder into out -> its scores, with greedy's beside them."""
    totals, decoded = evaluate(model, data, batches, exp.tokens, on_batch=advancer(bar, "greedy", batches))
    result = {"utterances": len(decoded), **{f"greedy_{k}": v for k, v in rates(totals).items()},
              "decode": decode_settings(conf), "lm": lm_used(conf)}
    beam = beam_decoder(conf, exp.data_dir("train") / "text", out, exp.tokens)
    if beam is not None:
        t0 = time.perf_counter()
        totals, decoded = evaluate(model, data, batches, exp.tokens, decode=beam,
                                   on_batch=advancer(bar, f"beam search ({conf.beam})", batches))
        result["beam_seconds"] = time.perf_counter() - t0
    result.update(rates(totals))  # the configured decoder's scores
    decoded.sort()
    errs, breakdown = error_report(decoded)
    (out / "hyp.txt").write_text("".join(f"{u} {h}\n" for u, _, h in decoded))
    (out / "ref.txt").write_text("".join(f"{u} {r}\n" for u, r, _ in decoded))
    (out / "errs.txt").write_text(errs)
    return {**result, **breakdown}


def main(argv=None) -> int:
    """Recipe stage: decode the held-out set with the final model; write hypotheses and scores."""
    from recipe.lib.experiment import Experiment

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--exp", required=True)
    p.add_argument("--checkpoint", default=None, help="default: the average of the decode.average_best "
                                                      "checkpoints of lowest held-out loss in EXP/checkpoints")
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
    model, meta = exp.load_model(args.checkpoint, conf.decode.average_best, conf.decode.average_within)
    data = exp.dataset("test")
    batches = BucketBatchSampler(data.lengths, 16, shuffle=False).epoch_batches(0)
    result = {"checkpoint": meta["path"], "epoch": meta["epoch"], "averaged": meta.get("averaged", [])}
    # the bar draws only on a terminal (recipe/lib/progress.py); the log gets the scores alone
    with progress_bar(TextColumn("decode {task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeRemainingColumn()) as bar:
        if isinstance(data, ChunkDataset):
            result.update(export_loglikes(model, data, batches, exp.targets("train").counts, out,
                                          advancer(bar, "log-likelihoods", batches)))
        else:
            result.update(decode_heldout(model, data, batches, exp, conf.decode, out, bar))
    (out / "scores.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
