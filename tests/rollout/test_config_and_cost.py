"""The small shared pieces: EngineConfig's validation (and that it loads without jax), the seed arithmetic, the EOS
rule both backends use, and the cost model against the weights the decoder actually holds and the FLOPs torch counts."""

import copy
import pickle
import subprocess
import sys

import numpy as np
import pytest
import transformers

from rollout import DTYPES, EngineConfig, mix_seed, request_id
from rollout.model_config import ModelConfig, eos_token_ids
from tests.conftest import make_tiny_hf_model


def test_engine_config_validates_fields_and_pickles():
    cfg = EngineConfig("some/model", max_batch=8, prefill_buckets=[16, 32])
    assert (cfg.model_path, cfg.dtype, cfg.max_batch, cfg.prefill_buckets) == ("some/model", "float32", 8, (16, 32))
    assert EngineConfig(model_path="m").max_batch == 256
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    for bad, field in [
        (dict(dtype="float16"), "dtype"),
        (dict(max_batch=0), "max_batch"),
        (dict(max_seq_len=1), "max_seq_len"),
        (dict(steps_per_dispatch=0), "steps_per_dispatch"),
        (dict(tp=0), "tp"),
        (dict(max_btach=8), "max_btach"),
    ]:
        with pytest.raises(ValueError, match=field):
            EngineConfig("m", **bad)
    assert set(DTYPES) == {"float32", "bfloat16"}


