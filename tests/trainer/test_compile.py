"""`TrainerConfig.compile`: compiled decoder layers, or the whole decoder compiled as one graph, train as the eager
model does, to within fp32 op-order noise, and batches of new lengths compile nothing more (dynamic shapes): a run
compiles once, not once per step."""

import pytest
import torch
from torch._dynamo.utils import counters

from tests.trainer.test_shared_prompts import is_split
from trainer import LossConfig, TrainBatch, Trainer, TrainerConfig


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test's compiles from none: the layers' forward is one code object in a process, so the compiles of
    earlier tests' trainers count toward its recompile limit."""
    torch._dynamo.reset()


def grouped(batch: TrainBatch, group: int = 4) -> TrainBatch:
    """GRPO groups: every `group` samples share the first one's prompt (shared-prompt rows, as the tiny recipe)."""
    prompts = [batch.prompts[i - i % group] for i in range(len(batch))]
    return TrainBatch(prompts, batch.responses, batch.advantages, batch.rollout_logprobs)


# 36-token responses: attention split by keys (trainer/split_attention.py), run eagerly inside the compiled code
@pytest.mark.parametrize("scope,response", [("layers", 12), ("layers", 36), ("model", 12), ("model", 36)])
def test_compiled_decoder_trains_like_eager_and_compiles_once(tiny_qwen3_dir, make_batch, scope, response):
    eager = Trainer(TrainerConfig(tiny_qwen3_dir, lr=1e-3, share_prompts=True))
    compiled = Trainer(TrainerConfig(tiny_qwen3_dir, lr=1e-3, share_prompts=True, compile=scope))
    batches = [grouped(make_batch(12, seed=s, max_prompt=9 + 3 * s, max_response=response + 4 * s)) for s in range(3)]
    mbs = [mb for b in batches for mb in compiled._plan(b, list(range(len(b))))]
    assert any(mb.segments is not None and is_split(mb.segments) for mb in mbs) == (response == 36)
    initial = {name: p.detach().clone() for name, p in eager.model.named_parameters()}
    before = counters["stats"]["unique_graphs"]  # the counters are the process's
    for step, batch in enumerate(batches):
        if step == 1:  # the first batch compiled what training needs
            graphs = counters["stats"]["unique_graphs"]
        want, got = eager.train_step(batch), compiled.train_step(batch)
        for key in ("train/loss", "train/grad_norm", "train/entropy", "train/pg_clipfrac"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (step, key)
    assert counters["stats"]["unique_graphs"] == graphs, "a batch of new lengths recompiled the layers"
    assert graphs > before, "nothing was compiled"
    # Each tensor's update, not each element: AdamW divides by sqrt(v), so an element whose gradient is ~0 moves by up
    # to lr whichever way op-order noise tips it (one element of 8192 did, by 1e-5, on an AVX2 CPU). Measured: the
    # updates agree to <= 6e-5 of their norm; a wrong gradient anywhere is O(1).
    for (name, a), b in zip(eager.model.named_parameters(), compiled.model.parameters()):
        want, got = a.detach() - initial[name], b.detach() - initial[name]
        assert float((got - want).norm()) <= 1e-3 * float(want.norm()), name


def test_the_whole_decoder_is_not_compiled_under_fsdp(tiny_qwen3_dir):
    """FSDP's units are the decoder layers: one graph over all of them is refused, naming the setting."""
    import transformers

    from trainer.policy_model import compile_decoder

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)
    with pytest.raises(ValueError, match="train.compile=model"):
        compile_decoder(model, "model", sharded=True)


def test_a_step_s_many_call_variants_stay_compiled(tiny_qwen3_dir, make_batch):
    """Gradient checkpointing, micro-batches (one with no padding: no mask), KL and entropy and two minibatches make
    more variants of a layer's call than dynamo compiles by default (8): past that it ran them eagerly, saying so only
    in a warning. What counts is that it never gave up."""
    loss = LossConfig(kl_coef=0.05, entropy_coef=0.01)
    cfg = dict(lr=1e-3, gradient_checkpointing=True, micro_batch_tokens=64, minibatches=2, loss=loss)
    trainer = Trainer(TrainerConfig(tiny_qwen3_dir, compile="layers", **cfg))
    for s in range(3):
        trainer.train_step(make_batch(12, seed=s, max_prompt=9 + 3 * s, max_response=12 + 4 * s))
    gave_up = [reason.split("\n")[0] for reason in counters["unimplemented"] if "recompile limit" in reason]
    assert not gave_up and counters["stats"]["unique_graphs"] > 0


@pytest.mark.parametrize("scope", ["layers", "model"])
def test_the_training_forward_compiles_under_gradient_checkpointing(tiny_qwen3_dir, make_batch, scope):
    """The recipe's setting: dynamo graph-broke on the attention wrapper's side effect inside the checkpoint and ran
    the training forward eagerly, so train.compile did nothing (one minibatch, no KL: no forward outside it). The
    compiled step trains as the one without checkpointing does."""
    plain = Trainer(TrainerConfig(tiny_qwen3_dir, lr=1e-3, compile=scope))
    checkpointed = Trainer(TrainerConfig(tiny_qwen3_dir, lr=1e-3, compile=scope, gradient_checkpointing=True))
    batch = make_batch(12, seed=0, max_prompt=9, max_response=12)
    want = plain.train_step(batch)
    counters.clear()
    got = checkpointed.train_step(batch)
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] > 0, dict(counters["graph_break"])
    for key in ("train/loss", "train/grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), key
