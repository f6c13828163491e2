"""The trainer's typed configs: `TrainerConfig` (model, optimizer, micro-batching) and `LossConfig` (the policy loss).

Each knob is declared once, here, with its type, default and allowed range; pydantic validates on construction,
whether the config comes from a test or from the run config (rlloop/config.py turns these fields into the YAML
`train:` and `grpo:` sections, so a new field here is a new YAML key). Imports no torch, so the driver can build and
validate a config without loading the trainer.
"""

from __future__ import annotations

import os
from typing import Annotated, Literal

from pydantic import BeforeValidator, ConfigDict, Field, model_validator
from pydantic.dataclasses import dataclass

# A [chunk, V] fp32 logits tensor in trainer/logprobs.py holds at most this many elements unless its `chunk_size`
# says otherwise: 64 MiB (110 positions for a 151,936-token vocabulary, every position at once for a tiny test
# vocabulary); on CUDA 8x that, where 110 positions leave a chunk's kernels too small to fill the GPU (an H200 train
# step on Qwen3-0.6B shapes: 1.28x faster with 883-position chunks) and a GPU has the memory. A chunk's backward holds
# about five such tensors (recomputed logits, softmax, their gradients). Here, not there, so that trainer/memory.py
# plans with it without importing torch.
CHUNK_ELEMENTS = 1 << 24
CUDA_CHUNK_ELEMENTS = 1 << 27
BF16_CPU_PAD = 32  # `TrainerConfig.pad_to_multiple_of` in bf16 on CPU


def chunk_elements(device: str) -> int:
    """The elements of a [chunk, V] logits tensor on `device` (a torch device type: cpu, cuda, tpu)."""
    return CUDA_CHUNK_ELEMENTS if device == "cuda" else CHUNK_ELEMENTS


def _compile_scope(value):
    """`TrainerConfig.compile` as YAML's booleans: true compiles each decoder layer, false nothing."""
    return {True: "layers", False: "off"}[value] if isinstance(value, bool) else value


Fraction = Annotated[float, Field(ge=0, lt=1)]
PositiveInt = Annotated[int, Field(ge=1)]
STRICT = ConfigDict(extra="forbid")


@dataclass(config=STRICT)
class LossConfig:
    """The GRPO-family policy loss (trainer/loss.py; definitions and TRL names in docs/design.md §4)."""

    clip_eps_low: Annotated[float, Field(ge=0)] = 0.2
    clip_eps_high: Annotated[float, Field(ge=0)] = 0.28  # clip-higher (DAPO): ε_high > ε_low lets rare tokens rise
    # Dual-clip (verl's clip_ratio_c, slime's eps_clip_c): with A < 0 a token's loss is at most −A·c; None: off
    clip_ratio_c: Annotated[float, Field(gt=1)] | None = None
    loss_agg: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    kl_coef: Annotated[float, Field(ge=0)] = 0.0  # β; 0 skips the reference model entirely
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = 0.0  # bonus weight; entropy is computed and logged either way
    tis_cap: Annotated[float, Field(gt=0)] | None = 2.0  # C of truncated importance sampling; None disables it
    importance_level: Literal["token", "sequence"] = "token"  # sequence: GSPO

    @model_validator(mode="after")
    def _clip_higher(self) -> LossConfig:
        if self.clip_eps_high < self.clip_eps_low:
            raise ValueError("clip_eps_high must be >= clip_eps_low (clip-higher)")
        return self


