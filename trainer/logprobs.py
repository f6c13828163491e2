"""Per-token log-probabilities (and entropies) of response tokens under a Hugging Face causal LM.

The rollout engine samples from softmax(logits / temperature); the trainer must score the same distribution, in
fp32 whatever the model dtype, or the importance ratios drift (docs/design.md §4). Only the logits that predict response
tokens are projected onto the vocabulary, via HF's `logits_to_keep`, since that projection dominates memory.
"""

import torch

from trainer.batching import MicroBatch


def response_logprobs(
    model: torch.nn.Module,
    mb: MicroBatch,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(response token | prefix) as a [B, R] fp32 tensor aligned with `mb.response_mask`, plus the entropy of
    each of those next-token distributions when `with_entropy` (else None). Padding positions hold junk; mask them.
    Log-probs are differentiable when called with grad enabled; the entropy only with `entropy_grad` (it is usually
    just logged, and its graph would hold another [B, R, vocab] tensor).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    device = next(model.parameters()).device
    input_ids = mb.input_ids.to(device)
    width = input_ids.shape[1]
    # Logits at column c predict the token at c + 1, so response tokens are predicted from columns
    # response_start - 1 onwards. Keep the trailing window from the earliest such column; the last column predicts
    # past the end of every row and is dropped.
    first = int(mb.response_start.min().item()) - 1
    out = model(
        input_ids=input_ids, attention_mask=mb.attention_mask.to(device), use_cache=False, logits_to_keep=width - first
    )
    logits = out.logits[:, :-1].float() / temperature  # [B, W, V] predicts columns first+1 .. L-1
    targets = input_ids[:, first + 1 :]  # [B, W]
    log_norm = torch.logsumexp(logits, dim=-1)  # [B, W]
    token_logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_norm

    # Per row, response token t sits at window column (response_start - 1 - first) + t.
    resp_width = mb.response_mask.shape[1]
    cols = (mb.response_start.to(device) - 1 - first).unsqueeze(-1) + torch.arange(resp_width, device=device)
    cols = cols.clamp(max=token_logp.shape[1] - 1)  # padding positions past the row end
    logp = token_logp.gather(1, cols)

    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            # H = logsumexp(z) − Σ softmax(z)·z
            ent = log_norm - (torch.softmax(logits, dim=-1) * logits).sum(-1)
            entropy = ent.gather(1, cols)
    return logp, entropy
