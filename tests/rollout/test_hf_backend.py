"""HFEngine against plain transformers: greedy parity with model.generate, log-probs against a manual forward pass,
stop handling, weight loading (including bf16 and tied heads) and its errors."""

import itertools
import threading

import ml_dtypes
import numpy as np
import pytest
import torch
import transformers

from rollout import EngineConfig, RolloutEngine, SamplingParams, make_engine
from rollout.hf_backend import HFEngine

try:
    from tests.conftest import make_tiny_hf_model
except ImportError:  # pragma: no cover - depends on how pytest was started
    from conftest import make_tiny_hf_model

PROMPTS = [[1, 5, 9, 17, 33], [1, 7], [1, 40, 41, 42, 43, 44, 45, 46], [1, 99, 3]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # A larger init range than HF's default gives peaked next-token distributions, so greedy paths are stable and
    # a wrong log-prob is far from a right one.
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("hf_a"), "qwen3", initializer_range=0.2, seed=0))


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory):
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("hf_b"), "qwen3", initializer_range=0.2, seed=1))


@pytest.fixture(scope="module")
def engine(model_dir):
    # 3 < rows, so batching and left padding across batches are exercised
    return HFEngine(EngineConfig(model_dir, max_batch=3))


def reference_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_greedy_matches_plain_generate(engine, model_dir):
    ref = reference_model(model_dir)
    # No stop_token_ids: rows stop on the model's own EOS id (2, from its config), as in vLLM.
    sampling = SamplingParams(temperature=0.0, max_new_tokens=10)
    out = engine.generate(PROMPTS, n=2, sampling=sampling)
    assert any(c.finish_reason == "stop" for c in out), "pick prompts where some greedy row emits EOS"
    assert [(c.prompt_index, c.sample_index) for c in out] == [(p, s) for p in range(len(PROMPTS)) for s in range(2)]
    for c in out:
        prompt = PROMPTS[c.prompt_index]
        with torch.no_grad():  # one unpadded prompt at a time: no padding in the reference
            seq = ref.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=10, eos_token_id=2, pad_token_id=0
            )[0, len(prompt) :].tolist()
        if 2 in seq:
            seq = seq[: seq.index(2) + 1]
        assert c.token_ids == seq
        assert c.finish_reason == ("stop" if seq[-1] == 2 else "length")
        assert len(c.logprobs) == len(c.token_ids)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, -1, 1.0), (0.7, 10, 0.9)])
def test_logprobs_match_manual_forward(engine, model_dir, temperature, top_k, top_p):
    ref = reference_model(model_dir)
    sampling = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=12, seed=3, ignore_eos=True
    )
    out = engine.generate(PROMPTS, n=2, sampling=sampling)
    for c in out:
        prompt = PROMPTS[c.prompt_index]
        assert c.finish_reason == "length" and len(c.token_ids) == 12
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1].double().numpy()
        z = logits / temperature
        # Restrict to the sampled distribution: top-k, then top-p over the renormalised top-k (HF's rule).
        keep = np.ones_like(z, bool)
        if top_k > 0:
            kth = np.sort(z, axis=-1)[:, -top_k][:, None]
            keep &= z >= kth
        zk = np.where(keep, z, -np.inf)
        p = np.exp(zk - zk.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        if top_p < 1.0:
            order = np.argsort(-p, axis=-1)
            sorted_p = np.take_along_axis(p, order, -1)
            ahead = np.cumsum(sorted_p, -1) - sorted_p
            keep_sorted = (ahead < top_p) | (np.arange(p.shape[-1]) == 0)
            np.put_along_axis(keep, order, keep_sorted & np.take_along_axis(keep, order, -1), -1)
            zk = np.where(keep, z, -np.inf)
        log_probs = zk - zk.max(-1, keepdims=True)
        log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
        expected = log_probs[np.arange(len(c.token_ids)), c.token_ids]
        assert np.all(np.isfinite(expected)), "a sampled token lies outside the filtered set"
        np.testing.assert_allclose(c.logprobs, expected, atol=1e-4, rtol=0)


def test_sampling_is_reproducible_per_seed(engine):
    a = engine.generate(PROMPTS, n=2, sampling=SamplingParams(max_new_tokens=8, seed=11))
    b = engine.generate(PROMPTS, n=2, sampling=SamplingParams(max_new_tokens=8, seed=11))
    c = engine.generate(PROMPTS, n=2, sampling=SamplingParams(max_new_tokens=8, seed=12))
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]


