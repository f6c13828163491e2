"""Prompt data in the DAPO-Math-17k schema: load, tokenize with the chat template, serve seeded batches, resume.

A source is a Hugging Face hub id, a local parquet/jsonl file, or a directory of such files. Rows carry a prompt
(`prompt`: a chat-message list as in DAPO-Math-17k, or a plain string) and an answer (`reward_model.ground_truth`).
Prompts are tokenized lazily, batch by batch (DAPO-Math-17k has 1.8 M rows), in an order fixed by (seed, epoch), so
the position alone is enough to resume. Prompts longer than `max_prompt_len` are dropped and counted, or are an
error, as configured.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rlloop.config import Config

FILE_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}


class DataError(ValueError):
    """Bad or unusable data; the message names the source and the problem."""


@dataclass
class Prompt:
    index: int  # row index in the source
    token_ids: list[int]
    answer: str
    messages: list[dict]
    cursor: dict | None = None  # PromptData.state_dict() just before this prompt was drawn: resume from here to
    # draw it again (the async loop modes checkpoint the cursor of the oldest prompt not yet trained on)


def load_rows(path: str, split: str = "train"):
    """A `datasets.Dataset` from a hub id, a parquet/jsonl file or a directory of them."""
    import datasets

    local = Path(path)
    if local.is_file():
        if local.suffix not in FILE_FORMATS:
            raise DataError(f"data file {path}: unsupported format {local.suffix!r} (use .parquet, .jsonl or .json)")
        if local.stat().st_size == 0:
            raise DataError(f"data {path}: no rows")
        return datasets.load_dataset(FILE_FORMATS[local.suffix], data_files=str(local), split="train")
    if local.is_dir():
        files = sorted(f for f in local.rglob("*") if f.suffix in FILE_FORMATS)
        if not files:
            raise DataError(f"data directory {path}: no .parquet, .jsonl or .json files in it")
        formats = {FILE_FORMATS[f.suffix] for f in files}
        if len(formats) > 1:
            raise DataError(f"data directory {path}: mixes parquet and json files; keep one format")
        return datasets.load_dataset(formats.pop(), data_files=[str(f) for f in files], split="train")
    if path.startswith((".", "/")) or path.endswith(tuple(FILE_FORMATS)):
        raise DataError(f"data path {path}: no such file or directory")
    try:
        return datasets.load_dataset(path, split=split)
    except Exception as e:  # the hub raises many kinds; the message is what matters
        raise DataError(f"data path {path!r} (split {split!r}): could not load from the Hugging Face hub: {e}") from e


def get_field(row: dict, dotted: str):
    value = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def check_columns(rows, prompt_key: str, answer_key: str, source: str) -> None:
    if len(rows) == 0:
        raise DataError(f"data {source}: no rows")
    first = rows[0]
    for key, what in ((prompt_key, "prompt_key"), (answer_key, "answer_key")):
        if get_field(first, key) is None:
            raise DataError(
                f"data {source}: column {key!r} (data.{what}) not found; columns are {sorted(rows.column_names)}"
            )


def to_messages(prompt) -> list[dict]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and all(isinstance(m, dict) and "content" in m for m in prompt):
        return [{"role": m.get("role", "user"), "content": m["content"]} for m in prompt]
    raise DataError(f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}")


def encode_prompt(tokenizer, messages: list[dict]) -> list[int]:
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids)
    return tokenizer.encode("\n".join(m["content"] for m in messages))


class PromptData:
    """Seeded, resumable batches of tokenized prompts."""

    def __init__(
        self,
        path: str,
        tokenizer,
        *,
        split: str = "train",
        prompt_key: str = "prompt",
        answer_key: str = "reward_model.ground_truth",
        max_prompt_len: int = 1024,
        on_long_prompt: str = "drop",
        shuffle: bool = True,
        seed: int = 0,
    ):
        self.rows = load_rows(path, split)
        check_columns(self.rows, prompt_key, answer_key, path)
        self.source, self.tokenizer = path, tokenizer
        self.prompt_key, self.answer_key = prompt_key, answer_key
        self.max_prompt_len, self.on_long_prompt = max_prompt_len, on_long_prompt
        self.shuffle, self.seed = shuffle, seed
        self.epoch, self.position, self.dropped = 0, 0, 0
        self._order = self._make_order()

    def __len__(self) -> int:
        return len(self.rows)

    def _make_order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.rows))

    def get(self, index: int) -> Prompt | None:
        """Row `index` tokenized, or None when it is too long and the policy is to drop it."""
        row = self.rows[int(index)]
        messages = to_messages(get_field(row, self.prompt_key))
        ids = encode_prompt(self.tokenizer, messages)
        if len(ids) > self.max_prompt_len:
            if self.on_long_prompt == "error":
                raise DataError(
                    f"data {self.source}: row {index} has {len(ids)} prompt tokens > "
                    f"data.max_prompt_len={self.max_prompt_len}"
                )
            self.dropped += 1
            return None
        return Prompt(int(index), ids, str(get_field(row, self.answer_key)), messages)

    def next_batch(self, n: int) -> list[Prompt]:
        batch: list[Prompt] = []
        seen_in_call = 0
        while len(batch) < n:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._make_order()
            cursor = self.state_dict()
            prompt = self.get(self._order[self.position])
            self.position += 1
            seen_in_call += 1
            if prompt is not None:
                prompt.cursor = cursor
                batch.append(prompt)
            elif seen_in_call > len(self._order) and not batch:
                raise DataError(
                    f"data {self.source}: every prompt is longer than data.max_prompt_len={self.max_prompt_len}"
                )
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "dropped": self.dropped, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.epoch, self.position, self.dropped = (
            state["seed"],
            state["epoch"],
            state["position"],
            state["dropped"],
        )
        self._order = self._make_order()


def load_datasets(cfg: Config, tokenizer) -> tuple[PromptData, PromptData | None]:
    """The training prompts (seeded by `run.seed`) and the eval prompts (in file order; None without `eval.path`)."""
    d = cfg.data
    train = PromptData(
        d.path,
        tokenizer,
        split=d.split,
        prompt_key=d.prompt_key,
        answer_key=d.answer_key,
        max_prompt_len=d.max_prompt_len,
        on_long_prompt=d.on_long_prompt,
        shuffle=d.shuffle,
        seed=cfg.run.seed,
    )
    if not cfg.eval.path:
        return train, None
    evals = PromptData(
        cfg.eval.path,
        tokenizer,
        split=cfg.eval.split,
        prompt_key=d.prompt_key,
        answer_key=d.answer_key,
        max_prompt_len=d.max_prompt_len,
        on_long_prompt="drop",
        shuffle=False,
    )
    return train, evals
