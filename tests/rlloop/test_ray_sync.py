"""The Ray object-store transport: same protocol as shm/disk, bit-exact, keyframe requests through the mailbox."""

import uuid

import ml_dtypes
import numpy as np
import pytest

ray = pytest.importorskip("ray")

from rlloop.ray_sync import get_mailbox, make_ray_receiver, make_ray_sender  # noqa: E402
from weight_sync import Sender, SyncConfig, encode_payload_into, payload_nbytes  # noqa: E402

pytestmark = pytest.mark.xdist_group("ray")  # starts Ray: one at a time (tests/conftest.py)


@pytest.fixture
def run_id():
    return f"raytest-{uuid.uuid4().hex[:8]}"


def _weights(rng, n=4096):
    return {
        "model.embed_tokens.weight": rng.standard_normal((n // 64, 64)).astype(ml_dtypes.bfloat16),
        "model.norm.weight": np.concatenate([[np.nan, -0.0, np.inf], rng.standard_normal(61)]).astype(np.float32),
        "counter": np.arange(5, dtype=np.int64),
    }


def _step(w, rng, k=20):
    w = {n: a.copy() for n, a in w.items()}
    emb = w["model.embed_tokens.weight"].reshape(-1)
    emb[rng.integers(0, emb.size, k)] = rng.standard_normal(k).astype(ml_dtypes.bfloat16)
    return w


def _same_bits(got, want):
    return got.keys() == want.keys() and all(
        got[n].tobytes() == a.tobytes() and got[n].dtype == a.dtype for n, a in want.items()
    )


def test_ray_round_trip_with_deltas_bit_exact(ray_cluster, run_id):
    rng = np.random.default_rng(0)
    sender = make_ray_sender(SyncConfig(run_id=run_id, transport="ray", delta=True, keyframe_every=3))
    receiver = make_ray_receiver(SyncConfig(run_id=run_id, transport="ray", delta=True))
    assert receiver.pull() is None
    w = _weights(rng)
    for v in range(5):
        stats = sender.push(w, v)
        assert stats.keyframe == (v % 3 == 0)
        if not stats.keyframe:
            assert stats.bytes < stats.full_bytes / 5
        version, got = receiver.pull()
        assert version == v and _same_bits(got, w)
        w = _step(w, rng)
    assert receiver.refused == 0 and receiver.keyframe_requests == 0


@ray.remote(num_cpus=0)
def _pull_in_another_process(run_id):
    import os

    receiver = make_ray_receiver(SyncConfig(run_id=run_id, transport="ray", delta=False))
    version, got = receiver.pull()
    return os.getpid(), version, {n: (a.dtype.str, a.tobytes()) for n, a in got.items()}


def test_ray_receiver_in_another_process(ray_cluster, run_id):
    import os

    rng = np.random.default_rng(1)
    w = _weights(rng)
    # held: the mailbox actor lives as long as its creator's handle
    sender = make_ray_sender(SyncConfig(run_id=run_id, transport="ray", delta=False))
    sender.push(w, 7)
    pid, version, got = ray.get(_pull_in_another_process.remote(run_id))
    assert pid != os.getpid() and version == 7
    assert {n: (a.dtype.str, a.tobytes()) for n, a in w.items()} == got


def test_ray_keyframe_request_reaches_sender_and_is_answered_once(ray_cluster, run_id):
    """A receiver that missed a delta's base asks for a keyframe; the mailbox hands the request to the sender once:
    after the keyframe that answers it, the sender goes back to deltas (a request never cleared made every later
    push a full keyframe)."""
    rng = np.random.default_rng(2)
    sender = make_ray_sender(SyncConfig(run_id=run_id, transport="ray", delta=True, keyframe_every=100, keep=1))
    receiver = make_ray_receiver(SyncConfig(run_id=run_id, transport="ray", delta=True))
    w = _weights(rng)
    sender.push(w, 0)
    receiver.pull()
    for v in (1, 2):  # missed: only the newest is kept, and it is a delta on top of version 1
        w = _step(w, rng)
        assert not sender.push(w, v).keyframe
    assert receiver.pull() is None and receiver.keyframe_requests == 1
    w = _step(w, rng)
    assert sender.push(w, 3).keyframe
    version, got = receiver.pull()
    assert version == 3 and _same_bits(got, w)
    for v in (4, 5):
        w = _step(w, rng)
        stats = sender.push(w, v)
        assert not stats.keyframe and stats.bytes < stats.full_bytes / 5
        version, got = receiver.pull()
        assert version == v and _same_bits(got, w)
    assert receiver.keyframe_requests == 1


def test_ray_corrupt_payload_is_refused_and_previous_kept(ray_cluster, run_id):
    rng = np.random.default_rng(3)
    sender = make_ray_sender(SyncConfig(run_id=run_id, transport="ray", delta=False))
    receiver = make_ray_receiver(SyncConfig(run_id=run_id, transport="ray", delta=False))
    w0 = _weights(rng)
    sender.push(w0, 0)
    assert receiver.pull()[0] == 0
    w1 = _step(w0, rng)
    manifest, blobs = Sender()._encode(w1, 1)[:2]
    payload = np.empty(payload_nbytes(manifest), np.uint8)
    encode_payload_into(payload, manifest, blobs)
    payload[payload.nbytes // 2] ^= 0x10  # a flipped byte in the tensor data, posted as version 1
    ray.get(get_mailbox(run_id).post.remote(sender._writer, 1, [ray.put(payload)]))
    assert receiver.pull() is None and receiver.refused == 1 and receiver.version == 0
    sender.push(w1, 2)
    version, got = receiver.pull()
    assert version == 2 and _same_bits(got, w1)


def test_a_replaced_ray_sender_cannot_publish_and_receivers_keep_the_new_ones_versions(ray_cluster, run_id):
    """Two senders of one run id (a rebuilt trainer's beside the dead one's, or two runs given the same run.dir in one
    Ray cluster): the replaced one's pushes must fail, not land in the new one's receivers."""
    first = make_ray_sender(SyncConfig(run_id=run_id, transport="ray", delta=False))
    receiver = make_ray_receiver(SyncConfig(run_id=run_id, transport="ray", delta=False))
    first.push({"w": np.full(8, 1.0, np.float32)}, 1)
    second = make_ray_sender(SyncConfig(run_id=run_id, transport="ray", delta=False))
    second.push({"w": np.full(8, 2.0, np.float32)}, 1)
    with pytest.raises(RuntimeError, match="another weight sender took run .* over"):
        first.push({"w": np.full(8, 3.0, np.float32)}, 5)
    version, got = receiver.pull()
    assert version == 1 and (got["w"] == 2.0).all()


def test_ray_bad_arguments(ray_cluster):
    with pytest.raises(ValueError, match="keep"):
        make_ray_sender(SyncConfig(run_id="x", transport="ray", delta=False, keep=0))
    with pytest.raises(ValueError, match="run_id"):
        make_ray_receiver(SyncConfig(run_id="", transport="ray", delta=False))


def test_ray_restarted_sender_starts_a_new_epoch(ray_cluster, run_id):
    first = make_ray_sender(SyncConfig(run_id=run_id, transport="ray", delta=True))
    receiver = make_ray_receiver(SyncConfig(run_id=run_id, transport="ray", delta=True))
    first.push({"w": np.full(10, 57, np.int32)}, 57)
    assert receiver.pull()[0] == 57
    # e.g. a resumed run, numbering from its checkpoint
    resumed = make_ray_sender(SyncConfig(run_id=run_id, transport="ray", delta=True))
    resumed.push({"w": np.full(10, 40, np.int32)}, 40)
    version, got = receiver.pull()
    assert version == 40 and (got["w"] == 40).all()


def test_ray_pull_of_at_most_a_version_applies_its_delta_though_a_newer_one_is_out(ray_cluster, run_id):
    rng = np.random.default_rng(0)
    sender = make_ray_sender(SyncConfig(run_id=run_id, transport="ray", delta=True, keyframe_every=10))
    receiver = make_ray_receiver(SyncConfig(run_id=run_id, transport="ray", delta=True))
    states = [_weights(rng)]
    states += [_step(states[-1], rng) for _ in range(2)]
    sender.push(states[0], 0)
    assert receiver.pull(at_most=0)[0] == 0
    assert not sender.push(states[1], 1).keyframe and not sender.push(states[2], 2).keyframe
    version, got = receiver.pull(at_most=1)
    assert version == 1 and _same_bits(got, states[1])
    version, got = receiver.pull()
    assert version == 2 and _same_bits(got, states[2])


def test_ray_pull_of_at_most_an_unpublished_version_loads_the_newest_below_it(ray_cluster, run_id):
    """Versions have gaps (a step whose update was skipped pushes nothing): at_most may name one never published."""
    rng = np.random.default_rng(0)
    sender = make_ray_sender(SyncConfig(run_id=run_id, transport="ray", delta=True))
    receiver = make_ray_receiver(SyncConfig(run_id=run_id, transport="ray", delta=True))
    states = [_weights(rng)]
    states.append(_step(states[0], rng))
    sender.push(states[0], 3)
    assert not sender.push(states[1], 5).keyframe
    version, got = receiver.pull(at_most=4)
    assert version == 3 and _same_bits(got, states[0])
    version, got = receiver.pull()
    assert version == 5 and _same_bits(got, states[1])
