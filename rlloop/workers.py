"""The two kinds of worker the loop drives, as plain classes: a Ray actor is a thin `ray.remote` wrapper around one
(rlloop/cluster.py), and without Ray they run in the driver process.

- `RolloutWorker`: a rollout engine (JAX compiled decoder or the transformers reference) plus a weight receiver.
- `TrainerWorker`: one trainer rank plus, on rank 0, the weight sender.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import gc
import os
import time

from rlloop.profiling import jax_trace, torch_trace
from rollout import EngineConfig
from trainer import TrainerConfig
from weight_sync import SyncConfig, make_receiver, make_sender
from weight_sync.shm import ShmSender

CPU_AFFINITY_ENV = "RLLOOP_CPUS"  # set by the Cluster on CPU hosts: the cores this actor's "chip" is made of
# How often a generation with in-flight updates looks for new weights: at most every IN_FLIGHT_POLL_S, and no more
# often than keeps the looks at POLL_SHARE of the engine's time. A version takes at least a train step (tens of ms on
# the tiny model, seconds on real ones), while a decode dispatch can take under a millisecond: looking before every
# one cost a fully_async engine on the tiny model ~7 % of its time through shm (~84 µs a look inside the busy actor),
# and about half of its time through the Ray transport (a call to its mailbox actor, ~1.2 ms).
IN_FLIGHT_POLL_S = 0.01
POLL_SHARE = 0.01


def limit_threads(n: int, torch_pools: bool = True) -> None:
    """Two cores are easily oversubscribed: pin torch's pools (XLA's is set through XLA_FLAGS before jax loads), and
    on CPU hosts the process itself to its own cores (taken modulo the cores this node has). `torch_pools=False` in
    a JAX engine's process, which never loads torch: importing it only to size its pools cost the actor's start ~2 s."""
    if os.environ.get(CPU_AFFINITY_ENV):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[int(c) % len(cores)] for c in os.environ[CPU_AFFINITY_ENV].split(",")})

    os.environ["OMP_NUM_THREADS"] = str(n)
    if torch_pools:
        import torch

        torch.set_num_threads(n)


# glibc mallopt() parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4


def keep_freed_memory() -> bool:
    """Make glibc malloc keep and reuse freed memory in this process; False where the C library is not glibc.

    By default every allocation above 32 MiB (most activations of a training step) is a fresh mmap, unmapped again
    when freed, so each one page-faults and zeroes all of its pages anew: a 30M-parameter train step on CPU took 1.1M
    page faults. From the heap and never trimmed, the memory of one step serves the next; that step went from 32.6 s to
    24.7 s (0.09M faults). The cost is that the process keeps its peak memory until it exits, as PyTorch's GPU caching
    allocator does. tcmalloc (LD_PRELOAD) does as well (22.9 s) but is not always installed."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return False
    return all(
        libc.mallopt(k, v) == 1 for k, v in ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 256 << 20))
    )


def freeze_heap() -> None:
    """Collect, then move every object alive now out of the garbage collector's reach (`gc.freeze`): call once the
    long-lived state (modules, model, compiled programs) is built. Otherwise each full collection walks all of it:
    80-170 ms pauses in both workers of the tiny example, one every few steps, each stalling a 0.12 s step."""
    gc.collect()
    gc.freeze()


def sync_sender(sync: SyncConfig):
    """Trainer rank 0's end of `sync.transport`: the Ray object store's is rlloop's (weight_sync stays Ray-free)."""
    if sync.transport == "ray":
        from rlloop.ray_sync import make_ray_sender

        return make_ray_sender(sync)
    return make_sender(sync)


def sync_receiver(sync: SyncConfig):
    """An engine's end of `sync.transport`."""
    if sync.transport == "ray":
        from rlloop.ray_sync import make_ray_receiver

        return make_ray_receiver(sync)
    return make_receiver(sync)


def use_compile_cache(path: str | None) -> None:
    """Keep XLA programs on disk across runs: a bucket compiled once is loaded, not recompiled, next time."""
    if path:
        import jax

        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def devices_per_chip(devices: list) -> int:
    """How many devices JAX shows of each chip: 2 on a TPU v7x (its TensorCores, which share the chip's `coords`), 1
    elsewhere. Counted from the devices themselves: Ray sets no TPU_VISIBLE_CHIPS for an actor given all its host's."""
    chips = {tuple(d.coords) for d in devices if getattr(d, "coords", None) is not None}
    return len(devices) // len(chips) if chips else 1


