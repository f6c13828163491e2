"""The embedded tiny default (rlloop/tiny.py): what `python -m rlloop.tiny` builds is what ships in rlloop/assets/tiny/
(its data rows, tokenizer and model shape), and the warm start's labels and training are the ones its docstring
describes."""

import json
import random
from collections import Counter

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer

from rlloop.tiny import (
    ASSETS,
    OPERAND_MAX,
    SFT_MIX,
    SHAPE,
    make_model,
    make_rows,
    make_tokenizer,
    noisy_answer,
    split_pairs,
)


@pytest.fixture(scope="module")
def shipped():
    return AutoTokenizer.from_pretrained(ASSETS / "model")


def shipped_rows(split: str) -> list[dict]:
    return [json.loads(line) for line in (ASSETS / "data" / f"{split}.jsonl").read_text().splitlines()]


def prompt_ids(tok, pair: tuple[int, int]) -> list[int]:
    chat = make_rows([pair], "eval")[0]["prompt"]
    return list(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))


def test_the_shipped_data_is_the_seeds_split_of_every_pair_once():
    """Every ordered pair a + b with a, b <= OPERAND_MAX once, 64 of them held out for eval; the shipped rows are
    `make_rows` of the default seed's split, in its order."""
    train, held_out = split_pairs()
    every = [(a, b) for a in range(OPERAND_MAX + 1) for b in range(OPERAND_MAX + 1)]
    assert len(held_out) == 64 and sorted(train + held_out) == every
    assert shipped_rows("train") == make_rows(train, "train")
    assert shipped_rows("eval") == make_rows(held_out, "eval")
    assert split_pairs(1) != (train, held_out)  # the seed decides the split


def test_make_tokenizer_builds_the_shipped_tokenizer(shipped):
    """The same vocabulary (3 special tokens, then printable ASCII but the whitespace a prompt never holds), special
    tokens and chat template: the shipped data's prompts encode to the same ids either way, one per character."""
    tok = make_tokenizer()
    assert tok.get_vocab() == shipped.get_vocab()
    assert (tok.eos_token, tok.pad_token, tok.bos_token, tok.unk_token) == ("<|im_end|>", "<|endoftext|>", None, None)
    assert (tok.eos_token_id, tok.pad_token_id) == (shipped.eos_token_id, shipped.pad_token_id)
    for pair in split_pairs()[1][:4]:
        assert prompt_ids(tok, pair) == prompt_ids(shipped, pair)
    text = "Answer: 12\nok"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert len(tok.encode(text, add_special_tokens=False)) == len(text)


def test_the_warm_starts_labels_follow_the_sft_mix():
    """Right ("Answer: <sum>"), right in the wrong format ("The sum is <sum>") and off by 1 or 2 in DAPO's format, as
    often as SFT_MIX says; an answer off by a little is never below 0."""
    rng, n = random.Random(0), 6000
    kinds = Counter()
    for _ in range(n):
        a, b = rng.randint(0, OPERAND_MAX), rng.randint(0, OPERAND_MAX)
        answer = noisy_answer(a, b, rng)
        if answer == f"The sum is {a + b}":
            kinds["bad_format"] += 1
        else:
            assert answer.startswith("Answer: "), answer
            off = int(answer.removeprefix("Answer: ")) - (a + b)
            assert off == 0 or 1 <= abs(off) <= 2, answer
            kinds["correct" if off == 0 else "wrong"] += 1
    for kind, share in SFT_MIX.items():
        sigma = (share * (1 - share) / n) ** 0.5
        assert abs(kinds[kind] / n - share) < 5 * sigma + 0.01, (kind, kinds)
    small = {noisy_answer(0, 0, rng) for _ in range(2000)}  # ~100 draws off by a little
    assert small <= {"Answer: 0", "Answer: 1", "Answer: 2", "The sum is 0"}


def test_make_model_builds_the_shipped_models_shape_from_its_seed():
    """A Qwen3 of SHAPE over the tokenizer's vocabulary, its embeddings tied: the shipped model's config and tensors;
    its initial weights are the seed's."""
    tok = make_tokenizer()
    model = make_model(tok, [], steps=0)
    config = json.loads((ASSETS / "model" / "config.json").read_text())
    built = model.config.to_dict()
    for key in [*SHAPE, "vocab_size", "max_position_embeddings", "tie_word_embeddings", "eos_token_id", "pad_token_id"]:
        assert built[key] == config[key], key
    assert model.config.vocab_size == len(tok)
    with safe_open(ASSETS / "model" / "model.safetensors", "pt") as f:
        shapes = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
    assert {name: list(t.shape) for name, t in model.state_dict().items() if name in shapes} == shapes
    assert "lm_head.weight" not in shapes and model.lm_head.weight is model.model.embed_tokens.weight
    again, other = make_model(tok, [], steps=0), make_model(tok, [], steps=0, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
    assert not torch.equal(model.model.embed_tokens.weight, other.model.embed_tokens.weight)


def test_the_warm_start_learns_an_answers_first_character():
    """The supervised loss covers every answer token, the first included (a loss mask off by one position trained on
    the padding after the EOS instead): three steps raise the held-out prompts' odds of starting an answer as the
    labels do, 'A' (Answer:) or 'T' (The sum is), well past the untrained model's (x2.2; x1.0 with that mask)."""
    tok = make_tokenizer()
    train, held_out = split_pairs()
    first = [tok.convert_tokens_to_ids(c) for c in "AT"]

    def odds(model) -> float:
        with torch.no_grad():
            return min(
                float(model(input_ids=torch.tensor([prompt_ids(tok, p)])).logits[0, -1].softmax(-1)[first].sum())
                for p in held_out[:8]
            )

    untrained, trained = odds(make_model(tok, [], steps=0)), odds(make_model(tok, train, steps=3))
    assert trained > 1.5 * untrained, (untrained, trained)
