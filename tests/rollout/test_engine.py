"""JaxEngine behaviour against HF transformers: greedy tokens and log-probs, batch-independent sampling, continuous
batching with slot reuse, stop ids, weight swaps and input errors."""

import os
import shutil

import jax
import numpy as np
import pytest
import torch
import transformers

from rollout import cost
from rollout.compiles import compile_count
from rollout.types import SamplingParams
from rollout.weights import load_safetensors_dir, params_from_named_arrays
from tests.conftest import make_tiny_hf_model
from tests.rollout.conftest import small_engine

EOS = 2


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf(tiny_qwen3_dir):
    return _hf(tiny_qwen3_dir)


def _hf_greedy(model, prompt, max_new, eos=EOS):
    """HF's greedy tokens, up to and including the first EOS; with eos=None, all max_new of them."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new,
            min_new_tokens=0 if eos is not None else max_new,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=0,
        )
    toks = out[0, len(prompt) :].tolist()
    return toks[: toks.index(EOS) + 1] if eos is not None and EOS in toks else toks


def _hf_logprobs(model, prompt, completion, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].double() / temperature
    return torch.log_softmax(logits, -1)[torch.arange(len(completion)), torch.tensor(completion)].numpy()


def _prompts(rng, count, lo=1, hi=30, vocab=128):
    return [[int(t) for t in rng.integers(3, vocab, int(rng.integers(lo, hi + 1)))] for _ in range(count)]


def test_greedy_matches_hf_generate(engine, hf):
    prompts = _prompts(np.random.default_rng(0), 3) + [[7]]  # a one-token prompt prefills nothing
    out = engine.generate(prompts, 2, SamplingParams(temperature=0.0, max_new_tokens=24))
    assert [(c.prompt_index, c.sample_index) for c in out] == [(i, j) for i in range(4) for j in range(2)]
    refs = [_hf_greedy(hf, p, 24) for p in prompts]
    for c in out:
        ref = refs[c.prompt_index]
        assert c.token_ids == ref
        assert c.finish_reason == ("stop" if ref[-1] == EOS else "length")
        # greedy log-probs are the model's own log-softmax at the chosen token
        np.testing.assert_allclose(c.logprobs, _hf_logprobs(hf, prompts[c.prompt_index], c.token_ids), atol=1e-4)
        assert c.weight_version == 0


def test_sampled_logprobs_are_hf_logprobs_of_the_tempered_distribution(engine, hf):
    prompts = _prompts(np.random.default_rng(1), 3)
    out = engine.generate(prompts, 3, SamplingParams(temperature=0.7, max_new_tokens=20, seed=3))
    assert len({tuple(c.token_ids) for c in out}) > 3  # samples of one prompt differ
    for c in out:
        ref = _hf_logprobs(hf, prompts[c.prompt_index], c.token_ids, temperature=0.7)
        np.testing.assert_allclose(c.logprobs, ref, atol=1e-4)


def test_same_seed_same_tokens_whatever_the_batch(engine):
    rng = np.random.default_rng(2)
    p, others = _prompts(rng, 1)[0], _prompts(rng, 6)
    # many stop ids: rows end at scattered steps, so later samples of a prompt join while a sibling still runs and
    # take their prompt KV from that sibling's slot (the scheduler's copy-from-holder path)
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=16, seed=11, stop_token_ids=tuple(range(3, 15)))
    alone = engine.generate([p], 3, sp)
    crowded = engine.generate([p] + others, 3, sp)  # 21 samples through 8 slots, other buckets
    assert [c.token_ids for c in alone] == [c.token_ids for c in crowded[:3]]
    assert {c.finish_reason for c in crowded} == {"stop", "length"}
    np.testing.assert_allclose(
        sum((c.logprobs for c in alone), []), sum((c.logprobs for c in crowded[:3]), []), atol=1e-6
    )
    reseeded = engine.generate([p], 3, SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=16, seed=12))
    assert [c.token_ids for c in reseeded] != [c.token_ids for c in alone]
    # EngineConfig.seed is mixed in: a second engine (same compiled programs) with another seed samples differently
    other_engine = small_engine(engine.cfg.model_path, seed=1)
    assert [c.token_ids for c in other_engine.generate([p], 3, sp)] != [c.token_ids for c in alone]


def test_continuous_batching_reuses_slots_and_matches_solo_runs(engine):
    rng = np.random.default_rng(3)
    prompts = _prompts(rng, 7, hi=32)
    sp = SamplingParams(temperature=0.0, max_new_tokens=30)
    together = engine.generate(prompts, 3, sp)  # 21 samples, 8 slots
    assert len(together) == 21
    st = engine.stats()
    assert st["gen_tokens"] == sum(len(c.token_ids) for c in together)
    assert 0.0 <= st["pad_frac"] < 1.0 and st["compiles"] == 0
    # every slot run is a prompt position prefilled, a token generated, or padding
    assert st["padded_slots"] - st["pad_slots"] == st["prefill_tokens"] + st["gen_tokens"]
    for i, p in enumerate(prompts):
        solo = engine.generate([p], 1, sp)[0]
        assert all(c.token_ids == solo.token_ids for c in together[3 * i : 3 * i + 3])


def test_stop_token_ids_and_max_new_tokens(engine):
    prompt = [5, 9, 17, 33]
    free = engine.generate([prompt], 1, SamplingParams(temperature=0.0, max_new_tokens=12))[0]
    assert len(free.token_ids) <= 12
    stop_at = max(i for i, t in enumerate(free.token_ids) if t not in free.token_ids[:i])  # a first occurrence
    stopped = engine.generate(
        [prompt], 1, SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(free.token_ids[stop_at],))
    )[0]
    assert stopped.token_ids == free.token_ids[: stop_at + 1] and stopped.finish_reason == "stop"
    short = engine.generate([prompt], 1, SamplingParams(temperature=0.0, max_new_tokens=3))[0]
    assert short.token_ids == free.token_ids[:3] and short.finish_reason == (
        "stop" if EOS in short.token_ids else "length"
    )


def test_load_weights_swaps_model_without_compiling(tmp_path, engine, hf, tiny_qwen3_dir):
    other_dir = make_tiny_hf_model(tmp_path / "other", "qwen3", tie=True, seed=7)
    prompt = [4, 8, 15, 16, 23, 42]
    sp = SamplingParams(temperature=0.0, max_new_tokens=10)
    before = compile_count()
    engine.load_weights(load_safetensors_dir(str(other_dir)), version=5)
    c = engine.generate([prompt], 1, sp)[0]
    assert c.weight_version == 5 and c.token_ids == _hf_greedy(_hf(other_dir), prompt, 10)
    # the tiny models' greedy tokens barely depend on their weights (they repeat the prompt's last one): the
    # log-probs are the new model's
    np.testing.assert_allclose(c.logprobs, _hf_logprobs(_hf(other_dir), prompt, c.token_ids), atol=1e-4)
    # on CPU the tied head is multiplied from a copy in [D, V] (rollout.weight_table.copies_tied_head), made from the
    # new embedding, not the old one
    np.testing.assert_array_equal(np.asarray(engine.params.lm_head), np.asarray(engine.params.embed).T)
    # a bad dict raises naming the tensor and leaves the loaded weights in place
    bad = load_safetensors_dir(str(other_dir))
    bad["model.norm.weight"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="model.norm.weight"):
        engine.load_weights(bad, version=6)
    # as does a tensor that is not floats, which would otherwise be cast into weights (or a list, not an array)
    norm = load_safetensors_dir(str(other_dir))["model.norm.weight"]
    for wrong, what in (
        (norm.astype(np.int32), "dtype int32"),
        (norm.astype(bool), "dtype bool"),
        (norm.tolist(), "a list"),
    ):
        with pytest.raises(
            ValueError, match=f"'model.norm.weight' is {what}, expected a numpy array of float16/32/64 or bfloat16"
        ):
            engine.load_weights(load_safetensors_dir(str(other_dir)) | {"model.norm.weight": wrong}, version=6)
    # so does an untied trainer's head pushed to this tied model: the engine would compute logits from the embedding
    embed = load_safetensors_dir(str(other_dir))["model.embed_tokens.weight"]
    for head in (embed + 1, embed[:-1]):
        with pytest.raises(ValueError, match="'lm_head.weight' (differs from|has another shape).*tie_word_embeddings"):
            engine.load_weights(load_safetensors_dir(str(other_dir)) | {"lm_head.weight": head}, version=6)
    engine.load_weights(load_safetensors_dir(str(other_dir)) | {"lm_head.weight": embed.copy()}, version=5)
    assert engine.generate([prompt], 1, sp)[0] == c
    assert compile_count() == before
    engine.load_weights(load_safetensors_dir(str(tiny_qwen3_dir)), version=0)  # restore for other tests
    assert engine.generate([prompt], 1, sp)[0].token_ids == _hf_greedy(hf, prompt, 10)


def test_a_failed_transfer_leaves_no_weights_rather_than_the_old_versions_number(tiny_qwen3_dir, monkeypatch):
    """The old weights go before the new ones arrive (two copies would not fit a chip's plan). When the transfer then
    fails (out of device memory), the engine holds no weights: a generation must say so, not fail inside the model
    or carry the old version on samples of none."""
    eng = small_engine(tiny_qwen3_dir)
    named = load_safetensors_dir(str(tiny_qwen3_dir))

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while trying to allocate")

    with monkeypatch.context() as patched:
        patched.setattr(jax, "device_put", out_of_memory)
        with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
            eng.load_weights(named, version=4)
    sp = SamplingParams(temperature=0.0, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"no weights loaded: .*the last load_weights\(\) failed"):
        eng.generate([[5, 6, 7]], 1, sp)
    eng.load_weights(named, version=4)
    assert eng.generate([[5, 6, 7]], 1, sp)[0].weight_version == 4


def test_weights_loaded_between_dispatches_apply_in_flight(tmp_path, tiny_qwen3_dir, hf):
    """PipelineRL's in-flight update: rows running across a weight load record both versions; the tokens before it
    are the old policy's, rows admitted after it are entirely the new policy's (HF's greedy tokens on those weights)."""
    other_dir = make_tiny_hf_model(tmp_path / "other", "qwen3", tie=True, seed=7)
    eng = small_engine(tiny_qwen3_dir)  # 8 slots, 4 steps per dispatch
    eng.warmup()
    prompts = _prompts(np.random.default_rng(5), 3, lo=4, hi=12)
    sp = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    calls = []

    def swap_after_first_dispatch():
        calls.append(len(calls))
        if len(calls) == 2:
            eng.load_weights(load_safetensors_dir(str(other_dir)), version=1)

    before = compile_count()
    out = eng.generate(prompts, 4, sp, between_dispatches=swap_after_first_dispatch)  # 12 rows, 8 slots
    assert compile_count() == before and len(calls) > 2
    spanning = [c for c in out if c.weight_version == 0]
    late = [c for c in out if c.weight_version == 1]
    assert len(spanning) == 8 and len(late) == 4  # the first 8 rows were running when the weights changed
    assert all(c.last_weight_version == 1 for c in out)
    for c in spanning:
        prompt = prompts[c.prompt_index]
        assert c.token_ids[:4] == _hf_greedy(hf, prompt, 4, eos=None)
        np.testing.assert_allclose(c.logprobs[:4], _hf_logprobs(hf, prompt, c.token_ids[:4]), atol=1e-4)
    new = _hf(other_dir)
    for c in late:  # log-probs too: the tiny models' greedy tokens barely depend on their weights
        assert c.token_ids == _hf_greedy(new, prompts[c.prompt_index], 12, eos=None)
        np.testing.assert_allclose(c.logprobs, _hf_logprobs(new, prompts[c.prompt_index], c.token_ids), atol=1e-4)


def test_a_sample_that_copies_a_running_siblings_prompt_kv_records_the_version_that_computed_it(tiny_qwen3_dir):
    """Two slots, three samples of one prompt: sample 0 stops at its first token, so sample 2 takes its slot while
    sample 1 still runs, after version 7 has been loaded, and copies sample 1's prompt KV, which version 3 computed.
    Its weight_version (where staleness is counted from) is 3, not 7; its last token is 7's."""
    eng = small_engine(tiny_qwen3_dir, max_batch=2, decode_buckets=(2,), steps_per_dispatch=1)
    named = load_safetensors_dir(str(tiny_qwen3_dir))
    eng.load_weights(named, version=3)
    calls = []

    def load_version_7_before_the_second_dispatch():
        calls.append(len(calls))
        if len(calls) == 2:
            eng.load_weights(named, version=7)

    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=list(range(0, 128, 9)), seed=0)
    out = eng.generate([[5, 9, 17, 33, 40]], 3, sampling, between_dispatches=load_version_7_before_the_second_dispatch)
    assert len(out[0].token_ids) == 1 < len(out[1].token_ids)  # the scenario: sample 1 ran on when 2 was admitted
    assert (out[1].weight_version, out[1].last_weight_version) == (3, 7)
    assert (out[2].weight_version, out[2].last_weight_version) == (3, 7)


def test_engine_from_config_only_dir_waits_for_weights(tmp_path, hf, tiny_qwen3_dir):
    cfg_only = tmp_path / "cfg_only"
    cfg_only.mkdir()
    shutil.copy(os.path.join(tiny_qwen3_dir, "config.json"), cfg_only / "config.json")
    eng = small_engine(cfg_only)  # same config as the warmed `engine`: shares its compiled programs
    with pytest.raises(ValueError, match="no weights loaded"):
        eng.generate([[1, 2, 3]], 1, SamplingParams(max_new_tokens=4))
    eng.load_weights(load_safetensors_dir(str(tiny_qwen3_dir)), version=3)
    out = eng.generate([[5, 6, 7]], 2, SamplingParams(temperature=0.0, max_new_tokens=8))
    assert [c.weight_version for c in out] == [3, 3]
    assert out[0].token_ids == _hf_greedy(hf, [5, 6, 7], 8)


def test_bad_requests_name_the_limit(engine):
    sp = SamplingParams(max_new_tokens=8)
    with pytest.raises(ValueError, match="largest prefill bucket 32"):
        engine.generate([[3] * 33], 1, sp)
    with pytest.raises(ValueError, match="max_seq_len 64"):
        engine.generate([[3] * 30], 1, SamplingParams(max_new_tokens=40))
    with pytest.raises(ValueError, match=r"n \(samples per prompt\) must be >= 1, got 0"):
        engine.generate([[3]], 0, sp)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[3], []], 1, sp)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.generate([[3, 500]], 1, sp)
    with pytest.raises(ValueError, match="dtype"):
        small_engine(os.devnull, dtype="float16")
    with pytest.raises(ValueError, match="no-such-org/no-such-model"):  # not a dir, and the hub is offline
        small_engine("no-such-org/no-such-model")


