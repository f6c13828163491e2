"""The typed run config: YAML files (with `inherit:`) + dotted command-line overrides -> a validated `Config`.

OmegaConf reads and merges the YAML and the `a.b=c` overrides; pydantic checks every key, type and range. Any problem
becomes one `ConfigError` naming the key path and what is allowed; `rlloop.run` turns it into exit code 2.
Relative paths in a file (`model.path`, `data.path`, ...) resolve against that file's directory when they exist there,
so `examples/grpo_dapo_tiny.yaml` works from any working directory.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

PositiveInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]
Prob = Annotated[float, Field(gt=0, le=1)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False, validate_default=True)


class RunConfig(Section):
    name: str = "grpo"
    dir: str = "runs/{name}"              # {name} is filled in
    seed: int = 0
    steps: PositiveInt = 100
    save_every: NonNegInt = 20            # 0: never
    eval_every: NonNegInt = 20            # 0: never


class ModelConfig(Section):
    path: str                             # hub id or local dir with config.json, weights and tokenizer
    tokenizer: str | None = None          # defaults to `path`
    dtype: Literal["float32", "bfloat16"] = "bfloat16"


class DataConfig(Section):
    path: str                             # hub id, parquet/jsonl file, or a directory of them
    split: str = "train"
    prompt_key: str = "prompt"            # a chat-message list (DAPO) or a plain string
    answer_key: str = "reward_model.ground_truth"
    max_prompt_len: PositiveInt = 1024
    on_long_prompt: Literal["drop", "error"] = "drop"   # dropped prompts are counted in the log
    shuffle: bool = True


class EvalConfig(Section):
    path: str | None = None               # None: no evaluation
    name: str | None = None               # logged as eval/<name>; default: the file or dataset name
    split: str = "train"
    samples: PositiveInt = 16             # completions per prompt; the score is mean accuracy
    max_prompts: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0)] = 1.0


class RewardConfig(Section):
    fn: str = "dapo"                      # dapo | math | package.module:function
    timeout_s: Annotated[float, Field(gt=0)] = 10.0
    failure_reward: float = 0.0           # given to a sample whose reward function raised or timed out
    workers: PositiveInt = 2


class RolloutConfig(Section):
    backend: Literal["jax", "hf"] = "jax"
    prompts_per_step: PositiveInt = 32
    group_size: Annotated[int, Field(ge=2)] = 8
    max_response_len: PositiveInt = 8192
    temperature: Annotated[float, Field(gt=0)] = 1.0
    top_p: Prob = 1.0
    top_k: int = -1                       # -1: off
    max_batch: PositiveInt = 256          # decode slots of the engine
    prefill_buckets: list[PositiveInt] | None = None
    decode_buckets: list[PositiveInt] | None = None
    steps_per_dispatch: PositiveInt = 8
    compile_cache_dir: str | None = "~/.cache/rlloop/jax"   # XLA's persistent cache: later runs skip most warmup


class GRPOConfig(Section):
    std_scale: bool = True                # False: Dr.GRPO advantages (no division by the group std)
    clip_eps_low: Annotated[float, Field(ge=0, lt=1)] = 0.2
    clip_eps_high: Annotated[float, Field(ge=0)] = 0.28
    loss_agg: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    importance_level: Literal["token", "sequence"] = "token"
    kl_coef: Annotated[float, Field(ge=0)] = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = 0.0
    tis_cap: Annotated[float, Field(gt=0)] | None = 2.0
    dynamic_sampling: bool = False        # DAPO: drop groups whose rewards are all equal, top the batch up
    max_sampling_rounds: PositiveInt = 3
    overlong_buffer: NonNegInt = 0        # DAPO overlong shaping: last L tokens before the max length are penalised
    overlong_penalty: Annotated[float, Field(ge=0)] = 1.0


class TrainConfig(Section):
    lr: Annotated[float, Field(gt=0)] = 1e-6
    weight_decay: Annotated[float, Field(ge=0)] = 0.1
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.98)
    eps: Annotated[float, Field(gt=0)] = 1e-8
    max_grad_norm: Annotated[float, Field(gt=0)] = 1.0
    micro_batch_tokens: PositiveInt = 16384
    minibatches: PositiveInt = 1          # optimizer steps per rollout batch
    gradient_checkpointing: bool = False


class SyncConfig(Section):
    transport: Literal["shm", "disk", "ray"] = "shm"
    delta: bool = True
    keyframe_every: PositiveInt = 10
    dir: str | None = None                # disk transport root; default <run dir>/sync


class ClusterConfig(Section):
    device: Literal["tpu", "gpu", "cpu"] = "cpu"
    rollout_chips: PositiveInt = 1
    train_chips: PositiveInt = 1
    address: str | None = None            # Ray address; None: $RAY_ADDRESS or a local Ray
    use_ray: bool = True                  # False: everything in this process (debugging)
    cpus_per_actor: PositiveInt = 1


class TrackingConfig(Section):
    wandb: bool = False
    project: str = "rlloop"
    entity: str | None = None
    mode: Literal["auto", "online", "offline", "disabled"] = "auto"   # auto: offline unless an API key is set
    progress: bool = True
    save_rollouts: bool = False           # write each step's samples to <run dir>/rollouts/step_N.jsonl


class Config(Section):
    run: RunConfig = RunConfig()
    model: ModelConfig
    data: DataConfig
    eval: EvalConfig = EvalConfig()
    reward: RewardConfig = RewardConfig()
    rollout: RolloutConfig = RolloutConfig()
    grpo: GRPOConfig = GRPOConfig()
    train: TrainConfig = TrainConfig()
    sync: SyncConfig = SyncConfig()
    cluster: ClusterConfig = ClusterConfig()
    tracking: TrackingConfig = TrackingConfig()

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        if self.grpo.clip_eps_high < self.grpo.clip_eps_low:
            raise ValueError("grpo.clip_eps_high must be >= grpo.clip_eps_low (clip-higher)")
        if self.grpo.overlong_buffer >= self.rollout.max_response_len:
            raise ValueError("grpo.overlong_buffer must be < rollout.max_response_len")
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir.format(name=self.run.name))


class ConfigError(Exception):
    """A config problem; the message names the key path. `rlloop.run` exits with code 2 on it."""


PATH_KEYS = ("model.path", "model.tokenizer", "data.path", "eval.path")


def _load_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """One YAML file merged over the file it `inherit`s from, with its relative paths made absolute."""
    path = path.resolve()
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}" + (f" (inherited by {seen[-1]})" if seen else ""))
    if path in seen:
        raise ConfigError(f"inherit: cycle through {path}")
    try:
        node = OmegaConf.to_container(OmegaConf.load(path))
    except OmegaConfBaseException as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    except Exception as e:  # yaml.YAMLError and friends
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(node, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    for key in PATH_KEYS:
        section, name = key.split(".")
        value = (node.get(section) or {}).get(name) if isinstance(node.get(section), dict) else None
        if isinstance(value, str) and not Path(value).is_absolute() and (path.parent / value).exists():
            node[section][name] = str((path.parent / value).resolve())
    parent = node.pop("inherit", None)
    if parent is None:
        return node
    if not isinstance(parent, str):
        raise ConfigError(f"inherit: expected a file path, got {parent!r}")
    base = _load_yaml(path.parent / parent, seen + (path,))
    return OmegaConf.to_container(OmegaConf.merge(base, node))


def _describe(err: dict) -> str:
    loc = ".".join(str(p) for p in err["loc"]) or "config"
    if err["type"] == "extra_forbidden":
        return f"{loc}: unknown key"
    if err["type"] == "missing":
        return f"{loc}: required key is missing"
    got = err.get("input")
    return f"{loc}: {err['msg']}" + (f", got {got!r}" if not isinstance(got, dict) else "")


def load_config(path: str | Path, overrides: list[str] = ()) -> Config:
    """Read `path` (following `inherit:`), apply `a.b=c` overrides, validate. Raises ConfigError."""
    raw = _load_yaml(Path(path))
    for item in overrides:
        if "=" not in item or not item.split("=", 1)[0]:
            raise ConfigError(f"override {item!r}: expected key.path=value")
    try:
        merged = OmegaConf.merge(OmegaConf.create(raw), OmegaConf.from_dotlist(list(overrides)))
        data = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"override: {e}") from None
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError("invalid config:\n  " + "\n  ".join(_describe(err) for err in e.errors())) from None


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(cfg.model_dump(mode="json")))
