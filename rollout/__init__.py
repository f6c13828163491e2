"""The rollout engine: turns prompts into sampled completions with per-token log-probs.

Two backends share one protocol (`RolloutEngine`): `"jax"`, the bucketed compiled decoder (rollout.engine), and
`"hf"`, a reference on `transformers.generate` (rollout.hf_backend). Imports stay lazy so that `import rollout`
pulls in neither jax nor torch.
"""
from rollout.types import Completion, RolloutEngine, SamplingParams

BACKENDS = ("hf", "jax")


def make_engine(backend: str, **kwargs) -> RolloutEngine:
    """Build a rollout engine: `make_engine("hf", model_path=...)` or `make_engine("jax", model_path=..., ...)`."""
    if backend == "hf":
        from rollout.hf_backend import HFEngine
        return HFEngine(**kwargs)
    if backend == "jax":
        from rollout.engine import EngineConfig, JaxEngine
        return JaxEngine(EngineConfig(**kwargs))
    raise ValueError(f"unknown rollout backend {backend!r}; expected one of {', '.join(BACKENDS)}")


__all__ = ["SamplingParams", "Completion", "RolloutEngine", "make_engine", "BACKENDS"]