def test_bfloat16_engine_logprobs_track_hf_fp32(tiny_qwen3_dir, hf):
    eng = small_engine(tiny_qwen3_dir, dtype="bfloat16", prefill_buckets=(32,), decode_buckets=(8,))
    prompts = _prompts(np.random.default_rng(5), 2)
    out = eng.generate(prompts, 2, SamplingParams(temperature=1.0, max_new_tokens=12, seed=1))
    for c in out:
        ref = _hf_logprobs(hf, prompts[c.prompt_index], c.token_ids)
        # bf16 weights / activations, fp32 logits: log-probs within bf16 rounding of the fp32 model's
        assert np.max(np.abs(np.array(c.logprobs) - ref)) < 0.05


def test_release_frees_device_memory_and_resume_recompiles_nothing(tiny_qwen3_dir):
    """Colocation: a released engine holds no device buffers; it comes back with the same weights and programs."""
    eng = small_engine(tiny_qwen3_dir)
    eng.warmup()
    prompts = _prompts(np.random.default_rng(9), 3)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    want = eng.generate(prompts, 2, greedy)
    held = eng.device_bytes()
    cache_bytes = sum(a.nbytes for a in jax.tree.leaves(eng.cache))
    before = compile_count()
    eng.release()
    assert held - eng.device_bytes() >= cache_bytes  # the cache and the weights are gone from the devices
    eng.load_weights(load_safetensors_dir(str(tiny_qwen3_dir)), version=1)  # while released: kept on the host
    assert held - eng.device_bytes() >= cache_bytes
    got = eng.generate(prompts, 2, greedy)  # resumes by itself
    assert [c.token_ids for c in got] == [c.token_ids for c in want] and got[0].weight_version == 1
    assert compile_count() == before


