"""`python -m rlloop.bench logprob_memory`: peak memory of one micro-batch's response log-probs + entropy, the old
full-logits implementation against trainer/logprobs.py's chunked one, on a 151,936-token (Qwen3) vocabulary.

The model is a tiny random Qwen3 (hidden 64, 2 layers by default) with the real vocabulary, so the LM head's
[positions, vocab] logits are almost all of the memory, as they are at scale. Each measurement runs in a fresh
subprocess (CPU, one torch thread): model and micro-batch built, one tiny warm-up call, then the resident set size
is read (the baseline) and one computation runs; the peak is `ru_maxrss` minus that baseline, read after the forward
and again after the backward. Modes:
    train     grad enabled, with_entropy=True, entropy_grad=False, then backward of a token-mean loss on the log-probs
              (what Trainer._accumulate_gradients does with entropy_coef 0)
    train_eg  the same with entropy_grad=True and the entropy in the loss (entropy_coef != 0)
    score     no grad, log-probs only (the old / reference scoring, Trainer._score)
The backward peak includes the parameters' .grad (for the embedding and the LM head: 2 × vocab × hidden fp32), the
same for both implementations. A last subprocess runs both implementations on the same micro-batch and reports the
largest differences of log-probs, entropies and gradients.

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from rlloop.bench import positive_int
from rlloop.bench.machine import machine

MODES = ("train", "train_eg", "score")


# ---- BASELINE: trainer/logprobs.py: response_logprobs as it was before chunking (commit 9b90aa0), verbatim apart
# ---- from its name. It materialises [B, W, vocab] fp32 logits and a full softmax for the entropy.
def old_response_logprobs(model, mb, temperature=1.0, with_entropy=False, entropy_grad=False):
    import torch

    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    device = next(model.parameters()).device
    input_ids = mb.input_ids.to(device)
    width = input_ids.shape[1]
    first = int(mb.response_start.min().item()) - 1
    out = model(
        input_ids=input_ids, attention_mask=mb.attention_mask.to(device), use_cache=False, logits_to_keep=width - first
    )
    logits = out.logits[:, :-1].float() / temperature  # [B, W, V] predicts columns first+1 .. L-1
    targets = input_ids[:, first + 1 :]  # [B, W]
    log_norm = torch.logsumexp(logits, dim=-1)  # [B, W]
    token_logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_norm

    resp_width = mb.response_mask.shape[1]
    cols = (mb.response_start.to(device) - 1 - first).unsqueeze(-1) + torch.arange(resp_width, device=device)
    cols = cols.clamp(max=token_logp.shape[1] - 1)  # padding positions past the row end
    logp = token_logp.gather(1, cols)

    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = log_norm - (torch.softmax(logits, dim=-1) * logits).sum(-1)
            entropy = ent.gather(1, cols)
    return logp, entropy


# ---- end of the baseline


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _setup(args):
    import numpy as np
    import torch
    import transformers

    from trainer.batching import TrainBatch, collate

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=args.hidden // 4,
        max_position_embeddings=max(args.seq, 64),
        tie_word_embeddings=args.tie,
        rope_theta=1e6,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, args.dtype)).eval()
    rng = np.random.default_rng(0)
    prompt_len = args.seq - args.response
    prompts = [rng.integers(3, args.vocab, prompt_len).tolist() for _ in range(args.rows)]
    responses = [rng.integers(3, args.vocab, args.response).tolist() for _ in range(args.rows)]
    mb = collate(TrainBatch(prompts, responses, rng.normal(size=args.rows).tolist()), list(range(args.rows)))
    tiny = collate(TrainBatch([[5, 6]], [[7, 8]], [1.0]), [0])
    return model, mb, tiny


def _impl(name: str, chunk_size: int | None = None):
    if name == "old":
        return old_response_logprobs
    import functools

    from trainer.logprobs import response_logprobs

    return functools.partial(response_logprobs, chunk_size=chunk_size)


def _loss(logp, entropy, mb, entropy_coef: float):
    mask = mb.response_mask
    per_token = -logp * mb.advantages[:, None] - (entropy_coef * entropy if entropy_coef else 0.0)
    return (per_token * mask).sum() / mask.sum()


def _call(fn, model, mb, args, mode):
    import torch

    if mode == "score":
        with torch.no_grad():
            return fn(model, mb, args.temperature)
    return fn(model, mb, args.temperature, with_entropy=True, entropy_grad=mode == "train_eg")


def _measure(args) -> dict:
    """One implementation, one mode, in this (fresh) process."""
    import gc

    model, mb, tiny = _setup(args)
    fn = _impl(args.impl, args.chunk_size)
    out = _call(fn, model, tiny, args, args.mode)  # warm-up: kernels, allocator, autograd
    if args.mode != "score":
        _loss(*out, tiny, 0.01).backward()
    model.zero_grad(set_to_none=True)
    del out
    gc.collect()
    base = _rss_bytes()
    t0 = time.perf_counter()
    logp, entropy = _call(fn, model, mb, args, args.mode)
    fwd_peak = _maxrss_bytes() - base
    t1 = time.perf_counter()
    bwd_peak = None
    if args.mode != "score":
        _loss(logp, entropy, mb, 0.01 if args.mode == "train_eg" else 0.0).backward()
        bwd_peak = _maxrss_bytes() - base
    t2 = time.perf_counter()
    return {
        "impl": args.impl,
        "mode": args.mode,
        "baseline_mb": base / 2**20,
        "fwd_peak_mb": fwd_peak / 2**20,
        "peak_mb": (bwd_peak if bwd_peak is not None else fwd_peak) / 2**20,
        "fwd_s": t1 - t0,
        "bwd_s": t2 - t1,
    }


def _parity(args) -> dict:
    """Old and new on the same micro-batch and model (--dtype): largest differences of log-probs, entropies, grads."""
    model, mb, _ = _setup(args)
    mask = mb.response_mask.bool()
    results = {}
    for name in ("old", "new"):
        logp, entropy = _impl(name, args.chunk_size)(model, mb, args.temperature, with_entropy=True, entropy_grad=True)
        model.zero_grad(set_to_none=True)
        _loss(logp, entropy, mb, 0.01).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[name] = (logp.detach()[mask], entropy.detach()[mask], grads)
        del logp, entropy
    (lo, eo, go), (ln, en, gn) = results["old"], results["new"]
    grad_diff = max(float((go[n] - gn[n]).abs().max()) for n in go)
    grad_scale = max(float(go[n].abs().max()) for n in go)
    return {
        "max_abs_diff_logp": float((lo - ln).abs().max()),
        "max_abs_diff_entropy": float((eo - en).abs().max()),
        "max_abs_diff_grad": grad_diff,
        "max_abs_grad": grad_scale,
        "same_grad_params": sorted(go) == sorted(gn),
    }


def _child(args, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "rlloop.bench", "logprob_memory", *extra, *args.passthrough]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m rlloop.bench logprob_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=positive_int, default=8)
    p.add_argument("--seq", type=positive_int, default=512, help="tokens per row, prompt + response")
    p.add_argument("--response", type=int, default=256, help="response tokens per row")
    p.add_argument("--vocab", type=positive_int, default=151936)
    p.add_argument("--hidden", type=positive_int, default=64)
    p.add_argument("--layers", type=positive_int, default=2)
    p.add_argument("--tie", action="store_true", help="tie the LM head to the input embedding")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads of each measurement")
    p.add_argument("--chunk-size", type=positive_int, default=None, help="positions per chunk (default: the library's)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--impl", choices=["old", "new"], help=argparse.SUPPRESS)  # child: measure one
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--parity", action="store_true", help=argparse.SUPPRESS)  # child: compare old and new
    args = p.parse_args(argv)
    if not 0 < args.response < args.seq:
        p.error(f"--response {args.response}: need 0 < --response < --seq ({args.seq})")
    modes = [m for m in args.modes.split(",") if m]
    if unknown := [m for m in modes if m not in MODES]:
        p.error(f"--modes: unknown {', '.join(map(repr, unknown))}; expected a comma list of {','.join(MODES)}")

    if args.impl or args.parity:
        print(json.dumps(_parity(args) if args.parity else _measure(args)))
        return

    from trainer.logprobs import default_chunk_size

    chunk = args.chunk_size or default_chunk_size(args.vocab)
    args.passthrough = list(argv)
    positions = args.rows * args.response
    logits_mb = positions * args.vocab * 4 / 2**20
    print(
        f"{args.rows} rows x {args.seq} tokens, {args.response}-token responses, vocab {args.vocab}, "
        f"{args.dtype}: {positions} positions, one fp32 [positions, V] logits tensor = {logits_mb:.0f} MiB; "
        f"new chunk = {chunk} positions",
        flush=True,
    )
    result = {
        "bench": "logprob_memory",
        **machine(),
        "vocab": args.vocab,
        "rows": args.rows,
        "seq": args.seq,
        "response": args.response,
        "dtype": args.dtype,
        "chunk_size": chunk,
        "full_logits_mb": logits_mb,
    }
    for mode in modes:
        old = _child(args, ["--impl", "old", "--mode", mode])
        new = _child(args, ["--impl", "new", "--mode", mode])
        print(
            f"{mode:9s} old: fwd {old['fwd_peak_mb']:7.0f} MiB, peak {old['peak_mb']:7.0f} MiB, "
            f"{old['fwd_s'] + old['bwd_s']:.2f} s | new: fwd {new['fwd_peak_mb']:6.0f} MiB, "
            f"peak {new['peak_mb']:6.0f} MiB, {new['fwd_s'] + new['bwd_s']:.2f} s | "
            f"{old['peak_mb'] / new['peak_mb']:.1f}x lower",
            flush=True,
        )
        for key in ("fwd_peak_mb", "peak_mb"):
            result[f"{mode}_old_{key}"] = old[key]
            result[f"{mode}_new_{key}"] = new[key]
        result[f"{mode}_x_lower"] = old["peak_mb"] / new["peak_mb"]
        result[f"{mode}_old_s"] = old["fwd_s"] + old["bwd_s"]
        result[f"{mode}_new_s"] = new["fwd_s"] + new["bwd_s"]
    parity = _child(args, ["--parity"])
    print(
        f"old vs new: max |dlogp| {parity['max_abs_diff_logp']:.2e}, max |dentropy| "
        f"{parity['max_abs_diff_entropy']:.2e}, max |dgrad| {parity['max_abs_diff_grad']:.2e} "
        f"(max |grad| {parity['max_abs_grad']:.2e})",
        flush=True,
    )
    result.update(parity)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) and abs(v) >= 1e-3 else v for k, v in result.items()}))
