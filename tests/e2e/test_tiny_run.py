"""Whole runs of the embedded example: the real components, Ray actors, shared-memory delta sync, resume, Ctrl-C."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import transformers

from rlloop.config import load_config
from rlloop.loop import train
from rlloop.model import check_model, load_tokenizer

pytestmark = pytest.mark.xdist_group("ray")  # starts Ray: one at a time (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "grpo_dapo_tiny.yaml")


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def rows_of(run_dir: Path, step: int) -> list[str]:
    """The samples `tracking.save_rollouts` saved of `step`, one JSON line each."""
    return (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()


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


@pytest.fixture
def other_rays() -> frozenset[int]:
    """The Ray processes and agents on this host before the test: another user's or another test's, not its own."""
    return frozenset(ray_processes()) | frozenset(ray_agents())


def rays_left(others: frozenset[int]) -> dict[int, str]:
    """The Ray processes the test's runs started and left."""
    return {pid: command for pid, command in ray_processes().items() if pid not in others}


def descendants_named(pid: int, title: str) -> list[int]:
    """The processes under `pid` whose title starts with `title` (a local Ray's actors are its driver's)."""
    import psutil

    under = psutil.Process(pid).children(recursive=True)
    return [p.pid for p in under if p.cmdline()[:1] and p.cmdline()[0].startswith(title)]


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


def ray_agents() -> set[int]:
    """Ray's per-node agents (their process titles start with ray::), orphaned or not."""
    out = subprocess.run(["pgrep", "-f", "ray::(DashboardAgent|RuntimeEnvAgent)"], capture_output=True, text=True)
    return {int(pid) for pid in out.stdout.split()}


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


KILL_ARGS = ["tracking.progress=false", "run.save_every=1", "run.eval_every=0", "rollout.backend=hf", "run.steps=8"]
# Each fault lands once a checkpoint newer than the last heal exists; 8 steps leave the last of 3 faults steps to land
# in and heal into even when every fault lands a step late.
# Each hang waits this out. Every call here takes < 1 s, but an actor's start (imports, model load, compiles) takes
# longer: each run's first start, and every rebuild, then shows that only actor_start_timeout_s applies to it.
TIMEOUT_S = 6
HANG = [f"cluster.actor_timeout_s={TIMEOUT_S}"]
# Every way an actor dies, in turn in one run: stopped (SIGTERM), killed (SIGKILL, an OOM kill) and hung (SIGSTOP:
# frozen, which the driver must notice by cluster.actor_timeout_s alone).
FAULTS = [signal.SIGTERM, signal.SIGKILL, signal.SIGSTOP]


def latest_step(run_dir: Path) -> int:
    """The newest complete checkpoint's step (0 without one)."""
    done = [p for p in (run_dir / "checkpoints").glob("step_*") if p.name[5:].isdigit() and (p / "state.json").exists()]
    return max((int(p.name[5:]) for p in done), default=0)


@pytest.fixture(scope="module")
def untouched_dir(tmp_path_factory) -> Path:
    """The run every fault below is compared against: the same run in this process, without Ray, which computes the
    same numbers (one thread per role either way) and starts in seconds rather than a minute."""
    run_dir = tmp_path_factory.mktemp("untouched")
    train(load_config(TINY, [f"run.dir={run_dir}", *KILL_ARGS, "cluster.use_ray=false", "run.keep_checkpoints=null"]))
    return run_dir


def test_run_keep_checkpoints_null_keeps_every_checkpoint(untouched_dir):
    kept = sorted(p.name for p in (untouched_dir / "checkpoints").iterdir())
    assert kept == [f"step_{step:06d}" for step in range(1, 9)]  # saved every step; by default the newest 2


@pytest.fixture(scope="module")
def untouched_run(untouched_dir) -> list[dict]:
    return metrics(untouched_dir)


