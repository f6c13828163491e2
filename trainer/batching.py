"""What the trainer eats: the TrainBatch it is given, its validation, and packing into padded micro-batches.

A sample is prompt + response token ids. Micro-batches hold whole rows, padded on the right to the longest one,
and are packed greedily to a token budget (rows × padded length) after sorting by length, so that similar lengths
share a micro-batch and little compute goes to padding.

A row is one sample (prompt + response), or, with shared prompts (`TrainerConfig.share_prompts`), one prompt
followed by several of its GRPO samples' responses: `prompt r1 r2 ... rk`. Each response then sees the prompt and
itself only (the micro-batch's `segments` say which tokens are what; trainer/shared_prompts.py turns them into
the attention mask) and has the positions it would have after the prompt alone, so every log-prob is the one of the
plain layout, but the prompt is run once per row instead of once per sample.
"""

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class TrainBatch:
    prompts: list[list[int]]  # prompt token ids per sample
    responses: list[list[int]]  # response token ids per sample
    advantages: list[float]  # one per sample
    rollout_logprobs: list[list[float]] | None = None  # per response token, from the rollout engine (None: no TIS)

    def __len__(self) -> int:
        return len(self.prompts)

    def select(self, indices: list[int]) -> "TrainBatch":
        return TrainBatch(
            [self.prompts[i] for i in indices],
            [self.responses[i] for i in indices],
            [self.advantages[i] for i in indices],
            None if self.rollout_logprobs is None else [self.rollout_logprobs[i] for i in indices],
        )


def validate_batch(batch: TrainBatch, vocab_size: int) -> None:
    """Raise ValueError naming the first field that is malformed; touch nothing."""
    n = len(batch.prompts)
    if n == 0:
        raise ValueError("TrainBatch.prompts is empty")
    fields = {"responses": batch.responses, "advantages": batch.advantages}
    if batch.rollout_logprobs is not None:
        fields["rollout_logprobs"] = batch.rollout_logprobs
    for name, values in fields.items():
        if len(values) != n:
            raise ValueError(f"TrainBatch.{name} has {len(values)} entries but prompts has {n}")
    for i in range(n):
        if len(batch.prompts[i]) == 0:
            raise ValueError(f"TrainBatch.prompts[{i}] is empty (the first response token needs a context)")
        if len(batch.responses[i]) == 0:
            raise ValueError(f"TrainBatch.responses[{i}] is empty")
        if batch.rollout_logprobs is not None:
            if len(batch.rollout_logprobs[i]) != len(batch.responses[i]):
                raise ValueError(
                    f"TrainBatch.rollout_logprobs[{i}] has {len(batch.rollout_logprobs[i])} values but "
                    f"responses[{i}] has {len(batch.responses[i])} tokens"
                )
            if not np.isfinite(np.asarray(batch.rollout_logprobs[i], dtype=np.float64)).all():
                raise ValueError(f"TrainBatch.rollout_logprobs[{i}] holds a non-finite value")
        if not math.isfinite(float(batch.advantages[i])):
            raise ValueError(f"TrainBatch.advantages[{i}] is {batch.advantages[i]}")
        for name in ("prompts", "responses"):
            ids = getattr(batch, name)[i]
            lo, hi = min(ids), max(ids)
            if lo < 0 or hi >= vocab_size:
                raise ValueError(
                    f"TrainBatch.{name}[{i}] holds token id {lo if lo < 0 else hi} outside the "
                    f"vocabulary [0, {vocab_size})"
                )


def shard_batch(batch: TrainBatch, rank: int, world_size: int) -> TrainBatch:
    """This rank's share: samples rank, rank + world_size, ... (strided, so that when the sample count divides by
    world_size × minibatches, every minibatch across ranks holds the same samples as the single-rank minibatch)."""
    if len(batch) < world_size:
        raise ValueError(f"TrainBatch has {len(batch)} samples, fewer than world_size={world_size}")
    return batch.select(list(range(rank, len(batch), world_size)))


def split_minibatches(n: int, minibatches: int) -> list[list[int]]:
    """Contiguous, near-equal index ranges: one per optimizer step."""
    if not 1 <= minibatches <= n:
        raise ValueError(f"minibatches={minibatches} needs 1 <= minibatches <= samples ({n})")
    base, extra = divmod(n, minibatches)
    out, start = [], 0
    for k in range(minibatches):
        size = base + (k < extra)
        out.append(list(range(start, start + size)))
        start += size
    return out


