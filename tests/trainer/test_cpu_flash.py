"""trainer/cpu_flash.py: CPU attention below fp32 whose backward runs in fp32.

Plain rows (no shared prompts) on CPU in bf16 go through `CPU_SDPA`: its outputs must be HF SDPA's exactly (the
log-probs do not move) and its input gradients fp32 attention's, rounded once. The shared-prompt paths are tested in
test_shared_prompts.py.
"""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from tests.trainer.conftest import assert_fp32_backward
from trainer import Trainer, TrainerConfig
from trainer.cpu_flash import CPU_SDPA, cpu_sdpa_attention

ROWS, HEADS, KV_HEADS, LENGTH, DIM = 3, 4, 2, 24, 8


def padded_causal_mask(lengths: list[int]) -> torch.Tensor:
    """HF's SDPA mask of right-padded rows, [rows, 1, L, L] boolean: causal over the real tokens; a padding query
    sees the real tokens (no row is empty)."""
    pos = torch.arange(LENGTH)
    real = pos[None, :] < torch.tensor(lengths)[:, None]  # [rows, L]
    return ((pos[None, :, None] >= pos[None, None, :]) & real[:, None, :])[:, None]


def output_and_grads(attention, mask, dtype, rounded_to=None):
    """`attention` (an HF attention function) on seeded inputs in `dtype` (first rounded to `rounded_to`) under
    `mask`: its output and the gradients of queries, keys and values for a random output gradient exact in bf16."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(ROWS, heads, LENGTH, DIM, generator=gen).to(rounded_to or dtype).to(dtype).requires_grad_()
        for heads in (HEADS, KV_HEADS, KV_HEADS)
    )
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, HEADS // KV_HEADS
    out, _ = attention(module, q, k, v, mask, scaling=0.3)
    (out.float() * torch.randn(out.shape, generator=gen).to(torch.bfloat16).float()).sum().backward()
    return out.detach(), [t.grad for t in (q, k, v)]


@pytest.mark.parametrize("mask", [None, padded_causal_mask([24, 17, 9])], ids=["causal", "padded"])
def test_plain_rows_in_bf16_equal_sdpa_and_backpropagate_in_fp32(mask):
    got, got_grads = output_and_grads(cpu_sdpa_attention, mask, torch.bfloat16)
    sdpa, sdpa_grads = output_and_grads(sdpa_attention_forward, mask, torch.bfloat16)
    _, want_grads = output_and_grads(sdpa_attention_forward, mask, torch.float32, rounded_to=torch.bfloat16)
    assert torch.equal(got, sdpa)  # the same kernel forward: the log-probs do not move
    assert_fp32_backward(got_grads, sdpa_grads, want_grads)


def test_fp32_rows_are_sdpa_itself():
    """In fp32 the function hands over to HF's SDPA: outputs and gradients bit for bit."""
    mask = padded_causal_mask([24, 17, 9])
    got, got_grads = output_and_grads(cpu_sdpa_attention, mask, torch.float32)
    want, want_grads = output_and_grads(sdpa_attention_forward, mask, torch.float32)
    assert torch.equal(got, want) and all(torch.equal(g, w) for g, w in zip(got_grads, want_grads))


@pytest.mark.parametrize("dtype, attention", [("bfloat16", CPU_SDPA), ("float32", "sdpa")])
def test_a_cpu_trainer_takes_cpu_sdpa_below_fp32(tiny_qwen3_dir, dtype, attention):
    trainer = Trainer(TrainerConfig(model_path=tiny_qwen3_dir, dtype=dtype))
    assert trainer.model.config._attn_implementation == attention
