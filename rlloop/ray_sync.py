"""Weight sync through the Ray object store: for multi-node runs with no shared filesystem.

The sender encodes each version as one flat payload (weight_sync's codec, `encode_payload_into`: manifest,
checksums, 64-byte aligned tensors), `ray.put`s it and posts the ObjectRef to a small named actor, the mailbox,
which keeps the newest `keep` refs and the receiver's keyframe requests. The receiver asks the mailbox for the newest
version it holds (none above the pull's `at_most`), `ray.get`s the payload (zero-copy from the local object store
on the same node, one transfer across nodes) and verifies it with the same code as shm (`decode_payload`).
Everything else (deltas, keyframes, refusal of corrupt versions) is the transport-neutral protocol of
`weight_sync.Sender` / `weight_sync.Receiver`, whose transport hooks this file implements, using only weight_sync's
public API: it is only about moving bytes.

The sender process owns the payload objects (Ray 2.56 removed `ray.put(_owner=...)`); if it dies, its versions are
lost and a receiver sees no new version until a restarted sender pushes one (a delta receiver then gets a
keyframe, since the new sender starts with one). Arrays returned by a pull are read-only views into the object
store, kept alive by Ray as long as they are referenced. The mailbox is an ordinary (not detached) actor: it lives
as long as whoever created it first, so it never outlives the job; in a run that is the driver (rlloop.cluster), so
that an engine or a trainer rank that dies does not take it along.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import ray

from rlloop.ray_session import NAMESPACE
from weight_sync import (
    Manifest,
    Message,
    Receiver,
    Sender,
    SyncConfig,
    decode_payload,
    encode_payload_into,
    payload_nbytes,
)


@ray.remote(num_cpus=0)
class SyncMailbox:
    """The newest versions' ObjectRefs of one run (boxed in a list so Ray does not resolve them) and a keyframe flag."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self.refs: dict[int, list] = {}
        self.keyframe_requested = False
        self.writer = 0  # bumped by each new sender: its versions start afresh (a resumed run)

    def new_writer(self, keep: int) -> int:
        self.keep, self.refs, self.keyframe_requested = keep, {}, False
        self.writer += 1
        return self.writer

    def post(self, writer: int, version: int, boxed_ref: list) -> bool:
        """False, and nothing kept, for a writer that another has replaced since."""
        if writer != self.writer:
            return False
        self.refs[version] = boxed_ref
        for old in sorted(self.refs)[: -self.keep]:
            del self.refs[old]
        return True

    def latest(self, at_most: int | None = None) -> tuple[int, int | None]:
        """The writer's number and its newest version held, none above `at_most` (versions may have gaps)."""
        held = [v for v in self.refs if at_most is None or v <= at_most]
        return self.writer, (max(held) if held else None)

    def get(self, version: int) -> list | None:
        return self.refs.get(version)

    def request_keyframe(self) -> None:
        self.keyframe_requested = True

    def take_keyframe_request(self) -> bool:
        requested, self.keyframe_requested = self.keyframe_requested, False
        return requested


def get_mailbox(run_id: str, keep: int = 2):
    """The run's mailbox actor, created by whichever side comes first."""
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"run_id {run_id!r} must be a non-empty string")
    return SyncMailbox.options(name=f"rlloop_sync_{run_id}", namespace=NAMESPACE, get_if_exists=True).remote(keep)


class RaySender(Sender):
    def __init__(self, run_id: str, *, delta: bool = False, keyframe_every: int = 10, keep: int = 2):
        super().__init__(delta=delta, keyframe_every=keyframe_every)
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.mailbox = get_mailbox(run_id, keep)
        self.run_id = run_id
        self._writer = ray.get(self.mailbox.new_writer.remote(keep))
        self._staging: np.ndarray | None = None

    def _publish(self, manifest: Manifest, blobs: Mapping[str, np.ndarray]) -> int:
        total = payload_nbytes(manifest)
        if self._staging is None or self._staging.nbytes < total:
            # Reused across versions: a fresh buffer per push would pay first-touch page faults every time.
            self._staging = np.empty(total + total // 16, np.uint8)
        encode_payload_into(self._staging, manifest, blobs)
        ref = ray.put(self._staging[:total])  # copied into the object store
        if not ray.get(self.mailbox.post.remote(self._writer, manifest.version, [ref])):
            raise RuntimeError(
                f"another weight sender took run {self.run_id!r}'s mailbox over: a rebuilt trainer's, or another run's "
                "with the same run id (run.dir) in this Ray cluster; this one publishes no more"
            )
        return total

    def _take_keyframe_request(self) -> bool:
        return ray.get(self.mailbox.take_keyframe_request.remote())


class RayReceiver(Receiver):
    def __init__(self, run_id: str, *, delta: bool = False):
        super().__init__(delta=delta)
        self.mailbox = get_mailbox(run_id)
        self._writer: int | None = None

    def _latest(self, at_most: int | None = None) -> int | None:
        writer, latest = ray.get(self.mailbox.latest.remote(at_most))
        if writer != self._writer:
            if self._writer is not None:
                self._writer_restarted()
            self._writer = writer
        return latest

    def _read(self, version: int) -> Message | None:
        boxed = ray.get(self.mailbox.get.remote(version))
        if boxed is None:
            return None
        try:
            payload = ray.get(boxed[0])
        except (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError):
            return None
        manifest, blobs = decode_payload(payload, verify=True)
        return Message(manifest, blobs)

    def _request_keyframe(self) -> None:
        ray.get(self.mailbox.request_keyframe.remote())


def _check(cfg: SyncConfig) -> None:
    if cfg.transport != "ray":
        raise ValueError(f"sync transport {cfg.transport!r} is built by weight_sync.make_sender / make_receiver")


def make_ray_sender(cfg: SyncConfig) -> RaySender:
    """Same semantics as weight_sync.make_sender, for `cfg.transport == "ray"`; needs `ray.init()` first."""
    _check(cfg)
    return RaySender(cfg.run_id, delta=cfg.delta, keyframe_every=cfg.keyframe_every, keep=cfg.keep)


def make_ray_receiver(cfg: SyncConfig) -> RayReceiver:
    """Same semantics as weight_sync.make_receiver, for `cfg.transport == "ray"`; needs `ray.init()` first."""
    _check(cfg)
    return RayReceiver(cfg.run_id, delta=cfg.delta)
