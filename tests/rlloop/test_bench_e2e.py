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
from types import SimpleNamespace

import pytest

from rlloop.bench.e2e import finish, median_run, parse_args, rooflines, summarize, trl_over_rlloop, warmup_steps
from rlloop.bench.roofline import bound, step_work
from rlloop.config import load_config
from rollout.cost import generate_flops, train_flops
from rollout.model_config import ModelConfig

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
    # sync: engine and trainer on half of the cores TRL and the peaks ran on each
    assert rl["cores"] == {"engine": result["threads"] // 2, "trainer": result["threads"] // 2}
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


def metrics_rows(step_s: list[float], wait_s: list[float]) -> list[dict]:
    """metrics.jsonl rows of steps 1..N with the given step times and waits for the batch (rollout_s: 10x the wait)."""
    return [
        {"step": k + 1, "perf/step_s": s, "perf/rollout_wait_s": w, "perf/rollout_s": 10 * w, "perf/train_s": 0.5}
        | {"rollout/raw_reward": -1.0, "rollout/response_len/mean": 16.0, "rollout/response_len/max": 16}
        for k, (s, w) in enumerate(zip(step_s, wait_s))
    ]


def test_the_async_modes_leave_their_last_step_out_of_the_means():
    """Step k's time holds the wait for batch k + 1 in the async modes: the last step has none and is left out. Sync
    steps are each whole."""
    rows = metrics_rows([9.0, 2.0, 4.0, 1.0], [0.0, 0.2, 0.4, 0.0])
    sync = summarize(rows, "sync", skip=1)
    assert sync["s_per_step"] == pytest.approx(7 / 3)
    assert sync["breakdown_s"]["rollout"] == pytest.approx(2.0)  # the generation itself: on the step's path
    for mode in ("async", "fully_async", "fully_async+compile"):
        run = summarize(rows, mode, skip=1)
        assert run["s_per_step"] == pytest.approx(3.0), mode
        assert run["breakdown_s"]["rollout"] == pytest.approx(0.3), mode  # the wait, not the overlapped generation
        assert run["breakdown_s"]["other"] == pytest.approx(3.0 - 0.3 - 0.5), mode
        assert run["step_s"] == [9.0, 2.0, 4.0, 1.0]  # every step's time is still reported


def test_the_defaults_fit_the_modes():
    assert parse_args(["--quick", "--modes", "sync,fully_async"]).quick_steps == 3  # warm-up, timed, last
    assert parse_args(["--quick"]).quick_steps == 2
    args = parse_args(["--threads", "1", "--modes", "colocate"])  # colocate's roles take turns on all cores
    assert args.threads == 1 and args.modes == ["colocate"] and args.settings == ["tiny", "30m"]


def test_decode_bytes_are_counted_step_by_step():
    """Generation's bytes: each decode step reads the weights and the KV pages in use at that step, as rollout.cost
    counts one step (decode_kv_positions), not every step at the final length."""
    from rlloop.config import load_config
    from rollout.cost import cache_dtype, decode_kv_positions, kv_bytes_per_token, weight_bytes
    from rollout.model_config import ModelConfig
    from trainer.memory import ITEMSIZE

    cfg = load_config(ROOT / "examples" / "grpo_dapo_tiny.yaml", [])
    g = cfg.rollout.group_size
    # Two steps of 2 prompts; the longest prompt's responses cross a page (64 positions) of the 144-position cache.
    batches = [[SimpleNamespace(token_ids=[5] * n) for n in lens] for lens in ([60, 30], [20, 10])]
    rl = {"response_len": [10.0, 12.0], "response_len_max": [16, 16]}
    work = step_work(cfg, batches, rl, timed=[0, 1])

    mc = ModelConfig.from_dir(cfg.model.path)
    max_len = cfg.data.max_prompt_len + cfg.rollout.max_response_len
    weights = weight_bytes(mc, ITEMSIZE[cfg.model.dtype])
    per_position = kv_bytes_per_token(mc, ITEMSIZE[cache_dtype(cfg.model.dtype, "cpu")])

    def generation(longest: int, rows: int, steps: int) -> float:
        kv = [decode_kv_positions(max_len, longest + j) for j in range(steps)]  # step 0 runs the prompt's last token
        return sum(weights + rows * n * per_position for n in kv)

    expected = [generation(60, 2 * g, 16), generation(20, 2 * g, 16)]
    assert work["decode_bytes"] == pytest.approx(sum(expected) / 2)
    # Every step charged at the final length (76 positions: two pages) counts more than the steps read.
    assert expected[0] < 16 * (weights + 2 * g * decode_kv_positions(max_len, 60 + 16) * per_position)


def test_a_run_is_over_the_bound_of_the_steps_it_is_timed_on():
    """An async mode's s/step leaves the last step out: its bound does too (it was the bound of every step after the
    warm-up, the last one, here the longest, included). Sync and TRL keep every step after the warm-up."""
    from rlloop.config import load_config

    cfg = load_config(ROOT / "examples" / "grpo_dapo_tiny.yaml", [])
    batches = [[SimpleNamespace(token_ids=[5] * n) for n in lens] for lens in ([30, 20], [20, 10], [60, 60])]
    rl = {"response_len": [10.0, 12.0, 16.0], "response_len_max": [16, 16, 16]}
    out = rooflines(cfg, batches, rl, skip=1, modes=["sync", "async+compile"])
    out |= {"rlloop_sync": {"s_per_step": 1.0}, "rlloop_async+compile": {"s_per_step": 1.0}, "trl": {"s_per_step": 1.0}}
    peaks = {"matmul_flops": 1e11, "mem_bytes_per_s": 1e10}
    finish(out, peaks)
    steps_2_3, step_2 = (bound(step_work(cfg, batches, rl, timed), peaks)["bound_s"] for timed in ([1, 2], [1]))
    assert step_2 < steps_2_3
    assert out["rlloop_async+compile_over_bound"] == pytest.approx(1.0 / step_2)
    assert out["rlloop_sync_over_bound"] == out["trl_over_bound"] == pytest.approx(1.0 / steps_2_3)


def test_the_trl_pin_is_the_bench_extras():
    """e2e checks the installed trl against the bench extra's requirement, read from rlloop's metadata (the pin is
    written once, in pyproject.toml; e2e had a copy of its own)."""
    import tomllib

    from rlloop.bench.e2e import trl_requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (pinned,) = [r for r in extras["bench"] if r.startswith("trl")]
    assert "rlloop[bench]" in extras["dev"] and not any(r.startswith("trl") for r in extras["dev"])
    requirement = trl_requirement()
    assert requirement is not None and f"{requirement.name}{requirement.specifier}" == pinned


def test_a_steps_work_is_each_prompt_once_and_every_sample_after_it():
    """The roofline's work of one step, from its definition: the trained tokens are each prompt once per group (shared
    prompt rows) plus every sample's response; training runs g responses per prompt; generation prefills each prompt
    but its last token once (decode step 0 runs that one) and decodes every one of the g samples."""
    cfg = load_config(ROOT / "examples" / "grpo_dapo_tiny.yaml", [])
    g, mc = cfg.rollout.group_size, ModelConfig.from_dir(cfg.model.path)
    lens = [30, 20, 7]
    batches = [[SimpleNamespace(token_ids=[5] * n) for n in lens]]
    work = step_work(cfg, batches, {"response_len": [10.0], "response_len_max": [16]}, timed=[0])
    assert work["trained_tokens"] == sum(lens) + 10.0 * g * len(lens)
    assert work["train_flops"] == pytest.approx(sum(train_flops(mc, [(lp, [10.0] * g)]) for lp in lens))
    one_sample = {lp: generate_flops(mc, [], [(lp, 10.0)]) for lp in lens}
    prefill = {lp: generate_flops(mc, [lp - 1], []) for lp in lens}
    assert work["gen_flops"] == pytest.approx(sum(prefill[lp] + g * one_sample[lp] for lp in lens))


def test_the_bound_is_training_after_the_slower_side_of_generation():
    """bound_s: training FLOPs over the matmul peak, after generation at whichever of its FLOPs over the matmul peak
    and its decode bytes over the bandwidth is slower (each step needs the other's result: no overlap)."""
    peaks = {"matmul_flops": 1e11, "mem_bytes_per_s": 1e10}
    for gen_flops, decode_bytes in ((5e11, 1e9), (1e10, 4e10)):  # compute-bound, then memory-bound generation
        work = {"params": 1, "trained_tokens": 1.0, "train_flops": 2e11, "gen_flops": gen_flops}
        out = bound(work | {"decode_bytes": decode_bytes}, peaks)
        assert out["train_s"] == pytest.approx(2.0)
        assert out["gen_compute_s"] == pytest.approx(gen_flops / 1e11)
        assert out["gen_memory_s"] == pytest.approx(decode_bytes / 1e10)
        assert out["bound_s"] == pytest.approx(2.0 + max(gen_flops / 1e11, decode_bytes / 1e10))


def test_the_busy_times_and_response_lengths_are_each_their_own_metric():
    """rollout_busy_s and train_busy_s are the means of their own keys over the timed steps; response_len_max is the
    per-step longest response, not the mean; compiles add up over every step, the warm-up step's included."""
    rows = metrics_rows([9.0, 2.0, 4.0], [0.0, 0.2, 0.4])
    for k, row in enumerate(rows):
        row |= {"perf/rollout_busy_s": 1.0 + k, "perf/train_busy_s": 0.25 * (k + 1), "perf/sync_s": 0.125}
        row |= {"rollout/response_len/mean": 10.0 + k, "rollout/response_len/max": 16 - k, "perf/compiles": 1.0}
    run = summarize(rows, "sync", skip=1)
    assert run["rollout_busy_s"] == pytest.approx((2.0 + 3.0) / 2)
    assert run["train_busy_s"] == pytest.approx((0.5 + 0.75) / 2)
    assert run["breakdown_s"]["sync"] == pytest.approx(0.125)
    assert run["breakdown_s"]["other"] == pytest.approx(3.0 - 3.0 - 0.5 - 0.125)
    assert run["response_len"] == [10.0, 11.0, 12.0] and run["response_len_max"] == [16, 15, 14]
    assert run["compiles"] == 3.0  # the engine warmed up before step 1: a compile in any step is a recompile


def test_the_ratio_to_trl_is_the_median_of_each_rounds_own_ratio():
    """Each round runs TRL and rlloop side by side: its ratio is taken within the round, then the median over the
    rounds (4.0 here), not the ratio of the medians (2.0 / 1.0)."""
    trl = [{"s_per_step": s} for s in (1.0, 4.0, 2.0)]
    rlloop = [{"s_per_step": s} for s in (1.0, 1.0, 0.25)]
    out = trl_over_rlloop("async", trl, rlloop)
    assert out == {"trl_over_rlloop_async": 4.0, "trl_over_rlloop_async_rounds": [1.0, 4.0, 8.0]}
    out = trl_over_rlloop("sync", trl[:2], rlloop[1:])  # an even count: the mean of the middle two
    assert out["trl_over_rlloop_sync_rounds"] == [1.0, 16.0] and out["trl_over_rlloop_sync"] == 8.5
    with pytest.raises(ValueError):  # a round missing on one side is not paired with another round
        trl_over_rlloop("sync", trl, rlloop[:2])


@pytest.mark.parametrize("steps, skip", [(1, 0), (2, 1), (5, 1), (6, 2), (12, 2)])
def test_warm_up_steps_leave_at_least_one_step_timed(steps, skip):
    assert warmup_steps(steps) == skip and steps - skip >= 1
