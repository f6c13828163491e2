"""Tracking: metrics.jsonl one line per step (trimmed on resume), curves and report, W&B offline without a key."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlloop.config import load_config
from rlloop.tracking import RunSummary, Tracker, make_report, read_metrics

TINY = str(Path(__file__).resolve().parents[2] / "examples" / "grpo_dapo_tiny.yaml")


def log_steps(tracker, steps):
    for s in steps:
        tracker.log(
            s,
            {
                "rollout/raw_reward": s / 10,
                "train/loss": 1.0 / s,
                "sync/bytes": 10.0,
                "sync/full_bytes": 40.0,
                "sync/keyframe": float(s == 1),
                "eval/tiny": 0.5,
            }
            | ({"perf/step_s": 2.0} if s % 2 else {}),
        )


def test_metrics_jsonl_resume_curves_and_report(tmp_path):
    cfg = load_config(TINY, ["tracking.progress=false", f"run.dir={tmp_path}"])
    tracker = Tracker(cfg)
    log_steps(tracker, [1, 2, 3, 4])
    tracker.close()
    tracker = Tracker(cfg, start_step=2)  # resumed from the step-2 checkpoint: 3 and 4 are redone
    log_steps(tracker, [3, 4, 5])
    tracker.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[2]["rollout/raw_reward"] == 0.3
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    report = (tmp_path / "report.md").read_text()
    assert "5 steps" in report and "4.0x smaller" in report and "eval/tiny" in report


def test_a_resume_killed_while_it_rewrites_the_metrics_loses_no_line(tmp_path, monkeypatch):
    """A resume keeps the lines up to its checkpoint's step; written in place, a kill half-way cut the file, and the
    next resume went on without the steps after the cut."""
    cfg = load_config(TINY, ["tracking.progress=false", f"run.dir={tmp_path}"])
    tracker = Tracker(cfg)
    log_steps(tracker, [1, 2, 3, 4])
    tracker.close()
    before = (tmp_path / "metrics.jsonl").read_text()

    def killed_half_way(self, text, *args, **kwargs):
        with open(self, "w") as f:
            f.write(text[: len(text) // 2])
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(Path, "write_text", killed_half_way)
        with pytest.raises(KeyboardInterrupt):
            Tracker(cfg, start_step=3)
    assert (tmp_path / "metrics.jsonl").read_text() == before


def test_numpy_scalars_are_logged_as_numbers_and_odd_rows_do_not_break_the_summary(tmp_path):
    import numpy as np

    from rlloop.tracking import plot_curves

    tracker = Tracker(load_config(TINY, ["tracking.progress=false", f"run.dir={tmp_path}"]))
    tracker.log(1, {"rollout/raw_reward": np.float32(0.25), "train/tokens": np.int64(7), "train/flag": np.bool_(1)})
    tracker.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [
        {"step": 1, "rollout/raw_reward": 0.25, "train/tokens": 7.0, "train/flag": 1.0}
    ]
    assert "final/eval/x" not in RunSummary([{"step": 1, "eval/x": None}]).values  # an eval key with no number
    plot_curves([{"step": 1, "train/other": 1.0}], tmp_path / "none.png")  # no curve to draw: no figure
    assert not (tmp_path / "none.png").exists()


def test_a_run_stopped_after_its_step_0_eval_reports_that_and_no_nan(tmp_path):
    """Its report read "reward: first 1 steps nan -> last 1 steps nan" and "mean per step: step_s nan, ...", and W&B's
    summary had mean/perf/step_s = nan."""
    rows = [{"step": 0, "eval/tiny_arith": 0.148}]
    report = make_report(load_config(TINY), rows)
    assert "nan" not in report and "- eval/tiny_arith: step 0: 0.148" in report
    assert RunSummary(rows).values == {"steps": 0, "final/eval/tiny_arith": 0.148}


def test_summary_means_are_over_the_steps_that_logged_the_key():
    """mean/perf/step_s over the rows that have it: a step-0 eval row, and steps without a step time, do not count."""
    rows = [{"step": 0, "eval/x": 0.1}, {"step": 1, "perf/step_s": 2.0}, {"step": 2}, {"step": 3, "perf/step_s": 4.0}]
    rows += [{"step": 4, "perf/rollout_tok_per_s": 30.0}]
    values = RunSummary(rows).values
    assert values["mean/perf/step_s"] == (2.0 + 4.0) / 2 and values["mean/perf/rollout_tok_per_s"] == 30.0
    assert values["steps"] == 4 and values["final/eval/x"] == 0.1


def test_a_resumed_runs_summary_covers_the_steps_before_its_checkpoint(tmp_path):
    """W&B's summary after a resume: mean step time over every step in metrics.jsonl (the kept ones before the
    checkpoint too), not only those since the resume; the last reward is the redone step's."""
    cfg = load_config(TINY, ["tracking.progress=false", f"run.dir={tmp_path}"])
    tracker = Tracker(cfg)
    for s in (1, 2, 3):
        tracker.log(s, {"perf/step_s": float(s), "rollout/raw_reward": s / 10})
    tracker.close()
    tracker = Tracker(cfg, start_step=2)  # step 3 is redone
    tracker.log(3, {"perf/step_s": 9.0, "rollout/raw_reward": 0.9})
    tracker.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert tracker.summary.values["mean/perf/step_s"] == pytest.approx(sum(r["perf/step_s"] for r in rows) / 3)
    assert tracker.summary.values["steps"] == 3 and tracker.summary.values["final/rollout/raw_reward"] == 0.9


