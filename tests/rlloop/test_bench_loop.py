"""`python -m rlloop.bench loop`'s figures from a run's metrics: every mode timed over the same steps (not the two
that fill the async pipeline, not the last, which has no next batch to wait for), without their evaluation."""

import pytest

from rlloop.bench.loop import summarize, wide_model


def test_every_mode_is_timed_over_the_same_steps_without_evaluation():
    rows = [{"step": 0, "eval/dapo": 0.25}]  # the eval before training
    for k, step_s in enumerate([9.0, 8.0, 2.0, 3.0, 4.0, 0.5], start=1):
        rows.append(
            {"step": k, "perf/step_s": step_s, "perf/rollout_busy_s": 1.0, "perf/train_busy_s": 0.5}
            | {"rollout/raw_reward": k / 10, "rollout/staleness/mean": 1.0, "rollout/staleness/max": 1.0}
        )
    rows[4] |= {"perf/step_s": 3.0 + 1.5, "perf/eval_s": 1.5, "eval/dapo": 0.5}  # step 4: 3 s of training, 1.5 of eval
    out = summarize(rows)
    assert out["s_per_step"] == pytest.approx(3.0)  # steps 3 to 5: 2, 3 (without its eval) and 4
    assert out["rollout_busy"] == pytest.approx(3 * 1.0 / 9.0) and out["train_busy"] == pytest.approx(3 * 0.5 / 9.0)
    assert (out["eval_start"], out["eval_end"]) == (0.25, 0.5)  # the eval still counts for learning
    # 6 steps: the first and the last 3 (5 at each end overlapped: 0.3 -> 0.4, steps 2 to 5 in both)
    assert out["steps"] == 6 and out["reward_window"] == 3
    assert (out["reward_first"], out["reward_last"]) == (pytest.approx(0.2), pytest.approx(0.5))


def test_a_wide_model_made_already_is_reused(tmp_path):
    """--balanced-hidden equal to --engine-hidden asks for the same model twice (it was a FileExistsError)."""
    path = wide_model(tmp_path, 64)
    assert wide_model(tmp_path, 64) == path and (path / "config.json").exists()


def test_staleness_is_the_mean_of_the_means_and_the_max_of_the_maxima():
    rows = [{"step": 0, "eval/dapo": 0.25}]
    for k, (mean, most) in enumerate([(0.0, 0.0), (0.5, 1.0), (1.5, 3.0), (1.0, 2.0)], start=1):
        rows.append(
            {"step": k, "perf/step_s": 1.0, "perf/rollout_busy_s": 0.5, "perf/train_busy_s": 0.5}
            | {"rollout/raw_reward": 0.0, "rollout/staleness/mean": mean, "rollout/staleness/max": most}
        )
    out = summarize(rows)
    assert out["staleness_mean"] == pytest.approx((0.0 + 0.5 + 1.5 + 1.0) / 4)
    assert out["staleness_max"] == 3.0
