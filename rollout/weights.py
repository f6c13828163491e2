"""The decoder's weights: the typed pytree built from rollout.weight_table's table, and the HF-name loading.

Weights arrive as a flat dict of numpy / ml_dtypes arrays keyed by HF names, either from the weight-sync layer or
read from the safetensors files of a model dir. The decoder wants `Weights`: matrices laid out for `x @ W` (HF stores
nn.Linear weights as [out, in], so they are transposed here, once, on the host), and None for the tensors a family
does not have. Everything per tensor (HF name, layout, shape, tensor-parallel split, presence) is declared once in
`TOP_PARAMS` / `LAYER_PARAMS` (rollout.weight_table); validation, conversion, zero weights and shardings
(rollout.sharding) derive from it.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from dataclasses import dataclass
from typing import Callable, Mapping

import jax
import ml_dtypes  # noqa: F401  (registers "bfloat16" with numpy, so np.dtype("bfloat16") works)
import numpy as np

from rollout.model_config import ModelConfig
from rollout.types import DTYPES, check_float_array
from rollout.weight_table import LAYER_PARAMS, TOP_PARAMS, Param

# Names a checkpoint may carry that the decoder does not need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer; the optional tensors are None in families without them."""

    attn_norm: jax.Array
    wq: jax.Array  # [D, H * hd]
    wk: jax.Array  # [D, KV * hd]
    wv: jax.Array
    wo: jax.Array  # [H * hd, D]
    mlp_norm: jax.Array
    w_gate: jax.Array  # [D, F]
    w_up: jax.Array
    w_down: jax.Array  # [F, D]
    bq: jax.Array | None = None  # q/k/v biases: Qwen2; Qwen3 and Llama with attention_bias
    bk: jax.Array | None = None
    bv: jax.Array | None = None
    bo: jax.Array | None = None  # Qwen3 and Llama with attention_bias
    q_norm: jax.Array | None = None  # Qwen3's per-head RMSNorm [hd]
    k_norm: jax.Array | None = None
    b_gate: jax.Array | None = None  # Llama with mlp_bias
    b_up: jax.Array | None = None
    b_down: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Weights:
    embed: jax.Array  # [V, D]
    final_norm: jax.Array  # [D]
    layers: tuple[LayerWeights, ...]
    lm_head: jax.Array | None = None  # [D, V]; None when tied to the embedding, unless held as a copy (with_head_copy)