@dataclass(config=STRICT)
class TrainerConfig:
    model_path: Annotated[str, BeforeValidator(os.fspath)]  # HF dir or hub id (AutoModelForCausalLM)
    trust_remote_code: bool = False  # run Python shipped with the checkpoint (auto_map); off unless asked for
    dtype: Literal["float32", "bfloat16"] = "float32"  # model params and compute; AdamW masters stay fp32
    device: Literal["cpu", "cuda", "tpu"] = "cpu"  # tpu needs torch_tpu, never installed on CPU machines
    # ddp: every rank a full replica; fsdp: FSDP2 shards of parameters, gradients and AdamW state (trainer/parallel.py);
    # auto: fsdp with several ranks. One rank is the plain model in every mode.
    parallel: Literal["auto", "ddp", "fsdp"] = "auto"
    lr: Annotated[float, Field(gt=0)] = 1e-6
    weight_decay: Annotated[float, Field(ge=0)] = 0.1  # on matrices only; norms and biases are not decayed
    betas: tuple[Fraction, Fraction] = (0.9, 0.98)
    eps: Annotated[float, Field(gt=0)] = 1e-8
    max_grad_norm: Annotated[float, Field(gt=0)] = 1.0
    max_bad_steps: PositiveInt = 3  # non-finite loss/gradient steps in a row (each skipped) before training stops
    adamw_fused: bool = False  # torch's fused AdamW kernel (CPU and CUDA): one kernel per step, not one per tensor
    lr_warmup_steps: Annotated[int, Field(ge=0)] = 0  # linear warmup to `lr` over this many updates (the recipe: 0)
    # After the warmup: "constant" (verl's and slime's default), or "linear" / "cosine" (transformers' schedules; TRL's
    # default is linear) down to `min_lr_ratio` x lr at update `total_updates`
    lr_decay: Literal["constant", "linear", "cosine"] = "constant"
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.0  # where linear and cosine end (verl's min_lr_ratio)
    total_updates: PositiveInt | None = None  # the run's optimizer updates (run.steps x minibatches); decay needs it
    micro_batch_tokens: PositiveInt = 16384  # micro-batches packed to this token budget (padded length × rows)
    # Micro-batch rows padded to a multiple of this many positions, as HF's collators' `pad_to_multiple_of`; None: 32 in
    # bf16 on CPU, else 1 (`pad_multiple`). CPU runs a bf16 matmul through oneDNN, which builds a kernel for each new
    # shape and caches it, and micro-batches of a new width every step rebuilt them every step: the tiny recipe's bf16
    # train step took 93-97 ms on fresh batches, 59-66 ms with rows padded to 32 (8: 63-65, 64: 73). fp32 builds
    # nothing per shape and lost 4-7% to the padding.
    pad_to_multiple_of: PositiveInt | None = None
    minibatches: PositiveInt = 1  # optimizer steps per rollout batch (1 = one step per rollout, the recipe)
    # A row per prompt holding several of its GRPO samples (trainer/batching.py): the prompt runs once per row, not once
    # per sample. Same log-probs; pays when prompts are long next to responses. Needs SDPA or eager attention and no
    # sliding-window layers.
    share_prompts: bool = False
    # A sample whose advantage is 0 (its group's rewards all equal) adds exactly nothing to the gradient while kl_coef
    # and entropy_coef are 0: its forward and backward are skipped. It still counts in the loss's normalisers, so the
    # update is the whole batch's; the token-mean metrics (entropy, clip fraction, log-prob gap) cover trained samples.
    skip_zero_advantage: bool = True
    temperature: Annotated[float, Field(gt=0)] = 1.0  # log-probs are of logits / temperature (the sampling one)
    max_response_len: PositiveInt | None = None  # dr_grpo's constant; None: the longest response in the minibatch
    loss: LossConfig = Field(default_factory=LossConfig)
    gradient_checkpointing: bool = False
    # torch.compile (inductor, dynamic shapes), "layers": each decoder layer, one graph for all of them, which fuses the
    # norms, RoPE and the MLP's elementwise ops around the matmuls and attention: 1.10-1.15x on the tiny recipe's train
    # step (one CPU thread), 1.05-1.07x on a 28M model, after a one-off compile in the first step (8 s to ~1 min here).
    # "model": the whole decoder as one graph, which also fuses what runs between and around the layers (embedding,
    # RoPE tables, final norm): another 1.06x on the tiny step, but its compile grows with the depth (cold, 23 s
    # against 6 s for the tiny model's 2 layers), so it is for small models; not under fsdp, whose units are the
    # layers. true and false read as "layers" and "off". Log-probs move by ~1e-5 in fp32 (another op order), and in
    # bf16 the engine-trainer gap (train/logprob_abs_diff) grows from ~2e-6 to ~7e-4 on the tiny model (inductor
    # rounds where the eager ops the engine matches do not), so it is off by default and the exactness tests run
    # eager. "layers" is untested under fsdp.
    compile: Annotated[Literal["off", "layers", "model"], BeforeValidator(_compile_scope)] = "off"
    seed: int = 0

    @model_validator(mode="after")
    def _decay_has_an_end(self) -> "TrainerConfig":
        if self.lr_decay != "constant" and self.total_updates is None:
            raise ValueError(f"lr_decay={self.lr_decay!r} decays over total_updates, which is not set")
        return self

    @property
    def pad_multiple(self) -> int:
        """What micro-batch rows are padded to a multiple of (`pad_to_multiple_of`, resolved)."""
        if self.pad_to_multiple_of is not None:
            return self.pad_to_multiple_of
        return BF16_CPU_PAD if self.dtype == "bfloat16" and self.device == "cpu" else 1


def resolve_parallel(parallel: str, world_size: int) -> str:
    """`TrainerConfig.parallel` over `world_size` ranks: `auto` is fsdp with several; one rank has nothing to shard,
    so every mode is the plain model."""
    if world_size == 1:
        return "ddp"
    return "fsdp" if parallel == "auto" else parallel
