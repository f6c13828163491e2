"""Where a run's numbers go: `metrics.jsonl` (one line per step), Weights & Biases, a progress bar, and at the end
`curves.png` and `report.md` in the run directory."""

from __future__ import annotations

import json
import logging
import netrc
import numbers
import os
import re
import sys
import uuid
from pathlib import Path
from urllib.parse import urlparse

from rlloop.config import Config

CURVES = [
    "rollout/raw_reward",
    "eval/*",
    "rollout/response_len/mean",
    "train/loss",
    "train/grad_norm",
    "train/logprob_abs_diff",
    "perf/step_s",
    "sync/bytes",
]
log = logging.getLogger(__name__)


def read_metrics(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl; a last line cut short (the disk filled, or the driver died, mid-write) is left
    out, with a warning: a resumed run logs that step again."""
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise
            log.warning("%s: its last line is cut short (%r); left out", path, line[:60])
    return rows


class _AboveTheBar(logging.Handler):
    """Writes each record on its own line above the progress bar (`tqdm.write`), which a plain stream handler
    would cut through."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        tqdm.write(self.format(record), file=sys.stderr)


def log_to_terminal() -> None:
    """rlloop's own log lines (a run's phases, then warnings) on stderr, time-stamped; once per process. For
    `python -m rlloop.run`: a library user configures logging as they like."""
    logger = logging.getLogger("rlloop")
    if any(isinstance(h, _AboveTheBar) for h in logger.handlers):
        return
    handler = _AboveTheBar()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def wandb_api_key() -> str | None:
    """The API key W&B would use here, read where `wandb login` leaves it, asking no server: WANDB_API_KEY, else the
    netrc entry (NETRC, else ~/.netrc) for W&B's host (WANDB_BASE_URL, else api.wandb.ai). wandb.login(verify=False)
    asks the server in wandb 0.31 (an API request through its service): with no route to it, a run's start hung
    for minutes."""
    if key := os.environ.get("WANDB_API_KEY"):
        return key
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        entry = netrc.netrc(os.environ.get("NETRC") or None).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return None
    return entry[2] if entry else None


def wandb_key_problem(key: str) -> str | None:
    """What W&B refuses in the form of an API key (its rule: after an optional `prefix-`, 40 or more letters,
    digits and underscores), or None."""
    secret = key.split("-", 1)[-1]
    if not re.fullmatch(r"[\w-]+", secret):
        return "the API key may only hold letters, digits and underscores"
    if len(secret) < 40:
        return f"the API key must have 40 or more characters, it has {len(secret)}"
    return None


def wandb_mode(setting: str) -> str:
    """tracking.mode as W&B takes it: `auto` is W&B's own WANDB_MODE where that is set (W&B lets the mode given to
    wandb.init win over it), else online where W&B has an API key (`wandb_api_key`), else offline."""
    if setting != "auto":
        return setting
    if (env := os.environ.get("WANDB_MODE")) in ("online", "offline", "disabled", "dryrun"):
        return "offline" if env == "dryrun" else env
    return "online" if wandb_api_key() else "offline"


class Tracker:
    """Logs one dict of metrics per step. A run that resumes from step `start_step` logs every later step again, so
    their lines go; one that starts from step 0 (afresh, or rebuilt before its first checkpoint) logs all again,
    the step-0 evaluation too."""

    def __init__(self, cfg: Config, start_step: int = 0):
        self.cfg, self.run_dir = cfg, cfg.run_dir
        self.path = self.run_dir / "metrics.jsonl"
        kept = [m for m in read_metrics(self.path) if m["step"] <= start_step] if start_step else []
        fresh = self.path.with_name(self.path.name + ".tmp")  # replaced whole: a kill mid-write loses no line
        fresh.write_text("".join(json.dumps(m) + "\n" for m in kept))
        os.replace(fresh, self.path)
        self.file = open(self.path, "a")
        self.summary = RunSummary(kept)
        self.wandb = self._start_wandb(start_step) if cfg.tracking.wandb else None
        # A step's W&B sample table waits for the step's metrics: in the async modes step k + 1's samples come before
        # step k's metrics, and W&B drops a step below the last it has (every step before a table's went missing)
        self._tables: dict[int, dict] = {}
        self.bar = None
        if cfg.tracking.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.run.steps, initial=start_step, desc=cfg.run.name, unit="step", dynamic_ncols=True)

    def _start_wandb(self, start_step: int):
        """The W&B run: the one this directory's run logged to when it resumes from a checkpoint, else a new one. W&B
        ignores a step below the last it has, so a run starting from step 0 in the old one would log nothing until it
        passed the old run's last step."""
        import wandb

        mode = wandb_mode(self.cfg.tracking.mode)
        id_file = self.run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if start_step and id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        if mode == "offline":  # a resumed run's part is an offline run directory of its own, with the same id
            log.warning(
                "W&B runs offline%s; upload later, every part of the run (resumed ones too) into one W&B run, with "
                "`wandb sync --id %s %s/wandb/offline-run-*-%s`",
                ": no API key (WANDB_API_KEY or `wandb login`)" if self.cfg.tracking.mode == "auto" else "",
                run_id,
                self.run_dir,
                run_id,
            )
        try:
            run = wandb.init(
                project=self.cfg.tracking.project,
                entity=self.cfg.tracking.entity,
                name=self.cfg.run.name,
                id=run_id,
                resume="allow",
                dir=str(self.run_dir),
                mode=mode,
                config=self.cfg.model_dump(mode="json"),
            )
        except Exception as e:  # W&B unreachable, or its service failed: the run goes on, metrics.jsonl keeps it all
            log.warning("W&B did not start (%s: %s); this run logs to %s only", type(e).__name__, e, self.path)
            return None
        if run.step > start_step + 1:  # W&B keeps what it had and has no rewind to offer outside a preview
            log.warning(
                "W&B run %s already has steps up to %d: it keeps those and ignores this run's steps %d-%d; "
                "metrics.jsonl holds the resumed run's values",
                run_id,
                run.step - 1,
                start_step + 1,
                run.step - 1,
            )
        return run

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        summary = self.summary.add(row)

        def to_wandb(run) -> None:
            run.log(metrics | self._tables.pop(step, {}), step=step)
            run.summary.update(summary)

        self._to_wandb("log", to_wandb)
        if self.bar is not None:
            postfix = {"reward": metrics.get("rollout/raw_reward"), "tok/s": metrics.get("perf/rollout_tok_per_s")}
            self.bar.set_postfix({k: f"{v:.3g}" for k, v in postfix.items() if v is not None}, refresh=False)
            self.bar.update(step - self.bar.n)

    def log_samples(self, step: int, samples) -> None:
        """A step's samples (`samples.rows()`; None for a step that has none to train on: its file is empty, for
        --debug train-only to replay it as such): every one as a JSON line in rollouts/step_N.jsonl with
        `tracking.save_rollouts`, and a W&B table of them every `tracking.sample_every` steps."""
        t = self.cfg.tracking
        table_now = self.wandb is not None and t.sample_every and step % t.sample_every == 0 and samples is not None
        save = t.save_rollouts or self.cfg.run.debug == "rollout-only"  # what train-only replays
        if not (save or table_now):
            return
        rows = samples.rows() if samples is not None else []
        if save:
            from rlloop.replay import write_rollouts  # the loop's modules: not for the driver's early checks

            write_rollouts(self.run_dir / "rollouts", step, rows)
        if table_now:
            import wandb

            columns = ["prompt", "response", "answer", "reward", "advantage", "weight_version"]
            data = [[json.dumps(r["prompt"]) if not isinstance(r["prompt"], str) else r["prompt"]] for r in rows]
            for cells, r in zip(data, rows):
                cells += [r["response"], r["answer"], r["reward"], r["advantage"], r["weight_version"]]
            self._tables[step] = {"samples": wandb.Table(columns=columns, data=data)}  # logged with its metrics

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.close(failed=error is not None)

    def close(self, failed: bool = False) -> None:
        """The report, the curves and W&B's summary (again: a resumed run that logged no step has sent none); W&B
        marks the run failed when `failed` (an error, Ctrl-C), where it showed a stopped run as finished."""
        if self.bar is not None:
            self.bar.close()
        self.file.close()
        rows = read_metrics(self.path)
        if rows:
            plot_curves(rows, self.run_dir / "curves.png")
            (self.run_dir / "report.md").write_text(make_report(self.cfg, rows))
            self._to_wandb("summarise", lambda run: run.summary.update(self.summary.values))
        self._to_wandb("finish", lambda run: run.finish(exit_code=1 if failed else 0))

    def _to_wandb(self, what: str, call) -> None:
        """`call(run)` unless W&B is off or has failed: a W&B that fails (its service killed, the network gone) stops
        W&B, not the run, which would lose the step's checkpoint to it; metrics.jsonl has every step."""
        if self.wandb is None:
            return
        try:
            call(self.wandb)
        except Exception as e:
            problem = f"{type(e).__name__}: {e}"
            log.warning("W&B failed to %s (%s): no more W&B for this run; %s has every step", what, problem, self.path)
            self.wandb = None


