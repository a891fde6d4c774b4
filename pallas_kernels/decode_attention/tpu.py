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

from pallas_kernels.cost import decode_cost, mla_decode_cost
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


def _over_cache_blocks(si, ns, bs, length, o_ref, m_sc, l_sc, acc_sc, attend):
    """One row's online softmax over its cache blocks (grid axis si of ns): reset the scratch at
    block 0, attend(valid) on blocks holding positions < length (valid(s): the mask of logits s
    [rows, bs]), normalize into o_ref at the last block."""
    @pl.when(si == 0)
    def _():
        m_sc[...] = jnp.full_like(m_sc, MASK_VALUE)
        l_sc[...] = jnp.zeros_like(l_sc)
        acc_sc[...] = jnp.zeros_like(acc_sc)

    @pl.when(si * bs < length)
    def _():
        attend(lambda s: si * bs + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1) < length)

    @pl.when(si == ns - 1)
    def _():
        l = l_sc[...]
        o_ref[...] = (acc_sc[...] / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)


_NT = (((1,), (1,)), ((), ()))   # a @ b.T


def _decode_kernel(len_ref, q_ref, k_ref, v_ref, o_ref, m_sc, l_sc, acc_sc, *, scale, bs, ns):
    def attend(valid):
        s = jax.lax.dot_general(q_ref[...], k_ref[...], _NT, preferred_element_type=jnp.float32) * scale  # [G, bs]
        online_softmax_step(s, valid(s), v_ref, m_sc, l_sc, acc_sc)
    _over_cache_blocks(pl.program_id(2), ns, bs, len_ref[pl.program_id(0)], o_ref, m_sc, l_sc, acc_sc, attend)


def _decode_heads_kernel(len_ref, q_ref, k_ref, v_ref, o_ref, m_sc, l_sc, acc_sc, *, scale, bs, ns, kh):
    """_decode_kernel over a [bs, K, D] block of the model's cache layout: every kv head of the
    row in one program, so each cache row is read once, in place."""
    def attend(valid):
        for h in range(kh):
            s = jax.lax.dot_general(q_ref[h], k_ref[:, h, :], _NT, preferred_element_type=jnp.float32) * scale
            online_softmax_step(s, valid(s), v_ref.at[:, h, :], m_sc.at[h], l_sc.at[h], acc_sc.at[h])
    _over_cache_blocks(pl.program_id(1), ns, bs, len_ref[pl.program_id(0)], o_ref, m_sc, l_sc, acc_sc, attend)


def reads_in_place(d: int, e: int, kh: int) -> bool:
    """Can the kernel read a [B, S, K, D] cache in its own layout ([bs, K, D] blocks, all kv heads
    of a row in one program)? D and E must fill whole 128-lane tiles."""
    return d % 128 == 0 and e % 128 == 0


