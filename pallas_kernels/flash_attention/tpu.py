"""Pallas TPU (Mosaic) flash attention: forward (online softmax) and backward (dK/dV and dQ kernels).

Causal block skipping (no compute and no new DMA for blocks above the diagonal), segment ids,
GQA (kv heads shared by H/K query heads; dK/dV summed over the group inside the kernel) and
distinct q/k and v head dims (MLA: D=192, E=128).
"""
# Dim letters: B batch, H q heads, K kv heads, G = H/K, L length, D q/k head dim, E v head dim.
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import (
    MASK_VALUE,
    online_softmax_step,
    pad_axis,
    round_up,
)

DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512
DEFAULT_BWD_BLOCK_Q = 256
DEFAULT_BWD_BLOCK_K = 256
VMEM_LIMIT_BYTES = 48 * 1024 * 1024  # v5p has 64 MiB VMEM per core
_Q_PAD = -(2**31) + 1
_KV_PAD = -(2**31)


def _blocks(l, block_q, block_k):
    bq = min(block_q, round_up(l, 128))
    bk = min(block_k, round_up(l, 128))
    return bq, bk, round_up(l, math.lcm(bq, bk))


def _mask(qs_ref, ks_ref, qi, ki, bq, bk, causal):
    mask = qs_ref[...].reshape(bq, 1) == ks_ref[...]  # (bq,1) == (1,bk); ids are stored as rows
    if causal:
        rows = qi * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
        cols = ki * bk + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
        mask = mask & (rows >= cols)
    return mask


def _needed(qi, ki, bq, bk, causal):
    return (ki * bk <= qi * bq + bq - 1) if causal else True