def test_import_rollout_loads_neither_jax_nor_torch():
    code = (
        "import sys, rollout; rollout.EngineConfig('m'); "
        "print(sorted(m for m in ('jax', 'torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_seed_arithmetic_is_the_engines_historic_one():
    for base, offset in [(0, 0), (0, 7), (3, 11), (2**31 - 1, 2**31 - 1), (123456, 2**40)]:
        assert mix_seed(base, offset) == (offset + 1_000_003 * base) & 0x7FFFFFFF
    assert mix_seed(0, 5) == 5  # engine seed 0 keeps the request's seed as is
    for i, j in [(0, 0), (1, 2), (40000, 65536)]:
        assert request_id(i, j) == (i * 65537 + j) & 0x7FFFFFFF


def test_eos_ids_prefer_generation_config():
    assert eos_token_ids({"eos_token_id": 2}, {"eos_token_id": [151645, 151643]}) == (151645, 151643)
    assert eos_token_ids({"eos_token_id": 2}, {"eos_token_id": None}) == (2,)
    assert eos_token_ids({"eos_token_id": [3, 4]}, None) == (3, 4)
    assert eos_token_ids({"eos_token_id": None}, {}) == ()
    assert eos_token_ids({}) == ()


def test_cost_model_counts_the_decoders_weights_and_chunks(tmp_path):
    import jax

    from rollout import cost
    from rollout.weights import load_safetensors_dir, params_from_named_arrays

    for family, tie in [("qwen3", True), ("qwen2", False), ("llama", False)]:
        path = make_tiny_hf_model(tmp_path / family, family, tie=tie)
        cfg = ModelConfig.from_dir(str(path))
        named = load_safetensors_dir(str(path))
        weights = params_from_named_arrays(cfg, named, "bfloat16")
        assert cost.param_count(cfg) == sum(a.size for a in jax.tree.leaves(weights))
        assert cost.weight_bytes(cfg, 2) == sum(a.nbytes for a in jax.tree.leaves(weights))
        assert (weights.lm_head is None) == tie and (weights.layers[0].bq is not None) == (family == "qwen2")
    # CPU (the default): a paged cache, read by its 64-position pages in use; at most 16 pages, longer ones past that
    assert cost.cache_page_len(256) == 64 and cost.cache_page_len(40) == 40 and cost.cache_page_len(4096) == 256
    # no page straddles torch's 512-key softmax blocks, which decode follows: a power of two up to 512, else a multiple
    assert [cost.cache_page_len(n) for n in (3000, 5000, 9216, 20000)] == [256, 512, 1024, 1536]
    for n in range(1025, 40000, 97):
        page = cost.cache_page_len(n)
        assert (cost.FLASH_KV_BLOCK % page == 0 or page % cost.FLASH_KV_BLOCK == 0) and -(-n // page) <= cost.MAX_PAGES
    assert cost.decode_kv_positions(256, 1) == 64 and cost.decode_kv_positions(256, 65) == 128
    assert cost.decode_kv_positions(200, 199) == 200  # capped at the cache (its last page is 8 positions)
    assert cost.decode_kv_positions(4096, 257) == 512
    # accelerators: one buffer, a short one read whole, a long one by the 128-position chunks in use
    assert cost.cache_page_len(4096, "gpu") == 4096 and cost.cache_page_len(512, "tpu") == 512
    assert cost.decode_kv_positions(1024, 1, whole=False) == 128 and cost.decode_kv_positions(1024, 129, False) == 256
    assert cost.decode_kv_positions(320, 300, whole=False) == 320  # capped at the cache
    assert cost.reads_whole_cache(1024, "gpu") and not cost.reads_whole_cache(2048, "gpu")  # a GPU: up to 8 chunks
    assert not cost.reads_whole_cache(512, "tpu") and cost.reads_whole_cache(256, "tpu")
    assert cost.decode_kv_positions(1024, 1, whole=True) == 1024
    assert cost.decode_kv_positions(2048, 129, whole=False) == 256
    # rollout.decode_attention overrides the rule either way
    assert cost.reads_whole_cache(4096, "cpu", "whole") and not cost.reads_whole_cache(256, "gpu", "chunked")
    assert cost.cache_page_len(256, "cpu", "whole") == 256 and cost.cache_page_len(256, "gpu", "paged") == 64
    assert int(cost.decode_chunks(np.int32(257))) == 3


def test_train_flops_are_the_matmuls_of_a_training_pass(tmp_path):
    """`train_flops` against torch's FLOP counter on an HF model's forward and backward with the LM head on the
    response positions, as the trainer takes log-probs. Eager attention, whose q.k and p.v the counter sees as matmuls
    over the whole [L, L] square: the bound counts the causal half (with the diagonal) only."""
    import torch
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    from rollout import cost

    for family, tie in [("qwen3", True), ("llama", False)]:
        path = make_tiny_hf_model(tmp_path / family, family, tie=tie)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
        cfg = ModelConfig.from_dir(str(path))
        prompt, response = 11, 7
        length = prompt + response
        with FlopCounterMode(display=False) as counter:
            hidden = model.model(torch.randint(3, cfg.vocab_size, (1, length))).last_hidden_state
            model.lm_head(hidden[:, prompt - 1 : length - 1]).logsumexp(-1).sum().backward()
        counted = sum(counter.get_flop_counts()["Global"].values())
        per_pair = 3 * 4 * cfg.num_layers * cfg.q_size  # q.k and p.v, forward and backward
        causal = counted - per_pair * length * length + per_pair * length * (length + 1) / 2
        assert cost.train_flops(cfg, [(prompt, [response])]) == causal


def test_generate_flops_count_each_prefill_once_against_the_flop_counter(tmp_path):
    """A prefill of n tokens is the layers' matmuls and causal attention over them (torch's counter on the model's
    forward, eager attention's square cut to the causal half); a prompt's samples share its one prefill (GRPO fan-out
    copies its KV), so each sample after the first adds only its decode."""
    import torch
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    from rollout import cost

    path = make_tiny_hf_model(tmp_path / "qwen3", "qwen3")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    cfg = ModelConfig.from_dir(str(path))
    n = 13
    with FlopCounterMode(display=False) as counter:
        model.model(torch.randint(3, cfg.vocab_size, (1, n)))
    counted = sum(counter.get_flop_counts()["Global"].values())
    per_pair = 4 * cfg.num_layers * cfg.q_size
    assert cost.generate_flops(cfg, [n], []) == counted - per_pair * n * n + per_pair * n * (n + 1) / 2
    one, four = (cost.generate_flops(cfg, [n], [(n + 1, 5)] * g) for g in (1, 4))
    assert four - one == 3 * cost.generate_flops(cfg, [], [(n + 1, 5)])


def test_a_config_is_read_as_transformers_reads_it_or_refused():
    """A Qwen3 config.json without head_dim has Qwen3Config's 128 (not hidden / heads, as for Llama and Qwen2); a
    sliding-window model is refused: decoded with full attention it would be another model than transformers runs."""
    import transformers

    hf = dict(vocab_size=100, hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4)
    for family, config in (("qwen3", transformers.Qwen3Config), ("qwen2", transformers.Qwen2Config)):
        model = transformers.AutoModelForCausalLM.from_config(config(**hf))
        want = model.model.layers[0].self_attn.head_dim
        assert ModelConfig.from_hf_dict({**hf, "model_type": family}).head_dim == want
        # mlp_bias is Llama's key: Qwen's MLPs have no biases whatever config.json says (the engine wanted them)
        biased = transformers.AutoModelForCausalLM.from_config(config(**hf, mlp_bias=True))
        assert biased.model.layers[0].mlp.gate_proj.bias is None
        assert not ModelConfig.from_hf_dict({**hf, "model_type": family, "mlp_bias": True}).mlp_bias
        windowed = config(**hf, use_sliding_window=True, sliding_window=4, max_window_layers=0).to_dict()
        with pytest.raises(ValueError, match="sliding-window attention"):
            ModelConfig.from_hf_dict(windowed)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_parameters": {**LLAMA3, "rope_theta": 5e5, "original_max_position_embeddings": 64}},  # transformers 5
        {"rope_theta": 5e5, "rope_scaling": {**LLAMA3, "original_max_position_embeddings": 64}},  # transformers 4
        # rope_scaling added by hand to a transformers 5 config.json: it wins, theta and all
        {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "rope_scaling": {**LLAMA3, "rope_theta": 2e5}},
        {"rope_theta": 5e5, "rope_scaling": LLAMA3},  # no original context: the model's own
    ],
    ids=["rope_parameters", "rope_scaling", "rope_scaling_over_rope_parameters", "no_original_context"],
)
def test_rope_frequencies_are_the_ones_transformers_builds(rope):
    """However config.json states RoPE, the decoder's frequencies are those of the model transformers builds from it;
    the engine had read rope_parameters over a rope_scaling beside it (plain RoPE where the trainer had Llama 3's)."""
    import transformers

    hf = dict(
        model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=256, **rope,
    )  # fmt: skip
    built = transformers.LlamaConfig.from_dict(copy.deepcopy(hf))  # it fills in the dicts it is given
    model = transformers.AutoModelForCausalLM.from_config(built)
    want = model.model.rotary_emb.inv_freq.numpy()
    np.testing.assert_allclose(ModelConfig.from_hf_dict(hf).rope_inv_freq(), want, rtol=1e-6)
    with pytest.raises(ValueError, match="unsupported rope_type 'yarn'"):
        ModelConfig.from_hf_dict({**hf, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_a_config_json_that_leaves_keys_out_gets_transformers_defaults(family):
    """A minimal config.json (no num_key_value_heads, tie_word_embeddings, rope_theta or rms_norm_eps) is read with
    the defaults transformers builds the model with: as many KV heads as heads (Llama), untied embeddings, RoPE's
    theta and the norm's epsilon."""
    hf = dict(model_type=family, vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=1)
    hf |= dict(num_attention_heads=4, head_dim=16)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**copy.deepcopy(hf)))
    cfg = ModelConfig.from_hf_dict(hf)
    attn = model.model.layers[0].self_attn
    if family == "llama":  # Qwen2Config and Qwen3Config default to 32 and 8 KV heads, whatever the heads
        assert cfg.num_kv_heads * cfg.head_dim == attn.k_proj.out_features == attn.v_proj.out_features
    assert cfg.tie_word_embeddings == (model.lm_head.weight is model.model.embed_tokens.weight)
    assert cfg.rms_norm_eps == model.model.norm.variance_epsilon
    np.testing.assert_allclose(cfg.rope_inv_freq(), model.model.rotary_emb.inv_freq.numpy(), rtol=1e-6)


def test_the_older_rope_scaling_key_type_is_read_as_rope_type():
    """transformers 4's configs may name the RoPE type `type` (rope_scaling={"type": "llama3", ...}); transformers
    still builds Llama 3 frequencies from it, and so must the decoder."""
    hf = dict(
        model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=256, rope_theta=5e5,
        rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig.from_dict(copy.deepcopy(hf)))
    want = model.model.rotary_emb.inv_freq.numpy()
    np.testing.assert_allclose(ModelConfig.from_hf_dict(hf).rope_inv_freq(), want, rtol=1e-6)
