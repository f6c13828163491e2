"""Prompt data in the DAPO-Math-17k schema: load, tokenize with the chat template, serve seeded batches, resume.

A source is a Hugging Face hub id, a local parquet/jsonl file, or a directory of such files (rlloop/data_files.py
reads it). Rows carry a prompt
(`prompt`: a chat-message list as in DAPO-Math-17k, or a plain string) and an answer (`reward_model.ground_truth`).
A row repeating an earlier row's prompt and answer is left out (`data.dedup`: the hub's DAPO-Math-17k is 17,398
prompts, each ~103 times). Prompts are tokenized lazily, batch by batch (DAPO-Math-17k has 1.8 M rows), in an order
fixed by (seed, epoch), so the position alone is enough to resume. Prompts longer than `max_prompt_len` are dropped
and counted, or are an error, as configured.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from rlloop.config import Config, DataSection
from rlloop.data_files import load_rows
from rlloop.errors import DataError

log = logging.getLogger(__name__)


@dataclass
class Prompt:
    index: int  # row index in the source
    token_ids: list[int]
    answer: str
    messages: list[dict]
    cursor: dict | None = None  # PromptData.state_dict() just before this prompt was drawn: resume from here to
    # draw it again (the async loop modes checkpoint the cursor of the oldest prompt not yet trained on)


def get_field(row: dict, dotted: str):
    """`row[dotted]`, a column of that literal name (pandas.json_normalize writes `reward_model.ground_truth`), or else
    the nested field the dotted path names; None when there is neither."""
    if dotted in row:
        return row[dotted]
    value = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def check_columns(rows, prompt_key: str, answer_key: str, source: str, label: str = "data.path") -> None:
    if len(rows) == 0:
        raise DataError(f"{label} {source}: no rows")
    for key, what in ((prompt_key, "prompt_key"), (answer_key, "answer_key")):
        if key in rows.column_names:  # a literal dotted name first, as get_field reads it
            continue
        # By the schema, not the first row: a column that is null in row 0 exists and is a row-level problem.
        node = rows.features
        for part in key.split("."):
            if not isinstance(node, dict):  # no fixed schema below here (datasets' Json feature): look at rows
                node = next((1 for i in range(min(len(rows), 64)) if get_field(rows[i], key) is not None), None)
                break
            node = node.get(part)
        if node is None:
            raise DataError(
                f"{label} {source}: column {key!r} (data.{what}) not found; columns are {sorted(rows.column_names)}"
            )


def top_columns(keys: Iterable[str], column_names: list[str]) -> list[str]:
    """The columns that hold these keys: a literal dotted column name, or else the top of the nested path."""
    return sorted({key if key in column_names else key.split(".")[0] for key in keys})


def to_messages(prompt) -> list[dict]:
    if isinstance(prompt, str) and prompt.strip():
        return [{"role": "user", "content": prompt}]
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in prompt)
        # the last turn, the user's, asks the question: a system message may be blank, not that one (a conversion
        # that read the wrong field left only the system prompt)
        and prompt[-1]["content"].strip()
    ):
        return [{"role": m.get("role") or "user", "content": m["content"]} for m in prompt]
    shown = repr(prompt)[:80]
    raise DataError(
        "prompt must be a non-empty string or a list of chat messages ({'role': ..., 'content': str}) whose last "
        f"(the user's turn) is not blank, got {type(prompt).__name__} {shown}"
    )


def to_answer(answer) -> str:
    """The ground truth as the reward function gets it: a non-empty string (numbers are written out). A whole number
    read as a float is written as an integer: Arrow gives a column of 3 and 2.5, or of 3 and nulls, float64, and "3.0"
    would fail DAPO's exact match with "Answer: 3". A float32 column's values come widened to float64: one that a
    float32 holds exactly is written with float32's shortest digits (0.1 of such a column is 0.10000000149011612)."""
    if isinstance(answer, numbers.Real) and not isinstance(answer, (bool, numbers.Integral)):
        if answer != answer:  # NaN: a null in a float column
            raise DataError("missing ground truth (null)")
        if float(answer).is_integer() and abs(answer) < 2**53:
            return str(int(answer))
        exact32 = abs(answer) <= float(np.finfo(np.float32).max) and float(np.float32(answer)) == answer
        return str(np.float32(answer)) if exact32 else str(float(answer))
    if isinstance(answer, numbers.Number) and not isinstance(answer, bool):
        return str(answer)
    if isinstance(answer, str) and answer.strip():
        return answer
    raise DataError(f"empty or missing ground truth: expected a non-empty string or a number, got {answer!r:.80}")


