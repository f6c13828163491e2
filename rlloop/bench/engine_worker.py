"""One JAX engine of `python -m rlloop.bench rollout --engines N`, in a process of its own, pinned to its cores.

    python -m rlloop.bench.engine_worker MODEL_DIR DTYPE MAX_BATCH MAX_SEQ_LEN CORES < requests

This is how several engines share a CPU host in a run (`cluster.rollout_engines`, docs/design.md §9): each owns some
cores, and its XLA runs single-threaded on one. Pinned before JAX starts, it loads the model, prints "ready", then
for each stdin line (JSON: prompts as token ids, samples per prompt, new tokens, seed) generates (T=1, ignore_eos)
and answers one JSON line {"tokens": generated tokens, "compiles": compiles during the call}.
"""

import json
import os
import sys


def main() -> None:
    model, dtype, max_batch, max_seq_len, cores = sys.argv[1:6]
    cores = [int(c) for c in cores.split(",")]
    os.sched_setaffinity(0, cores)
    if len(cores) == 1:  # as rlloop.cluster sets an engine actor up on one core
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
    from rollout.engine import JaxEngine
    from rollout.engine_config import EngineConfig
    from rollout.types import SamplingParams

    engine = JaxEngine(
        EngineConfig(model_path=model, dtype=dtype, max_batch=int(max_batch), max_seq_len=int(max_seq_len))
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
