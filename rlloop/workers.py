"""The two kinds of worker the loop drives, as plain classes: a Ray actor is a thin `ray.remote` wrapper around one
(rlloop/cluster.py), and without Ray they run in the driver process.

- `RolloutWorker`: a rollout engine (JAX compiled decoder or the transformers reference) plus a weight receiver.
- `TrainerWorker`: one trainer rank plus, on rank 0, the weight sender.
"""
from __future__ import annotations

import os
import time

from rlloop.config import Config


def limit_threads(n: int) -> None:
    """Two cores are easily oversubscribed: pin torch's pools (XLA's is set through XLA_FLAGS before jax loads)."""
    import torch

    os.environ["OMP_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)


def sync_args(cfg: Config, run_id: str, run_dir: str) -> dict:
    return {"transport": cfg.sync.transport, "run_id": run_id, "delta": cfg.sync.delta,
            "root": cfg.sync.dir or os.path.join(run_dir, "sync")}


def engine_args(cfg: Config, max_prompt_len: int) -> dict:
    r = cfg.rollout
    if r.backend == "hf":
        return {"model_path": cfg.model.path, "dtype": cfg.model.dtype, "max_batch": r.max_batch,
                "device": "cuda" if cfg.cluster.device == "gpu" else "cpu"}
    return {"model_path": cfg.model.path, "dtype": cfg.model.dtype, "max_batch": r.max_batch,
            "max_seq_len": max_prompt_len + r.max_response_len, "tp": cfg.cluster.rollout_chips,
            "prefill_buckets": tuple(r.prefill_buckets) if r.prefill_buckets else None,
            "decode_buckets": tuple(r.decode_buckets) if r.decode_buckets else None,
            "steps_per_dispatch": r.steps_per_dispatch, "seed": cfg.run.seed}


def trainer_args(cfg: Config) -> dict:
    t, g = cfg.train, cfg.grpo
    return {"model_path": cfg.model.path, "dtype": cfg.model.dtype,
            "device": {"gpu": "cuda", "tpu": "tpu", "cpu": "cpu"}[cfg.cluster.device],
            "lr": t.lr, "weight_decay": t.weight_decay, "betas": tuple(t.betas), "eps": t.eps,
            "max_grad_norm": t.max_grad_norm, "micro_batch_tokens": t.micro_batch_tokens,
            "minibatches": t.minibatches, "temperature": cfg.rollout.temperature,
            "max_response_len": cfg.rollout.max_response_len,
            "gradient_checkpointing": t.gradient_checkpointing, "seed": cfg.run.seed,
            "loss": {"clip_eps_low": g.clip_eps_low, "clip_eps_high": g.clip_eps_high, "loss_agg": g.loss_agg,
                     "kl_coef": g.kl_coef, "kl_estimator": g.kl_estimator, "entropy_coef": g.entropy_coef,
                     "tis_cap": g.tis_cap, "importance_level": g.importance_level}}


def make_sender(sync: dict, keyframe_every: int):
    if sync["transport"] == "ray":
        from rlloop.ray_sync import make_ray_sender
        return make_ray_sender(run_id=sync["run_id"], delta=sync["delta"], keyframe_every=keyframe_every)
    from weight_sync import make_sender as make
    return make(sync["transport"], run_id=sync["run_id"], root=sync["root"], delta=sync["delta"],
                keyframe_every=keyframe_every)


def make_receiver(sync: dict):
    if sync["transport"] == "ray":
        from rlloop.ray_sync import make_ray_receiver
        return make_ray_receiver(run_id=sync["run_id"], delta=sync["delta"])
    from weight_sync import make_receiver as make
    return make(sync["transport"], run_id=sync["run_id"], root=sync["root"], delta=sync["delta"])


def use_compile_cache(path: str | None) -> None:
    """Keep XLA programs on disk across runs: a bucket compiled once is loaded, not recompiled, next time."""
    if path:
        import jax

        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


class RolloutWorker:
    def __init__(self, backend: str, engine_kwargs: dict, sync: dict, threads: int = 1,
                 compile_cache_dir: str | None = None):
        limit_threads(threads)
        from rollout import make_engine

        if backend == "jax":
            use_compile_cache(compile_cache_dir)
        self.engine = make_engine(backend, **engine_kwargs)
        self.receiver = make_receiver(sync)
        self.version = 0

    def warmup(self) -> dict[str, float]:
        return self.engine.warmup() if hasattr(self.engine, "warmup") else {}

    def generate(self, prompts: list[list[int]], n: int, sampling) -> tuple[list, dict]:
        completions = self.engine.generate(prompts, n, sampling)
        return completions, self.engine.stats()

    def pull_weights(self) -> dict[str, float]:
        """Load the newest verified version, if there is one; a refused (corrupt) version keeps the old weights."""
        t0 = time.perf_counter()
        got = self.receiver.pull()
        if got is not None:
            self.version, arrays = got
            self.engine.load_weights(arrays, self.version)
        return {**self.receiver.metrics(), "sync/rollout_version": self.version,
                "perf/pull_s": time.perf_counter() - t0}

    def close(self) -> None:
        self.receiver.close()


class TrainerWorker:
    def __init__(self, trainer_kwargs: dict, rank: int, world_size: int, sync: dict, keyframe_every: int,
                 threads: int = 1):
        limit_threads(threads)
        self.kwargs, self.rank, self.world_size = trainer_kwargs, rank, world_size
        self.sync, self.keyframe_every = sync, keyframe_every
        self.trainer = self.sender = None

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's address and a free port there, for torch.distributed's env:// rendezvous."""
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return socket.gethostbyname(socket.gethostname()), s.getsockname()[1]

    def setup(self, master: tuple[str, int] | None = None) -> None:
        """Build the trainer; with several ranks this blocks until all have joined the process group."""
        from trainer import Trainer, TrainerConfig

        if master is not None:
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master[0], str(master[1])
        self.trainer = Trainer(TrainerConfig(**self.kwargs), self.rank, self.world_size)
        if self.rank == 0:
            self.sender = make_sender(self.sync, self.keyframe_every)

    def train_step(self, batch) -> dict[str, float]:
        return self.trainer.train_step(batch)

    def push_weights(self, version: int) -> dict[str, float]:
        if self.sender is None:
            return {}
        t0 = time.perf_counter()
        stats = self.sender.push(self.trainer.export_weights(), version)
        return {**stats.metrics(), "perf/push_s": time.perf_counter() - t0}

    def save(self, path: str) -> None:
        self.trainer.save(path)

    def load(self, path: str) -> None:
        self.trainer.load(path)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()

