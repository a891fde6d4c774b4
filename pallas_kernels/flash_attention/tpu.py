"""Pallas TPU (Mosaic) flash attention: forward (online softmax) and backward (dK/dV and dQ kernels).

Masks: segment ids (separate query / key ids, so Lq != Lk works) and causal, either by index
(query l sees keys s <= l; Lq == Lk) or by explicit positions (query l sees key s when
kv_pos[s] <= q_pos[l]: context parallelism with local queries against all-gathered keys in a
zigzag order, where positions are not monotone in the index).

Block skipping: by index, blocks above the diagonal are neither computed nor fetched (static
clamps in the index maps). With positions, a block pair is skipped when the query block's largest
position is below the key block's smallest position or their segment ranges do not overlap; a
scalar-prefetched schedule (SMEM) marks the needed pairs and, for a skipped pair, names a block
already in VMEM so that no DMA is issued. When that schedule would not fit SMEM, per-block bounds
are prefetched instead (compute is still skipped; the DMA is not).

GQA: kv heads shared by H/K query heads (dK/dV summed over the group inside the kernel); distinct
q/k and v head dims (MLA: D=192, E=128).
"""
# Dim letters: B batch, H q heads, K kv heads, G = H/K, L query length, S key length, D q/k head dim,
# E v head dim; Q / N query / key blocks (nq, nk).
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.cost import flash_cost
from pallas_kernels._common import (
    MASK_VALUE,
    online_softmax_step,
    out_struct,
    pad_axis,
    round_up,
)

DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512
DEFAULT_BWD_BLOCK_Q = 256
DEFAULT_BWD_BLOCK_K = 256
VMEM_LIMIT_BYTES = 48 * 1024 * 1024  # v5p has 64 MiB VMEM per core
SCHEDULE_MAX_ENTRIES = 1 << 16  # int32 entries of a schedule table in SMEM (256 KiB of 1 MiB)
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
_Q_PAD = _I32_MIN + 1  # padded query / key segment ids never match each other or a real id
_KV_PAD = _I32_MIN


class _Layout(NamedTuple):
    """Block sizes, padded lengths and the padded int32 mask operands ([B, 1, Lp] rows)."""
    bq: int
    bk: int
    lqp: int
    lkp: int
    qs: jax.Array
    ks: jax.Array
    qp: jax.Array | None
    kp: jax.Array | None


def _layout(b, lq, lk, q_seg, kv_seg, q_pos, kv_pos, block_q, block_k) -> _Layout:
    bq = min(block_q, round_up(lq, 128))
    bk = min(block_k, round_up(lk, 128))
    lqp, lkp = round_up(lq, bq), round_up(lk, bk)
    q_seg = jnp.zeros((b, lq), jnp.int32) if q_seg is None else q_seg.astype(jnp.int32)
    kv_seg = jnp.zeros((b, lk), jnp.int32) if kv_seg is None else kv_seg.astype(jnp.int32)
    qs = pad_axis(q_seg, 1, lqp, _Q_PAD)[:, None, :]
    ks = pad_axis(kv_seg, 1, lkp, _KV_PAD)[:, None, :]
    qp = kp = None
    if q_pos is not None:  # padded queries see nothing, padded keys are seen by nothing
        qp = pad_axis(q_pos.astype(jnp.int32), 1, lqp, _I32_MIN)[:, None, :]
        kp = pad_axis(kv_pos.astype(jnp.int32), 1, lkp, _I32_MAX)[:, None, :]
    return _Layout(bq, bk, lqp, lkp, qs, ks, qp, kp)


# ----------------------------------------------------------------------------- position schedule

