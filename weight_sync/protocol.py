"""The one protocol every transport speaks: `Sender.push(named arrays, version)` and `Receiver.pull()`.

The transport-neutral half lives here: validating input, deciding keyframe vs delta, checksums, applying a chain of
deltas, refusing corrupt versions while keeping the last good weights, and asking the sender for a keyframe when the
receiver's base does not match. A transport (shm, disk, Ray) only moves a `Manifest` plus its stored blobs, by
subclassing `Sender` and `Receiver` and implementing their hooks (documented on the classes):

    Sender._publish(manifest, blobs) -> bytes moved      Receiver._latest(at_most) -> newest version held | None
    Sender._take_keyframe_request() -> bool              Receiver._read(version) -> Message | None
                                                          Receiver._request_keyframe()

A receiving transport also calls `Receiver._writer_restarted()` when it sees that a new sender took over the run.
The hooks keep their leading underscore: push() and pull() call them; the users of a sender or receiver never do.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from weight_sync import delta as delta_codec
from weight_sync.checksum import checksum
from weight_sync.manifest import (
    CorruptVersion,
    Manifest,
    TensorEntry,
    bits_view,
    check_named_arrays,
    dtype_from_name,
    dtype_name,
)

log = logging.getLogger(__name__)


class TornRead(Exception):
    """The writer reused the buffer while we read it: not corruption, just read again."""


@dataclass
class SyncStats:
    version: int
    bytes: int  # bytes the transport moved for this version
    full_bytes: int  # bytes of the full state dict (what a full sync moves)
    changed_frac: float  # elements whose bits changed since the last version sent (1.0 when not tracked)
    keyframe: bool
    encode_s: float  # diffing, compression, the deltas' checksums
    transfer_s: float  # writing into the transport (copy into shm / files on disk / object store; raw tensors'
    # checksums are taken as they are written)

    def metrics(self) -> dict[str, float]:
        """The `sync/*` metrics the loop logs for this push."""
        return {
            "sync/version": self.version,
            "sync/bytes": self.bytes,
            "sync/full_bytes": self.full_bytes,
            "sync/changed_frac": self.changed_frac,
            "sync/keyframe": float(self.keyframe),
            "sync/encode_s": self.encode_s,
            "sync/transfer_s": self.transfer_s,
        }


DELTA_WORTH_RATIO = 0.5  # a delta past this fraction of the full version is sent as a keyframe instead


@dataclass
class Message:
    """One version as read from a transport: its verified manifest and a uint8 view of each entry's stored bytes."""

    manifest: Manifest
    blobs: dict[str, np.ndarray]
    still_valid: Callable[[], bool] = lambda: True  # shm: False once the writer started reusing the buffer
    borrowed: bool = False  # blobs are views into a buffer the transport will reuse


