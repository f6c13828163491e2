"""The rollout tests' shared cluster: the tiny model behind the HF backend, without Ray."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rlloop.cluster import Cluster
from rlloop.config import load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "grpo_dapo_tiny.yaml")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(cluster, tokenizer): the tiny model behind the HF backend, no Ray; one per test module."""
    cfg = load_config(
        TINY,
        [
            "rollout.backend=hf",
            "cluster.use_ray=false",
            "sync.transport=disk",
            f"run.dir={tmp_path_factory.mktemp('run')}",
        ],
    )
    cluster = Cluster(cfg)
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    yield cluster, tok
    cluster.close()
