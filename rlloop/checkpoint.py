"""Run checkpoints: `<run dir>/checkpoints/step_NNNNNN/` holding the trainer's state (`trainer/`: HF model, optimizer,
RNG, fsdp shards) and the loop's (`state.json`: step, data position).

A checkpoint is written under a temporary name and renamed, with `manifest.json` (every file's size and xxh3) and
then `state.json` last, so a crash or a full disk mid-save leaves the previous checkpoint as the latest. Resuming
verifies the newest checkpoint against its manifest and falls back, saying so, to the newest intact one: a flipped
byte or a missing file is never loaded. The newest `keep` are kept; checkpoints numbered past the step being saved
belong to an earlier run in this directory (a fresh run restarted it) and are removed.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import xxhash

from rlloop.errors import TrainerDied

PREFIX = "step_"
MANIFEST = "manifest.json"
log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (the previous one is intact) or no intact one is left to resume from."""


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"{PREFIX}{step:06d}"


def _completed(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    done = [p for p in root.glob(f"{PREFIX}*") if p.name[len(PREFIX) :].isdigit() and (p / "state.json").exists()]
    return sorted(done, key=lambda p: int(p.name[len(PREFIX) :]))  # step_1000000 after step_999999


def _remove(ckpt: Path) -> None:
    """Delete a checkpoint: renamed out of `_completed`'s sight first, so that a removal killed half-way never leaves
    a state.json without its manifest, which `verify` would take for an old, unverifiable checkpoint."""
    doomed = ckpt.with_name(ckpt.name + ".removing")
    shutil.rmtree(doomed, ignore_errors=True)  # left by a removal killed before (a rename onto it would fail)
    if ckpt.exists():
        ckpt.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _file_digest(path: Path) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _manifest(ckpt: Path) -> dict[str, list]:
    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name not in (MANIFEST, "state.json"))
    return {str(p.relative_to(ckpt)): [p.stat().st_size, _file_digest(p)] for p in files}


def verify(ckpt: Path) -> str | None:
    """What is wrong with `ckpt` (a missing, resized or changed file; an unreadable state), or None if intact."""
    try:
        state = json.loads((ckpt / "state.json").read_text())
        if not (ckpt / MANIFEST).exists() and isinstance(state, dict) and "step" in state:
            log.warning("checkpoint %s predates manifests: resuming from it unverified", ckpt)
            return None
        want = json.loads((ckpt / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        return f"unreadable {getattr(e, 'filename', None) or 'state.json / manifest.json'}: {e}"
    if not isinstance(state, dict) or "step" not in state:
        return "state.json has no step"
    have = _manifest(ckpt)
    for name, (size, digest) in want.items():
        if name not in have:
            return f"{name} is missing"
        if have[name][0] != size:
            return f"{name} differs from the checkpoint's manifest: {have[name][0]} bytes, was {size}"
        if have[name][1] != digest:
            return f"{name} differs from the checkpoint's manifest: same size, other content (xxh3 {have[name][1]})"
    return None


def checkpoint_marks(run_dir: Path) -> frozenset[tuple[str, int, int]]:
    """Each completed checkpoint's name and its state file's inode and write time: what tells the checkpoints a run
    wrote from an earlier run's in the same directory. A save may reuse a name, but it writes the new state file
    while the old one still exists, so never under the old inode."""
    marks = set()
    for p in _completed(run_dir):
        st = (p / "state.json").stat()
        marks.add((p.name, st.st_ino, st.st_mtime_ns))
    return frozenset(marks)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest intact checkpoint; each newer one that fails `verify` is skipped with a warning naming it."""
    completed = _completed(run_dir)
    for ckpt in reversed(completed):
        problem = verify(ckpt)
        if problem is None:
            return ckpt
        log.warning("checkpoint %s is corrupt (%s); trying the one before it", ckpt, problem)
    if completed:
        raise CheckpointError(f"no intact checkpoint left in {Path(run_dir) / 'checkpoints'} to resume from")
    return None


def save_checkpoint(run_dir: Path, step: int, state: dict, save_trainer, keep: int = 2) -> Path:
    """`save_trainer(path)` writes the trainer's state into `path`; `state` is the loop's (JSON). A write that
    fails is a CheckpointError; a trainer rank that dies mid-save is its TrainerDied, for the loop to heal."""
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        (tmp / "trainer").mkdir(parents=True)
        save_trainer(str(tmp / "trainer"))
        (tmp / MANIFEST).write_text(json.dumps(_manifest(tmp), indent=1))
        (tmp / "state.json").write_text(json.dumps({**state, "step": step}, indent=1))
    except Exception as e:  # a full disk, a trainer rank that failed to write: nothing half-written stays
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, TrainerDied):  # not a failed write: the loop rebuilds from the previous checkpoint
            raise
        previous = _completed(run_dir)
        kept = f"the previous checkpoint {previous[-1]} is intact" if previous else "no earlier checkpoint exists"
        raise CheckpointError(f"writing checkpoint {final} failed ({e}); {kept}; rerun with --resume") from e
    _remove(final)
    tmp.rename(final)
    for old in _completed(run_dir):
        if int(old.name[len(PREFIX) :]) > step:  # an earlier run's, past this one: never the one just written
            log.warning("removing %s, a checkpoint of an earlier run in this directory", old)
            _remove(old)
    older = [p for p in _completed(run_dir) if p != final]  # all before `step` now
    for old in older[: max(len(older) - (keep - 1), 0)]:
        _remove(old)
    return final


def load_state(ckpt: Path) -> dict:
    return json.loads((Path(ckpt) / "state.json").read_text())
