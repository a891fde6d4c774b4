"""XLA attention path: query chunks attend to all keys, rematerialized in the backward pass, so
memory is O(chunk x S) per head instead of O(L x S). Same masks and numerics as the reference."""
# Dim letters: B batch, H q heads, K kv heads, L query length, S key length, C query chunk,
# N chunks, D q/k head dim, E v head dim.
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import pad_axis, round_up
from pallas_kernels.flash_attention.reference import attention_reference

DEFAULT_CHUNK = 512


def attention_xla(q_BHLD, k_BKSD, v_BKSE, segment_ids_BL=None, causal=True, sm_scale=None,
                  chunk=DEFAULT_CHUNK, *, q_segment_ids_BL=None, kv_segment_ids_BS=None,
                  q_positions_BL=None, kv_positions_BS=None):
    """Chunked attention (f32 softmax); falls back to the reference when Lq <= chunk."""
    b, h, lq, d = q_BHLD.shape
    lk = k_BKSD.shape[2]
    masks = dict(q_segment_ids_BL=q_segment_ids_BL, kv_segment_ids_BS=kv_segment_ids_BS,
                 q_positions_BL=q_positions_BL, kv_positions_BS=kv_positions_BS)
    if lq <= chunk:
        return attention_reference(q_BHLD, k_BKSD, v_BKSE, segment_ids_BL, causal, sm_scale, **masks)
    scale = d ** -0.5 if sm_scale is None else sm_scale
    kh = k_BKSD.shape[1]
    g = h // kh
    lp = round_up(lq, chunk)
    nc = lp // chunk
    q_seg = segment_ids_BL if q_segment_ids_BL is None else q_segment_ids_BL
    kv_seg = segment_ids_BL if kv_segment_ids_BS is None else kv_segment_ids_BS
    q_seg_BL = jnp.zeros((b, lq), jnp.int32) if q_seg is None else q_seg.astype(jnp.int32)
    kv_seg_BS = jnp.zeros((b, lk), jnp.int32) if kv_seg is None else kv_seg.astype(jnp.int32)
    q_pos_BL = jnp.broadcast_to(jnp.arange(lq, dtype=jnp.int32), (b, lq)) if q_positions_BL is None \
        else q_positions_BL.astype(jnp.int32)
    kv_pos_BS = jnp.broadcast_to(jnp.arange(lk, dtype=jnp.int32), (b, lk)) if kv_positions_BS is None \
        else kv_positions_BS.astype(jnp.int32)
    q_NBKGCD = pad_axis(q_BHLD, 2, lp).reshape(b, kh, g, nc, chunk, d).transpose(3, 0, 1, 2, 4, 5)
    qseg_NBC = pad_axis(q_seg_BL, 1, lp).reshape(b, nc, chunk).transpose(1, 0, 2)
    qpos_NBC = pad_axis(q_pos_BL, 1, lp).reshape(b, nc, chunk).transpose(1, 0, 2)
    k = k_BKSD.astype(jnp.float32)
    v = v_BKSE.astype(jnp.float32)

    @jax.checkpoint
    def one_chunk(args):
        q_BKGCD, qseg_BC, qpos_BC = args
        s = jnp.einsum("bkgcd,bksd->bkgcs", q_BKGCD.astype(jnp.float32), k,
                       precision=jax.lax.Precision.HIGHEST) * scale
        mask_BCS = qseg_BC[:, :, None] == kv_seg_BS[:, None, :]
        if causal:
            mask_BCS = mask_BCS & (kv_pos_BS[:, None, :] <= qpos_BC[:, :, None])
        mask = mask_BCS[:, None, None]
        s = jnp.where(mask, s, -jnp.inf)
        m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.where(mask, jnp.exp(s - m), 0.0)
        den = jnp.sum(p, axis=-1, keepdims=True)
        p = p / jnp.where(den == 0, 1.0, den)
        return jnp.einsum("bkgcs,bkse->bkgce", p, v, precision=jax.lax.Precision.HIGHEST)

    out_N = jax.lax.map(one_chunk, (q_NBKGCD, qseg_NBC, qpos_NBC))
    out = out_N.transpose(1, 2, 3, 0, 4, 5).reshape(b, h, lp, -1)[:, :, :lq]
    return out.astype(q_BHLD.dtype)
