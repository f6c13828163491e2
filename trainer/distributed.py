"""Data-parallel plumbing for the trainer: the device a config names, process-group setup and the all-reduces a
train step needs.

Under `train.parallel: ddp` every rank holds the whole model and optimizer: ranks train on their own slice of the
batch and sum gradients with one bucketed all-reduce per optimizer step, instead of DDP hooks, because ranks may run
different numbers of micro-batches (packing depends on their samples' lengths). FSDP2 sharding, the default with
several ranks, is in trainer/parallel.py. With world_size 1 every helper is a no-op, so single-process code never
touches torch.distributed.
"""

import os

import torch
import torch.distributed as dist

# Flatten gradients into buckets of about this many bytes: one collective per bucket, bounded extra memory.
BUCKET_BYTES = 256 * 2**20


def backend_for(device: str) -> str | None:
    """gloo on CPU, nccl on CUDA; on another device (tpu) None: torch then takes, per device type, the backend its
    package registered (gloo cannot reduce TPU tensors, which FSDP2 and the parameter broadcast hand it)."""
    return {"cpu": "gloo", "cuda": "nccl"}.get(device)


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("TrainerConfig.device='cuda' but torch sees no CUDA device")
    if name == "tpu":
        try:
            import torch_tpu  # noqa: F401  (registers the device with torch)
        except ImportError as e:
            raise ValueError(
                "TrainerConfig.device='tpu' needs the torch_tpu package (pip install -e '.[tpu-train]' on a TPU host)"
            ) from e
    return torch.device(name)


def init_distributed(rank: int, world_size: int, device: str = "cpu", init_method: str | None = None) -> None:
    """Join the process group unless already in one. Without `init_method`, torch's env:// rendezvous is used
    (MASTER_ADDR / MASTER_PORT), which is what Ray actors and torchrun set up."""
    if world_size == 1 or dist.is_initialized():
        return
    if init_method is None and "MASTER_ADDR" not in os.environ:
        raise ValueError(
            "world_size > 1 needs MASTER_ADDR/MASTER_PORT in the environment, an init_method, "
            "or torch.distributed already initialised"
        )
    dist.init_process_group(backend_for(device), init_method=init_method or "env://", rank=rank, world_size=world_size)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce of one tensor (sum | max | min); returns it."""
    if is_distributed():
        dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return tensor


def all_reduce_grads_(params: list[torch.Tensor]) -> None:
    """Sum `.grad` of `params` over ranks, in place, bucket by bucket. Missing grads count as zeros."""
    if not is_distributed():
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    bucket, size = [], 0
    for p in params:
        bucket.append(p.grad)
        size += p.grad.numel() * p.grad.element_size()
        if size >= BUCKET_BYTES:
            _reduce_bucket(bucket)
            bucket, size = [], 0
    if bucket:
        _reduce_bucket(bucket)


def _reduce_bucket(grads: list[torch.Tensor]) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def broadcast_params_(params: list[torch.Tensor], src: int = 0) -> None:
    """Make every rank start from rank `src`'s parameters (guards against ranks loading different files)."""
    if not is_distributed():
        return
    with torch.no_grad():
        for p in params:
            dist.broadcast(p.data, src=src)
