"""The vLLM side of `python -m rlloop.bench rollout`: run by the interpreter of a separate vLLM-CPU environment.

    VLLM_PYTHON rlloop/bench/vllm_worker.py MODEL_DIR N NEW_TOKENS DTYPE < requests

vLLM pins its own transformers (< 5.20) and torch build, so it cannot share rlloop's environment; this file imports
nothing from rlloop. It loads the model once, then for each line on stdin (a JSON list of prompts as token ids)
generates N samples per prompt of exactly NEW_TOKENS tokens (T=1, no top-k/top-p, ignore_eos, token ids in and out,
no detokenizing) and answers one JSON line {"tokens": generated tokens}. Timing is the caller's, around the round
trip. Until the model is loaded it prints nothing on stdout but the line "ready".
"""

import json
import os
import sys


def main() -> None:
    model, n, new_tokens, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    # The answers get a private copy of stdout; fd 1 becomes stderr, so no log line of vLLM or of the engine
    # processes it spawns (they inherit fd 1) can reach the answer channel.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from vllm import LLM, SamplingParams

    # vLLM's default prefix cache, by which a prompt's n samples may share its prefill, as the JAX engine's fan-out
    # copies one prompt's KV into its samples' slots (docs/benchmarks.md measures it: no gain here, each round's
    # prompts all prefill in one engine step). Emptied before each round: the next would reuse the KV of the same
    # prompts, which the JAX engine prefills anew each time.
    llm = LLM(model=model, dtype=dtype, skip_tokenizer_init=True, seed=0, enforce_eager=False)
    params = SamplingParams(n=n, temperature=1.0, top_p=1.0, top_k=0, max_tokens=new_tokens, ignore_eos=True)
    params.detokenize = False
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        prompts = [{"prompt_token_ids": ids} for ids in json.loads(line)]
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not empty its prefix cache")
        results = llm.generate(prompts, params, use_tqdm=False)
        tokens = sum(len(c.token_ids) for r in results for c in r.outputs)
        out.write(json.dumps({"tokens": tokens}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
