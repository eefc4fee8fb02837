"""CTC prefix beam search (recipe/lib/decode.py) and the Kneser-Ney word n-gram LM (recipe/lib/ngram.py).

The decoding cases are small enough to work by hand; the comments give the arithmetic.
"""

import itertools
import math
import sys

import numpy as np
import pytest
import torch

from recipe.evaluate import greedy_decode
from recipe.lib.decode import beam_decode, beam_search
from recipe.lib.ngram import EOS, NgramLM

AB = ["<blank>", "a", "b"]


def frames(*probs):
    """Per-frame probabilities -> (T, V) natural-log probabilities."""
    return np.log(np.array(probs, dtype=np.float64))


def greedy(lp, tokens):
    return greedy_decode(torch.from_numpy(lp)[None], torch.tensor([len(lp)]), tokens)[0]


def labelling_probs(lp, tokens):
    """Brute force: sum the probability of every frame path into the labelling it collapses to."""
    totals = {}
    for path in itertools.product(range(lp.shape[1]), repeat=len(lp)):
        labels = [c for i, c in enumerate(path) if c != 0 and (i == 0 or c != path[i - 1])]
        text = "".join(tokens[c] for c in labels)
        totals[text] = totals.get(text, 0.0) + math.exp(sum(lp[t, c] for t, c in enumerate(path)))
    return totals


def test_summing_paths_beats_best_path():
    # Three frames, each blank .5, a .4, b .1. Best path: blank blank blank (.5^3 = .125) -> "".
    # P("a") sums the six paths a__ _a_ __a (.4*.5*.5 = .1 each), aa_ _aa (.4*.4*.5 = .08 each), aaa (.064):
    # .3 + .16 + .064 = .524 > 1/2, so "a" is the most probable labelling, although no path to it is the best.
    lp = frames(*[[0.5, 0.4, 0.1]] * 3)
    assert greedy(lp, AB) == ""
    probs = labelling_probs(lp, AB)
    assert probs["a"] == pytest.approx(0.524) and probs[""] == pytest.approx(0.125)
    assert beam_search(lp, AB, beam=4) == "a"


@pytest.mark.parametrize("seed", range(5))
def test_wide_beam_finds_the_most_probable_labelling(seed):
    # 4 frames, 2 labels: at most 1 + 2 + 4 + 8 + 16 prefixes, so a beam of 32 never prunes and must be exact.
    lp = np.log(np.random.default_rng(seed).dirichlet(np.ones(3), size=4))
    probs = labelling_probs(lp, AB)
    assert beam_search(lp, AB, beam=32) == max(probs, key=probs.get)


def test_beam_of_one_is_not_best_path():
    # Frame 1: blank .35, a .4, b .25; frame 2: blank .3, a .3, b .4. Best path a,b (.16) -> "ab".
    # Beam 1 keeps "a" (.4) after frame 1; at frame 2 "a" has a_ + aa = .12 + .12 = .24 against "ab" .16,
    # so it answers "a", which is in fact the most probable labelling: a_ + aa + _a = .24 + .105 = .345.
    lp = frames([0.35, 0.4, 0.25], [0.3, 0.3, 0.4])
    assert greedy(lp, AB) == "ab"
    assert beam_search(lp, AB, beam=1) == "a"
    probs = labelling_probs(lp, AB)
    assert max(probs, key=probs.get) == "a" and probs["a"] == pytest.approx(0.345)


CHARS = ["<blank>", " ", "a", "b", "c", "t"]


def spelt(text, last=None):
    """One frame per character at .95 (.01 for each other token); ``last``: the final frame's probabilities."""
    rows = []
    for ch in text:
        row = np.full(len(CHARS), 0.01)
        row[CHARS.index(ch)] = 0.95
        rows.append(row)
    if last is not None:
        rows.append([last.get(t, 1e-4) for t in CHARS])  # (normalised by the decoder's log-softmax)
    return np.log(np.array(rows))


