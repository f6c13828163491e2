"""`python -m rlloop.bench resources`: memory of the driver and of each actor over a long tiny run, and what is left.

    python -m rlloop.bench resources [--steps 300] [--every 2] [--out rss.png] [CONFIG overrides...]

Runs `python -m rlloop.run examples/grpo_dapo_tiny.yaml run.steps=N` (Ray actors, shm sync with deltas on: the
default) as a child process and samples, every --every seconds, the resident memory (RSS) of the driver, of each Ray
actor (found by its process title, `ray::RolloutWorker` / `ray::TrainerWorker`) and of the reward workers. A leak shows
as a rising line; a flat one after warmup is what we want. Reports per role (summed over its processes) start (first
sample after warmup), end and max, in MiB, the step count it reached, and after exit whether any process,
`/dev/shm/rlloop_*` segment or temp dir of the run is left. Writes the plot (--out) and ends with one JSON line.

In fp32 at the tiny example's lr nearly every element changes each step, so every version goes out as a keyframe;
`model.dtype=bfloat16 train.lr=2e-5` makes most of them deltas, and the run a test of long delta chains too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from rlloop.bench.machine import machine

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "grpo_dapo_tiny.yaml"
ROLES = {"ray::RolloutWorker": "rollout engine", "ray::TrainerWorker": "trainer rank", "spawn_main": "reward worker"}


def role_of(proc: psutil.Process, driver: int) -> str | None:
    if proc.pid == driver:
        return "driver"
    try:
        cmd = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return next((name for key, name in ROLES.items() if key in cmd), None)


def sample(driver: psutil.Process, seen: dict[int, psutil.Process]) -> dict[str, float]:
    """MiB of RSS per role (summed over processes of one role) right now, over the driver's process tree (a local
    Ray's raylet, and so every actor, descends from the driver); `seen` collects every process met."""
    out: dict[str, float] = {}
    try:
        procs = [driver, *driver.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    seen.update((p.pid, p) for p in procs)
    for p in procs:
        role = role_of(p, driver.pid)
        if role is None:
            continue
        try:
            out[role] = out.get(role, 0.0) + p.memory_info().rss / 2**20
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def plot(times: list[float], series: dict[str, list[float]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for role, values in series.items():
        ax.plot(times[: len(values)], values, label=role)
    ax.set_xlabel("seconds")
    ax.set_ylabel("RSS (MiB)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m rlloop.bench resources", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=float, default=2.0)
    p.add_argument("--out", default="rss.png")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    shm_before = {s for s in os.listdir("/dev/shm") if s.startswith("rlloop_")}
    tmp_before = set(os.listdir(tempfile.gettempdir()))
    with tempfile.TemporaryDirectory(prefix="rlloop_bench_resources_") as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "rlloop.run", str(TINY), f"run.steps={args.steps}", f"run.dir={run_dir}"]
        cmd += ["tracking.progress=false", "run.save_every=50", *args.overrides]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        driver, start = psutil.Process(proc.pid), time.perf_counter()
        times, series, warm_at, seen = [], {}, None, {}
        while proc.poll() is None:
            now = sample(driver, seen)
            times.append(time.perf_counter() - start)
            for role, mib in now.items():
                series.setdefault(role, [float("nan")] * (len(times) - 1)).append(mib)
            if warm_at is None and (run_dir / "metrics.jsonl").exists():
                warm_at = len(times) - 1  # the first step is logged: warmup (imports, compiles) is over
            time.sleep(args.every)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        plot(times, series, Path(args.out))
    time.sleep(2.0)  # let Ray's processes finish exiting
    w = warm_at or 0
    report = {
        "bench": "resources",
        **machine(),
        "steps": rows[-1]["step"] if rows else 0,
        "exit_code": proc.returncode,
        "wall_s": times[-1] if times else 0.0,
        "rss_mib": {
            role: {"start": next(x for x in v[w:] + v[-1:] if x == x), "end": v[-1], "max": max(x for x in v if x == x)}
            for role, v in series.items()
        },
        "left_processes": [" ".join(p.cmdline())[:80] for p in seen.values() if p.pid != proc.pid and _alive(p)],
        "left_shm": sorted({s for s in os.listdir("/dev/shm") if s.startswith("rlloop_")} - shm_before),
        "left_tmp": sorted(set(os.listdir(tempfile.gettempdir())) - tmp_before - {"ray", Path(args.out).name}),
        "plot": args.out,
    }
    for role, r in report["rss_mib"].items():
        print(f"{role:15s} RSS start {r['start']:.0f} MiB, end {r['end']:.0f} MiB, max {r['max']:.0f} MiB")
    print(json.dumps(report))
