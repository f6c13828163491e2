"""The JAX forward pass of the Qwen3 / Qwen2 / Llama decoder over a static KV cache: packed prefill and decode.

Pure functions of (params, cache, arrays); `cfg` is a static jit argument (rollout.programs). Everything that varies
between calls (tokens, positions, slots, lengths) is an array, so one compiled program per bucket shape serves
every request.

Numerics follow transformers (so logits match in fp32): RMSNorm in fp32 cast back before the weight multiply,
Qwen3's per-head q/k RMSNorm before RoPE, RoPE in the half-split (rotate_half) layout with fp32 angles,
softmax in fp32, logits in fp32. Matmuls accumulate in fp32 (preferred_element_type) and run at HIGHEST precision
so that fp32 really means fp32 on accelerators that would otherwise use bf16 passes. In bf16 every op rounds where
HF's bf16 forward rounds (SiLU and attention below, rollout.numerics for the exp and XLA's excess precision), so
that the engine's bf16 log-probs match the trainer's, not only its fp32 ones.

Prefill is *packed*: several prompts share one token-count bucket, told apart by a segment id per token; attention
is causal inside a segment and blind across segments. Decode handles one token per row, row i living in KV slot i.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp

from rollout.cost import DECODE_CHUNK, FLASH_KV_BLOCK, decode_chunks, reads_whole_cache
from rollout.kv_cache import KVCache, page_starts, write_layer
from rollout.model_config import ModelConfig
from rollout.numerics import attention_exp, inv_rms, matches_torch_cpu
from rollout.weights import LayerWeights, Weights

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST


def _linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    y = jnp.matmul(x, w, precision=HIGHEST, preferred_element_type=F32)
    if b is not None:
        y = y + b.astype(F32)
    return y.astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    # HF's order: normalise in fp32, round to the activation dtype, *then* multiply by the weight (in that dtype).
    x32 = x.astype(F32)
    return weight * (x32 * inv_rms(x32, eps, x.dtype)).astype(x.dtype)


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin [..., head_dim] for integer positions [...] (angles in fp32, as transformers computes them)."""
    freqs = positions.astype(F32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [N, heads, head_dim]; cos/sin [N, head_dim]. HF's rotate_half layout: (x1, x2) -> (-x2, x1)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _qkv(cfg: ModelConfig, layer: LayerWeights, h: jax.Array, cos: jax.Array, sin: jax.Array):
    """Projections for N tokens: q [N, H, hd], k/v [N, KV, hd], with q/k norm (Qwen3) and RoPE applied."""
    n = h.shape[0]
    q = _linear(h, layer.wq, layer.bq).reshape(n, cfg.num_heads, cfg.head_dim)
    k = _linear(h, layer.wk, layer.bk).reshape(n, cfg.num_kv_heads, cfg.head_dim)
    v = _linear(h, layer.wv, layer.bv).reshape(n, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _mlp(layer: LayerWeights, x: jax.Array) -> jax.Array:
    gate = _linear(x, layer.w_gate, layer.b_gate)
    up = _linear(x, layer.w_up, layer.b_up)
    # Matches HF's bf16 op order: torch's silu computes x·sigmoid(x) in fp32 and rounds once; jax.nn.silu on bf16
    # would round sigmoid(x) first (two roundings, which moved ~40% of bf16 activations by an ulp).
    act = jax.nn.silu(gate.astype(F32)).astype(gate.dtype)
    return _linear(act * up, layer.w_down, layer.b_down)


def _attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    subscripts: tuple[str, str],
    key_blocks: jax.Array | None = None,
    blocks: int = 1,
) -> jax.Array:
    """Grouped-query attention with fp32 scores/softmax; `mask` broadcasts against the scores.

    Matches HF's bf16 op order under its default attention (SDPA, a flash kernel on CPU and GPU alike): the
    *unnormalised* weights exp(s - max) are rounded to the activation dtype for the P·V matmul, which accumulates in
    fp32, and the fp32 result is scaled by 1 / (fp32 row sum) before the one rounding of the output. Rounding the
    normalised probabilities instead (eager attention's order) moved ~40% of bf16 attention outputs by an ulp. In
    fp32 the two orders agree to rounding. The exp itself is rollout.numerics.attention_exp. With `blocks` > 1 the
    softmax runs block by block as torch's CPU flash kernel's does past FLASH_KV_BLOCK keys (`_decode_attention`
    says why), `key_blocks` holding each key's block (broadcasting against the scores' key axis).
    """
    dtype = q.dtype  # the activations'; a CPU engine's cache k/v is fp32 (rollout.cost.cache_dtype)
    scale = q.shape[-1] ** -0.5
    scores = jnp.einsum(subscripts[0], q, k, precision=HIGHEST, preferred_element_type=F32) * scale
    # A large finite negative rather than -inf: a fully masked row (padding) then softmaxes to finite junk instead
    # of NaN, which would otherwise leak into valid rows through 0 * NaN in the next layer.
    scores = jnp.where(mask, scores, -1e30)
    # P·V in the scores' own layout (the key axis, last, contracted), so that the row sums broadcast over head_dim.
    score_sub, out_sub = subscripts[1].split("->")
    pv_sub = score_sub.split(",")[0][:-1] + "d"
    pv_of = f"{score_sub}->{pv_sub}"

    def weighted(weights):  # (P·V, row sum)
        pv = jnp.einsum(pv_of, weights.astype(dtype), v, precision=HIGHEST, preferred_element_type=F32)
        return pv, jnp.sum(weights, axis=-1)

    if blocks == 1:
        pv, total = weighted(attention_exp(scores - jnp.max(scores, axis=-1, keepdims=True), dtype))
    else:
        in_block = [key_blocks == b for b in range(blocks)]
        running = list(itertools.accumulate((jnp.where(b, scores, -1e30).max(-1) for b in in_block), jnp.maximum))
        parts = [
            weighted(jnp.where(b, attention_exp(scores - m[..., None], dtype), 0.0)) for b, m in zip(in_block, running)
        ]
        pv, total = _join_blocks(running, *zip(*parts))
    out = (pv * (1.0 / total)[..., None]).astype(dtype)
    return jnp.einsum(f"{pv_sub}->{out_sub}", out)


def _join_blocks(running: list[jax.Array], pv: tuple[jax.Array, ...], sums: tuple[jax.Array, ...]):
    """The (P·V, row sum) of a row's blocks joined in torch's flash kernel's order, each block's taken against its
    running max: sum = block sum + rescale · sum; out = out · rescale + block P·V, rescale = exp(old max - new max)."""
    out, total = pv[0], sums[0]
    for block in range(1, len(pv)):
        rescale = jnp.exp(running[block - 1] - running[block])
        total = sums[block] + rescale * total
        out = out * rescale[..., None] + pv[block]
    return out, total


def logits_from_hidden(params: Weights, h: jax.Array) -> jax.Array:
    """fp32 logits [N, V] from final hidden states [N, D] (tied models reuse the embedding)."""
    if params.lm_head is not None:
        return jnp.matmul(h, params.lm_head, precision=HIGHEST, preferred_element_type=F32)
    return jnp.einsum("nd,vd->nv", h, params.embed, precision=HIGHEST, preferred_element_type=F32)


def _forward(cfg: ModelConfig, params: Weights, tokens: jax.Array, positions: jax.Array, attend) -> jax.Array:
    """Embedding, the layer stack and the final norm for N tokens; returns hidden states [N, D].

    `attend(i, q, k, v)` is layer i's attention: q [N, KV, G, hd] (query heads grouped by the KV head they share),
    k/v [N, KV, hd] for these tokens; it stores k/v in the cache as it needs and returns [N, KV, G, hd].
    """
    n = tokens.shape[0]
    cos, sin = rope_cos_sin(positions, jnp.asarray(cfg.rope_inv_freq()), params.embed.dtype)
    x = params.embed[tokens]
    g = cfg.num_heads // cfg.num_kv_heads
    for i, layer in enumerate(params.layers):
        q, k, v = _qkv(cfg, layer, rms_norm(x, layer.attn_norm, cfg.rms_norm_eps), cos, sin)
        attn = attend(i, q.reshape(n, cfg.num_kv_heads, g, cfg.head_dim), k, v)
        x = x + _linear(attn.reshape(n, cfg.q_size), layer.wo, layer.bo)
        x = x + _mlp(layer, rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps))
    return rms_norm(x, params.final_norm, cfg.rms_norm_eps)


