"""Kernel tests: a persistent JAX compilation cache makes reruns much faster (interpret-mode
kernels spend most of their time compiling). Set C2JAX_JAX_CACHE="" to disable."""
import os

import jax

_cache = os.environ.get("C2JAX_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "c2jax_jax_cache"))
if _cache:
    jax.config.update("jax_compilation_cache_dir", _cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
