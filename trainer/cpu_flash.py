"""CPU's flash attention kernel with its backward in fp32, whatever the inputs' dtype.

The kernel (`_scaled_dot_product_flash_attention_for_cpu`, what SDPA runs on CPU) takes grouped-query heads and an
additive mask as they are. Its backward is ~2.8x slower in bf16 than in fp32: half of the tiny model's bf16 train step
and a third of a 30M model's. So the forward runs in the inputs' dtype (the log-probs are the kernel's, which the
engine reproduces: docs/design.md §3) and the backward upcasts the saved inputs, the output and its gradient, and
rounds the input gradients once: fp32 attention's gradients of the same forward, the more exact ones. fp32 models
keep SDPA's own calls (`takes_fp32_backward`): the same kernel and backward, and no graph break in a compiled layer.
"""

import torch

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
