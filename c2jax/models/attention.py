"""Attention: GQA (optional QK-norm, Qwen3) and MLA (DeepSeek-V3/Kimi), with an optional KV cache.

Letters: B batch, L query length, S key length (cache slots), D model width, H query heads,
G kv heads, P GQA head dim, Q q latent, C kv latent, N nope dims, R rope dims, O value dims.

Masking is by position: key slot s is visible to a query at position p when pos_s <= p and
both belong to the same segment. In the cache, slot index == position, so prefill and
decode share one code path and stale slots beyond p are never visible.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from c2jax.backends.cpu import attention as cpu_attention
from c2jax.models.layers import (Linear, LinearWeights, RMSNorm, apply_rope, dtype_of, fused_linears, rope_frequencies,
                                 rope_tables, rotate, softmax_scale)
from c2jax.platform import target_backend

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


def decode_attention(q_BLHP, k_BSGP, v_BSGO, mask_BLS, scale: float):
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


def write_cache(cache_BS_, new_BL_, positions_BL):
    """Write new entries into cache rows at their positions (out-of-range positions dropped).
    Few tokens per row (decode steps): one in-place dynamic_update_slice per entry; XLA CPU
    runs the batched scatter out of place, copying the whole cache at every step."""
    B, L = positions_BL.shape
    if L <= DECODE_MAX_QUERIES and target_backend() == "cpu":
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


def _attend(cfg, q, k, v, positions_BL, segment_ids_BL, k_pos_BS, k_seg_BS, scale):
    if k_seg_BS is not None:
        # context parallelism when the mesh has a context axis > 1
        from c2jax.parallel import context as cp
        if cp.cp_active(q.shape[1]):
            return cp.gqa_context_attention(q, k, v, positions_BL, segment_ids_BL, scale)
    if cfg.attention_impl == "xla" and k_seg_BS is not None:
        if cpu_attention.usable(q, k, v) is None:   # CPU float32 training: the FFI kernel
            return cpu_attention.causal_attention(q, k, v, positions_BL, segment_ids_BL, scale).astype(q.dtype)
        return causal_block_attention(q, k, v, positions_BL, segment_ids_BL, scale)
    mask = attention_mask(positions_BL, k_pos_BS,
                          segment_ids_BL if k_seg_BS is not None else None, k_seg_BS)
    if cfg.attention_impl == "flash" and k_seg_BS is not None:
        import pallas_kernels  # dispatcher; the model never calls a backend kernel directly
        out = pallas_kernels.flash_attention(
            q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
            segment_ids_BL=segment_ids_BL, causal=True, sm_scale=scale)
        return out.transpose(0, 2, 1, 3)
    return dot_product_attention(q, k, v, mask, scale)


def _cp_prefill(L: int) -> bool:
    """Cache path with more than DECODE_MAX_QUERIES tokens under an active context axis."""
    from c2jax.parallel import context as cp
    return cp.cp_prefill_active(L)


class GQAAttention(nn.Module):
    """Grouped-query attention with optional per-head QK RMSNorm before RoPE (Qwen3). With a
    cache, `span` (static) limits the keys read to cache slots [0, span): the caller promises no
    query position reaches span (the sampler's decode chunks, which bucket it by the rows' positions)."""

    cfg: object
    span: int | None = None

    @nn.compact
    def __call__(self, x_BLD, positions_BL, segment_ids_BL, cache=None):
        m = self.cfg
        dt, pdt = dtype_of(m.dtype), dtype_of(m.param_dtype)
        kw = dict(dtype=dt, param_dtype=pdt, init_std=m.init_std, use_bias=m.attention_bias)
        B, L, _ = x_BLD.shape
        H, G, P = m.num_heads, m.num_kv_heads, m.head_dim
        D = x_BLD.shape[-1]
        q, k, v = fused_linears(x_BLD, [LinearWeights(H * P, ("embed", "heads"), name="q_proj", **kw)(D),
                                        LinearWeights(G * P, ("embed", "kv_heads"), name="k_proj", **kw)(D),
                                        LinearWeights(G * P, ("embed", "kv_heads"), name="v_proj", **kw)(D)], dt)
        q, k, v = q.reshape(B, L, H, P), k.reshape(B, L, G, P), v.reshape(B, L, G, P)
        tables = rope_tables(positions_BL, *rope_frequencies(P, m))
        if m.qk_norm:   # norm then RoPE, one pass each on CPU
            q = RMSNorm(m.rms_norm_eps, "head_dim", pdt, name="q_norm")(q, rope=tables)
            k = RMSNorm(m.rms_norm_eps, "head_dim", pdt, name="k_norm")(k, rope=tables)
        else:
            q, k = rotate(q, *tables), rotate(k, *tables)
        q = nn.with_logical_constraint(q, ("batch", "length", "heads", "head_dim"))
        scale = P ** -0.5
        if cache is None:
            out = _attend(m, q, k, v, positions_BL, segment_ids_BL, positions_BL, segment_ids_BL, scale)
            new_cache = None
        elif _cp_prefill(L):
            # prefill under context parallelism: gather the new K/V, write the cache, local queries
            from c2jax.parallel import context as cp
            out, ck, cv = cp.gqa_context_prefill(q, k, v, positions_BL, cache["k"], cache["v"], scale)
            new_cache = {"k": ck, "v": cv}
        else:
            new_cache = {"k": write_cache(cache["k"], k, positions_BL),
                         "v": write_cache(cache["v"], v, positions_BL)}
            S = min(self.span or new_cache["k"].shape[1], new_cache["k"].shape[1])
            k_BSGP, v_BSGP = (new_cache[n][:, :S].astype(dt) for n in ("k", "v"))
            slots_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
            if L <= DECODE_MAX_QUERIES and target_backend() == "cpu":
                out = decode_attention(q, k_BSGP, v_BSGP, attention_mask(positions_BL, slots_BS), scale)
            else:
                out = _attend(m, q, k_BSGP, v_BSGP, positions_BL, None, slots_BS, None, scale)
        out = nn.with_logical_constraint(out, ("batch", "length", "heads", "head_dim"))
        return Linear(m.hidden_size, ("heads", "embed"), name="o_proj", dtype=dt, param_dtype=pdt,
                      init_std=m.init_std)(out.reshape(B, L, H * P)), new_cache


class MLAAttention(nn.Module):
    """Multi-head latent attention. Training expands the latent to per-head K/V; with a cache
    (prefill/decode) only the latent C and the shared rotary key R are stored, and the
    up-projection is absorbed into the query and output (no per-head K/V materialized). `span`:
    as GQAAttention's."""

    cfg: object
    span: int | None = None

    @nn.compact
    def __call__(self, x_BLD, positions_BL, segment_ids_BL, cache=None):
        m = self.cfg
        dt, pdt = dtype_of(m.dtype), dtype_of(m.param_dtype)
        kw = dict(dtype=dt, param_dtype=pdt, init_std=m.init_std)
        B, L, _ = x_BLD.shape
        H, N, R, O, C = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
        if m.q_lora_rank:
            q_lat = Linear(m.q_lora_rank, ("embed", "q_latent"), name="q_a_proj", **kw)(x_BLD)
            q_lat = RMSNorm(1e-6, "q_latent", pdt, name="q_a_norm")(q_lat)
            q = Linear(H * (N + R), ("q_latent", "heads"), name="q_b_proj", **kw)(q_lat)
        else:
            q = Linear(H * (N + R), ("embed", "heads"), name="q_proj", **kw)(x_BLD)
        q = q.reshape(B, L, H, N + R)
        q_nope, q_rope = q[..., :N], q[..., N:]
        ckv = Linear(C + R, ("embed", "kv_latent"), name="kv_a_proj", **kw)(x_BLD)
        latent_BLC = RMSNorm(1e-6, "kv_latent", pdt, name="kv_a_norm")(ckv[..., :C])
        latent_BLC = nn.with_logical_constraint(latent_BLC, ("batch", "length", "kv_latent"))
        k_rope = ckv[..., C:].reshape(B, L, 1, R)
        inv_freq, factor = rope_frequencies(R, m)
        q_rope = apply_rope(q_rope, positions_BL, inv_freq, factor, m.rope_interleave)
        k_rope_BLR = apply_rope(k_rope, positions_BL, inv_freq, factor, m.rope_interleave)[:, :, 0]
        kv_b = self.param("kv_b_proj", nn.with_logical_partitioning(
            nn.initializers.normal(m.init_std), ("kv_latent", "heads")), (C, H * (N + O)), pdt)
        kv_b_CHX = kv_b.astype(dt).reshape(C, H, N + O)
        scale = softmax_scale(N + R, m)
        # context parallelism when the mesh has a context axis > 1
        from c2jax.parallel import context as cp
        if cache is None and cp.cp_active(L):
            out = cp.mla_context_attention(q_nope, q_rope, latent_BLC, k_rope_BLR, kv_b_CHX, positions_BL,
                                           segment_ids_BL, scale, dt)
            new_cache = None
        elif cache is None:
            kv = jnp.einsum("blc,chx->blhx", latent_BLC, kv_b_CHX)
            k = jnp.concatenate([kv[..., :N], jnp.broadcast_to(k_rope_BLR[:, :, None], (B, L, H, R))], -1)
            qf = jnp.concatenate([q_nope, q_rope], -1)
            out = _attend(m, qf, k, kv[..., N:], positions_BL, segment_ids_BL, positions_BL,
                          segment_ids_BL, scale)
            new_cache = None
        elif _cp_prefill(L):
            # prefill under context parallelism: gather the new latents, write the cache, local queries
            out, cl, ckr = cp.mla_context_prefill(q_nope, q_rope, latent_BLC, k_rope_BLR, kv_b_CHX, positions_BL,
                                                  cache["latent"], cache["k_rope"], scale, dt)
            new_cache = {"latent": cl, "k_rope": ckr}
        else:
            new_cache = {"latent": write_cache(cache["latent"], latent_BLC, positions_BL),
                         "k_rope": write_cache(cache["k_rope"], k_rope_BLR, positions_BL)}
            S = self.span or new_cache["latent"].shape[1]
            out = mla_absorbed_attention(q_nope, q_rope, new_cache["latent"][:, :S], new_cache["k_rope"][:, :S],
                                         kv_b_CHX, positions_BL, scale, dt)
        out = nn.with_logical_constraint(out, ("batch", "length", "heads", "head_dim"))
        return Linear(m.hidden_size, ("heads", "embed"), name="o_proj", **kw)(
            out.reshape(B, L, H * O)), new_cache


def init_layer_cache(m, batch: int, max_len: int, dtype) -> dict:
    """Empty KV cache of one layer: MLA stores latent + rotary key, GQA stores K and V."""
    if m.attention == "mla":
        return {"latent": jnp.zeros((batch, max_len, m.kv_lora_rank), dtype),
                "k_rope": jnp.zeros((batch, max_len, m.qk_rope_head_dim), dtype)}
    shape = (batch, max_len, m.num_kv_heads, m.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
