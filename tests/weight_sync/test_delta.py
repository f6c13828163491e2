"""The delta codec reconstructs every tensor bit for bit, whatever the values (±0, NaN payloads, inf, denormals)."""

import struct

import ml_dtypes
import numpy as np
import pytest
import zstandard
from wsync_values import nan_with_payload, special_tensor

from weight_sync import delta
from weight_sync.manifest import CorruptVersion

DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16, np.float64, np.int8, np.int32, np.int64, np.uint16, np.bool_]
BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _bits(a):
    return a.reshape(-1).view(BITS[a.dtype.itemsize])


def _mutate(a: np.ndarray, rng) -> np.ndarray:
    """A random update: some elements get random bits, some get the special values a float comparison gets wrong."""
    new = a.copy()
    flat_bits = _bits(new)
    n = a.size
    k = int(rng.integers(0, max(1, n // 4) + 1))  # 0 .. 25 % of elements, sometimes none at all
    pos = rng.choice(n, size=k, replace=False)
    flat_bits[pos] = _bits(special_tensor(a.dtype, (k,), rng))
    if a.dtype.kind == "f" or a.dtype == np.dtype(ml_dtypes.bfloat16):
        # Float-equal but bit-different rewrites: +0 <-> -0, one NaN payload -> another.
        j = int(rng.integers(0, n))
        new.reshape(-1)[j] = np.array(-0.0 if rng.random() < 0.5 else 0.0, a.dtype)
        new.reshape(-1)[(j + 1) % n] = nan_with_payload(a.dtype, int(rng.integers(1, 60)), bool(rng.random() < 0.5))
    return new


def test_property_1000_rounds_bit_exact():
    rng = np.random.default_rng(1234)
    for round_ in range(1000):
        dtype = DTYPES[round_ % len(DTYPES)]
        shape = tuple(int(s) for s in rng.integers(1, 9, size=int(rng.integers(0, 4))))
        old = special_tensor(dtype, shape, rng)
        new = _mutate(old, rng)
        changed = delta.changed_indices(old, new)
        # Changed = elements with any differing byte (numpy on bytes, no float comparison involved).
        byte_diff = (
            old.reshape(-1).view(np.uint8).reshape(old.size, -1) != new.reshape(-1).view(np.uint8).reshape(new.size, -1)
        ).any(axis=1)
        assert changed.tolist() == np.flatnonzero(byte_diff).tolist()
        before = old.tobytes()
        got = delta.apply(old, delta.encode(old, new))
        assert got.dtype == new.dtype and got.shape == new.shape
        assert got.tobytes() == new.tobytes(), f"round {round_}: {dtype} {shape}"
        assert old.tobytes() == before, "apply must not modify its base"


def test_identical_tensors_give_empty_delta_and_nan_is_not_a_change():
    a = np.array([np.nan, -0.0, 0.0, np.inf], np.float32)
    assert delta.changed_indices(a, a.copy()).size == 0
    b = a.copy()
    b[1] = 0.0  # -0 -> +0: equal as floats, different bits
    assert delta.changed_indices(a, b).tolist() == [1]
    assert delta.apply(a, delta.encode(a, b)).tobytes() == b.tobytes()


def test_sparse_bf16_delta_is_small():
    rng = np.random.default_rng(0)
    old = rng.standard_normal(1 << 20).astype(ml_dtypes.bfloat16)
    new = old.copy()
    idx = rng.choice(old.size, old.size // 100, replace=False)  # 1 % of elements, as in RL steps
    new[idx] = (new[idx].astype(np.float32) * 1.01).astype(ml_dtypes.bfloat16)
    blob = delta.encode(old, new)
    # 1 % changed: values (2 B) + gap-coded positions must stay well under 4 B per change after zstd.
    assert len(blob) < 4 * len(delta.changed_indices(old, new))
    assert len(blob) < old.nbytes / 40
    assert delta.apply(old, blob).tobytes() == new.tobytes()


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_damaged_blob_raises_corrupt(damage):
    rng = np.random.default_rng(0)
    old = rng.standard_normal(4096).astype(np.float32)
    new = old.copy()
    new[::7] += 1
    blob = bytearray(delta.encode(old, new))
    if damage == "flip":
        blob[len(blob) // 2] ^= 0x40
    elif damage == "truncate":
        blob = blob[:-5]
    else:
        blob = bytearray(b"not a zstd frame")
    with pytest.raises(CorruptVersion):
        delta.apply(old, bytes(blob))


def test_delta_against_smaller_tensor_is_refused():
    old = np.zeros(100, np.float32)
    new = old.copy()
    new[99] = 1
    with pytest.raises(CorruptVersion):
        delta.apply(np.zeros(50, np.float32), delta.encode(old, new))


@pytest.mark.parametrize("past", [0, 1])  # index == size (off by one) and size + 1
def test_a_blob_indexing_at_or_past_the_end_is_refused(past):
    """A crafted blob (valid checksum) must be refused as corrupt, not escape pull() as an IndexError."""
    old = np.zeros(100, np.float32)
    idx = np.array([old.size + past], np.uint32)  # one change, gap-coded: its gap is the index itself
    values = np.array([1.0], np.float32).view(np.uint32)
    raw = (
        struct.pack("<QB", 1, 4)
        + idx.view(np.uint8).reshape(-1, 4).T.tobytes()
        + values.view(np.uint8).reshape(-1, 4).T.tobytes()
    )
    blob = zstandard.ZstdCompressor(write_checksum=True).compress(raw)
    with pytest.raises(CorruptVersion):
        delta.apply(old, blob)
