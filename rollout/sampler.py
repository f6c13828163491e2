"""On-device token sampling for the JAX decoder: temperature, top-k, then top-p inside top-k, greedy via `where`.

`sample` is pure JAX with static shapes, so it can sit inside a jitted / scanned decode step. Per-row settings are
arrays, so one compiled program serves any mix of greedy and sampled rows.

Determinism: each row draws its noise from a key derived only from (seed, request_id, position), so a row's token
does not depend on what else is in the batch, on the batch size, or on the bucket it was padded into.

Filtering cost: top-k and top-p need the row's logits in sorted order. We sort the full vocabulary (exact for any
k and p; O(V log V) per row) but only when some row in the batch actually filters: a batch-level `lax.cond` skips
the sort for pure temperature / greedy batches, which is the GRPO default (T=1, no top-k/top-p). Under `vmap` the
cond degrades to computing both branches, which is still correct.

Ties: the kept set is "logit >= the smallest kept logit", so tokens tied with the cutoff are all kept (as in
vLLM's threshold-based masking); with real-valued logits ties have probability ~0.

Log-probs: for sampled rows, the log-prob of the chosen token under the distribution actually sampled from,
log_softmax(logits / T) restricted and renormalised to the kept set. For greedy rows (T == 0) it is
log_softmax(logits) at the argmax (the model's own probability of the greedy token, unfiltered).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _row_keys(seed: jax.Array, request_id: jax.Array, position: jax.Array) -> jax.Array:
    """One PRNG key per row from (seed, request_id, position); nothing else about the batch enters it."""

    def one(s, r, p):
        key = jax.random.key(s.astype(jnp.uint32))
        return jax.random.fold_in(jax.random.fold_in(key, r), p)

    return jax.vmap(one)(seed, request_id, position)


def _keep_mask(x: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """[B, V] bool: tokens kept by top-k, then top-p computed on the top-k-renormalised probabilities."""
    vocab = x.shape[-1]
    sorted_x = -jnp.sort(-x, axis=-1)                                    # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)[:, None]  # [B, 1]
    rank = jnp.arange(vocab)[None, :]
    in_top_k = rank < k
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_x, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs                     # exclusive cumsum
    # Keep a token while the mass strictly ahead of it is below p (HF's and vLLM's rule); the top token always stays.
    keep_sorted = in_top_k & ((mass_before < top_p[:, None]) | (rank == 0))
    num_kept = jnp.sum(keep_sorted, axis=-1)                             # >= 1
    cutoff = jnp.take_along_axis(sorted_x, (num_kept - 1)[:, None], axis=-1)
    return x >= cutoff


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, seed: jax.Array,
           request_id: jax.Array, position: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row. Shapes: logits [B, V]; all others [B]. Returns (token_ids int32, logprobs f32)."""
    logits = logits.astype(jnp.float32)
    batch, vocab = logits.shape
    temperature = temperature.astype(jnp.float32)
    top_k = top_k.astype(jnp.int32)
    top_p = top_p.astype(jnp.float32)
    greedy = temperature <= 0.0

    x = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    filters = (~greedy) & (((top_k > 0) & (top_k < vocab)) | (top_p < 1.0))
    keep = jax.lax.cond(jnp.any(filters),
                        lambda: _keep_mask(x, top_k, top_p) | ~filters[:, None],
                        lambda: jnp.ones((batch, vocab), bool))
    masked = jnp.where(keep, x, -jnp.inf)

    # Gumbel-max in the original vocabulary order: argmax(masked + G) ~ softmax(masked), one noise row per key.
    keys = _row_keys(seed, request_id.astype(jnp.int32), position.astype(jnp.int32))
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(keys)
    sampled = jnp.argmax(masked + gumbel, axis=-1)
    token = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)

    chosen = jnp.take_along_axis(masked, token[:, None], axis=-1)[:, 0]
    logprob = chosen - jax.nn.logsumexp(masked, axis=-1)
    return token, logprob
