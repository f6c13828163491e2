"""JaxEngine: the bucketed, compiled rollout engine (continuous batching over a static KV cache).

Three kinds of compiled programs (rollout/programs.py), one per bucket, all built in `warmup()`:
  prefill/P  packed prompts, P tokens, K/V written straight into their slots
  copy/M     GRPO fan-out: copy M slot rows (a prompt's KV into its other samples' slots)
  decode/B   `steps_per_dispatch` decode steps for rows 0..B-1 in one on-device scan, sampling included
Every input is an array of a bucket's shape; the cache is donated and updated in place. Steady state therefore
compiles nothing, and rollout.compiles counts XLA compiles so that tests can prove it.

The host loop is thin: per dispatch it uploads the rows of a `DecodeState` (a few [B] arrays), reads back [K, B]
tokens / log-probs / an emitted mask in one transfer, scatters them into per-slot output buffers with numpy, and
recycles the slots of rows that finished (EOS / stop ids / max_new_tokens) for waiting samples. It keeps counters
only; what they cost in FLOPs and bytes is rollout.cost's arithmetic.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from rollout import cost
from rollout.buckets import default_decode_buckets, default_prefill_buckets, pick_bucket, validate_buckets
from rollout.compiles import compile_count
from rollout.decode_state import FREE, LENGTH, RUNNING, STOPPED, DecodeState
from rollout.engine_config import EngineConfig
from rollout.kv_cache import init_cache
from rollout.model_config import ModelConfig
from rollout.programs import copy_program, decode_program, prefill_program
from rollout.scheduler import Admission, Request, Scheduler, pack_prefills
from rollout.sharding import cache_sharding, check_tp, make_mesh, param_shardings
from rollout.types import MAX_STOP_IDS, Completion, SamplingParams, check_requests, request_id
from rollout.weight_table import copies_tied_head
from rollout.weights import (
    load_safetensors_dir,
    params_from_named_arrays,
    resolve_model_dir,
    zero_weights,
)

__all__ = ["EngineConfig", "JaxEngine", "DecodeState"]

_FINISH_REASON = {STOPPED: "stop", LENGTH: "length"}


@dataclass
class GenerateTally:
    """What one generate() ran, for its stats (`JaxEngine.stats`)."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_lens: list[int] = field(default_factory=list)  # tokens of each prefill (a prompt's all but its last)
    prefill_padded: int = 0  # prefill positions run, padding included
    decode_rows: int = 0  # decode rows run, padding included
    decode_emitted: int = 0  # of those, rows that emitted a token
    copy_rows: int = 0  # rows the fan-out copy ran (its bucket's, padding included): prompt KV to siblings
    dispatches: int = 0
    bytes: float = 0.0  # read and written, by rollout.cost's count


