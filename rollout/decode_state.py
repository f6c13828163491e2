"""The per-slot decode state of the JAX engine, as a registered dataclass pytree: the host keeps it in numpy over all
KV slots and uploads the rows of a decode bucket; the compiled decode program takes one and returns the next."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import jax
import numpy as np

from rollout.types import MAX_STOP_IDS, SamplingParams, mix_seed

RUNNING, STOPPED, LENGTH, FREE = 0, 1, 2, 3  # per-slot finish state


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DecodeState:
    """Per-slot decode state, one entry (row) per KV slot.

    The engine keeps a host copy of numpy arrays over all slots (`empty`, `arm`, `set_sampling` write into it),
    uploads `rows(b)` for a decode bucket of b rows, and the decode program returns the updated device copy.
    """

    tok: np.ndarray  # [S] int32 the row's last token, fed to the next step
    pos: np.ndarray  # [S] int32 that token's position
    n_gen: np.ndarray  # [S] int32 tokens generated so far
    finish: np.ndarray  # [S] int32 RUNNING / STOPPED / LENGTH / FREE
    max_new: np.ndarray  # [S] int32
    temp: np.ndarray  # [S] float32 sampling settings (rollout.sampler)
    top_k: np.ndarray  # [S] int32
    top_p: np.ndarray  # [S] float32
    seed: np.ndarray  # [S] int32
    rid: np.ndarray  # [S] int32 request id (rollout.types.request_id)
    stop: np.ndarray  # [S, MAX_STOP_IDS] int32 stop ids, padded with -1

    @classmethod
    def empty(cls, slots: int) -> "DecodeState":
        zeros = partial(np.zeros, slots)
        return cls(
            tok=zeros(np.int32),
            pos=zeros(np.int32),
            n_gen=zeros(np.int32),
            finish=np.full(slots, FREE, np.int32),
            max_new=zeros(np.int32),
            temp=zeros(np.float32),
            top_k=zeros(np.int32),
            top_p=np.ones(slots, np.float32),
            seed=zeros(np.int32),
            rid=zeros(np.int32),
            stop=np.full((slots, MAX_STOP_IDS), -1, np.int32),
        )

    def rows(self, b: int) -> "DecodeState":
        """The first b rows (views), what a decode bucket of b rows uploads."""
        return type(self)(*(getattr(self, f.name)[:b] for f in dataclasses.fields(self)))

    def set_sampling(self, sp: SamplingParams, stop_row: np.ndarray, engine_seed: int) -> None:
        self.temp[:], self.top_k[:], self.top_p[:] = sp.temperature, sp.top_k, sp.top_p
        self.seed[:] = mix_seed(engine_seed, sp.seed)
        self.stop[:] = stop_row

    def arm(self, slot: int, token: int, pos: int, max_new: int, rid: int) -> None:
        self.tok[slot], self.pos[slot], self.n_gen[slot] = token, pos, 0
        self.finish[slot], self.max_new[slot], self.rid[slot] = RUNNING, max_new, rid

    def update(self, b: int, tok, pos, n_gen, finish) -> None:
        """Write a dispatch's results for rows 0..b-1 back into the host copy."""
        self.tok[:b], self.pos[:b], self.n_gen[:b], self.finish[:b] = tok, pos, n_gen, finish