def test_a_released_engine_warms_up_again(tiny_qwen3_dir):
    """Colocation releases an engine while the trainer runs; a warmup (an engine rebuilt in its place) brings it
    back rather than running its programs on no cache."""
    eng = small_engine(tiny_qwen3_dir)
    eng.release()
    assert {f"decode/{b}" for b in eng.decode_buckets} <= set(eng.warmup())
    assert eng.generate([[5, 6, 7]], 1, SamplingParams(temperature=0.0, max_new_tokens=4))[0].token_ids


def test_loaded_weights_never_alias_the_arrays_they_came_from(tiny_qwen3_dir):
    """weight_sync's shm receiver hands out views of a buffer that the sender's next versions overwrite, and on CPU
    device_put may keep a host array as it is: the engine holds its own copy, so overwriting the arrays it loaded
    changes none of its tokens."""
    prompts = _prompts(np.random.default_rng(11), 3)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    eng = small_engine(tiny_qwen3_dir)
    want = [c.token_ids for c in eng.generate(prompts, 1, greedy)]
    named = {k: np.array(v) for k, v in load_safetensors_dir(str(tiny_qwen3_dir)).items()}
    eng.load_weights(named, version=1)
    for arr in named.values():  # the next version lands in the same memory
        arr[...] = 0
    assert [c.token_ids for c in eng.generate(prompts, 1, greedy)] == want


