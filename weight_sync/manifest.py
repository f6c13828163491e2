"""What a weight version is on the wire: a manifest of named tensors, their dtypes, shapes and checksums.

Every transport (shm, disk, Ray) carries one `Manifest` per version. It names each tensor with its Hugging Face
parameter name, its dtype (bf16 included, through ml_dtypes), its shape, how it is stored (`raw` bytes or a `delta`
against the previous version), where its stored bytes lie, and two checksums (`weight_sync.checksum`): one of the
stored bytes (refuse before decoding) and one of the reconstructed tensor (refuse after applying a delta). A delta
names the version it was computed against in `base_version`.

Also here: checking what a push is handed. Senders take numpy arrays (bf16 and fp8 as ml_dtypes), as
`Trainer.export_weights()` returns them; weight_sync never imports torch and refuses torch tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from weight_sync.checksum import checksums

# Dtypes we move. ml_dtypes supplies the ones numpy lacks.
_ML_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")
_NUMPY_DTYPES = (
    "bool",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "float32",
    "float64",
)
SUPPORTED_DTYPES = _NUMPY_DTYPES + _ML_DTYPES

# The unsigned integer type of each width: deltas compare and copy raw bits through these views, never floats.
BITS_DTYPE = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}


class CorruptVersion(Exception):
    """A version failed verification (checksum, framing, shape): the receiver refuses it and keeps what it has."""


def dtype_from_name(name: str) -> np.dtype:
    if name in _ML_DTYPES:
        # imported here, not at the top: it takes ~1 s, which a driver that only sweeps stale shm segments
        # (rlloop/cluster.py) need not wait for
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    if name in _NUMPY_DTYPES:
        return np.dtype(name)
    raise ValueError(f"unsupported dtype {name!r}; supported: {', '.join(SUPPORTED_DTYPES)}")


def dtype_name(dtype: np.dtype, tensor_name: str = "?") -> str:
    name = np.dtype(dtype).name
    if name not in SUPPORTED_DTYPES:
        raise ValueError(f"tensor {tensor_name!r} has unsupported dtype {name!r}; supported: {SUPPORTED_DTYPES}")
    return name


def check_array(name: str, value: Any) -> np.ndarray:
    """`value`, a numpy array of a supported dtype, native byte order and C-contiguous (itself unless it was not:
    then a copy)."""
    if not isinstance(value, np.ndarray):
        if hasattr(value, "detach") and hasattr(value, "dtype"):  # a torch tensor, recognised without importing torch
            raise ValueError(
                f"tensor {name!r} is a torch {type(value).__name__}; pass numpy arrays (bf16 as "
                "ml_dtypes.bfloat16): e.g. Trainer.export_weights()"
            )
        raise ValueError(f"tensor {name!r} is a {type(value).__name__}, expected a numpy array")
    dtype_name(value.dtype, name)
    if not value.dtype.isnative:  # a '>f4' array is named "float32" too: its bytes would be read as '<f4'
        value = value.astype(value.dtype.newbyteorder("="))
    # not np.ascontiguousarray(value) alone: it turns a 0-d array into shape (1,)
    return value if value.flags.c_contiguous else np.ascontiguousarray(value)


def bits_view(arr: np.ndarray) -> np.ndarray:
    """The raw bits of a contiguous array as a flat unsigned-integer view (no copy)."""
    return arr.reshape(-1).view(BITS_DTYPE[arr.dtype.itemsize])


def _is_count(x) -> bool:
    """A non-negative JSON integer (not a float, not a bool): what slices, offsets and version numbers need."""
    return type(x) is int and x >= 0


@dataclass
class TensorEntry:
    name: str
    dtype: str
    shape: list[int]
    encoding: str  # "raw": the tensor's bytes; "delta": a weight_sync.delta blob against base_version
    nbytes: int  # stored bytes (for raw: the tensor's bytes)
    blob_xxh3: int | None  # checksum of the stored bytes (None until the transport has hashed a raw tensor)
    xxh3: int | None  # checksum of the reconstructed tensor's bytes
    offset: int = 0  # where the stored bytes start inside a single-buffer payload (weight_sync.payload)

    @property
    def tensor_nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * dtype_from_name(self.dtype).itemsize


@dataclass
class Manifest:
    version: int
    base_version: int | None  # None for a keyframe (every entry raw)
    entries: list[TensorEntry] = field(default_factory=list)

    @property
    def keyframe(self) -> bool:
        return self.base_version is None

    def to_json(self) -> bytes:
        # The fields as they are: dataclasses.asdict deep-copies every entry, ~1 ms per call for a small model's
        # two dozen tensors, and a push serialises its manifest three times.
        entries = [vars(e) for e in self.entries]
        fields = {"version": self.version, "base_version": self.base_version, "entries": entries}
        return json.dumps(fields, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Manifest":
        """Parse and sanity-check a manifest; any inconsistency raises CorruptVersion."""
        try:
            raw = json.loads(bytes(data).decode())
            entries = [TensorEntry(**e) for e in raw.pop("entries")]
            m = cls(entries=entries, **raw)
            if not _is_count(m.version) or not (m.base_version is None or _is_count(m.base_version)):
                raise ValueError("version numbers must be non-negative integers")
            for e in m.entries:
                dtype_from_name(e.dtype)
                if (
                    e.encoding not in ("raw", "delta")
                    or not _is_count(e.nbytes)
                    or not _is_count(e.offset)
                    or not isinstance(e.blob_xxh3, int)
                    or not isinstance(e.xxh3, int)
                    or not all(_is_count(d) for d in e.shape)
                ):
                    raise ValueError(e.name)
                if e.encoding == "raw" and e.nbytes != e.tensor_nbytes:
                    raise ValueError(e.name)
            if (m.base_version is None) != all(e.encoding == "raw" for e in m.entries):
                raise ValueError("keyframe flag disagrees with entry encodings")
        except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError) as exc:
            raise CorruptVersion(f"bad manifest: {exc}") from exc
        return m


def fill_checksums(manifest: "Manifest", blobs: Mapping[str, np.ndarray]) -> None:
    """Hash the raw tensors left unhashed by the sender (transports that cannot hash while they copy)."""
    unset = [e for e in manifest.entries if e.blob_xxh3 is None]
    for e, digest in zip(unset, checksums([blobs[e.name] for e in unset])):
        e.blob_xxh3 = e.xxh3 = digest


def check_named_arrays(named_arrays: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Validate a push's input (name -> numpy array); errors name the offending tensor."""
    if not isinstance(named_arrays, Mapping) or not named_arrays:
        raise ValueError("named_arrays must be a non-empty mapping of parameter name -> array")
    out = {}
    for name, value in named_arrays.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"parameter name {name!r} must be a non-empty string")
        out[name] = check_array(name, value)
    return out
