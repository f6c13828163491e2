"""Test data for weight sync: tensors full of the values that float comparisons get wrong."""

import ml_dtypes
import numpy as np


def nan_with_payload(dtype, payload: int, negative: bool = False):
    """A quiet NaN of `dtype` carrying `payload` in its mantissa bits (distinct bits, all compare unequal)."""
    dtype = np.dtype(dtype)
    bits = {2: np.uint16, 4: np.uint32, 8: np.uint64}[dtype.itemsize]
    nmant = {
        np.dtype(np.float16): 10,
        np.dtype(ml_dtypes.bfloat16): 7,
        np.dtype(np.float32): 23,
        np.dtype(np.float64): 52,
    }[dtype]
    exp_all_ones = ((1 << (8 * dtype.itemsize - 1 - nmant)) - 1) << nmant
    sign = 1 << (8 * dtype.itemsize - 1) if negative else 0
    quiet = 1 << (nmant - 1)
    return np.array([sign | exp_all_ones | quiet | (payload % quiet)], bits).view(dtype)[0]


def special_tensor(dtype, shape, rng) -> np.ndarray:
    """Random bits of `dtype` with ±0, ±inf, denormals and NaNs with several payloads planted in it."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape))
    bits = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[dtype.itemsize]
    if dtype == np.dtype(bool):
        return rng.integers(0, 2, size=n).astype(bool).reshape(shape)
    a = rng.integers(0, np.iinfo(bits).max, size=n, dtype=bits, endpoint=True)
    if dtype.kind == "f" or dtype == np.dtype(ml_dtypes.bfloat16):
        tiny = float(ml_dtypes.finfo(dtype).smallest_subnormal)
        planted = np.array([0.0, -0.0, np.inf, -np.inf, tiny, -tiny, tiny * 3], np.float64).astype(dtype)
        nans = np.array([nan_with_payload(dtype, p, neg) for p in (1, 5, 17) for neg in (0, 1)], dtype)
        planted_bits = np.concatenate([planted.view(bits), nans.view(bits)])
        pos = rng.choice(n, size=min(n, len(planted_bits)), replace=False)
        a[pos] = planted_bits[: len(pos)]
    return a.view(dtype).reshape(shape)
