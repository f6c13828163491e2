"""The bad-input matrix: each bad config, model, data file or reward function, one row of a table.

Config, model and data problems exit 2 from `rlloop.run.main`, name the key / file / line and the problem, and are
found in the driver before the loop starts: a stand-in `rlloop.loop` fails the test if training is reached, and no
run directory may appear (nor may a resumed run's files change). A reward function that raises, hangs or returns a
non-number costs its sample `reward.failure_reward` and one count of `rollout/reward_failures`, not the run.
Fixtures (model copies, data files, reward modules) are built in tmp_path from the embedded tiny example.
"""

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

# Imported here, not first inside a test: its log handler keeps the stderr it finds at import (a closed capsys one).
import datasets  # noqa: F401
import pandas as pd
import pytest

from rlloop.run import main
from rlloop.tiny import ASSETS

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "grpo_dapo_tiny.yaml")
MODEL, TRAIN = ASSETS / "model", ASSETS / "data" / "train.jsonl"
ROWS = [json.loads(line) for line in TRAIN.read_text().splitlines()[:4]]


@pytest.fixture(autouse=True)
def no_training(monkeypatch):
    """Stand in for rlloop.loop: reaching train() means a bad input got past the driver's checks."""
    fail = lambda *a, **k: pytest.fail("training started: the bad input was not caught before the loop")  # noqa: E731
    monkeypatch.setitem(sys.modules, "rlloop.loop", types.SimpleNamespace(train=fail))


