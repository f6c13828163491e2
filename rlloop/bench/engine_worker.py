"""JAX engines of `python -m rlloop.bench rollout` (its `jax_tp` column and `--engines N`), each in a process of its
own, pinned to its cores:
the bench's side (`engines_runner`) and the engine's (`main`).

    python -m rlloop.bench.engine_worker MODEL_DIR DTYPE MAX_BATCH MAX_SEQ_LEN CORES < requests

This is how engines share a CPU host in a run (`cluster.rollout_engines`, docs/design.md §9): each owns some cores, with
an XLA host device per core where the model splits over them (tensor parallel), else one device. Pinned before JAX
starts, it loads the model, prints "ready", then for each stdin line (JSON: prompts as token ids, samples per prompt,
new tokens, seed) generates (T=1, ignore_eos) and answers one JSON line {"tokens": generated tokens, "compiles":
compiles during the call}.
"""

import json
import os
import subprocess
import sys
from pathlib import Path


def engines_runner(path: Path, prompts, n, sampling, dtype: str, engines: int):
    """(timed closure, close, compile counter) for `engines` JAX engines in processes of their own
    (`main` below), this process's cores split evenly between them and the prompts dealt out in turn, as
    `cluster.rollout_engines` shares a CPU host. The closure sends every engine its share at once and returns
    when all have answered."""
    cores = sorted(os.sched_getaffinity(0))
    shares = [prompts[e::engines] for e in range(engines)]
    max_seq_len = max(len(p) for p in prompts) + sampling.max_new_tokens
    procs = []
    for e, share in enumerate(shares):
        mine = ",".join(map(str, cores[e::engines]))
        args = [str(path), dtype, str(len(share) * n), str(max_seq_len), mine]
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "rlloop.bench.engine_worker", *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=os.environ | {"JAX_PLATFORMS": "cpu"},
            )
        )
    failed = [proc for proc in procs if proc.stdout.readline().strip() != "ready"]
    if failed:
        for proc in procs:
            proc.kill()
        raise RuntimeError(f"a JAX engine worker failed to start (exit {failed[0].wait(timeout=60)}); its log is above")
    compiles = {"after_warmup": 0.0}

    def run() -> int:
        for proc, share in zip(procs, shares):
            proc.stdin.write(json.dumps([share, n, sampling.max_new_tokens, sampling.seed]) + "\n")
            proc.stdin.flush()
        answers = [json.loads(proc.stdout.readline()) for proc in procs]
        compiles["after_warmup"] += sum(a["compiles"] for a in answers)
        return sum(a["tokens"] for a in answers)

    def close() -> None:
        for proc in procs:
            proc.stdin.close()
        for proc in procs:
            proc.wait(timeout=60)

    run()  # first-call costs, not counted (as for the other engines)
    compiles["after_warmup"] = 0.0
    return run, close, compiles


def main() -> None:
    model, dtype, max_batch, max_seq_len, cores = sys.argv[1:6]
    cores = [int(c) for c in cores.split(",")]
    os.sched_setaffinity(0, cores)
    from rlloop.model_shape import cpu_engine_tp
    from rlloop.placement import cpu_engine_xla_flags
    from rollout.model_config import ModelConfig

    # as a run sets up an engine actor of one chip on these cores
    tp = cpu_engine_tp(ModelConfig.from_dir(model), 1, len(cores))
    os.environ["XLA_FLAGS"] = cpu_engine_xla_flags(tp, len(cores))
    from rollout.engine import JaxEngine
    from rollout.engine_config import EngineConfig
    from rollout.types import SamplingParams

    engine = JaxEngine(
        EngineConfig(model_path=model, dtype=dtype, max_batch=int(max_batch), max_seq_len=int(max_seq_len), tp=tp)
    )
    print("ready", flush=True)  # no warmup(): the caller's untimed first request compiles what its shapes need
    for line in sys.stdin:
        prompts, n, new_tokens, seed = json.loads(line)
        sampling = SamplingParams(
            temperature=1.0, max_new_tokens=new_tokens, stop_token_ids=(), seed=seed, ignore_eos=True
        )
        out = engine.generate(prompts, n, sampling)
        compiles = engine.stats()["compiles"]
        print(json.dumps({"tokens": sum(len(c.token_ids) for c in out), "compiles": compiles}), flush=True)


if __name__ == "__main__":
    main()
