"""Rollout throughput: the JAX bucketed decoder vs `transformers.generate` on the same weights and requests.

    python -m rlloop.bench rollout [--quick] [--models tiny,30m] [--prompts 8] [--n 8] [--new-tokens 128]
                                   [--repeats 3] [--threads 0] [--engines 2] [--vllm-python PATH]

Both engines load one saved HF checkpoint, get the same prompts, the same sampling settings (T=1, no top-k/top-p) and no
stop ids; the benchmark checkpoints carry no EOS id and requests set ignore_eos, so every row generates exactly
--new-tokens tokens. Models: "tiny" (the embedded example model) and "30m", a random Qwen3 of ~31M parameters (vocab
32000, hidden 384, 12 layers, 6 heads / 2 KV heads of 64, MLP 1024, tied head). MFU / MBU divide the run's FLOPs /
bytes, as the JAX engine counts them with `rollout.cost`, by the peaks that `rlloop.bench.peaks` measures on the same
device. The "jax" column is one engine in this process, one XLA device on all its cores; "jax_tp" one engine in a
process of its own as a run starts it on several cores, a single-threaded device per core, tensor-parallel
(rlloop.model_shape.cpu_engine_tp); `--engines N` adds N JAX engines side by side, each in its own process on 1/N of the
cores with 1/N of the prompts (`engine_worker.py`), as `cluster.rollout_engines` runs them (N: 2 by default, 1 on a
single core; at most the cores the run has); the same requests, so the same tokens and FLOPs. --threads T runs it all
on T of the cores the process may use (the JSON's "threads" and "cpus": the cores it ran on). Timings are
best-of---repeats (default 3), the engines taking turns within each round so that load from other processes on a
shared machine hits all alike. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from rlloop.bench import positive_int
from rlloop.bench.bench_models import MODEL_SPECS, make_prompts, model_dir
from rlloop.bench.machine import machine
from rlloop.bench.vllm_runner import vllm_missing, vllm_runner
from rollout.types import DTYPES


def engine_config(path: Path, prompts, n, sampling, dtype: str):
    """Both engines' settings: every row at once, positions for the longest prompt and its new tokens."""
    from rollout.engine_config import EngineConfig

    max_seq_len = max(len(p) for p in prompts) + sampling.max_new_tokens
    return EngineConfig(model_path=str(path), dtype=dtype, max_batch=len(prompts) * n, max_seq_len=max_seq_len)


def hf_runners(path: Path, prompts, n, sampling, dtype: str) -> dict:
    """Timed closures for the baseline: HFEngine (generate + log-probs from the processed scores), and plain
    `model.generate` on the same padded batch without scores, so the report shows what the log-prob bookkeeping
    costs the baseline. Each closure returns the tokens it generated."""
    import torch

    from rollout.hf_backend import HFEngine

    engine = HFEngine(engine_config(path, prompts, n, sampling, dtype))
    engine.generate(prompts[:1], 1, type(sampling)(max_new_tokens=2))  # torch's first-call costs, not counted
    rows = [p for p in prompts for _ in range(n)]
    width = max(len(p) for p in rows)
    input_ids = torch.tensor([[engine.pad_token_id] * (width - len(p)) + p for p in rows])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])

    def hf() -> int:
        return sum(len(c.token_ids) for c in engine.generate(prompts, n, sampling))

    def hf_plain() -> int:
        torch.manual_seed(sampling.seed)
        with torch.inference_mode():
            seq = engine.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=True,
                temperature=sampling.temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=sampling.max_new_tokens,
                eos_token_id=None,
                pad_token_id=engine.pad_token_id,
            )
        return (seq.shape[1] - width) * seq.shape[0]

    return {"hf": hf, "hf_plain": hf_plain}


