"""Shared-prompt rows (`train.share_prompts`): one prompt then several of its samples' responses in one row give every
sample the log-prob, entropy and gradient of its own plain forward."""

from functools import partial

import numpy as np
import pytest
import torch
import transformers

from tests.conftest import make_tiny_hf_model
from tests.trainer.conftest import assert_fp32_backward
from tests.trainer.test_logprobs import assert_per_sample_hf_logprobs
from trainer import Trainer, TrainerConfig
from trainer.batching import TrainBatch, collate_rows, row_length, shared_prompt_rows
from trainer.logprobs import response_logprobs
from trainer.shared_prompts import (
    BLOCKED_SDPA,
    block_mask,
    check_shared_prompts,
    shared_prompt_attention,
    shared_prompt_mask,
    use_blocked_attention,
)


def grpo_batch(seed: int, group_sizes=(4, 3, 1, 2), max_response: int = 12) -> TrainBatch:
    """Groups of samples with the same prompt (prompt lengths differ between groups), interleaved the way a short
    batch or a shuffled one could be, and the first prompt coming back as a later group of its own."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 128, rng.integers(3, 14)).tolist() for _ in group_sizes]
    prompts[-1] = list(prompts[0])  # the same prompt in two groups: one row may take samples of both
    order = [g for g, size in enumerate(group_sizes) for _ in range(size)]
    rng.shuffle(order)
    responses = [rng.integers(3, 128, rng.integers(1, max_response + 1)).tolist() for _ in order]
    rollout = [(-4.8 + rng.normal(0.0, 0.3, len(r))).tolist() for r in responses]
    return TrainBatch([list(prompts[g]) for g in order], responses, rng.normal(0.0, 1.0, len(order)).tolist(), rollout)


def long_batch(seed: int) -> TrainBatch:
    """Responses up to 40 tokens after prompts of 3 to 13, up to 8 to a row: attention is split by keys on CPU."""
    return grpo_batch(seed, group_sizes=(8, 7, 1, 3), max_response=40)


def test_rows_group_samples_by_prompt_within_the_budget():
    batch = grpo_batch(0, group_sizes=(6, 5, 1), max_response=10)
    for budget in (10_000, 30, 1):
        rows = shared_prompt_rows(batch, list(range(len(batch))), budget)
        assert sorted(i for row in rows for i in row) == list(range(len(batch)))
        for row in rows:
            assert all(batch.prompts[i] == batch.prompts[row[0]] for i in row)
            assert len(row) == 1 or row_length(batch, row) <= budget
        if budget == 10_000:  # two distinct prompts: one row each
            assert len(rows) == 2
        if budget == 1:  # nothing fits: a sample per row
            assert all(len(row) == 1 for row in rows)


def test_a_shared_row_may_fill_the_budget_exactly():
    """The budget is inclusive: a prompt of 3 and responses of 4 and 3 (a 10-token row) fit one row at budget 10, and
    a third response of 1 token starts a new row."""
    batch = TrainBatch([[5, 6, 7]] * 3, [[8] * 4, [9] * 3, [10]], [1.0, -1.0, 0.5])
    rows = shared_prompt_rows(batch, [0, 1, 2], 10)
    assert rows == [[0, 1], [2]] and row_length(batch, rows[0]) == 10


@pytest.mark.parametrize(
    "family,attention,split",
    [("qwen3", "sdpa", False), ("qwen3", "eager", False), ("llama", "sdpa", False), ("qwen3", BLOCKED_SDPA, True)]
    + [("qwen3", BLOCKED_SDPA, False), ("llama", BLOCKED_SDPA, True)],
)
def test_shared_rows_give_each_sample_its_own_hf_logprobs(tmp_path, family, attention, split):
    path = make_tiny_hf_model(tmp_path / family, family, tie=family == "qwen3", seed=4)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    if attention == BLOCKED_SDPA:
        use_blocked_attention(model)  # what the trainer does to an SDPA model
    else:
        model.set_attn_implementation(attention)
    assert model.config._attn_implementation == attention
    model.eval()
    batch = long_batch(1) if split else grpo_batch(1)
    rows = shared_prompt_rows(batch, list(range(len(batch))), 10_000)
    mb = collate_rows(batch, rows)
    assert mb.segments is not None and mb.input_ids.shape[0] == len(rows) < len(batch)
    assert is_split(mb.segments) == split
    with torch.no_grad():
        logp, entropy = response_logprobs(model, mb, temperature=0.9, with_entropy=True)
    assert_per_sample_hf_logprobs(model, batch, mb, logp, entropy, 0.9)


@pytest.mark.parametrize(
    "budget, checkpointing, split",
    [(10_000, False, False), (24, False, False), (24, True, False), (10_000, True, True), (10_000, False, True)],
)
def test_shared_rows_give_the_gradient_of_plain_rows(tiny_qwen3_dir, budget, checkpointing, split):
    """Whole-minibatch gradients and metrics agree, with one row per prompt and with groups split across rows and
    micro-batches (budget 24), padding rows included, with activation checkpointing recomputing the layers, and with
    attention split by keys."""
    batch = long_batch(3) if split else grpo_batch(2)
    plain = Trainer(TrainerConfig(str(tiny_qwen3_dir), micro_batch_tokens=budget))
    shared = Trainer(
        TrainerConfig(
            str(tiny_qwen3_dir), micro_batch_tokens=budget, share_prompts=True, gradient_checkpointing=checkpointing
        )
    )
    mbs = shared._plan(batch, list(range(len(batch))))
    assert len(mbs) < len(batch)
    assert any(mb.segments is not None and is_split(mb.segments) for mb in mbs) == split
    want, want_metrics = plain.compute_gradients(batch)
    got, got_metrics = shared.compute_gradients(batch)
    assert want.keys() == got.keys()
    for name in want:
        scale = want[name].abs().max()
        torch.testing.assert_close(got[name], want[name], atol=1e-5 * float(scale), rtol=0, msg=name)
    assert got_metrics.pop("train/micro_batches") <= want_metrics.pop("train/micro_batches")
    for key, value in want_metrics.items():
        assert got_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_shared_rows_take_the_same_training_steps(tiny_qwen3_dir):
    """Three optimizer steps (new weights each time) leave both trainers with the same weights."""
    plain = Trainer(TrainerConfig(str(tiny_qwen3_dir), lr=1e-3, micro_batch_tokens=64))
    shared = Trainer(TrainerConfig(str(tiny_qwen3_dir), lr=1e-3, micro_batch_tokens=64, share_prompts=True))
    for seed in range(3):
        want, got = plain.train_step(grpo_batch(10 + seed)), shared.train_step(grpo_batch(10 + seed))
        assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-4, abs=1e-6)
    for (name, p), q in zip(plain.model.named_parameters(), shared.model.parameters()):
        torch.testing.assert_close(q, p, atol=1e-5, rtol=0, msg=name)


def test_models_that_cannot_take_a_custom_mask_are_refused(tiny_qwen3_dir):
    config = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir).config  # attention resolved on load
    check_shared_prompts(config)  # sdpa, full attention: fine
    windowed = transformers.Qwen3Config(use_sliding_window=True, sliding_window=16, max_window_layers=0)
    windowed._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match="sliding-window"):
        check_shared_prompts(windowed)
    config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="train.share_prompts needs the model's attention"):
        check_shared_prompts(config)


def is_split(segments: torch.Tensor) -> bool:
    """Whether the trainer's attention on CPU splits these rows by keys (the mask is the segments themselves)."""
    return shared_prompt_mask(segments, BLOCKED_SDPA, torch.float32).dtype == torch.long


