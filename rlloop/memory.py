"""The run's memory plan: what each rollout chip and each trainer rank will hold, checked before anything starts.

The engine allocates its weights and a static KV cache up front (rollout.cost.engine_memory: layers x 2 (K and V) x KV
heads / TP x head dim x max_batch x max_seq_len x bytes); a trainer rank holds its parameter, gradient and optimizer
state plus one micro-batch's activations and logits (trainer.memory.trainer_memory). Both need only the model's
config.json, so a plan that cannot fit is a config error, naming the keys that fix it, before any actor or weight loads.
The chip's memory is `cluster.device_memory_gb`; unset, it is the host's RAM on CPU (shared by every actor) and
unchecked on accelerators. Worked example (docs/design.md §11): Qwen3-4B at max_batch 256 x 9,216 positions in bf16
needs 348 GB of KV cache, 174 GB per chip at TP 2: it fits a 192 GB TPU v7x chip and not a 141 GB H200.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from rlloop.config import Config, ConfigError
from rlloop.model_shape import model_shape
from rlloop.placement import ENGINE_GPU_MEM_FRACTION
from rollout.cost import cache_dtype, engine_memory, kv_bytes_per_token, param_count
from rollout.weight_table import copies_tied_head
from trainer.memory import ITEMSIZE, trainer_memory

MAX_RANKS = 256  # searched for the fewest fsdp ranks whose shares fit

GB = 1e9


@dataclass
class MemoryPlan:
    engine: dict[str, int]  # bytes per rollout chip
    trainer: dict[str, int]  # bytes per trainer rank
    device_bytes: int | None  # what one chip (or, on CPU, the host) has; None: unknown, unchecked
    device_source: str
    fixes: dict[str, str]  # role -> the keys that would make it fit

    def describe(self) -> str:
        e, t = self.engine, self.trainer
        have = f" of {self.device_bytes / GB:.1f} GB ({self.device_source})" if self.device_bytes else ""
        return (
            f"memory per rollout chip: weights {e['weights'] / GB:.2f} GB + KV cache {e['kv_cache'] / GB:.2f} GB = "
            f"{e['total'] / GB:.2f} GB{have}\n"
            f"memory per trainer rank: state {t['state'] / GB:.2f} GB + activations {t['activations'] / GB:.2f} GB "
            f"+ logits {t['logits'] / GB:.2f} GB = {t['total'] / GB:.2f} GB{have}"
        )

    def check(self) -> None:
        if self.fixes:
            raise ConfigError(f"the run does not fit in memory:\n{self.describe()}\n" + "\n".join(self.fixes.values()))


def plan_memory(cfg: Config) -> MemoryPlan | None:
    """The plan of `cfg`, or None when the model's config.json cannot be read without a download."""
    shape = model_shape(cfg.model.path)
    if shape is None:
        return None
    c, engine_cfg, trainer_cfg = cfg.cluster, cfg.engine_config(), cfg.trainer_config()
    item = ITEMSIZE[cfg.model.dtype]
    head_copy = copies_tied_head(shape, c.device)
    kv_item = ITEMSIZE[cache_dtype(cfg.model.dtype, c.device)]
    engine = engine_memory(shape, item, engine_cfg.max_batch, engine_cfg.max_seq_len, engine_cfg.tp, head_copy, kv_item)

    def per_rank(trainer_cfg, ranks: int) -> dict[str, int]:
        return trainer_memory(
            trainer_cfg,
            param_count(shape),
            shape.hidden_size,
            shape.intermediate_size,
            shape.num_layers,
            shape.vocab_size,
            ranks,
            shape.q_size,
            shape.kv_size,
            longest_sample=cfg.data.max_prompt_len + cfg.rollout.max_response_len,
        )

    trainer = per_rank(trainer_cfg, c.train_chips)
    device, source = device_memory(cfg)
    plan = MemoryPlan(engine, trainer, device, source, {})
    if device is None:
        return plan
    # --debug starts one role only: the other's memory is not needed
    engines, ranks = cfg.run.debug != "train-only", cfg.run.debug != "rollout-only"
    if c.device == "cpu":  # one host: every engine (all of its devices) and rank together
        need = engines * c.rollout_engines * engine_cfg.tp * engine["total"] + ranks * c.train_chips * trainer["total"]
        if need > device:
            plan.fixes["host"] = (
                f"all actors together need {need / GB:.1f} GB of the host's {device / GB:.1f} GB: lower "
                f"rollout.max_batch, rollout.max_response_len or train.micro_batch_tokens"
            )
        return plan
    # On a GPU of its own the engine has JAX's share of it (placement.actor_env)
    usable, share = device, ""
    if c.device == "gpu" and not c.colocate:
        usable, share = int(device * ENGINE_GPU_MEM_FRACTION), f" ({ENGINE_GPU_MEM_FRACTION:g} of it: JAX's share)"
    if engines and engine["total"] > usable:
        per_row = engine_cfg.max_seq_len * kv_bytes_per_token(shape, kv_item) // engine_cfg.tp
        rows = (usable - engine["weights"]) // per_row
        more_chips = "more chips per engine (cluster.rollout_chips / cluster.rollout_engines)"
        if rows >= 1:
            fix = (
                f"rollout.max_batch <= {rows} fits, or fewer positions per row (rollout.max_response_len, "
                f"data.max_prompt_len), or {more_chips}"
            )
        else:  # no row count helps
            fix = f"the weights alone ({engine['weights'] / GB:.1f} GB) do not fit: {more_chips}"
        plan.fixes["rollout"] = (
            f"rollout: {engine['total'] / GB:.1f} GB per chip exceeds {usable / GB:.1f} GB{share} by "
            f"{(engine['total'] - usable) / GB:.1f} GB; {fix}"
        )
    if ranks and trainer["total"] > device:
        fsdp = replace(trainer_cfg, parallel="fsdp")
        samples = cfg.rollout.prompts_per_step * cfg.rollout.group_size
        splits = [n for n in range(c.train_chips + 1, MAX_RANKS + 1) if samples % (n * cfg.train.minibatches) == 0]
        fits = next((n for n in splits if per_rank(fsdp, n)["total"] <= device), None)
        shard = f"shard over {fits} ranks" if fits else "shard over more ranks"
        shard += " (cluster.train_chips with train.parallel: fsdp)"
        if trainer["state"] > device:  # no micro-batch size helps: the parameters, masters, gradients and AdamW
            fix = f"its state alone ({trainer['state'] / GB:.1f} GB) does not fit: {shard}"
        else:
            checkpointing = "" if cfg.train.gradient_checkpointing else "set train.gradient_checkpointing: true, "
            fix = f"lower train.micro_batch_tokens, {checkpointing}or {shard}"
        plan.fixes["trainer"] = (
            f"trainer: {trainer['total'] / GB:.1f} GB per rank exceeds {device / GB:.1f} GB by "
            f"{(trainer['total'] - device) / GB:.1f} GB; {fix}"
        )
    return plan


def device_memory(cfg: Config) -> tuple[int | None, str]:
    if cfg.cluster.device_memory_gb is not None:
        return int(cfg.cluster.device_memory_gb * GB), "cluster.device_memory_gb"
    if cfg.cluster.device == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host RAM"
    return None, "unknown: set cluster.device_memory_gb to check"
