"""What a trainer rank will hold, estimated before anything is allocated (imports no torch, so the driver can plan).

    state        parameters in the model dtype, fp32 masters (bf16 under ddp), fp32 gradients, AdamW's two fp32
                 moments: 16 (fp32) or 18 (bf16) bytes per parameter, divided over the ranks under fsdp; with a KL
                 term, the reference model's copy of the parameters too
    activations  what one micro-batch keeps for its backward: with gradient checkpointing each layer's input
                 (tokens x hidden) plus one layer's recomputation; without, every layer's intermediates
                 (~16 x hidden + 3 x intermediate values per token per layer, flash-style attention: nothing per
                 token pair); on CPU below fp32, plus the fp32 copies one layer's attention backward makes
                 (trainer/cpu_flash.py: q, k, v, the output and its gradient upcast, dq, dk, dv in fp32)
    logits       the chunked LM head (trainer/logprobs.py): about five [chunk, vocab] fp32 tensors, plus an fp32
                 copy of the LM head and its gradient when the model is not fp32

An estimate, not an allocator trace: it leaves out the framework's workspace, fragmentation and (fsdp) the one
unsharded layer in flight, and the plan (rlloop/memory.py) adds no margin for them: a plan that just fits can still
run out.
"""

from __future__ import annotations

from trainer.config import TrainerConfig, chunk_elements

ITEMSIZE = {"float32": 4, "bfloat16": 2}


def trainer_memory(
    cfg: TrainerConfig,
    params: int,
    hidden: int,
    intermediate: int,
    layers: int,
    vocab: int,
    world_size: int = 1,
    q_size: int | None = None,
    kv_size: int | None = None,
    longest_sample: int = 0,
) -> dict[str, int]:
    """Estimated bytes per rank: state (parameters, masters, gradients, optimizer), activations and logits.
    `q_size` and `kv_size` are the attention's query and key widths (heads x head_dim; None: `hidden`);
    `longest_sample` the most tokens one sample can have, which packing puts in a micro-batch of its own when it
    exceeds the budget."""
    item = ITEMSIZE[cfg.dtype]
    sharded = world_size > 1 and cfg.parallel != "ddp"
    per_param = item + (4 if cfg.dtype != "float32" else 0) + 4 + 8  # params, masters, grads, AdamW m and v
    if sharded:
        per_param = 16  # the shards are the fp32 masters; compute-dtype copies exist one layer at a time
    if cfg.loss.kl_coef != 0.0:  # the KL term's frozen reference model: the model's copy (fp32 shards under fsdp)
        per_param += 4 if sharded else item
    state = params * per_param // (world_size if sharded else 1)
    tokens = max(cfg.micro_batch_tokens, longest_sample)
    per_layer = tokens * (16 * hidden + 3 * intermediate) * item
    if cfg.gradient_checkpointing:
        activations = layers * tokens * hidden * item + per_layer
    else:
        activations = layers * per_layer
    if cfg.device == "cpu" and cfg.dtype != "float32":  # made and freed by one layer's backward at a time: once
        activations += tokens * 4 * ((q_size or hidden) + (kv_size or hidden)) * 4
    logits = 5 * min(chunk_elements(cfg.device), tokens * vocab) * 4
    if cfg.dtype != "float32":
        logits += 2 * vocab * hidden * 4
    return {"state": state, "activations": activations, "logits": logits, "total": state + activations + logits}