def run(capsys, tmp_path, *args, named=(), config=TINY, kind="config") -> None:
    """main() on a bad input: exit 2, '<kind> error: ...' naming each of `named` on stderr, and no run directory."""
    run_dir = tmp_path / "run"
    rc = main([str(config), *args, f"run.dir={run_dir}"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"{kind} error: " in err, err  # after any `datasets` progress bars
    assert not run_dir.exists(), "a bad input created the run directory"
    for piece in named:
        assert piece in err[err.index(f"{kind} error: ") :], f"{piece!r} not in:\n{err}"


# --- config --------------------------------------------------------------------------------------------------------
# fmt: off
CONFIG = [  # (id, overrides of the tiny recipe, what the message names)
    ("timeout-inf", ["reward.timeout_s=inf"], ["reward.timeout_s: Input should be a finite number"]),
    ("failure-reward-nan", ["reward.failure_reward=nan"], ["reward.failure_reward: Input should be a finite number"]),
    # finite, but inf in the float32 rewards: every advantage of its group NaN
    ("failure-reward-huge", ["reward.failure_reward=1e39"], ["reward.failure_reward: rewards are float32"]),
    ("overlong-penalty-huge", ["grpo.overlong_penalty=1e39"], ["grpo.overlong_penalty: rewards are float32"]),
    ("batch-over-ranks", ["rollout.prompts_per_step=3", "rollout.group_size=3", "cluster.train_chips=2"],
     ["rollout.prompts_per_step x rollout.group_size = 3 x 3 = 9", "cluster.train_chips x train.minibatches = 2 x 1"]),
    ("batch-over-minibatches", ["rollout.prompts_per_step=5", "rollout.group_size=2", "train.minibatches=4"],
     ["= 10 samples per step do not split evenly", "= 1 x 4 = 4"]),
    ("prefill-buckets-short", ["rollout.prefill_buckets=[16,64]"],
     ["rollout.prefill_buckets [16, 64] do not cover data.max_prompt_len=128"]),
    ("prefill-bucket-past-seq", ["rollout.prefill_buckets=[128,4096]"],
     ["rollout.prefill_buckets has 4096, above its limit 143 (data.max_prompt_len + rollout.max_response_len - 1)"]),
    ("decode-buckets-short-of-max-batch", ["rollout.decode_buckets=[16,64]"],
     ["rollout.decode_buckets must end at 128, got [16, 64] (rollout.max_batch)"]),
    ("compile-model-under-fsdp", ["train.compile=model", "cluster.train_chips=2"],
     ["train.compile=model", "train.parallel=auto with cluster.train_chips=2", "train.compile=layers"]),
    ("decode-bucket-past-batch", ["rollout.decode_buckets=[16,256]"],
     ["rollout.decode_buckets has 256, above its limit 128 (rollout.max_batch)"]),
    ("more-engines-than-chip", ["cluster.rollout_engines=2"],
     ["cluster.rollout_engines=2 is more engines than cluster.rollout_chips=1"]),
    ("more-engines-than-chips", ["cluster.rollout_chips=2", "cluster.rollout_engines=4"],
     ["cluster.rollout_engines=4 is more engines than cluster.rollout_chips=2"]),
    ("unknown-key-depth-2", ["rollout.sampling.temperature=1"], ["rollout.sampling: unknown key; known keys here:"]),
    ("unknown-key-typo", ["grpo.clip_eps_hi=0.3"], ["grpo.clip_eps_hi: unknown key; did you mean 'clip_eps_high'?"]),
    ("key-of-another-section", ["train.tis_cap=2"], ["train.tis_cap: unknown key; did you mean 'grpo.tis_cap'?"]),
    # before a typo of one of the section's own keys (profile_steps)
    ("key-of-another-section-over-a-typo", ["run.prompts_per_step=8"],
     ["run.prompts_per_step: unknown key; did you mean 'rollout.prompts_per_step'?"]),
    ("flow-mapping-unknown-key", ["rollout={max_batch:8}"],
     ["rollout.max_batch:8: unknown key", "put a space after the colon, {max_batch: 8}"]),
    # a component's field that another section sets: the error names that section's key
    ("wired-trainer-dtype", ["train.dtype=bfloat16"], ["train.dtype: not a key of this section", "from model.dtype"]),
    ("wired-engine-seq-len", ["rollout.max_seq_len=64"],
     ["rollout.max_seq_len: not a key", "from data.max_prompt_len + rollout.max_response_len"]),
    ("wired-sync-run-id", ["sync.run_id=x"], ["sync.run_id: not a key of this section", "from run.dir"]),
    ("key-below-a-value", ["train.lr.value=1"], ["train.lr: Input should be a valid number, got a mapping"]),
    ("list-item-not-a-number", ["train.betas=[0.9,x]"], ["train.betas.1: Input should be a valid number", "'x'"]),
    ("list-item-not-an-int", ["rollout.prefill_buckets=[16,abc]"], ["rollout.prefill_buckets.1", "'abc'"]),
    ("list-item-fraction", ["rollout.decode_buckets=[1.5]"], ["rollout.decode_buckets.0", "fractional part"]),
    ("list-too-short", ["train.betas=[0.9]"], ["train.betas.1: required key is missing"]),
    ("scalar-for-list", ["rollout.prefill_buckets=16"], ["rollout.prefill_buckets: Input should be a valid tuple"]),
    ("mapping-value-type", ["cluster.rollout_resources.node_a=-1"],
     ["cluster.rollout_resources.node_a: Input should be greater than 0"]),
    ("override-no-key", ["=5"], ["override '=5': expected key.path=value"]),
    ("override-empty-part", ["train..lr=1"], ["override 'train..lr=1'", "empty or space-padded part"]),
    ("override-leading-dot", [".lr=1"], ["override '.lr=1'", "empty or space-padded part"]),
    ("override-space-in-key", ["train. lr=1"], ["override 'train. lr=1'", "space-padded"]),
    ("override-hydra-plus", ["+train.lr=1"], ["override '+train.lr=1'", "Hydra-style '+' prefix"]),
    ("override-hydra-tilde", ["~train.lr"], ["override '~train.lr'", "Hydra-style '~' prefix"]),
    ("override-broken-value", ["train.lr=[1,"], ["override 'train.lr=[1,'", "while parsing"]),
    ("override-list-for-section", ["rollout=[1]"], ["override 'rollout=[1]'", "Cannot merge"]),
    ("override-double-equals", ["train.lr==1"], ["train.lr: Input should be a valid number", "'=1'"]),
    ("override-dangling-interpolation", ["train.lr=${nope}"], ["Interpolation key 'nope' not found"]),
    ("override-null-section", ["run=null"], ["override 'run=null': run: a section cannot be null"]),
    # the engine holds top_k as int32 (an OverflowError in the first generate); -1 or 0 is off, -5 is a typo
    ("top-k-past-int32", ["rollout.top_k=3000000000"], ["rollout.top_k: -1 (or 0) turns top-k off", "got 3000000000"]),
    ("top-k-below-minus-1", ["rollout.top_k=-5"], ["rollout.top_k: -1 (or 0) turns top-k off", "got -5"]),
    # timeouts past a week overflowed a wait (threading's, Ray's) after the actors had started
    ("reward-timeout-huge", ["reward.timeout_s=1e12"], ["reward.timeout_s: a timeout is at most 604800 s (7 days)"]),
    ("actor-timeout-huge", ["cluster.actor_timeout_s=1e308"], ["cluster.actor_timeout_s: a timeout is at most"]),
    ("actor-start-timeout-huge", ["cluster.actor_start_timeout_s=1e308"],
     ["cluster.actor_start_timeout_s: a timeout is at most"]),
    # torch.manual_seed overflowed in the trainer; the rollout's seeds are 31-bit
    ("seed-past-31-bits", ["run.seed=99999999999999999999"], ["run.seed: Input should be less than or equal to 2147"]),
    ("seed-2-to-the-31", ["run.seed=2147483648"], ["run.seed: Input should be less than or equal to 2147483647"]),
    ("tensor-parallel-without-ray", ["cluster.use_ray=false", "cluster.rollout_chips=4"],
     ["cluster.rollout_chips=4 over cluster.rollout_engines=1 gives an engine 4 chips", "set cluster.use_ray: true"]),
    ("sync-dir-in-proc", ["sync.transport=disk", "sync.dir=/proc/rlloop-sync"],
     ["sync.dir /proc/rlloop-sync cannot be made there: /proc is not a directory it can write to"]),
    # a size below 1 breaks no limit: no "(rollout.max_batch)" after it (the line ends there)
    ("decode-bucket-zero", ["rollout.decode_buckets=[0,128]"],
     ["rollout.decode_buckets must be non-empty positive sizes, got (0, 128)\n"]),
    ("clip-eps-high-below-low", ["grpo.clip_eps_high=0.1"], ["grpo.clip_eps_high must be >= clip_eps_low"]),
]
FILES = [  # (id, files to write: text, bytes or None for a directory; the file given to main; named)
    ("group-size-1", {"c.yaml": f"inherit: {TINY}\nrollout:\n  group_size: 1\n"}, "c.yaml",
     ["rollout.group_size", "needs >= 2", "got 1"]),
    ("unknown-key-in-section", {"c.yaml": f"inherit: {TINY}\nrollout:\n  engine:\n    max_batch: 8\n"}, "c.yaml",
     ["rollout.engine: unknown key"]),
    ("misspelled-section", {"c.yaml": f"inherit: {TINY}\ntrainer:\n  lr: 1.0e-5\n"}, "c.yaml",
     ["trainer: unknown key; did you mean 'train'?"]),
    ("empty-file", {"c.yaml": ""}, "c.yaml", ["model: required key is missing", "data: required key is missing"]),
    ("not-utf8", {"c.yaml": b"\xff\xfe\x00model"}, "c.yaml", ["c.yaml: cannot read it", "utf-8"]),
    ("config-is-a-directory", {"recipe": None}, "recipe", ["recipe is a directory; expected a YAML file"]),
    ("inherit-a-directory", {"base": None, "c.yaml": "inherit: base\n"}, "c.yaml",
     ["base (inherited by", "is a directory"]),
    # `train:` over a comment is null: with any train.* override it reset every inherited train setting to defaults
    ("null-section", {"c.yaml": f"inherit: {TINY}\ntrain:\n  # lr: 1.0e-5\n"}, "c.yaml",
     ["c.yaml: train: a section cannot be null"]),
    ("list-for-an-inherited-section", {"c.yaml": f"inherit: {TINY}\nrun: [1, 2]\n"}, "c.yaml",
     ["c.yaml: run: expected a mapping of settings", "grpo_dapo_tiny.yaml), got list [1, 2]"]),
    ("bare-number", {"c.yaml": "42\n"}, "c.yaml", ["c.yaml: expected a mapping of sections at the top", "got int 42"]),
    ("bare-word", {"c.yaml": "recipe\n"}, "c.yaml", ["c.yaml: expected a mapping of sections", "got str 'recipe'"]),
]
# fmt: on


@pytest.mark.parametrize("overrides,named", [c[1:] for c in CONFIG], ids=[c[0] for c in CONFIG])
def test_bad_config_override(overrides, named, capsys, tmp_path):
    run(capsys, tmp_path, *overrides, named=named)


def write_files(root: Path, files: dict) -> None:
    for name, content in files.items():
        path = root / name
        if content is None:
            path.mkdir()
        else:
            path.write_bytes(content if isinstance(content, bytes) else content.encode())


@pytest.mark.parametrize("files,entry,named", [c[1:] for c in FILES], ids=[c[0] for c in FILES])
def test_bad_config_file(files, entry, named, capsys, tmp_path):
    write_files(tmp_path, files)
    run(capsys, tmp_path, config=tmp_path / entry, named=named)


@pytest.mark.parametrize("how", ["chmod-000", "simulated"])
def test_unreadable_config_file(how, capsys, tmp_path, monkeypatch):
    target, read_text = tmp_path / "c.yaml", Path.read_text
    target.write_text(Path(TINY).read_text())
    if how == "chmod-000" and os.geteuid() == 0:
        pytest.skip("root reads a mode-000 file anyway; the simulated case stands in for it")
    target.chmod(0)

    def denied(self, *args, **kwargs):  # what the OS answers a non-root reader of a mode-000 file
        if self == target:
            raise PermissionError(13, "Permission denied", str(self))
        return read_text(self, *args, **kwargs)

    if how == "simulated":
        monkeypatch.setattr(Path, "read_text", denied)
    run(capsys, tmp_path, config=target, named=["c.yaml: cannot read it", "Permission denied"])


def test_a_run_dir_that_cannot_be_made_is_refused_before_anything_starts(capsys, tmp_path):
    """A file in the way; and /proc, whose permission bits say yes to root, where a directory cannot be made (it
    used to fail after Ray had started, with a traceback)."""
    (tmp_path / "afile").write_text("")
    assert main([TINY, f"run.dir={tmp_path / 'afile' / 'run'}", "--dry-run"]) == 2
    assert f"cannot be made there: {tmp_path / 'afile'} is not a directory it can write to" in capsys.readouterr().err
    assert main([TINY, "run.dir=/proc/rlloop-run"]) == 2
    assert "run.dir /proc/rlloop-run cannot be made there: /proc is not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("run_dir", ["runs/{seed}", "runs/{name"])
def test_a_run_dir_with_another_field_than_name_is_refused(run_dir, capsys):
    assert main([TINY, f"run.dir={run_dir}", "--dry-run"]) == 2
    assert "run.dir: may hold {name} and no other {field}" in capsys.readouterr().err


def test_a_ray_job_with_a_relative_run_dir_or_sync_dir_is_refused(capsys, tmp_path, monkeypatch):
    """`ray job submit --working-dir` runs the entrypoint in Ray's temporary copy of that directory: a relative
    run.dir (or disk sync.dir) would put the checkpoints (the weight versions) where Ray deletes them. Without a
    working_dir it runs in the Ray head's working directory: relative paths land there, not in the submitter's."""
    monkeypatch.chdir(tmp_path)
    absolute = f"run.dir={tmp_path / 'runs' / '{name}'}"
    for job, where in (
        ({"runtime_env": {"working_dir": "gcs://_ray_pkg_0123456789abcdef.zip"}}, "Ray's temporary copy"),
        ({"runtime_env": {}}, "the job's working directory on the Ray head"),
    ):
        monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(job))
        assert main([TINY, "run.dir=runs/{name}", "--dry-run"]) == 2
        err = capsys.readouterr().err
        assert f"run.dir 'runs/{{name}}' is relative, and this Ray job runs in {where}" in err
        assert str(tmp_path) in err and not (tmp_path / "runs").exists()
        assert main([TINY, absolute, "sync.transport=disk", "sync.dir=weights", "--dry-run"]) == 2
        assert f"sync.dir 'weights' is relative, and this Ray job runs in {where}" in capsys.readouterr().err
        assert main([TINY, absolute, "--dry-run"]) == 0
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR")  # not a job: relative to where the command is typed
    assert main([TINY, "run.dir=runs/{name}", "sync.transport=disk", "sync.dir=weights", "--dry-run"]) == 0


def test_wandb_online_without_an_api_key_is_refused_before_anything_starts(tmp_path):
    """tracking.mode=online with no W&B key failed in wandb.init after Ray and the actors had started. In a clean
    interpreter (W&B keeps a process's credentials), with no WANDB_* variable and an empty home: exit 2 naming
    tracking.mode; then, with a key in the environment, the same dry run passes (no network: nothing verifies it)."""
    home = tmp_path / "home"
    home.mkdir()
    args = [TINY, "tracking.wandb=true", "tracking.mode=online", f"run.dir={tmp_path / 'run'}", "--dry-run"]
    script = (
        "import os; from rlloop.run import main; "
        f"rc = main({args!r}); os.environ['WANDB_API_KEY'] = 'k' * 40; print('rcs', rc, main({args!r}))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env |= {"HOME": str(home), "NETRC": str(home / ".netrc"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
    )
    assert out.stdout.strip().splitlines()[-1] == "rcs 2 0", out.stdout[-2000:] + out.stderr
    refusal = "config error: tracking.mode=online: W&B goes online and has no API key configured; run `wandb login`"
    assert refusal in out.stderr and "tracking.mode=offline" in out.stderr, out.stderr
    assert not (tmp_path / "run").exists()
    # tracking.mode=auto goes online where a key is set: a malformed one failed as late, in the tracker
    auto = [TINY, "tracking.wandb=true", "tracking.mode=auto", f"run.dir={tmp_path / 'run'}", "--dry-run"]
    script = f"from rlloop.run import main; print('rc', main({auto!r}))"
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env | {"WANDB_API_KEY": "abc"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.stdout.strip().splitlines()[-1] == "rc 2", out.stdout[-2000:] + out.stderr
    assert "config error: tracking.mode=auto: W&B cannot use its credentials" in out.stderr, out.stderr


@pytest.mark.parametrize("mode", ["offline", "auto"])
def test_wandb_offline_without_the_wandb_package_is_refused_before_the_start(tmp_path, mode, monkeypatch, capsys):
    """Only online was checked for the package: offline failed with ModuleNotFoundError once the actors were up."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # what importlib reports for a package that is not installed
    monkeypatch.setenv("WANDB_MODE", "offline")
    rc = main([TINY, "tracking.wandb=true", f"tracking.mode={mode}", f"run.dir={tmp_path / 'run'}", "--dry-run"])
    assert rc == 2 and "tracking.wandb: true needs the wandb package" in capsys.readouterr().err


def test_unknown_flag_is_an_argparse_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main([TINY, "--train.lr=1"])
    assert e.value.code == 2 and "unrecognized arguments: --train.lr=1" in capsys.readouterr().err


# --- model ---------------------------------------------------------------------------------------------------------
def edit_json(path: Path, **changes) -> None:
    """Set (None: delete) top-level keys of a JSON file."""
    data = {**json.loads(path.read_text()), **changes}
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not None}))


GPT2 = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=64, n_head=4, n_layer=2)
MIXTRAL = dict(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=8)
AUTO_MAP = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
SHARD = "model-0000{}-of-00002.safetensors"
SHARDS = {"weight_map": {"a.weight": SHARD.format(1), "b.weight": SHARD.format(2)}}
# fmt: off
MODEL_CASES = [  # (id, how to break a copy d of the tiny model, overrides (default: model.path={d}), named)
    ("no-config-json", lambda d: (d / "config.json").unlink(), [], ["model.path: cannot load", "no config.json in it"]),
    ("config-json-not-json", lambda d: (d / "config.json").write_text("{nope"), [],
     ["config.json: not a readable JSON model config"]),
    ("model-path-is-a-file", lambda d: None, ["model.path={d}/config.json"], ["config.json' is not a directory"]),
    ("no-weight-files", lambda d: (d / "model.safetensors").unlink(), [], ["has no weight files (*.safetensors or"]),
    ("missing-weight-shard", lambda d: [(d / "model.safetensors").rename(d / SHARD.format(1)),
                                        (d / "model.safetensors.index.json").write_text(json.dumps(SHARDS))], [],
     [f"model.safetensors.index.json lists 1 weight file(s) that are not there: {SHARD.format(2)}"]),
    ("truncated-shard-index", lambda d: (d / "model.safetensors.index.json").write_text('{"weight_map": {"a'), [],
     ["model.safetensors.index.json is not a readable shard index", "an interrupted download?"]),
    ("gpt2", lambda d: (d / "config.json").write_text(json.dumps(GPT2)), [],
     ["model_type 'gpt2' (GPT2LMHeadModel)", "supports model_type qwen3, qwen2, llama"]),
    ("mistral-moe", lambda d: edit_json(d / "config.json", **MIXTRAL), [],
     ["model_type 'mixtral' (MixtralForCausalLM)", "Qwen3ForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM"]),
    ("gelu-mlp", lambda d: edit_json(d / "config.json", hidden_act="gelu"), [], ["unsupported hidden_act 'gelu'"]),
    ("yarn-rope", lambda d: edit_json(d / "config.json", rope_parameters={"rope_type": "yarn", "factor": 4.0}), [],
     ["unsupported rope_type 'yarn'"]),
    ("config-lacks-a-field", lambda d: edit_json(d / "config.json", num_attention_heads=None), [],
     ["config.json lacks 'num_attention_heads'"]),
    ("context-past-max-positions", lambda d: None, ["model.path={d}", "rollout.max_response_len=200"],
     ["data.max_prompt_len + rollout.max_response_len = 128 + 200 = 328", "max_position_embeddings 256 ("]),
    ("short-context-model", lambda d: edit_json(d / "config.json", max_position_embeddings=64), [],
     ["= 144 tokens, beyond the model's max_position_embeddings 64"]),
    ("logits-scaling", lambda d: edit_json(d / "config.json", logits_scaling=4.0), [],
     ["model.path:", "sets logits_scaling=4.0, a scaling of the logits that the trainer's log-probs do not apply"]),
    # MPT's ALiBi biases follow the key's column: shared-prompt rows gave later responses wrong log-probs, silently
    ("alibi-with-shared-prompts", lambda d: edit_json(d / "config.json", model_type="mpt"),
     ["model.path={d}", "rollout.backend=hf"],
     ["train.share_prompts:", "has ALiBi position biases (mpt)", "set train.share_prompts=false"]),
    ("stop-id-past-the-vocab", lambda d: None, ["rollout.stop_token_ids=[3, 99]"],
     ["rollout.stop_token_ids: [99] are not token ids of", "(vocab_size 99)"]),
    # 15 more ids pass the config's check (one EOS left room for them); a model with three EOS ids (Llama 3 Instruct
    # has) leaves room for 13: every generate call failed, once the cluster had started
    ("stop-ids-past-the-engine-row", lambda d: edit_json(d / "generation_config.json", eos_token_id=[2, 3, 4]),
     ["model.path={d}", f"rollout.stop_token_ids={list(range(5, 20))}"],
     ["rollout.stop_token_ids: with the model's and the tokenizer's EOS ids [2, 3, 4], 18 ids end a response, past "
      "the JAX engine's 16; give at most 13"]),
    # the tiny example trains with train.share_prompts: true; the HF backend (the JAX decoder refuses the model)
    ("sliding-window-with-shared-prompts",
     lambda d: edit_json(d / "config.json", use_sliding_window=True, sliding_window=32, max_window_layers=0,
                         layer_types=None),
     ["model.path={d}", "rollout.backend=hf"],
     ["train.share_prompts:", "has sliding-window attention layers", "set train.share_prompts=false"]),
    ("sliding-window-jax", lambda d: edit_json(d / "config.json", layer_types=["sliding_attention"] * 2,
                                               sliding_window=32), [],
     ["unsupported: sliding-window attention"]),
    ("no-chat-template", lambda d: (d / "chat_template.jinja").unlink(), [],
     ["model.path: the tokenizer in", "has no chat template"]),
    ("tokenizer-without-chat-template", lambda d: (d / "chat_template.jinja").unlink(),
     [f"model.path={MODEL}", "model.tokenizer={d}"], ["model.tokenizer: the tokenizer in", "has no chat template"]),
    ("vocab-mismatch", lambda d: edit_json(d / "config.json", vocab_size=50), [],
     ["the tokenizer's ids go up to 98 but", "vocab_size 50", "point model.tokenizer at the model's own tokenizer"]),
    ("vocab-one-short", lambda d: edit_json(d / "config.json", vocab_size=98), [],  # ids run to vocab_size - 1
     ["the tokenizer's ids go up to 98 but", "vocab_size 98"]),
    ("remote-code-model", lambda d: edit_json(d / "config.json", auto_map=AUTO_MAP), [],
     ["auto_map: ['AutoConfig', 'AutoModelForCausalLM']", "model.trust_remote_code: true"]),
    ("remote-code-tokenizer", lambda d: edit_json(d / "tokenizer_config.json", auto_map={"AutoTokenizer": ["t.T"]}),
     [], ["model.path:", "tokenizer_config.json maps to code", "model.trust_remote_code: true"]),
    # the engine's tensor-parallel split failed only in its warmup, after Ray and the actors had started
    ("tp-does-not-split-kv-heads", lambda d: None, ["model.path={d}", "cluster.rollout_chips=4"],
     ["cluster.rollout_chips=4 over cluster.rollout_engines=1 gives each engine 4 chips", "num_key_value_heads=2",
      "e.g. cluster.rollout_engines=2"]),
    # tracebacks of the memory plan (a list has no .get) and of transformers' config class (a field's type)
    ("config-json-a-list", lambda d: (d / "config.json").write_text("[]"), [],
     ["model.path: ", "config.json: expected a JSON object, got list"]),
    ("config-json-null-head-dim",
     lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                                          "head_dim": None})), [],
     ["model.path: ", "config.json: transformers cannot read it:", "'head_dim' expected int, got NoneType"]),
]
# fmt: on


def test_a_dry_run_with_a_hub_dataset_still_counts_the_stop_ids(capsys, tmp_path):
    """The dry run stops short of a hub dataset (it downloads nothing), but not of what the model and tokenizer tell."""
    d = Path(shutil.copytree(MODEL, tmp_path / "model"))
    edit_json(d / "generation_config.json", eos_token_id=[2, 3, 4])
    stops = f"rollout.stop_token_ids={list(range(5, 20))}"
    assert main([TINY, f"model.path={d}", stops, "data.path=BytedTsinghua-SIA/DAPO-Math-17k", "--dry-run"]) == 2
    assert "rollout.stop_token_ids: with the model's and the tokenizer's EOS ids" in capsys.readouterr().err


@pytest.mark.parametrize("breaks,overrides,named", [c[1:] for c in MODEL_CASES], ids=[c[0] for c in MODEL_CASES])
def test_bad_model(breaks, overrides, named, capsys, tmp_path):
    d = Path(shutil.copytree(MODEL, tmp_path / "model"))
    breaks(d)
    args = [o.format(d=d) for o in overrides or ["model.path={d}"]]
    run(capsys, tmp_path, *args, kind="model", named=named)


def test_trust_remote_code_is_the_way_out(capsys, tmp_path):
    """The remote-code message's advice works: with the key set, the same model passes the checks (dry run)."""
    d = Path(shutil.copytree(MODEL, tmp_path / "model"))
    edit_json(d / "config.json", auto_map=AUTO_MAP)
    assert main([TINY, f"model.path={d}", "model.trust_remote_code=true", "--dry-run"]) == 0
    assert "model, tokenizer and data: checked" in capsys.readouterr().out


@pytest.mark.parametrize("window", [dict(sliding_window=32), dict(use_sliding_window=True, sliding_window=32)])
def test_a_window_transformers_does_not_use_is_no_sliding_window(window, capsys, tmp_path):
    """Qwen2/Qwen3 configs carry `sliding_window` for layers from `max_window_layers` on, and only with
    `use_sliding_window`: a model with none of those layers keeps train.share_prompts (it was refused from
    config.json's `sliding_window` alone)."""
    d = Path(shutil.copytree(MODEL, tmp_path / "model"))
    layers = json.loads((d / "config.json").read_text())["num_hidden_layers"]
    edit_json(d / "config.json", max_window_layers=layers, **window)
    assert main([TINY, f"model.path={d}", "rollout.backend=hf", "--dry-run"]) == 0
    assert "model, tokenizer and data: checked" in capsys.readouterr().out


# --- data ----------------------------------------------------------------------------------------------------------
def rows(**changes) -> list[dict]:
    """The first tiny rows, with changes `r<i>={dotted key: value (DELETE: remove the key)}`."""
    out = json.loads(json.dumps(ROWS))
    for i, edits in changes.items():
        for dotted, value in edits.items():
            *parents, last = dotted.split(".")
            node = out[int(i[1:])]
            for part in parents:
                node = node[part]
            node.pop(last) if value is DELETE else node.__setitem__(last, value)
    return out


def jsonl(items) -> str:
    return "".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in items)


DELETE = object()
NO_ANSWER = {f"r{i}": {"reward_model.ground_truth": DELETE} for i in range(len(ROWS))}
LONG = [{"role": "user", "content": "pad " * 40}]
MANY = [ROWS[i % len(ROWS)] for i in range(5000)]
PARQUET = pd.DataFrame(ROWS).to_parquet()
# fmt: off
DATA = [  # (id, files: name -> text | bytes | None (a directory) | a list of rows, overrides, named)
    ("missing-prompt-column", {"d.jsonl": [{"problem": "1+1", "reward_model": {"ground_truth": "2"}}]}, [],
     ["column 'prompt' (data.prompt_key) not found; columns are ['problem', 'reward_model']"]),
    ("missing-custom-prompt-column", {"d.jsonl": ROWS}, ["data.prompt_key=question"], ["column 'question'"]),
    ("missing-answer-column", {"d.jsonl": [{"prompt": "1+1", "answer": "2"}]}, [],
     ["column 'reward_model.ground_truth' (data.answer_key) not found; columns are ['answer', 'prompt']"]),
    ("missing-nested-answer", {"d.jsonl": rows(**NO_ANSWER)}, [],
     ["column 'reward_model.ground_truth' (data.answer_key) not found"]),
    ("blank-lines-only", {"d.jsonl": "\n  \n\n"}, [], ["d.jsonl: no rows (empty file)"]),
    ("empty-json-array", {"d.json": "[]"}, [], ["d.json: no rows"]),  # was "cannot read as json ... broken?"
    ("empty-json-object", {"d.json": " {} \n"}, [], ["d.json: no rows"]),
    ("zero-row-parquet", {"d.parquet": pd.DataFrame({"prompt": [], "x": []}).to_parquet()}, [], ["d.parquet: no rows"]),
    ("int-prompt", {"d.jsonl": rows(r0={"prompt": 5})}, [],
     ["row 0 (0-based), data.prompt_key 'prompt'", "list of chat messages", "got int 5"]),
    ("string-list-prompt", {"d.jsonl": [{**r, "prompt": ["hi", "there"]} for r in ROWS]}, [],
     ["row 0 (0-based), data.prompt_key 'prompt'", "got list ['hi', 'there']"]),
    ("message-without-content", {"d.jsonl": [{**r, "prompt": [{"role": "user", "text": "1+1"}]} for r in ROWS]}, [],
     ["row 0 (0-based), data.prompt_key 'prompt'", "'content': str"]),
    ("empty-prompt", {"d.jsonl": [{**r, "prompt": ""} for r in ROWS]}, [], ["row 0 (0-based)", "non-empty string"]),
    ("blank-messages", {"d.jsonl": [{**r, "prompt": [{"role": "user", "content": "  "}]} for r in ROWS]}, [],
     ["row 0 (0-based)", "list of chat messages"]),
    ("empty-ground-truth", {"d.jsonl": rows(r1={"reward_model.ground_truth": ""})}, [],
     ["row 1 (0-based), data.answer_key 'reward_model.ground_truth'", "empty or missing ground truth", "got ''"]),
    ("null-ground-truth-row-0", {"d.jsonl": rows(r0={"reward_model.ground_truth": None})}, [],
     ["row 0 (0-based), data.answer_key", "got None"]),
    ("ground-truth-missing-in-row-2", {"d.jsonl": rows(r2={"reward_model.ground_truth": DELETE})}, [],
     ["row 2 (0-based), data.answer_key 'reward_model.ground_truth'", "got None"]),
    ("list-ground-truth", {"d.jsonl": [{"prompt": "1+1", "answer": ["2", "3"]}]}, ["data.answer_key=answer"],
     ["data.answer_key 'answer'", "got ['2', '3']"]),
    ("broken-jsonl-line", {"d.jsonl": jsonl([ROWS[0], ROWS[1], '{"prompt": "x", "reward_model"', ROWS[2]])}, [],
     ["d.jsonl line 3: not valid JSON"]),
    ("jsonl-line-not-an-object", {"d.jsonl": jsonl([ROWS[0], "[1, 2]", ROWS[1]])}, [],
     ["d.jsonl line 2: expected a JSON object (one row), got list"]),
    ("broken-json-array", {"d.json": "[\n" + json.dumps(ROWS[0]) + ",\n{broken\n]"}, [], ["d.json line 3: not valid"]),
    ("broken-parquet", {"d.parquet": b"PAR1 not parquet"}, [], ["d.parquet: cannot read as parquet", "broken"]),
    ("truncated-parquet", {"d.parquet": PARQUET[: len(PARQUET) // 2]}, [], ["d.parquet: cannot read as parquet"]),
    ("directory-with-a-broken-file", {"parts": None, "parts/a.jsonl": ROWS, "parts/b.jsonl": jsonl([ROWS[0], "{x"])},
     [], ["parts/b.jsonl line 2: not valid JSON"]),
    ("every-prompt-too-long", {}, [f"data.path={TRAIN}", "data.max_prompt_len=8", "rollout.prefill_buckets=null"],
     ["every prompt (all 336 rows) is longer than data.max_prompt_len=8 tokens (the shortest has 100)"]),
    # every row is checked before the run starts, not only the first ones (nor only those a step draws)
    ("empty-ground-truth-in-row-5000", {"d.jsonl": [*MANY, rows(r0={"reward_model.ground_truth": ""})[0]]}, [],
     ["row 5000 (0-based)", "empty or missing ground truth"]),
    ("long-prompt-in-row-5000-is-an-error", {"d.jsonl": [*MANY, {**ROWS[0], "prompt": LONG}]},
     ["data.on_long_prompt=error"], ["row 5000 has", "prompt tokens > data.max_prompt_len=128"]),
    ("long-prompt-is-an-error", {"d.jsonl": rows(r1={"prompt": LONG})}, ["data.on_long_prompt=error"],
     ["row 1 has", "prompt tokens > data.max_prompt_len=128 (data.on_long_prompt: error)"]),
    ("broken-eval-data", {"e.jsonl": [{"prompt": "1+1"}]}, [f"data.path={TRAIN}", "eval.path={d}/e.jsonl"],
     ["eval.path", "e.jsonl: column 'reward_model.ground_truth' (data.answer_key) not found"]),
]
# fmt: on


@pytest.mark.parametrize("files,overrides,named", [c[1:] for c in DATA], ids=[c[0] for c in DATA])
def test_bad_data(files, overrides, named, capsys, tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    write_files(d, {name: jsonl(v) if isinstance(v, list) else v for name, v in files.items()})
    first = next((name for name in files if "/" not in name), "")  # the file (or directory) data.path names
    args = [o.format(d=d) for o in overrides]
    if not any(o.startswith("data.path=") for o in args):
        args.insert(0, f"data.path={d / first}")
    if not any(o.startswith("eval.path=") for o in args):
        args.append("eval.path=null")  # the tiny eval set is fine; not loading it keeps the case fast
    run(capsys, tmp_path, *args, kind="data", named=named)


# --- resume: a bad input leaves the run being resumed as it was ----------------------------------------------------
@pytest.mark.parametrize(
    "bad,kind",
    [("rollout.group_size=1", "config"), ("data.path={tmp}/nope.jsonl", "data"), ("model.path={tmp}", "model")],
)
def test_bad_input_on_resume_touches_nothing(bad, kind, capsys, tmp_path):
    run_dir = tmp_path / "run"
    files = {"": None, "checkpoints": None, "checkpoints/step_10": None, "checkpoints/step_10/state.json": "{}"}
    write_files(run_dir, {**files, "config.yaml": "run: {}\n", "metrics.jsonl": '{"step": 10}\n'})
    snapshot = lambda: {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in run_dir.rglob("*") if p.is_file()}  # noqa: E731
    before = snapshot()
    assert main([TINY, bad.format(tmp=tmp_path), f"run.dir={run_dir}", "--resume"]) == 2
    assert f"{kind} error: " in capsys.readouterr().err and snapshot() == before


def test_errors_arrive_in_a_fresh_driver_without_ray_or_the_loop(tmp_path):
    """In a clean interpreter: a config, a model and a data error each exit 2, and neither Ray, the loop nor the
    JAX engine (what loads weights) was ever imported."""
    script = (
        "import sys; from rlloop.run import main; "
        f"rcs = [main([{TINY!r}, *a, 'run.dir={tmp_path}/run']) for a in "
        f"(['cluster.rollout_engines=2'], ['model.path={tmp_path}'], ['data.path={tmp_path}/x.jsonl'])]; "
        "print(rcs, [m for m in ('ray', 'rlloop.loop', 'rlloop.cluster', 'rollout.engine') if m in sys.modules])"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "[2, 2, 2] []", out.stdout + out.stderr
    assert not (tmp_path / "run").exists()


# --- rewards -------------------------------------------------------------------------------------------------------
REWARD_MODULE = """
import math, sys, time
CONSTANT = 3

def score(response, answer):
    kind = response.replace(" ", "")
    if kind == "raise":
        raise RuntimeError("reward function failed")
    if kind == "hang":
        time.sleep(60)
    if kind == "exit":
        sys.exit(3)
    if kind == "ctrlc":
        raise KeyboardInterrupt
    if kind == "huge":
        return 10**400
    return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "none": None, "str": "high", "numstr": "1.5",
            "list": [1.0], "bytes": b"1.5", "np": __import__("numpy").float32(0.5), "int": 1}.get(kind, 1.0)
"""


@pytest.fixture(scope="module")
def reward_modules(tmp_path_factory):
    """bad_rewards.score and two modules that fail on import, on sys.path (spawned reward workers inherit it)."""
    d = tmp_path_factory.mktemp("reward_mods")
    (d / "bad_rewards.py").write_text(REWARD_MODULE)
    (d / "raises_on_import.py").write_text("raise RuntimeError('no GPU here')\ndef score(r, a):\n    return 1.0\n")
    (d / "syntax_error.py").write_text("def score(r, a)\n    return 1.0\n")
    sys.path.insert(0, str(d))
    yield d
    sys.path.remove(str(d))


@pytest.fixture(scope="module")
def scorer(reward_modules):
    from rlloop.config import RewardSection
    from rlloop.reward_scorer import RewardScorer

    # The hang costs its 3 s and a fresh worker; its neighbours' limits run from that worker's start, not before it.
    s = RewardScorer(RewardSection(fn="bad_rewards:score", timeout_s=3.0, failure_reward=-7.0, workers=1))
    yield s
    s.close()


# (what the function does, the reward the sample gets, whether it counts as a failure); failure_reward is -7
# fmt: off
REWARDS = [("raise", -7.0, 1), ("hang", -7.0, 1), ("exit", -7.0, 1), ("ctrlc", -7.0, 1), ("huge", -7.0, 1),
           ("nan", -7.0, 1), ("inf", -7.0, 1), ("-inf", -7.0, 1), ("none", -7.0, 1), ("str", -7.0, 1),
           ("numstr", -7.0, 1), ("list", -7.0, 1), ("bytes", -7.0, 1), ("np", 0.5, 0), ("int", 1.0, 0)]
# fmt: on


@pytest.mark.parametrize("kind,reward,failed", REWARDS, ids=[r[0] for r in REWARDS])
def test_bad_reward_value_costs_one_sample_not_the_run(kind, reward, failed, scorer):
    errors, timeouts = scorer.errors, scorer.timeouts
    assert scorer.score(["ok", kind, "ok"], ["1"] * 3) == [1.0, reward, 1.0]  # its neighbours are scored as usual
    assert (scorer.errors - errors, scorer.timeouts - timeouts) == ((0, failed) if kind == "hang" else (failed, 0))


REWARD_SPECS = [
    ("nosuchmod:score", ["reward.fn 'nosuchmod:score': cannot import module 'nosuchmod'"]),
    ("raises_on_import:score", ["cannot import module 'raises_on_import': RuntimeError: no GPU here"]),
    ("syntax_error:score", ["cannot import module 'syntax_error': SyntaxError"]),
    (":score", ["reward.fn ':score': expected 'package.module:function', with both parts"]),
    ("'bad_rewards:'", ["reward.fn 'bad_rewards:': expected 'package.module:function'"]),
    ("bad_rewards:CONSTANT", ["module 'bad_rewards' has no function 'CONSTANT'"]),
    ("dapoo", ["reward.fn 'dapoo': expected one of ['dapo', 'math']"]),
]


@pytest.mark.parametrize("spec,named", REWARD_SPECS, ids=[s for s, _ in REWARD_SPECS])
def test_bad_reward_fn_exits_2_naming_it(spec, named, reward_modules, capsys, tmp_path):
    run(capsys, tmp_path, f"reward.fn={spec}", named=named)


def test_reward_failures_are_counted_in_the_rollout_metrics(reward_modules, tmp_path, monkeypatch):
    """A real (local) step whose reward function returns NaN for the responses of odd length: the step still trains,
    those samples get failure_reward, and rollout/reward_failures counts each one. One that fails on every sample
    ends the run (a RewardError, exit 1): every advantage would be 0."""
    from rlloop.config import load_config
    from rlloop.errors import RewardError

    monkeypatch.delitem(sys.modules, "rlloop.loop")  # this one test trains: the real loop, not the tripwire
    from rlloop.loop import train

    (reward_modules / "nan_rewards.py").write_text(
        "def score(response, answer):\n    return float('nan') if len(response) % 2 else 0.5\n\n\n"
        "def every(response, answer):\n    return float('nan')\n"
    )
    overrides = ["rollout.prompts_per_step=2", "reward.fn=nan_rewards:score", "run.steps=1", "run.eval_every=0"]
    overrides += ["run.save_every=0", "cluster.use_ray=false", "rollout.backend=hf", "tracking.progress=false"]
    cfg = load_config(TINY, [*overrides, "tracking.save_rollouts=true", f"run.dir={tmp_path}"])
    train(cfg)
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (tmp_path / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    odd = [len(s["response"]) % 2 == 1 for s in samples]
    assert 0 < sum(odd) < len(samples) == 2 * cfg.rollout.group_size  # some of each
    assert row["rollout/reward_failures"] == sum(odd) and row["rollout/reward_timeouts"] == 0  # NaN is no timeout
    assert [s["raw_reward"] for s in samples] == [cfg.reward.failure_reward if o else 0.5 for o in odd]
    assert "train/loss" in row
    every = load_config(TINY, [*overrides, "reward.fn=nan_rewards:every", f"run.dir={tmp_path / 'every'}"])
    with pytest.raises(RewardError, match="failed on each of the last 16 samples"):
        train(every)


def test_a_model_whose_context_is_exactly_prompt_plus_response_passes(capsys, tmp_path):
    """The context check's edge: data.max_prompt_len + rollout.max_response_len positions are what a sample can
    take, so a model with exactly that many (max_position_embeddings) runs it; one fewer is refused."""
    from rlloop.config import load_config

    cfg = load_config(TINY)
    need = cfg.data.max_prompt_len + cfg.rollout.max_response_len
    d = Path(shutil.copytree(MODEL, tmp_path / "model"))
    edit_json(d / "config.json", max_position_embeddings=need)
    assert main([TINY, f"model.path={d}", "--dry-run"]) == 0, capsys.readouterr().err
    assert "model, tokenizer and data: checked" in capsys.readouterr().out
    edit_json(d / "config.json", max_position_embeddings=need - 1)
    run(capsys, tmp_path, f"model.path={d}", kind="model", named=[f"= {need} tokens, beyond the model's"])


def test_a_broken_jsonl_line_after_blank_lines_is_named_by_its_own_number(capsys, tmp_path):
    """Blank lines in a jsonl file are no rows (datasets skips them): the line blamed is the broken one, counted as
    an editor counts lines, not the first blank one."""
    d = tmp_path / "data"
    d.mkdir()
    write_files(d, {"d.jsonl": jsonl([ROWS[0], "", "  ", '{"prompt": "x", "reward_model"', ROWS[1]])})
    run(
        capsys,
        tmp_path,
        f"data.path={d / 'd.jsonl'}",
        "eval.path=null",
        kind="data",
        named=["d.jsonl line 4: not valid JSON"],
    )


@pytest.mark.parametrize(
    "edits",
    [
        dict(use_sliding_window=True, sliding_window=32, max_window_layers=0, layer_types=None),  # sliding window
        dict(model_type="mpt"),  # ALiBi
    ],
    ids=["sliding-window", "alibi"],
)
def test_what_only_shared_prompt_rows_cannot_train_passes_with_train_share_prompts_off(edits, capsys, tmp_path):
    """The way out the sliding-window and ALiBi refusals name (train.share_prompts=false) works: the same model
    passes the checks (dry run)."""
    d = Path(shutil.copytree(MODEL, tmp_path / "model"))
    edit_json(d / "config.json", **edits)
    assert main([TINY, f"model.path={d}", "rollout.backend=hf", "train.share_prompts=false", "--dry-run"]) == 0
    assert "model, tokenizer and data: checked" in capsys.readouterr().out


def test_under_ignore_eos_only_the_stop_ids_count_against_the_engine_row(capsys, tmp_path):
    """With rollout.ignore_eos the model's and tokenizer's EOS ids end nothing: the 15 rollout.stop_token_ids that
    are refused beside three EOS ids (stop-ids-past-the-engine-row) fit the JAX engine's row of 16 alone."""
    d = Path(shutil.copytree(MODEL, tmp_path / "model"))
    edit_json(d / "generation_config.json", eos_token_id=[2, 3, 4])
    stops = f"rollout.stop_token_ids={list(range(5, 20))}"
    assert main([TINY, f"model.path={d}", stops, "rollout.ignore_eos=true", "--dry-run"]) == 0
    assert "model, tokenizer and data: checked" in capsys.readouterr().out


def test_a_model_with_pytorch_bin_weights_only_passes_the_weight_check(capsys, tmp_path):
    """pytorch_model*.bin is one of the weight files the checks accept (WEIGHT_PATTERNS): a model directory holding
    only those passes (dry run), as one holding only *.safetensors does."""
    d = Path(shutil.copytree(MODEL, tmp_path / "model"))
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    assert main([TINY, f"model.path={d}", "--dry-run"]) == 0
    assert "model, tokenizer and data: checked" in capsys.readouterr().out