def _block_min_max(ids_B1L, valid_L, blk):
    """(min, max) of ids per block over the valid (unpadded) entries -> [B, n] each."""
    b, _, lp = ids_B1L.shape
    ids = ids_B1L.reshape(b, lp // blk, blk)
    valid = valid_L.reshape(1, lp // blk, blk)
    return (jnp.min(jnp.where(valid, ids, _I32_MAX), axis=2), jnp.max(jnp.where(valid, ids, _I32_MIN), axis=2))


def _block_bounds(lay: _Layout, lq, lk):
    """Per query block (largest position, segment min, segment max) -> [B, nq, 3]; per key block
    (smallest position, segment min, segment max) -> [B, nk, 3]."""
    q_valid, k_valid = jnp.arange(lay.lqp) < lq, jnp.arange(lay.lkp) < lk
    q_b = jnp.stack([_block_min_max(lay.qp, q_valid, lay.bq)[1], *_block_min_max(lay.qs, q_valid, lay.bq)], -1)
    k_b = jnp.stack([_block_min_max(lay.kp, k_valid, lay.bk)[0], *_block_min_max(lay.ks, k_valid, lay.bk)], -1)
    return q_b, k_b


def _needed_blocks(lay: _Layout, lq, lk):
    """[B, nq, nk] bool: the block pair may hold a visible (query, key) pair (by bounds; conservative)."""
    q_b, k_b = _block_bounds(lay, lq, lk)
    q_b, k_b = q_b[:, :, None, :], k_b[:, None, :, :]
    return (k_b[..., 0] <= q_b[..., 0]) & (q_b[..., 1] <= k_b[..., 2]) & (k_b[..., 1] <= q_b[..., 2])


class _Schedule(NamedTuple):
    """Scalar-prefetch operands saying which (outer i, inner j) block pairs are needed, and which
    inner block to fetch at each step (a skipped step re-uses a block already in VMEM)."""
    arrays: tuple
    table: bool
    ni: int
    nj: int

    def fetch(self, refs, b, i, j):
        if self.table:
            return jax.lax.shift_right_logical(refs[0][(b * self.ni + i) * self.nj + j], 1)
        return j


def _schedule(need_BIJ) -> tuple:
    """Flat int32 table, entry (b, i, j) = 2 * (inner block to fetch) + needed: a skipped step fetches
    the last needed block before it (else the next one after it, else block 0): no new DMA."""
    _, _, nj = need_BIJ.shape
    j = jnp.arange(nj, dtype=jnp.int32)
    last = jax.lax.cummax(jnp.where(need_BIJ, j, -1), axis=2)
    nxt = jax.lax.cummin(jnp.where(need_BIJ, j, nj), axis=2, reverse=True)
    fetch = jnp.where(need_BIJ, j, jnp.where(last >= 0, last, jnp.where(nxt < nj, nxt, 0)))
    return (fetch * 2 + need_BIJ.astype(jnp.int32)).reshape(-1)


def _make_schedule(lay: _Layout, lq, lk, kv_inner: bool) -> _Schedule | None:
    """Schedule for a kernel whose inner grid axis runs over key blocks (kv_inner) or query blocks."""
    if lay.qp is None:
        return None
    b = lay.qs.shape[0]
    nq, nk = lay.lqp // lay.bq, lay.lkp // lay.bk
    ni, nj = (nq, nk) if kv_inner else (nk, nq)
    if b * ni * nj <= SCHEDULE_MAX_ENTRIES:
        need = _needed_blocks(lay, lq, lk)
        return _Schedule((_schedule(need if kv_inner else jnp.swapaxes(need, 1, 2)),), True, ni, nj)
    # too large for SMEM: per-block bounds only (flat [B * n * 3]: bound, segment min, segment max)
    qb, kb = (x.reshape(-1) for x in _block_bounds(lay, lq, lk))
    return _Schedule((qb, kb), False, ni, nj)


def _sched_needed(sched: _Schedule, refs, b, qi, ki, kv_inner):
    """Is the (query block qi, key block ki) pair needed (dynamic, from the schedule)?"""
    if sched.table:
        i, j = (qi, ki) if kv_inner else (ki, qi)
        return jax.lax.bitwise_and(refs[0][(b * sched.ni + i) * sched.nj + j], 1) == 1
    qb, kb = refs[0], refs[1]
    qo, ko = (b * sched.ni + qi) * 3, (b * sched.nj + ki) * 3
    if not kv_inner:
        qo, ko = (b * sched.nj + qi) * 3, (b * sched.ni + ki) * 3
    return (kb[ko] <= qb[qo]) & (qb[qo + 1] <= kb[ko + 2]) & (kb[ko + 1] <= qb[qo + 2])


# ----------------------------------------------------------------------------- kernels

def _mask(qs_ref, ks_ref, qp_ref, kp_ref, qi, ki, bq, bk, causal):
    mask = qs_ref[...].reshape(bq, 1) == ks_ref[...]  # (bq,1) == (1,bk); ids are stored as rows
    if qp_ref is not None:
        mask = mask & (kp_ref[...] <= qp_ref[...].reshape(bq, 1))
    elif causal:
        rows = qi * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
        cols = ki * bk + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
        mask = mask & (rows >= cols)
    return mask


def _static_needed(qi, ki, bq, bk, causal):
    return (ki * bk <= qi * bq + bq - 1) if causal else True


def _split(refs, n_sched, n_in, has_pos):
    """(schedule refs, input refs with None for absent positions, the rest)."""
    sched, rest = refs[:n_sched], refs[n_sched:]
    ins, rest = list(rest[:n_in]), rest[n_in:]
    if not has_pos:
        ins += [None, None]
    return sched, ins, rest


def _fwd_kernel(*refs, scale, causal, bq, bk, nk, sched, has_pos):
    n_sched = 0 if sched is None else len(sched.arrays)
    srefs, (q_ref, k_ref, v_ref, qs_ref, ks_ref, qp_ref, kp_ref), (o_ref, lse_ref, m_sc, l_sc, acc_sc) = \
        _split(refs, n_sched, 7 if has_pos else 5, has_pos)
    b, qi, ki = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(ki == 0)
    def _():
        m_sc[...] = jnp.full_like(m_sc, MASK_VALUE)
        l_sc[...] = jnp.zeros_like(l_sc)
        acc_sc[...] = jnp.zeros_like(acc_sc)

    needed = (_static_needed(qi, ki, bq, bk, causal) if sched is None
              else _sched_needed(sched, srefs, b, qi, ki, kv_inner=True))

    @pl.when(needed)
    def _():
        s = jax.lax.dot_general(q_ref[...], k_ref[...], (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * scale
        mask = _mask(qs_ref, ks_ref, qp_ref, kp_ref, qi, ki, bq, bk, causal)
        online_softmax_step(s, mask, v_ref, m_sc, l_sc, acc_sc)

    @pl.when(ki == nk - 1)
    def _():
        l = l_sc[...]
        l_safe = jnp.where(l == 0.0, 1.0, l)
        o_ref[...] = (acc_sc[...] / l_safe).astype(o_ref.dtype)
        lse_ref[...] = (m_sc[...] + jnp.log(l_safe)).reshape(1, bq)  # row layout: no 128-lane padding in HBM


def _grid_spec(sched, grid, in_specs, out_specs, scratch_shapes):
    return pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=0 if sched is None else len(sched.arrays),
                                        grid=grid, in_specs=in_specs, out_specs=out_specs,
                                        scratch_shapes=scratch_shapes)


def _kv_block(sched, causal, bq, bk):
    """Key block to fetch at grid step (b, qi, ki) of a kernel iterating key blocks innermost."""
    def idx(b_, qi, ki, refs):
        if sched is not None:
            return sched.fetch(refs, b_, qi, ki)
        if causal:
            return jnp.minimum(ki, jax.lax.div(qi * bq + bq - 1, bk))  # lax.div: no sign op in Mosaic
        return ki
    return idx


def _q_block(sched, causal, bq, bk):
    """Query block to fetch at grid step (b, ki, qi) of a kernel iterating query blocks innermost."""
    def idx(b_, ki, qi, refs):
        if sched is not None:
            return sched.fetch(refs, b_, ki, qi)
        if causal:
            return jnp.maximum(qi, jax.lax.div(ki * bk, bq))
        return qi
    return idx


def _check(q_pos, kv_pos, lq, lk, causal):
    if (q_pos is None) != (kv_pos is None):
        raise ValueError("pass both q_pos and kv_pos, or neither")
    if q_pos is not None and not causal:
        raise ValueError("positions define the causal mask: pass causal=True with q_pos/kv_pos")
    if causal and q_pos is None and lq != lk:
        raise ValueError(f"causal by index needs Lq == Lk (got {lq}, {lk}); pass q_pos and kv_pos")


def flash_fwd_tpu(q_BHLD, k_BKSD, v_BKSE, q_seg_BL, kv_seg_BS=None, q_pos_BL=None, kv_pos_BS=None, *,
                  causal, sm_scale, block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K, interpret=False):
    """Forward pass; returns (out [B,H,L,E], lse [B,H,1,Lp] f32 on the padded query length).

    kv_seg_BS defaults to q_seg_BL (Lq == Lk); positions, when given, replace the index causal mask.
    """
    b, h, lq, d = q_BHLD.shape
    kh, lk, e = k_BKSD.shape[1], k_BKSD.shape[2], v_BKSE.shape[3]
    if kv_seg_BS is None:
        kv_seg_BS = q_seg_BL
    _check(q_pos_BL, kv_pos_BS, lq, lk, causal)
    g = h // kh
    lay = _layout(b, lq, lk, q_seg_BL, kv_seg_BS, q_pos_BL, kv_pos_BS, block_q, block_k)
    bq, bk = lay.bq, lay.bk
    nq, nk = lay.lqp // bq, lay.lkp // bk
    q, k, v = pad_axis(q_BHLD, 2, lay.lqp), pad_axis(k_BKSD, 2, lay.lkp), pad_axis(v_BKSE, 2, lay.lkp)
    sched = _make_schedule(lay, lq, lk, kv_inner=True)
    has_pos = lay.qp is not None
    kvb = _kv_block(sched, causal, bq, bk)
    q_map = lambda b_, h_, qi, ki, *r: (b_, h_, qi, 0)
    kv_map = lambda b_, h_, qi, ki, *r: (b_, jax.lax.div(h_, g), kvb(b_, qi, ki, r), 0)
    qrow = lambda b_, h_, qi, ki, *r: (b_, 0, qi)
    krow = lambda b_, h_, qi, ki, *r: (b_, 0, kvb(b_, qi, ki, r))
    in_specs = [pl.BlockSpec((None, None, bq, d), q_map), pl.BlockSpec((None, None, bk, d), kv_map),
                pl.BlockSpec((None, None, bk, e), kv_map), pl.BlockSpec((None, 1, bq), qrow),
                pl.BlockSpec((None, 1, bk), krow)]
    args = [q, k, v, lay.qs, lay.ks]
    if has_pos:
        in_specs += [pl.BlockSpec((None, 1, bq), qrow), pl.BlockSpec((None, 1, bk), krow)]
        args += [lay.qp, lay.kp]
    prefetch = () if sched is None else sched.arrays
    operands = (*prefetch, *args)
    out, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, scale=sm_scale, causal=causal, bq=bq, bk=bk, nk=nk, sched=sched,
                          has_pos=has_pos),
        grid_spec=_grid_spec(
            sched, (b, h, nq, nk), in_specs,
            [pl.BlockSpec((None, None, bq, e), q_map),
             pl.BlockSpec((None, None, 1, bq), lambda b_, h_, qi, ki, *r: (b_, h_, 0, qi))],
            [pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, e), jnp.float32)]),
        out_shape=[out_struct((b, h, lay.lqp, e), q_BHLD.dtype, *operands),
                   out_struct((b, h, 1, lay.lqp), jnp.float32, *operands)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=VMEM_LIMIT_BYTES),
        cost_estimate=flash_cost("fwd", b, h, kh, lq, lk, d, e, causal=causal, by_position=has_pos,
                                 dtype=q_BHLD.dtype, bq=bq, bk=bk),
        interpret=interpret,
    )(*operands)
    return out[:, :, :lq], lse


