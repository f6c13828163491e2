"""Trainer behaviour: micro-batching is exact, the whole step matches an independent computation, it learns, exports
are named and typed as HF saves them, bad batches fail cleanly (checkpoints: test_save_load.py; non-finite steps:
test_non_finite_steps.py)."""

import json
import math
import shutil
from functools import partial

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

from tests.conftest import make_tiny_hf_model
from trainer import LossConfig, TrainBatch, Trainer, TrainerConfig
from trainer.optimizer import lr_factor


def perturbed(logprobs, seed, scale):
    rng = np.random.default_rng(seed)
    return [(np.asarray(lp, dtype=np.float64) + rng.normal(0.0, scale, len(lp))).tolist() for lp in logprobs]


@pytest.mark.parametrize("agg", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_micro_batched_gradients_equal_single_batch(tiny_qwen3_dir, make_batch, agg):
    loss = LossConfig(loss_agg=agg, kl_coef=0.05, kl_estimator="k2", entropy_coef=0.01, tis_cap=1.5)
    batch = make_batch(9, seed=4)
    micro = Trainer(TrainerConfig(tiny_qwen3_dir, micro_batch_tokens=24, loss=loss, max_response_len=16))
    single = Trainer(TrainerConfig(tiny_qwen3_dir, micro_batch_tokens=10**6, loss=loss, max_response_len=16))
    current = micro.compute_logprobs(batch.prompts, batch.responses)
    # An older policy far enough away that tokens get clipped on both sides, and rollout numbers that trip TIS.
    old = perturbed(current, seed=5, scale=0.4)
    batch.rollout_logprobs = perturbed(old, seed=6, scale=0.6)

    g_micro, m_micro = micro.compute_gradients(batch, old)
    g_single, m_single = single.compute_gradients(batch, old)
    assert m_micro["train/micro_batches"] > 2 and m_single["train/micro_batches"] == 1
    assert m_single["train/pg_clipfrac"] > 0.05
    assert g_micro.keys() == g_single.keys()
    for name in g_single:
        torch.testing.assert_close(g_micro[name], g_single[name], atol=1e-5, rtol=1e-5, msg=name)
    for key in (
        "train/loss",
        "train/pg_loss",
        "train/kl_loss",
        "train/pg_clipfrac",
        "train/entropy",
        "train/logprob_abs_diff",
        "train/ppo_kl",
        "train/tokens",
    ):
        assert m_micro[key] == pytest.approx(m_single[key], rel=1e-5, abs=1e-7), key


def test_step_gradient_matches_independent_per_sample_computation(tiny_qwen3_dir, make_batch):
    """dapo + TIS + clipping through the trainer == per-sample unpadded HF forwards and docs/design.md §4's formulas."""
    batch = make_batch(5, seed=7)
    cfg = TrainerConfig(
        tiny_qwen3_dir,
        temperature=0.9,
        micro_batch_tokens=30,
        loss=LossConfig(loss_agg="dapo", clip_eps_low=0.2, clip_eps_high=0.28, tis_cap=2.0),
    )
    trainer = Trainer(cfg)
    old = perturbed(trainer.compute_logprobs(batch.prompts, batch.responses), seed=8, scale=0.3)
    batch.rollout_logprobs = perturbed(old, seed=9, scale=0.5)
    got, _ = trainer.compute_gradients(batch, old)

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    total_tokens = sum(len(r) for r in batch.responses)
    objective = 0.0
    for i in range(len(batch)):
        p, r = batch.prompts[i], batch.responses[i]
        logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : len(p) + len(r) - 1] / 0.9
        logp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        old_i = torch.tensor(old[i], dtype=torch.float32)
        ratio = torch.exp(logp - old_i)
        a = batch.advantages[i]
        per_token = -torch.minimum(ratio * a, torch.clamp(ratio, 0.8, 1.28) * a)
        tis = torch.clamp(torch.exp(old_i - torch.tensor(batch.rollout_logprobs[i])), max=2.0)
        objective = objective + (per_token * tis).sum() / total_tokens
    objective.backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(got[name], param.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_fused_adamw_takes_the_same_step(tiny_qwen3_dir, make_batch):
    batch = make_batch(4, seed=3)
    trained = []
    for fused in (False, True):
        trainer = Trainer(TrainerConfig(tiny_qwen3_dir, lr=1e-2, adamw_fused=fused))
        trainer.train_step(batch)
        trained.append(trainer.export_weights())
    for name, weight in trained[0].items():
        np.testing.assert_allclose(trained[1][name], weight, rtol=1e-5, atol=1e-6, err_msg=name)
    assert any(
        not np.array_equal(w, Trainer(TrainerConfig(tiny_qwen3_dir)).export_weights()[n]) for n, w in trained[1].items()
    )  # the step did move the weights


def test_training_raises_logprobs_of_rewarded_responses(tiny_qwen3_dir):
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 128, 6).tolist()
    responses = [rng.integers(3, 128, 8).tolist() for _ in range(8)]
    advantages = [1.0 if i % 2 == 0 else -1.0 for i in range(8)]
    trainer = Trainer(
        TrainerConfig(tiny_qwen3_dir, lr=3e-3, weight_decay=0.0, micro_batch_tokens=64, loss=LossConfig(tis_cap=None))
    )
    before = [lp.sum() for lp in trainer.compute_logprobs([prompt] * 8, responses)]
    for _ in range(5):
        metrics = trainer.train_step(TrainBatch([prompt] * 8, responses, advantages))
        assert math.isfinite(metrics["train/loss"]) and metrics["train/grad_norm"] > 0
    after = [lp.sum() for lp in trainer.compute_logprobs([prompt] * 8, responses)]
    for i in range(8):
        if advantages[i] > 0:
            assert after[i] > before[i] + 1.0, i
        else:
            assert after[i] < before[i] - 1.0, i