@pytest.mark.parametrize("mode", ["chunked", "paged"])
def test_decode_attention_on_a_cache_shorter_than_a_chunk(tiny_qwen3_dir, mode):
    """A 64-position cache is one page and shorter than a decode chunk (128): `chunked` and `paged` read it in one
    chunk of its own length (they failed to compile) and generate what `whole` does."""
    prompts = _prompts(np.random.default_rng(12), 3)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    want = small_engine(tiny_qwen3_dir, decode_attention="whole").generate(prompts, 2, sampling)
    got = small_engine(tiny_qwen3_dir, decode_attention=mode).generate(prompts, 2, sampling)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5, rtol=0)


def test_decode_attention_paged_chunked_and_whole_generate_the_same(tiny_qwen3_dir, hf):
    """`decode_attention` picks how a 320-position cache is held and read (CPU's rule: in 64-position pages; TPU's:
    one buffer by chunks; a GPU's: whole): the same greedy tokens, those of HF, and log-probs equal to float
    rounding, from prompts long enough that decode walks three chunks and reads the cache's last page. Two samples
    a prompt: the second's prompt KV is the fan-out copy, page by page."""
    prompts = _prompts(np.random.default_rng(5), 3, lo=230, hi=250)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    outs = {}
    for mode, pages in (("auto", 5), ("chunked", 1), ("whole", 1)):
        eng = small_engine(tiny_qwen3_dir, max_seq_len=320, prefill_buckets=(256,), decode_attention=mode)
        assert eng.whole_cache == (mode == "whole") and len(eng.cache.page_lens) == pages
        outs[mode] = eng.generate(prompts, 2, sampling)
    greedy = [_hf_greedy(hf, p, 40, eos=None) for p in prompts]
    for paged, chunked, whole in zip(outs["auto"], outs["chunked"], outs["whole"]):
        assert paged.prompt_index == chunked.prompt_index == whole.prompt_index
        assert paged.token_ids == chunked.token_ids == whole.token_ids == greedy[whole.prompt_index]
        for c in (paged, chunked):
            np.testing.assert_allclose(c.logprobs, whole.logprobs, atol=1e-5, rtol=0)


