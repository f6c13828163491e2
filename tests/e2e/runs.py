"""What the end-to-end tests share: a run's metrics and shared-memory segments, its driver started as a user starts
it, and the Ray processes a run started and must not leave (told apart from another user's or another test's)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "grpo_dapo_tiny.yaml")


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def logged_so_far(run_dir: Path) -> list[dict]:
    """The metrics of a run still running: none before its first line, and none while a line is half-written."""
    try:
        return metrics(run_dir)
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def shm_segments(run_dir: Path) -> set[str]:
    """The run's shared-memory segments (named by its run id: other tests may hold their own meanwhile)."""
    from rlloop.config import run_id_for

    return {p for p in os.listdir("/dev/shm") if p.startswith(f"rlloop_{run_id_for(run_dir)}_")}


def ray_processes() -> dict[int, str]:
    """Ray's GCS servers and raylets on this host, but for the dead ones that wait to be reaped (zombies)."""
    out = subprocess.run(["pgrep", "-af", "raylet|gcs_server"], capture_output=True, text=True).stdout
    found = {int(pid): command for pid, _, command in (line.partition(" ") for line in out.splitlines())}
    return {pid: command for pid, command in found.items() if not command.endswith("<defunct>")}


def ray_agents() -> set[int]:
    """Ray's per-node agents (their process titles start with ray::), orphaned or not."""
    out = subprocess.run(["pgrep", "-f", "ray::(DashboardAgent|RuntimeEnvAgent)"], capture_output=True, text=True)
    return {int(pid) for pid in out.stdout.split()}


def rays_left(others: frozenset[int]) -> dict[int, str]:
    """The Ray processes the test's runs started and left."""
    return {pid: command for pid, command in ray_processes().items() if pid not in others}


def run_cli(*args: str, env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    env.pop("XLA_FLAGS", None)  # the actors set their own
    return subprocess.Popen(
        [sys.executable, "-m", "rlloop.run", TINY, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def latest_step(run_dir: Path) -> int:
    """The newest complete checkpoint's step (0 without one)."""
    done = [p for p in (run_dir / "checkpoints").glob("step_*") if p.name[5:].isdigit() and (p / "state.json").exists()]
    return max((int(p.name[5:]) for p in done), default=0)


def processes_with(variable: str, pids: list[str] | None = None) -> set[int]:
    """The processes (of `pids`, else all) whose environment holds `variable` ("NAME=value")."""
    ours = set()
    for pid in pids if pids is not None else [p for p in os.listdir("/proc") if p.isdigit()]:
        try:
            if variable.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                ours.add(int(pid))
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return ours


def processes_of(temp: Path) -> set[int]:
    """The processes a Ray started with TMPDIR=`temp` runs: those with it in their environment, and Ray's agents,
    whose environment Ray rebuilds, by the session logs they hold open there."""
    ours = processes_with(f"TMPDIR={temp}")
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to read
            if any(os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"{temp}/") for fd in os.listdir(f"/proc/{pid}/fd")):
                ours.add(int(pid))
    return ours


def end_ray_of(temp: Path) -> None:
    """Kill the processes of the Ray started with TMPDIR=`temp` until none is left: `ray stop` would end every Ray on
    the host, another user's or another test's too."""
    for _ in range(50):
        if not (ours := processes_of(temp)):
            return
        for pid in ours:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    raise AssertionError(f"the Ray started in {temp} outlived 50 rounds of SIGKILL: {sorted(processes_of(temp))}")
