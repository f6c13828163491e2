"""Cross-host weight sync through checkpoint directories on a (shared) filesystem.

    <root>/<run_id>/v000000000042/weights.safetensors   the tensors (raw, or uint8 delta blobs)
    <root>/<run_id>/v000000000042/manifest.json         weight_sync.manifest, checksum of the safetensors header, WRITER
    <root>/<run_id>/KEYFRAME_REQUEST                     created by a receiver whose base does not match
    <root>/<run_id>/WRITER                               a random id per sender: a new one restarts the numbering

A version is written under `.tmp-...` and renamed into place, so a reader on any host sees a whole version or none.
Its manifest names the sender that wrote it (WRITER's id), and a reader takes versions of the current sender only:
a sender whose directory was taken over (by a rebuilt trainer's, or by another run given the same run id and
directory) gets an error at its next push, and a version it may still have renamed into place is passed over by the
readers and removed by the current sender's next push.
The reader verifies everything before handing anything out: the manifest's own checksum (and that it is byte for
byte the canonical JSON), the safetensors header's checksum, and each tensor's checksum, shape and extent. Together
these cover every byte of both files. It maps the file and hands out read-only views (zero copy). Old versions
beyond `keep` are pruned; a reader that loses the race with pruning just sees no new version this time. Files are
not fsync'ed: rename gives atomicity against a killed writer, and NFS-style shared filesystems flush on close; only
a host power loss could tear a version, which the checksums then refuse.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import re
import shutil
import struct
from dataclasses import asdict
from pathlib import Path
from typing import Mapping

import numpy as np
from safetensors.numpy import save_file

from weight_sync.checksum import checksum, checksums
from weight_sync.manifest import CorruptVersion, Manifest, fill_checksums
from weight_sync.protocol import Message, Receiver, Sender
from weight_sync.shm import check_run_id

_VERSION_DIR = re.compile(r"^v(\d{12,})$")  # zero-padded to 12 digits, longer from 10**12 on
WEIGHTS, MANIFEST, KEYFRAME_REQUEST, WRITER = "weights.safetensors", "manifest.json", "KEYFRAME_REQUEST", "WRITER"


def _canonical(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def _read_header(f) -> tuple[bytes, int]:
    """The safetensors header of open file `f` as stored (8-byte length + JSON), and the JSON's length."""
    head = f.read(8)
    (n,) = struct.unpack("<Q", head)
    if n > os.fstat(f.fileno()).st_size - 8:
        raise CorruptVersion("safetensors header length beyond the file")
    return head + f.read(n), n


def _header_checksum(path: Path) -> int:
    """xxh3 of the safetensors header; the tensor checksums cover the rest of the file."""
    with open(path, "rb") as f:
        return checksum(_read_header(f)[0])


def _map_safetensors(path: Path, header_xxh3: int) -> tuple[dict, np.ndarray]:
    """A safetensors file mapped read-only: its header (checked against `header_xxh3`) and its data bytes.

    safetensors.numpy copies every tensor into fresh memory; mapping the file instead hands out views of the page
    cache (no copy, no first-touch page faults). On a local filesystem they stay valid after the version is pruned;
    on NFS another host's prune can invalidate them, hence `borrowed` below."""
    with open(path, "rb") as f:
        header, n = _read_header(f)
        if checksum(header) != header_xxh3:
            raise CorruptVersion("safetensors header checksum mismatch")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return json.loads(header[8:]), np.frombuffer(mapped, np.uint8)[8 + n :]


def _writer_of(vdir: Path, version: int) -> str | None:
    """The sender a version's manifest names, once the manifest verifies; None where it does not (pruned, or
    corrupt: then the version is read, and refused, as any other)."""
    try:
        return _read_manifest(vdir / MANIFEST, version)[2]
    except (OSError, CorruptVersion):
        return None


