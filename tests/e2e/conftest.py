"""The end-to-end tests' fixtures (their helpers are in tests/e2e/runs.py)."""

import pytest

from tests.e2e.runs import ray_agents, ray_processes


@pytest.fixture
def other_rays() -> frozenset[int]:
    """The Ray processes and agents on this host before the test: another user's or another test's, not its own."""
    return frozenset(ray_processes()) | frozenset(ray_agents())