class Output:
    """A running driver's output, read as it comes (a pipe nobody reads fills up and blocks the driver)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines, self.notes = proc, [], []  # notes: what the test did, for a failure's message
        self.reader = threading.Thread(target=lambda: self.lines.extend(proc.stdout), daemon=True)
        self.reader.start()

    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, done, what: str) -> None:
        deadline = time.monotonic() + 300
        while not done():
            assert self.proc.poll() is None and time.monotonic() < deadline, (
                f"never saw {what}:\n" + "".join(self.notes + self.lines)[-6000:]
            )
            time.sleep(0.2)

    def stop(self) -> None:
        """Stop the run as Ctrl-C does, so that its Ray goes too (after a failed check)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.reader.join()


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


def actor_pids(actor: str, temp: Path) -> set[str]:
    """The `ray::<actor>` processes of the run started with TMPDIR=`temp` (its Ray's workers inherit it): never
    another run's on the same machine."""
    pids = subprocess.run(["pgrep", "-f", f"ray::{actor}"], capture_output=True, text=True).stdout.split()
    return {str(pid) for pid in processes_with(f"TMPDIR={temp}", pids)}


def faults_mid_run(
    tmp_path,
    temp: Path,
    clean: list[dict],
    actor: str,
    healed: str,
    other_rays: frozenset[int],
    kill_mid_heal: bool = False,
) -> tuple[str, list[dict]]:
    """The untouched run again, with `ray::<actor>` sent each of FAULTS in turn, each once the last heal is done (the
    driver printing `healed` followed by the restart count) and a checkpoint newer than it exists; with
    `kill_mid_heal`, the actor rebuilt after the first fault is SIGKILLed as soon as it exists, while it is being
    healed. Checks that the run heals into the same numbers, step by step, and leaves nothing behind (`temp`: its
    $TMPDIR, and its Ray's); returns its output and metrics."""
    restarts = [f"run.max_restarts={len(FAULTS) + kill_mid_heal}"]
    out = Output(run_cli(f"run.dir={tmp_path}", *KILL_ARGS, *HANG, *restarts, env={"TMPDIR": str(temp)}))
    healed_at, count = 0, 0  # the newest checkpoint when the last fault was healed; restarts so far
    try:
        for sig in FAULTS:
            out.wait_for(lambda after=healed_at: latest_step(tmp_path) > after, f"a checkpoint after {healed_at}")
            send(out, actor, sig, before := actor_pids(actor, temp), f"checkpoint {latest_step(tmp_path)}")
            count += 1
            if kill_mid_heal and count == 1:
                out.wait_for(lambda: actor_pids(actor, temp) - before, f"the actor rebuilt after {sig.name}")
                send(out, actor, signal.SIGKILL, actor_pids(actor, temp) - before, "its rebuild")
                count += 1
            out.wait_for(lambda mark=f"{healed} ({count}/": mark in out.text(), f"{sig.name} healed")
            healed_at = latest_step(tmp_path)
        if out.proc.wait(timeout=600) != 0:
            events = [line for line in out.lines if any(w in line for w in ("restart", "died", "Error", "back"))]
            pytest.fail("".join(out.notes + events)[-6000:] + "\n...\n" + out.text()[-3000:])
    finally:
        out.stop()
    healed_metrics = metrics(tmp_path)
    assert [m["step"] for m in healed_metrics] == [m["step"] for m in clean]  # a replayed step is logged once
    for key in ("rollout/raw_reward", "rollout/response_len/mean", "train/loss", "train/grad_norm"):
        assert [m[key] for m in healed_metrics] == pytest.approx([m[key] for m in clean], rel=1e-6, abs=1e-9), key
    assert not rays_left(other_rays)
    assert not shm_segments(tmp_path), "shared-memory segments left behind"
    left = set(os.listdir(temp)) - {"ray"}  # Ray keeps its session logs by design
    assert not left, f"left in the temp dir: {left}"
    return out.text(), healed_metrics


def send(out: Output, actor: str, sig: signal.Signals, pids: set[str], when: str) -> None:
    assert pids, f"no ray::{actor} process to send {sig.name}"
    for pid in pids:
        os.kill(int(pid), sig)
    out.notes.append(f"{sig.name} to pids {pids} at {when}, output line {len(out.lines)}\n")