def _read_manifest(path: Path, version: int) -> tuple[Manifest, int, str]:
    """The manifest of `version` in `path`, verified, the checksum it holds of its safetensors file's header, and
    the sender that wrote it."""
    raw = path.read_bytes()
    try:
        doc = json.loads(raw)
        body = {k: doc[k] for k in ("manifest", "safetensors_header_xxh3", "writer")}
        ok = _canonical(doc) == raw and checksum(_canonical(body)) == doc["xxh3"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptVersion(f"unreadable manifest: {exc}") from exc
    if not ok:
        raise CorruptVersion("manifest checksum mismatch")
    manifest = Manifest.from_json(_canonical(body["manifest"]))
    if manifest.version != version:
        raise CorruptVersion(f"directory v{version} holds a manifest for version {manifest.version}")
    return manifest, body["safetensors_header_xxh3"], body["writer"]


def _verified_blobs(manifest: Manifest, header: dict, data: np.ndarray) -> dict[str, np.ndarray]:
    """Each manifest entry's stored bytes, as views of `data`, once the file's layout matches the manifest exactly
    and every blob its checksum."""
    names = sorted(e.name for e in manifest.entries)
    if sorted(k for k in header if k != "__metadata__") != names:
        raise CorruptVersion("tensor names differ from the manifest")
    blobs, end = {}, 0
    for e in manifest.entries:
        begin, stop = header[e.name]["data_offsets"]
        shape = e.shape if e.encoding == "raw" else [e.nbytes]
        if header[e.name]["shape"] != shape or stop - begin != e.nbytes or not 0 <= begin <= stop <= data.size:
            raise CorruptVersion(f"tensor {e.name!r} does not match its manifest entry")
        blobs[e.name] = data[begin:stop]
        end = max(end, stop)
    if end != data.size:
        raise CorruptVersion("bytes after the last tensor")
    for e, digest in zip(manifest.entries, checksums([blobs[e.name] for e in manifest.entries])):
        if digest != e.blob_xxh3:
            raise CorruptVersion(f"checksum mismatch in {e.name!r}")
    return blobs


def _versions(run_dir: Path) -> list[int]:
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for m in map(_VERSION_DIR.match, names) if m)


