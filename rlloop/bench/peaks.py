"""Measured peaks of the default JAX device, the denominators of MFU and MBU.

Datasheet peaks do not exist for "2 shared CPU cores" and are optimistic elsewhere, so we measure: a large jitted
matmul for FLOP/s (in the dtype, accumulating in fp32) and a large jitted fp32 elementwise pass (read once, write
once) for bytes/s. Best of a few timed runs after a compile+warmup run, repeated for at least a second: on a shared
host a neighbour (or the hypervisor) takes the cores in bursts, and five runs of ~10 ms can all land in one (the same
2 cores read 110 and 193 GFLOP/s in back-to-back processes with five). Cached per process and dtype, because
benchmarks ask repeatedly and a measurement costs seconds. `python -m rlloop.bench peaks [DTYPE ...]` prints the
numbers for each dtype (float32, bfloat16; default float32), then one JSON line.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

from rlloop.bench.machine import machine

# Sizes per platform: big enough to leave the caches and amortise dispatch, small enough to take ~1 s on a CPU.
_MATMUL_N = {"cpu": 1024, "gpu": 8192, "tpu": 8192}
_COPY_BYTES = {"cpu": 256 << 20, "gpu": 2 << 30, "tpu": 2 << 30}


def _best_seconds(run, repeats: int = 5, min_seconds: float = 1.0) -> float:
    """The fastest of at least `repeats` timed calls of `run()` (which blocks until done) that together take at least
    `min_seconds`."""
    run()  # compile + first touch
    best, spent, done = float("inf"), 0.0, 0
    while done < repeats or spent < min_seconds:
        start = time.perf_counter()
        run()
        took = time.perf_counter() - start
        best, spent, done = min(best, took), spent + took, done + 1
    return best


@functools.lru_cache(maxsize=None)
def measure_peaks(dtype: str = "float32") -> dict[str, float]:
    """{"matmul_flops": FLOP/s of an n x n x n matmul, "mem_bytes_per_s": bytes moved per second by x * c + 1}."""
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    platform = device.platform
    jdtype = jnp.dtype(dtype)
    n = _MATMUL_N.get(platform, 4096)
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(jdtype)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(jdtype)
    # fp32 accumulation, as the engine's matmuls: XLA:CPU runs a bf16 dot with a bf16 output 6x slower on AMX.
    matmul = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
    matmul_s = _best_seconds(lambda: matmul(a, b).block_until_ready())

    # Bytes in fp32 whatever the dtype: XLA:CPU's bf16 elementwise ops convert each value, and run at a seventh of the
    # bandwidth. Donating the input lets the output reuse its buffer: fresh pages would measure page faults instead.
    elems = _COPY_BYTES.get(platform, 1 << 30) // 4
    scale = jax.jit(lambda v: v * 0.5 + 1.0, donate_argnums=0)
    x = jnp.ones((elems,), jnp.float32)

    def copy() -> None:
        nonlocal x
        x = scale(x).block_until_ready()

    copy_s = _best_seconds(copy)
    return {
        "matmul_flops": 2.0 * n**3 / matmul_s,
        "mem_bytes_per_s": 2.0 * elems * 4 / copy_s,
        "platform": platform,
        "device_kind": getattr(device, "device_kind", platform),
        "dtype": dtype,
        "matmul_n": n,
        "copy_bytes": int(elems * 4),
    }


def main(argv: list[str]) -> None:
    from rollout.types import DTYPES

    ap = argparse.ArgumentParser(prog="python -m rlloop.bench peaks", description=__doc__.split("\n\n")[0])
    # No `choices`: argparse checks a list default of nargs="*" against them as one value and refuses it.
    ap.add_argument("dtypes", nargs="*", metavar="DTYPE", help=f"of {', '.join(DTYPES)} (default float32)")
    args = ap.parse_args(argv)
    if unknown := [d for d in args.dtypes if d not in DTYPES]:
        ap.error(f"argument DTYPE: unknown {', '.join(map(repr, unknown))}; expected {' or '.join(DTYPES)}")
    results = [measure_peaks(d) for d in args.dtypes or ["float32"]]
    for r in results:
        print(
            f"{r['device_kind']} {r['dtype']}: matmul {r['matmul_flops'] / 1e9:.1f} GFLOP/s, "
            f"memory {r['mem_bytes_per_s'] / 1e9:.1f} GB/s"
        )
    print(json.dumps({"bench": "peaks", **machine(), "results": results}))