# The table and the pytree must name the same tensors: checked at import, so a field added to one fails at once.
assert {p.field for p in TOP_PARAMS} | {"layers"} == {f.name for f in dataclasses.fields(Weights)}
assert {p.field for p in LAYER_PARAMS} == {f.name for f in dataclasses.fields(LayerWeights)}


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def build_weights(cfg: ModelConfig, make: Callable[[Param, str], object]) -> Weights:
    """A Weights whose present tensors are `make(param, full HF name)`, the absent ones None."""

    def fields(params, prefix=""):
        return {p.field: make(p, prefix + p.hf_name) for p in params if p.when(cfg)}

    layers = tuple(LayerWeights(**fields(LAYER_PARAMS, layer_prefix(i))) for i in range(cfg.num_layers))
    return Weights(layers=layers, **fields(TOP_PARAMS))


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> HF shape for every tensor the decoder reads (the top-level ones first, then layer by layer)."""
    shapes = {p.hf_name: p.hf_shape(cfg) for p in TOP_PARAMS if p.when(cfg)}
    for i in range(cfg.num_layers):
        shapes.update({layer_prefix(i) + p.hf_name: p.hf_shape(cfg) for p in LAYER_PARAMS if p.when(cfg)})
    return shapes


def params_from_named_arrays(
    cfg: ModelConfig, named: Mapping[str, np.ndarray], dtype: str = "float32", head_copy: bool = False
) -> Weights:
    """Validate HF-named arrays against `cfg` and build the decoder's Weights (host numpy arrays in `dtype`; with
    `head_copy`, a tied model's LM head copy too: `copies_tied_head`).

    Raises ValueError naming the first missing, misshapen, non-float or unknown tensor; nothing is built until all
    are valid.
    """
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    shapes = expected_shapes(cfg)
    missing = [n for n in shapes if n not in named]
    if missing:
        raise ValueError(f"missing weight {missing[0]!r} ({len(missing)} missing in all)")
    for name, arr in named.items():
        if name in shapes:
            check_float_array(name, arr)
            if tuple(arr.shape) != shapes[name]:
                raise ValueError(f"weight {name!r} has shape {tuple(arr.shape)}, expected {shapes[name]}")
        elif name == "lm_head.weight" and cfg.tie_word_embeddings:
            # A tied model's state_dict still lists lm_head.weight (the same tensor as the embedding): skipped, once
            # it is seen to be that tensor (an untied trainer's head would otherwise be dropped without a word).
            embed = named["model.embed_tokens.weight"]
            if arr.shape != embed.shape or not np.array_equal(arr, embed, equal_nan=True):
                how = "differs from" if arr.shape == embed.shape else "has another shape than"
                raise ValueError(
                    f"weight 'lm_head.weight' {how} 'model.embed_tokens.weight', and this model ties them "
                    "(tie_word_embeddings)"
                )
        elif not name.endswith(_IGNORED_SUFFIXES):
            raise ValueError(f"unexpected weight {name!r} for a {cfg.family} model with {cfg.num_layers} layers")

    np_dtype = np.dtype(dtype)

    def get(param: Param, name: str) -> np.ndarray:
        # Cast before transposing (a cheaper copy in bf16) and make the result contiguous for the device transfer.
        src = np.asarray(named[name])
        arr = src.astype(np_dtype, copy=False)
        arr = np.ascontiguousarray(arr.T if param.transposed else arr)
        # Never the caller's memory: a pulled version may be a view of a sync buffer that later versions overwrite
        # (weight_sync), and on CPU device_put can keep using a host array in place.
        return arr.copy() if np.may_share_memory(arr, src) else arr

    weights = build_weights(cfg, get)
    return with_head_copy(weights) if head_copy else weights


def with_head_copy(weights: Weights) -> Weights:
    """A tied model's weights with `lm_head` set to the embedding transposed (`copies_tied_head`): the same
    products, summed in another order (fp32 logits move by ~1e-6 relative). Made on every weight load, so the copy
    is never stale."""
    return dataclasses.replace(weights, lm_head=np.ascontiguousarray(np.asarray(weights.embed).T))


def zero_weights(cfg: ModelConfig, dtype: str, head_copy: bool = False) -> Weights:
    """All-zero host weights of the right shapes: what an engine holds before its first load_weights()."""
    weights = build_weights(cfg, lambda p, _: np.zeros(p.shape(cfg), np.dtype(dtype)))
    return with_head_copy(weights) if head_copy else weights


def resolve_model_dir(model_path: str) -> str:
    """A local dir as is; anything else is treated as a hub id and fetched (config + safetensors only)."""
    if os.path.isdir(model_path):
        return model_path
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(model_path, allow_patterns=["*.json", "*.safetensors"])
    except Exception as e:  # offline, unknown repo, ...: one error that names what was asked for
        raise ValueError(
            f"model_path {model_path!r} is not a local dir and could not be fetched from the hub: "
            f"{type(e).__name__}: {e}"
        ) from e


def load_safetensors_dir(path: str) -> dict[str, np.ndarray]:
    """All tensors of the `*.safetensors` files in a dir (bf16 comes back as ml_dtypes.bfloat16)."""
    from safetensors.numpy import load_file

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in model dir {path!r}")
    named: dict[str, np.ndarray] = {}
    for file in files:
        named.update(load_file(file))
    return named
