"""The trainer's checkpoint: a resume is bit-exact and takes the new config's optimizer settings; a checkpoint that is
incomplete, that would run code, or that another parallel mode wrote is refused, naming what is wrong, before anything
is loaded."""

import dataclasses
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from trainer import LossConfig, Trainer, TrainerConfig


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_save_load_resumes_bit_for_bit(tmp_path, tiny_qwen3_dir, make_batch, dtype):
    cfg = TrainerConfig(
        tiny_qwen3_dir,
        dtype=dtype,
        lr=1e-3,
        lr_warmup_steps=3,
        minibatches=2,
        micro_batch_tokens=40,
        loss=LossConfig(kl_coef=0.02),
    )
    batches = [make_batch(6, seed=s) for s in (10, 11, 12)]

    straight = Trainer(cfg)
    straight_metrics = [straight.train_step(b) for b in batches]

    first = Trainer(cfg)
    first.train_step(batches[0])
    first.save(tmp_path / "ckpt")
    rng_at_save = torch.get_rng_state()
    torch.manual_seed(1234)  # the checkpoint must restore RNG state too
    resumed = Trainer(cfg)
    resumed.load(tmp_path / "ckpt")
    assert torch.equal(torch.get_rng_state(), rng_at_save)
    assert resumed.step == 2
    resumed_metrics = [resumed.train_step(b) for b in batches[1:]]

    assert resumed_metrics == straight_metrics[1:]
    # Two optimizer steps per batch, warmup 1/3, 2/3, 1, ...: the scheduler position survives the restart.
    assert straight_metrics[0]["train/lr"] == pytest.approx(2e-3 / 3)
    assert resumed_metrics[-1]["train/lr"] == pytest.approx(1e-3)
    for name, p in straight.model.state_dict().items():
        assert torch.equal(p, resumed.model.state_dict()[name]), name
    for a, b in zip(straight.masters, resumed.masters):
        assert torch.equal(a, b)


def test_resume_takes_the_new_config_s_optimizer_settings(tmp_path, tiny_qwen3_dir, make_batch):
    """The moments and the schedule's position come from the checkpoint, lr, warmup, betas, eps and weight decay from
    the config the run resumes with (torch's load_state_dict would bring back the old ones)."""
    old = TrainerConfig(tiny_qwen3_dir, lr=1e-3, lr_warmup_steps=4, weight_decay=0.1, betas=(0.9, 0.98))
    first = Trainer(old)
    first.train_step(make_batch(6, seed=10))
    first.save(tmp_path / "ckpt")
    new = dataclasses.replace(old, lr=2e-3, lr_warmup_steps=0, weight_decay=0.0, betas=(0.8, 0.9), eps=1e-6)
    resumed = Trainer(new)
    resumed.load(tmp_path / "ckpt")
    for group in resumed.optimizer.param_groups:
        assert (group["lr"], group["weight_decay"], group["betas"], group["eps"]) == (2e-3, 0.0, (0.8, 0.9), 1e-6)
    assert resumed.train_step(make_batch(6, seed=11))["train/lr"] == 2e-3
    assert resumed.optimizer.state_dict()["state"][0]["step"] == 2  # AdamW's bias correction goes on from the save
    # unchanged settings resume where the schedule was: warmup 1/4 at the save, 2/4 at the next step
    again = Trainer(old)
    again.load(tmp_path / "ckpt")
    assert again.train_step(make_batch(6, seed=11))["train/lr"] == pytest.approx(1e-3 * 2 / 4)


def test_load_rejects_incomplete_checkpoint(tmp_path, tiny_qwen3_dir):
    trainer = Trainer(TrainerConfig(tiny_qwen3_dir))
    with pytest.raises(ValueError, match="trainer_state.pt"):
        trainer.load(tiny_qwen3_dir)  # an HF directory, not a trainer checkpoint


class _RunsCode:
    """A pickle that runs a shell command when it is loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_load_refuses_state_that_would_run_code_or_was_written_by_another_parallel_mode(tmp_path, tiny_qwen3_dir):
    trainer = Trainer(TrainerConfig(tiny_qwen3_dir))
    trainer.save(tmp_path / "ckpt")
    state_path = tmp_path / "ckpt" / "trainer_state.pt"
    state = torch.load(state_path, weights_only=True)

    torch.save({**state, "step": _RunsCode(tmp_path / "ran")}, state_path)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        trainer.load(tmp_path / "ckpt")
    assert not (tmp_path / "ran").exists()

    torch.save({**state, "parallel": "fsdp"}, state_path)  # what a checkpoint of two fsdp ranks records
    with pytest.raises(
        ValueError, match=r"written with train.parallel=fsdp; .* over 1 rank\(s\) \(resume it on 2 or more ranks"
    ):
        trainer.load(tmp_path / "ckpt")


def test_load_names_a_parameter_the_checkpoint_lacks_and_changes_nothing(tmp_path, tiny_qwen3_dir, make_batch):
    """A checkpoint whose safetensors miss a parameter is refused with that parameter's name, before anything is
    copied into the trainer (not a bare KeyError halfway through)."""
    source = Trainer(TrainerConfig(tiny_qwen3_dir, lr=1e-3))
    source.train_step(make_batch(4, seed=1))
    source.save(tmp_path / "ckpt")
    (file,) = (tmp_path / "ckpt").glob("*.safetensors")
    tensors = safetensors.torch.load_file(file)
    del tensors["model.norm.weight"]
    safetensors.torch.save_file(tensors, file, metadata={"format": "pt"})

    trainer = Trainer(TrainerConfig(tiny_qwen3_dir, lr=1e-3))
    before = {k: v.copy() for k, v in trainer.export_weights().items()}
    with pytest.raises(ValueError, match=r"lacks parameter 'model\.norm\.weight' \(1 missing\)"):
        trainer.load(tmp_path / "ckpt")
    assert trainer.step == 0
    assert all(np.array_equal(before[k], v) for k, v in trainer.export_weights().items())
