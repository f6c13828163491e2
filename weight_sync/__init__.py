"""Weight sync from trainer to rollout: shared memory (same host), disk checkpoints (across hosts), deltas on either.

    cfg = SyncConfig(run_id="exp1", transport="shm", delta=True)  # weight_sync/config.py: every knob, once
    sender = make_sender(cfg)                                      # trainer side
    stats = sender.push(trainer.export_weights(), version=step)    # SyncStats; stats.metrics() -> sync/* metrics
    receiver = make_receiver(cfg)                                  # rollout side
    got = receiver.pull()                                          # (version, {hf_name: np.ndarray}) or None

`TRANSPORTS` names what make_sender / make_receiver build ("shm", "disk"). push() takes numpy arrays keyed by
Hugging Face parameter name (bf16 as ml_dtypes.bfloat16, as `Trainer.export_weights()` returns them); weight_sync
never imports torch, and a torch tensor is refused with a ValueError naming it.

Arrays returned by pull() are zero-copy views (read-only for disk and Ray): load them onto the device before the
sender pushes two more versions (shm reuses its two buffers, and copies a version that the very next push
overwrites, e.g. one pulled with `at_most`; disk prunes beyond `keep`). A receiver whose config has `delta` keeps its
own copy of the current weights, which deltas are applied to (copy-on-write, never in place), and returns that copy:
treat pulled arrays as read-only (a scribbled-on base is caught by the checksum of the next reconstruction, refused,
and repaired by a keyframe).

Other transports speak the same protocol by subclassing `Sender` and `Receiver` (their docstrings list the hooks:
`_publish`, `_take_keyframe_request`; `_latest(at_most)`, `_read`, `_request_keyframe`; `_latest` calls the base
class's `_writer_restarted` when a new sender took over) and moving each version as one flat payload:

    n = payload_nbytes(manifest)                    # Sender._publish: size a (reused) uint8 buffer, write the
    encode_payload_into(buf, manifest, blobs)       # payload (fills in raw entries' checksums), move buf[:n]
    manifest, blobs = decode_payload(data, verify)  # Receiver._read: verify (raises CorruptVersion) and
    return Message(manifest, blobs)                 # hand back zero-copy views of the stored bytes

The Ray object-store transport is built that way and lives in `rlloop.ray_sync` (Ray stays out of here).
"""

from __future__ import annotations

from weight_sync.config import SyncConfig
from weight_sync.manifest import CorruptVersion, Manifest, TensorEntry
from weight_sync.payload import decode_payload, encode_payload_into, payload_nbytes
from weight_sync.protocol import Message, Receiver, Sender, SyncStats

TRANSPORTS = ("shm", "disk")

__all__ = [
    "SyncConfig",
    "make_sender",
    "make_receiver",
    "TRANSPORTS",
    "SyncStats",
    # the transport interface: base classes, what a read returns, the flat payload codec
    "Sender",
    "Receiver",
    "Message",
    "Manifest",
    "TensorEntry",
    "CorruptVersion",
    "payload_nbytes",
    "encode_payload_into",
    "decode_payload",
]


def _check(cfg: SyncConfig) -> None:
    if cfg.transport == "ray":
        raise ValueError("sync transport 'ray' is built by rlloop.ray_sync.make_ray_sender / make_ray_receiver")
    if cfg.transport == "disk" and cfg.dir is None:
        raise ValueError("sync transport 'disk' needs dir= (the root directory, shared between hosts)")


def make_sender(cfg: SyncConfig) -> Sender:
    """A sender for `cfg.transport` ("shm" | "disk")."""
    _check(cfg)
    if cfg.transport == "shm":
        from weight_sync.shm import ShmSender

        return ShmSender(cfg.run_id, delta=cfg.delta, keyframe_every=cfg.keyframe_every)
    from weight_sync.disk import DiskSender

    return DiskSender(cfg.dir, cfg.run_id, keep=cfg.keep, delta=cfg.delta, keyframe_every=cfg.keyframe_every)


def make_receiver(cfg: SyncConfig) -> Receiver:
    """A receiver for `cfg.transport`; with `cfg.delta` it keeps an owned copy of the weights to apply deltas to."""
    _check(cfg)
    if cfg.transport == "shm":
        from weight_sync.shm import ShmReceiver

        return ShmReceiver(cfg.run_id, delta=cfg.delta)
    from weight_sync.disk import DiskReceiver

    return DiskReceiver(cfg.dir, cfg.run_id, delta=cfg.delta)