def _dkv_kernel(*refs, scale, causal, bq, bk, ng, nq, sched, has_pos):
    n_sched = 0 if sched is None else len(sched.arrays)
    srefs, ins, (dk_ref, dv_ref, dk_sc, dv_sc) = _split(refs, n_sched, 10 if has_pos else 8, has_pos)
    q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, qs_ref, ks_ref, qp_ref, kp_ref = ins
    b, ki, gi, qi = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)

    @pl.when((gi == 0) & (qi == 0))
    def _():
        dk_sc[...] = jnp.zeros_like(dk_sc)
        dv_sc[...] = jnp.zeros_like(dv_sc)

    needed = (_static_needed(qi, ki, bq, bk, causal) if sched is None
              else _sched_needed(sched, srefs, b, qi, ki, kv_inner=False))

    @pl.when(needed)
    def _():
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        mask = _mask(qs_ref, ks_ref, qp_ref, kp_ref, qi, ki, bq, bk, causal)
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


def _dq_kernel(*refs, scale, causal, bq, bk, nk, sched, has_pos):
    n_sched = 0 if sched is None else len(sched.arrays)
    srefs, ins, (dq_ref, dq_sc) = _split(refs, n_sched, 10 if has_pos else 8, has_pos)
    q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, qs_ref, ks_ref, qp_ref, kp_ref = ins
    b, qi, ki = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(ki == 0)
    def _():
        dq_sc[...] = jnp.zeros_like(dq_sc)

    needed = (_static_needed(qi, ki, bq, bk, causal) if sched is None
              else _sched_needed(sched, srefs, b, qi, ki, kv_inner=True))

    @pl.when(needed)
    def _():
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        mask = _mask(qs_ref, ks_ref, qp_ref, kp_ref, qi, ki, bq, bk, causal)
        p = jnp.where(mask, jnp.exp(s - lse_ref[...].reshape(bq, 1)), 0.0)
        dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        ds = p * (dp - dl_ref[...].reshape(bq, 1))
        dq_sc[...] += jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32) * scale

    @pl.when(ki == nk - 1)
    def _():
        dq_ref[...] = dq_sc[...].astype(dq_ref.dtype)


