"""The rollout side of the loop, as one object (slime's RolloutManager): prompts in, a scored training batch out.

`RolloutManager` owns what generating a step needs (the cluster handle, the tokenizer, the reward scorer, the stop
ids, the prompt data): `collect(step)` generates G samples per prompt, scores them, shapes rewards and computes
advantages; `evaluate()` scores the held-out set. With DAPO's dynamic sampling, groups whose rewards are all equal
carry no signal and are dropped; more prompts are drawn until the batch is full or `grpo.max_sampling_rounds` is
spent (then the batch trains short).
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rlloop.advantages import group_advantages, overlong_penalty, zero_std_groups
from rlloop.config import Config
from rlloop.data import Prompt, PromptData, distinct
from rlloop.engine_shares import engine_metrics
from rlloop.model import stop_token_ids
from rlloop.profiling import profile_dir
from rlloop.reward_scorer import RewardScorer
from rollout import Completion, SamplingParams, mix_seed

log = logging.getLogger(__name__)


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
                "raw_reward": float(raw),
                "advantage": float(a),
                "weight_version": c.weight_version,
                "last_weight_version": c.last_weight_version,
                "finish_reason": c.finish_reason,
                # what --debug train-only needs to rebuild the TrainBatch exactly (JSON floats round-trip)
                "prompt_ids": self.prompts[j // self.group_size].token_ids,
                "response_ids": list(c.token_ids),
                "rollout_logprobs": [float(x) for x in c.logprobs],
            }
            for j, (c, text, r, raw, a) in enumerate(
                zip(self.completions, self.texts, self.rewards, self.raw_rewards, self.advantages)
            )
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
        # A function that fails on a step's worth of samples in a row ends the run (RewardError)
        self.scorer = RewardScorer(cfg.reward, broken_after=cfg.rollout.prompts_per_step * cfg.rollout.group_size)
        self.stop_ids = tuple(dict.fromkeys((*stop_token_ids(tokenizer), *cfg.rollout.stop_token_ids)))
        self._scoring = threading.Lock()
        self.unpublished: set[int] = set()  # steps that changed no weight (trained nothing, or a non-finite step)
        self.eval_failures = self.eval_timeouts = 0  # of the scorer's, those of eval samples
        self.eval_name = cfg.eval.name or (Path(cfg.eval.path).stem if cfg.eval.path else None)

    def sampling(self, seed: int, evaluating: bool = False) -> SamplingParams:
        """The rollout's sampling, or with `evaluating` the eval section's: its temperature, and its top-p and top-k
        where set; an evaluation always stops at EOS (rollout.ignore_eos is for benchmarks)."""
        r, e = self.cfg.rollout, self.cfg.eval
        ignore_eos = r.ignore_eos and not evaluating
        return SamplingParams(
            temperature=e.temperature if evaluating else r.temperature,
            top_p=e.top_p if evaluating and e.top_p is not None else r.top_p,
            top_k=e.top_k if evaluating and e.top_k is not None else r.top_k,
            max_new_tokens=r.max_response_len,
            # ignore_eos runs past the EOS ids, not past the ones asked for by name (as vLLM's and SGLang's)
            stop_token_ids=tuple(r.stop_token_ids) if ignore_eos else self.stop_ids,
            seed=seed,
            ignore_eos=ignore_eos,
        )

    def generate(
        self,
        prompts: list[Prompt],
        n: int,
        sampling: SamplingParams,
        in_flight: bool = False,
        profile: str | None = None,
        evaluating: bool = False,
    ) -> Generation:
        completions, stats = self.cluster.generate([p.token_ids for p in prompts], n, sampling, in_flight, profile)
        with self._scoring:  # the async loop modes score from two threads (the rollout thread and eval)
            texts = self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
            answers = [prompts[c.prompt_index].answer for c in completions]
            before = (self.scorer.failures, self.scorer.timeouts)
            rewards = np.asarray(self.scorer.score(texts, answers), np.float32)
            if evaluating:  # counted apart: the rollout's totals go with its batches, an eval's with its step
                self.eval_failures += self.scorer.failures - before[0]
                self.eval_timeouts += self.scorer.timeouts - before[1]
        return Generation(completions, texts, rewards, stats)

    def groups(
        self, prompts: list[Prompt], seed: int, in_flight: bool = False, profile: str | None = None
    ) -> tuple[list[Group], dict]:
        """G scored samples of each prompt, as groups, and the generation's stats (wall seconds included); with
        `profile`, the engines trace the generation there."""
        g = self.cfg.rollout.group_size
        t0 = time.perf_counter()
        gen = self.generate(prompts, g, self.sampling(seed), in_flight, profile)
        stats = {**gen.stats, "wall_s": time.perf_counter() - t0}
        groups = [
            Group(
                p,
                gen.completions[i * g : (i + 1) * g],
                gen.texts[i * g : (i + 1) * g],
                gen.rewards[i * g : (i + 1) * g],
            )
            for i, p in enumerate(prompts)
        ]
        return groups, stats

    def collect(self, step: int) -> StepRollout:
        """Rollout, reward and advantages of one step, generated now on the engines' current weights."""
        cfg = self.cfg
        want = cfg.rollout.prompts_per_step
        kept: list[Group] = []
        tally = RolloutTally()
        drawn = 0
        for round_ in range(cfg.grpo.max_sampling_rounds if cfg.grpo.dynamic_sampling else 1):
            prompts = self.data.next_batch(top_up(want, len(kept), drawn))
            drawn += len(prompts)
            seed = sampling_seed(cfg.run.seed, step, round_)
            groups, stats = self.groups(prompts, seed, profile=profile_dir(cfg, step))
            tally.add(groups, stats)
            kept += [grp for grp in groups if not (cfg.grpo.dynamic_sampling and grp.zero_std)]
            if len(kept) >= want:
                break
        batch = self.batch(step, kept[:want], tally)
        batch.metrics["rollout/groups_surplus"] = max(len(kept) - want, 0)  # informative, not trained (as verl's DAPO)
        return batch

    def record_publication(self, step: int, published: bool) -> None:
        """The schedule's word that `step` trained and did or did not publish weights."""
        if not published:
            self.unpublished.add(step)

    def updates_behind(self, version: int, step: int) -> int:
        """How many weight updates the trainer of `step` holds past `version`: it holds step - 1's weights, and each
        step since `version` changed them, but for those that published nothing (as far as known: in the async modes
        step - 1 may still be training). Counted in step numbers alone, a sample of unchanged weights looked stale, and
        in fully_async two such steps in a row made every later group too stale to train, for ever."""
        return step - 1 - version - sum(version < s < step for s in tuple(self.unpublished))

    def batch(self, step: int, groups: list[Group], tally: RolloutTally) -> StepRollout:
        """Shape rewards (overlong), compute group advantages and the step's rollout metrics, the running totals
        among them as of now: in the async modes the engines go on to the next batch while the loop logs this one."""
        cfg = self.cfg
        metrics = tally.metrics() | self.counters()
        # --debug rollout-only has no trainer, and its engines the initial weights throughout
        behind = (lambda v: 0) if cfg.run.debug == "rollout-only" else (lambda v: self.updates_behind(v, step))
        metrics["rollout/groups_kept"] = len(groups)
        completions = [c for grp in groups for c in grp.completions]
        # No group kept (every one uninformative; train_chips >= 1): train on nothing rather than on noise. So too
        # for a batch cut short by dynamic sampling that would leave a trainer rank without a sample.
        if len(groups) * cfg.rollout.group_size < cfg.cluster.train_chips:
            if groups:
                log.warning(
                    "step %d kept %d groups, too few for %d trainer ranks: it trains on nothing",
                    step,
                    len(groups),
                    cfg.cluster.train_chips,
                )
            return StepRollout(None, metrics | rollout_metrics(completions, behind))  # of the groups it kept
        raw = np.concatenate([grp.rewards for grp in groups])
        lengths = np.array([len(c.token_ids) for c in completions])
        rewards = raw + overlong_penalty(
            lengths, cfg.rollout.max_response_len, cfg.grpo.overlong_buffer, cfg.grpo.overlong_penalty
        )
        samples = Samples(
            group_size=cfg.rollout.group_size,
            prompts=[grp.prompt for grp in groups],
            completions=completions,
            texts=[t for grp in groups for t in grp.texts],
            raw_rewards=raw,
            rewards=rewards,
            advantages=group_advantages(rewards, cfg.rollout.group_size, std_scale=cfg.grpo.std_scale),
        )
        return StepRollout(samples, metrics | rollout_metrics(completions, behind))

    def evaluate(self) -> dict[str, float]:
        """Mean accuracy (reward > 0) over `eval.samples` completions for each distinct eval prompt, on the newest
        weights (in the async loop modes the engines may not have loaded them yet). A file that repeats its rows (some
        copies of AIME 2024 hold each problem 32 times, for one sample each) costs no more than one that does not."""
        self.cluster.pull_weights()
        data, cfg = self.eval_data, self.cfg.eval
        # the first max_prompts distinct rows that fit data.max_prompt_len (load_inputs checked that some do)
        fitting = filter(None, map(data.get, range(len(data))))
        prompts = list(itertools.islice(distinct(fitting), cfg.max_prompts or len(data)))
        sampling = self.sampling(seed=self.cfg.run.seed, evaluating=True)
        gen = self.generate(prompts, cfg.samples, sampling, evaluating=True)
        accuracy = float((gen.rewards > 0).mean())
        return {f"eval/{self.eval_name}": accuracy, "rollout/eval_reward_failures": self.eval_failures}

    def counters(self) -> dict[str, float]:
        """Running totals the loop logs every step, with its batch."""
        return {
            "data/dropped_prompts": self.data.dropped,
            "rollout/reward_failures": self.scorer.failures - self.eval_failures,
            "rollout/reward_timeouts": self.scorer.timeouts - self.eval_timeouts,
            "rollout/engine_restarts": self.cluster.restarts,
        }

    def close(self) -> None:
        self.scorer.close()


