"""What an optimizer step does with its gradients: several minibatches train against the pre-step policy, the gradient
is clipped to `max_grad_norm` before AdamW sees it, and bf16 micro-batches add up into the fp32 masters' gradient.

Each test compares the trainer with a reference built by hand from its public pieces (`compute_logprobs`,
`compute_gradients`) and torch's AdamW, and asserts that the behaviour under test actually acts (the clip fires,
clipping changes the weights, micro-batching splits the step), so that none of them passes vacuously."""

import numpy as np
import torch

from trainer import LossConfig, TrainBatch, Trainer, TrainerConfig


def grads_of(trainer: Trainer, batch: TrainBatch) -> torch.Tensor:
    """The gradient of `batch` as one flat fp32 vector over every parameter, in the trainer's parameter order."""
    grads, _ = trainer.compute_gradients(batch)
    return torch.cat([grads[n].flatten() for n in trainer.param_names])


def weights_of(trainer: Trainer) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in trainer.export_weights().items()}


def test_every_minibatch_trains_against_the_pre_step_policy(tiny_qwen3_dir, make_batch):
    """With minibatches=2 the second optimizer step must take πold from the weights that scored the batch, before the
    first step moved them: its importance ratio departs from 1 and the PPO clip acts. Were πold the current policy
    (πθ.detach(), right only for a single minibatch), the ratio would be 1, the clip idle and the update another one.
    Reference: a one-minibatch trainer takes the first half's step, then the second half's gradient against explicitly
    given pre-step log-probs, applied with the trainer's own AdamW."""
    batch = make_batch(8, seed=3)
    first, second = batch.select(range(4)), batch.select(range(4, 8))
    # A large rate, so that one step moves the policy far enough for the clip; no grad clipping to muddle the steps.
    cfg = dict(lr=1e-2, max_grad_norm=1e9)
    trainer = Trainer(TrainerConfig(tiny_qwen3_dir, minibatches=2, **cfg))
    metrics = trainer.train_step(batch)
    assert metrics["train/minibatches"] == 2

    ref = Trainer(TrainerConfig(tiny_qwen3_dir, **cfg))
    pre_step = [lp.tolist() for lp in ref.compute_logprobs(batch.prompts, batch.responses)]
    m1 = ref.train_step(first)  # one minibatch: πold is the policy itself, which is the pre-step one here
    grads, m2 = ref.compute_gradients(second, old_logprobs=pre_step[4:])
    assert m1["train/pg_clipfrac"] == 0.0 and m2["train/pg_clipfrac"] > 0.05  # the clip acts in the second step only
    for name, master in zip(ref.param_names, ref.masters):
        master.grad = grads[name]
    ref.optimizer.step()

    t1, t2 = m1["train/tokens"], m2["train/tokens"]
    for key in ("train/pg_clipfrac", "train/ppo_kl"):  # token means over the whole batch
        want = (m1[key] * t1 + m2[key] * t2) / (t1 + t2)
        assert abs(metrics[key] - want) <= 1e-6, (key, metrics[key], want)
    assert abs(metrics["train/loss"] - (m1["train/loss"] + m2["train/loss"]) / 2) <= 1e-6
    for name, weight in ref.export_weights().items():
        np.testing.assert_allclose(trainer.export_weights()[name], weight, rtol=1e-5, atol=1e-6, err_msg=name)


def test_dual_clip_reports_the_tokens_it_capped_over_the_step(tiny_qwen3_dir, make_batch):
    """`train/pg_clipfrac_lower` comes with grpo.clip_ratio_c only, and acts (like the clip) in the second minibatch,
    whose ratio departs from 1."""
    batch = make_batch(8, seed=3)
    cfg = dict(lr=1e-2, max_grad_norm=1e9, minibatches=2)
    plain = Trainer(TrainerConfig(tiny_qwen3_dir, **cfg)).train_step(batch)
    dual = Trainer(TrainerConfig(tiny_qwen3_dir, loss=LossConfig(clip_ratio_c=1.05), **cfg)).train_step(batch)
    assert "train/pg_clipfrac_lower" not in plain
    assert 0 < dual["train/pg_clipfrac_lower"] < 1 and dual["train/loss"] != plain["train/loss"]


