"""`rlloop.compare` as the guard against bugs that still run: a short tiny run with its loss sign flipped, with an
engine that never loads new weights, or with zero advantages lies outside two good seeds' band, while a third good
seed lies inside it. Each broken variant is the real loop with one function replaced (the bug), in-process.
(A band needs two seeds: one run's own step-to-step noise understates how far seeds drift apart.)"""

import numpy as np
import pytest

from rlloop.compare import compare
from rlloop.config import load_config
from rlloop.loop import train
from rlloop.tracking import read_metrics
from tests.e2e.runs import TINY

STEPS = 12
ARGS = [f"run.steps={STEPS}", "run.eval_every=0", "run.save_every=0", "cluster.use_ray=false", "rollout.backend=hf"]
ARGS += ["tracking.progress=false"]
METRICS = ["rollout/raw_reward"]


def run(tmp_path, name: str, seed: int = 0) -> list[dict]:
    run_dir = tmp_path / name
    train(load_config(TINY, [*ARGS, f"run.seed={seed}", f"run.dir={run_dir}"]))
    return read_metrics(run_dir / "metrics.jsonl")


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("good")
    return [run(tmp, f"seed{s}", seed=s) for s in (0, 1, 2)]


def test_a_good_seed_lies_within_the_other_seeds_band(good):
    assert compare(good[2:], good[:2], METRICS)["rollout/raw_reward"]["within"]
    for rows in good:  # each learns
        assert np.mean([r["rollout/raw_reward"] for r in rows[-3:]]) > rows[0]["rollout/raw_reward"]


def flipped_loss_sign(monkeypatch):
    import trainer.trainer

    real = trainer.trainer.policy_loss
    monkeypatch.setattr(trainer.trainer, "policy_loss", lambda *a, **k: (lambda lm: (-lm[0], lm[1]))(real(*a, **k)))


def stale_weight_sync(monkeypatch):
    import rlloop.workers

    monkeypatch.setattr(rlloop.workers.RolloutWorker, "_load_newest", lambda self, at_most=None: None)


def zero_advantages(monkeypatch):
    import rlloop.rollout_manager

    monkeypatch.setattr(rlloop.rollout_manager, "group_advantages", lambda r, g, std_scale: np.zeros_like(r))


@pytest.mark.parametrize("bug", [flipped_loss_sign, stale_weight_sync, zero_advantages], ids=lambda f: f.__name__)
def test_a_broken_run_lies_outside_the_good_seeds_band(good, tmp_path, monkeypatch, bug):
    bug(monkeypatch)
    broken = run(tmp_path, bug.__name__)
    verdict = compare([broken], good[:2], METRICS)["rollout/raw_reward"]
    assert not verdict["within"], verdict