def sampling_seed(run_seed: int, step: int, round_: int = 0) -> int:
    """The sampling seed of dynamic-sampling round `round_` of step `step`: a nested mix, so that no number of rounds
    reaches another step's seeds (a flat `step * k + round` does at round k). fully_async chunks use step = -chunk."""
    return mix_seed(mix_seed(run_seed, step), round_)


def top_up(want: int, kept: int, drawn: int) -> int:
    """How many prompts the next dynamic-sampling round draws: the missing groups divided by the fraction kept so
    far (DAPO over-samples, so a batch rarely trains short), at most one full batch per round."""
    return oversampled(want - kept, kept, drawn, want) if drawn else want


def oversampled(missing: int, kept: int, drawn: int, most: int) -> int:
    """Prompts to draw for `missing` groups when dynamic sampling has kept `kept` of `drawn`: the missing ones over that
    share, at most `most` (all of them while none was kept)."""
    return min(most, math.ceil(missing * drawn / kept)) if kept else most


@dataclass
class Group:
    """G completions of one prompt, decoded and scored."""

    prompt: Prompt
    completions: list[Completion]
    texts: list[str]
    rewards: np.ndarray  # raw, from the reward function

    @property
    def zero_std(self) -> bool:
        """All rewards equal: no advantage signal (DAPO's dynamic sampling drops these)."""
        return bool(zero_std_groups(self.rewards, len(self.rewards))[0])

    @property
    def first_version(self) -> int:
        return min(c.weight_version for c in self.completions)