def test_report_compares_the_mean_reward_of_the_first_and_last_steps():
    """9 steps: a third of them, 3, at each end: (0.1 + 0.2 + 0.3) / 3 -> (0.7 + 0.8 + 0.9) / 3."""
    rows = [{"step": s, "rollout/raw_reward": s / 10} for s in range(1, 10)]
    report = make_report(load_config(TINY), rows)
    assert "- reward (rollout/raw_reward): first 3 steps 0.200 -> last 3 steps 0.800" in report


def test_a_run_that_starts_over_before_its_first_checkpoint_logs_each_step_once(tmp_path):
    """A trainer rank that dies before the first checkpoint has the cluster rebuilt from step 0, whose evaluation
    runs again (as does a run started again in the same directory): its line, and the others, must not double."""
    cfg = load_config(TINY, ["tracking.progress=false", f"run.dir={tmp_path}"])
    for steps in ([1, 2, 3], [1, 2]):
        tracker = Tracker(cfg)
        tracker.log(0, {"eval/tiny": 0.25})
        log_steps(tracker, steps)
        tracker.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").open()] == [0, 1, 2]


def test_report_says_when_every_version_went_in_full():
    cfg = load_config(TINY, ["tracking.progress=false"])
    sync = {"sync/bytes": 40.2, "sync/full_bytes": 40.0, "sync/keyframe": 1.0}
    rows = [{"step": s, "rollout/raw_reward": 0.1, **sync} for s in (1, 2, 3)]
    assert "(every version in full)" in make_report(cfg, rows)


def test_wandb_goes_offline_without_an_api_key(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))  # nor a `wandb login`
    cfg = load_config(TINY, ["tracking.progress=false", "tracking.wandb=true", f"run.dir={tmp_path}"])
    tracker = Tracker(cfg)
    assert tracker.wandb.settings.mode == "offline"
    log_steps(tracker, [1, 2])
    tracker.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and (tmp_path / "wandb_id").read_text() in runs[0].name


AUTO_MODE = """
import os, sys
from rlloop.tracking import wandb_mode

print(wandb_mode("auto"))  # no key yet
with open(os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:  # what `wandb login` writes
    f.write("machine api.wandb.ai\\n  login user\\n  password " + "k" * 40 + "\\n")
print(wandb_mode("auto"))
os.environ["WANDB_MODE"] = "offline"  # W&B's own setting: the mode given to wandb.init would override it
print(wandb_mode("auto"))
"""


def test_auto_mode_goes_online_where_wandb_has_a_key(tmp_path):
    """`wandb login` stores its key in ~/.netrc, not in the environment (which was all that auto looked at). In a
    fresh process: W&B keeps its login for the process."""
    netrc = tmp_path / "netrc"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")} | {"NETRC": str(netrc)}
    run = [sys.executable, "-c", AUTO_MODE, str(netrc)]
    out = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split()[-3:] == ["offline", "online", "offline"], out.stdout + out.stderr[-2000:]


