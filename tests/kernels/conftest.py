"""Kernel tests: a persistent JAX compilation cache makes reruns much faster (interpret-mode
kernels spend most of their time compiling). Set C2JAX_JAX_CACHE="" to disable. The cache is
on only while this folder's tests run: serializing some other executables (e.g. the sampler's
large unrolled decode programs) crashes jaxlib's CPU cache writer.

TPU AOT tests load libtpu; under pytest-xdist (or next to another process that loaded it) the
second loader fails on libtpu's lockfile unless ALLOW_MULTIPLE_LIBTPU_LOAD is set."""
import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import pytest  # noqa: E402
from jax.experimental.compilation_cache import compilation_cache  # noqa: E402

_cache = os.environ.get("C2JAX_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "c2jax_jax_cache"))


@pytest.fixture(scope="module", autouse=True)
def kernel_compilation_cache():
    if not _cache:
        yield
        return
    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    old = {k: getattr(jax.config, k) for k in keys}
    compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", _cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    yield
    for k, v in old.items():
        jax.config.update(k, v)  # the root conftest resets JAX's memoized "cache in use" after the module
