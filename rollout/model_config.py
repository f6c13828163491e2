"""The decoder's model config, read from a Hugging Face `config.json`, with the per-family differences in one place.

Qwen3, Qwen2 and Llama share one decoder (RMSNorm, GQA, RoPE, SwiGLU); they differ only in a few switches:
  qwen3: per-head RMSNorm on q and k before RoPE, explicit head_dim, optional attention bias (off in released models)
  qwen2: q/k/v biases, head_dim = hidden / heads
  llama: optional attention / MLP biases, RoPE scaling ("llama3")
Both the transformers-5 layout (`rope_parameters`) and the older one (`rope_theta` + `rope_scaling`) are accepted.
This is the model's architecture, not the engine's settings (those are rollout.engine_config.EngineConfig).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import numpy as np

FAMILIES = ("qwen3", "qwen2", "llama")


def eos_token_ids(hf_config: dict, generation_config: dict | None = None) -> tuple[int, ...]:
    """The model's EOS ids: generation_config.json's `eos_token_id` when it sets one, else config.json's.

    Either may hold one id, a list of them, or nothing (Qwen3's generation config lists 151645 and 151643). Both
    backends read them here, so they stop rows on the same ids.
    """
    eos = (generation_config or {}).get("eos_token_id")
    if eos is None:
        eos = hf_config.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else (eos,)))


def _has_sliding_layers(hf: dict) -> bool:
    """Whether some layer of this config.json may attend through a sliding window: its `layer_types` (what
    transformers runs) where the file has them, else `use_sliding_window` (refused even where `max_window_layers`
    would keep every layer whole: reading transformers' config here would load torch into the engine)."""
    layer_types = hf.get("layer_types")
    return "sliding_attention" in layer_types if layer_types is not None else bool(hf.get("use_sliding_window"))


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # HF rope parameters beyond theta as sorted (key, value) pairs (hashable: the config is a static jit argument);
    # None for plain RoPE
    rope_scaling: tuple[tuple[str, object], ...] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def tp_sizes(self) -> dict[str, int]:
        """The dimensions tensor parallelism splits (rollout.sharding): each must divide by the tp size."""
        return {
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "intermediate_size": self.intermediate_size,
        }

    def splits_over(self, tp: int) -> bool:
        return all(size % tp == 0 for size in self.tp_sizes().values())

    @classmethod
    def from_hf_dict(cls, hf: dict, generation_config: dict | None = None) -> "ModelConfig":
        model_type = hf.get("model_type", "")
        family = {"qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama"}.get(model_type)
        if family is None:
            raise ValueError(f"unsupported model_type {model_type!r}; the JAX decoder supports {', '.join(FAMILIES)}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf.get('hidden_act')!r}; expected 'silu' (SwiGLU)")
        if _has_sliding_layers(hf):
            raise ValueError(
                "unsupported: sliding-window attention (use_sliding_window / layer_types); the JAX decoder attends "
                "over the whole sequence, so it would decode another model than transformers does"
            )
        heads = hf["num_attention_heads"]
        # What transformers takes for a config.json without head_dim: Qwen3Config's 128, the others' hidden / heads.
        head_dim = hf.get("head_dim") or (128 if family == "qwen3" else hf["hidden_size"] // heads)
        # transformers' precedence (convert_rope_params_to_dict): `rope_scaling` (the 4.x layout, and what model
        # cards say to add to config.json for long context) replaces `rope_parameters`, theta included
        rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"unsupported rope_type {rope_type!r}; supported: 'default', 'llama3'")
        if rope_type == "llama3":  # transformers takes the model's context for a missing original one
            rope.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
            for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                if isinstance(rope.get(key), bool) or not isinstance(rope.get(key), (int, float)):
                    raise ValueError(f"rope_type 'llama3' needs a number for {key}, got {rope.get(key)!r}")
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            family=family,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=None if rope_type == "default" else tuple(sorted({**rope, "rope_type": rope_type}.items())),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=attention_bias and family != "qwen2",
            mlp_bias=family == "llama" and bool(hf.get("mlp_bias", False)),  # Qwen's MLPs have none, whatever it says
            qk_norm=family == "qwen3",
            eos_token_ids=eos_token_ids(hf, generation_config),
        )

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        """Read `config.json` (and the eos ids of `generation_config.json` when present) from a local model dir."""
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise ValueError(f"no config.json in model dir {path!r}")
        with open(cfg_file) as f:
            hf = json.load(f)
        gen = None
        gen_file = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_file):
            with open(gen_file) as f:
                gen = json.load(f)
        return cls.from_hf_dict(hf, gen)

    def rope_inv_freq(self) -> np.ndarray:
        """Inverse RoPE frequencies [head_dim // 2] in float32, with Llama 3 scaling applied when configured."""
        inv_freq = 1.0 / (
            self.rope_theta ** (np.arange(0, self.head_dim, 2, dtype=np.int64).astype(np.float32) / self.head_dim)
        )
        if self.rope_scaling is None:
            return inv_freq.astype(np.float32)
        # Llama 3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly
        # (transformers' _compute_llama3_parameters).
        s = dict(self.rope_scaling)
        factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old_ctx = float(s["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
