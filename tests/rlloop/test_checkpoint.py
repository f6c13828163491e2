"""Run checkpoints survive what disks and crashes do: a full disk mid-save leaves the previous checkpoint intact
and loadable, a corrupt or truncated checkpoint is never loaded (resume takes the newest intact one and says so),
and a fresh run in an old run's directory does not prune its own new checkpoint, nor takes the old run's for its own.
What a run does with an earlier run's outputs, and a resume's checks: tests/rlloop/test_run_dir.py."""

import json
import subprocess
from pathlib import Path

import pytest

from rlloop import checkpoint
from rlloop.checkpoint import checkpoint_marks, latest_checkpoint, save_checkpoint, set_aside_earlier, verify
from rlloop.errors import CheckpointError, TrainerDied

TINY = str(Path(__file__).resolve().parents[2] / "examples" / "grpo_dapo_tiny.yaml")


def trainer_writing(nbytes: int, fill: int | None = None):
    """A trainer's save that writes `nbytes` of `fill`, or of the bytes 0-255 over and over."""

    def save(path):
        Path(path, "model.safetensors").write_bytes(
            bytes([fill]) * nbytes if fill is not None else bytes(range(256)) * (nbytes // 256)
        )

    return save


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs: room for one small checkpoint, not for a second, larger one."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_mid_save_keeps_the_previous_checkpoint(small_disk):
    first = save_checkpoint(small_disk, 1, {"data": {"position": 1}}, trainer_writing(300_000))
    with pytest.raises(CheckpointError, match=r"step_000002 failed .*No space left.*step_000001 is intact"):
        save_checkpoint(small_disk, 2, {"data": {"position": 2}}, trainer_writing(900_000))
    assert latest_checkpoint(small_disk) == first and verify(first) is None
    assert not list((small_disk / "checkpoints").glob("*.tmp"))  # the half-written one is gone


def test_a_save_that_fails_in_an_actor_is_one_line_naming_its_cause_and_the_free_space(tmp_path):
    """A trainer rank's write failing on a full disk reached the user as Ray's remote traceback (20 lines, colour
    codes), whose cause, torch's errno-less "iostream error", never says the disk is full."""
    from ray.exceptions import RayTaskError

    def save_in_an_actor(path):
        remote = "Traceback (most recent call last):\n  File ...\nRuntimeError: basic_ios::clear: iostream error"
        raise RayTaskError(
            "TrainerWorker.save", remote, RuntimeError("basic_ios::clear: iostream error")
        ).as_instanceof_cause()

    with pytest.raises(CheckpointError) as e:
        save_checkpoint(tmp_path, 2, {"data": {}}, save_in_an_actor)
    message = str(e.value)
    assert "\n" not in message and "\x1b" not in message, message
    assert "failed (RuntimeError: basic_ios::clear: iostream error; " in message and " GB free there)" in message


def test_a_trainer_dying_mid_save_is_left_for_the_loop_to_heal(tmp_path):
    """A death is not a failed write: it reaches the loop as TrainerDied (which rebuilds the cluster from the previous
    checkpoint), not as the CheckpointError that ends the run, and the half-written checkpoint is gone."""
    first = save_checkpoint(tmp_path, 1, {}, trainer_writing(4096))

    def dies_mid_write(path):
        trainer_writing(4096)(path)
        raise TrainerDied("a trainer actor died during save()")

    with pytest.raises(TrainerDied):
        save_checkpoint(tmp_path, 2, {}, dies_mid_write)
    assert latest_checkpoint(tmp_path) == first
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))


@pytest.mark.parametrize(
    "damage, named",
    [
        (lambda c: (c / "trainer" / "model.safetensors").unlink(), "model.safetensors is missing"),
        (lambda c: (c / "trainer" / "model.safetensors").write_bytes(b"\0" * 10), "manifest: 10 bytes, was"),
        (lambda c: _flip_one_byte(c / "trainer" / "model.safetensors"), "manifest: same size, other content"),
        (lambda c: (c / "state.json").write_text("{"), "unreadable"),
        (lambda c: (c / "manifest.json").write_text("[]x"), "unreadable"),
        (lambda c: (c / "manifest.json").unlink(), "unreadable"),
        (lambda c: _edit_state(c, data={"position": 36}), "state.json differs from what was saved"),
        (lambda c: (c / "state.json").write_text('{"step": 7}'), "state.json is of step 7"),
        (lambda c: (c / "trainer" / "x.safetensors").write_bytes(b"x"), "x.safetensors is not in the checkpoint's"),
    ],
)
def test_a_corrupt_checkpoint_is_skipped_for_the_newest_intact_one(tmp_path, caplog, damage, named):
    first = save_checkpoint(tmp_path, 1, {}, trainer_writing(4096))
    second = save_checkpoint(tmp_path, 2, {}, trainer_writing(4096))
    damage(second)
    assert latest_checkpoint(tmp_path) == first
    assert "step_000002 is corrupt" in caplog.text and named in caplog.text
    damage(first)
    for _ in range(2):  # and again once both are moved aside: it started the run over
        with pytest.raises(CheckpointError, match=r"no intact checkpoint .*step_000001.corrupt, step_000002.corrupt"):
            latest_checkpoint(tmp_path)