def over_every_tensorcore(engine: EngineConfig) -> EngineConfig:
    """On a TPU whose chips show JAX their two TensorCores as two devices (v7x), the engine's mesh is every device of
    its chips (those Ray made visible to it): `tp` counts chips. The memory plan holds either way: a chip's share
    of the weights and cache is the same bytes, split in two; the model's heads must split over the TensorCores."""
    import jax

    if jax.default_backend() != "tpu" or (per_chip := devices_per_chip(jax.local_devices())) == 1:
        return engine
    from rollout.model_config import ModelConfig
    from rollout.weights import resolve_model_dir

    cores = engine.tp * per_chip
    if uneven := [
        f"{k}={n}"
        for k, n in ModelConfig.from_dir(resolve_model_dir(engine.model_path)).tp_sizes().items()
        if n % cores
    ]:
        raise ValueError(
            f"each of this engine's {engine.tp} TPU chip(s) shows JAX {per_chip} TensorCores, and the engine spans "
            f"them all, tp={cores}: the model's {', '.join(uneven)} do not split over {cores}"
            + ("; give each engine fewer chips (cluster.rollout_engines)" if engine.tp > 1 else "")
        )
    return dataclasses.replace(engine, tp=cores)


class RolloutWorker:
    def __init__(
        self,
        engine: EngineConfig,
        backend: str,
        sync: SyncConfig,
        *,
        device: str = "cpu",
        threads: int = 1,
        compile_cache_dir: str | None = None,
    ):
        limit_threads(threads, torch_pools=backend != "jax")
        keep_freed_memory()
        from rollout import make_engine

        if backend == "jax":
            use_compile_cache(compile_cache_dir)
            engine = over_every_tensorcore(engine)
        self.engine = make_engine(backend, engine, device=device)
        self.trace = jax_trace if backend == "jax" else torch_trace
        self.receiver = sync_receiver(sync)
        self.version = 0
        self._polled_at = float("-inf")  # when _poll_in_flight last looked
        self._look_s = 0.0  # the fastest look that found nothing (0: none yet)

    def warmup(self) -> dict[str, float]:
        seconds = self.engine.warmup()
        freeze_heap()  # the engine and its compiled programs live as long as the actor
        return seconds

    def generate(
        self, prompts: list[list[int]], n: int, sampling, in_flight_updates: bool = False, profile: str | None = None
    ) -> tuple[list, dict]:
        """Completions and the engine's stats (plus `busy_s`, this call's wall time in the actor). With
        `in_flight_updates`, newly pushed weights are loaded between decode dispatches (fully async RL), and the
        stats carry the receiver's metrics as `pull_weights` does; with `profile`, the call is traced there
        (rlloop/profiling.py)."""
        t0 = time.perf_counter()
        self._polled_at = float("-inf")  # the first dispatch always looks: a version waiting now starts every row
        hook = self._poll_in_flight if in_flight_updates else None
        with self.trace(profile):
            completions = self.engine.generate(prompts, n, sampling, between_dispatches=hook)
        stats = {**self.engine.stats(), "busy_s": time.perf_counter() - t0}
        return completions, stats | (self._sync_metrics() if in_flight_updates else {})

    def _poll_in_flight(self) -> None:
        """Between decode dispatches: pull, if IN_FLIGHT_POLL_S has passed since the last look and long enough for
        the looks to take at most POLL_SHARE of the time."""
        now = time.perf_counter()
        if now - self._polled_at >= max(IN_FLIGHT_POLL_S, self._look_s / POLL_SHARE):
            self._polled_at = now
            if not self._load_newest():
                # what a look that finds nothing costs this transport: the fastest one, so that a look that stalled
                # once does not space out all the others
                took = time.perf_counter() - now
                self._look_s = took if self._look_s == 0.0 else min(self._look_s, took)

    def _load_newest(self, at_most: int | None = None) -> bool:
        """Load the newest verified version (at most `at_most`) if there is one (True); a refused (corrupt) version
        keeps the old weights."""
        got = self.receiver.pull(at_most)
        if got is not None:
            version, arrays = got
            self.engine.load_weights(arrays, version)
            self.version = version  # once loaded: an engine that refuses the arrays keeps reporting what it has
        return got is not None

    def sleep(self) -> dict[str, float]:
        """Colocated: free the engine's device memory while the trainer runs; returns the live bytes before/after."""
        before = self.engine.device_bytes()
        self.engine.release()
        return {"before": before, "after": self.engine.device_bytes()}

    def wake(self) -> None:
        self.engine.resume()

    def load_weights(self, versioned: tuple[int, dict]) -> int:
        """Load (version, HF-named arrays) given directly, not through the sync transport (a restarted engine);
        returns the version."""
        version, arrays = versioned
        self.engine.load_weights(arrays, version)
        self.version = version
        return version

    def pull_weights(self, at_most: int | None = None) -> dict[str, float]:
        """Load the newest verified version (at most `at_most`), if any, and report the receiver's sync metrics."""
        t0 = time.perf_counter()
        self._load_newest(at_most)
        return self._sync_metrics() | {"perf/pull_s": time.perf_counter() - t0}

    def _sync_metrics(self) -> dict[str, float]:
        return {**self.receiver.metrics(), "sync/rollout_version": self.version}

    def close(self) -> None:
        self.receiver.close()


