"""`python -m rlloop.compare RUN_DIR... [--vs RUN_DIR...]`: overlay runs with a seed band, and say whether they agree.

The seeds' parity test, made a number: each group (the positional runs, A; the `--vs` runs, B; typically the same
recipe on two backends, modes or rank counts, two seeds each) becomes one curve per metric, the mean over its runs at
each step after a rolling mean over `--smooth` steps (per-step rewards are noisy; eval metrics are not smoothed).
Group B's seed spread is the pooled standard deviation of its runs around their mean curve, floored by the standard
error of one smoothed point (the runs' noise around their own rolling mean), so one run per group still has a scale,
except for an eval metric (never smoothed): with one run in B it has none, and gets no verdict. A step where a run
logged a non-finite value (NaN) is left out for all. The verdict per metric is

    distance = mean over shared steps of |mean_A - mean_B| / spread_B        within: distance <= --tolerance (2)

`--out` writes the overlay (default `compare.png` in the working directory; one panel per metric: each group's mean
curve, its band of +-1 spread, and its runs faint). Ends with one JSON line: {metric: {"distance", "within"}}.
Without --vs, it only draws the overlay. The exit status is EXIT_STATUS below (the end of `--help`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from rlloop.tracking import expand, read_metrics

DEFAULT_METRICS = ("rollout/raw_reward", "rollout/response_len/mean", "eval/*", "train/entropy")
NOTHING_JUDGED = 3  # with --vs, no metric got a verdict: agreement is not shown, so not exit 0
EXIT_STATUS = f"""exit status: 0 when every judged metric is within (or, without --vs, once the overlay is drawn),
1 when one is OUTSIDE, 2 for a bad argument (a run directory that is missing or holds no metrics), {NOTHING_JUDGED}
when no metric got a verdict (each "no scale": B's runs do not vary, one run's noise is not known)"""


def load_group(run_dirs: list[str]) -> list[list[dict]]:
    """Each run's metrics.jsonl rows; ValueError naming a directory that is missing or has none."""
    runs = []
    for d in run_dirs:
        if not Path(d).is_dir():
            raise ValueError(f"{d}: no such run directory")
        if not (rows := read_metrics(Path(d) / "metrics.jsonl")):
            raise ValueError(f"{d} has no metrics.jsonl rows")
        runs.append(rows)
    return runs


def logged_steps(runs: list[list[dict]], metric: str) -> set[int]:
    """The steps at which every run logged `metric` as a finite number (metrics.jsonl keeps a NaN as NaN: one in
    one run made the whole metric's distance NaN)."""
    return set.intersection(*({r["step"] for r in rows if _finite(r.get(metric))} for rows in runs))


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and bool(np.isfinite(value))


def curves(
    runs: list[list[dict]], metric: str, smooth: int, within: set[int] | None = None
) -> tuple[np.ndarray, np.ndarray, float]:
    """(steps every run has (of `within`, if given), [runs, steps] values rolling-mean smoothed over `smooth` steps
    (eval: never), the standard error of one smoothed point: the runs' step-to-step noise around their own rolling
    mean, / sqrt(k))."""
    series = [{r["step"]: r[metric] for r in rows if metric in r} for rows in runs]
    steps = np.array(sorted(logged_steps(runs, metric) & (within if within is not None else set(series[0]))))
    values = np.array([[s[t] for t in steps] for s in series], dtype=float)
    k = 1 if metric.startswith("eval/") else max(1, min(smooth, len(steps)))
    if k == 1:
        return steps, values, 0.0
    kernel = np.ones(k) / k
    smoothed = np.array([np.convolve(v, kernel, mode="valid") for v in values])
    residual = values[:, k - 1 :] - smoothed
    return steps[k - 1 :], smoothed, float(residual.std() / np.sqrt(k))


def spread(values: np.ndarray, noise: float) -> float:
    """The seed spread of a group's curves: their pooled std across runs, at least the noise of one point; 0 when
    neither is known (one run of an unsmoothed metric)."""
    across = float(np.sqrt(np.mean(values.var(axis=0, ddof=1)))) if len(values) > 1 else 0.0
    return max(across, noise)


