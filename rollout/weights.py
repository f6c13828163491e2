"""Hugging Face parameter names -> the JAX decoder's pytree: the one place that knows the name mapping.

Weights arrive as a flat dict of numpy / ml_dtypes arrays keyed by HF names, either from the weight-sync layer or
read from the safetensors files of a model dir. The decoder wants per-layer dicts of matrices laid out for `x @ W`
(HF stores nn.Linear weights as [out, in], so they are transposed here, once, on the host).

Pytree: {"embed": [V, D], "final_norm": [D], "lm_head": [D, V] (untied only), "layers": [ {name: array}, ... ]}
"""
from __future__ import annotations

import glob
import os
from typing import Mapping

import ml_dtypes
import numpy as np

from rollout.config import ModelConfig

# decoder name -> (HF name inside `model.layers.{i}.`, transpose?)
_LAYER_NAMES = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "bo": ("self_attn.o_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
    "b_gate": ("mlp.gate_proj.bias", False),
    "b_up": ("mlp.up_proj.bias", False),
    "b_down": ("mlp.down_proj.bias", False),
}
# Names a checkpoint may carry that the decoder does not need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def layer_param_names(cfg: ModelConfig) -> list[str]:
    """Decoder names present in each layer for this config (the family switches decide the optional ones)."""
    names = ["attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"]
    if cfg.qkv_bias:
        names += ["bq", "bk", "bv"]
    if cfg.o_bias:
        names += ["bo"]
    if cfg.qk_norm:
        names += ["q_norm", "k_norm"]
    if cfg.mlp_bias:
        names += ["b_gate", "b_up", "b_down"]
    return names


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> HF shape for every tensor the decoder reads."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    per_layer = {
        "attn_norm": (d,), "mlp_norm": (d,), "wq": (cfg.q_size, d), "wk": (cfg.kv_size, d), "wv": (cfg.kv_size, d),
        "wo": (d, cfg.q_size), "bq": (cfg.q_size,), "bk": (cfg.kv_size,), "bv": (cfg.kv_size,), "bo": (d,),
        "q_norm": (hd,), "k_norm": (hd,), "w_gate": (f, d), "w_up": (f, d), "w_down": (d, f),
        "b_gate": (f,), "b_up": (f,), "b_down": (d,),
    }
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.num_layers):
        for name in layer_param_names(cfg):
            shapes[f"model.layers.{i}.{_LAYER_NAMES[name][0]}"] = per_layer[name]
    return shapes


def params_from_named_arrays(cfg: ModelConfig, named: Mapping[str, np.ndarray], dtype: str = "float32") -> dict:
    """Validate HF-named arrays against `cfg` and build the decoder pytree (host numpy arrays in `dtype`).

    Raises ValueError naming the first missing, misshapen or unknown tensor; nothing is built until all are valid.
    """
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    shapes = expected_shapes(cfg)
    missing = [n for n in shapes if n not in named]
    if missing:
        raise ValueError(f"missing weight {missing[0]!r} ({len(missing)} missing in all)")
    for name, arr in named.items():
        if name in shapes:
            if tuple(arr.shape) != shapes[name]:
                raise ValueError(f"weight {name!r} has shape {tuple(arr.shape)}, expected {shapes[name]}")
        elif not (name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_word_embeddings)):
            # A tied model's state_dict still lists lm_head.weight (the same tensor as the embedding): skip it.
            raise ValueError(f"unexpected weight {name!r} for a {cfg.family} model with {cfg.num_layers} layers")

    np_dtype = DTYPES[dtype]

    def get(name: str, transpose: bool = False) -> np.ndarray:
        arr = np.asarray(named[name])
        # Cast before transposing (a cheaper copy in bf16) and make the result contiguous for the device transfer.
        arr = arr.astype(np_dtype, copy=False)
        return np.ascontiguousarray(arr.T if transpose else arr)

    params = {"embed": get("model.embed_tokens.weight"), "final_norm": get("model.norm.weight"), "layers": []}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = get("lm_head.weight", transpose=True)
    for i in range(cfg.num_layers):
        params["layers"].append({name: get(f"model.layers.{i}.{_LAYER_NAMES[name][0]}", _LAYER_NAMES[name][1])
                                 for name in layer_param_names(cfg)})
    return params


def param_shapes(cfg: ModelConfig) -> dict:
    """The decoder pytree's shapes (tuples as leaves), for building zero weights before any load."""
    hf = expected_shapes(cfg)
    tree = {"embed": hf["model.embed_tokens.weight"], "final_norm": hf["model.norm.weight"], "layers": []}
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = hf["lm_head.weight"][::-1]
    for i in range(cfg.num_layers):
        layer = {}
        for name in layer_param_names(cfg):
            hf_name, transpose = _LAYER_NAMES[name]
            shape = hf[f"model.layers.{i}.{hf_name}"]
            layer[name] = shape[::-1] if transpose else shape
        tree["layers"].append(layer)
    return tree


def resolve_model_dir(model_path: str) -> str:
    """A local dir as is; anything else is treated as a hub id and fetched (config + safetensors only)."""
    if os.path.isdir(model_path):
        return model_path
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(model_path, allow_patterns=["*.json", "*.safetensors"])
    except Exception as e:  # offline, unknown repo, ...: one error that names what was asked for
        raise ValueError(f"model_path {model_path!r} is not a local dir and could not be fetched from the hub: "
                         f"{type(e).__name__}: {e}") from e


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
