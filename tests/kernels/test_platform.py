"""pallas_kernels choose nothing: every entry point runs the path its `impl=` names ("auto" and a
missing impl raise; c2jax.ops' registries choose per target), and nothing under pallas_kernels
reads the host's jax.default_backend()."""
# Dim letters: M rows, K contraction, N output, G groups, B batch, H q heads, L length, D head dim, S cache.
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk

RNG = np.random.default_rng(0)
_f = lambda *shape: jnp.asarray(RNG.standard_normal(shape), jnp.float32)

# entry -> (args, a pinned impl the XLA result must equal)
CALLS = {
    "gmm": (pk.gmm, (_f(16, 32), _f(2, 32, 32), jnp.asarray([8, 8], jnp.int32)), {}),
    "tgmm": (pk.tgmm, (_f(16, 32), _f(16, 32), jnp.asarray([8, 8], jnp.int32)), {}),
    "flash_attention": (pk.flash_attention, (_f(1, 2, 16, 8), _f(1, 1, 16, 8), _f(1, 1, 16, 8)), {}),
    "decode_attention": (pk.decode_attention, (_f(2, 2, 8), _f(2, 1, 16, 8), _f(2, 1, 16, 8),
                                               jnp.asarray([5, 16], jnp.int32)), {}),
    "qmatmul": (pk.qmatmul, (_f(8, 64), _f(64, 32)), {"quant": "mxfp8"}),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_the_caller_names_the_path(name):
    fn, args, kw = CALLS[name]
    with pytest.raises(TypeError, match="impl"):
        fn(*args, **kw)
    with pytest.raises(ValueError, match=r"impl must be one of .*c2jax.ops chooses"):
        fn(*args, impl="auto", **kw)


@pytest.mark.parametrize("name", list(CALLS))
def test_impl_is_the_path_that_runs(name):
    fn, args, kw = CALLS[name]
    # pallas: the Mosaic kernel is traced on this CPU host (it is only compiled for a TPU target)
    traced = jax.jit(functools.partial(fn, impl="pallas", **kw)).trace(*args)
    assert "pallas_call" in str(traced.jaxpr)
    traced = jax.jit(functools.partial(fn, impl="xla", **kw)).trace(*args)
    assert "pallas_call" not in str(traced.jaxpr)
    np.testing.assert_allclose(fn(*args, impl="interpret", **kw), fn(*args, impl="xla", **kw), rtol=2e-2, atol=2e-2)


def test_no_resolver_under_pallas_kernels():
    """The registries of c2jax.ops are the one resolver: no impl="auto" and no platform argument here."""
    root = pathlib.Path(pk.__file__).parent
    offenders = [str(p) for p in root.rglob("*.py") if '"auto"' in p.read_text() or "platform=" in p.read_text()]
    assert not offenders, offenders


def test_no_default_backend_under_pallas_kernels():
    root = pathlib.Path(pk.__file__).parent
    offenders = [str(p) for p in root.rglob("*.py") if "default_backend" in p.read_text()]
    assert not offenders, offenders
