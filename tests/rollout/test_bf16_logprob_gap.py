"""The engine's log-probs of its own samples against the trainer's scoring of the same tokens, in bf16 and in fp32.

This is the train-inference mismatch that truncated importance sampling corrects (docs/design.md §4.6): the JAX
engine samples completions with their log-probs, `trainer.Trainer.compute_logprobs` scores the same tokens with HF
transformers, and the two must agree. bf16 is the hard case: a single rounding that goes the other way upstream
spreads through every later layer, and on a model whose logits have a realistic scale a final hidden state off by
an ulp moves log-probs by ~1e-2 nats (before rollout.numerics the mean gap here was 1.3-1.6e-2, the max 6-13e-2).
The model is a small random Qwen3 with an untied LM head drawn at std 0.28, so that its logits have std ≈ 3 and a
largest |logit| ≈ 13, as trained LMs do (default init gives |logit| < 1, where every gap looks small).

Sequences are 16 + 48 = 64 tokens, a multiple of 16: torch's CPU flash attention takes the exp of a row's last
(length mod 16) keys from an exact exp rather than its vectorised approximation, which the engine cannot know.

The last tests check rollout.numerics' pieces on their own, against torch's kernels and exp's definition, at widths
and inputs that the tiny models do not reach.
"""

import platform

import jax
import numpy as np
import pytest
import torch
import transformers

from rollout.types import SamplingParams
from tests.conftest import make_tiny_hf_model
from tests.rollout.conftest import small_engine
from tests.rollout.test_sampler import expected_distribution

PROMPT_LEN, NEW_TOKENS, PROMPTS, SAMPLES = 16, 48, 4, 2
HEAD_STD = 0.28
# The engine reproduces torch's bf16 kernels as they run on an AVX-512 CPU, where its matmuls are oneDNN's. Without
# AVX-512, torch's bf16 matmuls and flash attention fall back to its own loops, whose fp32 accumulation order differs
# from XLA's in about one output element in 10^4; spread through the layers that left 1.3e-3 (T=1) and 2.1e-3
# (T=0.7) on a Zen 3 (docs/benchmarks.md, Numerics). Unmatched numerics give 1.4-1.6e-2 on either.
GAP_BOUND = 2e-3 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 3e-3


@pytest.fixture(scope="module")
def realistic_bf16_dir(tmp_path_factory):
    """A bf16 checkpoint of a random Qwen3 (vocab 512, hidden 128, 2 layers) whose logits have a realistic scale."""
    path = make_tiny_hf_model(
        tmp_path_factory.mktemp("q3_fp32"),
        "qwen3",
        tie=False,
        seed=1,
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        max_position_embeddings=2048,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, HEAD_STD)
    out = tmp_path_factory.mktemp("q3_bf16")
    model.to(torch.bfloat16).save_pretrained(out)
    return out


def _sample_and_score(model_dir, dtype: str, temperature: float, seed: int = 0, new_tokens: int = NEW_TOKENS):
    """(engine log-probs, trainer log-probs) [PROMPTS × SAMPLES, new_tokens] of the tokens of sampled completions."""
    from trainer import Trainer, TrainerConfig

    engine = small_engine(
        model_dir,
        dtype=dtype,
        max_seq_len=PROMPT_LEN + new_tokens + 16,
        prefill_buckets=(16,),
        decode_buckets=(8,),
        steps_per_dispatch=8,
    )
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(3, 512, PROMPT_LEN)] for _ in range(PROMPTS)]
    sampling = SamplingParams(temperature=temperature, max_new_tokens=new_tokens, ignore_eos=True, seed=seed)
    completions = engine.generate(prompts, SAMPLES, sampling)
    assert all(len(c.token_ids) == new_tokens for c in completions)
    trainer = Trainer(TrainerConfig(model_path=str(model_dir), dtype=dtype, temperature=temperature))
    responses = [c.token_ids for c in completions]
    theirs = trainer.compute_logprobs([prompts[c.prompt_index] for c in completions], responses)
    return np.array([c.logprobs for c in completions], np.float64), np.array(theirs, np.float64)


