"""Tensor parallelism for the decoder: a 1-D device mesh ("tp") and the partition spec of every weight and cache.

Megatron-style: q/k/v and gate/up projections are split by output columns (whole heads / MLP channels per device),
o_proj and down_proj by input rows, so each layer needs one all-reduce after attention and one after the MLP
(GSPMD inserts them). The KV cache is split on its kv-heads axis to follow k/v. The untied LM head is split by vocab;
embeddings, norms and output biases are replicated. With tp=1 the same code runs on a one-device mesh.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rollout.config import ModelConfig

AXIS = "tp"

_LAYER_SPECS = {
    "wq": P(None, AXIS), "wk": P(None, AXIS), "wv": P(None, AXIS), "bq": P(AXIS), "bk": P(AXIS), "bv": P(AXIS),
    "wo": P(AXIS, None), "w_gate": P(None, AXIS), "w_up": P(None, AXIS), "b_gate": P(AXIS), "b_up": P(AXIS),
    "w_down": P(AXIS, None),
}


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """ValueError naming the dimension that does not split evenly over `tp` devices (or too few devices)."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    available = len(jax.devices())
    if tp > available:
        raise ValueError(f"tp={tp} needs {tp} devices, only {available} available")
    for name, size in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
                       ("intermediate_size", cfg.intermediate_size)):
        if size % tp:
            raise ValueError(f"{name}={size} is not divisible by tp={tp}")


def make_mesh(tp: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:tp]), (AXIS,))


def param_shardings(cfg: ModelConfig, mesh: Mesh, params: dict) -> dict:
    """A pytree of NamedShardings matching `params` (the decoder pytree of rollout.weights)."""
    tp = mesh.shape[AXIS]
    rep = NamedSharding(mesh, P())
    out = {"embed": rep, "final_norm": rep, "layers": [
        {name: NamedSharding(mesh, _LAYER_SPECS.get(name, P())) for name in layer} for layer in params["layers"]]}
    if "lm_head" in params:
        out["lm_head"] = NamedSharding(mesh, P(None, AXIS) if cfg.vocab_size % tp == 0 else P())
    return out


def cache_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(None, AXIS, None, None))     # [slots, kv_heads, T, head_dim]


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
