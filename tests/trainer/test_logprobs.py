"""Batched, padded response log-probs and entropies equal a plain per-sample HF forward."""

import pytest
import torch
import transformers

from tests.conftest import make_tiny_hf_model
from trainer import Trainer, TrainerConfig
from trainer.batching import collate, pack_micro_batches
from trainer.logprobs import response_logprobs


def manual_logprobs(model, prompt, response, temperature):
    """One unpadded sequence through HF: log_softmax(logits / T) gathered at the response tokens, and entropy."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    pred = logp_all[len(prompt) - 1 : len(prompt) + len(response) - 1]  # position c predicts token c + 1
    logp = pred.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
    entropy = -(pred.exp() * pred).sum(-1)
    return logp, entropy


def assert_per_sample_hf_logprobs(model, batch, mb, logp, entropy, temperature):
    """Each sample's log-probs and entropies in a micro-batch equal its own unpadded HF forward; 0 past its end."""
    for s, i in enumerate(mb.indices):
        n = len(batch.responses[i])
        want_logp, want_entropy = manual_logprobs(model, batch.prompts[i], batch.responses[i], temperature)
        torch.testing.assert_close(logp[s, :n].double(), want_logp, atol=2e-5, rtol=0)
        torch.testing.assert_close(entropy[s, :n].double(), want_entropy, atol=2e-5, rtol=0)
        assert mb.response_mask[s].sum() == n and not logp[s, n:].any()


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_batched_logprobs_match_manual_hf_forward(tmp_path, make_batch, family):
    path = make_tiny_hf_model(tmp_path / family, family, tie=family == "qwen3", seed=3)
    batch = make_batch(7, seed=1)
    trainer = Trainer(TrainerConfig(str(path), temperature=0.7, micro_batch_tokens=48))
    got = trainer.compute_logprobs(batch.prompts, batch.responses)

    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for i in range(len(batch)):
        want, _ = manual_logprobs(reference, batch.prompts[i], batch.responses[i], 0.7)
        assert got[i].shape == (len(batch.responses[i]),)
        torch.testing.assert_close(torch.from_numpy(got[i]).double(), want, atol=2e-5, rtol=0)
    # The temperature really is applied: T=1 gives different numbers.
    want_t1, _ = manual_logprobs(reference, batch.prompts[0], batch.responses[0], 1.0)
    assert not torch.allclose(torch.from_numpy(got[0]).double(), want_t1, atol=1e-3)


def test_entropy_and_micro_batch_layout(tiny_qwen3_dir, make_batch):
    batch = make_batch(6, seed=2)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    lengths = {i: len(batch.prompts[i]) + len(batch.responses[i]) for i in range(len(batch))}
    groups = pack_micro_batches(lengths, 40)
    assert len(groups) > 1
    for group in groups:
        mb = collate(batch, group)
        with torch.no_grad():
            logp, entropy = response_logprobs(model, mb, temperature=1.3, with_entropy=True)
        assert_per_sample_hf_logprobs(model, batch, mb, logp, entropy, 1.3)


def test_packing_respects_budget_and_keeps_every_sample():
    lengths = {0: 10, 1: 3, 2: 7, 3: 7, 4: 30, 5: 1}
    groups = pack_micro_batches(lengths, 20)
    assert sorted(i for g in groups for i in g) == list(lengths)
    for g in groups:
        padded = max(lengths[i] for i in g) * len(g)
        assert padded <= 20 or len(g) == 1  # an over-long sample goes alone
    assert [4] in groups


def test_packing_fills_the_budget_exactly():
    """The budget is inclusive: rows x padded length equal to it fit one micro-batch (2 x 10 and 4 x 5 at 20), so no
    forward is spent on samples that fit with the others."""
    lengths = {0: 10, 1: 10, 2: 5, 3: 5, 4: 5, 5: 5}
    assert pack_micro_batches(lengths, 20) == [[0, 1], [2, 3, 4, 5]]


