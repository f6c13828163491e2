"""The decoder's weight table: every tensor declared once (HF name, the decoder's layout and shape, tensor-parallel
split, the family switch that makes it present). `rollout.weights` builds the typed pytree and the loading from it,
`rollout.sharding` the shardings, `rollout.cost` the parameter and memory counts. It imports no JAX, so the driver
can plan memory (rlloop/memory.py) without paying for JAX's import where the engine runs elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from rollout.model_config import ModelConfig


@dataclass(frozen=True)
class Param:
    """One decoder tensor."""

    field: str  # its field in Weights / LayerWeights
    hf_name: str  # HF name; for a layer tensor, the part after "model.layers.{i}."
    dims: tuple[str, ...]  # the decoder's shape, as ModelConfig sizes (see `dim_sizes`)
    tp_axis: int | None = None  # the axis split over the tensor-parallel mesh (None: replicated)
    transposed: bool = False  # HF stores it [out, in] (nn.Linear), the decoder [in, out]
    when: Callable[[ModelConfig], bool] = lambda cfg: True  # the family switch that makes it present

    def shape(self, cfg: ModelConfig) -> tuple[int, ...]:
        sizes = dim_sizes(cfg)
        return tuple(sizes[d] for d in self.dims)

    def hf_shape(self, cfg: ModelConfig) -> tuple[int, ...]:
        return self.shape(cfg)[::-1] if self.transposed else self.shape(cfg)

    def split(self, cfg: ModelConfig, tp: int) -> bool:
        """Whether the tensor is split over a `tp`-device mesh: it has a split axis and that axis divides by tp
        (only the LM head's may not: rollout.sharding.check_tp guarantees heads and MLP channels divide)."""
        return self.tp_axis is not None and self.shape(cfg)[self.tp_axis] % tp == 0


def dim_sizes(cfg: ModelConfig) -> dict[str, int]:
    return {
        "vocab": cfg.vocab_size,
        "d": cfg.hidden_size,
        "q": cfg.q_size,
        "kv": cfg.kv_size,
        "head_dim": cfg.head_dim,
        "mlp": cfg.intermediate_size,
    }


# A tied model reuses the embedding; its state_dict may still list lm_head.weight (skipped on load).
LM_HEAD = Param(
    "lm_head",
    "lm_head.weight",
    ("d", "vocab"),
    tp_axis=1,
    transposed=True,
    when=lambda cfg: not cfg.tie_word_embeddings,
)
# Megatron-style tensor parallelism: q/k/v and gate/up split by output columns, o/down by input rows, the untied LM
# head by vocab; embeddings, norms and output biases are replicated.
TOP_PARAMS = (
    Param("embed", "model.embed_tokens.weight", ("vocab", "d")),
    Param("final_norm", "model.norm.weight", ("d",)),
    LM_HEAD,
)
LAYER_PARAMS = (
    Param("attn_norm", "input_layernorm.weight", ("d",)),
    Param("wq", "self_attn.q_proj.weight", ("d", "q"), tp_axis=1, transposed=True),
    Param("wk", "self_attn.k_proj.weight", ("d", "kv"), tp_axis=1, transposed=True),
    Param("wv", "self_attn.v_proj.weight", ("d", "kv"), tp_axis=1, transposed=True),
    Param("wo", "self_attn.o_proj.weight", ("q", "d"), tp_axis=0, transposed=True),
    Param("mlp_norm", "post_attention_layernorm.weight", ("d",)),
    Param("w_gate", "mlp.gate_proj.weight", ("d", "mlp"), tp_axis=1, transposed=True),
    Param("w_up", "mlp.up_proj.weight", ("d", "mlp"), tp_axis=1, transposed=True),
    Param("w_down", "mlp.down_proj.weight", ("mlp", "d"), tp_axis=0, transposed=True),
    Param("bq", "self_attn.q_proj.bias", ("q",), tp_axis=0, when=lambda cfg: cfg.qkv_bias),
    Param("bk", "self_attn.k_proj.bias", ("kv",), tp_axis=0, when=lambda cfg: cfg.qkv_bias),
    Param("bv", "self_attn.v_proj.bias", ("kv",), tp_axis=0, when=lambda cfg: cfg.qkv_bias),
    Param("bo", "self_attn.o_proj.bias", ("d",), when=lambda cfg: cfg.o_bias),
    Param("q_norm", "self_attn.q_norm.weight", ("head_dim",), when=lambda cfg: cfg.qk_norm),
    Param("k_norm", "self_attn.k_norm.weight", ("head_dim",), when=lambda cfg: cfg.qk_norm),
    Param("b_gate", "mlp.gate_proj.bias", ("mlp",), tp_axis=0, when=lambda cfg: cfg.mlp_bias),
    Param("b_up", "mlp.up_proj.bias", ("mlp",), tp_axis=0, when=lambda cfg: cfg.mlp_bias),
    Param("b_down", "mlp.down_proj.bias", ("d",), when=lambda cfg: cfg.mlp_bias),
)


def copies_tied_head(cfg: ModelConfig, platform: str) -> bool:
    """Whether an engine on `platform` (a JAX platform: cpu, gpu, tpu) holds a tied model's LM head as a copy of the
    embedding in the head's own [D, V] layout (`with_head_copy`). On XLA:CPU on an AVX-512 Zen 4 the 32-row
    [N, D] x [D, V] product of a decode step runs ~1.1x faster than [N, D] x [V, D]^T, and the head is a third of
    the step, for V x D more memory (on an AVX2 Zen 3 it is 1.18x slower: ~4 % of a step; docs/benchmarks-history.md,
    rollout). Accelerators take either layout at full speed."""
    return cfg.tie_word_embeddings and platform == "cpu"
