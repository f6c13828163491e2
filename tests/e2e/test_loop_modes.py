"""The async loop modes and several engines, on the real tiny recipe: staleness bounds, recorded versions, resume
without losing or repeating a prompt, and 2 engines that share every step's work and every weight version."""

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rlloop.cluster import Cluster
from rlloop.config import load_config
from rlloop.data import load_inputs
from rlloop.loop import train
from rollout import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "grpo_dapo_tiny.yaml")
LOCAL = [
    "cluster.use_ray=false",
    "tracking.progress=false",
    "run.eval_every=0",
    "rollout.prompts_per_step=4",
    "tracking.save_rollouts=true",
    "sync.transport=disk",
]


def trained_rows(run_dir: Path) -> dict[int, list[dict]]:
    return {
        int(p.stem.split("_")[1]): [json.loads(line) for line in p.read_text().splitlines()]
        for p in sorted((run_dir / "rollouts").glob("step_*.jsonl"))
    }


@pytest.mark.parametrize(
    "mode,max_staleness,ray",
    [
        ("async", 1, False),
        pytest.param("async", 1, True, marks=pytest.mark.xdist_group("ray")),  # starts Ray: one at a time
        ("fully_async", 1, False),
        ("fully_async", 0, False),
    ],
)
def test_no_trained_sample_is_staler_than_allowed_and_versions_are_recorded(tmp_path, mode, max_staleness, ray):
    """With Ray the next step's training is queued on the trainer actor behind the one in flight; the generation
    after it must still wait for the weights of the step before (exactly one version stale)."""
    cfg = load_config(
        TINY,
        LOCAL
        + [
            f"cluster.use_ray={ray}",
            f"loop.mode={mode}",
            f"loop.max_staleness={max_staleness}",
            "run.steps=5",
            "run.save_every=0",
            f"run.dir={tmp_path}",
        ],
    )
    train(cfg)
    rows = trained_rows(tmp_path)
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sorted(rows) == [m["step"] for m in metrics if "train/loss" in m]
    assert [m["step"] for m in metrics] == sorted(m["step"] for m in metrics)  # logged in order, each step once
    assert rows, "nothing was trained"
    for step, samples in rows.items():
        for r in samples:
            assert r["last_weight_version"] >= r["weight_version"]
            assert step - 1 - r["weight_version"] <= max_staleness  # the trainer held version step - 1
    if mode == "async":  # exactly one step off-policy once the pipeline is full
        assert {r["weight_version"] for r in rows[4]} == {2}
    assert max(m.get("rollout/staleness/max", 0) for m in metrics) <= max_staleness
    # The engines' receivers report every step (fully_async's engines pull mid-generation, never in a pull call):
    # the version an engine holds is at least what its samples were generated on, and nothing was refused
    for m in metrics:
        if m["step"] in rows:
            assert m["sync/rollout_version"] >= max(r["last_weight_version"] for r in rows[m["step"]])
            assert m["sync/refused"] == 0 and "sync/read_s" in m
    assert_breakdown_fits(metrics)


@pytest.mark.parametrize("max_staleness,dynamic_sampling", [(1, False), (0, False), (1, True)])
def test_fully_async_generates_no_chunk_only_to_drop_it(tmp_path, max_staleness, dynamic_sampling):
    """The producer starts a chunk only if its groups will be fresh enough when the trainer takes them, so none is
    generated and then dropped as too stale (without that, 64 here, half as many as were trained: the engine ran ahead
    of the trainer). At max_staleness 0 it waits for the weights of the step in training rather than start a chunk
    on older ones (two chunks a step were dropped so when the producer heard of new weights only a batch later).
    With dynamic sampling a step takes its groups from several chunks: the groups it has taken already count (42 were
    dropped here, a third of those trained), and a trainer with groups in the buffer is not starving."""
    overrides = [
        "loop.mode=fully_async",
        f"loop.max_staleness={max_staleness}",
        f"grpo.dynamic_sampling={dynamic_sampling}",
        "rollout.prompts_per_step=16",
        "run.steps=8",
        "run.save_every=0",
    ]
    cfg = load_config(TINY, LOCAL + [*overrides, f"run.dir={tmp_path}"])
    inputs = load_inputs(cfg)
    train(cfg, inputs=inputs)
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "train/loss" in m] == list(range(1, 9))
    assert metrics[-1]["rollout/stale_groups_dropped"] == 0
    if not dynamic_sampling:  # nor a chunk after the last step's (it cost a whole step's generation at the end)
        cursor = inputs.data.state_dict()
        assert cursor["epoch"] * cursor["rows"] + cursor["position"] == 8 * 16
    assert max(m["rollout/staleness/max"] for m in metrics) == max_staleness  # it runs ahead as far as allowed


