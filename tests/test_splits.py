"""The dev set carved out of the training data (recipe/lib/splits.py) and the splits' checks in stage 1."""

from __future__ import annotations

import pytest

from recipe.lib.datadir import Utterance
from recipe.lib.splits import carve_dev, dev_size
from recipe.lib.tables import DataError
from recipe.prepare import check_disjoint


def corpus(speakers: int, each: int, named: bool = True) -> list[Utterance]:
    return [Utterance(f"s{s:02d}-u{u:03d}", f"s{s:02d}" if named else f"s{s:02d}-u{u:03d}", "x.wav", "a b")
            for s in range(speakers) for u in range(each)]


def test_the_dev_set_is_a_share_of_at_least_the_minimum_where_the_corpus_allows():
    assert dev_size(4000, 0.05, 100) == 200  # 5%
    assert dev_size(1000, 0.05, 100) == 100  # the minimum, 10%
    assert dev_size(500, 0.05, 100) == 50  # never over 2 x the share
    assert dev_size(9, 0.05, 100) == 0


def test_many_speakers_give_whole_speakers_to_the_dev_set():
    utts = corpus(40, 10)  # 400: 40 wanted, in whole speakers of 10
    train, dev, how = carve_dev(utts, 0.05, 100)
    dev_speakers = {u.speaker for u in dev}
    assert len(dev) == 40 and len(dev_speakers) == 4 and not dev_speakers & {u.speaker for u in train}
    assert len(train) + len(dev) == 400 and "4 of 40 training speakers held out whole" in how
    assert carve_dev(utts, 0.05, 100) == (train, dev, how)  # a pure function of the ids and the seed
    assert carve_dev(utts, 0.05, 100, seed=1)[1] != dev


def test_few_speakers_or_none_give_a_share_of_the_utterances():
    train, dev, how = carve_dev(corpus(5, 100), 0.05, 100)  # FSDD's five speakers: one would be a fifth
    assert len(dev) == 50 and {u.speaker for u in dev} <= {u.speaker for u in train}
    assert "5 speakers are too few" in how and "seen in training" in how
    _, dev, how = carve_dev(corpus(40, 10, named=False), 0.05, 100)  # no utt2spk: every utterance its own
    assert len(dev) == 40 and "utterances carry no speaker" in how
    with pytest.raises(ValueError, match="9 training utterances are too few.*run.sh --dev-dir"):
        carve_dev(corpus(1, 9), 0.05, 100)


def test_a_split_that_shares_utterances_with_another_is_refused(tmp_path):
    utts = corpus(2, 3)
    sources = {"train": tmp_path / "train", "dev": tmp_path / "dev", "test": tmp_path / "test"}
    check_disjoint({"train": utts[:3], "dev": utts[3:4], "test": utts[4:]}, sources)
    with pytest.raises(DataError, match=r"dev and .*test share 1 utterance ids \(first: s01-u001\)"):
        check_disjoint({"train": utts[:3], "dev": utts[3:5], "test": utts[4:]}, sources)
