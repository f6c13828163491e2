"""`python -m rlloop.bench rollout` end to end on the tiny model: every engine generates exactly the tokens asked
for (two JAX engines in processes of their own included), the JAX engines compile nothing after warmup, and without
a vLLM environment the vLLM column says why."""

import json
import os
import sys

from rlloop.bench import rollout
from rlloop.bench.vllm_runner import vllm_missing


def test_without_vllm_the_column_says_why():
    assert "--vllm-python" in vllm_missing(None)
    assert "cannot import vllm" in vllm_missing(sys.executable)  # rlloop's own environment has no vLLM


def test_quick_rollout_bench_ends_with_a_json_line(capsys, monkeypatch):
    monkeypatch.delenv("RLLOOP_VLLM_PYTHON", raising=False)
    rollout.main(["--quick", "--models", "tiny", "--repeats", "1"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (tiny,) = result["results"]
    assert result["bench"] == "rollout" and "--vllm-python" in result["vllm_missing"]
    assert tiny["vllm_tok_s"] is None and tiny["compiles_after_warmup"] == 0
    assert tiny["rows"] == 16 and tiny["jax_tok_s"] > 0 and tiny["hf_tok_s"] > 0
    assert 0 < tiny["mfu"] < 1 and 0 < tiny["mbu"] < 1
    assert tiny["engines"] == 2 and tiny["jax_engines_tok_s"] > 0 and tiny["jax_engines_compiles_after_warmup"] == 0
    several_cores = len(os.sched_getaffinity(0)) > 1  # a run's layout on them: one engine, a device per core
    assert ("jax_tp_tok_s" in tiny) == several_cores
    assert not several_cores or tiny["jax_tp_compiles_after_warmup"] == 0
