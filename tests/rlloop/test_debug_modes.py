"""slime's debug modes: --debug rollout-only (no trainer: generate, score, save) and --debug train-only --replay
(no engine: train on saved rollouts), and a replayed step reproducing the original step's numbers exactly."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from rlloop.checkpoint import checkpoint_marks, latest_checkpoint, load_state, save_checkpoint
from rlloop.config import run_id_for
from rlloop.errors import DataError
from rlloop.replay import ReplayRollout, rollouts_file
from rlloop.run import Terminated, go_on, main, parse_args, run_command, stopped_by
from rlloop.run_dir import run_dir_held
from weight_sync.shm import segment_path

TINY = str(Path(__file__).resolve().parents[2] / "examples" / "grpo_dapo_tiny.yaml")
COMMON = ["run.steps=3", "run.eval_every=0", "rollout.prompts_per_step=4", "cluster.use_ray=false"]
COMMON += ["rollout.backend=hf", "tracking.progress=false"]


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_only_replays_a_run_exactly(tmp_path):
    """Across a resume too: the replay stops after step 2's checkpoint and continues from it (a replayed run's
    checkpoint has no prompt cursor to restore, but the restart counts a resume goes on from). With DAPO's overlong
    shaping, which makes the rewards trained on differ from the verifier's that `rollout/raw_reward` reports. The
    replay keeps the recipe's eval period: with no engine to evaluate on, it trains without evaluating."""
    original, replay = tmp_path / "original", tmp_path / "replay"
    shaping = ["grpo.overlong_buffer=8", "grpo.std_scale=false"]
    assert main([TINY, *COMMON, *shaping, f"run.dir={original}", "tracking.save_rollouts=true"]) == 0
    replaying = [TINY, *COMMON, *shaping, "run.eval_every=1", f"run.dir={replay}", "--debug", "train-only"]
    replaying += ["--replay", str(original / "rollouts")]
    assert main([*replaying, "run.steps=2", "run.save_every=1"]) == 0
    state = load_state(latest_checkpoint(replay))
    assert state["train_parallel"] == "ddp"  # what a resume checks its layout against
    restarts = ("train/restarts", "rollout/engine_restarts")
    assert [state["totals"].get(key) for key in restarts] == [0, 0]  # what a resume counts on from
    assert main([*replaying, "--resume"]) == 0
    before, after = rows(original), rows(replay)
    assert [r["step"] for r in after] == [1, 2, 3]
    assert not any(key.startswith("eval/") for r in after for key in r)
    saved = [json.loads(line) for line in rollouts_file(original / "rollouts", 1).read_text().splitlines()]
    assert any(r["reward"] != r["raw_reward"] for r in saved)  # some responses were shaped
    keys = ("train/loss", "train/grad_norm", "train/entropy", "train/logprob_abs_diff", "train/tokens")
    for key in (*keys, "rollout/raw_reward"):
        assert [r[key] for r in after] == [r[key] for r in before], key  # bit for bit: same weights, same batch
    assert json.loads((replay / "warmup.json").read_text()) == {}  # no engine was built
    assert "sync/version" not in after[-1] and "perf/rollout_s" not in after[-1]
    report = (replay / "report.md").read_text()  # says what ran, and nothing of what did not
    assert "steps of GRPO training on the rollouts of" in report and "--debug train-only" in report
    assert "nan" not in report and "rollout_s" not in report and "sync" not in report


@pytest.mark.parametrize("mode", ["sync", "async", "fully_async"])
def test_rollout_only_generates_scores_and_saves_without_a_trainer(tmp_path, mode):
    # (an option between the config and the overrides, as a user may type it)
    assert main([TINY, "--debug", "rollout-only", *COMMON, f"run.dir={tmp_path}", f"loop.mode={mode}"]) == 0
    logged = rows(tmp_path)
    assert [r["step"] for r in logged] == [1, 2, 3]
    assert all("rollout/raw_reward" in r and not any(k.startswith("train/loss") for k in r) for r in logged)
    saved = [json.loads(line) for line in (tmp_path / "rollouts" / "step_000002.jsonl").read_text().splitlines()]
    assert len(saved) == 4 * 8 and {"prompt_ids", "response_ids", "rollout_logprobs", "advantage"} <= set(saved[0])
    assert not (tmp_path / "checkpoints").exists()
    # the engine never got new weights: every step sampled from the initial policy
    assert {r["weight_version"] for r in saved} == {0}
    assert [r["rollout/staleness/max"] for r in logged] == [0, 0, 0]  # no trainer is ahead of them
    report = (tmp_path / "report.md").read_text()
    assert "3 steps of rollouts (--debug rollout-only: no training)" in report
    assert "nan" not in report and "train_s" not in report and "sync" not in report