def full_logits_reference(model, mb, temperature):
    """Straightforward: the whole [B, L, V] fp32 logits from HF's own forward, a full log-softmax and softmax, then the
    response tokens picked out row by row. Returns [B, R] log-probs and entropies, 0 on padding."""
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits.float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    entropy_all = -(torch.softmax(logits, dim=-1) * logp_all).sum(-1)
    logp = torch.zeros(mb.response_mask.shape)
    entropy = torch.zeros(mb.response_mask.shape)
    for row in range(len(mb.indices)):
        n, start = int(mb.response_mask[row].sum()), int(mb.response_start[row])
        pred = slice(start - 1, start - 1 + n)  # column c predicts the token at c + 1
        targets = mb.input_ids[row, start : start + n]
        logp[row, :n] = logp_all[row, pred].gather(-1, targets[:, None]).squeeze(-1)
        entropy[row, :n] = entropy_all[row, pred]
    return logp, entropy


def grads_of(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("entropy_grad", [True, False])
def test_chunked_logprobs_entropy_and_grads_equal_full_logits(tmp_path, make_batch, tie, entropy_grad):
    path = make_tiny_hf_model(tmp_path / "m", "qwen3", tie=tie, seed=5)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tie
    batch = make_batch(5, seed=4)
    mb = collate(batch, list(range(5)))
    assert len(set(mb.attention_mask.sum(1).tolist())) > 1  # right-padded rows of different lengths
    chunk = 7
    assert mb.num_tokens > 3 * chunk and mb.num_tokens % chunk  # several chunks, the last one partial
    temperature = 0.8
    rng = torch.Generator().manual_seed(0)
    w_logp, w_ent = (
        torch.randn(mb.response_mask.shape, generator=rng),
        torch.randn(mb.response_mask.shape, generator=rng),
    )
    mask = mb.response_mask

    logp, entropy = response_logprobs(
        model, mb, temperature, with_entropy=True, entropy_grad=entropy_grad, chunk_size=chunk
    )
    assert logp.dtype == entropy.dtype == torch.float32 and logp.shape == entropy.shape == mask.shape
    assert entropy.requires_grad == entropy_grad
    # A token mean, as the trainer's losses are: gradients of order 0.1, where fp32 summation noise is ~1e-7.
    loss = ((logp * w_logp * mask).sum() + ((entropy * w_ent * mask).sum() if entropy_grad else 0.0)) / mb.num_tokens
    got = grads_of(model, loss)

    want_logp, want_entropy = full_logits_reference(model, mb, temperature)
    want_loss = (want_logp * w_logp * mask).sum() + ((want_entropy * w_ent * mask).sum() if entropy_grad else 0.0)
    want_loss = want_loss / mb.num_tokens
    want = grads_of(model, want_loss)

    torch.testing.assert_close(logp.detach(), want_logp.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy.detach(), want_entropy.detach(), atol=1e-6, rtol=0)
    assert (logp[mask == 0] == 0).all() and (entropy[mask == 0] == 0).all()
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


def test_chunk_size_does_not_change_the_numbers(tiny_qwen3_dir, make_batch):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    mb = collate(make_batch(4, seed=6), [0, 1, 2, 3])
    with torch.no_grad():
        whole = response_logprobs(model, mb, 1.3, with_entropy=True, chunk_size=10**6)
        for chunk in (1, 3, mb.num_tokens - 1):
            parts = response_logprobs(model, mb, 1.3, with_entropy=True, chunk_size=chunk)
            for a, b in zip(parts, whole):
                torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_backward_keeps_no_logits(tmp_path, make_batch):
    """What autograd keeps between the forward and the backward, outside the per-chunk checkpoints (which keep only
    their inputs): no tensor over the vocabulary, neither all positions' logits nor a chunk's."""
    vocab, chunk = 4096, 8
    path = make_tiny_hf_model(tmp_path / "m", "qwen3", tie=False, vocab_size=vocab, seed=1)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    mb = collate(make_batch(6, seed=7, max_response=24), list(range(6)))
    assert mb.num_tokens > 4 * chunk
    shapes = []

    def pack(x):
        shapes.append(tuple(x.shape))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        logp, entropy = response_logprobs(model, mb, 1.0, with_entropy=True, chunk_size=chunk)
    assert shapes and not [s for s in shapes if s[-1] == vocab]  # the LM head weight is [V, H]
    (logp * mb.response_mask).sum().backward()  # and the recomputation in the backward works
    assert model.lm_head.weight.grad is not None


def test_bf16_model_scores_with_fp32_logits(tiny_qwen3_dir, make_batch):
    """bf16 hidden states and LM head, upcast: the logits are fp32 products of the bf16 values, not bf16 logits."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.bfloat16).eval()
    mb = collate(make_batch(3, seed=8), [0, 1, 2])
    with torch.no_grad():
        logp, entropy = response_logprobs(model, mb, 0.7, with_entropy=True, chunk_size=5)
        hidden = model.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).last_hidden_state
        logits = hidden.float() @ model.get_output_embeddings().weight.float().T / 0.7
    assert logp.dtype == entropy.dtype == torch.float32
    logp_all = torch.log_softmax(logits, dim=-1)
    for row in range(3):
        n, start = int(mb.response_mask[row].sum()), int(mb.response_start[row])
        want = logp_all[row, start - 1 : start - 1 + n].gather(-1, mb.input_ids[row, start : start + n, None])
        torch.testing.assert_close(logp[row, :n], want.squeeze(-1), atol=1e-5, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="TF32 is a CUDA matmul mode")
def test_bf16_cuda_trainer_logprobs_in_tf32_stay_at_fp32_rounding(tiny_qwen3_dir, make_batch):
    """A bf16 CUDA trainer turns TF32 on for the LM head's fp32 matmuls (trainer/logprobs.py); their inputs are bf16
    values, exact in TF32, so the log-probs move by accumulation order only."""
    batch = make_batch(6, seed=2)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.bfloat16).cuda().eval()
    mb = collate(batch, list(range(len(batch))))
    with torch.no_grad():
        fp32, _ = response_logprobs(model, mb, 1.0)
    trainer = Trainer(TrainerConfig(tiny_qwen3_dir, dtype="bfloat16", device="cuda"))
    try:
        assert torch.backends.cuda.matmul.allow_tf32
        with torch.no_grad():
            tf32, _ = response_logprobs(trainer.model.eval(), mb, 1.0)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    torch.testing.assert_close(tf32[mb.response_mask], fp32[mb.response_mask], atol=2e-5, rtol=0)


@pytest.mark.parametrize("knob", ["final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier"])
def test_a_model_that_scales_its_logits_is_refused_not_scored_as_another(tmp_path, make_batch, knob):
    """The chunked LM head multiplies the hidden states by the head's weight and nothing else: a model whose forward
    then scales or caps the logits (Gemma 2's softcapping, Cohere's logit_scale, Granite's logits_scaling, FalconH1's
    lm_head_multiplier) would be trained on another distribution than its own."""
    trainer = Trainer(TrainerConfig(str(make_tiny_hf_model(tmp_path / "m", "qwen3", seed=3))))
    setattr(trainer.model.config, knob, 8.0)
    batch = make_batch(2, seed=1)
    with pytest.raises(NotImplementedError, match=knob):
        trainer.compute_logprobs(batch.prompts, batch.responses)


@pytest.mark.parametrize("knob", ["final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier"])
def test_a_model_whose_logit_scaling_is_one_is_scored_as_it_is(tmp_path, make_batch, knob):
    """A scaling of 1 leaves the logits as they are (Granite and Cohere configs write their knob even so): such a
    model is scored, with the log-probs it has without the knob, not refused."""
    trainer = Trainer(TrainerConfig(str(make_tiny_hf_model(tmp_path / "m", "qwen3", seed=3))))
    batch = make_batch(2, seed=1)
    want = trainer.compute_logprobs(batch.prompts, batch.responses)
    setattr(trainer.model.config, knob, 1.0)
    for got, plain in zip(trainer.compute_logprobs(batch.prompts, batch.responses), want):
        assert got.tolist() == plain.tolist()
