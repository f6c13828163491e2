"""`python -m rlloop.bench resources` without a long run: a run that fails is reported with its own error and exit
status, only this run's /dev/shm segments and temp entries count as left behind, and the start sample is one taken
after the first training step is logged (not after the step-0 eval)."""

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import psutil
import pytest

from rlloop.bench import resources
from rlloop.config import run_id_for
from weight_sync import SyncConfig, make_sender


@pytest.mark.parametrize(
    "override, named", [("train.lr=abc", "train.lr: Input should be a valid number"), ("train.lrr=1", "train.lrr")]
)
def test_a_run_that_fails_exits_with_its_own_status_and_error(tmp_path, override, named):
    """The run's config error reaches the user and its exit status is the bench's (it was a FileNotFoundError on a
    metrics.jsonl never written, exit 1, the error itself thrown away)."""
    cmd = [sys.executable, "-m", "rlloop.bench", "resources", "--steps", "2", "--every", "0.2"]
    out = subprocess.run([*cmd, "--out", str(tmp_path / "rss.png"), override], capture_output=True, text=True)
    assert out.returncode == 2, out.stderr[-3000:]
    assert named in out.stderr and "FileNotFoundError" not in out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["exit_code"] == 2


@pytest.mark.parametrize("argv, named", [(["--steps", "0"], "argument --steps: 0 is not >= 1")])
def test_a_bad_argument_is_a_usage_error(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_:
        resources.main(argv)
    assert exit_.value.code == 2 and named in capsys.readouterr().err


def test_what_other_processes_make_meanwhile_is_not_left_by_the_run(tmp_path, capsys):
    """Another run's /dev/shm segment and another process's temp entry, made while the bench's run is alive, are not
    this run's leftovers (every new `rlloop_*` segment and temp entry counted)."""
    me = psutil.Process()
    foreign_shm = Path("/dev/shm") / f"rlloop_not-this-run-{os.getpid()}_ctl"
    foreign_tmp = Path(tempfile.gettempdir()) / f"rlloop_not_this_run_{os.getpid()}"
    made_while_alive = []

    def make_foreign_entries():
        while not (children := me.children()):  # the run started
            threading.Event().wait(0.02)
        foreign_shm.write_bytes(b"x")
        foreign_tmp.mkdir()
        made_while_alive.append(children[0].is_running())

    maker = threading.Thread(target=make_foreign_entries, daemon=True)
    maker.start()
    try:
        with pytest.raises(SystemExit):  # a config error: a run that ends in seconds, without Ray
            resources.main(["--steps", "2", "--every", "0.2", "--out", str(tmp_path / "rss.png"), "train.lr=abc"])
        maker.join(timeout=60)
        assert made_while_alive == [True]
        report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert report["left_shm"] == [] and report["left_tmp"] == []
    finally:
        foreign_shm.unlink(missing_ok=True)
        if foreign_tmp.exists():
            foreign_tmp.rmdir()


def test_left_shm_names_this_runs_segments_only(tmp_path):
    """The segments weight_sync makes for this run's id count; a live sender of another run does not."""
    run_dir = tmp_path / "run"
    mine = make_sender(SyncConfig(run_id=run_id_for(run_dir), transport="shm", delta=False))
    other = make_sender(SyncConfig(run_id=run_id_for(tmp_path / "other"), transport="shm", delta=False))
    try:
        for sender in (mine, other):
            sender.push({"w": np.zeros(4, np.float32)}, 0)
        left = resources.left_shm(run_dir)
        assert left and all(name.startswith(f"rlloop_{run_id_for(run_dir)}_") for name in left)
    finally:
        mine.close()
        other.close()
    assert resources.left_shm(run_dir) == []


CHILD = """
import json, sys, time
from pathlib import Path
metrics = Path(sys.argv[1]) / "metrics.jsonl"
metrics.parent.mkdir()
metrics.write_text(json.dumps({"step": 0, "eval/x": 0.1}) + "\\n")  # the step-0 eval: warm-up goes on
time.sleep(1.0)
held = bytearray(300 * 2**20)  # the first training step's memory, allocated before its row is logged
held[::4096] = b"x" * len(held[::4096])
with metrics.open("a") as f:
    f.write(json.dumps({"step": 1, "rollout/raw_reward": 0.0}) + "\\n")
time.sleep(1.0)
"""


def test_the_start_sample_is_after_the_first_training_step(tmp_path):
    """A driver whose step-0 eval row comes a second before its 300 MiB first step: the start is after that step
    (it was the first sample once metrics.jsonl existed, holding only the eval)."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "run")])
    times, series, warm_at, _ = resources.sample_run(proc, tmp_path / "run", every=0.1)
    driver = resources.rss_summary(series, warm_at)["driver"]
    assert driver["start"] > 300  # (not the end: the last sample may catch the child freeing it as it exits)
