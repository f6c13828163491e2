"""The rollout engines and the trainer ranks, placed on chips as Ray actors, or run in this process.

The loop reaches the workers only through it: it calls `Cluster` methods and gets plain results back. Behind it,
rlloop/actor_calls.py makes the calls to the workers and turns an actor's death or silence into the driver's error,
rlloop/engine_pool.py makes the engines' calls and restarts them, rlloop/placement.py plans the placement group and
rlloop/ray_sync.py is the object-store weight transport. A `Cluster` neither starts nor stops Ray: it places its
actors in the Ray this process already runs, which under `train()` is rlloop/ray_session.py's, started once around
the whole run (rlloop/loop.py `_train`) and kept while a trainer's death rebuilds the Cluster: a local Ray of the
run's own when neither `cluster.address` nor `RAY_ADDRESS` names one, else that cluster (inside `ray job submit`, the
job's). Actors are thin `ray.remote` wrappers around `rlloop.workers`; with `cluster.use_ray: false` the same workers
run in the driver.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from rlloop.actor_calls import WorkerCalls, kill_unanswered
from rlloop.config import TORCH_DEVICE, Config
from rlloop.engine_pool import EnginePool, RestartCount
from rlloop.errors import ClusterError, TrainerDied
from rlloop.placement import (
    actor_env,
    actor_options,
    check_cluster_fits,
    check_one_node_fits,
    jax_gpu_env,
    plan_placement,
    plan_settings,
)
from rlloop.profiling import rank_trace
from rlloop.ray_session import local_ray
from rlloop.workers import RolloutWorker, TrainerWorker, freeze_heap

log = logging.getLogger(__name__)


@dataclass
class TrainedStep:
    metrics: dict[str, float]
    published: bool  # rank 0 published the step's weights (not when the step changed none, or was not asked to)


class Cluster:
    """A run's rollout engines (`pool`, an `EnginePool`) and trainer ranks (`trainers`), built for one config and
    driven as one: the loop's generations, train steps, weight syncs and checkpoints go through its methods, which
    hide whether the workers are Ray actors (`workers_are_ray_actors`, cluster.use_ray) or objects in this process,
    and the colocated roles' turns on shared chips (the sleep/wake around each). Built once per run, and again from
    the last checkpoint after a trainer rank's death (rlloop/loop.py); `close()` ends its workers."""

    def __init__(self, cfg: Config, engine_restarts: RestartCount | None = None):
        """`engine_restarts`: the driver's count, when a trainer's death rebuilt the cluster (rlloop/loop.py)."""
        self.cfg, self.workers_are_ray_actors = cfg, cfg.cluster.use_ray
        self.pg = self.mailbox = None
        self._warming: list = []  # the engines' warmup() calls in flight
        self._stepped = False  # whether the trainer ranks have taken a step
        self.calls = WorkerCalls(cfg.cluster)
        self._train_results = ThreadPoolExecutor(1, thread_name_prefix="rlloop-train-wait")  # waits on train steps
        self.pool = EnginePool(cfg, [])
        self.trainers: list = []
        sync, threads = cfg.sync_config(), cfg.cluster.cpus_per_actor
        self.sync_run_id = sync.run_id
        if cfg.sync.transport == "shm":
            from weight_sync.shm import remove_stale_segments

            # A killed run's segments under this run's name would be read as its versions by the engines' receivers
            # before the trainer's sender sweeps them, or ever, under --debug rollout-only (no sender)
            remove_stale_segments()
        engine = dict(
            engine=cfg.engine_config(),
            backend=cfg.rollout.backend,
            sync=sync,
            threads=threads,
            device=TORCH_DEVICE[cfg.cluster.device],  # the HF backend's (the JAX engine finds its own)
            compile_cache_dir=cfg.rollout.compile_cache_dir,
        )
        world = cfg.cluster.train_chips
        ranks = [
            dict(trainer=cfg.trainer_config(), rank=r, world_size=world, sync=sync, threads=threads)
            for r in range(world)
        ]
        self.placement: dict[str, str] = {}  # role -> Ray node id
        # run.debug leaves one role out (its bundles stay reserved, so the plan is the run's own)
        self.with_engines, self.with_trainers = cfg.run.debug != "train-only", cfg.run.debug != "rollout-only"
        log.info(
            "starting %d rollout engine(s) (%s, %s) and %d trainer rank(s)",
            cfg.cluster.rollout_engines * self.with_engines,
            cfg.rollout.backend,
            cfg.cluster.device,
            world * self.with_trainers,
        )
        if self.workers_are_ray_actors:
            import ray

            if not ray.is_initialized():  # else Ray's first remote call would start one without ray_session's settings
                raise RuntimeError(
                    "a Cluster with cluster.use_ray places its actors in this process's Ray: start or join one first "
                    "(rlloop.ray_session.ray_session, as rlloop.loop does)"
                )
        try:
            if self.workers_are_ray_actors:
                self._start(cfg, engine, ranks, engine_restarts)
            else:
                self._start_local(cfg, engine, ranks[0], engine_restarts)
        except BaseException:
            # A half-built cluster must not leave actors behind, nor, in this process, engines and a frozen heap
            self.close()
            raise

    def _start_local(self, cfg: Config, engine: dict, rank: dict, engine_restarts: RestartCount | None) -> None:
        """Without Ray: the engines and the one trainer rank (rlloop.config) in this process."""
        if cfg.cluster.device == "gpu":  # colocated (rlloop.config): JAX must leave torch its share of the GPU
            for key, value in jax_gpu_env(colocated=True).items():
                os.environ.setdefault(key, value)
        engines = [RolloutWorker(**engine) for _ in range(cfg.cluster.rollout_engines * self.with_engines)]
        self.pool = EnginePool(cfg, engines, count=engine_restarts)
        self.trainers = [TrainerWorker(**rank)] if self.with_trainers else []
        for t in self.trainers:
            t.setup()
        self._trainers_give_way()

    # ------------------------------------------------------------------ Ray
    def _start(self, cfg: Config, engine: dict, ranks: list[dict], engine_restarts: RestartCount | None) -> None:
        import ray
        from ray.util.placement_group import placement_group

        plan = plan_placement(cfg.cluster, same_host=cfg.sync.transport == "shm")
        if local_ray(cfg):  # nothing joins a Ray started here: a plan it cannot hold fails now, not after the timeout
            check_cluster_fits(plan, cfg.cluster)
        if cfg.sync.transport == "shm":
            check_one_node_fits(plan)
        # Named by the run directory, not run.name: runs of one name (seeds, each in its own run.dir) share a cluster
        self.pg = placement_group(plan.bundles, strategy=plan.strategy, name=f"rlloop-{self.sync_run_id}")
        waited = cfg.cluster.placement_timeout_s
        try:
            ray.get(self.pg.ready(), timeout=waited)
        except ray.exceptions.GetTimeoutError:
            raise ClusterError(
                f"the Ray cluster could not host the placement plan within cluster.placement_timeout_s={waited:g}; "
                f"it has {ray.cluster_resources()}. {plan_settings(cfg.cluster)}, or give it more time (an "
                f"autoscaler adding nodes).\n{plan.describe()}"
            ) from None

        if cfg.sync.transport == "ray":
            from rlloop.ray_sync import get_mailbox

            # The run's mailbox is the driver's: a Ray actor lives as long as whoever created it, and one created by
            # the first engine to ask would die with that engine, taking the trainer's next push down with it.
            self.mailbox = get_mailbox(engine["sync"].run_id, engine["sync"].keep)

        def options(bundle: int, rollout: bool) -> dict:
            env = actor_env(cfg, cfg.cluster.cpus_per_actor, rollout, plan.cores(bundle))
            runtime_env = cfg.cluster.rollout_runtime_env if rollout else cfg.cluster.trainer_runtime_env
            return actor_options(plan, bundle, self.pg, env, "rollout" if rollout else "trainer", runtime_env)

        # Kept to rebuild an engine that dies (run.max_restarts): the same bundle, environment and config.
        specs = [(options(b, True), engine) for b in plan.rollout_bundles if self.with_engines]
        engines = [ray.remote(RolloutWorker).options(**opts).remote(**kw) for opts, kw in specs]
        give = self._give_current_weights if self.with_trainers else None  # --debug rollout-only: the model's own
        self.pool = EnginePool(cfg, engines, specs, give, engine_restarts)
        if not cfg.cluster.colocate:  # engines on chips of their own compile while the ranks load; `warmup` waits
            self._warming = [engine.warmup.remote() for engine in self.engines]
        self.trainers = [
            ray.remote(TrainerWorker).options(**options(b, False)).remote(**kwargs)
            for b, kwargs in zip(plan.trainer_bundles, ranks)
            if self.with_trainers
        ]
        nodes = ray.util.placement_group_table(self.pg)["bundles_to_node_id"]
        self.placement = {who: nodes[bundle] for who, bundle in plan.roles().items()}  # -> <run dir>/cluster.json
        rank0 = self.trainers[:1]
        if len(self.trainers) > 1:
            master = self.calls.call_all(rank0, "trainer", "rendezvous", [()], start=True)[0]
        else:
            master = None
        self._on_every_rank("setup", master, start=True)
        self._trainers_give_way()

    def _trainers_give_way(self) -> None:
        """Colocated, the trainer ranks start asleep (state on the host, their allocator's cache emptied): the
        engines' warmup and first generation would otherwise find the chips holding the ranks' state, and the memory
        of loading the model whole before sharding it, which the memory plan gives the engine. Every train step wakes
        them first (`start_train_step`)."""
        if self.cfg.cluster.colocate and self.trainers:
            self._on_every_rank("sleep", start=True)

    def _give_current_weights(self, e: int, engine) -> int:
        """Load the trainer's current weights into `engine`, engine e rebuilt after a death: it has the checkpoint's.
        They go as an object ref, never through the driver, and the next push is a keyframe, since it has no base for
        deltas. The engine's death or silence raises Ray's error (the pool rebuilds it again), a rank's TrainerDied.
        Returns their version."""
        import ray

        current = [t.current_weights.remote() for t in self.trainers]  # every rank joins an fsdp gather
        # Queued behind a train step in the async modes: the trainer's silence is its own, not the new engine's hang
        timeout = self.cfg.cluster.actor_timeout_s
        if kill_unanswered(self.trainers, current, timeout):
            raise TrainerDied(f"a trainer actor hung (no answer in {timeout:g} s) while rollout engine {e} restarted")
        try:
            version = ray.get(engine.load_weights.remote(current[0]), timeout=timeout)
        except ray.exceptions.RayTaskError as err:  # raised in the engine: its argument, rank 0's weights, failed
            if isinstance(err.cause, ray.exceptions.RayActorError):  # rank 0 died too: rebuild from a checkpoint
                raise TrainerDied(f"a trainer actor died while rollout engine {e} restarted: {err.cause}") from None
            raise
        self.calls.gather(self.trainers[1:], "trainer", "current_weights", current[1:])  # a dead rank: TrainerDied
        self.calls.call_all(self.trainers[:1], "trainer", "force_keyframe", [()])
        return version

    def _on_every_rank(self, method: str, *args, start: bool = False) -> list:
        """`method(*args)` on every trainer rank, each with the same arguments; their results, in rank order."""
        return self.calls.call_all(self.trainers, "trainer", method, [args] * len(self.trainers), start)

    # ------------------------------------------------------------------ what the loop calls
    @property
    def engines(self) -> list:
        return self.pool.engines

    @property
    def restarts(self) -> int:
        """Engines rebuilt after dying (rollout/engine_restarts)."""
        return self.pool.restarts

    def warmup(self) -> dict[str, float]:
        """The engines' warm-up compiles (under way since they started, where they have chips of their own)."""
        if self._warming:
            warm, self._warming = self.calls.gather(self.engines, "rollout", "warmup", self._warming, start=True), []
        else:
            warm = self.calls.call_all(self.engines, "rollout", "warmup", [()] * len(self.engines), start=True)
        # The actors froze their own heaps; the driver's long-lived state (tokenizer, data, Ray) is built too by now
        if self.workers_are_ray_actors:
            freeze_heap()
        return warm[0] if warm else {}  # the same programs everywhere

    def generate(
        self, prompts: list[list[int]], n: int, sampling, in_flight_updates: bool = False, profile: str | None = None
    ):
        """`n` completions per prompt from the engines, and their merged stats (`EnginePool.generate`)."""
        return self.pool.generate(prompts, n, sampling, in_flight_updates, profile)

    def start_train_step(self, batch, publish: int | None = None, profile: str | None = None) -> Future[TrainedStep]:
        """Queue one train step on every rank, behind any step still running there; with `publish`, rank 0 then
        publishes the new weights as that version if the step changed them, queued behind the step so that it costs
        no round trip of its own; with `profile` (a directory), rank r traces its step into `profile`/trainer_rank{r}.
        Returns the step's metrics and whether it published as a future, done as soon as the ranks are."""
        from trainer import shard_batch

        world = len(self.trainers)
        minibatches = self.cfg.train.minibatches
        shards = [(shard_batch(batch, r, world, minibatches), rank_trace(profile, r)) for r in range(world)]
        freed = {}
        if self.cfg.cluster.colocate:  # the trainer's turn on the shared chips: the engines make room first
            slept = self.pool.call("sleep")
            freed = {
                "rollout/device_bytes": float(sum(s["before"] for s in slept)),
                "rollout/device_bytes_while_training": float(sum(s["after"] for s in slept)),
            }
            self._on_every_rank("wake")
        calls = [("train_step", shards)]
        if publish is not None:
            calls.append(("push_weights", [(publish, True)] * world))
        if self.cfg.cluster.colocate:
            calls.append(("sleep", [()] * world))
        # The first step builds the optimizer state and, with train.compile, compiles: a start, timed as one.
        results = self.calls.submit_in_order(self.trainers, "trainer", calls, start=not self._stepped)
        self._stepped = True

        def trained() -> TrainedStep:
            done = results()  # each call's result is equal on all ranks (push_weights: rank 0's is the push's)
            pushed = done[1][0] if publish is not None else None
            return TrainedStep(done[0][0] | (pushed or {}) | freed, published=pushed is not None)

        return self._train_results.submit(trained)

    def push_weights(self, version: int) -> dict[str, float]:
        """Rank 0 publishes `version` (the other ranks join the export's gather under fsdp); the engines take it at
        their next pull."""
        with self._trainers_awake():
            pushed = self._on_every_rank("push_weights", version)
        return (pushed[0] if pushed else None) or {}

    def sync_metrics(self) -> dict[str, float]:
        """The engines' receiver metrics as they last reported them (fully_async: as they loaded weights mid-
        generation); see `EnginePool.sync_metrics`."""
        return self.pool.sync_metrics()

    def pull_weights(self, at_most: int | None = None) -> dict[str, float]:
        """Every engine loads the newest version, or the newest up to `at_most` (queued behind a generation in flight,
        as slime's async loop does); see `EnginePool.pull_weights`."""
        if self.cfg.cluster.colocate:  # the engines' turn: their cache and weights come back before they load
            self.pool.call("wake")
        return self.pool.pull_weights(at_most)

    def sync_weights(self, version: int) -> dict[str, float]:
        return {**self.push_weights(version), **self.pull_weights()}

    def save(self, path: str) -> None:
        with self._trainers_awake():
            self._on_every_rank("save", path)

    def load(self, path: str) -> None:
        with self._trainers_awake():
            self._on_every_rank("load", path, start=True)

    @contextmanager
    def _trainers_awake(self):
        """Colocated on accelerators, what the trainer ranks do outside a train step (a checkpoint's save or load, a
        push) runs on their state on the chips, as in a step: their collectives (fsdp's gathers) reduce device
        tensors. The engines make room first and come back after."""
        if not (self.cfg.cluster.colocate and self.cfg.cluster.device != "cpu" and self.trainers):
            yield
            return
        self.pool.call("sleep")
        self._on_every_rank("wake")
        try:
            yield
        finally:
            self._on_every_rank("sleep")
            self.pool.call("wake")

    def close(self) -> None:
        """Stop the workers (gracefully first, so shared memory is released); Ray is left running. The heap
        this process froze (`freeze_heap`: the driver's, and without Ray the workers' too) is the collector's again:
        frozen, what the run left in reference cycles was never freed (a failed in-process run's traceback held its
        engine, whose JAX arrays outlived it). The disk transport's default root in the run directory goes too, once
        empty: the trainer's sender removes only its run's versions in it, and an empty `sync/` was left."""
        try:
            self._close_workers()
        finally:
            gc.unfreeze()
            if self.cfg.sync.dir is None:  # a sync.dir of the user's, which other runs may share, stays
                with suppress(OSError):  # not empty, or never made (shm, Ray)
                    Path(self.cfg.sync_config().dir).rmdir()

    def _close_workers(self) -> None:
        workers = [*self.engines, *self.trainers]
        self._train_results.shutdown(wait=False)  # a wait still under way ends with its actors below
        if not self.workers_are_ray_actors:
            self.calls.close()  # a step in flight finishes before its trainer closes
            for w in workers:
                w.close()
            return
        import ray

        # Wait for every close, not ray.get: a dead actor's error would return at once and the kill below would
        # then cut short the live ones' cleanup (the trainer's shared-memory segments). Stuck ones are killed anyway;
        # whatever they leave is swept at the next start.
        refs = [w.close.remote() for w in workers]
        ray.wait(refs, num_returns=len(refs), timeout=30)
        for w in [*workers, *([self.mailbox] if self.mailbox is not None else [])]:
            ray.kill(w)  # the mailbox too: a cluster rebuilt after a trainer's death starts with a new one
        if self.cfg.sync.transport == "shm":  # a rank killed outright (the run's last death) left its segments
            from weight_sync.shm import remove_stale_segments, segment_path

            # which go once its process is gone: ray.kill returns before that (a stopped process takes seconds)
            deadline = time.monotonic() + 30
            remove_stale_segments()
            while segment_path(self.sync_run_id, "ctl").exists():
                if time.monotonic() > deadline:
                    log.warning("a killed trainer's shared memory outlived it; the next run's start removes it")
                    break
                time.sleep(0.1)
                remove_stale_segments()
        if self.pg is not None:
            ray.util.remove_placement_group(self.pg)
