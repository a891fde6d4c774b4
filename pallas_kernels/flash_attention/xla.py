"""XLA attention path: query chunks attend to all keys, rematerialized in the backward pass, so
memory is O(chunk x L) per head instead of O(L x L). Same masks and numerics as the reference."""
# Dim letters: B batch, H q heads, K kv heads, L length, C query chunk, D q/k head dim, E v head dim.
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import pad_axis, round_up
from pallas_kernels.flash_attention.reference import attention_reference

DEFAULT_CHUNK = 512


def attention_xla(q_BHLD, k_BKLD, v_BKLE, segment_ids_BL=None, causal=True, sm_scale=None,
                  chunk=DEFAULT_CHUNK):
    """Chunked attention (f32 softmax); falls back to the reference when L <= chunk."""
    b, h, l, d = q_BHLD.shape
    if l <= chunk:
        return attention_reference(q_BHLD, k_BKLD, v_BKLE, segment_ids_BL, causal, sm_scale)
    scale = d ** -0.5 if sm_scale is None else sm_scale
    kh = k_BKLD.shape[1]
    g = h // kh
    lp = round_up(l, chunk)
    nc = lp // chunk
    seg_BL = jnp.zeros((b, l), jnp.int32) if segment_ids_BL is None else segment_ids_BL.astype(jnp.int32)
    q_NBKGCD = pad_axis(q_BHLD, 2, lp).reshape(b, kh, g, nc, chunk, d).transpose(3, 0, 1, 2, 4, 5)
    qseg_NBC = pad_axis(seg_BL, 1, lp, -1).reshape(b, nc, chunk).transpose(1, 0, 2)
    k = k_BKLD.astype(jnp.float32)
    v = v_BKLE.astype(jnp.float32)
    kpos = jnp.arange(l)

    @jax.checkpoint
    def one_chunk(args):
        q_BKGCD, qseg_BC, i = args
        s = jnp.einsum("bkgcd,bkld->bkgcl", q_BKGCD.astype(jnp.float32), k,
                       precision=jax.lax.Precision.HIGHEST) * scale
        mask = (qseg_BC[:, :, None] == seg_BL[:, None, :])[:, None, None]
        if causal:
            qpos = i * chunk + jnp.arange(chunk)
            mask = mask & (qpos[:, None] >= kpos[None, :])
        s = jnp.where(mask, s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.where(mask, jnp.exp(s - m), 0.0)
        den = jnp.sum(p, axis=-1, keepdims=True)
        p = p / jnp.where(den == 0, 1.0, den)
        return jnp.einsum("bkgcl,bkle->bkgce", p, v, precision=jax.lax.Precision.HIGHEST)

    out_N = jax.lax.map(one_chunk, (q_NBKGCD, qseg_NBC, jnp.arange(nc)))
    out = out_N.transpose(1, 2, 3, 0, 4, 5).reshape(b, h, lp, -1)[:, :, :l]
    return out.astype(q_BHLD.dtype)
