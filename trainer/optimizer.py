"""The trainer's AdamW and its learning-rate schedule (docs/design.md §4.11): weight decay on matrices only, a
linear warmup to `lr`, then constant or a linear or cosine decay (transformers' shapes) to `min_lr_ratio` x lr."""

import math
from functools import partial

import torch

from trainer.config import TrainerConfig


def make_optimizer(
    cfg: TrainerConfig, named: list[tuple[str, torch.nn.Parameter]], masters: list[torch.nn.Parameter]
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over `masters` (the parameters that take the updates, in `named`'s order) and its schedule; a master's
    decay follows its model parameter's shape: norms and biases (under 2 dims) are not decayed."""
    decay = [m for (_, p), m in zip(named, masters) if p.dim() >= 2]
    no_decay = [m for (_, p), m in zip(named, masters) if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        fused=cfg.adamw_fused,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, cfg))
    return optimizer, scheduler


def lr_factor(cfg: TrainerConfig, update: int) -> float:
    """The fraction of `lr` that optimizer update `update` (from 0) runs at. The warmup reaches the full rate at its
    last update, (k + 1) / warmup; after it the decay's progress runs from 0 at the first update past the warmup to 1
    at `total_updates`, as in transformers' get_linear_schedule_with_warmup and
    get_cosine_with_min_lr_schedule_with_warmup (verl's cosine with min_lr_ratio)."""
    warmup = cfg.lr_warmup_steps
    if update < warmup:
        return (update + 1) / warmup
    if cfg.lr_decay == "constant":
        return 1.0
    progress = min(1.0, (update - warmup) / max(1, cfg.total_updates - warmup))
    shape = 1.0 - progress if cfg.lr_decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape
