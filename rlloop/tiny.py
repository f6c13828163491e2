"""The embedded default: a tiny Qwen3-architecture model, its tokenizer and DAPO-schema arithmetic data.

`python -m rlloop.tiny [OUT_DIR]` rebuilds what ships in `rlloop/assets/tiny/` (deterministic for a given torch):
- `model/`: a character-level tokenizer with a Qwen-style chat template and a ~0.1M-parameter `Qwen3ForCausalLM`,
  warm-started by a short supervised pass (600 steps) on *noisy* answers to "a + b", a, b <= `OPERAND_MAX`.
- `data/train.jsonl`, `data/eval.jsonl`: rows in the DAPO-Math-17k schema (`prompt` as a chat-message list,
  `reward_model.ground_truth`, `data_source`, `ability`, `extra_info`). `split_pairs` holds out 64 ordered pairs for
  eval; the warm start and the RL prompts only ever see the other 336.

The lever that sets what the demo shows is `SFT_MIX`, the warm start's labels: a quarter "Answer: <sum>" (the format
DAPO's verifier accepts), 70% "The sum is <sum>" (right sum, wrong format: scored -1) and 5% "Answer: <sum +- 1 or 2>".
Sampled at temperature 1 on the held-out pairs, the warm start gives the right sum ~56% of the time but the "Answer:"
format only ~30%, so `eval/tiny_arith` starts near 0.15. In the 30 steps of `examples/grpo_dapo_tiny.yaml` GRPO
takes the format to ~90% (the same fix for every prompt: a strong signal that generalises at once) and the right
sums to ~70%: held-out accuracy reaches 0.66-0.71, +51 to +55 points on run seeds 0-3. Most of the gain is format,
as in early R1-Zero-style runs; the rest is sums the policy gets right more often. Why this mix: with no wrong labels
the model learns the sums almost perfectly (~97% at T=1) and RL has only the format to fix; with 20% (the earlier mix,
half right) the sums stay near 50% and GRPO plateaus at +20 to +30 points. Label noise weighs heavily on this tiny
model: 5% wrong labels leave ~40% of samples without the right sum.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

ASSETS = Path(__file__).parent / "assets" / "tiny"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A shortened DAPO instruction: the real one is ~250 characters, a lot of prefill for a character-level toy.
PROMPT_TEMPLATE = "Solve: {problem}\nThe last line of your response should be of the form Answer: $Answer"
OPERAND_MAX = 19
# The warm start's labels: right, right but in the wrong format (DAPO's rule scores it -1), or off by a little.
# Mostly the wrong format with a little arithmetic noise: RL has the format to fix and some sums to sharpen (see above).
SFT_MIX = {"correct": 0.25, "bad_format": 0.7, "wrong": 0.05}


# The model's widths and depth (its vocabulary is the tokenizer's); the benchmarks build a random one of this shape
# where the shipped model is missing (rlloop/bench/bench_models.py)
SHAPE = dict(
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)


def make_tokenizer():
    """A character-level fast tokenizer: 3 special tokens + printable ASCII, decoded by concatenation."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    core = Tokenizer(models.WordLevel(vocab, unk_token=None))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None, unk_token=None
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_rows(pairs: list[tuple[int, int]], split: str) -> list[dict]:
    return [
        {
            "data_source": "tiny_arith",
            "prompt": [{"role": "user", "content": PROMPT_TEMPLATE.format(problem=f"{a} + {b}")}],
            "ability": "MATH",
            "reward_model": {"ground_truth": str(a + b), "style": "rule"},
            "extra_info": {"index": i, "split": split},
        }
        for i, (a, b) in enumerate(pairs)
    ]


def split_pairs(seed: int = 0) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    pairs = [(a, b) for a in range(OPERAND_MAX + 1) for b in range(OPERAND_MAX + 1)]
    random.Random(seed).shuffle(pairs)
    return pairs[64:], pairs[:64]


def noisy_answer(a: int, b: int, rng: random.Random) -> str:
    kind = rng.choices(list(SFT_MIX), weights=list(SFT_MIX.values()))[0]
    if kind == "correct":
        return f"Answer: {a + b}"
    if kind == "bad_format":
        return f"The sum is {a + b}"
    return f"Answer: {max(0, a + b + rng.choice([-2, -1, 1, 2]))}"


def make_model(tok, train_pairs, steps: int = 600, seed: int = 0):
    """A Qwen3 config small enough for a CPU run, warm-started on noisy answers (see module docstring)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=len(tok),
        **SHAPE,
        max_position_embeddings=256,
        rope_theta=1e6,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = Qwen3ForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    rng = random.Random(seed)
    prompts = {
        p: tok.apply_chat_template(
            make_rows([p], "train")[0]["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for p in train_pairs
    }
    for step in range(steps):
        batch = rng.sample(train_pairs, 64)
        seqs, masks = [], []
        for a, b in batch:
            answer = tok.encode(noisy_answer(a, b, rng), add_special_tokens=False) + [tok.eos_token_id]
            seqs.append(list(prompts[(a, b)]) + answer)
            masks.append([0] * len(prompts[(a, b)]) + [1] * len(answer))
        width = max(map(len, seqs))
        ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
        loss_mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
        attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * loss_mask[:, 1:]).sum() / loss_mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0:
            print(f"sft step {step} loss {loss.item():.3f}", flush=True)
    return model


def build(out: Path = ASSETS, seed: int = 0) -> Path:
    import torch

    torch.set_num_threads(2)
    out = Path(out)
    train_pairs, eval_pairs = split_pairs(seed)
    (out / "data").mkdir(parents=True, exist_ok=True)
    for name, pairs in (("train", train_pairs), ("eval", eval_pairs)):
        with open(out / "data" / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in make_rows(pairs, name))
    tok = make_tokenizer()
    model = make_model(tok, train_pairs, seed=seed)
    model.save_pretrained(out / "model")
    tok.save_pretrained(out / "model")
    return out


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m rlloop.tiny", description="Build the tiny task's model and data.")
    parser.add_argument("out", nargs="?", type=Path, default=ASSETS, help=f"where to write them (default: {ASSETS})")
    print(build(parser.parse_args().out))
