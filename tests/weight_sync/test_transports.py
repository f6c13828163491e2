"""Round trips through the shm and disk transports: bit-exact for every dtype, zero-copy shm, keyframes and deltas."""

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch
from wsync_values import special_tensor

from tests.weight_sync.conftest import transport_pair
from trainer.parallel import to_numpy
from weight_sync import TRANSPORTS, SyncConfig, make_receiver, make_sender
from weight_sync.manifest import check_named_arrays

ALL_DTYPES = [
    np.float32,
    ml_dtypes.bfloat16,
    np.float16,
    np.float64,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.bool_,
]


def _state(rng):
    shapes = [(30, 50), (1700,), (), (20, 30, 4), (0, 4)]
    return {
        f"model.layers.{i}.w_{np.dtype(dt).name}": special_tensor(dt, shapes[i % len(shapes)], rng)
        for i, dt in enumerate(ALL_DTYPES)
    }


def _assert_bits_equal(got: dict, want: dict):
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert got[name].dtype == w.dtype and got[name].shape == w.shape, name
        assert got[name].tobytes() == w.tobytes(), name


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("delta", [False, True])
def test_round_trip_bit_exact_all_dtypes(transport, delta, run_id, tmp_path):
    rng = np.random.default_rng(0)
    sender, receiver = transport_pair(transport, run_id, tmp_path, delta=delta, keyframe_every=4)
    with sender, receiver:
        assert receiver.pull() is None
        state = _state(rng)
        for version in range(6):
            stats = sender.push(state, version)
            got = receiver.pull()
            assert got is not None and got[0] == version
            _assert_bits_equal(got[1], state)
            assert receiver.pull() is None  # nothing newer
            assert stats.full_bytes == sum(a.nbytes for a in state.values())
            assert stats.keyframe == (not delta or version % 4 == 0)
            # Next version: a few elements per tensor get new bits (NaN payloads, ±0, inf, denormals among them).
            state = {n: a.copy() for n, a in state.items()}
            for a in state.values():
                if a.size:
                    a.reshape(-1)[rng.integers(0, a.size, 2)] = special_tensor(a.dtype, (2,), rng)
        assert receiver.refused == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_hf_state_dict_in_bf16_and_fp32(transport, run_id, tmp_path, tiny_qwen3_dir):
    """A real HF state dict in bf16, turned into numpy as Trainer.export_weights does (trainer.parallel.to_numpy),
    comes out as the same bits in ml_dtypes bf16."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.bfloat16)
    sd = dict(model.state_dict())
    sd["extra.fp32"] = torch.randn(7, 3)
    sender, receiver = transport_pair(transport, run_id, tmp_path)
    with sender, receiver:
        sender.push({n: to_numpy(t) for n, t in sd.items()}, 1)
        version, got = receiver.pull()
    assert version == 1 and got.keys() == sd.keys()
    for name, t in sd.items():
        if t.dtype == torch.bfloat16:
            assert got[name].dtype == np.dtype(ml_dtypes.bfloat16)
            assert np.array_equal(got[name].view(np.int16), t.view(torch.int16).numpy()), name
        else:
            assert got[name].tobytes() == t.numpy().tobytes(), name


def test_contiguous_input_is_not_copied_before_the_transport():
    w = np.zeros((4, 4), ml_dtypes.bfloat16)
    strided = np.zeros((4, 8), np.float32)[:, ::2]
    checked = check_named_arrays({"w": w, "strided": strided})
    assert checked["w"] is w
    assert checked["strided"].flags.c_contiguous and checked["strided"].tobytes() == strided.tobytes()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_big_endian_arrays_arrive_with_their_values(transport, run_id, tmp_path):
    """A '>f4' array's dtype is named float32 like a '<f4' one's: its bytes must be swapped, not sent as they are."""
    sender, receiver = transport_pair(transport, run_id, tmp_path)
    state = {"w": np.array([1.0, -2.5, 3e-40], ">f4"), "i": np.arange(6, dtype=">i8").reshape(2, 3)[:, ::2]}
    with sender, receiver:
        sender.push(state, 0)
        version, got = receiver.pull()
        assert version == 0 and receiver.refused == 0
        for name, want in state.items():
            assert got[name].dtype.isnative and np.array_equal(got[name], want), name


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_torch_tensors_are_refused_with_a_pointer_to_numpy(transport, run_id, tmp_path):
    sender, receiver = transport_pair(transport, run_id, tmp_path)
    with sender, receiver:
        for t in (torch.zeros(3), torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))):
            with pytest.raises(ValueError, match=r"'lm_head\.weight' is a torch .*pass numpy arrays.*export_weights"):
                sender.push({"w": np.zeros(3, np.float32), "lm_head.weight": t}, 0)
        assert receiver.pull() is None and sender.version is None  # nothing was published


def test_shm_reads_are_zero_copy_views_valid_until_buffer_reused(run_id):
    sender, receiver = transport_pair("shm", run_id, None)
    a = {"w": np.full(1000, 1.0, np.float32)}
    with sender, receiver:
        sender.push(a, 0)
        _, v0 = receiver.pull()
        sender.push({"w": np.full(1000, 2.0, np.float32)}, 1)  # double buffer: goes to the other segment
        _, v1 = receiver.pull()
        assert (v0["w"] == 1.0).all() and (v1["w"] == 2.0).all()  # v0 still intact while v1 is read
        sender.push({"w": np.full(1000, 3.0, np.float32)}, 2)  # reuses v0's segment: the documented limit
        assert (v0["w"] == 3.0).all(), "shm pulls must be views into the segment, not copies"


def test_shm_views_of_an_older_version_outlive_the_next_push(run_id):
    """A pull of at most an older version reads the buffer the next push reuses: what it returns must still last
    until two more pushes, as every pull's arrays do."""
    sender, receiver = transport_pair("shm", run_id, None)
    with sender, receiver:
        sender.push({"w": np.full(1000, 1.0, np.float32)}, 1)
        sender.push({"w": np.full(1000, 2.0, np.float32)}, 2)
        version, v1 = receiver.pull(at_most=1)
        assert version == 1
        sender.push({"w": np.full(1000, 3.0, np.float32)}, 3)  # rewrites the buffer version 1 was read from
        assert (v1["w"] == 1.0).all()


