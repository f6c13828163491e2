"""Saved rollouts: a step's samples as JSON lines in `<dir>/step_NNNNNN.jsonl`, one per sample (`Samples.rows()` in
rlloop/rollout_manager.py), written by `tracking.save_rollouts` and `--debug rollout-only`, and trained on again by
`--debug train-only` (`ReplayRollout`, slime's --save-debug-rollout-data / --load-debug-rollout-data)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rlloop.errors import DataError
from rlloop.rollout_manager import StepRollout
from rlloop.schedules import RolloutSchedule


def rollouts_file(rollouts_dir: str | Path, step: int) -> Path:
    """Where a step's saved samples go."""
    return Path(rollouts_dir) / f"step_{step:06d}.jsonl"


def write_rollouts(rollouts_dir: Path, step: int, rows: list[dict]) -> None:
    """A step's rows, whole or not at all (a replay of a half-written file would train on part of a batch); none for
    a step that had nothing to train on, so that its replay trains nothing too."""
    rollouts_dir.mkdir(exist_ok=True)
    path = rollouts_file(rollouts_dir, step)
    path.with_suffix(".tmp").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path.with_suffix(".tmp").replace(path)


class ReplayRollout(RolloutSchedule):
    """`--debug train-only`: step N's batch is the one a run saved in `replay`/step_N.jsonl (tracking.save_rollouts,
    or --debug rollout-only), rebuilt exactly: the trainer alone, on known data, no engine (slime's
    --load-debug-rollout-data)."""

    def __init__(self, replay: str):
        self.dir = Path(replay)

    def next(self, step: int) -> StepRollout:
        path = rollouts_file(self.dir, step)
        if not path.is_file():
            raise DataError(f"run.replay: {path} is missing (the saved run has no rollouts of step {step})")
        try:
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            if not rows:  # the step had nothing to train on (dynamic sampling kept no group): nor has its replay
                return StepRollout(None, {})
            # the verifier's rewards before overlong shaping, as the run logged them (of the groups it kept)
            raw_reward = float(np.mean([r["raw_reward"] for r in rows]))
            return StepRollout(SavedSamples(rows), {"rollout/raw_reward": raw_reward})
        except (ValueError, KeyError, TypeError) as e:  # json's errors are ValueErrors
            raise DataError(f"run.replay: {path} is not a saved step's rollouts ({type(e).__name__}: {e})") from None

    def resume_state(self) -> dict:
        return {}  # no engine, no prompts drawn (and no evaluation)


@dataclass
class SavedSamples:
    """A step's samples as `Samples.rows()` saved them."""

    saved: list[dict]

    def rows(self) -> list[dict]:
        return self.saved

    def to_train_batch(self):
        from trainer import TrainBatch

        return TrainBatch(
            prompts=[r["prompt_ids"] for r in self.saved],
            responses=[r["response_ids"] for r in self.saved],
            advantages=[r["advantage"] for r in self.saved],
            rollout_logprobs=[r["rollout_logprobs"] for r in self.saved],
        )