WANDB_FAILS = """
import json, logging, sys
import psutil
from rlloop.config import load_config
from rlloop.tracking import Tracker

logging.basicConfig(level=logging.WARNING)
overrides = ["tracking.progress=false", "tracking.wandb=true", "run.dir=" + sys.argv[2], "tracking.mode=" + sys.argv[3]]
tracker = Tracker(load_config(sys.argv[1], overrides))
print("started", tracker.wandb is not None)
tracker.log(1, {"train/loss": 1.0})
if sys.argv[4] == "kill":  # W&B's service process dies mid-run (the OOM killer, a crash)
    for child in psutil.Process().children(recursive=True):
        if "wandb" in " ".join(child.cmdline()):
            child.kill()
            child.wait()
tracker.log(2, {"train/loss": 0.5})
tracker.close()
print("steps", [json.loads(line)["step"] for line in open(sys.argv[2] + "/metrics.jsonl")])
"""


@pytest.mark.parametrize("failure", ["unreachable", "killed"])
def test_a_wandb_that_fails_stops_wandb_not_the_run(tmp_path, failure):
    """wandb.init against an unreachable server, or W&B's service killed mid-run: either raised out of the tracker
    and ended the run (at a save step before its checkpoint). In a fresh process: W&B keeps process-wide state."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env |= {"WANDB_API_KEY": "k" * 40, "NETRC": str(tmp_path / "no_netrc")}
    if failure == "unreachable":
        env |= {"WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_INIT_TIMEOUT": "3"}
    mode, action = ("online", "none") if failure == "unreachable" else ("offline", "kill")
    run = [sys.executable, "-c", WANDB_FAILS, TINY, str(tmp_path), mode, action]
    out = subprocess.run(run, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    lines = out.stdout.split("\n")
    assert "started " + str(failure == "killed") in lines and "steps [1, 2]" in lines, out.stdout
    said = "W&B did not start" if failure == "unreachable" else "W&B failed to log"
    assert said in out.stderr and "metrics.jsonl" in out.stderr, out.stderr[-3000:]


WANDB_STOPPED = """
import sys, time
from rlloop.config import load_config
from rlloop.tracking import Tracker

overrides = ["tracking.progress=false", "tracking.wandb=true", "tracking.mode=offline", "run.dir=" + sys.argv[2]]
tracker = Tracker(load_config(sys.argv[1], overrides))
for step in (1, 2, 3):
    tracker.log(step, {"rollout/raw_reward": step / 10, "perf/step_s": float(step)})
