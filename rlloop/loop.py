"""The GRPO loop, read top to bottom like the recipe:
data -> rollout -> reward -> advantages -> train -> sync -> log -> checkpoint.

Everything clever lives behind these calls: the compiled decoder in `rollout/`, the loss in `trainer/`, the
transports in `weight_sync/`, placement in `rlloop/cluster.py`.
"""
from __future__ import annotations

import hashlib
import json
import re
import time
from contextlib import ExitStack, closing
from pathlib import Path

from rlloop.checkpoint import latest_checkpoint, load_state, save_checkpoint
from rlloop.cluster import Cluster
from rlloop.config import Config, to_yaml
from rlloop.data import PromptData
from rlloop.rewards import RewardScorer
from rlloop.samples import collect, evaluate, stop_token_ids
from rlloop.tracking import Tracker


def run_id_for(run_dir: Path) -> str:
    """Stable across resumes of one run directory, distinct between runs: it names shared-memory segments."""
    digest = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '-', run_dir.name)[:32]}-{digest}"


class ModelError(ValueError):
    """The model or tokenizer a config names cannot be loaded; the message names the key."""


def load_tokenizer(cfg: Config):
    """The tokenizer, after checking that model.path holds a model config: both fail here, in the driver, with the
    key named, rather than as a traceback from inside an actor (the usual cause: a hub id with no network)."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer_key = "model.tokenizer" if cfg.model.tokenizer else "model.path"
    for key, loader in (("model.path", AutoConfig), (tokenizer_key, AutoTokenizer)):
        source = cfg.model.tokenizer if key == "model.tokenizer" else cfg.model.path
        local = Path(source).exists() or source.startswith(("/", "."))
        if local and not Path(source).is_dir():
            raise ModelError(f"{key}: {source!r} is not a directory")
        try:
            loaded = loader.from_pretrained(source)
        except (OSError, ValueError) as e:
            reason = " ".join(str(e).split())[:400] or type(e).__name__
            hint = "" if local else (f"\n(offline? download it beforehand, e.g. `hf download {source}`, or set {key} "
                                     "to a local directory)")
            raise ModelError(f"{key}: cannot load {source!r}: {reason}{hint}") from None
    return loaded


def load_data(cfg: Config, tokenizer):
    d = cfg.data
    train = PromptData(d.path, tokenizer, split=d.split, prompt_key=d.prompt_key, answer_key=d.answer_key,
                       max_prompt_len=d.max_prompt_len, on_long_prompt=d.on_long_prompt, shuffle=d.shuffle,
                       seed=cfg.run.seed)
    evals = None
    if cfg.eval.path:
        evals = PromptData(cfg.eval.path, tokenizer, split=cfg.eval.split, prompt_key=d.prompt_key,
                           answer_key=d.answer_key, max_prompt_len=d.max_prompt_len, on_long_prompt="drop",
                           shuffle=False)
    return train, evals


def train(cfg: Config, resume: bool = False) -> Path:
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    tokenizer = load_tokenizer(cfg)
    data, eval_data = load_data(cfg, tokenizer)
    eval_name = cfg.eval.name or (Path(cfg.eval.path).stem if cfg.eval.path else None)
    stop_ids = stop_token_ids(tokenizer, cfg.model.path)
    ckpt = latest_checkpoint(run_dir) if resume else None
    start = load_state(ckpt)["step"] if ckpt else 0
    with ExitStack() as stack:  # closed in reverse: tracker, cluster (actors, shm, Ray), reward workers
        scorer = stack.enter_context(closing(RewardScorer(cfg.reward.fn, timeout_s=cfg.reward.timeout_s,
                                                          failure_reward=cfg.reward.failure_reward,
                                                          workers=cfg.reward.workers)))
        cluster = stack.enter_context(closing(Cluster(cfg, str(run_dir), run_id_for(run_dir))))
        tracker = stack.enter_context(closing(Tracker(cfg, run_dir, start)))
        if ckpt:  # model, optimizer and RNG from the checkpoint; the engine gets those weights; same data order
            cluster.load(str(ckpt / "trainer"))
            data.load_state_dict(load_state(ckpt)["data"])
            cluster.sync_weights(version=start)
        (run_dir / "warmup.json").write_text(json.dumps(cluster.warmup(), indent=1))
        if eval_data is not None and start == 0 and cfg.run.eval_every:
            tracker.log(0, evaluate(cfg, eval_data, cluster, tokenizer, scorer, stop_ids, eval_name))

        for step in range(start + 1, cfg.run.steps + 1):
            t_step = time.perf_counter()
            samples, metrics = collect(cfg, step, data, cluster, tokenizer, scorer, stop_ids)  # rollout+reward+adv
            if samples is not None:
                t0 = time.perf_counter()
                metrics |= cluster.train_step(samples.to_train_batch(cfg.rollout.group_size))
                t1 = time.perf_counter()
                metrics |= cluster.sync_weights(version=step)
                metrics |= {"perf/train_s": t1 - t0, "perf/sync_s": time.perf_counter() - t1}
                if cfg.tracking.save_rollouts:
                    save_rollouts(run_dir, step, samples.rows(cfg.rollout.group_size))
            if eval_data is not None and cfg.run.eval_every and step % cfg.run.eval_every == 0:
                metrics |= evaluate(cfg, eval_data, cluster, tokenizer, scorer, stop_ids, eval_name)
            metrics |= {"perf/step_s": time.perf_counter() - t_step, "data/dropped_prompts": data.dropped,
                        "rollout/reward_failures": scorer.errors + scorer.timeouts}
            tracker.log(step, metrics)
            if cfg.run.save_every and (step % cfg.run.save_every == 0 or step == cfg.run.steps):
                save_checkpoint(run_dir, step, {"data": data.state_dict()}, cluster.save)
    return run_dir


def save_rollouts(run_dir: Path, step: int, rows: list[dict]) -> None:
    out = run_dir / "rollouts"
    out.mkdir(exist_ok=True)
    (out / f"step_{step:06d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