@pytest.mark.parametrize("reward", ["dapo", "tests.rlloop.reward_fns:informative_quarter"])
def test_fully_async_at_staleness_0_with_dynamic_sampling_trains_full_batches_of_few_stale_groups(tmp_path, reward):
    """A chunk started for a starving trainer is the groups its step lacks over the share dynamic sampling keeps, as
    sync's rounds over-sample: a whole chunk's surplus went stale in the buffer (66 groups dropped under DAPO's
    reward, against 32 dynamic sampling dropped), and the bare shortfall trained short batches (under a reward that
    leaves three groups in four uninformative).
    What still goes stale is the over-sampling's surplus, fewer than the groups dynamic sampling drops. (Rounds
    enough to fill each batch: at the default 3 a step trains short under the quarter reward, as sync's does.)"""
    overrides = ["loop.mode=fully_async", "loop.max_staleness=0", "grpo.dynamic_sampling=true"]
    overrides += ["grpo.max_sampling_rounds=8"]
    overrides += [f"reward.fn={reward}"]
    overrides += ["rollout.prompts_per_step=16", "run.steps=8", "run.save_every=0"]
    train(load_config(TINY, LOCAL + [*overrides, f"run.dir={tmp_path}"]))
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout/groups_kept"] for m in metrics if "train/loss" in m] == [16] * 8
    assert metrics[-1]["rollout/stale_groups_dropped"] < metrics[-1]["rollout/zero_std_groups_dropped"]
    assert max(m["rollout/staleness/max"] for m in metrics) == 0


def test_fully_async_dynamic_sampling_draws_at_most_its_rounds_a_step(tmp_path, monkeypatch):
    """grpo.max_sampling_rounds bounds a step's generation as in sync (verl's max_num_gen_batches): once that many
    chunks have been drawn since the last batch was taken, it trains short. It counted only chunks in a row that kept
    no group, so under a reward that leaves three groups in four uninformative a step drew on for as many as it took;
    and while the driver was busy elsewhere (here: slow to save its samples) chunks went on filling the buffer."""
    from rlloop.tracking import Tracker

    log_samples = Tracker.log_samples
    monkeypatch.setattr(Tracker, "log_samples", lambda *a: (time.sleep(2), log_samples(*a)))
    overrides = ["loop.mode=fully_async", "grpo.dynamic_sampling=true", "grpo.max_sampling_rounds=1"]
    overrides += ["reward.fn=tests.rlloop.reward_fns:informative_quarter"]
    overrides += ["rollout.prompts_per_step=16", "run.steps=4", "run.save_every=0", f"run.dir={tmp_path}"]
    cfg = load_config(TINY, LOCAL + overrides)
    inputs = load_inputs(cfg)
    train(cfg, inputs=inputs)
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(m["rollout/groups_kept"] < 16 for m in metrics if "rollout/groups_kept" in m)
    cursor = inputs.data.state_dict()
    assert cursor["epoch"] * cursor["rows"] + cursor["position"] <= 4 * 16  # a chunk of at most 16 prompts a step


FAILING_STEP = """
import gc
import sys

import jax

from rlloop.config import load_config
from rlloop.data import load_inputs
from rlloop.loop import train
from rlloop.workers import TrainerWorker

real, calls = TrainerWorker.train_step, []


def fails_third(self, *args, **kwargs):
    calls.append(None)
    if len(calls) == 3:
        raise RuntimeError("injected train step failure")
    return real(self, *args, **kwargs)


if __name__ == "__main__":
    TrainerWorker.train_step = fails_third
    try:
        train(load_config(sys.argv[1], sys.argv[2:]))
    except RuntimeError as e:
        print("raised:", e)
    gc.collect()
    print("live JAX bytes:", sum(a.nbytes for a in jax.live_arrays()))
"""


