"""The real recipe (examples/grpo_dapo.yaml) end to end without a download: every code path of a Qwen3-4B run on
DAPO-Math-17k but the download itself, on local files of the same formats.

- a Qwen3 directory with Qwen3's vocabulary size (151,936), its special-token ids (<|endoftext|> 151643,
  <|im_start|> 151644, <|im_end|> 151645), EOS ids 151645/151643 in generation_config.json and the real Qwen3 chat
  template (the copy TRL ships), with tiny layers;
- DAPO-Math-17k-schema training parquet and an AIME-schema eval parquet;
- the recipe as written (bf16, gradient checkpointing, TP-2 JAX engine, 2 FSDP trainer ranks, shm delta sync, W&B
  offline), only shrunk in lengths and counts and pointed at cluster.device=cpu.
"""

import json

import pytest

from rlloop.config import load_config
from rlloop.loop import train
from tests.e2e.runs import ROOT, metrics

pytestmark = pytest.mark.xdist_group("ray")  # starts Ray: one at a time (tests/conftest.py)

REAL = str(ROOT / "examples" / "grpo_dapo.yaml")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def qwen3_tokenizer():
    """A byte-level BPE tokenizer laid out like Qwen3's: 151,643 regular ids, then the special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    trl = pytest.importorskip("trl", reason="the real Qwen3 chat template comes from TRL (pip install -e '.[dev]')")
    import importlib.resources

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({f"<unused_{i}>": i for i in range(len(vocab), 151643)})  # where Qwen3 has its BPE merges
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = (importlib.resources.files(trl) / "chat_templates" / "qwen3.jinja").read_text()
    return tok


def dapo_rows(n: int, split: str) -> list[dict]:
    return [
        {
            "data_source": "math_dapo" if split == "train" else "aime",
            "prompt": [{"role": "user", "content": f"Solve: {i} + {i + 1}\nAnswer: $Answer"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": str(2 * i + 1), "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": i, "split": split},
        }
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def local_files(tmp_path_factory):
    import pandas as pd
    import torch
    import transformers

    root = tmp_path_factory.mktemp("qwen3_local")
    tok = qwen3_tokenizer()
    assert tok.convert_tokens_to_ids(SPECIALS) == [151643, 151644, 151645]
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=151936,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=40960,
        rope_theta=1e6,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
    )
    model_dir = root / "Qwen3-local"
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    gen = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643}
    (model_dir / "generation_config.json").write_text(json.dumps(gen))
    pd.DataFrame(dapo_rows(32, "train")).to_parquet(root / "dapo-math-17k.parquet")
    pd.DataFrame(dapo_rows(4, "test")).to_parquet(root / "aime-2024.parquet")
    return root


def test_the_real_recipe_runs_two_steps_on_local_files(local_files, tmp_path):
    import ray

    cfg = load_config(
        REAL,
        [
            f"model.path={local_files / 'Qwen3-local'}",
            f"data.path={local_files / 'dapo-math-17k.parquet'}",
            f"eval.path={local_files / 'aime-2024.parquet'}",
            f"run.dir={tmp_path}",
            "cluster.device=cpu",
            "run.steps=2",
            "run.eval_every=2",
            "eval.samples=2",
            "data.max_prompt_len=64",
            "rollout.max_response_len=16",
            "rollout.prompts_per_step=4",
            "rollout.group_size=4",
            "rollout.max_batch=32",
            "tracking.progress=false",
        ],
    )
    assert cfg.model.dtype == "bfloat16" and cfg.train.gradient_checkpointing and cfg.sync.delta
    assert (cfg.cluster.rollout_chips, cfg.cluster.train_chips, cfg.rollout.backend) == (2, 2, "jax")
    ray.init(
        address="local", num_cpus=4, include_dashboard=False, configure_logging=False
    )  # 1 engine + 2 ranks on 2 real cores
    try:
        train(cfg)
    finally:
        ray.shutdown()
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "eval/aime-2024" in rows[0] and "eval/aime-2024" in rows[2]
    assert all(r["perf/compiles"] == 0 for r in rows[1:])
    assert [r["sync/rollout_version"] for r in rows[1:]] == [1, 2]
    assert rows[-1]["train/state_bytes_per_rank"] > 0
    # the EOS ids of generation_config.json end responses, and the checkpoint is sharded beside its HF directory
    checkpoint = tmp_path / "checkpoints" / "step_000002" / "trainer"
    assert (checkpoint / "sharded").is_dir() and (checkpoint / "config.json").is_file()
