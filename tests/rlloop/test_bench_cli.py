"""`python -m rlloop.bench` offers the benchmarks and only them: each name it lists runs `main(argv)` of its module,
and no module with such a `main` is missing from the list (the workers and runners it spawns are not benchmarks)."""

import importlib
import inspect
import pkgutil
import subprocess
import sys

import rlloop.bench
from rlloop.bench.__main__ import BENCHES


def takes_argv(module_name: str) -> bool:
    main = getattr(importlib.import_module(f"rlloop.bench.{module_name}"), "main", None)
    return main is not None and len(inspect.signature(main).parameters) == 1


def test_usage_lists_exactly_the_benchmarks():
    out = subprocess.run([sys.executable, "-m", "rlloop.bench"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.startswith(f"usage: python -m rlloop.bench {{{'|'.join(BENCHES)}}} [args]")
    modules = [m.name for m in pkgutil.iter_modules(rlloop.bench.__path__) if not m.name.startswith("_")]
    assert sorted(name for name in modules if takes_argv(name)) == sorted(BENCHES)
    helped = subprocess.run(
        [sys.executable, "-m", "rlloop.bench", "--help"], capture_output=True, text=True, timeout=120
    )
    assert helped.returncode == 0
    assert [line.split()[0] for line in helped.stdout.splitlines()[1:]] == list(BENCHES)  # each with what it does


def test_a_bad_argument_is_a_usage_error():
    for args, named in [(["sync", "--mb", "0"], "argument --mb: 0 is not >= 1"), (["loop", "--settings", "x"], "x")]:
        out = subprocess.run([sys.executable, "-m", "rlloop.bench", *args], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and named in out.stderr.splitlines()[-1], out.stderr[-2000:]


def test_the_json_lines_name_the_cpu_by_family_and_vector_units():
    """A CPU is named with its family and vector units: "AMD EPYC" alone is both a Zen 3 and a Zen 4, whose figures
    differ a lot. Checked against lscpu and the kernels torch picked."""
    import os

    import torch

    from rlloop.bench.machine import machine

    m = machine()
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    info = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lscpu.splitlines())}
    assert m["cpu"].startswith(info["Model name"])
    assert f"(family {info['CPU family']}, model {info['Model']})" in m["cpu"]
    capability = torch.backends.cpu.get_cpu_capability()  # the kernels torch picked: "AVX2", "AVX512", ...
    assert ("avx2" in m["cpu_flags"]) == (capability in ("AVX2", "AVX512"))
    if capability == "AVX512":
        assert "avx512f" in m["cpu_flags"]
    assert m["cpus"] == len(os.sched_getaffinity(0))