def compare(a: list[list[dict]], b: list[list[dict]], metrics, smooth: int = 5, tolerance: float = 2.0) -> dict:
    """{metric: {"distance": mean |mean_A - mean_B| / spread_B, "within": distance <= tolerance, ...}}; both None
    where B has no spread to measure by."""
    out = {}
    for metric in expand(metrics, a + b):
        # Both groups smoothed over the steps both logged, so their points line up (a window sized to each group's
        # own length left runs of 4 and 2 steps no point in common, and the verdict empty)
        both = logged_steps(a, metric) & logged_steps(b, metric)
        if not both:
            continue
        shared, va, _ = curves(a, metric, smooth, both)
        _, vb, noise = curves(b, metric, smooth, both)
        ma, mb = va.mean(axis=0), vb.mean(axis=0)
        scale = spread(vb, noise)
        gap = float(np.mean(np.abs(ma - mb)))
        if scale > 0 or gap == 0:
            distance = gap / scale if scale > 0 else 0.0
            out[metric] = {"distance": distance, "within": distance <= tolerance, "spread": scale}
        else:  # a distance over a zero spread would call any gap OUTSIDE
            out[metric] = {"distance": None, "within": None, "spread": scale}
        out[metric]["steps"] = len(shared)
    return out


def plot(groups: dict[str, list[list[dict]]], metrics, smooth: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = expand(metrics, [rows for runs in groups.values() for rows in runs])
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.6 * len(keys)), squeeze=False)
    for ax, metric in zip(axes[:, 0], keys):
        for (label, runs), color in zip(groups.items(), ("tab:blue", "tab:orange")):
            steps, values, noise = curves(runs, metric, smooth)
            mean, s = values.mean(axis=0), spread(values, noise)
            for v in values:
                ax.plot(steps, v, color=color, alpha=0.25, lw=0.8)
            ax.plot(steps, mean, color=color, label=f"{label} ({len(runs)} runs)")
            ax.fill_between(steps, mean - s, mean + s, color=color, alpha=0.2)
        ax.set_title(metric, fontsize=9)
        ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m rlloop.compare", description=__doc__.split("\n\n")[0], epilog=EXIT_STATUS
    )
    p.add_argument("runs", nargs="+", help="run directories of group A")
    p.add_argument("--vs", nargs="*", default=[], help="run directories of group B (the reference)")
    p.add_argument("--metrics", default=",".join(DEFAULT_METRICS), help="comma-separated; prefix* expands")
    p.add_argument("--smooth", type=int, default=5)
    p.add_argument("--tolerance", type=float, default=2.0, help="largest distance, in B's spreads, that agrees")
    p.add_argument("--labels", default="A,B")
    p.add_argument("--out", default="compare.png")
    args = p.parse_args(argv)
    metrics, labels = args.metrics.split(","), args.labels.split(",")
    if len(labels) < (2 if args.vs else 1):
        p.error(f"--labels {args.labels!r}: a name for each group, comma-separated")
    if args.smooth < 1:
        p.error(f"--smooth {args.smooth}: at least 1 (1: no smoothing)")
    if not Path(args.out).resolve().parent.is_dir():
        p.error(f"--out {args.out}: {Path(args.out).resolve().parent} is not a directory")
    try:
        a, b = load_group(args.runs), load_group(args.vs) if args.vs else []
    except ValueError as e:  # exit 2 like every bad argument: 1 says that the groups disagree
        p.error(str(e))
    groups = {labels[0]: a}
    if not expand(metrics, a + b):
        known = [k for k in expand(["*"], a + b) if k != "step"]
        p.error(f"--metrics {args.metrics!r} matches none of the runs' metrics: {', '.join(known)}")
    verdicts = {}
    if args.vs:
        groups[labels[1]] = b
        verdicts = compare(a, b, metrics, args.smooth, args.tolerance)
        if not verdicts:
            p.error("no metric was logged at the same steps by both groups: nothing to compare")
        for metric, v in verdicts.items():
            if v["within"] is None:
                print(
                    f"{metric:32s} no scale: B's runs do not vary (one run, or equal ones), and one run's noise is "
                    f"not known (an eval metric, or no more steps than --smooth {args.smooth})"
                )
                continue
            word = "within" if v["within"] else "OUTSIDE"
            print(f"{metric:32s} {word:8s} distance {v['distance']:.2f} spreads (spread {v['spread']:.4g})")
    plot(groups, metrics, args.smooth, Path(args.out))
    print(f"overlay: {args.out}" + ("" if args.vs else " (no --vs group: nothing judged)"))
    print(json.dumps({m: {"distance": v["distance"], "within": v["within"]} for m, v in verdicts.items()}))
    if any(v["within"] is False for v in verdicts.values()):
        return 1
    if args.vs and all(v["within"] is None for v in verdicts.values()):
        print(f"nothing judged: no metric has a scale to measure the gap by (exit {NOTHING_JUDGED})", file=sys.stderr)
        return NOTHING_JUDGED
    return 0


if __name__ == "__main__":
    sys.exit(main())