def segments_of(rows: list[tuple[int, list[int]]]) -> torch.Tensor:
    """The segments of shared-prompt rows given as (prompt length, response lengths); (0, []) is a padding row."""
    width = max(p + sum(r) for p, r in rows)
    segments = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, (prompt, responses) in enumerate(rows):
        segments[i, :prompt] = 0
        segments[i, prompt : prompt + sum(responses)] = torch.repeat_interleave(
            torch.arange(1, len(responses) + 1), torch.tensor(responses, dtype=torch.long)
        )
    return segments


def attention_and_input_grads(
    segments: torch.Tensor, mask: torch.Tensor, dtype=torch.float32, rounded_to: torch.dtype | None = None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`shared_prompt_attention` under `mask` with grouped-query heads, on random inputs fixed by a seed (in `dtype`,
    first rounded to `rounded_to` if given): its output at the real positions and the gradients of queries, keys and
    values."""
    rows, length = segments.shape
    real = (segments >= 0)[:, :, None, None]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(rows, heads, length, 8, generator=gen).to(rounded_to or dtype).to(dtype).requires_grad_()
        for heads in (4, 2, 2)
    )
    module = torch.nn.Module()
    module.config = transformers.Qwen3Config(num_attention_heads=4, num_key_value_heads=2)
    module.is_causal, module.num_key_value_groups = False, 2
    out, _ = shared_prompt_attention(module, q, k, v, mask, scaling=0.3)  # [rows, L, heads, dim]
    # The output's gradient: random, exact in bf16, so that every dtype backpropagates the same one.
    (out.float() * real * torch.randn(out.shape, generator=gen).to(torch.bfloat16).float()).sum().backward()
    return (out * real).detach(), [t.grad for t in (q, k, v)]


def assert_same_attention(segments: torch.Tensor, mask: torch.Tensor) -> None:
    """Outputs and input gradients at every real position equal those under the dense mask."""
    want, want_grads = attention_and_input_grads(segments, shared_prompt_mask(segments, "sdpa", torch.float32))
    got, got_grads = attention_and_input_grads(segments, mask)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    # fp32 reassociation only: the split's backward sums its parts in another order than the dense mask's. Up to
    # 1e-6 of the largest gradient on AVX-512 CPUs, 1.14e-6 on an AVX2-only Zen 1; a wrong mask or merge is O(1).
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=4e-6 * float(w.abs().max()), rtol=0)


def test_attention_in_blocks_equals_the_dense_mask():
    """Over rows of different prompt lengths and a padding row, where responses as long as a block start at many
    offsets into one."""
    segments = segments_of(
        [(3, [40, 40, 17, 40, 1, 40, 40, 33]), (11, [40, 2, 40, 40, 39, 40, 40, 40]), (7, [5]), (0, [])]
    )
    blocks = block_mask(segments)  # what a CUDA micro-batch gets (on CPU attention is split by keys)
    assert blocks.shape[-2] == 40  # one block per response length
    assert_same_attention(segments, blocks)


@pytest.mark.parametrize(
    "rows",
    [
        [(3, [40, 40, 17, 40, 1, 40, 40, 33]), (11, [40, 2, 40, 40, 39, 40, 40, 40]), (7, [5]), (0, [])],
        [(30, [1, 32]), (4, [2, 1, 3]), (0, []), (17, [33, 9])],  # a long prompt over other rows' responses
        [(9, [32, 32, 32]), (9, [32, 7])],  # prompts of one length: no key mask
    ],
)
def test_attention_split_by_keys_equals_the_dense_mask(rows):
    """On CPU, from responses of `SPLIT_FROM` tokens on: over prompts of different lengths, padding rows, one-token
    responses and a prompt longer than another row's prompt and responses together."""
    segments = segments_of(rows)
    assert is_split(segments)
    assert_same_attention(segments, shared_prompt_mask(segments, BLOCKED_SDPA, torch.float32))


@pytest.mark.parametrize(
    "rows, split",
    [
        ([(9, [32, 32, 32]), (30, [1, 32]), (0, [])], True),
        ([(12, [3, 5, 1, 4]), (9, [2, 2]), (15, [6]), (0, [])], False),  # short responses: cut at the prompt
    ],
)
def test_attention_on_cpu_in_bf16_backpropagates_in_fp32(rows, split):
    """bf16 inputs, split by keys or cut at the shortest prompt: the output is the bf16 kernels' (dense SDPA's to a
    bf16 rounding), the input gradients those of fp32 attention on the same inputs, rounded. In units of one rounding's
    mean error they are 1.0-1.8 away from fp32 attention's gradients, the bf16 kernel's own backward (dense SDPA's, and
    these paths' before) 1.8-2.3; the test asks for at most 0.85 of the latter on average over q, k and v."""
    segments = segments_of(rows)
    assert is_split(segments) == split
    ours = shared_prompt_mask(segments, BLOCKED_SDPA, torch.bfloat16)
    dense = shared_prompt_mask(segments, "sdpa", torch.bfloat16)
    want, want_grads = attention_and_input_grads(segments, dense, torch.float32, rounded_to=torch.bfloat16)
    dense_out, dense_grads = attention_and_input_grads(segments, dense, torch.bfloat16)
    got, got_grads = attention_and_input_grads(segments, ours, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in got_grads)
    torch.testing.assert_close(got.float(), dense_out.float(), atol=2**-7 * float(want.abs().max()), rtol=0)
    assert_fp32_backward(got_grads, dense_grads, want_grads)


def test_attention_cut_at_the_shortest_prompt_equals_the_dense_mask():
    """Short responses, where blocks do not pay: the queries before the shortest prompt's end (9; the padding row has
    none) attend causally without a mask, the rest under theirs, the longer prompts' last tokens among them."""
    segments = segments_of([(12, [3, 5, 1, 4]), (9, [2, 2]), (15, [6]), (0, [])])
    cut = shared_prompt_mask(segments, BLOCKED_SDPA, torch.float32)
    assert cut.shape == (4, 1, segments.shape[1] - 9, segments.shape[1])
    assert_same_attention(segments, cut)


@pytest.mark.parametrize("share, max_response", [(False, 12), (True, 12), (True, 40)])  # a row a sample; cut; split
def test_rows_padded_to_a_multiple_give_the_same_gradients(tiny_qwen3_dir, share, max_response):
    """`pad_to_multiple_of` (bf16 on CPU pads to 32 by default) adds padding columns and nothing else: the gradients
    and metrics of rows padded to the longest, and micro-batches within the same token budget."""
    cfg = dict(model_path=str(tiny_qwen3_dir), lr=1e-3, micro_batch_tokens=160, share_prompts=share)
    exact, padded = Trainer(TrainerConfig(**cfg)), Trainer(TrainerConfig(**cfg, pad_to_multiple_of=32))
    batch = grpo_batch(7, max_response=max_response)
    everything = list(range(len(batch)))
    planned = padded._plan(batch, everything)
    widths = [mb.input_ids.shape[1] for mb in planned]
    assert all(w % 32 == 0 for w in widths)
    assert widths != [mb.input_ids.shape[1] for mb in exact._plan(batch, everything)]  # it padded
    assert all(mb.input_ids.shape[0] == 1 or mb.input_ids.numel() <= 160 for mb in planned)
    want, want_metrics = exact.compute_gradients(batch)
    got, got_metrics = padded.compute_gradients(batch)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6 * float(want[name].abs().max()), rtol=0)
    want_metrics.pop("train/micro_batches"), got_metrics.pop("train/micro_batches")
    for key, value in want_metrics.items():
        assert got_metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key


