"""Rollout throughput: the JAX bucketed decoder vs `transformers.generate` on the same weights and requests.

    python -m rlloop.bench rollout [--quick] [--models tiny,30m] [--prompts 8] [--n 8] [--new-tokens 128]

Both engines load one saved HF checkpoint, get the same prompts, the same sampling settings (T=1, no top-k/top-p)
and no stop ids; the benchmark checkpoints carry no EOS id and requests set ignore_eos, so every row generates
exactly --new-tokens tokens. Models: "tiny" (the embedded example model)
and "30m", a random Qwen3 of ~31M parameters (vocab 32000, hidden 384, 12 layers, 6 heads / 2 KV heads of 64,
MLP 1024, tied head). MFU / MBU divide the run's FLOPs / bytes by the peaks that `rlloop.bench.peaks` measures on
the same device. The last line is one JSON object.
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

TINY_ASSET = Path(__file__).resolve().parents[1] / "assets" / "tiny" / "model"

# name -> Qwen3 config overrides; "tiny" is only used when the shipped asset is missing.
MODEL_SPECS = {
    "tiny": dict(vocab_size=99, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32),
    "30m": dict(vocab_size=32000, hidden_size=384, intermediate_size=1024, num_hidden_layers=12,
                num_attention_heads=6, num_key_value_heads=2, head_dim=64),
}


def save_random_qwen3(path: Path, seed: int = 0, **overrides) -> Path:
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
                                   max_position_embeddings=4096, bos_token_id=1, eos_token_id=None, pad_token_id=0,
                                   **overrides)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return without_eos(path)


def without_eos(path: Path) -> Path:
    """Drop the EOS ids from a saved checkpoint, so no engine can end a row early whatever its EOS policy."""
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["eos_token_id"] = None
    cfg_file.write_text(json.dumps(cfg, indent=2))
    (path / "generation_config.json").unlink(missing_ok=True)
    return path


def model_dir(name: str, workdir: Path) -> Path:
    if name == "tiny" and (TINY_ASSET / "config.json").exists():
        shutil.copytree(TINY_ASSET, workdir / name)
        return without_eos(workdir / name)
    if name not in MODEL_SPECS:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODEL_SPECS)}")
    return save_random_qwen3(workdir / name, **MODEL_SPECS[name])


def model_shape(path: Path) -> dict:
    """Parameter counts and attention sizes from the HF config, for the FLOP / byte model."""
    cfg = json.loads((path / "config.json").read_text())
    d, f, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or d // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    layer_matmul = d * q + 2 * d * kv + q * d + 3 * d * f
    tied = cfg.get("tie_word_embeddings", False)
    params = V * d + L * (layer_matmul + 2 * d + 2 * hd) + d + (0 if tied else V * d)
    # Every decoded token multiplies through all layers and the LM head; the embedding lookup is not a matmul.
    return {"params": params, "matmul_params": L * layer_matmul + V * d, "layers": L, "q": q, "kv": kv}


def analytic_cost(shape: dict, prompt_lens: list[int], n: int, new_tokens: int,
                  itemsize: int) -> tuple[float, float]:
    """FLOPs and HBM/DRAM bytes of an ideal engine: prefill each prompt once, decode all rows together.

    FLOPs: 2 per matmul weight per token, plus QK^T and PV over the context. Bytes: every decode step reads all
    weights once and each row's KV up to its position; prefill reads the weights once.
    """
    L, q, kv = shape["layers"], shape["q"], shape["kv"]
    flops = 0.0
    kv_bytes = 0.0
    for p in prompt_lens:
        flops += 2 * shape["matmul_params"] * p + 2 * L * q * p * p   # causal attention ~ p^2 / 2 pairs, x4 flops
        for t in range(new_tokens):
            ctx = p + t + 1
            flops += n * (2 * shape["matmul_params"] + 4 * L * q * ctx)
            kv_bytes += n * 2 * L * kv * ctx * itemsize
    weight_bytes = shape["params"] * itemsize * (new_tokens + 1)
    return flops, weight_bytes + kv_bytes


def make_prompts(num_prompts: int, vocab: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(rng.integers(min_len, max_len + 1))).tolist() for _ in range(num_prompts)]


def run_hf(path: Path, prompts, n, sampling, dtype: str) -> dict:
    """HFEngine (generate + log-probs from the processed scores), then plain `model.generate` on the same padded
    batch without scores, so the report shows what the log-prob bookkeeping costs the baseline."""
    import torch

    from rollout.hf_backend import HFEngine

    engine = HFEngine(str(path), dtype=dtype, max_batch=len(prompts) * n)
    engine.generate(prompts[:1], 1, type(sampling)(max_new_tokens=2))   # torch's first-call costs, not counted
    start = time.perf_counter()
    out = engine.generate(prompts, n, sampling)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for c in out)

    rows = [p for p in prompts for _ in range(n)]
    width = max(len(p) for p in rows)
    input_ids = torch.tensor([[engine.pad_token_id] * (width - len(p)) + p for p in rows])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
    torch.manual_seed(sampling.seed)
    start = time.perf_counter()
    with torch.inference_mode():
        seq = engine.model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True,
                                    temperature=sampling.temperature, top_k=0, top_p=1.0,
                                    max_new_tokens=sampling.max_new_tokens, eos_token_id=None,
                                    pad_token_id=engine.pad_token_id)
    plain_seconds = time.perf_counter() - start
    plain_tokens = (seq.shape[1] - width) * seq.shape[0]
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "plain_tok_s": plain_tokens / plain_seconds}


def run_jax(path: Path, prompts, n, sampling, dtype: str) -> dict:
    from rollout.engine import EngineConfig, JaxEngine

    max_seq_len = max(len(p) for p in prompts) + sampling.max_new_tokens
    engine = JaxEngine(EngineConfig(model_path=str(path), dtype=dtype, max_batch=len(prompts) * n,
                                    max_seq_len=max_seq_len))
    start = time.perf_counter()
    warm = engine.warmup() or {}
    warmup_s = time.perf_counter() - start
    compiles_before = engine.stats().get("compiles", warm.get("compiles", 0.0))
    start = time.perf_counter()
    out = engine.generate(prompts, n, sampling)
    seconds = time.perf_counter() - start
    stats = engine.stats()
    tokens = sum(len(c.token_ids) for c in out)
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "warmup_s": warmup_s,
            "compiles_after_warmup": stats.get("compiles", float("nan")) - compiles_before,
            "pad_frac": stats.get("pad_frac", float("nan")), "prefill_s": stats.get("prefill_s", float("nan")),
            "decode_s": stats.get("decode_s", float("nan")), "flops": stats.get("flops"),
            "bytes": stats.get("bytes")}


def bench_model(name: str, args, workdir: Path, peaks: dict) -> dict:
    from rollout.types import SamplingParams

    path = model_dir(name, workdir)
    shape = model_shape(path)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(args.prompts, vocab, args.min_prompt_len, args.max_prompt_len, seed=0)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, stop_token_ids=(), seed=0,
                              ignore_eos=True)
    expected_tokens = len(prompts) * args.n * args.new_tokens

    hf = run_hf(path, prompts, args.n, sampling, args.dtype)
    try:
        jx = run_jax(path, prompts, args.n, sampling, args.dtype)
    except ImportError as e:  # the JAX engine not built yet / broken: still report the baseline, say why
        print(f"[{name}] JAX engine unavailable ({e}); reporting the HF baseline only", flush=True)
        return {"model": name, "params": shape["params"], "hf_tok_s": hf["tok_s"], "jax_tok_s": None,
                "error": f"rollout.engine: {e}"}
    for label, r in (("hf", hf), ("jax", jx)):
        if r["tokens"] != expected_tokens:
            raise RuntimeError(f"{label} generated {r['tokens']} tokens, expected {expected_tokens}")

    itemsize = 2 if args.dtype in ("bfloat16", "float16") else 4
    flops, nbytes = analytic_cost(shape, [len(p) for p in prompts], args.n, args.new_tokens, itemsize)
    # Prefer the engine's own accounting when it reports one; it knows what it actually computed.
    flops = jx["flops"] or flops
    nbytes = jx["bytes"] or nbytes
    result = {"model": name, "params": shape["params"], "rows": len(prompts) * args.n,
              "new_tokens": args.new_tokens, "jax_tok_s": jx["tok_s"], "hf_tok_s": hf["tok_s"],
              "speedup": jx["tok_s"] / hf["tok_s"], "hf_plain_generate_tok_s": hf["plain_tok_s"],
              "speedup_vs_plain_generate": jx["tok_s"] / hf["plain_tok_s"], "mfu": flops / jx["seconds"] / peaks["matmul_flops"],
              "mbu": nbytes / jx["seconds"] / peaks["mem_bytes_per_s"],
              "compiles_after_warmup": jx["compiles_after_warmup"], "warmup_s": jx["warmup_s"],
              "pad_frac": jx["pad_frac"], "jax_s": jx["seconds"], "hf_s": hf["seconds"], "prefill_s": jx["prefill_s"],
              "decode_s": jx["decode_s"], "flops": flops, "bytes": nbytes}
    print(f"[{name}] params {shape['params'] / 1e6:.1f}M rows {result['rows']} x {args.new_tokens} tokens: "
          f"jax {jx['tok_s']:.0f} tok/s, hf {hf['tok_s']:.0f} tok/s (plain generate {hf['plain_tok_s']:.0f}), "
          f"speedup {result['speedup']:.2f}x, "
          f"warmup {jx['warmup_s']:.1f}s, compiles after warmup {result['compiles_after_warmup']}, "
          f"MFU {result['mfu']:.1%}, MBU {result['mbu']:.1%}, pad {result['pad_frac']:.1%}", flush=True)
    return result


def limit_cpu_threads(threads: int) -> None:
    """Give torch and XLA the same number of CPU threads (must run before jax initialises its backend)."""
    import torch

    torch.set_num_threads(threads)
    if threads == 1:
        flags = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m rlloop.bench rollout", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 prompts x 4 samples x 32 tokens")
    ap.add_argument("--models", default="tiny,30m")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (rows = prompts x n)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--min-prompt-len", type=int, default=16)
    ap.add_argument("--max-prompt-len", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=0,
                    help="CPU threads for torch and XLA alike (0: all cores). 1 gives stable numbers on a shared box")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.n, args.new_tokens = 4, 4, 32
    return args


def main(argv: list[str]) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    args = parse_args(argv)
    if args.threads:
        limit_cpu_threads(args.threads)
    from rlloop.bench.peaks import measure_peaks

    peaks = measure_peaks(args.dtype)
    print(f"peaks ({peaks['device_kind']}, {args.dtype}): matmul {peaks['matmul_flops'] / 1e9:.1f} GFLOP/s, "
          f"memory {peaks['mem_bytes_per_s'] / 1e9:.1f} GB/s", flush=True)
    with tempfile.TemporaryDirectory(prefix="rlloop_bench_rollout_") as tmp:
        results = [bench_model(name, args, Path(tmp), peaks) for name in args.models.split(",")]
    print(json.dumps({"bench": "rollout", "device": peaks["device_kind"], "cpus": os.cpu_count(),
                      "threads": args.threads or os.cpu_count(),
                      "dtype": args.dtype, "peak_matmul_flops": peaks["matmul_flops"],
                      "peak_mem_bytes_per_s": peaks["mem_bytes_per_s"], "results": results}))
