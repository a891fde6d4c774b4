"""The CPU RMSNorm / RMSNorm + RoPE kernels (c2jax/backends/cpu/cpu_norm.cc) against float64 numpy
forwards and gradients written out from the formulas, and RMSNorm's dispatch to them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from c2jax.backends.cpu import norm as cpu_norm
from c2jax.models.layers import RMSNorm, rope_tables
from c2jax.ops.layers import rms_norm, rotate

pytestmark = pytest.mark.skipif(cpu_norm.cpu_kernels.unavailable() is not None,
                                reason=f"CPU kernels unavailable: {cpu_norm.cpu_kernels.unavailable()}")


def _norm64(x, w, eps):
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    return w * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)


def _rot64(y, c, s):
    c, s = np.asarray(c, np.float64)[..., None, :], np.asarray(s, np.float64)[..., None, :]
    h = y.shape[-1] // 2
    y1, y2 = y[..., :h], y[..., h:]
    return np.concatenate([y1 * c - y2 * s, y2 * c + y1 * s], -1)


def _norm_grads64(x, w, eps, dy):
    """d/dx and d/dw of sum(dy * w x / rms(x)), float64."""
    x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
    r = 1 / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)
    xhat = x * r
    g = dy * w
    dx = r * (g - xhat * np.mean(g * xhat, -1, keepdims=True))
    dw = np.sum((dy * xhat).reshape(-1, x.shape[-1]), 0)
    return dx, dw


def _unrot64(dy, c, s):
    """The rotation's transpose (its inverse) applied to a cotangent."""
    return _rot64(np.asarray(dy, np.float64), c, -np.asarray(s, np.float64))


@pytest.mark.parametrize("shape", [(3, 40, 96), (1, 1, 16), (2, 130, 512), (70, 48)])
def test_rms_norm_matches_float64(shape):
    ks = jax.random.split(jax.random.key(shape[-1] + len(shape)), 3)
    x = jax.random.normal(ks[0], shape) * 2 + 0.3
    w = jax.random.normal(ks[1], shape[-1:])
    dy = jax.random.normal(ks[2], shape)
    assert cpu_norm.usable(x, w) is None
    y = jax.jit(lambda x, w: cpu_norm.rms_norm(x, w, 1e-6))(x, w)
    np.testing.assert_allclose(y, _norm64(x, w, 1e-6), rtol=2e-5, atol=2e-5)
    dx, dw = jax.jit(jax.grad(lambda x, w: jnp.sum(cpu_norm.rms_norm(x, w, 1e-6) * dy), (0, 1)))(x, w)
    ref_dx, ref_dw = _norm_grads64(x, w, 1e-6, dy)
    np.testing.assert_allclose(dx, ref_dx, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(dw, ref_dw, rtol=2e-5, atol=2e-4)


@pytest.mark.parametrize("B,L,H,P,factor", [(2, 33, 5, 64, 1.3), (1, 130, 8, 32, 1.0), (3, 7, 2, 128, 0.7)])
def test_rms_norm_rope_matches_float64(B, L, H, P, factor):
    ks = jax.random.split(jax.random.key(L), 4)
    x = jax.random.normal(ks[0], (B, L, H, P)) * 3
    w = jax.random.normal(ks[1], (P,))
    pos = jax.random.randint(ks[2], (B, L), 0, 5000)
    dy = jax.random.normal(ks[3], x.shape)
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, P, 2, dtype=jnp.float32) / P))
    c, s = rope_tables(pos, inv_freq, factor)
    assert cpu_norm.usable(x, w, rope=True) is None

    def kernel(x, w):
        return cpu_norm.rms_norm_rope(x, w, c, s, 1e-6)

    np.testing.assert_allclose(jax.jit(kernel)(x, w), _rot64(_norm64(x, w, 1e-6), c, s), rtol=3e-5, atol=3e-5)
    dx, dw = jax.jit(jax.grad(lambda x, w: jnp.sum(kernel(x, w) * dy), (0, 1)))(x, w)
    ref_dx, ref_dw = _norm_grads64(x, w, 1e-6, _unrot64(dy, c, s))
    np.testing.assert_allclose(dx, ref_dx, rtol=3e-5, atol=3e-5)
    np.testing.assert_allclose(dw, ref_dw, rtol=3e-5, atol=5e-4)


def test_weight_gradient_is_deterministic():
    """The weight's gradient sums fixed row blocks in order: bitwise equal across calls."""
    ks = jax.random.split(jax.random.key(7), 3)
    x, dy = jax.random.normal(ks[0], (4096, 256)), jax.random.normal(ks[1], (4096, 256))
    w = jax.random.normal(ks[2], (256,))
    g = jax.jit(jax.grad(lambda w: jnp.sum(cpu_norm.rms_norm(x, w, 1e-6) * dy)))
    first = np.asarray(g(w))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(g(w)), first)


def test_rmsnorm_module_dispatch_matches_plain_path():
    """layers.RMSNorm takes the kernels on CPU float32 and gives what rms_norm (+ rotate) gives;
    shapes the kernel cannot take (odd width, bfloat16) keep the jnp path."""
    ks = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(ks[0], (2, 9, 4, 64))
    pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
    tables = rope_tables(pos, 1.0 / (10000.0 ** (jnp.arange(0, 64, 2, dtype=jnp.float32) / 64)), 1.0)
    mod = RMSNorm(1e-6, "head_dim")
    params = {"params": {"scale": jax.random.normal(ks[1], (64,))}}
    w = params["params"]["scale"]
    np.testing.assert_allclose(mod.apply(params, x, rope=tables), rotate(rms_norm(x, w, 1e-6), *tables),
                               rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(mod.apply(params, x), rms_norm(x, w, 1e-6), rtol=2e-5, atol=2e-5)
    lowered = jax.jit(lambda x: mod.apply(params, x, rope=tables)).lower(x).as_text()
    assert cpu_norm.cpu_kernels.NORM_ROPE_FWD in lowered
    odd = jax.random.normal(ks[2], (3, 24))
    assert cpu_norm.usable(odd, jnp.ones(24)) is not None
    out = RMSNorm(1e-6).apply({"params": {"scale": jnp.ones(24)}}, odd)
    np.testing.assert_allclose(out, _norm64(odd, np.ones(24), 1e-6), rtol=2e-5, atol=2e-5)
    assert cpu_norm.usable(x.astype(jnp.bfloat16), w) == "operands are not float32"


def test_bad_tables_are_refused():
    x = jnp.ones((2, 5, 3, 32))
    c = jnp.ones((2, 5, 8))
    with pytest.raises(ValueError, match="rope tables"):
        cpu_norm.rms_norm_rope(x, jnp.ones(32), c, c, 1e-6)
