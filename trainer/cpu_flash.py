"""CPU's flash attention kernel with its backward in fp32, whatever the inputs' dtype.

The kernel (`_scaled_dot_product_flash_attention_for_cpu`, what SDPA runs on CPU) takes grouped-query heads and an
additive mask as they are. Its backward is ~2.8x slower in bf16 than in fp32: half of the tiny model's bf16 train step
and a third of a 30M model's. So the forward runs in the inputs' dtype (the log-probs are the kernel's, which the
engine reproduces: docs/design.md §3) and the backward upcasts the saved inputs, the output and its gradient, and
rounds the input gradients once: fp32 attention's gradients of the same forward, the more exact ones. fp32 models
keep SDPA's own calls (`takes_fp32_backward`): the same kernel and backward, and no graph break in a compiled layer.
The shared-prompt paths call it for their pieces (trainer/shared_prompts.py, trainer/split_attention.py); plain rows
take it through `CPU_SDPA`, an HF attention function.
"""

import torch
import transformers
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

CPU_SDPA = "rlloop_cpu_sdpa"  # HF's SDPA, through `cpu_flash_attention` where that takes an fp32 backward

flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def takes_fp32_backward(query: torch.Tensor, dropout: float) -> bool:
    """Whether attention on `query` goes through `cpu_flash_attention`: on CPU, below fp32, without dropout."""
    return query.device.type == "cpu" and query.dtype != torch.float32 and not dropout


@torch.compiler.disable  # a compiled layer (`train.compile`) runs it eagerly: dynamo cannot trace this Function
def cpu_flash_attention(query, key, value, causal: bool, mask: torch.Tensor | None, scale: float | None):
    """Attention of query [B, H, T, D] over key/value [B, KV, S, D] (H a multiple of KV) under an additive mask
    broadcasting to [B, H, T, S] or none; returns [B, H, T, D]. No dropout."""
    return _FlashFp32Backward.apply(query, key, value, causal, mask, scale)


class _FlashFp32Backward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, causal, mask, scale):
        out, lse = flash(query, key, value, 0.0, causal, attn_mask=mask, scale=scale)
        ctx.causal, ctx.scale = causal, scale
        ctx.save_for_backward(query, key, value, out, lse, mask)
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, lse, mask = ctx.saved_tensors
        upcast = (t.float() for t in (grad, query, key, value, out))
        mask = None if mask is None else mask.float()  # exact: an additive bf16 mask's values are fp32 values
        dq, dk, dv = flash_backward(*upcast, lse, 0.0, ctx.causal, attn_mask=mask, scale=ctx.scale)
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None, None, None


def use_cpu_sdpa(model: transformers.PreTrainedModel) -> None:
    """Switch an SDPA model to `CPU_SDPA` (the trainer's plain rows on CPU below fp32); others stay as they are."""
    if model.config._attn_implementation != "sdpa":
        return
    transformers.AttentionInterface.register(CPU_SDPA, cpu_sdpa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(CPU_SDPA, sdpa_mask)  # the masks HF makes for SDPA
    model.set_attn_implementation(CPU_SDPA)


def cpu_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """HF attention function of `CPU_SDPA`: what `sdpa_attention_forward` computes, through `cpu_flash_attention` for
    the training case (several queries, no position bias, below fp32 on CPU) with SDPA's own choices: causal without a
    mask, a boolean mask made additive as SDPA makes it. Anything else goes to HF's SDPA."""
    decoding_or_biased = query.shape[2] == 1 or kwargs.get("position_bias") is not None or kwargs.get("softcap")
    if decoding_or_biased or not takes_fp32_backward(query, dropout):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    causal = attention_mask is None and (is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
            ~attention_mask, float("-inf")
        )
    if causal and key.shape[2] > query.shape[2]:  # as HF's SDPA: the kernel's causal mask is aligned top-left
        key, value = key[:, :, : query.shape[2]], value[:, :, : query.shape[2]]
    out = cpu_flash_attention(query, key, value, causal, attention_mask, scaling)
    return out.transpose(1, 2).contiguous(), None
