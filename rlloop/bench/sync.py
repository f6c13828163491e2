"""`python -m rlloop.bench sync`: weight-sync speed against the physical limits, and delta size on real GRPO steps.

Part 1, on one ~1 GB bf16 state dict (the same bytes for every line):
    copy      np.copyto into an already-used buffer, one tensor after the other: the plain copy the goals are set
              against; also reported, the same copies split over the transports' thread pool
              (`copy_parallel_gbps`, closer to the memory bandwidth) and shm's speed relative to that
              (`shm_vs_parallel_copy`)
    shm       push + pull through the shm transport (copy into a reused segment, checksums on both sides)
    disk      push + pull through the disk transport (safetensors + manifest written, renamed, read back, verified)
    raw disk  writing the same bytes to one plain file and reading them back into memory (np.fromfile); the disk
              transport's reader maps its file instead (zero copy), so it can beat this baseline on the read side
All four are timed in turn within each round, in steady state (buffers warmed), best of --reps rounds.

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

from rlloop.bench import positive_int
from rlloop.bench.machine import machine
from weight_sync import SyncConfig, make_receiver, make_sender
from weight_sync.checksum import byte_view, copy_with_checksums


def _state_dict(total_mb: int, rng) -> dict[str, np.ndarray]:
    """bf16 tensors shaped like a decoder's, adding up to ~total_mb MiB."""
    hidden, inter = 2048, 6144
    shapes = [
        ("self_attn.q_proj.weight", (hidden, hidden)),
        ("self_attn.k_proj.weight", (hidden // 4, hidden)),
        ("self_attn.v_proj.weight", (hidden // 4, hidden)),
        ("self_attn.o_proj.weight", (hidden, hidden)),
        ("mlp.gate_proj.weight", (inter, hidden)),
        ("mlp.up_proj.weight", (inter, hidden)),
        ("mlp.down_proj.weight", (hidden, inter)),
        ("input_layernorm.weight", (hidden,)),
    ]
    out, total, i = {}, 0, 0
    while total < total_mb << 20:
        name, shape = shapes[i % len(shapes)]
        a = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
        out[f"model.layers.{i // len(shapes)}.{name}"] = a
        total += a.nbytes
        i += 1
    return out


def bench_full_sync(state: dict[str, np.ndarray], reps: int, root: str) -> dict[str, float]:
    """Best seconds of each way to move `state`, timed round by round in turn (copy, shm, disk, raw disk), so that
    every system sees the same background load on a shared machine. Two warm-up rounds first: both shm buffers,
    the copy destination and the page cache have been touched once, as in a long run."""
    copy_dst = {n: np.empty_like(a) for n, a in state.items()}
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    cfg = SyncConfig(run_id=run_id, transport="shm", delta=False)
    shm_tx, shm_rx = make_sender(cfg), make_receiver(cfg)
    shm_rx_unverified = make_receiver(cfg)
    shm_rx_unverified.verify = False  # trusts the seqlock and the manifest checksum, skips the data checksums
    disk_tx = make_sender(SyncConfig(run_id=run_id, transport="disk", delta=False, dir=root, keep=1))
    disk_rx = make_receiver(SyncConfig(run_id=run_id, transport="disk", delta=False, dir=root))
    copy_jobs = [(byte_view(copy_dst[n]), byte_view(a), False) for n, a in state.items()]
    best = {
        k: float("inf")
        for k in ("copy", "copy_parallel", "shm", "shm_push", "shm_pull", "shm_unverified", "disk", "raw_disk")
    }

    def clock(key, seconds, warm):
        if warm:
            best[key] = min(best[key], seconds)

    def pull(receiver, version):
        got = receiver.pull()
        assert got is not None and got[0] == version, f"version {version} not received"

    try:
        for version in range(reps + 2):
            warm = version >= 2
            t0 = time.perf_counter()
            for n, a in state.items():
                np.copyto(copy_dst[n], a)
            t1 = time.perf_counter()
            copy_with_checksums(copy_jobs)
            clock("copy", t1 - t0, warm)
            clock("copy_parallel", time.perf_counter() - t1, warm)
            t1 = time.perf_counter()
            shm_tx.push(state, version)
            t2 = time.perf_counter()
            pull(shm_rx, version)
            t3 = time.perf_counter()
            pull(shm_rx_unverified, version)
            t4 = time.perf_counter()
            clock("shm", t3 - t1, warm)
            clock("shm_push", t2 - t1, warm)
            clock("shm_pull", t3 - t2, warm)
            clock("shm_unverified", (t2 - t1) + (t4 - t3), warm)

            t0 = time.perf_counter()
            disk_tx.push(state, version)
            pull(disk_rx, version)
            t1 = time.perf_counter()
            path = Path(root) / f"raw-{version}.bin"
            with open(path, "wb") as f:
                for a in state.values():
                    f.write(a.view(np.uint8).data)
            with open(path, "rb") as f:
                back = [np.fromfile(f, np.uint8, a.nbytes) for a in state.values()]
            (Path(root) / f"raw-{version - 1}.bin").unlink(missing_ok=True)  # like the transport: newest only
            t2 = time.perf_counter()
            del back
            clock("disk", t1 - t0, warm)
            clock("raw_disk", t2 - t1, warm)
    finally:
        for end in (shm_tx, shm_rx, shm_rx_unverified, disk_tx, disk_rx):
            end.close()
        for p in Path(root).glob("raw-*.bin"):
            p.unlink()
        shutil.rmtree(Path(root) / run_id, ignore_errors=True)
    return best


def bench_delta(steps: int, root: str) -> dict:
    """Real GRPO steps (trainer.Trainer, bf16, lr 1e-6) pushed as deltas; exactness checked on every version."""
    import torch
    import transformers

    from trainer import TrainBatch, Trainer, TrainerConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_theta=1e6,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model_dir = os.path.join(root, "delta_model")
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(model_dir)
    trainer = Trainer(TrainerConfig(model_path=model_dir, dtype="bfloat16", lr=1e-6))
    rng = np.random.default_rng(0)
    run_id = f"bench-delta-{uuid.uuid4().hex[:8]}"
    sender = make_sender(SyncConfig(run_id=run_id, transport="shm", delta=True, keyframe_every=steps + 1))
    receiver = make_receiver(SyncConfig(run_id=run_id, transport="shm", delta=True))
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
            exact &= (
                got is not None
                and got[0] == version
                and got[1].keys() == sent.keys()
                and all(got[1][n].dtype == a.dtype and got[1][n].tobytes() == a.tobytes() for n, a in sent.items())
            )
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
    return {
        "delta_ratio": delta_bytes / full_bytes,
        "delta_exact": bool(exact),
        "changed_frac": float(np.mean(changed)),
        "delta_x_smaller": full_bytes / delta_bytes,
        "delta_steps": steps,
        "delta_model_bytes": full_bytes // steps,
        "delta_encode_s": float(np.mean(encode_s)),
        "delta_apply_s": float(np.mean(apply_s)),
    }


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m rlloop.bench sync", description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=positive_int, default=1024, help="size of the full-sync state dict in MiB")
    p.add_argument(
        "--reps", type=positive_int, default=4, help="timed rounds after two warm-up rounds (best is reported)"
    )
    p.add_argument("--delta-steps", type=positive_int, default=8, help="GRPO steps in the delta part")
    p.add_argument("--root", default=None, help="directory for the disk transport (default: a temp dir)")
    args = p.parse_args(argv)
    if args.root is not None and not Path(args.root).is_dir():
        p.error(f"--root {args.root}: not a directory")

    root = tempfile.mkdtemp(prefix="rlloop-bench-sync-", dir=args.root)
    try:
        state = _state_dict(args.mb, np.random.default_rng(0))
        nbytes = sum(a.nbytes for a in state.values())
        gb = nbytes / 1e9
        t = bench_full_sync(state, args.reps, root)
        del state
        result = {
            "bench": "sync",
            **machine(),
            "bytes": nbytes,
            "copy_gbps": gb / t["copy"],
            "shm_gbps": gb / t["shm"],
            "disk_gbps": gb / t["disk"],
            "raw_disk_gbps": gb / t["raw_disk"],
            "shm_vs_copy": t["copy"] / t["shm"],
            "disk_vs_raw": t["raw_disk"] / t["disk"],
        }
        print(
            f"full sync of {gb:.2f} GB: copy {gb / t['copy']:.2f} GB/s | shm {gb / t['shm']:.2f} GB/s "
            f"(push {gb / t['shm_push']:.2f}, pull {gb / t['shm_pull']:.2f}; without data checksums on the "
            f"reader {gb / t['shm_unverified']:.2f}) | disk {gb / t['disk']:.2f} GB/s | "
            f"raw disk {gb / t['raw_disk']:.2f} GB/s",
            flush=True,
        )
        delta = bench_delta(args.delta_steps, root)
        print(
            f"delta over {args.delta_steps} GRPO steps: {delta['delta_x_smaller']:.1f}x smaller, "
            f"{100 * delta['changed_frac']:.2f}% elements changed, exact={delta['delta_exact']}",
            flush=True,
        )
        result.update({k: delta[k] for k in ("delta_ratio", "delta_exact", "changed_frac")})
        result.update(
            {
                "shm_push_gbps": gb / t["shm_push"],
                "shm_pull_gbps": gb / t["shm_pull"],
                "shm_unverified_gbps": gb / t["shm_unverified"],
                "copy_parallel_gbps": gb / t["copy_parallel"],
                "shm_vs_parallel_copy": t["copy_parallel"] / t["shm"],
                **{k: v for k, v in delta.items() if k not in result},
            }
        )
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))
    finally:
        shutil.rmtree(root, ignore_errors=True)
