"""The engine's compiled programs (rollout/engine.py drives them): a packed prefill, the GRPO fan-out copy of cache
rows, and a scan of decode steps with sampling. Jitted at module level with the model config, the cache layout and
the loop sizes static: engines of one configuration (restarted, several in a process, tests) share compiled
programs; array shapes select the bucket; the donated cache is updated in place. The programs keep every bf16
rounding they name, as HF's bf16 forward does (no excess precision: rollout.numerics).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from rollout import model, numerics
from rollout.decode_state import LENGTH, RUNNING, STOPPED, DecodeState
from rollout.kv_cache import copy_slots
from rollout.sampler import sample

_jit = partial(jax.jit, compiler_options=numerics.COMPILER_OPTIONS)


def _constrain(cache, cache_sh):
    # Pin the cache's layout so each output matches the next call's input (GSPMD could otherwise choose another
    # sharding for an output, which would mean a re-layout and a recompile on the next call).
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, cache_sh), cache)


@partial(_jit, donate_argnums=1, static_argnames=("mc", "cache_sh"))
def prefill_program(params, cache, tokens, positions, segments, slots, *, mc, cache_sh):
    cache, _ = model.prefill(mc, params, cache, tokens, positions, segments, slots)
    return _constrain(cache, cache_sh)


# plain jax.jit: a copy rounds nothing, so numerics' compiler options do not apply
@partial(jax.jit, donate_argnums=0, static_argnames=("cache_sh", "length"))
def copy_program(cache, src, dst, *, cache_sh, length):
    return _constrain(copy_slots(cache, src, dst, length), cache_sh)


@partial(_jit, donate_argnums=1, static_argnames=("mc", "cache_sh", "steps", "max_len", "whole_cache"))
def decode_program(params, cache, state: DecodeState, *, mc, cache_sh, steps, max_len, whole_cache):
    """`steps` decode steps for rows 0..B-1 in one on-device scan; finished rows ride along masked. Returns the
    cache, the state after the last step, and per step [steps, B] tokens, log-probs and emitted masks."""
    s = state

    def step(carry, _):
        cache, tok, pos, n_gen, finish = carry
        active = finish == RUNNING
        # attention reads only as far as the longest running row (finished / free rows are junk anyway)
        kv_len = jnp.max(jnp.where(active, pos, 0)) + 1
        cache, logits = model.decode_step(mc, params, cache, tok, pos, kv_len, whole_cache)
        new_tok, logp = sample(logits, s.temp, s.top_k, s.top_p, s.seed, s.rid, pos + 1)
        n_gen = n_gen + active.astype(jnp.int32)
        hit_stop = jnp.any(new_tok[:, None] == s.stop, axis=-1)
        # the new token sits at pos + 1; the sequence is full once that is the cache's last position
        ended = jnp.where(
            hit_stop, STOPPED, jnp.where((n_gen >= s.max_new) | (pos + 1 >= max_len - 1), LENGTH, RUNNING)
        )
        finish = jnp.where(active, ended, finish)
        tok = jnp.where(active, new_tok, tok)
        pos = jnp.where(active, pos + 1, pos)
        return (cache, tok, pos, n_gen, finish), (new_tok, logp, active)

    init = (cache, s.tok, s.pos, s.n_gen, s.finish)
    (cache, tok, pos, n_gen, finish), (toks, logps, emitted) = jax.lax.scan(step, init, None, length=steps)
    return (
        _constrain(cache, cache_sh),
        dataclasses.replace(s, tok=tok, pos=pos, n_gen=n_gen, finish=finish),
        toks,
        logps,
        emitted,
    )