@pytest.mark.parametrize("tie", [True, False])
def test_bf16_export_names_dtype_and_bits(tmp_path, tie):
    path = make_tiny_hf_model(tmp_path / "m", "qwen3", tie=tie, seed=5)
    trainer = Trainer(TrainerConfig(str(path), dtype="bfloat16"))
    exported = trainer.export_weights()
    saved = safetensors.numpy.load_file(str(path / "model.safetensors"))  # what HF's save_pretrained wrote
    assert set(exported) == set(saved)
    assert ("lm_head.weight" in exported) == (not tie)
    assert trainer.export_nbytes() == sum(a.nbytes for a in exported.values())
    for name, array in exported.items():
        assert array.dtype == ml_dtypes.bfloat16, name
        assert array.shape == saved[name].shape, name
        # Bits equal round-to-nearest-even of the float32 checkpoint, computed by ml_dtypes rather than torch.
        want = saved[name].astype(ml_dtypes.bfloat16)
        assert np.array_equal(array.view(np.uint16), want.view(np.uint16)), name


def test_bf16_keeps_fp32_masters_and_exports_them_rounded(tiny_qwen3_dir, make_batch):
    """At RL learning rates an AdamW update (~lr) is far below bf16 resolution: the fp32 masters must keep it, and
    the bf16 weights handed out are the masters rounded to nearest (as ml_dtypes rounds them)."""
    trainer = Trainer(TrainerConfig(tiny_qwen3_dir, dtype="bfloat16", lr=1e-6, weight_decay=0.0))
    start = [m.detach().clone() for m in trainer.masters]
    bf16_start = {k: v.copy() for k, v in trainer.export_weights().items()}
    trainer.train_step(make_batch(6, seed=16))
    steps = torch.cat([(m.detach() - s).abs().flatten() for m, s in zip(trainer.masters, start)])
    assert 0.5e-6 < float(steps.max()) < 2e-6  # Adam's first step moves every weight with a gradient by ~lr
    exported = trainer.export_weights()
    changed = sum(int((exported[k].view(np.uint16) != bf16_start[k].view(np.uint16)).sum()) for k in exported)
    total = sum(v.size for v in exported.values())
    assert changed < 0.2 * total  # most bf16 words did not move, yet the masters all did
    for name, master in zip(trainer.param_names, trainer.masters):
        want = master.detach().numpy().astype(ml_dtypes.bfloat16)
        assert np.array_equal(exported[name].view(np.uint16), want.view(np.uint16)), name


