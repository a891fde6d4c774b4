"""Pure-jnp decode attention: one new query token per row against a ragged KV cache."""
# Dim letters: B batch, H q heads, K kv heads (H % K == 0), S cache length, D q/k head dim, E v head dim.
from __future__ import annotations

import jax
import jax.numpy as jnp


def decode_attention_reference(q_BHD, k_cache_BKSD, v_cache_BKSE, lengths_B, sm_scale=None):
    """Attend q to cache positions < lengths[b]; rows with length 0 give 0."""
    b, h, d = q_BHD.shape
    kh, s = k_cache_BKSD.shape[1], k_cache_BKSD.shape[2]
    scale = d ** -0.5 if sm_scale is None else sm_scale
    q_BKGD = q_BHD.reshape(b, kh, h // kh, d).astype(jnp.float32)
    s_BKGS = jnp.einsum("bkgd,bksd->bkgs", q_BKGD, k_cache_BKSD.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST) * scale
    mask = (jnp.arange(s)[None, :] < lengths_B[:, None])[:, None, None, :]
    s_BKGS = jnp.where(mask, s_BKGS, -jnp.inf)
    m = jnp.max(s_BKGS, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(s_BKGS - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(l == 0, 1.0, l)
    out = jnp.einsum("bkgs,bkse->bkge", p, v_cache_BKSE.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return out.reshape(b, h, -1).astype(q_BHD.dtype)


def mla_decode_attention_reference(q_latent_BHC, q_rope_BHR, latent_BSC, k_rope_BSR, lengths_B, sm_scale):
    """MLA decode in the latent space, float32: logits q_latent . latent + q_rope . k_rope over
    positions < lengths[b], values the latents -> [B, H, C] (rows with length 0 give 0)."""
    hp = jax.lax.Precision.HIGHEST
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    s_BHS = (jnp.einsum("bhc,bsc->bhs", f32(q_latent_BHC), f32(latent_BSC), precision=hp)
             + jnp.einsum("bhr,bsr->bhs", f32(q_rope_BHR), f32(k_rope_BSR), precision=hp)) * sm_scale
    mask = (jnp.arange(latent_BSC.shape[1])[None, :] < lengths_B[:, None])[:, None, :]
    s_BHS = jnp.where(mask, s_BHS, -jnp.inf)
    m = jnp.max(s_BHS, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s_BHS - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bhs,bsc->bhc", p / jnp.where(l == 0, 1.0, l), f32(latent_BSC), precision=hp)
    return out.astype(q_latent_BHC.dtype)
