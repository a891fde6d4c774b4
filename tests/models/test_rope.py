"""apply_rope (written-out backward) against autodiff of the plain rotation, both pair layouts."""
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
