"""Reference rollout backend on `transformers.generate`: the baseline the JAX decoder is measured and checked against.

It is deliberately plain: left-pad the prompts, run `model.generate` in batches, and read log-probs from the
processed scores (the logits after temperature / top-k / top-p, i.e. the distribution that was actually sampled
from), one step at a time (`Sampler`): `output_scores=True` would keep every step's full-vocabulary scores,
rows × steps × vocabulary floats (1.3 TB for 256 rows of 8,192 tokens over Qwen's 151,936). The draw is the
`Sampler`'s too, from a generator of the call's own seeded with `mix_seed(seed, SamplingParams.seed)`, so a call is
reproducible whatever else the process does; unlike the JAX sampler, a row's draw depends on the rest of its batch.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Callable, Mapping

import numpy as np
import torch
import transformers

from rollout.engine_config import EngineConfig
from rollout.model_config import eos_token_ids
from rollout.types import Completion, RolloutEngine, SamplingParams, check_float_array, check_requests, mix_seed


def numpy_to_torch(array: np.ndarray) -> torch.Tensor:
    """numpy / ml_dtypes array -> torch tensor; bfloat16 goes through its raw bits (numpy has no native bf16)."""
    array = np.ascontiguousarray(array)
    with warnings.catch_warnings():
        # Read-only arrays (mmap'd checkpoints, shared memory) are fine: the tensor is only copied from.
        warnings.filterwarnings("ignore", message=".*not writable.*")
        if array.dtype.name == "bfloat16":
            return torch.from_numpy(array.view(np.uint16).view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)


class Sampler(transformers.LogitsProcessor):
    """The last of the logits processors: draws each step's token from the processed scores, as generate's sampling
    does (softmax, one multinomial draw per row), but from `generator` (None: the argmax), keeps that token's log-prob,
    and leaves generate's own greedy pick only that token. generate draws from torch's global RNG, which any thread
    of the process may seed or rewind meanwhile: in a run without Ray the trainer's checkpointed recomputes did, and
    a resumed async run sampled other tokens than the run it resumed. One step's scores in memory, never all."""

    def __init__(self, generator: torch.Generator | None):
        self.generator = generator
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.generator is None:
            tokens = scores.argmax(dim=-1, keepdim=True)
        else:
            tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1, generator=self.generator)
        self.steps.append(torch.log_softmax(scores.float(), dim=-1).gather(-1, tokens)[:, 0])
        return torch.full_like(scores, -math.inf).scatter_(-1, tokens, 0.0)

    def logprobs(self) -> torch.Tensor:
        """[rows, steps] log-probs of the drawn tokens."""
        return torch.stack(self.steps, dim=1)


