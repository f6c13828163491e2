"""The on-device sampler against an exact numpy model of temperature -> top-k -> top-p (HF / vLLM semantics)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollout.sampler import sample
from rollout.types import GREEDY_BELOW, SamplingParams

sample_jit = jax.jit(sample)

# Gaps chosen so that no cumulative mass lands within float32 noise of the top_p values used below.
LOGITS = np.array([2.0, 1.5, 1.2, 0.3, 0.0, -0.5, -1.0, -2.0], np.float32)
N = 40_000


def expected_distribution(logits, temperature, top_k, top_p):
    """Written from the definitions, independently of rollout.sampler: softmax(l/T), keep the top k,
    renormalise, keep tokens while the mass strictly ahead of them is < p, renormalise."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(len(p), bool)
    k = len(p) if top_k <= 0 else min(top_k, len(p))
    keep[order[:k]] = True
    p = np.where(keep, p, 0.0)
    p /= p.sum()
    ahead = 0.0
    for rank, tok in enumerate(order):
        if not keep[tok]:
            continue
        if rank > 0 and ahead >= top_p:
            keep[tok] = False
        ahead += p[tok]
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def rows(n, temperature=1.0, top_k=-1, top_p=1.0, seed=0, request_id=None, position=0):
    return (
        jnp.full((n,), temperature, jnp.float32),
        jnp.full((n,), top_k, jnp.int32),
        jnp.full((n,), top_p, jnp.float32),
        jnp.full((n,), seed, jnp.uint32),
        jnp.arange(n, dtype=jnp.int32) if request_id is None else jnp.asarray(request_id, jnp.int32),
        jnp.full((n,), position, jnp.int32),
    )


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [
        (1.0, -1, 1.0),
        (0.7, 5, 1.0),
        (1.3, -1, 0.8),
        (1.0, 4, 0.7),
        (0.5, 3, 0.95),
        (2.0, 0, 0.5),
        (1.0, 1, 1.0),
    ],
)
def test_empirical_frequencies_match_exact_distribution(temperature, top_k, top_p):
    expected = expected_distribution(LOGITS, temperature, top_k, top_p)
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (N, len(LOGITS)))
    tokens, logprobs = sample_jit(logits, *rows(N, temperature, top_k, top_p, seed=123))
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)

    freq = np.bincount(tokens, minlength=len(LOGITS)) / N
    # Tokens outside the kept set must never appear, exactly.
    assert np.all(freq[expected == 0] == 0), (freq, expected)
    # Each frequency is binomial(N, p)/N: allow 5 standard deviations (plus a floor for p near 0 or 1).
    tol = 5 * np.sqrt(expected * (1 - expected) / N) + 1e-3
    assert np.all(np.abs(freq - expected) <= tol), (freq, expected, tol)
    # The returned log-prob is the log of the exact probability of the drawn token under the filtered distribution.
    np.testing.assert_allclose(logprobs, np.log(expected[tokens]), rtol=0, atol=2e-5)


