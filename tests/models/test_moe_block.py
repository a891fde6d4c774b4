"""The CPU capacity path (`block_dispatch`: expert-aligned row blocks, run CPU_BLOCK_GROUP blocks
at a time while that many are left) against the plain per-token gather reference, values and
gradients, with small blocks so every expert has whole groups, leftover blocks and padding."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from c2jax.ops import experts_xla


def _inputs(seed, T, D, F, E, K, skew):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    if skew:   # expert 0 is in every token's choice: one long run of blocks
        ids = np.stack([np.concatenate([[0], rng.choice(np.arange(1, E), K - 1, replace=False)]) for _ in range(T)])
    else:
        ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
    wts = jnp.asarray(rng.uniform(0.1, 1.0, (T, K)), jnp.float32)
    ws = [jnp.asarray(0.3 * rng.standard_normal(s), jnp.float32) for s in ((E, D, F), (E, D, F), (E, F, D))]
    return x, jnp.asarray(ids, jnp.int32), wts, ws


@pytest.mark.parametrize("T,E,K,block,skew", [(96, 4, 2, 3, False), (80, 6, 2, 2, True), (40, 3, 1, 4, False)])
def test_block_dispatch_equals_gather_reference(T, E, K, block, skew):
    D, F = 8, 12
    x, ids, wts, ws = _inputs(T + E, T, D, F, E, K, skew)
    counts = np.bincount(np.asarray(ids).ravel(), minlength=E)
    blocks = -(-counts // block)
    assert (blocks >= experts_xla.CPU_BLOCK_GROUP).any() and (blocks % experts_xla.CPU_BLOCK_GROUP).any()
    g = jnp.asarray(np.random.default_rng(7).standard_normal((T, D)), jnp.float32)

    def loss(fn, x, wts, *w):
        return jnp.sum(fn(x, ids, wts, *w)[0] * g)

    block_fn = lambda x, i, wt, *w: experts_xla.block_dispatch(x, i, wt, *w, cap=T, block=block)  # noqa: E731
    got, dropped = jax.jit(block_fn)(x, ids, wts, *ws)
    want, _ = experts_xla.gather_dispatch(x, ids, wts, *ws)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert float(dropped) == 0.0
    g_got = jax.jit(jax.grad(lambda *a: loss(block_fn, *a), argnums=(0, 1, 2, 3, 4)))(x, wts, *ws)
    g_want = jax.grad(lambda *a: loss(experts_xla.gather_dispatch, *a), argnums=(0, 1, 2, 3, 4))(x, wts, *ws)
    for a, b in zip(g_got, g_want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_block_dispatch_drops_past_capacity_like_the_einsum_path():
    T, E, K, D, F = 48, 4, 2, 8, 12
    x, ids, wts, ws = _inputs(3, T, D, F, E, K, skew=True)
    cap = 10                                                  # expert 0 has 48 assignments: 38 drop
    got, dropped = experts_xla.block_dispatch(x, ids, wts, *ws, cap=cap, block=3)
    # reference: zero the dropped assignments' weights (rank >= cap in token order per expert)
    flat = np.asarray(ids).ravel()
    rank = np.array([np.sum(flat[:a] == flat[a]) for a in range(flat.size)])
    keep = (rank < cap).reshape(T, K)
    want, _ = experts_xla.gather_dispatch(x, ids, jnp.where(keep, wts, 0.0), *ws)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(dropped), 1 - keep.mean(), rtol=1e-6)