def flash_bwd_tpu(q_BHLD, k_BKSD, v_BKSE, q_seg_BL, out_BHLE, lse_BH1L, do_BHLE, *, kv_seg_BS=None,
                  q_pos_BL=None, kv_pos_BS=None, causal, sm_scale, block_q=DEFAULT_BWD_BLOCK_Q,
                  block_k=DEFAULT_BWD_BLOCK_K, interpret=False):
    """Backward pass; returns (dq, dk, dv). lse comes from flash_fwd_tpu (any block sizes)."""
    b, h, lq, d = q_BHLD.shape
    kh, lk, e = k_BKSD.shape[1], k_BKSD.shape[2], v_BKSE.shape[3]
    if kv_seg_BS is None:
        kv_seg_BS = q_seg_BL
    _check(q_pos_BL, kv_pos_BS, lq, lk, causal)
    g = h // kh
    lay = _layout(b, lq, lk, q_seg_BL, kv_seg_BS, q_pos_BL, kv_pos_BS, block_q, block_k)
    bq, bk, lqp, lkp = lay.bq, lay.bk, lay.lqp, lay.lkp
    nq, nk = lqp // bq, lkp // bk
    q, k, v = pad_axis(q_BHLD, 2, lqp), pad_axis(k_BKSD, 2, lkp), pad_axis(v_BKSE, 2, lkp)
    do = pad_axis(do_BHLE, 2, lqp)
    delta = jnp.sum(out_BHLE.astype(jnp.float32) * do_BHLE.astype(jnp.float32), axis=-1)[:, :, None, :]
    delta = pad_axis(delta, 3, lqp)  # [B, H, 1, Lp]
    lse = pad_axis(lse_BH1L[..., :lq], 3, lqp)
    has_pos = lay.qp is not None
    cp = lambda sem: pltpu.CompilerParams(dimension_semantics=sem, vmem_limit_bytes=VMEM_LIMIT_BYTES)
    cost = functools.partial(flash_cost, b=b, h=h, kh=kh, lq=lq, lk=lk, d=d, e=e, causal=causal, by_position=has_pos,
                             dtype=q_BHLD.dtype, bq=bq, bk=bk)
    args = [q, k, v, do, lse, delta, lay.qs, lay.ks] + ([lay.qp, lay.kp] if has_pos else [])

    # dK, dV: grid (b, kv head, key block, group member, query block), query blocks innermost
    sched_t = _make_schedule(lay, lq, lk, kv_inner=False)
    qb = _q_block(sched_t, causal, bq, bk)
    q4 = lambda b_, hk, ki, gi, qi, *r: (b_, hk * g + gi, qb(b_, ki, qi, r), 0)
    row4 = lambda b_, hk, ki, gi, qi, *r: (b_, hk * g + gi, 0, qb(b_, ki, qi, r))
    k4 = lambda b_, hk, ki, gi, qi, *r: (b_, hk, ki, 0)
    qrow = lambda b_, hk, ki, gi, qi, *r: (b_, 0, qb(b_, ki, qi, r))
    krow = lambda b_, hk, ki, gi, qi, *r: (b_, 0, ki)
    in_specs = [pl.BlockSpec((None, None, bq, d), q4), pl.BlockSpec((None, None, bk, d), k4),
                pl.BlockSpec((None, None, bk, e), k4), pl.BlockSpec((None, None, bq, e), q4),
                pl.BlockSpec((None, None, 1, bq), row4), pl.BlockSpec((None, None, 1, bq), row4),
                pl.BlockSpec((None, 1, bq), qrow), pl.BlockSpec((None, 1, bk), krow)]
    if has_pos:
        in_specs += [pl.BlockSpec((None, 1, bq), qrow), pl.BlockSpec((None, 1, bk), krow)]
    operands = (*(() if sched_t is None else sched_t.arrays), *args)
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=sm_scale, causal=causal, bq=bq, bk=bk, ng=g, nq=nq,
                          sched=sched_t, has_pos=has_pos),
        grid_spec=_grid_spec(sched_t, (b, kh, nk, g, nq), in_specs,
                             [pl.BlockSpec((None, None, bk, d), k4), pl.BlockSpec((None, None, bk, e), k4)],
                             [pltpu.VMEM((bk, d), jnp.float32), pltpu.VMEM((bk, e), jnp.float32)]),
        out_shape=[out_struct((b, kh, lkp, d), k_BKSD.dtype, *operands),
                   out_struct((b, kh, lkp, e), v_BKSE.dtype, *operands)],
        compiler_params=cp(("parallel", "parallel", "parallel", "arbitrary", "arbitrary")),
        cost_estimate=cost("dkv"),
        interpret=interpret,
    )(*operands)

    # dQ: grid (b, q head, query block, key block), key blocks innermost
    sched = _make_schedule(lay, lq, lk, kv_inner=True)
    kvb = _kv_block(sched, causal, bq, bk)
    q_map = lambda b_, h_, qi, ki, *r: (b_, h_, qi, 0)
    kv_map = lambda b_, h_, qi, ki, *r: (b_, jax.lax.div(h_, g), kvb(b_, qi, ki, r), 0)
    row_map = lambda b_, h_, qi, ki, *r: (b_, h_, 0, qi)
    qrow = lambda b_, h_, qi, ki, *r: (b_, 0, qi)
    krow = lambda b_, h_, qi, ki, *r: (b_, 0, kvb(b_, qi, ki, r))
    in_specs = [pl.BlockSpec((None, None, bq, d), q_map), pl.BlockSpec((None, None, bk, d), kv_map),
                pl.BlockSpec((None, None, bk, e), kv_map), pl.BlockSpec((None, None, bq, e), q_map),
                pl.BlockSpec((None, None, 1, bq), row_map), pl.BlockSpec((None, None, 1, bq), row_map),
                pl.BlockSpec((None, 1, bq), qrow), pl.BlockSpec((None, 1, bk), krow)]
    if has_pos:
        in_specs += [pl.BlockSpec((None, 1, bq), qrow), pl.BlockSpec((None, 1, bk), krow)]
    operands = (*(() if sched is None else sched.arrays), *args)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=sm_scale, causal=causal, bq=bq, bk=bk, nk=nk, sched=sched,
                          has_pos=has_pos),
        grid_spec=_grid_spec(sched, (b, h, nq, nk), in_specs, pl.BlockSpec((None, None, bq, d), q_map),
                             [pltpu.VMEM((bq, d), jnp.float32)]),
        out_shape=out_struct((b, h, lqp, d), q_BHLD.dtype, *operands),
        compiler_params=cp(("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=cost("dq"),
        interpret=interpret,
    )(*operands)
    return dq[:, :, :lq], dk[:, :, :lk], dv[:, :, :lk]
