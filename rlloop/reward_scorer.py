"""`RewardScorer`: runs the reward function (rlloop/rewards.py) on responses in worker processes, safely.

A sample whose function raises, returns something other than a finite number (None, a string, NaN, inf; a bool counts
as 1 or 0), kills its worker or exceeds `timeout_s` gets `failure_reward` and increments a counter; a stuck or dead
worker is replaced (with whatever the function started) and the run goes on. Each worker is a process of its own that
reports every sample as it finishes, so a sample's time limit runs from its own start, and a stuck one costs its own
limit and its worker's restart: not its chunk-mates' results, nor the other workers' work, which goes on meanwhile.
Workers that die as they start, again and again, are a `RewardError`; so is a function that fails on `broken_after`
samples in a row (a step's worth).
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
from dataclasses import dataclass, field
from multiprocessing import connection, util
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Callable

from rlloop.errors import RewardError
from rlloop.rewards import FLOAT32_MAX, math_reward, resolve

if TYPE_CHECKING:  # the reward workers import this module: they need no config (pydantic, the components' configs)
    from rlloop.config import RewardSection

log = logging.getLogger(__name__)

_resolved: dict[str, Callable] = {}
MAX_CHUNK = 16  # samples per round trip to a reward worker
WORKER_START_S = 120.0  # the most a new worker is waited for (imports, the function's) before it counts as failed
MAX_FAILURE_KINDS_LOGGED = 10  # distinct kinds of failure warned of, each once
MAX_FAILED_STARTS = 3  # per worker: starts in a row that failed, over all workers, before a RewardError


def _load(spec: str) -> Callable:
    if spec not in _resolved:
        _resolved[spec] = resolve(spec)
    return _resolved[spec]


def _start_worker(spec: str) -> None:
    """A new worker's first job: import the function; for `math`, math-verify too, which the function imports at its
    first call (~1.5 s: a short reward.timeout_s failed every sample, each new worker paying the import again)."""
    if _load(spec) is math_reward:
        math_reward("\\boxed{1}", "1")


def init_worker(parent: int) -> None:
    """A reward worker's first acts. It leads a process group of its own, so that killing the group at a timeout also
    ends what the function started (a code-execution reward's subprocess lived on after the run). And it asks the
    kernel for SIGKILL when the *thread* that started it exits (PR_SET_PDEATHSIG follows the thread, not the process):
    a SIGKILLed driver runs no cleanup, and its workers would otherwise live on, each holding a core's worth of imports
    (Linux only). Workers started by a thread that has since ended are gone too: the scorer starts new ones, blaming
    no sample (a sample running when its worker was killed from outside is run once more)."""
    os.setsid()
    if sys.platform != "linux":
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the request was in place
        os._exit(0)


def serve(conn: connection.Connection, spec: str, parent: int) -> None:
    """A reward worker's life: start, say so (None), then score the chunks it is sent, answering each sample as soon as
    it is done (`_outcome`): the driver times each sample from the previous one's answer, and keeps the answers of a
    chunk whose later sample hangs. Ends, quietly, when the driver hangs up."""
    init_worker(parent)
    try:
        _start_worker(spec)
    except BaseException:  # each sample raises it again, and fails with its message
        pass
    try:
        conn.send(None)
        while True:
            spec, pairs = conn.recv()
            for response, answer in pairs:
                conn.send_bytes(_outcome(spec, response, answer))
    except (EOFError, OSError):  # the driver has closed the scorer, or is gone
        return


def _outcome(spec: str, response: str, answer: str) -> bytes:
    """One sample's answer, pickled: (True, value) or (False, why). A function that calls sys.exit() or raises
    KeyboardInterrupt fails its sample: the worker's, not the run's; so does a value that does not pickle."""
    try:
        outcome = (True, _load(spec)(response, answer))
    except BaseException as e:
        outcome = (False, f"raised {type(e).__name__}: {e}")
    try:
        return ForkingPickler.dumps(outcome)
    except Exception as e:
        return ForkingPickler.dumps((False, f"returned a {type(outcome[1]).__name__} that does not pickle ({e})"))


@dataclass
class _Worker:
    """A worker process, the pipe to it and the samples sent to it that it has not answered yet (the first is
    running)."""

    proc: multiprocessing.process.BaseProcess
    conn: connection.Connection
    deadline: float  # starting: when it counts as failed; busy: when its running sample has run past the limit
    ready: bool = False
    job: deque[int] = field(default_factory=deque)


def _stop(workers: list[_Worker]) -> None:
    """Kill the workers, each with its group (what the function started: init_worker), and reap them."""
    while workers:
        worker = workers.pop()
        try:
            os.killpg(worker.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # gone, or not yet its group's leader
            worker.proc.kill()
        worker.proc.join()
        worker.conn.close()


class RewardScorer:
    """Scores responses in worker processes, with a per-sample time limit and a failure reward."""

    def __init__(self, cfg: RewardSection, broken_after: int | None = None):
        """`broken_after`: failed samples in a row (over calls) that make `score` raise a RewardError; None: never."""
        resolve(cfg.fn)  # fail fast, in the caller's process
        self.cfg, self.broken_after = cfg, broken_after
        self.failed_in_a_row = 0  # since the last call in which a sample scored
        self.errors = 0  # raised, returned a non-number, or killed its worker
        self.timeouts = 0
        self._warned: set[str] = set()  # the kinds of failure logged
        self.last_failure = ""  # what the latest failed sample did
        self.worker_starts = 0  # worker processes started so far
        self._workers: list[_Worker] = []
        # Non-daemonic workers (a function may start processes of its own) are joined, forever, at the interpreter's
        # exit: an unclosed scorer's are killed first, by multiprocessing's exit hook (weakref.finalize's runs later
        # where anything made a finalize before multiprocessing was imported, as pytest does).
        util.Finalize(self, _stop, (self._workers,), exitpriority=0)
        self._failed_starts = 0  # worker starts in a row that died or hung before their first sample

    def _start(self) -> _Worker:
        """A new worker, starting: its time limits run once it says it is ready (`serve`), since a spawned worker
        imports the driver's modules again (~1 s, more on a busy host), which a short reward.timeout_s took for a hang,
        again and again, failing every sample."""
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=serve, args=(theirs, self.cfg.fn, os.getpid()), name="rlloop-reward")
        proc.start()
        theirs.close()  # the worker's end is its own now: its death is an EOF here
        self.worker_starts += 1
        return _Worker(proc, ours, time.monotonic() + WORKER_START_S)

    def _discard(self, worker: _Worker) -> None:
        self._workers.remove(worker)
        _stop([worker])

    def _failed_start(self) -> None:
        self._failed_starts += 1
        if self._failed_starts >= MAX_FAILED_STARTS * self.cfg.workers:  # else new workers forever, none scoring
            _stop(self._workers)
            raise RewardError(
                f"reward.fn {self.cfg.fn}: the reward worker processes died (or hung) as they started, "
                f"{self._failed_starts} in a row. A script that starts a run must guard it with "
                "`if __name__ == '__main__':` (each worker imports the script again); else the host may be out of "
                "memory"
            )

    @property
    def failures(self) -> int:
        """Samples given the failure reward so far (rollout/reward_failures)."""
        return self.errors + self.timeouts

    def _fail(self, why: str) -> float:
        self.errors += 1
        self.last_failure = why
        # Each kind of failure once ("raised KeyError", "returned nan"): the counters (rollout/reward_failures) track
        # the rest, and a new kind later in the run is not lost behind the first
        kind = why.split(":")[0][:60]
        if kind not in self._warned and len(self._warned) < MAX_FAILURE_KINDS_LOGGED:
            self._warned.add(kind)
            log.warning("reward.fn %s %s; such samples get reward.failure_reward", self.cfg.fn, why)
        return self.cfg.failure_reward

    def _time_out(self) -> None:
        self.timeouts += 1
        self.last_failure = f"ran past reward.timeout_s={self.cfg.timeout_s}"
        if self.timeouts == 1:
            log.warning(
                "reward.fn %s ran past reward.timeout_s=%s; its worker is killed", self.cfg.fn, self.cfg.timeout_s
            )

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

    def _chunk_size(self, remaining: int) -> int:
        """Samples for the next round trip: many, so that a worker seldom waits for its next sample (one by one, 128
        samples' round trips through a process pool were half of a tiny rollout), and few enough that every worker
        gets some. Each sample has its own time limit, whatever the chunk's size."""
        return max(1, min(MAX_CHUNK, -(-remaining // (2 * self.cfg.workers))))

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
        # Samples go out in chunks, at most one per worker, each answered sample by sample (`serve`): a sample's limit
        # runs from the previous one's answer. A sample past it is a timeout; its worker is killed and replaced, and
        # the rest of its chunk goes out again, while the other workers go on with theirs.
        results: list[float] = [self.cfg.failure_reward] * len(responses)
        todo = deque(range(len(responses)))  # to send; what a killed worker had not done goes back to the front
        died_once: set[int] = set()  # running when their worker died: each runs once more, in case it was not them
        for worker in [w for w in self._workers if w.job or w.proc.exitcode is not None]:
            self._discard(worker)  # dead while idle (no sample to blame), or busy still with an interrupted call
        while todo or any(w.job for w in self._workers):
            # Once the function has hung, one more worker than `workers` is kept started, idle, to take a killed one's
            # place at once: a restart (~1 s of imports, more for a heavy driver) costs as much as a short limit.
            while len(self._workers) < self.cfg.workers + (self.timeouts > 0):
                self._workers.append(self._start())
            for worker in list(self._workers):
                busy = sum(bool(w.job) for w in self._workers)
                if worker.ready and not worker.job and todo and busy < self.cfg.workers:
                    self._send(
                        worker, [todo.popleft() for _ in range(self._chunk_size(len(todo)))], todo, responses, answers
                    )
            waits = [w.conn for w in self._workers] + [w.proc.sentinel for w in self._workers]
            deadline = min((w.deadline for w in self._workers), default=0.0)  # none left: each died as it was sent work
            connection.wait(waits, max(0.0, deadline - time.monotonic()))
            for worker in list(self._workers):
                self._collect(worker, results, todo, died_once)
        return results

    def _send(self, worker: _Worker, job: list[int], todo: deque, responses: list[str], answers: list[str]) -> None:
        try:
            worker.conn.send((self.cfg.fn, [(responses[i], answers[i]) for i in job]))
        except OSError:  # it died since its last answer (BrokenPipeError): no sample to blame
            todo.extendleft(reversed(job))
            self._discard(worker)
            return
        worker.job.extend(job)
        worker.deadline = time.monotonic() + self.cfg.timeout_s

    def _collect(self, worker: _Worker, results: list[float], todo: deque, died_once: set[int]) -> None:
        """Record what `worker` has answered; replace it if it died or its running sample is past the limit."""
        dead = worker.proc.exitcode is not None  # looked at first: what it sent before it died is read below
        while worker.conn.poll():
            try:
                message = worker.conn.recv()
            except (EOFError, OSError):
                dead = True
                break
            except Exception as e:  # the value pickled there and does not unpickle here
                message = (False, f"returned a value that does not unpickle ({type(e).__name__}: {e})")
            if not worker.ready:  # its first message: started
                worker.ready, worker.deadline, self._failed_starts = True, math.inf, 0
                continue
            ok, value = message
            sample = worker.job.popleft()
            results[sample] = self._accept(value) if ok else self._fail(value)
            worker.deadline = time.monotonic() + self.cfg.timeout_s if worker.job else math.inf
        if not dead and time.monotonic() < worker.deadline:
            return
        if worker.job and dead:  # the OOM killer, a segfault, os._exit: most likely its running sample
            sample = worker.job.popleft()
            if sample in died_once:
                results[sample] = self._fail("killed its worker process")
            else:
                died_once.add(sample)
                worker.job.appendleft(sample)
        elif worker.job:
            worker.job.popleft()
            self._time_out()
        todo.extendleft(reversed(worker.job))
        self._discard(worker)
        if not worker.ready:
            self._failed_start()

    def close(self) -> None:
        _stop(self._workers)
