"""The driver SIGKILLed at random points, again and again, then `--resume`d each time: the run ends with exactly the
numbers of a run nobody touched (CPU fp32: same data order, same samples, same losses), and no process or shared
memory segment of the killed drivers is left behind."""

import random
import signal
import time

import psutil
import pytest

from tests.e2e.test_tiny_run import latest_step, metrics, run_cli, shm_segments

KILLS = 10
# A kill can land a step late (a step faster than the straight run's shortest, on a shared host) and pass a save:
# 4 steps more than kills leave room for 3 such.
STEPS = KILLS + 4
ARGS = [f"run.steps={STEPS}", "run.save_every=1", "run.eval_every=0", "rollout.backend=hf", "cluster.use_ray=false"]
ARGS += ["tracking.progress=false", "rollout.prompts_per_step=8"]


def test_a_driver_killed_at_ten_random_points_resumes_into_the_untouched_run(tmp_path):
    straight = run_cli(f"run.dir={tmp_path / 'straight'}", *ARGS)
    out, _ = straight.communicate(timeout=600)
    assert straight.returncode == 0, out[-3000:]
    clean = metrics(tmp_path / "straight")
    step_s = min(m["perf/step_s"] for m in clean[1:])  # the shortest steady step: a kill lands before the next save

    run_dir, rng, kills = tmp_path / "killed", random.Random(0), []
    while True:
        proc = run_cli(f"run.dir={run_dir}", *ARGS, *(["--resume"] if kills else []))
        if len(kills) == KILLS:
            break  # this one runs to the end
        seen = latest_step(run_dir) if run_dir.exists() else 0
        while proc.poll() is None and (not run_dir.exists() or latest_step(run_dir) <= seen):
            time.sleep(0.02)
        assert proc.poll() is None, f"the run ended after {len(kills)} kills, at {kills}"
        time.sleep(rng.uniform(0.0, 0.8 * step_s))  # somewhere in the next step: rollout, train, sync or save
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills.append(latest_step(run_dir))
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"left behind by the killed driver: {[p.cmdline() for p in alive]}"
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    assert kills[-1] < STEPS, kills  # every kill landed before the run's end

    healed = metrics(run_dir)
    assert [m["step"] for m in healed] == list(range(1, STEPS + 1))  # every step logged once
    for key in ("rollout/raw_reward", "rollout/response_len/mean", "train/loss", "train/grad_norm"):
        assert [m[key] for m in healed] == pytest.approx([m[key] for m in clean], rel=1e-6, abs=1e-9), key
    left = shm_segments(run_dir)
    assert not left, left  # a killed driver's segments are swept at the next start, and the last run's at its exit