def test_lm_flips_an_acoustically_close_pair():
    # "a ca" then a frame with b .5, t .4, blank .1: acoustically "a cab" beats "a cat" by ln(.5/.4) = 0.22.
    # An LM that has seen "cat" after "a" but never "cab" (an unknown word) prefers "a cat" by far more than
    # that, so at weight 1 the answer flips; at weight 0 the LM is ignored.
    lp = spelt("a ca", {"b": 0.5, "t": 0.4, "<blank>": 0.1})
    lm = NgramLM.train(["a cat", "the cat sat", "a cat sat on a mat"], order=2)
    assert lm.sentence_score("a cat") - lm.sentence_score("a cab") > math.log(0.5 / 0.4)
    assert greedy(lp, CHARS) == "a cab"
    assert beam_search(lp, CHARS, beam=8) == "a cab"
    assert beam_search(lp, CHARS, beam=8, lm=lm, lm_weight=0.0) == "a cab"
    assert beam_search(lp, CHARS, beam=8, lm=lm, lm_weight=1.0) == "a cat"
    # The same acoustics with an LM that knows "cab" instead: no flip.
    cab = NgramLM.train(["a cab", "the cab sat"], order=2)
    assert beam_search(lp, CHARS, beam=8, lm=cab, lm_weight=1.0) == "a cab"


def test_oov_penalty_is_charged_once_where_the_spelling_leaves_the_vocabulary():
    # lm_weight 0: the LM's probabilities are ignored, only its vocabulary ("a", "cat") counts.
    lm = NgramLM.train(["a cat"], order=2)
    # "a cab" beats "a cat" acoustically by ln(.5/.4) = 0.223; "cab" leaves the vocabulary at its "b".
    lp = spelt("a ca", {"b": 0.5, "t": 0.4, "<blank>": 0.1})
    assert beam_search(lp, CHARS, lm=lm, lm_weight=0.0, oov_penalty=0.15) == "a cab"
    assert beam_search(lp, CHARS, lm=lm, lm_weight=0.0, oov_penalty=0.3) == "a cat"
    # A word that stops short of a vocabulary word ("ca" of "cat") pays when it ends: "a ca" beats "a cat"
    # acoustically by ln(.6/.4) = 0.405.
    lp = spelt("a ca", {"t": 0.4, "<blank>": 0.6})
    assert beam_search(lp, CHARS, lm=lm, lm_weight=0.0, oov_penalty=0.3) == "a ca"
    assert beam_search(lp, CHARS, lm=lm, lm_weight=0.0, oov_penalty=0.6) == "a cat"
    # Once per word, not per letter: "cbt" and "cb" both left the vocabulary at "c" and pay 3 each, so the
    # acoustics decide between them ("cbt" by ln(.55/.45)); "cat" pays ln(.95/.01) = 4.55 for its "a". Charged
    # per letter, "cbt" would pay 9 and lose to "cat"; a penalty of 5 makes "cat" win either way.
    lp = spelt("cb", {"t": 0.55, "<blank>": 0.45})
    assert beam_search(lp, CHARS, lm=lm, lm_weight=0.0, oov_penalty=3.0) == "cbt"
    assert beam_search(lp, CHARS, lm=lm, lm_weight=0.0, oov_penalty=5.0) == "cat"
    # Without a penalty the same search as before.
    assert beam_search(lp, CHARS, lm=lm, lm_weight=0.0) == "cbt"


def test_word_bonus_trades_against_the_lm():
    # "a", a space, then a frame that is "b" .5 / blank .5: acoustically "a" and "a b" are equal (to within the
    # .01-probability paths). The LM prefers "a" by 0.757 nats, so one word's bonus of 0.5 leaves "a" and one
    # of 1.0 gives "a b".
    lp = spelt("a ", {"b": 0.5, "<blank>": 0.5})
    lm = NgramLM.train(["a", "a b"], order=2)
    assert lm.sentence_score("a") - lm.sentence_score("a b") == pytest.approx(0.757, abs=1e-3)
    assert beam_search(lp, CHARS, lm=lm, lm_weight=1.0, word_bonus=0.0) == "a"
    assert beam_search(lp, CHARS, lm=lm, lm_weight=1.0, word_bonus=0.5) == "a"
    assert beam_search(lp, CHARS, lm=lm, lm_weight=1.0, word_bonus=1.0) == "a b"


