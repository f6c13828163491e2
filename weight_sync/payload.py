"""One weight version as one flat byte buffer: what the shm segments and the Ray object store carry.

    [magic "RLSYNC01" | u64 manifest length | u64 xxh3(manifest) | u64 total length]  header, 32 bytes
    [manifest JSON]                                                                   weight_sync.manifest
    [zero padding to 64] [entry 0 bytes] [zero padding to 64] [entry 1 bytes] ...     offsets relative to data start

Entries start 64-byte aligned so the reader can hand out typed numpy views into the buffer (zero copy). Every byte
is covered by a check: the header by its magic and lengths, the manifest by its checksum, each entry by its
`blob_xxh3`, and padding must be zero, so flipping any byte of a payload makes `read_payload` refuse it.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from weight_sync.manifest import CorruptVersion, Manifest, checksum

MAGIC = b"RLSYNC01"
_HEADER = struct.Struct("<8sQQQ")
ALIGN = 64


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class PayloadLayout:
    manifest_json: bytes
    data_start: int
    total: int


def plan_payload(manifest: Manifest) -> PayloadLayout:
    """Assign each entry its (aligned) offset and return the sizes a writer needs before it writes."""
    offset = 0
    for e in manifest.entries:
        e.offset = offset
        offset = _align(offset + e.nbytes)
    mjson = manifest.to_json()
    data_start = _align(_HEADER.size + len(mjson))
    end = manifest.entries[-1].offset + manifest.entries[-1].nbytes if manifest.entries else 0
    return PayloadLayout(mjson, data_start, data_start + end)


def write_payload(dst: np.ndarray, layout: PayloadLayout, manifest: Manifest, blobs: Mapping[str, np.ndarray]) -> int:
    """Write the payload into `dst` (a uint8 array at least `layout.total` long); returns the bytes written."""
    if dst.nbytes < layout.total:
        raise ValueError(f"payload of {layout.total} bytes does not fit a buffer of {dst.nbytes}")
    mjson = layout.manifest_json
    dst[:_HEADER.size] = np.frombuffer(_HEADER.pack(MAGIC, len(mjson), checksum(mjson), layout.total), np.uint8)
    dst[_HEADER.size:_HEADER.size + len(mjson)] = np.frombuffer(mjson, np.uint8)
    pos = _HEADER.size + len(mjson)
    for e in manifest.entries:
        start = layout.data_start + e.offset
        dst[pos:start] = 0
        np.copyto(dst[start:start + e.nbytes], np.asarray(blobs[e.name]).reshape(-1).view(np.uint8))
        pos = start + e.nbytes
    return layout.total


def encode_payload(manifest: Manifest, blobs: Mapping[str, np.ndarray]) -> np.ndarray:
    """The payload in a fresh uint8 array (what the Ray transport puts in the object store)."""
    layout = plan_payload(manifest)
    out = np.empty(layout.total, np.uint8)
    write_payload(out, layout, manifest, blobs)
    return out


def read_payload(buf, verify: bool = True) -> tuple[Manifest, dict[str, np.ndarray]]:
    """Parse and verify a payload; returns its manifest and a uint8 view (no copy) of each entry's stored bytes.

    Raises CorruptVersion on any inconsistency. `verify=False` skips only the per-entry data checksums.
    """
    buf = np.frombuffer(buf, np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1).view(np.uint8)
    if buf.nbytes < _HEADER.size:
        raise CorruptVersion("payload shorter than its header")
    magic, mlen, mhash, total = _HEADER.unpack(buf[:_HEADER.size].tobytes())
    if magic != MAGIC or total > buf.nbytes or _HEADER.size + mlen > total:
        raise CorruptVersion("bad payload header")
    mjson = buf[_HEADER.size:_HEADER.size + mlen].tobytes()
    if checksum(mjson) != mhash:
        raise CorruptVersion("manifest checksum mismatch")
    manifest = Manifest.from_json(mjson)
    data_start = _align(_HEADER.size + mlen)
    views, pos, offset = {}, _HEADER.size + mlen, 0
    for e in manifest.entries:
        if e.offset != offset or data_start + offset + e.nbytes > total:
            raise CorruptVersion(f"entry {e.name!r} lies outside its payload")
        start = data_start + offset
        if buf[pos:start].any():
            raise CorruptVersion(f"non-zero padding before entry {e.name!r}")
        view = buf[start:start + e.nbytes]
        if verify and checksum(view) != e.blob_xxh3:
            raise CorruptVersion(f"checksum mismatch in {e.name!r}")
        views[e.name] = view
        pos, offset = start + e.nbytes, _align(offset + e.nbytes)
    if max(pos, data_start) != total:
        raise CorruptVersion("payload length disagrees with its entries")
    return manifest, views