def test_gradients_are_clipped_to_max_grad_norm_before_adamw(tiny_qwen3_dir, make_batch):
    """A gradient whose global norm exceeds `max_grad_norm` is scaled down to it before AdamW's step. One step would
    not show it (Adam's first update hardly depends on a constant gradient scale), so three steps on batches whose
    advantages are scaled 1, 10 and 0.1 (gradient norms ~6, ~34, ~0.3): clipped, every step's gradient has the same
    norm and AdamW's moments weigh the three alike; unclipped, the second one dominates them.
    Reference: the trainer's gradients clipped by hand (torch's rule: scale by max_norm / (norm + 1e-6) when below 1)
    and stepped by torch's AdamW with the trainer's settings (weight decay on matrices only, no warmup)."""
    max_norm, lr, decay, betas, eps = 1e-3, 1e-3, 0.1, (0.9, 0.98), 1e-8
    batches = [make_batch(6, seed=s) for s in (20, 21, 22)]
    for batch, scale in zip(batches, (1.0, 10.0, 0.1)):
        batch.advantages = [a * scale for a in batch.advantages]
    cfg = dict(lr=lr, weight_decay=decay, betas=betas, eps=eps)
    clipped = Trainer(TrainerConfig(tiny_qwen3_dir, max_grad_norm=max_norm, **cfg))
    unclipped = Trainer(TrainerConfig(tiny_qwen3_dir, max_grad_norm=1e9, **cfg))

    ref = Trainer(TrainerConfig(tiny_qwen3_dir, max_grad_norm=1e9, **cfg))  # its model is stepped by hand
    params = dict(zip(ref.param_names, ref.params))
    adamw = torch.optim.AdamW(
        [
            {"params": [p for p in ref.params if p.dim() >= 2], "weight_decay": decay},
            {"params": [p for p in ref.params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=lr,
        betas=betas,
        eps=eps,
    )
    norms, reported = [], []
    for batch in batches:
        grads, _ = ref.compute_gradients(batch)
        norm = float(torch.sqrt(sum(g.double().square().sum() for g in grads.values())))
        for name, p in params.items():
            p.grad = grads[name] * min(1.0, max_norm / (norm + 1e-6))
        adamw.step()
        norms.append(norm)
        reported.append(clipped.train_step(batch)["train/grad_norm"])
        unclipped.train_step(batch)

    want = {n: p.detach().numpy() for n, p in params.items()}
    moved = weights_of(clipped)
    for name, weight in moved.items():
        np.testing.assert_allclose(weight, want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(reported, norms, rtol=1e-4)  # train/grad_norm is the norm before clipping
    assert min(norms) > 100 * max_norm and max(norms) > 20 * min(norms)  # the clip fires, on different norms
    # Not vacuous: without the clip the same three steps end somewhere else, by far more than the tolerance.
    plain = weights_of(unclipped)
    assert max(float(np.abs(plain[n] - moved[n]).max()) for n in moved) > 0.2 * lr


def test_bf16_micro_batch_gradients_add_up_in_the_fp32_masters(tiny_qwen3_dir, make_batch):
    """In bf16 each micro-batch's gradient is moved into the fp32 masters and added to what is there: a step split
    into a dozen micro-batches takes the gradient of the whole minibatch, as one micro-batch does. Tolerance: bf16's
    own error, i.e. the one-micro-batch bf16 gradient's distance from the fp32 one; keeping only one micro-batch's
    share would miss most of the gradient, far outside it."""
    batch = make_batch(12, seed=4)
    fp32 = grads_of(Trainer(TrainerConfig(tiny_qwen3_dir, micro_batch_tokens=10**6)), batch)
    single_trainer = Trainer(TrainerConfig(tiny_qwen3_dir, dtype="bfloat16", micro_batch_tokens=10**6))
    micro_trainer = Trainer(TrainerConfig(tiny_qwen3_dir, dtype="bfloat16", micro_batch_tokens=24))
    assert micro_trainer.compute_gradients(batch)[1]["train/micro_batches"] >= 8
    assert single_trainer.compute_gradients(batch)[1]["train/micro_batches"] == 1
    single, micro = grads_of(single_trainer, batch), grads_of(micro_trainer, batch)
    assert single.dtype == micro.dtype == torch.float32  # accumulated in the masters' fp32

    bf16_error = float((single - fp32).norm() / fp32.norm())
    micro_error = float((micro - fp32).norm() / fp32.norm())
    assert 0 < bf16_error < 0.05, bf16_error  # bf16 compute does differ, by a few bf16 roundings
    assert micro_error <= 1.5 * bf16_error, (micro_error, bf16_error)


def test_the_grad_norm_of_several_minibatches_is_their_mean(tiny_qwen3_dir, make_batch):
    """train/grad_norm of a step of two minibatches is the mean of the two optimizer steps' pre-clip norms (as the
    losses are per optimizer step), not the last one's. Reference as above: the first half's step by a one-minibatch
    trainer, then the second half's gradient against the pre-step log-probs."""
    batch = make_batch(8, seed=3)
    first, second = batch.select(range(4)), batch.select(range(4, 8))
    cfg = dict(lr=1e-2, max_grad_norm=1e9)
    metrics = Trainer(TrainerConfig(tiny_qwen3_dir, minibatches=2, **cfg)).train_step(batch)

    ref = Trainer(TrainerConfig(tiny_qwen3_dir, **cfg))
    pre_step = [lp.tolist() for lp in ref.compute_logprobs(batch.prompts, batch.responses)]
    norm1 = float(grads_of(ref, first).double().norm())
    m1 = ref.train_step(first)
    grads, _ = ref.compute_gradients(second, old_logprobs=pre_step[4:])
    norm2 = float(torch.cat([grads[n].flatten() for n in ref.param_names]).double().norm())
    np.testing.assert_allclose(m1["train/grad_norm"], norm1, rtol=1e-4)
    assert abs(norm1 - norm2) > 0.1 * norm2  # the two steps' norms differ: mean and last one are told apart
    np.testing.assert_allclose(metrics["train/grad_norm"], (norm1 + norm2) / 2, rtol=1e-4)


def test_bf16_micro_batch_gradients_add_in_fp32_not_in_bf16(tiny_qwen3_dir, make_batch):
    """With πold = πθ the policy gradient is linear in the advantages, and each micro-batch's bf16 gradient does not
    depend on the others': a step's gradient is then the sum of the gradients of its samples taken apart (the rest's
    advantages 0, skipped), up to fp32 rounding, when each micro-batch's gradient is added into the fp32 masters.
    Adding them up in bf16 first would round a small share away against a large one (advantages 1e-3 x the rest)."""
    batch = make_batch(4, seed=17, with_rollout_logprobs=False)
    batch.advantages = [1.0, -0.8, 1e-3, -1e-3]
    trainer = Trainer(TrainerConfig(tiny_qwen3_dir, dtype="bfloat16", micro_batch_tokens=1))  # one sample each
    whole, metrics = trainer.compute_gradients(batch)
    assert metrics["train/micro_batches"] == 4
    big = TrainBatch(batch.prompts, batch.responses, [1.0, -0.8, 0.0, 0.0])
    small = TrainBatch(batch.prompts, batch.responses, [0.0, 0.0, 1e-3, -1e-3])
    parts = [trainer.compute_gradients(b)[0] for b in (big, small)]
    for name in whole:
        want = parts[0][name] + parts[1][name]
        torch.testing.assert_close(whole[name], want, rtol=1e-5, atol=1e-7 * float(want.abs().max()), msg=name)
