"""The driver SIGKILLed at random points, again and again, then `--resume`d each time: the run ends with exactly the
numbers of a run nobody touched (CPU fp32: same data order, same samples, same losses), and no process or shared
memory segment of the killed drivers is left behind."""

import random
import signal
import time

import psutil

from tests.e2e.runs import latest_step, metrics, run_cli, shm_segments

KILLS = 10
# Each kill times one step of the running driver, then lands in the next: 2 steps a kill, and 4 more for kills that
# land a step late all the same (the host's load changes between the two steps).
STEPS = 2 * KILLS + 4
ARGS = [f"run.steps={STEPS}", "run.save_every=1", "run.eval_every=0", "rollout.backend=hf", "cluster.use_ray=false"]
ARGS += ["tracking.progress=false", "rollout.prompts_per_step=8"]


def next_checkpoint(proc, run_dir, after: int) -> int:
    """Wait for the running driver to save a checkpoint newer than `after`; its step."""
    while proc.poll() is None and latest_step(run_dir) <= after:
        time.sleep(0.01)
    assert proc.poll() is None, f"the run ended at step {latest_step(run_dir)}"
    return latest_step(run_dir)


def test_a_driver_killed_at_ten_random_points_resumes_into_the_untouched_run(tmp_path):
    straight = run_cli(f"run.dir={tmp_path / 'straight'}", *ARGS)
    out, _ = straight.communicate(timeout=600)
    assert straight.returncode == 0, out[-3000:]
    clean = metrics(tmp_path / "straight")

    run_dir, rng, kills = tmp_path / "killed", random.Random(0), []
    while True:
        proc = run_cli(f"run.dir={run_dir}", *ARGS, *(["--resume"] if kills else []))
        if len(kills) == KILLS:
            break  # this one runs to the end
        first = next_checkpoint(proc, run_dir, latest_step(run_dir))
        t0 = time.monotonic()
        next_checkpoint(proc, run_dir, first)
        step_s = time.monotonic() - t0  # a steady step of this driver, at the host's load now
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
        assert [m[key] for m in healed] == [m[key] for m in clean], key  # fp32 CPU, same threads: bit for bit
    left = shm_segments(run_dir)
    assert not left, left  # a killed driver's segments are swept at the next start, and the last run's at its exit