def test_sampling_is_deaf_to_other_threads_use_of_torchs_rng(engine):
    """In a run without Ray the trainer shares the engine's process, and its checkpointed recomputes rewind torch's
    global RNG: drawn from it, a resumed async run sampled other tokens than the run it resumed, now and then."""
    sampling = SamplingParams(max_new_tokens=8, seed=11)
    quiet = engine.generate(PROMPTS, n=4, sampling=sampling)
    stop = threading.Event()

    def reseed() -> None:
        for seed in itertools.count():
            if stop.is_set():
                return
            torch.manual_seed(seed)

    other = threading.Thread(target=reseed)
    other.start()
    try:
        busy = engine.generate(PROMPTS, n=4, sampling=sampling)
    finally:
        stop.set()
        other.join()
    assert [c.token_ids for c in busy] == [c.token_ids for c in quiet]
    assert [c.logprobs for c in busy] == [c.logprobs for c in quiet]


def test_stop_ids_end_rows(engine):
    free = engine.generate(PROMPTS, n=1, sampling=SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True))
    assert 2 in sum((c.token_ids for c in free), []), "the model's EOS must occur for ignore_eos to be tested"
    assert all(c.finish_reason == "length" and len(c.token_ids) == 10 for c in free)
    # Pick a token that greedy decoding emits mid-way in some row (not at its first step), then stop on it.
    stop = next(t for c in free for t in c.token_ids[2:])
    stopped = engine.generate(
        PROMPTS,
        n=1,
        sampling=SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=(stop, 127), ignore_eos=True),
    )
    for before, after in zip(free, stopped):
        if stop in before.token_ids:
            cut = before.token_ids.index(stop) + 1
            assert after.token_ids == before.token_ids[:cut] and after.finish_reason == "stop"
            np.testing.assert_allclose(after.logprobs, before.logprobs[:cut], atol=1e-5)
        else:
            assert after.token_ids == before.token_ids and after.finish_reason == "length"
    assert any(c.finish_reason == "stop" for c in stopped)


def test_load_weights_changes_outputs_and_stamps_version(model_dir, other_model_dir):
    engine = HFEngine(EngineConfig(model_dir))
    other = HFEngine(EngineConfig(other_model_dir))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    before = engine.generate(PROMPTS, 1, greedy)
    assert all(c.weight_version == 0 for c in before)
    # A tied checkpoint: send it without lm_head.weight, as real Qwen3 small checkpoints do.
    arrays = {k: v.numpy().copy() for k, v in other.model.state_dict().items() if k != "lm_head.weight"}
    engine.load_weights(arrays, version=7)
    after = engine.generate(PROMPTS, 1, greedy)
    expected = other.generate(PROMPTS, 1, greedy)
    assert [c.token_ids for c in after] == [c.token_ids for c in expected]
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    assert all(c.weight_version == 7 for c in after)
    assert engine.stats()["weight_version"] == 7 and engine.stats()["gen_tokens"] == 40


