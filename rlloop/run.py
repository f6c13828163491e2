"""`python -m rlloop.run CONFIG.yaml [key.path=value ...] [--dry-run] [--resume] [--debug rollout-only|train-only]
[--replay RUN_DIR/rollouts]`: the user's entry point.

The same command runs locally and as a Ray job (`ray job submit --working-dir . -- python -m rlloop.run ...`). Exit
codes: 0 done; 1 an actor died, the cluster cannot host the plan, training stayed non-finite for train.max_bad_steps
steps, the reward function's workers cannot start, a checkpoint cannot be written or resumed, or the data no longer
fits the checkpoint being resumed; 2 bad config, model or data, found before anything starts (the message names the
key), or a run directory another run holds; 130 interrupted (Ctrl-C) and 143 terminated (SIGTERM), both after
cleaning up: continue with --resume, or, before the run's first checkpoint, start it again (the last line says which).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

from rlloop.config import Config, ConfigError, load_config, to_yaml
from rlloop.preflight import check_before_start, preflight
from rlloop.tracking import log_to_terminal

log = logging.getLogger("rlloop.run")  # not __name__: that is "__main__" under python -m


def error_label(e: Exception) -> str:
    """What the run calls an error it ends on: the first word of its one line."""
    from rlloop import errors
    from trainer import NonFiniteTraining

    labels = {
        ConfigError: "config",
        errors.RunDirInUse: "config",
        errors.ModelError: "model",
        errors.DataError: "data",
        errors.RewardError: "reward",
        errors.ClusterError: "cluster",
        errors.CheckpointError: "checkpoint",
        NonFiniteTraining: "training",
    }
    return next(label for kind, label in labels.items() if isinstance(e, kind))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rlloop.run", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="YAML recipe, e.g. examples/grpo_dapo.yaml")
    # default=[]: without it, parse_intermixed_args calls the overrides required when no argument is given
    p.add_argument("overrides", nargs="*", default=[], help="dotted overrides, e.g. train.lr=2e-6 rollout.group_size=4")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and placement plan, then exit")
    p.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")
    p.add_argument(
        "--debug",
        choices=["rollout-only", "train-only"],
        help="rollout-only: generate, score and save rollouts, no trainer; train-only: train on --replay, no engine",
    )
    p.add_argument("--replay", metavar="RUN_DIR/rollouts", help="the saved rollouts --debug train-only trains on")
    return p.parse_intermixed_args(argv)  # options may come before, between or after the overrides


def run_command(args: argparse.Namespace, resume: bool) -> str:
    """This run's command line, as a shell reads it back: the same config, overrides and debug mode. In a Ray job, the
    `ray job submit` that runs it again, from where the job was submitted (run where the job ran, the bare command
    would start a Ray of its own there)."""
    flags = [arg for k, v in (("debug", args.debug), ("replay", args.replay)) if v for arg in (f"--{k}", v)]
    command = ["python", "-m", "rlloop.run", args.config, *args.overrides, *flags, *["--resume"] * resume]
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ:
        runtime_env = dict(json.loads(os.environ["RAY_JOB_CONFIG_JSON_ENV_VAR"] or "{}").get("runtime_env") or {})
        uploaded = bool(runtime_env.pop("working_dir", None))  # Ray's copy's URI: the submitter's directory again
        rest = ["--runtime-env-json", json.dumps(runtime_env)] if runtime_env else []
        command = ["ray", "job", "submit", *["--working-dir", "."] * uploaded, *rest, "--", *command]
    return shlex.join(command)


def go_on(args: argparse.Namespace, run_dir: Path, earlier: frozenset) -> str:
    """What to run after this run stopped early: with --resume if it saved a checkpoint, without if not (a --resume
    would then start over, or load `earlier`: the checkpoints an earlier run left in its directory)."""
    from rlloop.checkpoint import checkpoint_marks

    if args.resume or checkpoint_marks(run_dir) - earlier:
        return f"continue with: {run_command(args, resume=True)}"
    return f"this run saved no checkpoint; start it again without --resume: {run_command(args, resume=False)}"


class Terminated(KeyboardInterrupt):
    """SIGTERM (`ray job stop`, a scheduler preempting the job, `kill`): unwound and cleaned up like Ctrl-C."""

    received = False  # what says it was SIGTERM once `ray.get` has turned the exception into a KeyboardInterrupt


def on_sigterm(advice: Callable[[], str], signum, frame):
    """Say what to run next before the cleanup, not after it: `ray job stop` kills the job 3 s after its SIGTERM
    (RAY_JOB_STOP_WAIT_TIME_S), before a cleanup waiting on actors that are still starting has ended. A second
    SIGTERM during that cleanup is let be: raised again, it would cut the cleanup short."""
    if Terminated.received:
        return
    Terminated.received = True
    print(f"\nterminated; {advice()}", file=sys.stderr, flush=True)
    raise Terminated()


def stopped_by(e: BaseException) -> str | None:
    """How `e` stopped the run: "terminated" (SIGTERM) or "interrupted" (Ctrl-C); None for an exit to let through.
    While `ray.init` runs, Ray's own SIGTERM handler is in place: it exits with SystemExit(15)."""
    if isinstance(e, SystemExit):
        return "terminated" if e.code == signal.SIGTERM else None
    return "terminated" if isinstance(e, Terminated) or Terminated.received else "interrupted"


