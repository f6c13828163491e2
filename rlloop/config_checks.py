"""The run config's checks across sections: what no single section can see wrong (a mode and the knob it needs, the
chips and the roles on them, the batch and its splits, the buckets and the lengths), and the cluster's Ray settings
that Ray itself would refuse only once the actors start, run once every section is valid, so that a bad combination
exits 2 naming its keys before any actor starts."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pydantic import ValidationError

from rlloop.config_errors import describe
from rollout.buckets import validate_buckets

TPU_CHIPS_PER_ACTOR = (1, 2, 4, 8)  # what Ray's TPU accelerator manager grants one actor
# Resources Ray defines itself (and accelerator_type:<kind>): the placement plan sets CPU and the chips, so one of
# these in cluster.*_resources replaced (or, colocated, added to) the plan's counts without a word
RAY_OWN_RESOURCES = ("CPU", "GPU", "TPU", "memory", "object_store_memory")

if TYPE_CHECKING:
    from rlloop.config import Config

log = logging.getLogger("rlloop.config")


def check_across_sections(cfg: Config) -> None:
    """ValueError naming the keys of the first combination of settings that cannot run."""
    checks = (
        _modes_and_loss,
        _without_ray,
        _colocated,
        _chips_per_engine,
        _batch_and_buckets,
        _components,
        _ray_settings,
    )
    for check in checks:
        check(cfg)
    _unused_eval_settings(cfg)
    _settings_the_mode_ignores(cfg)
    _lr_schedule(cfg)
    if not cfg.run.save_every and cfg.run.debug != "rollout-only":
        log.warning("run.save_every=0: no checkpoint is written, so the trained policy is not kept (nor resumable)")


def _modes_and_loss(cfg: Config) -> None:
    if (cfg.run.debug == "train-only") != (cfg.run.replay is not None):
        raise ValueError(
            "run.replay (the rollouts/ directory of a run made with tracking.save_rollouts or --debug "
            "rollout-only) goes with run.debug: train-only, and train-only needs it"
        )
    if cfg.grpo.overlong_buffer >= cfg.rollout.max_response_len:
        raise ValueError("grpo.overlong_buffer must be < rollout.max_response_len")
    g = cfg.grpo
    if g.overlong_buffer and g.std_scale and not g.dynamic_sampling:
        # Eight wrong answers and one small length penalty: std scaling makes that penalty a full-size advantage
        # (+0.35 x 7, -2.46). Dynamic sampling drops such groups by their raw reward first, as DAPO does.
        log.warning(
            "grpo.overlong_buffer with grpo.std_scale and without grpo.dynamic_sampling: in a group whose answers"
            " are all equally right or wrong, the length penalty alone becomes full-size advantages; set "
            "grpo.dynamic_sampling: true (DAPO's pairing) or grpo.std_scale: false"
        )
    if cfg.loop.mode != "sync" and cfg.grpo.tis_cap is None:
        raise ValueError(
            f"loop.mode={cfg.loop.mode} trains on samples of older weights: it needs the off-policy "
            "correction against the rollout log-probs, grpo.tis_cap (e.g. 2.0), not null"
        )


def _without_ray(cfg: Config) -> None:
    """cluster.use_ray: false runs one engine and one trainer rank in this process."""
    c = cfg.cluster
    if not c.use_ray and c.train_chips > 1:
        raise ValueError(
            f"cluster.train_chips={c.train_chips}: trainer ranks are Ray actors; set cluster.use_ray: true"
        )
    if not c.use_ray and c.device == "tpu":
        raise ValueError(
            "cluster.use_ray: false runs the engine and the trainer in this one process, which on TPU would need "
            "jax[tpu] and torch_tpu in one environment and both on one chip: set cluster.use_ray: true"
        )
    if not c.use_ray and c.device == "gpu" and not c.colocate:
        raise ValueError(
            "cluster.use_ray: false runs the engine and the trainer in this one process on one GPU: set "
            "cluster.colocate: true (they take turns on it), or cluster.use_ray: true (a GPU each)"
        )
    trains = cfg.run.debug != "rollout-only"
    if (
        not c.use_ray
        and trains
        and cfg.rollout.backend == "hf"
        and cfg.loop.mode != "sync"
        and cfg.train.compile != "off"
    ):
        raise ValueError(
            f"rollout.backend=hf with train.compile={cfg.train.compile} and loop.mode={cfg.loop.mode}, without Ray: "
            "the HF engine generates in a thread of this process while torch.compile traces the trainer's layers in "
            "another, and transformers' attention wrapper cannot be traced and run at once (the run crashed in "
            "torch._dynamo); set cluster.use_ray: true (each in a process of its own), train.compile: off, or "
            "loop.mode: sync"
        )
    if not c.use_ray and cfg.sync.transport == "ray":
        raise ValueError("sync.transport: ray moves weights through Ray's object store; set cluster.use_ray: true")
    if not c.use_ray and c.rollout_chips > c.rollout_engines:
        raise ValueError(
            f"cluster.rollout_chips={c.rollout_chips} over cluster.rollout_engines={c.rollout_engines} gives an engine "
            f"{c.rollout_chips // c.rollout_engines} chips (tensor parallel), which Ray's placement provides; without "
            "Ray an engine runs in this process on one chip: set cluster.use_ray: true, or one chip per engine"
        )


def _colocated(cfg: Config) -> None:
    """cluster.colocate: the engines and the trainer ranks take turns on the same chips."""
    c = cfg.cluster
    if c.colocate and cfg.loop.mode != "sync":
        raise ValueError(
            f"cluster.colocate: true takes turns on the chips, so it cannot overlap rollout and "
            f"training: loop.mode must be sync, got {cfg.loop.mode}"
        )
    if c.colocate and c.device == "tpu":
        raise ValueError(
            "cluster.colocate: true needs cluster.device gpu or cpu: a TPU chip serves one process at "
            "a time, so the engine and the trainer cannot take turns on it"
        )
    if c.colocate and c.device == "gpu" and c.rollout_chips > c.rollout_engines:
        raise ValueError(
            f"cluster.colocate: true on GPUs needs one chip per engine (cluster.rollout_engines="
            f"{c.rollout_chips}, not {c.rollout_engines}): Ray gives an actor a fraction of one GPU or whole ones,"
            " so a tensor-parallel engine would not see its GPUs and its trainer ranks would share one"
        )
    if c.colocate and c.rollout_chips != c.train_chips:
        raise ValueError(
            f"cluster.colocate: true puts both roles on the same chips: cluster.rollout_chips "
            f"({c.rollout_chips}) must equal cluster.train_chips ({c.train_chips})"
        )


def _chips_per_engine(cfg: Config) -> None:
    c = cfg.cluster
    if c.device == "tpu" and cfg.rollout.backend == "hf":  # transformers' generate has no TPU path here
        raise ValueError("rollout.backend: hf generates on cpu or gpu; on cluster.device: tpu the engine is jax")
    if c.rollout_engines > c.rollout_chips:
        raise ValueError(
            f"cluster.rollout_engines={c.rollout_engines} is more engines than cluster.rollout_chips="
            f"{c.rollout_chips}: each engine needs at least one chip of its own"
        )
    if c.rollout_chips % c.rollout_engines:
        raise ValueError(
            f"cluster.rollout_chips={c.rollout_chips} does not split evenly over "
            f"cluster.rollout_engines={c.rollout_engines}"
        )
    if c.device == "tpu" and (chips := c.rollout_chips // c.rollout_engines) not in TPU_CHIPS_PER_ACTOR:
        raise ValueError(
            f"cluster.rollout_chips={c.rollout_chips} over cluster.rollout_engines={c.rollout_engines} gives an engine "
            f"{chips} TPU chips; Ray gives an actor {', '.join(map(str, TPU_CHIPS_PER_ACTOR))} chips of a host"
        )


def _batch_and_buckets(cfg: Config) -> None:
    c, r, t, p = cfg.cluster, cfg.rollout, cfg.train, cfg.data.max_prompt_len
    if t.compile == "model" and cfg.train_parallel == "fsdp":
        raise ValueError(
            f"train.compile=model compiles the whole decoder as one graph, but fsdp (train.parallel={t.parallel} "
            f"with cluster.train_chips={c.train_chips}) shards it layer by layer: use train.compile=layers, or "
            "train.parallel=ddp"
        )
    samples, shares = r.prompts_per_step * r.group_size, c.train_chips * t.minibatches
    if samples % shares:  # ranks would get unequal shares, and optimizer steps unequal minibatches
        raise ValueError(
            f"rollout.prompts_per_step x rollout.group_size = {r.prompts_per_step} x {r.group_size} = {samples}"
            f" samples per step do not split evenly over cluster.train_chips x train.minibatches = "
            f"{c.train_chips} x {t.minibatches} = {shares}; make the product a multiple of {shares}"
        )
    if r.prefill_buckets and max(r.prefill_buckets) < p:  # None / []: the engine's defaults cover every prompt
        raise ValueError(
            f"rollout.prefill_buckets {list(r.prefill_buckets)} do not cover data.max_prompt_len={p}: a longer "
            f"prompt cannot be prefilled; add a bucket >= {p} or lower data.max_prompt_len"
        )
    # The engine's own bucket rules (rollout.buckets), here rather than in an actor minutes later.
    for kind, limit, why in (
        ("prefill", p + r.max_response_len - 1, "data.max_prompt_len + rollout.max_response_len - 1"),
        ("decode", r.max_batch, "rollout.max_batch"),
    ):
        buckets = getattr(r, f"{kind}_buckets")
        try:
            if buckets:
                validate_buckets(f"rollout.{kind}_buckets", buckets, limit, kind == "decode")
        except ValueError as e:  # `why` names the limit's keys: not for a size below 1, which breaks no limit
            raise ValueError(f"{e}{f' ({why})' if min(buckets) >= 1 else ''}") from None


def _components(cfg: Config) -> None:
    """The components' own checks (cross-field ones too) at load time, not in an actor minutes later."""
    for section, build in (
        ("grpo", cfg.loss_config),
        ("rollout", cfg.engine_config),
        ("train", cfg.trainer_config),
    ):
        try:
            build()
        except ValidationError as e:
            raise ValueError("; ".join(_component_error(err, cfg, section) for err in e.errors())) from None


