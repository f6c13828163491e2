"""What the trainer eats: the TrainBatch it is given, its validation, and packing into padded micro-batches.

A sample is prompt + response token ids. Micro-batches hold whole samples, padded on the right to the longest one,
and are packed greedily to a token budget (rows × padded length) after sorting by length, so that similar lengths
share a micro-batch and little compute goes to padding.
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


@dataclass
class MicroBatch:
    indices: list[int]  # rows' positions in the TrainBatch
    input_ids: torch.Tensor  # [B, L] prompt + response, right-padded with pad_id
    attention_mask: torch.Tensor  # [B, L]
    response_start: torch.Tensor  # [B] column of each row's first response token
    response_mask: torch.Tensor  # [B, R] 1.0 on real response tokens
    advantages: torch.Tensor  # [B] float32
    rollout_logp: torch.Tensor | None  # [B, R] float32

    @property
    def num_tokens(self) -> int:
        return int(self.response_mask.sum().item())


def collate(batch: TrainBatch, indices: list[int], pad_id: int = 0) -> MicroBatch:
    seqs = [batch.prompts[i] + batch.responses[i] for i in indices]
    rows, width = len(indices), max(len(s) for s in seqs)
    resp_width = max(len(batch.responses[i]) for i in indices)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((rows, width), dtype=torch.long)
    response_mask = torch.zeros((rows, resp_width), dtype=torch.float32)
    rollout_logp = None if batch.rollout_logprobs is None else torch.zeros((rows, resp_width), dtype=torch.float32)
    for r, i in enumerate(indices):
        input_ids[r, : len(seqs[r])] = torch.tensor(seqs[r], dtype=torch.long)
        attention_mask[r, : len(seqs[r])] = 1
        response_mask[r, : len(batch.responses[i])] = 1.0
        if rollout_logp is not None:
            rollout_logp[r, : len(batch.responses[i])] = torch.tensor(batch.rollout_logprobs[i], dtype=torch.float32)
    return MicroBatch(
        indices=list(indices),
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_start=torch.tensor([len(batch.prompts[i]) for i in indices], dtype=torch.long),
        response_mask=response_mask,
        advantages=torch.tensor([float(batch.advantages[i]) for i in indices], dtype=torch.float32),
        rollout_logp=rollout_logp,
    )
