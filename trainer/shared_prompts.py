"""Shared-prompt rows (`TrainerConfig.share_prompts`): the attention that keeps a row's responses apart, and the
check that a model can take it.

A shared-prompt row is one prompt followed by several of its GRPO samples' responses (trainer/batching.py lays them
out). HF's decoder takes a custom 4D attention mask as it is, so a mask alone makes every response see its prompt and
itself, as it would in a row of its own. A dense [L, L] mask makes attention cost L^2 per row, though, and with long
responses most of it is masked: eight 128-token responses after a 100-token prompt leave 14% of it to compute. So an
SDPA model attends in pieces instead (`shared_prompt_attention`):

- on CPU where responses are long, split by keys (trainer/split_attention.py): the prompt's queries against the
  prompt, the responses' against the prompt, each response against itself, merged by log-sum-exp;
- elsewhere where responses are long, in blocks: the row is cut into blocks of c >= the longest response, and each
  block's queries attend to the prompt and to their block and the one before it (which hold all of a response that
  ends in the block). That is the same softmax over the same keys, in SDPA calls over [P + 2c] keys instead of L;
- else with the mask's rows cut at the micro-batch's shortest prompt: the queries before that cut are prompt tokens
  that see the prompt causally, which SDPA computes without a mask and without the half above the diagonal; only the
  queries after it take the mask.

docs/design.md §4.12 says what each costs and when it pays.
"""

import torch
import torch.nn.functional as F
import transformers
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from trainer.cpu_flash import cpu_flash_attention, takes_fp32_backward
from trainer.model_support import position_bias_from_columns, sliding_window_layers
from trainer.split_attention import split_attention

# The attention implementations that take a custom 4D mask as it is (flash attention takes none).
SHARED_PROMPT_ATTENTION = ("sdpa", "eager")
# An SDPA model's implementation under shared prompts: SDPA in blocks where they pay, else cut at the shortest prompt.
BLOCKED_SDPA = "rlloop_shared_prompts"
# Blocks are used when they compute at most this fraction of the dense mask's [L, L] scores. They copy the prompt's
# keys into every block, so they must save a lot to pay: on 2 CPU cores, 0.32 of the scores (8 x 128-token responses)
# ran 2.6x faster than dense, 0.65 (8 x 16) 1.45x slower.
BLOCKED_BELOW = 0.4
BLOCK_ALIGN = 8  # block sizes are rounded up to this many positions
# On CPU, attention is split by keys from responses this long on: on 2 cores, one layer's forward and backward at 16
# rows of a 101-token prompt and 8 responses ran 1.4x slower than the cut mask at 16 tokens, as fast at 32, 2.8x
# faster at 128 (1.5x faster than blocks).
SPLIT_FROM = 32


def check_shared_prompts(config: transformers.PretrainedConfig) -> None:
    """Shared-prompt rows pass a custom 4D attention mask, which HF takes as it is: only SDPA and eager attention
    accept one, and it would replace a sliding window's mask rather than add to it."""
    attention = getattr(config, "_attn_implementation", None)
    if attention not in (*SHARED_PROMPT_ATTENTION, BLOCKED_SDPA):
        raise ValueError(
            f"train.share_prompts needs the model's attention to be one of {SHARED_PROMPT_ATTENTION}, "
            f"not {attention!r}; set train.share_prompts=false"
        )
    if position_bias_from_columns(config):
        raise ValueError(
            f"train.share_prompts does not support ALiBi position biases ({config.model_type}), which follow a key's "
            "column in the row, not its position; set train.share_prompts=false"
        )
    if sliding_window_layers(config):
        raise ValueError(
            "train.share_prompts does not support sliding-window attention layers (this model has layer_types "
            f"{getattr(config, 'layer_types', None)}, sliding_window {getattr(config, 'sliding_window', None)}); "
            "set train.share_prompts=false"
        )


