"""`python -m rlloop.bench resources`: memory of the driver and of each actor over a long tiny run, and what is left.

    python -m rlloop.bench resources [--steps 300] [--every 2] [--out rss.png] [CONFIG overrides...]

Runs `python -m rlloop.run examples/grpo_dapo_tiny.yaml run.steps=N` (Ray actors, shm sync with deltas on: the
default) as a child process and samples, every --every seconds, the resident memory (RSS) of the driver, of each Ray
actor (found by its process title, `ray::RolloutWorker` / `ray::TrainerWorker`) and of the reward workers. A leak shows
as a rising line; a flat one after warmup is what we want. Reports per role (summed over its processes) start (the
first sample after step 1 is logged: the run's first row is the step-0 eval, still warm-up), end and max, in MiB, the
step count it reached, and after exit whether any process of the run, /dev/shm segment of its run id
(`rlloop_<run_id>_*`) or entry of its own $TMPDIR (a temp dir given to the run; Ray's session logs aside) is left.
Writes the plot (--out) and ends with one JSON line. The run's log (stderr) passes through; a run that fails still
gets its report, and the bench exits with the run's exit status.

In fp32 at the tiny example's lr nearly every element changes each step, so every version goes out as a keyframe;
`model.dtype=bfloat16 train.lr=2e-5` makes most of them deltas, and the run a test of long delta chains too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from rlloop.bench import positive_int
from rlloop.bench.machine import machine
from rlloop.config import run_id_for
from rlloop.tracking import read_metrics

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


def warmed_up(metrics: Path) -> bool:
    """Whether the run has logged a training step: its first row is the step-0 eval, before any training."""
    return any(row["step"] >= 1 for row in read_metrics(metrics))


def left_shm(run_dir: Path) -> list[str]:
    """This run's /dev/shm segments still there: weight_sync names them `rlloop_<run_id>_*`; another run's live
    segments are not this run's leak."""
    return sorted(p.name for p in Path("/dev/shm").glob(f"rlloop_{run_id_for(run_dir)}_*"))


def rss_summary(series: dict[str, list[float]], warm_at: int | None) -> dict[str, dict[str, float]]:
    """Per role: RSS at the first sample from `warm_at` on (the first one when the run never got there), at the end,
    and the most; NaN marks samples before the role's first process existed."""
    out = {}
    for role, values in series.items():
        seen = [x for x in values if x == x]
        after = [x for x in values[warm_at or 0 :] if x == x]
        if seen:
            out[role] = {"start": (after or seen)[0], "end": values[-1], "max": max(seen)}
    return out


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m rlloop.bench resources", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=positive_int, default=300)
    p.add_argument("--every", type=float, default=2.0, help="seconds between samples")
    p.add_argument("--out", default="rss.png")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    if not args.every > 0:
        p.error(f"--every {args.every}: more than 0 seconds")
    # The child's own temp dir (short: its Ray keeps unix sockets there, at most 107 bytes): what is left in it is
    # the run's, whatever other processes put in the shared one meanwhile.
    child_tmp = Path(tempfile.mkdtemp(prefix="rlloop-res-"))
    try:
        with tempfile.TemporaryDirectory(prefix="rlloop_bench_resources_") as tmp:
            run_dir = Path(tmp) / "run"
            cmd = [sys.executable, "-m", "rlloop.run", str(TINY), f"run.steps={args.steps}", f"run.dir={run_dir}"]
            cmd += ["tracking.progress=false", "run.save_every=50", *args.overrides]
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TMPDIR": str(child_tmp)}
            # the run's stderr passes through: its log, and its error when it fails (a config error, a crash)
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
            times, series, warm_at, seen = sample_run(proc, run_dir, args.every)
            rows = read_metrics(run_dir / "metrics.jsonl")
            if proc.returncode:
                print(f"bench resources: the run exited with {proc.returncode} (its log is above)", file=sys.stderr)
            plot(times, series, Path(args.out))
            time.sleep(2.0)  # let Ray's processes finish exiting
            shm = left_shm(run_dir)
        # Ray keeps its session logs in "ray" by design
        tmp_left = sorted(set(os.listdir(child_tmp)) - {"ray"})
    finally:
        shutil.rmtree(child_tmp, ignore_errors=True)
    report = {
        "bench": "resources",
        **machine(),
        "steps": rows[-1]["step"] if rows else 0,
        "exit_code": proc.returncode,
        "wall_s": times[-1] if times else 0.0,
        "rss_mib": rss_summary(series, warm_at),
        "left_processes": [" ".join(p.cmdline())[:80] for p in seen.values() if p.pid != proc.pid and _alive(p)],
        "left_shm": shm,
        "left_tmp": tmp_left,
        "plot": args.out,
    }
    for role, r in report["rss_mib"].items():
        print(f"{role:15s} RSS start {r['start']:.0f} MiB, end {r['end']:.0f} MiB, max {r['max']:.0f} MiB")
    print(json.dumps(report))
    if proc.returncode:
        raise SystemExit(proc.returncode)


def sample_run(proc: subprocess.Popen, run_dir: Path, every: float):
    """Sample the run's RSS by role every `every` seconds until it exits: (times, {role: MiB per sample}, the index
    of the first sample after the first training step is logged or None, every process met)."""
    driver, start = psutil.Process(proc.pid), time.perf_counter()
    times, series, warm_at, seen = [], {}, None, {}
    while proc.poll() is None:
        if warm_at is None and warmed_up(run_dir / "metrics.jsonl"):
            warm_at = len(times)  # step 1 is logged: warm-up (imports, compiles, the step-0 eval) is over
        now = sample(driver, seen)
        times.append(time.perf_counter() - start)
        for role, mib in now.items():
            series.setdefault(role, [float("nan")] * (len(times) - 1)).append(mib)
        time.sleep(every)
    return times, series, warm_at, seen
