"""Shared test fixtures: an offline environment and tiny random HF models that the tests make themselves.

The suite runs on two pytest-xdist workers (pyproject.toml). Every test that starts Ray is marked
`xdist_group("ray")`, so those run one at a time on one worker, and two use fixed ports. They check that no Ray
process of theirs is left (those running before the test, another user's, are not theirs) and signal their own
actors (by their run's $TMPDIR, or as processes under their driver). Checks of shared memory and temp files name
the run's own segments and directories, since the other worker runs tests meanwhile; a test that keeps a killed
writer's segments keeps them in a directory of its own (`private_shm`).
"""

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

# Set before anything imports transformers / datasets / jax: a failed hub call retries for tens of seconds, and two
# cores are easily oversubscribed.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray starts its workers at nice 15: next to the other xdist worker's busy tests (nice 0) an actor then gets ~1/28 of
# its share of a core, and a call the fault tests time out at 6 s can take longer. At 0 they share the cores fairly.
os.environ.setdefault("RAY_worker_niceness", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import psutil
import pytest
import torch

torch.set_num_threads(2)


def make_tiny_hf_model(path, family: str = "qwen3", tie: bool = True, seed: int = 0, **overrides):
    """Save a tiny random causal LM of the given family to `path` and return the path.

    head_dim is deliberately != hidden_size / num_attention_heads, so code that derives it gets caught.
    """
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    common.update(overrides)
    if family == "qwen3":
        cfg = transformers.Qwen3Config(rope_theta=1e6, **common)
    elif family == "qwen2":
        common.pop("head_dim")
        cfg = transformers.Qwen2Config(rope_theta=1e6, **common)
    elif family == "llama":
        cfg = transformers.LlamaConfig(
            rope_theta=5e5,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            **common,
        )
    elif family == "phi3":  # fused qkv and gate_up projections, dropout as nn.Dropout modules
        common.pop("head_dim")
        cfg = transformers.Phi3Config(**common)
    else:
        raise ValueError(family)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(path)
    return path


@pytest.fixture
def short_tmp():
    """A temp dir of the test's own with a short path, removed afterwards: a Ray started with it as $TMPDIR keeps its
    unix sockets there, and their paths may not exceed 107 bytes, as they can under xdist's tmp_path."""
    path = tempfile.mkdtemp(prefix="rlloop-test-")
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def private_shm():
    """A tmpfs directory of the test's own for weight_sync.shm's segments, yielded. A test that keeps a killed
    writer's segments to look at needs one: any sender that starts on the host (another worker's test) sweeps every
    dead writer's. A writer in a subprocess must be given it. Patched apart from the test's `monkeypatch`, which a test
    may undo midway."""
    import uuid

    import weight_sync.shm

    private = weight_sync.shm.SHM_DIR / f"rlloop-test-{uuid.uuid4().hex[:12]}"
    private.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(weight_sync.shm, "SHM_DIR", private)
        yield private
    leaked = sorted(path.name for path in private.iterdir())
    for path in private.iterdir():
        path.unlink()
    private.rmdir()
    assert not leaked, f"leaked shm segments: {leaked}"


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray of two CPUs for a module's tests (mark them `xdist_group("ray")`), unless one is running. Its
    processes end with it: now and then an actor's worker outlived `ray.shutdown()` and its raylet (a SyncMailbox
    of tests/rlloop/test_ray_sync.py was still running 10 minutes after the suite)."""
    import ray

    started = not ray.is_initialized()
    if started:
        # address="local": a Ray of the suite's own, even beside a `ray start` head on this host
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    if started:
        ours = [p for p in psutil.Process().children(recursive=True) if _is_ray(p)]
        ray.shutdown()
        for left in psutil.wait_procs(ours, timeout=10)[1]:
            with contextlib.suppress(psutil.NoSuchProcess):
                left.kill()


def _is_ray(process) -> bool:
    """Whether a process is one of Ray's (GCS, raylet, agents, workers: `ray::` titles, paths in the ray package)."""
    with contextlib.suppress(psutil.Error):
        return "ray" in " ".join(process.cmdline())
    return False


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", tie=True)
