"""How the trainer's model is spread over its ranks: `ddp` (every rank a full replica) or `fsdp` (FSDP2 shards).

ddp: parameters, gradients and AdamW state are replicated (16 bytes per parameter per rank in fp32, plus fp32
masters for bf16); gradients are summed by one bucketed all-reduce per optimizer step (trainer/distributed.py).

fsdp: `torch.distributed.fsdp.fully_shard` on every decoder layer and on the root, so each rank holds 1/world of the
parameters, gradients and optimizer state; a layer's parameters are all-gathered for its forward and backward and
its gradients reduce-scattered after. The sharded fp32 parameters are the masters: under bf16 FSDP's mixed
precision all-gathers them in bf16 for compute and reduce-scatters gradients in fp32, which is what the ddp path does
by hand (bf16 model, fp32 masters, fp32 gradient accumulation), so both modes round the same way.

Two things differ from DDP and shape the trainer's code:
- Every forward and backward is a collective, so all ranks must run the same number of them; a rank with fewer
  micro-batches runs `filler` micro-batches whose loss is multiplied by zero (`even_out`).
- Gradients are summed over ranks, not averaged: the losses are already divided by batch-level constants computed
  over all ranks (trainer/trainer.py), as in the ddp path. Gloo has no pre-multiplied sum, hence
  `set_force_sum_reduction_for_comms`.

Weights leave a sharded model one tensor at a time (`full_tensors`): each is all-gathered, copied to host on rank 0
and dropped, so the accelerator never holds more than one extra unsharded tensor (the embedding, at most); `to_numpy`
hands each out as numpy without a copy (bf16 as ml_dtypes bits).

`trainer/policy_model.py` compiles the same decoder layers (`TrainerConfig.compile`) before they are sharded.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainer.batching import MicroBatch, TrainBatch, collate
from trainer.logprobs import response_logprobs


class LogprobModel(torch.nn.Module):
    """`response_logprobs` of the wrapped HF causal LM as a module's forward.

    The log-probs run the backbone and the LM head separately (trainer/logprobs.py), so they must be one forward for
    FSDP: sharded as the root module, this wrapper gathers the embedding, final norm and LM head around the whole
    computation (the decoder layers gather their own)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, mb: MicroBatch, temperature: float, with_entropy: bool = False, entropy_grad: bool = False):
        return response_logprobs(self.model, mb, temperature, with_entropy=with_entropy, entropy_grad=entropy_grad)


def shard_fsdp(scorer: LogprobModel, device: torch.device, compute_dtype: torch.dtype) -> None:
    """FSDP2 in place: each decoder layer its own unit, the rest (embedding, norm, LM head) the root unit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    units = [*scorer.model.get_decoder().layers, scorer]
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    for unit in units:  # per unit: each FSDP module has its own reduce-scatter settings
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)


def full_tensors(model: torch.nn.Module, dtype: torch.dtype, keep: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full CPU tensor in `dtype`) for every saved tensor of a model, one all-gather at a time if it is
    sharded; a replica's CPU tensors of that dtype come as they are (no copy).

    Sharded, a collective: every rank must iterate to the end. Ranks with `keep` False get nothing (the gathered
    tensor is dropped at once). A tied LM head is left out, as save_pretrained leaves it out."""
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        full = whole(tensor)
        if keep:
            yield name, full.to(device="cpu", dtype=dtype)
        del full


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """CPU tensor → numpy without a copy where possible; bfloat16 becomes ml_dtypes.bfloat16 via its bits."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        import ml_dtypes  # here: its import takes ~1 s of the trainer's start, for bf16 runs only

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (the shard of a DTensor; the tensor itself otherwise)."""
    return t.to_local() if isinstance(t, DTensor) else t


def whole(t: torch.Tensor) -> torch.Tensor:
    """The whole of a tensor, detached: a DTensor's shards all-gathered (a collective), any other tensor itself."""
    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t


def filler(pad_id: int) -> MicroBatch:
    """The smallest micro-batch (one prompt token, one response token): what a rank with fewer micro-batches runs so
    that every rank joins every FSDP collective."""
    return collate(TrainBatch([[pad_id]], [[pad_id]], [0.0]), [0], pad_id)


def even_out(mbs: list[MicroBatch], pad_id: int, device: torch.device) -> tuple[list[MicroBatch], int]:
    """Pad `mbs` with fillers to the largest micro-batch count of any rank; returns them and how many are real."""
    count = torch.tensor([len(mbs)], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return mbs + [filler(pad_id)] * (int(count) - len(mbs)), len(mbs)
