"""The driver's checks before anything starts: a bad input ends the run there, exit 2, in one line naming its key,
file, row or line (`rlloop.run` prints it).

What they check: the reward function imports; the paths the run reads can be looked up, and the run directory (and a
disk sync directory) can be made, and are absolute in a Ray job; W&B has its package and, online, credentials; the
memory plan fits each rollout chip and trainer rank; a --debug train-only replay has the rollouts of every step; then
the model (config.json and file list, no weights), the tokenizer and every data row.

Why before anything starts: the run directory, Ray and the actors do not exist yet, so a bad input costs one message
instead of a failure once Ray and the actors are up, and nothing is written (a --resume with a bad input leaves the
checkpoints of the run it resumes untouched). Every run and every restart pays what these checks import, so each
imports its modules inside it (importing this file loads no torch), and the config checks load no JAX
(tests/test_layering.py).
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import tempfile
from pathlib import Path

from rlloop.config import Config, ConfigError
from rlloop.config_errors import path_errors
from rlloop.data import Inputs


def ray_job_cwd() -> str | None:
    """When this process is a `ray job submit` entrypoint: what its working directory is, which a relative path
    would be under (not the submitter's); else None."""
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" not in os.environ:
        return None
    job = json.loads(os.environ["RAY_JOB_CONFIG_JSON_ENV_VAR"] or "{}")
    if job.get("runtime_env", {}).get("working_dir"):
        return f"Ray's temporary copy of its working_dir ({os.getcwd()}), which Ray deletes"
    return f"the job's working directory on the Ray head ({os.getcwd()}), not the submitter's"


def can_make_dirs_in(directory: Path) -> bool:
    """Whether a directory can be made in `directory`, tried (and undone): permission bits say yes to root anywhere,
    /proc and read-only mounts included."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".rlloop-probe-", dir=directory))
    except OSError:
        return False
    return True


def check_makeable(key: str, directory: Path) -> None:
    """ConfigError naming `key` unless `directory` exists or can be made: its nearest existing parent must be a
    directory this process can make directories in, and no part still to be made longer than its file system allows."""
    with path_errors(key, directory):
        nearest = next(p for p in [directory, *directory.parents] if p.exists())  # "." for a relative one
        if not nearest.is_dir() or not can_make_dirs_in(nearest):
            raise ConfigError(f"{key} {directory} cannot be made there: {nearest} is not a directory it can write to")
        longest = max(len(os.fsencode(part)) for part in directory.relative_to(nearest).parts or ("",))
        if longest > os.pathconf(nearest, "PC_NAME_MAX"):  # what mkdir would answer, once the run had started
            raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG))


def check_wandb(cfg: Config) -> None:
    """tracking.wandb needs the wandb package, and W&B online (tracking.mode online, or auto where a key is
    configured) usable credentials; without either the run failed once Ray and the actors were up.
    `tracking.wandb_api_key` reads, with no network and no prompt, the key W&B would use (WANDB_API_KEY, the ~/.netrc
    entry `wandb login` writes). Offline or disabled (auto follows WANDB_MODE where it is set) needs none."""
    from rlloop.tracking import wandb_api_key, wandb_key_problem, wandb_mode

    t = cfg.tracking
    if not t.wandb or wandb_mode(t.mode) == "disabled":
        return
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("tracking.wandb: true needs the wandb package (pip install wandb)")
    if wandb_mode(t.mode) != "online":
        return
    advice = "run `wandb login`, set WANDB_API_KEY, or set tracking.mode=offline (upload later with `wandb sync`)"
    key = wandb_api_key()
    if key and (problem := wandb_key_problem(key)):
        raise ConfigError(f"tracking.mode={t.mode}: W&B cannot use its credentials: {problem}; {advice}")
    if not key:  # online set, or auto under WANDB_MODE=online
        raise ConfigError(f"tracking.mode={t.mode}: W&B goes online and has no API key configured; {advice}")


def check_before_start(cfg: Config) -> None:
    """What the config points at, checked before anything heavy starts and reported as config errors (exit 2): the
    reward function, the directories, W&B's credentials, the memory plan, the rollouts a replay trains on."""
    from rlloop.rewards import resolve

    try:
        resolve(cfg.reward.fn)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_paths(cfg)
    check_wandb(cfg)
    from rlloop.memory import plan_memory

    memory = plan_memory(cfg)
    if memory is not None:
        memory.check()
    if cfg.run.replay is not None:
        check_replay(cfg.run.replay, cfg.run.steps)
    check_debug_run_dir(cfg)


def check_debug_run_dir(cfg: Config) -> None:
    """The debug modes against what the run directory holds. --debug rollout-only samples from model.path, and with
    a trained run's checkpoints in its directory replaced that run's metrics (a --resume of either then mixed the
    two); a replay from the directory's rollouts.earlier/ is what a run starting there replaces."""
    from rlloop.checkpoint import newest_checkpoint
    from rlloop.run_dir import EARLIER_ROLLOUTS

    if cfg.run.debug == "rollout-only" and (newest := newest_checkpoint(cfg.run_dir)):
        raise ConfigError(
            f"run.dir: {cfg.run_dir} holds a trained run's checkpoints, and --debug rollout-only samples from "
            f"model.path: give it another run.dir (to sample from the trained policy, model.path={newest / 'trainer'})"
        )
    earlier = (cfg.run_dir / EARLIER_ROLLOUTS).resolve()
    if cfg.run.replay is not None and Path(cfg.run.replay).resolve().is_relative_to(earlier):
        raise ConfigError(
            f"run.replay: {cfg.run.replay} is in run.dir's {EARLIER_ROLLOUTS}/, which a run starting in {cfg.run_dir} "
            "replaces: give the run another run.dir, or copy the rollouts elsewhere first"
        )


def check_paths(cfg: Config) -> None:
    """The paths the run reads can be looked up; the run directory and a disk sync directory can be made, and are
    absolute in a Ray job."""
    read = {"model.path": cfg.model.path, "model.tokenizer": cfg.model.tokenizer, "data.path": cfg.data.path}
    for key, path in (read | {"eval.path": cfg.eval.path, "run.replay": cfg.run.replay}).items():
        if path is not None:
            with path_errors(key, path):
                Path(path).exists()  # a hub id is a path that does not exist
    check_makeable("run.dir", cfg.run_dir)
    if cfg.sync.transport == "disk" and cfg.sync.dir is not None:  # else <run dir>/sync
        check_makeable("sync.dir", Path(cfg.sync.dir))
    relative = {"run.dir": cfg.run.dir, "sync.dir": cfg.sync.dir if cfg.sync.transport == "disk" else None}
    for key, path in relative.items():
        if path is not None and not Path(path).is_absolute() and (cwd := ray_job_cwd()):
            raise ConfigError(
                f"{key} {path!r} is relative, and this Ray job runs in {cwd}: what is written there is lost or "
                f"misplaced (checkpoints, and a --resume would start over). Give an absolute path on storage that "
                f"lasts (and that every node sees, on several nodes), e.g. {key}=/mnt/runs/{{name}}"
                + ("/sync" if key == "sync.dir" else "")
            )


def check_replay(replay: str, steps: int) -> None:
    """--debug train-only: the saved rollouts of every step it is to train."""
    from rlloop.replay import rollouts_file

    if not Path(replay).is_dir():
        raise ConfigError(f"run.replay: {replay} is not a directory (a run's rollouts/, saved by it)")
    missing = [s for s in range(1, steps + 1) if not rollouts_file(replay, s).is_file()]
    if missing:
        raise ConfigError(
            f"run.replay: {replay} has no rollouts of step {missing[0]}"
            f"{f' (nor of {len(missing) - 1} more)' if len(missing) > 1 else ''}; run.steps={steps} can "
            "train only the steps the run saved"
        )


def preflight(cfg: Config, dry_run: bool = False) -> tuple[Inputs | None, list[str]]:
    """Check the model (config.json and file list: no weights), tokenizer and every data row from the driver,
    before a run directory, Ray or an actor exists: ModelError / DataError. Returns the loaded inputs, which the loop
    then uses, and notes on what a dry run skipped (it checks only what is on this machine: it downloads nothing)."""
    from rlloop import data, data_files, model

    sources = {"model.path": cfg.model.path, "model.tokenizer": cfg.model.tokenizer or cfg.model.path}
    remote = [key for key, src in sources.items() if not model.is_local(src)]
    if dry_run and remote:
        return None, [f"{', '.join(remote)} not checked: a hub id (a dry run downloads nothing)"]
    model.check_model(cfg)
    paths = {"data.path": cfg.data.path, "eval.path": cfg.eval.path}
    remote = [key for key, src in paths.items() if src and not data_files.is_local(src)]
    if dry_run and remote:
        model.check_stop_ids(cfg, model.load_tokenizer(cfg.model))
        return None, [f"{', '.join(remote)} not checked: a hub dataset (a dry run downloads nothing)"]
    return data.load_inputs(cfg), []
