"""Checksums of weight bytes, computed on every core: xxh3-64 over fixed-size parts.

    checksum(buf) = xxh3_64(buf)                                   if len(buf) <= PART
                    xxh3_64(digest(part 0) || digest(part 1) ...)  otherwise, digests as little-endian u64

A flipped byte changes its part's digest and so the whole checksum. Why parts: one xxh3 stream runs at ~10 GB/s on
one core, as fast as a memory copy, so a verified sync (hash on the writer, hash again on the reader) would spend more
time hashing than moving bytes. xxhash releases the GIL, so the parts of every buffer in a version are hashed on a
small thread pool at once. The writer hashes each part right after copying it, while it is still in cache.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import xxhash

PART = 8 << 20  # bytes per independently hashed part
_COPY_CHUNK = 256 << 10  # within a part: copy this much, then hash it while it is still in cache
# Fewer bytes than this in all are hashed inline: ~0.2 ms of hashing, less than handing two dozen small buffers to
# the pool costs (a small model's push spent ~0.8 ms waiting on it).
_PARALLEL_MIN_BYTES = 2 << 20
_pool: ThreadPoolExecutor | None = None
_pool_pid = -1


def _map(fn, items: list, nbytes: int) -> list:
    """fn over items (`nbytes` in all) on the shared thread pool, or inline when there is one item or too few bytes
    to be worth the pool."""
    global _pool, _pool_pid
    if len(items) <= 1 or nbytes < _PARALLEL_MIN_BYTES:
        return [fn(x) for x in items]
    if _pool is None or _pool_pid != os.getpid():  # a forked child inherits the pool object but not its threads
        _pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="rlloop-hash")
        _pool_pid = os.getpid()
    return list(_pool.map(fn, items))


def byte_view(buf) -> np.ndarray:
    """The raw bytes of an array or buffer as a flat uint8 array (no copy for contiguous input)."""
    if isinstance(buf, np.ndarray):
        return np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    return np.frombuffer(buf, np.uint8)


def _parts(n: int) -> list[slice]:
    return [slice(i, min(i + PART, n)) for i in range(0, max(n, 1), PART)]


def _combine(digests: list) -> int | None:
    if len(digests) == 1 or digests[0] is None:  # None: parts copied without hashing
        return digests[0]
    return xxhash.xxh3_64_intdigest(np.array(digests, "<u8").tobytes())


def _per_buffer(digests: list, parts: list[list[slice]]) -> list:
    """Combine the flat list of part digests back into one checksum per buffer."""
    out, at = [], 0
    for ps in parts:
        out.append(_combine(digests[at : at + len(ps)]))
        at += len(ps)
    return out


def checksums(bufs: Sequence) -> list[int]:
    """checksum() of each buffer; the parts of all of them are hashed in parallel."""
    views = [byte_view(b) for b in bufs]
    parts = [_parts(v.size) for v in views]
    digests = _map(
        xxhash.xxh3_64_intdigest, [v[s] for v, ps in zip(views, parts) for s in ps], sum(v.size for v in views)
    )
    return _per_buffer(digests, parts)


def checksum(buf) -> int:
    return checksums([buf])[0]


def _copy_part(job: tuple[np.ndarray, np.ndarray, bool]) -> int | None:
    dst, src, want_hash = job
    if not want_hash:
        np.copyto(dst, src)
        return None
    h = xxhash.xxh3_64()
    for i in range(0, src.size, _COPY_CHUNK):
        chunk = dst[i : i + _COPY_CHUNK]
        np.copyto(chunk, src[i : i + _COPY_CHUNK])
        h.update(chunk)
    return h.intdigest()


def copy_with_checksums(pairs: Sequence[tuple[np.ndarray, np.ndarray, bool]]) -> list[int | None]:
    """Copy each (dst, src, want_hash) pair of equal-length uint8 arrays, all parts in parallel; returns the checksum
    of each copied buffer where asked for, else None."""
    parts = [_parts(src.size) for _, src, _ in pairs]
    jobs = [(dst[s], src[s], want) for (dst, src, want), ps in zip(pairs, parts) for s in ps]
    return _per_buffer(_map(_copy_part, jobs, sum(src.size for _, src, _ in pairs)), parts)