def pack_micro_batches(lengths: dict[int, int], token_budget: int) -> list[list[int]]:
    """Group sample indices into micro-batches whose rows × padded length stays within `token_budget`.

    Longest first, so each micro-batch's padded length is its first sample's; a sample longer than the budget
    gets a micro-batch of its own rather than an error.
    """
    order = sorted(lengths, key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= token_budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def row_length(batch: TrainBatch, row: list[int]) -> int:
    """Tokens in a row: its (shared) prompt once, then every sample's response."""
    return len(batch.prompts[row[0]]) + sum(len(batch.responses[i]) for i in row)


def shared_prompt_rows(batch: TrainBatch, indices: list[int], token_budget: int) -> list[list[int]]:
    """`indices` grouped into rows of samples with the same prompt (in order of first appearance), each row's
    prompt + responses within `token_budget` where it can be (a row always takes at least one sample)."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i in indices:
        by_prompt.setdefault(tuple(batch.prompts[i]), []).append(i)
    rows = []
    for prompt, members in by_prompt.items():
        row, length = [], len(prompt)
        for i in members:
            if row and length + len(batch.responses[i]) > token_budget:
                rows.append(row)
                row, length = [], len(prompt)
            row.append(i)
            length += len(batch.responses[i])
        rows.append(row)
    return rows


@dataclass
class MicroBatch:
    indices: list[int]  # samples' positions in the TrainBatch; the per-sample tensors below follow this order
    input_ids: torch.Tensor  # [rows, L] each row a prompt then one or more responses, right-padded with pad_id
    attention_mask: torch.Tensor  # [rows, L] 1 on real tokens
    row_of: torch.Tensor  # [S] the row that holds each sample
    response_start: torch.Tensor  # [S] column of each sample's first response token in its row
    context_end: torch.Tensor  # [S] column of its prompt's last token: what predicts the first response token
    response_mask: torch.Tensor  # [S, R] 1.0 on real response tokens
    advantages: torch.Tensor  # [S] float32
    rollout_logp: torch.Tensor | None  # [S, R] float32
    # Shared prompts only (None when every row is one sample): per token, -1 padding, 0 prompt, j the row's j-th
    # response; and each token's position (a response's positions continue its prompt's, not the row's columns).
    segments: torch.Tensor | None = None  # [rows, L]
    position_ids: torch.Tensor | None = None  # [rows, L]

    @property
    def num_tokens(self) -> int:
        return int(self.response_mask.sum().item())


def collate(batch: TrainBatch, indices: list[int], pad_id: int = 0) -> MicroBatch:
    """One sample per row."""
    return collate_rows(batch, [[i] for i in indices], pad_id)


def collate_rows(batch: TrainBatch, rows: list[list[int]], pad_id: int = 0) -> MicroBatch:
    """`rows`: lists of sample indices; the samples of a row must share their prompt (`shared_prompt_rows`)."""
    indices = [i for row in rows for i in row]
    width, resp_width = max(row_length(batch, row) for row in rows), max(len(batch.responses[i]) for i in indices)
    shared = any(len(row) > 1 for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    segments = torch.full((len(rows), width), -1, dtype=torch.long) if shared else None
    position_ids = torch.zeros((len(rows), width), dtype=torch.long) if shared else None
    row_of, response_start, context_end = [], [], []
    for r, row in enumerate(rows):
        prompt = batch.prompts[row[0]]
        if any(batch.prompts[i] != prompt for i in row):
            raise ValueError(f"collate_rows: the samples {row} of one row do not share their prompt")
        seq = prompt + [t for i in row for t in batch.responses[i]]
        input_ids[r, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention_mask[r, : len(seq)] = 1
        col = len(prompt)
        if shared:
            segments[r, :col] = 0
            position_ids[r, :col] = torch.arange(col)
        for j, i in enumerate(row, 1):
            n = len(batch.responses[i])
            if shared:
                segments[r, col : col + n] = j
                position_ids[r, col : col + n] = torch.arange(len(prompt), len(prompt) + n)
            row_of.append(r)
            response_start.append(col)
            context_end.append(len(prompt) - 1)
            col += n
    response_mask = torch.zeros((len(indices), resp_width), dtype=torch.float32)
    rollout_logp = None if batch.rollout_logprobs is None else torch.zeros(response_mask.shape, dtype=torch.float32)
    for s, i in enumerate(indices):
        response_mask[s, : len(batch.responses[i])] = 1.0
        if rollout_logp is not None:
            rollout_logp[s, : len(batch.responses[i])] = torch.tensor(batch.rollout_logprobs[i], dtype=torch.float32)
    return MicroBatch(
        indices=indices,
        input_ids=input_ids,
        attention_mask=attention_mask,
        row_of=torch.tensor(row_of, dtype=torch.long),
        response_start=torch.tensor(response_start, dtype=torch.long),
        context_end=torch.tensor(context_end, dtype=torch.long),
        response_mask=response_mask,
        advantages=torch.tensor([float(batch.advantages[i]) for i in indices], dtype=torch.float32),
        rollout_logp=rollout_logp,
        segments=segments,
        position_ids=position_ids,
    )


def plan_micro_batches(
    batch: TrainBatch, indices: list[int], token_budget: int, pad_id: int, share_prompts: bool
) -> list[MicroBatch]:
    """The samples `indices` as micro-batches within `token_budget`: a row per sample, or per prompt and some of its
    samples (`share_prompts`)."""
    if not share_prompts:
        lengths = {i: len(batch.prompts[i]) + len(batch.responses[i]) for i in indices}
        return [collate(batch, group, pad_id) for group in pack_micro_batches(lengths, token_budget)]
    rows = shared_prompt_rows(batch, indices, token_budget)
    groups = pack_micro_batches({r: row_length(batch, row) for r, row in enumerate(rows)}, token_budget)
    return [collate_rows(batch, [rows[r] for r in group], pad_id) for group in groups]
