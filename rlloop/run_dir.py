"""The run directory as a run holds it: one run at a time (an flock), the checkpoint a run starts from, checked
against it, and a resumed run's settings compared with those it was started with (its config.yaml)."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

from rlloop.checkpoint import EARLIER, checkpoint_marks, latest_checkpoint, load_state, set_aside_earlier
from rlloop.config import Config, to_yaml
from rlloop.data import Inputs
from rlloop.errors import CheckpointError, RunDirInUse
from rlloop.model import read_model_config

log = logging.getLogger(__name__)


@contextmanager
def run_dir_held(run_dir: Path):
    """The run directory for this process alone while it runs: a second run started into it (a --debug run, the same
    command in another terminal) replaced the first one's metrics, report and checkpoints as both went on. An flock
    on the directory itself: nothing is written into it (a refused start leaves the run as it was), and a killed run
    holds nothing."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirInUse(
                f"run.dir: {run_dir} is in use by another run: let it finish, or give this one another run.dir or "
                "run.name"
            ) from None
        yield
    finally:
        os.close(fd)


EARLIER_ROLLOUTS = "rollouts.earlier"  # an earlier run's saved rollouts: the run whose checkpoints are in EARLIER


@dataclass
class EarlierRun:
    """What an earlier run left in `run.dir`, which a run starting there from step 0 replaces once its actors are up
    (a start that fails leaves the directory as it was): its checkpoints (`checkpoint_marks`; none with --resume) go
    to checkpoints.earlier/ until this run's first save, its saved rollouts to rollouts.earlier/, and its profiler
    traces, report and curves go, as its metrics do. Left in place, a replay of rollouts/ trained on steps of both
    runs (a run rewrites only the steps it reaches), and the report described the earlier run."""

    run_dir: Path
    checkpoints: frozenset
    replay: Path | None  # the rollouts a --debug train-only run trains on: they stay where they are
    outputs_replaced: bool = False  # once per driver: a rebuild from step 0 must not move this run's own aside

    def replace(self) -> None:
        had_checkpoints = set_aside_earlier(self.run_dir)
        if self.outputs_replaced:
            return
        self.outputs_replaced = True
        rollouts, aside = self.run_dir / "rollouts", self.run_dir / EARLIER_ROLLOUTS
        if rollouts.is_dir() and any(rollouts.iterdir()) and rollouts.resolve() != self.replay:
            if (self.run_dir / EARLIER).is_dir() and not had_checkpoints:
                # a run that saved no checkpoint since the one in checkpoints.earlier/: rollouts.earlier/ is that one's
                shutil.rmtree(rollouts)
            else:
                shutil.rmtree(aside, ignore_errors=True)
                rollouts.rename(aside)
                log.warning("moved the earlier run's saved rollouts to %s", aside)
        shutil.rmtree(self.run_dir / "profile", ignore_errors=True)
        for name in ("report.md", "curves.png"):
            (self.run_dir / name).unlink(missing_ok=True)


def earlier_run(cfg: Config, resume: bool) -> EarlierRun:
    """The earlier run in `run.dir`, with a warning when it holds checkpoints (none are its with --resume)."""
    inherited = frozenset() if resume else checkpoint_marks(cfg.run_dir)
    if inherited:
        log.warning(
            "%s holds an earlier run (checkpoints %s); this one starts from step 0 and replaces it: its metrics, "
            "saved rollouts (moved to %s/), traces and report at once, its checkpoints at this run's first save "
            "(kept in checkpoints.earlier/ until then). To continue it instead, add --resume",
            cfg.run_dir,
            ", ".join(sorted(name for name, _, _ in inherited)),
            EARLIER_ROLLOUTS,
        )
    return EarlierRun(cfg.run_dir, inherited, Path(cfg.run.replay).resolve() if cfg.run.replay else None)


