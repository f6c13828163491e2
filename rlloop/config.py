"""The typed run config: YAML files (with `inherit:`) + dotted command-line overrides -> a validated `Config`.

rlloop/config_files.py reads and merges the YAML and the `a.b=c` overrides (OmegaConf); pydantic checks every key, type
and range here, and rlloop/config_checks.py the combinations across sections. Any problem becomes one `ConfigError`
naming the key path and what is allowed; `rlloop.run` turns it into exit code 2.

One source of truth per knob: each component owns its typed config (`rollout.EngineConfig`, `trainer.TrainerConfig`,
`trainer.LossConfig`, `weight_sync.SyncConfig`), and the YAML sections `rollout:`, `train:`, `grpo:` and `sync:` are
made from those fields (`knobs_of`), so a knob is declared, defaulted and range-checked once, in its component.
`Config.engine_config()`, `trainer_config()` and `sync_config()` are the only places that build those configs; the
workers receive the built dataclasses.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from omegaconf import OmegaConf
from pydantic import (
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from rlloop.config_checks import check_across_sections
from rlloop.config_errors import ConfigError, describe, flow_mapping_hint
from rlloop.config_files import read_config
from rlloop.config_types import (
    NonNegInt,
    PathStr,
    PositiveInt,
    Prob,
    Reward,
    Section,
    TimeoutS,
    TopK,
    component_kwargs,
    knobs_of,
    mapping_settings,
)
from rlloop.model_shape import engine_tp
from rlloop.rewards import wrong_answer_score
from rollout import EngineConfig
from rollout.buckets import default_prefill_buckets
from rollout.types import GREEDY_BELOW, INT32_MAX, MAX_STOP_IDS, DType
from trainer import LossConfig, TrainerConfig
from trainer.config import resolve_parallel
from weight_sync import SyncConfig

TORCH_DEVICE = {"tpu": "tpu", "gpu": "cuda", "cpu": "cpu"}


class RunSection(Section):
    name: str = "grpo"
    dir: PathStr = "runs/{name}"  # {name} is filled in
    # 0 .. 2**31 - 1: the rollout's sampling seeds are 31-bit (rollout.types.mix_seed), so a larger seed would draw
    # the samples of a smaller one (and torch.manual_seed refuses one past 64 bits)
    seed: Annotated[int, Field(ge=0, le=INT32_MAX)] = 0
    steps: PositiveInt = 100
    save_every: NonNegInt = 20  # 0: never (the trained policy is not kept)
    keep_checkpoints: PositiveInt | None = 2  # the newest kept; null: all (TRL's save_total_limit)
    eval_every: NonNegInt = 20  # 0: never
    max_restarts: NonNegInt = 3  # engine restarts, and cluster rebuilds after a trainer rank dies, before exit 1
    # slime's debug modes (--debug on the command line): rollout-only generates, scores and saves rollouts with no
    # trainer; train-only trains on the rollouts a run saved (`replay`: its rollouts/ directory) with no engine.
    debug: Literal["off", "rollout-only", "train-only"] = "off"
    replay: PathStr | None = None
    # Steps whose generation and training the engines (JAX's profiler) and trainer ranks (torch's) record into
    # run_dir/profile/ (rlloop/profiling.py); pick ones after the first, whose compiles are done.
    profile_steps: list[PositiveInt] = []

    def saves_at(self, step: int) -> bool:
        """Whether the loop checkpoints after `step`: every `save_every` steps and the last."""
        return bool(self.save_every) and (step % self.save_every == 0 or step == self.steps)

    def evals_at(self, step: int) -> bool:
        """Whether the loop evaluates after `step`: every `eval_every` steps and the last (as verl's final validation;
        the run's summary reports the trained policy's accuracy, not the last multiple's)."""
        return bool(self.eval_every) and (step % self.eval_every == 0 or step == self.steps)

    @field_validator("name")
    @classmethod
    def _name_is_one_path_part(cls, v: str) -> str:
        # it names the run directory (run.dir's {name}) and the W&B run: "../x" or "a/b" would put the run elsewhere
        if v in ("", ".", "..") or "/" in v or "\\" in v or "\0" in v:
            raise ValueError("must be one part of a path (it fills in run.dir's {name}); put a path in run.dir instead")
        return v

    @field_validator("dir")
    @classmethod
    def _dir_fills_in_name_only(cls, v: str) -> str:
        try:
            v.format(name="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"may hold {{name}} and no other {{field}} ({type(e).__name__}: {e})") from None
        return v

    @model_validator(mode="after")
    def _profile_within_run(self) -> RunSection:
        if self.profile_steps and max(self.profile_steps) > self.steps:
            raise ValueError(f"profile_steps {self.profile_steps} go past steps={self.steps}")
        return self


class ModelSection(Section):
    path: PathStr  # hub id or local dir with config.json, weights and tokenizer
    tokenizer: PathStr | None = None  # defaults to `path`
    dtype: DType = "float32"  # engine and trainer; the real recipe sets bfloat16
    trust_remote_code: bool = False  # run code shipped with the checkpoint (auto_map): only when asked by name


# apply_chat_template's own arguments, which rlloop sets: not for data.chat_template_kwargs
TEMPLATE_CALL_ARGS = frozenset(
    "conversation add_generation_prompt continue_final_message tokenize padding truncation max_length "
    "return_tensors return_dict return_assistant_tokens_mask tokenizer_kwargs".split()
)


class DataSection(Section):
    path: PathStr  # hub id, parquet/jsonl file, or a directory of them (a hub snapshot)
    # As datasets.load_dataset takes them: the split (a single file is "train"; slices such as "train[:1000]"), and
    # the subset of a hub id or snapshot whose README declares several configs (TRL's dataset_config, datasets' name)
    split: str = "train"
    subset: str | None = None
    prompt_key: str = "prompt"  # a chat-message list (DAPO) or a plain string
    answer_key: str = "reward_model.ground_truth"
    max_prompt_len: PositiveInt = 1024
    on_long_prompt: Literal["drop", "error"] = "drop"  # dropped prompts are counted in the log
    shuffle: bool = True  # a new seeded order of the rows every epoch (run.seed); false: the file's order
    # Each distinct (prompt, answer) once, the first row of it: the hub's DAPO-Math-17k repeats each prompt ~100x
    # (slime and Miles train on a deduplicated copy); false: every row, repeats too
    dedup: bool = True
    # More arguments for the tokenizer's chat template, eval prompts' too: {enable_thinking: false} turns Qwen3's
    # thinking off (TRL's chat_template_kwargs, verl's data.apply_chat_template_kwargs)
    chat_template_kwargs: dict[str, Any] = {}

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_the_calls_own(cls, v: dict[str, Any]) -> dict[str, Any]:
        if odd := [k for k in v if not k.isidentifier()]:  # the template reads each as a variable
            raise ValueError(f"{odd[0]!r} is not a name a template can read{flow_mapping_hint(odd[0], v[odd[0]])}")
        if own := sorted(set(v) & TEMPLATE_CALL_ARGS):
            raise ValueError(f"{', '.join(own)}: rlloop sets it (the prompt is rendered with a generation prompt)")
        return v


class EvalSection(Section):
    path: PathStr | None = None  # None: no evaluation
    name: str | None = None  # logged as eval/<name>; default: the file or dataset name
    split: str = "train"  # and subset: as data.split and data.subset
    subset: str | None = None
    samples: PositiveInt = 16  # completions per prompt; the score is mean accuracy
    max_prompts: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 1.0
    top_p: Prob | None = None  # None: rollout.top_p
    top_k: TopK | None = None  # None: rollout.top_k (eval always stops at EOS, whatever rollout.ignore_eos says)


class RewardSection(Section):
    fn: str = "dapo"  # dapo | math | package.module:function
    timeout_s: TimeoutS = 10.0
    # Given to a sample whose reward function raised or timed out; null: a built-in's wrong-answer score (dapo -1,
    # math 0; rlloop.rewards.wrong_answer_score), else 0. Above the wrong answers', a failed sample would get the
    # group's best advantage: set it for a function of your own that scores wrong answers below 0.
    failure_reward: Reward | None = None
    workers: PositiveInt = 2

    @model_validator(mode="after")
    def _failure_scores_as_wrong(self) -> RewardSection:
        if self.failure_reward is None:
            self.failure_reward = wrong_answer_score(self.fn)
        return self


# Fields of both components that the model and run sections set (`engine_config`, `trainer_config`)
WIRED_FROM_MODEL = {
    "model_path": "model.path",
    "trust_remote_code": "model.trust_remote_code",
    "dtype": "model.dtype",
    "seed": "run.seed",
}
ENGINE_WIRED = WIRED_FROM_MODEL | {
    "max_seq_len": "data.max_prompt_len + rollout.max_response_len",
    "tp": "cluster.rollout_chips / cluster.rollout_engines (on CPU, a device per core)",
}


# The engine's own knobs (max_batch, buckets, steps_per_dispatch) come from rollout.EngineConfig; the model, dtype,
# sequence length, chips and seed are wired from the model, data, cluster and run sections.
class RolloutSection(knobs_of(EngineConfig, wired=ENGINE_WIRED)):
    backend: Literal["jax", "hf"] = "jax"
    prompts_per_step: PositiveInt = 32
    group_size: int = 8  # >= 2 (_group_size)
    max_response_len: PositiveInt = 8192
    # The trainer scores samples at this temperature (_sampled); eval.temperature may be 0, greedy
    temperature: Annotated[float, Field(allow_inf_nan=False)] = 1.0
    top_p: Prob = 1.0
    top_k: TopK = -1
    ignore_eos: bool = False  # benchmarks: responses run past EOS to max_response_len (stop_token_ids still stop them)
    # Ids that end a response besides the EOS ids of the tokenizer and of generation_config.json (slime's
    # --rollout-stop-token-ids): e.g. <|im_end|> for a base model whose tokenizer's EOS is <|endoftext|>
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=INT32_MAX)]], Field(max_length=MAX_STOP_IDS - 1)] = []
    compile_cache_dir: str | None = "~/.cache/rlloop/jax"  # XLA's persistent cache: later runs skip most warmup

    @field_validator("temperature")
    @classmethod
    def _sampled(cls, t: float) -> float:  # the engine decodes greedily below GREEDY_BELOW, as vLLM does
        if t < GREEDY_BELOW:
            raise ValueError(
                f"GRPO samples: at least {GREEDY_BELOW:g} (greedy decoding would give every sample of a group the same "
                "response, and the trainer divides the logits by it); eval.temperature=0 evaluates greedily"
            )
        return t

    @field_validator("group_size")
    @classmethod
    def _group_size(cls, v: int) -> int:  # not Field(ge=2): the message says why
        if v < 2:
            raise ValueError("GRPO's advantage compares the samples of one prompt with each other: needs >= 2")
        return v