def debug_overrides(args: argparse.Namespace) -> list[str]:
    """--debug / --replay are spellings of run.debug / run.replay."""
    out = [f"run.debug={args.debug}"] if args.debug else []
    return out + ([f"run.replay={os.path.abspath(args.replay)}"] if args.replay else [])


def dry_run(cfg: Config, notes: list[str] = ()) -> None:
    from rlloop.placement import plan_placement, plan_settings
    from rlloop.ray_session import local_ray

    print(to_yaml(cfg), end="")
    print("\n".join(f"# {note}" for note in notes or ["model, tokenizer and data: checked"]))
    print(f"# run directory: {cfg.run_dir}")
    plan = plan_placement(cfg.cluster, same_host=cfg.sync.transport == "shm")
    parallel = cfg.train_parallel if cfg.cluster.train_chips > 1 else "one"
    print(
        f"# rollout: {cfg.cluster.rollout_chips} {cfg.cluster.device} chip(s) in {cfg.cluster.rollout_engines} "
        f"{cfg.rollout.backend} engine(s); trainer: {cfg.cluster.train_chips} rank(s) ({parallel}); "
        f"loop: {cfg.loop.mode}"
    )
    print("\n".join("# " + line for line in plan.describe().splitlines()))
    if cfg.cluster.use_ray and cfg.cluster.device == "cpu" and local_ray(cfg):  # the Ray the run would start here
        cores = len(os.sched_getaffinity(0))
        need = plan.total().get("CPU", 0.0)
        fits = (
            "holds it"
            if need <= cores
            else f"cannot hold it: the run would stop at the start. {plan_settings(cfg.cluster)}"
        )
        print(f"# a local Ray on this host ({cores} CPUs; the plan needs {need:g}) {fits}")
    elif cfg.cluster.use_ray:  # a dry run starts no Ray and joins none
        where = "the cluster it joins" if not local_ray(cfg) else f"this host's {cfg.cluster.device} chips"
        print(f"# not checked against {where}: the run waits cluster.placement_timeout_s for what the plan asks")
    from rlloop.memory import plan_memory

    memory = plan_memory(cfg)
    if memory is None:
        print(f"# memory plan: no config.json of {cfg.model.path} here (download the model to see it)")
    else:
        print("\n".join("# " + line for line in memory.describe().splitlines()))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_to_terminal()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from rlloop import errors

    # Config, reward, model and data problems end here, exit 2, before the run directory, Ray or any actor exists:
    # nothing is written, and no checkpoint of a run being resumed is touched.
    try:
        cfg = load_config(args.config, args.overrides + debug_overrides(args))
        check_before_start(cfg)
        inputs, notes = preflight(cfg, dry_run=args.dry_run)
    except (ConfigError, errors.ModelError, errors.DataError) as e:
        print(f"{error_label(e)} error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        dry_run(cfg, notes)
        return 0

    from rlloop.checkpoint import checkpoint_marks, newest_checkpoint
    from rlloop.loop import train
    from trainer import NonFiniteTraining

    log.info("%s: model, tokenizer and data checked; %d steps into %s", cfg.run.name, cfg.run.steps, cfg.run_dir)
    earlier = checkpoint_marks(cfg.run_dir)  # an earlier run's, which this one replaces at its first save
    Terminated.received = False
    before = signal.signal(signal.SIGTERM, partial(on_sigterm, lambda: go_on(args, cfg.run_dir, earlier)))
    try:
        run_dir = train(cfg, resume=args.resume, inputs=inputs)
    # Data errors here: other data than the checkpoint's, lost replays
    except errors.RunDirInUse as e:  # nothing was started or written
        print(f"{error_label(e)} error: {e}", file=sys.stderr)
        return 2
    except (errors.ClusterError, errors.CheckpointError, errors.DataError, NonFiniteTraining, errors.RewardError) as e:
        advice = (
            f"\n{go_on(args, cfg.run_dir, earlier)}" if isinstance(e, (errors.ActorDied, errors.RewardError)) else ""
        )
        print(f"{error_label(e)} error: {e}{advice}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, SystemExit) as e:
        if (what := stopped_by(e)) is None:
            raise
        if not (what == "terminated" and Terminated.received):  # else on_sigterm said it
            print(f"\n{what}; {go_on(args, cfg.run_dir, earlier)}", file=sys.stderr)
        return 143 if what == "terminated" else 130
    finally:  # the run is over: a SIGTERM now is not its to explain
        signal.signal(signal.SIGTERM, before)
    # those there are: a --resume with no step left to train writes nothing, and a killed run wrote no report
    written = [name for name in ("metrics.jsonl", "curves.png", "report.md") if (run_dir / name).exists()]
    print(f"done: {run_dir}/{', '.join(written)}" if written else f"done: nothing in {run_dir}")
    if cfg.run.debug != "rollout-only":  # this run's last checkpoint, or the one it resumed from
        newest = newest_checkpoint(run_dir) if args.resume or checkpoint_marks(run_dir) - earlier else None
        where = newest / "trainer" if newest else "not saved (run.save_every=0)"
        print(f"the trained policy, as of the last checkpoint (a transformers model directory): {where}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C before the run's own handler (checks, imports): a traceback said nothing more
        print("\ninterrupted before the run started: nothing was written", file=sys.stderr)
        sys.exit(130)
