"""Two Ray nodes on this machine, the test bed of every multi-host path: the engine on one node, the trainer on the
other, syncing through disk and through the Ray object store; shm between them is refused naming sync.transport."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.e2e.runs import end_ray_of

pytestmark = pytest.mark.xdist_group("ray")  # starts Ray: one at a time (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "grpo_dapo_tiny.yaml")
PORT = 6392
ENV = {
    **os.environ,
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
}
ENV.pop("XLA_FLAGS", None)


def ray_cli(*args: str, env: dict[str, str]) -> None:
    done = subprocess.run(["ray", *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"ray {' '.join(args)}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"


@pytest.fixture(scope="module")
def two_nodes():
    """A head node labelled node_a and a second node labelled node_b, one CPU each."""
    # Short: Ray's unix sockets live under it, and a socket path may not exceed 107 bytes (pytest's tmp paths can)
    temp = tempfile.TemporaryDirectory(prefix="rlloop-test-", ignore_cleanup_errors=True)
    env = {**ENV, "TMPDIR": temp.name}  # the nodes' processes are found by it at the end (`end_ray_of`)
    ray_cli(
        "start",
        "--head",
        f"--port={PORT}",
        "--num-cpus=1",
        '--resources={"node_a": 1}',
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--temp-dir={temp.name}",
        env=env,
    )
    try:
        ray_cli(
            "start",
            f"--address=127.0.0.1:{PORT}",
            "--num-cpus=1",
            '--resources={"node_b": 1}',
            "--disable-usage-stats",
            env=env,
        )
        yield f"127.0.0.1:{PORT}"
    finally:
        end_ray_of(Path(temp.name))
        temp.cleanup()


def run_split(address: str, run_dir: Path, transport: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "rlloop.run",
            TINY,
            f"run.dir={run_dir}",
            f"cluster.address={address}",
            "cluster.rollout_resources={node_a: 0.01}",
            "cluster.trainer_resources={node_b: 0.01}",
            f"sync.transport={transport}",
            "rollout.backend=hf",
            "run.steps=2",
            "run.eval_every=0",
            "run.save_every=0",
            "tracking.progress=false",
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize("transport", ["disk", "ray"])
def test_engine_and_trainer_on_different_nodes_sync_across(two_nodes, tmp_path, transport):
    done = run_split(two_nodes, tmp_path, transport)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    placement = json.loads((tmp_path / "cluster.json").read_text())
    assert placement["rollout engine 0"] != placement["trainer rank 0"]  # two nodes really
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["sync/rollout_version"] for r in rows] == [1, 2]  # every pushed version reached the other node


def test_shm_between_nodes_is_refused_naming_the_key(two_nodes, tmp_path):
    done = run_split(two_nodes, tmp_path, "shm")
    assert done.returncode == 1
    assert "sync.transport=shm needs the rollout engines and the trainer ranks on one node" in done.stderr