# The policy loss's knobs come from trainer.LossConfig; the rest shape rewards and batches before the trainer.
class GRPOSection(knobs_of(LossConfig)):
    std_scale: bool = True  # False: Dr.GRPO advantages (no division by the group std)
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, top the batch up
    max_sampling_rounds: PositiveInt = 3
    overlong_buffer: NonNegInt = 0  # DAPO overlong shaping: last L tokens before the max length are penalised
    overlong_penalty: Annotated[Reward, Field(ge=0)] = 1.0


# All of trainer.TrainerConfig but what other sections decide (the model, devices, sampling temperature, lengths, and
# the optimizer updates of the whole run).
TRAINER_WIRED = WIRED_FROM_MODEL | {
    "device": "cluster.device",
    "temperature": "rollout.temperature",
    "max_response_len": "rollout.max_response_len",
    "loss": "the grpo section",
    "total_updates": "run.steps x train.minibatches",
}
TrainSection = knobs_of(TrainerConfig, wired=TRAINER_WIRED)


# The weight-sync knobs come from weight_sync.SyncConfig; the run's id is the run directory's (`sync_config`).
SyncSection = knobs_of(SyncConfig, wired={"run_id": "run.dir"})  # sync.dir: None is <run dir>/sync


class ClusterSection(Section):
    device: Literal["tpu", "gpu", "cpu"] = "cpu"
    rollout_chips: PositiveInt = 1
    rollout_engines: PositiveInt = 1  # each engine gets rollout_chips / rollout_engines chips (its TP size)
    # Engines and trainer ranks share the same chips in turns (Miles/slime's default on one node): the engine frees
    # its KV cache and weights while the trainer steps; the trainer offloads to host memory while the engine runs
    # (on CPU this is time-sharing only). Needs rollout_chips == train_chips and loop.mode: sync.
    colocate: bool = False
    train_chips: PositiveInt = 1
    address: str | None = None  # Ray address; None: $RAY_ADDRESS or a local Ray
    use_ray: bool = True  # False: everything in this process (debugging)
    cpus_per_actor: PositiveInt = 1
    # Memory of one chip, for the memory plan checked at start (rlloop/memory.py); None: the host's RAM on CPU,
    # unchecked on accelerators. E.g. 141 for an H200, 192 for a TPU v7x chip.
    device_memory_gb: Annotated[float, Field(gt=0)] | None = None
    # an actor call taking longer counts as dead (a generation gets this for each full batch of rollout.max_batch
    # sequences it holds: a large evaluation is not a hang)
    actor_timeout_s: TimeoutS | None = 1800.0
    # The same for an actor's start: process, imports, model load (setup), checkpoint load, warmup compiles, the
    # first train step (optimizer state; train.compile's compile). Kept apart so that a short actor_timeout_s (a hang
    # noticed fast) does not take a slow start for a hang.
    actor_start_timeout_s: TimeoutS | None = 3600.0
    # How long the run's placement group may wait for a Ray cluster it joined (cluster.address, a Ray job) to have
    # the resources: an autoscaler adding TPU or GPU nodes takes minutes. A local Ray is checked at once instead.
    placement_timeout_s: TimeoutS = 600.0
    # Extra Ray resources each engine / trainer-rank bundle asks for: node labels that pin the roles to nodes, e.g.
    # {node_a: 0.01} with `ray start --resources='{"node_a": 1}'` on that node.
    rollout_resources: dict[str, Annotated[float, Field(gt=0)]] = {}
    trainer_resources: dict[str, Annotated[float, Field(gt=0)]] = {}
    # Ray runtime_env of each role's actors, over rlloop's (whose env_vars theirs override): an environment of its own,
    # e.g. {py_executable: /opt/jax-tpu/bin/python} for the engine and torch_tpu's for the trainer, since jax[tpu] and
    # torch_tpu pin different libtpu versions (README, TPU install).
    rollout_runtime_env: dict[str, Any] = {}
    trainer_runtime_env: dict[str, Any] = {}


