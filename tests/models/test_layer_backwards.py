"""apply_rope, rms_norm and cpu_product (written-out backwards) against autodiff of their plain formulas."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from c2jax.models.layers import apply_rope
from c2jax.ops.layers import _rotate_pairs


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
    from c2jax.ops.layers import rms_norm

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
    from c2jax.ops.layers import cpu_product
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


@pytest.mark.parametrize("use_bias", [False, True])
def test_fused_linears_match_separate_linears(use_bias):
    """LinearWeights + fused_linears (one product over the kernels side by side, CPU) give what
    separate Linear layers give, values and gradients, under the same param names and init."""
    import flax.linen as nn

    from c2jax.models.layers import Linear, LinearWeights, fused_linears

    class Separate(nn.Module):
        @nn.compact
        def __call__(self, x):
            return [Linear(n, ("embed", None), use_bias=use_bias, name=f"p{i}")(x) for i, n in enumerate((48, 16, 32))]

    class Fused(nn.Module):
        @nn.compact
        def __call__(self, x):
            ws = [LinearWeights(n, ("embed", None), use_bias=use_bias, name=f"p{i}")(x.shape[-1])
                  for i, n in enumerate((48, 16, 32))]
            return fused_linears(x, ws, jnp.float32)

    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((2, 5, 24)), jnp.float32)
    cots = [jnp.asarray(rng.standard_normal((2, 5, n)), jnp.float32) for n in (48, 16, 32)]
    params = Separate().init(jax.random.key(0), x)
    fused_params = Fused().init(jax.random.key(0), x)
    jax.tree.map(np.testing.assert_array_equal, params, fused_params)   # same names, shapes and init
    if use_bias:
        params = jax.tree.map(lambda p: p + 0.1 * jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params)

    def loss(mod):
        return lambda p, x: sum(jnp.sum(y * c) for y, c in zip(mod.apply(p, x), cots))

    for a, b in zip(Separate().apply(params, x), Fused().apply(params, x)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    g_sep = jax.grad(loss(Separate()), argnums=(0, 1))(params, x)
    g_fused = jax.grad(loss(Fused()), argnums=(0, 1))(params, x)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), g_sep, g_fused)
    hlo = jax.jit(lambda p, x: Fused().apply(p, x)).lower(params, x).as_text()
    assert hlo.count("dot_general") == 1   # one product for the three projections