def test_a_rollout_engine_that_dies_in_any_way_is_restarted_and_the_run_ends_as_if_nothing_happened(
    tmp_path, short_tmp, untouched_run, other_rays
):
    """Each time, the engine is rebuilt with the trainer's weights, its requests are generated again, and every
    step's samples and losses equal those of a run nobody touched; an engine that dies while it is being rebuilt
    costs one more restart."""
    args = (tmp_path, short_tmp, untouched_run, "RolloutWorker", "is back", other_rays)
    out, healed = faults_mid_run(*args, kill_mid_heal=True)
    assert "rollout engine 0 hung during" in out  # the hang, noticed by the timeout alone
    assert "died during its restart" in out
    assert healed[-1]["rollout/engine_restarts"] == 4 and untouched_run[-1]["rollout/engine_restarts"] == 0


def test_a_trainer_rank_that_dies_in_any_way_rebuilds_from_the_checkpoint_and_the_run_matches(
    tmp_path, short_tmp, untouched_run, other_rays
):
    """Each time, the driver rebuilds the cluster from the last checkpoint and replays from there with the same data
    order, and every step's numbers equal an untouched run's."""
    healed_mark = "restarting from the last checkpoint"
    out, healed = faults_mid_run(tmp_path, short_tmp, untouched_run, "TrainerWorker", healed_mark, other_rays)
    assert f"hung (no answer in {TIMEOUT_S} s)" in out
    assert healed[-1]["train/restarts"] == 3 and untouched_run[-1]["train/restarts"] == 0


def test_a_trainer_that_dies_before_the_runs_first_checkpoint_starts_over_and_past_max_restarts_ends_the_run(
    tmp_path, short_tmp, untouched_dir, untouched_run, other_rays
):
    """In a directory that holds an earlier run's checkpoint (the untouched run's last, step 8), a fresh run whose
    trainer dies before it has saved one of its own starts over from step 0 with the same data order, not from the
    earlier run's step; when its trainer dies again, past run.max_restarts, it exits 1 and says how to go on."""
    earlier = untouched_dir / "checkpoints" / "step_000008"
    shutil.copytree(earlier, tmp_path / "checkpoints" / earlier.name)
    args = ["run.save_every=0", "run.max_restarts=1"]  # saves nothing before the end
    out = Output(run_cli(f"run.dir={tmp_path}", *KILL_ARGS, *args, env={"TMPDIR": str(short_tmp)}))
    try:
        for life in (0, 1):  # its rows say which life logged them: train/restarts
            out.wait_for(
                lambda life=life: any(m["step"] >= 2 and m["train/restarts"] == life for m in logged_so_far(tmp_path)),
                f"step 2 of life {life}",
            )
            send(out, "TrainerWorker", signal.SIGKILL, actor_pids("TrainerWorker", short_tmp), f"life {life}")
        assert out.proc.wait(timeout=300) == 1, out.text()[-3000:]
    finally:
        out.stop()
    text = out.text()
    logged = metrics(tmp_path)  # the second life's steps: it started over, from step 1
    assert [m["step"] for m in logged] == list(range(1, len(logged) + 1))
    for key in ("rollout/raw_reward", "train/loss", "train/grad_norm"):
        assert [m[key] for m in logged] == pytest.approx([m[key] for m in untouched_run[: len(logged)]], rel=1e-6)
    assert all(m["train/restarts"] == 1 for m in logged)
    assert "restarting from the last checkpoint (1/1)" in text and "cluster error: a trainer actor died" in text
    assert "this run saved no checkpoint" in text and "without --resume" in text  # --resume would load step 8
    assert not rays_left(other_rays)
    assert not shm_segments(tmp_path), "shared-memory segments left behind"


