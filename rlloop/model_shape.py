"""The model's architecture, read from its config.json before any weight loads, and what it decides before the run
starts: the devices of each rollout engine's mesh (`engine_tp`). The run's config (building the engine's config), the
memory plan and the placement all read these; this module imports none of them."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from rollout.model_config import ModelConfig

if TYPE_CHECKING:
    from rlloop.config import Config

# config.json of the reference recipe's model, so that its plan is known before the first download.
SHIPPED_CONFIGS = Path(__file__).parent / "assets" / "model_configs"


def model_shape(path: str) -> ModelConfig | None:
    """The model's architecture from its config.json: a local directory, a hub id in the local cache, or a copy
    shipped with rlloop (the reference model); None when none has it."""
    shipped = SHIPPED_CONFIGS / (path.replace("/", "--") + ".json")
    if os.path.isdir(path):
        try:
            return ModelConfig.from_dir(path)
        except (ValueError, KeyError, TypeError, AttributeError, OSError):  # `[]`, a field of the wrong type
            return None  # reported as a model error naming model.path by rlloop.model.check_model
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(path, "config.json")
    except Exception:  # a malformed repo id: the model loader names it
        return None
    if not isinstance(cached, str):
        cached = str(shipped) if shipped.is_file() else None
    if cached is None:
        return None
    try:
        with open(cached) as f:
            return ModelConfig.from_hf_dict(json.load(f))
    except (ValueError, KeyError, TypeError, AttributeError, OSError):  # a family the JAX engine has no decoder for
        return None  # (the hf backend runs it), or a config.json not of the shape ModelConfig reads


# Narrower models decode too little per step to split it: the embedded tiny model (hidden 64) ran 0.67x at 16 rows
# and 1.06x at 64 with a device per core of 2, widths 128 to 768 ran 1.12-1.42x (docs/benchmarks-history.md).
CPU_TP_MIN_HIDDEN = 128


def engine_tp(cfg: Config) -> int:
    """Devices in one engine's mesh, its tensor-parallel size: its chips. On CPU, one XLA host device per core
    (`cpu_engine_tp`): XLA:CPU runs most of a decode step's ops (attention over the cache, norms, cache writes,
    small dots) on one thread each, so one device leaves the other cores idle for much of the step, where a
    single-threaded device per core splits every op (docs/design.md §5.10)."""
    c = cfg.cluster
    chips = c.rollout_chips // c.rollout_engines
    if c.device != "cpu" or c.cpus_per_actor == 1:
        return chips
    return cpu_engine_tp(model_shape(cfg.model.path), chips, chips * c.cpus_per_actor)


def cpu_engine_tp(shape: ModelConfig | None, chips: int, cores: int) -> int:
    """A CPU engine's mesh size: a device per core when the model (None: unknown) is wide enough and splits over
    them, else a device per chip."""
    if shape is None or shape.hidden_size < CPU_TP_MIN_HIDDEN or not shape.splits_over(cores):
        return chips
    return cores
