"""The larger-than-memory benchmark (recipe/tools/scale_bench.py) at a tiny size: the corpus generator and the
memory measurement of a learner trained under RLIMIT_DATA."""

from __future__ import annotations

import numpy as np
import pytest

from recipe.tools.scale_bench import DIM, MAX_FRAMES, MIN_FRAMES, measure, utterance_lengths


@pytest.mark.parametrize("size_bytes", [2e6, 20e6, 0.5e9])
def test_utterance_lengths_add_up_to_the_requested_size(size_bytes):
    lengths = utterance_lengths(size_bytes)
    assert lengths.min() >= MIN_FRAMES and lengths.max() <= MAX_FRAMES
    assert abs(lengths.sum() * DIM * 4 - size_bytes) <= 0.05 * size_bytes
    np.testing.assert_array_equal(lengths, utterance_lengths(size_bytes))  # the same corpus for the same seed


@pytest.mark.slow
def test_trains_under_the_limit_and_reports_peak_rss(tmp_path):
    row = measure(tmp_path, 0.02, limit_gb=2.0)
    assert row["utterances"] > 0 and row["frames"] * DIM * 4 == pytest.approx(0.02e9, rel=0.05)
    assert row["trained_frames"] == row["frames"]  # one learner, one epoch: every chunk once
    assert 0 < row["peak_rss_mb"] < 2e3  # MB, under the 2 GB limit
    assert row["frames_per_s"] > 0
