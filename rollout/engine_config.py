"""EngineConfig: the JAX rollout engine's settings, validated on construction.

Kept apart from rollout.engine because the RL loop's driver builds (and checks) it without loading jax; it is a
pydantic dataclass so that each field declares its own range, a bad value fails with the field named, and it pickles
to Ray actors as is. The HF backend (rollout.hf_backend) reads the settings that apply to `transformers.generate`.
"""

from __future__ import annotations

import os
from typing import Annotated, Literal

from pydantic import BeforeValidator, ConfigDict, Field
from pydantic.dataclasses import dataclass

from rollout.types import DType

PositiveInt = Annotated[int, Field(ge=1)]
# A pathlib.Path is accepted and stored as str (the plain dataclass this replaces took one too).
PathStr = Annotated[str, BeforeValidator(lambda v: os.fspath(v) if isinstance(v, os.PathLike) else v)]


@dataclass(config=ConfigDict(extra="forbid"))
class EngineConfig:
    model_path: PathStr  # HF dir or hub id with config.json (+ safetensors weights)
    trust_remote_code: bool = False  # hf backend: run Python shipped with the checkpoint; the JAX decoder never does
    dtype: DType = "float32"  # compute/params dtype (the real recipe sets bfloat16); logits/sampling in fp32
    max_batch: PositiveInt = 256  # KV slots
    max_seq_len: Annotated[int, Field(ge=2)] = 1024  # prompt + response
    # Bucket sizes are checked against max_seq_len / max_batch by the engine (rollout.buckets.validate_buckets).
    prefill_buckets: tuple[int, ...] | None = None  # None => powers of two from 16 up to max_seq_len - 1
    decode_buckets: tuple[int, ...] | None = None  # None => powers of two (floor 8) up to max_batch
    steps_per_dispatch: PositiveInt = 8
    # How decode attention reads a row's KV cache, only as far as the longest running row wherever it can: "paged"
    # holds the cache in 64-position pages, each a buffer of its own, and reads the pages in use (XLA:CPU copies a
    # slice of a buffer before multiplying it, not a page); "chunked" walks 128-position chunks of one buffer in a
    # while loop; "whole" reads all max_seq_len positions in one pass (no loop; on a GPU XLA drives a loop or a
    # conditional from the host, a sync per chunk, per layer, per step); "auto" picks by platform and cache length
    # (paged on CPU; rollout.cost.cache_page_len, reads_whole_cache).
    decode_attention: Literal["auto", "paged", "chunked", "whole"] = "auto"
    tp: PositiveInt = 1  # devices in the engine's mesh
    # Mixed into every sampling key with SamplingParams.seed (rollout.types.mix_seed; 0 => the request's seed as is),
    # so engines given different seeds draw different samples for the same request.
    seed: int = 0