class HFEngine(RolloutEngine):
    """`RolloutEngine` backed by a Hugging Face causal LM and `model.generate`."""

    def __init__(self, cfg: EngineConfig, device: str = "cpu"):
        """The model of `cfg.model_path` on torch device `device`. Of the JAX engine's settings it keeps dtype,
        trust_remote_code, max_batch (rows per generate batch), max_seq_len (the bound on prompt + response that
        the JAX engine's cache sets) and seed (mixed into every request's)."""
        self.device = torch.device(device)
        self.max_batch, self.max_seq_len, self.seed = cfg.max_batch, cfg.max_seq_len, cfg.seed
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            cfg.model_path, dtype=getattr(torch, cfg.dtype), trust_remote_code=cfg.trust_remote_code
        )
        self.model.to(self.device).eval()
        cfg = self.model.config
        self.vocab_size = cfg.vocab_size
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        self.pad_token_id = pad[0] if isinstance(pad, (list, tuple)) else int(pad)
        # The model's own EOS ids, read by the function the JAX engine's model config uses: generation_config.json
        # (as transformers loaded it), else config.json.
        self.eos_token_ids = eos_token_ids(cfg.to_dict(), self.model.generation_config.to_dict())
        # Replace the checkpoint's generation defaults (Qwen3 ships T=0.6, top_k=20, ...) and its eos ids: every
        # knob comes from SamplingParams, and rows stop only on the ids `sampling.stop_ids` returns.
        self.model.generation_config = transformers.GenerationConfig(pad_token_id=self.pad_token_id)
        self.weight_version = 0
        self._stats = {"gen_tokens": 0.0, "wall_s": 0.0, "tok_s": 0.0, "weight_version": 0.0}

    def warmup(self) -> dict[str, float]:
        """Nothing to compile: transformers runs eagerly."""
        return {}

    def release(self) -> None:
        """Colocation: the model leaves the accelerator (on CPU there is nothing to free)."""
        if self.device.type != "cpu":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def resume(self) -> None:
        if self.device.type != "cpu":
            self.model.to(self.device)

    def device_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: SamplingParams,
        between_dispatches: Callable[[], None] | None = None,
    ) -> list[Completion]:
        """`model.generate` over batches of rows; `between_dispatches` runs before each batch (weights load between
        batches, never inside one)."""
        check_requests(prompts, n, sampling, self.max_seq_len, self.vocab_size)
        self.resume()  # a released (colocated) model comes back to its device first, as the JAX engine's does
        # One row per sample, in (prompt_index, sample_index) order, so results come back already ordered.
        rows = [(p, s) for p in range(len(prompts)) for s in range(n)]
        start = time.perf_counter()
        completions: list[Completion] = []
        generator = None
        if not sampling.greedy:  # one stream for the call's batches, as torch's global RNG was
            generator = torch.Generator(self.device).manual_seed(mix_seed(self.seed, sampling.seed))
        with torch.inference_mode():
            for lo in range(0, len(rows), self.max_batch):
                chunk = rows[lo : lo + self.max_batch]
                if between_dispatches is not None:
                    between_dispatches()
                completions += self._generate_batch([prompts[p] for p, _ in chunk], chunk, sampling, generator)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for c in completions)
        self._stats = {  # the JAX engine's names for them
            "gen_tokens": float(tokens),
            "wall_s": seconds,
            "tok_s": tokens / max(seconds, 1e-9),
            "weight_version": float(self.weight_version),
        }
        return completions

    def _generate_batch(
        self, batch_prompts, row_ids, sampling: SamplingParams, generator: torch.Generator | None
    ) -> list[Completion]:
        width = max(len(p) for p in batch_prompts)
        input_ids = torch.full((len(batch_prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for r, prompt in enumerate(batch_prompts):  # left padding: every row's next token lands in the last column
            input_ids[r, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[r, width - len(prompt) :] = 1
        stop_ids = sampling.stop_ids(self.eos_token_ids)
        # The warpers are ours, in generate's own order (temperature, top-k, top-p), and the sampler after them.
        # generate itself runs greedy: it builds no warpers of its own and takes the one token the sampler leaves.
        sampler = Sampler(generator)
        processors = []
        if not sampling.greedy:
            processors.append(transformers.TemperatureLogitsWarper(sampling.temperature))
            if sampling.top_k > 0:
                processors.append(transformers.TopKLogitsWarper(sampling.top_k))
            if sampling.top_p < 1.0:
                processors.append(transformers.TopPLogitsWarper(sampling.top_p))
        sequences = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            max_new_tokens=sampling.max_new_tokens,
            min_new_tokens=0,
            eos_token_id=list(stop_ids) or None,
            pad_token_id=self.pad_token_id,
            do_sample=False,
            logits_processor=transformers.LogitsProcessorList([*processors, sampler]),
        )
        generated = sequences[:, width:].cpu()  # [rows, steps]
        logprobs = sampler.logprobs().cpu()

        stops = set(stop_ids)
        completions = []
        for r, (prompt_index, sample_index) in enumerate(row_ids):
            tokens = generated[r].tolist()
            # Finished rows are padded after their stop token; the pad id can be a real token, so cut by position.
            end = next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))
            tokens = tokens[:end]
            completions.append(
                Completion(
                    prompt_index=prompt_index,
                    sample_index=sample_index,
                    token_ids=tokens,
                    logprobs=logprobs[r, :end].tolist(),
                    finish_reason="stop" if tokens and tokens[-1] in stops else "length",
                    weight_version=self.weight_version,
                )
            )
        return completions

    # ------------------------------------------------------------------ weights

    def load_weights(self, named_arrays: Mapping[str, np.ndarray], version: int) -> None:
        """Copy HF-named arrays into the model: all of its tensors (a tied pair by either name). Everything is
        validated before anything is written."""
        state = self.model.state_dict()
        # RoPE's frequencies, saved as a buffer by some checkpoints and exporters: derived from the config here (as in
        # the JAX engine), never a weight to load
        named_arrays = {k: v for k, v in named_arrays.items() if not k.endswith("rotary_emb.inv_freq")}
        unknown = sorted(set(named_arrays) - set(state))
        if unknown:
            raise ValueError(f"unknown parameter names (not in the model): {unknown[:10]}")
        storages = {state[name].data_ptr() for name in named_arrays}
        missing = [name for name, t in state.items() if t.data_ptr() not in storages]
        if missing:  # load_state_dict(strict=False) would keep their old values under the new version
            raise ValueError(f"missing weight {missing[0]!r} ({len(missing)} missing in all)")
        tensors = {}
        for name, array in named_arrays.items():
            check_float_array(name, array)
            tensor = numpy_to_torch(array)
            if tuple(tensor.shape) != tuple(state[name].shape):
                raise ValueError(
                    f"shape mismatch for {name}: got {tuple(tensor.shape)}, model has {tuple(state[name].shape)}"
                )
            tensors[name] = tensor
        # Tied parameters (lm_head.weight / embed_tokens.weight) share storage: a checkpoint may carry either or
        # both, but if it carries both they must agree, or one would be silently overwritten by the other.
        by_storage: dict[int, list[str]] = {}
        for name in tensors:
            by_storage.setdefault(state[name].data_ptr(), []).append(name)
        for names in by_storage.values():
            if any(not torch.equal(tensors[names[0]].float(), tensors[other].float()) for other in names[1:]):
                raise ValueError(f"{' and '.join(names)} are tied in the model but differ in the given arrays")
        with torch.no_grad():
            self.model.load_state_dict(tensors, strict=False)
        self.weight_version = int(version)

    def stats(self) -> dict[str, float]:
        return dict(self._stats)