def test_sender_copies_input_before_push_returns(run_id):
    """The trainer's arrays may alias live parameters: changing them after push must not change what was sent."""
    sender, receiver = transport_pair("shm", run_id, None, delta=True)
    w = np.arange(100, dtype=np.float32)
    with sender, receiver:
        sender.push({"w": w}, 0)
        w[:] = -1  # the optimizer steps in place
        _, got = receiver.pull()
        assert got["w"].tolist() == list(range(100))
        sender.push({"w": w}, 1)
        assert receiver.pull()[1]["w"].tolist() == [-1.0] * 100


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_keyframe_when_delta_not_worth_it_and_on_shape_change(transport, run_id, tmp_path):
    rng = np.random.default_rng(0)
    sender, receiver = transport_pair(transport, run_id, tmp_path, delta=True, keyframe_every=100)
    w = rng.standard_normal(4096).astype(np.float32)
    with sender, receiver:
        assert sender.push({"w": w}, 0).keyframe
        small = w.copy()
        small[:10] += 1
        s1 = sender.push({"w": small}, 1)
        assert not s1.keyframe and s1.changed_frac == pytest.approx(10 / 4096)
        s2 = sender.push({"w": rng.standard_normal(4096).astype(np.float32)}, 2)  # everything changed
        assert s2.keyframe and s2.changed_frac == 1.0
        s3 = sender.push({"w": np.zeros(10, np.float32)}, 3)  # new shape: no base to diff against
        assert s3.keyframe
        version, got = receiver.pull()
        assert version == 3 and got["w"].tobytes() == np.zeros(10, np.float32).tobytes()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_receiver_with_wrong_base_requests_keyframe(transport, run_id, tmp_path):
    sender, receiver = transport_pair(transport, run_id, tmp_path, delta=True, keep=1)
    w = np.arange(1000, dtype=np.float32)
    with sender, receiver:
        sender.push({"w": w}, 0)
        receiver.pull()
        for v in (1, 2, 3):  # the receiver sleeps through three deltas; only the newest is kept
            w = w.copy()
            w[v] = -v
            sender.push({"w": w}, v)
        assert receiver.pull() is None and receiver.keyframe_requests == 1 and receiver.version == 0
        assert receiver.pull() is None and receiver.keyframe_requests == 1  # asked once, waits for the answer
        w = w.copy()
        w[500] = 7
        assert sender.push({"w": w}, 4).keyframe, "the receiver's request must reach the sender"
        version, got = receiver.pull()
        assert version == 4 and got["w"].tobytes() == w.tobytes()
        assert receiver.metrics()["sync/keyframe_requests"] == 1 and receiver.metrics()["sync/refused"] == 0
        w = w.copy()
        w[501] = 8
        assert not sender.push({"w": w}, 5).keyframe, "one request, one keyframe"
        assert receiver.pull()[1]["w"].tobytes() == w.tobytes()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_bad_input_names_the_problem(transport, run_id, tmp_path):
    sender, receiver = transport_pair(transport, run_id, tmp_path)
    with sender, receiver:
        with pytest.raises(ValueError, match="embed.weight"):
            sender.push({"embed.weight": np.zeros(3, np.complex64)}, 0)
        with pytest.raises(ValueError, match="lm_head"):
            sender.push({"lm_head": [1.0, 2.0]}, 0)
        with pytest.raises(ValueError, match="non-empty"):
            sender.push({}, 0)
        sender.push({"w": np.zeros(3, np.float32)}, 5)
        with pytest.raises(ValueError, match="version 5 is not newer"):
            sender.push({"w": np.zeros(3, np.float32)}, 5)
        assert receiver.pull()[0] == 5  # the bad pushes lost nothing


