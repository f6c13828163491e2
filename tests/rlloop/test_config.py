"""Config loading: inheritance, overrides, and bad input -> exit code 2 with the key path named."""

import os
from pathlib import Path

import pytest

from rlloop.config import ConfigError, load_config, to_yaml
from rlloop.run import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
REAL, TINY = str(EXAMPLES / "grpo_dapo.yaml"), str(EXAMPLES / "grpo_dapo_tiny.yaml")


def test_tiny_inherits_the_recipe_and_overrides_what_it_needs():
    real, tiny = load_config(REAL), load_config(TINY)
    assert real.model.path == "Qwen/Qwen3-4B" and real.cluster.device == "tpu"
    assert (real.cluster.rollout_chips, real.cluster.train_chips) == (2, 2)
    assert (real.rollout.prompts_per_step, real.rollout.group_size, real.train.lr) == (32, 8, 1e-6)
    assert (real.grpo.clip_eps_low, real.grpo.clip_eps_high, real.train.betas) == (0.2, 0.28, (0.9, 0.98))
    assert tiny.cluster.device == "cpu" and Path(tiny.model.path).is_dir() and Path(tiny.data.path).is_file()
    assert tiny.grpo == real.grpo  # inherited untouched


def test_paths_starting_with_a_tilde_are_in_the_home_directory():
    cfg = load_config(TINY, ["model.path=~/models/tiny", "run.dir=~/runs/{name}", "sync.dir=~/sync"])
    home = Path.home()
    assert (Path(cfg.model.path), cfg.run_dir, Path(cfg.sync.dir)) == (
        home / "models/tiny",
        home / "runs/tiny",
        home / "sync",
    )


def test_dotted_overrides():
    cfg = load_config(TINY, ["train.lr=2e-6", "rollout.group_size=4", "train.betas=[0.8,0.9]", "eval.path=null"])
    assert (cfg.train.lr, cfg.rollout.group_size, cfg.train.betas, cfg.eval.path) == (2e-6, 4, (0.8, 0.9), None)


def test_train_compile_is_a_scope_and_reads_booleans_as_one():
    values = ("true", "false", "layers", "model", "off")
    scopes = [load_config(TINY, [f"train.compile={v}"]).trainer_config().compile for v in values]
    assert scopes == ["layers", "off", "layers", "model", "off"]


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> str:
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


