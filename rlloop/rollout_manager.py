"""The rollout side of the loop, as one object (slime's RolloutManager): prompts in, a scored training batch out.

`RolloutManager` owns what generating a step needs (the cluster handle, the tokenizer, the reward scorer, the stop
ids, the prompt data): `collect(step)` generates G samples per prompt, scores them, shapes rewards and computes
advantages; `evaluate()` scores the held-out set. With DAPO's dynamic sampling, groups whose rewards are all equal
carry no signal and are dropped; more prompts are drawn until the batch is full or `grpo.max_sampling_rounds` is
spent (then the batch trains short).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rlloop.advantages import group_advantages, overlong_penalty, zero_std_groups
from rlloop.config import Config
from rlloop.data import Prompt, PromptData
from rlloop.model import stop_token_ids
from rlloop.rewards import RewardScorer
from rollout import Completion, SamplingParams, mix_seed


@dataclass
class Samples:
    """One step's training samples: G completions per prompt, grouped, with rewards and advantages."""

    group_size: int
    prompts: list[Prompt]  # one per group
    completions: list[Completion]  # G per prompt, grouped
    texts: list[str]
    raw_rewards: np.ndarray  # from the reward function
    rewards: np.ndarray  # after overlong shaping
    advantages: np.ndarray

    def to_train_batch(self):
        from trainer import TrainBatch

        g = self.group_size
        return TrainBatch(
            prompts=[self.prompts[j // g].token_ids for j in range(len(self.completions))],
            responses=[list(c.token_ids) for c in self.completions],
            advantages=[float(a) for a in self.advantages],
            rollout_logprobs=[list(c.logprobs) for c in self.completions],
        )

    def rows(self) -> list[dict]:
        """One JSON-able row per sample, for `tracking.save_rollouts` and replay."""
        return [
            {
                "prompt_index": self.prompts[j // self.group_size].index,
                "prompt": self.prompts[j // self.group_size].messages,
                "answer": self.prompts[j // self.group_size].answer,
                "response": text,
                "reward": float(r),
                "advantage": float(a),
                "weight_version": c.weight_version,
                "finish_reason": c.finish_reason,
            }
            for j, (c, text, r, a) in enumerate(zip(self.completions, self.texts, self.rewards, self.advantages))
        ]


@dataclass
class StepRollout:
    """What `collect` returns: the samples to train on (None when every group was uninformative) and metrics."""

    samples: Samples | None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Generation:
    """One generate call, decoded and scored."""

    completions: list[Completion]
    texts: list[str]
    rewards: np.ndarray
    stats: dict[str, float]


class RolloutManager:
    def __init__(self, cfg: Config, cluster, tokenizer, data: PromptData, eval_data: PromptData | None = None):
        self.cfg, self.cluster, self.tokenizer = cfg, cluster, tokenizer
        self.data, self.eval_data = data, eval_data
        r = cfg.reward
        self.scorer = RewardScorer(r.fn, timeout_s=r.timeout_s, failure_reward=r.failure_reward, workers=r.workers)
        self.stop_ids = stop_token_ids(tokenizer)
        self.eval_name = cfg.eval.name or (Path(cfg.eval.path).stem if cfg.eval.path else None)

    def sampling(self, seed: int, temperature: float | None = None) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(
            temperature=r.temperature if temperature is None else temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_response_len,
            stop_token_ids=self.stop_ids,
            seed=seed,
        )

    def generate(self, prompts: list[Prompt], n: int, sampling: SamplingParams) -> Generation:
        completions, stats = self.cluster.generate([p.token_ids for p in prompts], n, sampling)
        texts = self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        answers = [prompts[c.prompt_index].answer for c in completions]
        return Generation(completions, texts, np.asarray(self.scorer.score(texts, answers), np.float32), stats)

    def collect(self, step: int) -> StepRollout:
        """Rollout, reward and advantages of one step."""
        cfg = self.cfg
        g, want = cfg.rollout.group_size, cfg.rollout.prompts_per_step
        kept: list[tuple[Prompt, slice, Generation]] = []
        metrics = {"perf/rollout_s": 0.0, "perf/compiles": 0.0, "rollout/tokens": 0.0}
        all_raw, all_zero, pad = [], [], []
        for round_ in range(cfg.grpo.max_sampling_rounds if cfg.grpo.dynamic_sampling else 1):
            prompts = self.data.next_batch(want - len(kept))
            t0 = time.perf_counter()
            gen = self.generate(prompts, g, self.sampling(mix_seed(cfg.run.seed, step * 101 + round_)))
            metrics["perf/rollout_s"] += time.perf_counter() - t0
            metrics["perf/compiles"] += gen.stats.get("compiles", 0.0)
            metrics["rollout/tokens"] += sum(len(c.token_ids) for c in gen.completions)
            pad.append(gen.stats.get("pad_frac", 0.0))
            zero = zero_std_groups(gen.rewards, g)
            all_raw.append(gen.rewards)
            all_zero.append(zero)
            kept += [
                (p, slice(i * g, (i + 1) * g), gen)
                for i, p in enumerate(prompts)
                if not (cfg.grpo.dynamic_sampling and zero[i])
            ]
            if len(kept) >= want:
                break
        raw_all, zero_all = np.concatenate(all_raw), np.concatenate(all_zero)
        if not kept:  # every group was uninformative: train on nothing rather than on noise
            return StepRollout(None, metrics | rollout_metrics(raw_all, zero_all, [], pad))
        completions = [c for _, sl, gen in kept for c in gen.completions[sl]]
        raw = np.concatenate([gen.rewards[sl] for _, sl, gen in kept])
        lengths = np.array([len(c.token_ids) for c in completions])
        rewards = raw + overlong_penalty(
            lengths, cfg.rollout.max_response_len, cfg.grpo.overlong_buffer, cfg.grpo.overlong_penalty
        )
        samples = Samples(
            group_size=g,
            prompts=[p for p, _, _ in kept],
            completions=completions,
            texts=[t for _, sl, gen in kept for t in gen.texts[sl]],
            raw_rewards=raw,
            rewards=rewards,
            advantages=group_advantages(rewards, g, std_scale=cfg.grpo.std_scale),
        )
        metrics |= rollout_metrics(raw_all, zero_all, completions, pad)
        metrics["rollout/groups_kept"] = len(kept)
        metrics["perf/rollout_tok_per_s"] = metrics["rollout/tokens"] / max(metrics["perf/rollout_s"], 1e-9)
        return StepRollout(samples, metrics)

    def evaluate(self) -> dict[str, float]:
        """Mean accuracy (reward > 0) over `eval.samples` completions for each eval prompt."""
        data, cfg = self.eval_data, self.cfg.eval
        n = min(len(data), cfg.max_prompts or len(data))
        prompts = [p for p in (data.get(i) for i in range(n)) if p is not None]
        gen = self.generate(prompts, cfg.samples, self.sampling(seed=self.cfg.run.seed, temperature=cfg.temperature))
        return {f"eval/{self.eval_name}": float((gen.rewards > 0).mean())}

    def counters(self) -> dict[str, float]:
        """Running totals the loop logs every step."""
        return {
            "data/dropped_prompts": self.data.dropped,
            "rollout/reward_failures": self.scorer.errors + self.scorer.timeouts,
        }

    def close(self) -> None:
        self.scorer.close()


def rollout_metrics(raw: np.ndarray, zero: np.ndarray, completions: list[Completion], pad: list[float]) -> dict:
    lengths = np.array([len(c.token_ids) for c in completions]) if completions else np.zeros(1)
    return {
        "rollout/raw_reward": float(raw.mean()),
        "rollout/response_len/mean": float(lengths.mean()),
        "rollout/response_len/max": float(lengths.max()),
        "rollout/truncated_ratio": float(np.mean([c.finish_reason == "length" for c in completions]))
        if completions
        else 0.0,
        "rollout/zero_std_ratio": float(zero.mean()),
        "rollout/weight_version": float(min(c.weight_version for c in completions)) if completions else -1.0,
        "perf/pad_frac": float(np.mean(pad)) if pad else 0.0,
    }
