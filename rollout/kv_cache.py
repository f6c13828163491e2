"""The static KV cache: per layer one K buffer [slots, kv_heads, head_dim, max_len] and one V buffer
[slots, kv_heads, max_len, head_dim], allocated once.

Sized by config (slots x max length) so its shape never changes; the engine donates it to every compiled call, so
updates happen in place. Slot i holds one sequence (prompt + response); rows of a decode bucket map to slots 0..B-1.
K is stored transposed (positions minor) so that both decode products, q.K^T over head_dim and p.V over positions,
contract a non-minor axis and stream the cache contiguously (about 2x faster than [T, head_dim] K on CPU). The
kv_heads axis comes first so tensor parallelism can shard it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    k: tuple[jax.Array, ...]  # per layer [slots, kv_heads, head_dim, max_len]
    v: tuple[jax.Array, ...]  # per layer [slots, kv_heads, max_len, head_dim]

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.v[0].shape[2]


def init_cache(
    num_layers: int,
    slots: int,
    kv_heads: int,
    max_len: int,
    head_dim: int,
    dtype,
    sharding: jax.sharding.Sharding | None = None,
) -> KVCache:
    """Zero cache; with a sharding, each buffer is created directly in its sharded layout (no host copy). The
    zero-makers are cached, so rebuilding a cache of the same layout (a colocated engine waking up) compiles
    nothing."""
    make_k = _zeros((slots, kv_heads, head_dim, max_len), jnp.dtype(dtype), sharding)
    make_v = _zeros((slots, kv_heads, max_len, head_dim), jnp.dtype(dtype), sharding)
    return KVCache(tuple(make_k() for _ in range(num_layers)), tuple(make_v() for _ in range(num_layers)))


@functools.lru_cache(maxsize=None)
def _zeros(shape: tuple[int, ...], dtype, sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def write_layer(
    cache: KVCache, layer: int, slots: jax.Array, positions: jax.Array, k: jax.Array, v: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Layer `layer`'s K and V buffers with token t's k/v [N, kv_heads, head_dim] stored at (slots[t], positions[t]).
    Tokens whose slot is >= the cache's slots are padding and dropped."""
    k_buf, v_buf = cache.k[layer], cache.v[layer]
    return (
        k_buf.at[slots, :, :, positions].set(k.astype(k_buf.dtype), mode="drop"),
        v_buf.at[slots, :, positions].set(v.astype(v_buf.dtype), mode="drop"),
    )


def copy_slots(cache: KVCache, src: jax.Array, dst: jax.Array, length: int) -> KVCache:
    """GRPO fan-out: copy the first `length` positions of slot rows src[i] -> dst[i] (a prompt's KV into its
    sample slots). `length` is static: the longest prompt the engine accepts, often far below max_len.

    Pairs with dst >= slots are padding and dropped. Positions past a prompt's end hold junk that decode overwrites
    before it ever reads them (attention only sees positions <= the row's current one).
    """
    return KVCache(
        tuple(k.at[dst, :, :, :length].set(k[src, :, :, :length], mode="drop") for k in cache.k),
        tuple(v.at[dst, :, :length].set(v[src, :, :length], mode="drop") for v in cache.v),
    )
