"""Whole runs of the embedded example: the real components, Ray actors, shared-memory delta sync, resume, Ctrl-C."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import transformers

from rlloop.config import load_config
from rlloop.loop import train
from rlloop.model import check_model, load_tokenizer
from tests.e2e.runs import (
    ROOT,
    TINY,
    end_ray_of,
    latest_step,
    metrics,
    ray_agents,
    rays_left,
    run_cli,
    shm_segments,
)

pytestmark = pytest.mark.xdist_group("ray")  # starts Ray: one at a time (tests/conftest.py)


def rows_of(run_dir: Path, step: int) -> list[str]:
    """The samples `tracking.save_rollouts` saved of `step`, one JSON line each."""
    return (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()


def descendants_named(pid: int, title: str) -> list[int]:
    """The processes under `pid` whose title starts with `title` (a local Ray's actors are its driver's)."""
    import psutil

    under = psutil.Process(pid).children(recursive=True)
    return [p.pid for p in under if p.cmdline()[:1] and p.cmdline()[0].startswith(title)]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_local_run_resumes_exactly_where_it_stopped(tmp_path, mode):
    """4 steps straight == 2 steps, stop, --resume to 4: same samples, same losses, same weights, and the running
    totals go on from the checkpoint's. In async mode the step after a checkpoint is generated from the checkpoint's
    weights in both runs (the resumed one has no older)."""
    common = [
        "reward.fn=tests.rlloop.reward_fns:fails_on_odd_length",
        "reward.failure_reward=-1.0",  # below exact's 0 for a wrong answer: the failures make groups informative
        f"loop.mode={mode}",
        "rollout.backend=hf",
        "cluster.use_ray=false",
        "tracking.progress=false",
        "run.save_every=2",
        "run.eval_every=2",  # an eval's reward failures are its own: not in the rollout's totals, nor lost on resume
        "eval.samples=1",
        "eval.max_prompts=8",
        "rollout.prompts_per_step=4",
        "sync.transport=disk",
    ]
    straight = load_config(TINY, common + ["run.steps=4", f"run.dir={tmp_path / 'a'}", "tracking.save_rollouts=true"])
    train(straight)
    first = load_config(TINY, common + ["run.steps=2", f"run.dir={tmp_path / 'b'}"])
    train(first)
    resumed = load_config(TINY, common + ["run.steps=4", f"run.dir={tmp_path / 'b'}"])
    train(resumed, resume=True)
    # and from the straight run's own step-2 checkpoint, saved (async) with step 3's batch drawn already: its data
    # cursor is that batch's first prompt, not the next (the run stopped at step 2 had drawn no step 3)
    shutil.copytree(tmp_path / "a", tmp_path / "c")
    shutil.rmtree(tmp_path / "c/checkpoints/step_000004")
    train(load_config(TINY, common + ["run.steps=4", f"run.dir={tmp_path / 'c'}"]), resume=True)
    a, b, c = (metrics(tmp_path / d) for d in "abc")
    assert [m["step"] for m in b] == [0, 1, 2, 3, 4]  # the step-0 evaluation, then the steps
    for key in (
        "rollout/raw_reward",
        "rollout/response_len/mean",
        "train/loss",
        "train/grad_norm",
        "train/logprob_abs_diff",
        "sync/version",
        "rollout/weight_version",
        "rollout/reward_failures",
        "rollout/reward_timeouts",
        "rollout/eval_reward_failures",
    ):
        expected = [m.get(key) for m in a]  # one process, fp32 CPU: bit for bit
        assert [m.get(key) for m in b] == expected and [m.get(key) for m in c] == expected, key
    a, b = a[1:], b[1:]  # the steps
    assert a[-1]["rollout/eval_reward_failures"] > 0  # the evals' own failures, at steps 0, 2 and 4
    assert 0 < b[1]["rollout/reward_failures"] < b[3]["rollout/reward_failures"]
    # each step's total counts the failures of its own samples and the steps' before, not (async) of the next step's,
    # which the engines are generating and scoring while the driver logs it
    odd = [sum(len(json.loads(r)["response"]) % 2 for r in rows_of(tmp_path / "a", step)) for step in range(1, 5)]
    assert [m["rollout/reward_failures"] for m in a] == [sum(odd[:k]) for k in range(1, 5)]
    # sync: each step sampled by the previous policy; async: one version older, but for the step after a checkpoint
    assert [m["rollout/weight_version"] for m in b] == ([0, 1, 2, 3] if mode == "sync" else [0, 0, 2, 2])
    assert not (tmp_path / "a" / "sync").exists()  # the disk transport's versions went with the run, and their dir
    a_weights, b_weights = (tmp_path / d / "checkpoints/step_000004/trainer/model.safetensors" for d in "ab")
    assert a_weights.read_bytes() == b_weights.read_bytes()
    # the trained policy is a model directory of its own, tokenizer and chat template included: it passes the checks
    # a run makes of model.path, and the run's prompts encode to the same ids
    trained = load_config(TINY, [f"model.path={a_weights.parent}"])
    check_model(trained)
    chat = [{"role": "user", "content": "1 + 2 ="}]
    prompt_ids = [
        tok(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))["input_ids"]
        for tok in (load_tokenizer(trained.model), load_tokenizer(straight.model))
    ]
    assert prompt_ids[0] == prompt_ids[1] and len(prompt_ids[0]) > 5
    # a --resume with no step left to train (run.steps below the checkpoint's step, or at it) returns at once,
    # touching nothing
    files = [tmp_path / "b" / name for name in ("metrics.jsonl", "config.yaml")]
    before = [f.read_text() for f in files]
    written = {p: p.stat().st_mtime_ns for p in (tmp_path / "b").rglob("*")}
    for steps in (3, 4):
        train(load_config(TINY, common + [f"run.steps={steps}", f"run.dir={tmp_path / 'b'}"]), resume=True)
    assert [f.read_text() for f in files] == before
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "b").rglob("*")} == written


def test_tiny_example_with_ray_learns_and_leaves_nothing_behind(tmp_path, other_rays):
    """The README's main job, as a user runs it: Ray actors, JAX decoder, shm sync with deltas on (in fp32 at this lr
    each version changes nearly every element, so each goes as a keyframe; test_transports.py applies delta chains)."""
    proc = run_cli(f"run.dir={tmp_path}", "tracking.progress=false")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    # the terminal shows the run's phases, and no other program's progress bars or notices
    for phase in ("model, tokenizer and data checked", "starting a local Ray", "trainer rank(s)", "actors ready in"):
        assert phase in out, out[-3000:]
    for noise in ("Writing model shards", "Loading weights", "Token authentication"):
        assert noise not in out, out[-3000:]
    rows = [m for m in metrics(tmp_path) if m["step"] > 0]
    cfg = load_config(TINY)
    assert [m["step"] for m in rows] == list(range(1, cfg.run.steps + 1))
    assert [m["rollout/weight_version"] for m in rows] == list(range(cfg.run.steps))
    assert all(m["perf/compiles"] == 0 for m in rows)  # warmup compiled every bucket
    assert [m["sync/version"] for m in rows] == list(range(1, cfg.run.steps + 1))
    assert rows[0]["sync/keyframe"] == 1 and all(m["sync/refused"] == 0 for m in rows)
    reward = [m["rollout/raw_reward"] for m in rows]
    k = 5
    assert sum(reward[-k:]) / k > sum(reward[:k]) / k + 0.3, reward  # it learns, visibly
    for name in ("curves.png", "report.md", "checkpoints"):
        assert (tmp_path / name).exists()
    # the last line says where the policy is, and it is there, loadable as it is
    policy = out.strip().splitlines()[-1].split("(a transformers model directory): ")[1]
    assert policy == str(tmp_path / "checkpoints" / f"step_{cfg.run.steps:06d}" / "trainer")
    assert transformers.AutoConfig.from_pretrained(policy).model_type == "qwen3", out[-3000:]
    assert not shm_segments(tmp_path) and not rays_left(other_rays)


@pytest.fixture
def sigint_not_ignored():
    """A suite started in the background by a non-interactive shell ignores SIGINT, and exec hands that on to the
    driver under test, which then never sees the Ctrl-C. A handler in this process is reset to the default by exec."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_every_way_a_run_stops_leaves_nothing_and_resume_continues(tmp_path, sigint_not_ignored, other_rays):
    """Ctrl-C (exit 130), an actor's death with run.max_restarts=0 (exit 1) and SIGTERM (`ray job stop`, a
    preemption: exit 143) unwind cleanly: a --resume hint, Ray and shared memory gone. A SIGKILLed driver cannot clean
    up: Ray's agents outlive it by ~60 s, and the next start ends them. Each time --resume continues the run, which
    ends at its last step with every step logged once."""
    args = [f"run.dir={tmp_path}", "tracking.progress=false", "run.save_every=1", "run.eval_every=0"]
    args += ["rollout.backend=hf", "run.steps=8"]

    def start_and_stop(stop, *extra: str) -> tuple[int, str]:
        """A driver (resuming, once a checkpoint exists) stopped by `stop(proc)` once it has saved a checkpoint."""
        seen = latest_step(tmp_path)
        # a session of its own, as a terminal's foreground job is (Ctrl-C signals the whole group)
        proc = run_cli(*args, *extra, *(["--resume"] if seen else []), start_new_session=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and latest_step(tmp_path) <= seen:
            time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        stop(proc)
        out, _ = proc.communicate(timeout=180)
        return proc.returncode, out

    rc, out = start_and_stop(lambda p: os.killpg(p.pid, signal.SIGINT))  # what Ctrl-C does
    assert rc == 130 and "--resume" in out, out[-3000:]
    assert not rays_left(other_rays) and not shm_segments(tmp_path)

    def kill_engine(p: subprocess.Popen) -> None:  # this run's, not another's on the host
        engines = descendants_named(p.pid, "ray::RolloutWorker")
        assert engines
        for pid in engines:
            os.kill(pid, signal.SIGKILL)

    rc, out = start_and_stop(kill_engine, "run.max_restarts=0")
    assert rc == 1 and "actor died" in out and "--resume" in out, out[-3000:]
    assert not rays_left(other_rays) and not shm_segments(tmp_path)

    rc, out = start_and_stop(lambda p: p.send_signal(signal.SIGTERM))  # the driver alone, as `kill` does
    assert rc == 143 and out.count("terminated; continue with") == 1 and "--resume" in out, out[-3000:]
    assert not rays_left(other_rays) and not ray_agents() - other_rays and not shm_segments(tmp_path)

    rc, _ = start_and_stop(lambda p: p.send_signal(signal.SIGKILL))
    orphans, saved = ray_agents() - other_rays, latest_step(tmp_path)
    assert rc == -signal.SIGKILL and orphans, "Ray's agents used to outlive a killed driver: if not, drop the reaping"
    resume = run_cli(*args, "--resume")
    while orphans & ray_agents() and resume.poll() is None:
        time.sleep(0.2)
    # Ray's agents would exit by themselves only after a 60 s timeout; the next start ends them as it starts Ray,
    # before its first step has saved a checkpoint
    assert not orphans & ray_agents() and latest_step(tmp_path) == saved
    out, _ = resume.communicate(timeout=600)
    assert resume.returncode == 0, out[-3000:]
    assert [m["step"] for m in metrics(tmp_path)] == list(range(1, 9))  # every step once, in order, over 5 drivers
    # the killed driver's segments: swept too
    assert not rays_left(other_rays) and not ray_agents() - other_rays and not shm_segments(tmp_path)


def test_ray_job_submit_runs_the_same_command(tmp_path, short_tmp, other_rays):
    """`ray job submit -- python -m rlloop.run ...` against a local head, as on a cluster."""
    env = {
        **os.environ,
        "TMPDIR": str(short_tmp),  # the head's own: its processes are found by it, and what they leave goes with it
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    env.pop("XLA_FLAGS", None)
    port = 6390
    subprocess.run(
        [
            "ray",
            "start",
            "--head",
            f"--port={port}",
            "--num-cpus=2",
            "--include-dashboard=true",
            "--dashboard-port=8275",
            "--disable-usage-stats",
        ],
        env=env,
        check=True,
        capture_output=True,
    )
    try:
        job = subprocess.run(
            [
                "ray",
                "job",
                "submit",
                "--address",
                "http://127.0.0.1:8275",
                "--working-dir",
                str(ROOT),
                "--",
                sys.executable,
                "-m",
                "rlloop.run",
                TINY,
                f"run.dir={tmp_path}",
                "run.steps=2",
                "run.eval_every=0",
                "rollout.backend=hf",
                "tracking.progress=false",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert job.returncode == 0 and "succeeded" in job.stdout.lower(), job.stdout[-3000:] + job.stderr[-2000:]
        assert [m["step"] for m in metrics(tmp_path)] == [1, 2]
    finally:
        end_ray_of(short_tmp)
    assert not rays_left(other_rays)


def test_two_trainer_ranks_over_gloo_match_one(tmp_path):
    """cluster.train_chips=2: two Ray trainer actors, torch.distributed over gloo, weights through the Ray object
    store: the same numbers as one rank in one process with shared memory."""
    import ray

    common = [
        "rollout.backend=hf",
        "tracking.progress=false",
        "run.save_every=0",
        "run.eval_every=0",
        "run.steps=2",
        "rollout.prompts_per_step=4",
    ]
    ray.init(
        address="local", num_cpus=4, include_dashboard=False, configure_logging=False
    )  # 1 rollout + 2 ranks on 2 real cores
    try:
        train(
            load_config(TINY, common + ["cluster.train_chips=2", "sync.transport=ray", f"run.dir={tmp_path / 'two'}"])
        )
    finally:
        ray.shutdown()
    train(load_config(TINY, common + ["cluster.use_ray=false", f"run.dir={tmp_path / 'one'}"]))
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    for key in ("rollout/raw_reward", "train/loss", "train/grad_norm", "train/tokens", "train/entropy"):
        assert [m[key] for m in two] == pytest.approx([m[key] for m in one], rel=1e-4, abs=1e-7), key
    assert [m["sync/rollout_version"] for m in two] == [1, 2]
