"""How one generate call is shared out over the rollout engines and put back together: each share's seed, the time it
may take, and the call's merged stats."""

from __future__ import annotations

import dataclasses

from rollout import mix_seed


def batches_in(samples: int, max_batch: int) -> int:
    """Full engine batches that `samples` sequences take one after another (at least 1): an evaluation of 30 prompts
    x 16 samples through 256 slots takes 2, and as long as 2 training rollouts."""
    return max(1, -(-samples // max_batch))


def share_sampling(sampling, engine: int):
    """Engine i > 0 samples with seed mix_seed(seed, i), so that shares never repeat each other's random streams."""
    return sampling if engine == 0 else dataclasses.replace(sampling, seed=mix_seed(sampling.seed, engine))


def merge_stats(per_engine: dict[int, dict]) -> dict[str, float]:
    """One generate call's stats over its engines: counts add up, `busy_s` is the slowest engine's, and with several
    engines each one's tokens/s and busy seconds are kept as rollout/engine_N/*."""
    stats = list(per_engine.values())
    tokens = [s.get("gen_tokens", s.get("tokens", 0.0)) for s in stats]
    merged = {
        "compiles": sum(s.get("compiles", 0.0) for s in stats),
        "pad_frac": stats[0].get("pad_frac", 0.0)
        if len(stats) == 1
        else sum(s.get("pad_frac", 0.0) * t for s, t in zip(stats, tokens)) / max(sum(tokens), 1.0),
        "busy_s": max(s.get("busy_s", 0.0) for s in stats),
    }
    if len(per_engine) > 1 or next(iter(per_engine)) > 0:
        for e, s in per_engine.items():
            merged[f"rollout/engine_{e}/tok_per_s"] = s.get("tok_s", 0.0)
            merged[f"rollout/engine_{e}/busy_s"] = s.get("busy_s", 0.0)
    return merged