class TrainerWorker:
    def __init__(self, trainer: TrainerConfig, rank: int, world_size: int, sync: SyncConfig, threads: int = 1):
        limit_threads(threads)
        keep_freed_memory()
        self.cfg, self.rank, self.world_size, self.sync = trainer, rank, world_size, sync
        self.trainer = self.sender = None
        self.steps = 0
        self.updated = False  # whether the last train step changed the weights (a non-finite one applies nothing)

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's address and a free port there, for torch.distributed's env:// rendezvous. The address is the
        node's as Ray knows it: the host name's often resolves to a loopback one (Debian's 127.0.1.1), which ranks on
        other nodes cannot reach."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def setup(self, master: tuple[str, int] | None = None) -> None:
        """Build the trainer; with several ranks this blocks until all have joined the process group."""
        import transformers

        from trainer import Trainer

        if master is not None:
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master[0], str(master[1])
        self.trainer = Trainer(self.cfg, self.rank, self.world_size)
        # The model is loaded (any download done): transformers' bar at each checkpoint's save_pretrained would cut
        # through the run's own progress bar, as an actor's output reaches the driver's terminal
        transformers.utils.logging.disable_progress_bar()
        if self.rank == 0:
            self.sender = sync_sender(self.sync)
            if isinstance(self.sender, ShmSender):  # a /dev/shm too small for the run fails here, at the start
                self.sender.reserve(self.trainer.export_nbytes())
        freeze_heap()

    def train_step(self, batch, profile: str | None = None) -> dict[str, float]:
        """`train.minibatches` optimizer steps on this rank's share of the batch; with `profile`, traced there
        (rlloop/profiling.py)."""
        t0 = time.perf_counter()
        self.updated = False  # until this step has changed the weights: a step that raises publishes nothing either
        with torch_trace(profile):
            metrics = self.trainer.train_step(batch)
        self.steps += 1
        self.updated = metrics["train/skipped_steps"] < metrics["train/minibatches"]
        if self.steps == 1:
            freeze_heap()  # the first step built the optimizer state and, with train.compile, the compiled layers
        state = self.trainer.state_nbytes()["total"]  # rank 0's share: what train.parallel=fsdp divides
        return {**metrics, "perf/train_busy_s": time.perf_counter() - t0, "train/state_bytes_per_rank": state}

    def push_weights(self, version: int, if_updated: bool = False) -> dict[str, float] | None:
        """Rank 0 publishes `version` and returns the push's metrics; None where nothing was published. Called on
        every rank: under fsdp the export is a gather all ranks join. With `if_updated`, only when the last train step
        changed the weights (every rank skips alike: the step's metrics are reduced over ranks)."""
        if if_updated and not self.updated:
            return None
        t0 = time.perf_counter()
        weights = self.trainer.export_weights()
        if self.sender is None:  # not rank 0
            return None
        stats = self.sender.push(weights, version)
        return {**stats.metrics(), "perf/push_s": time.perf_counter() - t0}

    def sleep(self) -> None:
        """Colocated: move parameters and optimizer state off the accelerator while the engine runs."""
        self.trainer.offload()

    def wake(self) -> None:
        self.trainer.reload()

    def current_weights(self) -> tuple[int, dict]:
        """(the last version pushed, the weights now): what a restarted engine loads. Called on every rank, like
        push_weights; only rank 0's answer holds weights."""
        weights = self.trainer.export_weights()
        version = self.sender.version if self.sender is not None and self.sender.version is not None else 0
        return version, weights

    def force_keyframe(self) -> None:
        if self.sender is not None:
            self.sender.force_keyframe()

    def save(self, path: str) -> None:
        self.trainer.save(path)

    def load(self, path: str) -> None:
        self.trainer.load(path)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
