"""Held-out evaluation, summable across learners: CTC loss, decoding, CER and WER (jiwer); or, for the CE
objective, frame cross entropy and frame accuracy on the chunks (and scaled log-likelihoods for Kaldi).

Used after every epoch by the training loop on the dev set (greedy decoding; each learner scores a share and the
totals are summed over the world) and by the recipe's decode stage on the final model (one process, the weights
averaged over the best epochs if configured). The decode stage chooses on the dev set: greedy, and the beam search
with its word LM at every LM weight and word bonus of a small grid, the best of them kept; then it decodes the
test set once with that choice. Per-utterance hypotheses are written out, and errs.txt: every utterance's
reference aligned with its hypothesis, the worst first, as icefall's errs-*.txt (the dev set's under dev/):

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


def word_lm(conf, train_text: Path, out: Path) -> NgramLM | None:
    """The beam search's word LM: the user's ARPA file, or one trained on the training transcripts and saved as
    out/lm.arpa (for inspection, for the user's own decoder, and for flashlight); None without one."""
    if not conf.beam:
        return None
    if conf.lm_arpa:
        try:
            return NgramLM.load_arpa(conf.lm_arpa)
        except ValueError as err:  # a malformed line, or no <unk> (a closed-vocabulary LM)
            raise SystemExit(f"decode.lm_arpa: {conf.lm_arpa}: {err}") from None
    if not conf.lm_order:
        return None
    lm = NgramLM.train([text for text, _ in read_table(train_text).values()], order=conf.lm_order)
    lm.save_arpa(out / "lm.arpa")
    return lm


def beam_decoder(conf, lm: NgramLM | None, arpa: Path, tokens: list[str], lm_weight: float,
                 word_bonus: float) -> Callable:
    """The configured beam search over the tokens at these weights (arpa: the LM's file, for flashlight)."""
    if conf.backend == "flashlight":  # the same ARPA file, read by flashlight's KenLM
        from recipe.lib.decode_flashlight import FlashlightDecoder
        return FlashlightDecoder(arpa, tokens, beam=conf.beam, lm_weight=lm_weight, word_bonus=word_bonus)
    return partial(beam_decode, beam=conf.beam, lm=lm, lm_weight=lm_weight, word_bonus=word_bonus,
                   oov_penalty=conf.oov_penalty)


def export_loglikes(model: torch.nn.Module, data: ChunkDataset, batches: list[list[int]], counts: np.ndarray,
                    out: Path, on_batch: Callable[[list[int]], None] | None = None) -> dict:
    """CE: frame accuracy of the test set, and its scaled log-likelihoods (log posterior - log prior, the
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
# The utterances as the decode stage's decoder got them, the most word errors first. Each line: the
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


class Pass:
    """One set through the network once, decoded greedily, its outputs kept: the dev set's grid decodes them again
    at every setting, and no set is scored twice by a different model pass."""

    def __init__(self, model: torch.nn.Module, data: CTCDataset, batches: list[list[int]], tokens: list[str],
                 on_batch: Callable[[list[int]], None] | None = None):
        self.outputs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.tokens = tokens

        def greedy(logits, lengths, tokens):
            self.outputs.append((logits, lengths))
            return greedy_decode(logits, lengths, tokens)
        self.totals, self.greedy = evaluate(model, data, batches, tokens, decode=greedy, on_batch=on_batch)

    def decode(self, decoder: Callable | None) -> tuple[dict[str, float], list[tuple[str, str, str]]]:
        """-> (the scores, [(utt, ref, hyp)]) of a decoder (None: greedy's, already known)."""
        if decoder is None:
            return rates(self.totals), self.greedy
        hyps = [h for logits, lengths in self.outputs for h in decoder(logits, lengths, self.tokens)]
        refs = [r for _, r, _ in self.greedy]
        totals = {**self.totals, **error_counts(refs, hyps), "empty_hyps": sum(not h for h in hyps)}
        return rates(totals), [(u, r, h) for (u, r, _), h in zip(self.greedy, hyps)]


GRIDS = {"lm_weight": "lm_weights", "word_bonus": "word_bonuses"}  # each setting's grid in the decode section


def choose_weights(conf, lm: NgramLM | None, arpa: Path, dev: Pass, bar) -> tuple[dict, list[dict]]:
    """The LM weight and word bonus of lowest dev WER (then CER) over the grid decode.lm_weights x
    decode.word_bonuses, as Kaldi's scoring picks its LM weight; a value set by hand (decode.lm_weight, word_bonus)
    is not searched. Ties go to the setting nearest the grid's middle. -> (the choice, every setting's scores)."""
    weights = [conf.lm_weight] if conf.lm_weight is not None else list(conf.lm_weights)
    bonuses = [conf.word_bonus] if conf.word_bonus is not None else list(conf.word_bonuses)
    if lm is None:  # a beam without an LM: no weight to choose; the bonus alone (0 unless set) would only
        weights, bonuses = [0.0], [conf.word_bonus or 0.0]  # trade insertions against deletions
    task = bar.add_task(f"dev: beam {conf.beam} at {len(weights) * len(bonuses)} LM settings",
                        total=len(weights) * len(bonuses))
    rows = []
    for i, w in enumerate(weights):
        for j, b in enumerate(bonuses):
            scores, _ = dev.decode(beam_decoder(conf, lm, arpa, dev.tokens, w, b))
            off_middle = abs(i - (len(weights) - 1) / 2) + abs(j - (len(bonuses) - 1) / 2)
            rows.append({"lm_weight": w, "word_bonus": b, "cer": scores["cer"], "wer": scores["wer"],
                         "_rank": (scores["wer"], scores["cer"], off_middle)})
            bar.advance(task)
    best = min(rows, key=lambda r: r["_rank"])
    for r in rows:
        del r["_rank"]
    for key, searched in (("lm_weight", weights), ("word_bonus", bonuses)):
        if len(searched) > 1 and best[key] in (min(searched), max(searched)):
            print(f"decode: the dev set chose {key}={best[key]}, at the edge of decode.{GRIDS[key]} "
                  f"{searched}: a wider grid may do better", file=sys.stderr)
    return {"lm_weight": best["lm_weight"], "word_bonus": best["word_bonus"]}, rows


def decode_sets(model: torch.nn.Module, dev_data: CTCDataset, test_data: CTCDataset, exp, conf, out: Path,
                bar) -> dict:
    """CTC: the dev set chooses the decoder (the beam search at the grid's best LM weight and word bonus, or
    greedy where its dev WER is lower); the test set is then decoded once with it. Writes the test set's hyp.txt, ref.txt and errs.txt into
    out (the dev set's into out/dev) -> the test set's scores, greedy's beside them, the dev set's under "dev"."""
    dev_batches, test_batches = batches_of(dev_data), batches_of(test_data)
    dev = Pass(model, dev_data, dev_batches, exp.tokens, advancer(bar, "dev: greedy", dev_batches))
    chosen, grid, decoder = {"lm_weight": None, "word_bonus": None}, [], None
    lm = word_lm(conf, exp.data_dir("train") / "text", out)
    arpa = Path(conf.lm_arpa) if conf.lm_arpa else out / "lm.arpa"
    if conf.beam:
        chosen, grid = choose_weights(conf, lm, arpa, dev, bar)
        decoder = beam_decoder(conf, lm, arpa, exp.tokens, **chosen)
        beam_wer = next(r["wer"] for r in grid if all(r[k] == v for k, v in chosen.items()))
        if rates(dev.totals)["wer"] < beam_wer:  # by word errors, the figure reported: a character alone is noise
            decoder = None  # the beam lost to greedy on dev: the test set is decoded greedily
    test = Pass(model, test_data, test_batches, exp.tokens, advancer(bar, "test: greedy", test_batches))
    t0 = time.perf_counter()
    scores, decoded = test.decode(decoder)
    result = {"utterances": len(decoded), **{f"greedy_{k}": v for k, v in rates(test.totals).items()}, **scores,
              "decoder": "greedy" if decoder is None else f"beam {conf.beam}",
              "decode": {**decode_settings(conf), **chosen}, "lm": lm_used(conf),
              "beam_seconds": time.perf_counter() - t0 if decoder else None}
    dev_scores, dev_decoded = dev.decode(decoder)
    result["dev"] = {"utterances": len(dev_decoded), **{f"greedy_{k}": v for k, v in rates(dev.totals).items()},
                     **dev_scores, "grid": grid}
    write_decoded(dev_decoded, out / "dev")
    return {**result, **write_decoded(decoded, out)}


def batches_of(data) -> list[list[int]]:
    """The decode stage's batches: 16 utterances (or chunks) of similar length, in a fixed order."""
    return BucketBatchSampler(data.lengths, 16, shuffle=False).epoch_batches(0)


def write_decoded(decoded: list[tuple[str, str, str]], out: Path) -> dict:
    """hyp.txt, ref.txt and errs.txt of a decoded set -> its error breakdown."""
    out.mkdir(parents=True, exist_ok=True)
    decoded = sorted(decoded)
    errs, breakdown = error_report(decoded)
    (out / "hyp.txt").write_text("".join(f"{u} {h}\n" for u, _, h in decoded))
    (out / "ref.txt").write_text("".join(f"{u} {r}\n" for u, r, _ in decoded))
    (out / "errs.txt").write_text(errs)
    return breakdown


def main(argv=None) -> int:
    """Recipe stage: choose the decoder on the dev set, then decode the test set once; write hypotheses and scores."""
    from recipe.lib.experiment import Experiment

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--exp", required=True)
    p.add_argument("--checkpoint", default=None, help="default: the average of the decode.average_best "
                                                      "checkpoints of lowest dev loss in EXP/checkpoints")
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
    model.packed = True  # an utterance's outputs do not depend on the batch: recipe.transcribe gets the same
    dev, test = exp.dataset("dev"), exp.dataset("test")  # the test set's first read of the whole recipe
    result = {"checkpoint": meta["path"], "epoch": meta["epoch"], "averaged": meta.get("averaged", [])}
    # the bar draws only on a terminal (recipe/lib/progress.py); the log gets the scores alone
    with progress_bar(TextColumn("decode {task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeRemainingColumn()) as bar:
        if isinstance(test, ChunkDataset):
            dev_batches, test_batches = batches_of(dev), batches_of(test)
            result["dev"] = rates(evaluate_frames(model, dev, dev_batches,
                                                  on_batch=advancer(bar, "dev: frames", dev_batches)))
            result.update(export_loglikes(model, test, test_batches, exp.targets("train").counts, out,
                                          advancer(bar, "test: log-likelihoods", test_batches)))
        else:
            result.update(decode_sets(model, dev, test, exp, conf.decode, out, bar))
    (out / "scores.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    if not isinstance(test, ChunkDataset) and args.checkpoint is None and test.reader.vectors is None:
        from recipe.transcribe import Transcriber  # the one-file model: the weights and decoder chosen here
        Transcriber.from_experiment(exp.root, args.out, model).export(out / "model.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