class _Endpoint:
    """Either end of a transport: a context manager whose `close` releases what the transport holds."""

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Sender(_Endpoint):
    """Base sender: input checks and the keyframe / delta policy. A transport subclasses it and implements

    `_publish(manifest, blobs) -> int`: make version `manifest.version` readable and return the bytes moved. `blobs`
        maps each entry's name to its stored bytes (a numpy array: the tensor for a raw entry, a uint8 delta blob
        otherwise); they may alias the caller's live arrays, so copy them before returning. Raw entries arrive with
        their checksums unset (None): fill them in (encode_payload_into does it while it copies).
    `_take_keyframe_request() -> bool`: whether a receiver asked for a keyframe since the last call (and clear the
        request). Polled once per push; the default never sees one.
    `close()`: release what the transport holds (also called by `with`).
    """

    def __init__(self, *, delta: bool = False, keyframe_every: int = 10):
        if keyframe_every < 1:
            raise ValueError(f"keyframe_every must be >= 1, got {keyframe_every}")
        self.delta = delta
        self.keyframe_every = keyframe_every
        self.version: int | None = None
        self._last: dict[str, np.ndarray] | None = None  # bits of the last version sent (delta mode only)
        self._deltas_since_key = 0
        self._keyframe_next = False

    def force_keyframe(self) -> None:
        """Make the next push a keyframe: a receiver that joins late (a restarted engine) has no base for deltas."""
        self._keyframe_next = True

    # -- transport hooks --
    def _publish(self, manifest: Manifest, blobs: Mapping[str, np.ndarray]) -> int:
        raise NotImplementedError

    def _take_keyframe_request(self) -> bool:
        return False

    # -- protocol --
    def push(self, named_arrays: Mapping[str, np.ndarray], version: int) -> SyncStats:
        """Publish `named_arrays` as `version`. The arrays may alias live parameters: they are copied before return."""
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
            raise ValueError(f"version must be a non-negative int, got {version!r}")
        version = int(version)
        if self.version is not None and version <= self.version:
            raise ValueError(f"version {version} is not newer than the last pushed version {self.version}")
        t0 = time.perf_counter()
        arrays = check_named_arrays(named_arrays)
        manifest, blobs, changed = self._encode(arrays, version)
        t1 = time.perf_counter()
        nbytes = self._publish(manifest, blobs)
        t2 = time.perf_counter()
        if self.delta:
            self._remember(arrays, changed)
        t3 = time.perf_counter()
        total = sum(a.size for a in arrays.values())
        frac = sum(len(i) for i in changed.values()) / max(total, 1) if changed else 1.0
        self.version = version
        return SyncStats(
            version,
            nbytes,
            sum(a.nbytes for a in arrays.values()),
            frac,
            manifest.keyframe,
            (t1 - t0) + (t3 - t2),
            t2 - t1,
        )

    def _compatible(self, arrays: dict[str, np.ndarray]) -> bool:
        last = self._last
        return (
            last is not None
            and last.keys() == arrays.keys()
            and all(last[n].dtype == a.dtype and last[n].shape == a.shape for n, a in arrays.items())
        )

    def _encode(self, arrays: dict[str, np.ndarray], version: int):
        requested = self._take_keyframe_request() or self._keyframe_next  # polled always: consumed by this push
        self._keyframe_next = False
        changed: dict[str, np.ndarray] = {}
        if self.delta and self._compatible(arrays):
            changed = {n: delta_codec.changed_indices(self._last[n], a) for n, a in arrays.items()}
        full_bytes = sum(a.nbytes for a in arrays.values())
        # A delta carries every changed value: when those alone exceed what a delta may weigh, encoding it would
        # only find that out (fp32 at a high learning rate changes every element; zstd-ing it all cost more than
        # the whole push of a small model). Weights are float mantissas, which zstd barely shrinks.
        value_bytes = sum(len(idx) * arrays[n].itemsize for n, idx in changed.items())
        hopeless = value_bytes > DELTA_WORTH_RATIO * full_bytes
        if changed and not requested and not hopeless and self._deltas_since_key + 1 < self.keyframe_every:
            entries, blobs = [], {}
            for name, new in arrays.items():
                blob = np.frombuffer(delta_codec.encode(self._last[name], new, changed[name]), np.uint8)
                blobs[name] = blob
                entries.append(
                    TensorEntry(
                        name,
                        dtype_name(new.dtype, name),
                        list(new.shape),
                        "delta",
                        blob.nbytes,
                        checksum(blob),
                        checksum(new),
                    )
                )
            if sum(b.nbytes for b in blobs.values()) <= DELTA_WORTH_RATIO * full_bytes:
                self._deltas_since_key += 1
                return Manifest(version, self.version, entries), blobs, changed
        self._deltas_since_key = 0
        # Raw tensors are hashed by the transport while it copies them (encode_payload_into): one pass, not two.
        entries = [
            TensorEntry(name, dtype_name(a.dtype, name), list(a.shape), "raw", a.nbytes, None, None)
            for name, a in arrays.items()
        ]
        return Manifest(version, None, entries), arrays, changed

    def _remember(self, arrays: dict[str, np.ndarray], changed: dict[str, np.ndarray]) -> None:
        """Keep the bits just sent; after a delta only the changed elements are copied."""
        if changed:
            for name, idx in changed.items():
                bits_view(self._last[name])[idx] = bits_view(arrays[name])[idx]
        elif self._compatible(arrays):
            for name, a in arrays.items():
                np.copyto(self._last[name], a)  # reuse the buffers: no fresh pages
        else:
            self._last = {n: a.copy() for n, a in arrays.items()}