def test_factory_errors(run_id, tmp_path):
    assert TRANSPORTS == ("shm", "disk")  # what make_sender builds; "ray" is rlloop.ray_sync's
    with pytest.raises(ValueError, match="'zmq'"):
        make_sender(SyncConfig(run_id=run_id, transport="zmq", delta=False))
    with pytest.raises(ValueError, match="root"):
        make_sender(SyncConfig(run_id=run_id, transport="disk", delta=False))
    for make in (make_sender, make_receiver):
        with pytest.raises(ValueError, match="rlloop.ray_sync.make_ray_sender / make_ray_receiver"):
            make(SyncConfig(run_id=run_id, transport="ray", delta=False))
    with pytest.raises(ValueError, match="run_id"):
        make_sender(SyncConfig(run_id="../etc", transport="shm", delta=False))
    with pytest.raises(ValueError, match="keyframe_every"):
        make_sender(SyncConfig(run_id=run_id, transport="shm", delta=False, keyframe_every=0))
    first = make_sender(SyncConfig(run_id=run_id, transport="shm", delta=False))
    with first, pytest.raises(ValueError, match="live shm sender"):
        make_sender(SyncConfig(run_id=run_id, transport="shm", delta=False))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_random_rounds_with_skipped_pulls_always_bit_exact(transport, run_id, tmp_path):
    """Deltas, keyframes, chains and keyframe requests interleaved at random: whatever a pull returns is exactly the
    version it names."""
    rng = np.random.default_rng(7)
    sender, receiver = transport_pair(
        transport, run_id, tmp_path, delta=True, keyframe_every=int(rng.integers(3, 9)), keep=3
    )
    state = {
        f"t{i}": special_tensor(dt, (int(rng.integers(50, 400)),), rng)
        for i, dt in enumerate([np.float32, ml_dtypes.bfloat16, np.float16, np.int32])
    }
    history, returned = {}, 0
    with sender, receiver:
        for version in range(150):
            state = {n: a.copy() for n, a in state.items()}
            for a in state.values():  # 0-5 % of elements take new bits, specials included
                k = int(rng.integers(0, a.size // 20 + 1))
                a[rng.integers(0, a.size, k)] = special_tensor(a.dtype, (k,), rng)
            sender.push(state, version)
            history[version] = {n: a.tobytes() for n, a in state.items()}
            if rng.random() < 0.5:  # the engine is busy half the time and skips this sync
                continue
            got = receiver.pull()
            if got is not None:
                returned += 1
                assert {n: a.tobytes() for n, a in got[1].items()} == history[got[0]], f"version {got[0]}"
    assert returned > 30 and receiver.refused == 0
    assert receiver.keyframe_requests > 0  # the skipped pulls did break delta chains: that path was exercised


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_wrong_base_is_caught_by_the_reconstruction_checksum_and_healed(transport, run_id, tmp_path):
    """If the receiver's copy differs from what the sender diffed against (here: the caller scribbled on the
    returned arrays), applying a delta gives wrong bits: the checksum refuses it and a keyframe repairs the state."""
    sender, receiver = transport_pair(transport, run_id, tmp_path, delta=True, keyframe_every=100)
    w = np.arange(4096, dtype=np.float32)
    with sender, receiver:
        sender.push({"w": w}, 0)
        _, got = receiver.pull()
        got["w"][5] = -1.0  # a delta receiver returns its own copy: writing to it changes the delta base
        w = w.copy()
        w[100] = 7.0
        assert not sender.push({"w": w}, 1).keyframe
        assert receiver.pull() is None and receiver.refused == 1 and receiver.version == 0
        w = w.copy()
        w[200] = 8.0
        assert sender.push({"w": w}, 2).keyframe
        version, got = receiver.pull()
        assert version == 2 and got["w"].tobytes() == w.tobytes()


def test_weights_are_readable_by_their_owner_only(run_id, tmp_path):
    """Security: shm segments are 0600 and a disk sync directory 0700, whatever the umask."""
    import os
    import stat

    from weight_sync.shm import segment_path

    weights = {"w": np.arange(8, dtype=np.float32)}
    with make_sender(SyncConfig(run_id=run_id, transport="shm", delta=False)) as sender:
        sender.push(weights, version=1)
        for part in ("ctl", "buf0"):
            assert stat.S_IMODE(os.stat(segment_path(run_id, part)).st_mode) == 0o600, part
    old = os.umask(0o000)
    try:
        with make_sender(SyncConfig(run_id=run_id, transport="disk", dir=tmp_path, delta=False)) as sender:
            sender.push(weights, version=1)
            assert stat.S_IMODE(os.stat(tmp_path / run_id).st_mode) == 0o700
    finally:
        os.umask(old)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("delta", [False, True])
def test_a_pull_of_at_most_a_version_loads_it_though_a_newer_one_is_out(transport, delta, run_id, tmp_path):
    """The async loop mode's engine loads step k - 2's weights for step k even when k - 1's are out already."""
    rng = np.random.default_rng(0)
    sender, receiver = transport_pair(transport, run_id, tmp_path, delta=delta, keyframe_every=4)
    with sender, receiver:
        states = [_state(rng) for _ in range(3)]
        sender.push(states[0], 0)
        assert receiver.pull(at_most=0)[0] == 0
        sender.push(states[1], 1)
        sender.push(states[2], 2)
        version, got = receiver.pull(at_most=1)
        assert version == 1
        _assert_bits_equal(got, states[1])
        assert receiver.pull(at_most=1) is None  # nothing newer than what it has, up to 1
        version, got = receiver.pull()
        assert version == 2
        _assert_bits_equal(got, states[2])


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("delta", [False, True])
def test_a_pull_of_at_most_an_unpublished_version_loads_the_newest_below_it(transport, delta, run_id, tmp_path):
    """Versions have gaps (a step whose update was skipped pushes nothing): at_most may name one never published."""
    rng = np.random.default_rng(0)
    sender, receiver = transport_pair(transport, run_id, tmp_path, delta=delta)
    with sender, receiver:
        states = [_state(rng) for _ in range(2)]
        sender.push(states[0], 3)
        assert receiver.pull(at_most=2) is None  # nothing that old (shm: an unwritten buffer holds no version 0)
        sender.push(states[1], 5)
        version, got = receiver.pull(at_most=4)
        assert version == 3
        _assert_bits_equal(got, states[0])
        assert receiver.pull(at_most=4) is None
        version, got = receiver.pull()
        assert version == 5
        _assert_bits_equal(got, states[1])


DISK_READER = r"""
import hashlib, sys
from weight_sync import SyncConfig, make_receiver

version, arrays = make_receiver(SyncConfig(run_id=sys.argv[2], transport="disk", dir=sys.argv[1], delta=True)).pull()
print(version)
for name in sorted(arrays):
    print(name, arrays[name].dtype.name, hashlib.sha256(arrays[name].tobytes()).hexdigest())
"""


def test_disk_version_readable_by_another_process(run_id, tmp_path):
    """Nothing but the directory is shared: a fresh process (as on another host) reads the same bits."""
    import hashlib
    from pathlib import Path

    rng = np.random.default_rng(5)
    state = _state(rng)
    sender = make_sender(SyncConfig(run_id=run_id, transport="disk", dir=tmp_path, delta=False))
    sender.push(state, 11)
    out = subprocess.run(
        [sys.executable, "-c", DISK_READER, str(tmp_path), run_id],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
        timeout=120,
    ).stdout.split("\n")
    assert out[0] == "11"
    want = [f"{n} {state[n].dtype.name} {hashlib.sha256(state[n].tobytes()).hexdigest()}" for n in sorted(state)]
    assert out[1 : 1 + len(want)] == want


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("delta", [False, True])
def test_fp8_weights_round_trip_bit_exact(transport, delta, run_id, tmp_path):
    """fp8 (ml_dtypes float8_e4m3fn and float8_e5m2: SUPPORTED_DTYPES) as a quantized export hands them over: every
    bit pattern, NaNs included, arrives as it was, as a keyframe and as deltas on it."""
    rng = np.random.default_rng(0)
    sender, receiver = transport_pair(transport, run_id, tmp_path, delta=delta, keyframe_every=4)
    state = {
        name: rng.integers(0, 256, size=(64, 8), dtype=np.uint8).view(dt)
        for name, dt in (("e4m3", ml_dtypes.float8_e4m3fn), ("e5m2", ml_dtypes.float8_e5m2))
    }
    with sender, receiver:
        for version in range(3):
            stats = sender.push(state, version)
            assert stats.keyframe == (not delta or version == 0)
            got = receiver.pull()
            assert got is not None and got[0] == version
            _assert_bits_equal(got[1], state)
            state = {n: a.copy() for n, a in state.items()}
            for a in state.values():
                a.view(np.uint8).reshape(-1)[rng.integers(0, a.size, 3)] ^= 0x5A
        assert receiver.refused == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_tensor_without_a_name_is_refused(transport, run_id, tmp_path):
    """Names are Hugging Face parameter names, the engine's key for each tensor: an empty or non-string one is a
    caller's bug, refused before anything is published."""
    sender, receiver = transport_pair(transport, run_id, tmp_path)
    with sender, receiver:
        for bad in ("", 0, None):
            with pytest.raises(ValueError, match="must be a non-empty string"):
                sender.push({"w": np.zeros(3, np.float32), bad: np.ones(3, np.float32)}, 0)
        assert receiver.pull() is None and sender.version is None  # nothing was published


@pytest.mark.parametrize(
    "knob,value",
    [("keyframe_every", 0), ("keep", 0), ("keep", -1), ("dir", ""), ("keyframes_every", 5)],  # the last: misspelt
)
def test_a_bad_sync_knob_is_refused_where_the_config_is_made_naming_it(knob, value, run_id):
    """The YAML's sync: section is built from SyncConfig's fields: a bad knob must fail when the config is made, with
    its name, not later in a trainer actor (keyframe_every), never for a transport that ignores it (keep, for shm),
    and never silently (an empty dir is the working directory; a misspelt knob would keep the default)."""
    import pydantic

    with pytest.raises(pydantic.ValidationError, match=knob):
        SyncConfig(run_id=run_id, transport="shm", **{knob: value})
