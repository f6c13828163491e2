"""The model a run names, checked from the driver: its config must load and its tokenizer is returned.

Both fail here with the key named (`ModelError`, exit code 2) rather than as a traceback from inside an actor
minutes later; the usual cause is a hub id with no network.
"""

from __future__ import annotations

from pathlib import Path

from rlloop.config import ModelSection


class ModelError(ValueError):
    """The model or tokenizer a config names cannot be loaded; the message names the key."""


def load_tokenizer(model: ModelSection):
    """The tokenizer of `model.tokenizer` (default `model.path`), after checking that `model.path` holds a model
    config."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer_key = "model.tokenizer" if model.tokenizer else "model.path"
    for key, loader in (("model.path", AutoConfig), (tokenizer_key, AutoTokenizer)):
        source = model.tokenizer if key == "model.tokenizer" else model.path
        local = Path(source).exists() or source.startswith(("/", "."))
        if local and not Path(source).is_dir():
            raise ModelError(f"{key}: {source!r} is not a directory")
        try:
            loaded = loader.from_pretrained(source)
        except (OSError, ValueError) as e:
            reason = " ".join(str(e).split())[:400] or type(e).__name__
            hint = (
                ""
                if local
                else (
                    f"\n(offline? download it beforehand, e.g. `hf download {source}`, or set {key} "
                    "to a local directory)"
                )
            )
            raise ModelError(f"{key}: cannot load {source!r}: {reason}{hint}") from None
    return loaded


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """The tokenizer's EOS id. The engines add the model's own EOS ids (generation_config.json, e.g. Qwen3's 151645
    and 151643), so those are read in one place, rollout's model config."""
    return () if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),)