def test_pruning_counts_completed_words_lm_score():
    # Frames: c, a, then b .6 / t .3 / blank .1, then space .6 / blank .4. After the last frame the best prefixes
    # are "cab " (.6 * .6 = .36), "cab" (.6 * .4 = .24, its word not yet scored), "cat " (.18), "cat" (.12).
    # LM from "cat" x4: p(cat | <s>) = .927 (ln -0.076), p(<unk> | <s>) = .021 (ln -3.87). By total score the
    # 2-best are "cab" (-1.43) and "cat " (ln .18 - 0.076 = -1.79), not "cab " (ln .36 - 3.87 = -4.89); pruning
    # on the acoustic score alone would keep "cab " and "cab" and could only answer "cab".
    lp = spelt("ca", {"b": 0.6, "t": 0.3, "<blank>": 0.1})
    lp = np.concatenate([lp, np.log([[0.4, 0.6, 1e-4, 1e-4, 1e-4, 1e-4]])])
    lm = NgramLM.train(["cat"] * 4, order=2)
    assert math.exp(lm.score([], "cat")) == pytest.approx(0.927, abs=1e-3)
    assert beam_search(lp, CHARS, beam=2) == "cab"
    assert beam_search(lp, CHARS, beam=2, lm=lm, lm_weight=1.0) == "cat"


def test_prefixes_differing_only_in_spaces_add_up():
    # Two frames, each blank .35, space .35, a .3. Normalised outputs: "" from "" (__ .1225) and " " (s_ _s ss,
    # 3 x .1225); "a" from "a" (a_ _a aa: .105 + .105 + .09), " a" (.105) and "a " (.105). So P("") = .49 and
    # P("a") = .51: "a", although the single most probable prefix is " " (.3675 against "a"'s .3).
    lp = frames(*[[0.35, 0.35, 0.3]] * 2)
    assert beam_search(lp, ["<blank>", " ", "a"], beam=8) == "a"


def test_batch_matches_single_and_accepts_torch_logits():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 12, len(CHARS))) * 3  # raw scores: normalised inside
    lengths = [12, 7, 0]
    lm = NgramLM.train(["a cat", "a bat"], order=3)
    batch = beam_decode(torch.tensor(logits, dtype=torch.float32), torch.tensor(lengths), CHARS, beam=6, lm=lm)
    single = [beam_search(logits[b, :n], CHARS, beam=6, lm=lm) for b, n in enumerate(lengths)]
    assert batch == single and batch[2] == ""
    for text in batch:
        assert text == " ".join(text.split())


def test_decoding_is_deterministic():
    logits = np.random.default_rng(1).normal(size=(40, len(CHARS)))
    lm = NgramLM.train(["a cat", "a bat sat", "the cat"], order=3)
    runs = {beam_search(logits, CHARS, beam=8, lm=lm, lm_weight=0.7, word_bonus=0.5) for _ in range(3)}
    assert len(runs) == 1


# --- the language model ---

