"""The policy trainer: a Hugging Face causal LM, AdamW, micro-batched GRPO steps, export, checkpoints.

One `train_step` per rollout batch: with `minibatches` > 1, score the batch under the current weights (the "old" policy;
with one, πold is the policy itself, detached); split it into `minibatches` optimizer steps, and for each accumulate
gradients over micro-batches packed to a token budget. Every loss aggregation is a sum divided by a batch-level constant
(trainer/loss.py), so the trainer computes those constants over the whole minibatch (and across ranks) first; the summed
micro-batch gradients then equal the full-minibatch gradient exactly, whatever the packing and however many ranks share
the batch.

bfloat16 keeps fp32 master weights for AdamW (Megatron-style): at RL learning rates (~1e-6) most updates are far below
a bf16 weight's resolution and would round away. The model computes in bf16; gradients are accumulated in fp32 on the
masters; after each step the masters are rounded into the model, which is also what `export_weights` returns.

With several ranks the model is either replicated (`ddp`) or sharded with FSDP2 (`fsdp`); trainer/parallel.py says
how, and why the two give the same numbers.
"""

import copy

import numpy as np
import torch

from trainer import checkpoint
from trainer.batching import MicroBatch, TrainBatch, collate, minibatch_indices, plan_micro_batches, validate_batch
from trainer.config import TrainerConfig, resolve_parallel
from trainer.distributed import all_reduce_, all_reduce_grads_, broadcast_params_, init_distributed, resolve_device
from trainer.errors import NonFiniteTraining
from trainer.logprobs import lm_head_on_tensor_cores
from trainer.loss import policy_loss
from trainer.optimizer import make_optimizer
from trainer.parallel import (
    LogprobModel,
    even_out,
    full_tensors,
    local,
    shard_fsdp,
    to_numpy,
    whole,
)
from trainer.policy_model import load_policy_model

# Summed over micro-batches and ranks (they are aggregated losses); every other loss metric is a token mean.
ADDITIVE_METRICS = ("loss", "pg_loss", "kl_loss")
TOKEN_MEAN_METRICS = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy", "logprob_abs_diff")
COUNTS = ("tokens", "micro_batches", "skipped_samples")  # tokens trained; samples skipped for a zero advantage


