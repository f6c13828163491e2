"""One weight version as one flat byte buffer: what the shm segments and the Ray object store carry.

    [magic "RLSYNC01" | u64 manifest length | u64 xxh3(manifest) | u64 total length]  header, 32 bytes
    [manifest JSON, space-padded to its reserved length]                              weight_sync.manifest
    [zero padding to 64] [entry 0 bytes] [zero padding to 64] [entry 1 bytes] ...     offsets relative to data start

Entries start 64-byte aligned so the reader can hand out typed numpy views into the buffer (zero copy). Every byte
is covered by a check: the header by its magic and lengths, the manifest by its checksum, each entry by its
`blob_xxh3`, and padding must be zero, so flipping any byte of a payload makes `decode_payload` refuse it.

The codec, public as part of the transport interface (weight_sync/__init__.py):

    n = payload_nbytes(manifest)                    # size it (assigns each entry its offset)
    encode_payload_into(dst, manifest, blobs)       # into any uint8 buffer of >= n bytes (reused: no page faults)
    manifest, blobs = decode_payload(buf)           # verify and view; raises CorruptVersion
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from weight_sync.checksum import byte_view, checksum, checksums, copy_with_checksums
from weight_sync.manifest import CorruptVersion, Manifest

MAGIC = b"RLSYNC01"
_HEADER = struct.Struct("<8sQQQ")
ALIGN = 64


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class _Layout:
    manifest_capacity: int  # bytes reserved for the manifest JSON (space-padded): checksums are known only later
    data_start: int
    total: int


def _plan(manifest: Manifest) -> _Layout:
    """Assign each entry its (aligned) offset and return the sizes a writer needs before it writes.

    Checksums still unset (None, see Sender._encode) are filled in by encode_payload_into, so the manifest's room
    is sized for the widest checksum value."""
    offset = 0
    for e in manifest.entries:
        e.offset = offset
        offset = _align(offset + e.nbytes)
    unset = [(e, e.blob_xxh3, e.xxh3) for e in manifest.entries]
    for e, _, _ in unset:
        e.blob_xxh3 = e.xxh3 = 2**64 - 1
    capacity = len(manifest.to_json())
    for e, blob_h, h in unset:
        e.blob_xxh3, e.xxh3 = blob_h, h
    data_start = _align(_HEADER.size + capacity)
    end = manifest.entries[-1].offset + manifest.entries[-1].nbytes if manifest.entries else 0
    return _Layout(capacity, data_start, data_start + end)


def payload_nbytes(manifest: Manifest) -> int:
    """The size of `manifest`'s payload: how big a buffer encode_payload_into needs. Assigns each entry its offset."""
    return _plan(manifest).total


def encode_payload_into(dst: np.ndarray, manifest: Manifest, blobs: Mapping[str, np.ndarray]) -> int:
    """Write the payload of `manifest` (entry bytes `blobs[entry.name]`) into the uint8 array `dst`, which must
    hold at least payload_nbytes(manifest) bytes; returns the bytes written.

    Raw entries whose checksums are unset (None) are hashed while they are copied (one pass over memory, not two)
    and their checksums filled into `manifest`. Data goes first, then the manifest, then the header."""
    layout = _plan(manifest)
    if dst.nbytes < layout.total:
        raise ValueError(f"payload of {layout.total} bytes does not fit a buffer of {dst.nbytes}")
    pos = _HEADER.size + layout.manifest_capacity
    copies = []
    for e in manifest.entries:
        start = layout.data_start + e.offset
        dst[pos:start] = 0
        copies.append((dst[start : start + e.nbytes], byte_view(blobs[e.name]), e.blob_xxh3 is None))
        pos = start + e.nbytes
    for e, digest in zip(manifest.entries, copy_with_checksums(copies)):
        if digest is not None:
            e.blob_xxh3 = e.xxh3 = digest
    mjson = manifest.to_json().ljust(layout.manifest_capacity)  # JSON allows the trailing spaces
    dst[_HEADER.size : _HEADER.size + len(mjson)] = np.frombuffer(mjson, np.uint8)
    dst[: _HEADER.size] = np.frombuffer(_HEADER.pack(MAGIC, len(mjson), checksum(mjson), layout.total), np.uint8)
    return layout.total


def decode_payload(buf, verify: bool = True) -> tuple[Manifest, dict[str, np.ndarray]]:
    """Parse and verify a payload (any buffer: numpy array, bytes, memoryview); returns its manifest and a uint8
    view (no copy) of each entry's stored bytes.

    Raises CorruptVersion on any inconsistency. `verify=False` skips only the per-entry data checksums.
    """
    buf = np.frombuffer(buf, np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1).view(np.uint8)
    if buf.nbytes < _HEADER.size:
        raise CorruptVersion("payload shorter than its header")
    magic, mlen, mhash, total = _HEADER.unpack(buf[: _HEADER.size].tobytes())
    if magic != MAGIC or total > buf.nbytes or _HEADER.size + mlen > total:
        raise CorruptVersion("bad payload header")
    mjson = buf[_HEADER.size : _HEADER.size + mlen].tobytes()
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
        views[e.name] = buf[start : start + e.nbytes]
        pos, offset = start + e.nbytes, _align(offset + e.nbytes)
    if max(pos, data_start) != total:
        raise CorruptVersion("payload length disagrees with its entries")
    if verify:
        for e, digest in zip(manifest.entries, checksums([views[e.name] for e in manifest.entries])):
            if digest != e.blob_xxh3:
                raise CorruptVersion(f"checksum mismatch in {e.name!r}")
    return manifest, views
