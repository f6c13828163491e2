"""What the trainer can train of a model, read from its transformers config: the probes that the driver's model
check (rlloop/model.py) and the trainer itself ask. Imports no torch, so the driver can ask before anything loads."""

from __future__ import annotations


def sliding_window_layers(config) -> bool:
    """Whether a model (its transformers config, as transformers built it) has sliding-window attention layers, which
    `share_prompts` cannot train: HF would take its 4D mask in place of the window's. The built config, not
    config.json: Qwen2's `sliding_window` is only used with `use_sliding_window` and from `max_window_layers` on,
    which transformers resolves into `layer_types`; a model without `layer_types` (Mistral) slides wherever the window
    is set."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return "sliding_attention" in layer_types
    return getattr(config, "sliding_window", None) is not None


def position_bias_from_columns(config) -> bool:
    """Whether a model adds ALiBi biases by the key's column in the row (Bloom, MPT, Falcon with `alibi`) rather than
    by `position_ids`: in a shared-prompt row a later response's biases would be another sample's."""
    return getattr(config, "model_type", None) in ("bloom", "mpt") or bool(getattr(config, "alibi", False))


# Scalings of the logits that the trainer's chunked LM head (trainer/logprobs.py) does not apply: Gemma 2's soft-cap,
# Cohere's logit_scale, Granite's logits_scaling, and the like
LOGIT_SCALINGS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier")


def unapplied_logit_scaling(config) -> str | None:
    """The first of LOGIT_SCALINGS the model sets (to anything but 1), or None."""
    return next((knob for knob in LOGIT_SCALINGS if getattr(config, knob, None) not in (None, 1.0)), None)
