"""Host-side continuous batching: the waiting queue, KV slot assignment, and packing prompts into prefill buckets.

The unit of work is one sample (prompt_index, sample_index). Samples wait in FIFO order and take the lowest free KV
slot as soon as one frees up, so running rows stay packed at the low slots and the decode bucket stays small.
A prompt is prefilled once per admission wave into the slot of its first admitted sample (its "leader"); its other
samples get a copy of that KV (GRPO fan-out). If a sample of the same prompt is still running from an earlier wave,
its slot already holds the prompt's KV (decode never writes below the prompt's end), so it is copied from instead.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

import numpy as np

from rollout.buckets import pick_bucket


@dataclass
class Request:
    prompt_index: int
    sample_index: int
    prompt: list[int]
    request_id: int  # feeds the sampling key: depends only on (prompt_index, sample_index)


@dataclass
class PrefillBatch:
    """One packed prefill call: arrays of length `bucket`; padding tokens target slot `num_slots` (dropped)."""

    tokens: np.ndarray
    positions: np.ndarray
    segments: np.ndarray
    slots: np.ndarray


@dataclass
class Admission:
    slots: list[int]  # newly owned slots, aligned with `requests`
    requests: list[Request]
    prefill: list[tuple[int, list[int]]]  # (leader slot, prompt tokens to prefill)
    copies: list[tuple[int, int]]  # (source slot, destination slot)


class Scheduler:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self._free = list(range(num_slots))  # min-heap: lowest slot first

    def add(self, requests: list[Request]) -> None:
        self.waiting.extend(requests)

    def release(self, slot: int) -> Request:
        heapq.heappush(self._free, slot)
        return self.running.pop(slot)

    def extent(self) -> int:
        """Rows a decode step must cover: highest running slot + 1."""
        return max(self.running) + 1 if self.running else 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> Admission:
        """Move waiting samples into free slots; plan their prefills (one per prompt) and KV copies."""
        adm = Admission([], [], [], [])
        # Slots already holding a prompt's KV: running samples, then leaders chosen in this wave.
        holder = {req.prompt_index: slot for slot, req in self.running.items()}
        while self.waiting and self._free:
            req, slot = self.waiting.popleft(), heapq.heappop(self._free)
            self.running[slot] = req
            adm.slots.append(slot)
            adm.requests.append(req)
            src = holder.get(req.prompt_index)
            if src is None:
                holder[req.prompt_index] = slot
                adm.prefill.append((slot, req.prompt))
            else:
                adm.copies.append((src, slot))
        return adm


def pack_prefills(
    prefills: list[tuple[int, list[int]]], buckets: tuple[int, ...], num_slots: int
) -> list[PrefillBatch]:
    """Pack (slot, tokens) pairs first-fit in order into batches no longer than the largest bucket."""
    batches, current, used = [], [], 0
    for slot, toks in prefills:
        if not toks:
            continue
        if used + len(toks) > buckets[-1]:
            batches.append(current)
            current, used = [], 0
        current.append((slot, toks))
        used += len(toks)
    if current:
        batches.append(current)
    out = []
    for group in batches:
        size = pick_bucket(buckets, sum(len(t) for _, t in group))
        tokens = np.zeros(size, np.int32)
        positions = np.zeros(size, np.int32)
        segments = np.full(size, -1, np.int32)
        slots = np.full(size, num_slots, np.int32)
        at = 0
        for seg, (slot, toks) in enumerate(group):
            n = len(toks)
            tokens[at : at + n] = toks
            positions[at : at + n] = np.arange(n)
            segments[at : at + n] = seg
            slots[at : at + n] = slot
            at += n
        out.append(PrefillBatch(tokens, positions, segments, slots))
    return out