def test_rollout_only_never_reads_the_weights_a_killed_run_left_in_shared_memory(tmp_path, private_shm):
    """A run killed outright leaves its segments; with no trainer there is no sender to sweep them, and fully_async's
    engines pulled the dead run's newest version as this run's weights. (The run is in-process: the directory of its
    own, `private_shm`, is the one it reads.)"""
    writer = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER.format(run_id=run_id_for(tmp_path), shm_dir=private_shm)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout.readline().strip() == "pushed"
    writer.kill()
    writer.wait()
    assert segment_path(run_id_for(tmp_path), "ctl").exists()
    assert main([TINY, "--debug", "rollout-only", *COMMON, f"run.dir={tmp_path}", "loop.mode=fully_async"]) == 0
    saved = [json.loads(line) for line in (tmp_path / "rollouts" / "step_000003.jsonl").read_text().splitlines()]
    assert {r["last_weight_version"] for r in saved} == {0}
    assert not segment_path(run_id_for(tmp_path), "ctl").exists()


KILLED_WRITER = """
import time
from pathlib import Path
import numpy as np
import weight_sync.shm
from weight_sync import SyncConfig, make_sender

weight_sync.shm.SHM_DIR = Path("{shm_dir}")
sender = make_sender(SyncConfig(run_id="{run_id}", transport="shm", delta=False))
for version in (1, 2):
    sender.push({{"model.embed_tokens.weight": np.ones((99, 64), np.float32)}}, version)
print("pushed", flush=True)
time.sleep(600)
"""


def test_a_run_dir_another_run_holds_is_refused(tmp_path, capsys):
    """A second run started into a running one's directory (a --debug run, the command typed again) replaced its
    metrics, report and checkpoints as both went on; it is refused before it starts, and the holder's files stay."""
    run_dir = tmp_path / "run"
    with run_dir_held(run_dir):
        (run_dir / "metrics.jsonl").write_text("the running run's\n")
        assert main([TINY, f"run.dir={run_dir}", "cluster.use_ray=false", "--debug", "rollout-only"]) == 2
        err = capsys.readouterr().err
        assert f"config error: run.dir: {run_dir} is in use by another run" in err
        assert (run_dir / "metrics.jsonl").read_text() == "the running run's\n"


def test_the_resume_command_printed_on_ctrl_c_keeps_the_debug_mode():
    """Without its --debug and --replay, the printed command would resume a replayed run as a normal one."""
    argv = [TINY, "run.steps=3", "--debug", "train-only", "--replay", "runs/a/rollouts"]
    command = run_command(parse_args(argv), resume=True)
    assert command == f"python -m rlloop.run {TINY} run.steps=3 --debug train-only --replay runs/a/rollouts --resume"
    assert parse_args(command.split()[3:]).replay == "runs/a/rollouts"


def test_a_sigterm_is_told_apart_however_it_arrives(monkeypatch):
    """Ray's handler (in place while ray.init runs) exits with SystemExit(15), and `ray.get` turns our Terminated into
    a plain KeyboardInterrupt: both are still a SIGTERM (exit 143), and a reward-style sys.exit(3) is no signal."""
    monkeypatch.setattr(Terminated, "received", False)
    assert stopped_by(KeyboardInterrupt()) == "interrupted"
    assert stopped_by(SystemExit(signal.SIGTERM)) == "terminated" and stopped_by(SystemExit(3)) is None
    assert stopped_by(Terminated()) == "terminated"
    monkeypatch.setattr(Terminated, "received", True)
    assert stopped_by(KeyboardInterrupt()) == "terminated"


