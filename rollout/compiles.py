"""Counting XLA compiles: every backend compile in this process, whoever triggers it (a jax.monitoring listener).

The engine compiles each bucket's program once, in warmup; tests and `perf/compiles` use this count to show that
steady state compiles nothing. A program loaded from the persistent compilation cache counts too (JAX times the
compile-or-load as one event): after warmup either is a program warmup did not prepare.
"""

import jax

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles = 0


def _on_duration_event(event: str, duration: float, **_) -> None:
    global _compiles
    if event == _BACKEND_COMPILE_EVENT:
        _compiles += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration_event)


def compile_count() -> int:
    """XLA compiles in this process so far (all jit programs, not only the engine's)."""
    return _compiles
