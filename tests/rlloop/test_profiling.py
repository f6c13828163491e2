"""`run.profile_steps`: the chosen steps' generation (JAX's profiler) and training (torch's) leave traces in
run_dir/profile/, and nothing else does; a profiler busy in the same process leaves a call untraced, not crashed."""

import gzip
import json
from pathlib import Path

import jax.numpy as jnp
import pytest
import torch

from rlloop.profiling import jax_trace, torch_trace
from rlloop.run import main

TINY = str(Path(__file__).resolve().parents[2] / "examples" / "grpo_dapo_tiny.yaml")


def test_a_profiled_step_leaves_the_engines_and_the_trainers_traces(tmp_path):
    args = ["run.steps=2", "run.eval_every=0", "run.save_every=0", "rollout.prompts_per_step=4"]
    args += ["cluster.use_ray=false", "tracking.progress=false", "run.profile_steps=[2]", f"run.dir={tmp_path}"]
    assert main([TINY, *args]) == 0
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["step_000002"]
    step = tmp_path / "profile" / "step_000002"

    trace = json.loads((step / "trainer_rank0.json").read_text())
    ops = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert {"aten::mm", "Optimizer.step#AdamW.step"} <= ops  # the forward/backward and the optimizer step
    assert "aten::mm" in (step / "trainer_rank0.txt").read_text()

    (perfetto,) = (step / "engine0").glob("plugins/profile/*/perfetto_trace.json.gz")
    events = json.loads(gzip.decompress(perfetto.read_bytes()))["traceEvents"]
    programs = {e["name"] for e in events if e.get("name", "").startswith("PjitFunction(")}
    assert {"PjitFunction(prefill_program)", "PjitFunction(decode_program)"} <= programs


def test_a_call_traced_while_the_profiler_records_another_runs_untraced(tmp_path, caplog):
    outer, inner = tmp_path / "outer", tmp_path / "inner"
    with torch_trace(str(outer)):
        with torch_trace(str(inner)):  # two torch profilers at once crashed the process
            x = torch.ones(8, 8) @ torch.ones(8, 8)
    assert float(x.sum()) == 512.0
    assert Path(f"{outer}.json").is_file() and not Path(f"{inner}.json").exists()
    assert "not profiled" in caplog.text and str(inner) in caplog.text


@pytest.mark.parametrize("trace", [jax_trace, torch_trace], ids=["jax", "torch"])
def test_a_trace_that_cannot_be_written_is_a_warning_not_a_failed_call(tmp_path, caplog, trace):
    (tmp_path / "a_file").write_text("")
    with trace(str(tmp_path / "a_file" / "trace")):  # a directory cannot be made under a file
        x = jnp.ones((8, 8)) @ jnp.ones((8, 8))
    assert float(x.sum()) == 512.0
    assert "a_file/trace" in caplog.text and ("not written" in caplog.text or "not profiled" in caplog.text)
    # and the process's profiler is free for the next step's trace (JAX's stayed started after a failed write)
    with trace(str(tmp_path / "next")):
        jnp.ones((8, 8)).block_until_ready()
    assert list(tmp_path.glob("next.json")) or list(tmp_path.glob("next/plugins/profile/*/*.xplane.pb"))


def test_profile_steps_past_the_run_is_a_config_error(tmp_path, capsys):
    assert main([TINY, f"run.dir={tmp_path}", "run.steps=3", "run.profile_steps=[2,4]"]) == 2
    assert "run.profile_steps [2, 4] go past steps=3" in capsys.readouterr().err


def test_a_torch_trace_makes_the_directories_it_goes_in(tmp_path):
    """A trainer rank's trace goes to run_dir/profile/step_N/, which nothing else may have made (no engine trace in
    the same place: a `transformers` engine, another node): it is made, not a warning and no trace."""
    path = tmp_path / "profile" / "step_000001" / "trainer_rank0"
    with torch_trace(str(path)):
        x = torch.ones(8, 8) @ torch.ones(8, 8)
    assert float(x.sum()) == 512.0
    assert Path(f"{path}.json").is_file() and "aten::mm" in Path(f"{path}.txt").read_text()


def test_an_engine_s_jax_trace_and_a_trainer_s_torch_trace_record_at_once(tmp_path):
    """In one process (cluster.use_ray: false, the async modes) an engine's generation and a trainer's step overlap:
    each profiler records only one call at a time, but the two profilers are independent, so both are traced."""
    with jax_trace(str(tmp_path / "engine0")):
        with torch_trace(str(tmp_path / "trainer_rank0")):
            x = torch.ones(8, 8) @ torch.ones(8, 8)
        y = jnp.ones((8, 8)) @ jnp.ones((8, 8))
    assert float(x.sum()) == float(y.sum()) == 512.0
    assert (tmp_path / "trainer_rank0.json").is_file()
    assert list((tmp_path / "engine0").glob("plugins/profile/*/*.xplane.pb"))
