"""Word n-gram language model for shallow fusion in CTC beam search (recipe/lib/decode.py).

Estimated from the training transcripts with interpolated Kneser-Ney smoothing (one absolute discount per
order, Ney's estimate D = n1 / (n1 + 2 n2) from the count-of-counts; 0.5 where the corpus is too small to
estimate it). As in KenLM, lower orders use continuation counts (the number of distinct words seen before an
n-gram) except for n-grams that start with <s>, which nothing can precede, and the unigram level is
interpolated with a uniform distribution over the vocabulary, <unk> included: that uniform share is the
probability of an unknown word. Interpolated KN converts exactly into backoff form (the backoff weight of a
history is its interpolation weight), so the model is kept as ARPA tables and scored with the ARPA backoff
rule: one code path for a trained model and one read back from disk, which score identically.

Logarithms: the tables, like every ARPA file, hold log10; ``score`` returns the natural log, the base of the
CTC log-probabilities it is added to. Words are case-sensitive, like the character tokens.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable, Sequence

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
LN10 = math.log(10.0)
NO_PROB = -99.0  # ARPA's log10 "probability" of <s>, which is never predicted


class NgramLM:
    """A backoff n-gram model: ``logp`` maps each n-gram (tuple of words) to log10 p(last | rest), ``bow``
    maps a history to its log10 backoff weight (absent: 0, i.e. weight 1)."""

    def __init__(self, order: int, logp: dict[tuple[str, ...], float], bow: dict[tuple[str, ...], float]):
        if (UNK,) not in logp:
            raise ValueError(f"the model has no {UNK} unigram: unknown words could not be scored (make it with an "
                             f"open vocabulary: KenLM's lmplz does by default, SRILM's ngram-count with -unk)")
        self.order = order
        self.logp = logp
        self.bow = bow

    @classmethod
    def train(cls, texts: Iterable[str], order: int = 3) -> "NgramLM":
        """Estimate an interpolated Kneser-Ney model from transcripts (one sentence each, words split on
        whitespace)."""
        if order < 1:
            raise ValueError(f"order must be >= 1, got {order}")
        counts = [Counter() for _ in range(order + 1)]  # counts[n]: raw n-gram counts
        for text in texts:
            words = [BOS, *text.split(), EOS]
            for n in range(1, order + 1):
                for i in range(len(words) - n + 1):
                    counts[n][tuple(words[i:i + n])] += 1
        if not counts[1]:
            raise ValueError("no transcripts to estimate the language model from")

        # Adjusted counts: raw at the highest order and for n-grams starting with <s>; elsewhere the number of
        # distinct words seen before the n-gram (how many contexts it continues), which is what a lower order
        # is consulted for once a higher order has backed off.
        adjusted: list[dict[tuple[str, ...], int]] = [{} for _ in range(order + 1)]
        adjusted[order] = dict(counts[order])
        for n in range(order - 1, 0, -1):
            continues = Counter(g[1:] for g in counts[n + 1])
            adjusted[n] = {g: c if g[0] == BOS else continues[g] for g, c in counts[n].items()}
        adjusted[1].pop((BOS,), None)  # <s> is only ever a history

        logp: dict[tuple[str, ...], float] = {}
        bow: dict[tuple[str, ...], float] = {}
        # Unigrams: discounted continuation counts plus the discounted mass spread uniformly over the vocabulary.
        uni = adjusted[1]
        vocab = sorted({g[0] for g in uni} | {EOS, UNK})
        d = _discount(uni.values())
        total = sum(uni.values())
        uniform = d * len(uni) / total / len(vocab)
        for w in vocab:
            logp[(w,)] = math.log10(max(uni.get((w,), 0) - d, 0.0) / total + uniform)
        logp[(BOS,)] = NO_PROB

        # Higher orders: p(w | h) = (a(h w) - D) / a(h .) + gamma(h) p_lower(w | h[1:]), gamma(h) = D types(h) / a(h .)
        # with p_lower the model of one order less (backoff form, already built).
        for n in range(2, order + 1):
            grams = adjusted[n]
            d = _discount(grams.values())
            totals: dict[tuple[str, ...], int] = defaultdict(int)
            types: dict[tuple[str, ...], int] = defaultdict(int)
            for g, c in grams.items():
                totals[g[:-1]] += c
                types[g[:-1]] += 1
            gamma = {h: d * types[h] / totals[h] for h in totals}
            level = {}
            for g, c in grams.items():
                h = g[:-1]
                lower = 10.0 ** cls._backoff_log10(logp, bow, h[1:], g[-1])
                level[g] = math.log10((c - d) / totals[h] + gamma[h] * lower)
            logp.update(level)
            bow.update({h: math.log10(w) for h, w in gamma.items()})
        return cls(order, logp, bow)

    def score(self, history: Sequence[str], word: str) -> float:
        """Natural log of p(word | history). ``history``: the words before ``word`` in the sentence, without <s>
        (the sentence start is implied); ``word`` may be </s>. Words not in the vocabulary are scored as <unk>."""
        context = (BOS, *(self._known(w) for w in history))
        context = context[max(0, len(context) - (self.order - 1)):]
        return self._backoff_log10(self.logp, self.bow, context, self._known(word)) * LN10

    def sentence_score(self, text: str) -> float:
        """Natural log of the probability of a whole sentence, </s> included."""
        words = text.split()
        return sum(self.score(words[:i], w) for i, w in enumerate([*words, EOS]))

    @property
    def vocab(self) -> list[str]:
        """Every word the model can predict: the training words, </s> and <unk> (not <s>)."""
        return sorted(g[0] for g in self.logp if len(g) == 1 and g[0] != BOS)

    def _known(self, word: str) -> str:
        return word if (word,) in self.logp else UNK

    @staticmethod
    def _backoff_log10(logp, bow, context: tuple[str, ...], word: str) -> float:
        """The ARPA rule: the longest n-gram the model has, plus the backoff weights of the histories skipped."""
        total = 0.0
        while (context + (word,)) not in logp:
            if not context:
                raise KeyError(f"{word!r} is not in the language model's vocabulary")
            total += bow.get(context, 0.0)
            context = context[1:]
        return total + logp[context + (word,)]

    def save_arpa(self, path: str | Path) -> None:
        """Write the model as an ARPA file (sorted, full float precision so that reading it back is exact)."""
        by_order: dict[int, list[tuple[str, ...]]] = defaultdict(list)
        for g in self.logp:
            by_order[len(g)].append(g)
        lines = ["\\data\\"] + [f"ngram {n}={len(by_order[n])}" for n in range(1, self.order + 1)]
        for n in range(1, self.order + 1):
            lines += ["", f"\\{n}-grams:"]
            for g in sorted(by_order[n]):
                line = f"{self.logp[g]!r}\t{' '.join(g)}"
                if g in self.bow:
                    line += f"\t{self.bow[g]!r}"
                lines.append(line)
        lines += ["", "\\end\\", ""]
        Path(path).write_text("\n".join(lines), encoding="utf-8")

    @classmethod
    def load_arpa(cls, path: str | Path) -> "NgramLM":
        """Read an ARPA file (ours, or any with a <unk> unigram)."""
        logp: dict[tuple[str, ...], float] = {}
        bow: dict[tuple[str, ...], float] = {}
        order, n = 0, 0
        for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
            line = line.strip()
            if not line or line == "\\data\\" or line == "\\end\\":
                continue
            if line.startswith("ngram "):
                order = max(order, int(line[6:].split("=")[0]))
            elif line.startswith("\\") and line.endswith("-grams:"):
                n = int(line[1:-7])
            else:
                fields = line.split()
                if n == 0 or len(fields) not in (n + 1, n + 2):
                    raise ValueError(f"{path}:{lineno}: not an ARPA {n}-gram line: {line!r}")
                g = tuple(fields[1:n + 1])
                logp[g] = float(fields[0])
                if len(fields) == n + 2:
                    bow[g] = float(fields[-1])
        return cls(order, logp, bow)


def _discount(adjusted_counts: Iterable[int]) -> float:
    """Ney's absolute discount n1 / (n1 + 2 n2); 0.5 when there are no singletons or no doubletons."""
    of = Counter(adjusted_counts)
    n1, n2 = of[1], of[2]
    return n1 / (n1 + 2 * n2) if n1 and n2 else 0.5