def _component_error(err: dict, cfg: Config, section: str) -> str:
    """A component's error as one line naming the key path. A component's own cross-field check (no path) names its
    field bare ("clip_eps_high must be >= ..."): that becomes the section's key (grpo.clip_eps_high)."""
    msg = err["msg"].removeprefix("Value error, ")
    if not err["loc"] and msg.split(" ", 1)[0] in type(getattr(cfg, section)).model_fields:
        return f"{section}.{msg}"
    return describe(err, type(cfg), section)


def _lr_schedule(cfg: Config) -> None:
    """Schedule settings that would do nothing, said rather than silently ignored."""
    t, updates = cfg.train, cfg.run.steps * cfg.train.minibatches
    if t.lr_decay == "constant" and _given(t, "min_lr_ratio"):
        log.warning("train.min_lr_ratio=%s does nothing with train.lr_decay: constant", t.min_lr_ratio)
    if t.lr_warmup_steps >= updates:
        log.warning(
            "train.lr_warmup_steps=%d outlasts the run's %d updates (run.steps x train.minibatches): the rate never "
            "reaches train.lr",
            t.lr_warmup_steps,
            updates,
        )


def _given(section, name: str) -> bool:
    """Whether a setting was given a value other than its default: a run's own config.yaml, fed back in, sets every
    key, most to their defaults, and those are no one's choice to warn about."""
    return name in section.model_fields_set and getattr(section, name) != type(section).model_fields[name].default


