"""The GRPO loop, read top to bottom like the recipe:
data -> rollout -> reward -> advantages -> train -> sync -> log -> checkpoint.

Everything clever lives behind these calls: generation and scoring in `rlloop/rollout_manager.py` (the compiled
decoder itself in `rollout/`), the loss in `trainer/`, the transports in `weight_sync/`, placement in
`rlloop/cluster.py` and `rlloop/placement.py`.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import ExitStack, closing
from functools import partial
from pathlib import Path

from rlloop.checkpoint import checkpoint_marks, latest_checkpoint, load_state, save_checkpoint
from rlloop.cluster import Cluster
from rlloop.config import Config, to_yaml
from rlloop.data import Inputs, load_inputs
from rlloop.engine_pool import RestartCount
from rlloop.errors import CheckpointError, TrainerDied
from rlloop.profiling import profile_dir
from rlloop.ray_session import ray_session
from rlloop.rollout_manager import RolloutManager
from rlloop.run_dir import run_dir_held, warn_of_changes
from rlloop.schedules import rollout_schedule
from rlloop.step_clock import StepClock, step_overhead
from rlloop.tracking import Tracker

log = logging.getLogger(__name__)

# Running totals kept by the cluster, the reward scorer and the rollout schedule, which a resume or a rebuild after a
# trainer's death makes anew: each is logged as the checkpoint's figure (the run's, up to the step it continues from)
# plus the new one's. (data/dropped_prompts comes back with the data's own state; train/restarts and
# rollout/engine_restarts are counted by `train` across the clusters it rebuilds.)
RUN_TOTALS = (
    "rollout/reward_failures",
    "rollout/reward_timeouts",
    "rollout/stale_groups_dropped",
    "rollout/zero_std_groups_dropped",
    "sync/refused",
    "sync/keyframe_requests",
)


def train(cfg: Config, resume: bool = False, inputs: Inputs | None = None) -> Path:
    """Run (or with `resume`, continue) the recipe on `inputs` (loaded and checked here unless the caller has).
    A trainer rank that dies costs a rebuild of the cluster from the run's last checkpoint (from the start before
    its first), with the same data order, up to `run.max_restarts` times (engines heal in place)."""
    inputs = inputs or load_inputs(cfg)
    with run_dir_held(cfg.run_dir):
        return _train(cfg, resume, inputs)


def _train(cfg: Config, resume: bool, inputs: Inputs) -> Path:
    # A fresh run in a directory that holds an earlier run's checkpoints leaves them until its first save; a rebuild
    # before then starts over, not from the earlier run's step.
    inherited = frozenset() if resume else checkpoint_marks(cfg.run_dir)
    if inherited:
        log.warning(
            "%s holds an earlier run (checkpoints %s); this one starts from step 0 and replaces it: its metrics now, "
            "its checkpoints at this run's first save. To continue it instead, add --resume",
            cfg.run_dir,
            ", ".join(sorted(name for name, _, _ in inherited)),
        )
    ckpt = latest_checkpoint(cfg.run_dir) if resume else None
    resumed = load_state(ckpt) if ckpt else {"step": 0}
    # Other data or another trainer layout than the checkpoint's: refused now, before Ray or any actor starts
    if resumed.get("data"):
        inputs.data.load_state_dict(resumed["data"])
    if (written := resumed.get("train_parallel", cfg.train_parallel)) != cfg.train_parallel:
        # One rank trains the plain model whatever train.parallel says: an fsdp checkpoint needs 2 or more
        fix = "cluster.train_chips >= 2" if cfg.cluster.train_chips == 1 else f"train.parallel={written}"
        raise CheckpointError(
            f"{ckpt} was trained with train.parallel={written}, and this run's trainer is {cfg.train_parallel} "
            f"(train.parallel={cfg.train.parallel} over cluster.train_chips={cfg.cluster.train_chips}): its optimizer "
            f"state does not load across the two; resume with {fix}"
        )
    if resume and ckpt:
        warn_of_changes(cfg)
    if resume and not checkpoint_marks(cfg.run_dir):
        log.warning("--resume: %s holds no checkpoint; the run starts from step 0", cfg.run_dir / "checkpoints")
    elif resume and resumed["step"] >= cfg.run.steps:
        log.warning("--resume: the run is at step %d, run.steps=%d: nothing to train", resumed["step"], cfg.run.steps)
        return cfg.run_dir
    before = resumed.get("totals", {}).get("train/restarts", 0)  # the earlier drivers', as of that checkpoint
    # Engines healed in place: counted across the clusters rebuilt below (an engine's restart before a trainer's
    # death happened, even if the steps after the checkpoint are trained again), and bounded by run.max_restarts
    engines = RestartCount(before=int(resumed.get("totals", {}).get("rollout/engine_restarts", 0)))
    with ray_session(cfg):  # a rebuilt cluster's actors start in the same Ray
        for restarts in range(cfg.run.max_restarts + 1):
            if restarts:  # from the run's last checkpoint: not an earlier run's left in its directory
                own = resume or bool(checkpoint_marks(cfg.run_dir) - inherited)
                ckpt = latest_checkpoint(cfg.run_dir) if own else None
            try:
                return run_recipe(cfg, inputs, ckpt, trainer_restarts=before + restarts, engine_restarts=engines)
            except TrainerDied as e:
                if restarts == cfg.run.max_restarts:
                    raise TrainerDied(f"{e}\n(run.max_restarts={cfg.run.max_restarts} spent)") from None
                log.warning("%s\nrestarting from the last checkpoint (%d/%d)", e, restarts + 1, cfg.run.max_restarts)
    raise AssertionError("unreachable")


def save_model(cluster: Cluster, tokenizer, path: str) -> None:
    """The trainer's state, and next to its model the run's tokenizer: a checkpoint's trainer/ is a model directory
    that `model.path` (or transformers) loads as it is."""
    cluster.save(path)
    tokenizer.save_pretrained(path)


def run_recipe(
    cfg: Config,
    inputs: Inputs,
    ckpt: Path | None,
    trainer_restarts: int,
    engine_restarts: RestartCount,
) -> Path:
    """The recipe's steps, from `ckpt` (an intact checkpoint of this run) or from the start."""
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    tokenizer, data, eval_data = inputs.tokenizer, inputs.data, inputs.eval_data
    inputs.rewind()  # a checkpoint, if any, sets the position below
    state = load_state(ckpt) if ckpt else {"step": 0}
    start = state["step"]
    with ExitStack() as stack:  # closed in reverse: rollout thread, tracker, reward workers, cluster (actors, Ray)
        t0 = time.perf_counter()
        cluster = stack.enter_context(closing(Cluster(cfg, engine_restarts)))
        rollout = stack.enter_context(closing(RolloutManager(cfg, cluster, tokenizer, data, eval_data)))
        warm = cluster.warmup()
        compiled = f" (the engines compiled {len(warm)} programs)" if warm else ""
        log.info("actors ready in %.1f s%s", time.perf_counter() - t0, compiled)
        if ckpt:  # model, optimizer and RNG from the checkpoint; the engine gets those weights; same data order
            log.info("resuming from %s", ckpt)
            cluster.load(str(ckpt / "trainer"))
            if state["data"]:  # empty when --debug train-only replays saved rollouts: it draws no prompts
                data.load_state_dict(state["data"])
            cluster.sync_weights(version=start)
        # The run directory changes only now: a start that failed (a checkpoint the trainer cannot load, a cluster
        # that cannot host the run) leaves the run it was given as it was, config, metrics and report.
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        (run_dir / "cluster.json").write_text(json.dumps(cluster.placement, indent=1))  # role -> Ray node id
        (run_dir / "warmup.json").write_text(json.dumps(warm, indent=1))
        tracker = stack.enter_context(Tracker(cfg, start))
        evaluating = eval_data is not None and cfg.run.eval_every > 0 and bool(cluster.engines)
        if evaluating and start == 0:
            tracker.log(0, rollout.evaluate())
        # sync | async | fully_async, or the saved rollouts of --debug train-only
        batches = stack.enter_context(closing(rollout_schedule(cfg.loop, rollout, cfg.run.replay, start)))

        clock = StepClock()
        totals = dict(state.get("totals", {}))  # RUN_TOTALS as of the checkpoint, then as last logged
        carried = dict(totals)

        def finish(step: int, metrics: dict, training) -> None:
            """Wait for the step's training, then evaluate, log and checkpoint it. Its times are the driver's since the
            step before ended (`clock`): in the async modes they hold the wait for the next batch and the queueing of
            the next training."""
            if training is not None:
                metrics |= training(clock.queued)
            if cfg.loop.mode != "sync":  # the engines generate while the trainer trains: what the driver waited
                metrics["perf/rollout_wait_s"] = clock.waited
            if evaluating and cfg.run.evals_at(step):
                t0 = time.perf_counter()
                # fully_async's producer starts no chunk meanwhile; async's step + 1 (older weights) is done first
                with batches.paused():
                    if cfg.loop.mode != "sync":  # the engines finish the generation under way: that wait is not eval
                        cluster.pull_weights()
                        metrics["perf/rollout_wait_s"] += time.perf_counter() - t0
                        t0 = time.perf_counter()
                    metrics |= rollout.evaluate() | {"perf/eval_s": time.perf_counter() - t0}
            metrics |= {"perf/step_s": clock.elapsed(), "train/restarts": trainer_restarts}
            metrics |= step_overhead(metrics)
            metrics |= rollout.counters()
            for key in RUN_TOTALS:
                if key in metrics:
                    metrics[key] = totals[key] = metrics[key] + carried.get(key, 0)
            tracker.log(step, metrics)
            if cluster.trainers and cfg.run.saves_at(step):
                restarts = {"train/restarts": trainer_restarts, "rollout/engine_restarts": cluster.restarts}
                loop_state = {
                    "data": batches.resume_state(),
                    "totals": totals | restarts,
                    "train_parallel": cfg.train_parallel,
                }
                save_trainer = partial(save_model, cluster, tokenizer)
                save_checkpoint(run_dir, step, loop_state, save_trainer, keep=cfg.run.keep_checkpoints)
            clock.restart()

        # In the async modes step k + 1's training is queued behind step k's before step k is finished, so the
        # trainer goes from one to the next without waiting for the driver (not past an eval or a checkpoint).
        pending = None  # (step, metrics, training) of a step not yet finished
        for step in range(start + 1, cfg.run.steps + 1):
            with clock.waiting():
                batch = batches.next(step)  # rollout + reward + advantages
            training = None
            if batch.samples is not None and cluster.trainers:  # none in --debug rollout-only
                with clock.queueing():
                    training = start_training(cfg, cluster, step, batch.samples, batches)
            # While the trainer runs; the driver's time here is the step's other_s, not its train_s
            tracker.log_samples(step, batch.samples)  # tracking.save_rollouts, W&B sample tables
            if training is None:  # nothing to train on: the weights stay as they are
                batches.trained(step, published=False)
            if pending:
                finish(*pending)
            pending = (step, batch.metrics, training)
            if cfg.loop.mode == "sync" or cfg.run.saves_at(step) or (evaluating and cfg.run.evals_at(step)):
                finish(*pending)
                pending = None
        if pending:
            finish(*pending)
    return run_dir


def start_training(cfg: Config, cluster: Cluster, step: int, samples, batches):
    """Queue the step's training and the publication of its weights (in the trainer's same round trip): the sync
    mode's engines load them now, the async modes' before (async) or while (fully_async) they generate. A step that
    applied no update (non-finite) publishes nothing, nor does --debug train-only, which has no engine.
    The rollout schedule `batches` hears `trained(step, published)` as soon as the trainer is done, not once the
    driver, a batch later, waits for the step: fully_async's producer may be waiting for those weights to start a
    chunk. A step whose training failed is not `trained`: no generation is released by it (the next one found a dead
    engine and spent a restart on it while the trainer's death was still being found); the schedule hears
    `training_failed(step, error)`, so that a driver waiting on it for a batch gets the error (fully_async at
    max_staleness 0 waited for ever, for weights that would never come).
    Returns the wait for the step's metrics, which counts `queued` seconds of the driver's in queueing as training."""
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
        if result.published and cfg.loop.mode == "sync":
            metrics |= cluster.pull_weights()
        return metrics | {"perf/train_s": blocked - push_s, "perf/sync_s": push_s + time.perf_counter() - t1}

    return wait
