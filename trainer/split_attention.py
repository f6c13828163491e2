"""Split-KV attention of shared-prompt rows on CPU: a row's attention as three unmasked (or key-masked) flash-attention
calls whose outputs merge by their log-sum-exp, for rows whose responses are long.

A shared-prompt row is a prompt and then several of its GRPO samples' responses (trainer/batching.py); each response
sees the prompt and itself, causally. That is three kinds of scores, each of which CPU's flash kernel computes with no
mask or a key mask only:

- part A, the prompt's queries against the prompt's keys, causal (the row's first P columns, P the longest prompt);
- part B, the responses' queries against their prompt's keys, all of them (a key mask where prompts differ in length);
- part C, each response's queries against its own keys, causal (the responses gathered into a padded [n, R] layout).

A response token's softmax runs over parts B and C; the kernel returns each part's log-sum-exp, so the merged output
is their outputs weighted by exp(lse_part - lse). The backward calls the kernel's own backward per part with the
merged output and log-sum-exp, which is flash attention's backward over a split key set, exactly.

Of a row of L columns this computes P^2/2 + (L - P) P + sum r^2/2 scores, against (L - P) L for the rows of the dense
mask after the prompt: 1.5x faster than blocks for one layer at 8 x 128-token responses (docs/design.md §4.12).
"""

from dataclasses import dataclass

import torch

from trainer.cpu_flash import flash, flash_backward


@dataclass(frozen=True)
class SplitPlan:
    """Which queries each part gives and where part C's come from, in a micro-batch of shared-prompt rows
    (`split_plan`). A's queries are the first p_max columns, B's those from p_min on; C's are gathered."""

    p_min: int  # the shortest prompt (padding rows aside): no response starts before it
    p_max: int  # the longest prompt: the prompt's keys are the first p_max columns
    in_a: torch.Tensor  # [rows, p_max] bool: the place's output is part A's (prompt and early padding)
    in_b: torch.Tensor  # [rows, L - p_min] bool: the place's output is part B's and C's (responses, late padding)
    key_mask: torch.Tensor | None  # [rows, 1, 1, p_max] additive: a row's prompt keys, for B; None if all are p_max
    gather: torch.Tensor  # [n, R] flat places of each response's tokens, its last token repeated after its end
    within: torch.Tensor  # [n, R] bool: the gathered place is the response's own (not a repeat)


