"""The vLLM-CPU column of `python -m rlloop.bench rollout`: vLLM in its own environment (`vllm_worker.py`, run by
that environment's interpreter over a pipe), or the reason there is none."""

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import psutil

VLLM_WORKER = Path(__file__).with_name("vllm_worker.py")
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def vllm_missing(python: str | None) -> str | None:
    """Why there is no vLLM column, or None when `python` is an interpreter with vLLM."""
    if not python:
        return "no vLLM-CPU environment given (--vllm-python or RLLOOP_VLLM_PYTHON; docs/benchmarks.md says how)"
    try:
        probe = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    except OSError as e:  # no such file, not executable: a wrong path, or a stale RLLOOP_VLLM_PYTHON
        return f"{python} cannot be run: {e}"
    if probe.returncode:
        return f"{python} cannot import vllm: {(probe.stderr.strip().splitlines() or ['?'])[-1]}"
    return None


def vllm_runner(path: Path, prompts, n, sampling, dtype: str, python: str):
    """(timed closure, close, preloaded libraries) for vLLM-CPU in its own environment (`vllm_worker.py` over a
    pipe), set up as vLLM recommends for CPU: OpenMP threads bound to this process's cores, tcmalloc and Intel's
    libiomp5 preloaded."""
    cores = sorted(os.sched_getaffinity(0))
    preload = [str(lib) for lib in (TCMALLOC, Path(python).parents[1] / "lib" / "libiomp5.so") if lib.exists()]
    sockets = tempfile.mkdtemp(prefix="rlloop-vllm-")  # vLLM's ZMQ sockets, which it leaves behind at exit
    env = os.environ | {
        "VLLM_RPC_BASE_PATH": sockets,
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
        "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB; plenty for 64 rows x 200 tokens
        "OMP_NUM_THREADS": str(len(cores)),  # else vLLM drops its torch to one thread
        "LD_PRELOAD": ":".join(preload),
        "TOKENIZERS_PARALLELISM": "false",
    }
    args = [python, str(VLLM_WORKER), str(path), str(n), str(sampling.max_new_tokens), dtype]
    proc = subprocess.Popen(args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        proc.wait(timeout=60)
        shutil.rmtree(sockets, ignore_errors=True)
        raise RuntimeError(f"vLLM worker failed to start (exit {proc.returncode}); its log is above")
    request = json.dumps(prompts) + "\n"

    def run() -> int:
        proc.stdin.write(request)
        proc.stdin.flush()
        return json.loads(proc.stdout.readline())["tokens"]

    def close() -> None:
        children = psutil.Process(proc.pid).children(recursive=True)
        pids = [proc.pid] + [c.pid for c in children]
        with contextlib.suppress(BrokenPipeError):  # a worker that died left a request unsent
            proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        # vLLM force-kills its engine process at exit, so Intel OpenMP never unregisters it from /dev/shm
        psutil.wait_procs([c for c in children if c.is_running()], timeout=30)
        for pid in pids:
            for left in Path("/dev/shm").glob(f"__KMP_REGISTERED_LIB_{pid}_*"):
                left.unlink(missing_ok=True)
        shutil.rmtree(sockets, ignore_errors=True)

    try:
        run()  # first-call costs, not counted (as for the other engines)
    except BaseException:  # the caller gets no close() to call: the worker, its engine and its files go now
        close()
        raise
    return run, close, preload
