"""What machine a benchmark ran on, for its JSON line: figures only mean something next to the CPU they came from.

"AMD EPYC" alone names both a Zen 3 and a Zen 4 guest, whose vector units differ (AVX2 against AVX-512 with bf16)
and move ratios against other frameworks a lot (docs/benchmarks.md), so the CPU family / model numbers and the vector
extensions that matter to matmul kernels are recorded too.
"""

from __future__ import annotations

import os
import platform

# The /proc/cpuinfo flags that decide which matmul kernels a CPU gets.
VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")


def machine() -> dict:
    """{"cpu": model name (family, model), "cpu_flags": the VECTOR_FLAGS it has, "cpus": cores this process may use}."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor says it all
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or "unknown"
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    flags = set(fields.get("flags", "").split())
    return {"cpu": name, "cpu_flags": [f for f in VECTOR_FLAGS if f in flags], "cpus": len(os.sched_getaffinity(0))}
