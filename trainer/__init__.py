"""The PyTorch trainer: HF causal LM, GRPO-family policy loss, micro-batching, data parallelism, weight export.

Never imports rollout/, weight_sync/ or rlloop/: it takes token-id lists in a TrainBatch and hands weights out as
numpy / ml_dtypes arrays keyed by Hugging Face parameter names.
"""
from trainer.batching import TrainBatch, shard_batch
from trainer.loss import LossConfig, kl_penalty, policy_loss
from trainer.trainer import Trainer, TrainerConfig

__all__ = ["LossConfig", "TrainBatch", "Trainer", "TrainerConfig", "kl_penalty", "policy_loss", "shard_batch"]
