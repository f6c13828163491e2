"""Advantages against hand-computed values and torch.std; DAPO overlong shaping against its definition."""

import math

import numpy as np
import pytest
import torch

from rlloop.advantages import group_advantages, overlong_penalty, zero_std_groups


def test_std_scaled_advantages_hand_computed():
    # group 1: rewards 1, 0, 0, 1 -> mean 0.5, sample std sqrt(1/3)
    adv = group_advantages([1, 0, 0, 1, 2, 2, 2, 2], group_size=4)
    s = math.sqrt(1 / 3)
    expected = [0.5 / (s + 1e-4), -0.5 / (s + 1e-4), -0.5 / (s + 1e-4), 0.5 / (s + 1e-4), 0, 0, 0, 0]
    np.testing.assert_allclose(adv, expected, rtol=1e-6)


def test_matches_torch_std_with_bessel():
    rng = np.random.default_rng(0)
    r = rng.normal(size=(5, 8))
    t = torch.tensor(r)
    expected = ((t - t.mean(1, keepdim=True)) / (t.std(1, keepdim=True) + 1e-4)).reshape(-1).numpy()
    np.testing.assert_allclose(group_advantages(r.reshape(-1), 8), expected, rtol=1e-5)


def test_dr_grpo_does_not_scale():
    np.testing.assert_allclose(group_advantages([1, 0, -1, 0], 2, std_scale=False), [0.5, -0.5, -0.5, 0.5])


def test_bad_group_size():
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages([1, 2, 3, 4], 3)


def test_zero_std_groups():
    assert zero_std_groups(np.array([1, 1, 0, 1, -1, -1]), 2).tolist() == [True, False, True]


def test_overlong_penalty_linear_ramp():
    # max 100, buffer 20: free up to 80, -0.5 at 90, -1 at 100
    np.testing.assert_allclose(overlong_penalty([10, 80, 90, 100, 120], 100, 20), [0, 0, -0.5, -1, -1])
    np.testing.assert_allclose(overlong_penalty([90], 100, 20, penalty=2.0), [-1.0])
    assert overlong_penalty([100], 100, 0).tolist() == [0.0]


@pytest.mark.parametrize("std_scale", [True, False])
def test_a_group_of_equal_rewards_gets_exactly_zero(std_scale):
    # 0.1 three times sums to 0.30000000000000004: r - mean is an ulp off zero, which would stop the trainer from
    # skipping the group (TrainerConfig.skip_zero_advantage).
    adv = group_advantages([0.1, 0.1, 0.1, 1.0, 0.0, 0.0], 3, std_scale=std_scale)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0] and np.all(adv[3:] != 0.0)