def test_kneser_ney_by_hand():
    # Sentences "<s> a b </s>", "<s> a c </s>", bigram model.
    # Bigram counts: <s> a 2, a b 1, a c 1, b </s> 1, c </s> 1 -> n1 = 4, n2 = 1, D2 = 4 / (4 + 2) = 2/3.
    # Unigram continuation counts (distinct left words): a 1 (<s>), b 1, c 1, </s> 2 (b, c); total 5,
    # n1 = 3, n2 = 1 -> D1 = 3/5; 4 words seen; uniform over {a, b, c, </s>, <unk>}: (3/5 * 4 / 5) / 5 = .096.
    # p(a) = (1 - .6) / 5 + .096 = .176 (= p(b) = p(c)); p(</s>) = 1.4 / 5 + .096 = .376; p(<unk>) = .096.
    # After "a": 2 counts of 2 types, gamma = 2/3 * 2 / 2 = 2/3: p(b | a) = (1 - 2/3) / 2 + 2/3 * .176 = .284,
    # p(</s> | a) = 2/3 * .376 = .250667; after <s>: p(a | <s>) = (2 - 2/3) / 2 + 1/3 * .176 = .725333.
    lm = NgramLM.train(["a b", "a c"], order=2)
    p = lambda h, w: math.exp(lm.score(h, w))  # noqa: E731
    assert p([], "a") == pytest.approx(0.725333, abs=1e-6)
    assert p(["a"], "b") == pytest.approx(0.284)
    assert p(["a"], EOS) == pytest.approx(0.250667, abs=1e-6)
    assert p(["zebra"], "b") == pytest.approx(0.176)  # unseen history: the unigram
    assert p(["a"], "zebra") == p(["a"], "<unk>") == pytest.approx(2 / 3 * 0.096)
    assert p(["a"], "b") > p(["c"], "b")  # seen bigram over unseen, same word


CORPUS = ["the cat sat on the mat", "a cat sat", "the dog sat on a log", "a dog", "the cat ate the rat",
          "Dogs ran", "the the cat"]


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_distributions_sum_to_one(order):
    lm = NgramLM.train(CORPUS, order=order)
    assert "<s>" not in lm.vocab and {"</s>", "<unk>", "Dogs"} <= set(lm.vocab)
    for history in [[], ["the"], ["the", "cat"], ["cat", "sat", "on"], ["unseen"], ["a", "unseen"], ["rat"]]:
        total = sum(math.exp(lm.score(history, w)) for w in lm.vocab)
        assert total == pytest.approx(1.0, abs=1e-9), history


def test_seen_ngrams_score_higher():
    lm = NgramLM.train(CORPUS, order=3)
    assert lm.score(["the"], "cat") > lm.score(["a"], "mat")
    assert lm.score(["cat"], "sat") > lm.score(["cat"], "on")
    assert lm.score(["the", "cat"], "sat") > lm.score(["a", "dog"], "sat")
    assert lm.score(["the"], "cat") > lm.score(["the"], "unseen")


def test_arpa_round_trip_and_determinism(tmp_path):
    lm = NgramLM.train(CORPUS, order=3)
    lm.save_arpa(tmp_path / "lm.arpa")
    NgramLM.train(list(CORPUS), order=3).save_arpa(tmp_path / "again.arpa")
    text = (tmp_path / "lm.arpa").read_text()
    assert text == (tmp_path / "again.arpa").read_text()
    assert text.startswith("\\data\\\nngram 1=") and text.rstrip().endswith("\\end\\")
    back = NgramLM.load_arpa(tmp_path / "lm.arpa")
    assert back.order == 3 and back.logp == lm.logp and back.bow == lm.bow
    for history in [[], ["the"], ["the", "cat"], ["on", "a"], ["unseen", "cat"]]:
        for w in lm.vocab + ["unseen"]:
            assert back.score(history, w) == lm.score(history, w)
    assert back.sentence_score("the cat sat on a mat") == lm.sentence_score("the cat sat on a mat")


def test_bad_inputs():
    with pytest.raises(ValueError):
        NgramLM.train([], order=2)
    with pytest.raises(ValueError):
        NgramLM.train(["a"], order=0)
    with pytest.raises(ValueError):
        beam_search(frames([0.5, 0.4, 0.1]), AB, beam=0)


ARPA = """\\data\\
ngram 1=5
ngram 2=3

\\1-grams:
-99 <s> -0.3
-0.6 cat -0.2
-0.6 hat -0.2
-0.7 </s>
-2.0 <unk>

\\2-grams:
-0.1 <s> cat
-0.2 cat </s>
-0.3 <s> hat

\\end\\
"""


