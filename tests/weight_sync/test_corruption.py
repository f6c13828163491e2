"""Flipping any single byte of a version makes the receiver refuse it and keep the weights it had."""

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import xxhash

from weight_sync import (
    CorruptVersion,
    Sender,
    SyncConfig,
    decode_payload,
    encode_payload_into,
    make_receiver,
    make_sender,
    payload_nbytes,
)
from weight_sync.checksum import checksum


def _flip(path: Path, pos: int, rng) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ int(rng.integers(1, 256))]))


def _weights(v: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(v)
    return {
        "embed.weight": rng.standard_normal((4, 8)).astype(ml_dtypes.bfloat16),
        "norm.weight": rng.standard_normal(8).astype(np.float32),
        "step": np.array([v, -v], np.int64),
    }


def _keyframe_payload(weights: dict[str, np.ndarray]) -> np.ndarray:
    """`weights` as version 0's flat payload (what the shm and Ray transports carry), in a fresh buffer."""
    manifest, blobs = Sender()._encode(weights, 0)[:2]
    payload = np.empty(payload_nbytes(manifest), np.uint8)
    assert encode_payload_into(payload, manifest, blobs) == payload.nbytes
    return payload


def _latest_shm_payload(run_id: str) -> tuple[Path, int]:
    """The buffer holding the newest version and its payload length, read from the control segment's layout."""
    ctl = np.fromfile(f"/dev/shm/rlloop_{run_id}_ctl", np.uint64, count=16)
    i = int(ctl[2]) - 1
    return Path(f"/dev/shm/rlloop_{run_id}_buf{i}"), int(ctl[(8, 12)[i] + 2])


def test_every_byte_of_a_payload_is_covered():
    """decode_payload (what shm and Ray receivers run) refuses a flip at every position of a keyframe payload."""
    payload = _keyframe_payload(_weights(0))
    decode_payload(payload)  # intact: accepted
    rng = np.random.default_rng(0)
    for pos in range(payload.nbytes):
        bad = payload.copy()
        bad[pos] ^= rng.integers(1, 256, dtype=np.uint8)
        with pytest.raises(CorruptVersion):
            decode_payload(bad)


def test_shm_refuses_flipped_keyframes_and_keeps_previous(run_id):
    rng = np.random.default_rng(1)
    cfg = SyncConfig(run_id=run_id, transport="shm", delta=False)
    sender, receiver = make_sender(cfg), make_receiver(cfg)
    with sender, receiver:
        sender.push(_weights(0), 0)
        assert receiver.pull()[0] == 0
        total = _latest_shm_payload(run_id)[1]
        for i, pos in enumerate(range(0, total, 3)):  # every third byte: headers, manifest, padding, data
            sender.push(_weights(0), i + 1)
            _flip(_latest_shm_payload(run_id)[0], pos, rng)
            assert receiver.pull() is None, f"accepted a flip at byte {pos}"
            assert receiver.refused == i + 1 and receiver.version == 0
        sender.push(_weights(7), 10_000)
        version, got = receiver.pull()
        assert version == 10_000 and all(got[n].tobytes() == a.tobytes() for n, a in _weights(7).items())


def test_shm_delta_flip_is_refused_then_recovered_by_keyframe(run_id):
    """A delta receiver that refuses a version asks for a keyframe at once, and the next push brings it."""
    rng = np.random.default_rng(2)
    sender = make_sender(SyncConfig(run_id=run_id, transport="shm", delta=True, keyframe_every=1_000_000))
    receiver = make_receiver(SyncConfig(run_id=run_id, transport="shm", delta=True))
    with sender, receiver:
        w = _weights(0)
        w["big"] = np.zeros(4096, np.float32)  # makes the delta worth sending
        v = 0
        sender.push(w, v)
        receiver.pull()
        for trial in range(60):
            good = {n: a.copy() for n, a in w.items()}
            w["big"][trial] = trial + 1
            v += 1
            assert not sender.push(w, v).keyframe
            buf, length = _latest_shm_payload(run_id)
            _flip(buf, int(rng.integers(0, length)), rng)
            assert receiver.pull() is None and receiver.version == v - 1
            assert receiver.refused == trial + 1 and receiver.keyframe_requests == trial + 1
            w["big"][trial + 100] = 1
            v += 1
            assert sender.push(w, v).keyframe  # the refusal asked for one: no delta on top of a refused version
            version, got = receiver.pull()
            assert version == v and all(got[n].tobytes() == a.tobytes() for n, a in w.items())
            assert any(got[n].tobytes() != a.tobytes() for n, a in good.items())


@pytest.mark.parametrize("target", ["manifest.json", "weights.safetensors"])
def test_disk_refuses_any_flipped_byte(target, run_id, tmp_path):
    rng = np.random.default_rng(3)
    sender = make_sender(SyncConfig(run_id=run_id, transport="disk", delta=False, dir=tmp_path, keep=1_000_000))
    receiver = make_receiver(SyncConfig(run_id=run_id, transport="disk", delta=False, dir=tmp_path))
    sender.push(_weights(0), 0)
    assert receiver.pull()[0] == 0
    size = (tmp_path / run_id / "v000000000000" / target).stat().st_size
    for i, pos in enumerate(range(size)):
        sender.push(_weights(0), i + 1)
        _flip(tmp_path / run_id / f"v{i + 1:012d}" / target, pos, rng)
        assert receiver.pull() is None, f"accepted a flip at byte {pos} of {target}"
        assert receiver.refused == i + 1 and receiver.version == 0
    sender.push(_weights(5), size + 1)
    version, got = receiver.pull()
    assert version == size + 1 and all(got[n].tobytes() == a.tobytes() for n, a in _weights(5).items())


@pytest.mark.parametrize(
    "field,value",
    [
        ("dtype", "complex64"),
        ("dtype", "object"),
        ("shape", [-4, -8]),
        ("encoding", "xor"),
        ("nbytes", 7),
        ("xxh3", None),
        ("shape", "abc"),
        # the right values as the wrong JSON types: they passed the value checks and raised in slicing or comparing
        ("nbytes", float),
        ("offset", float),
        ("shape", lambda shape: [float(d) for d in shape]),
        ("version", str),
        ("version", bool),
    ],
)
def test_well_framed_but_inconsistent_manifest_is_refused(field, value):
    """A manifest whose checksum is right but whose content is not self-consistent is refused, not crashed on."""
    import json
    import struct

    import xxhash

    payload = _keyframe_payload(_weights(0))
    magic, mlen, _, total = struct.unpack("<8sQQQ", payload[:32].tobytes())
    doc = json.loads(payload[32 : 32 + mlen].tobytes())
    fields = doc if field == "version" else doc["entries"][0]
    fields[field] = value(fields[field]) if callable(value) else value
    tampered = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode().ljust(mlen)
    assert len(tampered) == mlen
    payload[32 : 32 + mlen] = np.frombuffer(tampered, np.uint8)
    payload[:32] = np.frombuffer(
        struct.pack("<8sQQQ", magic, mlen, xxhash.xxh3_64_intdigest(tampered), total), np.uint8
    )
    with pytest.raises(CorruptVersion):
        decode_payload(payload)


@pytest.mark.timeout(60)
def test_a_delta_on_itself_is_refused_not_followed_forever(run_id, tmp_path):
    """A crafted or corrupt manifest whose base is its own version: walking its chain of bases would never end."""
    w = {**_weights(0), "big": np.zeros(4096, np.float32)}  # makes the delta worth sending
    sender = make_sender(SyncConfig(run_id=run_id, transport="disk", dir=tmp_path, delta=True))
    receiver = make_receiver(SyncConfig(run_id=run_id, transport="disk", dir=tmp_path, delta=True))
    sender.push(w, 0)
    assert receiver.pull()[0] == 0
    w["big"][0] = 1
    manifest, blobs = sender._encode(w, 1)[:2]
    assert manifest.base_version == 0
    manifest.base_version = 1
    sender._publish(manifest, blobs)  # well framed, checksums right: only the chain is wrong
    assert receiver.pull() is None and receiver.refused == 1 and receiver.keyframe_requests == 1
    assert sender.push(w, 2).keyframe
    version, got = receiver.pull()
    assert version == 2 and all(got[n].tobytes() == a.tobytes() for n, a in w.items())


def test_a_raw_entry_longer_than_its_tensor_is_refused_though_its_checksums_agree():
    """Crafted: 8 bytes of zero padding more, checksums recomputed; reshape would raise ValueError in pull()."""
    payload = _keyframe_payload(_weights(0))
    magic, mlen, _, total = struct.unpack("<8sQQQ", payload[:32].tobytes())
    doc = json.loads(payload[32 : 32 + mlen].tobytes())
    e = next(e for e in doc["entries"] if e["name"] == "norm.weight")  # float32 (8,): 32 bytes, then zero padding
    data_start = (32 + mlen + 63) // 64 * 64
    e["nbytes"] = 40  # 8 padding bytes more: still inside the zero padding before the next entry
    e["blob_xxh3"] = e["xxh3"] = checksum(payload[data_start + e["offset"] : data_start + e["offset"] + 40])
    tampered = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode().ljust(mlen)
    assert len(tampered) == mlen
    payload[32 : 32 + mlen] = np.frombuffer(tampered, np.uint8)
    header = struct.pack("<8sQQQ", magic, mlen, xxhash.xxh3_64_intdigest(tampered), total)
    payload[:32] = np.frombuffer(header, np.uint8)
    with pytest.raises(CorruptVersion):
        decode_payload(payload)


@pytest.mark.parametrize("delta", [False, True])
def test_a_refused_version_is_refused_once_and_asked_about_once(delta, run_id, tmp_path):
    """The engine pulls between every decode dispatch: a corrupt version it refused must not be read, verified and
    refused again at each pull (sync/refused would count pulls, not versions, and a delta receiver would send one
    keyframe request per pull); a receiver without delta never asks for a keyframe (every version is one)."""
    rng = np.random.default_rng(4)
    cfg = SyncConfig(run_id=run_id, transport="disk", delta=delta, dir=tmp_path, keyframe_every=100)
    sender, receiver = make_sender(cfg), make_receiver(cfg)
    with sender, receiver:
        sender.push(_weights(0), 0)
        assert receiver.pull()[0] == 0
        sender.push(_weights(1), 1)
        _flip(tmp_path / run_id / "v000000000001" / "weights.safetensors", 100, rng)
        for _ in range(3):
            assert receiver.pull() is None and receiver.version == 0
            assert receiver.refused == 1 and receiver.keyframe_requests == int(delta)
        sender.push(_weights(2), 2)
        version, got = receiver.pull()
        assert version == 2 and all(got[n].tobytes() == a.tobytes() for n, a in _weights(2).items())
        assert receiver.refused == 1 and receiver.keyframe_requests == int(delta)


@pytest.mark.parametrize("verify", [True, False])
def test_a_payload_s_length_must_match_its_entries_exactly(verify):
    """decode_payload takes any buffer, which may be longer than the payload (a reused transport buffer): the header's
    total length is checked against both the buffer and the entries, with or without the data checksums (verify=False
    skips only those), so a truncated payload or a total that claims bytes after the last entry is refused."""
    payload = _keyframe_payload(_weights(0))
    n = payload.nbytes
    room = np.zeros(2 * n, np.uint8)  # a reused buffer: the payload at its start, zeros after it
    room[:n] = payload
    manifest, blobs = decode_payload(room, verify=verify)
    assert all(blobs[k].tobytes() == a.tobytes() for k, a in _weights(0).items())
    for total in (n + 8, n + 64, n - 8):
        bad = room.copy()
        bad[24:32] = np.frombuffer(struct.pack("<Q", total), np.uint8)  # the header's u64 total length
        with pytest.raises(CorruptVersion, match="payload length disagrees with its entries|lies outside"):
            decode_payload(bad, verify=verify)
    for cut in (1, 8, 200):
        with pytest.raises(CorruptVersion, match="bad payload header"):
            decode_payload(payload[: n - cut], verify=verify)


def test_disk_refuses_a_weights_file_with_bytes_appended(run_id, tmp_path, caplog):
    """The checksums cover the header and each tensor's bytes; what lies after the last tensor is covered by the
    rule that the tensors end the file: a weights file grown by anything (a botched copy, two writers' bytes) is
    refused, named, and the receiver keeps its version."""
    sender = make_sender(SyncConfig(run_id=run_id, transport="disk", delta=False, dir=tmp_path))
    receiver = make_receiver(SyncConfig(run_id=run_id, transport="disk", delta=False, dir=tmp_path))
    with sender, receiver:
        sender.push(_weights(0), 0)
        assert receiver.pull()[0] == 0
        sender.push(_weights(1), 1)
        with open(tmp_path / run_id / "v000000000001" / "weights.safetensors", "ab") as f:
            f.write(b"\0" * 64)
        with caplog.at_level("WARNING", logger="weight_sync.protocol"):
            assert receiver.pull() is None and receiver.refused == 1 and receiver.version == 0
        assert "refused version 1 (bytes after the last tensor)" in caplog.text
        sender.push(_weights(2), 2)
        version, got = receiver.pull()
        assert version == 2 and all(got[n].tobytes() == a.tobytes() for n, a in _weights(2).items())