def decode_attention_tpu(q_BHD, k_cache_BKSD, v_cache_BKSE, lengths_B, *, sm_scale,
                         block_s=DEFAULT_BLOCK_S, interpret=False, cache_layout="BKSD"):
    """Decode attention on TPU; pads S only when no multiple of 128 <= block_s divides it.
    cache_layout "BSKD": the caches are [B, S, K, D] / [B, S, K, E] (the model's own), read in
    place where reads_in_place allows, else transposed once here."""
    if cache_layout == "BSKD":
        kh, d, e = k_cache_BKSD.shape[2], k_cache_BKSD.shape[3], v_cache_BKSE.shape[3]
        if not reads_in_place(d, e, kh):
            cache_layout = "BKSD"
            k_cache_BKSD, v_cache_BKSE = k_cache_BKSD.transpose(0, 2, 1, 3), v_cache_BKSE.transpose(0, 2, 1, 3)
    elif cache_layout != "BKSD":
        raise ValueError(f"cache_layout must be 'BKSD' or 'BSKD', got {cache_layout!r}")
    in_place = cache_layout == "BSKD"
    b, h, d = q_BHD.shape
    if in_place:
        s, kh = k_cache_BKSD.shape[1], k_cache_BKSD.shape[2]
    else:
        kh, s = k_cache_BKSD.shape[1], k_cache_BKSD.shape[2]
    e = v_cache_BKSE.shape[3]
    g = h // kh
    bs = pick_tile(s, block_s, 128)
    sp = round_up(s, bs)
    if in_place:   # grid (B, S blocks): each program reads [bs, K, D] rows, all kv heads
        k = pad_axis(k_cache_BKSD, 1, sp)
        v = pad_axis(v_cache_BKSE, 1, sp)
    else:
        k = pad_axis(k_cache_BKSD, 2, sp)
        v = pad_axis(v_cache_BKSE, 2, sp)
    ns = sp // bs
    q_BKGD = q_BHD.reshape(b, kh, g, d)
    lengths_B = jnp.clip(lengths_B.astype(jnp.int32), 0, s)

    def last_block(b_, lens):
        return jnp.maximum(jax.lax.div(lens[b_] + bs - 1, bs) - 1, 0)  # lax.div: no sign op in Mosaic

    if in_place:
        row = lambda b_, si, lens: (b_, 0, 0, 0)  # noqa: E731
        kv_idx = lambda b_, si, lens: (b_, jnp.minimum(si, last_block(b_, lens)), 0, 0)  # noqa: E731
        kernel = functools.partial(_decode_heads_kernel, scale=sm_scale, bs=bs, ns=ns, kh=kh)
        grid, sem = (b, ns), ("parallel", "arbitrary")
        specs = [pl.BlockSpec((None, kh, g, d), row), pl.BlockSpec((None, bs, kh, d), kv_idx),
                 pl.BlockSpec((None, bs, kh, e), kv_idx)]
        out_spec = pl.BlockSpec((None, kh, g, e), row)
        scratch = [pltpu.VMEM((kh, g, 1), jnp.float32), pltpu.VMEM((kh, g, 1), jnp.float32),
                   pltpu.VMEM((kh, g, e), jnp.float32)]
    else:
        row = lambda b_, h_, si, lens: (b_, h_, 0, 0)  # noqa: E731
        kv_idx = lambda b_, h_, si, lens: (b_, h_, jnp.minimum(si, last_block(b_, lens)), 0)  # noqa: E731
        kernel = functools.partial(_decode_kernel, scale=sm_scale, bs=bs, ns=ns)
        grid, sem = (b, kh, ns), ("parallel", "parallel", "arbitrary")
        specs = [pl.BlockSpec((None, None, g, d), row), pl.BlockSpec((None, None, bs, d), kv_idx),
                 pl.BlockSpec((None, None, bs, e), kv_idx)]
        out_spec = pl.BlockSpec((None, None, g, e), row)
        scratch = [pltpu.VMEM((g, 1), jnp.float32), pltpu.VMEM((g, 1), jnp.float32), pltpu.VMEM((g, e), jnp.float32)]

    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=grid, in_specs=specs,
                                               out_specs=out_spec, scratch_shapes=scratch),
        out_shape=out_struct((b, kh, g, e), q_BHD.dtype, lengths_B, q_BKGD, k, v),
        compiler_params=pltpu.CompilerParams(dimension_semantics=sem, vmem_limit_bytes=VMEM_LIMIT_BYTES),
        cost_estimate=decode_cost(b, h, kh, s, d, e, q_BHD.dtype, k.dtype),
        interpret=interpret,
    )(lengths_B, q_BKGD, k, v)
    return out.reshape(b, h, e)


def _mla_decode_kernel(len_ref, qa_ref, qr_ref, c_ref, r_ref, o_ref, m_sc, l_sc, acc_sc, *, scale, bs, ns):
    def attend(valid):
        s = (jax.lax.dot_general(qa_ref[...], c_ref[...], _NT, preferred_element_type=jnp.float32)
             + jax.lax.dot_general(qr_ref[...], r_ref[...], _NT, preferred_element_type=jnp.float32)) * scale
        online_softmax_step(s, valid(s), c_ref, m_sc, l_sc, acc_sc)   # the values are the latents
    _over_cache_blocks(pl.program_id(1), ns, bs, len_ref[pl.program_id(0)], o_ref, m_sc, l_sc, acc_sc, attend)


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
        cost_estimate=mla_decode_cost(b, h, s, c, r, q_latent_BHC.dtype, lat.dtype),
        interpret=interpret,
    )(lengths_B, q_latent_BHC, q_rope_BHR, lat, rope)
