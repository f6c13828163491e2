"""The run directory (rlloop/run_dir.py): what a fresh run does with an earlier run's outputs in it, and what a
--resume checks and says before anything starts."""

import json
from pathlib import Path

import pytest

from rlloop.checkpoint import checkpoint_marks, save_checkpoint
from rlloop.errors import CheckpointError
from tests.rlloop.test_checkpoint import TINY, trainer_writing


def test_a_resume_with_another_model_is_refused_before_anything_starts(tmp_path):
    """It failed once the actors were up, in the trainer's words: a parameter missing, or with fewer layers torch's
    "loaded state dict contains a parameter group that doesn't match"."""
    from rlloop.config import load_config
    from rlloop.data import load_inputs
    from rlloop.run_dir import resume_point

    cfg = load_config(TINY, [f"run.dir={tmp_path}"])
    model = json.loads((Path(cfg.model.path) / "config.json").read_text())

    def trainer_of(config: dict):
        def save(path):
            trainer_writing(256)(path)
            Path(path, "config.json").write_text(json.dumps(config))

        return save

    inputs = load_inputs(cfg)
    save_checkpoint(tmp_path, 2, {}, trainer_of(model | {"num_hidden_layers": model["num_hidden_layers"] + 1}))
    with pytest.raises(CheckpointError, match=r"model.path: .* is not the model .* trained \(num_hidden_layers"):
        resume_point(cfg, True, inputs)
    save_checkpoint(tmp_path, 3, {}, trainer_of(model | {"torch_dtype": "bfloat16", "extra_key": 1}))
    assert resume_point(cfg, True, inputs)[0].name == "step_000003"  # the same shapes: another dtype resumes


def test_a_resume_is_not_told_that_it_replaces_the_run_it_continues(tmp_path, caplog):
    """The checkpoints in run.dir are an earlier run's only for a fresh start, which is warned; --resume continues
    them, with no such warning and nothing to set aside."""
    from rlloop.config import load_config
    from rlloop.run_dir import earlier_run

    save_checkpoint(tmp_path, 2, {}, trainer_writing(256))
    cfg = load_config(TINY, [f"run.dir={tmp_path}"])
    with caplog.at_level("WARNING", logger="rlloop"):
        assert earlier_run(cfg, resume=True).checkpoints == frozenset()
        assert len(earlier_run(cfg, resume=False).checkpoints) == 1
    assert caplog.text.count("holds an earlier run") == 1  # the fresh start's


def test_a_resume_names_the_settings_it_changes_and_that_a_decaying_lr_moves(tmp_path, caplog):
    """Resumed with another train.lr and another run.steps under a cosine decay than the run's config.yaml: the
    checkpoint found names the changed lr, and says the lr moves, as the schedule now spans the new run.steps."""
    from rlloop.config import load_config, to_yaml
    from rlloop.data import load_inputs
    from rlloop.run_dir import resume_point

    cfg = load_config(TINY, [f"run.dir={tmp_path}", "train.lr_decay=cosine", "run.steps=20"])
    inputs = load_inputs(cfg)
    save_checkpoint(tmp_path, 2, {"data": inputs.data.state_dict()}, trainer_writing(256))
    started = ["train.lr=0.5", "train.lr_decay=cosine", "run.steps=10"]
    (tmp_path / "config.yaml").write_text(to_yaml(load_config(TINY, [f"run.dir={tmp_path}", *started])))
    with caplog.at_level("WARNING", logger="rlloop"):
        assert resume_point(cfg, True, inputs)[0].name == "step_000002"
    assert f"train.lr: 0.5 -> {cfg.train.lr}" in caplog.text
    assert "(train.lr_decay cosine decays over the new run.steps from here: lr moves)" in caplog.text


def _rollouts(directory: Path, steps, tag: str) -> dict[str, str]:
    directory.mkdir(parents=True, exist_ok=True)
    for step in steps:
        (directory / f"step_{step:06d}.jsonl").write_text(f'{{"run": "{tag}", "step": {step}}}\n')
    return {p.name: p.read_text() for p in directory.iterdir()}


def _files(directory: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in directory.iterdir()} if directory.is_dir() else {}


def test_a_fresh_run_sets_the_earlier_run_s_outputs_aside_once_and_keeps_them_with_its_checkpoints(tmp_path):
    """Run 1 trained 3 steps, saving checkpoints and rollouts; run 2 started fresh there and was killed before its
    first save; run 3 starts fresh again, and its trainer dies before the first save (a rebuild from step 0). Run 1's
    rollouts must stay beside its checkpoints in *.earlier/ throughout; the report, curves and traces of the runs
    replaced go; rollouts/ never mixes two runs' steps."""
    from rlloop.run_dir import EarlierRun

    for step in (2, 3):
        save_checkpoint(tmp_path, step, {}, trainer_writing(256))
    first = _rollouts(tmp_path / "rollouts", (1, 2, 3), "run 1")
    (tmp_path / "profile" / "step_000003").mkdir(parents=True)
    for name in ("report.md", "curves.png"):
        (tmp_path / name).write_text("run 1's")

    run2 = EarlierRun(tmp_path, checkpoint_marks(tmp_path), replay=None)
    run2.replace()
    assert _files(tmp_path / "rollouts.earlier") == first and not (tmp_path / "rollouts").exists()
    assert not any((tmp_path / name).exists() for name in ("profile", "report.md", "curves.png"))
    _rollouts(tmp_path / "rollouts", (1,), "run 2")  # then killed before its first save

    run3 = EarlierRun(tmp_path, checkpoint_marks(tmp_path), replay=None)
    run3.replace()
    assert _files(tmp_path / "rollouts.earlier") == first, "run 1's rollouts go with its checkpoints.earlier/"
    assert sorted(p.name for p in (tmp_path / "checkpoints.earlier").iterdir()) == ["step_000002", "step_000003"]
    assert not (tmp_path / "rollouts").exists()
    own = _rollouts(tmp_path / "rollouts", (1, 2), "run 3")  # then its trainer dies: rebuilt from step 0
    run3.replace()
    assert _files(tmp_path / "rollouts") == own and _files(tmp_path / "rollouts.earlier") == first

    save_checkpoint(tmp_path, 2, {}, trainer_writing(256))  # run 3 saves: run 1's checkpoints go
    run4 = EarlierRun(tmp_path, checkpoint_marks(tmp_path), replay=None)
    run4.replace()  # and a run after run 3 sets run 3's aside, rollouts with checkpoints
    assert _files(tmp_path / "rollouts.earlier") == own
    assert sorted(p.name for p in (tmp_path / "checkpoints.earlier").iterdir()) == ["step_000002"]


def test_the_rollouts_a_replay_trains_on_stay_where_they_are(tmp_path):
    from rlloop.run_dir import EarlierRun

    saved = _rollouts(tmp_path / "rollouts", (1, 2), "rollout-only")
    EarlierRun(tmp_path, frozenset(), replay=(tmp_path / "rollouts").resolve()).replace()
    assert _files(tmp_path / "rollouts") == saved and not (tmp_path / "rollouts.earlier").exists()
