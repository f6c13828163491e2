"""Segments of a killed writer: never a half-written version for readers, removed at the next start, and removed on
normal exit and on SIGTERM."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import weight_sync.shm
from weight_sync import SyncConfig, make_receiver, make_sender
from weight_sync.shm import SHM_DIR, _map, remove_stale_segments, segment_path

# The writer process. In "midpush" mode it publishes version 1, then writes half of version 2 and stops there (the
# hook stands in for the moment a SIGKILL lands; the real encode_payload_into produces the bytes).
WRITER = r"""
import sys, time
import numpy as np
import pytest
import weight_sync.shm as shm

run_id, mode, shm.SHM_DIR = sys.argv[1], sys.argv[2], shm.Path(sys.argv[3])
sender = shm.ShmSender(run_id)
sender.push({"w": np.full(1 << 16, 1.0, np.float32)}, 1)
if mode == "midpush":
    real_write = shm.encode_payload_into
    def write_half_then_hang(dst, manifest, blobs):
        scratch = np.zeros(shm.payload_nbytes(manifest), np.uint8)
        total = real_write(scratch, manifest, blobs)
        dst[: total // 2] = scratch[: total // 2]
        print("mid-push", flush=True)
        time.sleep(120)
    shm.encode_payload_into = write_half_then_hang
    sender.push({"w": np.full(1 << 16, 2.0, np.float32)}, 2)
if mode == "fork-exits":  # a child inherits the sender and its exit hooks, and ends normally (they run)
    import os
    child = os.fork()
    if child == 0:
        sys.exit(0)
    os.waitpid(child, 0)
if mode == "fork":  # a child inherits the sender and its SIGTERM and exit hooks; it is terminated
    import os, signal
    child = os.fork()
    if child == 0:
        os.kill(os.getpid(), signal.SIGTERM)
        os._exit(3)
    _, status = os.waitpid(child, 0)
    if not os.WIFSIGNALED(status):
        sys.exit(f"the child was not terminated: status {status}")
print("ready", flush=True)
if mode in ("wait", "fork", "fork-exits"):
    time.sleep(120)
"""


def start_writer(run_id: str, mode: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, run_id, mode, str(weight_sync.shm.SHM_DIR)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    line = proc.stdout.readline().strip()
    assert line in ("mid-push", "ready"), f"writer failed to start (got {line!r})"
    return proc


def _segments(run_id: str) -> list[str]:
    return sorted(p.name for p in weight_sync.shm.SHM_DIR.glob(f"rlloop_{run_id}_*"))


def test_sigkill_mid_push_never_shows_partial_version_and_next_start_cleans_up(run_id, private_shm):
    proc = start_writer(run_id, "midpush")
    try:
        receiver = make_receiver(SyncConfig(run_id=run_id, transport="shm", delta=False))
        version, got = receiver.pull()
        assert version == 1 and (got["w"] == 1.0).all()
        assert receiver._read(2) is None  # the half-written buffer is not offered even when asked for by name
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    fresh = make_receiver(SyncConfig(run_id=run_id, transport="shm", delta=False))
    version, got = fresh.pull()
    assert version == 1 and (got["w"] == 1.0).all(), "after the kill readers still get the last whole version"
    assert receiver.pull() is None
    assert _segments(run_id) == [f"rlloop_{run_id}_buf0", f"rlloop_{run_id}_buf1", f"rlloop_{run_id}_ctl"]

    # The next start finds the dead writer's segments and replaces them.
    with make_sender(SyncConfig(run_id=run_id, transport="shm", delta=False)) as sender:
        assert fresh.pull() is None  # new, empty run: nothing published yet
        sender.push({"w": np.full(8, 3.0, np.float32)}, 1)
        # a restarted writer's version 1 is new again
        for r in (fresh, make_receiver(SyncConfig(run_id=run_id, transport="shm", delta=False))):
            version, got = r.pull()
            assert version == 1 and (got["w"] == 3.0).all()
    assert _segments(run_id) == []


def test_remove_stale_segments_spares_live_writers(run_id, private_shm):
    proc = start_writer(run_id, "midpush")
    try:
        assert run_id not in remove_stale_segments()
        assert len(_segments(run_id)) == 3
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert run_id in remove_stale_segments()
    assert _segments(run_id) == []


def test_sigterm_removes_segments(run_id):
    proc = start_writer(run_id, "wait")
    assert _segments(run_id) == [f"rlloop_{run_id}_buf0", f"rlloop_{run_id}_ctl"]  # one push: one buffer used
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGTERM  # still dies of SIGTERM, as the default action would
    assert _segments(run_id) == []


def test_a_forked_child_that_is_terminated_leaves_its_parents_segments(run_id):
    """A child forked from the writer inherits its sender and the hooks that close every sender on SIGTERM and at
    exit, not its segments: after the child is terminated the writer's version is still there to pull."""
    proc = start_writer(run_id, "fork")
    try:
        assert _segments(run_id) == [f"rlloop_{run_id}_buf0", f"rlloop_{run_id}_ctl"]
        with make_receiver(SyncConfig(run_id=run_id, transport="shm", delta=False)) as receiver:
            version, got = receiver.pull()
            assert version == 1 and (got["w"] == 1.0).all()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert _segments(run_id) == []  # the writer's own SIGTERM still removes them


def test_normal_exit_without_close_removes_segments(run_id):
    proc = start_writer(run_id, "exit")
    proc.wait(timeout=30)
    assert proc.returncode == 0
    assert _segments(run_id) == []


def test_close_keeps_views_held_by_the_reader_valid(run_id):
    sender = make_sender(SyncConfig(run_id=run_id, transport="shm", delta=False))
    sender.push({"w": np.arange(10, dtype=np.float32)}, 0)
    _, got = make_receiver(SyncConfig(run_id=run_id, transport="shm", delta=False)).pull()
    sender.close()
    sender.close()  # idempotent
    assert _segments(run_id) == [] and got["w"].tolist() == list(range(10))


READER = r"""
import sys
import numpy as np
import pytest
from weight_sync.shm import ShmReceiver

run_id, want = sys.argv[1], int(sys.argv[2])
# verify=False: only the seqlock stands between us and a torn version; delta=True: arrays are copied before the
# seqlock is re-checked, so checking them afterwards is sound.
receiver = ShmReceiver(run_id, delta=True, verify=False)
pulls = torn = 0
print("ready", flush=True)
while pulls < want:
    got = receiver.pull()
    if got is not None:
        pulls += 1
        version, arrays = got
        torn += int(not (arrays["w"] == version).all() or not (arrays["v"] == -version).all())
print(pulls, torn, flush=True)
"""


def test_concurrent_reader_never_sees_a_torn_version(run_id):
    """A reader process pulls as fast as it can while the writer rewrites both buffers as fast as it can, until the
    reader has read `want` versions mid-write-stream (however the two are scheduled)."""
    want = 100
    with make_sender(SyncConfig(run_id=run_id, transport="shm", delta=False)) as sender:
        sender.push({"w": np.zeros(1 << 17, np.float32), "v": np.zeros(1 << 16, np.int32)}, 0)
        proc = subprocess.Popen(
            [sys.executable, "-c", READER, run_id, str(want)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        try:
            assert proc.stdout.readline().strip() == "ready"
            v = 0
            while proc.poll() is None and v < 200_000:
                v += 1
                sender.push({"w": np.full(1 << 17, v, np.float32), "v": np.full(1 << 16, -v, np.int32)}, v)
            out, _ = proc.communicate(timeout=120)
        finally:
            proc.kill()
            proc.wait()
    pulls, torn = map(int, out.split())
    assert proc.returncode == 0 and pulls == want and torn == 0


def test_a_delta_overwritten_while_applied_is_a_torn_read_not_a_corrupt_version(run_id):
    """Two pushes while the receiver decodes a delta reuse the buffer under it: the decode fails, and the version must
    not be counted as refused. The receiver then lacks the base of the newest delta, so it asks for a keyframe, which
    the next push brings."""
    from weight_sync.shm import ShmReceiver

    rng = np.random.default_rng(0)
    versions = [{"w": rng.standard_normal(4096).astype(np.float32)}]
    for _ in range(4):  # 1% of the elements change: each version is sent as a delta
        w = versions[-1]["w"].copy()
        w[rng.integers(0, w.size, 40)] += 1
        versions.append({"w": w})

    class OverwrittenWhileApplying(ShmReceiver):
        writer = None  # pushes versions 2 and 3 when the receiver starts its next apply

        def _apply(self, msg, state):
            if self.writer:
                self.writer, writer = None, self.writer
                writer()
            return super()._apply(msg, state)

    cfg = SyncConfig(run_id=run_id, transport="shm", delta=True)
    with make_sender(cfg) as sender, OverwrittenWhileApplying(run_id, delta=True) as rx:
        sender.push(versions[0], 0)
        assert rx.pull()[0] == 0
        sender.push(versions[1], 1)
        rx.writer = lambda: [sender.push(versions[v], v) for v in (2, 3)]
        assert rx.pull() is None  # version 1 was overwritten by 3: nothing to build 3 on
        assert (rx.refused, rx.keyframe_requests) == (0, 1)
        assert sender.push(versions[4], 4).keyframe
        version, got = rx.pull()
        assert version == 4 and got["w"].tobytes() == versions[4]["w"].tobytes() and rx.refused == 0


def test_push_that_fails_midway_is_never_shown_and_the_next_push_works(run_id, monkeypatch):
    import weight_sync.shm as shm

    cfg = SyncConfig(run_id=run_id, transport="shm", delta=False)
    sender, receiver = make_sender(cfg), make_receiver(cfg)
    with sender, receiver:
        sender.push({"w": np.full(1000, 1.0, np.float32)}, 1)
        real_write = shm.encode_payload_into

        def write_half_then_fail(dst, manifest, blobs):
            scratch = np.zeros(shm.payload_nbytes(manifest), np.uint8)
            total = real_write(scratch, manifest, blobs)
            dst[: total // 2] = scratch[: total // 2]
            raise OSError("disk on fire")

        monkeypatch.setattr(shm, "encode_payload_into", write_half_then_fail)
        with pytest.raises(OSError):
            sender.push({"w": np.full(1000, 2.0, np.float32)}, 2)
        monkeypatch.undo()
        version, got = receiver.pull()
        assert version == 1 and (got["w"] == 1.0).all()
        sender.push({"w": np.full(1000, 3.0, np.float32)}, 3)  # rewrites the buffer the failed push left odd
        version, got = receiver.pull()
        assert version == 3 and (got["w"] == 3.0).all()


def test_a_push_refused_for_lack_of_shared_memory_leaves_the_sender_usable(run_id, monkeypatch):
    import types

    cfg = SyncConfig(run_id=run_id, transport="shm", delta=False)
    sender, receiver = make_sender(cfg), make_receiver(cfg)
    with sender, receiver:
        sender.push({"w": np.full(1000, 1.0, np.float32)}, 1)
        sender.push({"w": np.full(1000, 2.0, np.float32)}, 2)  # both buffers mapped
        monkeypatch.setattr(os, "statvfs", lambda path: types.SimpleNamespace(f_bavail=256, f_frsize=4096))  # 1 MiB
        with pytest.raises(OSError, match="GB free"):
            sender.push({"w": np.zeros(1 << 20, np.float32)}, 3)  # would grow version 1's buffer to 4 MiB
        monkeypatch.undo()
        assert receiver.pull()[0] == 2
        sender.push({"w": np.full(1000, 4.0, np.float32)}, 4)  # fits the buffer whose grow was refused
        version, got = receiver.pull()
        assert version == 4 and (got["w"] == 4.0).all()


def _open_files(run_id: str) -> list[str]:
    """What this process holds open of the run's segments (descriptors, and the ones behind its mappings)."""
    names = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
        except FileNotFoundError:
            pass  # the descriptor listdir read through
    return [n for n in names if f"rlloop_{run_id}_" in n]


def test_a_sender_dropped_without_close_removes_its_segments_and_lock(run_id):
    """A worker that rebuilds its sender drops the old one: once collected, its segments must not stay behind to
    outlive the process, nor its lock and mappings stay open."""
    import gc

    sender = make_sender(SyncConfig(run_id=run_id, transport="shm", delta=False))
    sender.push({"w": np.ones(4, np.float32)}, 0)
    assert len(_segments(run_id)) == 2 and _open_files(run_id)
    del sender
    gc.collect()
    assert _segments(run_id) == [] and _open_files(run_id) == []


def test_a_new_writer_waits_out_another_process_s_slow_sweep_of_the_dead_one(run_id, private_shm):
    """A writer restarting after a SIGKILL can find another process's sweep holding the dead writer's lock. On a
    loaded host that sweep may be descheduled for tens of milliseconds with the name still there: the new writer was
    refused as if the dead one were alive after 30 ms."""
    import threading

    from weight_sync.shm import _lock_if_dead

    proc = start_writer(run_id, "wait")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    lock = _lock_if_dead(segment_path(run_id, "ctl"))  # the other process's sweep, from here
    assert lock is not None

    def finish_the_sweep_late() -> None:
        time.sleep(0.3)
        for part in ("buf0", "buf1", "ctl"):
            segment_path(run_id, part).unlink(missing_ok=True)
        os.close(lock)

    sweep = threading.Thread(target=finish_the_sweep_late)
    sweep.start()
    try:
        with make_sender(SyncConfig(run_id=run_id, transport="shm", delta=False)) as sender:
            sender.push({"w": np.full(8, 4.0, np.float32)}, 1)
            with make_receiver(SyncConfig(run_id=run_id, transport="shm", delta=False)) as receiver:
                version, got = receiver.pull()
                assert version == 1 and (got["w"] == 4.0).all()
    finally:
        sweep.join()
    assert _segments(run_id) == []


def test_a_sweep_spares_a_writer_that_replaced_the_dead_one_meanwhile(run_id, private_shm, monkeypatch):
    """A sweep opens a dead writer's control segment; before it takes the lock, a new writer of the run removes the
    dead one's segments (its own sweep) and starts. The first sweep must not then remove the new writer's by name."""
    import fcntl

    proc = start_writer(run_id, "wait")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    ctl, real_flock, new = str(segment_path(run_id, "ctl")), fcntl.flock, []

    def flock_after_a_new_writer_started(fd, op):
        if op & fcntl.LOCK_NB and os.readlink(f"/proc/self/fd/{fd}") == ctl:
            monkeypatch.undo()  # once: from here on (the new writer's sweep too) the real flock
            new.append(make_sender(SyncConfig(run_id=run_id, transport="shm", delta=False)))
            new[0].push({"w": np.full(8, 5.0, np.float32)}, 5)
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock_after_a_new_writer_started)
    try:
        assert run_id not in remove_stale_segments() and len(new) == 1
        with make_receiver(SyncConfig(run_id=run_id, transport="shm", delta=False)) as receiver:
            version, got = receiver.pull()
            assert version == 5 and (got["w"] == 5.0).all()
    finally:
        for sender in new:
            sender.close()
    assert _segments(run_id) == []


def test_a_version_larger_than_the_free_shared_memory_is_refused_before_any_write(run_id):
    """Rather than a SIGBUS at some write through the map, once tmpfs is found full."""
    st = os.statvfs(SHM_DIR)
    too_big = st.f_bavail * st.f_frsize + (1 << 30)
    path = segment_path(run_id, "buf0")
    try:
        with pytest.raises(OSError, match=r"/dev/shm has .* GB free, and this weight version needs .* GB more"):
            _map(path, too_big, create=True)
        assert path.stat().st_size == 0  # nothing reserved
        m = _map(path, 1 << 20)  # what fits is reserved and mapped
        assert len(m) == 1 << 20 and os.stat(path).st_blocks * 512 >= 1 << 20
        m.close()
    finally:
        path.unlink(missing_ok=True)


def test_of_two_senders_starting_at_once_the_second_to_publish_is_refused(run_id, monkeypatch):
    """Both pass the "no live sender" check; the one whose control segment lands second must fail, not replace the
    first's (two live senders of one run, each receiver following whichever wrote last)."""
    real_ftruncate, first = os.ftruncate, []

    def another_starts_meanwhile(fd, size):
        if not first:
            monkeypatch.undo()
            first.append(make_sender(SyncConfig(run_id=run_id, transport="shm", delta=False)))
        return real_ftruncate(fd, size)

    monkeypatch.setattr(os, "ftruncate", another_starts_meanwhile)
    try:
        with pytest.raises(ValueError, match="already has a live shm sender"):
            make_sender(SyncConfig(run_id=run_id, transport="shm", delta=False))
        first[0].push({"w": np.full(8, 1.0, np.float32)}, 1)
        with make_receiver(SyncConfig(run_id=run_id, transport="shm", delta=False)) as receiver:
            version, got = receiver.pull()
            assert version == 1 and (got["w"] == 1.0).all()
            with pytest.raises(ValueError, match="read-only"):  # shared by every receiver of the host
                got["w"][0] = 2.0
    finally:
        for sender in first:
            sender.close()
    assert _segments(run_id) == [] and not list(SHM_DIR.glob(f"rlloop_{run_id}_*"))


def test_a_sender_reserves_both_buffers_at_the_start_or_says_the_shared_memory_is_too_small(run_id):
    """A /dev/shm too small for the run fails when the trainer starts, not at its second push."""
    st = os.statvfs(SHM_DIR)
    with make_sender(SyncConfig(run_id=run_id, transport="shm", delta=False)) as sender:
        with pytest.raises(OSError, match=r"/dev/shm has .* GB free, and this weight version needs"):
            sender.reserve(st.f_bavail * st.f_frsize + (1 << 30))
        sender.reserve(1 << 20)
        assert len(_segments(run_id)) == 3  # the control segment and both buffers
        reserved = [os.stat(segment_path(run_id, f"buf{i}")).st_blocks * 512 for i in (0, 1)]
        assert min(reserved) >= 1 << 20
        for version in (1, 2):  # versions of about that size fit what was reserved: no remap
            sender.push({"w": np.full((1 << 20) // 4 - 64, version, np.float32)}, version)
        assert [os.stat(segment_path(run_id, f"buf{i}")).st_blocks * 512 for i in (0, 1)] == reserved


def test_a_sender_refused_at_its_start_leaves_the_live_senders_buffers(run_id, monkeypatch):
    """A second sender that missed the live one's control segment in its check removed the live one's buffers before
    it was refused: the live one went on writing into unlinked pages, and a receiver that started later (a restarted
    engine) never saw a version again."""
    live = make_sender(SyncConfig(run_id=run_id, transport="shm", delta=False))
    try:
        live.push({"w": np.full(8, 1.0, np.float32)}, 1)
        ctl, real_exists = segment_path(run_id, "ctl"), Path.exists
        monkeypatch.setattr(Path, "exists", lambda p: False if p == ctl else real_exists(p))  # the check misses it
        with pytest.raises(ValueError, match="already has a live shm sender"):
            make_sender(SyncConfig(run_id=run_id, transport="shm", delta=False))
        monkeypatch.undo()
        for version in (2, 3):  # 3 goes to version 1's buffer, which the refused sender removed
            live.push({"w": np.full(8, float(version), np.float32)}, version)
        with make_receiver(SyncConfig(run_id=run_id, transport="shm", delta=False)) as late:
            assert late.pull() is not None, "a receiver started after the refusal sees no version"
            assert late.version == 3
    finally:
        live.close()
