"""Which version a receiver takes, and what a sender sends: deltas on the last version pushed (across gaps in the
numbering), keyframes when a delta cannot be built or is asked for (a forced one and a request answered by one), a
restarted sender's numbers taken afresh, `pull(at_most=)`, and a bool never a version."""

from pathlib import Path

import numpy as np
import pytest

from tests.weight_sync.conftest import transport_pair
from weight_sync import TRANSPORTS, SyncConfig, make_receiver, make_sender


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_restarted_sender_starts_a_new_epoch(transport, run_id, tmp_path):
    """A resumed run pushes lower version numbers than the crashed one: receivers must follow, not ignore them."""
    sender, receiver = transport_pair(transport, run_id, tmp_path, delta=True)
    sender.push({"w": np.full(100, 57, np.int32)}, 57)
    assert receiver.pull()[0] == 57
    sender.close()
    resumed = make_sender(SyncConfig(run_id=run_id, transport=transport, dir=tmp_path, delta=True))
    with resumed, receiver:
        resumed.push({"w": np.full(100, 40, np.int32)}, 40)
        version, got = receiver.pull()
        assert version == 40 and (got["w"] == 40).all()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_late_receiver_gets_a_forced_keyframe(transport, run_id, tmp_path):
    """A restarted engine joins with no base: force_keyframe makes the next push one it can load on its own."""
    sender, first = transport_pair(transport, run_id, tmp_path, delta=True)
    w = np.arange(1000, dtype=np.float32)
    with sender, first:
        sender.push({"w": w}, 0)
        w = w.copy()
        w[3] = -3
        assert not sender.push({"w": w}, 1).keyframe
        late = make_receiver(SyncConfig(run_id=run_id, transport=transport, dir=tmp_path, delta=True))
        with late:
            sender.force_keyframe()
            w = w.copy()
            w[4] = -4
            assert sender.push({"w": w}, 2).keyframe
            version, got = late.pull()
            assert version == 2 and got["w"].tobytes() == w.tobytes() and late.keyframe_requests == 0
            w = w.copy()
            w[5] = -5
            assert not sender.push({"w": w}, 3).keyframe  # one forced keyframe, then deltas again
            assert late.pull()[1]["w"].tobytes() == w.tobytes()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_delta_after_a_gap_in_versions_builds_on_the_last_version_pushed(transport, run_id, tmp_path):
    """Versions have gaps (a step whose update was skipped pushes nothing): the delta after a gap is computed against
    the last version pushed and names it as its base, so a receiver holding that version applies it at once, without
    a keyframe request (a base of `version - 1`, never published, would cost one keyframe per gap)."""
    sender, receiver = transport_pair(transport, run_id, tmp_path, delta=True, keyframe_every=100)
    w = np.arange(1000, dtype=np.float32)
    with sender, receiver:
        sender.push({"w": w}, 3)
        assert receiver.pull()[0] == 3
        for version in (5, 9, 10):
            w = w.copy()
            w[version] = -version
            assert not sender.push({"w": w}, version).keyframe
            got = receiver.pull()
            assert got is not None, f"version {version}, a delta on the version the receiver holds, was not applied"
            assert got[0] == version and got[1]["w"].tobytes() == w.tobytes()
        assert receiver.keyframe_requests == 0 and receiver.refused == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_bool_is_not_a_version(transport, run_id, tmp_path):
    """True == 1 in Python: a flag passed where the step goes must be refused, not published as version 1."""
    sender, receiver = transport_pair(transport, run_id, tmp_path)
    with sender, receiver:
        for bad in (True, False, np.bool_(True)):
            with pytest.raises(ValueError, match="version must be a non-negative int"):
                sender.push({"w": np.zeros(3, np.float32)}, bad)
        assert receiver.pull() is None and sender.version is None  # nothing was published
        sender.push({"w": np.zeros(3, np.float32)}, np.int64(0))  # a numpy integer is a version
        assert receiver.pull()[0] == 0


