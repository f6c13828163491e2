"""Shared-prompt rows (`train.share_prompts`): one prompt then several of its samples' responses in one row give every
sample the log-prob, entropy and gradient of its own plain forward."""

import numpy as np
import pytest
import torch
import transformers

from tests.conftest import make_tiny_hf_model
from tests.trainer.test_logprobs import assert_per_sample_hf_logprobs
from trainer import Trainer, TrainerConfig
from trainer.batching import TrainBatch, collate_rows, row_length, shared_prompt_rows
from trainer.logprobs import response_logprobs
from trainer.trainer import check_shared_prompts


def grpo_batch(seed: int, group_sizes=(4, 3, 1, 2), max_response: int = 12) -> TrainBatch:
    """Groups of samples with the same prompt (prompt lengths differ between groups), interleaved the way a short
    batch or a shuffled one could be, and the first prompt coming back as a later group of its own."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 128, rng.integers(3, 14)).tolist() for _ in group_sizes]
    prompts[-1] = list(prompts[0])  # the same prompt in two groups: one row may take samples of both
    order = [g for g, size in enumerate(group_sizes) for _ in range(size)]
    rng.shuffle(order)
    responses = [rng.integers(3, 128, rng.integers(1, max_response + 1)).tolist() for _ in order]
    rollout = [(-4.8 + rng.normal(0.0, 0.3, len(r))).tolist() for r in responses]
    return TrainBatch([list(prompts[g]) for g in order], responses, rng.normal(0.0, 1.0, len(order)).tolist(), rollout)


def test_rows_group_samples_by_prompt_within_the_budget():
    batch = grpo_batch(0, group_sizes=(6, 5, 1), max_response=10)
    for budget in (10_000, 30, 1):
        rows = shared_prompt_rows(batch, list(range(len(batch))), budget)
        assert sorted(i for row in rows for i in row) == list(range(len(batch)))
        for row in rows:
            assert all(batch.prompts[i] == batch.prompts[row[0]] for i in row)
            assert len(row) == 1 or row_length(batch, row) <= budget
        if budget == 10_000:  # two distinct prompts: one row each
            assert len(rows) == 2
        if budget == 1:  # nothing fits: a sample per row
            assert all(len(row) == 1 for row in rows)


@pytest.mark.parametrize("family,attention", [("qwen3", "sdpa"), ("qwen3", "eager"), ("llama", "sdpa")])
def test_shared_rows_give_each_sample_its_own_hf_logprobs(tmp_path, family, attention):
    path = make_tiny_hf_model(tmp_path / family, family, tie=family == "qwen3", seed=4)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attention)
    model.eval()
    batch = grpo_batch(1)
    rows = shared_prompt_rows(batch, list(range(len(batch))), 10_000)
    mb = collate_rows(batch, rows)
    assert mb.segments is not None and mb.input_ids.shape[0] == len(rows) < len(batch)
    with torch.no_grad():
        logp, entropy = response_logprobs(model, mb, temperature=0.9, with_entropy=True)
    assert_per_sample_hf_logprobs(model, batch, mb, logp, entropy, 0.9)


@pytest.mark.parametrize("budget, checkpointing", [(10_000, False), (24, False), (24, True)])
def test_shared_rows_give_the_gradient_of_plain_rows(tiny_qwen3_dir, budget, checkpointing):
    """Whole-minibatch gradients and metrics agree, with one row per prompt and with groups split across rows and
    micro-batches (budget 24), padding rows included, and with activation checkpointing recomputing the layers."""
    batch = grpo_batch(2)
    plain = Trainer(TrainerConfig(str(tiny_qwen3_dir), micro_batch_tokens=budget))
    shared = Trainer(
        TrainerConfig(
            str(tiny_qwen3_dir), micro_batch_tokens=budget, share_prompts=True, gradient_checkpointing=checkpointing
        )
    )
    assert len(shared._plan(batch, list(range(len(batch))))) < len(batch)
    want, want_metrics = plain.compute_gradients(batch)
    got, got_metrics = shared.compute_gradients(batch)
    assert want.keys() == got.keys()
    for name in want:
        scale = want[name].abs().max()
        torch.testing.assert_close(got[name], want[name], atol=1e-5 * float(scale), rtol=0, msg=name)
    assert got_metrics.pop("train/micro_batches") <= want_metrics.pop("train/micro_batches")
    for key, value in want_metrics.items():
        assert got_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_shared_rows_take_the_same_training_steps(tiny_qwen3_dir):
    """Three optimizer steps (new weights each time) leave both trainers with the same weights."""
    plain = Trainer(TrainerConfig(str(tiny_qwen3_dir), lr=1e-3, micro_batch_tokens=64))
    shared = Trainer(TrainerConfig(str(tiny_qwen3_dir), lr=1e-3, micro_batch_tokens=64, share_prompts=True))
    for seed in range(3):
        want, got = plain.train_step(grpo_batch(10 + seed)), shared.train_step(grpo_batch(10 + seed))
        assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-4, abs=1e-6)
    for (name, p), q in zip(plain.model.named_parameters(), shared.model.parameters()):
        torch.testing.assert_close(q, p, atol=1e-5, rtol=0, msg=name)


def test_models_that_cannot_take_a_custom_mask_are_refused(tiny_qwen3_dir):
    config = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir).config  # attention resolved on load
    check_shared_prompts(config)  # sdpa, full attention: fine
    windowed = transformers.Qwen3Config(use_sliding_window=True, sliding_window=16, max_window_layers=0)
    windowed._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match="sliding-window"):
        check_shared_prompts(windowed)
    config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="train.share_prompts needs the model's attention"):
        check_shared_prompts(config)
