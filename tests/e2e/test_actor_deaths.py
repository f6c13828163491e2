"""Runs of the embedded example whose actors die (stopped, killed, hung), through Ray and in-process: a rollout
engine is restarted in place, a trainer's death rebuilds the cluster from the last checkpoint (from step 0 before the
run's first), and either way the run ends with the numbers of a run nobody touched."""

import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from rlloop.config import load_config
from rlloop.loop import train
from tests.e2e.runs import (
    TINY,
    latest_step,
    logged_so_far,
    metrics,
    processes_with,
    rays_left,
    run_cli,
    shm_segments,
)

pytestmark = pytest.mark.xdist_group("ray")  # starts Ray: one at a time (tests/conftest.py)


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
