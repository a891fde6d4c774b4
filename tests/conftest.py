import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import flags  # noqa: E402

flags.FLAGS.mark_as_parsed()  # grain reads absl flags outside an absl app

import c2jax.sections  # noqa: E402,F401  (registers the data / eval / rl config sections)

import shutil  # noqa: E402

import pytest  # noqa: E402

# Test dependencies a machine can install; the run fails without them unless named here, e.g.
# C2JAX_ALLOW_MISSING=bwrap,cpu_kernels. (What a machine cannot have, a TPU, still skips.)
ALLOW_MISSING_ENV = "C2JAX_ALLOW_MISSING"
MISSING_KINDS = ("bwrap", "cpu_kernels")


def missing_dependencies() -> list[str]:
    """What this machine lacks of MISSING_KINDS and has not opted out of, each with its fix."""
    allowed = {x.strip() for x in os.environ.get(ALLOW_MISSING_ENV, "").split(",") if x.strip()}
    unknown = allowed - set(MISSING_KINDS)
    if unknown:
        return [f"{ALLOW_MISSING_ENV} names unknown dependencies {sorted(unknown)}; known: {', '.join(MISSING_KINDS)}"]
    out = []
    if "bwrap" not in allowed:
        from c2jax.agent.sandbox import unavailable_reason
        why = unavailable_reason()
        if why:
            fix = "" if "apt-get install" in why else "\n  fix: sudo apt-get install -y bubblewrap"
            out.append(f"bubblewrap: {why}{fix}")
    if "cpu_kernels" not in allowed:
        cxx = os.environ.get("CXX", "g++")
        if shutil.which(cxx) is None:
            out.append(f"cpu_kernels: the C++ compiler {cxx!r} is not installed, so the CPU kernels cannot be "
                       f"built\n  fix: sudo apt-get install -y g++")
    return out


def pytest_sessionstart(session):
    problems = missing_dependencies()
    if problems:
        raise pytest.UsageError(
            "the test suite needs these, or their tests would skip silently:\n- " + "\n- ".join(problems)
            + f"\nTo run without them anyway, set {ALLOW_MISSING_ENV}=<names> (e.g. "
            f"{ALLOW_MISSING_ENV}=bwrap,cpu_kernels): their tests are then skipped.")


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
