"""Fixtures for the trainer tests: random GRPO-shaped batches over the tiny model's 128-token vocabulary."""

import numpy as np
import pytest
import torch

from trainer import TrainBatch


def random_batch(
    n: int, seed: int = 0, max_prompt: int = 9, max_response: int = 12, with_rollout_logprobs: bool = True
) -> TrainBatch:
    """Varied prompt and response lengths (so packing and padding matter), advantages of both signs."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 128, rng.integers(2, max_prompt + 1)).tolist() for _ in range(n)]
    responses = [rng.integers(3, 128, rng.integers(1, max_response + 1)).tolist() for _ in range(n)]
    advantages = rng.normal(0.0, 1.0, n).tolist()
    rollout = [(-4.8 + rng.normal(0.0, 0.3, len(r))).tolist() for r in responses] if with_rollout_logprobs else None
    return TrainBatch(prompts, responses, advantages, rollout)


def assert_fp32_backward(got_grads, bf16_grads, want_grads) -> None:
    """bf16 input gradients from an fp32 attention backward: measured in one bf16 rounding's mean error of the fp32
    reference (`want_grads`), each within 2 and together at most 0.85 of the bf16 kernel's own (`bf16_grads`, 1.7-2.3
    each)."""
    ours, bf16 = [], []
    for got, kernel, want in zip(got_grads, bf16_grads, want_grads):
        rounding = float((want.to(torch.bfloat16).float() - want).abs().mean())
        ours.append(float((got.float() - want).abs().mean()) / rounding)
        bf16.append(float((kernel.float() - want).abs().mean()) / rounding)
    assert max(ours) <= 2.0 and sum(ours) <= 0.85 * sum(bf16), (ours, bf16)


@pytest.fixture
def make_batch():
    return random_batch


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models on a shared 2-core machine: a second intra-op thread only adds contention (~3x slower here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