def prefill(
    cfg: ModelConfig,
    params: Weights,
    cache: KVCache,
    tokens: jax.Array,
    positions: jax.Array,
    segments: jax.Array,
    slots: jax.Array,
) -> tuple[KVCache, jax.Array]:
    """Run packed prompt tokens [P] through the model and write their K/V into the cache.

    positions [P]: position of each token in its own prompt; segments [P]: which prompt a token belongs to;
    slots [P]: the KV slot of its prompt, or any index >= cache slots for padding (those writes are dropped).
    Returns the updated cache and final-norm hidden states [P, D] (the engine does not need prefill logits: the
    last prompt token is fed to the first decode step, which samples from it).
    """
    valid = slots < cache.num_slots
    # causal inside a segment, blind across segments and to padding
    mask = (segments[:, None] == segments[None, :]) & (positions[None, :] <= positions[:, None]) & valid[None, :]
    written = []
    blocks = -(-tokens.shape[0] // FLASH_KV_BLOCK)

    def attend(i, q, k, v):
        written.append(write_layer(cache, i, slots, positions, k, v))
        args = (q, k, v, mask[None, None], ("qkgd,tkd->kgqt", "kgqt,tkd->qkgd"))
        if blocks == 1 or not matches_torch_cpu(q.dtype):
            return _attend(*args)
        # torch's 512-key blocks (a P·V product each), where a prompt in the bucket is that long; keys by position
        in_blocks = lambda: _attend(*args, positions // FLASH_KV_BLOCK, blocks)  # noqa: E731
        return jax.lax.cond(jnp.max(positions) >= FLASH_KV_BLOCK, in_blocks, lambda: _attend(*args))

    h = _forward(cfg, params, tokens, positions, attend)
    return KVCache(*map(tuple, zip(*written))), h


def _decode_attention(
    q: jax.Array,
    k_pages: tuple[jax.Array, ...],
    v_pages: tuple[jax.Array, ...],
    positions: jax.Array,
    kv_len: jax.Array,
    whole: bool,
) -> jax.Array:
    """Attention of q [B, KV, G, hd] over the cache rows (pages of K [B, KV, hd, n], V [B, KV, n, hd]), positions
    <= positions[b]. rollout.cost decides how the engine reads its cache (cache_page_len, reads_whole_cache) and
    counts the bytes that each way reads.

    A paged cache reads the pages below kv_len and skips the others by a conditional, so the bytes read follow the
    longest live sequence. One page is read `whole` in one pass, or chunk by chunk (`_chunked_attention`).
    """
    if len(k_pages) == 1:
        (k_cache,), (v_cache,) = k_pages, v_pages
        if not whole:
            return _chunked_attention(q, k_cache, v_cache, positions, kv_len)
        mask = (jnp.arange(v_cache.shape[2])[None, :] <= positions[:, None])[:, None, None, :]
        return _attend(q, k_cache, v_cache, mask, ("bkgd,bkdt->bkgt", "bkgt,bktd->bkgd"))
    # Two passes, in the op order of torch's CPU flash kernel (what the trainer's attention runs on CPU), so that
    # every bf16 rounding is the trainer's: the scores of the pages in use, then exp(s - max) times V, summed in fp32
    # with the softmax's denominator. That kernel softmaxes a row in blocks of FLASH_KV_BLOCK keys, each block's exp
    # taken against the running max (the largest score up to and including the block), the sums so far rescaled by
    # exp(old max - new max) as the max grows: against the row's overall max, every weight of a block before the
    # max's was rounded to bf16 at another scale, which took the bf16 log-prob gap past 512 positions from ~1e-3 to
    # ~9e-3 nats. A cache of one block is the plain two-pass softmax (`_attend`'s).
    dtype, scale = q.dtype, q.shape[-1] ** -0.5
    lens = tuple(v.shape[2] for v in v_pages)
    starts = page_starts(lens)
    pieces = _block_pieces(starts, lens)
    blocks = pieces[-1][-1][0] + 1

    def in_use(i, read, skipped):
        return read() if i == 0 else jax.lax.cond(starts[i] < kv_len, read, skipped)

    def page_scores(start, k):
        s = jnp.einsum("bkgd,bkdt->bkgt", q, k, precision=HIGHEST, preferred_element_type=F32) * scale
        keys = start + jnp.arange(k.shape[3])
        return jnp.where((keys[None, :] <= positions[:, None])[:, None, None, :], s, -1e30)

    scores = [
        in_use(i, lambda k=k, i=i: page_scores(starts[i], k), lambda k=k: jnp.full((*q.shape[:3], k.shape[3]), -1e30))
        for i, k in enumerate(k_pages)
    ]
    block_max = [[] for _ in range(blocks)]
    for s, page in zip(scores, pieces):
        for block, lo, end in page:
            block_max[block].append(s[..., lo:end].max(axis=-1))
    running = list(itertools.accumulate((jnp.max(jnp.stack(m), axis=0) for m in block_max), jnp.maximum))
    pv = [jnp.zeros(q.shape, F32) for _ in range(blocks)]
    denom = [jnp.zeros(q.shape[:3], F32) for _ in range(blocks)]
    for i, (s, v, page) in enumerate(zip(scores, v_pages, pieces)):

        def page_values(s=s, v=v, page=page):
            outs = []
            for block, lo, end in page:
                weights = attention_exp(s[..., lo:end] - running[block][..., None], dtype)
                block_pv = jnp.einsum(
                    "bkgt,bktd->bkgd",
                    weights.astype(dtype),
                    v[:, :, lo:end],
                    precision=HIGHEST,
                    preferred_element_type=F32,
                )
                outs.append((block_pv, jnp.sum(weights, axis=-1)))
            return tuple(outs)

        skipped = tuple((jnp.zeros(q.shape, F32), jnp.zeros(q.shape[:3], F32)) for _ in page)
        for (block, _, _), (page_pv, page_sum) in zip(page, in_use(i, page_values, lambda skipped=skipped: skipped)):
            pv[block], denom[block] = pv[block] + page_pv, denom[block] + page_sum
    out, total = _join_blocks(running, pv, denom)
    return (out * (1.0 / total)[..., None]).astype(dtype)


def _block_pieces(starts: list[int], lens: tuple[int, ...]) -> list[list[tuple[int, int, int]]]:
    """Each page's (kv block, first, end) offsets: the page cut where a block of FLASH_KV_BLOCK keys starts (only a
    page longer than a block is: rollout.cost.cache_page_len aligns pages with the blocks)."""
    pieces = []
    for start, n in zip(starts, lens):
        page, lo = [], 0
        while lo < n:
            end = min(n, lo + FLASH_KV_BLOCK - (start + lo) % FLASH_KV_BLOCK)
            page.append(((start + lo) // FLASH_KV_BLOCK, lo, end))
            lo = end
        pieces.append(page)
    return pieces


def _chunked_attention(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array, kv_len: jax.Array
) -> jax.Array:
    """Flash-decoding style attention over one buffer (K [B, KV, hd, T], V [B, KV, T, hd]): a while loop walks
    ceil(kv_len / chunk) chunks with an online softmax (running max, normaliser, accumulator), so the trip count is
    data (no recompile) and the bytes read follow the longest live sequence."""
    b, n_kv, g, hd = q.shape
    dtype = q.dtype  # the activations'; the cache may hold them in fp32 (rollout.cost.cache_dtype)
    max_len = v_cache.shape[2]
    chunk = min(DECODE_CHUNK, max_len)  # a cache shorter than a chunk is one chunk (decode_chunks counts 1)
    q = q.astype(F32) * hd**-0.5

    def body(i, carry):
        m, denom, acc = carry
        # The last chunk may be clamped back inside the cache; the `>= i * chunk` mask skips positions seen already.
        start = jnp.minimum(i * chunk, max_len - chunk)
        k = jax.lax.dynamic_slice_in_dim(k_cache, start, chunk, axis=3)
        v = jax.lax.dynamic_slice_in_dim(v_cache, start, chunk, axis=2)
        idx = start + jnp.arange(chunk)
        mask = ((idx[None, :] <= positions[:, None]) & (idx[None, :] >= i * chunk))[:, None, None, :]
        s = jnp.einsum("bkgd,bkdt->bkgt", q, k, precision=HIGHEST, preferred_element_type=F32)
        s = jnp.where(mask, s, -1e30)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = attention_exp(s - m_new[..., None], dtype)
        corr = jnp.exp(m - m_new)
        pv = jnp.einsum("bkgt,bktd->bkgd", p.astype(dtype), v, precision=HIGHEST, preferred_element_type=F32)
        return m_new, denom * corr + p.sum(axis=-1), acc * corr[..., None] + pv

    init = (jnp.full((b, n_kv, g), -1e30, F32), jnp.zeros((b, n_kv, g), F32), jnp.zeros((b, n_kv, g, hd), F32))
    n_chunks = decode_chunks(jnp.clip(kv_len, 1, max_len))
    _, denom, acc = jax.lax.fori_loop(0, n_chunks, body, init)
    return (acc / denom[..., None]).astype(dtype)


def decode_step(
    cfg: ModelConfig,
    params: Weights,
    cache: KVCache,
    tokens: jax.Array,
    positions: jax.Array,
    kv_len: jax.Array | None = None,
    whole_cache: bool | None = None,
) -> tuple[KVCache, jax.Array]:
    """One token per row for rows 0..B-1 (row i is KV slot i): write its K/V at `positions[i]`, attend over the
    slot's first positions[i] + 1 entries, return the cache and fp32 logits [B, V].

    kv_len: cache positions any row that matters needs (max position + 1 over live rows); attention reads only
    that far. Rows beyond it get junk (the engine passes it over its running rows). None => max(positions) + 1.
    Only the first B slots are read (a static slice), so a small decode bucket costs a small fraction of the cache.
    whole_cache: attention reads a one-page cache's rows whole rather than chunk by chunk (None: by CPU's rule for
    the cache's length, rollout.cost.reads_whole_cache; the engine decides per platform and setting). A paged cache
    is read by its pages in use.
    """
    b = tokens.shape[0]
    rows = jnp.arange(b)
    if kv_len is None:
        kv_len = jnp.max(positions) + 1
    if whole_cache is None:
        whole_cache = reads_whole_cache(cache.max_len)
    written = []

    def attend(i, q, k, v):
        written.append(write_layer(cache, i, rows, positions, k, v))
        k_pages, v_pages = ([page[:b] for page in pages] for pages in written[-1])
        return _decode_attention(q, k_pages, v_pages, positions, kv_len, whole_cache)

    h = _forward(cfg, params, tokens, positions, attend)
    return KVCache(*map(tuple, zip(*written))), logits_from_hidden(params, h)
