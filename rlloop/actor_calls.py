"""How the driver calls its workers, Ray actors or objects in this process alike, and what a failed call becomes.

`rlloop/cluster.py` makes its calls to the trainer ranks (and the engines' warm-up) through `WorkerCalls`: one method
on several workers at once, several queued in order behind each other, and the results gathered within the run's
timeouts (cluster.actor_timeout_s; cluster.actor_start_timeout_s for the calls of the run's start). An actor that died
or hung is the driver's error, `ActorDied` for a rollout engine and `TrainerDied` for a trainer rank (the loop
rebuilds the cluster on the latter), and a start call that raised is one `ClusterError` line. A hung actor is killed:
it would never answer anything after, nor its graceful stop.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Literal

from rlloop.config import ClusterSection
from rlloop.errors import ActorDied, ClusterError, TrainerDied

Role = Literal["rollout", "trainer"]  # whose call it is: what its error says and which error it is


def kill_unanswered(workers: list, refs: list, timeout: float) -> bool:
    """Wait up to `timeout` seconds for each worker's call (`refs`), then kill the workers that have not answered: a
    hung actor is treated as dead, and would never answer close()'s graceful stop. Whether any had not."""
    import ray

    _, waiting = ray.wait(refs, num_returns=len(refs), timeout=timeout, fetch_local=False)
    for worker, ref in zip(workers, refs):
        if ref in waiting:
            ray.kill(worker)
    return bool(waiting)


class WorkerCalls:
    """Calls to a cluster's workers: on Ray actors with `cluster.use_ray`, else on the workers in this process, the
    trainer's queued on one thread of their own (as an actor's calls queue in its process)."""

    def __init__(self, cluster: ClusterSection):
        self.workers_are_ray_actors = cluster.use_ray
        self.timeout_s, self.start_timeout_s = cluster.actor_timeout_s, cluster.actor_start_timeout_s
        self._local_queue = ThreadPoolExecutor(1, thread_name_prefix="rlloop-trainer")  # without Ray: trainer calls

    def call_all(self, workers: list, role: Role, method: str, args: list[tuple], start: bool = False) -> list:
        """`method(*args[i])` on every worker at once (Ray) or in turn (local); an actor's death, or no answer within
        cluster.actor_timeout_s (actor_start_timeout_s for a `start` call), is an ActorDied, or TrainerDied."""
        if not self.workers_are_ray_actors:
            return [getattr(w, method)(*a) for w, a in zip(workers, args)]
        return self.gather(workers, role, method, [getattr(w, method).remote(*a) for w, a in zip(workers, args)], start)

    def submit_in_order(
        self, workers: list, role: Role, calls: list[tuple[str, list[tuple]]], start: bool = False
    ) -> Callable[[], list]:
        """Several `call_all`s, (method, args) in turn, queued at once behind any the workers still run: each actor
        runs its calls in that order, and none waits for the driver between them. The returned function waits for
        each call's results. Without Ray the trainer's queue is one thread, as an actor's is."""
        if not self.workers_are_ray_actors:
            queued = self._local_queue.submit(lambda: [self.call_all(workers, role, m, args) for m, args in calls])
            return queued.result
        refs = [[getattr(w, method).remote(*a) for w, a in zip(workers, args)] for method, args in calls]
        return lambda: [self.gather(workers, role, method, r, start) for (method, _), r in zip(calls, refs)]

    def gather(self, workers: list, role: Role, method: str, refs: list, start: bool = False) -> list:
        """The results of `refs`, one `method` call on each worker, with `call_all`'s errors."""
        import ray

        timeout = self.start_timeout_s if start else self.timeout_s
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.RayTaskError as e:
            if not start:
                raise
            # A call of the run's start (setup, warmup, the first train step) that raises is the host's or the
            # config's doing (a sync.dir it cannot create, a model it cannot load, a NaN failure_reward): one line that
            # says what, not a remote traceback.
            why = f"{type(e.cause).__name__}: {e.cause}"
            raise ClusterError(f"a {role} actor's {method}() raised {why}") from None
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            error = ActorDied if role == "rollout" else TrainerDied
            if isinstance(e, ray.exceptions.GetTimeoutError):
                kill_unanswered(workers, refs, timeout=0)
            how = "died" if isinstance(e, ray.exceptions.RayActorError) else f"hung (no answer in {timeout:g} s)"
            raise error(f"a {role} actor {how} during {method}()\n{e}") from None

    def close(self) -> None:
        """Wait for the local trainer calls still queued (a step in flight finishes before its trainer closes)."""
        self._local_queue.shutdown(wait=True)