class LoopSection(Section):
    # sync: rollout, then train, then sync. async: one step off-policy (slime's train_async): step k+1 generates on
    # the engines' weights while step k trains. fully_async: the engines generate continuously into a buffer and
    # load new weights between decode dispatches (PipelineRL / Miles --fully-async). docs/design.md §9.
    mode: Literal["sync", "async", "fully_async"] = "sync"
    max_staleness: NonNegInt = 1  # fully_async: a group whose first version lags the trainer by more is dropped


class TrackingSection(Section):
    wandb: bool = False
    project: str = "rlloop"
    entity: str | None = None  # the W&B team or user the run is logged under (None: the API key's default)
    mode: Literal["auto", "online", "offline", "disabled"] = "auto"  # auto: offline unless an API key is set
    progress: bool = True
    save_rollouts: bool = False  # write each step's samples to <run dir>/rollouts/step_NNNNNN.jsonl
    sample_every: NonNegInt = 10  # W&B: a table of the step's completions every N steps (0: never)


class Config(Section):
    run: RunSection = RunSection()
    model: ModelSection
    data: DataSection
    eval: EvalSection = EvalSection()
    reward: RewardSection = RewardSection()
    rollout: RolloutSection = RolloutSection()
    grpo: GRPOSection = GRPOSection()
    train: TrainSection = TrainSection()
    sync: SyncSection = SyncSection()
    cluster: ClusterSection = ClusterSection()
    loop: LoopSection = LoopSection()
    tracking: TrackingSection = TrackingSection()

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        check_across_sections(self)  # rlloop/config_checks.py
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir.format(name=self.run.name))

    @property
    def train_parallel(self) -> str:
        """The trainer ranks' mode, `train.parallel` resolved over `cluster.train_chips` (one rank: ddp)."""
        return resolve_parallel(self.train.parallel, self.cluster.train_chips)

    # -- the components' configs, built here and nowhere else ------------------------------------------------------
    def engine_config(self) -> EngineConfig:
        knobs = component_kwargs(self.rollout, EngineConfig)
        # No prompt longer than data.max_prompt_len reaches the engine (rlloop.data drops it): its prefill programs, and
        # the positions each GRPO fan-out copies, stop there instead of at the engine's own max_seq_len - 1.
        knobs["prefill_buckets"] = knobs["prefill_buckets"] or default_prefill_buckets(self.data.max_prompt_len)
        return EngineConfig(
            **knobs,
            model_path=self.model.path,
            trust_remote_code=self.model.trust_remote_code,
            dtype=self.model.dtype,
            max_seq_len=self.data.max_prompt_len + self.rollout.max_response_len,
            tp=engine_tp(self),
            seed=self.run.seed,
        )

    def trainer_config(self) -> TrainerConfig:
        return TrainerConfig(
            **component_kwargs(self.train, TrainerConfig),
            model_path=self.model.path,
            trust_remote_code=self.model.trust_remote_code,
            dtype=self.model.dtype,
            device=TORCH_DEVICE[self.cluster.device],
            temperature=self.rollout.temperature,
            max_response_len=self.rollout.max_response_len,
            seed=self.run.seed,
            total_updates=self.run.steps * self.train.minibatches,
            loss=self.loss_config(),
        )

    def loss_config(self) -> LossConfig:
        return LossConfig(**component_kwargs(self.grpo, LossConfig))

    def sync_config(self) -> SyncConfig:
        """The `sync:` section's knobs, plus the run's identity and the disk root's default (in the run directory)."""
        knobs = component_kwargs(self.sync, SyncConfig)
        # absolute: the actors' working directory need not be the driver's
        knobs["dir"] = str(Path(knobs["dir"] or self.run_dir / "sync").absolute())
        return SyncConfig(**knobs, run_id=run_id_for(self.run_dir))


def run_id_for(run_dir: Path) -> str:
    """Stable across resumes of one run directory, distinct between runs: it names shared-memory segments."""
    digest = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '-', Path(run_dir).name)[:32]}-{digest}"


def load_config(path: str | Path, overrides: list[str] = ()) -> Config:
    """Read `path` (following `inherit:`), apply `a.b=c` overrides, validate. Raises ConfigError."""
    data = read_config(Path(path), overrides, mapping_settings(Config))
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError("invalid config:\n  " + "\n  ".join(describe(err, Config) for err in e.errors())) from None


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(cfg.model_dump(mode="json")))