def use_blocked_attention(model: transformers.PreTrainedModel) -> None:
    """Switch an SDPA model to `shared_prompt_attention` (SDPA in blocks or cut at the shortest prompt); others stay as
    they are."""
    if model.config._attn_implementation != "sdpa":
        return
    transformers.AttentionInterface.register(BLOCKED_SDPA, shared_prompt_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(BLOCKED_SDPA, sdpa_mask)  # a 2D padding mask works as under SDPA
    model.set_attn_implementation(BLOCKED_SDPA)


def shared_prompt_mask(segments: torch.Tensor, attention: str | None, dtype: torch.dtype) -> torch.Tensor:
    """The attention mask of shared-prompt rows (trainer/batching.py) from their segments: causal, and a response sees
    its prompt and itself, never the row's other responses. For `BLOCKED_SDPA` the blocks' mask where blocks pay
    (`block_mask`), else the dense mask's rows from the shortest prompt on (`prompt_cut`); on CPU from responses of
    `SPLIT_FROM` tokens on, the segments as a [rows, 1, 1, L] integer tensor (`split_attention`). For SDPA the dense
    [rows, 1, L, L] mask, boolean (True: attend); additive in the model's dtype for the others (eager attention adds
    the mask to the scores). A padding query sees itself only, so that no row of the softmax is empty (that would be
    NaN, and NaN times a zero gradient is NaN)."""
    if attention not in (*SHARED_PROMPT_ATTENTION, BLOCKED_SDPA):
        raise ValueError(f"shared prompts need attn_implementation in {SHARED_PROMPT_ATTENTION}, not {attention!r}")
    if attention == BLOCKED_SDPA and segments.device.type == "cpu" and longest_response(segments) >= SPLIT_FROM:
        return segments[:, None, None]  # the segments themselves: `split_attention` plans from them
    if attention == BLOCKED_SDPA and (blocks := block_mask(segments)) is not None:
        return blocks
    cut = prompt_cut(segments) if attention == BLOCKED_SDPA else 0  # the mask's rows (queries) from `cut` on
    q, k = segments[:, cut:, None], segments[:, None, :]
    q_pos = torch.arange(cut, segments.shape[1], device=segments.device)[:, None]
    k_pos = torch.arange(segments.shape[1], device=segments.device)
    allowed = (((k_pos <= q_pos) & (k >= 0) & ((k == 0) | (k == q))) | (k_pos == q_pos))[:, None]  # | itself
    if attention == "sdpa":
        return allowed
    additive = torch.zeros(allowed.shape, dtype=dtype, device=segments.device)
    return additive.masked_fill_(~allowed, torch.finfo(dtype).min)


def prompt_cut(segments: torch.Tensor) -> int:
    """The micro-batch's shortest prompt (padding rows aside): the columns before it hold prompt tokens in every row
    that has one, so their queries attend causally to them alone."""
    prompts = (segments == 0).sum(1)
    prompts = prompts[prompts > 0]
    return int(prompts.min()) if prompts.numel() else 0


def longest_response(segments: torch.Tensor) -> int:
    """The micro-batch's longest response (1 if it has none)."""
    ids = torch.arange(1, int(segments.max()) + 1, device=segments.device)
    return int((segments[:, :, None] == ids).sum(1).max()) if ids.numel() else 1


def block_mask(segments: torch.Tensor) -> torch.Tensor | None:
    """The [rows * blocks, 1, c, P + 2c] boolean mask of `shared_prompt_attention`'s blocks, or None where they would
    not save enough of the dense mask's scores (`BLOCKED_BELOW`; the mask cut at the shortest prompt serves then). P is
    the micro-batch's longest prompt, c >= its longest response. Block b holds the queries at columns [b c, (b + 1) c);
    its keys are the row's first P columns (the prompt, causal for prompt queries) and columns [(b - 1) c, (b + 1) c)
    (the query's own response, causal). A padding query sees the row's first column, so that no row of the softmax is
    empty."""
    rows, length = segments.shape
    device = segments.device
    prompt = max(1, int((segments == 0).sum(1).max()))  # a filler micro-batch of padding rows has none
    c = -(-longest_response(segments) // BLOCK_ALIGN) * BLOCK_ALIGN
    blocks = -(-length // c)
    if blocks * c * (prompt + 2 * c) > BLOCKED_BELOW * length * length:
        return None
    seg = F.pad(segments, (0, blocks * c - length), value=-1)
    q_seg, q_pos = seg.view(rows, blocks, c, 1), torch.arange(blocks * c, device=device).view(blocks, c, 1)
    k_pos = torch.arange(prompt, device=device)
    to_prompt = (seg[:, None, None, :prompt] == 0) & ((q_seg >= 1) | ((q_seg == 0) & (k_pos <= q_pos)))
    to_prompt[..., 0] |= q_seg[..., 0] < 0
    w_seg = F.pad(seg, (c, 0), value=-1).unfold(1, 2 * c, c)[:, :, None]  # [rows, blocks, 1, 2c]
    w_pos = (torch.arange(2 * c, device=device) + torch.arange(blocks, device=device)[:, None] * c - c)[:, None]
    to_window = (q_seg >= 1) & (w_seg == q_seg) & (w_pos <= q_pos)
    return torch.cat([to_prompt, to_window], -1).view(rows * blocks, 1, c, prompt + 2 * c)


def shared_prompt_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """HF attention function of `BLOCKED_SDPA`: the same attention as HF's SDPA under the dense mask, from the mask
    `shared_prompt_mask` made for it, which says how: the segments (an integer tensor) split by keys, the dense mask's
    last rows (a [rows, 1, L - cut, L] mask) or `block_mask`'s blocks. query [rows, H, L, D], key/value
    [rows, KV, L, D]; returns [rows, L, H, D] and no weights, as HF's SDPA does."""
    if attention_mask is not None and not attention_mask.is_floating_point() and attention_mask.dtype != torch.bool:
        if dropout:  # its backward would need each part's dropout mask; the trainer keeps the model in eval mode
            raise ValueError("shared-prompt attention split by keys computes no attention dropout")
        return split_attention(query, key, value, attention_mask[:, 0, 0], scaling), None
    if attention_mask is None or attention_mask.shape[-2] == query.shape[-2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if attention_mask.shape[-1] == query.shape[-2]:  # blocks have P + 2c > L keys
        return cut_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    return block_attention(query, key, value, attention_mask, dropout, scaling), None


def block_attention(query, key, value, mask, dropout=0.0, scaling=None) -> torch.Tensor:
    """`shared_prompt_attention` in `block_mask`'s blocks ([rows * blocks, 1, c, P + 2c]): block b's queries attend to
    the row's first P keys and to blocks b - 1 and b."""
    rows, heads, length, dim = query.shape
    c = mask.shape[-2]
    blocks, prompt = mask.shape[0] // rows, mask.shape[-1] - 2 * c
    pad = blocks * c - length
    q = F.pad(query, (0, 0, 0, pad)).view(rows, heads, blocks, c, dim).transpose(1, 2).reshape(-1, heads, c, dim)

    def block_keys(t: torch.Tensor) -> torch.Tensor:  # [rows, KV, L, D] -> [rows * blocks, KV, P + 2c, D]
        kv = t.shape[1]
        own = F.pad(t, (0, 0, 0, pad)).view(rows, kv, blocks, c, dim).transpose(1, 2)  # [rows, blocks, KV, c, D]
        before = F.pad(own, (0, 0, 0, 0, 0, 0, 1, 0))[:, :-1]  # block b - 1 (zeros before the first)
        first = t[:, None, :, :prompt].expand(rows, blocks, kv, prompt, dim)
        return torch.cat([first, before, own], 3).reshape(rows * blocks, kv, prompt + 2 * c, dim)

    out = masked_sdpa(q, block_keys(key), block_keys(value), mask, dropout, scaling)
    out = out.view(rows, blocks, heads, c, dim).transpose(2, 3).reshape(rows, blocks * c, heads, dim)
    return out[:, :length].contiguous()


def cut_attention(module, query, key, value, rest_mask, dropout=0.0, scaling=None, **kwargs):
    """`shared_prompt_attention` under the dense mask's rows from the prompt cut on ([rows, 1, L - cut, L]): the
    queries before the cut attend causally to the keys before it, which SDPA computes without a mask and without the
    half above the diagonal; the others take their mask."""
    cut = query.shape[-2] - rest_mask.shape[-2]
    if takes_fp32_backward(query, dropout):
        first = cpu_flash_attention(query[:, :, :cut], key[:, :, :cut], value[:, :, :cut], True, None, scaling)
        first = first.transpose(1, 2)
    else:
        causal = {**kwargs, "is_causal": True}  # whatever the module says: these are a decoder's prompt tokens
        first, _ = sdpa_attention_forward(
            module, query[:, :, :cut], key[:, :, :cut], value[:, :, :cut], None, dropout, scaling, **causal
        )
    rest = masked_sdpa(query[:, :, cut:], key, value, rest_mask, dropout, scaling)
    return torch.cat([first, rest.transpose(1, 2)], 1), None


def masked_sdpa(query, key, value, mask, dropout=0.0, scaling=None) -> torch.Tensor:
    """SDPA under a mask with grouped-query heads (query [B, H, T, D], key/value [B, KV, S, D]): CPU's flash kernel
    takes the mask and GQA at once (trainer/cpu_flash.py: with its backward in fp32); CUDA's kernels take one or the
    other, so there the keys are copied for every query head, as HF does."""
    if takes_fp32_backward(query, dropout) and mask.is_floating_point():
        return cpu_flash_attention(query, key, value, False, mask, scaling)
    on_cpu = query.device.type == "cpu"
    if not on_cpu and (groups := query.shape[1] // key.shape[1]) > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(query, key, value, mask, dropout, scale=scaling, enable_gqa=on_cpu)