def test_bf16_masters_start_from_the_fp32_checkpoint_and_resume_from_an_fp32_one(tmp_path, tiny_qwen3_dir, make_batch):
    """One rank (ddp) built its fp32 masters from the bf16-rounded weights, where fsdp's start from the checkpoint's
    fp32 values: one rank and two trained apart. And an fp32 checkpoint resumed in bf16 kept the base model's masters,
    which the first step copied back into the model: the checkpoint's training was lost."""
    import safetensors.torch

    base = safetensors.torch.load_file(f"{tiny_qwen3_dir}/model.safetensors")
    bf16 = Trainer(TrainerConfig(tiny_qwen3_dir, dtype="bfloat16"))
    for name, master in zip(bf16.param_names, bf16.masters):
        assert torch.equal(master, base[name]), name  # not its rounding to bf16
    assert {b.dtype for b in bf16.model.buffers()} == {torch.float32}  # RoPE's, as from_pretrained keeps them
    fp32 = Trainer(TrainerConfig(tiny_qwen3_dir, lr=5e-2))
    fp32.train_step(make_batch(6, seed=3))
    fp32.save(tmp_path / "ckpt")
    bf16.load(tmp_path / "ckpt")
    for name, master, trained in zip(bf16.param_names, bf16.masters, fp32.params):
        assert torch.equal(master, trained), name


def test_fp32_export_aliases_live_parameters(tiny_qwen3_dir, make_batch):
    trainer = Trainer(TrainerConfig(tiny_qwen3_dir, lr=1e-3))
    exported = trainer.export_weights()
    snapshot = {k: v.copy() for k, v in exported.items()}
    assert all(v.dtype == np.float32 for v in exported.values())
    trainer.train_step(make_batch(4, seed=13))
    name = "model.layers.0.mlp.down_proj.weight"
    # Documented: the arrays are views of the parameters, so the step shows through them.
    assert np.array_equal(exported[name], trainer.model.get_parameter(name).detach().numpy())
    assert not np.array_equal(exported[name], snapshot[name])


def saved_activation_elements(trainer, batch):
    """Elements autograd keeps for the backward of one forward: what activation checkpointing is meant to cut."""
    from trainer.logprobs import response_logprobs

    mb = trainer._plan(batch, list(range(len(batch))))[0]
    count = [0]

    def pack(x):
        count[0] += x.numel()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        response_logprobs(trainer.model, mb)
    return count[0]


def test_gradient_checkpointing_gives_the_same_gradients(tiny_qwen3_dir, make_batch):
    batch = make_batch(4, seed=14)
    plain_trainer = Trainer(TrainerConfig(tiny_qwen3_dir))
    ckpt_trainer = Trainer(TrainerConfig(tiny_qwen3_dir, gradient_checkpointing=True))
    plain, _ = plain_trainer.compute_gradients(batch)
    ckpt, _ = ckpt_trainer.compute_gradients(batch)
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], atol=1e-6, rtol=1e-5, msg=name)
    assert saved_activation_elements(ckpt_trainer, batch) < saved_activation_elements(plain_trainer, batch) / 3


