"""The GRPO loop, read top to bottom like the recipe:
data -> rollout -> reward -> advantages -> train -> sync -> log -> checkpoint.

Everything clever lives behind these calls: generation and scoring in `rlloop/rollout_manager.py` (the compiled
decoder itself in `rollout/`), when generation runs relative to training in `rlloop/schedules.py`, the loss in
`trainer/`, the transports in `weight_sync/`, placement in `rlloop/cluster.py` and `rlloop/placement.py`, and what
ends a step (eval, logging, checkpoints) in `rlloop/step_end.py`.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import ExitStack, closing
from pathlib import Path

from rlloop.checkpoint import checkpoint_marks, latest_checkpoint, load_state
from rlloop.cluster import Cluster
from rlloop.config import Config, to_yaml
from rlloop.data import Inputs, load_inputs
from rlloop.engine_pool import RestartCount
from rlloop.errors import TrainerDied
from rlloop.profiling import profile_dir
from rlloop.ray_session import ray_session
from rlloop.replay import ReplayRollout
from rlloop.rollout_manager import RolloutManager
from rlloop.run_dir import EarlierRun, earlier_run, resume_point, run_dir_held
from rlloop.schedules import AsyncRollout, FullyAsyncRollout, RolloutSchedule, SyncRollout
from rlloop.step_clock import StepClock
from rlloop.step_end import StepEnds, Training, evaluates
from rlloop.tracking import Tracker

log = logging.getLogger(__name__)


def train(cfg: Config, resume: bool = False, inputs: Inputs | None = None) -> Path:
    """Run (or with `resume`, continue) the recipe on `inputs` (loaded and checked here unless the caller has).
    A trainer rank that dies costs a rebuild of the cluster from the run's last checkpoint (from the start before
    its first), with the same data order, up to `run.max_restarts` times (engines heal in place)."""
    inputs = inputs or load_inputs(cfg)
    with run_dir_held(cfg.run_dir):
        return _train(cfg, resume, inputs)


def _train(cfg: Config, resume: bool, inputs: Inputs) -> Path:
    earlier = earlier_run(cfg, resume)
    ckpt, resumed = resume_point(cfg, resume, inputs)
    if resumed["step"] >= cfg.run.steps and ckpt:
        log.warning("--resume: the run is at step %d, run.steps=%d: nothing to train", resumed["step"], cfg.run.steps)
        return cfg.run_dir
    totals = resumed.get("totals", {})  # the earlier drivers', as of that checkpoint
    before = totals.get("train/restarts", 0)
    # Engines healed in place: counted across the clusters rebuilt below (an engine's restart before a trainer's
    # death happened, even if the steps after the checkpoint are trained again), and bounded by run.max_restarts
    engines = RestartCount(before=int(totals.get("rollout/engine_restarts", 0)))
    with ray_session(cfg):  # a rebuilt cluster's actors start in the same Ray
        for restarts in range(cfg.run.max_restarts + 1):
            if restarts:  # from the run's last checkpoint: not an earlier run's left in its directory
                own = resume or bool(checkpoint_marks(cfg.run_dir) - earlier.checkpoints)
                ckpt = latest_checkpoint(cfg.run_dir) if own else None
            try:
                return run_recipe(cfg, inputs, ckpt, before + restarts, engines, earlier)
            except TrainerDied as e:
                if restarts == cfg.run.max_restarts:
                    raise TrainerDied(f"{e}\n(run.max_restarts={cfg.run.max_restarts} spent)") from None
                log.warning("%s\nrestarting from the last checkpoint (%d/%d)", e, restarts + 1, cfg.run.max_restarts)
    raise AssertionError("unreachable")


def run_recipe(
    cfg: Config,
    inputs: Inputs,
    ckpt: Path | None,
    trainer_restarts: int,
    engine_restarts: RestartCount,
    earlier: EarlierRun,
) -> Path:
    """The recipe's steps, from `ckpt` (an intact checkpoint of this run) or from the start, replacing the `earlier`
    run in the directory."""
    state = load_state(ckpt) if ckpt else {"step": 0}
    start = state["step"]
    inputs.rewind()  # a checkpoint, if any, sets the position below
    with ExitStack() as stack:  # closed in reverse: rollout thread, tracker, reward workers, actors
        t0 = time.perf_counter()
        cluster = stack.enter_context(closing(Cluster(cfg, engine_restarts)))
        rollout = stack.enter_context(
            closing(RolloutManager(cfg, cluster, inputs.tokenizer, inputs.data, inputs.eval_data))
        )
        warm = cluster.warmup()
        compiled = f" (the engines compiled {len(warm)} programs)" if warm else ""
        log.info("actors ready in %.1f s%s", time.perf_counter() - t0, compiled)
        if ckpt:  # model, optimizer and RNG from the checkpoint; the engine gets those weights; same data order
            log.info("resuming from %s", ckpt)
            cluster.load(str(ckpt / "trainer"))
            if state["data"]:  # empty when --debug train-only replays saved rollouts: it draws no prompts
                inputs.data.load_state_dict(state["data"])
            cluster.sync_weights(version=start)
        # The run directory changes only now: a start that failed (a checkpoint the trainer cannot load, a cluster
        # that cannot host the run) leaves the run it was given as it was, config, metrics, report and checkpoints.
        if ckpt is None:
            earlier.replace()
        (cfg.run_dir / "config.yaml").write_text(to_yaml(cfg))
        (cfg.run_dir / "cluster.json").write_text(json.dumps(cluster.placement, indent=1))  # role -> Ray node id
        (cfg.run_dir / "warmup.json").write_text(json.dumps(warm, indent=1))
        tracker = stack.enter_context(Tracker(cfg, start))
        if evaluates(cfg, rollout) and start == 0:  # before any generation starts: the engines are the eval's alone
            tracker.log(0, rollout.evaluate())
        batches = stack.enter_context(closing(rollout_schedule(rollout, start)))  # a loop.mode, or a replay
        clock = StepClock()  # step 1's time starts here, after the step-0 evaluation
        ends = StepEnds(cfg, cluster, rollout, batches, tracker, clock, state.get("totals", {}), trainer_restarts)

        for step in range(start + 1, cfg.run.steps + 1):
            with clock.waiting():
                batch = batches.next(step)  # rollout + reward + advantages
            training = None
            if batch.samples is not None and cluster.trainers:  # none in --debug rollout-only
                with clock.queueing():
                    training = start_training(cfg, cluster, step, batch.samples, batches)  # train + sync
            else:  # nothing to train on: the weights stay as they are
                batches.trained(step, published=False)
            tracker.log_samples(step, batch.samples)  # while the trainer runs: the step's other_s, not its train_s
            ends.add(step, batch.metrics, training)  # eval + log + checkpoint (of the step before, in the async modes)
        ends.flush()
    return cfg.run_dir


def start_training(cfg: Config, cluster: Cluster, step: int, samples, batches: RolloutSchedule) -> Training:
    """Queue the step's training and the publication of its weights (in the same round trip to the trainer): the
    sync mode's engines load them when the step ends, the async modes' before (async) or while (fully_async) they
    generate. A step that applied no update (non-finite) publishes nothing, nor does --debug train-only (no engine).
    `batches` hears `trained(step, published)` as soon as the trainer is done, not a batch later when the driver
    waits for it (fully_async's producer may be waiting for those weights), or `training_failed(step, error)`, so
    that no generation waits for weights that will never come. Returns the wait for the step's metrics, which counts
    the driver's `queued` seconds as training."""
    training = cluster.start_train_step(
        samples.to_train_batch(), publish=step if cluster.engines else None, profile=profile_dir(cfg, step)
    )

    def heard(done) -> None:
        if done.exception() is None:
            batches.trained(step, done.result().published)
        else:
            batches.training_failed(step, done.exception())

    training.add_done_callback(heard)

    def wait(queued: float) -> dict[str, float]:
        t0 = time.perf_counter()
        result = training.result()
        metrics = result.metrics
        blocked = queued + time.perf_counter() - t0
        push_s = min(metrics.get("perf/push_s", 0.0), blocked)  # as far as the driver waited for it
        t1 = time.perf_counter()
        if result.published and not batches.overlapped:  # sync: the engines load the step's weights now
            metrics |= cluster.pull_weights()
        return metrics | {"perf/train_s": blocked - push_s, "perf/sync_s": push_s + time.perf_counter() - t1}

    return wait


def rollout_schedule(manager: RolloutManager, start: int = 0) -> RolloutSchedule:
    """The batch source of `loop.mode` for a run that has trained `start` steps, or of the saved rollouts in
    `run.replay` (--debug train-only)."""
    cfg = manager.cfg
    if cfg.run.replay is not None:
        return ReplayRollout(cfg.run.replay)
    if cfg.loop.mode == "async":
        return AsyncRollout(manager, start)
    if cfg.loop.mode == "fully_async":
        return FullyAsyncRollout(manager, start)
    return SyncRollout(manager)
