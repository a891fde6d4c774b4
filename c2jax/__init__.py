"""c2jax: the Composer 2 recipe in JAX (MoE models, CPT, async RL, self-summarization)."""
import importlib

from c2jax import hostmem

# Before anything starts XLA's threads: they must allocate from the arena set up here.
hostmem.retain_freed_memory()

__version__ = "0.1.0"

_LAZY = ("config", "models", "hf", "sampling", "parallel", "data", "train", "agent", "tasks", "rl", "evals")


def __getattr__(name):
    if name in _LAZY:
        return importlib.import_module(f"c2jax.{name}")
    raise AttributeError(f"module 'c2jax' has no attribute {name!r}")
