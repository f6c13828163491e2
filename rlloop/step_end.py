"""How a step ends once the loop has queued its training: wait for it, evaluate, log, checkpoint.

A step's metrics cover the driver from the end of the step before to its own end (`StepClock`). In the modes where
the engines generate while the trainer trains, step k ends only after step k + 1's training is queued, so that the
trainer goes from one to the next without waiting for the driver; a step that evaluates or saves ends at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

from rlloop.checkpoint import save_checkpoint
from rlloop.cluster import Cluster
from rlloop.config import Config
from rlloop.rollout_manager import RolloutManager
from rlloop.schedules import RolloutSchedule
from rlloop.step_clock import StepClock, step_overhead
from rlloop.tracking import Tracker

# Running totals kept by the cluster, the reward scorer and the rollout schedule, which a resume or a rebuild after a
# trainer's death makes anew: each is logged as the checkpoint's figure (the run's, up to the step it continues from)
# plus the new one's. (data/dropped_prompts comes back with the data's own state; train/restarts and
# rollout/engine_restarts are counted by `train` across the clusters it rebuilds.)
RUN_TOTALS = (
    "rollout/reward_failures",
    "rollout/reward_timeouts",
    "rollout/eval_reward_failures",
    "rollout/stale_groups_dropped",
    "rollout/zero_std_groups_dropped",
    "sync/refused",
    "sync/keyframe_requests",
)

# A step's training as the loop queued it: called with the driver's seconds spent queueing it, it waits for the
# step's training metrics (rlloop.loop.start_training)
Training = Callable[[float], dict]


def evaluates(cfg: Config, rollout: RolloutManager) -> bool:
    """Whether the run evaluates at all: an eval set, a period, and engines to generate it."""
    return rollout.eval_data is not None and cfg.run.eval_every > 0 and bool(rollout.cluster.engines)


def save_model(cluster: Cluster, tokenizer, path: str) -> None:
    """The trainer's state, and next to its model the run's tokenizer: a checkpoint's trainer/ is a model directory
    that `model.path` (or transformers) loads as it is."""
    cluster.save(path)
    tokenizer.save_pretrained(path)


class StepEnds:
    """Ends the loop's steps in order, each once its training is done."""

    def __init__(
        self,
        cfg: Config,
        cluster: Cluster,
        rollout: RolloutManager,
        batches: RolloutSchedule,
        tracker: Tracker,
        clock: StepClock,
        carried: dict,
        trainer_restarts: int,
    ):
        self.cfg, self.cluster, self.rollout, self.batches, self.tracker = cfg, cluster, rollout, batches, tracker
        self.clock, self.trainer_restarts = clock, trainer_restarts
        self.carried = dict(carried)  # RUN_TOTALS as of the checkpoint the run started from
        self.totals = dict(carried)  # and as last logged
        self.evaluating = evaluates(cfg, rollout)
        self.pending: tuple[int, dict, Training | None] | None = None

    def add(self, step: int, metrics: dict, training: Training | None) -> None:
        """Step `step`'s rollout metrics and its queued training (None: it trained nothing). Ends the step before;
        ends this one too unless the engines are generating the next batch meanwhile and it neither evaluates nor
        saves."""
        self.flush()
        self.pending = (step, metrics, training)
        if not self.batches.overlapped or self.cfg.run.saves_at(step) or self._evals_at(step):
            self.flush()

    def flush(self) -> None:
        """End the step not yet ended, if any."""
        if self.pending:
            pending, self.pending = self.pending, None
            self._end(*pending)

    def _evals_at(self, step: int) -> bool:
        return self.evaluating and self.cfg.run.evals_at(step)

    def _end(self, step: int, metrics: dict, training: Training | None) -> None:
        if training is not None:
            metrics |= training(self.clock.queued)
        if self.batches.overlapped:  # what the driver waited for the engines, which generate while the trainer trains
            metrics["perf/rollout_wait_s"] = self.clock.waited
        if self._evals_at(step):
            self._evaluate(metrics)
        metrics |= {"perf/step_s": self.clock.elapsed(), "train/restarts": self.trainer_restarts}
        metrics |= step_overhead(metrics)
        for key, total in self.rollout.counters().items():  # a replay's batches carry none: it scores nothing
            metrics.setdefault(key, total)
        for key in RUN_TOTALS:
            if key in metrics:
                metrics[key] = self.totals[key] = metrics[key] + self.carried.get(key, 0)
        self.tracker.log(step, metrics)
        if self.cluster.trainers and self.cfg.run.saves_at(step):
            self._save(step)
        self.clock.restart()

    def _evaluate(self, metrics: dict) -> None:
        """The eval set on the step's weights. While it runs fully_async's producer starts no chunk, and async's next
        batch (older weights) is done first; that wait, and the engines' pull of the step's weights, count as the
        step's rollout wait, not as eval."""
        t0 = time.perf_counter()
        with self.batches.paused():
            if self.batches.overlapped:
                self.cluster.pull_weights()
                metrics["perf/rollout_wait_s"] += time.perf_counter() - t0
                t0 = time.perf_counter()
            metrics |= self.rollout.evaluate() | {"perf/eval_s": time.perf_counter() - t0}

    def _save(self, step: int) -> None:
        restarts = {"train/restarts": self.trainer_restarts, "rollout/engine_restarts": self.cluster.restarts}
        loop_state = {
            "data": self.batches.resume_state(),
            "totals": self.totals | restarts,
            "train_parallel": self.cfg.train_parallel,
        }
        save_trainer = partial(save_model, self.cluster, self.rollout.tokenizer)
        save_checkpoint(self.cfg.run_dir, step, loop_state, save_trainer, keep=self.cfg.run.keep_checkpoints)
