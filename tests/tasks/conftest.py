import pytest


@pytest.fixture(scope="session")
def stdlib_cache(tmp_path_factory):
    """A fresh, session-wide cache dir for stdlib-bug discovery (hermetic, shared by tests)."""
    import os
    d = tmp_path_factory.mktemp("c2jax_cache")
    old = os.environ.get("C2JAX_CACHE")
    os.environ["C2JAX_CACHE"] = str(d)
    yield d
    if old is None:
        os.environ.pop("C2JAX_CACHE", None)
    else:
        os.environ["C2JAX_CACHE"] = old
