"""The cost model of the decoder: FLOPs and memory bytes per token, and how much KV cache a decode step reads.

One place for the arithmetic that the engine's stats (flops, bytes, hence MFU / MBU) and the benchmarks report, and
for the rules of how decode reads the cache (pages, chunks or whole rows), which rollout.model executes and the byte
count has to follow.

FLOPs: 2 per matmul weight per token (the LM head in decode only), plus 4 per query-head dim per attended position
(q.k and p.v); a training pass (the e2e benchmark's bound) is three times its forward's. Bytes: a prefill or decode
step reads every weight once; decode reads each row's KV up to the pages or chunks in use, prefill writes the KV of its
bucket, a fan-out copy reads and writes its rows. `itemsize` is the weights' bytes per value, `kv_itemsize` the KV
cache's (`cache_dtype`; None: the weights' own).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterable

from rollout.model_config import ModelConfig
from rollout.weight_table import LAYER_PARAMS, LM_HEAD, TOP_PARAMS

# Decode reads only the part of the cache that the longest running row needs: a step costs the context actually in
# use, not the cache's full max_len. How depends on the platform (a JAX platform: cpu, gpu, tpu) and
# `rollout.decode_attention`:
# - paged (CPU's default): the cache is held in pages of DECODE_PAGE positions, each a buffer of its own, and decode
#   reads the pages in use whole, skipping the rest. XLA:CPU copies any slice of a buffer before a dot reads it, so
#   slicing one buffer into chunks cost more than the positions it skipped, where a page is read in place at the rate
#   of the whole row: one core, the e2e bench's 28M model (128 rows, 256 positions, fp32 cache), 20.9 / 30.3 / 39.5 ms
#   for a step's attention with 120 / 180 / 228 positions in use against 40 ms for the whole row and 69-123 ms in
#   128-position chunks. 32-position pages cost more per page (44.5 ms at 228). At most MAX_PAGES pages per row
#   (longer pages for long caches), so that the program stays small. A longer page is a power of two up to 512
#   positions, else a multiple of 512, so that no page straddles the FLASH_KV_BLOCK-key blocks that decode softmaxes
#   by: a piece of a page would be a slice, which XLA:CPU copies.
# - chunked (TPU's default for a long cache): one buffer, read in chunks of DECODE_CHUNK positions by a while loop.
# - whole: one buffer read whole in one pass, a short cache's default on accelerators. On a GPU, XLA drives a loop (or
#   a conditional) from the host, its predicate copied back per chunk, per layer, per step, and copies every chunk it
#   slices, so the whole row wins far longer: on an H200 (Qwen3-0.6B shapes, bf16, 256 rows, ~380 positions in use)
#   2.33x faster decode with a 384-position cache, 0.85x with a 2048-position one (docs/benchmarks.md, device).
DECODE_PAGE = 64
MAX_PAGES = 16
# torch's CPU flash kernel softmaxes a row's keys in blocks of this many (its kv_split_size for every query length);
# the paged decode follows it (rollout.model, rollout.numerics)
FLASH_KV_BLOCK = 512
DECODE_CHUNK = 128
WHOLE_CACHE_CHUNKS = {"gpu": 8}  # other platforms: 2


def cache_page_len(max_len: int, platform: str = "cpu", decode_attention: str = "auto") -> int:
    """Positions per page of an engine's KV cache of `max_len` positions (the last page may be shorter): pages of
    DECODE_PAGE, or longer to keep to MAX_PAGES, where the cache is paged ("paged", or "auto" on CPU), else max_len
    (one buffer)."""
    if decode_attention == "paged" or (decode_attention == "auto" and platform == "cpu"):
        page = DECODE_PAGE * -(-max_len // (DECODE_PAGE * MAX_PAGES))
        page = 1 << (page - 1).bit_length() if page <= FLASH_KV_BLOCK else -(-page // FLASH_KV_BLOCK) * FLASH_KV_BLOCK
        return min(max_len, page)
    return max_len


def reads_whole_cache(max_len: int, platform: str = "cpu", decode_attention: str = "auto") -> bool:
    """Whether decode attention reads a one-buffer cache row whole in one pass rather than chunk by chunk: as the
    engine's `decode_attention` setting says ("whole"; "chunked" or "paged" not), or with "auto" by the rule above
    for `platform` (on CPU, where "auto" pages the cache, for a cache of one page)."""
    if decode_attention != "auto":
        return decode_attention == "whole"
    return max_len <= WHOLE_CACHE_CHUNKS.get(platform, 2) * DECODE_CHUNK


def decode_chunks(kv_len):
    """Chunks the chunked decode attention walks to cover `kv_len` positions (a Python int or a traced array)."""
    return (kv_len + DECODE_CHUNK - 1) // DECODE_CHUNK


def decode_kv_positions(max_len: int, kv_len: int, whole: bool | None = None, page_len: int | None = None) -> int:
    """Cache positions a decode step reads per row when the longest live row needs `kv_len` (its position + 1): a
    paged cache (`page_len` < max_len) its pages up to kv_len; one buffer all of it when read `whole`, else whole
    chunks up to kv_len; at most max_len. Both None: as a CPU engine reads it by default (paged)."""
    if whole is None and page_len is None:
        page_len = cache_page_len(max_len)
    if page_len is not None and page_len < max_len:
        return min(max_len, -(-kv_len // page_len) * page_len)
    if reads_whole_cache(max_len) if whole is None else whole:
        return max_len
    return min(max_len, decode_chunks(kv_len) * DECODE_CHUNK)


@lru_cache(maxsize=None)  # the engine asks on every dispatch; a ModelConfig is frozen and hashable
def param_count(cfg: ModelConfig) -> int:
    """Elements of every tensor the decoder holds (rollout.weight_table)."""

    def size(p) -> int:
        n = 1
        for s in p.shape(cfg):
            n *= s
        return n

    top = sum(size(p) for p in TOP_PARAMS if p.when(cfg))
    return top + cfg.num_layers * sum(size(p) for p in LAYER_PARAMS if p.when(cfg))


def weight_bytes(cfg: ModelConfig, itemsize: int) -> int:
    return param_count(cfg) * itemsize


def device_weight_bytes(cfg: ModelConfig, itemsize: int, tp: int = 1, head_copy: bool = False) -> int:
    """Bytes of an engine's weights on each of its `tp` devices: a tensor split over the mesh (`Param.split`) a tp-th
    of it, the others (embeddings, norms, output biases) whole on every device; with `head_copy`, a tied model's LM
    head copy, split as an untied head is. (All divided by tp under-counted a small model's by up to ~1.8x.)"""

    def on_device(p) -> int:
        n = 1
        for s in p.shape(cfg):
            n *= s
        return n // tp if p.split(cfg, tp) else n

    top = sum(on_device(p) for p in TOP_PARAMS if p.when(cfg)) + (on_device(LM_HEAD) if head_copy else 0)
    return (top + cfg.num_layers * sum(on_device(p) for p in LAYER_PARAMS if p.when(cfg))) * itemsize


def cache_dtype(dtype: str, platform: str) -> str:
    """The KV cache's dtype for an engine computing in `dtype` on `platform` (a JAX platform: cpu, gpu, tpu).

    fp32 on CPU: XLA:CPU runs a low-precision batched dot, decode attention over the cache, by converting its operands
    to fp32 first, which converted every layer's whole K and V on every step (two-thirds of a bf16 decode step of the
    rollout bench's 31M model at 64 rows; docs/benchmarks-history.md, rollout). The values are the same: K/V are
    rounded to the activation dtype before they are stored, and fp32 holds them exactly. Accelerators keep the
    model's dtype."""
    return "float32" if platform == "cpu" else dtype


def kv_bytes_per_token(cfg: ModelConfig, itemsize: int) -> int:
    """K and V of one position over all layers."""
    return 2 * cfg.num_layers * cfg.kv_size * itemsize


def _layer_matmul_params(cfg: ModelConfig) -> int:
    d = cfg.hidden_size
    return 2 * d * cfg.q_size + 2 * d * cfg.kv_size + 3 * d * cfg.intermediate_size  # q, o; k, v; gate, up, down


def generate_flops(cfg: ModelConfig, prefills: Iterable[int], sequences: Iterable[tuple[int, int]]) -> float:
    """FLOPs of one generate call: each prefill of n prompt tokens (a prompt's all but its last, once for all its
    samples: they copy its KV) through the layers (no LM head) with causal attention, then for each (prompt length
    lp, generated k) sequence k decode tokens through every matmul, the LM head included, each attending to its
    whole context."""
    body = cfg.num_layers * _layer_matmul_params(cfg)
    head = cfg.vocab_size * cfg.hidden_size
    attn = 4 * cfg.num_layers * cfg.q_size
    flops = sum(2.0 * body * n + attn * n * (n + 1) / 2 for n in prefills)
    for lp, k in sequences:
        flops += (2.0 * (body + head)) * k + attn * (k * lp + k * (k - 1) / 2)
    return flops


def train_flops(cfg: ModelConfig, groups: Iterable[tuple[int, Iterable[float]]]) -> float:
    """FLOPs of one training pass, forward and backward (twice the forward), over GRPO groups, each (prompt length
    lp, its samples' response lengths): the prompt once, causal (shared-prompt rows; a row per sample repeats it), and
    each response attending to its prompt and causally to itself, through every matmul and the LM head (log-probs are
    of response tokens only)."""
    body = cfg.num_layers * _layer_matmul_params(cfg)
    head = cfg.vocab_size * cfg.hidden_size
    attn = 4 * cfg.num_layers * cfg.q_size
    forward = 0.0
    for lp, responses in groups:
        forward += 2.0 * body * lp + attn * lp * (lp + 1) / 2
        for k in responses:
            forward += 2.0 * (body + head) * k + attn * (k * lp + k * (k + 1) / 2)
    return 3 * forward


def prefill_bytes(cfg: ModelConfig, itemsize: int, bucket_tokens: int, kv_itemsize: int | None = None) -> int:
    """One packed prefill call: the weights read once, the bucket's K/V written."""
    return weight_bytes(cfg, itemsize) + bucket_tokens * kv_bytes_per_token(cfg, kv_itemsize or itemsize)


def copy_bytes(cfg: ModelConfig, kv_itemsize: int, rows: int, length: int) -> int:
    """A fan-out copy of `rows` slot rows, `length` positions each: read and written."""
    return 2 * rows * length * kv_bytes_per_token(cfg, kv_itemsize)


def decode_bytes(
    cfg: ModelConfig,
    itemsize: int,
    steps: int,
    rows: int,
    max_len: int,
    kv_len: int,
    kv_itemsize: int | None = None,
    whole: bool | None = None,
    page_len: int | None = None,
) -> int:
    """`steps` decode steps over `rows` rows, the cache read by pages, whole or by chunks (`decode_kv_positions`): per
    step the weights once and each row's KV in use (counted at the dispatch's largest `kv_len`)."""
    per_row = decode_kv_positions(max_len, kv_len, whole, page_len) * kv_bytes_per_token(cfg, kv_itemsize or itemsize)
    return steps * (weight_bytes(cfg, itemsize) + rows * per_row)


def engine_memory(
    cfg: ModelConfig,
    itemsize: int,
    max_batch: int,
    max_seq_len: int,
    tp: int = 1,
    head_copy: bool = False,
    kv_itemsize: int | None = None,
) -> dict[str, int]:
    """Bytes per device that an engine allocates up front: its weights (with `head_copy`, a tied model's LM head
    copy too: rollout.weight_table.copies_tied_head) and its static KV cache (max_batch rows of max_seq_len positions,
    heads split over the tp devices), before any activation or compiled-program workspace."""
    weights = device_weight_bytes(cfg, itemsize, tp, head_copy)
    kv_cache = max_batch * max_seq_len * kv_bytes_per_token(cfg, kv_itemsize or itemsize) // tp
    return {"weights": weights, "kv_cache": kv_cache, "total": weights + kv_cache}
