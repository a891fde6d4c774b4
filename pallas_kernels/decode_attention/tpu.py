"""Pallas TPU (Mosaic) decode attention: online softmax over cache blocks, blocks past the length skipped.

All G = H/K query heads of one kv head are processed together, so each KV block is read once.
"""
# Dim letters: B batch, H q heads, K kv heads, G = H/K, S cache length, D q/k head dim, E v head dim.
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import (
    MASK_VALUE,
    online_softmax_step,
    out_struct,
    pad_axis,
    pick_tile,
    round_up,
)

DEFAULT_BLOCK_S = 512
VMEM_LIMIT_BYTES = 32 * 1024 * 1024


def _decode_kernel(len_ref, q_ref, k_ref, v_ref, o_ref, m_sc, l_sc, acc_sc, *, scale, bs, ns):
    b, si = pl.program_id(0), pl.program_id(2)
    length = len_ref[b]

    @pl.when(si == 0)
    def _():
        m_sc[...] = jnp.full_like(m_sc, MASK_VALUE)
        l_sc[...] = jnp.zeros_like(l_sc)
        acc_sc[...] = jnp.zeros_like(acc_sc)

    @pl.when(si * bs < length)
    def _():
        s = jax.lax.dot_general(q_ref[...], k_ref[...], (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * scale  # [G, bs]
        cols = si * bs + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        online_softmax_step(s, cols < length, v_ref, m_sc, l_sc, acc_sc)

    @pl.when(si == ns - 1)
    def _():
        l = l_sc[...]
        o_ref[...] = (acc_sc[...] / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)


def decode_attention_tpu(q_BHD, k_cache_BKSD, v_cache_BKSE, lengths_B, *, sm_scale,
                         block_s=DEFAULT_BLOCK_S, interpret=False):
    """Decode attention on TPU; pads S only when no multiple of 128 <= block_s divides it."""
    b, h, d = q_BHD.shape
    kh, s = k_cache_BKSD.shape[1], k_cache_BKSD.shape[2]
    e = v_cache_BKSE.shape[3]
    g = h // kh
    bs = pick_tile(s, block_s, 128)
    sp = round_up(s, bs)
    k = pad_axis(k_cache_BKSD, 2, sp)
    v = pad_axis(v_cache_BKSE, 2, sp)
    ns = sp // bs
    q_BKGD = q_BHD.reshape(b, kh, g, d)
    lengths_B = jnp.clip(lengths_B.astype(jnp.int32), 0, s)

    def kv_idx(b_, h_, si, lens):
        last = jnp.maximum(jax.lax.div(lens[b_] + bs - 1, bs) - 1, 0)  # lax.div: no sign op in Mosaic
        return (b_, h_, jnp.minimum(si, last), 0)

    out = pl.pallas_call(
        functools.partial(_decode_kernel, scale=sm_scale, bs=bs, ns=ns),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, kh, ns),
            in_specs=[pl.BlockSpec((None, None, g, d), lambda b_, h_, si, lens: (b_, h_, 0, 0)),
                      pl.BlockSpec((None, None, bs, d), kv_idx),
                      pl.BlockSpec((None, None, bs, e), kv_idx)],
            out_specs=pl.BlockSpec((None, None, g, e), lambda b_, h_, si, lens: (b_, h_, 0, 0)),
            scratch_shapes=[pltpu.VMEM((g, 1), jnp.float32), pltpu.VMEM((g, 1), jnp.float32),
                            pltpu.VMEM((g, e), jnp.float32)]),
        out_shape=out_struct((b, kh, g, e), q_BHD.dtype, lengths_B, q_BKGD, k, v),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=VMEM_LIMIT_BYTES),
        interpret=interpret,
    )(lengths_B, q_BKGD, k, v)
    return out.reshape(b, h, e)


def _mla_decode_kernel(len_ref, qa_ref, qr_ref, c_ref, r_ref, o_ref, m_sc, l_sc, acc_sc, *, scale, bs, ns):
    b, si = pl.program_id(0), pl.program_id(1)
    length = len_ref[b]

    @pl.when(si == 0)
    def _():
        m_sc[...] = jnp.full_like(m_sc, MASK_VALUE)
        l_sc[...] = jnp.zeros_like(l_sc)
        acc_sc[...] = jnp.zeros_like(acc_sc)

    @pl.when(si * bs < length)
    def _():
        nt = (((1,), (1,)), ((), ()))
        s = (jax.lax.dot_general(qa_ref[...], c_ref[...], nt, preferred_element_type=jnp.float32)
             + jax.lax.dot_general(qr_ref[...], r_ref[...], nt, preferred_element_type=jnp.float32)) * scale
        cols = si * bs + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        online_softmax_step(s, cols < length, c_ref, m_sc, l_sc, acc_sc)   # the values are the latents

    @pl.when(si == ns - 1)
    def _():
        l = l_sc[...]
        o_ref[...] = (acc_sc[...] / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)


def mla_decode_attention_tpu(q_latent_BHC, q_rope_BHR, latent_BSC, k_rope_BSR, lengths_B, *, sm_scale,
                             block_s=DEFAULT_BLOCK_S, interpret=False):
    """MLA decode on TPU in the latent space: every head attends the shared latent cache (keys:
    latent and rope parts; values: the latents), read in the cache's own [B, S, C] / [B, S, R]
    layout, blocks past the row's length skipped. Returns the heads' latent contexts [B, H, C]."""
    b, h, c = q_latent_BHC.shape
    r, s = q_rope_BHR.shape[2], latent_BSC.shape[1]
    bs = pick_tile(s, block_s, 128)
    sp = round_up(s, bs)
    lat = pad_axis(latent_BSC, 1, sp)
    rope = pad_axis(k_rope_BSR, 1, sp)
    ns = sp // bs
    lengths_B = jnp.clip(lengths_B.astype(jnp.int32), 0, s)

    def kv_idx(b_, si, lens):
        last = jnp.maximum(jax.lax.div(lens[b_] + bs - 1, bs) - 1, 0)
        return (b_, jnp.minimum(si, last), 0)

    row = lambda b_, si, lens: (b_, 0, 0)  # noqa: E731
    return pl.pallas_call(
        functools.partial(_mla_decode_kernel, scale=sm_scale, bs=bs, ns=ns),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, ns),
            in_specs=[pl.BlockSpec((None, h, c), row), pl.BlockSpec((None, h, r), row),
                      pl.BlockSpec((None, bs, c), kv_idx), pl.BlockSpec((None, bs, r), kv_idx)],
            out_specs=pl.BlockSpec((None, h, c), row),
            scratch_shapes=[pltpu.VMEM((h, 1), jnp.float32), pltpu.VMEM((h, 1), jnp.float32),
                            pltpu.VMEM((h, c), jnp.float32)]),
        out_shape=out_struct((b, h, c), q_latent_BHC.dtype, lengths_B, q_latent_BHC, lat, rope),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"),
            vmem_limit_bytes=VMEM_LIMIT_BYTES),
        interpret=interpret,
    )(lengths_B, q_latent_BHC, q_rope_BHR, lat, rope)
