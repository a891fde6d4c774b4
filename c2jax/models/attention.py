"""Attention: GQA (optional QK-norm, Qwen3) and MLA (DeepSeek-V3/Kimi), with an optional KV cache.

Letters: B batch, L query length, S key length (cache slots), D model width, H query heads,
G kv heads, P GQA head dim, Q q latent, C kv latent, N nope dims, R rope dims, O value dims.

Masking is by position: key slot s is visible to a query at position p when pos_s <= p and
both belong to the same segment. In the cache, slot index == position, so prefill and
decode share one code path and stale slots beyond p are never visible.
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from c2jax.models.layers import (Linear, LinearWeights, RMSNorm, apply_rope, dtype_of, fused_linears, kernels_of,
                                 rope_frequencies, rope_tables, rotate, softmax_scale)
from c2jax.ops import attention as attention_ops
from c2jax.ops import remat


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
        kn = kernels_of(m)
        kw = dict(dtype=dt, param_dtype=pdt, init_std=m.init_std, use_bias=m.attention_bias)
        B, L, _ = x_BLD.shape
        H, G, P = m.num_heads, m.num_kv_heads, m.head_dim
        D = x_BLD.shape[-1]
        q, k, v = fused_linears(x_BLD, [LinearWeights(H * P, ("embed", "heads"), name="q_proj", **kw)(D),
                                        LinearWeights(G * P, ("embed", "kv_heads"), name="k_proj", **kw)(D),
                                        LinearWeights(G * P, ("embed", "kv_heads"), name="v_proj", **kw)(D)], dt, kn)
        q, k, v = (remat.tag(t, remat.QKV_PROJ) for t in (q, k, v))
        q, k, v = q.reshape(B, L, H, P), k.reshape(B, L, G, P), v.reshape(B, L, G, P)
        tables = rope_tables(positions_BL, *rope_frequencies(P, m))
        if m.qk_norm:   # norm then RoPE, one op
            q = RMSNorm(m.rms_norm_eps, "head_dim", pdt, kn, name="q_norm")(q, rope=tables)
            k = RMSNorm(m.rms_norm_eps, "head_dim", pdt, kn, name="k_norm")(k, rope=tables)
        else:
            q, k = rotate(q, *tables), rotate(k, *tables)
        q = nn.with_logical_constraint(q, ("batch", "length", "heads", "head_dim"))
        out, new_cache = attention_ops.gqa_attention(kn, q, k, v, positions_BL, segment_ids_BL, P ** -0.5, dt,
                                                     cache, self.span)
        out = nn.with_logical_constraint(out, ("batch", "length", "heads", "head_dim"))
        y = Linear(m.hidden_size, ("heads", "embed"), name="o_proj", dtype=dt, param_dtype=pdt,
                   init_std=m.init_std, kernels=kn)(out.reshape(B, L, H * P))
        return remat.tag(y, remat.OUT_PROJ), new_cache


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
        kn = kernels_of(m)
        kw = dict(dtype=dt, param_dtype=pdt, init_std=m.init_std, kernels=kn)
        B, L, _ = x_BLD.shape
        H, N, R, O, C = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
        if m.q_lora_rank:
            q_lat = Linear(m.q_lora_rank, ("embed", "q_latent"), name="q_a_proj", **kw)(x_BLD)
            q_lat = RMSNorm(1e-6, "q_latent", pdt, kn, name="q_a_norm")(q_lat)
            q = Linear(H * (N + R), ("q_latent", "heads"), name="q_b_proj", **kw)(q_lat)
        else:
            q = Linear(H * (N + R), ("embed", "heads"), name="q_proj", **kw)(x_BLD)
        q = remat.tag(q, remat.QKV_PROJ).reshape(B, L, H, N + R)
        q_nope, q_rope = q[..., :N], q[..., N:]
        ckv = remat.tag(Linear(C + R, ("embed", "kv_latent"), name="kv_a_proj", **kw)(x_BLD), remat.QKV_PROJ)
        latent_BLC = RMSNorm(1e-6, "kv_latent", pdt, kn, name="kv_a_norm")(ckv[..., :C])
        latent_BLC = nn.with_logical_constraint(latent_BLC, ("batch", "length", "kv_latent"))
        k_rope = ckv[..., C:].reshape(B, L, 1, R)
        inv_freq, factor = rope_frequencies(R, m)
        q_rope = apply_rope(q_rope, positions_BL, inv_freq, factor, m.rope_interleave)
        k_rope_BLR = apply_rope(k_rope, positions_BL, inv_freq, factor, m.rope_interleave)[:, :, 0]
        kv_b = self.param("kv_b_proj", nn.with_logical_partitioning(
            nn.initializers.normal(m.init_std), ("kv_latent", "heads")), (C, H * (N + O)), pdt)
        kv_b_CHX = kv_b.astype(dt).reshape(C, H, N + O)
        out, new_cache = attention_ops.mla_attention(kn, q_nope, q_rope, latent_BLC, k_rope_BLR, kv_b_CHX, positions_BL,
                                                     segment_ids_BL, softmax_scale(N + R, m), dt, cache, self.span)
        out = nn.with_logical_constraint(out, ("batch", "length", "heads", "head_dim"))
        y = Linear(m.hidden_size, ("heads", "embed"), name="o_proj", **kw)(out.reshape(B, L, H * O))
        return remat.tag(y, remat.OUT_PROJ), new_cache


def init_layer_cache(m, batch: int, max_len: int, dtype) -> dict:
    """Empty KV cache of one layer: MLA stores latent + rotary key, GQA stores K and V."""
    if m.attention == "mla":
        return {"latent": jnp.zeros((batch, max_len, m.kv_lora_rank), dtype),
                "k_rope": jnp.zeros((batch, max_len, m.qk_rope_head_dim), dtype)}
    shape = (batch, max_len, m.num_kv_heads, m.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
