"""`python -m rlloop.bench loop`: the same steps in `loop.mode` sync, async and fully_async, and 1 vs 2 rollout engines.

Part 1 runs the real loop (`rlloop.loop.train`, Ray actors: one engine on one core, one trainer rank on the other)
in each mode, on two settings:
    tiny      the embedded default as shipped (examples/grpo_dapo_tiny.yaml): training dominates the step
    balanced  the same model and task with responses that run to --balanced-len tokens (rollout.ignore_eos) and an
              engine of --balanced-slots KV slots (rollout.max_batch), so the 128 samples decode in waves, as on a
              memory-bound accelerator: generation and training then take about the same time, the case the
              async modes exist for
and reports seconds per step (mean over the steps after the first two, which include the async pipeline's fill, and
before the last, which in the async modes has no next batch to wait for: every mode over the same steps, so --steps
is 4 or more), each actor's busy fraction (its own seconds in generate / train_step over the wall time of those
steps), staleness, and learning (mean raw reward of the first and of the last `reward_window` steps: 5, or half
the run below 10 steps, so the two never overlap; eval accuracy at the start and the end
where the setting evaluates: tiny, at the last step, whose eval is taken out of its step time).

Part 2 is rollout only: one generate call of --engine-prompts prompts x 8 samples through `Cluster.generate` on a
random Qwen3 --engine-hidden wide (compute, not dispatch overhead, dominates its decode), with 1 engine on one core
and with 2 engines on one core each (best of 3 after a warm call); the ratio is the gain from the second engine.

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from rlloop.bench import positive_int
from rlloop.bench.machine import machine

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "grpo_dapo_tiny.yaml"
MODES = ("sync", "async", "fully_async")


def wide_model(workdir: Path, hidden: int) -> Path:
    """The tiny task's tokenizer with a random Qwen3 `hidden` wide (4 layers), in `workdir`; the one made there
    already if there is one (the same seed: the same model)."""
    import torch
    import transformers

    src = ROOT / "rlloop" / "assets" / "tiny" / "model"
    out = workdir / f"wide-{hidden}"
    if out.exists():
        return out
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = transformers.AutoConfig.from_pretrained(src)
    cfg.update(
        dict(
            hidden_size=hidden,
            intermediate_size=3 * hidden,
            num_hidden_layers=4,
            head_dim=32,
            num_attention_heads=hidden // 32,
            num_key_value_heads=max(1, hidden // 64),
            max_position_embeddings=512,
            layer_types=["full_attention"] * 4,
        )
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


def run_mode(setting: str, mode: str, overrides: list[str], workdir: Path) -> dict:
    from rlloop.config import load_config
    from rlloop.loop import train
    from rlloop.tracking import read_metrics

    run_dir = workdir / f"{setting}-{mode}"
    cfg = load_config(TINY, [*overrides, f"loop.mode={mode}", f"run.dir={run_dir}", "tracking.progress=false"])
    t0 = time.perf_counter()
    train(cfg)
    wall = time.perf_counter() - t0
    return summarize(read_metrics(run_dir / "metrics.jsonl")) | {"wall_s": wall}


def summarize(metrics: list[dict]) -> dict:
    """A run's figures from its metrics.jsonl rows. Timed are the steps after the first two (the async pipeline's
    fill) and before the last (in the async modes step k's time holds the wait for batch k + 1, and the last has
    none), without their evaluation: the same steps in every mode, the same work."""
    rows = [r for r in metrics if r["step"] > 0]
    timed = rows[2:-1]
    step_s = sum(r["perf/step_s"] - r.get("perf/eval_s", 0.0) for r in timed)

    def total(key: str) -> float:
        return sum(r.get(key, 0.0) for r in timed)

    evals = [r[k] for r in metrics for k in r if k.startswith("eval/")]
    rewards = [r["rollout/raw_reward"] for r in rows]
    window = max(1, min(5, len(rows) // 2))  # steps averaged at each end: 5, or half the run, so they never overlap
    return {
        "s_per_step": step_s / len(timed),
        "rollout_busy": total("perf/rollout_busy_s") / step_s,
        "train_busy": total("perf/train_busy_s") / step_s,
        "staleness_mean": float(np.mean([r.get("rollout/staleness/mean", 0.0) for r in rows])),
        "staleness_max": max(r.get("rollout/staleness/max", 0.0) for r in rows),
        "reward_first": float(np.mean(rewards[:window])),
        "reward_last": float(np.mean(rewards[-window:])),
        "reward_window": window,
        "eval_start": evals[0] if evals else None,
        "eval_end": evals[-1] if evals else None,
        "steps": len(rows),
    }


def engines_throughput(model: Path, prompts_n: int, max_len: int, workdir: Path) -> dict:
    """Rollout-only tokens/s of one generate call through the Cluster, with 1 and with 2 engines."""
    import ray

    from rlloop.cluster import Cluster
    from rlloop.config import load_config
    from rollout import SamplingParams

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 90, int(rng.integers(16, 40))).tolist() for _ in range(prompts_n)]
    sampling = SamplingParams(max_new_tokens=max_len, ignore_eos=True, seed=1)
    out = {}
    for engines in (1, 2):
        cfg = load_config(
            TINY,
            [
                f"model.path={model}",
                f"rollout.max_response_len={max_len}",
                f"cluster.rollout_engines={engines}",
                f"cluster.rollout_chips={engines}",
                "rollout.decode_buckets=[16,64,128]",
                f"run.dir={workdir / f'engines-{engines}'}",
            ],
        )
        # a Ray of its own, as rlloop.run starts: never a `ray start` head on the host; + 1 for the idle trainer
        ray.init(address="local", num_cpus=os.cpu_count() + 1, include_dashboard=False, configure_logging=False)
        try:
            cluster = Cluster(cfg)
            try:
                cluster.warmup()
                cluster.generate(prompts, 8, sampling)
                best = float("inf")
                for _ in range(3):
                    t0 = time.perf_counter()
                    completions, _ = cluster.generate(prompts, 8, sampling)
                    best = min(best, time.perf_counter() - t0)
                out[f"engines_{engines}_tok_s"] = sum(len(c.token_ids) for c in completions) / best
            finally:
                cluster.close()
        finally:
            ray.shutdown()
    out["engines_speedup"] = out["engines_2_tok_s"] / out["engines_1_tok_s"]
    return out


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m rlloop.bench loop", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=positive_int, default=12, help="steps per run (4 or more: 2 fill, 1 last, untimed)")
    ap.add_argument("--engine-hidden", type=int, default=384, help="width of the random model of part 2")
    ap.add_argument(
        "--balanced-hidden",
        type=int,
        default=0,
        help="width of a random model for the balanced setting (0: the tiny model itself)",
    )
    ap.add_argument("--balanced-len", type=int, default=64)
    ap.add_argument("--balanced-slots", type=int, default=2, help="engine KV slots (rollout.max_batch) when balanced")
    ap.add_argument("--engine-prompts", type=int, default=32)
    ap.add_argument("--settings", default="tiny,balanced", help="comma list of tiny,balanced")
    args = ap.parse_args(argv)
    if args.steps < 4:
        ap.error(f"--steps {args.steps}: 4 or more (the first two and the last step are not timed)")
    if unknown := set(args.settings.split(",")) - {"tiny", "balanced"}:
        ap.error(f"--settings: unknown {', '.join(sorted(unknown))}; expected tiny and/or balanced")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    result = {"bench": "loop", **machine(), "steps": args.steps}
    with tempfile.TemporaryDirectory(prefix="rlloop_bench_loop_") as tmp:
        work = Path(tmp)
        model = wide_model(work, args.engine_hidden)
        settings = {
            "tiny": [f"run.steps={args.steps}", "run.save_every=0", f"run.eval_every={args.steps}"],
            "balanced": [
                f"run.steps={args.steps}",
                "run.save_every=0",
                "run.eval_every=0",
                "rollout.ignore_eos=true",
                *([f"model.path={wide_model(work, args.balanced_hidden)}"] if args.balanced_hidden else []),
                f"rollout.max_response_len={args.balanced_len}",
                f"rollout.max_batch={args.balanced_slots}",
                f"rollout.decode_buckets=[{args.balanced_slots}]",
                # responses forced to full length all score -1, so every advantage is 0: train them anyway, or the
                # trainer skips them all (train.skip_zero_advantage) and the setting is generation alone
                "train.skip_zero_advantage=false",
            ],
        }
        for setting in args.settings.split(","):
            runs = {mode: run_mode(setting, mode, settings[setting], work) for mode in MODES}
            sync_s = runs["sync"]["s_per_step"]
            for mode, r in runs.items():
                r["speedup_vs_sync"] = sync_s / r["s_per_step"]
                print(
                    f"[{setting}] {mode:<11} {r['s_per_step']:.3f} s/step ({r['speedup_vs_sync']:.2f}x sync), busy "
                    f"rollout {r['rollout_busy']:.0%} train {r['train_busy']:.0%}, staleness max "
                    f"{r['staleness_max']:.0f}, reward {r['reward_first']:+.3f} -> {r['reward_last']:+.3f}",
                    flush=True,
                )
            result[setting] = runs
        result["rollout_only"] = engines_throughput(model, args.engine_prompts, args.balanced_len, work)
        print(
            f"rollout only: 1 engine {result['rollout_only']['engines_1_tok_s']:.0f} tok/s, 2 engines "
            f"{result['rollout_only']['engines_2_tok_s']:.0f} tok/s "
            f"({result['rollout_only']['engines_speedup']:.2f}x)",
            flush=True,
        )
    print(json.dumps(result))
