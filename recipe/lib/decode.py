"""CTC prefix beam search, optionally fused with a word n-gram language model (recipe/lib/ngram.py).

Greedy (best-path) decoding takes the single most probable frame sequence; a labelling is the sum over all
the frame sequences that collapse to it, so several mediocre paths can outweigh the best one. The prefix
beam search keeps, for each of the ``beam`` best prefixes (label sequences so far), the total probability of
the paths that produce it, split by whether they end in a blank (the next label may repeat the last one) or
not (a repeat merges into the last label). With unlimited beam it finds the most probable labelling exactly.

Shallow fusion: when a word is completed (a space is emitted after it, or the utterance ends) the score
gains ``lm_weight * ln p_LM(word | previous words) + word_bonus``; at the end, ``lm_weight * ln p_LM(</s> | ..)``
too. The bonus offsets the LM's per-word cost, which would otherwise favour dropping words. A word outside the
LM's vocabulary (scored as <unk>, which n-gram LMs price generously) also costs ``oov_penalty``, charged as soon
as its spelling stops being the start of any vocabulary word, so that a non-word (`fiv`) leaves the beam early
instead of outliving the word it misspells (pyctcdecode's ``unk_score_offset``). Prefixes are pruned to the
``beam`` best by total (acoustic + LM) score after every frame.

All scores are natural logs. Written in numpy, vectorised over the beam and the token set per frame; plain
Python was chosen over pyctcdecode (its wheel requires numpy < 2) and torchaudio's flashlight decoder (no
build for our torch).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from recipe.lib.ngram import EOS, UNK, NgramLM

NEG = -np.inf


def beam_search(log_probs, tokens: Sequence[str], beam: int = 8, lm: Optional[NgramLM] = None,
                lm_weight: float = 0.5, word_bonus: float = 0.0, oov_penalty: float = 0.0) -> str:
    """log_probs (T, V) numpy array or torch tensor of log-softmax outputs or raw logits (normalised here;
    log-softmax of log-probabilities is a no-op), ``tokens[0]`` the CTC blank, " " the word separator
    -> the best transcript, with single spaces and no leading or trailing ones (as greedy_decode)."""
    return _search(_log_softmax(log_probs), tokens, beam, _WordScorer(tokens, lm, lm_weight, word_bonus, oov_penalty))


def beam_decode(logits, lengths, tokens: Sequence[str], beam: int = 8, lm: Optional[NgramLM] = None,
                lm_weight: float = 0.5, word_bonus: float = 0.0, oov_penalty: float = 0.0) -> list[str]:
    """Batch form with greedy_decode's signature: logits (B, T, V), lengths (B,) valid frames -> B strings.
    The LM scores are cached across the batch."""
    scorer = _WordScorer(tokens, lm, lm_weight, word_bonus, oov_penalty)
    scores = _log_softmax(logits)
    return [_search(scores[b, : int(lengths[b])], tokens, beam, scorer) for b in range(len(scores))]


def _log_softmax(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor, maybe half precision or on a GPU
        x = x.detach().float().cpu().numpy()
    x = np.asarray(x, dtype=np.float64)
    top = x.max(axis=-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True))


class _WordScorer:
    """``lm_weight * ln p(word | history) + word_bonus``, cached: beams share histories, so most calls repeat;
    and the out-of-vocabulary penalty of a word being spelt."""

    def __init__(self, tokens: Sequence[str], lm: Optional[NgramLM], lm_weight: float, word_bonus: float,
                 oov_penalty: float):
        self.lm, self.lm_weight, self.word_bonus = lm, lm_weight, word_bonus
        self.keep = lm.order - 1 if lm is not None else 0  # history words that can matter
        self.cache: dict[tuple[tuple[str, ...], str], float] = {}
        self.tokens, self.oov_penalty = list(tokens), oov_penalty if lm is not None else 0.0
        self.vocab = set(lm.vocab) - {EOS, UNK} if lm is not None else set()
        self.starts = {w[:i] for w in self.vocab for i in range(len(w) + 1)}  # "" and every start of a word
        self.spelling_cache: dict[str, np.ndarray] = {}

    @property
    def active(self) -> bool:
        return self.lm is not None or self.word_bonus != 0.0

    def __call__(self, history: tuple[str, ...], word: str) -> float:
        if self.lm is None:
            return 0.0 if word == EOS else self.word_bonus
        key = (history[len(history) - self.keep:] if self.keep else (), word)
        if key not in self.cache:
            self.cache[key] = self.lm_weight * self.lm.score(key[0], word) + (0.0 if word == EOS else self.word_bonus)
        # A word that starts like a vocabulary word but ends short of one (`fiv`): its penalty is charged now.
        unpaid = word != EOS and word not in self.vocab and word in self.starts
        return self.cache[key] - (self.oov_penalty if unpaid else 0.0)

    def spelling(self, partial: str) -> np.ndarray:
        """(V,) penalties of extending the word being spelt by each token: ``oov_penalty`` for a letter after
        which no vocabulary word starts this way (charged once: a partial already off the vocabulary pays
        nothing more), 0 for the blank and the word separator (scored when the word ends)."""
        if partial not in self.spelling_cache:
            row = np.zeros(len(self.tokens))
            if partial in self.starts:
                for c, token in enumerate(self.tokens[1:], start=1):
                    if token != " " and partial + token not in self.starts:
                        row[c] = -self.oov_penalty
            self.spelling_cache[partial] = row
        return self.spelling_cache[partial]


def _search(lp: np.ndarray, tokens: Sequence[str], beam: int, word_score: Callable) -> str:
    if beam < 1:
        raise ValueError(f"beam must be >= 1, got {beam}")
    T, V = lp.shape
    space = list(tokens).index(" ") if " " in tokens else -1
    # The beam, one entry per prefix: labels (tuple of token ids), ln P(paths ending in blank / in its last
    # label), LM score of its completed words, completed words, the word being spelt.
    prefixes: list[tuple[int, ...]] = [()]
    p_b, p_nb, lm = np.zeros(1), np.full(1, NEG), np.zeros(1)
    words: list[tuple[str, ...]] = [()]
    partial = [""]
    for t in range(T):
        row = lp[t]
        last = np.array([p[-1] if p else -1 for p in prefixes])
        # Extending by label c: from a blank ending always; from a label ending only if c differs from it.
        repeat = np.arange(V)[None, :] == last[:, None]
        ext = np.logaddexp(p_b[:, None], np.where(repeat, NEG, p_nb[:, None])) + row[None, :]
        ext[:, 0] = NEG
        lm_ext, word_end = _lm_scores(lm, words, partial, word_score, V, space)
        total = ext + lm_ext
        if space >= 0:
            total[:, space] += word_end
        # Staying on the same prefix: a blank, or a repeat of the last label (merged into it).
        stay_b = np.logaddexp(p_b, p_nb) + row[0]
        stay_nb = np.where(last >= 0, p_nb + row[np.maximum(last, 0)], NEG)
        # An extension can produce a prefix already in the beam ("ab" from "a" + "b"): add it to that entry.
        index = {p: i for i, p in enumerate(prefixes)}
        for j, p in enumerate(prefixes):
            i = index.get(p[:-1]) if p else None
            if i is not None:
                stay_nb[j] = np.logaddexp(stay_nb[j], ext[i, p[-1]])
                total[i, p[-1]] = NEG
        stay_total = np.logaddexp(stay_b, stay_nb) + lm
        # Any other extension is a new prefix with a single parent, so the top `beam` of them is enough.
        flat = total.ravel()
        k = min(beam, flat.size)
        top = np.argpartition(-flat, k - 1)[:k]
        scores = np.concatenate([stay_total, flat[top]])
        order = [o for o in np.argsort(-scores, kind="stable")[:beam] if scores[o] > NEG] or [0]
        new = ([], [], [], [], [], [])
        for o in order:
            if o < len(prefixes):
                entry = (prefixes[o], stay_b[o], stay_nb[o], lm[o], words[o], partial[o])
            else:
                i, c = divmod(int(top[o - len(prefixes)]), V)
                if c == space:
                    done = (words[i] + (partial[i],), "") if partial[i] else (words[i], "")
                    entry = (prefixes[i] + (c,), NEG, ext[i, c], lm[i] + word_end[i], *done)
                else:
                    entry = (prefixes[i] + (c,), NEG, ext[i, c], lm_ext[i, c], words[i], partial[i] + tokens[c])
            for column, value in zip(new, entry):
                column.append(value)
        prefixes, p_b, p_nb, lm, words, partial = new
        p_b, p_nb, lm = np.array(p_b), np.array(p_nb), np.array(lm)

    return _best_text(prefixes, np.logaddexp(p_b, p_nb) + lm, words, partial, tokens, word_score)


def _lm_scores(lm: np.ndarray, words: list, partial: list[str], word_score: Callable, vocab: int,
               space: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (the LM score of each prefix's extension by each label, before any word it completes; the score of
    the word a space would complete, per prefix)."""
    if word_score.oov_penalty:
        lm_ext = lm[:, None] + np.stack([word_score.spelling(p) for p in partial])
    else:
        lm_ext = np.broadcast_to(lm[:, None], (len(lm), vocab))
    word_end = np.zeros(len(lm))
    if space >= 0 and word_score.active:
        word_end = np.array([word_score(w, p) if p else 0.0 for w, p in zip(words, partial)])
    return lm_ext, word_end


def _best_text(prefixes: list, scores: np.ndarray, words: list, partial: list[str], tokens: Sequence[str],
               word_score: Callable) -> str:
    """End of utterance: score the last word and </s>; prefixes that normalise to the same text add up."""
    best: dict[str, float] = {}
    for j, p in enumerate(prefixes):
        history, end = words[j], 0.0
        if partial[j]:
            end += word_score(history, partial[j])
            history += (partial[j],)
        score = scores[j] + end + word_score(history, EOS)
        text = " ".join("".join(tokens[c] for c in p).split())
        best[text] = np.logaddexp(best.get(text, NEG), score)
    return min(best, key=lambda text: (-best[text], text))
