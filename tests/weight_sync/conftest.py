"""Fixtures for the weight-sync tests: a fresh run id per test, and a check that no /dev/shm segment leaks."""

import os
import uuid
from pathlib import Path

import pytest


@pytest.fixture
def run_id():
    rid = f"test{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield rid
    leaked = sorted(p.name for p in Path("/dev/shm").glob(f"rlloop_{rid}_*"))
    for name in leaked:
        (Path("/dev/shm") / name).unlink(missing_ok=True)
    assert not leaked, f"leaked shm segments: {leaked}"
