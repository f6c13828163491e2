"""The benchmarks' models and requests: the shipped tiny model or a random Qwen3 of a named size, saved as an HF
checkpoint without EOS ids (so every engine generates exactly the tokens asked for), and random prompts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from rlloop import tiny

TINY_ASSET = Path(__file__).resolve().parents[1] / "assets" / "tiny" / "model"

# name -> Qwen3 config overrides; "tiny" is only used when the shipped asset is missing.
MODEL_SPECS = {
    "tiny": dict(vocab_size=99, **tiny.SHAPE),
    "30m": dict(
        vocab_size=32000,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=12,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
    ),
}


def save_random_qwen3(path: Path, seed: int = 0, **overrides) -> Path:
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
        **overrides,
    )
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return without_eos(path)


def without_eos(path: Path) -> Path:
    """Drop the EOS ids from a saved checkpoint, so no engine can end a row early whatever its EOS policy."""
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["eos_token_id"] = None
    cfg_file.write_text(json.dumps(cfg, indent=2))
    (path / "generation_config.json").unlink(missing_ok=True)
    return path


def model_dir(name: str, workdir: Path) -> Path:
    if name == "tiny" and (TINY_ASSET / "config.json").exists():
        shutil.copytree(TINY_ASSET, workdir / name)
        return without_eos(workdir / name)
    if name not in MODEL_SPECS:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODEL_SPECS)}")
    return save_random_qwen3(workdir / name, **MODEL_SPECS[name])


def make_prompts(num_prompts: int, vocab: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(rng.integers(min_len, max_len + 1))).tolist() for _ in range(num_prompts)]
