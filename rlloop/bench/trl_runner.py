"""The TRL column of `python -m rlloop.bench e2e`: TRL's `GRPOTrainer` on rlloop's own work, timed step by step.

TRL runs in the bench's process as its docs say for CPU (use_cpu; in fp32, or with `bf16=True`, the transformers
docs' mixed precision for CPU training and GRPOConfig's own default, where rlloop runs in bfloat16; torch on the
bench's threads; defaults otherwise), on the prompts rlloop's loader draws in the same order, one optimizer step
per generation batch, with rlloop's AdamW settings, constant lr and loss, and rlloop's DAPO verifier as its reward.
"""

from __future__ import annotations

import gc
import time
import warnings
from pathlib import Path

import numpy as np


def micro_rows(rows: int, max_len: int, token_budget: int) -> int:
    """The largest divisor of `rows` whose padded micro-batch fits rlloop's token budget (at least 1)."""
    return max([d for d in range(1, rows + 1) if rows % d == 0 and d * max_len <= token_budget] or [1])


def run_trl(cfg, batches, tokenizer, threads: int, out_dir: Path, skip: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import PrinterCallback, ProgressCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlloop.rewards import resolve

    torch.set_num_threads(threads)
    verifier = resolve(cfg.reward.fn)  # the very function rlloop's RewardScorer runs

    def reward(prompts, completions, answer, **_) -> list[float]:
        """TRL's reward-function signature around rlloop's verifier (conversational completions)."""
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(verifier(t, a)) for t, a in zip(texts, answer)]

    reward.__name__ = cfg.reward.fn
    r, t, g = cfg.rollout, cfg.train, cfg.grpo
    rows = r.prompts_per_step * r.group_size
    longest = max(len(p.token_ids) for b in batches for p in b) + r.max_response_len
    per_device = micro_rows(rows, longest, t.micro_batch_tokens)
    dataset = Dataset.from_list([{"prompt": p.messages, "answer": p.answer} for b in batches for p in b])
    # As the docs say for CPU (use_cpu; bf16 AMP where rlloop runs bf16: fp32 weights and masters, bf16 matmuls),
    # quiet, one log line (the reward) per step.
    cpu = dict(use_cpu=True, bf16=cfg.model.dtype == "bfloat16", report_to="none", save_strategy="no")
    cpu |= dict(logging_steps=1, disable_tqdm=True)
    # One generation of 128 rows per optimizer step, in micro-batches through gradient accumulation; the loader's
    # order (no shuffle): TRL's step k trains on the very prompts rlloop's step k draws.
    batching = dict(per_device_train_batch_size=per_device, gradient_accumulation_steps=rows // per_device)
    batching |= dict(max_steps=len(batches), shuffle_dataset=False, seed=cfg.run.seed)
    # ignore_eos: EOS is forbidden until the last token, so every row runs to max length, as rlloop's do.
    sampling = dict(num_generations=r.group_size, max_completion_length=r.max_response_len, temperature=r.temperature)
    sampling |= dict(top_p=r.top_p, top_k=max(r.top_k, 0), model_init_kwargs={"dtype": torch.float32})
    sampling["generation_kwargs"] = {"min_new_tokens": r.max_response_len} if r.ignore_eos else None
    # rlloop's AdamW and its constant lr (TRL's default decays linearly); TRL turns gradient checkpointing on by
    # default, the tiny recipe has it off.
    optim = dict(learning_rate=t.lr, lr_scheduler_type="constant", weight_decay=t.weight_decay, adam_epsilon=t.eps)
    optim |= dict(adam_beta1=t.betas[0], adam_beta2=t.betas[1], max_grad_norm=t.max_grad_norm)
    optim["gradient_checkpointing"] = t.gradient_checkpointing
    loss = dict(loss_type=g.loss_agg, epsilon=g.clip_eps_low, epsilon_high=g.clip_eps_high, beta=g.kl_coef)
    loss["scale_rewards"] = "group" if g.std_scale else "none"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing's rename in transformers 5
        args = GRPOConfig(output_dir=str(out_dir), **cpu, **batching, **sampling, **optim, **loss)
    trainer = GRPOTrainer(
        model=cfg.model.path, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)

    marks: list[float] = []
    gen_s: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            marks.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            marks.append(time.perf_counter())

    trainer.add_callback(Clock())
    generate = trainer._generate_single_turn  # timed from outside: TRL's own profiling goes to wandb/trackio only

    def timed_generate(*a, **k):
        t0 = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            gen_s.append(time.perf_counter() - t0)

    trainer._generate_single_turn = timed_generate
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    logs = [e for e in trainer.state.log_history if "reward" in e]
    precision = trainer.accelerator.mixed_precision  # "bf16" where asked for: what accelerate's autocast ran
    step_s = list(np.diff(marks))
    del trainer
    gc.collect()
    return {
        "s_per_step": float(np.mean(step_s[skip:])),
        "generate_s": float(np.mean(gen_s[skip:])),
        "step_s": step_s,
        "rewards": [e["reward"] for e in logs],
        "response_len": [e.get("completions/mean_length") for e in logs],
        "micro_batch_rows": per_device,
        "mixed_precision": precision,
        "setup_s": wall - sum(step_s),
    }