def test_every_sample_of_a_prompt_at_the_length_limit_matches_its_solo_run(tiny_qwen3_dir):
    """Samples 1.. of a prompt get sample 0's prompt KV by copy: for a prompt at the length limit too."""
    engine = small_engine(tiny_qwen3_dir)  # prefill_buckets (16, 32): prompts of up to 32 tokens
    longest = [3 + (7 * i) % 120 for i in range(engine.prefill_buckets[-1])]
    sp = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    solo = engine.generate([longest], 1, sp)[0]
    group = engine.generate([longest], 4, sp)  # samples 1..3 get sample 0's prompt KV by copy
    assert [c.token_ids for c in group] == [solo.token_ids] * 4
    assert all(c.logprobs == solo.logprobs for c in group)


def test_prefill_tokens_are_each_prompts_all_but_last_token(tiny_qwen3_dir):
    """In one admission wave, each prompt's prefill counts once (fan-out copies are free), all but its last token."""
    engine = small_engine(tiny_qwen3_dir)
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(3, 128, int(rng.integers(2, 30)))] for _ in range(2)]
    # 6 samples in 8 slots: one admission wave
    engine.generate(prompts, 3, SamplingParams(temperature=0.0, max_new_tokens=4))
    st = engine.stats()
    assert st["prefill_tokens"] == sum(len(p) - 1 for p in prompts)  # once per prompt, fan-out copies are free
    assert st["prompt_tokens"] == 3 * sum(len(p) for p in prompts)


