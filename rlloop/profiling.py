"""`run.profile_steps`: the chosen steps' generation and training recorded by each framework's own profiler.

For a step in `run.profile_steps`, `run_dir/profile/step_N/` gets
- `engine{e}/`: JAX's profiler over that engine's generate calls for the step (`plugins/profile/<time>/` with a
  `*.xplane.pb` for TensorBoard / XProf and a `perfetto_trace.json.gz` for ui.perfetto.dev); a `transformers` engine
  writes torch's files instead, as below;
- `trainer_rank{r}.json`: torch's profiler over that rank's train step, a Chrome trace (Perfetto, chrome://tracing),
  and `trainer_rank{r}.txt`, its ops ranked by their own time.

The paths are plain strings so that the workers, which may run on other nodes of a Ray cluster, write where the
checkpoints go. In `loop.mode: fully_async` generation runs in chunks, not steps: step N's is the N-th chunk after the
start, the one that step takes unless groups were dropped.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the workers use the tracers alone
    from rlloop.config import Config

log = logging.getLogger(__name__)

TOP_OPS = 40  # rows of the .txt summary


def profile_dir(cfg: Config, step: int) -> str | None:
    """Where step `step`'s traces go, or None when it is not one to profile."""
    return str(cfg.run_dir / "profile" / f"step_{step:06d}") if step in cfg.run.profile_steps else None


def engine_trace(profile: str | None, engine: int) -> str | None:
    """Engine `engine`'s part of a step's profile directory."""
    return None if profile is None else str(Path(profile) / f"engine{engine}")


def rank_trace(profile: str | None, rank: int) -> str | None:
    """Trainer rank `rank`'s part of a step's profile directory."""
    return None if profile is None else str(Path(profile) / f"trainer_rank{rank}")


# Each profiler records one thing at a time per process: JAX's raises on a second trace, and two of torch's at once
# (an engine and a trainer in one process, `cluster.use_ray: false`, async modes) crashed the process.
_JAX_BUSY, _TORCH_BUSY = threading.Lock(), threading.Lock()


@contextlib.contextmanager
def _traced(busy: threading.Lock, path: str | None, start, stop):
    """Run the body traced into `path`: `start()` returns the profiler, `stop(profiler)` ends it and writes its
    files. Untraced, with a warning, while this process's profiler records another call; a profiler that cannot
    start or a trace that cannot be written is a warning too: profiling never fails a step."""
    if path is None:
        yield
        return
    if not busy.acquire(blocking=False):
        log.warning("not profiled: %s (this process's profiler is recording another call)", path)
        yield
        return
    try:
        try:
            profiler = start()
        except Exception as e:
            log.warning("not profiled: %s (%s: %s)", path, type(e).__name__, e)
            yield
            return
        try:
            yield
        finally:  # a step that raised is traced too, up to where it failed
            try:
                stop(profiler)
            except Exception as e:
                log.warning("profile %s not written: %s: %s", path, type(e).__name__, e)
    finally:
        busy.release()


def jax_trace(path: str | None):
    """JAX's profiler into the directory `path` (nothing when None)."""
    import jax

    def start():
        # Made first: JAX writes the directory only as the trace stops, and a session whose files cannot be written
        # stays started (jax 0.10), so that every later trace in this process was refused as one already running
        Path(path).mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(path, create_perfetto_trace=True)

    return _traced(_JAX_BUSY, path, start, lambda _: jax.profiler.stop_trace())


def torch_trace(path: str | None):
    """torch's profiler (CPU, and CUDA where there is one): `path`.json, a Chrome trace, and `path`.txt, the ops
    by self time (nothing when None)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()

    def start():
        profiler = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
        profiler.start()
        return profiler

    def stop(profiler):
        profiler.stop()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(f"{path}.json")
        by = "self_device_time_total" if cuda else "self_cpu_time_total"
        Path(f"{path}.txt").write_text(profiler.key_averages().table(sort_by=by, row_limit=TOP_OPS) + "\n")

    return _traced(_TORCH_BUSY, path, start, stop)