BAD_OVERRIDES = [
    (["train.lrr=1"], "train.lrr: unknown key"),
    (["rollout.group_size=abc"], "rollout.group_size"),
    (["rollout.group_size=1"], "rollout.group_size"),
    (["cluster.device=fpga"], "cluster.device"),
    (["grpo.loss_agg=mean"], "grpo.loss_agg"),
    (["train.lr=-1"], "train.lr"),
    (["train.lr=on"], "train.lr: expected a number, not a boolean"),
    (["rollout.prompts_per_step=true"], "rollout.prompts_per_step: expected a number"),
    (["grpo.kl_coef=yes"], "grpo.kl_coef: expected a number"),
    (["train.compile=graph"], "train.compile"),
    (["rollout.top_p=1.5"], "rollout.top_p"),
    (["rollout.temperature=inf"], "rollout.temperature: Input should be a finite number"),  # uniform, silently
    (["eval.temperature=.inf"], "eval.temperature: Input should be a finite number"),
    (["rollout.temperature=0"], "rollout.temperature: GRPO samples: at least 1e-05 (greedy decoding would give"),
    (["eval.top_k=-2"], "eval.top_k: -1 (or 0) turns top-k off"),
    (["grpo.clip_ratio_c=1"], "grpo.clip_ratio_c: Input should be greater than 1"),
    (["cluster.placement_timeout_s=0"], "cluster.placement_timeout_s"),
    (["sync.transport=nfs"], "sync.transport"),
    (["grpo.clip_eps_high=0.1"], "clip_eps_high"),
    (["nosuchsection.x=1"], "nosuchsection: unknown key"),
    (["train.lr"], "expected key.path=value"),
    (["reward.fn=no_such_module:score"], "reward.fn"),
    (["reward.fn=tests.rlloop.reward_fns:missing"], "reward.fn"),
    (["grpo.overlong_buffer=9000"], "overlong_buffer"),
    (["grpo.overlong_buffer=8192"], "grpo.overlong_buffer must be < rollout.max_response_len"),  # all of it
    (["loop.mode=async", "grpo.tis_cap=null"], "grpo.tis_cap"),
    (["loop.mode=fully_async", "grpo.tis_cap=null"], "loop.mode=fully_async"),
    (["loop.mode=eventually"], "loop.mode"),
    (["run.seed=-1"], "run.seed"),
    (["data.path="], "data.path"),  # None for a key that must be a path
    (["data.path=''"], "data.path: String should have at least 1 character"),  # not the working directory
    (["run.dir=''"], "run.dir: String should have at least 1 character"),
    (["run.name=../elsewhere"], "run.name: must be one part of a path (it fills in run.dir's {name}); put a path in"),
    (["run.name=.."], "run.name: must be one part of a path"),
    (["cluster.rollout_engines=3"], "cluster.rollout_engines=3"),
    (["cluster.use_ray=false"], "cluster.train_chips=2: trainer ranks are Ray actors"),
    (
        ["cluster.use_ray=false", "cluster.train_chips=1", "cluster.device=cpu", "sync.transport=ray"],
        "sync.transport: ray moves weights",
    ),
    (
        ["cluster.use_ray=false", "cluster.train_chips=1", "cluster.device=cpu", "rollout.backend=hf"]
        + ["loop.mode=async", "train.compile=layers"],
        "rollout.backend=hf with train.compile=layers and loop.mode=async, without Ray",
    ),
    (["cluster.colocate=true"], "a TPU chip serves one process at a time"),
    (["rollout.backend=hf"], "rollout.backend: hf generates on cpu or gpu"),  # the real recipe is on TPU
    (["data.chat_template_kwargs={tokenize: false}"], "data.chat_template_kwargs: tokenize: rlloop sets it"),
    (["rollout.stop_token_ids=[-1]"], "rollout.stop_token_ids.0: Input should be greater than or equal to 0"),
    ([f"rollout.stop_token_ids={list(range(16))}"], "rollout.stop_token_ids: List should have at most 15 items"),
    (["cluster.rollout_chips=3", "cluster.train_chips=1"], "Ray gives an actor 1, 2, 4, 8 chips of a host"),
    (
        ["cluster.use_ray=false", "cluster.train_chips=1", "cluster.rollout_chips=1"],
        "cluster.use_ray: false runs the engine and the trainer in this one process, which on TPU",
    ),
    (
        ["cluster.use_ray=false", "cluster.train_chips=1", "cluster.rollout_chips=1", "cluster.device=gpu"],
        "set cluster.colocate: true (they take turns on it)",
    ),
    (["cluster.colocate=true", "cluster.device=gpu", "loop.mode=async"], "loop.mode must be sync"),
    (
        ["cluster.colocate=true", "cluster.device=gpu", "cluster.rollout_chips=1"],
        "cluster.rollout_chips (1) must equal",
    ),
    (
        ["cluster.colocate=true", "cluster.device=gpu", "cluster.rollout_chips=2", "cluster.train_chips=2"],
        "cluster.colocate: true on GPUs needs one chip per engine (cluster.rollout_engines=2, not 1)",
    ),
]


@pytest.mark.parametrize("overrides,named", BAD_OVERRIDES, ids=[o[0][0] for o in BAD_OVERRIDES])
def test_bad_overrides_exit_2_naming_the_key(overrides, named, capsys):
    assert main([REAL, *overrides, "--dry-run"]) == 2
    assert named in capsys.readouterr().err


BAD_FILES = [
    ("model:\n  path: x\n", "data: required key is missing"),
    ("inherit: nope.yaml\n", "nope.yaml"),
    ("model: [1, 2\n", "not valid YAML"),
    ("- a\n- b\n", "mapping"),
    ("model:\n  path: x\n  dtype: int8\ndata:\n  path: y\n", "model.dtype"),
    ("model:\n  path: x\ndata:\n  path: y\n  max_prompt_len: 0\n", "data.max_prompt_len"),
]


@pytest.mark.parametrize(
    "text,named", BAD_FILES, ids=["missing-section", "missing-inherit", "bad-yaml", "list", "bad-dtype", "zero-len"]
)
def test_bad_files_exit_2_naming_the_problem(tmp_path, text, named, capsys):
    assert main([write(tmp_path, text), "--dry-run"]) == 2
    assert named in capsys.readouterr().err


