"""Run checkpoints: `<run dir>/checkpoints/step_NNNNNN/` holding the trainer's state (`trainer/`: model, optimizer,
RNG) and the loop's (`state.json`: step, data position, weight version). Written under a temporary name and renamed,
so a crash mid-save leaves the previous checkpoint as the latest; the newest `keep` are kept."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

PREFIX = "step_"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"{PREFIX}{step:06d}"


def latest_checkpoint(run_dir: Path) -> Path | None:
    root = Path(run_dir) / "checkpoints"
    done = sorted(p for p in root.glob(f"{PREFIX}*") if p.name[len(PREFIX) :].isdigit() and (p / "state.json").exists())
    return done[-1] if done else None


def save_checkpoint(run_dir: Path, step: int, state: dict, save_trainer, keep: int = 2) -> Path:
    """`save_trainer(path)` writes the trainer's state into `path`; `state` is the loop's (JSON)."""
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "trainer").mkdir(parents=True)
    save_trainer(str(tmp / "trainer"))
    (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in sorted(final.parent.glob(f"{PREFIX}*"))[:-keep]:
        if not old.name.endswith(".tmp"):
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_state(ckpt: Path) -> dict:
    return json.loads((Path(ckpt) / "state.json").read_text())