def test_a_sigterm_says_what_to_run_next_before_the_cleanup_once_and_only_during_the_run(monkeypatch, capsys, tmp_path):
    """`ray job stop` kills the job 3 s after its SIGTERM: the line saying what to run next comes first, before a
    cleanup that may not finish; a second SIGTERM during the cleanup does not cut it short; and once main() returns
    the handler is the one it found (a SIGTERM then is not the run's to explain). The run's loop is a stand-in whose
    cleanup prints markers: what is under test is the driver's handling, not the loop's."""

    def train(cfg, resume=False, inputs=None):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # ended by the handler's Terminated
        finally:
            print("cleanup starts", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            print("cleanup done", file=sys.stderr, flush=True)

    monkeypatch.setitem(sys.modules, "rlloop.loop", types.SimpleNamespace(train=train))
    before = signal.getsignal(signal.SIGTERM)
    assert main([TINY, f"run.dir={tmp_path}", "cluster.use_ray=false"]) == 143
    err = capsys.readouterr().err
    said = err.index("terminated; this run saved no checkpoint; start it again without --resume")
    assert said < err.index("cleanup starts") < err.index("cleanup done") and err.count("terminated;") == 1
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_resume_command_is_one_a_shell_reads_back_as_it_was():
    argv = [TINY, "run.name=my run", "train.lr=1e-4"]
    words = shlex.split(run_command(parse_args(argv), resume=True))
    assert words[3:] == [*argv, "--resume"]


@pytest.mark.parametrize("working_dir", ["gcs://_ray_pkg_0123.zip", None])
def test_a_ray_jobs_resume_command_submits_it_again(monkeypatch, working_dir):
    """Run where the job ran, the bare command started a Ray of its own there (or, with RAY_ADDRESS=http://..., failed
    on the address); the job is resubmitted from where it was submitted, with its working directory if it had one."""
    env_vars = {"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "30"}}  # what the README submits with: kept
    runtime_env = env_vars | ({"working_dir": working_dir} if working_dir else {})
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": runtime_env}))
    words = shlex.split(run_command(parse_args([TINY, "run.dir=/mnt/runs/{name}"]), resume=True))
    submit = ["ray", "job", "submit", *(["--working-dir", "."] if working_dir else [])]
    submit += ["--runtime-env-json", json.dumps(env_vars), "--"]
    assert words == [*submit, "python", "-m", "rlloop.run", TINY, "run.dir=/mnt/runs/{name}", "--resume"]


def test_a_run_stopped_before_its_first_checkpoint_is_told_to_start_again_not_to_resume(tmp_path):
    """A --resume would load the checkpoint an earlier run left in the directory, or start over: the advice printed
    after Ctrl-C or a dead actor says --resume only once this run (or the one it resumed) has saved."""
    args, write = parse_args([TINY, f"run.dir={tmp_path}"]), lambda path: Path(path, "weights").write_text("w")
    save_checkpoint(tmp_path, 8, {}, write)  # the earlier run's
    earlier = checkpoint_marks(tmp_path)
    assert (
        go_on(args, tmp_path, earlier)
        == f"this run saved no checkpoint; start it again without --resume: {run_command(args, resume=False)}"
    )
    assert go_on(parse_args([TINY, f"run.dir={tmp_path}", "--resume"]), tmp_path, earlier).startswith("continue with")
    save_checkpoint(tmp_path, 2, {}, write)  # this run's first
    assert go_on(args, tmp_path, earlier) == f"continue with: {run_command(args, resume=True)}"


def test_replay_without_train_only_is_a_config_error(tmp_path, capsys):
    assert main([TINY, f"run.dir={tmp_path}", "--replay", str(tmp_path)]) == 2
    assert "run.replay" in capsys.readouterr().err


def test_a_replay_directory_that_is_not_there_is_named(tmp_path, capsys):
    args = [TINY, *COMMON, f"run.dir={tmp_path / 'run'}", "--debug", "train-only", "--replay", str(tmp_path / "nope")]
    assert main(args) == 2
    assert f"run.replay: {tmp_path / 'nope'} is not a directory" in capsys.readouterr().err


def test_train_only_on_fewer_saved_steps_than_run_steps_is_a_config_error(tmp_path, capsys):
    """Found before anything starts, not at the missing step after the others have trained."""
    saved = tmp_path / "rollouts"
    saved.mkdir()
    for step in (1, 2):
        (saved / f"step_{step:06d}.jsonl").write_text("")
    args = [TINY, *COMMON, f"run.dir={tmp_path / 'run'}", "--debug", "train-only", "--replay", str(saved)]
    assert main(args) == 2
    assert f"run.replay: {saved} has no rollouts of step 3;" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_run_whose_steps_trained_nothing_is_replayed_so(tmp_path):
    """Dynamic sampling kept no group (every sample scores the same): the rollout-only run saves each step empty, and
    train-only replays them as steps with nothing to train on (the replay used to stop at the first: no rollouts)."""
    nothing = ["grpo.dynamic_sampling=true", "grpo.max_sampling_rounds=1", "reward.fn=tests.rlloop.reward_fns:constant"]
    assert main([TINY, *COMMON, *nothing, f"run.dir={tmp_path / 'gen'}", "--debug", "rollout-only"]) == 0
    assert [rollouts_file(tmp_path / "gen" / "rollouts", s).read_text() for s in (1, 2, 3)] == ["", "", ""]
    replaying = [f"run.dir={tmp_path / 'replay'}", "--debug", "train-only", "--replay", str(tmp_path / "gen/rollouts")]
    assert main([TINY, *COMMON, *replaying]) == 0
    logged = rows(tmp_path / "replay")
    assert [r["step"] for r in logged] == [1, 2, 3] and not any("train/loss" in r for r in logged)


def test_a_saved_step_cut_short_is_a_data_error_naming_it(tmp_path):
    saved = tmp_path / "rollouts"
    saved.mkdir()
    (saved / "step_000001.jsonl").write_text('{"prompt": [{"role": "user", "con')
    with pytest.raises(DataError, match=r"run.replay: .*step_000001.jsonl is not a saved step's rollouts"):
        ReplayRollout(str(saved)).next(1)


def test_the_last_line_names_the_last_checkpoint_s_policy(tmp_path, capsys):
    """A run's own last checkpoint; on a --resume that has nothing left to train, the one it found (the line named
    step run.steps, which did not exist) and only the files there are (it named a report a killed run never wrote);
    with nothing saved, says so."""
    policy = "the trained policy, as of the last checkpoint (a transformers model directory): "
    assert main([TINY, *COMMON, "run.steps=2", "run.save_every=2", f"run.dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert policy + str(tmp_path / "checkpoints" / "step_000002" / "trainer") in out
    assert f"done: {tmp_path}/metrics.jsonl, curves.png, report.md\n" in out
    for made_at_the_end in ("curves.png", "report.md"):  # as a run killed after its last checkpoint leaves it
        (tmp_path / made_at_the_end).unlink()
    assert main([TINY, *COMMON, "run.steps=1", f"run.dir={tmp_path}", "--resume"]) == 0
    out = capsys.readouterr().out
    assert policy + str(tmp_path / "checkpoints" / "step_000002" / "trainer") in out
    assert f"done: {tmp_path}/metrics.jsonl\n" in out
    assert main([TINY, *COMMON, "run.steps=1", "run.save_every=0", f"run.dir={tmp_path / 'unsaved'}"]) == 0
    assert policy + "not saved (run.save_every=0)" in capsys.readouterr().out


def test_rollout_only_refuses_a_trained_run_s_directory_and_a_replay_its_next_start_would_move(tmp_path, capsys):
    """--debug rollout-only in a trained run's directory replaced its metrics and kept its checkpoints (a --resume
    then went on from them under the rollout-only run's metrics); with --resume it said it resumed from the
    checkpoint and sampled from model.path. A replay from the directory's rollouts.earlier/ was moved and deleted
    by the start it fed. Both are refused before anything starts, the directory as it was."""
    ckpt = save_checkpoint(tmp_path, 2, {}, lambda path: (Path(path) / "model.safetensors").write_bytes(b"w"))
    for resume in ([], ["--resume"]):
        assert main([TINY, "--debug", "rollout-only", *COMMON, f"run.dir={tmp_path}", *resume]) == 2
        err = capsys.readouterr().err
        assert f"run.dir: {tmp_path} holds a trained run's checkpoints" in err
        assert f"model.path={ckpt / 'trainer'}" in err
    earlier = tmp_path / "rollouts.earlier"
    earlier.mkdir()
    for step in (1, 2, 3):
        (earlier / f"step_{step:06d}.jsonl").write_text("")
    replay = ["--debug", "train-only", "--replay", str(earlier)]
    assert main([TINY, *replay, *COMMON, f"run.dir={tmp_path}"]) == 2
    assert f"run.replay: {earlier} is in run.dir's rollouts.earlier/" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "rollouts.earlier"]


def test_a_reward_function_that_breaks_mid_run_exits_1_saying_what_to_run_next(tmp_path, capsys):
    """A reward function failing on a step's worth of samples in a row ends the run after it started: exit 1 (not 2,
    a bad input found before the start), the error, and, as after a dead actor, what to run next: this run saved no
    checkpoint, so start it again (once the function is fixed), not --resume."""
    fn = "tests.rlloop.reward_fns:always_raises"
    args = [TINY, *COMMON, f"reward.fn={fn}", f"run.dir={tmp_path}"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert f"reward error: reward.fn {fn} failed on each of the last" in err
    assert "this run saved no checkpoint; start it again without --resume: python -m rlloop.run " in err