def _edit_state(ckpt, **changes):
    state = json.loads((ckpt / "state.json").read_text())
    (ckpt / "state.json").write_text(json.dumps(state | changes))


def _flip_one_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_fresh_run_in_an_old_directory_keeps_its_own_checkpoints(tmp_path):
    for step in (5, 6):  # an earlier, longer run
        save_checkpoint(tmp_path, step, {}, trainer_writing(256))
    set_aside_earlier(tmp_path)  # as a fresh run starts
    assert latest_checkpoint(tmp_path) is None  # a --resume before its first save does not take up the earlier run
    assert sorted(p.name for p in (tmp_path / "checkpoints.earlier").iterdir()) == ["step_000005", "step_000006"]
    new = save_checkpoint(tmp_path, 1, {}, trainer_writing(256))
    assert latest_checkpoint(tmp_path) == new and not (tmp_path / "checkpoints.earlier").exists()
    save_checkpoint(tmp_path, 2, {}, trainer_writing(256))
    save_checkpoint(tmp_path, 3, {}, trainer_writing(256))
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["step_000002", "step_000003"]
    assert json.loads((tmp_path / "checkpoints" / "step_000003" / "state.json").read_text())["step"] == 3


@pytest.mark.parametrize("keep", [1, 3, None])
def test_the_newest_keep_checkpoints_stay(tmp_path, keep):
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, {}, trainer_writing(256), keep=keep)
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == [f"step_{step:06d}" for step in range(1, 6)][-(keep or 5) :]


def test_checkpoints_past_a_million_steps_are_ordered_by_step(tmp_path):
    for step in (999_999, 1_000_000, 1_000_001):
        save_checkpoint(tmp_path, step, {}, trainer_writing(256))
    assert latest_checkpoint(tmp_path).name == "step_1000001"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1000000", "step_1000001"]


def test_a_checkpoint_being_removed_is_never_resumed(tmp_path, monkeypatch):
    """A removal killed half-way (pruning, or replacing a step's checkpoint) leaves files behind; the first to go is
    the checkpoint's name, so what is left is no checkpoint at all, not one without its manifest (loaded unverified)."""
    from rlloop import checkpoint

    for step in (4, 6):
        save_checkpoint(tmp_path, step, {}, trainer_writing(256))

    class Killed(Exception):
        pass

    def killed_half_way(path, ignore_errors=False):  # shutil.rmtree, killed after the manifest went
        if not Path(path).exists():
            return
        (Path(path) / "manifest.json").unlink(missing_ok=True)
        raise Killed

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint.shutil, "rmtree", killed_half_way)
        with pytest.raises(Killed):
            checkpoint._remove(tmp_path / "checkpoints" / "step_000006")
    assert latest_checkpoint(tmp_path).name == "step_000004"
    # what the killed removal left does not stand in the way of removing that step again
    save_checkpoint(tmp_path, 6, {}, trainer_writing(256))
    (tmp_path / "checkpoints" / "step_000006.removing" / "left").mkdir(parents=True)
    checkpoint._remove(tmp_path / "checkpoints" / "step_000006")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000004"]


def test_a_fresh_run_tells_its_own_checkpoints_from_an_earlier_runs(tmp_path):
    """What `train` rebuilds a dead trainer from: before its first save a fresh run has no checkpoint of its own (the
    earlier run's step 6 is not one), after it it has, even where its save reused the earlier run's name."""
    for step in (2, 6):  # an earlier run
        save_checkpoint(tmp_path, step, {}, trainer_writing(256))
    inherited = checkpoint_marks(tmp_path)
    assert len(inherited) == 2 and not checkpoint_marks(tmp_path) - inherited
    set_aside_earlier(tmp_path)
    save_checkpoint(tmp_path, 2, {}, trainer_writing(256))  # this run's step 2, under the old one's name
    assert checkpoint_marks(tmp_path) - inherited
    assert latest_checkpoint(tmp_path).name == "step_000002"  # and the earlier run's step 6 is gone


def test_a_corrupt_checkpoint_moved_aside_no_longer_counts_among_those_kept(tmp_path):
    """Left in place, the corrupt step 12 would be one of the two kept at the next save, and the intact step 10, the
    one the run resumed from, would be pruned."""
    for step in (10, 12):
        save_checkpoint(tmp_path, step, {}, trainer_writing(256))
    _flip_one_byte(tmp_path / "checkpoints" / "step_000012" / "trainer" / "model.safetensors")
    assert latest_checkpoint(tmp_path).name == "step_000010"
    save_checkpoint(tmp_path, 15, {}, trainer_writing(256))
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["step_000010", "step_000012.corrupt", "step_000015"]


