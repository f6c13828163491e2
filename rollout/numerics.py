"""Low-precision numerics that make the JAX decoder's bf16 path compute what transformers' bf16 path computes.

In bf16, the trainer's log-probs (HF torch) and the engine's agree closely only if the two backbones produce the
*same bits*: one rounding that goes the other way anywhere upstream spreads through every later matmul, and on a model
with realistic logits (|logit| ~ 10) a final hidden state that is off by an ulp in most elements moves log-probs by
~1e-2 nats. That is the bf16 noise floor: HF's own eager and SDPA attentions differ by as much. rollout.model follows
HF's bf16 op order (RMSNorm cast before the weight, fp32 RoPE angles, SiLU rounded once, flash-style attention);
this module holds the rest:

- `COMPILER_OPTIONS`: torch rounds every op's output to bf16. XLA by default may keep fp32 across fused elementwise
  ops and skip those roundings ("excess precision"): with every other op matched, ~65% of the final hidden states
  still differed by an ulp. The engine compiles its programs with it off, so that every bf16 value the program
  names is rounded, as in HF.
- On an x86-64 CPU in bf16 (where a CPU trainer runs torch's x86 kernels), the few places where torch's kernels
  are not correctly rounded math are reproduced bit for bit, elsewhere (GPU/TPU, fp32) plain jnp math is used:
  - `attention_exp`: HF's default attention (SDPA) runs torch's CPU flash kernel, which for bf16 inputs takes
    exp(s - max) from a fast approximation (`fexp_u20`, relative error ~1e-4, far below the bf16 resolution that
    those weights are rounded to next);
  - `inv_rms`: RMSNorm's mean of squares is summed in the order of torch's CPU cascade sum, divided by n, and
    torch's rsqrt is 1 / sqrt, two correctly rounded ops (XLA's rsqrt and reduction order differ by an fp32 ulp
    in ~30% of rows, enough to flip a bf16 rounding now and then);
  - past `rollout.cost.FLASH_KV_BLOCK` keys the flash kernel softmaxes a row block by block against the running
    max, and rollout.model's paged decode and long prefills follow it.
  What is left differs rarely, and each difference spreads to every later token, so the gap grows with a row's
  length: the accumulation order of XLA's matmuls against oneDNN's (a paged cache's P·V summed page by page among
  them), and the last (row length mod 16) keys of torch's attention rows, whose exp torch takes exactly
  (docs/design.md §3.13 has the figures).
"""

from __future__ import annotations

import platform

import jax
import jax.numpy as jnp

F32 = jnp.float32

# Passed to the engine's jax.jit programs (rollout.programs); see the module docstring.
COMPILER_OPTIONS = {"xla_allow_excess_precision": False}


def matches_torch_cpu(dtype) -> bool:
    """Whether the decoder reproduces torch's x86 CPU kernels: low-precision activations on an x86-64 CPU backend."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return jnp.dtype(dtype) != jnp.float32 and x86 and jax.default_backend() == "cpu"


def _f32_bits(bits: int) -> jax.Array:
    return jax.lax.bitcast_convert_type(jnp.uint32(bits), F32)


def torch_cpu_fast_exp(x: jax.Array) -> jax.Array:
    """fp32 exp(x) as torch's x86 `Vectorized<float>::fexp_u20` computes it (Malossi et al., "Fast exponential
    computation on SIMD architectures"): 2^(x·log2 e) with the fractional power corrected by a cubic in Horner form,
    the result assembled by writing its bits directly. Bit for bit equal to torch's AVX2 / AVX-512 versions."""
    c0, c1, c2, c3 = 0.00010703434948458272, 0.30354260500649682, -0.22433836478672356, -0.079204240219773236
    ln_flt_min, ln_flt_max = _f32_bits(0xC2AEAC50), _f32_bits(0x42B17218)
    src = jnp.clip(x, ln_flt_min, ln_flt_max) * _f32_bits(0x3FB8AA3B)  # x · log2(e), kept finite
    frac = src - jnp.floor(src)
    poly = ((c3 * frac + c2) * frac + c1) * frac + c0
    # torch uses fused multiply-adds for the Horner steps and this line; XLA's CPU backend contracts a * b + c
    # into them too (checked bit for bit against an FMA reference and against torch's SDPA outputs).
    bits = ((src - poly) * float(2**23) + float(2**23 * 127)).astype(jnp.int32)  # truncation, as cvttps2dq
    out = jax.lax.bitcast_convert_type(bits, F32)
    return jnp.where(x < ln_flt_min, 0.0, jnp.where(x > ln_flt_max, jnp.inf, out))


