"""The GRPO-family policy loss: clipped importance ratio, KL to a reference, entropy bonus, TIS, four aggregations.

Pure torch functions on padded [batch, response_len] tensors. Names and numbers follow TRL's GRPOTrainer
(docs/design.md §4):
  ratio    s = exp(logπθ − logπold) per token, or with `importance_level="sequence"` (GSPO) exp of the masked mean of
           logπθ − logπold over each sequence, broadcast to its tokens;
  ℓ_pg     = −min(s·A, clip(s, 1−ε_low, 1+ε_high)·A), with dual-clip at most −c·A where A < 0, times the TIS weight
           min(exp(logπold − logπrollout), C);
  ℓ        = ℓ_pg + β·k(logπθ, logπref) − entropy_coef·H;
  loss     = aggregation of ℓ over the tokens:
             grpo    Σ_seq (Σ_tok ℓ / tokens_in_seq) / sequences
             bnpo    Σ ℓ / tokens in the (local) batch
             dr_grpo Σ ℓ / (sequences × max_completion_len)
             dapo    Σ ℓ / tokens in the whole minibatch (across ranks and micro-batches)

Micro-batching: every aggregation is a plain sum over sequences or tokens divided by a batch-level constant, so a
caller that passes the batch-level constants (`total_sequences`, `total_tokens`, `max_completion_len`) can sum the
losses of its micro-batches and get exactly the loss of the whole batch. Left as None they default to this call's own
tensors, which is the single-batch definition.
"""

from typing import get_args

import torch

from trainer.config import LossConfig

LOSS_AGGREGATIONS = get_args(LossConfig.__pydantic_fields__["loss_agg"].annotation)
KL_ESTIMATORS = get_args(LossConfig.__pydantic_fields__["kl_estimator"].annotation)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(πθ || πref) from samples of πθ (Schulman's k1/k2/k3)."""
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        # exp(ref − θ) − (ref − θ) − 1: unbiased and always >= 0.
        return torch.exp(-log_ratio) + log_ratio - 1.0
    raise ValueError(f"kl_estimator={estimator!r}: expected one of {KL_ESTIMATORS}")


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    loss_agg: str,
    *,
    total_tokens=None,
    total_sequences=None,
    max_completion_len=None,
) -> torch.Tensor:
    """Reduce a [B, T] per-token quantity to the scalar loss of `loss_agg` (see the module docstring)."""
    masked = per_token * mask
    if loss_agg == "grpo":
        per_seq = masked.sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_seq.sum() / (total_sequences if total_sequences is not None else mask.shape[0])
    if loss_agg in ("bnpo", "dapo"):
        return masked.sum() / (total_tokens if total_tokens is not None else mask.sum().clamp(min=1.0))
    if loss_agg == "dr_grpo":
        sequences = total_sequences if total_sequences is not None else mask.shape[0]
        return masked.sum() / (sequences * (max_completion_len if max_completion_len is not None else mask.shape[1]))
    raise ValueError(f"loss_agg={loss_agg!r}: expected one of {LOSS_AGGREGATIONS}")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    *,
    ref_logp: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    total_tokens: float | None = None,
    total_sequences: float | None = None,
    max_completion_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO/DAPO/GSPO policy loss of one (micro-)batch.

    logp, old_logp, ref_logp, rollout_logp, entropy, mask: [B, T] over response tokens (mask 1 on real tokens);
    advantages: [B] (one per sequence) or [B, T]. Gradient flows through `logp` (and `entropy` if entropy_coef != 0).

    Returns (loss, metrics). `pg_loss` and `kl_loss` in metrics use the same aggregation and normalisers as the loss
    (so they add up over micro-batches like the loss does); `kl_loss` is the unscaled k (β not applied);
    `pg_clipfrac`, `ppo_kl`, `entropy`, `logprob_abs_diff` and, with dual-clip, `pg_clipfrac_lower` (tokens whose
    loss it capped) are token means over this call's mask.
    """
    mask = mask.to(logp.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    old_logp = old_logp.detach()
    agg = dict(total_tokens=total_tokens, total_sequences=total_sequences, max_completion_len=max_completion_len)

    log_ratio = logp - old_logp
    if cfg.importance_level == "sequence":
        # GSPO: one length-normalised ratio per sequence, shared by its tokens.
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1).expand_as(logp)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    pg_per_token = -torch.min(ratio * advantages, clipped_ratio * advantages)
    metrics: dict[str, torch.Tensor] = {}
    if cfg.clip_ratio_c is not None:
        # Dual-clip PPO: with A < 0 the surrogate above grows with s without bound; cap it at −c·A (no gradient there).
        bound = -advantages * cfg.clip_ratio_c
        lower = (advantages < 0) & (pg_per_token > bound)
        pg_per_token = torch.where(lower, bound, pg_per_token)
        metrics["pg_clipfrac_lower"] = masked_mean(lower.to(logp.dtype), mask).detach()

    if rollout_logp is not None:
        rollout_gap = old_logp - rollout_logp
        metrics["logprob_abs_diff"] = masked_mean(rollout_gap.abs(), mask).detach()
        if cfg.tis_cap is not None:
            # Correct for the rollout engine sampling from a slightly different π than the trainer's πold.
            pg_per_token = pg_per_token * torch.clamp(torch.exp(rollout_gap), max=cfg.tis_cap).detach()

    per_token = pg_per_token
    pg_loss = aggregate(pg_per_token, mask, cfg.loss_agg, **agg)
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp.detach(), cfg.kl_estimator)
        kl_loss = aggregate(kl, mask, cfg.loss_agg, **agg)
        per_token = per_token + cfg.kl_coef * kl
    else:
        kl_loss = torch.zeros((), dtype=logp.dtype, device=logp.device)
    if entropy is not None:
        if cfg.entropy_coef != 0.0:
            per_token = per_token - cfg.entropy_coef * entropy
        metrics["entropy"] = masked_mean(entropy.detach(), mask)
    loss = aggregate(per_token, mask, cfg.loss_agg, **agg)

    # TRL's clip ratio: tokens whose gradient the clip switched off (the low side matters for A < 0, high for A > 0).
    with torch.no_grad():
        low = (ratio < 1.0 - cfg.clip_eps_low) & (advantages < 0)
        high = (ratio > 1.0 + cfg.clip_eps_high) & (advantages > 0)
        metrics["pg_clipfrac"] = masked_mean((low | high).to(logp.dtype), mask)
        metrics["ppo_kl"] = masked_mean(old_logp - logp.detach(), mask)
    metrics["pg_loss"] = pg_loss.detach()
    metrics["kl_loss"] = kl_loss.detach()
    return loss, metrics