def resume_point(cfg: Config, resume: bool, inputs: Inputs) -> tuple[Path | None, dict]:
    """The checkpoint a run starts from (None: step 0) and its loop state. Other data or another trainer layout than
    the checkpoint's is refused here, before Ray or any actor starts; --resume names the settings that changed."""
    ckpt = latest_checkpoint(cfg.run_dir) if resume else None
    if ckpt is None:
        if resume:
            earlier = cfg.run_dir / EARLIER
            aside = f" (an earlier run's are in {earlier}: move it to checkpoints/ to go on with that run)"
            log.warning(
                "--resume: %s holds no checkpoint%s; the run starts from step 0",
                cfg.run_dir / "checkpoints",
                aside if earlier.is_dir() else "",
            )
        return None, {"step": 0}
    state = load_state(ckpt)
    if state.get("data"):
        inputs.data.load_state_dict(state["data"])  # refuses a position in other data (the loop loads it again)
    if (written := state.get("train_parallel", cfg.train_parallel)) != cfg.train_parallel:
        # One rank trains the plain model whatever train.parallel says: an fsdp checkpoint needs 2 or more
        fix = "cluster.train_chips >= 2" if cfg.cluster.train_chips == 1 else f"train.parallel={written}"
        raise CheckpointError(
            f"{ckpt} was trained with train.parallel={written}, and this run's trainer is {cfg.train_parallel} "
            f"(train.parallel={cfg.train.parallel} over cluster.train_chips={cfg.cluster.train_chips}): its optimizer "
            f"state does not load across the two; resume with {fix}"
        )
    _same_model_shape(cfg, ckpt)
    warn_of_changes(cfg)
    return ckpt, state


# What makes one model's weights and optimizer state load into another
SHAPE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)


def _same_model_shape(cfg: Config, ckpt: Path) -> None:
    """A checkpoint of another model than `model.path`: refused now, not once the actors are up, in the trainer's
    words (a missing parameter, or torch's optimizer "parameter group that doesn't match")."""
    saved = ckpt / "trainer" / "config.json"
    if not saved.is_file():
        return
    was, (now, _) = json.loads(saved.read_text()), read_model_config(cfg.model)
    # keys both name: transformers writes every key into a saved model's config.json, an original may leave some out
    differ = [f"{k} {was[k]} -> {now[k]}" for k in SHAPE_KEYS if k in was and k in now and was[k] != now[k]]
    if differ:
        raise CheckpointError(
            f"model.path: {cfg.model.path} is not the model {ckpt} trained ({'; '.join(differ)}): resume with the "
            "run's model.path, or start a new run (another run.dir)"
        )


def warn_of_changes(cfg: Config) -> None:
    """A resumed run's settings that differ from those it was started with (its config.yaml), each named."""
    saved = cfg.run_dir / "config.yaml"
    if not saved.is_file():
        return
    was = yaml.safe_load(saved.read_text())
    if not isinstance(was, dict):
        return
    was, now = _flat(was), _flat(yaml.safe_load(to_yaml(cfg)))
    changed = [
        f"{key}: {was.get(key)} -> {now.get(key)}"
        for key in sorted(was.keys() | now.keys())
        if _in_job_copy(was.get(key)) != _in_job_copy(now.get(key))
    ]
    if cfg.train.lr_decay != "constant" and was.get("run.steps") != cfg.run.steps:
        changed.append(f"(train.lr_decay {cfg.train.lr_decay} decays over the new run.steps from here: lr moves)")
    if changed:
        log.warning("--resume with settings other than the run's (%s): %s", saved, "; ".join(changed))


# A path in Ray's unpacked copy of a job's working_dir: each job (a resumed one too) gets a copy of its own
RAY_JOB_COPY = re.compile(r"^.*/runtime_resources/working_dir_files/_ray_pkg_[0-9a-f]+/")


def _in_job_copy(value):
    """`value`, a path in a Ray job's copy of its working_dir as the same path in any such copy."""
    return RAY_JOB_COPY.sub("<working_dir>/", value) if isinstance(value, str) else value


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out
