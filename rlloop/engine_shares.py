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
    """One generate call's stats over its engines, as sums a step's rounds add up further (RolloutTally): counts,
    the padding slots and all slots run (`perf/pad_frac` is their ratio), `busy_s` the slowest engine's, and each
    engine's busy seconds, tokens and generate seconds as engine_N/*."""
    stats = list(per_engine.values())
    merged = {
        "compiles": sum(s.get("compiles", 0.0) for s in stats),
        "padded_slots": sum(s.get("padded_slots", 0.0) for s in stats),
        "pad_slots": sum(s.get("pad_slots", 0.0) for s in stats),
        "busy_s": max(s.get("busy_s", 0.0) for s in stats),
    }
    for e, s in per_engine.items():
        merged[f"engine_{e}/busy_s"] = s.get("busy_s", 0.0)
        merged[f"engine_{e}/tokens"] = s.get("gen_tokens", 0.0)
        merged[f"engine_{e}/seconds"] = s.get("wall_s", 0.0)
    return merged


def engine_metrics(totals: dict[str, float]) -> dict[str, float]:
    """rollout/engine_N/busy_s and tok_per_s from the engine_N/* sums of `merge_stats` over a step's calls (a top-up
    round on one engine counts toward that engine's); none where engine 0 did all the work."""
    engines = sorted({int(k.split("/")[0].removeprefix("engine_")) for k in totals})
    if engines in ([], [0]):
        return {}
    out = {}
    for e in engines:
        out[f"rollout/engine_{e}/busy_s"] = totals[f"engine_{e}/busy_s"]
        out[f"rollout/engine_{e}/tok_per_s"] = totals[f"engine_{e}/tokens"] / max(totals[f"engine_{e}/seconds"], 1e-9)
    return out
