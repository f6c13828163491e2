"""`python -m rlloop.bench` offers the benchmarks and only them: each name it lists runs `main(argv)` of its module,
and no module with such a `main` is missing from the list (the workers and runners it spawns are not benchmarks)."""

import importlib
import inspect
import pkgutil
import subprocess
import sys

import pytest

import rlloop.bench
from rlloop.bench import peaks
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


# (bench, argv, what the error names): each refused before any work, as a usage error (exit 2) naming the argument.
BAD_ARGUMENTS = [
    ("e2e", ["--settings", "tiny,big"], "--settings: unknown 'big'"),
    ("e2e", ["--modes", "sync,asnyc"], "--modes: unknown mode 'asnyc'"),
    ("e2e", ["--modes", "sync,async+compile+bogus"], "--modes: async+compile+bogus: unknown option(s) bogus"),
    ("e2e", ["--frameworks", "trl,rlop"], "--frameworks: unknown 'rlop'"),
    ("e2e", ["--steps", "-1"], "argument --steps: -1 is not >= 1"),
    ("e2e", ["--steps", "0"], "argument --steps: 0 is not >= 1"),
    ("e2e", ["--rounds", "0"], "argument --rounds: 0 is not >= 1"),
    ("e2e", ["--threads", "1", "--modes", "colocate,fully_async"], "--threads 1: --modes fully_async run"),
    ("e2e", ["--threads", "100000"], "--threads 100000: this process may use"),
    ("e2e", ["--steps", "2", "--modes", "sync,fully_async"], "--steps 2: the async modes need 3"),
    ("e2e", ["--quick", "--steps", "2", "--modes", "async"], "--steps 2: the async modes need 3"),
    ("rollout", ["--repeats", "-1"], "argument --repeats: -1 is not >= 1"),
    ("rollout", ["--repeats", "0"], "argument --repeats: 0 is not >= 1"),
    ("rollout", ["--threads", "1", "--engines", "2"], "--engines 2: the run has 1 core(s)"),
    ("rollout", ["--models", "tiny,3m"], "--models: unknown '3m'"),
    # each of these failed late (exit 1, in a worker or a pydantic error) without naming the argument
    ("rollout", ["--prompts", "0"], "argument --prompts: 0 is not >= 1"),
    ("rollout", ["--n", "0"], "argument --n: 0 is not >= 1"),
    ("rollout", ["--new-tokens", "0"], "argument --new-tokens: 0 is not >= 1"),
    ("rollout", ["--min-prompt-len", "65"], "--min-prompt-len 65: above --max-prompt-len 64"),
    ("logprob_memory", ["--response", "0"], "--response 0: need 0 < --response < --seq (512)"),
    ("logprob_memory", ["--response", "512"], "--response 512: need 0 < --response < --seq (512)"),
    ("logprob_memory", ["--rows", "0"], "argument --rows: 0 is not >= 1"),
    ("logprob_memory", ["--threads", "0"], "argument --threads: 0 is not >= 1"),
    ("logprob_memory", ["--modes", "train,foo"], "--modes: unknown 'foo'"),
    ("device", ["--parts", "engine,foo"], "--parts: unknown 'foo'"),
    ("peaks", ["float64"], "argument DTYPE: unknown 'float64'"),
    ("loop", ["--steps", "3"], "--steps 3: 4 or more"),
]


@pytest.mark.parametrize("bench, argv, named", BAD_ARGUMENTS, ids=[f"{b} {' '.join(a)}" for b, a, _ in BAD_ARGUMENTS])
def test_a_bad_argument_is_refused_before_any_work(bench, argv, named, capsys, monkeypatch):
    """In this process: a bench that got past its arguments would start its work (models, Ray, subprocesses)."""
    monkeypatch.delenv("RLLOOP_VLLM_PYTHON", raising=False)
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(f"rlloop.bench.{bench}").main(argv)
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err.splitlines()[-1]


def test_peaks_has_a_usage():
    """`peaks --help` was a TypeError. (`peaks float32`, as e2e calls it, runs in test_bench_e2e.)"""
    out = subprocess.run(
        [sys.executable, "-m", "rlloop.bench", "peaks", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.startswith("usage: python -m rlloop.bench peaks [-h] [DTYPE ...]")


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


def test_the_peaks_time_is_the_fastest_of_enough_runs(monkeypatch):
    """_best_seconds: one untimed first call, then at least `repeats` timed ones that together take `min_seconds`,
    and the fastest of them (a neighbour's burst slows some runs, never speeds one up). On a clock of its own,
    which each call moves on by its duration (quarters: exact)."""
    now = [0.0]
    monkeypatch.setattr(peaks.time, "perf_counter", lambda: now[0])
    durations, calls = iter([9.0, 0.5, 0.25, 0.75, 0.5, 1.0]), []

    def run():
        calls.append(None)
        now[0] += next(durations)

    assert peaks._best_seconds(run, repeats=5, min_seconds=0.0) == 0.25 and len(calls) == 1 + 5
    calls.clear()

    def quarter():
        calls.append(None)
        now[0] += 0.25

    assert peaks._best_seconds(quarter, repeats=2, min_seconds=1.0) == 0.25
    assert len(calls) == 1 + 4  # 2 runs of 0.25 s do not make 1 s: it goes on until they do