def test_the_model_has_realistic_logits(realistic_bf16_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(realistic_bf16_dir, dtype=torch.float32).eval()
    ids = torch.tensor(np.random.default_rng(0).integers(3, 512, (2, 64)))
    with torch.no_grad():
        logits = model(ids).logits
    print(f"logits: std {logits.std():.2f}, max |logit| {logits.abs().max():.2f}")
    assert 2.0 < float(logits.std()) < 5.0
    assert 9.0 < float(logits.abs().max()) < 20.0


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_bf16_engine_logprobs_match_the_trainer(realistic_bf16_dir, temperature):
    ours, theirs = _sample_and_score(realistic_bf16_dir, "bfloat16", temperature)
    gap = np.abs(ours - theirs)
    print(f"bf16 T={temperature}: mean |engine - trainer| {gap.mean():.2e}, max {gap.max():.2e} over {gap.size}")
    assert gap.mean() <= GAP_BOUND


def test_the_bf16_gap_stays_small_past_torchs_512_key_blocks(realistic_bf16_dir):
    """Responses of 1,024 tokens: past 512 keys torch's flash kernel softmaxes 512 keys at a time against the running
    max, which the engine's decode follows (rollout/model.py). Against the row's overall max, the mean gap past
    position 528 was 6.8-9.6e-3 (windows of 64 positions), against ~6e-4 before it. It still grows with the length:
    each rare rounding the other way spreads to every later token (docs/design.md §3.13)."""
    ours, theirs = _sample_and_score(realistic_bf16_dir, "bfloat16", 1.0, new_tokens=1024)
    gap = np.abs(ours - theirs)
    windows = [f"{PROMPT_LEN + lo}: {gap[:, lo : lo + 128].mean():.1e}" for lo in range(0, 1024, 128)]
    print(f"bf16, responses of 1,024 tokens: mean {gap.mean():.2e}; from position {', '.join(windows)}")
    assert gap[:, 512:].mean() <= 2 * GAP_BOUND  # 1.7e-3 on a Zen 4, where the blocks ignored left 8.7e-3


def test_fp32_engine_logprobs_match_the_trainer(realistic_bf16_dir):
    """The control: the same bf16 checkpoint, both sides in fp32."""
    ours, theirs = _sample_and_score(realistic_bf16_dir, "float32", 1.0)
    gap = np.abs(ours - theirs)
    print(f"fp32: mean |engine - trainer| {gap.mean():.2e}, max {gap.max():.2e} over {gap.size}")
    assert gap.max() <= 1e-4


def test_with_top_k_and_top_p_the_engine_reports_the_truncated_distribution_the_trainer_the_full_one(
    realistic_bf16_dir,
):
    """The convention (rollout/sampler.py, docs/design.md §5.8): the engine's log-prob is the behaviour policy q
    (renormalised over the kept set), the trainer's the full tempered policy pi. So TIS's ratio pi/q is <= 1 on every
    sampled token, and log q - log pi is exactly -log(the kept set's mass under pi) at that position."""
    from trainer import Trainer, TrainerConfig

    temperature, top_k, top_p = 0.8, 20, 0.9
    engine = small_engine(realistic_bf16_dir, dtype="float32", max_seq_len=80, prefill_buckets=(16,))
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(3, 512, PROMPT_LEN)] for _ in range(PROMPTS)]
    sampling = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=NEW_TOKENS, ignore_eos=True, seed=3
    )
    completions = engine.generate(prompts, SAMPLES, sampling)
    trainer = Trainer(TrainerConfig(model_path=str(realistic_bf16_dir), temperature=temperature))
    responses = [c.token_ids for c in completions]
    theirs = trainer.compute_logprobs([prompts[c.prompt_index] for c in completions], responses)
    ours = [np.asarray(c.logprobs, np.float64) for c in completions]
    assert all(np.all(t <= o + 1e-5) for o, t in zip(ours, theirs))  # pi <= q on every kept token
    model = transformers.AutoModelForCausalLM.from_pretrained(realistic_bf16_dir, dtype=torch.float32).eval()
    c = completions[0]
    with torch.no_grad():
        ids = torch.tensor([prompts[c.prompt_index] + c.token_ids])
        z = (model(ids).logits[0, PROMPT_LEN - 1 : -1] / temperature).numpy()
    kept = np.stack([expected_distribution(row, 1.0, top_k, top_p) > 0 for row in z])  # from the definitions
    log_pi = z - np.logaddexp.reduce(z, axis=-1, keepdims=True)
    kept_mass = np.logaddexp.reduce(np.where(kept, log_pi, -np.inf), axis=-1)
    np.testing.assert_allclose(ours[0] - theirs[0], -kept_mass, atol=1e-4)


@pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64") or jax.default_backend() != "cpu",
    reason="torch's x86 CPU kernels are reproduced on an x86-64 CPU only",
)
def test_sums_and_rms_norm_scales_are_torchs_bit_for_bit():
    """rollout.numerics sums a row in the order of torch's CPU cascade sum, whatever its length: a scalar tail, vectors
    left over after rows of 4, 16-row blocks folded into levels 2 and 3; and RMSNorm's scale over bf16 values is
    torch's rsqrt(mean(x²) + eps), bit for bit. Short rows (the tiny models' widths) reach few of those branches."""
    from rollout.numerics import inv_rms, matches_torch_cpu, torch_cpu_sum

    assert matches_torch_cpu("bfloat16") and not matches_torch_cpu("float32")  # fp32 runs plain XLA math
    rng = np.random.default_rng(0)
    for n in (8, 13, 40, 100, 520, 9000, 70003, 131072 + 60):  # from one vector (shorter rows: plain sums)
        x = rng.normal(size=(4, n)).astype(np.float32)
        ours = np.asarray(jax.jit(torch_cpu_sum)(x))[:, 0]
        np.testing.assert_array_equal(ours, torch.from_numpy(x).sum(-1).numpy(), err_msg=f"row length {n}")
    scale = jax.jit(inv_rms, static_argnums=(1, 2))
    for n in (32, 64, 100, 1000, 4096):
        for std in (1.0, 1e-3):  # at 1e-3, eps is a tenth of the mean square
            xb = torch.from_numpy(rng.normal(0, std, (16, n)).astype(np.float32)).bfloat16().float()
            want = torch.rsqrt(xb.pow(2).mean(-1, keepdim=True) + 1e-7).numpy()
            np.testing.assert_array_equal(np.asarray(scale(xb.numpy(), 1e-7, "bfloat16")), want)
            np.testing.assert_allclose(np.asarray(scale(xb.numpy(), 1e-7, "float32")), want, rtol=1e-6)


