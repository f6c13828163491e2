"""The rollout engine and the trainer ranks, placed on chips as Ray actors, or run in this process.

This is the only place that knows about Ray actors and placement groups: the loop calls `Cluster` methods and gets
plain results back. A local Ray starts when neither `cluster.address` nor `RAY_ADDRESS` names one (and is stopped at
the end); inside `ray job submit` the job's cluster is used. Actors are thin `ray.remote` wrappers around
`rlloop.workers`; with `cluster.use_ray: false` the same workers run in the driver.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from rlloop.config import Config
from rlloop.placement import actor_options, plan_placement
from rlloop.workers import RolloutWorker, SyncSpec, TrainerWorker

# Passed to every actor: offline switches, tokens and caches must reach workers on other nodes too.
FORWARDED_ENV = (
    "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_HOME",
    "HF_TOKEN",
    "WANDB_MODE",
    "JAX_PLATFORMS",
    "PYTHONPATH",
)
PLACEMENT_TIMEOUT_S = 120


def run_id_for(run_dir: Path) -> str:
    """Stable across resumes of one run directory, distinct between runs: it names shared-memory segments."""
    digest = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '-', Path(run_dir).name)[:32]}-{digest}"


def sync_spec(cfg: Config, run_dir: Path) -> SyncSpec:
    s = cfg.sync
    return SyncSpec(
        transport=s.transport,
        run_id=run_id_for(run_dir),
        root=s.dir or str(Path(run_dir) / "sync"),
        delta=s.delta,
        keyframe_every=s.keyframe_every,
        keep=s.keep,
    )


class ClusterError(RuntimeError):
    """The cluster cannot host the plan, or an actor died; the message says which and what to do."""


def actor_env(cfg: Config, threads: int, rollout: bool) -> dict[str, str]:
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    env.update({"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0"})
    if cfg.cluster.device == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        if rollout:  # a CPU "chip" per engine device, so tensor parallel decode works on CPU hosts too
            env["XLA_FLAGS"] = (
                f"--xla_force_host_platform_device_count={cfg.cluster.rollout_chips} "
                f"--xla_cpu_multi_thread_eigen={'true' if threads > 1 else 'false'}"
            )
    return env


class Cluster:
    def __init__(self, cfg: Config, run_dir: Path):
        self.cfg, self.remote, self.owns_ray = cfg, cfg.cluster.use_ray, False
        self.pg = None
        sync, threads = sync_spec(cfg, run_dir), cfg.cluster.cpus_per_actor
        engine = dict(
            engine=cfg.engine_config(),
            backend=cfg.rollout.backend,
            sync=sync,
            threads=threads,
            device="cuda" if cfg.cluster.device == "gpu" else "cpu",
            compile_cache_dir=cfg.rollout.compile_cache_dir,
        )
        world = cfg.cluster.train_chips
        ranks = [
            dict(trainer=cfg.trainer_config(), rank=r, world_size=world, sync=sync, threads=threads)
            for r in range(world)
        ]
        if not self.remote:
            if world > 1:
                raise ClusterError("cluster.train_chips > 1 needs Ray (cluster.use_ray: true)")
            self.rollout = RolloutWorker(**engine)
            self.trainers = [TrainerWorker(**ranks[0])]
            self.trainers[0].setup()
            return
        try:
            self._start(cfg, engine, ranks)
        except BaseException:
            self.close()  # a half-built cluster must not leave actors or a local Ray behind
            raise

    # ------------------------------------------------------------------ Ray
    def _start(self, cfg: Config, engine: dict, ranks: list[dict]) -> None:
        import ray
        from ray.util.placement_group import placement_group

        if not ray.is_initialized():
            address = cfg.cluster.address or os.environ.get("RAY_ADDRESS")
            self.owns_ray = address is None
            ray.init(
                address=address,
                namespace="rlloop",
                include_dashboard=False,
                log_to_driver=True,
                configure_logging=False,
            )
        plan = plan_placement(cfg.cluster, same_host=cfg.sync.transport == "shm")
        self.pg = placement_group(plan.bundles, strategy=plan.strategy, name=f"rlloop-{cfg.run.name}")
        try:
            ray.get(self.pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise ClusterError(
                f"the Ray cluster cannot host the plan within {PLACEMENT_TIMEOUT_S}s; it has "
                f"{ray.cluster_resources()}, the plan needs\n{plan.describe()}"
            ) from None

        def options(bundle: int, rollout: bool) -> dict:
            return actor_options(plan, bundle, self.pg, actor_env(cfg, cfg.cluster.cpus_per_actor, rollout))

        self.rollout = ray.remote(RolloutWorker).options(**options(plan.rollout_bundle, True)).remote(**engine)
        self.trainers = [
            ray.remote(TrainerWorker).options(**options(b, False)).remote(**kwargs)
            for b, kwargs in zip(plan.trainer_bundles, ranks)
        ]
        master = self._call(self.trainers[0], "rendezvous") if len(self.trainers) > 1 else None
        self._call_all(self.trainers, "setup", [(master,)] * len(self.trainers))

    def _call(self, worker, method: str, *args):
        if not self.remote:
            return getattr(worker, method)(*args)
        import ray

        try:
            return ray.get(getattr(worker, method).remote(*args))
        except ray.exceptions.RayActorError as e:
            role = "rollout" if worker is self.rollout else "trainer"
            raise ClusterError(
                f"the {role} actor died during {method}(); the last checkpoint is intact: rerun with --resume.\n{e}"
            ) from None

    def _call_all(self, workers: list, method: str, args: list[tuple]) -> list:
        if not self.remote:
            return [getattr(w, method)(*a) for w, a in zip(workers, args)]
        import ray

        try:
            return ray.get([getattr(w, method).remote(*a) for w, a in zip(workers, args)])
        except ray.exceptions.RayActorError as e:
            raise ClusterError(
                f"a trainer actor died during {method}(); the last checkpoint is intact: rerun with --resume.\n{e}"
            ) from None

    # ------------------------------------------------------------------ what the loop calls
    def warmup(self) -> dict[str, float]:
        return self._call(self.rollout, "warmup")

    def generate(self, prompts: list[list[int]], n: int, sampling) -> tuple[list, dict]:
        return self._call(self.rollout, "generate", prompts, n, sampling)

    def train_step(self, batch) -> dict[str, float]:
        from trainer import shard_batch

        world = len(self.trainers)
        shards = [(shard_batch(batch, r, world),) for r in range(world)]
        return self._call_all(self.trainers, "train_step", shards)[0]  # metrics are all-reduced: equal on all ranks

    def sync_weights(self, version: int) -> dict[str, float]:
        pushed = self._call(self.trainers[0], "push_weights", version)
        return {**pushed, **self._call(self.rollout, "pull_weights")}

    def save(self, path: str) -> None:
        self._call_all(self.trainers, "save", [(path,)] * len(self.trainers))

    def load(self, path: str) -> None:
        self._call_all(self.trainers, "load", [(path,)] * len(self.trainers))

    def close(self) -> None:
        """Stop the workers (gracefully first, so shared memory is released), then Ray if we started it."""
        workers = [w for w in (getattr(self, "rollout", None), *getattr(self, "trainers", [])) if w is not None]
        if not self.remote:
            for w in workers:
                w.close()
            return
        import ray

        # Wait for every close, not ray.get: a dead actor's error would return at once and the kill below would
        # then cut short the live ones' cleanup (the trainer's shared-memory segments). Stuck ones are killed anyway;
        # whatever they leave is swept at the next start.
        refs = [w.close.remote() for w in workers]
        ray.wait(refs, num_returns=len(refs), timeout=30)
        for w in workers:
            ray.kill(w)
        if self.pg is not None:
            ray.util.remove_placement_group(self.pg)
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()
