"""The PyTorch trainer: HF causal LM, GRPO-family policy loss, micro-batching, data parallelism, weight export.

Never imports rollout/, weight_sync/ or rlloop/: it takes token-id lists in a TrainBatch and hands weights out as
numpy / ml_dtypes arrays keyed by Hugging Face parameter names. The configs (trainer.config) import no torch; the
rest loads lazily, so `from trainer import TrainerConfig` stays cheap for the driver.
"""

from importlib import import_module

from trainer.config import LossConfig, TrainerConfig
from trainer.errors import NonFiniteTraining

_LAZY = {
    "TrainBatch": "trainer.batching",
    "shard_batch": "trainer.batching",
    "kl_penalty": "trainer.loss",
    "policy_loss": "trainer.loss",
    "Trainer": "trainer.trainer",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")


__all__ = [
    "LossConfig",
    "NonFiniteTraining",
    "TrainBatch",
    "Trainer",
    "TrainerConfig",
    "kl_penalty",
    "policy_loss",
    "shard_batch",
]
