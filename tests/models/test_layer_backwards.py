"""apply_rope, rms_norm and cpu_product (written-out backwards) against autodiff of their plain formulas."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from c2jax.models.layers import _rotate_pairs, apply_rope


@pytest.mark.parametrize("interleave", [False, True])
def test_rope_values_and_gradient_match_plain_rotation(interleave):
    rng = np.random.default_rng(int(interleave))
    B, L, H, R = 2, 7, 3, 8
    x = jnp.asarray(rng.standard_normal((B, L, H, R)), jnp.float32)
    cot = jnp.asarray(rng.standard_normal((B, L, H, R)), jnp.float32)
    pos = jnp.asarray(rng.integers(0, 50, (B, L)), jnp.int32)
    inv_freq = 1.0 / (100.0 ** (jnp.arange(0, R, 2, dtype=jnp.float32) / R))

    def plain(x):
        f = pos.astype(jnp.float32)[..., None] * inv_freq
        return _rotate_pairs(x, (jnp.cos(f) * 1.3)[:, :, None], (jnp.sin(f) * 1.3)[:, :, None], interleave)

    got = apply_rope(x, pos, inv_freq, 1.3, interleave)
    np.testing.assert_allclose(got, plain(x), rtol=1e-6, atol=1e-6)
    g_got = jax.grad(lambda x: jnp.sum(apply_rope(x, pos, inv_freq, 1.3, interleave) * cot))(x)
    g_want = jax.grad(lambda x: jnp.sum(plain(x) * cot))(x)
    np.testing.assert_allclose(g_got, g_want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rms_norm_values_and_gradients_match_plain(dtype):
    from c2jax.models.layers import rms_norm

    def _rms_norm_plain(x, w, eps):
        x32 = x.astype(jnp.float32)
        return w.astype(x.dtype) * (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)).astype(x.dtype)
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((3, 5, 16)) * 2.0, dtype)
    w = jnp.asarray(rng.uniform(0.5, 1.5, 16), jnp.float32)
    cot = jnp.asarray(rng.standard_normal((3, 5, 16)), dtype)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(rms_norm(x, w, 1e-6), np.float32),
                               np.asarray(_rms_norm_plain(x, w, 1e-6), np.float32), rtol=tol, atol=tol)

    def grads(fn):
        return jax.grad(lambda x, w: jnp.sum((fn(x, w, 1e-6) * cot).astype(jnp.float32)), argnums=(0, 1))(x, w)
    for a, b in zip(grads(rms_norm), grads(_rms_norm_plain)):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol * 10)


def test_cpu_product_values_and_gradients_match_einsum():
    from c2jax.models.layers import cpu_product
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((3, 5, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((16, 24)), jnp.float32)
    cot = jnp.asarray(rng.standard_normal((3, 5, 24)), jnp.float32)
    plain = lambda x, w: jnp.einsum("...d,df->...f", x, w)  # noqa: E731
    np.testing.assert_allclose(cpu_product(x, w), plain(x, w), rtol=1e-6, atol=1e-6)
    got = jax.grad(lambda x, w: jnp.sum(cpu_product(x, w) * cot), argnums=(0, 1))(x, w)
    want = jax.grad(lambda x, w: jnp.sum(plain(x, w) * cot), argnums=(0, 1))(x, w)
    for g, h in zip(got, want):
        np.testing.assert_allclose(g, h, rtol=1e-5, atol=1e-5)
