"""Pure-jnp attention reference (materialized scores) with causal / position + segment masks and GQA."""
# Dim letters: B batch, H query heads, K kv heads (H % K == 0), L query length, S key length,
# D q/k head dim, E v head dim.
from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_mask(b, lq, lk, segment_ids_BL=None, causal=True, *, q_segment_ids_BL=None,
                   kv_segment_ids_BS=None, q_positions_BL=None, kv_positions_BS=None):
    """[B, Lq, Lk] bool: key s visible to query l (same segment; kv_pos[s] <= q_pos[l] if causal,
    with positions defaulting to the indices)."""
    q_seg = segment_ids_BL if q_segment_ids_BL is None else q_segment_ids_BL
    kv_seg = segment_ids_BL if kv_segment_ids_BS is None else kv_segment_ids_BS
    mask = jnp.ones((b, lq, lk), bool)
    if q_seg is not None:
        mask &= q_seg[:, :, None] == kv_seg[:, None, :]
    if causal:
        q_pos = jnp.arange(lq)[None] if q_positions_BL is None else q_positions_BL
        kv_pos = jnp.arange(lk)[None] if kv_positions_BS is None else kv_positions_BS
        mask &= kv_pos[:, None, :] <= q_pos[:, :, None]
    return mask


def attention_reference(q_BHLD, k_BKSD, v_BKSE, segment_ids_BL=None, causal=True, sm_scale=None, *,
                        q_segment_ids_BL=None, kv_segment_ids_BS=None, q_positions_BL=None,
                        kv_positions_BS=None):
    """softmax(scale * q k^T + mask) v with f32 softmax; rows that see no key give 0 (and 0 grads)."""
    b, h, lq, d = q_BHLD.shape
    kh, lk = k_BKSD.shape[1], k_BKSD.shape[2]
    scale = d ** -0.5 if sm_scale is None else sm_scale
    rep = h // kh
    k = jnp.repeat(k_BKSD, rep, axis=1)
    v = jnp.repeat(v_BKSE, rep, axis=1)
    s_BHLS = jnp.einsum("bhqd,bhkd->bhqk", q_BHLD.astype(jnp.float32), k.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST) * scale
    mask = attention_mask(b, lq, lk, segment_ids_BL, causal, q_segment_ids_BL=q_segment_ids_BL,
                          kv_segment_ids_BS=kv_segment_ids_BS, q_positions_BL=q_positions_BL,
                          kv_positions_BS=kv_positions_BS)[:, None]
    s_BHLS = jnp.where(mask, s_BHLS, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s_BHLS, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(s_BHLS - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(l == 0, 1.0, l)
    out = jnp.einsum("bhqk,bhke->bhqe", p, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return out.astype(q_BHLD.dtype)