@pytest.mark.timeout(300)  # it used to wait for ever
@pytest.mark.parametrize("max_staleness", [0, 1])
def test_fully_async_ends_with_the_error_of_a_train_step_that_fails(tmp_path, max_staleness):
    """At max_staleness 0 the trainer waited for groups that only the failed step's weights would let start: the run
    neither ended nor rebuilt. The step's error ends it (a dead trainer's, TrainerDied, rebuilds the cluster), and
    what the failed run leaves is freed: its traceback held the in-process engine in a reference cycle that the heap
    the workers froze (freeze_heap) kept from the collector, 19 MB of JAX arrays a failure. In a process of its own,
    since it counts the process's live arrays."""
    script = tmp_path / "failing_step.py"
    script.write_text(FAILING_STEP)
    overrides = ["loop.mode=fully_async", f"loop.max_staleness={max_staleness}", "run.steps=6", "run.save_every=0"]
    args = [sys.executable, str(script), TINY, *LOCAL, *overrides, f"run.dir={tmp_path / 'run'}"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert "raised: injected train step failure" in done.stdout, done.stderr[-3000:]
    assert "live JAX bytes: 0" in done.stdout, done.stdout


@pytest.mark.timeout(300)  # it used to run for ever
def test_fully_async_goes_on_after_steps_that_trained_nothing(tmp_path, monkeypatch):
    """Dynamic sampling keeps no group in two steps' rounds (the first 128 samples all score 1), so they train and
    publish nothing; then groups disagree again, and the steps after train on them: they come from the weights the
    trainer holds. Staleness counted in step numbers made every later group two versions stale: each was dropped, and
    the engines generated for ever."""
    monkeypatch.setenv("RLLOOP_TEST_SCORED", str(tmp_path / "scored"))
    overrides = [
        "loop.mode=fully_async",
        "loop.max_staleness=1",
        "grpo.dynamic_sampling=true",
        "grpo.max_sampling_rounds=2",
        "reward.fn=tests.rlloop.reward_fns:agree_first_128",
        "run.steps=4",
        "run.save_every=0",
    ]
    train(load_config(TINY, LOCAL + [*overrides, f"run.dir={tmp_path / 'run'}"]))
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [("train/loss" in m) for m in metrics] == [False, False, True, True]
    assert metrics[-1]["rollout/stale_groups_dropped"] == 0


@pytest.mark.parametrize("delay_s,evals", [(0.5, "run.eval_every=0"), (3.0, "run.eval_every=2")])
def test_async_generates_each_step_on_the_weights_two_steps_back_however_late_it_pulls(
    tmp_path, monkeypatch, delay_s, evals
):
    """async generates step k on step k - 2's weights. The rollout thread's pull is delayed here past a whole train
    step (a loaded host), so step k - 1's weights are out by then too; the engines used to load those, the newest, and
    the run differed from one on an idle host. Past an evaluation, too, which loads the newest weights: step 3's pull
    found step 2's loaded by the step-2 evaluation and generated on them."""
    pull = Cluster.pull_weights

    def late_pull(self, *args, **kwargs):
        if threading.current_thread().name.startswith("rlloop-rollout"):
            time.sleep(delay_s)
        return pull(self, *args, **kwargs)

    monkeypatch.setattr(Cluster, "pull_weights", late_pull)
    overrides = ["loop.mode=async", "run.steps=5", "run.save_every=0", evals, f"run.dir={tmp_path}"]
    train(load_config(TINY, LOCAL + overrides))
    versions = {step: {r["weight_version"] for r in rows} for step, rows in trained_rows(tmp_path).items()}
    assert versions == {1: {0}, 2: {0}, 3: {1}, 4: {2}, 5: {3}}


@pytest.mark.parametrize("mode", ["sync", "fully_async"])
def test_dynamic_sampling_on_a_policy_whose_groups_all_agree_trains_nothing_and_ends(tmp_path, mode):
    """Every group scores the same (a saturated policy, a wrong answer key): dynamic sampling keeps none. After
    `grpo.max_sampling_rounds` rounds (fully_async: chunks in a row) a step trains on nothing, and the run goes on to
    its end; fully_async used to wait for a kept group for ever."""
    overrides = [
        f"loop.mode={mode}",
        "grpo.dynamic_sampling=true",
        "grpo.max_sampling_rounds=2",
        "reward.fn=tests.rlloop.reward_fns:constant",
        "run.steps=3",
        "run.save_every=0",
    ]
    train(load_config(TINY, LOCAL + [*overrides, f"run.dir={tmp_path}"]))
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert not any("train/loss" in m for m in metrics)
    assert metrics[-1]["rollout/raw_reward"] == 1.0
    if mode == "fully_async":
        assert metrics[-1]["rollout/zero_std_groups_dropped"] >= 3 * 2 * 4  # steps x rounds x prompts_per_step
    else:
        assert all(m["rollout/zero_std_ratio"] == 1.0 and m["rollout/groups_kept"] == 0 for m in metrics)


def assert_breakdown_fits(metrics: list[dict]) -> None:
    """A step's breakdown is the driver's time inside that step: no wait is counted in two steps."""
    for m in metrics:
        if "perf/step_s" in m:
            rollout = m.get("perf/rollout_wait_s", m.get("perf/rollout_s", 0.0))
            busy = rollout + sum(m.get(f"perf/{k}_s", 0.0) for k in ("train", "sync", "eval"))
            assert busy <= m["perf/step_s"] + 1e-3, (m["step"], busy, m["perf/step_s"])


@pytest.mark.parametrize("mode", ["sync", "async", "fully_async"])
def test_each_steps_breakdown_fits_in_its_time_across_evals_and_checkpoints(tmp_path, mode):
    """Steps with an eval or a checkpoint are finished at once, the others (async modes) one step later; either way
    each step's rollout, train, sync and eval seconds lie inside its own step time. (fully_async's producer is paused
    through the eval.)"""
    overrides = [f"loop.mode={mode}", "run.steps=5", "run.save_every=2", "run.eval_every=3", f"run.dir={tmp_path}"]
    train(load_config(TINY, LOCAL + ["eval.samples=1"] + overrides))
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "perf/step_s" in m] == [1, 2, 3, 4, 5]
    assert [m["step"] for m in metrics if "perf/eval_s" in m] == [3, 5]  # every 3 steps, and the last
    assert_breakdown_fits(metrics)
    # the perf/* keys docs/design.md names, in the modes it names them for
    wanted = {"step", "train", "sync", "push", "other", "rollout_busy", "train_busy"}
    for m in metrics[1:]:
        logged = {k.removeprefix("perf/").removesuffix("_s") for k in m if k.startswith("perf/") and k.endswith("_s")}
        assert wanted <= logged, (m["step"], wanted - logged)
        assert ("pull" in logged) == (mode != "fully_async") and ("rollout_wait" in logged) == (mode != "sync")
        assert 0 <= m["perf/other_frac"] <= 1 and m["perf/other_s"] == pytest.approx(
            m["perf/other_frac"] * m["perf/step_s"]
        )