def test_weights_loaded_while_released_are_the_ones_it_resumes_with(tmp_path, tiny_qwen3_dir, hf):
    """Colocation may load the trainer's new weights while the engine is released: it must resume with those, not
    with the host copy it kept at release (the version number alone would say the new policy ran). The tiny models'
    greedy tokens barely depend on the weights (they repeat the prompt's last token), so the log-probs tell."""
    other_dir = make_tiny_hf_model(tmp_path / "other", "qwen3", tie=True, seed=7)
    prompt = [4, 8, 15, 16, 23, 42]
    sp = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    eng = small_engine(tiny_qwen3_dir)
    eng.release()
    eng.load_weights(load_safetensors_dir(str(other_dir)), version=1)
    c = eng.generate([prompt], 1, sp)[0]
    assert c.weight_version == 1
    want, old = (_hf_logprobs(model, prompt, c.token_ids) for model in (_hf(other_dir), hf))
    assert np.max(np.abs(want - old)) > 1e-2  # the two models tell apart
    np.testing.assert_allclose(c.logprobs, want, atol=1e-4)


def test_stats_bytes_flops_and_padding_count_what_the_programs_ran(tiny_qwen3_dir):
    """The bench's MBU / MFU / pad figures come from stats(): checked from first principles on a run whose programs
    are known. One 62-token prompt, 4 samples, 8 greedy tokens, 4 steps a dispatch, a 192-position cache in
    64-position pages: one prefill of bucket 64 (61 tokens), 3 fan-out copies run as copy bucket 4 (one padding pair)
    of the 64 positions a prompt can hold, then two dispatches of decode bucket 4 whose rows start at positions 61 and
    65: by each dispatch's last step they reach 65 and 69, so both read two pages (128 positions) a row a step."""
    eng = small_engine(tiny_qwen3_dir, max_seq_len=192, prefill_buckets=(64,))
    mc = eng.model_cfg
    assert eng.page_len == 64 and len(eng.cache.page_lens) == 3
    prompt = [3 + (5 * i) % 120 for i in range(62)]
    out = eng.generate([prompt], 4, SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))
    assert [len(c.token_ids) for c in out] == [8] * 4
    st = eng.stats()
    assert (st["dispatches"], st["copy_rows"], st["prefill_tokens"], st["gen_tokens"]) == (2, 4, 61, 32)
    # slots run: the prefill bucket's 64 positions and 2 dispatches x 4 steps x 4 rows; all but 61 + 32 are padding
    assert (st["padded_slots"], st["pad_slots"]) == (64 + 2 * 4 * 4, 64 + 2 * 4 * 4 - 61 - 32)

    host = params_from_named_arrays(mc, load_safetensors_dir(str(tiny_qwen3_dir)))
    weights = sum(a.nbytes for a in jax.tree.leaves(host))
    per_position = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 4  # K and V, every layer, fp32 cache
    prefill = weights + 64 * per_position  # the weights read, the bucket's K/V written
    copies = 2 * 4 * 64 * per_position  # 4 rows of 64 positions, read and written
    decode = 2 * 4 * (weights + 4 * 128 * per_position)  # 2 dispatches x 4 steps: the weights, 4 rows x 2 pages
    assert st["bytes"] == prefill + copies + decode

    # FLOPs: the prefill of 61 tokens once, then each sample's 8 decode tokens over a 62-token prompt
    body = mc.num_layers * sum(a.size for a in jax.tree.leaves(host.layers[0]) if a.ndim == 2)
    head, attn = mc.vocab_size * mc.hidden_size, 4 * mc.num_layers * mc.num_heads * mc.head_dim
    want = 2 * body * 61 + attn * 61 * 62 / 2 + 4 * (2 * (body + head) * 8 + attn * sum(62 + j for j in range(8)))
    assert st["flops"] == pytest.approx(want, rel=1e-12)
    assert st["flops"] == pytest.approx(cost.generate_flops(mc, [61], [(62, 8)] * 4), rel=1e-12)


