"""`python -m rlloop.bench e2e --quick`: the command runs end to end and its last line is the JSON it promises.

Structure and sanity only (every number positive and finite): timings on a shared 2-core box are not asserted.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlloop.bench.e2e import median_run

ROOT = Path(__file__).resolve().parents[2]


def run_bench(*args: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)  # conftest's 4 fake devices are for in-process jax; the actors set their own
    out = subprocess.run(
        [sys.executable, "-m", "rlloop.bench", "e2e", "--quick", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def check_top(result: dict) -> None:
    assert result["bench"] == "e2e"
    assert positive(result["peak_matmul_flops"]) and positive(result["peak_mem_bytes_per_s"])
    assert result["cpus"] >= 1 and result["threads"] >= 1
    assert result["cpu"] != "unknown" and isinstance(result["cpu_flags"], list)  # rlloop.bench.machine
    tiny = result["tiny"]
    assert tiny["steps"] == 2 and tiny["warmup_steps"] == 1
    assert (tiny["prompts_per_step"], tiny["group_size"], tiny["max_response_len"]) == (16, 8, 16)
    assert tiny["rounds"] == 1


@pytest.mark.xdist_group("ray")  # starts Ray: one at a time (tests/conftest.py)
def test_rlloop_half():
    result = run_bench("--frameworks", "rlloop")
    check_top(result)
    assert result["dtype"] == "float32"
    tiny = result["tiny"]
    rl = tiny["rlloop_sync"]
    assert positive(rl["s_per_step"]) and positive(rl["setup_s"])
    assert rl["s_per_step_rounds"] == [rl["s_per_step"]]
    assert set(rl["breakdown_s"]) == {"rollout", "train", "sync", "other"}
    for key in ("rollout", "train", "sync"):
        assert positive(rl["breakdown_s"][key]), key
    assert math.isfinite(rl["breakdown_s"]["other"])  # the remainder: tiny, may round either way
    assert len(rl["step_s"]) == len(rl["rewards"]) == 2 and all(positive(s) for s in rl["step_s"])
    assert all(-1.0 <= r <= 1.0 for r in rl["rewards"])  # DAPO's verifier: +1 / -1 per sample
    assert rl["compiles"] == 0
    roof = tiny["roofline"]
    for key in ("params", "trained_tokens", "train_flops", "gen_flops", "decode_bytes", "bound_s", "train_s"):
        assert positive(roof[key]), key
    assert positive(tiny["rlloop_sync_over_bound"])
    assert "trl" not in tiny and not any(k.startswith("trl_over") for k in tiny)


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed (the bench extra)")
def test_trl_half():
    """In bf16 (TRL's mixed precision), the dtype the rlloop half does not run."""
    result = run_bench("--frameworks", "trl", "--dtype", "bfloat16")
    check_top(result)
    assert result["dtype"] == "bfloat16"
    trl = result["tiny"]["trl"]
    assert result["trl_version"] and result["trl_missing"] is None
    assert positive(trl["s_per_step"]) and positive(trl["generate_s"])
    assert len(trl["step_s"]) == len(trl["rewards"]) == 2 and all(positive(s) for s in trl["step_s"])
    assert all(-1.0 <= r <= 1.0 for r in trl["rewards"])
    assert all(0 < n <= 16 for n in trl["response_len"])
    assert 128 % trl["micro_batch_rows"] == 0
    assert trl["mixed_precision"] == "bf16"


def test_the_median_round_is_reported_with_every_round():
    runs = [{"s_per_step": s, "round": k} for k, s in enumerate([0.3, 0.1, 0.2, 0.4])]
    assert median_run(runs[:3]) == {"s_per_step": 0.2, "round": 2, "s_per_step_rounds": [0.3, 0.1, 0.2]}
    assert median_run(runs)["round"] == 2  # an even count: the lower of the two middle runs
    assert median_run(runs[:1])["s_per_step_rounds"] == [0.3]


def test_an_unknown_mode_option_is_named(tmp_path):
    from rlloop.bench.e2e import run_rlloop

    with pytest.raises(SystemExit, match="bogus"):
        run_rlloop([], "async+compile+bogus", steps=1, skip=0, run_dir=tmp_path, threads=1)
