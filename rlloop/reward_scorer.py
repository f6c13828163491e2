"""`RewardScorer`: runs the reward function (rlloop/rewards.py) on responses in worker processes, safely.

A sample whose function raises, returns something other than a finite number (None, a string, NaN, inf; a bool counts
as 1 or 0), kills its worker or exceeds `timeout_s` gets `failure_reward` and increments a counter; a stuck or dead
worker is replaced (with whatever the function started) and the run goes on. Workers that die as they start, pool
after pool, are a `RewardError`; so is a function that fails on `broken_after` samples in a row (a step's worth).
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import signal
import sys
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import TYPE_CHECKING, Callable

from rlloop.errors import RewardError
from rlloop.rewards import math_reward, resolve

if TYPE_CHECKING:  # the reward workers import this module: they need no config (pydantic, the components' configs)
    from rlloop.config import RewardSection

log = logging.getLogger(__name__)

_resolved: dict[str, Callable] = {}
MAX_CHUNK = 16  # samples per round trip to a reward worker
WORKER_START_S = 120.0  # the most a new pool's workers are waited for before samples go out
MAX_FAILED_STARTS = 3
FLOAT32_MAX = 3.4028234663852886e38  # np.finfo(np.float32).max: past it a reward is inf in the rollout's arrays


def _load(spec: str) -> Callable:
    if spec not in _resolved:
        _resolved[spec] = resolve(spec)
    return _resolved[spec]


def _score_chunk(spec: str, pairs: list[tuple[str, str]]) -> list[tuple[bool, object]]:
    """In a worker: (True, value) or (False, 'Error: message') per (response, answer), so that one raising sample
    fails alone. A function that calls sys.exit() or raises KeyboardInterrupt fails its sample too: the worker's,
    not the run's."""
    outcomes = []
    for response, answer in pairs:
        try:
            outcomes.append((True, _load(spec)(response, answer)))
        except BaseException as e:
            outcomes.append((False, f"{type(e).__name__}: {e}"))
    return outcomes


def _start_worker(spec: str) -> None:
    """A new worker's first job: import the function (and return nothing, since it need not pickle); for `math`,
    math-verify too, which the function imports at its first call (~1.5 s: a short reward.timeout_s failed every
    sample, each new pool paying the import again)."""
    if _load(spec) is math_reward:
        math_reward("\\boxed{1}", "1")


def init_worker(parent: int) -> None:
    """A reward worker's first acts. It leads a process group of its own, so that killing the group at a timeout also
    ends what the function started (a code-execution reward's subprocess lived on after the run). And it asks the
    kernel for SIGKILL when its parent dies: a SIGKILLed driver runs no cleanup, and its pool's workers would
    otherwise live on, each holding a core's worth of imports (Linux only)."""
    os.setsid()
    if sys.platform != "linux":
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the request was in place
        os._exit(0)


