"""Shared-prompt rows (`TrainerConfig.share_prompts`): the attention mask that keeps a row's responses apart, and the
check that a model can take it.

A shared-prompt row is one prompt followed by several of its GRPO samples' responses (trainer/batching.py lays them
out). HF's decoder takes a custom 4D attention mask as it is, so this mask alone makes every response see its prompt
and itself, as it would in a row of its own; docs/design.md §4.12 says what it costs and when it pays.
"""

import torch
import transformers

from trainer.config import sliding_window_layers

# The attention implementations that take a custom 4D mask as it is (flash attention takes none).
SHARED_PROMPT_ATTENTION = ("sdpa", "eager")


def check_shared_prompts(config: transformers.PretrainedConfig) -> None:
    """Shared-prompt rows pass a custom 4D attention mask, which HF takes as it is: only SDPA and eager attention
    accept one, and it would replace a sliding window's mask rather than add to it."""
    attention = getattr(config, "_attn_implementation", None)
    if attention not in SHARED_PROMPT_ATTENTION:
        raise ValueError(
            f"train.share_prompts needs the model's attention to be one of {SHARED_PROMPT_ATTENTION}, "
            f"not {attention!r}; set train.share_prompts=false"
        )
    if sliding_window_layers(config.to_dict()):
        raise ValueError(
            "train.share_prompts does not support sliding-window attention layers (this model has layer_types "
            f"{getattr(config, 'layer_types', None)}, sliding_window {getattr(config, 'sliding_window', None)}); "
            "set train.share_prompts=false"
        )


def shared_prompt_mask(segments: torch.Tensor, attention: str | None, dtype: torch.dtype) -> torch.Tensor:
    """The [rows, 1, L, L] attention mask of shared-prompt rows (trainer/batching.py) from their segments: causal, and
    a response sees its prompt and itself, never the row's other responses. Boolean (True: attend) for SDPA; additive
    in the model's dtype for the eager implementation, which adds the mask to the scores. A padding query sees itself
    only, so that no row of the softmax is empty (that would be NaN, and NaN times a zero gradient is NaN)."""
    if attention not in SHARED_PROMPT_ATTENTION:
        raise ValueError(f"shared prompts need attn_implementation in {SHARED_PROMPT_ATTENTION}, not {attention!r}")
    q, k = segments[:, :, None], segments[:, None, :]
    length = segments.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segments.device).tril()
    allowed = causal & (k >= 0) & ((k == 0) | (k == q))
    allowed |= torch.eye(length, dtype=torch.bool, device=segments.device)
    allowed = allowed[:, None]
    if attention == "sdpa":
        return allowed
    additive = torch.zeros(allowed.shape, dtype=dtype, device=segments.device)
    return additive.masked_fill_(~allowed, torch.finfo(dtype).min)
