"""The training path's causal block attention against the full masked L x L reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from c2jax.ops.attention_xla import attention_mask, causal_block_attention, dot_product_attention


def _packed_rows(B, L, rng):
    """Positions restarting at every segment boundary, segment ids 1.. with 0-padding at the end."""
    seg = np.zeros((B, L), np.int32)
    pos = np.zeros((B, L), np.int32)
    for b in range(B):
        cuts = sorted(rng.choice(np.arange(1, L - 4), size=3, replace=False))
        bounds = [0, *cuts, L - 3]
        for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            seg[b, lo:hi] = i + 1
            pos[b, lo:hi] = np.arange(hi - lo)
        pos[b, L - 3:] = np.arange(3)  # padding rows (segment 0) still attend among themselves
    return jnp.asarray(pos), jnp.asarray(seg)


@pytest.mark.parametrize("L,block,H,G,P,O", [(200, 64, 4, 2, 16, 16), (96, 32, 6, 3, 24, 8), (64, 128, 2, 2, 8, 8)])
def test_causal_block_attention_matches_full(L, block, H, G, P, O):
    rng = np.random.default_rng(L + block)
    B = 2
    kq, kk, kv, kg = jax.random.split(jax.random.key(L), 4)
    q = jax.random.normal(kq, (B, L, H, P))
    k = jax.random.normal(kk, (B, L, G, P))
    v = jax.random.normal(kv, (B, L, G, O))
    pos, seg = _packed_rows(B, L, rng)
    cot = jax.random.normal(kg, (B, L, H, O))
    scale = P ** -0.5

    def full(q, k, v):
        return dot_product_attention(q, k, v, attention_mask(pos, pos, seg, seg), scale)

    def blocked(q, k, v):
        return causal_block_attention(q, k, v, pos, seg, scale, block=block)

    np.testing.assert_allclose(blocked(q, k, v), full(q, k, v), rtol=1e-5, atol=1e-5)
    g_full = jax.grad(lambda *a: jnp.sum(full(*a) * cot), argnums=(0, 1, 2))(q, k, v)
    g_blk = jax.grad(lambda *a: jnp.sum(blocked(*a) * cot), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_blk, g_full):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