def test_a_restarted_sender_s_versions_are_not_held_against_it(run_id, tmp_path):
    """A resumed run numbers its versions afresh: a number the receiver refused (a corrupt file of the crashed run), or
    was waiting on for a keyframe, names another version now, which the receiver must load."""

    def flip(path: Path, pos: int) -> None:
        data = bytearray(path.read_bytes())
        data[pos] ^= 0xFF
        path.write_bytes(bytes(data))

    w = np.arange(1000, dtype=np.float32)
    sender, receiver = transport_pair("disk", run_id, tmp_path, delta=True, keep=1)
    sender.push({"w": w}, 1)
    assert receiver.pull()[0] == 1
    sender.push({"w": w + 1}, 2)  # everything changed: a keyframe
    flip(tmp_path / run_id / "v000000000002" / "weights.safetensors", 200)
    assert receiver.pull() is None and receiver.refused == 1
    sender.close()
    resumed, _ = transport_pair("disk", run_id, tmp_path, delta=True, keep=1)
    resumed.push({"w": w + 2}, 2)
    got = receiver.pull()
    assert got is not None and got[0] == 2 and (got[1]["w"] == w + 2).all(), (
        "the new sender's version 2 was passed over"
    )
    # now the receiver waits for a keyframe after version 4 (the delta chain from 2 to 4 lost version 3 to keep=1)
    asked = receiver.keyframe_requests
    for v in (3, 4):
        w = w.copy()
        w[v] = -v
        assert not resumed.push({"w": w + 2}, v).keyframe
    assert receiver.pull() is None and receiver.keyframe_requests == asked + 1
    resumed.close()
    again, _ = transport_pair("disk", run_id, tmp_path, delta=True, keep=1)
    with again, receiver:
        again.push({"w": w + 3}, 4)
        got = receiver.pull()
        assert got is not None and got[0] == 4, "the newest sender's version 4 was passed over"
        assert (got[1]["w"] == w + 3).all()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_dtype_change_is_sent_as_a_keyframe_though_the_shapes_stay(transport, run_id, tmp_path):
    """A delta carries raw bits for the receiver's tensor of the same dtype: a tensor whose dtype changed (same shape)
    has no base to diff against, so the push is a keyframe, and the receiver loads it without refusing anything."""
    sender, receiver = transport_pair(transport, run_id, tmp_path, delta=True, keyframe_every=100)
    big = np.arange(4096, dtype=np.float32)  # unchanged: the delta alone would be small
    with sender, receiver:
        sender.push({"big": big, "w": np.arange(8, dtype=np.float32)}, 0)
        assert receiver.pull()[0] == 0
        retyped = {"big": big, "w": np.arange(8, dtype=np.int32)}
        assert sender.push(retyped, 1).keyframe
        version, got = receiver.pull()
        assert version == 1 and receiver.refused == 0 and receiver.keyframe_requests == 0
        assert got["w"].dtype == np.int32 and got["w"].tolist() == list(range(8))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_keyframe_request_and_a_forced_keyframe_together_cost_one_keyframe(transport, run_id, tmp_path):
    """A receiver's request and force_keyframe (a restarted engine) pending at the same push: that keyframe answers
    both; the request must not stay pending and turn the next push into a keyframe as well."""
    sender, receiver = transport_pair(transport, run_id, tmp_path, delta=True, keyframe_every=100)
    w = np.arange(4096, dtype=np.float32)
    with sender, receiver:
        sender.push({"w": w}, 0)
        _, got = receiver.pull()
        got["w"][5] = -1.0  # the receiver's base no longer matches: the next delta is refused and a keyframe asked for
        w = w.copy()
        w[100] = 7.0
        assert not sender.push({"w": w}, 1).keyframe
        assert receiver.pull() is None and receiver.keyframe_requests == 1
        sender.force_keyframe()
        w = w.copy()
        w[200] = 8.0
        assert sender.push({"w": w}, 2).keyframe
        assert receiver.pull()[1]["w"].tobytes() == w.tobytes()
        w = w.copy()
        w[300] = 9.0
        assert not sender.push({"w": w}, 3).keyframe, "the request answered by version 2 was still pending"
        assert receiver.pull()[1]["w"].tobytes() == w.tobytes()


def test_the_default_sync_config_sends_deltas_between_keyframes(run_id):
    """By default (the YAML's sync: section too) a push after the first sends only what changed: a keyframe every
    keyframe_every pushes, deltas between them, which the default receiver applies."""
    cfg = SyncConfig(run_id=run_id)
    sender, receiver = make_sender(cfg), make_receiver(cfg)
    w = np.arange(4096, dtype=np.float32)
    with sender, receiver:
        for version in range(cfg.keyframe_every + 1):
            w = w.copy()
            w[version] = -1.0
            stats = sender.push({"w": w}, version)
            assert stats.keyframe == (version % cfg.keyframe_every == 0), version
            got = receiver.pull()
            assert got[0] == version and got[1]["w"].tobytes() == w.tobytes()
        assert receiver.keyframe_requests == 0 and receiver.refused == 0
