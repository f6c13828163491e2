"""The roofline of `python -m rlloop.bench e2e`: one GRPO step's FLOPs and bytes as rollout.cost counts them, over the
matmul peak and memory bandwidth that rlloop.bench.peaks measures on the bench's cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def measure_peaks(threads: int, dtype: str) -> dict:
    """rlloop.bench.peaks in a child pinned to `threads` cores: pinning this process would pin the Ray cluster it
    starts later (raylet inherits the affinity), and the child keeps jax out of this process."""
    cores = sorted(os.sched_getaffinity(0))[:threads]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    out = subprocess.run(
        [sys.executable, "-m", "rlloop.bench", "peaks", dtype],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=True,
        preexec_fn=lambda: os.sched_setaffinity(0, cores),
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["results"][0]


def step_work(cfg, batches, rl: dict, timed: list[int]) -> dict:
    """FLOPs and bytes of one step (mean over the steps of indices `timed`: those a run's s/step is the mean of), as
    the trainer and the engine must do them; token counts are rlloop's (TRL's are the same prompts and, in
    distribution, the same lengths)."""
    from rollout.cost import cache_dtype, decode_bytes, generate_flops, param_count, train_flops
    from rollout.model_config import ModelConfig
    from trainer.memory import ITEMSIZE

    mc = ModelConfig.from_dir(cfg.model.path)
    params, g = param_count(mc), cfg.rollout.group_size
    max_len = cfg.data.max_prompt_len + cfg.rollout.max_response_len  # the engine's cache row
    itemsize, kv_itemsize = ITEMSIZE[cfg.model.dtype], ITEMSIZE[cache_dtype(cfg.model.dtype, "cpu")]
    per_step = []
    for k, batch in enumerate(batches):
        lens = [len(p.token_ids) for p in batch]
        resp_mean, resp_max = rl["response_len"][k], int(rl["response_len_max"][k])
        # The least training work: each prompt once per group (what shared-prompt rows, train.share_prompts, run;
        # one row per sample runs it g times), every response token (the zero-advantage samples rlloop skips too:
        # the bound is of the GRPO step as TRL computes it), causal attention, the LM head on responses only.
        trained = sum(lens) + resp_mean * g * len(lens)
        train = train_flops(mc, [(lp, [resp_mean] * g) for lp in lens])
        # Each prompt prefilled once (GRPO fan-out copies its KV), then every sample decoded.
        gen_flops = generate_flops(mc, [lp - 1 for lp in lens], [(lp, resp_mean) for lp in lens for _ in range(g)])
        # All rows decode together: one pass over the weights per decode step, and each row's KV as the engine reads
        # it at that step (the pages in use by the longest row, which grow as it does), not all at the final length.
        # Decode step j reads len(prompt) + j positions: the first runs the prompt's last token (rollout/engine.py).
        rows = g * len(lens)
        gen_bytes = sum(
            decode_bytes(mc, itemsize, 1, rows, max_len, max(lens) + j, kv_itemsize) for j in range(resp_max)
        )
        per_step.append((trained, train, gen_flops, gen_bytes))
    trained, train, gen_flops, gen_bytes = (float(np.mean(c)) for c in zip(*(per_step[k] for k in timed)))
    return {
        "params": params,
        "trained_tokens": trained,
        "train_flops": train,
        "gen_flops": gen_flops,
        "decode_bytes": gen_bytes,
    }


def bound(work: dict, peaks: dict) -> dict:
    """Lower bound of one on-policy step on this machine: training after generation (each needs the other's
    result), training compute-bound, generation at whichever of compute and memory is slower."""
    flops_s, bytes_s = peaks["matmul_flops"], peaks["mem_bytes_per_s"]
    train_s, gen_compute_s = work["train_flops"] / flops_s, work["gen_flops"] / flops_s
    gen_memory_s = work["decode_bytes"] / bytes_s
    return work | {
        "train_s": train_s,
        "gen_compute_s": gen_compute_s,
        "gen_memory_s": gen_memory_s,
        "bound_s": train_s + max(gen_compute_s, gen_memory_s),
    }
