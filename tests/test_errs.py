"""The decode stage's error report (recipe/evaluate.py): errs.txt aligns each reference with its hypothesis word
by word in icefall's notation, the worst utterances first; scores.json and the report's final table carry the
substitution / deletion / insertion breakdown; the decode passes advance a progress bar batch by batch.

The alignments are small enough to work by hand; the comments give them."""

from __future__ import annotations

import json

import jiwer
import numpy as np
import pytest
import torch

from model.lstm import LSTMAcousticModel
from recipe.evaluate import aligned_words, decode_sets, error_counts, error_report, evaluate, greedy_decode
from recipe.lib.config import load_config
from recipe.lib.progress import progress_bar
from recipe.report import summary_rows


def aligned(ref: str, hyp: str) -> tuple[str, int]:
    o = jiwer.process_words([ref], [hyp])
    return aligned_words(o.references[0], o.hypotheses[0], o.alignments[0])


def test_words_aligned_by_hand():
    assert aligned("the cat sat", "the cat sat") == ("the cat sat", 0)
    assert aligned("the cat sat", "the cat sad") == ("the cat (sat->sad)", 1)
    # a b c d -> a c d e: b deleted, e inserted (2 edits; substituting b->c, c->d, d->e would be 3)
    assert aligned("a b c d", "a c d e") == ("a (b->*) c d (*->e)", 2)
    assert aligned("one two", "") == ("(one->*) (two->*)", 2)  # nothing decoded: every word deleted
    assert aligned("go", "go go now") == ("go (*->go) (*->now)", 2)


def test_errs_txt_puts_the_worst_first_and_scores_break_the_errors_down():
    decoded = [("u1", "a b", "a b"), ("u2", "x y z", ""), ("u3", "p q", "p r")]
    errs, breakdown = error_report(decoded)
    header = [line for line in errs.splitlines() if line.startswith("#")]
    assert "(ref->hyp) a substitution" in " ".join(header)  # the notation is documented in the file itself
    assert [line for line in errs.splitlines() if not line.startswith("#")] == [
        "u2\t3/3\t(x->*) (y->*) (z->*)", "u3\t1/2\tp (q->r)", "u1\t0/2\ta b"]
    # words: q->r substituted, x y z deleted; characters: "p q"/"p r" 1 substituted, "x y z" 5 deleted (spaces too)
    assert breakdown == {"word_errors": {"substitutions": 1, "deletions": 3, "insertions": 0},
                         "char_errors": {"substitutions": 1, "deletions": 5, "insertions": 0}}
    assert "# 1 substitutions, 3 deletions, 0 insertions over 7 reference words" in header
    counts = error_counts([r for _, r, _ in decoded], [h for _, _, h in decoded])  # what WER and CER count
    assert sum(breakdown["word_errors"].values()) == counts["word_errors"]
    assert sum(breakdown["char_errors"].values()) == counts["char_errors"]