def split_plan(segments: torch.Tensor, dtype: torch.dtype) -> SplitPlan:
    """The plan of `split_attention` from a micro-batch's segments ([rows, L]: 0 prompt, i >= 1 the row's i-th
    response, -1 padding); `dtype`, the queries' (the kernel's key mask is additive, in their dtype). Every place is
    some part's query: a padding query is part A's before p_max and part B's after it (it sees a prompt; a padding
    row sees its first column), so that no softmax is empty."""
    rows, length = segments.shape
    device = segments.device
    prompts = (segments == 0).sum(1)
    p_max = max(1, int(prompts.max()))
    p_min = int(prompts[prompts > 0].min()) if bool((prompts > 0).any()) else p_max
    columns = torch.arange(length, device=device)
    seen = (columns[:p_max] < prompts.clamp(min=1)[:, None])[:, None, None]  # [rows, 1, 1, p_max]
    key_mask = (
        None
        if bool(seen.all())
        else torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, -torch.inf)
    )
    in_b = (segments >= 1) | ((segments == -1) & (columns >= p_max))

    places = (segments.view(-1) >= 1).nonzero().squeeze(1)  # responses are contiguous runs of one segment id
    _, lengths = torch.unique_consecutive(places // length * length + segments.view(-1)[places], return_counts=True)
    starts = torch.cumsum(lengths, 0) - lengths
    offsets = torch.arange(int(lengths.max()) if lengths.numel() else 1, device=device)
    gather = places[starts[:, None] + torch.minimum(offsets, lengths[:, None] - 1)]
    return SplitPlan(
        p_min, p_max, segments[:, :p_max] <= 0, in_b[:, p_min:], key_mask, gather, offsets < lengths[:, None]
    )


@torch.compiler.disable  # a compiled layer (`train.compile`) runs it eagerly: inductor fails on its backward's ops
def split_attention(query, key, value, segments: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """Attention of shared-prompt rows with these segments ([rows, L]): query [rows, H, L, D], key/value
    [rows, KV, L, D] (grouped-query heads as they are); returns [rows, L, H, D], HF's attention output layout."""
    return _SplitAttention.apply(query, key, value, split_plan(segments, query.dtype), scaling)


def _gathered(t: torch.Tensor, gather: torch.Tensor) -> torch.Tensor:
    """[rows, h, L, D] at the [n, R] flat places -> [n, h, R, D]"""
    rows, heads, length, dim = t.shape
    return t.transpose(1, 2).reshape(rows * length, heads, dim)[gather].transpose(1, 2)


class _SplitAttention(torch.autograd.Function):
    """Parts A, B and C through CPU's flash kernel, merged by log-sum-exp; the backward is the kernel's per part, given
    the merged output and log-sum-exp. Outputs and gradients are kept in the [rows, L, H, D] layout, where A's and
    B's places are slices and C's an index."""

    @staticmethod
    def forward(ctx, query, key, value, plan: SplitPlan, scale):
        rows, heads, length, dim = query.shape
        a, b = slice(None, plan.p_max), slice(plan.p_min, None)
        calls = (
            (query[:, :, a], key[:, :, a], value[:, :, a], True, None),
            (query[:, :, b], key[:, :, a], value[:, :, a], False, plan.key_mask),
            (*(_gathered(t, plan.gather) for t in (query, key, value)), True, None),
        )
        outs, lses = [], []
        for q, k, v, causal, mask in calls:
            out, lse = flash(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
            outs.append(out.transpose(1, 2))  # [B, T, H, D]
            lses.append(lse.transpose(1, 2))  # [B, T, H], fp32

        total = query.new_full((rows, length, heads), -torch.inf, dtype=torch.float32)  # each place's log-sum-exp
        total[:, a] = torch.where(plan.in_a[..., None], lses[0], -torch.inf)
        total[:, b] = torch.logaddexp(total[:, b], torch.where(plan.in_b[..., None], lses[1], -torch.inf))
        flat_total, c_places = total.view(-1, heads), plan.gather[plan.within]
        flat_total[c_places] = torch.logaddexp(flat_total[c_places], lses[2][plan.within])

        merged = query.new_zeros((rows, length, heads, dim), dtype=torch.float32)
        for cols, valid, out, lse in ((a, plan.in_a, outs[0], lses[0]), (b, plan.in_b, outs[1], lses[1])):
            merged[:, cols] += out * torch.where(valid[..., None], torch.exp(lse - total[:, cols]), 0.0)[..., None]
        c_weight = torch.exp(lses[2][plan.within] - flat_total[c_places])[..., None]
        merged.view(-1, heads, dim).index_add_(0, c_places, outs[2][plan.within] * c_weight)
        merged = merged.to(query.dtype)

        ctx.plan, ctx.scale = plan, scale
        ctx.save_for_backward(merged, total, *lses, *(t for call in calls for t in call[:3]))
        return merged

    @staticmethod
    def backward(ctx, grad):
        merged, total, *rest = ctx.saved_tensors
        plan, lses, tensors = ctx.plan, rest[:3], rest[3:]
        rows, length, heads, dim = merged.shape
        a, b = slice(None, plan.p_max), slice(plan.p_min, None)
        flat = lambda t: t.reshape(rows * length, *t.shape[2:])  # noqa: E731
        # Each part's places (`at`) and which of them it gives the output of. The kernel gets the gradient there (zero
        # where it gives none), the merged output, and the merged log-sum-exp, or its own where it gives none: there is
        # no gradient there, and its own keeps the kernel's P finite.
        parts = (
            (plan.in_a, lambda t: t[:, a], True, None),
            (plan.in_b, lambda t: t[:, b], False, plan.key_mask),
            (plan.within, lambda t: flat(t)[plan.gather], True, None),
        )
        # The backward runs in fp32 whatever the model's dtype: CPU's flash backward is ~2.8x slower in bf16 than in
        # fp32 (a 30M model's bf16 train step spent a third of its time there), and the fp32 backward of the same
        # forward is the more exact gradient. The forward, and so the log-probs, keep the model's dtype.
        grads = []
        for i, (gives, at, causal, mask) in enumerate(parts):
            g = (at(grad) * gives[..., None, None]).transpose(1, 2).float()
            lse = torch.where(gives[..., None], at(total), lses[i]).transpose(1, 2).contiguous()
            q, k, v = (t.float() for t in tensors[3 * i : 3 * i + 3])
            out = at(merged).transpose(1, 2).float()
            dq, dk, dv = flash_backward(g, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=ctx.scale)
            grads.append([t.transpose(1, 2) for t in (dq, dk, dv)])  # [B, T, h, D], fp32

        def assemble(j: int, shape) -> torch.Tensor:  # the j-th of q, k, v: A's and B's slices, C's places
            total_grad = grad.new_zeros(shape, dtype=torch.float32)
            total_grad[:, a] += grads[0][j]
            total_grad[:, b if j == 0 else a] += grads[1][j]  # B's queries are columns p_min on, its keys A's
            flat(total_grad).index_add_(0, plan.gather.view(-1), grads[2][j].reshape(-1, *shape[2:]))
            return total_grad.transpose(1, 2).to(grad.dtype)

        kv_shape = (rows, length, tensors[1].shape[1], dim)
        return assemble(0, (rows, length, heads, dim)), assemble(1, kv_shape), assemble(2, kv_shape), None, None
