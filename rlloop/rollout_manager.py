"""From prompts to a training batch: generate G samples per prompt, score them, shape rewards, compute advantages.

With DAPO's dynamic sampling, groups whose rewards are all equal carry no signal and are dropped; more prompts are
drawn until the batch is full or `grpo.max_sampling_rounds` is spent (then the batch trains short).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from rlloop.advantages import group_advantages, overlong_penalty, zero_std_groups
from rlloop.config import Config
from rlloop.data import Prompt, PromptData
from rlloop.rewards import RewardScorer
from rollout import SamplingParams


@dataclass
class Samples:
    prompts: list[Prompt]          # one per group
    completions: list              # rollout.Completion, G per prompt, grouped
    texts: list[str]
    raw_rewards: np.ndarray        # from the reward function
    rewards: np.ndarray            # after overlong shaping
    advantages: np.ndarray

    def to_train_batch(self, group_size: int):
        from trainer import TrainBatch

        return TrainBatch(prompts=[self.prompts[j // group_size].token_ids for j in range(len(self.completions))],
                          responses=[list(c.token_ids) for c in self.completions],
                          advantages=[float(a) for a in self.advantages],
                          rollout_logprobs=[list(c.logprobs) for c in self.completions])

    def rows(self, group_size: int) -> list[dict]:
        """One JSON-able row per sample, for `tracking.save_rollouts` and replay."""
        return [{"prompt_index": p.index, "prompt": p.messages, "answer": p.answer, "response": text,
                 "reward": float(r), "advantage": float(a), "weight_version": c.weight_version,
                 "finish_reason": c.finish_reason}
                for p_i, p in enumerate(self.prompts)
                for c, text, r, a in zip(self.completions[p_i * group_size:(p_i + 1) * group_size],
                                         self.texts[p_i * group_size:(p_i + 1) * group_size],
                                         self.rewards[p_i * group_size:(p_i + 1) * group_size],
                                         self.advantages[p_i * group_size:(p_i + 1) * group_size])]


def stop_token_ids(tokenizer, model_path: str) -> tuple[int, ...]:
    """EOS ids from the model's generation config (Qwen3: 151645 and 151643) and the tokenizer."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:
        pass  # no generation_config.json: the tokenizer's EOS is all there is
    return tuple(sorted(ids))


def sampling_params(cfg: Config, stop_ids: tuple[int, ...], seed: int, temperature: float | None = None):
    r = cfg.rollout
    return SamplingParams(temperature=r.temperature if temperature is None else temperature, top_p=r.top_p,
                          top_k=r.top_k, max_new_tokens=r.max_response_len, stop_token_ids=stop_ids, seed=seed)


def generate_and_score(cluster, prompts: list[Prompt], n: int, sampling, tokenizer, scorer: RewardScorer):
    prompt_ids = [p.token_ids for p in prompts]
    completions, stats = cluster.generate(prompt_ids, n, sampling)
    texts = tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
    answers = [prompts[c.prompt_index].answer for c in completions]
    return completions, texts, np.asarray(scorer.score(texts, answers), dtype=np.float32), stats


def collect(cfg: Config, step: int, data: PromptData, cluster, tokenizer, scorer: RewardScorer,
            stop_ids: tuple[int, ...]) -> tuple[Samples, dict]:
    g, want = cfg.rollout.group_size, cfg.rollout.prompts_per_step
    kept: list[tuple[Prompt, list, list[str], np.ndarray]] = []
    metrics = {"perf/rollout_s": 0.0, "perf/compiles": 0.0, "rollout/tokens": 0.0}
    all_raw, all_zero, pad = [], [], []
    for round_ in range(cfg.grpo.max_sampling_rounds if cfg.grpo.dynamic_sampling else 1):
        prompts = data.next_batch(want - len(kept))
        t0 = time.perf_counter()
        seed = cfg.run.seed * 1_000_003 + step * 101 + round_
        completions, texts, raw, stats = generate_and_score(cluster, prompts, g, sampling_params(cfg, stop_ids, seed),
                                                            tokenizer, scorer)
        metrics["perf/rollout_s"] += time.perf_counter() - t0
        metrics["perf/compiles"] += stats.get("compiles", 0.0)
        metrics["rollout/tokens"] += sum(len(c.token_ids) for c in completions)
        pad.append(stats.get("pad_frac", 0.0))
        zero = zero_std_groups(raw, g)
        all_raw.append(raw)
        all_zero.append(zero)
        for i, prompt in enumerate(prompts):
            if cfg.grpo.dynamic_sampling and zero[i]:
                continue
            sl = slice(i * g, (i + 1) * g)
            kept.append((prompt, completions[sl], texts[sl], raw[sl]))
        if len(kept) >= want:
            break
    if not kept:  # every group was uninformative: train on nothing rather than on noise
        return None, metrics | rollout_metrics(np.concatenate(all_raw), np.concatenate(all_zero), [], pad)
    raw = np.concatenate([k[3] for k in kept])
    completions = [c for k in kept for c in k[1]]
    lengths = np.array([len(c.token_ids) for c in completions])
    rewards = raw + overlong_penalty(lengths, cfg.rollout.max_response_len, cfg.grpo.overlong_buffer,
                                     cfg.grpo.overlong_penalty)
    samples = Samples(prompts=[k[0] for k in kept], completions=completions, texts=[t for k in kept for t in k[2]],
                      raw_rewards=raw, rewards=rewards,
                      advantages=group_advantages(rewards, g, std_scale=cfg.grpo.std_scale))
    metrics |= rollout_metrics(np.concatenate(all_raw), np.concatenate(all_zero), completions, pad)
    metrics["rollout/groups_kept"] = len(kept)
    metrics["perf/rollout_tok_per_s"] = metrics["rollout/tokens"] / max(metrics["perf/rollout_s"], 1e-9)
    return samples, metrics


def rollout_metrics(raw: np.ndarray, zero: np.ndarray, completions: list, pad: list[float]) -> dict:
    lengths = np.array([len(c.token_ids) for c in completions]) if completions else np.zeros(1)
    return {"rollout/raw_reward": float(raw.mean()),
            "rollout/response_len/mean": float(lengths.mean()),
            "rollout/response_len/max": float(lengths.max()),
            "rollout/truncated_ratio": float(np.mean([c.finish_reason == "length" for c in completions]))
            if completions else 0.0,
            "rollout/zero_std_ratio": float(zero.mean()),
            "rollout/weight_version": float(min(c.weight_version for c in completions)) if completions else -1.0,
            "perf/pad_frac": float(np.mean(pad)) if pad else 0.0}


def evaluate(cfg: Config, data: PromptData, cluster, tokenizer, scorer: RewardScorer,
             stop_ids: tuple[int, ...], name: str) -> dict:
    """Mean accuracy (reward > 0) over `eval.samples` completions for each eval prompt."""
    n = min(len(data), cfg.eval.max_prompts or len(data))
    prompts = [p for p in (data.get(i) for i in range(n)) if p is not None]
    sampling = sampling_params(cfg, stop_ids, seed=cfg.run.seed, temperature=cfg.eval.temperature)
    _, _, raw, _ = generate_and_score(cluster, prompts, cfg.eval.samples, sampling, tokenizer, scorer)
    return {f"eval/{name}": float((raw > 0).mean())}
