"""The loop's own time in a step (perf/other_s), from the step's parts."""

import pytest

from rlloop.step_clock import step_overhead


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_other_s_is_the_step_time_outside_the_rollout_wait_train_sync_and_eval(mode):
    """perf/other_s, from first principles: a 10 s step that spent 3 s training, 0.5 s syncing and 2 s evaluating,
    and, in the async modes, waited 1 s for its batch (its 6 s of generation overlapped the training before it, so
    they are not the driver's time), in sync mode generated for 1 s: 3.5 s were the loop's own, 35%."""
    m = {"perf/step_s": 10.0, "perf/train_s": 3.0, "perf/sync_s": 0.5, "perf/eval_s": 2.0}
    m.update({"perf/rollout_s": 1.0} if mode == "sync" else {"perf/rollout_s": 6.0, "perf/rollout_wait_s": 1.0})
    assert step_overhead(m) == pytest.approx({"perf/other_s": 3.5, "perf/other_frac": 0.35})