class JaxEngine:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.model_dir = resolve_model_dir(cfg.model_path)
        self.model_cfg = mc = ModelConfig.from_dir(self.model_dir)
        check_tp(mc, cfg.tp)
        self.prefill_buckets = validate_buckets(
            "prefill_buckets", cfg.prefill_buckets or default_prefill_buckets(cfg.max_seq_len - 1), cfg.max_seq_len - 1
        )
        self.decode_buckets = validate_buckets(
            "decode_buckets", cfg.decode_buckets or default_decode_buckets(cfg.max_batch), cfg.max_batch, True
        )
        self.mesh = make_mesh(cfg.tp)
        self._itemsize = jnp.dtype(cfg.dtype).itemsize
        self.platform = self.mesh.devices.flat[0].platform  # cpu, gpu or tpu: picks the cache dtype and its reads
        self._cache_dtype = jnp.dtype(cost.cache_dtype(cfg.dtype, self.platform))
        self.whole_cache = cost.reads_whole_cache(cfg.max_seq_len, self.platform, cfg.decode_attention)
        self.page_len = cost.cache_page_len(cfg.max_seq_len, self.platform, cfg.decode_attention)

        # Weights: the safetensors in model_path when there are any, else zeros until load_weights() (the RL loop
        # pushes the trainer's weights); generate() refuses to run on the zeros.
        self._head_copy = copies_tied_head(mc, self.platform)
        self._shardings = param_shardings(mc, self.mesh, self._head_copy)
        self.weight_version: int | None = None
        self._host_params = None  # the weights while released (colocation)
        try:
            named = load_safetensors_dir(self.model_dir)
        except ValueError:
            named = None
        if named is not None:
            self.load_weights(named, 0)
        else:
            self.params = jax.device_put(zero_weights(mc, cfg.dtype, self._head_copy), self._shardings)
        self.cache = self._new_cache()
        self._static = dict(mc=mc, cache_sh=cache_sharding(self.mesh))
        # fan-out copies only the positions a prompt can occupy (prefill takes all but a prompt's last token)
        self._copy_len = self.prefill_buckets[-1]
        self._stats: dict[str, float] = {}

    def _new_cache(self):
        mc, cfg = self.model_cfg, self.cfg
        return init_cache(
            mc.num_layers,
            cfg.max_batch,
            mc.num_kv_heads,
            cfg.max_seq_len,
            mc.head_dim,
            self._cache_dtype,
            cache_sharding(self.mesh),
            self.page_len,
        )

    # -- colocation: give the chips' memory to a trainer in between generations ---------------------------------
    def release(self) -> None:
        """Delete the KV cache and the device weights (a host copy of the weights is kept); `resume()` rebuilds
        both with the same layouts, so nothing recompiles."""
        if self._host_params is not None:
            return
        self._host_params = jax.device_get(self.params)
        for array in jax.tree.leaves((self.params, self.cache)):
            array.delete()
        self.params = self.cache = None

    def resume(self) -> None:
        if self._host_params is None:
            return
        self.params = jax.device_put(self._host_params, self._shardings)
        self.cache, self._host_params = self._new_cache(), None

    def device_bytes(self) -> int:
        """Bytes JAX holds on this process's devices: where the device reports its allocator's figures (GPU, TPU),
        the larger of what is in use and what its pool keeps (a pooling allocator keeps what release() freed, unless
        JAX runs with XLA_PYTHON_CLIENT_ALLOCATOR=platform: counting live arrays would show memory given back that
        the trainer cannot have); elsewhere the live arrays'."""
        stats = [d.memory_stats() for d in jax.local_devices()]
        if all(stats):
            return sum(max(s.get("bytes_in_use", 0), s.get("pool_bytes", 0)) for s in stats)
        return sum(a.nbytes for a in jax.live_arrays())

    def _decode_dispatch(self, state: DecodeState, b: int):
        """Run one decode dispatch on rows 0..b-1; the cache is replaced, the rest is returned (on device)."""
        self.cache, new, toks, logps, emitted = decode_program(
            self.params,
            self.cache,
            state.rows(b),
            **self._static,
            steps=self.cfg.steps_per_dispatch,
            max_len=self.cfg.max_seq_len,
            whole_cache=self.whole_cache,
        )
        return new, toks, logps, emitted

    def _run_prefill(self, batch) -> None:
        self.cache = prefill_program(
            self.params, self.cache, batch.tokens, batch.positions, batch.segments, batch.slots, **self._static
        )

    def _run_copies(self, pairs: list[tuple[int, int]]) -> int:
        """Copy KV rows in chunks of the largest bucket; returns the padded pair count."""
        padded, top = 0, self.decode_buckets[-1]
        for i in range(0, len(pairs), top):
            chunk = pairs[i : i + top]
            m = pick_bucket(self.decode_buckets, len(chunk))
            src = np.zeros(m, np.int32)
            dst = np.full(m, self.cfg.max_batch, np.int32)  # padding pairs write out of range: dropped
            src[: len(chunk)], dst[: len(chunk)] = zip(*chunk)
            self.cache = copy_program(self.cache, src, dst, cache_sh=self._static["cache_sh"], length=self._copy_len)
            padded += m
        return padded

    def warmup(self) -> dict[str, float]:
        """Compile (and run once) every bucket's program; returns seconds per bucket, e.g. {"decode/8": 0.8}."""
        self.resume()  # a released engine has no cache to run them on
        times, s = {}, self.cfg.max_batch
        for p in self.prefill_buckets:
            t0 = time.perf_counter()
            z = np.zeros(p, np.int32)
            self.cache = prefill_program(self.params, self.cache, z, z, z, np.full(p, s, np.int32), **self._static)
            jax.block_until_ready(self.cache)
            times[f"prefill/{p}"] = time.perf_counter() - t0
        for m in self.decode_buckets:
            t0 = time.perf_counter()
            src, dst = np.zeros(m, np.int32), np.full(m, s, np.int32)
            self.cache = copy_program(self.cache, src, dst, cache_sh=self._static["cache_sh"], length=self._copy_len)
            jax.block_until_ready(self.cache)
            times[f"copy/{m}"] = time.perf_counter() - t0
        state = DecodeState.empty(s)
        for b in self.decode_buckets:
            t0 = time.perf_counter()
            out = self._decode_dispatch(state, b)
            jax.block_until_ready((self.cache, out))
            times[f"decode/{b}"] = time.perf_counter() - t0
        return times

    # -- weights ----------------------------------------------------------------------------------------------------
    def load_weights(self, named_arrays: Mapping[str, np.ndarray], version: int) -> None:
        """Swap in new HF-named weights (same shapes, so nothing recompiles); later completions carry `version`.

        Everything is validated before anything is replaced: a bad dict leaves the current weights in place.
        """
        host = params_from_named_arrays(self.model_cfg, named_arrays, self.cfg.dtype, self._head_copy)
        if self._host_params is not None:  # released (colocation): applied when it resumes
            self._host_params = host
        else:
            # The old weights go before the new ones arrive, as vLLM and slime update in place: two copies at once
            # are ~8 GB a chip more than the memory plan gives a 4B model. (A dispatch still running holds its own.)
            # Until the new ones are in, there are none: a failed transfer (out of device memory) must not leave
            # the old version's number on no weights.
            self.weight_version, self.params = None, None
            self.params = jax.device_put(host, self._shardings)
        self.weight_version = int(version)

    # -- generation -------------------------------------------------------------------------------------------------
    def _validate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> np.ndarray:
        if self.weight_version is None:
            raise ValueError(
                f"no weights loaded: {self.model_dir!r} has no safetensors, or the last load_weights() failed; "
                "call load_weights()"
            )
        check_requests(prompts, n, sampling, self.cfg.max_seq_len, self.model_cfg.vocab_size)
        limit = self.prefill_buckets[-1]
        for i, p in enumerate(prompts):
            if len(p) > limit:
                raise ValueError(f"prompt {i} has {len(p)} tokens, above the largest prefill bucket {limit}")
        stop = sampling.stop_ids(self.model_cfg.eos_token_ids)
        if len(stop) > MAX_STOP_IDS:
            raise ValueError(f"{len(stop)} stop token ids (eos included), above the limit MAX_STOP_IDS={MAX_STOP_IDS}")
        row = np.full(MAX_STOP_IDS, -1, np.int32)
        row[: len(stop)] = stop
        return row

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: SamplingParams,
        between_dispatches: Callable[[], None] | None = None,
    ) -> list[Completion]:
        """`n` samples of every prompt, sorted by (prompt_index, sample_index), each tagged with the weight versions
        that started and finished it. `between_dispatches()` runs before every decode dispatch: weights it loads
        apply from the next token on (an in-flight update), for running rows and newly admitted ones alike."""
        stop_row = self._validate(prompts, n, sampling)
        self.resume()  # a released engine takes its memory back
        t_start, compiles_before = time.perf_counter(), compile_count()
        slots, max_new = self.cfg.max_batch, sampling.max_new_tokens
        sched = Scheduler(slots)
        # the sampling key of a sample depends on (seed, prompt_index, sample_index, position) only
        sched.add([Request(i, j, list(p), request_id(i, j)) for i, p in enumerate(prompts) for j in range(n)])
        state = DecodeState.empty(slots)
        state.set_sampling(sampling, stop_row, self.cfg.seed)
        out_tok = np.zeros((slots, max_new), np.int32)
        out_lp = np.zeros((slots, max_new), np.float32)
        start_version = np.zeros(slots, np.int64)  # weight version each slot's sample started with
        done: list[Completion] = []
        st = GenerateTally()

        while sched.has_work():
            if between_dispatches is not None:
                between_dispatches()
            adm = sched.admit()
            if adm.requests:
                t0 = time.perf_counter()
                self._admit(adm, state, max_new, st)
                start_version[adm.slots] = self.weight_version
                for src, dst in adm.copies:  # a copied prompt KV is as old as its source's: the version it started on
                    start_version[dst] = start_version[src]
                jax.block_until_ready(self.cache)
                st.prefill_s += time.perf_counter() - t0
            b = pick_bucket(self.decode_buckets, sched.extent())
            t0 = time.perf_counter()
            new, toks, logps, emitted = self._decode_dispatch(state, b)
            tok, pos, n_gen, finish, toks, logps, emitted = jax.device_get(
                (new.tok, new.pos, new.n_gen, new.finish, toks, logps, emitted)
            )
            st.decode_s += time.perf_counter() - t0
            st.dispatches += 1
            st.decode_rows += emitted.size
            st.decode_emitted += int(emitted.sum())
            st.bytes += self._dispatch_bytes(state, b)

            # scatter this dispatch's tokens into the per-slot output buffers (vectorised: no per-token Python)
            step_idx = state.n_gen[None, :b] + np.cumsum(emitted, axis=0) - 1
            _, cols = np.nonzero(emitted)
            out_tok[cols, step_idx[emitted]] = toks[emitted]
            out_lp[cols, step_idx[emitted]] = logps[emitted]
            state.update(b, tok, pos, n_gen, finish)

            for slot in np.nonzero((finish == STOPPED) | (finish == LENGTH))[0]:
                req, k = sched.release(int(slot)), int(n_gen[slot])
                done.append(
                    Completion(
                        req.prompt_index,
                        req.sample_index,
                        out_tok[slot, :k].tolist(),
                        out_lp[slot, :k].tolist(),
                        _FINISH_REASON[int(finish[slot])],
                        int(start_version[slot]),
                        self.weight_version,
                    )
                )
                state.finish[slot] = FREE

        done.sort(key=lambda c: (c.prompt_index, c.sample_index))
        self._record_stats(st, done, prompts, t_start, compiles_before)
        return done

    def _dispatch_bytes(self, state: DecodeState, b: int) -> float:
        """Bytes a decode dispatch of bucket `b` reads (rollout.cost), its KV counted at the longest running row's
        position after the dispatch's last step; `state` is the state the dispatch started from."""
        live = state.pos[:b][state.finish[:b] == RUNNING]
        kv_len = int(live.max()) + self.cfg.steps_per_dispatch if live.size else 1
        return cost.decode_bytes(
            self.model_cfg,
            self._itemsize,
            self.cfg.steps_per_dispatch,
            b,
            self.cfg.max_seq_len,
            kv_len,
            self._cache_dtype.itemsize,
            self.whole_cache,
            self.page_len,
        )

    def _admit(self, adm: Admission, state: DecodeState, max_new: int, st: GenerateTally) -> None:
        """Prefill each new prompt once (all but its last token), fan its KV out, and arm the slots for decode."""
        st.prefill_lens += [len(p) - 1 for _, p in adm.prefill]
        for batch in pack_prefills([(s, p[:-1]) for s, p in adm.prefill], self.prefill_buckets, self.cfg.max_batch):
            self._run_prefill(batch)
            st.prefill_padded += batch.tokens.size
            st.bytes += cost.prefill_bytes(
                self.model_cfg, self._itemsize, batch.tokens.size, self._cache_dtype.itemsize
            )
        if adm.copies:
            rows = self._run_copies(adm.copies)
            st.copy_rows += rows
            st.bytes += cost.copy_bytes(self.model_cfg, self._cache_dtype.itemsize, rows, self._copy_len)
        for slot, req in zip(adm.slots, adm.requests):
            # The last prompt token is fed to the first decode step, which samples the first new token.
            state.arm(slot, req.prompt[-1], len(req.prompt) - 1, max_new, req.request_id)

    def _record_stats(
        self, st: GenerateTally, done: list[Completion], prompts, t_start: float, compiles_before: int
    ) -> None:
        gen = sum(len(c.token_ids) for c in done)
        flops = cost.generate_flops(
            self.model_cfg, st.prefill_lens, ((len(prompts[c.prompt_index]), len(c.token_ids)) for c in done)
        )
        prefill_tokens = sum(st.prefill_lens)
        busy = st.prefill_s + st.decode_s
        wall = time.perf_counter() - t_start
        padded = st.prefill_padded + st.decode_rows
        pad = padded - prefill_tokens - st.decode_emitted
        self._stats = dict(
            compiles=float(compile_count() - compiles_before),
            total_compiles=float(compile_count()),
            pad_frac=pad / max(padded, 1),
            padded_slots=float(padded),  # prefill positions and decode rows run, padding included
            pad_slots=float(pad),
            prefill_s=st.prefill_s,
            decode_s=st.decode_s,
            wall_s=wall,
            tok_s=gen / max(wall, 1e-9),
            gen_tokens=float(gen),
            prompt_tokens=float(sum(len(prompts[c.prompt_index]) for c in done)),
            prefill_tokens=float(prefill_tokens),
            dispatches=float(st.dispatches),
            copy_rows=float(st.copy_rows),
            flops=flops,
            bytes=st.bytes,
            flop_s=flops / max(busy, 1e-9),
            bytes_s=st.bytes / max(busy, 1e-9),
            weight_version=float(self.weight_version),
        )

    def stats(self) -> dict[str, float]:
        """Figures of the last generate() (see _record_stats) plus total_compiles over the process."""
        return dict(self._stats) if self._stats else {"compiles": 0.0, "total_compiles": float(compile_count())}