def _plain(value):
    """A metric as metrics.jsonl holds it: numbers as floats, numpy's scalars included (json cannot write them).
    NaN and inf are written as json's NaN / Infinity, which Python's json reads back."""
    if getattr(value, "shape", None) == () and hasattr(value, "item"):  # a numpy scalar or 0-d array
        value = value.item()
    return float(value) if isinstance(value, numbers.Real) else value


class RunSummary:
    """What W&B shows for the run as a whole: the last eval scores, the last reward, mean throughput. Kept up to date
    row by row and sent with each step, not only as the run ends: `ray job stop` signals W&B's service as well as the
    driver, and the summary a stopped run wrote at its end never reached W&B."""

    MEANS = ("perf/rollout_tok_per_s", "perf/step_s")  # none before the first step (a run stopped after its eval)

    def __init__(self, rows: list[dict] = ()):
        self.values: dict[str, float] = {}
        self._totals = {key: [0.0, 0] for key in self.MEANS}
        for row in rows:
            self.add(row)

    def add(self, row: dict) -> dict[str, float]:
        self.values["steps"] = max(row["step"], self.values.get("steps", row["step"]))
        for key, value in row.items():
            if not isinstance(value, (int, float)):  # an eval key with no number
                continue
            if key.startswith("eval/") or key == "rollout/raw_reward":
                self.values[f"final/{key}"] = value
            elif key in self._totals:
                total = self._totals[key]
                total[0], total[1] = total[0] + value, total[1] + 1
                self.values[f"mean/{key}"] = total[0] / total[1]
        return dict(self.values)


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def expand(patterns, runs: list[list[dict]]) -> list[str]:
    """The metric names `patterns` ("eval/*": every name under eval/) match in the rows of `runs`, in order."""
    keys = sorted({k for rows in runs for r in rows for k in r})
    out = []
    for p in patterns:
        out += [k for k in keys if k.startswith(p[:-1])] if p.endswith("*") else [p] if p in keys else []
    return list(dict.fromkeys(out))


