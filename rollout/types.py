"""Plain data types every rollout backend speaks: sampling settings, one finished completion, the engine protocol,
the supported dtypes and the seed arithmetic.

These are the only rollout types that cross package boundaries (the RL loop builds `SamplingParams` and consumes
`Completion`s), so they hold plain Python values and import nothing heavy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal, Mapping, Protocol, get_args, runtime_checkable

import numpy as np

# Parameter / compute dtypes both backends support, by name; each library maps the name to its own dtype
# (`np.dtype(name)` once ml_dtypes is imported, `jnp.dtype(name)`, `getattr(torch, name)`).
DType = Literal["float32", "bfloat16"]
DTYPES: tuple[str, ...] = get_args(DType)


def mix_seed(base: int, offset: int) -> int:
    """A deterministic 31-bit combination of two seeds: the engine mixes its own seed with a request's, and the RL
    loop derives its per-step seeds from the run seed the same way."""
    return (int(base) * 1_000_003 + int(offset)) & 0x7FFFFFFF


def request_id(prompt_index: int, sample_index: int) -> int:
    """The id a sample's sampling key is folded from: a function of (prompt_index, sample_index) only, so a sample
    draws the same tokens whatever else shares its batch."""
    return (int(prompt_index) * 65537 + int(sample_index)) & 0x7FFFFFFF


INT32_MAX = 2**31 - 1  # the JAX engine holds seeds, top-k and token ids in int32
MAX_STOP_IDS = 16  # the JAX engine's stop ids per row: a fixed-width array (padded with -1), so they never recompile
# A temperature below this samples greedily (vLLM's _SAMPLING_EPS): logits / T overflows float32 long before T
# reaches 0 (|logit| 40 at T = 1e-37), and the log-prob of the token picked came out NaN.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 (or anything below GREEDY_BELOW) => greedy
    top_p: float = 1.0  # 1.0 => off; applied inside the top-k set (vLLM / HF order)
    top_k: int = -1  # -1 (or any value <= 0) => off
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    # Like vLLM: generation also stops on the model's EOS ids (generation_config.json, else config.json) unless
    # ignore_eos; stop_token_ids always apply. Benchmarks set ignore_eos so every row runs to max_new_tokens.
    ignore_eos: bool = False

    def __post_init__(self):
        # One clear error per bad field, so a typo in a config fails before any compile or model load.
        for name in ("top_k", "max_new_tokens", "seed"):  # a float was cut to an int (top_k 1.5 -> 1), or crashed
            if not isinstance(getattr(self, name), (int, np.integer)):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        if not 0.0 <= self.temperature < math.inf:
            raise ValueError(
                f"temperature must be finite and >= 0 (below GREEDY_BELOW means greedy), got {self.temperature}"
            )
        if self.top_k > INT32_MAX:  # the JAX engine holds it in int32
            raise ValueError(f"top_k must be <= {INT32_MAX} (or <= 0 for off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not isinstance(self.stop_token_ids, tuple):
            # A list would make the frozen dataclass unhashable; accept it but store a tuple.
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if any(not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids in [0, {INT32_MAX}], got {self.stop_token_ids}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def stop_ids(self, eos_token_ids) -> tuple[int, ...]:
        """Ids that end a row, sorted: the model's `eos_token_ids` (unless ignore_eos) and stop_token_ids."""
        eos = () if self.ignore_eos else eos_token_ids
        return tuple(sorted(set(eos) | set(self.stop_token_ids)))


def check_requests(prompts: list[list[int]], n: int, sampling: SamplingParams, max_seq_len: int, vocab_size: int):
    """What both backends refuse of a generate call, in the same words: no samples, an empty prompt, a prompt that
    with its new tokens passes `max_seq_len`, a token id outside the vocabulary. The JAX engine refuses two more,
    which its compiled programs fix: a prompt above its largest prefill bucket, and more than MAX_STOP_IDS stop
    ids (the model's EOS ids included)."""
    if n < 1:
        raise ValueError(f"n (samples per prompt) must be >= 1, got {n}")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty")
        if len(prompt) + sampling.max_new_tokens > max_seq_len:
            raise ValueError(
                f"prompt {i} ({len(prompt)} tokens) + max_new_tokens ({sampling.max_new_tokens}) "
                f"exceeds max_seq_len {max_seq_len}"
            )
        if min(prompt) < 0 or max(prompt) >= vocab_size:  # C-speed on every call; the list only for the message
            bad = [t for t in prompt if not 0 <= t < vocab_size]
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


@dataclass
class Completion:
    prompt_index: int  # index into the prompts list given to generate()
    sample_index: int  # 0..n-1 within its group
    token_ids: list[int]  # generated tokens (includes the stop token if one ended it)
    logprobs: list[float]  # log-prob of each generated token under the distribution actually sampled from
    finish_reason: str  # "stop" | "length"
    weight_version: int  # the version that started the sample (prefill and its first token)
    # The version that produced its last token: later than weight_version when new weights were loaded while it
    # was generating (an in-flight update; see RolloutEngine.generate's `between_dispatches`).
    last_weight_version: int | None = None

    def __post_init__(self):
        if self.last_weight_version is None:
            self.last_weight_version = self.weight_version


@runtime_checkable
class RolloutEngine(Protocol):
    """What the RL loop needs from a rollout backend (HF reference or the JAX bucketed decoder).

    `generate` returns `len(prompts) * n` completions ordered by (prompt_index, sample_index).
    `load_weights` takes numpy / ml_dtypes arrays keyed by Hugging Face parameter names.
    `stats` describes the last `generate` call (gen_tokens, wall_s, tok_s, weight_version, and backend-specific
    counters).
    `warmup` builds whatever the backend compiles and returns seconds per compiled bucket ({} if it compiles nothing).
    `between_dispatches`, if given, is called by the JAX engine before each decode dispatch, so the caller can
    `load_weights` mid-generation (PipelineRL's in-flight update: tokens after it come from the new weights); the HF
    backend calls it between its batches of rows.
    """

    def warmup(self) -> dict[str, float]: ...

    def release(self) -> None: ...  # colocation: free device memory until the next resume() / generate()

    def resume(self) -> None: ...

    def device_bytes(self) -> int: ...

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: SamplingParams,
        between_dispatches: Callable[[], None] | None = None,
    ) -> list[Completion]: ...

    def load_weights(self, named_arrays: Mapping[str, np.ndarray], version: int) -> None: ...

    def stats(self) -> dict[str, float]: ...


def check_float_array(name: str, arr) -> None:
    """Refuse weight `name` unless it is a numpy array of real floats (bf16 included): an int, bool or complex array
    would otherwise be cast into weights without a word."""
    if isinstance(arr, np.ndarray) and (np.issubdtype(arr.dtype, np.floating) or arr.dtype.name == "bfloat16"):
        return
    what = f"dtype {arr.dtype}" if isinstance(arr, np.ndarray) else f"a {type(arr).__name__}"
    raise ValueError(f"weight {name!r} is {what}, expected a numpy array of float16/32/64 or bfloat16")