def render_prompt(tokenizer, messages: list[dict], template_kwargs: dict, tokenize: bool = True) -> list[int] | str:
    """The prompt as the policy sees it: the chat template (every tokenizer rlloop loads has one, rlloop/model.py)
    with a generation prompt, as token ids (or, `tokenize=False`, as text)."""
    out = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=tokenize, return_dict=False, **template_kwargs
    )
    return list(out) if tokenize else out


def encodes_any_text(tokenizer) -> bool:
    """Whether the tokenizer encodes text of any characters (byte-level, byte fallback or an unknown token), probed
    with characters a small vocabulary lacks."""
    try:
        tokenizer.encode("\u00e9\u03c0\u4e2d\U0001f600\x00")
    except Exception:
        return False
    return True


T = TypeVar("T")


def prompt_identity(prompt: Prompt) -> tuple:
    """What the policy sees and what it is scored against: the prompt's token ids and its answer."""
    return tuple(prompt.token_ids), prompt.answer


def distinct(items: Iterable[T], key: Callable[[T], Hashable] = prompt_identity) -> Iterator[T]:
    """Each item once: the first of those with its key (for prompts, the first of the rows with its tokens and
    answer)."""
    seen = set()
    for item in items:
        if (k := key(item)) not in seen:
            seen.add(k)
            yield item