class DiskSender(Sender):
    def __init__(self, root: str | Path, run_id: str, *, keep: int = 2, delta: bool = False, keyframe_every: int = 10):
        super().__init__(delta=delta, keyframe_every=keyframe_every)
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self.run_dir = Path(root) / check_run_id(run_id)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.run_dir, 0o700)  # the weights are the owner's: nobody else lists or reads the versions
        # A new sender starts a new epoch: versions of an earlier writer (a crashed or resumed run) would otherwise
        # look newer than ours, and half-written .tmp-* directories of a killed one are garbage.
        for old in self.run_dir.iterdir():
            if old.name.startswith(".tmp-") or _VERSION_DIR.match(old.name):
                shutil.rmtree(old, ignore_errors=True)
        (self.run_dir / KEYFRAME_REQUEST).unlink(missing_ok=True)
        tmp = self.run_dir / f".tmp-{WRITER}-{os.getpid()}"
        self._epoch = os.urandom(8).hex()
        tmp.write_text(self._epoch)
        os.rename(tmp, self.run_dir / WRITER)

    def _ours(self) -> bool:
        try:
            return (self.run_dir / WRITER).read_text() == self._epoch
        except FileNotFoundError:
            return False

    def _check_still_writer(self) -> None:
        if not self._ours():
            raise RuntimeError(
                f"another weight sender took {self.run_dir} over: a rebuilt trainer's, or another run's with the same "
                "run id (run.dir) and sync dir; this one publishes no more"
            )

    def close(self) -> None:
        """Remove the versions: no later sender reads them (it starts a new epoch), and each is a copy of the model.
        Not if another sender has since taken the directory over."""
        if self._ours():
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _publish(self, manifest: Manifest, blobs: Mapping[str, np.ndarray]) -> int:
        if "__metadata__" in blobs:  # safetensors keeps its own metadata under that key: no reader would see a tensor
            raise ValueError("tensor name '__metadata__' is reserved by safetensors: the disk transport cannot move it")
        final = self.run_dir / f"v{manifest.version:012d}"
        tmp = self.run_dir / f".tmp-v{manifest.version:012d}-{os.getpid()}"
        self._check_still_writer()
        tmp.mkdir()
        try:
            fill_checksums(manifest, blobs)
            save_file(dict(blobs), tmp / WEIGHTS)
            body = {
                "manifest": asdict(manifest),
                "safetensors_header_xxh3": _header_checksum(tmp / WEIGHTS),
                "writer": self._epoch,
            }
            (tmp / MANIFEST).write_bytes(_canonical({**body, "xxh3": checksum(_canonical(body))}))
            self._check_still_writer()
            os.rename(tmp, final)
        except BaseException:  # a full disk: nothing half-written stays to block the version's next try
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if self._ours():  # a sender replaced in the meantime prunes nothing: the versions are the new one's
            for v in _versions(self.run_dir):  # a replaced sender's, renamed into place after our start: not kept
                if v != manifest.version and _writer_of(self.run_dir / f"v{v:012d}", v) not in (self._epoch, None):
                    shutil.rmtree(self.run_dir / f"v{v:012d}", ignore_errors=True)
            for old in _versions(self.run_dir)[: -self.keep]:
                shutil.rmtree(self.run_dir / f"v{old:012d}", ignore_errors=True)
        return (final / WEIGHTS).stat().st_size + (final / MANIFEST).stat().st_size

    def _take_keyframe_request(self) -> bool:
        try:
            (self.run_dir / KEYFRAME_REQUEST).unlink()
            return True
        except FileNotFoundError:
            return False


class DiskReceiver(Receiver):
    def __init__(self, root: str | Path, run_id: str, *, delta: bool = False):
        super().__init__(delta=delta)
        self.run_dir = Path(root) / check_run_id(run_id)
        self._writer: str | None = None  # the sender epoch whose versions we follow

    def _latest(self, at_most: int | None = None) -> int | None:
        try:
            writer = (self.run_dir / WRITER).read_text()
        except FileNotFoundError:
            return None
        if writer != self._writer:
            if self._writer is not None:
                self._writer_restarted()
            self._writer = writer
        versions = [v for v in _versions(self.run_dir) if at_most is None or v <= at_most]
        # the newest of the current sender's: a replaced one's may have landed after it took over
        return next(
            (v for v in reversed(versions) if _writer_of(self.run_dir / f"v{v:012d}", v) in (writer, None)), None
        )

    def _read(self, version: int) -> Message | None:
        vdir = self.run_dir / f"v{version:012d}"
        try:
            manifest, header_xxh3, writer = _read_manifest(vdir / MANIFEST, version)
            if writer != self._writer:  # replaced since we looked: a newer sender's, or a replaced one's
                return None
            header, data = _map_safetensors(vdir / WEIGHTS, header_xxh3)
            blobs = _verified_blobs(manifest, header, data)
        except FileNotFoundError:
            return None  # pruned while we read: not corruption, a newer version exists
        except OSError as exc:
            if exc.errno == errno.ESTALE:  # pruned by the writer's host, on NFS
                return None
            raise CorruptVersion(f"unreadable safetensors file: {exc}") from exc
        except (struct.error, ValueError, KeyError, TypeError) as exc:
            raise CorruptVersion(f"unreadable safetensors file: {exc}") from exc
        # borrowed: on a shared filesystem a mapped file pruned by the writer's host can vanish under us, so a delta
        # receiver copies what it keeps; a returned version should be loaded (put on device) before `keep` more land.
        return Message(manifest, blobs, borrowed=True)

    def _request_keyframe(self) -> None:
        (self.run_dir / KEYFRAME_REQUEST).touch()
