"""Tensor parallelism for the decoder: a 1-D device mesh ("tp") and the partition spec of every weight and cache.

Megatron-style: q/k/v and gate/up projections are split by output columns (whole heads / MLP channels per device),
o_proj and down_proj by input rows, so each layer needs one all-reduce after attention and one after the MLP
(GSPMD inserts them). The KV cache is split on its kv-heads axis to follow k/v. Which axis of which weight is split
is declared in rollout.weight_table. With tp=1 the same code runs on a one-device mesh.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rollout.model_config import ModelConfig
from rollout.weight_table import LM_HEAD, Param
from rollout.weights import Weights, build_weights

AXIS = "tp"


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """ValueError naming the dimension that does not split evenly over `tp` devices (or too few devices)."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    available = len(jax.devices())
    if tp > available:
        raise ValueError(f"tp={tp} needs {tp} devices, only {available} available")
    for name, size in cfg.tp_sizes().items():
        if size % tp:
            raise ValueError(f"{name}={size} is not divisible by tp={tp}")


def make_mesh(tp: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:tp]), (AXIS,))


def param_spec(cfg: ModelConfig, param: Param, tp: int) -> P:
    """The tensor's split axis on the mesh; replicated when it is not split (`Param.split`)."""
    if not param.split(cfg, tp):
        return P()
    return P(*(AXIS if i == param.tp_axis else None for i in range(len(param.dims))))


def param_shardings(cfg: ModelConfig, mesh: Mesh, head_copy: bool = False) -> Weights:
    """NamedShardings in the structure of the decoder's Weights (None where a tensor is absent); with `head_copy`, a
    tied model's copy of the LM head (rollout.weights.with_head_copy) is split by vocab as an untied head is."""
    tp = mesh.shape[AXIS]
    shardings = build_weights(cfg, lambda p, _: NamedSharding(mesh, param_spec(cfg, p, tp)))
    if head_copy:
        shardings = dataclasses.replace(shardings, lm_head=NamedSharding(mesh, param_spec(cfg, LM_HEAD, tp)))
    return shardings


def cache_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(None, AXIS, None, None))  # kv_heads is axis 1 of K and V alike
