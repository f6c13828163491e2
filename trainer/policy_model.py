"""The policy's HF model as the trainer trains it: loaded, on its device, with the attention, gradient checkpointing
and compilation its config asks for."""

import torch
import transformers

from trainer.config import TrainerConfig
from trainer.cpu_flash import use_cpu_sdpa
from trainer.shared_prompts import check_shared_prompts, use_blocked_attention


def load_policy_model(
    cfg: TrainerConfig, device: torch.device, sharded: bool
) -> tuple[transformers.PreTrainedModel, dict[str, torch.Tensor] | None]:
    """`cfg.model_path` on `device`: in cfg.dtype, or in fp32 when `sharded` (fsdp keeps fp32 shards, the masters,
    and computes in cfg.dtype through its mixed-precision policy). Unsharded in a lower precision, also the fp32
    values its parameters were rounded from, by name: the optimizer's fp32 masters start from them, as fsdp's do
    (they started from the rounded weights, and one rank and two trained apart from an fp32 checkpoint)."""
    lower = not sharded and cfg.dtype != "float32"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        cfg.model_path,
        dtype=torch.float32 if sharded or lower else getattr(torch, cfg.dtype),
        trust_remote_code=cfg.trust_remote_code,
    )
    model.to(device)
    loaded = None
    if lower:  # the fp32 tensors themselves: cast, the parameters get new ones
        loaded = {name: p.detach() for name, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():  # not model.to(): RoPE's buffers stay fp32, as loaded
                p.data = p.data.to(getattr(torch, cfg.dtype))
    if cfg.share_prompts:
        check_shared_prompts(model.config)
        use_blocked_attention(model)
    elif device.type == "cpu" and cfg.dtype != "float32":
        use_cpu_sdpa(model)  # attention's backward in fp32 (trainer/cpu_flash.py)
    if cfg.gradient_checkpointing:
        # transformers >= 5.x renamed it; non-reentrant checkpointing works with inputs that need no grad. With every
        # dropout off no layer draws: no RNG state to keep and set again around a recompute (the set rewinds torch's
        # global RNG under any other thread of the process drawing from it).
        kwargs = {"use_reentrant": False, "preserve_rng_state": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # HF checkpoints only recompute in train mode; otherwise eval mode. Either way nothing is stochastic: π and πold
    # must be the same function of the weights (as TRL's disable_dropout makes them), so every dropout is off.
    model.train(cfg.gradient_checkpointing)
    disable_dropout(model)
    if cfg.compile != "off":
        compile_decoder(model, cfg.compile, sharded, cfg.gradient_checkpointing)  # before FSDP wraps the layers
    return model, loaded


def disable_dropout(model: torch.nn.Module) -> None:
    """Zero every dropout: the `nn.Dropout` modules, and the probability HF attention modules pass to their kernel
    when in train mode (`attention_dropout`, read from a config such as Qwen3's or Llama's)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "attention_dropout", None):
        config.attention_dropout = 0.0


RECOMPILE_LIMIT = 64  # compiles of one layer's forward before dynamo gives up on it (its default: 8)


def compile_decoder(model: torch.nn.Module, scope: str, sharded: bool, checkpointed: bool = False) -> None:
    """`TrainerConfig.compile`: torch.compile in place, with dynamic shapes since every batch has other lengths, each
    decoder layer (`scope` "layers": the classes HF names in `_no_split_modules`) or the whole decoder ("model"; not
    when `sharded`, as FSDP's units are the layers), as torchtitan orders it: before FSDP wraps the layers."""
    if checkpointed:
        # Under gradient checkpointing dynamo refuses the forward's side effects inside the checkpoint, and
        # transformers' attention wrapper sets a context variable (kernels' CompileableContextVar): every layer
        # graph-broke and ran eagerly, saying so only in debug logs. The recompute in backward needs none of it.
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    # Each variant of a call a step makes (grad on or off, a mask or none, a one-row micro-batch, each twice under
    # gradient checkpointing) is a compile of its own, and past dynamo's default limit of 8 a layer runs eagerly for
    # every new variant, saying so only in a warning: a run with checkpointing, KL and micro-batches reached it.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    if scope == "model":
        if sharded:
            raise ValueError(
                "train.compile=model compiles the whole decoder as one graph, but fsdp shards it layer by "
                "layer: use train.compile=layers, or train.parallel=ddp"
            )
        model.get_decoder().compile(dynamic=True)
        return
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(
            f"train.compile=layers: found no decoder layers ({sorted(layer_classes)}, from _no_split_modules) in "
            f"{type(model).__name__}; use train.compile=model or off"
        )
    for layer in layers:
        layer.compile(dynamic=True)
