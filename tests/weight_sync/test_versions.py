"""Which version a receiver takes, and what a sender sends: deltas on the last version pushed (across gaps in the
numbering), keyframes when a delta cannot be built or is asked for (a forced one and a request answered by one), a
restarted sender's numbers taken afresh, `pull(at_most=)`, and a bool never a version."""

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
