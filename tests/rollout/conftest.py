"""Fixtures for the JAX engine tests: tiny HF models on disk and small-bucket engines (few programs to compile)."""

import pytest

from tests.conftest import make_tiny_hf_model


def small_engine(model_path, **overrides):
    from rollout.engine import EngineConfig, JaxEngine

    kw = dict(
        model_path=str(model_path),
        dtype="float32",
        max_batch=8,
        max_seq_len=64,
        prefill_buckets=(16, 32),
        decode_buckets=(4, 8),
        steps_per_dispatch=4,
    )
    kw.update(overrides)
    return JaxEngine(EngineConfig(**kw))


@pytest.fixture(scope="module")
def qwen3_untied_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("q3u"), "qwen3", tie=False, seed=1)


@pytest.fixture(scope="module")
def engine(tiny_qwen3_dir):
    eng = small_engine(tiny_qwen3_dir)
    eng.warmup()
    return eng
