"""GRPO advantages and DAPO's reward shaping, as pure numpy functions over flat per-sample arrays.

Samples arrive grouped: G consecutive entries share one prompt (the order `RolloutEngine.generate` returns).
"""

from __future__ import annotations

import numpy as np

STD_EPS = 1e-4  # TRL's epsilon: A = (r - mean) / (std + 1e-4)


def group_advantages(rewards: np.ndarray, group_size: int, std_scale: bool = True) -> np.ndarray:
    """A = r - mean(group), divided by (std(group) + 1e-4) unless `std_scale` is off (Dr.GRPO).

    std uses Bessel's correction, as `torch.std` does. A group whose rewards are all equal gets exactly 0 (r − mean can
    be an ulp off), which is what lets the trainer skip it (`TrainerConfig.skip_zero_advantage`).
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.size % group_size:
        raise ValueError(f"{r.size} rewards do not split into groups of {group_size}")
    groups = r.reshape(-1, group_size)
    adv = groups - groups.mean(axis=1, keepdims=True)
    if std_scale:
        adv = adv / (groups.std(axis=1, ddof=1, keepdims=True) + STD_EPS)
    adv[zero_std_groups(groups, group_size)] = 0.0
    return adv.reshape(-1).astype(np.float32)


def zero_std_groups(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """One bool per group: True where every sample got the same reward (no learning signal)."""
    groups = np.asarray(rewards).reshape(-1, group_size)
    return (groups == groups[:, :1]).all(axis=1)


def overlong_penalty(lengths: np.ndarray, max_len: int, buffer: int, penalty: float = 1.0) -> np.ndarray:
    """DAPO's soft overlong punishment, added to the reward: 0 up to max_len - buffer, then falling linearly to
    -penalty at max_len (and -penalty beyond)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    if buffer <= 0:
        return np.zeros_like(lengths, dtype=np.float32)
    start = max_len - buffer
    return (-penalty * np.clip((lengths - start) / buffer, 0.0, 1.0)).astype(np.float32)
