"""The CPU training attention kernel (c2jax/backends/cpu/cpu_attention.cc) against references: float64
numpy for the forward and the full masked L x L jnp attention for the gradients (the model's
training loss and gradients with the kernels off: test_cpu_moe.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from c2jax.backends.cpu import attention as cpu_attention
from c2jax.ops.attention_xla import attention_mask, dot_product_attention

pytestmark = pytest.mark.skipif(cpu_attention.cpu_kernels.unavailable() is not None,
                                reason=f"CPU kernels unavailable: {cpu_attention.cpu_kernels.unavailable()}")


def _packed_rows(B, L, rng):
    """Segments 1.. with positions restarting at each, and 3 rows of padding (segment 0) at the end."""
    seg, pos = np.zeros((B, L), np.int32), np.zeros((B, L), np.int32)
    for b in range(B):
        bounds = [0, *sorted(rng.choice(np.arange(1, L - 4), size=3, replace=False)), L - 3]
        for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            seg[b, lo:hi], pos[b, lo:hi] = i + 1, np.arange(hi - lo)
        pos[b, L - 3:] = np.arange(3)
    return pos, seg


def _reference64(q, k, v, pos, seg, scale):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, L, H, _ = q.shape
    R = H // k.shape[2]
    mask = (pos[:, None, :] <= pos[:, :, None]) & (seg[:, None, :] == seg[:, :, None])   # [B, Lq, Lk]
    s = np.einsum("blhp,bshp->bhls", q, np.repeat(k, R, axis=2)) * scale
    s = np.where(mask[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhls,bsho->blho", p, np.repeat(v, R, axis=2))


@pytest.mark.parametrize("B,L,H,G,P,O", [(2, 40, 4, 2, 16, 32), (2, 130, 6, 3, 32, 16), (1, 200, 4, 4, 64, 80),
                                         (2, 97, 8, 1, 48, 64)])
def test_kernel_matches_references(B, L, H, G, P, O):
    rng = np.random.default_rng(L)
    ks = jax.random.split(jax.random.key(L), 4)
    q = jax.random.normal(ks[0], (B, L, H, P))
    k = jax.random.normal(ks[1], (B, L, G, P))
    v = jax.random.normal(ks[2], (B, L, G, O))
    cot = jax.random.normal(ks[3], (B, L, H, O))
    pos, seg = _packed_rows(B, L, rng)
    scale = P ** -0.5
    assert cpu_attention.usable(q, k, v) is None

    def kernel(q, k, v):
        return cpu_attention.causal_attention(q, k, v, jnp.asarray(pos), jnp.asarray(seg), scale)

    def full(q, k, v):
        return dot_product_attention(q, k, v, attention_mask(*map(jnp.asarray, (pos, pos, seg, seg))), scale)

    out = jax.jit(kernel)(q, k, v)
    np.testing.assert_allclose(out, _reference64(q, k, v, pos, seg, scale), rtol=2e-5, atol=2e-5)
    g_ker = jax.jit(jax.grad(lambda *a: jnp.sum(kernel(*a) * cot), argnums=(0, 1, 2)))(q, k, v)
    g_ref = jax.grad(lambda *a: jnp.sum(full(*a) * cot), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_ker, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)


def test_kernel_under_vmap_and_refusals():
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (3, 1, 20, 2, 16))
    k = jax.random.normal(ks[1], (3, 1, 20, 1, 16))
    v = jax.random.normal(ks[2], (3, 1, 20, 1, 16))
    pos = jnp.broadcast_to(jnp.arange(20, dtype=jnp.int32), (1, 20))
    seg = jnp.ones((1, 20), jnp.int32)
    out = jax.vmap(lambda q, k, v: cpu_attention.causal_attention(q, k, v, pos, seg, 0.25))(q, k, v)
    for i in range(3):
        np.testing.assert_allclose(out[i], _reference64(q[i], k[i], v[i], np.asarray(pos), np.asarray(seg), 0.25),
                                   rtol=2e-5, atol=2e-5)
    assert "float32" in cpu_attention.usable(q[0].astype(jnp.bfloat16), k[0], v[0])
    assert "multiples of 16" in cpu_attention.usable(q[0, ..., :8], k[0, ..., :8], v[0])
    with pytest.raises(RuntimeError, match="cannot run: operands are not float32"):
        cpu_attention.causal_attention(q[0].astype(jnp.bfloat16), k[0], v[0], pos, seg, 0.25)
    with pytest.raises(Exception, match="shapes disagree"):   # the FFI call's own check
        cpu_attention._attention(q[0], k[0, :, :, :, :16], v[0, :, :10], pos, seg, 0.25)