class RolloutTally:
    """What generating a step cost and saw, over all its rounds or chunks: every group generated, kept or not."""

    def __init__(self):
        self.rewards, self.zero = [], []
        self.seconds = self.busy = self.compiles = self.tokens = self.padded = self.pad = 0.0
        self.engines: dict[str, float] = {}  # merge_stats' engine_N/* sums

    def add(self, groups: list[Group], stats: dict) -> None:
        self.rewards += [grp.rewards for grp in groups]
        self.zero += [grp.zero_std for grp in groups]
        self.padded += stats.get("padded_slots", 0.0)
        self.pad += stats.get("pad_slots", 0.0)
        self.seconds += stats["wall_s"]
        self.busy += stats.get("busy_s", 0.0)
        self.compiles += stats.get("compiles", 0.0)
        self.tokens += sum(len(c.token_ids) for grp in groups for c in grp.completions)
        for key, value in stats.items():
            if key.startswith("engine_"):
                self.engines[key] = self.engines.get(key, 0.0) + value

    def metrics(self) -> dict[str, float]:
        return {
            "perf/rollout_s": self.seconds,
            "perf/compiles": self.compiles,
            "rollout/tokens": self.tokens,
            "rollout/raw_reward": float(np.concatenate(self.rewards).mean()) if self.rewards else 0.0,
            "rollout/zero_std_ratio": float(np.mean(self.zero)) if self.zero else 0.0,
            "perf/pad_frac": self.pad / max(self.padded, 1.0),
            "perf/rollout_busy_s": self.busy,
            "perf/rollout_tok_per_s": self.tokens / max(self.seconds, 1e-9),
            **engine_metrics(self.engines),
        }


def rollout_metrics(completions: list[Completion], behind: Callable[[int], int]) -> dict:
    """Lengths, truncation and weight versions of a step's samples. Staleness is in weight updates: the trainer that
    takes a sample started on `weight_version` holds `behind(weight_version)` updates more."""
    if not completions:
        return {
            "rollout/response_len/mean": 0.0,
            "rollout/response_len/max": 0.0,
            "rollout/truncated_ratio": 0.0,
            "rollout/weight_version": -1.0,
        }
    lengths = np.array([len(c.token_ids) for c in completions])
    staleness = np.array([behind(c.weight_version) for c in completions])
    return {
        "rollout/response_len/mean": float(lengths.mean()),
        "rollout/response_len/max": float(lengths.max()),
        "rollout/truncated_ratio": float(np.mean([c.finish_reason == "length" for c in completions])),
        "rollout/weight_version": float(min(c.weight_version for c in completions)),
        "rollout/staleness/mean": float(staleness.mean()),
        "rollout/staleness/max": float(staleness.max()),
        "rollout/versions_spanned_ratio": float(
            np.mean([c.last_weight_version != c.weight_version for c in completions])
        ),
    }