class Trainer:
    def __init__(self, cfg: TrainerConfig, rank: int = 0, world_size: int = 1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside world_size={world_size}")
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.device = resolve_device(cfg.device)
        torch.manual_seed(cfg.seed)
        init_distributed(rank, world_size, cfg.device)
        # nccl only reduces device tensors; gloo takes CPU ones.
        self.reduce_device = self.device if cfg.device == "cuda" else torch.device("cpu")
        self.parallel = resolve_parallel(cfg.parallel, world_size)
        self.export_dtype = getattr(torch, cfg.dtype)
        sharded = self.parallel == "fsdp"

        self.model, loaded = load_policy_model(cfg, self.device, sharded)
        lm_head_on_tensor_cores(self.device, cfg.dtype)
        # Exact only while a zero advantage zeroes a sample's whole loss: no KL term, no entropy bonus.
        self.skip_zero_advantage = cfg.skip_zero_advantage and cfg.loss.kl_coef == 0.0 and cfg.loss.entropy_coef == 0.0
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.pad_id = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else 0

        broadcast_params_(list(self.model.parameters()))
        self.scorer, self.ref_scorer = LogprobModel(self.model), None
        if cfg.loss.kl_coef != 0.0:
            self.ref_scorer = LogprobModel(copy.deepcopy(self.model).eval().requires_grad_(False))
        if sharded:
            for scorer in filter(None, (self.scorer, self.ref_scorer)):
                shard_fsdp(scorer, self.device, self.export_dtype)

        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        if cfg.dtype == "float32" or sharded:
            self.masters = self.params
        else:
            self.masters = [torch.nn.Parameter(loaded[n]) for n in self.param_names]
        del loaded
        self.optimizer, self.scheduler = make_optimizer(cfg, named, self.masters)
        self.step = 0
        self.bad_steps = 0  # non-finite optimizer steps in a row

    # ------------------------------------------------------------------ training

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One rollout batch (this rank's share when world_size > 1) → `minibatches` optimizer steps.

        Returns `train/*` metrics for the whole batch over all ranks (identical on every rank).
        """
        minibatches = self._agreed_minibatches(batch)
        norms = [self._normalisers(batch, idx) for idx in minibatches]
        trained = [self._trained(batch, idx) for idx in minibatches]
        plans = [self._plan(batch, idx) for idx in trained]
        # With one minibatch the weights that scored the batch are the ones being trained: πold = πθ.detach(),
        # as TRL does, which saves a forward pass. Otherwise every minibatch must see the pre-step policy.
        old = [self._score(self.scorer, mbs) for mbs in plans] if len(plans) > 1 else [None] * len(plans)
        ref = [self._score(self.ref_scorer, mbs) for mbs in plans] if self.ref_scorer else [None] * len(plans)

        totals: dict[str, float] = {}
        lr = None  # the rate of the last update applied
        grad_norms = []
        for mbs, norms_mb, old_mb, ref_mb in zip(plans, norms, old, ref):
            self.optimizer.zero_grad(set_to_none=True)
            for key, value in self._accumulate_gradients(mbs, norms_mb, old_mb, ref_mb).items():
                # Losses are per optimizer step (averaged over minibatches); token sums simply add up.
                totals[key] = totals.get(key, 0.0) + (value / len(plans) if key in ADDITIVE_METRICS else value)
            rate = self.optimizer.param_groups[0]["lr"]
            grad_norms.append(self._optimizer_step())
            lr = rate if np.isfinite(grad_norms[-1]) else lr  # of an update applied, not of one skipped
        totals["skipped_samples"] = float(len(batch) - sum(map(len, trained)))
        metrics = self._finish_metrics(totals, batch)
        metrics["train/grad_norm"] = float(np.mean(grad_norms))
        if lr is not None:  # none when every update was skipped
            metrics["train/lr"] = lr
        metrics["train/minibatches"] = float(len(plans))
        metrics["train/skipped_steps"] = float(sum(not np.isfinite(g) for g in grad_norms))
        if self.bad_steps >= self.cfg.max_bad_steps:
            raise NonFiniteTraining(
                f"optimizer step {self.step}: the loss or its gradient was non-finite in {self.bad_steps} optimizer "
                f"steps in a row (train.max_bad_steps={self.cfg.max_bad_steps}); those updates were skipped, so the "
                "weights are intact. Lower train.lr or check the rewards, then rerun with --resume"
            )
        return metrics

    def _agreed_minibatches(self, batch: TrainBatch) -> list[list[int]]:
        """The sample indices of each optimizer step's minibatch of this rank's share, once every rank has found its
        share valid and taking as many optimizer steps as the others' (one would otherwise wait in the others'
        collectives for ever); a ValueError on every rank if any share is not."""
        steps = len(batch.minibatch_sizes or ())
        fewest, most_neg = all_reduce_(torch.tensor([len(batch), -steps], device=self.reduce_device), op="min").tolist()
        try:
            validate_batch(batch, self.vocab_size)
            minibatches = minibatch_indices(batch, self.cfg.minibatches, int(fewest))
            if -most_neg != steps:
                raise ValueError(f"the ranks' shares take {steps} to {-most_neg} optimizer steps")
            problem = None
        except ValueError as e:
            problem = e
        rejected = torch.tensor([problem is not None], dtype=torch.int32, device=self.reduce_device)
        all_reduce_(rejected)
        if problem is not None:
            raise problem
        if int(rejected):
            raise ValueError("another rank rejected its share of this TrainBatch (see that rank's error)")
        return minibatches

    def compute_gradients(
        self,
        batch: TrainBatch,
        old_logprobs: list[list[float]] | None = None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The gradient of `batch` taken as ONE minibatch (summed over ranks), keyed by HF parameter name, and the
        step's metrics; no weights change. `old_logprobs` stands in for πold (default: the current policy).
        For debugging and for tests of the micro-batching."""
        validate_batch(batch, self.vocab_size)
        if old_logprobs is not None:
            validate_batch(TrainBatch(batch.prompts, batch.responses, batch.advantages, old_logprobs), self.vocab_size)
        everything = list(range(len(batch)))
        norms, trained = self._normalisers(batch, everything), self._trained(batch, everything)
        mbs = self._plan(batch, trained)
        old = None
        if old_logprobs is not None:
            old = [
                collate(
                    TrainBatch(batch.prompts, batch.responses, batch.advantages, old_logprobs), mb.indices
                ).rollout_logp.to(self.device)
                for mb in mbs
            ]
        ref = self._score(self.ref_scorer, mbs) if self.ref_scorer is not None else None
        self.optimizer.zero_grad(set_to_none=True)
        sums = self._accumulate_gradients(mbs, norms, old, ref)
        sums["skipped_samples"] = float(len(batch) - len(trained))
        if self.parallel == "ddp":
            all_reduce_grads_(self.masters)
        grads = {n: whole(m.grad).clone() for n, m in zip(self.param_names, self.masters) if m.grad is not None}
        self.optimizer.zero_grad(set_to_none=True)
        return grads, self._finish_metrics(sums, batch)

    @torch.no_grad()
    def compute_logprobs(self, prompts: list[list[int]], responses: list[list[int]]) -> list[np.ndarray]:
        """log π(response token | prefix) at the configured temperature, one float32 array per sample."""
        batch = TrainBatch(prompts, responses, [0.0] * len(prompts))
        validate_batch(batch, self.vocab_size)
        out: list[np.ndarray] = [None] * len(batch)
        mbs = self._plan(batch, list(range(len(batch))))
        for mb, logp in zip(mbs, self._score(self.scorer, mbs)):
            for row, i in enumerate(mb.indices):
                out[i] = logp[row, : len(responses[i])].cpu().numpy().astype(np.float32)
        return out

    def _trained(self, batch: TrainBatch, indices: list[int]) -> list[int]:
        """The samples of `indices` that need a forward and backward: all, or those whose advantage is not 0."""
        if not self.skip_zero_advantage:
            return indices
        return [i for i in indices if batch.advantages[i] != 0.0]

    def _normalisers(self, batch: TrainBatch, indices: list[int]) -> dict[str, float]:
        """The loss aggregation's batch-level constants (trainer/loss.py) over the minibatch `indices` on all ranks,
        skipped samples included: the summed micro-batch losses are then exactly the whole minibatch's."""
        lengths = [len(batch.responses[i]) for i in indices]
        here = torch.tensor([len(lengths), sum(lengths)], dtype=torch.float64, device=self.reduce_device)
        everywhere = all_reduce_(here.clone())
        longest = int(all_reduce_(torch.tensor([max(lengths)], device=self.reduce_device), op="max"))
        return dict(
            total_sequences=float(everywhere[0]),
            total_tokens=float(here[1] if self.cfg.loss.loss_agg == "bnpo" else everywhere[1]),
            max_completion_len=self.cfg.max_response_len or longest,
        )

    def _plan(self, batch: TrainBatch, indices: list[int]) -> list[MicroBatch]:
        cfg = self.cfg
        return plan_micro_batches(
            batch, indices, cfg.micro_batch_tokens, self.pad_id, cfg.share_prompts, cfg.pad_multiple
        )

    def _even_out(self, mbs: list[MicroBatch]) -> tuple[list[MicroBatch], int]:
        """Under fsdp every rank must run as many forwards as the busiest one (trainer/parallel.py)."""
        return even_out(mbs, self.pad_id, self.reduce_device) if self.parallel == "fsdp" else (mbs, len(mbs))

    @torch.no_grad()
    def _score(self, scorer: LogprobModel, mbs: list[MicroBatch]) -> list[torch.Tensor]:
        padded, real = self._even_out(mbs)
        scored = [scorer(mb, self.cfg.temperature)[0] for mb in padded][:real]
        if self.parallel == "fsdp":  # FSDP2 reshards the root unit after a backward; a forward alone leaves it
            scorer.reshard()  # gathered: the KL reference would hold its embedding and LM head whole on every rank
        return scored

    def _accumulate_gradients(
        self,
        mbs: list[MicroBatch],
        norms: dict[str, float],
        old: list[torch.Tensor] | None,
        ref: list[torch.Tensor] | None,
    ) -> dict[str, float]:
        """Backward every micro-batch of one minibatch into the masters' .grad; return summed metrics. `norms`: the
        minibatch's `_normalisers`."""
        cfg = self.cfg
        # bnpo normalises by this rank's tokens; averaging over ranks (TRL/DDP semantics) rather than summing.
        scale = 1.0 / self.world_size if cfg.loss.loss_agg == "bnpo" else 1.0

        sums = {k: 0.0 for k in ADDITIVE_METRICS + TOKEN_MEAN_METRICS}
        sums["tokens"], sums["micro_batches"] = 0.0, float(len(mbs))
        padded, real = self._even_out(mbs)
        for j, mb in enumerate(padded):
            if j >= real:  # a filler: joins the collectives, adds nothing to the gradient
                (self.scorer(mb, cfg.temperature)[0].sum() * 0.0).backward()
                continue
            mask = mb.response_mask.to(self.device)
            logp, entropy = self.scorer(
                mb, cfg.temperature, with_entropy=True, entropy_grad=cfg.loss.entropy_coef != 0.0
            )
            loss, m = policy_loss(
                logp,
                old[j] if old is not None else logp.detach(),
                mb.advantages.to(self.device),
                mask,
                cfg.loss,
                ref_logp=ref[j] if ref is not None else None,
                rollout_logp=mb.rollout_logp.to(self.device) if mb.rollout_logp is not None else None,
                entropy=entropy,
                **norms,
            )
            (loss * scale).backward()
            if self.masters is not self.params:
                self._move_grads_to_masters()
            tokens = mb.num_tokens
            sums["loss"] += float(loss.detach()) * scale
            sums["tokens"] += tokens
            for key in ("pg_loss", "kl_loss"):
                sums[key] += float(m[key]) * scale
            for key in TOKEN_MEAN_METRICS:
                if key in m:
                    sums[key] += float(m[key]) * tokens
        if all(m.grad is None for m in self.masters):
            # Every sample here was skipped for a zero advantage (under fsdp on every rank, or fillers would have run
            # a backward): the gradient is exactly zero, and AdamW still takes its step (momentum, weight decay), as
            # it would after computing it. DDP's all-reduce fills a missing gradient with zeros the same way.
            for m in self.masters:
                m.grad = torch.zeros_like(m)
        return sums

    def _finish_metrics(self, sums: dict[str, float], batch: TrainBatch) -> dict[str, float]:
        keys = list(sums)
        totals = all_reduce_(torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.reduce_device))
        totals = dict(zip(keys, totals.tolist()))
        out = {f"train/{k}": totals[k] for k in ADDITIVE_METRICS}
        if totals["tokens"]:  # absent when every sample was skipped: there is no token to average over
            out.update({f"train/{k}": totals[k] / totals["tokens"] for k in TOKEN_MEAN_METRICS})
        out.update({f"train/{k}": totals[k] for k in COUNTS})
        if batch.rollout_logprobs is None:  # no engine log-probs to compare with: no gap to report (not a gap of 0)
            out.pop("train/logprob_abs_diff", None)
        if self.cfg.loss.clip_ratio_c is None:
            out.pop("train/pg_clipfrac_lower", None)
        return out

    @torch.no_grad()
    def _move_grads_to_masters(self) -> None:
        # Accumulate in fp32: summing many micro-batches in bf16 would lose the small ones.
        for p, m in zip(self.params, self.masters):
            if p.grad is None:
                continue
            g = p.grad.float()
            m.grad = g if m.grad is None else m.grad.add_(g)
            p.grad = None

    def _optimizer_step(self) -> float:
        if self.parallel == "ddp":  # fsdp reduce-scattered them during backward
            all_reduce_grads_(self.masters)
        grad_norm = float(whole(torch.nn.utils.clip_grad_norm_(self.masters, self.cfg.max_grad_norm)))
        # A non-finite loss gives a non-finite gradient, and its norm is all-reduced: every rank skips the update
        # together (reported as the grad norm and train/skipped_steps) instead of poisoning the weights.
        self.bad_steps = 0 if np.isfinite(grad_norm) else self.bad_steps + 1
        if np.isfinite(grad_norm):
            self.optimizer.step()
            self.scheduler.step()
            if self.masters is not self.params:
                with torch.no_grad():
                    for p, m in zip(self.params, self.masters):
                        p.copy_(m)
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return grad_norm

    # ------------------------------------------------------------------ colocation

    def offload(self) -> None:
        """Move parameters (the reference model's too), fp32 masters and AdamW state to host memory, so a colocated
        engine can use the accelerator; `reload()` brings them back. On CPU there is nothing to move."""
        self._move_state(torch.device("cpu"))

    def reload(self) -> None:
        self._move_state(self.device)

    def _move_state(self, device: torch.device) -> None:
        if self.device.type == "cpu":
            return
        with torch.no_grad():
            self.model.to(device)  # in place: the optimizer keeps pointing at the same Parameters
            if self.ref_scorer is not None:  # the KL term's frozen reference copy
                self.ref_scorer.to(device)
            for m in self.masters:
                m.data = m.data.to(device)
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value) and value.dim() > 0:
                        state[key] = value.to(device)
        if device.type == "cpu" and torch.cuda.is_available():
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ weights and checkpoints

    def export_weights(self) -> dict[str, np.ndarray]:
        """Current weights keyed by HF parameter name, as save_pretrained would write them (a tied lm_head is left
        out), in the model dtype.

        ddp: float32 arrays share memory with the live CPU parameters and bfloat16 ones are views of their bits:
        copy or encode them before the next train_step changes them under you.
        fsdp: a collective, gathered one tensor at a time (trainer/parallel.py); every rank must call it, rank 0
        gets the (fresh) arrays and the other ranks an empty dict."""
        keep = self.parallel != "fsdp" or self.rank == 0
        return {n: to_numpy(t) for n, t in full_tensors(self.model, self.export_dtype, keep=keep)}

    def export_nbytes(self) -> int:
        """The bytes `export_weights` returns, counted without gathering anything (fsdp's tensors count whole)."""
        tensors = {id(t): t for t in self.model.state_dict(keep_vars=True).values()}  # a tied head once
        return sum(t.numel() for t in tensors.values()) * self.export_dtype.itemsize

    def state_nbytes(self) -> dict[str, int]:
        """Bytes this rank holds in a step for parameters (and fp32 masters, a KL term's reference model), gradients
        (by size, one fp32 per master value: a step releases them as it ends) and AdamW state: what fsdp shards."""
        masters = [] if self.masters is self.params else self.masters
        reference = [] if self.ref_scorer is None else list(self.ref_scorer.parameters())
        params = sum(local(p).nbytes for p in [*self.model.parameters(), *masters, *reference])
        grads = sum(local(m).nbytes for m in self.masters)
        optim = sum(  # AdamW's moments; its 0-dim step counters are left out
            local(v).nbytes
            for st in self.optimizer.state.values()
            for v in st.values()
            if torch.is_tensor(v) and v.dim()
        )
        return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}

    def save(self, path) -> None:
        """Write a checkpoint: an HF model directory plus the trainer state (trainer/checkpoint.py). Every rank
        must call it."""
        checkpoint.save(self, path)

    def load(self, path) -> None:
        """Restore what `save` wrote into this trainer (trainer.checkpoint.load says what must match)."""
        checkpoint.load(self, path)
