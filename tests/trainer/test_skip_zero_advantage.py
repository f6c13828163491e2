"""Samples with a zero advantage are skipped (`TrainerConfig.skip_zero_advantage`) without changing the update: the
gradient, the loss and AdamW's step equal the ones computed over every sample, in every aggregation, with a row per
sample or per prompt."""

import numpy as np
import pytest
import torch

from tests.trainer.conftest import random_batch
from tests.trainer.test_shared_prompts import grpo_batch
from trainer import LossConfig, TrainBatch, Trainer, TrainerConfig


def with_zero_advantages(batch: TrainBatch, zeroed: list[int]) -> TrainBatch:
    advantages = [0.0 if i in zeroed else a for i, a in enumerate(batch.advantages)]
    return TrainBatch(batch.prompts, batch.responses, advantages, batch.rollout_logprobs)


def pair(model_dir, **kwargs) -> tuple[Trainer, Trainer]:
    """Two trainers from the same weights, one skipping zero-advantage samples and one computing them."""
    return tuple(Trainer(TrainerConfig(str(model_dir), skip_zero_advantage=s, **kwargs)) for s in (True, False))


@pytest.mark.parametrize("share_prompts", [False, True])
@pytest.mark.parametrize("agg", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_skipping_zero_advantages_leaves_the_gradient_unchanged(tiny_qwen3_dir, agg, share_prompts):
    batch = grpo_batch(5) if share_prompts else random_batch(9, seed=3)
    # The longest response among the skipped: dr_grpo's normaliser must still see it.
    longest = max(range(len(batch)), key=lambda i: len(batch.responses[i]))
    zeroed = sorted({longest, *range(0, len(batch), 3)})
    batch = with_zero_advantages(batch, zeroed)
    skip, full = pair(tiny_qwen3_dir, micro_batch_tokens=30, share_prompts=share_prompts, loss=LossConfig(loss_agg=agg))
    old = [(np.asarray(lp) - 0.3).tolist() for lp in full.compute_logprobs(batch.prompts, batch.responses)]

    g_skip, m_skip = skip.compute_gradients(batch, old)
    g_full, m_full = full.compute_gradients(batch, old)
    assert m_skip["train/skipped_samples"] == len(zeroed) and m_full["train/skipped_samples"] == 0
    skipped_tokens = sum(len(batch.responses[i]) for i in zeroed)
    assert m_skip["train/tokens"] == m_full["train/tokens"] - skipped_tokens
    assert g_skip.keys() == g_full.keys()
    for name in g_full:
        torch.testing.assert_close(g_skip[name], g_full[name], atol=1e-6, rtol=1e-5, msg=name)
    for key in ("train/loss", "train/pg_loss"):
        assert m_skip[key] == pytest.approx(m_full[key], rel=1e-5, abs=1e-7), key


def test_a_step_with_every_advantage_zero_still_takes_adamws_step(tiny_qwen3_dir):
    """Nothing is forwarded, yet momentum and weight decay move the weights exactly as after a zero gradient."""
    skip, full = pair(tiny_qwen3_dir, lr=1e-2, weight_decay=0.1, minibatches=2)
    first = random_batch(8, seed=1)
    idle = with_zero_advantages(random_batch(8, seed=2), list(range(8)))
    for trainer in (skip, full):
        trainer.train_step(first)
    before = {k: v.copy() for k, v in skip.export_weights().items()}
    m_skip, m_full = skip.train_step(idle), full.train_step(idle)
    assert m_skip["train/skipped_samples"] == 8 and m_skip["train/micro_batches"] == 0
    assert "train/entropy" not in m_skip and "train/entropy" in m_full  # no trained token to average over
    assert m_full["train/micro_batches"] > 0 and m_skip["train/minibatches"] == 2
    after_skip, after_full = skip.export_weights(), full.export_weights()
    assert max(float(np.abs(after_skip[k] - before[k]).max()) for k in before) > 1e-4
    for key, value in after_full.items():
        np.testing.assert_allclose(after_skip[key], value, atol=1e-7, rtol=0, err_msg=key)


@pytest.mark.parametrize("loss", [LossConfig(kl_coef=0.05), LossConfig(entropy_coef=0.01)])
def test_a_kl_or_entropy_term_trains_zero_advantage_samples(tiny_qwen3_dir, loss):
    """Their loss is then not zero: nothing may be skipped."""
    batch = with_zero_advantages(random_batch(6, seed=4), [0, 1, 2])
    trainer = Trainer(TrainerConfig(str(tiny_qwen3_dir), loss=loss))
    _, metrics = trainer.compute_gradients(batch)
    assert metrics["train/skipped_samples"] == 0
    assert metrics["train/tokens"] == sum(map(len, batch.responses))