def test_the_fast_exp_is_exp_within_its_approximation():
    """torch_cpu_fast_exp is torch's fexp_u20: exp to a relative ~1e-4 over fp32's range, 0 below it (masked scores
    at -1e30 weigh nothing), inf above it."""
    from rollout.numerics import torch_cpu_fast_exp

    x = np.concatenate([np.linspace(-87.0, 88.0, 20001), np.linspace(-1.0, 1.0, 4001)]).astype(np.float32)
    got = np.asarray(jax.jit(torch_cpu_fast_exp)(x)).astype(np.float64)
    np.testing.assert_allclose(got, np.exp(x.astype(np.float64)), rtol=2e-4, atol=0)
    edges = np.asarray(jax.jit(torch_cpu_fast_exp)(np.array([-1e30, -104.0, 89.0, 1e30], np.float32)))
    assert list(edges) == [0.0, 0.0, np.inf, np.inf]


@pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64") or jax.default_backend() != "cpu",
    reason="torch's x86 CPU kernels are reproduced on an x86-64 CPU only",
)
@pytest.mark.parametrize("page_len, max_len", [(64, 1152), (1024, 2048)])
def test_paged_decode_attention_is_torchs_flash_kernel_bit_for_bit(page_len, max_len):
    """Decode attention over a paged cache against torch's CPU flash kernel (the trainer's attention) on the last
    query of causal bf16 rows of 96 to 1,104 keys whose largest score lies in the row's last 512-key block. The kernel
    softmaxes 512 keys at a time against the running max, so the weights of the blocks before the max's are rounded
    at another scale than against the row's max: computed that way, 19 % of the outputs at 528 keys were an ulp off,
    and the log-prob gap past 512 positions was ~9e-3 nats. What may remain is the P.V sum's order (pages against
    torch's matmul), which moves an output that nearly cancels by an ulp now and then. Pages of 1,024 positions
    (a long cache's) hold two blocks."""
    import jax.numpy as jnp

    from rollout.kv_cache import page_starts
    from rollout.model import _decode_attention

    heads, kv_heads, dim = 4, 2, 32
    rng = np.random.default_rng(0)
    attend = jax.jit(_decode_attention, static_argnums=5)
    ours, theirs = [], []
    for keys in (96, 512, 528, 704, 1024, 1104):  # multiples of 16, as above
        q, k, v = (
            torch.from_numpy(rng.normal(0, 1, (1, n, keys, dim))).bfloat16() for n in (heads, kv_heads, kv_heads)
        )
        # query heads 0 and 2 (of kv heads 0 and 1) score ~4.5 there, a little above the rest: the earlier blocks weigh
        k[0, :, keys - 3] = 0.8 * q[0, ::2, -1]
        expand = heads // kv_heads
        want, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k.repeat_interleave(expand, 1), v.repeat_interleave(expand, 1), 0.0, True
        )
        k_pages, v_pages = [], []
        for start in page_starts((page_len,) * (max_len // page_len)):
            k_page, v_page = (
                np.zeros((1, kv_heads, dim, page_len), np.float32),
                np.zeros((1, kv_heads, page_len, dim), np.float32),
            )
            n = max(0, min(page_len, keys - start))
            k_page[0, :, :, :n] = k[0, :, start : start + n].float().numpy().transpose(0, 2, 1)
            v_page[0, :, :n] = v[0, :, start : start + n].float().numpy()
            k_pages.append(k_page)
            v_pages.append(v_page)
        query = jnp.asarray(q[0, :, -1].float().numpy().reshape(1, kv_heads, expand, dim), jnp.bfloat16)
        got = attend(query, tuple(k_pages), tuple(v_pages), jnp.array([keys - 1]), jnp.array(keys), False)
        ours.append(np.asarray(got.astype(jnp.float32)).reshape(heads, dim))
        theirs.append(want[0, :, -1].float().numpy())
    ulps = np.abs((np.stack(ours).view(np.int32) >> 16) - (np.stack(theirs).view(np.int32) >> 16))
    print(f"pages of {page_len}: {np.count_nonzero(ulps)} of {ulps.size} outputs differ, by {ulps.max()} ulp at most")
    assert np.count_nonzero(ulps) <= 0.01 * ulps.size and ulps.max() <= 1
