"""XLA implementations of attention (registered in c2jax.ops.attention): masked dot-product
attention, query-blocked causal attention over packed rows with a written-out backward, the
few-query multiply-reduce form for decode, MLA over a latent cache, and KV-cache writes.

Letters: B batch, L query length, S key length (cache slots), H query heads, G kv heads, P head
dim, C kv latent, N nope dims, R rope dims, O value dims, M rows (position x head-in-group).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

NEG_INF = -1e30
DECODE_MAX_QUERIES = 4  # cached GQA with at most this many new tokens per row uses decode_attention


def attention_mask(q_pos_BL, k_pos_BS, q_seg_BL=None, k_seg_BS=None):
    """bool [B, L, S]: causal by position, restricted to equal segment ids when given."""
    mask = k_pos_BS[:, None, :] <= q_pos_BL[:, :, None]
    if q_seg_BL is not None:
        mask &= q_seg_BL[:, :, None] == k_seg_BS[:, None, :]
    return mask


def dot_product_attention(q_BLHP, k_BSGP, v_BSGO, mask_BLS, scale: float):
    """Softmax attention in float32 with grouped kv heads (G divides H)."""
    B, L, H, P = q_BLHP.shape
    G = k_BSGP.shape[2]
    q = q_BLHP.reshape(B, L, G, H // G, P)
    logits = jnp.einsum("blgrp,bsgp->bgrls", q, k_BSGP, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(mask_BLS[:, None, None], logits, NEG_INF)
    probs = jax.nn.softmax(logits, axis=-1).astype(v_BSGO.dtype)
    out = jnp.einsum("bgrls,bsgo->blgro", probs, v_BSGO, preferred_element_type=jnp.float32)
    return out.reshape(B, L, H, v_BSGO.shape[-1]).astype(q_BLHP.dtype)


def causal_block_size(L: int) -> int:
    """Query block of the training path: 64 rows, or L / 16 for long rows (bounded unrolling).
    64 rather than 128 at L = 512: fewer masked-out scores (56% of the L x L products instead of
    62%), and XLA CPU's products at 64 rows ran no slower (isolated fwd+bwd, 8 x 512, 8 heads:
    109-133 ms against 121-148 at 128 in the same runs)."""
    return max(64, -(-L // 16))


def causal_block_attention(q_BLHP, k_BLGP, v_BLGO, positions_BL, segment_ids_BL, scale: float,
                           block: int | None = None):
    """Self-attention of packed rows (keys = queries' own row), query block by query block, each
    block reading only the keys up to its last row: ~half the score FLOPs and memory of the full
    L x L product. Exact when positions increase along the row inside each segment (every batch
    c2jax packs): keys after a query's block are then masked anyway. Masks as attention_mask.
    The backward is written out (saved probabilities, rowsum(dO * O) for the softmax term): fewer
    passes over each score block than XLA CPU made of autodiff's masked softmax."""
    B, L, H, P = q_BLHP.shape
    G, O = k_BLGP.shape[2], v_BLGO.shape[-1]
    R = H // G
    b = block or causal_block_size(L)
    # rows are (position, head-in-group) pairs, position-major: a query block is one
    # contiguous range of rows, and the backward's products over rows need no reordering
    q = q_BLHP.reshape(B, L, G, R, P).transpose(0, 2, 1, 3, 4).reshape(B, G, L * R, P)   # [B, G, M, P]
    k, v = k_BLGP.transpose(0, 2, 1, 3), v_BLGO.transpose(0, 2, 1, 3)                    # [B, G, L, P|O]
    masks = tuple(attention_mask(positions_BL[:, lo:lo + b], positions_BL[:, :lo + b],
                                 segment_ids_BL[:, lo:lo + b], segment_ids_BL[:, :lo + b])
                  for lo in range(0, L, b))
    out = _causal_blocks(q, k, v, masks, float(scale), b)                                 # [B, G, M, O]
    return out.reshape(B, G, L, R, O).transpose(0, 2, 1, 3, 4).reshape(B, L, H, O).astype(q_BLHP.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _causal_blocks(q_BGMP, k_BGLP, v_BGLO, masks, scale, b):
    return _causal_blocks_fwd(q_BGMP, k_BGLP, v_BGLO, masks, scale, b)[0]


def _block_probs(q_BGmP, k_BGsP, mask_Bcs, scale, dtype):
    """Softmax probabilities of one query block's rows [B, G, m = c * R, s] over keys [0, s)."""
    B, G, m, _ = q_BGmP.shape
    c, s = mask_Bcs.shape[1:]
    s_BGmS = jnp.einsum("bgmp,bgsp->bgms", q_BGmP, k_BGsP, preferred_element_type=jnp.float32) * scale
    s_BGcRS = jnp.where(mask_Bcs[:, None, :, None], s_BGmS.reshape(B, G, c, m // c, s), NEG_INF)
    return jax.nn.softmax(s_BGcRS, axis=-1).astype(dtype).reshape(B, G, m, s)


def _causal_blocks_fwd(q_BGMP, k_BGLP, v_BGLO, masks, scale, b):
    L = k_BGLP.shape[2]
    R = q_BGMP.shape[2] // L
    outs, probs = [], []
    for i, lo in enumerate(range(0, L, b)):
        hi = min(lo + b, L)
        p = _block_probs(q_BGMP[:, :, lo * R:hi * R], k_BGLP[:, :, :hi], masks[i], scale, v_BGLO.dtype)
        outs.append(jnp.einsum("bgms,bgso->bgmo", p, v_BGLO[:, :, :hi], preferred_element_type=jnp.float32))
        probs.append(p)
    out = (jnp.concatenate(outs, axis=2) if len(outs) > 1 else outs[0]).astype(q_BGMP.dtype)
    return out, (q_BGMP, k_BGLP, v_BGLO, masks, tuple(probs), out)


def _causal_blocks_bwd(scale, b, res, dout_BGMO):
    q, k, v, masks, probs, out = res
    f32 = jnp.float32
    B, G, L, P = k.shape
    R = q.shape[2] // L
    dsum_BGM = jnp.sum(dout_BGMO.astype(f32) * out.astype(f32), axis=-1)    # rowsum(dP * P) = rowsum(dO * O)
    dq_blocks, dkT, dvT = [], jnp.zeros((B, G, P, L), f32), jnp.zeros((B, G, v.shape[-1], L), f32)
    for i, lo in enumerate(range(0, L, b)):
        hi = min(lo + b, L)
        p, do, qb = probs[i], dout_BGMO[:, :, lo * R:hi * R], q[:, :, lo * R:hi * R]
        # dk, dv come out transposed ([.., P|O, S]): XLA CPU then transposes the small q / dO
        # blocks for these products instead of the [m, S] score blocks
        dvT = dvT.at[..., :hi].add(jnp.einsum("bgmo,bgms->bgos", do, p, preferred_element_type=f32))
        dp = jnp.einsum("bgmo,bgso->bgms", do, v[:, :, :hi], preferred_element_type=f32)
        ds = (p.astype(f32) * (dp - dsum_BGM[..., lo * R:hi * R, None]) * scale).astype(q.dtype)
        dq_blocks.append(jnp.einsum("bgms,bgsp->bgmp", ds, k[:, :, :hi], preferred_element_type=f32))
        dkT = dkT.at[..., :hi].add(jnp.einsum("bgmp,bgms->bgps", qb, ds, preferred_element_type=f32))
    dq = jnp.concatenate(dq_blocks, axis=2) if len(dq_blocks) > 1 else dq_blocks[0]
    dk, dv = dkT.swapaxes(2, 3).astype(k.dtype), dvT.swapaxes(2, 3).astype(v.dtype)
    return dq.astype(q.dtype), dk, dv, tuple(None for _ in masks)


_causal_blocks.defvjp(_causal_blocks_fwd, _causal_blocks_bwd)


def decode_attention_reduce(q_BLHP, k_BSGP, v_BSGO, mask_BLS, scale: float):
    """dot_product_attention for a few queries over a cache (decode steps), as f32 multiply-reduce
    on the cache's own [B, S, G, P] layout: the batched-matmul form makes XLA CPU copy each
    layer's K and V cache transposed to [B, G, S, P] at every step."""
    B, L, H, P = q_BLHP.shape
    G, f32 = k_BSGP.shape[2], jnp.float32
    q = q_BLHP.reshape(B, L, 1, G, H // G, P).astype(f32)
    logits = jnp.sum(q * k_BSGP[:, None, :, :, None, :].astype(f32), axis=-1) * scale  # [B, L, S, G, R]
    logits = jnp.where(mask_BLS[..., None, None], logits, NEG_INF)
    probs = jax.nn.softmax(logits, axis=2).astype(v_BSGO.dtype).astype(f32)
    out = jnp.sum(probs[..., None] * v_BSGO[:, None, :, :, None, :].astype(f32), axis=2)  # [B, L, G, R, O]
    return out.reshape(B, L, H, v_BSGO.shape[-1]).astype(q_BLHP.dtype)


def write_cache(cache_BS_, new_BL_, positions_BL, per_entry: bool = False):
    """Write new entries into cache rows at their positions (out-of-range positions dropped).
    per_entry (for XLA:CPU, which runs the batched scatter out of place, copying the whole cache at
    every step): few tokens per row (decode steps) as one in-place dynamic_update_slice each."""
    B, L = positions_BL.shape
    if L <= DECODE_MAX_QUERIES and per_entry:
        return _write_cache_entries(cache_BS_, new_BL_, positions_BL)

    def one_row(c, n, p):
        return c.at[p].set(n.astype(c.dtype), mode="drop")
    return jax.vmap(one_row)(cache_BS_, new_BL_, positions_BL)


def mla_absorbed_attention(q_nope_BLHN, q_rope_BLHR, latent_BSC, k_rope_BSR, kv_b_CHX, positions_BL,
                           scale: float, dt):
    """MLA over a latent cache with the up-projection absorbed into the query and the output (no
    per-head K/V materialized); cache slot index == position. Returns [B, L, H, O]."""
    B, S = latent_BSC.shape[:2]
    N = q_nope_BLHN.shape[-1]
    mask = attention_mask(positions_BL, jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S)))
    latent = latent_BSC.astype(dt)
    q_abs_BLHC = jnp.einsum("blhn,chn->blhc", q_nope_BLHN, kv_b_CHX[..., :N])
    logits = (jnp.einsum("blhc,bsc->bhls", q_abs_BLHC, latent, preferred_element_type=jnp.float32)
              + jnp.einsum("blhr,bsr->bhls", q_rope_BLHR, k_rope_BSR.astype(dt),
                           preferred_element_type=jnp.float32)) * scale
    logits = jnp.where(mask[:, None], logits, NEG_INF)
    probs = jax.nn.softmax(logits, axis=-1).astype(dt)
    ctx_BLHC = jnp.einsum("bhls,bsc->blhc", probs, latent)
    return jnp.einsum("blhc,cho->blho", ctx_BLHC, kv_b_CHX[..., N:])


def _write_cache_entries(cache_BS_, new_BL_, positions_BL):
    """write_cache as B*L dynamic_update_slices (unrolled up to 16, else a fori_loop); negative
    positions count from the end, as in the scatter."""
    B, L = positions_BL.shape
    S, tail = cache_BS_.shape[1], cache_BS_.shape[2:]
    new_BL_ = new_BL_.astype(cache_BS_.dtype)
    zeros = (0,) * len(tail)

    def one(i, c):
        b, l = i // L, i % L
        p = positions_BL[b, l]
        p = jnp.where(p < 0, p + S, p)
        start = (b, jnp.clip(p, 0, S - 1)) + zeros
        old = jax.lax.dynamic_slice(c, start, (1, 1) + tail)
        new = jax.lax.dynamic_slice(new_BL_, (b, l) + zeros, (1, 1) + tail)
        return jax.lax.dynamic_update_slice(c, jnp.where((p >= 0) & (p < S), new, old), start)
    if B * L <= 16:
        for i in range(B * L):
            cache_BS_ = one(i, cache_BS_)
        return cache_BS_
    return jax.lax.fori_loop(0, B * L, one, cache_BS_)

