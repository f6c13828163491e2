"""Two gloo ranks, each on its slice of a batch, end with the same weights as one rank on the whole batch."""

import json

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from tests.trainer.conftest import random_batch
from trainer import LossConfig, Trainer, TrainerConfig, shard_batch

# name, samples, minibatches, aggregation, kl_coef. Odd sample counts give the ranks unequal shares, which is where
# a per-rank normalisation would go wrong. bnpo is absent on purpose: it normalises by each rank's own tokens
# (TRL/DDP semantics), so it is not meant to equal the single-rank loss.
CASES = [
    ("dapo_2minibatches", 8, 2, "dapo", 0.0),
    ("grpo_2minibatches", 8, 2, "grpo", 0.0),
    ("dr_grpo_uneven", 7, 1, "dr_grpo", 0.0),
    ("grpo_uneven_kl", 7, 1, "grpo", 0.05),
]


def make_config(model_dir, minibatches, agg, kl_coef):
    return TrainerConfig(
        str(model_dir),
        lr=1e-3,
        minibatches=minibatches,
        micro_batch_tokens=30,
        loss=LossConfig(loss_agg=agg, kl_coef=kl_coef, tis_cap=2.0),
    )


def train_on_rank(rank, world_size, model_dir, init_file, out_dir):
    """Module-level so that mp.spawn can pickle it; runs every case in one process group."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        for name, n, minibatches, agg, kl_coef in CASES:
            trainer = Trainer(make_config(model_dir, minibatches, agg, kl_coef), rank, world_size)
            metrics = trainer.train_step(shard_batch(random_batch(n, seed=n), rank, world_size))
            np.savez(f"{out_dir}/{name}_rank{rank}.npz", **trainer.export_weights())
            with open(f"{out_dir}/{name}_rank{rank}.json", "w") as f:
                json.dump(metrics, f)
        # Rank 1 gets a malformed share: both ranks must raise instead of rank 0 waiting in a collective forever.
        batch = shard_batch(random_batch(8, seed=8), rank, world_size)
        if rank == 1:
            batch.advantages.pop()
        try:
            trainer.train_step(batch)
            outcome = "trained"
        except ValueError as e:
            outcome = str(e)
        with open(f"{out_dir}/rejected_rank{rank}.txt", "w") as f:
            f.write(outcome)
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory, tiny_qwen3_dir):
    out = tmp_path_factory.mktemp("two_ranks")
    mp.spawn(train_on_rank, args=(2, str(tiny_qwen3_dir), str(out / "rendezvous"), str(out)), nprocs=2, join=True)
    return out


@pytest.mark.parametrize("name, n, minibatches, agg, kl_coef", CASES)
def test_two_ranks_equal_one_rank(two_rank_results, tiny_qwen3_dir, name, n, minibatches, agg, kl_coef):
    single = Trainer(make_config(tiny_qwen3_dir, minibatches, agg, kl_coef))
    initial = {k: v.copy() for k, v in single.export_weights().items()}
    single_metrics = single.train_step(random_batch(n, seed=n))
    want = single.export_weights()

    ranks = [np.load(two_rank_results / f"{name}_rank{r}.npz") for r in (0, 1)]
    moved = 0.0
    for key, value in want.items():
        assert np.array_equal(ranks[0][key], ranks[1][key]), f"ranks disagree on {key}"
        np.testing.assert_allclose(ranks[0][key], value, atol=1e-5, rtol=0, err_msg=key)
        moved = max(moved, float(np.abs(value - initial[key]).max()))
    assert moved > 1e-4  # the step did something, so agreement means something

    metrics = json.loads((two_rank_results / f"{name}_rank0.json").read_text())
    assert metrics == json.loads((two_rank_results / f"{name}_rank1.json").read_text())
    for key in (
        "train/loss",
        "train/pg_loss",
        "train/kl_loss",
        "train/grad_norm",
        "train/entropy",
        "train/pg_clipfrac",
        "train/ppo_kl",
        "train/logprob_abs_diff",
        "train/tokens",
    ):
        assert metrics[key] == pytest.approx(single_metrics[key], rel=1e-4, abs=1e-6), key


def test_a_rejected_share_fails_every_rank(two_rank_results):
    assert "advantages" in (two_rank_results / "rejected_rank1.txt").read_text()
    assert "another rank rejected" in (two_rank_results / "rejected_rank0.txt").read_text()