def test_rows_are_padded_to_32_in_bf16_on_cpu_and_to_the_longest_elsewhere(tiny_qwen3_dir):
    config = partial(TrainerConfig, str(tiny_qwen3_dir))
    assert config(dtype="bfloat16").pad_multiple == 32
    assert config().pad_multiple == config(dtype="bfloat16", device="cuda").pad_multiple == 1
    assert config(dtype="bfloat16", pad_to_multiple_of=8).pad_multiple == 8
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        config(pad_to_multiple_of=0)


@pytest.mark.parametrize(
    "config", [transformers.MptConfig(), transformers.BloomConfig(), transformers.FalconConfig(alibi=True)]
)
def test_alibi_models_are_refused(config):
    """ALiBi biases follow a key's column in the row, not position_ids: MPT scored a shared row's later responses
    wrong without a word, Bloom and Falcon failed inside transformers on the 4D mask."""
    from trainer.shared_prompts import check_shared_prompts

    config._attn_implementation = "eager"
    with pytest.raises(ValueError, match=rf"ALiBi position biases \({config.model_type}\)"):
        check_shared_prompts(config)
    rope = transformers.FalconConfig(alibi=False)  # Falcon's RoPE variant is fine
    rope._attn_implementation = "eager"
    check_shared_prompts(rope)
