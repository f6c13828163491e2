"""The shared-memory sender's start and the sweep of dead writers' segments, in the orders that lose data when they
change: the control segment removed last, the sweep tried again while a new writer waits, a forked child's exit, and
the temporary control files of writers killed while starting."""

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import weight_sync.shm
from tests.weight_sync.test_shm_lifecycle import start_writer
from weight_sync import SyncConfig, make_receiver, make_sender
from weight_sync.shm import remove_stale_segments, segment_path


def cfg(run_id):
    return SyncConfig(run_id=run_id, transport="shm", delta=False)


def killed_writer(run_id):
    proc = start_writer(run_id, "wait")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def test_a_forked_child_that_exits_normally_leaves_its_parents_segments(run_id):
    """The pid check in _remove_segments. A child that ends by sys.exit runs the sender's weakref.finalize at
    exit; it must not remove the parent's live segments."""
    proc = start_writer(run_id, "fork-exits")
    try:
        with make_receiver(cfg(run_id)) as receiver:
            pulled = receiver.pull()
            assert pulled is not None and pulled[0] == 1, "the child's exit removed its parent's segments"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_a_new_writer_sweeps_again_while_it_waits(run_id, private_shm, monkeypatch):
    """A dead writer whose lock is still held at the first sweep (another process's sweep gave up, or the
    kernel had not yet released it) is swept by a later try within the start wait, not refused as live."""
    killed_writer(run_id)
    real, calls = weight_sync.shm._lock_if_dead, []

    def held_the_first_time(path):
        calls.append(path)
        return None if len(calls) == 1 else real(path)

    monkeypatch.setattr(weight_sync.shm, "_lock_if_dead", held_the_first_time)
    with make_sender(cfg(run_id)) as sender:
        sender.push({"w": np.full(8, 2.0, np.float32)}, 1)
    assert len(calls) >= 2


def test_a_refused_writer_is_told_the_live_writers_pid(run_id, private_shm):
    """The message names the pid of the writer that holds the run."""
    proc = start_writer(run_id, "wait")
    try:
        with pytest.raises(ValueError, match=rf"already has a live shm sender \(pid {proc.pid}\)"):
            make_sender(cfg(run_id))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        remove_stale_segments()


def test_a_sweep_removes_the_control_segment_last(run_id, private_shm, monkeypatch):
    """A new writer starts as soon as the control segment's name is free; a sweep that removed it first then
    removed the new writer's buffer (its versions went into unlinked pages: no receiver ever saw one)."""
    killed_writer(run_id)
    real_unlink, fired, new = Path.unlink, [], []

    def new_writer():
        new.append(make_sender(cfg(run_id)))
        new[0].push({"w": np.full(8, 7.0, np.float32)}, 7)

    def unlink(self, missing_ok=False):
        real_unlink(self, missing_ok=missing_ok)
        if not fired and self.name.startswith(f"rlloop_{run_id}_"):
            fired.append(threading.Thread(target=new_writer))
            fired[0].start()
            fired[0].join(0.5)  # the new writer gets its chance in the middle of the sweep

    monkeypatch.setattr(Path, "unlink", unlink)
    try:
        assert run_id in remove_stale_segments()
        fired[0].join(10)
        monkeypatch.undo()
        with make_receiver(cfg(run_id)) as receiver:
            pulled = receiver.pull()
            assert pulled is not None and pulled[0] == 7, "the new writer's version is gone"
    finally:
        for s in new:
            s.close()


def test_a_dead_writers_temporary_control_file_is_swept_once_old_and_a_fresh_one_is_not(run_id, private_shm):
    """The 4 KiB ctl.*.tmp of a writer killed while starting goes at a sweep once a minute old; one younger
    (a live writer between creating and locking it) stays."""
    old = segment_path(run_id, "ctl.1-aaaa.tmp")
    fresh = segment_path(run_id, "ctl.2-bbbb.tmp")
    for p in (old, fresh):
        p.write_bytes(b"\0" * 4096)
    past = time.time() - 120
    os.utime(old, (past, past))
    remove_stale_segments()
    assert not old.exists() and fresh.exists()
    fresh.unlink()
