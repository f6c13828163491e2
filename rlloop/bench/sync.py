"""`python -m rlloop.bench sync`: weight-sync speed against the physical limits, and delta size on real GRPO steps.

Part 1, on one ~1 GB bf16 state dict (the same bytes for every line):
    copy      np.copyto into an already-used buffer: what moving the bytes costs at best on this host
    shm       push + pull through the shm transport (copy into a reused segment, checksums on both sides)
    disk      push + pull through the disk transport (safetensors + manifest written, renamed, read back, verified)
    raw disk  writing the same bytes to one plain file and reading them back
Each is timed in steady state (buffers warmed, best of --reps).

Part 2: a small random Qwen3 model trained in bf16 (fp32 masters) at lr 1e-6 by trainer.Trainer on random GRPO
batches; after every step its exported weights go through a delta sender/receiver pair. Reports delta bytes over full
bytes, the changed-element fraction and whether every received version is bit-identical to what was exported.

Ends with one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import ml_dtypes
import numpy as np

from weight_sync import make_receiver, make_sender


def _state_dict(total_mb: int, rng) -> dict[str, np.ndarray]:
    """bf16 tensors shaped like a decoder's, adding up to ~total_mb MiB."""
    hidden, inter = 2048, 6144
    shapes = [("self_attn.q_proj.weight", (hidden, hidden)), ("self_attn.k_proj.weight", (hidden // 4, hidden)),
              ("self_attn.v_proj.weight", (hidden // 4, hidden)), ("self_attn.o_proj.weight", (hidden, hidden)),
              ("mlp.gate_proj.weight", (inter, hidden)), ("mlp.up_proj.weight", (inter, hidden)),
              ("mlp.down_proj.weight", (hidden, inter)), ("input_layernorm.weight", (hidden,))]
    out, total, i = {}, 0, 0
    while total < total_mb << 20:
        name, shape = shapes[i % len(shapes)]
        a = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
        out[f"model.layers.{i // len(shapes)}.{name}"] = a
        total += a.nbytes
        i += 1
    return out


def _best(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_copy(state, reps) -> float:
    dst = {n: np.empty_like(a) for n, a in state.items()}
    for n, a in state.items():
        np.copyto(dst[n], a)  # touch every page first: "already-used buffer"
    return _best(lambda: [np.copyto(dst[n], a) for n, a in state.items()], reps)


def bench_transport(transport, state, reps, root, verify=True) -> tuple[float, float, float]:
    """Best push+pull seconds, and the push and pull seconds of that same round."""
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    sender = make_sender(transport, run_id=run_id, root=root, keep=1)
    receiver = make_receiver(transport, run_id=run_id, root=root)
    if hasattr(receiver, "verify"):
        receiver.verify = verify
    best = (float("inf"), 0.0, 0.0)
    try:
        for version in range(reps + 2):  # two warm-up rounds: both shm buffers touched once
            t0 = time.perf_counter()
            sender.push(state, version)
            t1 = time.perf_counter()
            got = receiver.pull()
            t2 = time.perf_counter()
            assert got is not None and got[0] == version, f"{transport}: version {version} not received"
            del got
            if version >= 2 and t2 - t0 < best[0]:
                best = (t2 - t0, t1 - t0, t2 - t1)
    finally:
        sender.close()
        receiver.close()
        if root is not None:
            shutil.rmtree(Path(root) / run_id, ignore_errors=True)
    return best


def bench_raw_disk(state, reps, root) -> float:
    def write_read(i=[0]):
        path = Path(root) / f"raw-{i[0]}.bin"
        with open(path, "wb") as f:
            for a in state.values():
                f.write(a.view(np.uint8).data)
        with open(path, "rb") as f:
            back = [np.fromfile(f, np.uint8, a.nbytes) for a in state.values()]
        (Path(root) / f"raw-{i[0] - 1}.bin").unlink(missing_ok=True)  # like the transport, keep the newest only
        i[0] += 1
        return back

    write_read()
    t = _best(write_read, reps)
    for p in Path(root).glob("raw-*.bin"):
        p.unlink()
    return t


def bench_delta(steps: int, root: str) -> dict:
    """Real GRPO steps (trainer.Trainer, bf16, lr 1e-6) pushed as deltas; exactness checked on every version."""
    import torch
    import transformers

    from trainer import TrainBatch, Trainer, TrainerConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=512, tie_word_embeddings=True, rope_theta=1e6,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model_dir = os.path.join(root, "delta_model")
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(model_dir)
    trainer = Trainer(TrainerConfig(model_path=model_dir, dtype="bfloat16", lr=1e-6))
    rng = np.random.default_rng(0)
    run_id = f"bench-delta-{uuid.uuid4().hex[:8]}"
    sender = make_sender("shm", run_id=run_id, delta=True, keyframe_every=steps + 1)
    receiver = make_receiver("shm", run_id=run_id, delta=True)
    delta_bytes = full_bytes = 0
    changed, encode_s, apply_s, exact = [], [], [], True
    try:
        for version in range(steps + 1):
            if version:
                groups, g = 4, 8  # 4 prompts x 8 samples, random tokens, group-normalised random rewards
                prompts = [rng.integers(3, cfg.vocab_size, 32).tolist() for _ in range(groups) for _ in range(g)]
                responses = [rng.integers(3, cfg.vocab_size, int(rng.integers(16, 64))).tolist() for _ in prompts]
                rewards = rng.integers(0, 2, (groups, g)).astype(np.float64)
                adv = (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, ddof=1, keepdims=True) + 1e-4)
                trainer.train_step(TrainBatch(prompts, responses, adv.reshape(-1).tolist()))
            exported = trainer.export_weights()
            sent = {n: a.copy() for n, a in exported.items()}  # exported arrays alias the live parameters
            stats = sender.push(exported, version)
            got = receiver.pull()
            exact &= got is not None and got[0] == version and got[1].keys() == sent.keys() and all(
                got[1][n].dtype == a.dtype and got[1][n].tobytes() == a.tobytes() for n, a in sent.items())
            if version:
                exact &= not stats.keyframe
                delta_bytes += stats.bytes
                full_bytes += stats.full_bytes
                changed.append(stats.changed_frac)
                encode_s.append(stats.encode_s)
                apply_s.append(receiver.apply_s)
    finally:
        sender.close()
        receiver.close()
    return {"delta_ratio": delta_bytes / full_bytes, "delta_exact": bool(exact),
            "changed_frac": float(np.mean(changed)), "delta_x_smaller": full_bytes / delta_bytes,
            "delta_steps": steps, "delta_model_bytes": full_bytes // steps,
            "delta_encode_s": float(np.mean(encode_s)), "delta_apply_s": float(np.mean(apply_s))}


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m rlloop.bench sync", description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=1024, help="size of the full-sync state dict in MiB")
    p.add_argument("--reps", type=int, default=3, help="timed rounds per transport (best is reported)")
    p.add_argument("--delta-steps", type=int, default=8, help="GRPO steps in the delta part")
    p.add_argument("--root", default=None, help="directory for the disk transport (default: a temp dir)")
    args = p.parse_args(argv)
    if args.mb < 1 or args.reps < 1 or args.delta_steps < 1:
        raise ValueError("--mb, --reps and --delta-steps must be >= 1")

    root = tempfile.mkdtemp(prefix="rlloop-bench-sync-", dir=args.root)
    try:
        state = _state_dict(args.mb, np.random.default_rng(0))
        nbytes = sum(a.nbytes for a in state.values())
        gb = nbytes / 1e9
        copy_s = bench_copy(state, args.reps)
        shm_s, shm_push_s, shm_pull_s = bench_transport("shm", state, args.reps, None)
        shm_unverified_s = bench_transport("shm", state, args.reps, None, verify=False)[0]
        disk_s = bench_transport("disk", state, args.reps, root)[0]
        raw_s = bench_raw_disk(state, args.reps, root)
        del state
        result = {"bench": "sync", "bytes": nbytes, "copy_gbps": gb / copy_s, "shm_gbps": gb / shm_s,
                  "disk_gbps": gb / disk_s, "raw_disk_gbps": gb / raw_s, "shm_vs_copy": copy_s / shm_s,
                  "disk_vs_raw": raw_s / disk_s}
        print(f"full sync of {gb:.2f} GB: copy {gb / copy_s:.2f} GB/s | shm {gb / shm_s:.2f} GB/s "
              f"(push {gb / shm_push_s:.2f}, pull {gb / shm_pull_s:.2f}, unverified pull {gb / shm_unverified_s:.2f}"
              f" round trip) | disk {gb / disk_s:.2f} GB/s | raw disk {gb / raw_s:.2f} GB/s", flush=True)
        delta = bench_delta(args.delta_steps, root)
        print(f"delta over {args.delta_steps} GRPO steps: {delta['delta_x_smaller']:.1f}x smaller, "
              f"{100 * delta['changed_frac']:.2f}% elements changed, exact={delta['delta_exact']}", flush=True)
        result.update({k: delta[k] for k in ("delta_ratio", "delta_exact", "changed_frac")})
        result.update({"shm_push_gbps": gb / shm_push_s, "shm_pull_gbps": gb / shm_pull_s,
                       "shm_unverified_gbps": gb / shm_unverified_s,
                       **{k: v for k, v in delta.items() if k not in result}})
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))
    finally:
        shutil.rmtree(root, ignore_errors=True)
