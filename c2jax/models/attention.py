"""Attention: GQA (optional QK-norm, Qwen3) and MLA (DeepSeek-V3/Kimi), with an optional KV cache.

Letters: B batch, L query length, S key length (cache slots), D model width, H query heads,
G kv heads, P GQA head dim, Q q latent, C kv latent, N nope dims, R rope dims, O value dims.

Masking is by position: key slot s is visible to a query at position p when pos_s <= p and
both belong to the same segment. In the cache, slot index == position, so prefill and
decode share one code path and stale slots beyond p are never visible.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from c2jax.models.layers import Linear, RMSNorm, apply_rope, dtype_of, rope_frequencies, softmax_scale

NEG_INF = -1e30


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


def write_cache(cache_BS_, new_BL_, positions_BL):
    """Write new entries into cache rows at their positions (out-of-range positions dropped)."""
    def one_row(c, n, p):
        return c.at[p].set(n.astype(c.dtype), mode="drop")
    return jax.vmap(one_row)(cache_BS_, new_BL_, positions_BL)


def _attend(cfg, q, k, v, positions_BL, segment_ids_BL, k_pos_BS, k_seg_BS, scale):
    if k_seg_BS is not None:
        # context parallelism when the mesh has a context axis > 1
        from c2jax.parallel import context as cp
        if cp.cp_active(q.shape[1]):
            return cp.gqa_context_attention(q, k, v, positions_BL, segment_ids_BL, scale)
    mask = attention_mask(positions_BL, k_pos_BS,
                          segment_ids_BL if k_seg_BS is not None else None, k_seg_BS)
    if cfg.attention_impl == "flash" and k_seg_BS is not None:
        import pallas_kernels  # dispatcher; the model never calls a backend kernel directly
        out = pallas_kernels.flash_attention(
            q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
            segment_ids_BL=segment_ids_BL, causal=True, sm_scale=scale)
        return out.transpose(0, 2, 1, 3)
    return dot_product_attention(q, k, v, mask, scale)


class GQAAttention(nn.Module):
    """Grouped-query attention with optional per-head QK RMSNorm before RoPE (Qwen3)."""

    cfg: object

    @nn.compact
    def __call__(self, x_BLD, positions_BL, segment_ids_BL, cache=None):
        m = self.cfg
        dt, pdt = dtype_of(m.dtype), dtype_of(m.param_dtype)
        kw = dict(dtype=dt, param_dtype=pdt, init_std=m.init_std, use_bias=m.attention_bias)
        B, L, _ = x_BLD.shape
        H, G, P = m.num_heads, m.num_kv_heads, m.head_dim
        q = Linear(H * P, ("embed", "heads"), name="q_proj", **kw)(x_BLD).reshape(B, L, H, P)
        k = Linear(G * P, ("embed", "kv_heads"), name="k_proj", **kw)(x_BLD).reshape(B, L, G, P)
        v = Linear(G * P, ("embed", "kv_heads"), name="v_proj", **kw)(x_BLD).reshape(B, L, G, P)
        if m.qk_norm:
            q = RMSNorm(m.rms_norm_eps, "head_dim", pdt, name="q_norm")(q)
            k = RMSNorm(m.rms_norm_eps, "head_dim", pdt, name="k_norm")(k)
        inv_freq, factor = rope_frequencies(P, m)
        q = apply_rope(q, positions_BL, inv_freq, factor, interleave=False)
        k = apply_rope(k, positions_BL, inv_freq, factor, interleave=False)
        q = nn.with_logical_constraint(q, ("batch", "length", "heads", "head_dim"))
        scale = P ** -0.5
        if cache is None:
            out = _attend(m, q, k, v, positions_BL, segment_ids_BL, positions_BL, segment_ids_BL, scale)
            new_cache = None
        else:
            new_cache = {"k": write_cache(cache["k"], k, positions_BL),
                         "v": write_cache(cache["v"], v, positions_BL)}
            S = new_cache["k"].shape[1]
            slots_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
            out = _attend(m, q, new_cache["k"].astype(dt), new_cache["v"].astype(dt),
                          positions_BL, None, slots_BS, None, scale)
        out = nn.with_logical_constraint(out, ("batch", "length", "heads", "head_dim"))
        return Linear(m.hidden_size, ("heads", "embed"), name="o_proj", dtype=dt, param_dtype=pdt,
                      init_std=m.init_std)(out.reshape(B, L, H * P)), new_cache


class MLAAttention(nn.Module):
    """Multi-head latent attention. Training expands the latent to per-head K/V; with a cache
    (prefill/decode) only the latent C and the shared rotary key R are stored, and the
    up-projection is absorbed into the query and output (no per-head K/V materialized)."""

    cfg: object

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
        else:
            new_cache = {"latent": write_cache(cache["latent"], latent_BLC, positions_BL),
                         "k_rope": write_cache(cache["k_rope"], k_rope_BLR, positions_BL)}
            S = new_cache["latent"].shape[1]
            slots_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
            mask = attention_mask(positions_BL, slots_BS)
            q_abs_BLHC = jnp.einsum("blhn,chn->blhc", q_nope, kv_b_CHX[..., :N])
            logits = (jnp.einsum("blhc,bsc->bhls", q_abs_BLHC, new_cache["latent"].astype(dt),
                                 preferred_element_type=jnp.float32)
                      + jnp.einsum("blhr,bsr->bhls", q_rope, new_cache["k_rope"].astype(dt),
                                   preferred_element_type=jnp.float32)) * scale
            logits = jnp.where(mask[:, None], logits, NEG_INF)
            probs = jax.nn.softmax(logits, axis=-1).astype(dt)
            ctx_BLHC = jnp.einsum("bhls,bsc->blhc", probs, new_cache["latent"].astype(dt))
            out = jnp.einsum("blhc,cho->blho", ctx_BLHC, kv_b_CHX[..., N:])
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