def test_what_a_killed_save_or_removal_left_goes_at_the_next_save(tmp_path):
    save_checkpoint(tmp_path, 1, {}, trainer_writing(256))
    for left in ("step_000001.removing", "step_000003.tmp"):  # never saved again under those names
        (tmp_path / "checkpoints" / left / "trainer").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_²" / "state.json").parent.mkdir()  # not a step: a digit, but not ASCII
    (tmp_path / "checkpoints" / "step_²" / "state.json").write_text("{}")
    save_checkpoint(tmp_path, 5, {}, trainer_writing(256))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001", "step_000005", "step_²"]
    assert latest_checkpoint(tmp_path).name == "step_000005"


def test_a_resume_under_another_trainer_layout_is_refused_before_anything_starts(tmp_path):
    """An fsdp checkpoint resumed with ddp (one trainer chip) failed in the trainer's load, once Ray and every actor
    were up; now the loop's own state says which layout trained it, and the run directory is left as it was."""
    from rlloop.config import load_config
    from rlloop.loop import train

    cfg = load_config(TINY, [f"run.dir={tmp_path}"])
    assert cfg.train_parallel == "ddp"
    save_checkpoint(tmp_path, 2, {"train_parallel": "fsdp"}, trainer_writing(256))
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    with pytest.raises(  # the fix named is more chips: train.parallel=fsdp on one chip is still the plain model
        CheckpointError, match=r"trained with train.parallel=fsdp, and this run's trainer is ddp.*train_chips >= 2$"
    ):
        train(cfg, resume=True)
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before


def test_what_a_killed_prune_left_goes_at_a_resume_that_saves_nothing(tmp_path):
    """A run killed while pruning at its last step is resumed with nothing left to train: no save sweeps it then."""
    save_checkpoint(tmp_path, 4, {}, trainer_writing(256))
    (tmp_path / "checkpoints" / "step_000002.removing" / "trainer").mkdir(parents=True)
    assert latest_checkpoint(tmp_path).name == "step_000004"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000004"]


def test_a_fresh_run_sets_aside_the_earlier_run_over_a_leftover_checkpoints_earlier(tmp_path):
    """A checkpoints.earlier/ left behind (a run killed while its first save deleted it) is replaced, not a
    start that fails with 'Directory not empty'."""
    save_checkpoint(tmp_path, 4, {}, trainer_writing(256))  # an earlier run's; then what a later one left half-deleted
    (tmp_path / "checkpoints.earlier" / "step_000009" / "trainer").mkdir(parents=True)
    set_aside_earlier(tmp_path)
    assert [p.name for p in (tmp_path / "checkpoints.earlier").iterdir()] == ["step_000004"]
    assert latest_checkpoint(tmp_path) is None


def test_a_manifest_changed_along_with_the_files_is_caught(tmp_path, caplog):
    """A manifest rewritten to match what is left (here: emptied, with the weights gone) is still caught by
    its checksum in state.json."""
    first = save_checkpoint(tmp_path, 1, {}, trainer_writing(256))
    second = save_checkpoint(tmp_path, 2, {}, trainer_writing(256))
    (second / "trainer" / "model.safetensors").unlink()
    (second / "manifest.json").write_text("{}")
    assert verify(second) == "manifest.json differs from what was saved"
    assert latest_checkpoint(tmp_path) == first


def test_every_file_and_directory_is_synced_before_the_rename_and_the_parent_after(tmp_path, monkeypatch):
    """What makes a checkpoint survive a power loss: fsync of every file and directory under the temporary
    name before it is renamed into place, then of the checkpoints directory."""
    events = []
    real_fsync, real_rename = checkpoint._fsync, Path.rename
    monkeypatch.setattr(checkpoint, "_fsync", lambda p: (events.append(("fsync", Path(p))), real_fsync(p))[1])
    monkeypatch.setattr(Path, "rename", lambda s, t: (events.append(("rename", Path(s))), real_rename(s, t))[1])
    final = save_checkpoint(tmp_path, 3, {}, trainer_writing(256))
    tmp = final.with_name(final.name + ".tmp")
    renamed = events.index(("rename", tmp))
    synced = {p for kind, p in events[:renamed] if kind == "fsync"}
    wanted = {tmp / p.relative_to(final) for p in final.rglob("*")} | {tmp}
    assert wanted <= synced, wanted - synced
    assert ("fsync", final.parent) in events[renamed:]


def test_a_step_saved_again_replaces_its_checkpoint(tmp_path):
    """A second save of the same step (the checkpoint's name reused) replaces the first one whole."""
    save_checkpoint(tmp_path, 2, {"data": {"position": 1}}, trainer_writing(256, fill=1))
    final = save_checkpoint(tmp_path, 2, {"data": {"position": 2}}, trainer_writing(256, fill=2))
    assert json.loads((final / "state.json").read_text())["data"] == {"position": 2}
    assert (final / "trainer" / "model.safetensors").read_bytes() == bytes([2]) * 256
    assert verify(final) is None


def test_a_failed_write_leaves_nothing_behind_at_once(tmp_path):
    """The half-written checkpoint goes when the write fails, not only at the next save or resume (on a full
    disk it held the space the user had to free)."""

    def fails_half_way(path):
        trainer_writing(4096)(path)
        raise OSError(28, "No space left on device")

    with pytest.raises(CheckpointError):
        save_checkpoint(tmp_path, 2, {}, fails_half_way)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == []
