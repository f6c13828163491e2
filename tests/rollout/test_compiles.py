"""Steady state compiles nothing: after warmup, hundreds of requests of random shapes and settings (and a weight
swap) run on the programs built in warmup. The counter itself is checked to see compiles."""

import jax
import numpy as np

from rollout.buckets import default_decode_buckets, default_prefill_buckets
from rollout.compiles import compile_count
from rollout.types import SamplingParams
from rollout.weights import load_safetensors_dir
from tests.rollout.conftest import small_engine


def _random_sampling(rng, max_new):
    return SamplingParams(
        temperature=float(rng.choice([0.0, 0.6, 1.0, 1.3])),
        top_k=int(rng.choice([-1, 1, 5, 40])),
        top_p=float(rng.choice([1.0, 0.9, 0.5])),
        max_new_tokens=max_new,
        stop_token_ids=tuple(int(t) for t in rng.integers(3, 128, rng.integers(0, 4))),
        seed=int(rng.integers(0, 2**31 - 1)),
    )


def test_zero_compiles_after_warmup_over_200_requests(tiny_qwen3_dir):
    eng = small_engine(tiny_qwen3_dir, prefill_buckets=(8, 16, 32), decode_buckets=(2, 4, 8))
    times = eng.warmup()
    assert set(times) == {
        "prefill/8",
        "prefill/16",
        "prefill/32",
        "decode/2",
        "decode/4",
        "decode/8",
        "copy/2",
        "copy/4",
        "copy/8",
    }
    assert all(t > 0 for t in times.values())
    weights = load_safetensors_dir(str(tiny_qwen3_dir))
    rng = np.random.default_rng(0)
    before, requests, calls = compile_count(), 0, 0
    while requests < 200:
        prompts = [[int(t) for t in rng.integers(0, 128, rng.integers(1, 33))] for _ in range(rng.integers(1, 7))]
        n = int(rng.integers(1, 4))
        max_new = int(rng.integers(1, 64 - max(map(len, prompts)) + 1))
        out = eng.generate(prompts, n, _random_sampling(rng, max_new))
        assert len(out) == len(prompts) * n
        assert all(1 <= len(c.token_ids) <= max_new for c in out)
        assert eng.stats()["compiles"] == 0, f"call {calls} compiled"
        requests += len(out)
        calls += 1
        if calls == 10:
            eng.load_weights(weights, version=1)
    assert compile_count() == before
    assert {c.weight_version for c in out} == {1}


def test_compile_counter_sees_each_program_a_request_builds(tiny_qwen3_dir):
    """Warmed, nothing compiles; with JAX's caches cleared, each request compiles exactly the programs it is the first
    to need (prompt [5, 6, 7]: prefill bucket 16; n samples: decode bucket >= n, copy bucket >= n - 1 siblings)."""
    eng = small_engine(tiny_qwen3_dir, prefill_buckets=(16, 32), decode_buckets=(3, 8))
    eng.warmup()
    sp = SamplingParams(max_new_tokens=2)
    eng.generate([[5, 6, 7]], 8, sp)
    assert eng.stats()["compiles"] == 0
    jax.clear_caches()
    for n, built in [(1, 2), (2, 1), (4, 1), (8, 1), (8, 0)]:  # prefill/16 + decode/3, copy/3, decode/8, copy/8
        eng.generate([[5, 6, 7]], n, sp)
        assert eng.stats()["compiles"] == built, n


def test_default_buckets_follow_design():
    assert default_prefill_buckets(1023) == (16, 32, 64, 128, 256, 512, 1023)
    assert default_prefill_buckets(10) == (10,)
    assert default_decode_buckets(64) == (8, 16, 32, 64)
    assert default_decode_buckets(48) == (8, 16, 32, 48)
    assert default_decode_buckets(4) == (4,)
