"""`python -m rlloop.bench device`: the accelerator check, one short script for the minutes a device machine is lent.

    python -m rlloop.bench device              # on a GPU host (on a TPU one, the engine parts): a few minutes
    python -m rlloop.bench device --quick      # the same code paths with tiny shapes (what the tests run, on CPU)

Five parts, each reported even when another fails (its error is recorded instead):
  engine   the JAX engine in bf16 on a random Qwen3-0.6B-shaped model (28 layers, hidden 1024, 16/8 heads of 128,
           vocab 151,936): tokens/s, MFU and MBU against the device's measured peaks (rlloop.bench.peaks), compiles
           after warmup (must be 0)
  engine_long
           a long generation: responses that fill a cache of --long-cache positions (2,048), as an RL rollout fills
           the recipe's, decoded with each way of reading the cache (rollout.decode_attention: chunked, whole) and
           their ratio: the evidence for the platform's rule (rollout.cost.reads_whole_cache)
  trainer  one torch Trainer step in bf16 on the same shapes on cuda (cpu without a GPU): seconds, tokens/s, MFU
           against a measured torch matmul peak, peak device memory
  tiny     the embedded example for a few steps with cluster.device=gpu and cluster.colocate=true (one GPU holds
           both roles: the offload path runs for real), in a process of its own where Ray is not installed (its JAX
           with the allocator that hands memory back); reward, compiles and the engine's device bytes while the
           trainer trains (its allocator's pool included) from its metrics.jsonl
  nccl     two trainer ranks over nccl (fsdp) when the host has two GPUs: both ranks' loss, equal
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

from rlloop.bench import positive_int
from rlloop.bench.bench_models import make_prompts, save_random_qwen3
from rlloop.bench.machine import machine

TINY = Path(__file__).resolve().parents[2] / "examples" / "grpo_dapo_tiny.yaml"
LONG_CACHE_SHARE = 0.6  # of JAX's pool limit, for engine_long's cache: the rest for weights and XLA's scratch
PARTS = ("engine", "engine_long", "trainer", "tiny", "nccl")
QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
)
QUICK = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def long_rows(path: Path, args) -> int:
    """engine_long's rows: the part's prompts x n, fewer where their cache would take more than LONG_CACHE_SHARE of
    the device's memory (JAX's pool limit). 256 rows of a 2,048-position bf16 cache of the 0.6B shape are 60 GB:
    they fit an H200 (141 GB), not beside the pool's other buffers on an 80-GB H100."""
    import jax

    from rollout.cost import kv_bytes_per_token
    from rollout.model_config import ModelConfig

    rows = args.prompts * args.n
    limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
    if not limit:  # CPU: no pool limit to size against
        return rows
    per_row = args.long_cache * kv_bytes_per_token(ModelConfig.from_dir(str(path)), 2)
    fits = int(LONG_CACHE_SHARE * limit // per_row) // args.n * args.n  # whole groups
    return max(args.n, min(rows, fits))


def bench_engine(
    path: Path, args, cache_len: int | None = None, decode_attention: str = "auto", n_prompts: int | None = None
) -> dict:
    """The engine part, or with `cache_len` one run of engine_long: responses that fill the cache, timed once (its
    warmup ran every program already, and a second pass would double the part's minutes). `n_prompts`: how many prompts
    (the part's --prompts by default)."""
    from rlloop.bench.peaks import measure_peaks
    from rollout.engine import JaxEngine
    from rollout.engine_config import EngineConfig
    from rollout.model_config import ModelConfig
    from rollout.types import SamplingParams

    vocab = ModelConfig.from_dir(str(path)).vocab_size
    count = n_prompts or args.prompts
    prompts = make_prompts(count, vocab, args.prompt_len // 2, args.prompt_len, seed=0)
    new_tokens = cache_len - args.prompt_len if cache_len else args.new_tokens
    sampling = SamplingParams(max_new_tokens=new_tokens, stop_token_ids=(), seed=0, ignore_eos=True)
    rows, seq_len = count * args.n, args.prompt_len + new_tokens
    # One bucket each (the prompts packed into one prefill size, every row decoding to the end), not the default
    # ladders: warmup compiles 3 programs of a 28-layer model instead of 18, minutes of a short lease.
    engine = JaxEngine(
        EngineConfig(
            model_path=str(path),
            dtype="bfloat16",
            max_batch=rows,
            max_seq_len=seq_len,
            prefill_buckets=(seq_len - 1,),
            decode_buckets=(rows,),
            decode_attention=decode_attention,
        )
    )
    t0 = time.perf_counter()
    engine.warmup()
    warmup_s = time.perf_counter() - t0
    compiled = 0.0  # after warmup, in the untimed run too: a program warmup missed compiles there, not in the timed
    if not cache_len:
        engine.generate(prompts, args.n, sampling)  # first run: touches every program once more, not timed
        compiled = engine.stats()["compiles"]
    t0 = time.perf_counter()
    out = engine.generate(prompts, args.n, sampling)
    seconds = time.perf_counter() - t0
    stats, peaks = engine.stats(), measure_peaks("bfloat16")
    tokens = sum(len(c.token_ids) for c in out)
    return {
        "device_kind": peaks["device_kind"],
        "rows": rows,
        "cache_len": engine.cfg.max_seq_len,
        "reads_whole_cache": engine.whole_cache,
        "cache_page_len": engine.page_len,
        "tok_s": tokens / seconds,
        "mfu": stats["flops"] / seconds / peaks["matmul_flops"],
        "mbu": stats["bytes"] / seconds / peaks["mem_bytes_per_s"],
        "compiles_after_warmup": compiled + stats["compiles"],
        "warmup_s": warmup_s,
        "peak_matmul_tflops": peaks["matmul_flops"] / 1e12,
        "peak_mem_gb_s": peaks["mem_bytes_per_s"] / 1e9,
    }


def bench_engine_long(path: Path, args) -> dict:
    """engine_long: the same long generation with the cache read chunk by chunk and whole, and which was faster."""
    n_prompts = long_rows(path, args) // args.n
    runs = {mode: bench_engine(path, args, args.long_cache, mode, n_prompts) for mode in ("chunked", "whole")}
    return {**runs, "whole_over_chunked": runs["whole"]["tok_s"] / runs["chunked"]["tok_s"]}


def torch_matmul_peak(device: str) -> float:
    """The best bf16 FLOP/s of torch's square matmuls over a few sizes: a CPU without bf16 units (AVX2) runs small
    ones faster than large ones (1.7 against 0.9 GFLOP/s at 64 and 1024 on a Zen 3), so one size is no peak."""
    import torch

    best = 0.0
    for n in (4096, 8192) if device == "cuda" else (64, 256, 1024):
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        reps = max(1, int(2e8 // (2 * n**3)))  # ~0.2 GFLOP a timing, so small sizes are not all timer overhead
        for _ in range(5):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                a @ a
            if device == "cuda":
                torch.cuda.synchronize()
            best = max(best, 2.0 * n**3 * reps / (time.perf_counter() - t0))
    return best


def bench_trainer(path: Path, args) -> dict:
    import torch

    from rollout.cost import generate_flops
    from rollout.model_config import ModelConfig
    from trainer import TrainBatch, Trainer, TrainerConfig

    if not args.quick and not torch.cuda.is_available():  # ~98k tokens a step on a CPU would take the whole lease
        raise RuntimeError(f"torch {torch.__version__} finds no CUDA GPU: the trainer part needs one (or --quick)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = TrainerConfig(str(path), dtype="bfloat16", device=device, lr=1e-6, gradient_checkpointing=True)
    trainer = Trainer(cfg)
    rng = np.random.default_rng(0)
    rows = args.prompts * args.n
    vocab = trainer.vocab_size
    batch = TrainBatch(
        [rng.integers(3, vocab, args.prompt_len).tolist() for _ in range(rows)],
        [rng.integers(3, vocab, args.new_tokens).tolist() for _ in range(rows)],
        rng.normal(size=rows).tolist(),
    )
    trainer.train_step(batch)  # allocator and kernel warmup
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    metrics = trainer.train_step(batch)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    tokens = rows * (args.prompt_len + args.new_tokens)
    # Model FLOPs (the recomputation under checkpointing is not counted, as MFU is defined): a training forward is
    # what generating the responses computes (the layers over every token, the LM head over the scored ones, the same
    # attention), and the backward twice that.
    mc = ModelConfig.from_dir(str(path))
    flops = 3.0 * generate_flops(mc, [args.prompt_len - 1] * rows, [(args.prompt_len, args.new_tokens)] * rows)
    out = {
        "device": device,
        "step_s": seconds,
        "tok_s": tokens / seconds,
        "mfu": flops / seconds / torch_matmul_peak(device),
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None,
        "loss": metrics["train/loss"],
    }
    del trainer
    if device == "cuda":  # torch's cache back to the device, for the parts after this one
        torch.cuda.empty_cache()
    return out


def bench_tiny(args, workdir: Path) -> dict:
    from rlloop.config import load_config
    from rlloop.loop import train
    from rlloop.placement import jax_gpu_env

    overrides = [f"run.dir={workdir / 'tiny'}", f"run.steps={args.tiny_steps}", "run.save_every=0"]
    overrides += ["run.eval_every=0", "tracking.progress=false"]
    # Without Ray (a GPU image it is not installed on: rlloop/bench/device_requirements.txt) the example's engine and
    # trainer run in one process, colocated all the same: a process of its own, since the engine must hand memory
    # back to the trainer, which JAX's pooling allocator, started by the parts before, would keep.
    with_ray = not args.quick and importlib.util.find_spec("ray") is not None
    colocated_env = jax_gpu_env(colocated=True)
    if not (with_ray or args.quick) and any(os.environ.get(k) != v for k, v in colocated_env.items()):
        argv = [sys.executable, "-m", "rlloop.bench", "device", "--parts", "tiny", f"--tiny-steps={args.tiny_steps}"]
        child = subprocess.run(argv, env=os.environ | colocated_env, capture_output=True, text=True, timeout=1800)
        if child.returncode:
            raise RuntimeError(f"the tiny part's process failed:\n{child.stderr[-3000:]}")
        return json.loads(child.stdout.strip().splitlines()[-1])["tiny"]
    overrides.append("cluster.colocate=true")
    if not with_ray:
        overrides.append("cluster.use_ray=false")
    if not args.quick:
        overrides.append("cluster.device=gpu")
    t0 = time.perf_counter()
    run_dir = train(load_config(str(TINY), overrides))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "ray": with_ray,
        "steps": len(rows),
        "wall_s": time.perf_counter() - t0,
        "reward_first": rows[0]["rollout/raw_reward"],
        "reward_last": rows[-1]["rollout/raw_reward"],
        "compiles": sum(r.get("perf/compiles", 0.0) for r in rows),
        "logprob_abs_diff": max(r["train/logprob_abs_diff"] for r in rows),
        "device_bytes_while_training": rows[-1].get("rollout/device_bytes_while_training"),
    }


def _nccl_rank(rank: int, path: str, init_file: str, out_dir: str) -> None:
    import torch

    from trainer import TrainBatch, Trainer, TrainerConfig, shard_batch

    torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        rng = np.random.default_rng(0)
        batch = TrainBatch(
            [rng.integers(3, 500, 32).tolist() for _ in range(8)],
            [rng.integers(3, 500, 32).tolist() for _ in range(8)],
            rng.normal(size=8).tolist(),
        )
        trainer = Trainer(TrainerConfig(path, dtype="bfloat16", device="cuda", parallel="fsdp"), rank, 2)
        metrics = trainer.train_step(shard_batch(batch, rank, 2, minibatches=1))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(metrics))
    finally:
        torch.distributed.destroy_process_group()


def bench_nccl(path: Path, workdir: Path) -> dict:
    import torch
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < 2:
        return {"skipped": f"needs 2 GPUs, this host has {torch.cuda.device_count()}"}
    mp.spawn(_nccl_rank, args=(str(path), str(workdir / "nccl_init"), str(workdir)), nprocs=2, join=True)
    losses = [json.loads((workdir / f"rank{r}.json").read_text())["train/loss"] for r in (0, 1)]
    return {"losses": losses, "ranks_agree": losses[0] == losses[1]}


# flag: (default, --quick's, what it sizes); --quick's apply only to the sizes not given
SIZES = {
    "--prompts": (32, 2, "prompts of the engine parts"),
    "--n": (8, 2, "samples per prompt"),
    "--prompt-len": (128, 8, "tokens per prompt"),
    "--new-tokens": (256, 8, "tokens generated per row"),
    "--tiny-steps": (5, 2, "steps of the tiny run"),
    "--long-cache": (2048, 384, "engine_long's cache, filled by its responses"),
}


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m rlloop.bench device", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes: the code paths, not the figures")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {','.join(PARTS)}")
    for flag, (default, quick, what) in SIZES.items():
        ap.add_argument(flag, type=positive_int, default=None, help=f"{what} (default {default}, --quick {quick})")
    args = ap.parse_args(argv)
    args.parts = args.parts.split(",")
    if unknown := [p for p in args.parts if p not in PARTS]:
        ap.error(f"--parts: unknown {', '.join(map(repr, unknown))}; expected a comma list of {','.join(PARTS)}")
    for flag, (default, quick, _) in SIZES.items():
        key = flag.removeprefix("--").replace("-", "_")
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else default)
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    # The engine and the trainer parts share this process's GPU: JAX must not reserve 75% of it up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    uses_jax = {"engine", "engine_long", "tiny"} & set(args.parts)
    if not args.quick and uses_jax and jax.default_backend() == "cpu":  # a jaxlib without its plugin falls back
        raise SystemExit(
            f"bench device: JAX {jax.__version__} finds no accelerator (backend cpu); install the device's jaxlib "
            "(rlloop/bench/device_requirements.txt), or run with --quick on a CPU"
        )
    report: dict = {"bench": "device", **machine(), "quick": args.quick, "jax_backend": jax.default_backend()}
    with tempfile.TemporaryDirectory(prefix="rlloop_bench_device_") as tmp:
        workdir = Path(tmp)
        path = save_random_qwen3(workdir / "model", **(QUICK if args.quick else QWEN3_0_6B))
        parts = {
            "engine": lambda: bench_engine(path, args),
            "engine_long": lambda: bench_engine_long(path, args),
            "trainer": lambda: bench_trainer(path, args),
            "tiny": lambda: bench_tiny(args, workdir),
            "nccl": lambda: bench_nccl(path, workdir),
        }
        for name in args.parts:
            t0 = time.perf_counter()
            try:
                report[name] = parts[name]()
            except Exception as e:  # one broken part must not cost the figures of the others
                traceback.print_exc()
                report[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"[{name}] {time.perf_counter() - t0:.1f}s: {report[name]}", flush=True)
    print(json.dumps(report))