def test_your_own_arpa_lm_replaces_the_trained_one(tmp_path):
    from recipe.evaluate import word_lm
    from recipe.lib.config import ConfigError, load_config

    (tmp_path / "lm.arpa").write_text(ARPA)
    (tmp_path / "text").write_text("u1 a dog\n")  # what a trained LM would have learned instead
    conf = load_config(None, [f"decode.lm_arpa={tmp_path / 'lm.arpa'}", "decode.oov_penalty=5"]).decode
    (tmp_path / "out").mkdir()
    lm = word_lm(conf, tmp_path / "text", tmp_path / "out")
    assert lm.vocab == ["</s>", "<unk>", "cat", "hat"]  # the file's vocabulary, for the OOV penalty too
    assert lm.score([], "cat") == pytest.approx(-0.1 * math.log(10))  # a bigram of the file
    assert lm.score(["hat"], "</s>") == pytest.approx((-0.2 - 0.7) * math.log(10))  # backoff(hat) + p(</s>)
    assert lm.score([], "dog") == pytest.approx((-0.3 - 2.0) * math.log(10))  # unknown: backoff(<s>) + p(<unk>)
    assert not (tmp_path / "out" / "lm.arpa").exists()  # nothing trained
    from recipe.evaluate import decode_settings, lm_used

    assert lm_used(conf) == str(tmp_path / "lm.arpa")  # what scores.json records, not decode.lm_order's 3
    assert decode_settings(conf)["lm_order"] is None and decode_settings(load_config(None, []).decode)["lm_order"] == 3
    assert lm_used(load_config(None, []).decode) == "3-gram of the training transcripts (lm.arpa)"
    assert lm_used(load_config(None, ["decode.beam=0", "decode.lm_order=0"]).decode) is None  # greedy: no LM
    with pytest.raises(ConfigError, match="decode.lm_arpa: .*nowhere.arpa: no such file"):
        load_config(None, [f"decode.lm_arpa={tmp_path / 'nowhere.arpa'}"])
    (tmp_path / "closed.arpa").write_text(ARPA.replace("-2.0 <unk>\n", "").replace("ngram 1=5", "ngram 1=4"))
    closed = load_config(None, [f"decode.lm_arpa={tmp_path / 'closed.arpa'}"]).decode
    with pytest.raises(SystemExit, match="closed.arpa: the model has no <unk> unigram.*ngram-count with -unk"):
        word_lm(closed, tmp_path / "text", tmp_path / "out")


def test_flashlight_backend_needs_flashlight_text_and_a_word_lm(monkeypatch):
    from recipe.lib.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="decode.backend=flashlight decodes with a word LM"):
        load_config(None, ["decode.backend=flashlight", "decode.lm_order=0"])
    monkeypatch.setitem(sys.modules, "flashlight", None)  # as if it were not installed
    with pytest.raises(ConfigError, match="pip install flashlight-text"):
        load_config(None, ["decode.backend=flashlight"])


ABCD = ["<blank>", " ", "a", "b", "c", "d"]


def spoken(*letters, p: float = 0.9):
    """One frame per letter, each followed by a blank frame: the letter (or blank) at probability p, the rest
    spread evenly. A letter may be a dict {letter: probability} for an ambiguous frame -> (T, V) log-probs."""
    rows = []
    for letter in letters:
        for target in (letter, "<blank>"):
            probs = target if isinstance(target, dict) else {target: p}
            rest = (1.0 - sum(probs.values())) / (len(ABCD) - len(probs))
            rows.append([probs.get(c, rest) for c in ABCD])
    return np.log(np.array(rows))


