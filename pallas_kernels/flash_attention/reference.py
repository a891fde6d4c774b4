"""Pure-jnp attention reference (materialized scores) with causal + segment masks and GQA."""
# Dim letters: B batch, H query heads, K kv heads (H % K == 0), L length, D q/k head dim, E v head dim.
from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_reference(q_BHLD, k_BKLD, v_BKLE, segment_ids_BL=None, causal=True, sm_scale=None):
    """softmax(scale * q k^T + mask) v with f32 softmax; fully masked rows give 0."""
    b, h, lq, d = q_BHLD.shape
    kh, lk = k_BKLD.shape[1], k_BKLD.shape[2]
    scale = d ** -0.5 if sm_scale is None else sm_scale
    rep = h // kh
    k = jnp.repeat(k_BKLD, rep, axis=1)
    v = jnp.repeat(v_BKLE, rep, axis=1)
    s_BHLL = jnp.einsum("bhqd,bhkd->bhqk", q_BHLD.astype(jnp.float32), k.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST) * scale
    mask = jnp.ones((b, 1, lq, lk), bool)
    if segment_ids_BL is not None:
        mask &= (segment_ids_BL[:, None, :, None] == segment_ids_BL[:, None, None, :])
    if causal:
        mask &= (jnp.arange(lq)[:, None] >= jnp.arange(lk)[None, :])[None, None]
    s_BHLL = jnp.where(mask, s_BHLL, -jnp.inf)
    m = jnp.max(s_BHLL, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(s_BHLL - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(l == 0, 1.0, l)
    out = jnp.einsum("bhqk,bhke->bhqe", p, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return out.astype(q_BHLD.dtype)
