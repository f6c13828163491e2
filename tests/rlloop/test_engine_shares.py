"""Sharing one generate call out over the engines: the time a share may take, and its stats merged back."""

import pytest

from rlloop.engine_shares import batches_in, merge_stats
from rlloop.rollout_manager import RolloutTally


@pytest.mark.parametrize("samples, want", [(1, 1), (256, 1), (257, 2), (480, 2), (15360, 60), (0, 1)])
def test_a_generation_may_take_the_timeout_once_for_each_full_batch(samples, want):
    assert batches_in(samples, 256) == want


def engine_stats(pad: int, slots: int, busy: float, tokens: float, seconds: float, compiles: float = 0.0) -> dict:
    """What a JAX engine's stats() says of one generate call (the fields merging reads)."""
    return dict(
        compiles=compiles,
        pad_slots=float(pad),
        padded_slots=float(slots),
        busy_s=busy,
        gen_tokens=tokens,
        wall_s=seconds,
    )


def test_merged_stats_add_counts_and_keep_the_slowest_engine():
    merged = merge_stats({0: engine_stats(100, 1200, 2.0, 100.0, 2.5, 1.0), 1: engine_stats(300, 500, 3.0, 100.0, 3.2)})
    assert merged["compiles"] == 1.0 and merged["busy_s"] == 3.0
    # padding over every slot run: engine 0's long prefills weigh 1200, engine 1's 500, whatever tokens each made
    assert merged["pad_slots"] / merged["padded_slots"] == pytest.approx(400 / 1700)


def test_a_steps_rounds_add_up_per_engine_and_padding_weighs_by_slots():
    """Dynamic sampling's rounds (or fully_async's chunks) of one step: each engine's busy time is its sum over them,
    its tokens/s its tokens over its generate seconds; a top-up round on engine 0 alone counts toward engine 0."""
    tally = RolloutTally()
    rounds = [
        {0: engine_stats(100, 1200, 3.0, 300.0, 3.0), 1: engine_stats(300, 500, 2.0, 100.0, 2.0)},
        {0: engine_stats(10, 100, 0.5, 50.0, 0.5)},
    ]
    for r in rounds:
        tally.add([], {**merge_stats(r), "wall_s": max(s["wall_s"] for s in r.values())})
    got = tally.metrics()
    assert got["perf/pad_frac"] == pytest.approx(410 / 1800)
    assert got["perf/rollout_busy_s"] == 3.5  # the slowest engine of each round
    assert got["rollout/engine_0/busy_s"] == 3.5 and got["rollout/engine_1/busy_s"] == 2.0
    assert got["rollout/engine_0/tok_per_s"] == pytest.approx(350 / 3.5)
    assert got["rollout/engine_1/tok_per_s"] == pytest.approx(100 / 2.0)

    one = RolloutTally()  # one engine: no per-engine metrics
    one.add([], {**merge_stats({0: engine_stats(1, 10, 1.0, 5.0, 1.0)}), "wall_s": 1.0})
    assert not any(k.startswith("rollout/engine_") for k in one.metrics())


def test_each_engine_samples_its_share_with_a_seed_of_its_own():
    """Engine 0 keeps the call's seed (one engine samples as the call says); every other engine mixes in its index,
    so two engines' shares never draw the same random stream row for row."""
    from rlloop.engine_shares import share_sampling
    from rollout import SamplingParams, mix_seed

    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=1234)
    shares = [share_sampling(sampling, e) for e in range(4)]
    assert shares[0] == sampling
    assert [s.seed for s in shares[1:]] == [mix_seed(1234, e) for e in (1, 2, 3)]
    assert len({s.seed for s in shares}) == 4
    assert all(s.max_new_tokens == 8 and s.temperature == 1.0 for s in shares)  # only the seed differs


def test_an_engines_tokens_per_second_are_over_its_generate_seconds_not_its_busy_seconds():
    """rollout/engine_N/tok_per_s is tokens over the seconds of the engine's generate calls (wall_s), which include
    what its busy_s leaves out (host-side scheduling): with the two apart, the rate follows wall_s."""
    tally = RolloutTally()
    rounds = [
        {0: engine_stats(0, 100, 1.0, 300.0, 4.0), 1: engine_stats(0, 100, 2.0, 100.0, 2.5)},
        {0: engine_stats(0, 100, 0.5, 60.0, 2.0), 1: engine_stats(0, 100, 0.5, 50.0, 0.5)},
    ]
    for r in rounds:
        tally.add([], {**merge_stats(r), "wall_s": max(s["wall_s"] for s in r.values())})
    got = tally.metrics()
    assert got["rollout/engine_0/busy_s"] == 1.5 and got["rollout/engine_1/busy_s"] == 2.5
    assert got["rollout/engine_0/tok_per_s"] == pytest.approx((300 + 60) / (4.0 + 2.0))
    assert got["rollout/engine_1/tok_per_s"] == pytest.approx((100 + 50) / (2.5 + 0.5))
