"""Fixtures for the weight-sync tests: a fresh run id per test, a check that no /dev/shm segment leaks, and a sender
with its receiver."""

import os
import uuid
from pathlib import Path

import pytest

from weight_sync import SyncConfig, make_receiver, make_sender


@pytest.fixture
def run_id():
    rid = f"test{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield rid
    leaked = sorted(p.name for p in Path("/dev/shm").glob(f"rlloop_{rid}_*"))
    for name in leaked:
        (Path("/dev/shm") / name).unlink(missing_ok=True)
    assert not leaked, f"leaked shm segments: {leaked}"


def transport_pair(transport, run_id, tmp_path, **kw):
    """A sender and a receiver of one run on `transport` (disk: under `tmp_path`), no deltas and keep=2 unless `kw`
    says otherwise."""
    keep = kw.pop("keep", 2)
    kw.setdefault("delta", False)
    cfg = SyncConfig(run_id=run_id, transport=transport, dir=tmp_path, keep=keep, **kw)
    return make_sender(cfg), make_receiver(cfg)  # a receiver reads only run_id, transport, dir and delta
