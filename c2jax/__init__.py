"""c2jax: the Composer 2 recipe in JAX (MoE models, CPT, async RL, self-summarization).

Importing c2jax changes no process state: entry points that run XLA on the CPU call
`c2jax.hostmem.retain_freed_memory()` first (the CLI's `main` does).
"""
import importlib

__version__ = "0.1.0"

_LAZY = ("config", "models", "hf", "sampling", "parallel", "data", "train", "agent", "tasks", "rl", "evals",
         "hostmem")


def __getattr__(name):
    if name in _LAZY:
        return importlib.import_module(f"c2jax.{name}")
    raise AttributeError(f"module 'c2jax' has no attribute {name!r}")
