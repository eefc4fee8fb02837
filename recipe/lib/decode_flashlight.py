"""The beam search with a word LM through flashlight-text's C++ lexicon decoder (``decode.backend=flashlight``),
an optional alternative to recipe/lib/decode.py's numpy prefix beam search.

flashlight-text is not a dependency of the recipe (``pip install flashlight-text``). Its KenLM reads the ARPA
file directly; its ``LexiconDecoder`` spells every word of the LM's vocabulary into a trie of the character
tokens. Each spelling ends with the word separator " ", so that a word is scored when the separator after it
is emitted, as in the numpy search: spelt without it, flashlight let words follow each other with no separator
and completed a one-letter word again on a CTC repeat of its letter ("six x"), 35% WER where numpy had 0.3%.
The last word has no separator after it, so one frame of certain separator is appended to every utterance. A
token set without " " (FSDD: one word per utterance) gets a separator column the model never emits, so an
utterance is one word, as in the numpy search.
What still differs from the numpy search (ACCURACY.md section 7 measures it):

- only words of the LM's vocabulary can be hypothesised: a lexicon decoder has no out-of-vocabulary spellings,
  so ``decode.oov_penalty`` has nothing to charge (an infinite penalty, in effect);
- hypotheses that reach the same decoder state (LM state, trie node) are merged by log-add, flashlight's
  approximation of the prefix beam search's sum over the paths of one prefix.

The scores are the numpy search's: KenLM returns log10, so the LM weight is multiplied by ln 10 to weigh the
natural-log LM score as ``decode.lm_weight`` does there; ``decode.word_bonus`` is flashlight's word score.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np

from recipe.lib.decode import _log_softmax
from recipe.lib.ngram import BOS, EOS, UNK

CERTAINLY_NOT = -1e30  # log-probability of the other tokens in the appended separator frame (finite for C++)
INSTALL = "decode.backend=flashlight needs flashlight-text, which the recipe does not install: pip install flashlight-text"


def _flashlight():
    try:
        from flashlight.lib.text import decoder
        from flashlight.lib.text.decoder.kenlm import KenLM
        from flashlight.lib.text.dictionary import Dictionary
    except ImportError as err:
        raise SystemExit(f"{INSTALL} ({err})") from None
    return decoder, KenLM, Dictionary


class FlashlightDecoder:
    """decode(logits, lengths, tokens) -> transcripts, as recipe/lib/decode.py's beam_decode, for one token set
    and one ARPA file. ``tokens[0]`` is the CTC blank, " " the word separator (if any)."""

    def __init__(self, arpa: str | Path, tokens: Sequence[str], beam: int = 8, lm_weight: float = 0.5,
                 word_bonus: float = 0.0):
        decoder, KenLM, Dictionary = _flashlight()
        self.tokens = list(tokens)
        # flashlight's columns: the tokens, and a separator column of its own where the tokens have none
        self.width = len(self.tokens) + (" " not in self.tokens)
        self.separator = self.tokens.index(" ") if " " in self.tokens else len(self.tokens)
        self.words = Dictionary()
        vocab = _arpa_unigrams(arpa)
        for word in vocab:
            self.words.add_entry(word)
        self.lm = KenLM(str(arpa), self.words)
        trie = self._lexicon(decoder, vocab)
        options = decoder.LexiconDecoderOptions(
            beam_size=beam, beam_size_token=self.width,
            beam_threshold=1e30,  # no score threshold: the beam width alone prunes, as in the numpy search
            lm_weight=lm_weight * math.log(10.0), word_score=word_bonus, unk_score=-math.inf, sil_score=0.0,
            log_add=True, criterion_type=decoder.CriterionType.CTC)
        unk = self.words.get_index(UNK) if self.words.contains(UNK) else -1
        self.decoder = decoder.LexiconDecoder(options, trie, self.lm, self.separator, 0, unk, [], False)

    def _lexicon(self, decoder, vocab: list[str]):
        """The trie of the vocabulary's spellings, each followed by the separator, whose node holds the word;
        interior nodes carry the best unigram score below them (smearing), so the beam sees a word's LM cost while
        it is still being spelt (replaced by the word's real LM score when it completes)."""
        index = {t: i for i, t in enumerate(self.tokens)}
        trie = decoder.Trie(self.width, self.separator)
        start = self.lm.start(False)
        for word in vocab:
            if word in (BOS, EOS, UNK) or not all(c in index and c != " " for c in word):
                continue  # not spellable with these tokens: it can never be hypothesised anyway
            _, score = self.lm.score(start, self.words.get_index(word))
            trie.insert([index[c] for c in word] + [self.separator], self.words.get_index(word), score)
        trie.smear(decoder.SmearingMode.MAX)
        return trie

    def __call__(self, logits, lengths, tokens: Sequence[str]) -> list[str]:
        if list(tokens) != self.tokens:
            raise ValueError("the decoder was built for another token set")
        separator = np.full((1, self.width), CERTAINLY_NOT, dtype=np.float32)
        separator[0, self.separator] = 0.0  # the frame that completes the last word
        out = []
        for b in range(len(logits)):
            scores = _log_softmax(logits[b, : int(lengths[b])]).astype(np.float32)
            scores = np.pad(scores, ((0, 0), (0, self.width - scores.shape[1])), constant_values=CERTAINLY_NOT)
            emissions = np.ascontiguousarray(np.concatenate([scores, separator]))
            best = self.decoder.decode(emissions.ctypes.data, len(emissions), self.width)[0]
            out.append(" ".join(self.words.get_entry(w) for w in best.words if w >= 0))
        return out


def _arpa_unigrams(path: str | Path) -> list[str]:
    """The words of an ARPA file's 1-grams section, in file order."""
    words, inside = [], False
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line.startswith("\\"):
                inside = line == "\\1-grams:"
            elif inside and line:
                words.append(line.split()[1])
    return words