def plot_curves(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in expand(CURVES, [rows]) if _series(rows, k)[0]]
    if not keys:  # nothing numeric to draw
        return
    cols = 4
    fig, axes = plt.subplots(
        (len(keys) + cols - 1) // cols, cols, figsize=(4 * cols, 3 * ((len(keys) + cols - 1) // cols)), squeeze=False
    )
    for ax, key in zip(axes.flat, keys):
        ax.plot(*_series(rows, key), marker="." if len(rows) < 50 else None)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def make_report(cfg: Config, rows: list[dict]) -> str:
    _, reward = _series(rows, "rollout/raw_reward")
    k = max(1, min(5, len(reward) // 3))
    steps = max(r["step"] for r in rows)
    # --debug runs one role: say so, and leave out what the other would have done
    what = {
        "rollout-only": "rollouts (--debug rollout-only: no training)",
        "train-only": f"GRPO training on the rollouts of {cfg.run.replay} (--debug train-only: no engine)",
    }.get(cfg.run.debug, "GRPO")
    source = f"rollout backend {cfg.rollout.backend}" if cfg.run.debug != "train-only" else "saved rollouts"
    sync = f"; sync {cfg.sync.transport}{' + delta' if cfg.sync.delta else ''}" if cfg.run.debug == "off" else ""
    lines = [
        f"# {cfg.run.name}: {steps} steps of {what} on {cfg.model.path}",
        "",
        f"- data: {cfg.data.path}; {cfg.rollout.prompts_per_step} prompts x {cfg.rollout.group_size} samples "
        f"per step; {source}{sync}",
    ]
    if reward:  # none before the first step: a run stopped after its step-0 eval has only that to report
        lines.append(
            f"- reward (rollout/raw_reward): first {k} steps {_mean(reward[:k]):.3f} -> last {k} steps "
            f"{_mean(reward[-k:]):.3f}"
        )
    for key in sorted({k for r in rows for k in r if k.startswith("eval/")}):
        steps, values = _series(rows, key)
        lines.append(f"- {key}: " + ", ".join(f"step {s}: {v:.3f}" for s, v in zip(steps, values)))
    timed = ["perf/step_s", "perf/rollout_s", "perf/train_s", "perf/sync_s", "perf/rollout_tok_per_s"]
    if cfg.run.debug != "off":  # one role: nothing is synced (the other's times are not there, and are left out below)
        timed.remove("perf/sync_s")
    timing = {key: _mean(values) for key in timed if (values := _series(rows, key)[1])}
    if timing:
        lines.append("- mean per step: " + ", ".join(f"{k.split('/')[1]} {v:.3g}" for k, v in timing.items()))
    sent, full = _series(rows, "sync/bytes")[1], _series(rows, "sync/full_bytes")[1]
    if sent and sum(sent):
        # a delta that does not pay is not sent (docs/design.md §6.6): then every version is a keyframe
        keyframes = _series(rows, "sync/keyframe")[1]
        in_full = bool(keyframes) and all(k == 1.0 for k in keyframes)
        saving = "every version in full" if in_full else f"{sum(full) / sum(sent):.1f}x smaller"
        lines.append(f"- weight sync: {sum(sent) / 1e6:.2f} MB sent for {sum(full) / 1e6:.2f} MB of weights ({saving})")
    compiles = _series(rows, "perf/compiles")[1]
    if compiles:
        lines.append(f"- decoder compiles after warmup: {int(sum(compiles))}")
    return "\n".join(lines) + "\n"
