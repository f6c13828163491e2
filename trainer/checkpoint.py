"""Trainer checkpoints: an HF model directory plus what resuming needs, for both parallel modes.

    <path>/config.json, model.safetensors, ...   save_pretrained: the policy, loadable by anything that reads HF
    <path>/sharded/                               fsdp only: torch.distributed.checkpoint of the sharded parameters
                                                  and AdamW state, every rank writing its own shards
    <path>/trainer_state.pt                       scheduler, RNG, step, mode; under ddp also the optimizer and the
                                                  fp32 masters. Written last, so its presence marks a complete
                                                  checkpoint.

ddp ranks are identical, so rank 0 writes everything. fsdp gathers the HF directory one tensor at a time onto rank
0 (trainer/parallel.py) and resumes from `sharded/` (the HF weights are rounded to the model dtype; the shards are
the fp32 masters). A checkpoint resumes only under the mode that wrote it.
"""

from __future__ import annotations

import glob
import os
from dataclasses import asdict
from typing import TYPE_CHECKING

import safetensors.torch
import torch

from trainer.parallel import full_tensors

if TYPE_CHECKING:
    from trainer.trainer import Trainer

STATE_FILE = "trainer_state.pt"
SHARDED_DIR = "sharded"


def save(trainer: Trainer, path) -> None:
    path = os.fspath(path)
    sharded = trainer.parallel == "fsdp"
    if trainer.rank == 0:
        os.makedirs(path, exist_ok=True)
    state = {
        "scheduler": trainer.scheduler.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "step": trainer.step,
        "bad_steps": trainer.bad_steps,
        "parallel": trainer.parallel,
        "config": {k: v for k, v in asdict(trainer.cfg).items() if k != "loss"},
    }
    if sharded:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(trainer.model, trainer.optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(path, SHARDED_DIR))
        full = dict(full_tensors(trainer.model, trainer.export_dtype, keep=trainer.rank == 0))
    else:
        state["optimizer"] = trainer.optimizer.state_dict()
        state["masters"] = None if trainer.masters is trainer.params else [m.detach() for m in trainer.masters]
    if trainer.rank == 0:
        trainer.model.save_pretrained(path, **({"state_dict": full} if sharded else {}))
        if sharded:  # save_pretrained wrote the fp32 shards' dtype into config.json, not that of the tensors it wrote
            config = trainer.model.config
            shards_dtype, config.dtype = config.dtype, trainer.export_dtype
            try:
                config.save_pretrained(path)
            finally:
                config.dtype = shards_dtype
        if torch.cuda.is_available():
            state["cuda_rng"] = torch.cuda.get_rng_state_all()
        tmp = os.path.join(path, STATE_FILE + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, os.path.join(path, STATE_FILE))
    if trainer.world_size > 1:
        torch.distributed.barrier()


def load(trainer: Trainer, path) -> None:
    """Restore what `save` wrote into `trainer` (same model architecture and parallel mode); the optimizer's settings
    (lr, warmup, betas, eps, weight decay) stay those of `trainer`'s config."""
    path = os.fspath(path)
    state_path = os.path.join(path, STATE_FILE)
    if not os.path.exists(state_path):
        raise ValueError(f"{path!r} is not a complete trainer checkpoint: {STATE_FILE} is missing")
    state = torch.load(state_path, weights_only=True)
    written_by = state.get("parallel", "ddp")
    if written_by != trainer.parallel:
        # one rank trains the plain model whatever train.parallel says (resolve_parallel)
        fix = "resume it on 2 or more ranks" if trainer.world_size == 1 else f"set train.parallel={written_by}"
        raise ValueError(
            f"checkpoint {path!r} was written with train.parallel={written_by}; this trainer runs "
            f"train.parallel={trainer.parallel} over {trainer.world_size} rank(s) ({fix} to resume it)"
        )
    configured = [{k: v for k, v in group.items() if k != "params"} for group in trainer.optimizer.param_groups]
    if trainer.parallel == "fsdp":
        _load_sharded(trainer, os.path.join(path, SHARDED_DIR))
    else:
        _load_replicated(trainer, path, state)
    trainer.scheduler.load_state_dict(state["scheduler"])
    _apply_configured(trainer, configured)
    torch.set_rng_state(state["torch_rng"])
    if "cuda_rng" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    trainer.step = state["step"]
    trainer.bad_steps = state.get("bad_steps", 0)


def _apply_configured(trainer: Trainer, configured: list[dict]) -> None:
    """Resume the optimizer's state (moments, step counts, the schedule's position) under this config's settings:
    torch's load_state_dict brings back the checkpoint's lr, betas, eps and weight decay, so a run resumed with a new
    train.lr would log the new value and keep training at the old one."""
    scheduler = trainer.scheduler
    scheduler.base_lrs = [hp["initial_lr"] for hp in configured]
    for group, hp, base, factor in zip(
        trainer.optimizer.param_groups, configured, scheduler.base_lrs, scheduler.lr_lambdas
    ):
        group.update(hp, lr=base * factor(scheduler.last_epoch))


def _load_sharded(trainer: Trainer, sharded: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not os.path.isdir(sharded):
        raise ValueError(f"fsdp checkpoint lacks its sharded state {sharded!r}")
    model_state, optim_state = get_state_dict(trainer.model, trainer.optimizer)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=sharded)
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=model_state, optim_state_dict=optim_state)


def _load_replicated(trainer: Trainer, path: str, state: dict) -> None:
    expected = trainer.export_weights()
    loaded: dict[str, torch.Tensor] = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        loaded.update(safetensors.torch.load_file(file))
    missing = sorted(set(expected) - set(loaded))
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks parameter {missing[0]!r} ({len(missing)} missing)")
    live = trainer.model.state_dict()
    with torch.no_grad():
        for name in expected:
            live[name].copy_(loaded[name])
        if state["masters"] is not None:
            for m, saved in zip(trainer.masters, state["masters"]):
                m.copy_(saved)
        elif trainer.masters is not trainer.params:  # an fp32 checkpoint, in a lower precision now: its weights
            for name, m in zip(trainer.param_names, trainer.masters):  # are the masters (they kept the base model's)
                m.copy_(loaded[name])
    trainer.optimizer.load_state_dict(state["optimizer"])
