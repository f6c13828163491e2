"""Run checkpoints: `<run dir>/checkpoints/step_NNNNNN/` holding the trainer's state (`trainer/`: HF model with the
run's tokenizer, optimizer, RNG, fsdp shards) and the loop's (`state.json`: step, data position).

A checkpoint is written under a temporary name and renamed, with `manifest.json` (every file's size and xxh3) and
then `state.json` last (it holds the xxh3 of the manifest and of its own content), so a crash or a full disk mid-save
leaves the previous checkpoint as the latest. Resuming verifies the newest checkpoint and falls back, saying so, to
the newest intact one: a flipped byte, a missing or an extra file is never loaded. A corrupt checkpoint is moved
aside to `step_NNNNNN.corrupt`, out of the count of the newest `keep` that are kept. A fresh run in a directory that
holds an earlier run's checkpoints moves them to `checkpoints.earlier/` as it starts (`set_aside_earlier`), where no
--resume finds them, and deletes them at its first save.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

import xxhash

from rlloop.errors import CheckpointError, TrainerDied

PREFIX = "step_"
EARLIER = "checkpoints.earlier"  # an earlier run's checkpoints, while the run that replaces it has saved none
MANIFEST = "manifest.json"
CHECKSUMS = "checksums"  # state.json's key for the xxh3 of the manifest and of the rest of state.json
_OWN = {(MANIFEST,), ("state.json",)}  # the checkpoint's own files, outside its manifest
_NAME = re.compile(rf"{PREFIX}(\d+)", re.ASCII)
log = logging.getLogger(__name__)


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"{PREFIX}{step:06d}"


def _step(ckpt: Path) -> int | None:
    """The step a checkpoint directory is named for, or None for what is not a checkpoint (a .tmp, a .corrupt)."""
    match = _NAME.fullmatch(ckpt.name)
    return int(match[1]) if match else None


def _completed(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    done = [p for p in root.glob(f"{PREFIX}*") if _step(p) is not None and (p / "state.json").exists()]
    return sorted(done, key=_step)  # step_1000000 after step_999999


def set_aside_earlier(run_dir: Path) -> bool:
    """Move the checkpoints in `run_dir` (an earlier run's: this one starts from step 0) to `checkpoints.earlier/`,
    replacing any there before; whether there were any. Left in place until this run's first save, a --resume after
    this run was killed took up the earlier run where it had stopped, under this run's metrics."""
    root, aside = Path(run_dir) / "checkpoints", Path(run_dir) / EARLIER
    if not _completed(run_dir):
        return False
    shutil.rmtree(aside, ignore_errors=True)
    root.rename(aside)
    log.warning("moved the earlier run's checkpoints to %s: deleted at this run's first save", aside)
    return True


def _sweep(root: Path) -> None:
    """What a save or a removal killed half-way left (one writer per run dir: the run holds it)."""
    for stale in (*root.glob(f"{PREFIX}*.tmp"), *root.glob(f"{PREFIX}*.removing")):
        shutil.rmtree(stale, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.relative_to(ckpt).parts not in _OWN)
    return {str(p.relative_to(ckpt)): [p.stat().st_size, _file_digest(p)] for p in files}


def _state_digest(state: dict) -> str:
    body = {k: v for k, v in state.items() if k != CHECKSUMS}
    return xxhash.xxh3_64(json.dumps(body, sort_keys=True).encode()).hexdigest()


def verify(ckpt: Path) -> str | None:
    """What is wrong with `ckpt` (a missing, extra, resized or changed file; a state that is unreadable, changed or
    of another step), or None if intact."""
    try:
        state = json.loads((ckpt / "state.json").read_text())
        if not isinstance(state, dict) or "step" not in state:
            return "state.json has no step"
        if CHECKSUMS not in state and not (ckpt / MANIFEST).exists():
            log.warning("checkpoint %s predates manifests: resuming from it unverified", ckpt)
            return None
        manifest = (ckpt / MANIFEST).read_bytes()
        want = json.loads(manifest)
    except (OSError, ValueError) as e:
        return f"unreadable {getattr(e, 'filename', None) or 'state.json / manifest.json'}: {e}"
    if state["step"] != _step(ckpt):
        return f"state.json is of step {state['step']}"
    if CHECKSUMS in state:  # older checkpoints' state.json holds none
        sums = state[CHECKSUMS]
        if sums.get("state") != _state_digest(state):
            return "state.json differs from what was saved"
        if sums.get("manifest") != xxhash.xxh3_64(manifest).hexdigest():
            return f"{MANIFEST} differs from what was saved"
    have = _manifest(ckpt)
    for name, (size, digest) in want.items():
        if name not in have:
            return f"{name} is missing"
        if have[name][0] != size:
            return f"{name} differs from the checkpoint's manifest: {have[name][0]} bytes, was {size}"
        if have[name][1] != digest:
            return f"{name} differs from the checkpoint's manifest: same size, other content (xxh3 {have[name][1]})"
    if extra := sorted(set(have) - set(want)):  # the trainer would load a stray *.safetensors with the rest
        return f"{extra[0]} is not in the checkpoint's manifest"
    return None


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The newest completed checkpoint, as it is (`latest_checkpoint` verifies it first), or None."""
    done = _completed(run_dir)
    return done[-1] if done else None


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
    """The newest intact checkpoint. Each newer one that fails `verify` is moved aside to `<name>.corrupt`, with a
    warning naming it: left in place, it would count among the `keep` newest and have the intact one pruned. None if
    the run has none; a CheckpointError if it has only corrupt ones, now or moved aside before (a second --resume
    found none left, and started the run over)."""
    _sweep(Path(run_dir) / "checkpoints")
    completed = _completed(run_dir)
    for ckpt in reversed(completed):
        problem = verify(ckpt)
        if problem is None:
            return ckpt
        aside = ckpt.with_name(ckpt.name + ".corrupt")
        shutil.rmtree(aside, ignore_errors=True)
        ckpt.rename(aside)
        log.warning("checkpoint %s is corrupt (%s): moved to %s; trying the one before it", ckpt, problem, aside.name)
    if corrupt := sorted(p.name for p in (Path(run_dir) / "checkpoints").glob(f"{PREFIX}*.corrupt")):
        raise CheckpointError(
            f"no intact checkpoint left in {Path(run_dir) / 'checkpoints'} to resume from (corrupt: "
            f"{', '.join(corrupt)}); to start the run over, run it without --resume"
        )
    return None


def one_line(e: BaseException) -> str:
    """An error as one line: a Ray actor's (RayTaskError) is its whole remote traceback, whose cause says what failed
    (a full disk shows as torch's "iostream error ... unexpected pos", errno-less: hence the free space beside it)."""
    cause = getattr(e, "cause", None) or e
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[-1]}" if lines else type(cause).__name__


def save_checkpoint(run_dir: Path, step: int, state: dict, save_trainer, keep: int | None = 2) -> Path:
    """`save_trainer(path)` writes the trainer's state into `path`; `state` is the loop's (JSON). The newest `keep`
    checkpoints stay (None: all). A write that fails is a CheckpointError; a trainer rank that dies mid-save is its
    TrainerDied, for the loop to heal."""
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    _sweep(final.parent)
    try:
        (tmp / "trainer").mkdir(parents=True)
        save_trainer(str(tmp / "trainer"))
        manifest = json.dumps(_manifest(tmp), indent=1)
        (tmp / MANIFEST).write_text(manifest)
        state = {**state, "step": step}
        state[CHECKSUMS] = {"manifest": xxhash.xxh3_64(manifest.encode()).hexdigest(), "state": _state_digest(state)}
        (tmp / "state.json").write_text(json.dumps(state, indent=1))
        for path in (*(p for p in tmp.rglob("*") if p.is_file()), *(p for p in tmp.rglob("*") if p.is_dir()), tmp):
            _fsync(path)  # on disk before the rename and the pruning: a power loss keeps a checkpoint whole
    except Exception as e:  # a full disk, a trainer rank that failed to write: nothing half-written stays
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, TrainerDied):  # not a failed write: the loop rebuilds from the previous checkpoint
            raise
        previous = _completed(run_dir)
        kept = f"the previous checkpoint {previous[-1]} is intact" if previous else "no earlier checkpoint exists"
        free = shutil.disk_usage(final.parent).free / 1e9
        raise CheckpointError(
            f"writing checkpoint {final} failed ({one_line(e)}; {free:.2f} GB free there); {kept}; rerun with --resume"
        ) from e
    _remove(final)
    tmp.rename(final)
    _fsync(final.parent)
    if (earlier := Path(run_dir) / EARLIER).exists():
        log.warning("removing %s: the checkpoints of the run this one replaced", earlier)
        shutil.rmtree(earlier, ignore_errors=True)
    older = [p for p in _completed(run_dir) if p != final]  # all before `step` now
    for old in older[: max(len(older) - (keep - 1), 0)] if keep else []:
        _remove(old)
    return final


def load_state(ckpt: Path) -> dict:
    state = json.loads((Path(ckpt) / "state.json").read_text())
    state.pop(CHECKSUMS, None)
    return state
