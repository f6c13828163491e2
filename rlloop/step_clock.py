"""Where the driver's time goes in a step: `StepClock` times the waits for a batch and the queueing of a training,
`step_overhead` what is left outside generation, training, sync and eval (the loop's own cost, `perf/other_s`)."""

from __future__ import annotations

import time
from contextlib import contextmanager


def step_overhead(metrics: dict[str, float]) -> dict[str, float]:
    """The step's seconds outside generation (or, in the async modes, waiting for it), training, sync and eval:
    scoring, advantages, batch transfer, logging and saving the step's samples; what the loop itself costs."""
    rollout = metrics.get("perf/rollout_wait_s", metrics.get("perf/rollout_s", 0.0))
    busy = rollout + sum(metrics.get(f"perf/{k}_s", 0.0) for k in ("train", "sync", "eval"))
    other = max(metrics["perf/step_s"] - busy, 0.0)
    return {"perf/other_s": other, "perf/other_frac": other / max(metrics["perf/step_s"], 1e-9)}


class StepClock:
    """The driver's time since the last step ended, and how much of it went to waiting for a batch and to queueing a
    training: a step's metrics cover the driver from the end of the step before to its own end."""

    def __init__(self):
        self.restart()

    def restart(self) -> None:
        self.started, self.waited, self.queued = time.perf_counter(), 0.0, 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    @contextmanager
    def waiting(self):
        t0 = time.perf_counter()
        yield
        self.waited += time.perf_counter() - t0

    @contextmanager
    def queueing(self):
        t0 = time.perf_counter()
        yield
        self.queued += time.perf_counter() - t0
