"""The disk transport: a version is a directory published by a rename, read by any process, pruned to `keep`, and
what a killed or replaced writer left is removed or passed over; its files are its owner's alone."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.weight_sync.conftest import transport_pair


def test_disk_receiver_applies_a_chain_of_deltas(run_id, tmp_path):
    """A receiver that missed versions catches up through the retained deltas without asking for a keyframe."""
    sender, receiver = transport_pair("disk", run_id, tmp_path, delta=True, keep=4)
    w = np.arange(1000, dtype=np.float32)
    sender.push({"w": w}, 0)
    assert receiver.pull()[0] == 0
    for v in (1, 2, 3):
        w = w.copy()
        w[v * 10] = -v
        assert not sender.push({"w": w}, v).keyframe
    version, got = receiver.pull()
    assert version == 3 and got["w"].tobytes() == w.tobytes() and receiver.keyframe_requests == 0


def test_disk_versions_past_twelve_digits_are_read(run_id, tmp_path):
    sender, receiver = transport_pair("disk", run_id, tmp_path)
    with sender, receiver:
        for version in (10**12 - 1, 10**12):
            sender.push({"w": np.full(3, version % 7, np.float32)}, version)
            assert receiver.pull()[0] == version


def test_a_disk_version_gone_stale_on_nfs_is_pruned_not_corrupt(run_id, tmp_path, monkeypatch):
    """Another host's prune shows up on NFS as ESTALE, not FileNotFoundError: a newer version exists, the read is
    not refused (which would remember a good version as bad)."""
    import errno

    sender, receiver = transport_pair("disk", run_id, tmp_path)
    with sender, receiver:
        sender.push({"w": np.zeros(3, np.float32)}, 1)
        read_bytes = Path.read_bytes

        def stale(path):
            if path.name == "manifest.json":
                raise OSError(errno.ESTALE, "Stale file handle", str(path))
            return read_bytes(path)

        monkeypatch.setattr(Path, "read_bytes", stale)
        assert receiver.pull() is None and receiver.refused == 0
        monkeypatch.setattr(Path, "read_bytes", read_bytes)
        assert receiver.pull()[0] == 1


def test_disk_prunes_old_versions(run_id, tmp_path):
    sender, receiver = transport_pair("disk", run_id, tmp_path, keep=2)
    for v in range(5):
        sender.push({"w": np.full(4, v, np.int32)}, v)
    kept = sorted(p.name for p in (tmp_path / run_id).iterdir() if p.name.startswith("v"))
    assert kept == ["v000000000003", "v000000000004"]
    assert receiver.pull()[1]["w"].tolist() == [4] * 4


def test_a_closed_disk_sender_leaves_no_versions_behind_unless_another_took_over(run_id, tmp_path):
    """Each version is a copy of the model, and no later sender reads them (it starts a new epoch): a finished run
    left its last two, up to 16 GB for a 4B model in bf16."""
    sender, _ = transport_pair("disk", run_id, tmp_path)
    sender.push({"w": np.zeros(4, np.int32)}, 1)
    successor, _ = transport_pair("disk", run_id, tmp_path)  # a rebuilt trainer's, before the old one's close ran
    successor.push({"w": np.ones(4, np.int32)}, 1)
    sender.close()
    assert [p.name for p in (tmp_path / run_id).iterdir() if p.name.startswith("v")] == ["v000000000001"]
    successor.close()
    assert not (tmp_path / run_id).exists()


def test_a_replaced_disk_sender_cannot_publish_and_its_versions_are_passed_over(run_id, tmp_path):
    """Two senders of one directory (a rebuilt trainer's beside the dead one's, or two runs with the same run id and
    sync dir): the replaced one's pushes fail, and a version it renamed into place before it could notice is never
    loaded, nor does it stand in the way of the current sender's lower-numbered versions (it held every receiver
    until the new numbering passed it, and took a place among those kept)."""
    first, receiver = transport_pair("disk", run_id, tmp_path)
    first.push({"w": np.full(8, 1.0, np.float32)}, 1)
    second, _ = transport_pair("disk", run_id, tmp_path)
    second.push({"w": np.full(8, 2.0, np.float32)}, 1)
    with pytest.raises(RuntimeError, match="another weight sender took .* over"):
        first.push({"w": np.full(8, 3.0, np.float32)}, 5)
    versions = lambda: sorted(p.name for p in (tmp_path / run_id).iterdir() if p.name.startswith("v"))  # noqa: E731
    assert versions() == ["v000000000001"]
    # the race the check cannot close: the first sender's rename lands just after the second took over
    first._check_still_writer = lambda: None
    first.push({"w": np.full(8, 3.0, np.float32)}, 5)
    version, got = receiver.pull()
    assert version == 1 and (got["w"] == 2.0).all() and receiver.refused == 0
    for v in (2, 3):
        second.push({"w": np.full(8, float(v), np.float32)}, v)
        version, got = receiver.pull()
        assert version == v and (got["w"] == v).all()
    assert versions() == ["v000000000002", "v000000000003"]  # the slipped-in one removed, keep=2 of the second's
    second.close()


def test_disk_push_that_fails_midway_leaves_nothing_and_the_version_can_be_pushed_again(run_id, tmp_path, monkeypatch):
    """A full disk mid-write: the receiver keeps the last version, nothing half-written stays in the directory, and
    pushing the same version again works (its leftover temporary directory blocked it)."""
    import weight_sync.disk as disk

    sender, receiver = transport_pair("disk", run_id, tmp_path)
    sender.push({"w": np.full(1000, 1.0, np.float32)}, 1)
    receiver.pull()

    def write_half_then_fail(tensors, path):
        open(path, "wb").write(b"\0" * 100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk, "save_file", write_half_then_fail)
    with pytest.raises(OSError):
        sender.push({"w": np.full(1000, 2.0, np.float32)}, 2)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / run_id).iterdir() if p.name.startswith((".tmp-v", "v"))) == [
        "v000000000001"
    ]
    assert receiver.pull() is None  # nothing newer than what it has
    sender.push({"w": np.full(1000, 2.0, np.float32)}, 2)
    version, got = receiver.pull()
    assert version == 2 and (got["w"] == 2.0).all()


def test_disk_refuses_a_tensor_named_like_the_safetensors_metadata(run_id, tmp_path):
    """safetensors keeps its metadata under "__metadata__": a tensor of that name would be pushed but never pulled."""
    sender, receiver = transport_pair("disk", run_id, tmp_path)
    with sender, receiver:
        with pytest.raises(ValueError, match="'__metadata__' is reserved by safetensors"):
            sender.push({"__metadata__": np.ones(3, np.float32), "w": np.zeros(3, np.float32)}, 0)
        assert receiver.pull() is None and sender.version is None  # nothing was published
        sender.push({"w": np.zeros(3, np.float32)}, 0)
        assert receiver.pull()[0] == 0


def test_a_new_disk_sender_removes_what_a_killed_one_left_half_written(run_id, tmp_path):
    """A writer killed mid-push (SIGKILL, OOM) leaves its .tmp- directory: a copy of the model that nobody will rename
    into place. The next sender of the run removes it (and the dead one's versions), and never shows it."""
    script = (
        "import os, signal, sys, numpy as np, weight_sync.disk as disk\n"
        "from weight_sync import SyncConfig, make_sender\n"
        "s = make_sender(SyncConfig(run_id=sys.argv[2], transport='disk', dir=sys.argv[1], delta=False))\n"
        "s.push({'w': np.ones(1000, np.float32)}, 1)\n"
        "def killed(tensors, path):\n"
        "    open(path, 'wb').write(b'\\0' * 100)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "disk.save_file = killed\n"
        "s.push({'w': np.full(1000, 2.0, np.float32)}, 2)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path), run_id], cwd=Path(__file__).resolve().parents[2], timeout=120
    )
    assert p.returncode == -signal.SIGKILL
    left = lambda: sorted(n for n in os.listdir(tmp_path / run_id) if n.startswith((".tmp-", "v")))  # noqa: E731
    assert left()[0].startswith(".tmp-v000000000002-") and left()[1:] == ["v000000000001"]  # what the kill left
    sender, receiver = transport_pair("disk", run_id, tmp_path)
    with sender, receiver:
        assert left() == [] and receiver.pull() is None
        sender.push({"w": np.full(1000, 3.0, np.float32)}, 1)
        assert left() == ["v000000000001"]
        version, got = receiver.pull()
        assert version == 1 and (got["w"] == 3.0).all()


def test_disk_sync_bytes_are_the_version_s_files(run_id, tmp_path):
    """sync/bytes is what a version costs the transport: for disk, both files of its directory (weights and
    manifest); a delta's are far fewer than full_bytes."""
    sender, receiver = transport_pair("disk", run_id, tmp_path, delta=True, keyframe_every=100)
    w = np.arange(4096, dtype=np.float32)
    with sender, receiver:
        for version in (0, 1):
            w = w.copy()
            w[version] = -1.0
            stats = sender.push({"w": w}, version)
            assert stats.keyframe == (version == 0)
            files = list((tmp_path / run_id / f"v{version:012d}").iterdir())
            assert sorted(f.name for f in files) == ["manifest.json", "weights.safetensors"]
            assert stats.metrics()["sync/bytes"] == sum(f.stat().st_size for f in files)
        assert stats.bytes < stats.full_bytes / 10
