"""Kernel selection comes from the `platform=` argument (the target's devices), never from the host's
jax.default_backend(): impl="auto" without a platform raises, "pallas" off TPU raises, "tpu" picks
the Mosaic kernels even on this CPU host, "cpu"/"gpu" pick the XLA paths."""
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
def test_auto_needs_a_platform(name):
    fn, args, kw = CALLS[name]
    with pytest.raises(ValueError, match=r"impl='auto' needs the target platform: pass platform="):
        fn(*args, **kw)
    with pytest.raises(ValueError, match="platform must be one of"):
        fn(*args, platform="cuda", **kw)


@pytest.mark.parametrize("name", list(CALLS))
def test_pallas_off_tpu_raises_with_what_to_do(name):
    fn, args, kw = CALLS[name]
    for platform in ("cpu", "gpu"):
        with pytest.raises(ValueError, match=r"impl='pallas' needs .*tpu.*impl='interpret'.*impl='xla'"):
            fn(*args, impl="pallas", platform=platform, **kw)


@pytest.mark.parametrize("name", list(CALLS))
def test_platform_picks_the_path(name):
    fn, args, kw = CALLS[name]
    xla = np.asarray(fn(*args, impl="xla", **kw))
    for platform in ("cpu", "gpu"):  # XLA paths, whatever the host
        np.testing.assert_array_equal(fn(*args, platform=platform, **kw), xla)
    # tpu: the Mosaic kernel is traced on this CPU host (it is only compiled for a TPU target)
    traced = jax.jit(functools.partial(fn, platform="tpu", **kw)).trace(*args)
    assert "pallas_call" in str(traced.jaxpr)
    traced = jax.jit(functools.partial(fn, platform="cpu", **kw)).trace(*args)
    assert "pallas_call" not in str(traced.jaxpr)


def test_no_default_backend_under_pallas_kernels():
    root = pathlib.Path(pk.__file__).parent
    offenders = [str(p) for p in root.rglob("*.py") if "default_backend" in p.read_text()]
    assert not offenders, offenders