class PromptData:
    """Seeded, resumable batches of tokenized prompts."""

    def __init__(self, cfg: DataSection, tokenizer, *, seed: int = 0, key: str = "data.path"):
        """The rows of `cfg.path` (each distinct prompt once, with `cfg.dedup`), in an order seeded by `seed`
        (run.seed); `key` is the config key errors name."""
        self.rows = load_rows(cfg.path, cfg.split, key, cfg.subset)
        check_columns(self.rows, cfg.prompt_key, cfg.answer_key, cfg.path, key)
        self.cfg, self.tokenizer, self.seed, self.key = cfg, tokenizer, seed, key
        self._columns = top_columns((cfg.prompt_key, cfg.answer_key), self.rows.column_names)
        self._kept = self._distinct_rows() if cfg.dedup else np.arange(len(self.rows))  # source row indices
        log.info(
            "%s %s: %d rows, %s",
            key,
            cfg.path,
            len(self.rows),
            f"{len(self._kept)} distinct (prompt, answer) pairs" if cfg.dedup else "data.dedup off: repeats kept",
        )
        self.epoch, self.position, self.dropped = 0, 0, 0
        self._order = self._make_order()
        self._template_bytes: dict[tuple, int] = {}  # roles -> the chat template's bytes around them

    def __len__(self) -> int:
        return len(self._kept)

    def _make_order(self) -> np.ndarray:
        """This epoch's order of the kept rows (positions in them, as `get` takes)."""
        if not self.cfg.shuffle:
            return np.arange(len(self))
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self))

    def _iter_rows(self, indices: np.ndarray | None = None) -> Iterator[tuple[int, dict]]:
        """(source index, the prompt and answer columns) of each row, or of those at `indices`, in file order."""
        rows = self.rows.select_columns(self._columns)
        if indices is None:
            indices = np.arange(len(self.rows))
        elif len(indices) < len(self.rows):
            rows = rows.select(indices)
        at = iter(indices)
        for batch in rows.iter(batch_size=4096):
            for values in zip(*(batch[c] for c in self._columns)):
                yield int(next(at)), dict(zip(self._columns, values))

    def _distinct_rows(self) -> np.ndarray:
        """The source index of the first row of each distinct (prompt, answer) pair, in file order: deterministic, so
        a resumed run has the same rows. A prompt's messages stand for the prompt the chat template renders from them
        (rendering 1.8 M rows would take minutes); a row that does not parse is kept, for validate() to name."""

        def identity(item: tuple[int, dict]) -> Hashable:
            index, row = item
            try:
                messages, answer = self._parse_row(index, row)
            except DataError:
                return index
            return tuple((m["role"], m["content"]) for m in messages), answer

        return np.fromiter((index for index, _ in distinct(self._iter_rows(), identity)), dtype=np.int64)

    def _parse_row(self, index: int, row: dict) -> tuple[list[dict], str]:
        """(messages, answer) of `row`; a DataError naming the row and the column otherwise."""
        parsed = []
        for key, name, parse in (
            (self.cfg.prompt_key, "data.prompt_key", to_messages),
            (self.cfg.answer_key, "data.answer_key", to_answer),
        ):
            try:
                parsed.append(parse(get_field(row, key)))
            except DataError as e:
                raise DataError(f"{self.key} {self.cfg.path}: row {index} (0-based), {name} {key!r}: {e}") from None
        return parsed[0], parsed[1]

    def _parse(self, index: int) -> tuple[list[dict], list[int], str]:
        """(messages, token ids, answer) of row `index`."""
        messages, answer = self._parse_row(index, self.rows[int(index)])
        return messages, self._encode(index, messages), answer

    def _encode(self, index: int, messages: list[dict]) -> list[int]:
        try:
            return render_prompt(self.tokenizer, messages, self.cfg.chat_template_kwargs)
        except Exception as e:  # a character the tiny tokenizer lacks (no unknown token), a template that raises
            raise DataError(f"{self.key} {self.cfg.path}: row {index}: the tokenizer cannot encode it: {e}") from None

    def _token_bound(self, index: int, messages: list[dict]) -> int:
        """An upper bound on the prompt's tokens without tokenizing it: the UTF-8 bytes of its text as the tokenizer
        normalizes it (NFC can lengthen a character) plus the chat template's (a token covers at least one byte; +2
        for a sentencepiece prefix space)."""
        roles = tuple(m["role"] for m in messages)
        if roles not in self._template_bytes:
            empty = [{"role": r, "content": ""} for r in roles]
            try:
                text = render_prompt(self.tokenizer, empty, self.cfg.chat_template_kwargs, tokenize=False)
            except Exception as e:  # e.g. a template that wants user and assistant turns to alternate
                raise DataError(f"{self.key} {self.cfg.path}: row {index}: the chat template refuses it: {e}") from None
            self._template_bytes[roles] = len(text.encode()) + 2
        normalizer = getattr(getattr(self.tokenizer, "backend_tokenizer", None), "normalizer", None)
        normalize = normalizer.normalize_str if normalizer else str
        return self._template_bytes[roles] + sum(len(normalize(m["content"]).encode()) for m in messages)

    def _too_long(self, index: int, tokens: int) -> DataError:
        return DataError(
            f"{self.key} {self.cfg.path}: row {index} has {tokens} prompt tokens > "
            f"data.max_prompt_len={self.cfg.max_prompt_len} (data.on_long_prompt: error)"
        )

    def get(self, position: int) -> Prompt | None:
        """The kept row at `position` (0 to len(self) - 1; with data.dedup off, the row of that index) tokenized, or
        None when it is too long and the policy is to drop it. Its `index`, as errors name it, is the source row's."""
        index = int(self._kept[position])
        messages, ids, answer = self._parse(index)
        if len(ids) > self.cfg.max_prompt_len:
            if self.cfg.on_long_prompt == "error":
                raise self._too_long(index, len(ids))
            self.dropped += 1
            return None
        return Prompt(int(index), ids, answer, messages)

    def validate(self) -> None:
        """Check every row now, in the driver, so that a bad row fails before anything starts, not at the step
        that draws it: each row's prompt and answer, and its length against `max_prompt_len`. Only rows whose byte
        bound exceeds the limit are tokenized (DAPO-Math-17k's 1.8 M rows take seconds, not a tokenizer pass), unless
        the tokenizer cannot encode every text (no byte fallback, no unknown token: the tiny one), where every row is:
        one with a character it lacks ended the run at the step that drew it."""
        fits, shortest = 0, None
        every_row = not encodes_any_text(self.tokenizer)
        for index, row in self._iter_rows(self._kept):
            messages, _ = self._parse_row(index, row)
            if not every_row and self._token_bound(index, messages) <= self.cfg.max_prompt_len:
                fits += 1
            else:
                tokens = len(self._encode(index, messages))
                if tokens > self.cfg.max_prompt_len and self.cfg.on_long_prompt == "error":
                    raise self._too_long(index, tokens)
                fits += tokens <= self.cfg.max_prompt_len
                shortest = tokens if shortest is None else min(shortest, tokens)
        if not fits:
            raise DataError(
                f"{self.key} {self.cfg.path}: every prompt (all {len(self)} rows) is longer than data.max_prompt_len="
                f"{self.cfg.max_prompt_len} tokens (the shortest has {shortest}); raise data.max_prompt_len "
                "(and rollout.prefill_buckets with it) or shorten the prompts"
            )
        if fits < len(self):  # each is counted in data/dropped_prompts as it is drawn; the eval's, nowhere else
            log.warning(
                "%s %s: %d of its %d prompts are longer than data.max_prompt_len=%d tokens and are left out",
                self.key,
                self.cfg.path,
                len(self) - fits,
                len(self),
                self.cfg.max_prompt_len,
            )

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
                    f"{self.key} {self.cfg.path}: every prompt ({len(self._order)} rows) is longer than "
                    f"data.max_prompt_len={self.cfg.max_prompt_len} tokens"
                )
        return batch

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "dropped": self.dropped,
            "seed": self.seed,
            "rows": len(self),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("rows", len(self)) != len(self):  # a position in other data means nothing here
            repeats = (
                " (every row, repeats too: a checkpoint from before data.dedup; resume it with data.dedup=false)"
                if len(self) < len(self.rows) == state["rows"]
                else ""
            )
            raise DataError(
                f"{self.key} {self.cfg.path} has {len(self)} rows, and the checkpoint's position is in data of "
                f"{state['rows']}{repeats}: resume with the data the run was trained on, or start a new run (another "
                "run.dir)"
            )
        self.seed, self.epoch, self.position, self.dropped = (
            state["seed"],
            state["epoch"],
            state["position"],
            state["dropped"],
        )
        self._order = self._make_order()