def test_load_weights_takes_what_the_jax_engine_takes(model_dir, other_model_dir):
    """Some checkpoints and exporters carry RoPE's inv_freq buffer: derived from the config, not a weight, it is left
    out by both backends alike rather than refused by one."""
    engine = HFEngine(EngineConfig(model_dir))
    arrays = {k: v.numpy().copy() for k, v in HFEngine(EngineConfig(other_model_dir)).model.state_dict().items()}
    arrays["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    engine.load_weights(arrays, version=3)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    assert all(c.weight_version == 3 for c in engine.generate(PROMPTS, 1, greedy))
    # and refuses what it refuses: a tensor that is not floats would be cast into the weights
    norm = arrays["model.norm.weight"]
    for wrong, what in ((norm.astype(np.int64), "dtype int64"), (norm.tolist(), "a list")):
        with pytest.raises(
            ValueError, match=f"'model.norm.weight' is {what}, expected a numpy array of float16/32/64 or bfloat16"
        ):
            engine.load_weights(arrays | {"model.norm.weight": wrong}, version=4)
    assert engine.stats()["weight_version"] == 3


def test_load_weights_bf16_is_bit_exact(model_dir):
    engine = HFEngine(EngineConfig(model_dir, dtype="bfloat16"))
    name = "model.layers.0.mlp.up_proj.weight"
    values = np.random.default_rng(0).normal(size=tuple(engine.model.state_dict()[name].shape)).astype(np.float32)
    sent = values.astype(ml_dtypes.bfloat16)
    sent.flags.writeable = False  # as from an mmap'd checkpoint or a shared-memory reader
    state = {k: v.float().numpy().astype(ml_dtypes.bfloat16) for k, v in engine.model.state_dict().items()}
    engine.load_weights(state | {name: sent}, version=1)
    got = engine.model.state_dict()[name].view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(got, values.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_bad_weights_raise_and_change_nothing(model_dir):
    engine = HFEngine(EngineConfig(model_dir))
    snapshot = {k: v.clone() for k, v in engine.model.state_dict().items()}
    good = {k: np.zeros(tuple(v.shape), np.float32) for k, v in snapshot.items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match="model.layers.9.bogus"):
        engine.load_weights({**good, "model.layers.9.bogus": np.zeros(3, np.float32)}, version=1)
    with pytest.raises(ValueError, match="model.norm.weight"):
        engine.load_weights({**good, "model.norm.weight": np.zeros(65, np.float32)}, version=1)
    embed = good["model.embed_tokens.weight"]
    with pytest.raises(ValueError, match="lm_head.weight"):
        engine.load_weights({**good, "lm_head.weight": embed + 1}, version=1)
    # A partial version would keep the other tensors' old values under the new version number.
    with pytest.raises(ValueError, match=r"missing weight 'model.layers.1.*\(11 missing in all\)"):
        engine.load_weights({k: v for k, v in good.items() if not k.startswith("model.layers.1.")}, version=1)
    for k, v in engine.model.state_dict().items():
        assert torch.equal(v, snapshot[k]), k
    assert engine.weight_version == 0


def test_engine_seed_gives_engines_their_own_samples(model_dir):
    """EngineConfig.seed is mixed into every request's seed, as the JAX engine's is: engines sharing a request draw
    different samples, and an engine reproduces its own."""
    sp = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5, ignore_eos=True)
    draws = [
        [c.token_ids for c in make_engine("hf", EngineConfig(model_path=model_dir, seed=seed)).generate(PROMPTS, 2, sp)]
        for seed in (0, 0, 1)
    ]
    assert draws[0] == draws[1] and draws[0] != draws[2]


def test_bad_requests_raise(engine, model_dir):
    with pytest.raises(ValueError, match="vocabulary"):
        engine.generate([[1, 500]], 1, SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], 1, SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    # values the JAX engine cannot hold (int32) or that would sample uniformly without a word: refused by name
    for bad, field in (
        (dict(top_k=2**31), "top_k"),
        (dict(stop_token_ids=(2**31,)), "stop_token_ids"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_k=1.5), "top_k must be an integer"),  # was cut to 1
        (dict(max_new_tokens=4.5), "max_new_tokens must be an integer"),  # crashed in generate, naming no field
    ):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="tpu_magic"):
        make_engine("tpu_magic", EngineConfig(model_path=model_dir))
    built = make_engine("hf", EngineConfig(model_path=model_dir, dtype="float32", max_batch=2, max_seq_len=16))
    assert isinstance(built, HFEngine) and isinstance(built, RolloutEngine)
    assert built.max_batch == 2 and built.model.dtype == torch.float32 and built.warmup() == {}
    with pytest.raises(ValueError, match=r"prompt 0 \(10 tokens\) \+ max_new_tokens \(7\) exceeds max_seq_len 16"):
        built.generate([[1] * 10], 1, SamplingParams(max_new_tokens=7))  # as the JAX engine refuses it