def _unused_eval_settings(cfg: Config) -> None:
    """Evaluation settings without eval.path, or with run.eval_every 0 (no evaluation runs), are ignored: say so
    rather than silently."""
    if cfg.eval.path is not None:
        if not cfg.run.eval_every:
            log.warning("run.eval_every=0, so no evaluation runs: eval.path %s set but unused", cfg.eval.path)
        return
    unused = [f"eval.{k}" for k in type(cfg.eval).model_fields if _given(cfg.eval, k) and k != "path"]
    if cfg.run.eval_every and _given(cfg.run, "eval_every"):
        unused.append(f"run.eval_every={cfg.run.eval_every}")
    if unused:
        log.warning("no eval.path, so no evaluation runs: %s set but unused", ", ".join(unused))


def _settings_the_mode_ignores(cfg: Config) -> None:
    """Settings another one makes idle, said rather than silently ignored (like the eval settings above)."""
    idle = []
    if _given(cfg.sync, "dir") and cfg.sync.transport != "disk":
        idle.append(f"sync.dir (only sync.transport=disk reads it; this run's is {cfg.sync.transport})")
    if _given(cfg.grpo, "max_sampling_rounds") and not cfg.grpo.dynamic_sampling:
        idle.append("grpo.max_sampling_rounds (only grpo.dynamic_sampling draws more rounds)")
    if cfg.cluster.address and not cfg.cluster.use_ray:
        idle.append("cluster.address (cluster.use_ray=false: no Ray is joined)")
    if _given(cfg.loop, "max_staleness") and cfg.loop.mode != "fully_async":
        idle.append(f"loop.max_staleness (only loop.mode=fully_async admits by it; this run's is {cfg.loop.mode})")
    for what in idle:
        log.warning("%s: set but unused", what)