def test_greedy_is_argmax_with_unfiltered_logprob():
    """Temperatures below GREEDY_BELOW are greedy too (vLLM's rule): logits of a realistic scale over T = 1e-37
    overflowed float32, and the log-prob came out NaN."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 1000)).astype(np.float32) * 12
    # Greedy rows ignore top-k/top-p; mix in sampled rows with filters so the filtering branch runs too.
    near_zero = np.array([0.0, 1e-37, 1e-6, GREEDY_BELOW / 2], np.float32)
    temperature = np.where(np.arange(64) % 2 == 0, near_zero[np.arange(64) // 2 % 4], 1.0).astype(np.float32)
    assert all(SamplingParams(temperature=float(t)).greedy for t in near_zero)
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy
    top_k = np.full(64, 5, np.int32)
    top_p = np.full(64, 0.5, np.float32)
    tokens, logprobs = sample_jit(
        jnp.asarray(logits),
        jnp.asarray(temperature),
        jnp.asarray(top_k),
        jnp.asarray(top_p),
        jnp.zeros(64, jnp.uint32),
        jnp.arange(64, dtype=jnp.int32),
        jnp.zeros(64, jnp.int32),
    )
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    g = temperature < GREEDY_BELOW
    assert g.sum() == 32
    np.testing.assert_array_equal(tokens[g], logits[g].argmax(-1))
    ref = logits.astype(np.float64)
    log_softmax = ref - ref.max(-1, keepdims=True)
    log_softmax -= np.log(np.exp(log_softmax).sum(-1, keepdims=True))
    np.testing.assert_allclose(logprobs[g], log_softmax[g, tokens[g]], atol=1e-5)
    # Sampled rows stayed inside their top-5.
    top5 = np.argsort(-logits, axis=-1)[:, :5]
    assert all(tokens[i] in top5[i] for i in np.flatnonzero(~g))


def test_bf16_logits_are_sampled_in_float32():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(4, 50)), jnp.bfloat16)
    tokens, logprobs = sample_jit(logits, *rows(4, temperature=0.0))
    assert tokens.dtype == jnp.int32 and logprobs.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(logits.astype(jnp.float32)).argmax(-1))


def test_row_does_not_depend_on_the_rest_of_the_batch():
    rng = np.random.default_rng(2)
    vocab = 300
    row = rng.normal(size=vocab).astype(np.float32)
    settings = dict(temperature=0.9, top_k=-1, top_p=1.0)
    alone_tok, alone_lp = sample_jit(jnp.asarray(row[None]), *rows(1, seed=7, request_id=[3], position=5, **settings))
    # Same row at index 17 of a 64-row batch whose other rows differ in logits, seeds and filters (so the
    # batch-level filtering branch is taken here but not above).
    batch = rng.normal(size=(64, vocab)).astype(np.float32)
    batch[17] = row
    temperature = rng.uniform(0.5, 1.5, 64).astype(np.float32)
    top_k = rng.integers(1, 50, 64).astype(np.int32)
    top_p = rng.uniform(0.3, 1.0, 64).astype(np.float32)
    seed = rng.integers(0, 2**32, 64, dtype=np.uint64).astype(np.uint32)
    request_id = rng.integers(0, 1000, 64).astype(np.int32)
    position = rng.integers(0, 100, 64).astype(np.int32)
    temperature[17], top_k[17], top_p[17], seed[17], request_id[17], position[17] = 0.9, -1, 1.0, 7, 3, 5
    tok, lp = sample_jit(
        jnp.asarray(batch),
        jnp.asarray(temperature),
        jnp.asarray(top_k),
        jnp.asarray(top_p),
        jnp.asarray(seed),
        jnp.asarray(request_id),
        jnp.asarray(position),
    )
    assert int(tok[17]) == int(alone_tok[0])
    assert float(lp[17]) == pytest.approx(float(alone_lp[0]), abs=1e-6)


def test_seed_request_and_position_each_change_the_draws():
    logits = jnp.zeros((256, 64), jnp.float32)  # uniform: every draw is pure noise
    base = np.asarray(sample_jit(logits, *rows(256, seed=0))[0])
    assert np.array_equal(base, np.asarray(sample_jit(logits, *rows(256, seed=0))[0]))  # deterministic
    other_seed = np.asarray(sample_jit(logits, *rows(256, seed=1))[0])
    other_pos = np.asarray(sample_jit(logits, *rows(256, seed=0, position=1))[0])
    shifted_ids = np.asarray(sample_jit(logits, *rows(256, seed=0, request_id=np.arange(256) + 1))[0])
    # Under independence each pair agrees on ~1/64 of rows; require clear disagreement.
    for other in (other_seed, other_pos, shifted_ids):
        assert np.mean(base == other) < 0.2
    # Large uint32 seeds are valid.
    big = np.asarray(sample_jit(logits, *rows(256, seed=2**32 - 1))[0])
    assert np.mean(base == big) < 0.2


def test_mixed_rows_keep_exactly_the_filtered_set():
    """Per-row settings over a realistic vocabulary: every drawn token lies in numpy's kept set for its row and its
    log-prob is numpy's. Vocab 1000 has a non-power-of-two CDF block, and the cutoffs come from bisection."""
    rng = np.random.default_rng(4)
    batch, vocab = 96, 1000
    logits = (rng.normal(size=(batch, vocab)) * rng.uniform(0.5, 4, (batch, 1))).astype(np.float32)
    temperature = rng.choice([0.0, 0.6, 1.0, 1.7], batch).astype(np.float32)
    top_k = rng.choice([-1, 1, 7, 50, 999, 5000], batch).astype(np.int32)
    top_p = rng.choice([1.0, 0.95, 0.6, 0.1], batch).astype(np.float32)
    for position in range(3):
        tokens, logprobs = sample_jit(
            jnp.asarray(logits),
            jnp.asarray(temperature),
            jnp.asarray(top_k),
            jnp.asarray(top_p),
            jnp.full((batch,), 9, jnp.uint32),
            jnp.arange(batch, dtype=jnp.int32),
            jnp.full((batch,), position, jnp.int32),
        )
        tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
        for r in range(batch):
            if temperature[r] == 0:
                assert tokens[r] == logits[r].argmax()
                continue
            p = expected_distribution(logits[r], temperature[r], top_k[r], top_p[r])
            assert p[tokens[r]] > 0, (r, top_k[r], top_p[r])
            np.testing.assert_allclose(logprobs[r], np.log(p[tokens[r]]), atol=1e-4)


