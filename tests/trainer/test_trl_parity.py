"""The trainer's loss and gradient against TRL's own `GRPOTrainer._compute_loss` (trl 1.16, a dev dependency).

The same model (the shipped tiny Qwen3), the same samples, the same πold, in every aggregation mode and in GSPO's
sequence-level ratio. TRL scores a padded batch as one forward; rlloop packs its own micro-batches. TRL runs in eval
mode, where its loss is one minibatch's with no gradient-accumulation scaling, which is what `compute_gradients`
returns. Prompts share one length because TRL passes no position ids, so a left-padded prompt would shift its
positions; completions are right-padded, which the causal mask makes harmless.
"""

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer import LossConfig, TrainBatch, Trainer, TrainerConfig

trl = pytest.importorskip("trl")

TINY_MODEL = Path(__file__).resolve().parents[2] / "rlloop" / "assets" / "tiny" / "model"
PROMPT_LEN, MAX_COMPLETION = 7, 12
EPS_LOW, EPS_HIGH = 0.2, 0.28  # clip-higher, the same on both sides


def samples(seed: int, rows: int = 6) -> TrainBatch:
    """Random token ids (the tiny vocabulary is 99 tokens), completions of 3..12 tokens, advantages of both signs."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 99, PROMPT_LEN).tolist() for _ in range(rows)]
    responses = [rng.integers(3, 99, int(rng.integers(3, MAX_COMPLETION + 1))).tolist() for _ in range(rows)]
    advantages = rng.normal(0.0, 1.0, rows).tolist()
    return TrainBatch(prompts, responses, advantages)


def trl_trainer(tmp_path, loss_type: str, level: str, model: Path = TINY_MODEL, beta: float = 0.0):
    from datasets import Dataset
    from transformers import AutoTokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = trl.GRPOConfig(
            output_dir=str(tmp_path),
            use_cpu=True,
            bf16=False,
            report_to="none",
            loss_type=loss_type,
            importance_sampling_level=level,
            epsilon=EPS_LOW,
            epsilon_high=EPS_HIGH,
            beta=beta,
            # rlloop's KL term is verl's kl_loss: β·k3 per token, not weighted by the ratio as TRL's default is
            use_bias_correction_kl=False,
            num_generations=2,
            per_device_train_batch_size=2,
            max_completion_length=MAX_COMPLETION,
            gradient_checkpointing=False,
            model_init_kwargs={"dtype": torch.float32},
        )
        return trl.GRPOTrainer(
            model=str(model),
            reward_funcs=lambda completions, **_: [0.0] * len(completions),
            args=args,
            train_dataset=Dataset.from_list([{"prompt": "1+1"}] * 2),
            processing_class=AutoTokenizer.from_pretrained(TINY_MODEL),
        )


def trl_loss_and_grads(trainer, batch: TrainBatch, old: list[list[float]], ref: list[list[float]] | None = None):
    rows = len(batch)
    completion_ids = torch.zeros(rows, MAX_COMPLETION, dtype=torch.long)
    completion_mask = torch.zeros(rows, MAX_COMPLETION, dtype=torch.long)
    old_logps, ref_logps = torch.zeros(rows, MAX_COMPLETION), torch.zeros(rows, MAX_COMPLETION)
    for i, (response, lp) in enumerate(zip(batch.responses, old)):
        completion_ids[i, : len(response)] = torch.tensor(response)
        completion_mask[i, : len(response)] = 1
        old_logps[i, : len(response)] = torch.tensor(lp)
        if ref is not None:
            ref_logps[i, : len(response)] = torch.tensor(ref[i], dtype=torch.float32)
    inputs = {
        "prompt_ids": torch.tensor(batch.prompts),
        "prompt_mask": torch.ones(rows, PROMPT_LEN, dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor(batch.advantages, dtype=torch.float32),
        "old_per_token_logps": old_logps,
        "num_items_in_batch": completion_mask.sum().float(),  # dapo's normaliser: the batch's completion tokens
    } | ({"ref_per_token_logps": ref_logps} if ref is not None else {})
    model = trainer.model.eval()  # eval: one minibatch's loss, no gradient-accumulation scaling
    model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "loss_type, level",
    [
        ("grpo", "token"),
        ("bnpo", "token"),
        ("dr_grpo", "token"),
        ("dapo", "token"),
        ("grpo", "sequence"),
        ("dapo", "sequence"),
    ],
)
def test_loss_and_gradient_equal_trls_compute_loss(tmp_path, loss_type, level):
    batch = samples(seed=3)
    loss_cfg = LossConfig(loss_agg=loss_type, importance_level=level, clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH)
    ours = Trainer(TrainerConfig(TINY_MODEL, loss=loss_cfg, max_response_len=MAX_COMPLETION, skip_zero_advantage=False))
    # πold away from the current policy by enough that both clip sides act on some tokens, and, through a shift per
    # sample, on some sequences (GSPO's ratio is a sequence's mean)
    rng = np.random.default_rng(4)
    current = ours.compute_logprobs(batch.prompts, batch.responses)
    old = [(np.asarray(lp, np.float64) + rng.normal(rng.normal(0, 0.3), 0.4, len(lp))).tolist() for lp in current]

    got_grads, got_metrics = ours.compute_gradients(batch, old)
    want_loss, want_grads = trl_loss_and_grads(trl_trainer(tmp_path, loss_type, level), batch, old)

    assert got_metrics["train/pg_clipfrac"] > 0.05  # the clip is exercised, not only the ratio
    assert got_metrics["train/loss"] == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    assert got_grads.keys() == want_grads.keys()
    for name, want in want_grads.items():
        # fp32 rounding of two op orders: ~1e-7 of the tensor's scale (elementwise, tiny entries differ relatively)
        err = (got_grads[name] - want).abs().max().item()
        assert err <= 1e-6 * want.abs().max().item(), f"{name}: max |difference| {err:.3g}"


@pytest.mark.parametrize("loss_type, level", [("dapo", "token"), ("grpo", "sequence")])
def test_the_kl_term_equals_trls_without_its_ratio_weighting(tmp_path, loss_type, level):
    """β·k3 against a reference the policy has moved away from (one large step), as TRL computes it with
    use_bias_correction_kl=False (its default weights each token's KL by the ratio; verl's kl_loss does not)."""
    import shutil

    batch, rng = samples(seed=3), np.random.default_rng(4)
    mover = Trainer(TrainerConfig(TINY_MODEL, lr=3e-2, max_grad_norm=1e9))
    mover.train_step(samples(seed=9))
    moved = tmp_path / "moved"
    mover.save(str(moved))
    for f in TINY_MODEL.iterdir():  # the tokenizer, for TRL's processing class
        if not (moved / f.name).exists():
            shutil.copy(f, moved / f.name)
    beta = 0.04
    loss_cfg = LossConfig(
        loss_agg=loss_type, importance_level=level, clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, kl_coef=beta
    )
    ours = Trainer(TrainerConfig(TINY_MODEL, loss=loss_cfg, max_response_len=MAX_COMPLETION, skip_zero_advantage=False))
    ours.load(str(moved))  # the policy moved; its reference stays model.path's
    ref = Trainer(TrainerConfig(TINY_MODEL)).compute_logprobs(batch.prompts, batch.responses)
    current = ours.compute_logprobs(batch.prompts, batch.responses)
    old = [(np.asarray(lp, np.float64) + rng.normal(rng.normal(0, 0.3), 0.4, len(lp))).tolist() for lp in current]

    got_grads, got_metrics = ours.compute_gradients(batch, old)
    trl_side = trl_trainer(tmp_path / "trl", loss_type, level, model=moved, beta=beta)
    want_loss, want_grads = trl_loss_and_grads(trl_side, batch, old, ref=[r.tolist() for r in ref])

    assert got_metrics["train/kl_loss"] > 1e-3  # the reference is away from the policy: the term acts
    assert got_metrics["train/loss"] == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    for name, want in want_grads.items():
        err = (got_grads[name] - want).abs().max().item()
        assert err <= 1e-6 * want.abs().max().item(), f"{name}: max |difference| {err:.3g}"
