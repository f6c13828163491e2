"""`python -m rlloop.compare` on hand-made metrics: groups of different lengths line up, bad arguments exit 2."""

import json

import pytest

from rlloop.compare import main


def write_run(path, rewards: list[float]):
    path.mkdir(parents=True)
    rows = [{"step": i + 1, "rollout/raw_reward": r} for i, r in enumerate(rewards)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def runs(tmp_path):
    rewards = [-0.7, -0.6, -0.5, -0.45, -0.3, -0.2]
    long = [write_run(tmp_path / f"long{s}", [r + 0.01 * s for r in rewards]) for s in (0, 1)]
    short = [write_run(tmp_path / f"short{s}", [r + 0.01 * s for r in rewards[:3]]) for s in (0, 1)]
    return long, short


def test_runs_of_different_lengths_are_compared_on_the_steps_both_have(runs, tmp_path, capsys):
    """The same runs, one group cut short: they agree, over its 3 steps, smoothed alike (each group's own window
    left no step in common, and an empty verdict that passed)."""
    long, short = runs
    assert main([*long, "--vs", *short, "--out", str(tmp_path / "c.png")]) == 0
    verdict = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert verdict["rollout/raw_reward"] == {"distance": 0.0, "within": True}


def test_an_eval_metric_of_one_run_has_no_scale_rather_than_any_gap_outside(tmp_path, capsys):
    """Eval points are not smoothed, so one run per group gives them no spread: no verdict, where a floor of ~0
    called a 0.01 gap OUTSIDE. The smoothed reward still has one, and decides the exit code."""
    a, b = (write_run(tmp_path / name, [-0.7, -0.6, -0.5, -0.45, -0.3, -0.2]) for name in ("a", "b"))
    for run, accuracy in ((a, 0.50), (b, 0.51)):
        path = tmp_path / run / "metrics.jsonl"
        path.write_text(path.read_text() + json.dumps({"step": 6, "eval/x": accuracy}) + "\n")
    assert main([a, "--vs", b, "--out", str(tmp_path / "c.png")]) == 0
    out = capsys.readouterr().out
    assert "eval/x" in out and "no scale" in out
    verdict = json.loads(out.strip().splitlines()[-1])
    assert verdict["eval/x"] == {"distance": None, "within": None}
    assert verdict["rollout/raw_reward"] == {"distance": 0.0, "within": True}


def test_a_nan_at_one_step_of_one_run_leaves_that_step_out(runs, tmp_path, capsys):
    """metrics.jsonl keeps a non-finite value as NaN (a non-finite train step's loss): the step is left out for every
    run, where it made the metric's distance NaN, OUTSIDE, and the JSON line invalid."""
    long, _ = runs
    path = tmp_path / "long0" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[3]["rollout/raw_reward"] = float("nan")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main([*long, "--vs", *long, "--out", str(tmp_path / "c.png")]) == 0
    verdict = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert verdict["rollout/raw_reward"] == {"distance": 0.0, "within": True}


@pytest.mark.parametrize(
    "args, named",
    [
        (["--labels", "A"], "--labels 'A': a name for each group"),
        (["--metrics", "nope"], "matches none of the runs' metrics: rollout/raw_reward"),
        (["--out", "/nonexistent/c.png"], "/nonexistent is not a directory"),
        (["--smooth", "0"], "--smooth 0: at least 1"),
        (["--vs", "/nonexistent/run"], "/nonexistent/run: no such run directory"),  # 1 was "the groups disagree"
    ],
)
def test_bad_arguments_exit_2_naming_them(runs, tmp_path, capsys, args, named):
    long, short = runs
    with pytest.raises(SystemExit) as e:
        main([*long, "--vs", *short, "--out", str(tmp_path / "c.png"), *args])
    assert e.value.code == 2 and named in capsys.readouterr().err


def test_nothing_judged_is_not_agreement(tmp_path, capsys):
    """One run a group, each as long as the smoothing window: the metric has "no scale", so nothing was shown to
    agree: exit 3, where it was 0 (the exit status of a pass)."""
    a, b = (write_run(tmp_path / name, [-0.7 + d, -0.6, -0.5, -0.45]) for name, d in (("a", 0.0), ("b", 0.1)))
    assert main([a, "--vs", b, "--smooth", "4", "--out", str(tmp_path / "c.png")]) == 3
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1]) == {
        "rollout/raw_reward": {"distance": None, "within": None}
    }
    assert "nothing judged" in captured.err
    assert main([a, "--out", str(tmp_path / "c.png")]) == 0  # without --vs: an overlay, nothing asked to be judged


def test_distance_is_the_mean_gap_in_b_s_seed_spreads_and_the_tolerance_is_inclusive(tmp_path, capsys):
    """Unsmoothed (--smooth 1), from first principles: B's three seeds sit at -0.25, 0, +0.25 around one curve, so
    their standard deviation (n-1) is 0.25 at every step; A is that curve +0.5, -0.5, +0.5, ...: a gap of 0.5 at
    every step (gaps of either sign count, they do not cancel), 2.0 spreads. 2.0 is within a tolerance of 2, not of
    1.99. All values are multiples of 1/4, so the arithmetic is exact."""
    base = [-1.0 + 0.25 * t for t in range(6)]
    b = [write_run(tmp_path / f"b{i}", [v + d for v in base]) for i, d in enumerate((-0.25, 0.0, 0.25))]
    a = write_run(tmp_path / "a", [v + (0.5 if t % 2 == 0 else -0.5) for t, v in enumerate(base)])
    out = ["--smooth", "1", "--out", str(tmp_path / "c.png")]
    assert main([a, "--vs", *b, *out]) == 0
    verdict = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert verdict["rollout/raw_reward"] == {"distance": 2.0, "within": True}
    assert main([a, "--vs", *b, *out, "--tolerance", "1.99"]) == 1
    verdict = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert verdict["rollout/raw_reward"] == {"distance": 2.0, "within": False}


def test_b_s_spread_is_floored_by_the_noise_of_one_smoothed_point(tmp_path, capsys):
    """B's two seeds zigzag +-0.2 around a line rising 0.05 a step and differ by only 0.001: their spread across
    seeds (~0.0007) understates how far a smoothed point can move, so it is floored by B's own noise: each point
    lies 0.075 (the line's rise over a 4-step window's lag) +-0.2 from its rolling mean, as many + as -: a std of
    0.2, and one mean of 4 points has a standard error of 0.2 / sqrt(4) = 0.1. A is the smooth line +0.01 (no
    noise of its own, so the floor must be B's): B's smoothed curve is the line +0.0005, a gap of 0.0095, 0.095
    spreads: within, where the seeds' spread alone called it OUTSIDE by 13 spreads."""
    line = [-0.8 + 0.05 * t for t in range(1, 10)]
    zigzag = [v + (0.2 if t % 2 else -0.2) for t, v in enumerate(line, 1)]
    b = [write_run(tmp_path / f"b{i}", [v + 0.001 * i for v in zigzag]) for i in (0, 1)]
    a = write_run(tmp_path / "a", [v + 0.01 for v in line])
    assert main([a, "--vs", *b, "--smooth", "4", "--out", str(tmp_path / "c.png")]) == 0
    verdict = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rollout/raw_reward"]
    assert verdict["within"] is True
    assert verdict["distance"] == pytest.approx(0.0095 / 0.1, rel=1e-6)