def _ray_settings(cfg: Config) -> None:
    """cluster.*_resources and cluster.*_runtime_env as Ray reads them when the actors are created, after Ray has
    started: refused here."""
    for role in ("rollout", "trainer"):
        key, resources = f"cluster.{role}_resources", getattr(cfg.cluster, f"{role}_resources")
        if own := [name for name in resources if name in RAY_OWN_RESOURCES or name.startswith("accelerator_type:")]:
            raise ValueError(
                f"{key}: {', '.join(own)}: Ray's own resources, which the placement plan sets from cluster.device, "
                f"cluster.cpus_per_actor and the chip counts; {key} adds node labels (custom resources), e.g. "
                "{node_a: 0.01} with `ray start --resources='{\"node_a\": 1}'` on that node"
            )
        key, env = f"cluster.{role}_runtime_env", getattr(cfg.cluster, f"{role}_runtime_env")
        env_vars = env.get("env_vars", {})
        if not isinstance(env_vars, dict):  # rlloop puts its own env_vars under the user's (placement.actor_options)
            raise ValueError(f"{key}.env_vars: expected a mapping of names to strings, got {env_vars!r:.60}")
        for name, value in env_vars.items():
            if not isinstance(value, str):  # YAML reads 1, true, 0.5 as numbers and booleans
                raise ValueError(
                    f"{key}.env_vars.{name}: an environment variable is a string, got {value!r}; quote it: "
                    f"{{{name}: '{value}'}}"
                )
        if env:
            from ray.runtime_env import RuntimeEnv  # here: a config without a runtime_env imports no Ray

            try:
                RuntimeEnv(**env)
            except Exception as e:  # Ray's TypeError / ValueError, whatever a runtime_env plugin raises
                raise ValueError(f"{key}: Ray refuses it as a runtime_env: {' '.join(str(e).split())}") from None