def test_missing_config_file(capsys):
    assert main(["/nonexistent/recipe.yaml"]) == 2
    assert "config file not found" in capsys.readouterr().err


@pytest.mark.parametrize(
    "override,named",
    [
        ("model.path={tmp}/missing", "model.path: '{tmp}/missing' is not a directory"),
        ("model.path={tmp}/empty", "model.path: cannot load"),
        ("model.tokenizer={tmp}/empty", "model.tokenizer: cannot load"),
        ("model.path=no-such-org/no-such-model", "offline?"),  # a hub id without network (tests run offline)
    ],
    ids=["missing-dir", "empty-dir", "empty-tokenizer-dir", "hub-id-offline"],
)
def test_unloadable_model_exits_2_naming_the_key(tmp_path, override, named, capsys):
    (tmp_path / "empty").mkdir()
    override, named = override.format(tmp=tmp_path), named.format(tmp=tmp_path)
    assert main([TINY, override, f"run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("model error: ") and named in err, err


def test_an_inherit_cycle_is_named_as_one(tmp_path, capsys):
    """The cycle is said as such, naming the file it passes through again, not found by recursing until Python's
    stack runs out (test_inherit_cycle's "cycle" also matched its own tmp_path, test_inherit_cycle0)."""
    d = tmp_path / "recipes"
    d.mkdir()
    write(d, "inherit: b.yaml\n", "a.yaml")
    write(d, "inherit: a.yaml\n", "b.yaml")
    assert main([str(d / "a.yaml")]) == 2
    assert f"config error: inherit: cycle through {d / 'a.yaml'}" in capsys.readouterr().err


def test_relative_paths_resolve_against_the_file(tmp_path):
    (tmp_path / "model").mkdir()
    cfg = load_config(write(tmp_path, f"inherit: {REAL}\nmodel:\n  path: model\n"))
    assert cfg.model.path == str(tmp_path / "model")
    assert cfg.data.path == "BytedTsinghua-SIA/DAPO-Math-17k"  # a hub id stays a hub id


def test_dry_run_prints_recipe_and_tpu_plan(capsys):
    assert main([REAL, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "Qwen/Qwen3-4B" in out and "DAPO-Math-17k" in out
    assert "bundle 0: rollout engine 0 {'CPU': 1.0, 'TPU': 2.0}" in out
    assert out.count("'TPU': 1.0") == 2  # two trainer ranks, one chip each


def test_a_trainer_knob_is_one_field_reachable_from_yaml():
    """train.lr_warmup_steps is declared only on trainer.TrainerConfig; YAML reaches it, ranges come with it."""
    assert load_config(TINY, ["train.lr_warmup_steps=5"]).trainer_config().lr_warmup_steps == 5
    with pytest.raises(ConfigError, match="train.lr_warmup_steps"):
        load_config(TINY, ["train.lr_warmup_steps=-1"])
    assert load_config(TINY, ["train.adamw_fused=true"]).trainer_config().adamw_fused is True


@pytest.mark.parametrize(
    "build,section,wired",
    [
        (
            "trainer_config",
            "train",
            {"model_path", "trust_remote_code", "dtype", "device", "temperature", "max_response_len", "loss", "seed"}
            | {"total_updates"},
        ),
        ("engine_config", "rollout", {"model_path", "trust_remote_code", "dtype", "max_seq_len", "tp", "seed"}),
    ],
)
def test_every_component_knob_is_a_yaml_key_or_wired_from_one(build, section, wired):
    cfg = load_config(TINY)  # the tiny recipe sets several knobs away from their defaults
    built = getattr(cfg, build)()
    fields = set(type(built).__pydantic_fields__)
    knobs = fields - wired
    assert knobs <= set(type(getattr(cfg, section)).model_fields)
    assert {k: getattr(built, k) for k in knobs} == {k: getattr(getattr(cfg, section), k) for k in knobs}


def test_wired_values_come_from_their_sections():
    cfg = load_config(REAL)
    engine, trainer = cfg.engine_config(), cfg.trainer_config()
    assert engine.max_seq_len == cfg.data.max_prompt_len + cfg.rollout.max_response_len
    assert (engine.tp, engine.dtype, trainer.dtype, trainer.device) == (2, "bfloat16", "bfloat16", "tpu")
    assert trainer.temperature == cfg.rollout.temperature and trainer.seed == engine.seed == cfg.run.seed
    assert trainer.loss.clip_eps_high == cfg.grpo.clip_eps_high == 0.28 and trainer.loss.loss_agg == "dapo"
    decaying = load_config(REAL, ["train.lr_decay=cosine", "train.minibatches=2"])
    assert decaying.trainer_config().total_updates == 2 * decaying.run.steps  # the schedule ends with the run
    # unset, the prefill buckets (and so the positions a GRPO fan-out copies) stop at the longest prompt, not at
    # max_seq_len - 1 = 9,215: 1,024 of Qwen3-4B's 147,456 bytes a position per copied sample, not 9,215
    assert cfg.rollout.prefill_buckets is None and engine.prefill_buckets == (16, 32, 64, 128, 256, 512, 1024)


def test_dry_run_shows_every_engine(capsys):
    # TP 1 per engine: 256 rows x 9,216 positions would need 356 GB on one chip; 128 rows fit a v7x chip
    assert main([REAL, "cluster.rollout_engines=2", "rollout.max_batch=128", "loop.mode=async", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "rollout engine 0 {'CPU': 1.0, 'TPU': 1.0}" in out and "rollout engine 1 {'CPU': 1.0, 'TPU': 1.0}" in out
    assert "loop: async" in out


def test_a_cpu_dry_run_says_whether_the_local_ray_holds_the_plan(capsys):
    """It printed the plan of two trainer ranks, one CPU each beside the engine's, on a 2-core host, and the run then
    stopped at the start: the README's fsdp comparison needs a `ray start` head with 3 CPUs there."""
    cores = len(os.sched_getaffinity(0))
    for ranks in (1, cores):  # the engine's CPU and then `cores` ranks': one more than the host has
        assert main([TINY, f"cluster.train_chips={ranks}", "--dry-run"]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("# a local Ray on this host"))
        assert f"({cores} CPUs; the plan needs {ranks + 1})" in line
        assert ("cannot hold it" in line) == (ranks + 1 > cores), line


def test_overlong_shaping_with_std_scaling_warns_unless_dynamic_sampling_pairs_it(caplog):
    risky = ["grpo.overlong_buffer=4", "grpo.std_scale=true", "grpo.dynamic_sampling=false"]
    with caplog.at_level("WARNING", logger="rlloop.config"):
        load_config(TINY, risky)
    assert "length penalty alone becomes full-size advantages" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="rlloop.config"):
        load_config(TINY, [*risky[:2], "grpo.dynamic_sampling=true"])
        load_config(TINY, [*risky[:1], "grpo.std_scale=false"])
    assert "full-size advantages" not in caplog.text


def test_eval_settings_without_eval_path_warn_that_they_are_unused(caplog):
    with caplog.at_level("WARNING", logger="rlloop.config"):
        load_config(TINY, ["eval.path=null"])  # the tiny recipe sets eval.name, samples and top_p, run.eval_every
    assert "no eval.path, so no evaluation runs: eval.name, eval.samples, eval.top_p, run.eval_every=10" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="rlloop.config"):
        load_config(TINY)
    assert "no eval.path" not in caplog.text and "no evaluation runs" not in caplog.text
    with caplog.at_level("WARNING", logger="rlloop.config"):
        load_config(TINY, ["run.eval_every=0"])
    assert "run.eval_every=0, so no evaluation runs: eval.path" in caplog.text


@pytest.mark.parametrize(
    "overrides, idle",
    [
        (["sync.dir=/tmp/sync"], "sync.dir (only sync.transport=disk reads it; this run's is shm): set but unused"),
        (["cluster.address=10.0.0.1:6379", "cluster.use_ray=false"], "cluster.address (cluster.use_ray=false"),
        (["loop.max_staleness=3"], "loop.max_staleness (only loop.mode=fully_async admits by it; this run's is sync)"),
        (["grpo.max_sampling_rounds=5"], "grpo.max_sampling_rounds (only grpo.dynamic_sampling draws more rounds)"),
    ],
)
def test_a_setting_another_makes_idle_warns(caplog, overrides, idle):
    """They passed silently (an unwritable sync.dir too), as the eval settings without eval.path once did."""
    with caplog.at_level("WARNING", logger="rlloop.config"):
        load_config(TINY, overrides)
    assert idle in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="rlloop.config"):
        used = ["sync.transport=disk", "sync.dir=/tmp/sync", "loop.mode=fully_async", "loop.max_staleness=2"]
        load_config(TINY, used)
    assert "set but unused" not in caplog.text


def test_the_hf_compile_refusal_leaves_a_run_without_trainer_alone():
    """--debug rollout-only has no trainer, so nothing compiles beside the HF engine's thread."""
    hf_async = ["cluster.use_ray=false", "rollout.backend=hf", "loop.mode=async", "train.compile=layers"]
    assert load_config(TINY, [*hf_async, "run.debug=rollout-only"]).run.debug == "rollout-only"


def test_a_runs_own_config_fed_back_warns_of_nothing(tmp_path, caplog):
    """A run's config.yaml holds every key, most at their defaults: it warned of settings no one had chosen."""
    saved = tmp_path / "config.yaml"
    saved.write_text(to_yaml(load_config(TINY)))
    with caplog.at_level("WARNING", logger="rlloop.config"):
        load_config(str(saved))
    assert "unused" not in caplog.text and "does nothing" not in caplog.text


def test_lr_schedule_settings_that_would_do_nothing_warn(caplog):
    with caplog.at_level("WARNING", logger="rlloop.config"):
        load_config(TINY, ["train.min_lr_ratio=0.1"])  # lr_decay: constant
        load_config(TINY, ["train.lr_warmup_steps=30"])  # the tiny run's 30 updates
    assert "train.min_lr_ratio=0.1 does nothing with train.lr_decay: constant" in caplog.text
    assert "train.lr_warmup_steps=30 outlasts the run's 30 updates" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="rlloop.config"):
        load_config(TINY, ["train.min_lr_ratio=0.1", "train.lr_decay=cosine", "train.lr_warmup_steps=29"])
    assert "train.min_lr_ratio" not in caplog.text and "train.lr_warmup_steps" not in caplog.text


def test_bounds_keep_their_edges_and_the_off_values():
    """The bounds that stop overflows deep in a run leave every meaningful value: top_k -1 and 0 (off, as the
    engine and HF read them), the largest 31-bit seed, a week-long timeout, no actor timeout at all."""
    edges = ["rollout.top_k=0", "run.seed=2147483647", "reward.timeout_s=604800", "cluster.actor_timeout_s=null"]
    cfg = load_config(TINY, [*edges, "cluster.actor_start_timeout_s=604800"])
    assert (cfg.rollout.top_k, cfg.run.seed, cfg.reward.timeout_s) == (0, 2**31 - 1, 604800)
    assert cfg.cluster.actor_timeout_s is None and cfg.cluster.actor_start_timeout_s == 604800
    assert load_config(TINY).rollout.top_k == -1
    assert load_config(TINY, ["rollout.top_k=2147483647"]).rollout.top_k == 2**31 - 1


def test_an_empty_section_does_not_reset_the_inherited_one(tmp_path):
    """`train:` above only a comment is null; an override into it then made the section anew, every inherited
    train setting back at its default, with no word."""
    path = write(tmp_path, f"inherit: {TINY}\ntrain:\n  # lr: 1.0e-5\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: train: a section cannot be null"):
        load_config(path, ["train.lr=1e-4"])


def test_a_mapping_setting_is_replaced_as_a_whole(tmp_path):
    """A child file or an override sets a mapping-valued setting as one value (OmegaConf merged the mappings, so
    `{}` could not clear one nor a new one drop an inherited key); null reads as {}; sections still merge."""
    base = write(
        tmp_path,
        f"inherit: {TINY}\ndata:\n  chat_template_kwargs: {{enable_thinking: false}}\ncluster:\n"
        "  rollout_resources: {node_a: 0.01}\n  rollout_runtime_env: {py_executable: /opt/jax/bin/python}\n",
        "base.yaml",
    )
    child = write(
        tmp_path,
        "inherit: base.yaml\ndata:\n  chat_template_kwargs: {}\ncluster:\n  rollout_resources: {node_b: 1}\n"
        "  rollout_runtime_env:\n",
        "child.yaml",
    )
    cfg = load_config(child)
    assert (cfg.data.chat_template_kwargs, cfg.cluster.rollout_resources, cfg.cluster.rollout_runtime_env) == (
        {},
        {"node_b": 1},
        {},
    )
    assert cfg.data.max_prompt_len == load_config(TINY).data.max_prompt_len  # the section merged
    cfg = load_config(
        base,
        [
            "data.chat_template_kwargs={}",
            "cluster.rollout_runtime_env={pip: [numpy]}",
            "cluster={rollout_resources: null}",  # a section's override replaces the mappings it names
        ],
    )
    assert cfg.data.chat_template_kwargs == {} and cfg.cluster.rollout_runtime_env == {"pip": ["numpy"]}
    assert cfg.cluster.rollout_resources == {} and cfg.cluster.device == "cpu"
    # a key inside the mapping sets that entry only
    cfg = load_config(base, ["cluster.rollout_resources.node_b=1"])
    assert cfg.cluster.rollout_resources == {"node_a": 0.01, "node_b": 1}


RAY_SETTINGS = [  # what Ray refused only when it created the actors, after it had started
    (
        "cluster.trainer_runtime_env={env_vars: {OMP_NUM_THREADS: 1}}",
        "cluster.trainer_runtime_env.env_vars.OMP_NUM_THREADS: an environment variable is a string, got 1; quote it",
    ),
    ("cluster.rollout_runtime_env={env_vars: null}", "cluster.rollout_runtime_env.env_vars: expected a mapping"),
    (
        "cluster.rollout_runtime_env={pip: 5}",
        "cluster.rollout_runtime_env: Ray refuses it as a runtime_env: runtime_env['pip'] must be of type str",
    ),
    # a built-in resource replaced the plan's count (GPU: 2 chips became 1), or was added to it when colocated
    ("cluster.rollout_resources={GPU: 1}", "cluster.rollout_resources: GPU: Ray's own resources, which the placement"),
    ("cluster.trainer_resources={CPU: 4, node_a: 1}", "cluster.trainer_resources: CPU: Ray's own resources"),
    ("cluster.trainer_resources={accelerator_type:A100: 0.01}", "accelerator_type:A100: Ray's own resources"),
]


@pytest.mark.parametrize(
    "override,named",
    RAY_SETTINGS,
    ids=["env-var-a-number", "env-vars-null", "pip-a-number", "GPU", "CPU", "accelerator-type"],
)
def test_ray_settings_ray_would_refuse_exit_2_naming_the_key(override, named, capsys):
    assert main([TINY, override, "--dry-run"]) == 2
    assert named in capsys.readouterr().err


def test_a_runtime_env_ray_takes_passes():
    env = "{py_executable: /opt/jax/bin/python, env_vars: {OMP_NUM_THREADS: '1'}, pip: [numpy]}"
    assert load_config(TINY, [f"cluster.rollout_runtime_env={env}"]).cluster.rollout_runtime_env["pip"] == ["numpy"]


FLOW_MAPPINGS = [  # `{a:b}`, no space after the colon, is YAML for {"a:b": null}: the setting passed, meaning nothing
    (
        "data.chat_template_kwargs={enable_thinking:false}",
        "data.chat_template_kwargs: 'enable_thinking:false' is not a name a template can read (YAML reads "
        "{enable_thinking:false} as the key 'enable_thinking:false' with no value: put a space after the colon, "
        "{enable_thinking: false})",
    ),
    ("data.chat_template_kwargs={enable-thinking: false}", "'enable-thinking' is not a name a template can read"),
    (
        "cluster.rollout_resources={node_a:1}",
        "cluster.rollout_resources.node_a:1: Input should be a valid number, got None (YAML reads {node_a:1} as the "
        "key 'node_a:1' with no value: put a space after the colon, {node_a: 1})",
    ),
]


@pytest.mark.parametrize("override,named", FLOW_MAPPINGS, ids=["no-space", "not-a-name", "resources-no-space"])
def test_a_flow_mapping_without_a_space_after_the_colon_is_refused_with_the_fix(override, named, capsys):
    assert main([TINY, override, "--dry-run"]) == 2
    assert named in capsys.readouterr().err
    assert load_config(TINY, ["data.chat_template_kwargs={enable_thinking: false}"])  # with the space


@pytest.mark.parametrize(
    "override,key",
    [
        ("train.betas=[0.9, no]", "train.betas"),  # beta2 0
        ("rollout.stop_token_ids=[yes]", "rollout.stop_token_ids"),  # token 1 ends every response
        ("rollout.prefill_buckets=[true]", "rollout.prefill_buckets"),
        ("cluster.rollout_resources={node_a: on}", "cluster.rollout_resources"),
        ("run.profile_steps=[on]", "run.profile_steps"),
    ],
)
def test_booleans_inside_lists_and_mappings_are_not_numbers(override, key):
    """pydantic reads True as 1 and False as 0 in a list or a mapping as it does alone."""
    with pytest.raises(ConfigError, match=rf"{key}: expected a number, not a boolean \(YAML reads yes/no/on/off"):
        load_config(TINY, [override])


LONG = "a" * 300  # past the 255 bytes a path part may have: the OS answers ENAMETOOLONG
LONG_PATHS = [
    ("run.dir", ["run.dir={tmp}/{{name}}", f"run.name={LONG}"]),
    ("run.dir", [f"run.dir={{tmp}}/not-yet/{LONG}/run"]),  # only mkdir, once the run had started, found it
    ("sync.dir", ["sync.transport=disk", f"sync.dir={{tmp}}/{LONG}"]),
    ("model.path", [f"model.path={{tmp}}/{LONG}"]),
    ("data.path", [f"data.path={{tmp}}/{LONG}.jsonl"]),
    ("eval.path", [f"eval.path={{tmp}}/{LONG}"]),
    ("run.replay", ["run.debug=train-only", f"run.replay={{tmp}}/{LONG}"]),
]


@pytest.mark.parametrize("key,overrides", LONG_PATHS, ids=[f"{k}-{i}" for i, (k, _) in enumerate(LONG_PATHS)])
def test_a_path_part_too_long_is_a_config_error_naming_the_key(key, overrides, tmp_path, capsys):
    assert main([TINY, *[o.format(tmp=tmp_path) for o in overrides], "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"config error: {key}: {tmp_path}/" in err and err.rstrip().endswith(": File name too long"), err


def test_no_arguments_asks_for_the_config_only(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.rstrip().endswith("the following arguments are required: config"), err


def test_a_config_that_is_not_a_regular_file_is_not_called_missing(capsys):
    assert main(["/dev/null", "--dry-run"]) == 2
    assert "config error: config file /dev/null is not a regular file" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text,overrides,named",
    [
        ("", ["tracking.mode=off"], "tracking.mode: Input should be 'auto', 'online', 'offline' or 'disabled', got "),
        ("run:\n  name: 0123\n", [], "run.name: Input should be a valid string, got 83"),  # YAML 1.1's octal
        ("", ["run.name="], "run.name: Input should be a valid string, got None"),
    ],
    ids=["off", "octal", "empty"],
)
def test_text_that_yaml_read_as_another_type_says_to_quote_it(text, overrides, named, tmp_path, capsys):
    assert main([write(tmp_path, f"inherit: {TINY}\n{text}"), *overrides, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert named in err and "(YAML reads yes/no/on/off as booleans, leading-zero numbers as octal" in err, err
    assert err.rstrip().endswith("quote it)"), err


def test_every_path_setting_resolves_against_the_file_that_sets_it(tmp_path, monkeypatch):
    """model.path, model.tokenizer, data.path and eval.path written relative in a recipe name what lies next to the
    recipe, from whatever directory the run is started (and even where the working directory holds the same names:
    the file's own neighbours win)."""
    recipes = tmp_path / "recipes"
    for where in (recipes, tmp_path):
        for name in ("model", "tok"):
            (where / name).mkdir(parents=True)
        for name in ("train.jsonl", "eval.jsonl"):
            (where / name).write_text("")
    path = write(
        recipes,
        f"inherit: {TINY}\nmodel:\n  path: model\n  tokenizer: tok\n"
        "data:\n  path: train.jsonl\neval:\n  path: eval.jsonl\n",
    )
    monkeypatch.chdir(tmp_path)
    cfg = load_config(path)
    assert (cfg.model.path, cfg.model.tokenizer, cfg.data.path, cfg.eval.path) == tuple(
        str(recipes / name) for name in ("model", "tok", "train.jsonl", "eval.jsonl")
    )
