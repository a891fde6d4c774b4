import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import flags  # noqa: E402

flags.FLAGS.mark_as_parsed()  # grain reads absl flags outside an absl app

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def no_persistent_compilation_cache_after_module():
    """A module may turn JAX's persistent compilation cache on for its own compiles; it is off
    again for the next one (jaxlib's CPU cache writer has crashed serializing some sampler
    programs, and JAX memoizes "cache in use" until reset_cache)."""
    yield
    import jax
    from jax.experimental.compilation_cache import compilation_cache
    if jax.config.jax_compilation_cache_dir is not None:
        jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def no_persistent_cache():
    """JAX's persistent compilation cache off for a module's compiles (TPU executables compiled
    against a topology cannot be reloaded from it), restored after."""
    import jax
    old = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", old)


@pytest.fixture
def wide_cpu_kernels(monkeypatch):
    """The CPU product kernels chosen by "auto" whatever the host's vector width (they are slower
    than XLA's paths without AVX-512, c2jax.backends.cpu.kernels.narrow_vectors), so a test of
    their numerics runs them on every host."""
    from c2jax.backends.cpu import kernels as cpu_kernels
    monkeypatch.setenv("C2JAX_CPU_KERNELS", "wide")
    cpu_kernels.narrow_vectors.cache_clear()
    yield
    cpu_kernels.narrow_vectors.cache_clear()
