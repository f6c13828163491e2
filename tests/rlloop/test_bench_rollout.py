"""`python -m rlloop.bench rollout` end to end on the tiny model: every engine generates exactly the tokens asked
for (two JAX engines in processes of their own included), the JAX engines compile nothing after warmup, and without
a vLLM environment the vLLM column says why."""

import json
import os
import sys

import pytest

from rlloop.bench import device, rollout
from rlloop.bench.vllm_runner import vllm_missing


def test_without_vllm_the_column_says_why(tmp_path):
    assert "--vllm-python" in vllm_missing(None)
    assert "cannot import vllm" in vllm_missing(sys.executable)  # rlloop's own environment has no vLLM
    # a wrong path, or a stale RLLOOP_VLLM_PYTHON: a reason too, not a FileNotFoundError
    assert vllm_missing(str(tmp_path / "nowhere" / "python")).startswith(f"{tmp_path / 'nowhere' / 'python'} cannot")
    (tmp_path / "python").write_text("")  # not executable
    assert "cannot be run" in vllm_missing(str(tmp_path / "python"))


def test_the_engines_fit_the_cores_the_run_has(monkeypatch):
    """--threads pins the run to that many cores, one engine each at most: the default of 2 engines drops to 1."""
    monkeypatch.delenv("RLLOOP_VLLM_PYTHON", raising=False)
    assert rollout.parse_args(["--threads", "1"]).engines == 1
    assert rollout.parse_args(["--threads", "1", "--engines", "1"]).engines == 1
    assert rollout.parse_args([]).engines == min(2, len(os.sched_getaffinity(0)))


def test_the_engines_fit_the_prompts(monkeypatch):
    """The prompts are dealt out to the engines: the default drops to one engine a prompt, and more engines than
    prompts are refused (one engine got no prompts and failed late in a pydantic error)."""
    monkeypatch.delenv("RLLOOP_VLLM_PYTHON", raising=False)
    assert rollout.parse_args(["--prompts", "1"]).engines == 1
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("--engines 2 needs 2 cores")
    with pytest.raises(SystemExit) as exit_:
        rollout.parse_args(["--prompts", "1", "--engines", "2"])
    assert exit_.value.code == 2


def test_quick_applies_only_to_the_sizes_not_given(monkeypatch):
    """--quick's sizes replaced the ones given explicitly."""
    monkeypatch.delenv("RLLOOP_VLLM_PYTHON", raising=False)
    args = rollout.parse_args(["--quick", "--prompts", "16", "--new-tokens", "64"])
    assert (args.prompts, args.n, args.new_tokens, args.repeats) == (16, 4, 64, 2)
    args = rollout.parse_args(["--prompts", "16"])
    assert (args.prompts, args.n, args.new_tokens, args.repeats) == (16, 8, 128, 3)
    args = device.parse_args(["--quick", "--tiny-steps", "10"])
    assert (args.tiny_steps, args.prompts, args.long_cache) == (10, 2, 384)
    assert device.parse_args([]).tiny_steps == 5


def test_a_vllm_python_without_vllm_is_refused_when_given_and_a_reason_when_inherited(monkeypatch, tmp_path, capsys):
    """--vllm-python given explicitly but wrong was accepted, and the bench ran on without the column: refused now,
    naming why. From $RLLOOP_VLLM_PYTHON (perhaps stale), it is a missing column, with the reason."""
    wrong = str(tmp_path / "python")
    monkeypatch.delenv("RLLOOP_VLLM_PYTHON", raising=False)
    with pytest.raises(SystemExit) as exit_:
        rollout.parse_args(["--vllm-python", wrong])
    assert exit_.value.code == 2
    assert f"--vllm-python {wrong}: {wrong} cannot be run" in capsys.readouterr().err
    monkeypatch.setenv("RLLOOP_VLLM_PYTHON", wrong)
    assert rollout.parse_args([]).vllm_missing.startswith(f"{wrong} cannot be run")


def test_quick_rollout_bench_ends_with_a_json_line(capsys, monkeypatch):
    monkeypatch.delenv("RLLOOP_VLLM_PYTHON", raising=False)
    rollout.main(["--quick", "--models", "tiny", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "vLLM column missing: no vLLM-CPU environment given" in out  # said, not only a JSON field
    result = json.loads(out.strip().splitlines()[-1])
    (tiny,) = result["results"]
    assert result["bench"] == "rollout" and "--vllm-python" in result["vllm_missing"]
    assert result["threads"] == result["cpus"] == len(os.sched_getaffinity(0))  # the cores it ran on
    assert tiny["vllm_tok_s"] is None and tiny["compiles_after_warmup"] == 0
    assert tiny["rows"] == 16 and tiny["jax_tok_s"] > 0 and tiny["hf_tok_s"] > 0
    assert 0 < tiny["mfu"] < 1 and 0 < tiny["mbu"] < 1
    assert tiny["engines"] == 2 and tiny["jax_engines_tok_s"] > 0 and tiny["jax_engines_compiles_after_warmup"] == 0
    several_cores = len(os.sched_getaffinity(0)) > 1  # a run's layout on them: one engine, a device per core
    assert ("jax_tp_tok_s" in tiny) == several_cores
    assert not several_cores or tiny["jax_tp_compiles_after_warmup"] == 0
    # the ratios are the ones they name, from the JSON's own tok/s, seconds, FLOPs, bytes and peaks
    tokens = tiny["rows"] * tiny["new_tokens"]
    assert tiny["jax_tok_s"] == pytest.approx(tokens / tiny["jax_s"])
    assert tiny["hf_tok_s"] == pytest.approx(tokens / tiny["hf_s"])
    assert tiny["speedup"] == pytest.approx(tiny["jax_tok_s"] / tiny["hf_tok_s"])
    assert tiny["speedup_vs_plain_generate"] == pytest.approx(tiny["jax_tok_s"] / tiny["hf_plain_generate_tok_s"])
    assert tiny["mfu"] == pytest.approx(tiny["flops"] / tiny["jax_s"] / result["peak_matmul_flops"])
    assert tiny["mbu"] == pytest.approx(tiny["bytes"] / tiny["jax_s"] / result["peak_mem_bytes_per_s"])
    for key in [k.removesuffix("_tok_s") for k in tiny if k in ("jax_tp_tok_s", "jax_engines_tok_s")]:
        assert tiny[f"{key}_over_jax"] == pytest.approx(tiny[f"{key}_tok_s"] / tiny["jax_tok_s"])
        seconds = tokens / tiny[f"{key}_tok_s"]
        assert tiny[f"{key}_mfu"] == pytest.approx(tiny["flops"] / seconds / result["peak_matmul_flops"])