@pytest.mark.parametrize(
    "sampling",
    [
        dict(temperature=0.0, max_new_tokens=12),
        dict(temperature=1e-6, max_new_tokens=12),  # below GREEDY_BELOW: greedy too
        dict(temperature=0.0, max_new_tokens=12, ignore_eos=True),
        dict(temperature=0.0, max_new_tokens=12, stop_token_ids=(5, 17, 60)),
        dict(temperature=0.0, max_new_tokens=30, ignore_eos=True, stop_token_ids=(7,)),
        dict(temperature=0.0, max_new_tokens=1),
    ],
)
def test_both_backends_give_the_same_greedy_completions(model_dir, sampling):
    """A user switching rollout.backend gets the same contract: the same tokens, finish reasons, stop-token handling
    (the stop token kept, with its log-prob), versions and order, over more rows than the JAX engine's slots (its
    fan-out copies and slot reuse) and prompts of mixed lengths."""
    config = EngineConfig(
        model_path=model_dir, max_batch=8, max_seq_len=64, prefill_buckets=(16, 32), decode_buckets=(4, 8)
    )
    prompts = [*PROMPTS, [3] * 20]
    sp = SamplingParams(**sampling)
    hf, jax_ = (make_engine(backend, config).generate(prompts, 2, sp) for backend in ("hf", "jax"))
    fields = lambda c: (c.prompt_index, c.sample_index, c.token_ids, c.finish_reason, c.weight_version)  # noqa: E731
    assert [fields(c) for c in hf] == [fields(c) for c in jax_]
    for a, b in zip(hf, jax_):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


PEAK_MEMORY = """
import resource, sys
from rollout import EngineConfig, SamplingParams
from rollout.hf_backend import HFEngine

engine = HFEngine(EngineConfig(sys.argv[1], max_batch=4, max_seq_len=160))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
engine.generate([[5, 6, 7]], 4, SamplingParams(max_new_tokens=128, ignore_eos=True, top_k=20, top_p=0.9))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before)
"""


def test_generation_keeps_one_steps_scores_not_every_steps(tmp_path):
    """With output_scores every step's full-vocabulary scores were kept, then stacked and log-softmaxed: ~4 copies of
    rows x steps x vocabulary floats (1.3 TB for the recipe's 256 rows of 8,192 tokens over Qwen's vocabulary), an
    out-of-memory kill the memory plan did not foresee. In a fresh process: peak RSS only grows."""
    import subprocess
    import sys

    vocab = 151_936  # Qwen's
    path = make_tiny_hf_model(tmp_path / "m", "qwen3", vocab_size=vocab)
    run = [sys.executable, "-c", PEAK_MEMORY, str(path)]
    out = subprocess.run(run, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    grew, scores = int(out.stdout.split()[-1]), 4 * 128 * vocab * 4
    assert grew < scores / 2, f"peak memory grew by {grew / 2**20:.0f} MiB; all the scores are {scores / 2**20:.0f} MiB"


def test_top_k_zero_is_off_as_minus_one_is(engine):
    """SamplingParams: top_k <= 0 is off. Both 0 and -1 sample from the whole (tempered) distribution alike."""
    off = [SamplingParams(temperature=0.8, top_k=k, max_new_tokens=8, seed=4, ignore_eos=True) for k in (-1, 0)]
    a, b = (engine.generate(PROMPTS, 2, sp) for sp in off)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.logprobs for c in a] == [c.logprobs for c in b]