class RewardScorer:
    """Scores responses in worker processes, with a per-sample time limit and a failure reward."""

    def __init__(self, cfg: RewardSection, broken_after: int | None = None):
        """`broken_after`: failed samples in a row (over calls) that make `score` raise a RewardError; None: never."""
        resolve(cfg.fn)  # fail fast, in the caller's process
        self.cfg, self.broken_after = cfg, broken_after
        self.failed_in_a_row = 0  # since the last call in which a sample scored
        self.errors = 0  # raised, returned a non-number, or killed its worker
        self.timeouts = 0
        self.last_failure = ""  # what the latest failed sample did
        self._pool: ProcessPoolExecutor | None = None
        self._failed_starts = 0  # pools in a row whose workers died as they started
        self._sample_s: float | None = None  # seconds per sample of the last round trip, chunk size follows it

    def _get_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                self.cfg.workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=init_worker,
                initargs=(os.getpid(),),
            )
            # Start the workers and import the function before any sample's time limit runs: a spawned worker
            # imports the driver's modules again (~1 s, more on a busy host), which a short reward.timeout_s took for
            # a hang, again and again, failing every sample.
            starts = [self._pool.submit(_start_worker, self.cfg.fn) for _ in range(self.cfg.workers)]
            done, _ = wait(starts, timeout=WORKER_START_S)
            if any(isinstance(f.exception(), BrokenProcessPool) for f in done):
                self._kill_pool()
                self._failed_starts += 1
                if self._failed_starts == MAX_FAILED_STARTS:  # else new pools forever, no sample ever scored
                    raise RewardError(
                        f"reward.fn {self.cfg.fn}: the reward worker processes died as they started, "
                        f"{MAX_FAILED_STARTS} pools in a row. A script that starts a run must guard it with "
                        "`if __name__ == '__main__':` (each worker imports the script again); else the host may be "
                        "out of memory"
                    )
                return self._get_pool()
            self._failed_starts = 0
        return self._pool

    def _kill_pool(self) -> None:
        if self._pool is not None:
            for proc in list(getattr(self._pool, "_processes", {}).values()):
                try:  # the worker's group: what the function started too (init_worker)
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):  # gone, or not yet its group's leader
                    proc.kill()
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    @property
    def failures(self) -> int:
        """Samples given the failure reward so far (rollout/reward_failures)."""
        return self.errors + self.timeouts

    def _fail(self, why: str) -> float:
        self.errors += 1
        self.last_failure = why
        if self.errors == 1:  # once per scorer: the counter (rollout/reward_failures) tracks the rest
            log.warning("reward.fn %s %s; such samples get reward.failure_reward", self.cfg.fn, why)
        return self.cfg.failure_reward

    def _accept(self, value) -> float:
        # A str is refused even when it parses ("1.5"): the contract is a number, and a function returning text
        # is a bug to surface, not to guess around. NaN and inf would poison the group's advantages.
        if value is None or isinstance(value, (str, bytes)):
            return self._fail(f"returned {value!r:.40} instead of a number")
        try:
            number = float(value)
        except Exception:  # TypeError, ValueError, OverflowError (an int past float's range), a raising __float__
            return self._fail(f"returned a {type(value).__name__}, not a number")
        if not math.isfinite(number) or abs(number) > FLOAT32_MAX:  # the rollout keeps rewards in float32
            return self._fail(f"returned {number}")
        return number

    def _settle(self, job: list[int], fut, results: list[float], retry: deque, suspects: deque, alone: bool) -> bool:
        """Record a finished job's rewards in `results`; True if its pool broke. A chunk that failed as a whole (its
        results would not unpickle) goes back to `retry` one sample at a time, so that the culprit alone gets the
        failure reward. A dead worker (os._exit, a segfault, the OOM killer) breaks every job in flight in its pool,
        and which sample killed it is not known: each goes to `suspects`, to run again `alone`, where a sample that
        kills its worker is the culprit."""
        try:
            outcomes = fut.result()
        except Exception as e:
            broken = isinstance(e, BrokenProcessPool)
            if broken and not alone:
                suspects.extend([i] for i in job)
            elif len(job) > 1:
                retry.extend([i] for i in job)
            elif broken:
                results[job[0]] = self._fail("killed its worker process")
            else:
                results[job[0]] = self._fail(f"raised {type(e).__name__}: {e}")
            return broken
        for i, (ok, value) in zip(job, outcomes):
            results[i] = self._accept(value) if ok else self._fail(f"raised {value}")
        return False

    def _may_send(self, waiting, suspects: deque, inflight: dict) -> bool:
        """Whether another job goes out now: a suspect only into an empty pool, and nothing beside it."""
        if any(alone for *_, alone in inflight.values()):
            return False
        if suspects:
            return not inflight
        return bool(waiting) and len(inflight) < self.cfg.workers

    def _chunk_size(self, remaining: int) -> int:
        """Samples for the next round trip: as many as the last ones suggest take ~10 % of one sample's time limit (the
        chunk's limit), one until there is a measurement, and few enough that every worker gets some."""
        if self._sample_s is None:
            return 1
        fit = int(0.1 * self.cfg.timeout_s / max(self._sample_s, 1e-6))
        return max(1, min(MAX_CHUNK, fit, -(-remaining // (2 * self.cfg.workers))))

    def score(self, responses: list[str], answers: list[str]) -> list[float]:
        """A reward per response; a RewardError once `broken_after` samples in a row have failed."""
        failed = self.failures
        results = self._score(responses, answers)
        # Nothing but failure rewards for a whole step's worth of samples in a row: every advantage is 0, and the run
        # would go on learning nothing. Counted over calls (a top-up round of two prompts whose answers the function
        # cannot read is bad data, not a broken function), from the last one that scored.
        failed = self.failures - failed
        self.failed_in_a_row = self.failed_in_a_row + failed if failed == len(responses) else 0
        if self.broken_after is not None and self.failed_in_a_row >= self.broken_after:
            raise RewardError(
                f"reward.fn {self.cfg.fn} failed on each of the last {self.failed_in_a_row} samples (the last "
                f"{self.last_failure}); fix the function, or try it on one response and answer by hand"
            )
        return results

    def _score(self, responses: list[str], answers: list[str]) -> list[float]:
        # Samples go out in chunks: a round trip to a worker costs ~0.3 ms, which for 128 samples one by one was
        # half of a tiny rollout. At most `workers` chunks in flight, so each one in flight is really running and its
        # deadline (one sample's `timeout_s`; chunks are sized to take a tenth of it) is its own. A chunk that runs
        # past it comes back one sample at a time, each with that limit, so only a sample that is itself too slow
        # times out.
        results: list[float] = [self.cfg.failure_reward] * len(responses)
        pending = deque(range(len(responses)))  # not sent yet
        jobs: deque[list[int]] = deque()  # sent before and to be sent again as they are: retries, survivors of a kill
        suspects: deque[list[int]] = deque()  # in flight when a worker died: each runs again alone (`_settle`)
        inflight: dict = {}  # future -> (sample indices, sent at, deadline, alone)
        while pending or jobs or suspects or inflight:
            pool, broken, expired = self._get_pool(), False, []
            while self._may_send(pending or jobs, suspects, inflight):
                queue = suspects or jobs
                job = queue.popleft() if queue else [pending.popleft() for _ in range(self._chunk_size(len(pending)))]
                try:
                    fut = pool.submit(_score_chunk, self.cfg.fn, [(responses[i], answers[i]) for i in job])
                except BrokenProcessPool:  # a worker died between calls (the OOM killer, a thread the fn left)
                    (suspects if queue is suspects else jobs).appendleft(job)
                    broken = True
                    break
                now = time.monotonic()
                inflight[fut] = (job, now, now + self.cfg.timeout_s, queue is suspects)
            if inflight and not broken:
                first_deadline = min(deadline for _, _, deadline, _ in inflight.values())
                timeout = max(0.0, first_deadline - time.monotonic())
                done, _ = wait(inflight, timeout=timeout, return_when=FIRST_COMPLETED)
                for fut in done:
                    job, sent, _, alone = inflight.pop(fut)
                    self._sample_s = (time.monotonic() - sent) / len(job)
                    broken |= self._settle(job, fut, results, jobs, suspects, alone)
                now = time.monotonic()
                expired = [fut for fut, (_, _, deadline, _) in inflight.items() if deadline <= now]
                for fut in expired:
                    job, _, _, _ = inflight.pop(fut)
                    if len(job) > 1:
                        jobs.extend([i] for i in job)
                        continue
                    self.timeouts += 1
                    self.last_failure = f"ran past reward.timeout_s={self.cfg.timeout_s}"
                    if self.timeouts == 1:
                        log.warning(
                            "reward.fn %s ran past reward.timeout_s=%s; its worker is killed",
                            self.cfg.fn,
                            self.cfg.timeout_s,
                        )
            if expired or broken:  # kill the stuck or dead pool; restart the samples caught in it
                caught = [job for job, _, _, _ in inflight.values()]
                if broken:  # their futures fail with the pool: any of them may have killed it
                    suspects.extend([i] for job in caught for i in job)
                else:
                    jobs.extendleft(caught)
                inflight.clear()
                self._kill_pool()
        return results

    def close(self) -> None:
        self._kill_pool()
