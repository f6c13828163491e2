"""The trainer's AdamW and its learning-rate schedule (docs/design.md §4.11): weight decay on matrices only, a
linear warmup to `lr`, then constant."""

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
    warmup = cfg.lr_warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0
    )
    return optimizer, scheduler
