"""The rollout engine: turns prompts into sampled completions with per-token log-probs.

Two backends share one protocol (`RolloutEngine`): `"jax"`, the bucketed compiled decoder (rollout.engine), and
`"hf"`, a reference on `transformers.generate` (rollout.hf_backend). Both are built from one `EngineConfig`
(rollout.engine_config). Imports stay lazy so that `import rollout` pulls in neither jax nor torch.
"""

from rollout.engine_config import EngineConfig
from rollout.types import DTYPES, Completion, RolloutEngine, SamplingParams, mix_seed, request_id

BACKENDS = ("hf", "jax")


def make_engine(backend: str, cfg: EngineConfig, device: str = "cpu") -> RolloutEngine:
    """Build a rollout engine from `cfg`: "jax" uses all of it (on JAX's default devices); "hf" what
    `HFEngine` says, on torch device `device`."""
    if backend == "hf":
        from rollout.hf_backend import HFEngine

        return HFEngine(cfg, device)
    if backend == "jax":
        from rollout.engine import JaxEngine

        return JaxEngine(cfg)
    raise ValueError(f"unknown rollout backend {backend!r}; expected one of {', '.join(BACKENDS)}")


__all__ = [
    "SamplingParams",
    "Completion",
    "RolloutEngine",
    "EngineConfig",
    "make_engine",
    "BACKENDS",
    "DTYPES",
    "mix_seed",
    "request_id",
]