def _fwd_kernel(q_ref, k_ref, v_ref, qs_ref, ks_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc,
                *, scale, causal, bq, bk, nk):
    qi, ki = pl.program_id(2), pl.program_id(3)

    @pl.when(ki == 0)
    def _():
        m_sc[...] = jnp.full_like(m_sc, MASK_VALUE)
        l_sc[...] = jnp.zeros_like(l_sc)
        acc_sc[...] = jnp.zeros_like(acc_sc)

    @pl.when(_needed(qi, ki, bq, bk, causal))
    def _():
        s = jax.lax.dot_general(q_ref[...], k_ref[...], (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * scale
        online_softmax_step(s, _mask(qs_ref, ks_ref, qi, ki, bq, bk, causal), v_ref, m_sc, l_sc, acc_sc)

    @pl.when(ki == nk - 1)
    def _():
        l = l_sc[...]
        l_safe = jnp.where(l == 0.0, 1.0, l)
        o_ref[...] = (acc_sc[...] / l_safe).astype(o_ref.dtype)
        lse_ref[...] = (m_sc[...] + jnp.log(l_safe)).reshape(1, bq)  # row layout: no 128-lane padding in HBM


def _prep(q, k, v, seg_BL, block_q, block_k):
    b, _h, l, _d = q.shape
    bq, bk, lp = _blocks(l, block_q, block_k)
    if seg_BL is None:
        seg_BL = jnp.zeros((b, l), jnp.int32)
    seg_BL = seg_BL.astype(jnp.int32)
    qs = pad_axis(seg_BL, 1, lp, _Q_PAD)[:, None, :]   # [B, 1, Lp]
    ks = pad_axis(seg_BL, 1, lp, _KV_PAD)[:, None, :]  # [B, 1, Lp]
    return bq, bk, lp, pad_axis(q, 2, lp), pad_axis(k, 2, lp), pad_axis(v, 2, lp), qs, ks


def _kv_index(causal, bq, bk):
    def idx(b, h, qi, ki, g):
        if causal:
            ki = jnp.minimum(ki, jax.lax.div(qi * bq + bq - 1, bk))  # lax.div: no sign op in Mosaic
        return (b, jax.lax.div(h, g), ki, 0)
    return idx


def flash_fwd_tpu(q_BHLD, k_BKLD, v_BKLE, seg_BL, *, causal, sm_scale, block_q=DEFAULT_BLOCK_Q,
                  block_k=DEFAULT_BLOCK_K, interpret=False):
    """Forward pass; returns (out [B,H,L,E], lse [B,H,1,Lp] f32 on the padded length)."""
    b, h, l, d = q_BHLD.shape
    kh, e = k_BKLD.shape[1], v_BKLE.shape[3]
    g = h // kh
    bq, bk, lp, q, k, v, qs, ks = _prep(q_BHLD, k_BKLD, v_BKLE, seg_BL, block_q, block_k)
    nq, nk = lp // bq, lp // bk
    kvi = _kv_index(causal, bq, bk)
    out, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, scale=sm_scale, causal=causal, bq=bq, bk=bk, nk=nk),
        grid=(b, h, nq, nk),
        in_specs=[
            pl.BlockSpec((None, None, bq, d), lambda b_, h_, qi, ki: (b_, h_, qi, 0)),
            pl.BlockSpec((None, None, bk, d), lambda b_, h_, qi, ki: kvi(b_, h_, qi, ki, g)),
            pl.BlockSpec((None, None, bk, e), lambda b_, h_, qi, ki: kvi(b_, h_, qi, ki, g)),
            pl.BlockSpec((None, 1, bq), lambda b_, h_, qi, ki: (b_, 0, qi)),
            pl.BlockSpec((None, 1, bk), lambda b_, h_, qi, ki: (b_, 0, kvi(b_, h_, qi, ki, g)[2])),
        ],
        out_specs=[
            pl.BlockSpec((None, None, bq, e), lambda b_, h_, qi, ki: (b_, h_, qi, 0)),
            pl.BlockSpec((None, None, 1, bq), lambda b_, h_, qi, ki: (b_, h_, 0, qi)),
        ],
        out_shape=[jax.ShapeDtypeStruct((b, h, lp, e), q_BHLD.dtype),
                   jax.ShapeDtypeStruct((b, h, 1, lp), jnp.float32)],
        scratch_shapes=[pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32),
                        pltpu.VMEM((bq, e), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=VMEM_LIMIT_BYTES),
        interpret=interpret,
    )(q, k, v, qs, ks)
    return out[:, :, :l], lse


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, qs_ref, ks_ref, dk_ref, dv_ref,
                dk_sc, dv_sc, *, scale, causal, bq, bk, ng, nq):
    ki, gi, qi = pl.program_id(2), pl.program_id(3), pl.program_id(4)

    @pl.when((gi == 0) & (qi == 0))
    def _():
        dk_sc[...] = jnp.zeros_like(dk_sc)
        dv_sc[...] = jnp.zeros_like(dv_sc)

    @pl.when(_needed(qi, ki, bq, bk, causal))
    def _():
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        mask = _mask(qs_ref, ks_ref, qi, ki, bq, bk, causal)
        p = jnp.where(mask, jnp.exp(s - lse_ref[...].reshape(bq, 1)), 0.0)
        dv_sc[...] += jax.lax.dot_general(p.astype(do.dtype), do, (((0,), (0,)), ((), ())),
                                          preferred_element_type=jnp.float32)
        dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        ds = p * (dp - dl_ref[...].reshape(bq, 1))
        dk_sc[...] += jax.lax.dot_general(ds.astype(q.dtype), q, (((0,), (0,)), ((), ())),
                                          preferred_element_type=jnp.float32) * scale

    @pl.when((gi == ng - 1) & (qi == nq - 1))
    def _():
        dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, qs_ref, ks_ref, dq_ref, dq_sc,
               *, scale, causal, bq, bk, nk):
    qi, ki = pl.program_id(2), pl.program_id(3)

    @pl.when(ki == 0)
    def _():
        dq_sc[...] = jnp.zeros_like(dq_sc)

    @pl.when(_needed(qi, ki, bq, bk, causal))
    def _():
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        mask = _mask(qs_ref, ks_ref, qi, ki, bq, bk, causal)
        p = jnp.where(mask, jnp.exp(s - lse_ref[...].reshape(bq, 1)), 0.0)
        dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        ds = p * (dp - dl_ref[...].reshape(bq, 1))
        dq_sc[...] += jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32) * scale

    @pl.when(ki == nk - 1)
    def _():
        dq_ref[...] = dq_sc[...].astype(dq_ref.dtype)


