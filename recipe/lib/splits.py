"""A dev set carved out of the training data, when the corpus brings none (data.dev_dir unset).

Kaldi's `utils/subset_data_dir_tr_cv.sh --cv-spk-percent` holds whole speakers out, so that the dev set, like the
test set, is speech of voices training never heard. With few speakers (FSDD's five or six) one speaker is a fifth
of the data and the dev set would be a coin toss on that voice: below MIN_SPEAKERS_TO_SPLIT the dev set is a
share of every speaker's utterances instead, and says so. The choice is a pure function of the ids (and of `seed`,
which stage 1 leaves at 0): every rerun, and every training seed, gets the same split, so runs that differ in
train.seed share the prepared data and differ in nothing else.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from recipe.lib.datadir import Utterance

MIN_SPEAKERS_TO_SPLIT = 10  # whole speakers out only when one speaker is at most about a tenth of the data


def dev_size(total: int, share: float, minimum: int) -> int:
    """Utterances the dev set should have: `share` of them, at least `minimum` where at most 2 x share allows."""
    return min(max(math.ceil(share * total), minimum), math.floor(2 * share * total))


def carve_dev(utts: list[Utterance], share: float, minimum: int, seed: int = 0
              ) -> tuple[list[Utterance], list[Utterance], str]:
    """-> (training utterances left, dev utterances, how they were chosen)."""
    target = dev_size(len(utts), share, minimum)
    if target < 1:
        raise ValueError(f"{len(utts)} training utterances are too few to hold out a dev set "
                         f"(data.dev_share={share}); give one with data.dev_dir (run.sh --dev-dir)")
    by_speaker: dict[str, list[Utterance]] = defaultdict(list)
    for u in utts:
        by_speaker[u.speaker].append(u)
    rng = np.random.default_rng([seed, 7])
    if len(by_speaker) >= MIN_SPEAKERS_TO_SPLIT and len(by_speaker) < len(utts):
        held, count = set(), 0
        for speaker in rng.permutation(sorted(by_speaker)):
            if count >= target:
                break
            if count + len(by_speaker[speaker]) <= 2 * target or not held:
                held.add(str(speaker))
                count += len(by_speaker[speaker])
        how = f"{len(held)} of {len(by_speaker)} training speakers held out whole ({count} utterances)"
        dev = [u for u in utts if u.speaker in held]
    else:  # every speaker gives the same share, so the dev set sounds like the training set
        chosen = set(int(i) for i in rng.permutation(len(utts))[:target])
        dev = [u for i, u in enumerate(utts) if i in chosen]
        why = "utterances carry no speaker" if len(by_speaker) == len(utts) else \
            f"{len(by_speaker)} speakers are too few to hold whole ones out"
        how = f"{len(dev)} training utterances held out at random ({why}: the dev set's voices are seen in training)"
    kept = {u.utt for u in dev}
    return [u for u in utts if u.utt not in kept], dev, how
