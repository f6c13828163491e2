"""Sharing one generate call out over the engines: the time a share may take, and its stats merged back."""

import pytest

from rlloop.engine_shares import batches_in, merge_stats


@pytest.mark.parametrize("samples, want", [(1, 1), (256, 1), (257, 2), (480, 2), (15360, 60), (0, 1)])
def test_a_generation_may_take_the_timeout_once_for_each_full_batch(samples, want):
    assert batches_in(samples, 256) == want


def test_merged_stats_add_counts_and_keep_the_slowest_engine():
    merged = merge_stats(
        {
            0: {"compiles": 1.0, "pad_frac": 0.5, "busy_s": 2.0, "gen_tokens": 100.0, "tok_s": 50.0},
            1: {"compiles": 0.0, "pad_frac": 0.0, "busy_s": 3.0, "gen_tokens": 300.0, "tok_s": 100.0},
        }
    )
    assert merged["compiles"] == 1.0 and merged["busy_s"] == 3.0
    assert merged["pad_frac"] == pytest.approx(0.5 * 100 / 400)  # weighted by the tokens each engine made
    assert merged["rollout/engine_1/tok_per_s"] == 100.0 and merged["rollout/engine_0/busy_s"] == 2.0
    assert "rollout/engine_0/tok_per_s" not in merge_stats({0: {"busy_s": 1.0}})  # one engine: no per-engine keys
