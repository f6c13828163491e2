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
    assert out.stderr.strip() == f"usage: python -m rlloop.bench {{{'|'.join(BENCHES)}}} [args]"
    modules = [m.name for m in pkgutil.iter_modules(rlloop.bench.__path__) if not m.name.startswith("_")]
    assert sorted(name for name in modules if takes_argv(name)) == sorted(BENCHES)