def test_fully_async_resume_trains_the_same_prompts_in_the_same_order(tmp_path):
    """Prompts in flight at a checkpoint are drawn again after --resume: none lost, none trained twice. Both from a
    run stopped at the checkpoint's step and from the straight run's own checkpoint, saved while the producer
    generated step 3's chunk (the stopped run's had drawn nothing ahead). (async's resume is held to the same
    samples, losses and weights in tests/e2e/test_tiny_run.py.)"""
    common = LOCAL + ["rollout.backend=hf", "loop.mode=fully_async", "loop.max_staleness=100", "run.save_every=2"]
    train(load_config(TINY, common + ["run.steps=4", f"run.dir={tmp_path / 'straight'}"]))
    train(load_config(TINY, common + ["run.steps=2", f"run.dir={tmp_path / 'cut'}"]))
    train(load_config(TINY, common + ["run.steps=4", f"run.dir={tmp_path / 'cut'}"]), resume=True)
    shutil.copytree(tmp_path / "straight", tmp_path / "mid")
    shutil.rmtree(tmp_path / "mid/checkpoints/step_000004")
    for step in (3, 4):  # what the resumed run trains, then, and not the copy's
        (tmp_path / f"mid/rollouts/step_{step:06d}.jsonl").unlink()
    train(load_config(TINY, common + ["run.steps=4", f"run.dir={tmp_path / 'mid'}"]), resume=True)

    def order(run_dir):
        return [r["prompt_index"] for _, rows in sorted(trained_rows(run_dir).items()) for r in rows[::8]]

    assert order(tmp_path / "cut") == order(tmp_path / "straight") == order(tmp_path / "mid")
    assert len(order(tmp_path / "straight")) == 4 * 4


