"""Bucket sizes for the compiled programs: prefill by token count, decode (and KV fan-out) by batch size.

Each bucket is one compiled program, built once in warmup; a request is padded up to the smallest bucket that fits
(tpu-inference's and JetStream's defaults, docs/design.md §5.1: powers of two from 16 tokens for prefill, powers of
two for decode batches, with a floor of 8 rows because a smaller decode batch costs the same weight reads anyway).
"""

from __future__ import annotations

import bisect


def _powers_of_two(lo: int, hi: int) -> list[int]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return out + [hi]


def default_prefill_buckets(max_prompt_len: int, smallest: int = 16) -> tuple[int, ...]:
    """16, 32, 64, ... capped by (and ending at) `max_prompt_len`."""
    return tuple(_powers_of_two(min(smallest, max_prompt_len), max_prompt_len))


def default_decode_buckets(max_batch: int, smallest: int = 8) -> tuple[int, ...]:
    """8, 16, 32, ... ending at `max_batch` (which need not be a power of two)."""
    return tuple(_powers_of_two(min(smallest, max_batch), max_batch))


def validate_buckets(name: str, buckets: tuple[int, ...], limit: int, ends_at_limit: bool = False) -> tuple[int, ...]:
    """Sorted, deduplicated buckets; ValueError naming the field if any is non-positive or above `limit`, or with
    `ends_at_limit` (decode buckets: every slot must fit a decode step) if the largest is not `limit`."""
    buckets = tuple(sorted(set(int(b) for b in buckets)))
    if not buckets or buckets[0] < 1:
        raise ValueError(f"{name} must be non-empty positive sizes, got {buckets}")
    if buckets[-1] > limit:
        raise ValueError(f"{name} has {buckets[-1]}, above its limit {limit}")
    if ends_at_limit and buckets[-1] != limit:
        raise ValueError(f"{name} must end at {limit}, got {list(buckets)}")
    return buckets


def pick_bucket(buckets: tuple[int, ...], size: int) -> int:
    """Smallest bucket >= size (buckets sorted); the caller guarantees size <= buckets[-1]."""
    return buckets[bisect.bisect_left(buckets, size)]
