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
        for row, i in enumerate(mb.indices):
            n = len(batch.responses[i])
            want_logp, want_entropy = manual_logprobs(model, batch.prompts[i], batch.responses[i], 1.3)
            torch.testing.assert_close(logp[row, :n].double(), want_logp, atol=2e-5, rtol=0)
            torch.testing.assert_close(entropy[row, :n].double(), want_entropy, atol=2e-5, rtol=0)
            assert mb.response_mask[row].sum() == n


def test_packing_respects_budget_and_keeps_every_sample():
    lengths = {0: 10, 1: 3, 2: 7, 3: 7, 4: 30, 5: 1}
    groups = pack_micro_batches(lengths, 20)
    assert sorted(i for g in groups for i in g) == list(lengths)
    for g in groups:
        padded = max(lengths[i] for i in g) * len(g)
        assert padded <= 20 or len(g) == 1  # an over-long sample goes alone
    assert [4] in groups