def test_a_sequence_may_fill_the_cache_to_max_seq_len(engine, hf):
    """prompt + max_new_tokens == max_seq_len is allowed (check_requests), so every one of the max_new_tokens comes
    back: the last lands on the cache's last position."""
    prompt = [3 + (7 * i) % 120 for i in range(engine.prefill_buckets[-1])]
    max_new = engine.cfg.max_seq_len - len(prompt)
    c = engine.generate([prompt], 1, SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True))[0]
    assert (len(c.token_ids), c.finish_reason) == (max_new, "length")
    assert c.token_ids == _hf_greedy(hf, prompt, max_new, eos=None)


def test_a_stop_token_drawn_as_the_last_allowed_token_finishes_with_stop(engine):
    """When the max_new_tokens-th token is a stop id, the row ended on the stop id: finish_reason 'stop', as the HF
    backend reports it (its last token is a stop id), not 'length'."""
    prompt = [5, 9, 17, 33]
    free = engine.generate([prompt], 1, SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True))[0]
    k = max(i for i, t in enumerate(free.token_ids) if t not in free.token_ids[:i])  # a first occurrence
    sp = SamplingParams(temperature=0.0, max_new_tokens=k + 1, stop_token_ids=(free.token_ids[k],), ignore_eos=True)
    c = engine.generate([prompt], 1, sp)[0]
    assert c.token_ids == free.token_ids[: k + 1]
    assert c.finish_reason == "stop"


def test_load_weights_names_a_missing_or_unknown_tensor_and_keeps_the_loaded_ones(engine, tiny_qwen3_dir):
    """A weight dict from another architecture (an extra layer, a renamed tensor) must be refused by name, not
    loaded in part: an unknown tensor would be dropped without a word, a missing one fail somewhere inside."""
    named = load_safetensors_dir(str(tiny_qwen3_dir))
    extra = named | {"model.layers.2.mlp.up_proj.weight": named["model.layers.1.mlp.up_proj.weight"]}
    with pytest.raises(
        ValueError, match=r"unexpected weight 'model.layers.2.mlp.up_proj.weight' for a qwen3 model with 2 layers"
    ):
        engine.load_weights(extra, version=9)
    gone = {k: v for k, v in named.items() if not k.startswith("model.layers.1.self_attn.")}
    with pytest.raises(
        ValueError, match=r"missing weight 'model.layers.1.self_attn.q_proj.weight' \(6 missing in all\)"
    ):
        engine.load_weights(gone, version=9)
    c = engine.generate([[5, 6, 7]], 1, SamplingParams(temperature=0.0, max_new_tokens=4))[0]
    assert c.weight_version == 0