print("logged", flush=True)
time.sleep(120)
"""


def test_wandb_has_the_runs_summary_while_it_runs_not_only_at_its_end(tmp_path):
    """`ray job stop` signals every process of the job, W&B's service too: the summary a finishing run wrote never
    reached W&B. Here the driver and W&B's service are signalled together, after W&B wrote what it had (its flush
    interval made short); W&B's log of the run must hold the summary of the steps logged."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env |= {"NETRC": str(tmp_path / "no_netrc"), "WANDB_X_TRANSACTION_LOG_FLUSH_INTERVAL": "0.2"}
    run = [sys.executable, "-c", WANDB_STOPPED, TINY, str(tmp_path)]
    job = subprocess.Popen(
        run, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert job.stdout.readline() == "logged\n", job.stderr.read()[-3000:]
        time.sleep(2)
    finally:
        os.killpg(job.pid, signal.SIGTERM)  # the job's processes, as Ray's job supervisor signals them
        job.wait(timeout=60)
    (log,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")  # W&B's own record of the run
    assert b"mean/perf/step_s" in log.read_bytes() and b"final/rollout/raw_reward" in log.read_bytes()


def test_wandb_run_is_continued_on_resume_and_new_for_a_run_from_step_0(tmp_path, monkeypatch):
    """W&B ignores steps below the last it has: a run that starts over from step 0 in this directory (afresh, or
    rebuilt before its first checkpoint) gets a run of its own; one resumed from a checkpoint continues its run."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = load_config(TINY, ["tracking.progress=false", "tracking.wandb=true", f"run.dir={tmp_path}"])
    ids = []
    for start in (0, 2, 0):
        tracker = Tracker(cfg, start_step=start)
        log_steps(tracker, [start + 1])
        tracker.close()
        ids.append((tmp_path / "wandb_id").read_text())
    assert ids[1] == ids[0] and ids[2] != ids[0]


def test_wandb_gets_sample_tables_and_no_secret_is_written(tmp_path, monkeypatch):
    """A real (local, 2-step) run offline: a table of the step's completions every tracking.sample_every steps, and
    the tokens in the environment appear in none of the run's files."""
    from rlloop.loop import train

    monkeypatch.setenv("WANDB_API_KEY", "wandb_secret_never_written" + "0" * 14)  # 40 characters, as W&B's are
    monkeypatch.setenv("HF_TOKEN", "hf_secret_never_written")
    cfg = load_config(
        TINY,
        [
            f"run.dir={tmp_path}",
            "run.steps=2",
            "run.eval_every=0",
            "run.save_every=0",
            "rollout.prompts_per_step=4",
            "cluster.use_ray=false",
            "tracking.progress=false",
            "tracking.wandb=true",
            "tracking.sample_every=2",
            "tracking.mode=offline",  # with a key set, auto would go online
        ],
    )
    train(cfg)
    tables = list(tmp_path.glob("wandb/offline-run-*/files/media/table/samples_*.table.json"))
    assert len(tables) == 1  # step 2 only
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["prompt", "response", "answer", "reward", "advantage", "weight_version"]
    assert len(table["data"]) == 4 * cfg.rollout.group_size
    assert {row[5] for row in table["data"]} == {1}  # step 2 sampled with the weights of step 1
    for f in tmp_path.rglob("*"):  # W&B's own binary .wandb log and debug files included
        if f.is_file():
            assert b"_secret_never_written" not in f.read_bytes(), f


def test_the_async_modes_log_every_step_to_wandb_in_order(tmp_path, monkeypatch):
    """W&B drops a step logged below the last it has. In the async modes step k + 1's samples are ready before step
    k's metrics, and the sample table went to W&B first: every step before a table's step was lost (10 % of a run's
    history at tracking.sample_every=10). What reaches W&B is recorded on its way in."""
    import wandb

    logged, log = [], wandb.Run.log
    monkeypatch.setattr(
        wandb.Run, "log", lambda run, data, step: logged.append((step, set(data))) or log(run, data, step)
    )
    overrides = ["run.steps=3", "run.eval_every=0", "run.save_every=0", "rollout.prompts_per_step=4", "loop.mode=async"]
    overrides += ["cluster.use_ray=false", "tracking.progress=false", "tracking.wandb=true", "tracking.mode=offline"]
    from rlloop.loop import train

    train(load_config(TINY, [f"run.dir={tmp_path}", *overrides, "tracking.sample_every=2"]))
    assert [step for step, _ in logged] == [1, 2, 3]
    assert [("samples" in keys, "train/loss" in keys) for _, keys in logged] == [
        (False, True),
        (True, True),
        (False, True),
    ]


def test_a_run_stopped_by_an_error_or_ctrl_c_is_failed_in_wandb_not_finished(tmp_path, monkeypatch):
    import wandb

    codes, finish = [], wandb.Run.finish
    monkeypatch.setattr(
        wandb.Run, "finish", lambda run, exit_code=None: codes.append(exit_code) or finish(run, exit_code)
    )
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    args = ["tracking.progress=false", "tracking.wandb=true", "tracking.mode=offline"]
    (tmp_path / "done").mkdir(), (tmp_path / "stopped").mkdir()
    with Tracker(load_config(TINY, [*args, f"run.dir={tmp_path / 'done'}"])) as tracker:
        log_steps(tracker, [1])
    stopped = load_config(TINY, [*args, f"run.dir={tmp_path / 'stopped'}"])
    with pytest.raises(KeyboardInterrupt), Tracker(stopped) as tracker:
        log_steps(tracker, [1])
        raise KeyboardInterrupt
    assert codes == [0, 1]
    assert (tmp_path / "stopped" / "report.md").exists()  # the report of what it did, all the same


def test_a_metrics_line_cut_short_at_the_end_is_left_out_and_one_inside_is_an_error(tmp_path):
    """The disk filled, or the driver died, while it wrote the last line: --resume goes on (and logs it again)."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 0.5}\n{"step": 2, "x": 0.')
    assert read_metrics(path) == [{"step": 1, "x": 0.5}]
    path.write_text('{"step": 1, "x": 0.\n{"step": 2, "x": 0.5}\n')
    with pytest.raises(json.JSONDecodeError):
        read_metrics(path)