class Heldout:
    """What evaluate() reads of a CTCDataset: collate, scorable, texts, utt."""

    def __init__(self, n: int, dim: int = 4, tokens: int = 4):
        rng = np.random.default_rng(0)
        self.x = [torch.from_numpy(rng.normal(size=(20 + 3 * k, dim)).astype(np.float32)) for k in range(n)]
        self.texts = ["a b", "b", "a a b", "b a"][:n] * (n // 4 + 1)
        self.scorable, self.tokens, self.lengths = [True] * n, tokens, [len(x) for x in self.x]

    def utt(self, k: int) -> str:
        return f"s-{k:02d}"

    def collate(self, batch: list[int]) -> dict:
        lengths = torch.tensor([len(self.x[k]) for k in batch])
        targets = [[2 if c == "a" else 3 if c == "b" else 1 for c in self.texts[k]] for k in batch]
        return {"feats": torch.nn.utils.rnn.pad_sequence([self.x[k] for k in batch], batch_first=True),
                "lengths": lengths, "targets": torch.tensor([t for tt in targets for t in tt]),
                "target_lengths": torch.tensor([len(t) for t in targets])}


TOKENS = ["<blank>", " ", "a", "b"]


def test_evaluate_reports_each_batch_and_keeps_the_training_loops_call():
    data, model = Heldout(5), LSTMAcousticModel(4, len(TOKENS), layers=1, hidden=8)
    batches, seen = [[0, 1], [2], [3, 4]], []
    totals, decoded = evaluate(model, data, batches, TOKENS, on_batch=seen.append)
    assert seen == batches and totals["utterances"] == 5
    assert evaluate(model, data, batches, TOKENS) == (totals, decoded)  # recipe/train.py's call


class Exp:
    """What the decode stage reads of an Experiment: the tokens and the training transcripts (for the LM)."""

    tokens = TOKENS

    def __init__(self, root):
        self.root = root
        (root / "text").write_text("t1 a b\nt2 b a\n")

    def data_dir(self, split: str):
        return self.root


def decode(tmp_path, dev, test, *overrides):
    model = LSTMAcousticModel(4, len(TOKENS), layers=1, hidden=8)
    conf = load_config(None, ["decode.beam=2", "decode.lm_order=2", *overrides]).decode
    with progress_bar(enabled=False) as bar:  # no terminal: the tasks still count, nothing is drawn
        result = decode_sets(model, dev, test, Exp(tmp_path), conf, tmp_path, bar)
        tasks = [(t.description, t.completed, t.total) for t in bar.tasks]
    return result, tasks


def test_decode_stage_writes_errs_txt_and_the_breakdown(tmp_path):
    dev, test = Heldout(5), Heldout(7)
    result, tasks = decode(tmp_path, dev, test, "decode.word_bonus=0.0")
    # dev through the network once and the beam at 3 LM weights (the bonus set by hand is not searched); then
    # the test set once
    assert tasks == [("dev: greedy", 5, 5), ("dev: beam 2 at 3 LM settings", 3, 3), ("test: greedy", 7, 7)]
    assert [(r["lm_weight"], r["word_bonus"]) for r in result["dev"]["grid"]] == [(0.25, 0.0), (0.5, 0.0), (0.75, 0.0)]
    for folder, data in ((tmp_path, test), (tmp_path / "dev", dev)):
        errs = (folder / "errs.txt").read_text().splitlines()
        lines = [line.split("\t") for line in errs if not line.startswith("#")]
        assert sorted(utt for utt, *_ in lines) == [f"s-{k:02d}" for k in range(len(data.x))]
        errors = [int(count.split("/")[0]) for _, count, _ in lines]
        assert errors == sorted(errors, reverse=True)  # worst first
        words = sum(len(data.texts[k].split()) for k in range(len(data.x)))
        scores = result if data is test else result["dev"]
        assert scores["wer"] * words == pytest.approx(sum(errors))  # the same errors the WER counts
    assert (tmp_path / "hyp.txt").read_text().count("\n") == 7


def rigged(good: tuple[float, float]):
    """beam_decoder's stand-in: at the LM weight and word bonus `good` it decodes as greedy does; at any other
    setting it says nonsense, many words of it."""
    def make(conf, lm, arpa, tokens, lm_weight, word_bonus):
        if (lm_weight, word_bonus) == good:
            return greedy_decode
        return lambda logits, lengths, tokens: ["b a " * 20] * len(logits)
    return make


def test_the_dev_set_chooses_the_lm_weight_and_bonus_and_greedy_when_the_beam_loses(tmp_path, monkeypatch):
    import recipe.evaluate

    monkeypatch.setattr(recipe.evaluate, "beam_decoder", rigged((0.75, 1.0)))
    result, _ = decode(tmp_path, Heldout(5), Heldout(4))
    assert (result["decode"]["lm_weight"], result["decode"]["word_bonus"]) == (0.75, 1.0)
    assert result["decoder"] == "beam 2" and result["cer"] == result["greedy_cer"]  # the beam ties greedy: kept
    assert len(result["dev"]["grid"]) == 9
    # every setting ties: the grid's middle, the old fixed 0.5 and 2.0
    monkeypatch.setattr(recipe.evaluate, "beam_decoder", lambda *a, **k: greedy_decode)
    result, _ = decode(tmp_path, Heldout(5), Heldout(4))
    assert (result["decode"]["lm_weight"], result["decode"]["word_bonus"]) == (0.5, 2.0)
    # the beam loses to greedy at every setting: the test set is decoded greedily
    monkeypatch.setattr(recipe.evaluate, "beam_decoder", rigged((9.0, 9.0)))
    result, _ = decode(tmp_path, Heldout(5), Heldout(4))
    assert result["decoder"] == "greedy" and result["wer"] == result["greedy_wer"]
    assert result["dev"]["wer"] == result["dev"]["greedy_wer"] < min(r["wer"] for r in result["dev"]["grid"])


def test_the_final_table_gives_dev_and_test_apart_with_the_breakdown(tmp_path):
    m = {"strategy": "sync", "learners": 2, "nodes": 1, "global_batch": 16, "precision": "fp32", "params": 1000,
         "epochs": 1, "wall_s": 60.0, "train_frames_per_s": 1000.0, "heldout_loss": 1.0, "cer": 0.1, "wer": 0.2}
    (tmp_path / "decode").mkdir()
    scores = {"cer": 0.05, "wer": 0.1, "greedy_cer": 0.06, "greedy_wer": 0.12, "averaged": [], "decoder": "beam 8",
              "lm": "3-gram", "decode": {"beam": 8, "lm_order": 3, "lm_weight": 0.75, "word_bonus": 1.0},
              "dev": {"cer": 0.04, "wer": 0.08, "greedy_cer": 0.07, "greedy_wer": 0.09}}
    scores.update(error_report([("u1", "a b c", "a x c d"), ("u2", "b", "")])[1])
    (tmp_path / "decode" / "scores.json").write_text(json.dumps(scores))
    rows = dict(summary_rows(tmp_path, m, [], (("cer", "CER"), ("wer", "WER"))))
    assert rows["dev CER, last epoch (greedy)"] == "10.00%"
    assert rows["decoder, chosen on dev"] == "beam 8, LM weight 0.75, word bonus 1.0"
    assert rows["dev CER / WER, decoded"] == "4.00% / 8.00% (greedy 7.00% / 9.00%)"
    assert rows["[bold]test CER / WER, decoded once[/bold]"] == "[bold]5.00% / 10.00%[/bold] (greedy 6.00% / 12.00%)"
    # words: b->x substituted, d inserted, b (u2) deleted; chars: b->x, " d" inserted, b deleted
    assert rows["  test substitutions / deletions / insertions"] == "chars 1 / 1 / 2  words 1 / 1 / 1"
    assert rows["  each utterance aligned, worst first"].endswith("errs.txt")