def test_inverse_cdf_never_returns_a_zero_weight_token_at_the_top_edge():
    from rollout.sampler import _pick

    def _pick_sampled(weights, u):
        x = jnp.where(jnp.asarray(weights) > 0, jnp.log(jnp.asarray(weights)), -jnp.inf)
        return _pick(x, jnp.max(x, -1), jnp.asarray(weights), jnp.asarray(u), jnp.zeros(len(u), bool))

    weights = np.zeros((3, 64), np.float32)
    weights[0, [5, 20]] = [1.0, 3.0]
    weights[1, 0] = 1.0
    weights[2, [40, 41]] = [2.0, 1e-30]
    u = np.full(3, np.nextafter(np.float32(1), np.float32(0)), np.float32)  # the largest uniform below 1
    idx = np.asarray(_pick_sampled(weights, u))
    assert list(idx) == [20, 0, 41] or list(idx) == [20, 0, 40]
    assert np.all(weights[np.arange(3), idx] > 0)
    np.testing.assert_array_equal(np.asarray(_pick_sampled(weights, np.zeros(3, np.float32))), [5, 0, 40])


def test_top_p_exactly_reached_by_the_top_token_keeps_only_it():
    # probabilities 1/2, 1/4, 1/8, 1/8 (exact in float32): the top token alone holds top_p = 0.5, so HF's and vLLM's
    # top-p keep only it (mass strictly ahead of the second token, 0.5, is not < 0.5)
    logits = np.log(np.array([0.5, 0.25, 0.125, 0.125], np.float32))
    n = 2000
    tok, lp = sample(
        jnp.broadcast_to(jnp.asarray(logits), (n, 4)),
        jnp.ones(n, jnp.float32),
        jnp.zeros(n, jnp.int32),
        jnp.full(n, 0.5, jnp.float32),
        jnp.zeros(n, jnp.uint32),
        jnp.arange(n, dtype=jnp.int32),
        jnp.zeros(n, jnp.int32),
    )
    assert set(np.asarray(tok).tolist()) == {0}
    np.testing.assert_allclose(np.asarray(lp), 0.0, atol=1e-6)


def test_greedy_ties_take_the_first_index_of_the_maximum_like_argmax():
    """bf16 logits tie often at the top: greedy takes the first index of the row maximum, as np.argmax, torch.argmax
    and HF's greedy search do, whether the tied tokens share one of the sampler's CDF blocks (25 tokens at V = 1000)
    or lie in different ones. Its log-prob is the log-softmax at that token."""
    vocab = 1000
    logits = np.random.default_rng(0).normal(size=(5, vocab)).astype(np.float32)
    ties = [(3, 7), (30, 900), (5, 6, 999), (24, 25), tuple(range(vocab))]  # one block, two blocks, both, an edge, all
    for r, cols in enumerate(ties):
        logits[r, list(cols)] = 9.0
    tokens, logprobs = sample_jit(jnp.asarray(logits), *rows(5, temperature=0.0))
    want = logits.argmax(-1)
    assert want.tolist() == [3, 30, 5, 24, 0]
    np.testing.assert_array_equal(np.asarray(tokens), want)
    z = logits.astype(np.float64)
    log_softmax = z - z.max(-1, keepdims=True)
    log_softmax -= np.log(np.exp(log_softmax).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(logprobs), log_softmax[np.arange(5), want], atol=1e-5)