class Receiver(_Endpoint):
    """Base receiver: verification, delta chains, refusal and keyframe requests. A transport subclasses it and
    implements

    `_latest(at_most=None) -> int | None`: the newest version the transport holds, none above `at_most` when it is
        given (versions have gaps: a step whose update was skipped pushes nothing), or None. A transport that can
        tell a new sender took over the run (a resumed run numbering afresh) calls `self._writer_restarted()` here
        first.
    `_read(version) -> Message | None`: that version, verified (decode_payload does it for a flat payload), or None
        if it is gone; raise CorruptVersion if it fails verification.
    `_request_keyframe()`: ask the sender for a keyframe at its next push (the default does nothing).
    `close()`: release what the transport holds (also called by `with`).

    Attributes after each pull: `version` (last returned), `refused` (versions that failed verification),
    `keyframe_requests`, `read_s` (reading and verifying) and `apply_s` (decoding deltas / building arrays).
    """

    def __init__(self, *, delta: bool = False):
        self.delta = delta
        self.version: int | None = None
        self.refused = 0
        self.keyframe_requests = 0
        self.read_s = 0.0
        self.apply_s = 0.0
        self._state: dict[str, np.ndarray] | None = None  # owned arrays of `version` (delta mode only)
        self._bad: set[int] = set()
        self._waiting_since: int | None = None  # newest version when we last asked for a keyframe

    # -- transport hooks --
    def _latest(self, at_most: int | None = None) -> int | None:
        raise NotImplementedError

    def _read(self, version: int) -> Message | None:
        raise NotImplementedError

    def _request_keyframe(self) -> None:
        pass

    def _writer_restarted(self) -> None:
        """A new sender took over the run (e.g. a resumed run): its versions start afresh, forget ours."""
        self.version, self._state, self._bad, self._waiting_since = None, None, set(), None

    def metrics(self) -> dict[str, float]:
        """The receiver-side `sync/*` metrics: the last pull's read and apply seconds, and the running counters."""
        return {
            "sync/read_s": self.read_s,
            "sync/apply_s": self.apply_s,
            "sync/refused": self.refused,
            "sync/keyframe_requests": self.keyframe_requests,
        }

    # -- protocol --
    def pull(self, at_most: int | None = None) -> tuple[int, dict[str, np.ndarray]] | None:
        """The newest verified version newer than the last one returned, or None. Never raises on bad data. With
        `at_most`, the newest version not above it that the transport still holds (the disk and Ray transports keep
        `keep` versions, shm the last two): `at_most` itself need not have been published."""
        for _ in range(5):
            latest = self._latest(at_most)
            if (
                latest is None
                or latest in self._bad
                or latest == self._waiting_since
                or (self.version is not None and latest <= self.version)
            ):
                return None  # nothing new, refused before, or still waiting for the keyframe we asked for
            try:
                return self._pull(latest)
            except TornRead:
                continue
            except CorruptVersion as exc:
                self._refuse(latest, exc)
                if self.delta:  # the next deltas would build on what we refused: ask for a fresh start right away
                    self.keyframe_requests += 1
                    self._request_keyframe()
                return None
        return None

    def _pull(self, latest: int):
        t0 = time.perf_counter()
        msg = self._checked(self._read(latest), latest)
        if msg is None:
            return None
        chain = [msg]
        while not chain[-1].manifest.keyframe and (
            self._state is None or chain[-1].manifest.base_version != self.version
        ):
            base = chain[-1].manifest.base_version
            prev = None
            if base not in self._bad and (self.version is None or base > self.version):
                try:
                    prev = self._checked(self._read(base), base)
                except CorruptVersion as exc:
                    self._refuse(base, exc)
            if prev is None:
                if not self.delta and not self.keyframe_requests:
                    log.warning(
                        "weight_sync: the sender sends deltas but this receiver has delta=False; every "
                        "version will cost a keyframe request: set delta=True on both sides"
                    )
                self.keyframe_requests += 1
                self._request_keyframe()
                self._waiting_since = chain[0].manifest.version
                return None
            chain.append(prev)
        t1 = time.perf_counter()
        state = dict(self._state or {})
        try:
            for m in reversed(chain):
                state = self._apply(m, state)
        except CorruptVersion:
            if all(m.still_valid() for m in chain):
                raise
            # else the writer reused a buffer under us: a torn read (below), not a corrupt version
        if not all(m.still_valid() for m in chain):
            raise TornRead()
        self.read_s, self.apply_s = t1 - t0, time.perf_counter() - t1
        self._state = state if self.delta else None
        self.version = latest
        return latest, dict(state)

    @staticmethod
    def _checked(msg: Message | None, version: int) -> Message | None:
        """`msg`, read as `version`, once it is what the chain walk may follow: each step must go to an older version,
        or a crafted or corrupt manifest (a delta on itself, on a newer version) would walk in circles forever."""
        if msg is not None:
            m = msg.manifest
            if m.version != version:
                raise CorruptVersion(f"version {version} holds a manifest for version {m.version}")
            if m.base_version is not None and m.base_version >= m.version:
                raise CorruptVersion(f"version {m.version} is a delta on version {m.base_version}, not an older one")
        return msg

    def _refuse(self, version: int, exc: CorruptVersion) -> None:
        self.refused += 1
        self._bad.add(version)
        log.warning("weight_sync: refused version %d (%s); keeping version %s", version, exc, self.version)

    def _apply(self, msg: Message, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The tensors of `msg` on top of `state` (never modified); raises CorruptVersion if anything mismatches."""
        out = {}
        for e in msg.manifest.entries:
            dtype, blob = dtype_from_name(e.dtype), msg.blobs[e.name]
            if e.encoding == "raw":
                if e.xxh3 != e.blob_xxh3:
                    raise CorruptVersion(f"checksums of raw tensor {e.name!r} disagree")
                arr = blob.view(dtype).reshape(e.shape)
                if self.delta and msg.borrowed:
                    arr = arr.copy()  # the state must outlive the transport's buffer
            else:
                base = state.get(e.name)
                if base is None or base.dtype != dtype or list(base.shape) != e.shape:
                    raise CorruptVersion(f"delta for {e.name!r} does not fit the receiver's tensor")
                arr = delta_codec.apply(base, blob)
                if checksum(arr) != e.xxh3:
                    raise CorruptVersion(f"reconstructed {e.name!r} does not match its checksum")
            out[e.name] = arr
        return out
