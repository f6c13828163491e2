"""The static KV cache: per layer, K buffers [slots, kv_heads, head_dim, page] and V buffers [slots, kv_heads, page,
head_dim], allocated once.

Sized by config (slots x max length) so its shape never changes; the engine donates it to every compiled call, so
updates happen in place. Slot i holds one sequence (prompt + response); rows of a decode bucket map to slots 0..B-1.
K is stored transposed (positions minor) so that both decode products, q.K^T over head_dim and p.V over positions,
contract a non-minor axis and stream the cache contiguously (about 2x faster than [T, head_dim] K on CPU). The
kv_heads axis comes second (after slots) in both, so that tensor parallelism shards it alike.

A layer's positions are held in pages, each a buffer of its own: page i holds positions [i * page, (i + 1) * page),
the last page what is left. Decode then reads only the pages in use, each as a whole buffer (rollout.model). One page
(the default) is the plain layout. Pages are separate arrays rather than slices of one because XLA:CPU copies a
slice before it multiplies it, which cost more than the positions it skipped (rollout.cost.cache_page_len).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    k: tuple[tuple[jax.Array, ...], ...]  # per layer, per page [slots, kv_heads, head_dim, page]
    v: tuple[tuple[jax.Array, ...], ...]  # per layer, per page [slots, kv_heads, page, head_dim]

    @property
    def num_slots(self) -> int:
        return self.k[0][0].shape[0]

    @property
    def page_lens(self) -> tuple[int, ...]:
        return tuple(v.shape[2] for v in self.v[0])

    @property
    def max_len(self) -> int:
        return sum(self.page_lens)


def page_starts(page_lens: tuple[int, ...]) -> list[int]:
    """The first position of each page."""
    return [sum(page_lens[:i]) for i in range(len(page_lens))]


def init_cache(
    num_layers: int,
    slots: int,
    kv_heads: int,
    max_len: int,
    head_dim: int,
    dtype,
    sharding: jax.sharding.Sharding | None = None,
    page_len: int | None = None,
) -> KVCache:
    """Zero cache of max_len positions in pages of `page_len` (None: one page); with a sharding, each buffer is
    created directly in its sharded layout (no host copy). The zero-makers are cached, so rebuilding a cache of the
    same layout (a colocated engine waking up) compiles nothing."""
    page_len = min(page_len or max_len, max_len)
    lens = [page_len] * (max_len // page_len) + ([max_len % page_len] if max_len % page_len else [])
    dtype = jnp.dtype(dtype)

    def layer(shape):
        return tuple(_zeros(shape(n), dtype, sharding)() for n in lens)

    return KVCache(
        tuple(layer(lambda n: (slots, kv_heads, head_dim, n)) for _ in range(num_layers)),
        tuple(layer(lambda n: (slots, kv_heads, n, head_dim)) for _ in range(num_layers)),
    )


@functools.lru_cache(maxsize=None)
def _zeros(shape: tuple[int, ...], dtype, sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def write_layer(
    cache: KVCache, layer: int, slots: jax.Array, positions: jax.Array, k: jax.Array, v: jax.Array
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Layer `layer`'s K and V pages with token t's k/v [N, kv_heads, head_dim] stored at (slots[t], positions[t]).
    Tokens whose slot is >= the cache's slots are padding and dropped."""
    k_pages, v_pages = [], []
    for start, k_buf, v_buf in zip(page_starts(cache.page_lens), cache.k[layer], cache.v[layer]):
        n = v_buf.shape[2]
        # a token of another page writes out of this one's range, so it is dropped (a negative index would wrap)
        at = positions - start
        at = at if len(cache.page_lens) == 1 else jnp.where((at >= 0) & (at < n), at, n)
        k_pages.append(k_buf.at[slots, :, :, at].set(k.astype(k_buf.dtype), mode="drop"))
        v_pages.append(v_buf.at[slots, :, at].set(v.astype(v_buf.dtype), mode="drop"))
    return tuple(k_pages), tuple(v_pages)


def copy_slots(cache: KVCache, src: jax.Array, dst: jax.Array, length: int) -> KVCache:
    """GRPO fan-out: copy the first `length` positions of slot rows src[i] -> dst[i] (a prompt's KV into its
    sample slots). `length` is static: the longest prompt the engine accepts, often far below max_len.

    Pairs with dst >= slots are padding and dropped. Positions past a prompt's end hold junk that decode overwrites
    before it ever reads them (attention only sees positions <= the row's current one).
    """
    starts = page_starts(cache.page_lens)

    def copy(page, start, axis):  # axis: the page's positions (3 in K, 2 in V)
        n = length - start  # this page's positions to copy (all of them if the prompt runs past it)
        if n <= 0:
            return page
        prefix = (slice(None),) * (axis - 1) + (slice(0, n),)
        return page.at[(dst, *prefix)].set(page[(src, *prefix)], mode="drop")

    return KVCache(
        tuple(tuple(copy(page, start, 3) for page, start in zip(pages, starts)) for pages in cache.k),
        tuple(tuple(copy(page, start, 2) for page, start in zip(pages, starts)) for pages in cache.v),
    )
