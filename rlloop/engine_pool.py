"""A run's rollout engines as one pool: prompts split by pending work, and calls that outlive an engine's death.

`Cluster` builds the engines (Ray actors, or `RolloutWorker`s in this process) and hands them to an `EnginePool`; the
pool is what the loop's generations, weight pulls and the colocated sleep/wake go through. An engine that dies or
hangs during a call is rebuilt from its spec (the same bundle, environment and config), given the weights it had (the
version it last pulled, read back from the weight-sync transport; if that is gone, the trainer's current weights, by
the cluster's `give_weights`), and called again, up to run.max_restarts.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable

from rlloop.config import Config
from rlloop.engine_shares import batches_in, merge_stats, share_sampling
from rlloop.errors import ActorDied
from rlloop.profiling import engine_trace
from rlloop.workers import RolloutWorker

RECEIVER_COUNTS = ("sync/refused", "sync/keyframe_requests")  # running counts of each engine's weight receiver
log = logging.getLogger(__name__)


@dataclass
class RestartCount:
    """Engines rebuilt after dying. One per driver, shared by the clusters a trainer's death rebuilds:
    run.max_restarts bounds `done`, this driver's; rollout/engine_restarts is `before` (its checkpoint's) + `done`."""

    before: int = 0
    done: int = 0


class EnginePool:
    def __init__(
        self,
        cfg: Config,
        engines: list,
        specs: list[tuple[dict, dict]] | None = None,
        give_weights: Callable[[int, object], int] | None = None,
        count: RestartCount | None = None,
    ):
        """`engines`: Ray actors (with `specs`, each one's actor options and `RolloutWorker` arguments, to rebuild it,
        and `give_weights(e, engine)`, which loads the trainer's current weights into engine e rebuilt and returns their
        version), or workers in this process."""
        self.cfg, self.engines, self.engines_are_ray_actors = cfg, engines, specs is not None
        self._specs, self._give_weights = specs, give_weights
        n = len(engines)
        # Work handed to each engine and not yet returned (prompt + response tokens), for balancing; and, without
        # Ray, one lock per engine: a local engine is not safe to call from two threads (the async loop modes).
        self._pending = [0] * n
        self._balance = threading.Lock()
        self._locks = [threading.Lock() for _ in range(n)]
        # Full batches of generation queued on each engine (Ray): a call behind them waits that long too. And one
        # lock per engine for its restart: two threads that find it dead rebuild it once.
        self._queued = [0] * n
        self._restarting = [threading.Lock() for _ in range(n)]
        self._count, self._counting = count or RestartCount(), threading.Lock()
        self._versions = [0] * n  # the weight version each engine holds, as its last pull said
        self._sync_reports: dict[int, dict[str, float]] = {}  # each engine's receiver metrics, as it last said
        # fully_async's producer thread notes reports and restarts engines while the loop's thread reads the metrics
        self._sync_lock = threading.Lock()
        self._retired_counts = dict.fromkeys(RECEIVER_COUNTS, 0.0)  # those of engines rebuilt (new ones count from 0)

    def generate(
        self, prompts: list[list[int]], n: int, sampling, in_flight_updates: bool = False, profile: str | None = None
    ):
        """`n` completions per prompt, ordered as one engine returns them, and merged stats. Prompts go to the engine
        with the least pending work (longest first), so concurrent calls (eval during async generation) balance too;
        engine i > 0 samples with seed mix_seed(seed, i), so shares never repeat each other's random streams. With
        `profile` (a directory), engine i traces its share into `profile`/engine{i}."""
        shares = self._assign(prompts, n, sampling.max_new_tokens)
        calls = [(e, idx) for e, idx in enumerate(shares) if idx]
        args = [
            ([prompts[i] for i in idx], n, share_sampling(sampling, e), in_flight_updates, engine_trace(profile, e))
            for e, idx in calls
        ]
        own = [batches_in(len(idx) * n, self.cfg.rollout.max_batch) for _, idx in calls]
        try:
            if self.engines_are_ray_actors:
                with self._balance:  # a generation waits for those queued before it on its engine, then its own
                    waits = [self._queued[e] + b for (e, _), b in zip(calls, own)]
                    for (e, _), b in zip(calls, own):
                        self._queued[e] += b
                called = [self.engines[e] for e, _ in calls]
                refs = [engine.generate.remote(*a) for engine, a in zip(called, args)]
                results = [
                    self._result(e, engine, ref, "generate", a, batches)
                    for (e, _), engine, a, ref, batches in zip(calls, called, args, refs, waits)
                ]
            else:
                results = []
                for (e, _), a in zip(calls, args):
                    with self._locks[e]:
                        results.append(self.engines[e].generate(*a))
        finally:
            with self._balance:
                for (e, idx), b in zip(calls, own):
                    self._pending[e] -= sum(len(prompts[i]) + sampling.max_new_tokens for i in idx) * n
                    if self.engines_are_ray_actors:
                        self._queued[e] -= b
        for (e, _), (_, stats) in zip(calls, results):  # with in-flight updates (fully_async) it may have moved on
            self._versions[e] = int(stats.get("weight_version", self._versions[e]))
        self._note_sync({e: stats for (e, _), (_, stats) in zip(calls, results) if "sync/rollout_version" in stats})
        completions = []
        for (_, idx), (share, _) in zip(calls, results):
            for c in share:
                c.prompt_index = idx[c.prompt_index]
            completions += share
        completions.sort(key=lambda c: (c.prompt_index, c.sample_index))
        return completions, merge_stats({e: stats for (e, _), (_, stats) in zip(calls, results)})

    def _assign(self, prompts: list[list[int]], n: int, max_new: int) -> list[list[int]]:
        shares = [[] for _ in self.engines]
        with self._balance:
            for i in sorted(range(len(prompts)), key=lambda i: -len(prompts[i])):
                e = min(range(len(shares)), key=lambda e: (self._pending[e], e))
                shares[e].append(i)
                self._pending[e] += (len(prompts[i]) + max_new) * n
        return [sorted(s) for s in shares]

    def pull_weights(self, at_most: int | None = None) -> dict[str, float]:
        """Every engine loads the newest version, or the newest up to `at_most`; engine 0's pull seconds and
        `sync_metrics`."""
        pulled = self.call("pull_weights", at_most)
        self._note_sync(dict(enumerate(pulled)))
        return {"perf/pull_s": pulled[0]["perf/pull_s"], **self.sync_metrics()} if pulled else {}

    def _note_sync(self, reports: dict[int, dict[str, float]]) -> None:
        """Engines' receiver metrics, from a pull or a generation that loaded weights as it went (fully_async)."""
        with self._sync_lock:
            for e, m in reports.items():
                self._sync_reports[e] = {key: v for key, v in m.items() if key.startswith("sync/")}
                self._versions[e] = int(m["sync/rollout_version"])

    def sync_metrics(self) -> dict[str, float]:
        """The receivers' metrics as last reported: engine 0's (the last pull's read and apply seconds, its version),
        the counts over every engine there has been, and with several engines each one's version."""
        with self._sync_lock:
            if not self._sync_reports:
                return {}
            out = dict(self._sync_reports[min(self._sync_reports)])
            for key in RECEIVER_COUNTS:
                out[key] = sum(r.get(key, 0.0) for r in self._sync_reports.values()) + self._retired_counts[key]
            if len(self.engines) > 1:
                out |= {f"rollout/engine_{e}/version": float(v) for e, v in enumerate(self._versions)}
            return out

    @property
    def restarts(self) -> int:
        """Engines rebuilt after dying over the run (rollout/engine_restarts)."""
        return self._count.before + self._count.done

    def call(self, method: str, *args) -> list:
        """`method(*args)` on every engine at once; one that died (or hung) is rebuilt and called again. Without Ray,
        in turn, each under its lock (a generation may be running on it from the rollout thread)."""
        if not self.engines_are_ray_actors:
            results = []
            for lock, engine in zip(self._locks, self.engines):
                with lock:
                    results.append(getattr(engine, method)(*args))
            return results
        with self._balance:  # behind the generations queued on each engine (the loop's eval pull in the async modes)
            waits = [1 + queued for queued in self._queued]
        called = list(self.engines)
        refs = [getattr(engine, method).remote(*args) for engine in called]
        return [
            self._result(e, engine, ref, method, args, waits[e]) for e, (engine, ref) in enumerate(zip(called, refs))
        ]

    def _result(self, e: int, engine, ref, method: str, args: tuple, batches: int = 1):
        """The result of `ref`, the call `method(*args)` made on engine e (`engine`). If the engine died, or hung past
        cluster.actor_timeout_s for each of the `batches` full batches of generation the call waits for (those queued
        before it and its own: an eval's pull queued behind a long generation was taken for a hung engine), it is
        rebuilt with the weights it had (`_reload`), once however many threads find it dead, and the call is made
        again on it."""
        import ray

        timeout = self.cfg.cluster.actor_timeout_s
        while True:
            try:
                return ray.get(ref, timeout=timeout and timeout * batches)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e_info:
                with self._restarting[e]:
                    if self.engines[e] is engine:  # not rebuilt meanwhile by another thread that found it dead
                        how = "died" if isinstance(e_info, ray.exceptions.RayActorError) else "hung"
                        self._restart(e, f"{how} during {method}()")
                    engine = self.engines[e]
                ref = getattr(engine, method).remote(*args)

    def _restart(self, e: int, why: str) -> None:
        """Rebuild engine e, which died or hung during `why`, with the weights it had. A rebuild that dies or hangs
        too is one more restart, up to run.max_restarts."""
        import ray

        most, dead = self.cfg.run.max_restarts, self.engines[e]
        while True:
            ray.kill(dead)  # dead, or hung: it would never answer close()'s graceful stop either
            with self._counting:  # engines restarting at once from two threads share the allowance
                if self._count.done >= most:
                    raise ActorDied(
                        f"rollout engine {e}: its actor {why} after {self._count.done} restart(s) "
                        f"(run.max_restarts={most})"
                    )
                self._count.done += 1
                done = self._count.done
            log.warning("rollout engine %d %s; restarting it (%d/%d)", e, why, done, most)
            with self._sync_lock:  # its counts retire; the rest of its report stays until the new engine's first
                for key in RECEIVER_COUNTS:
                    self._retired_counts[key] += self._sync_reports.get(e, {}).pop(key, 0.0)
            opts, kwargs = self._specs[e]
            engine = ray.remote(RolloutWorker).options(**opts).remote(**kwargs)
            try:
                ray.get(engine.warmup.remote(), timeout=self.cfg.cluster.actor_start_timeout_s)
                version = self._reload(e, engine)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
                dead, why = engine, f"died during its restart ({type(err).__name__})"
                continue
            except BaseException:  # TrainerDied, from the trainer's weights: the whole cluster is rebuilt
                ray.kill(engine)
                raise
            # Only now: another thread's call made meanwhile went to the dead engine and waits for this restart,
            # rather than reaching the new one before it has its weights.
            self.engines[e], self._versions[e] = engine, version
            break
        log.warning("rollout engine %d is back (%d/%d), on weight version %d", e, done, most, self._versions[e])

    def _reload(self, e: int, engine) -> int:
        """Give rebuilt engine e the version it held, read back from the transport, so that what it generates again
        is what it would have generated (async: the version the schedule pulled, not the trainer's newer one); the
        trainer's current weights if the transport cannot give it back. Returns the version loaded."""
        import ray

        held = self._versions[e]
        if held == 0 or not self._give_weights:  # the model's own weights, which a new engine starts with
            return held
        pulled = ray.get(engine.pull_weights.remote(held), timeout=self.cfg.cluster.actor_timeout_s)
        if pulled["sync/rollout_version"] == held:
            return held
        log.warning(
            "rollout engine %d: the transport cannot give version %d back (dropped, or a delta whose base is gone); "
            "loading the trainer's current weights",
            e,
            held,
        )
        return self._give_weights(e, engine)