def attention_exp(x: jax.Array, dtype) -> jax.Array:
    """exp of fp32 attention scores minus their row max, for attention over `dtype` activations."""
    return torch_cpu_fast_exp(x) if matches_torch_cpu(dtype) else jnp.exp(x)


def _plus(a: jax.Array | None, b: jax.Array) -> jax.Array:
    return b if a is None else a + b  # None: a zero accumulator (0 + b is exact)


def _fold(t: jax.Array) -> jax.Array:
    """Left-to-right running sum over axis -3 (t[0] + t[1] + ...), unrolled so that XLA keeps the order."""
    out = t[..., 0, :, :]
    for i in range(1, t.shape[-3]):
        out = out + t[..., i, :, :]
    return out


def _fold_groups(t: jax.Array) -> tuple[jax.Array | None, jax.Array | None]:
    """(running sum of each complete group of 16 along axis -3 [..., groups, 4, lanes], running sum of the leftover
    items [..., 4, lanes]); None where there are none."""
    count = t.shape[-3]
    full = count // 16
    groups = _fold(t[..., : full * 16, :, :].reshape(*t.shape[:-3], full, 16, *t.shape[-2:])) if full else None
    rest = _fold(t[..., full * 16 :, :, :]) if count % 16 else None
    return groups, rest


def torch_cpu_sum(x: jax.Array, lanes: int = 8) -> jax.Array:
    """Sum over the last axis [..., n] -> [..., 1] in the order of torch's CPU `cascade_sum` for a contiguous inner
    reduction (aten/src/ATen/native/cpu/SumKernel.cpp: vectorized_inner_sum, row_sum, multi_row_sum). Its kernels
    are built without an AVX-512 variant, so a vector is 8 fp32 lanes on AVX2 and AVX-512 machines alike.

    The n // lanes vectors are summed lane-wise into 4 interleaved accumulators (vector i into accumulator i % 4):
    a running sum over blocks of 16 rows of 4 vectors, each block's sum added into a level-1 running sum that is
    folded into level 2 every 16 blocks, and level 2 into level 3 every 16 of those. The levels are added in
    order, then the leftover vectors, then the accumulators, the scalar tail and the lanes one by one.
    """
    n = x.shape[-1]
    nvec, size = n // lanes, n // (4 * lanes)  # vectors; rows of 4 vectors (ilp_factor 4)
    if nvec == 0 or size >= 1 << 16:  # a row shorter than a vector (scalar code) or levels > 16 rows: not reproduced
        return jnp.sum(x, axis=-1, keepdims=True)
    levels: list[jax.Array | None] = [None] * 4  # [..., 4, lanes] each: rows in the open block, levels 1..3
    if size:
        rows = x[..., : size * 4 * lanes].reshape(*x.shape[:-1], size, 4, lanes)
        blocks, levels[0] = _fold_groups(rows)
        if blocks is not None:
            groups, levels[1] = _fold_groups(blocks)
            if groups is not None:
                supers, levels[2] = _fold_groups(groups)
                levels[3] = None if supers is None else _fold(supers)
    present = [a for a in levels if a is not None]
    part = [None] * 4 if not present else list(jnp.moveaxis(sum(present[1:], start=present[0]), -2, 0))
    for i in range(size * 4, nvec):  # leftover vectors into accumulator 0
        part[0] = _plus(part[0], x[..., i * lanes : (i + 1) * lanes])
    lanes_sum = part[0]
    for a in part[1:]:
        lanes_sum = lanes_sum if a is None else lanes_sum + a
    out = None
    for k in range(nvec * lanes, n):  # the scalar tail, then the lanes one by one
        out = _plus(out, x[..., k : k + 1])
    for lane in range(lanes):
        out = _plus(out, lanes_sum[..., lane : lane + 1])
    return out


def inv_rms(x32: jax.Array, eps: float, dtype) -> jax.Array:
    """rsqrt(mean(x32², last axis) + eps) [..., 1] for RMSNorm over `dtype` activations, as HF computes it."""
    if not matches_torch_cpu(dtype):
        return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    # x32 holds bf16 / fp16 values, so its squares are exact in fp32 (a multiply-add that XLA fuses rounds the same).
    # The barriers keep XLA from rewriting the division by n into a multiply by 1 / n (not the same unless n is a
    # power of two) and 1 / sqrt into its own rsqrt.
    total = torch_cpu_sum(x32 * x32)
    mean = total / jax.lax.optimization_barrier(jnp.full(total.shape, x32.shape[-1], F32))
    return 1.0 / jax.lax.optimization_barrier(jnp.sqrt(mean + eps))