def trainer_dies_in(monkeypatch, method: str, *calls: int) -> None:
    """The in-process trainer's `method` calls numbered `calls` (counted over the test, across rebuilds) end as a dead
    trainer actor's do: TrainerDied. Without Ray the loop's restarts are reached no other way."""
    from rlloop.errors import TrainerDied
    from rlloop.workers import TrainerWorker

    real, made = getattr(TrainerWorker, method), []

    def dies(self, *args, **kwargs):
        made.append(None)
        if len(made) in calls:
            raise TrainerDied(f"a trainer actor died during {method}() (injected, call {len(made)})")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TrainerWorker, method, dies)


def test_a_trainer_death_without_ray_rebuilds_from_the_checkpoint_and_a_resume_carries_the_restarts(
    tmp_path, monkeypatch, untouched_run, caplog
):
    """The loop's side of the Ray tests above, in seconds: step 4's trainer dies after checkpoint 3, the cluster is
    rebuilt from it and the run matches the untouched one, its later steps counting the restart. A --resume (a new
    driver) goes on counting from its checkpoint's totals, the trainer's restarts and the engines' (set here to what
    a run whose engines were restarted twice saves)."""
    from rlloop.checkpoint import latest_checkpoint, load_state, save_checkpoint

    trainer_dies_in(monkeypatch, "train_step", 4)
    args = [f"run.dir={tmp_path}", *KILL_ARGS, "cluster.use_ray=false", "run.max_restarts=1"]
    with caplog.at_level("WARNING", logger="rlloop"):
        train(load_config(TINY, args))
    assert "restarting from the last checkpoint (1/1)" in caplog.text
    healed = metrics(tmp_path)
    assert [m["step"] for m in healed] == [m["step"] for m in untouched_run]
    for key in ("rollout/raw_reward", "rollout/response_len/mean", "train/loss", "train/grad_norm"):
        assert [m[key] for m in healed] == [m[key] for m in untouched_run], key  # fp32, one process: bit for bit
    assert [m["train/restarts"] for m in healed] == [0, 0, 0, 1, 1, 1, 1, 1]

    last = latest_checkpoint(tmp_path)
    state = load_state(last)
    assert state["totals"]["train/restarts"] == 1
    state["totals"]["rollout/engine_restarts"] = 2
    save_checkpoint(
        tmp_path, state.pop("step"), state, lambda path: shutil.copytree(last / "trainer", path, dirs_exist_ok=True)
    )
    train(load_config(TINY, [*args, "run.steps=9"]), resume=True)
    resumed = metrics(tmp_path)[-1]
    assert (resumed["step"], resumed["train/restarts"], resumed["rollout/engine_restarts"]) == (9, 1, 2)


def test_a_trainer_death_without_ray_before_the_runs_first_checkpoint_starts_over_until_max_restarts(
    tmp_path, monkeypatch, untouched_dir, untouched_run
):
    """In a directory holding an earlier run's checkpoint, a fresh run whose trainer dies before the run has saved one
    of its own starts over from step 0, not from the earlier run's step 8: as the cluster starts (the directory not
    yet changed), and at step 3, where it starts over with the data from its first prompt again. When it dies there
    once more, past run.max_restarts=2, the run ends with TrainerDied."""
    from rlloop.errors import TrainerDied

    shutil.copytree(untouched_dir / "checkpoints" / "step_000008", tmp_path / "checkpoints" / "step_000008")
    trainer_dies_in(monkeypatch, "setup", 1)
    trainer_dies_in(monkeypatch, "train_step", 3, 6)  # the third step of the second life, and of the third
    args = [f"run.dir={tmp_path}", *KILL_ARGS, "cluster.use_ray=false", "run.save_every=0", "run.max_restarts=2"]
    with pytest.raises(TrainerDied, match=r"call 6\)\n\(run.max_restarts=2 spent\)$"):
        train(load_config(TINY, args))
    logged = metrics(tmp_path)  # the third life's steps before it died
    assert [(m["step"], m["train/restarts"]) for m in logged] == [(1, 2), (2, 2)]
    for key in ("rollout/raw_reward", "train/loss", "train/grad_norm"):
        assert [m[key] for m in logged] == [m[key] for m in untouched_run[:2]], key