def flash_bwd_tpu(q_BHLD, k_BKLD, v_BKLE, seg_BL, out_BHLE, lse_BH1L, do_BHLE, *, causal, sm_scale,
                  block_q=DEFAULT_BWD_BLOCK_Q, block_k=DEFAULT_BWD_BLOCK_K, interpret=False):
    """Backward pass; returns (dq, dk, dv). lse comes from flash_fwd_tpu (any block sizes)."""
    b, h, l, d = q_BHLD.shape
    kh, e = k_BKLD.shape[1], v_BKLE.shape[3]
    g = h // kh
    bq, bk, lp, q, k, v, qs, ks = _prep(q_BHLD, k_BKLD, v_BKLE, seg_BL, block_q, block_k)
    nq, nk = lp // bq, lp // bk
    do = pad_axis(do_BHLE, 2, lp)
    delta = jnp.sum(out_BHLE.astype(jnp.float32) * do_BHLE.astype(jnp.float32), axis=-1)[:, :, None, :]
    delta = pad_axis(delta, 3, lp)  # [B, H, 1, Lp]
    lse = pad_axis(lse_BH1L[..., :l], 3, lp)
    cp = lambda sem: pltpu.CompilerParams(dimension_semantics=sem, vmem_limit_bytes=VMEM_LIMIT_BYTES)

    def qrow(b_, hk, ki, gi, qi):
        if causal:
            qi = jnp.maximum(qi, jax.lax.div(ki * bk, bq))
        return b_, hk * g + gi, qi

    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=sm_scale, causal=causal, bq=bq, bk=bk, ng=g, nq=nq),
        grid=(b, kh, nk, g, nq),
        in_specs=[
            pl.BlockSpec((None, None, bq, d), lambda *a: (*qrow(*a), 0)),
            pl.BlockSpec((None, None, bk, d), lambda b_, hk, ki, gi, qi: (b_, hk, ki, 0)),
            pl.BlockSpec((None, None, bk, e), lambda b_, hk, ki, gi, qi: (b_, hk, ki, 0)),
            pl.BlockSpec((None, None, bq, e), lambda *a: (*qrow(*a), 0)),
            pl.BlockSpec((None, None, 1, bq), lambda *a: (qrow(*a)[0], qrow(*a)[1], 0, qrow(*a)[2])),
            pl.BlockSpec((None, None, 1, bq), lambda *a: (qrow(*a)[0], qrow(*a)[1], 0, qrow(*a)[2])),
            pl.BlockSpec((None, 1, bq), lambda *a: (qrow(*a)[0], 0, qrow(*a)[2])),
            pl.BlockSpec((None, 1, bk), lambda b_, hk, ki, gi, qi: (b_, 0, ki)),
        ],
        out_specs=[pl.BlockSpec((None, None, bk, d), lambda b_, hk, ki, gi, qi: (b_, hk, ki, 0)),
                   pl.BlockSpec((None, None, bk, e), lambda b_, hk, ki, gi, qi: (b_, hk, ki, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, kh, lp, d), k_BKLD.dtype),
                   jax.ShapeDtypeStruct((b, kh, lp, e), v_BKLE.dtype)],
        scratch_shapes=[pltpu.VMEM((bk, d), jnp.float32), pltpu.VMEM((bk, e), jnp.float32)],
        compiler_params=cp(("parallel", "parallel", "parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
    )(q, k, v, do, lse, delta, qs, ks)

    kvi = _kv_index(causal, bq, bk)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=sm_scale, causal=causal, bq=bq, bk=bk, nk=nk),
        grid=(b, h, nq, nk),
        in_specs=[
            pl.BlockSpec((None, None, bq, d), lambda b_, h_, qi, ki: (b_, h_, qi, 0)),
            pl.BlockSpec((None, None, bk, d), lambda b_, h_, qi, ki: kvi(b_, h_, qi, ki, g)),
            pl.BlockSpec((None, None, bk, e), lambda b_, h_, qi, ki: kvi(b_, h_, qi, ki, g)),
            pl.BlockSpec((None, None, bq, e), lambda b_, h_, qi, ki: (b_, h_, qi, 0)),
            pl.BlockSpec((None, None, 1, bq), lambda b_, h_, qi, ki: (b_, h_, 0, qi)),
            pl.BlockSpec((None, None, 1, bq), lambda b_, h_, qi, ki: (b_, h_, 0, qi)),
            pl.BlockSpec((None, 1, bq), lambda b_, h_, qi, ki: (b_, 0, qi)),
            pl.BlockSpec((None, 1, bk), lambda b_, h_, qi, ki: (b_, 0, kvi(b_, h_, qi, ki, g)[2])),
        ],
        out_specs=pl.BlockSpec((None, None, bq, d), lambda b_, h_, qi, ki: (b_, h_, qi, 0)),
        out_shape=jax.ShapeDtypeStruct((b, h, lp, d), q_BHLD.dtype),
        scratch_shapes=[pltpu.VMEM((bq, d), jnp.float32)],
        compiler_params=cp(("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(q, k, v, do, lse, delta, qs, ks)
    return dq[:, :, :l], dk[:, :, :l], dv[:, :, :l]