def test_a_checkpoint_with_dropout_trains_deterministically_with_gradient_checkpointing(
    tiny_qwen3_dir, make_batch, tmp_path
):
    """Gradient checkpointing needs train mode, where HF attention applies the config's attention_dropout: π and πold
    would be random draws. Every dropout is off, so the two trainers compute the same function."""
    shutil.copytree(tiny_qwen3_dir, tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    (tmp_path / "model" / "config.json").write_text(json.dumps(config | {"attention_dropout": 0.5}))
    batch = make_batch(4, seed=15)
    plain_trainer = Trainer(TrainerConfig(str(tmp_path / "model")))
    ckpt_trainer = Trainer(TrainerConfig(str(tmp_path / "model"), gradient_checkpointing=True))
    first = ckpt_trainer.compute_logprobs(batch.prompts, batch.responses)
    for again, plain in zip(ckpt_trainer.compute_logprobs(batch.prompts, batch.responses), first):
        np.testing.assert_array_equal(again, plain)
    plain, _ = plain_trainer.compute_gradients(batch)
    ckpt, _ = ckpt_trainer.compute_gradients(batch)
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda b: b.advantages.pop(), "advantages"),
        (lambda b: b.responses.pop(), "responses"),
        (lambda b: b.rollout_logprobs[2].append(-1.0), r"rollout_logprobs\[2\]"),
        (lambda b: b.responses.__setitem__(1, []), r"responses\[1\]"),
        (lambda b: b.prompts[3].append(128), r"prompts\[3\]"),
        (lambda b: b.advantages.__setitem__(0, float("nan")), r"advantages\[0\]"),
        (lambda b: b.rollout_logprobs[4].__setitem__(0, float("-inf")), r"rollout_logprobs\[4\]"),
        (lambda b: b.prompts.__setitem__(2, []), r"TrainBatch\.prompts\[2\] is empty"),  # no context to predict from
        (lambda b: b.responses[1].__setitem__(0, -1), r"TrainBatch\.responses\[1\] holds token id -1 outside the"),
    ],
)
def test_bad_batch_is_rejected_and_loses_nothing(tiny_qwen3_dir, make_batch, mutate, field):
    trainer = Trainer(TrainerConfig(tiny_qwen3_dir, lr=1e-3))
    before = {k: v.copy() for k, v in trainer.export_weights().items()}
    bad = make_batch(5, seed=15)
    mutate(bad)
    with pytest.raises(ValueError, match=field):
        trainer.train_step(bad)
    assert trainer.step == 0
    after = trainer.export_weights()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    trainer.train_step(make_batch(5, seed=15))  # still usable
    assert trainer.step == 1


def test_bad_config_names_the_field(tiny_qwen3_dir):
    with pytest.raises(ValueError, match="dtype"):
        TrainerConfig(tiny_qwen3_dir, dtype="float16x")
    with pytest.raises(ValueError, match="tpu"):
        Trainer(TrainerConfig(tiny_qwen3_dir, device="tpu"))  # torch_tpu is never installed here


def test_a_batch_shorter_than_minibatches_takes_fewer_optimizer_steps(tiny_qwen3_dir, make_batch):
    """Dynamic sampling can run out of rounds and hand over fewer samples than `train.minibatches`: the trainer
    takes one step per sample then (the same steps a config with that many minibatches takes), not an error."""
    batch = make_batch(3, seed=21)
    short = Trainer(TrainerConfig(tiny_qwen3_dir, lr=1e-3, minibatches=8))
    metrics = short.train_step(batch)
    assert metrics["train/minibatches"] == 3 and short.step == 3
    exact = Trainer(TrainerConfig(tiny_qwen3_dir, lr=1e-3, minibatches=3))
    assert exact.train_step(batch)["train/loss"] == metrics["train/loss"]
    for key, value in exact.export_weights().items():
        assert np.array_equal(value, short.export_weights()[key]), key


def test_the_logprob_gap_is_reported_only_against_engine_logprobs(tiny_qwen3_dir, make_batch):
    """Without the engine's log-probs there is no gap to measure: no metric, rather than a gap of exactly 0."""
    trainer = Trainer(TrainerConfig(tiny_qwen3_dir))
    assert "train/logprob_abs_diff" not in trainer.train_step(make_batch(4, seed=3, with_rollout_logprobs=False))
    assert trainer.train_step(make_batch(4, seed=3))["train/logprob_abs_diff"] > 0


@pytest.mark.parametrize(
    "decay,warmup,min_ratio", [("linear", 0, 0.0), ("linear", 3, 0.0), ("cosine", 0, 0.0), ("cosine", 3, 0.1)]
)
def test_the_lr_decays_as_transformers_schedules_do(decay, warmup, min_ratio):
    """Past the warmup, update k runs at transformers' factor for step k (its linear schedule, its cosine with a
    minimum rate); in the warmup at its factor for k + 1, since ours reaches the full rate at the warmup's last update
    where transformers' first update runs at rate 0."""
    schedules = {
        "linear": transformers.get_linear_schedule_with_warmup,
        "cosine": partial(transformers.get_cosine_with_min_lr_schedule_with_warmup, min_lr_rate=min_ratio),
    }
    total = 20
    cfg = TrainerConfig("unused", lr_decay=decay, lr_warmup_steps=warmup, min_lr_ratio=min_ratio, total_updates=total)
    theirs = schedules[decay](torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), warmup, total)
    want = [theirs.lr_lambdas[0](k + 1 if k < warmup else k) for k in range(total)]
    assert [lr_factor(cfg, k) for k in range(total)] == pytest.approx(want, abs=1e-12)
    assert lr_factor(cfg, total + 5) == pytest.approx(min_ratio)  # it stays at the end, not back up