def jax_runner(path: Path, prompts, n, sampling, dtype: str):
    """(timed closure, warmup report) for the JAX engine; the closure records the stats of its last run."""
    from rollout.engine import JaxEngine

    engine = JaxEngine(engine_config(path, prompts, n, sampling, dtype))
    start = time.perf_counter()
    engine.warmup()
    warm = {"warmup_s": time.perf_counter() - start, "compiles_after_warmup": 0.0}

    def run() -> int:
        out = engine.generate(prompts, n, sampling)
        stats = engine.stats()
        warm["compiles_after_warmup"] += stats["compiles"]
        warm["stats"] = stats
        return sum(len(c.token_ids) for c in out)

    return run, warm


def best_of(runners: dict, repeats: int, expected_tokens: int) -> dict[str, float]:
    """Best wall seconds of each runner over `repeats` rounds. Runners take turns inside a round, so a burst of
    load from whatever else shares the machine hits all engines alike rather than one engine's whole run."""
    best = {name: float("inf") for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            start = time.perf_counter()
            tokens = run()
            seconds = time.perf_counter() - start
            if tokens != expected_tokens:
                raise RuntimeError(f"{name} generated {tokens} tokens, expected {expected_tokens}")
            best[name] = min(best[name], seconds)
    return best


def bench_model(name: str, args, workdir: Path, peaks: dict) -> dict:
    from rollout.cost import param_count
    from rollout.model_config import ModelConfig
    from rollout.types import SamplingParams

    path = model_dir(name, workdir)
    mc = ModelConfig.from_dir(str(path))
    params = param_count(mc)
    prompts = make_prompts(args.prompts, mc.vocab_size, args.min_prompt_len, args.max_prompt_len, seed=0)
    sampling = SamplingParams(
        temperature=1.0, max_new_tokens=args.new_tokens, stop_token_ids=(), seed=0, ignore_eos=True
    )
    expected_tokens = len(prompts) * args.n * args.new_tokens

    try:
        jax_run, jax_info = jax_runner(path, prompts, args.n, sampling, args.dtype)
    except ImportError as e:  # the JAX engine not built yet / broken: still report the baseline, say why
        print(f"[{name}] JAX engine unavailable ({e}); reporting the HF baseline only", flush=True)
        hf_s = best_of(
            {"hf": hf_runners(path, prompts, args.n, sampling, args.dtype)["hf"]}, args.repeats, expected_tokens
        )["hf"]
        return {
            "model": name,
            "params": params,
            "hf_tok_s": expected_tokens / hf_s,
            "jax_tok_s": None,
            "error": f"rollout.engine: {e}",
        }
    runners = {"jax": jax_run, **hf_runners(path, prompts, args.n, sampling, args.dtype)}
    closers, preload, worker_compiles = [], [], {}
    try:
        from rlloop.bench.engine_worker import engines_runner

        # Engine processes: one as a run starts it on all the cores (a device per core,
        # rlloop.model_shape.cpu_engine_tp) where there are several, and --engines N of them side by side.
        workers = {"jax_tp": 1} if len(os.sched_getaffinity(0)) > 1 else {}
        if args.engines > 1:
            workers["jax_engines"] = args.engines
        for key, engines in workers.items():
            runners[key], close, worker_compiles[key] = engines_runner(
                path, prompts, args.n, sampling, args.dtype, engines
            )
            closers.append(close)
        if not args.vllm_missing:
            runners["vllm"], close, preload = vllm_runner(path, prompts, args.n, sampling, args.dtype, args.vllm_python)
            closers.append(close)
        best = best_of(runners, args.repeats, expected_tokens)
    finally:
        for close in closers:
            close()
    stats = jax_info["stats"]  # of the last run; its timings are not the best ones, its counts are the same
    jx = {"seconds": best["jax"], "tok_s": expected_tokens / best["jax"]}
    hf = {
        "seconds": best["hf"],
        "tok_s": expected_tokens / best["hf"],
        "plain_tok_s": expected_tokens / best["hf_plain"],
    }

    # The engine's own accounting (rollout.cost over what it actually computed and read).
    flops, nbytes = stats["flops"], stats["bytes"]
    result = {
        "model": name,
        "params": params,
        "rows": len(prompts) * args.n,
        "new_tokens": args.new_tokens,
        "jax_tok_s": jx["tok_s"],
        "hf_tok_s": hf["tok_s"],
        "speedup": jx["tok_s"] / hf["tok_s"],
        "hf_plain_generate_tok_s": hf["plain_tok_s"],
        "speedup_vs_plain_generate": jx["tok_s"] / hf["plain_tok_s"],
        "mfu": flops / jx["seconds"] / peaks["matmul_flops"],
        "mbu": nbytes / jx["seconds"] / peaks["mem_bytes_per_s"],
        "vllm_tok_s": expected_tokens / best["vllm"] if "vllm" in best else None,
        "speedup_vs_vllm": best["vllm"] / best["jax"] if "vllm" in best else None,
        "vllm_missing": args.vllm_missing,
        "vllm_preload": [Path(lib).name for lib in preload],
        "compiles_after_warmup": jax_info["compiles_after_warmup"],
        "warmup_s": jax_info["warmup_s"],
        "pad_frac": stats["pad_frac"],
        "jax_s": jx["seconds"],
        "hf_s": hf["seconds"],
        "prefill_s": stats["prefill_s"],
        "decode_s": stats["decode_s"],
        "repeats": args.repeats,
        "flops": flops,
        "bytes": nbytes,
    }
    columns = f"vllm {result['vllm_tok_s']:.0f} tok/s ({result['speedup_vs_vllm']:.2f}x), " if "vllm" in best else ""
    # The same requests, split over devices or engines: the same tokens, the same FLOPs.
    for key, label in (("jax_tp", "1 engine as a run starts it"), ("jax_engines", f"{args.engines} engines")):
        if key not in best:
            continue
        result |= {
            f"{key}_tok_s": expected_tokens / best[key],
            f"{key}_over_jax": best["jax"] / best[key],
            f"{key}_mfu": flops / best[key] / peaks["matmul_flops"],
            f"{key}_over_vllm": best["vllm"] / best[key] if "vllm" in best else None,
            f"{key}_compiles_after_warmup": worker_compiles[key]["after_warmup"],
        }
        columns += (
            f"{label} {result[f'{key}_tok_s']:.0f} tok/s ({result[f'{key}_over_jax']:.2f}x one device, "
            f"MFU {result[f'{key}_mfu']:.1%}), "
        )
    if "jax_engines" in best:
        result["engines"] = args.engines
    print(
        f"[{name}] params {params / 1e6:.1f}M rows {result['rows']} x {args.new_tokens} tokens: "
        f"jax {jx['tok_s']:.0f} tok/s, hf {hf['tok_s']:.0f} tok/s (plain generate {hf['plain_tok_s']:.0f}), "
        f"speedup {result['speedup']:.2f}x, {columns}"
        f"warmup {jax_info['warmup_s']:.1f}s, compiles after warmup {result['compiles_after_warmup']}, "
        f"MFU {result['mfu']:.1%}, MBU {result['mbu']:.1%}, pad {result['pad_frac']:.1%}",
        flush=True,
    )
    return result


def limit_cpu_threads(threads: int) -> None:
    """Give torch and XLA the same number of CPU threads (must run before jax initialises its backend).

    XLA:CPU sizes its thread pools from the cores the process may run on, so the process is pinned to `threads`
    cores (an XLA flag alone left its matmuls on every core while torch had one)."""
    import torch

    cores = sorted(os.sched_getaffinity(0))
    if threads < len(cores):
        os.sched_setaffinity(0, cores[:threads])
    torch.set_num_threads(threads)


# Sizes: (default, --quick's), each applied only where the argument is not given.
SIZES = {"prompts": (8, 4), "n": (8, 4), "new_tokens": (128, 32), "repeats": (3, 2)}


def parse_args(argv):
    """The arguments, every one checked (a usage error, exit 2, naming it) before any work starts."""
    ap = argparse.ArgumentParser(prog="python -m rlloop.bench rollout", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 prompts x 4 samples x 32 tokens, where not given")
    ap.add_argument("--models", default="tiny,30m", help=f"comma list of {','.join(MODEL_SPECS)}")

    def size(flag: str, what: str) -> None:
        default, quick = SIZES[flag.removeprefix("--").replace("-", "_")]
        ap.add_argument(flag, type=positive_int, default=None, help=f"{what} (default {default}, --quick {quick})")

    size("--prompts", "prompts, dealt out to the engines")
    size("--n", "samples per prompt: rows = prompts x n")
    size("--new-tokens", "tokens generated per row")
    ap.add_argument("--min-prompt-len", type=positive_int, default=16)
    ap.add_argument("--max-prompt-len", type=positive_int, default=64)
    size("--repeats", "timed runs per engine after its warmup; the best is reported")
    ap.add_argument("--dtype", default="float32", choices=DTYPES)
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads for torch and XLA alike (0: all cores). 1 gives stable numbers on a shared box",
    )
    ap.add_argument(
        "--engines",
        type=positive_int,
        default=None,
        help="also run this many JAX engines side by side, each in its own process on its share of the cores and "
        "the rows, as cluster.rollout_engines does (1: none side by side; default 2, at most the cores and the "
        "prompts)",
    )
    ap.add_argument(
        "--vllm-python",
        default=None,
        help="the python of a vLLM-CPU environment: adds a vLLM column (default $RLLOOP_VLLM_PYTHON)",
    )
    args = ap.parse_args(argv)
    if unknown := [m for m in args.models.split(",") if m not in MODEL_SPECS]:
        ap.error(f"--models: unknown {', '.join(map(repr, unknown))}; expected a comma list of {','.join(MODEL_SPECS)}")
    for key, (default, quick) in SIZES.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else default)
    if args.min_prompt_len > args.max_prompt_len:
        ap.error(f"--min-prompt-len {args.min_prompt_len}: above --max-prompt-len {args.max_prompt_len}")
    # The cores the run will have: main pins the process to --threads of them before any engine starts.
    cores = len(os.sched_getaffinity(0))
    if not 0 <= args.threads <= cores:
        ap.error(f"--threads {args.threads}: this process may use {cores} core(s) (0: all of them)")
    cores = args.threads or cores
    if args.engines is None:
        args.engines = min(2, cores, args.prompts)
    elif args.engines > cores:  # each engine needs a core of its own
        ap.error(f"--engines {args.engines}: the run has {cores} core(s) (--threads or this process's), one per engine")
    elif args.engines > args.prompts:  # the prompts are dealt out to the engines
        ap.error(f"--engines {args.engines}: more than the {args.prompts} prompt(s); an engine would get none")
    if args.vllm_python is not None and (reason := vllm_missing(args.vllm_python)):
        ap.error(f"--vllm-python {args.vllm_python}: {reason}")
    args.vllm_python = args.vllm_python or os.environ.get("RLLOOP_VLLM_PYTHON")
    args.vllm_missing = vllm_missing(args.vllm_python)
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.vllm_missing:
        print(f"vLLM column missing: {args.vllm_missing}", flush=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if args.threads:
        limit_cpu_threads(args.threads)
    from rlloop.bench.peaks import measure_peaks

    peaks = measure_peaks(args.dtype)
    print(
        f"peaks ({peaks['device_kind']}, {args.dtype}): matmul {peaks['matmul_flops'] / 1e9:.1f} GFLOP/s, "
        f"memory {peaks['mem_bytes_per_s'] / 1e9:.1f} GB/s",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="rlloop_bench_rollout_") as tmp:
        results = [bench_model(name, args, Path(tmp), peaks) for name in args.models.split(",")]
    if args.vllm_missing:  # again after the results, where it is read
        print(f"vLLM column missing: {args.vllm_missing}", flush=True)
    print(
        json.dumps(
            {
                "bench": "rollout",
                "device": peaks["device_kind"],
                **machine(),
                "threads": len(os.sched_getaffinity(0)),  # the cores it ran on (pinned to --threads), as "cpus"
                "dtype": args.dtype,
                "vllm_missing": args.vllm_missing,
                "peak_matmul_flops": peaks["matmul_flops"],
                "peak_mem_bytes_per_s": peaks["mem_bytes_per_s"],
                "results": results,
            }
        )
    )