def load_datasets(cfg: Config, tokenizer) -> tuple[PromptData, PromptData | None]:
    """The training prompts (seeded by `run.seed`) and the eval prompts (in file order; None without `eval.path`)."""
    train = PromptData(cfg.data, tokenizer, seed=cfg.run.seed)
    if not cfg.eval.path or not cfg.run.eval_every:  # no evaluation runs (config_checks warns of it)
        return train, None
    # The training data's columns and length limit; the file's order, and too-long prompts left out
    held_out = cfg.data.model_copy(
        update=dict(
            path=cfg.eval.path, split=cfg.eval.split, subset=cfg.eval.subset, on_long_prompt="drop", shuffle=False
        )
    )
    return train, PromptData(held_out, tokenizer, key="eval.path")


@dataclass
class Inputs:
    """What the driver loads and checks before anything starts, once: the tokenizer and the prompts."""

    tokenizer: object
    data: PromptData
    eval_data: PromptData | None

    def rewind(self) -> None:
        """Back to the first batch of `run.seed`'s order (a run restarted before its first checkpoint)."""
        self.data.load_state_dict({"seed": self.data.seed, "epoch": 0, "position": 0, "dropped": 0})


def load_inputs(cfg: Config) -> Inputs:
    """The tokenizer (ModelError, as are stop ids it and the model leave no room for) and the training and eval
    prompts, every row validated (DataError)."""
    from rlloop.model import check_stop_ids, load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    check_stop_ids(cfg, tokenizer)
    data, eval_data = load_datasets(cfg, tokenizer)
    for prompts in (data, eval_data):
        if prompts is not None:
            prompts.validate()
    return Inputs(tokenizer, data, eval_data)
