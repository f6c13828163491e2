"""`python -m rlloop.bench e2e`: TRL's GRPOTrainer vs rlloop on the same GRPO work, end to end, seconds per step.

    python -m rlloop.bench e2e [--settings tiny,30m] [--steps N] [--rounds R] [--quick] [--threads T]
                               [--modes sync,async[,fully_async,colocate]] [--frameworks trl,rlloop]
                               [--dtype float32|bfloat16]

Both settings are examples/grpo_dapo_tiny.yaml (its tokenizer, the prompts rlloop's loader draws, rlloop's DAPO
verifier, 16 prompts x 8 samples, lr, loss dapo with eps 0.2/0.28, beta 0, temperature 1) on one of two models:
    tiny  the shipped rlloop/assets/tiny/model; responses end at EOS or 16 tokens
    30m   a random Qwen3 of ~28M parameters with the tiny tokenizer (`wide_model(768)` of rlloop/bench/loop.py); every
          response runs to 128 tokens (rollout.ignore_eos; TRL: min_new_tokens), so compute dominates. A random
          policy never writes "Answer:": its reward stays at -1, the setting is for timing (and so trains with
          train.skip_zero_advantage off, or every sample would be skipped)
TRL runs in this process (rlloop/bench/trl_runner.py: as its docs say for CPU, on the same prompts in the same order,
one optimizer step per 128 samples, rlloop's AdamW settings and constant lr) with --threads torch threads (default:
every core this process may use). rlloop runs its real loop (`rlloop.loop.train`, Ray actors) in each of --modes on
the same --threads cores: in sync, async and fully_async (`loop.mode`) engine and trainer on half of them each
(cluster.cpus_per_actor = threads // 2: they need 2 or more, and an odd count leaves one idle); `colocate` is sync
with both roles on all of them in turns (cluster.colocate). Each run's `cores` says what its engine and trainer had.
A mode may add options (`async+compile`, `async+no_skip`): `+compile` runs with `train.compile: layers`,
`+compile_model` with `train.compile: model` (the whole decoder as one graph), `+no_skip` with
`train.skip_zero_advantage: false`. --dtype is both sides' precision: float32 (the default), or bfloat16, where rlloop
runs `model.dtype: bfloat16` (bf16 weights and compute, fp32 AdamW masters) and TRL the mixed precision the
transformers docs give for CPU training (`bf16=True`: fp32 weights, bf16 autocast). The runs go back to back
(rlloop's first mode, TRL, then the other modes), --rounds times over: the machine is shared and noisy, so a ratio is
taken within each round, from runs a minute apart, and the median round is reported (each run's s/step too; every
round's figures are in the JSON).

Per setting: s/step (mean after the warm-up steps; in async and fully_async the last step is left out too: step k's
time holds the wait for batch k + 1, and the last has none to wait for), TRL/rlloop, rlloop's per-step breakdown
from metrics.jsonl (rollout, train, sync, other = the rest of the step; in async and fully_async, rollout is the
driver's wait for the next batch and train its wait for the training in flight, both inside the step's time), a
roofline bound (rlloop/bench/roofline.py: training FLOPs, each prompt once per group, with causal attention and the
LM head on responses only, plus generation FLOPs, both as rollout.cost counts them, over the matmul peak; generation
is bounded by decode bytes, each decode step reading the weights and the KV pages in use at that step, over the
memory bandwidth where that is slower; peaks measured by rlloop.bench.peaks in --dtype on --threads cores, best of
several) and every run's step over the bound of the same steps (the async modes' without the last), and the
per-step reward curves.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
from packaging.requirements import Requirement

from rlloop.bench import positive_int
from rlloop.bench.machine import machine
from rlloop.bench.roofline import bound, measure_peaks, step_work
from rlloop.bench.trl_runner import run_trl

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "grpo_dapo_tiny.yaml"
WIDE_HIDDEN = 768  # wide_model(768): 4 layers x 12 h^2 + a 99-token embedding, ~28.4M parameters
SETTINGS = ("tiny", "30m")
FRAMEWORKS = ("trl", "rlloop")
MODES = ("sync", "async", "fully_async", "colocate")
ASYNC_MODES = ("async", "fully_async")  # step k's perf/step_s holds the driver's wait for batch k + 1
DEFAULT_STEPS = {"tiny": 12, "30m": 4}
DEFAULT_ROUNDS = {"tiny": 3, "30m": 1}  # a tiny round takes about a minute, a 30m one half an hour
MODE_OPTIONS = {
    "compile": "train.compile=layers",
    "compile_model": "train.compile=model",
    "no_skip": "train.skip_zero_advantage=false",
}


def trl_requirement() -> Requirement | None:
    """The trl requirement of rlloop's `bench` extra, as the installed distribution's metadata has it (pyproject.toml
    writes the pin once); None when rlloop runs from a source tree that is not installed."""
    try:
        requires = importlib.metadata.requires("rlloop") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    reqs = [Requirement(text) for text in requires]
    return next((r for r in reqs if r.name == "trl" and r.marker and r.marker.evaluate({"extra": "bench"})), None)


def trl_missing() -> str | None:
    """Why the TRL column cannot be run here, or None; a note when the installed trl is not the one pinned."""
    try:
        import trl  # noqa: F401  (an installed trl that fails to import has no column either)
    except ImportError as e:
        return f"trl is not installed ({e}); pip install -e '.[bench]'"
    installed, pin = importlib.metadata.version("trl"), trl_requirement()
    if pin is None:
        print(f"note: trl {installed} installed; no trl in the bench extra of an installed rlloop to check against")
    elif not pin.specifier.contains(installed, prereleases=True):
        print(f"note: trl {installed} installed, the bench extra asks for {pin}", flush=True)
    return None


def setting_overrides(name: str, work: Path) -> list[str]:
    if name == "tiny":
        return []
    if name == "30m":
        from rlloop.bench.loop import wide_model

        model = wide_model(work, WIDE_HIDDEN)
        overrides = [f"model.path={model}", "rollout.max_response_len=128", "rollout.ignore_eos=true"]
        # Its constant reward gives every sample a zero advantage: the trainer would skip them all.
        return [*overrides, "train.skip_zero_advantage=false"]
    raise SystemExit(f"unknown setting {name!r}; expected tiny or 30m")


def draw_prompts(cfg, steps: int):
    """The prompts rlloop's loader serves for steps 1..steps (the same seed and order the loop draws), and the
    tokenizer. Without dynamic sampling every step draws exactly prompts_per_step of them."""
    from rlloop.data import load_datasets
    from rlloop.model import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    data, _ = load_datasets(cfg, tokenizer)
    return [data.next_batch(cfg.rollout.prompts_per_step) for _ in range(steps)], tokenizer


def timed_steps(values: list, skip: int, mode: str) -> list:
    """The steps a run's means are over: those after the `skip` warm-up steps, and in the async modes not the last
    either (it has no next batch to wait for: shorter than the others by that wait)."""
    return values[skip:-1] if mode.split("+")[0] in ASYNC_MODES else values[skip:]


def summarize(rows: list[dict], mode: str, skip: int) -> dict:
    """A run's figures from its metrics.jsonl rows (steps 1..N): means over `timed_steps`, and every step's."""

    def mean(key: str) -> float:
        return float(np.mean(timed_steps([r.get(key, 0.0) for r in rows], skip, mode)))

    # In the async modes the generation overlaps the train step: only the wait for the batch is on the step's path.
    rollout_key = "perf/rollout_wait_s" if mode.split("+")[0] in ASYNC_MODES else "perf/rollout_s"
    parts = {"rollout": mean(rollout_key), "train": mean("perf/train_s"), "sync": mean("perf/sync_s")}
    s_per_step = mean("perf/step_s")
    parts["other"] = s_per_step - sum(parts.values())
    return {
        "s_per_step": s_per_step,
        "breakdown_s": parts,
        "rollout_busy_s": mean("perf/rollout_busy_s"),
        "train_busy_s": mean("perf/train_busy_s"),
        "step_s": [r["perf/step_s"] for r in rows],
        "rewards": [r["rollout/raw_reward"] for r in rows],
        "response_len": [r["rollout/response_len/mean"] for r in rows],
        "response_len_max": [r["rollout/response_len/max"] for r in rows],
        "compiles": sum(r.get("perf/compiles", 0.0) for r in rows),
    }


# ---------------------------------------------------------------------------------------------------------- rlloop
def run_rlloop(cfg_overrides: list[str], mode: str, steps: int, skip: int, run_dir: Path, threads: int) -> dict:
    from rlloop.config import load_config
    from rlloop.loop import train
    from rlloop.tracking import read_metrics

    # No eval (TRL runs none: the steps compare the same work), no checkpoints.
    overrides = [*cfg_overrides, f"run.steps={steps}", "run.save_every=0", "run.eval_every=0"]
    loop_mode, *options = mode.split("+")  # main checked both
    overrides += [f"run.dir={run_dir}", "tracking.progress=false", *(MODE_OPTIONS[o] for o in options)]
    if loop_mode == "colocate":  # both roles on all `threads` cores, in turns (rlloop.placement.colocated_plan)
        overrides += ["loop.mode=sync", "cluster.colocate=true"]
        each = threads
    else:  # each role on half of them, its own: together the cores TRL and the peaks run on
        overrides.append(f"loop.mode={loop_mode}")
        each = threads // 2
    overrides.append(f"cluster.cpus_per_actor={each}")
    t0 = time.perf_counter()
    train(load_config(TINY, overrides))
    wall = time.perf_counter() - t0
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] > 0]
    out = summarize(rows, mode, skip)
    # Ray, actors, model loads, XLA warmup: outside the steps
    return out | {"cores": {"engine": each, "trainer": each}, "setup_s": wall - sum(out["step_s"])}


# ------------------------------------------------------------------------------------------------------------ main
def bench_setting(name: str, args, work: Path, trl_reason: str | None) -> dict:
    from rlloop.config import load_config

    steps = args.steps or (args.quick_steps if args.quick else DEFAULT_STEPS[name])
    skip = warmup_steps(steps)
    overrides = [*setting_overrides(name, work), f"model.dtype={args.dtype}"]
    cfg = load_config(TINY, overrides)
    batches, tokenizer = draw_prompts(cfg, steps)
    r = cfg.rollout
    out: dict = dict(steps=steps, warmup_steps=skip, prompts_per_step=r.prompts_per_step, group_size=r.group_size)
    out |= dict(max_response_len=r.max_response_len, ignore_eos=r.ignore_eos)
    frameworks = args.frameworks
    modes = args.modes if "rlloop" in frameworks else []
    with_trl = "trl" in frameworks and not trl_reason
    order = modes[:1] + (["trl"] if with_trl else []) + modes[1:]  # TRL between the rlloop runs
    rounds = args.rounds or (1 if args.quick else DEFAULT_ROUNDS[name])
    runs: dict[str, list[dict]] = {what: [] for what in order}
    for k in range(rounds):
        for what in order:
            if what == "trl":
                run = run_trl(cfg, batches, tokenizer, args.threads, work / f"{name}-trl-{k}", skip)
            else:
                run = run_rlloop(overrides, what, steps, skip, work / f"{name}-{what}-{k}", args.threads)
            runs[what].append(run)
            print(f"[{name}] round {k + 1}/{rounds} {what:<8} {run['s_per_step']:.3f} s/step", flush=True)
    out["rounds"] = rounds
    if "trl" in frameworks and trl_reason:
        out["trl"] = None
    for what, results in runs.items():
        out["trl" if what == "trl" else f"rlloop_{what}"] = median_run(results)
    if modes:
        out |= rooflines(cfg, batches, out[f"rlloop_{modes[0]}"], skip, modes)  # bound_s: in finish()
    for mode in modes if with_trl else ():
        out |= trl_over_rlloop(mode, runs["trl"], runs[mode])
    return out


def warmup_steps(steps: int) -> int:
    """The first steps left out of the means (compiles, allocator growth): two of six or more, one of two or more."""
    return 2 if steps >= 6 else 1 if steps >= 2 else 0


def trl_over_rlloop(mode: str, trl: list[dict], rlloop: list[dict]) -> dict:
    """TRL's s/step over `mode`'s, round by round (each round runs both side by side, so a neighbour's burst moves
    both), and the median of those ratios."""
    ratios = [t["s_per_step"] / m["s_per_step"] for t, m in zip(trl, rlloop, strict=True)]
    return {f"trl_over_rlloop_{mode}": float(np.median(ratios)), f"trl_over_rlloop_{mode}_rounds": ratios}


def median_run(results: list[dict]) -> dict:
    """The run of median s/step over the rounds (the lower one of an even count), with every round's s/step."""
    ranked = sorted(results, key=lambda r: r["s_per_step"])
    return ranked[(len(ranked) - 1) // 2] | {"s_per_step_rounds": [r["s_per_step"] for r in results]}


def rooflines(cfg, batches, rl: dict, skip: int, modes: list[str]) -> dict:
    """The work of one step averaged over the steps each run's s/step is over (`timed_steps`): "roofline" over those
    after the warm-up (sync, colocate, TRL), "roofline_async" without the last as well, when an async mode runs."""
    every = list(range(len(batches)))
    out = {"roofline": step_work(cfg, batches, rl, timed_steps(every, skip, "sync"))}
    if any(mode.split("+")[0] in ASYNC_MODES for mode in modes):
        out["roofline_async"] = step_work(cfg, batches, rl, timed_steps(every, skip, "async"))
    return out


def finish(out: dict, peaks: dict) -> None:
    """The roofline bounds at the best peaks seen in this invocation (the machine is shared: a single measurement
    can land in a neighbour's burst), and every run's step over the bound of the same steps."""
    if "roofline" not in out:  # TRL alone: the token counts are rlloop's
        return
    for key in ("roofline", "roofline_async"):
        if key in out:
            out[key] = bound(out[key], peaks)
    for key in [k for k in out if k == "trl" or k.startswith("rlloop_")]:
        if isinstance(out[key], dict):
            asynchronous = key.removeprefix("rlloop_").split("+")[0] in ASYNC_MODES
            roof = out["roofline_async" if asynchronous else "roofline"]
            out[f"{key}_over_bound"] = out[key]["s_per_step"] / roof["bound_s"]


def describe(name: str, r: dict) -> str:
    lines = [f"[{name}] {r['steps']} steps, means after {r['warmup_steps']} warm-up step(s); median of {r['rounds']}:"]
    for key in [k for k in r if (k == "trl" or k.startswith("rlloop_")) and isinstance(r[k], dict)]:
        parts = r[key].get("breakdown_s") or {"generate": r[key]["generate_s"]}
        lines.append(
            f"  {key:<15} {r[key]['s_per_step']:8.3f} s/step ({', '.join(f'{k} {v:.3f}' for k, v in parts.items())})"
        )
        lines.append(f"  {'':<15} reward " + " ".join(f"{x:+.2f}" for x in r[key]["rewards"]))
    for k in [k for k in r if k.startswith("trl_over_") and not k.endswith("_rounds") or k.endswith("_over_bound")]:
        each = r.get(f"{k}_rounds", [])
        lines.append(f"  {k} = {r[k]:.2f}" + (f" (rounds: {', '.join(f'{x:.2f}' for x in each)})" if each else ""))
    for key, which in (("roofline", ""), ("roofline_async", " (the async modes' steps, the last left out)")):
        if "bound_s" in r.get(key, {}):
            f = r[key]
            lines.append(
                f"  {key} {f['bound_s']:.3f} s/step{which}: train {f['train_s']:.3f} + generation max(compute "
                f"{f['gen_compute_s']:.3f}, memory {f['gen_memory_s']:.3f}), {f['params'] / 1e6:.2f}M params"
            )
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The arguments, every one checked (a usage error, exit 2) before any run starts."""
    ap = argparse.ArgumentParser(prog="python -m rlloop.bench e2e", description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", default=None, help="comma list of tiny,30m (default both; --quick: tiny)")
    ap.add_argument(
        "--steps", type=positive_int, help=f"steps per run (default {DEFAULT_STEPS}; --quick: 2, 3 with an async mode)"
    )
    ap.add_argument("--rounds", type=positive_int, help=f"runs of each, alternating (default {DEFAULT_ROUNDS})")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: 2 steps (3 with an async mode), 1 round, tiny, sync unless told",
    )
    ap.add_argument(
        "--threads", type=int, default=0, help="TRL's torch threads, rlloop's cores and the peaks' cores (0: all)"
    )
    ap.add_argument(
        "--modes", default=None, help="of sync,async,fully_async,colocate, each [+compile|+compile_model][+no_skip]"
    )
    ap.add_argument("--frameworks", default="trl,rlloop", help="trl,rlloop or one of them")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both sides' precision")
    args = ap.parse_args(argv)

    def listed(flag: str, text: str, allowed) -> list[str]:
        items = text.split(",")
        if unknown := [x for x in items if x not in allowed]:
            ap.error(f"{flag}: unknown {', '.join(map(repr, unknown))}; expected a comma list of {','.join(allowed)}")
        return items

    args.settings = listed("--settings", args.settings or ("tiny" if args.quick else "tiny,30m"), SETTINGS)
    args.frameworks = listed("--frameworks", args.frameworks, FRAMEWORKS)
    args.modes = (args.modes or ("sync" if args.quick else "sync,async")).split(",")
    for mode in args.modes:
        loop_mode, *options = mode.split("+")
        if loop_mode not in MODES:
            ap.error(f"--modes: unknown mode {loop_mode!r}; expected one of {', '.join(MODES)}")
        if unknown := [o for o in options if o not in MODE_OPTIONS]:
            ap.error(f"--modes: {mode}: unknown option(s) {', '.join(unknown)}; expected +{' +'.join(MODE_OPTIONS)}")
    loop_modes = {m.split("+")[0] for m in args.modes} if "rlloop" in args.frameworks else set()
    cores = len(os.sched_getaffinity(0))
    if not 0 <= args.threads <= cores:
        ap.error(f"--threads {args.threads}: this process may use {cores} core(s) (0: all of them)")
    args.threads = args.threads or cores
    if args.threads < 2 and loop_modes - {"colocate"}:
        ap.error(
            f"--threads {args.threads}: --modes {', '.join(sorted(loop_modes - {'colocate'}))} run the engine and the "
            "trainer on half of the cores each, so need 2 or more (colocate runs on 1)"
        )
    # An async mode leaves the warm-up step and the last step out of its means: 3 steps leave one timed.
    asynchronous = bool(loop_modes & set(ASYNC_MODES))
    if asynchronous and args.steps is not None and args.steps < 3:
        ap.error(f"--steps {args.steps}: the async modes need 3 or more (the warm-up and the last step are not timed)")
    args.quick_steps = 3 if asynchronous else 2
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    trl_reason = trl_missing() if "trl" in args.frameworks else None
    if trl_reason:
        print(f"TRL column missing: {trl_reason}", flush=True)
    trl_version = None if trl_reason or "trl" not in args.frameworks else importlib.metadata.version("trl")
    result: dict = dict(bench="e2e", **machine(), threads=args.threads, dtype=args.dtype)
    result |= dict(trl_version=trl_version, trl_missing=trl_reason, load_avg_start=os.getloadavg()[0])
    peaks = [measure_peaks(args.threads, args.dtype)]
    with tempfile.TemporaryDirectory(prefix="rlloop_bench_e2e_") as tmp:
        for name in args.settings:
            result[name] = bench_setting(name, args, Path(tmp), trl_reason)
            # Between and after the runs: the best one is the peak.
            peaks.append(measure_peaks(args.threads, args.dtype))
    best = {key: max(p[key] for p in peaks) for key in ("matmul_flops", "mem_bytes_per_s")}
    print(
        f"{args.dtype} peaks on {args.threads} core(s), best of {len(peaks)}: "
        f"matmul {best['matmul_flops'] / 1e9:.1f} GFLOP/s "
        f"(lowest {min(p['matmul_flops'] for p in peaks) / 1e9:.1f}), memory {best['mem_bytes_per_s'] / 1e9:.1f} GB/s",
        flush=True,
    )
    result["peak_matmul_flops"], result["peak_mem_bytes_per_s"] = best["matmul_flops"], best["mem_bytes_per_s"]
    result["peak_matmul_flops_each"] = [p["matmul_flops"] for p in peaks]
    result["load_avg_end"] = os.getloadavg()[0]  # other work on the machine: the ratios are what to read
    for name in args.settings:
        finish(result[name], best)
        print(describe(name, result[name]), flush=True)
    if trl_reason:
        print(f"TRL column missing: {trl_reason}", flush=True)
    print(json.dumps(result))