def test_two_engines_generate_every_prompt_once_and_hold_the_same_version(tmp_path):
    cfg = load_config(
        TINY,
        LOCAL
        + [
            "cluster.rollout_engines=2",
            "cluster.rollout_chips=2",
            "run.steps=3",
            "run.save_every=0",
            f"run.dir={tmp_path / 'run'}",
        ],
    )
    train(cfg)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:
        assert m["rollout/engine_0/version"] == m["rollout/engine_1/version"] == m["step"]
        assert m["rollout/engine_0/tok_per_s"] > 0 and m["rollout/engine_1/tok_per_s"] > 0  # both did work
    assert len(trained_rows(tmp_path / "run")) == 3
    for rows in trained_rows(tmp_path / "run").values():
        assert sorted((r["prompt_index"], r["prompt"][-1]["content"]) for r in rows[::8]) == sorted(
            {(r["prompt_index"], r["prompt"][-1]["content"]) for r in rows}
        )  # 8 samples of each prompt, once

    # Greedy samples do not depend on the seed: two engines give exactly what one gives, prompt by prompt.
    prompts = [[5, 6, 7, 8][: 1 + i % 4] + [9] * (i % 3) for i in range(7)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    out = {}
    for engines in (1, 2):
        c = load_config(
            TINY,
            LOCAL
            + [
                f"cluster.rollout_engines={engines}",
                f"cluster.rollout_chips={engines}",
                f"run.dir={tmp_path / str(engines)}",
            ],
        )
        cluster = Cluster(c)
        try:
            completions, _ = cluster.generate(prompts, 3, greedy)
        finally:
            cluster.close()
        assert [(x.prompt_index, x.sample_index) for x in completions] == [(i, j) for i in range(7) for j in range(3)]
        out[engines] = [x.token_ids for x in completions]
    assert out[1] == out[2]


def test_colocated_run_frees_the_engine_while_training_and_matches_the_split_run(tmp_path):
    common = LOCAL + ["run.steps=3", "run.save_every=0", "rollout.prompts_per_step=4"]
    train(load_config(TINY, common + [f"run.dir={tmp_path / 'split'}"]))
    train(load_config(TINY, common + ["cluster.colocate=true", f"run.dir={tmp_path / 'colocated'}"]))
    split, colocated = (
        [json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
        for d in ("split", "colocated")
    )
    for m in colocated:
        assert m["rollout/device_bytes_while_training"] < 0.5 * m["rollout/device_bytes"]  # cache + weights freed
        assert m["perf/compiles"] == 0  # and back without compiling
    for key in ("rollout/raw_reward", "train/loss", "train/grad_norm"):
        assert [m[key] for m in colocated] == [m[key] for m in split], key


def test_the_last_step_is_evaluated_and_a_run_started_over_another_says_it_replaces_it(tmp_path, caplog):
    """Eval every 2 steps of 3: at 0, 2 and the last (the summary's final eval used to be step 2's). Then a fresh run
    in the same directory, without --resume, warns that it replaces the one there, and it does: its saved rollouts
    too, which a replay of the directory took for the new run's (mixed with its own)."""
    args = LOCAL + ["run.steps=3", "run.eval_every=2", "eval.samples=1", "run.save_every=2", f"run.dir={tmp_path}"]
    args += ["tracking.save_rollouts=true"]
    train(load_config(TINY, args))
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if any(k.startswith("eval/") for k in m)] == [0, 2, 3]
    earlier_rollouts = {p.name: p.read_text() for p in (tmp_path / "rollouts").iterdir()}
    with caplog.at_level("WARNING", logger="rlloop"):
        train(load_config(TINY, [*args, "run.steps=1", "run.save_every=0", "run.seed=1"]))
    assert f"{tmp_path} holds an earlier run (checkpoints step_000002, step_000003)" in caplog.text
    assert [p.name for p in (tmp_path / "rollouts").iterdir()] == ["step_000001.jsonl"]
    assert {p.name: p.read_text() for p in (tmp_path / "rollouts.earlier").iterdir()} == earlier_rollouts
    assert (tmp_path / "rollouts" / "step_000001.jsonl").read_text() != earlier_rollouts["step_000001.jsonl"]
    # This run saved none (nor would one killed before its first save): a --resume starts it over. It took up the
    # earlier run at its step 3 instead, under this run's metrics.
    caplog.clear()
    with caplog.at_level("WARNING", logger="rlloop"):
        train(load_config(TINY, [*args, "run.steps=2"]), resume=True)
    assert f"holds no checkpoint (an earlier run's are in {tmp_path / 'checkpoints.earlier'}" in caplog.text
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert not (tmp_path / "checkpoints.earlier").exists()  # its first save deleted the earlier run's
