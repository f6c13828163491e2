"""The policy's HF model as the trainer trains it: loaded, on its device, with the attention, gradient checkpointing
and compilation its config asks for."""

import torch
import transformers

from trainer.config import TrainerConfig
from trainer.cpu_flash import use_cpu_sdpa
from trainer.parallel import compile_decoder
from trainer.shared_prompts import check_shared_prompts, use_blocked_attention


def load_policy_model(cfg: TrainerConfig, device: torch.device, sharded: bool) -> transformers.PreTrainedModel:
    """`cfg.model_path` on `device`: in cfg.dtype, or in fp32 when `sharded` (fsdp keeps fp32 shards, the masters,
    and computes in cfg.dtype through its mixed-precision policy)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        cfg.model_path,
        dtype=torch.float32 if sharded else getattr(torch, cfg.dtype),
        trust_remote_code=cfg.trust_remote_code,
    )
    model.to(device)
    if cfg.share_prompts:
        check_shared_prompts(model.config)
        use_blocked_attention(model)
    elif device.type == "cpu" and cfg.dtype != "float32":
        use_cpu_sdpa(model)  # attention's backward in fp32 (trainer/cpu_flash.py)
    if cfg.gradient_checkpointing:
        # transformers >= 5.x renamed it; non-reentrant checkpointing works with inputs that need no grad.
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # HF checkpoints only recompute in train mode; otherwise eval mode, so nothing is stochastic.
    model.train(cfg.gradient_checkpointing)
    if cfg.compile != "off":
        compile_decoder(model, cfg.compile, sharded)  # before FSDP wraps the layers, as torchtitan orders it
    return model
