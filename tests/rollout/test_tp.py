"""Tensor parallelism on fake CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=4 from conftest):
tp=2 gives the same logits and the same tokens as one device, with weights and KV cache really split."""

import functools

import jax
import numpy as np
import pytest

from rollout.cost import engine_memory
from rollout.kv_cache import init_cache
from rollout.model import decode_step, logits_from_hidden, prefill
from rollout.model_config import ModelConfig
from rollout.sharding import cache_sharding, check_tp, make_mesh, param_shardings
from rollout.types import SamplingParams
from rollout.weights import load_safetensors_dir, params_from_named_arrays
from tests.conftest import make_tiny_hf_model
from tests.rollout.conftest import small_engine

pytestmark = pytest.mark.skipif(len(jax.devices()) < 2, reason="needs >= 2 (fake) devices")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("q3tp"), "qwen3", tie=False, seed=2)


def _run(mc, host_params, tp, prompt, steps=8, page_len=None):
    mesh = make_mesh(tp)
    params = jax.device_put(host_params, param_shardings(mc, mesh))
    # 320 positions: longer than two decode chunks, so the chunked attention loop runs on the sharded cache too; or
    # in pages, each sharded
    sharding = cache_sharding(mesh)
    cache = init_cache(mc.num_layers, 2, mc.num_kv_heads, 320, mc.head_dim, np.float32, sharding, page_len)
    n = len(prompt)
    cache, hidden = jax.jit(functools.partial(prefill, mc))(
        params,
        cache,
        np.array(prompt, np.int32),
        np.arange(n, dtype=np.int32),
        np.zeros(n, np.int32),
        np.ones(n, np.int32),
    )
    logits = [np.asarray(logits_from_hidden(params, hidden))]
    step = jax.jit(functools.partial(decode_step, mc))
    tok, pos = np.array([0, int(np.argmax(logits[0][-1]))], np.int32), np.array([0, n], np.int32)
    for _ in range(steps):
        cache, lg = step(params, cache, tok, pos)
        logits.append(np.asarray(lg))
        tok, pos = np.argmax(logits[-1], -1).astype(np.int32), pos + 1
    return params, cache, logits


@pytest.mark.parametrize("page_len", [None, 64])
def test_tp2_logits_match_one_device(model_dir, page_len):
    mc = ModelConfig.from_dir(str(model_dir))
    host = params_from_named_arrays(mc, load_safetensors_dir(str(model_dir)), "float32")
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    _, _, one = _run(mc, host, 1, prompt, page_len=page_len)
    params, cache, two = _run(mc, host, 2, prompt, page_len=page_len)
    # weights and cache are split, not replicated
    wq = params.layers[0].wq
    assert len(wq.sharding.device_set) == 2 and wq.addressable_shards[0].data.shape == (64, mc.q_size // 2)
    assert all(page.addressable_shards[0].data.shape[1] == mc.num_kv_heads // 2 for page in cache.k[0])
    for a, b in zip(one, two, strict=True):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)


def test_tp2_engine_generates_what_one_device_does(model_dir):
    prompts = [[5, 6, 7, 8, 9], [20, 21, 22], list(range(30, 50))]
    sp = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=16, seed=4)
    outs = []
    for tp in (1, 2):
        eng = small_engine(model_dir, tp=tp, prefill_buckets=(32,), decode_buckets=(8,))
        outs.append(eng.generate(prompts, 2, sp))
    assert [c.token_ids for c in outs[0]] == [c.token_ids for c in outs[1]]
    for a, b in zip(*outs):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_tp_must_divide_heads(model_dir):
    mc = ModelConfig.from_dir(str(model_dir))
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tp=3"):
        check_tp(mc, 3)
    with pytest.raises(ValueError, match="tp=64"):
        check_tp(mc, 64)


def _bytes_per_device(arrays) -> dict[int, int]:
    held: dict[int, int] = {}
    for a in arrays:
        for shard in a.addressable_shards:
            held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
    return held


def test_each_device_holds_the_planned_bytes_and_one_copy_of_the_weights_while_loading(model_dir, monkeypatch):
    """At tp=2 the embedding and the norms are whole on both devices and the projections halved (the plan used to
    halve all of it); a weight load drops the old weights before the new arrive, so no device holds two copies."""
    from rollout.cost import engine_memory
    from rollout.weights import expected_shapes

    engine = small_engine(model_dir, tp=2)
    plan = engine_memory(engine.model_cfg, 4, 8, 64, tp=2, head_copy=engine._head_copy, kv_itemsize=4)
    assert set(_bytes_per_device(jax.tree.leaves(engine.params)).values()) == {plan["weights"]}
    assert set(_bytes_per_device(jax.tree.leaves(engine.cache)).values()) == {plan["kv_cache"]}

    put, peak = jax.device_put, {}

    def put_and_look(*args, **kwargs):
        out = put(*args, **kwargs)
        peak.update(_bytes_per_device(jax.live_arrays()))
        return out

    monkeypatch.setattr(jax, "device_put", put_and_look)
    before = _bytes_per_device(jax.live_arrays())
    engine.load_weights({n: np.ones(s, np.float32) for n, s in expected_shapes(engine.model_cfg).items()}, 1)
    assert peak and all(peak[d] <= before[d] for d in before), (before, peak)


def test_an_lm_head_whose_vocab_does_not_divide_is_held_whole_on_each_device(tmp_path):
    """Heads and MLP channels must divide by tp (check_tp); the vocabulary need not (127 here): the untied LM head is
    then replicated, whole on both devices, and the memory plan counts it so."""
    path = make_tiny_hf_model(tmp_path / "odd_vocab", "qwen3", tie=False, vocab_size=127)
    engine = small_engine(path, tp=2)
    mc = engine.model_cfg
    head = engine.params.lm_head
    assert head.shape == (mc.hidden_size, 127)
    assert set(_bytes_per_device([head]).values()) == {mc.hidden_size * 127 * 4}  # whole on each of the 2 devices
    wq = engine.params.layers[0].wq  # a dimension that divides is still split
    assert wq.addressable_shards[0].data.shape == (mc.hidden_size, mc.q_size // 2)
    plan = engine_memory(mc, 4, 8, 64, tp=2, head_copy=engine._head_copy, kv_itemsize=4)
    assert set(_bytes_per_device(jax.tree.leaves(engine.params)).values()) == {plan["weights"]}
