"""Non-finite steps: an update whose loss or gradient is not finite is skipped with nothing applied, the lr schedule
moves only with updates applied, and `train.max_bad_steps` such steps in a row stop training; a healthy update starts
the count again and a checkpoint keeps it."""

import math

import numpy as np
import pytest
import torch

from trainer import NonFiniteTraining, Trainer, TrainerConfig


def overflowing(make_batch, n: int = 4, seed: int = 1):
    """A batch whose advantages are finite but whose fp32 loss and gradient are not: its update is skipped."""
    batch = make_batch(n, seed=seed)
    batch.advantages = [3e38] * n
    return batch


def test_train_lr_is_the_rate_of_an_update_applied(tiny_qwen3_dir, make_batch):
    """With two minibatches the second update is skipped (its loss overflows): train/lr said the skipped update's
    rate, where it is the rate of the last update the step applied."""
    trainer = Trainer(TrainerConfig(tiny_qwen3_dir, lr=1.0, lr_warmup_steps=4, minibatches=2))
    batch = make_batch(4, seed=1)
    batch.advantages[2] = batch.advantages[3] = 3e38  # finite, but the second minibatch's fp32 loss is not
    metrics = trainer.train_step(batch)
    assert metrics["train/skipped_steps"] == 1 and metrics["train/lr"] == 0.25  # warmup: 1/4, then 2/4 skipped


def test_non_finite_steps_are_skipped_and_stop_training_after_max_bad_steps(tiny_qwen3_dir, make_batch):
    trainer = Trainer(TrainerConfig(tiny_qwen3_dir, lr=1e-3, max_bad_steps=2))
    healthy = trainer.train_step(make_batch(4, seed=1))
    assert healthy["train/skipped_steps"] == 0
    with torch.no_grad():  # one poisoned weight: every loss and gradient from here on is NaN
        trainer.model.get_decoder().norm.weight[0] = float("nan")
    before = {k: v.copy() for k, v in trainer.export_weights().items()}
    first = trainer.train_step(make_batch(4, seed=2))
    assert first["train/skipped_steps"] == 1 and not math.isfinite(first["train/grad_norm"])
    with pytest.raises(NonFiniteTraining, match=r"optimizer step 3: .* 2 optimizer steps in a row"):
        trainer.train_step(make_batch(4, seed=3))
    after = trainer.export_weights()
    assert all(np.array_equal(before[k], after[k], equal_nan=True) for k in before)  # nothing was applied


def test_a_healthy_update_restarts_the_count_of_non_finite_steps_in_a_row(tiny_qwen3_dir, make_batch):
    """Skipped, applied, skipped trains on under max_bad_steps=2: only a second skipped step in a row stops the run
    (scattered overflows must not add up to kill a healthy run)."""
    trainer = Trainer(TrainerConfig(tiny_qwen3_dir, lr=1e-3, max_bad_steps=2))
    assert trainer.train_step(overflowing(make_batch))["train/skipped_steps"] == 1
    assert trainer.train_step(make_batch(4, seed=2))["train/skipped_steps"] == 0
    assert trainer.train_step(overflowing(make_batch))["train/skipped_steps"] == 1
    with pytest.raises(NonFiniteTraining, match="2 optimizer steps in a row"):
        trainer.train_step(overflowing(make_batch))


def test_a_resumed_run_goes_on_counting_non_finite_steps_in_a_row(tmp_path, tiny_qwen3_dir, make_batch):
    """One skipped step before the save and one after the resume are two in a row, as in the run that did not stop."""
    cfg = TrainerConfig(tiny_qwen3_dir, lr=1e-3, max_bad_steps=2)
    first = Trainer(cfg)
    assert first.train_step(overflowing(make_batch))["train/skipped_steps"] == 1
    first.save(tmp_path / "ckpt")
    resumed = Trainer(cfg)
    resumed.load(tmp_path / "ckpt")
    with pytest.raises(NonFiniteTraining, match=r"optimizer step 2: .* 2 optimizer steps in a row"):
        resumed.train_step(overflowing(make_batch))


def test_a_skipped_update_does_not_advance_the_lr_schedule(tiny_qwen3_dir, make_batch):
    """The schedule counts updates applied: after the warmup's first update (1/4) and a skipped one, the next update
    applied is the warmup's second and runs at 2/4 of train.lr, not 3/4."""
    trainer = Trainer(TrainerConfig(tiny_qwen3_dir, lr=1e-3, lr_warmup_steps=4))
    assert trainer.train_step(make_batch(4, seed=1))["train/lr"] == pytest.approx(1e-3 * 1 / 4)
    skipped = trainer.train_step(overflowing(make_batch, seed=2))
    assert skipped["train/skipped_steps"] == 1 and "train/lr" not in skipped
    assert trainer.train_step(make_batch(4, seed=3))["train/lr"] == pytest.approx(1e-3 * 2 / 4)