def test_the_trainer_steps_the_decay_once_per_update(tiny_qwen3_dir, make_batch):
    cfg = TrainerConfig(tiny_qwen3_dir, lr=1e-3, lr_decay="linear", total_updates=4, minibatches=2)
    trainer = Trainer(cfg)
    assert [trainer.train_step(make_batch(4, seed=s))["train/lr"] for s in (1, 2)] == pytest.approx([7.5e-4, 2.5e-4])


def test_the_entropy_bonus_gradient_matches_an_independent_computation(tiny_qwen3_dir, make_batch):
    """train.entropy_coef adds -coef x the token-mean entropy (dapo) to the loss, and its gradient with it: with every
    advantage 0 the step's gradient is the entropy bonus's alone, from per-sample unpadded HF forwards."""
    batch = make_batch(4, seed=16, with_rollout_logprobs=False)
    batch.advantages = [0.0] * len(batch)
    coef = 0.01
    trainer = Trainer(TrainerConfig(tiny_qwen3_dir, micro_batch_tokens=30, loss=LossConfig(entropy_coef=coef)))
    got, metrics = trainer.compute_gradients(batch)

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    total_tokens = sum(len(r) for r in batch.responses)
    entropy_sum = 0.0
    for p, r in zip(batch.prompts, batch.responses):
        logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : len(p) + len(r) - 1].float()
        logp = torch.log_softmax(logits, -1)
        entropy_sum = entropy_sum - (logp.exp() * logp).sum()
    objective = -coef * entropy_sum / total_tokens
    objective.backward()
    assert metrics["train/entropy"] == pytest.approx(float(entropy_sum.detach()) / total_tokens, rel=1e-5)
    assert max(float(param.grad.abs().max()) for param in model.parameters()) > 1e-6  # the bonus has a gradient
    for name, param in model.named_parameters():
        torch.testing.assert_close(got[name], param.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_a_model_with_dropout_modules_trains_deterministically_with_gradient_checkpointing(tmp_path, make_batch):
    """Phi-3 applies its resid_pdrop and embd_pdrop through nn.Dropout modules, which gradient checkpointing's train
    mode would switch on: every one is zeroed, so a checkpointed trainer's log-probs are the eval-mode model's."""
    path = make_tiny_hf_model(tmp_path / "phi3", "phi3", resid_pdrop=0.5, embd_pdrop=0.5)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert any(isinstance(m, torch.nn.Dropout) and m.p == 0.5 for m in model.modules())
    batch = make_batch(4, seed=15)
    ckpt_trainer = Trainer(TrainerConfig(str(path), gradient_checkpointing=True))
    plain_trainer = Trainer(TrainerConfig(str(path)))
    for got, want in zip(
        ckpt_trainer.compute_logprobs(batch.prompts, batch.responses),
        plain_trainer.compute_logprobs(batch.prompts, batch.responses),
    ):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_the_loss_config_takes_a_symmetric_clip_and_a_decay_needs_its_end():
    """clip_eps_high == clip_eps_low is PPO's symmetric clip (GRPO's 0.2 / 0.2): allowed, only a high below the low
    is refused. A decaying lr needs total_updates to decay over: refused without it, naming it."""
    assert LossConfig(clip_eps_low=0.2, clip_eps_high=0.2).clip_eps_high == 0.2
    with pytest.raises(ValueError, match="clip_eps_high must be >= clip_eps_low"):
        LossConfig(clip_eps_low=0.2, clip_eps_high=0.1)
    for decay in ("linear", "cosine"):
        with pytest.raises(ValueError, match="total_updates"):
            TrainerConfig("unused", lr_decay=decay)
        assert TrainerConfig("unused", lr_decay=decay, total_updates=4).total_updates == 4
    assert TrainerConfig("unused").lr_decay == "constant"  # needs no end