def test_flashlight_backend_agrees_with_the_numpy_search_on_clear_cases(tmp_path):
    """Same ARPA file, beam, LM weight and word bonus: the spoken sentences come back from both decoders; a word
    whose first letter is 50/50 between 'c' and 'b' ('cab' or 'bab', both in the LM) is settled by the LM context
    the same way by both (LM weights converted from flashlight's log10); and words need the separator between
    them: 'dad' with its last letter held two frames (a CTC repeat) is not 'dad d', nor 'da' + 'd' run together
    ('d' and 'da' are words too)."""
    pytest.importorskip("flashlight.lib.text.decoder")
    from recipe.lib.decode_flashlight import FlashlightDecoder

    lm = NgramLM.train(["ab cab", "ab cab", "ab cab", "da bab", "dad", "cab ab", "d dad", "dad d"], order=2)
    lm.save_arpa(tmp_path / "lm.arpa")
    flashlight = FlashlightDecoder(tmp_path / "lm.arpa", ABCD, beam=8, lm_weight=0.5, word_bonus=2.0)
    held = np.concatenate([spoken("d", "a")] + [np.log(np.array([[0.02, 0.02, 0.02, 0.02, 0.02, 0.9]]))] * 2)
    cases = [spoken("a", "b", " ", "c", "a", "b"), spoken("d", "a", "d"), spoken("d", "a", " ", "b", "a", "b"),
             spoken("a", "b", " ", {"c": 0.45, "b": 0.45}, "a", "b"), held]
    hyps = [flashlight(torch.from_numpy(lp)[None], torch.tensor([len(lp)]), ABCD)[0] for lp in cases]
    assert hyps == ["ab cab", "dad", "da bab", "ab cab", "dad"]
    assert hyps == [beam_search(lp, ABCD, beam=8, lm=lm, lm_weight=0.5, word_bonus=2.0) for lp in cases]


def test_flashlight_backend_without_a_word_separator_decodes_one_word(tmp_path):
    """FSDD's token set has no " ": every utterance is one word of the LM, as in the numpy search."""
    pytest.importorskip("flashlight.lib.text.decoder")
    from recipe.lib.decode_flashlight import FlashlightDecoder

    tokens = [t for t in ABCD if t != " "]
    NgramLM.train(["dad", "bab", "cab", "cab"], order=2).save_arpa(tmp_path / "lm.arpa")
    flashlight = FlashlightDecoder(tmp_path / "lm.arpa", tokens, beam=8, lm_weight=0.5, word_bonus=2.0)
    lp = np.delete(spoken({"c": 0.45, "b": 0.45}, "a", "b"), 1, axis=1)  # the " " column dropped
    lp -= np.logaddexp.reduce(lp, axis=1, keepdims=True)
    hyp = flashlight(torch.from_numpy(lp)[None], torch.tensor([len(lp)]), tokens)[0]
    assert hyp == "cab" == beam_search(lp, tokens, beam=8, lm=NgramLM.load_arpa(tmp_path / "lm.arpa"),
                                       lm_weight=0.5, word_bonus=2.0)


def test_compare_decoders_counts_identical_hypotheses_and_scores_each():
    from recipe.tools.compare_decoders import compare

    lp = torch.from_numpy(np.stack([spoken("a", "b", " ", "c", "a", "b"), spoken("d", "a", "d", " ", "d", " ")]))
    outputs = [(lp, torch.tensor([12, 12]))]
    refs, utts = ["ab cab", "dad d"], ["u1", "u2"]
    same = compare(outputs, refs, utts, ABCD, {"greedy": greedy_decode, "again": greedy_decode})
    assert same["identical"] == 2 and same["differ"] == [] and same["greedy"]["wer"] == 0.0
    dropped = compare(outputs, refs, utts, ABCD, {"greedy": greedy_decode,
                                                  "first": lambda logits, lengths, tokens: ["ab", "dad"]})
    assert dropped["identical"] == 0 and dropped["first"]["wer"] == pytest.approx(2 / 4)  # 2 of 4 words dropped
    assert dropped["differ"][1] == {"utt": "u2", "ref": "dad d", "greedy": "dad d", "first": "dad"}
