"""Pallas TPU (Mosaic) kernels for grouped matmul (gmm) and its weight gradient (tgmm)."""
# Dim letters: M rows, K contraction, N output, G groups, V visits; tm/tk/tn tile sizes.
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import (
    expand_cols_t,
    expand_rows,
    out_struct,
    pad_axis,
    pick_tile,
    quantized_tiles,
    round_up,
    varying_zeros,
)
from pallas_kernels.cost import gmm_cost, gmm_traffic, gmm_visits, roofline_seconds, tgmm_cost, tgmm_traffic
from pallas_kernels.gmm.metadata import make_visits

DEFAULT_TILING = (256, 512, 1024)  # (tm, tk, tn) of the quantized kernels; gmm / tgmm choose per shape
VMEM_LIMIT_BYTES = 48 * 1024 * 1024
# choose_tiling: blocks of one grid step within this much VMEM (double-buffered in/out plus the f32
# accumulator; the rest of VMEM_LIMIT_BYTES is Mosaic's), timed by v5p's roofline as XLA states it
# (pallas_kernels.cost.roofline_seconds) plus a fixed cost per grid step
TILE_VMEM_BUDGET = 24 * 1024 * 1024
GRID_STEP_S = 0.35e-6
_TM_CHOICES = (128, 256, 512, 1024)
_KN_CHOICES = (128, 256, 512, 1024, 2048, 4096, 8192)


def _tiles(m, k, n, tiling):
    tm, tk, tn = tiling
    tm = min(tm, round_up(m, 8))
    tk = pick_tile(k, tk, 128)
    tn = pick_tile(n, tn, 128)
    return tm, tk, tn


def gmm_vmem_bytes(tiling, lhs_dtype, rhs_dtype, out_dtype) -> int:
    """VMEM footprint of one gmm grid step: double-buffered in/out blocks plus the f32 accumulator."""
    tm, tk, tn = tiling
    isz = lambda d: jnp.dtype(d).itemsize
    return 2 * (tm * tk * isz(lhs_dtype) + tk * tn * isz(rhs_dtype) + tm * tn * isz(out_dtype)) + tm * tn * 4


def tgmm_vmem_bytes(tiling, lhs_dtype, dy_dtype, out_dtype) -> int:
    """VMEM footprint of one tgmm grid step: double-buffered lhs / dy / out blocks plus the f32 accumulator."""
    tm, tk, tn = tiling
    isz = lambda d: jnp.dtype(d).itemsize
    return 2 * (tm * tk * isz(lhs_dtype) + tm * tn * isz(dy_dtype) + tk * tn * isz(out_dtype)) + tk * tn * 4


def _grid_steps(m, k, n, g, tiling) -> int:
    tm, tk, tn = tiling
    return gmm_visits(m, g, tm) * -(-k // tk) * -(-n // tn)


def tiling_seconds(kind: str, m, k, n, g, tiling, lhs_dtype, rhs_dtype, out_dtype) -> float:
    """Modelled time of one gmm / tgmm call at `tiling` (already clamped): the roofline of the
    whole-tile MXU work and the HBM traffic of pallas_kernels/cost.py, plus the grid steps."""
    traffic = gmm_traffic if kind == "gmm" else tgmm_traffic
    t = traffic(m, k, n, g, tiling, lhs_dtype, rhs_dtype, out_dtype)
    return roofline_seconds(t["flops"], t["bytes"]) + _grid_steps(m, k, n, g, tiling) * GRID_STEP_S


@functools.lru_cache(maxsize=None)
def choose_tiling(kind: str, m: int, k: int, n: int, g: int, lhs_dtype, rhs_dtype, out_dtype) -> tuple:
    """The (tm, tk, tn) of a gmm ("gmm": [M, K] x G x [K, N]) or tgmm ("tgmm": [M, K]^T x [M, N]
    -> [G, K, N]) call of these shapes with the least tiling_seconds whose blocks fit
    TILE_VMEM_BUDGET; ties go to fewer grid steps. Small tm pays fewer straddled rows (G groups
    in M rows), whole K / N avoid re-reading the other operand."""
    vmem = gmm_vmem_bytes if kind == "gmm" else tgmm_vmem_bytes
    seen, best = set(), None
    for pref in ((tm, tk, tn) for tm in _TM_CHOICES for tk in _KN_CHOICES + (k,) for tn in _KN_CHOICES + (n,)):
        tiles = _tiles(m, k, n, pref)
        if tiles in seen:
            continue
        seen.add(tiles)
        if vmem(tiles, lhs_dtype, rhs_dtype, out_dtype) > TILE_VMEM_BUDGET:
            continue
        key = (tiling_seconds(kind, m, k, n, g, tiles, lhs_dtype, rhs_dtype, out_dtype),
               _grid_steps(m, k, n, g, tiles), -tiles[0])
        if best is None or key < best[0]:
            best = (key, tiles)
    if best is None:
        raise ValueError(f"no {kind} tiling of (m, k, n, g) = {(m, k, n, g)} fits {TILE_VMEM_BUDGET} bytes of VMEM")
    return best[1]


def _store_group_rows(out_ref, acc_ref, row0, start, end, first):
    """Write the accumulator's rows of group [start, end) into the output tile; other rows keep
    what an earlier visit of the same row tile wrote (zeros on a tile's first visit)."""
    rows = row0 + jax.lax.broadcasted_iota(jnp.int32, acc_ref.shape, 0)
    mask = (rows >= start) & (rows < end)
    prev = jnp.where(first == 1, 0.0, out_ref[...].astype(jnp.float32))
    out_ref[...] = jnp.where(mask, acc_ref[...], prev).astype(out_ref.dtype)


def _group_run_bounds(gid_ref, v, nv, num_groups):
    """(first, last) visit of a run of consecutive visits to one group (tgmm: the [K, N] output
    block of that group is accumulated over the run and written at its end)."""
    gc = jnp.minimum(gid_ref[v], num_groups - 1)
    g_prev = jnp.minimum(gid_ref[jnp.maximum(v - 1, 0)], num_groups - 1)
    g_next = jnp.minimum(gid_ref[jnp.minimum(v + 1, nv - 1)], num_groups - 1)
    return (v == 0) | (gc != g_prev), (v == nv - 1) | (gc != g_next)


def _gmm_kernel(gid_ref, mt_ref, first_ref, st_ref, en_ref, lhs_ref, rhs_ref, out_ref, acc_ref,
                *, tm, nk, transpose_rhs):
    v = pl.program_id(1)
    k = pl.program_id(2)
    g = gid_ref[v]

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(st_ref[g] < en_ref[g])
    def _():
        dims = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))
        acc_ref[...] += jax.lax.dot_general(lhs_ref[...], rhs_ref[...], dims,
                                            preferred_element_type=jnp.float32)

    @pl.when(k == nk - 1)
    def _():
        _store_group_rows(out_ref, acc_ref, mt_ref[v] * tm, st_ref[g], en_ref[g], first_ref[v])


def gmm_tpu(lhs_MK, rhs_GKN, group_sizes_G, *, preferred_element_type=jnp.float32,
            transpose_rhs=False, tiling=None, interpret=False):
    """Grouped matmul out[m] = lhs[m] @ rhs[group(m)] (rhs given as [G,N,K] when transpose_rhs);
    tiling None: choose_tiling's for these shapes."""
    m, k = lhs_MK.shape
    g = rhs_GKN.shape[0]
    n = rhs_GKN.shape[1] if transpose_rhs else rhs_GKN.shape[2]
    tiling = tiling or choose_tiling("gmm", m, k, n, g, jnp.dtype(lhs_MK.dtype), jnp.dtype(rhs_GKN.dtype),
                                     jnp.dtype(preferred_element_type))
    tm, tk, tn = _tiles(m, k, n, tiling)
    m_pad, k_pad, n_pad = round_up(m, tm), round_up(k, tk), round_up(n, tn)
    lhs = pad_axis(pad_axis(lhs_MK, 0, m_pad), 1, k_pad)
    if transpose_rhs:
        rhs = pad_axis(pad_axis(rhs_GKN, 1, n_pad), 2, k_pad)
        rhs_spec = pl.BlockSpec((None, tn, tk), lambda n_, v, k_, gid, *_: (jnp.minimum(gid[v], g - 1), n_, k_))
    else:
        rhs = pad_axis(pad_axis(rhs_GKN, 1, k_pad), 2, n_pad)
        rhs_spec = pl.BlockSpec((None, tk, tn), lambda n_, v, k_, gid, *_: (jnp.minimum(gid[v], g - 1), k_, n_))
    vis = make_visits(group_sizes_G, m, m_pad, tm)
    nv = vis.gid_V.shape[0]
    nk = k_pad // tk
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(n_pad // tn, nv, nk),
        in_specs=[pl.BlockSpec((tm, tk), lambda n_, v, k_, gid, mt, *_: (mt[v], k_)), rhs_spec],
        out_specs=pl.BlockSpec((tm, tn), lambda n_, v, k_, gid, mt, *_: (mt[v], n_)),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
    )
    out = pl.pallas_call(
        functools.partial(_gmm_kernel, tm=tm, nk=nk, transpose_rhs=transpose_rhs),
        grid_spec=grid_spec,
        out_shape=out_struct((m_pad, n_pad), preferred_element_type, lhs, rhs, vis),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=VMEM_LIMIT_BYTES),
        cost_estimate=gmm_cost(m, k, n, g, lhs_MK.dtype, rhs_GKN.dtype, preferred_element_type, tiling=(tm, tk, tn)),
        interpret=interpret,
    )(vis.gid_V, vis.mtile_V, vis.first_V, vis.starts_G1, vis.ends_G1, lhs, rhs)
    return out[:m, :n]


def _tgmm_kernel(gid_ref, mt_ref, first_ref, st_ref, en_ref, lhs_ref, dy_ref, zeros_ref, out_ref, acc_ref,
                 *, tm, num_groups):
    del zeros_ref  # aliased to out: groups no visit touches (empty groups) keep its zeros
    v = pl.program_id(2)
    g = gid_ref[v]
    first_of_group, last_of_group = _group_run_bounds(gid_ref, v, pl.num_programs(2), num_groups)

    @pl.when(first_of_group)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(st_ref[g] < en_ref[g])
    def _():
        row0 = mt_ref[v] * tm
        rx = row0 + jax.lax.broadcasted_iota(jnp.int32, lhs_ref.shape, 0)
        ry = row0 + jax.lax.broadcasted_iota(jnp.int32, dy_ref.shape, 0)
        x = jnp.where((rx >= st_ref[g]) & (rx < en_ref[g]), lhs_ref[...], 0).astype(lhs_ref.dtype)
        d = jnp.where((ry >= st_ref[g]) & (ry < en_ref[g]), dy_ref[...], 0).astype(dy_ref.dtype)
        acc_ref[...] += jax.lax.dot_general(x, d, (((0,), (0,)), ((), ())),
                                            preferred_element_type=jnp.float32)

    @pl.when(last_of_group)
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def tgmm_tpu(lhs_MK, dy_MN, group_sizes_G, *, preferred_element_type=jnp.float32,
             tiling=None, interpret=False):
    """Weight gradient out[g] = lhs[rows of g]^T @ dy[rows of g] -> [G,K,N]; tiling None:
    choose_tiling's for these shapes."""
    m, k = lhs_MK.shape
    n = dy_MN.shape[1]
    g = group_sizes_G.shape[0]
    tiling = tiling or choose_tiling("tgmm", m, k, n, g, jnp.dtype(lhs_MK.dtype), jnp.dtype(dy_MN.dtype),
                                     jnp.dtype(preferred_element_type))
    tm, tk, tn = _tiles(m, k, n, tiling)
    m_pad, k_pad, n_pad = round_up(m, tm), round_up(k, tk), round_up(n, tn)
    lhs = pad_axis(pad_axis(lhs_MK, 0, m_pad), 1, k_pad)
    dy = pad_axis(pad_axis(dy_MN, 0, m_pad), 1, n_pad)
    vis = make_visits(group_sizes_G, m, m_pad, tm)
    nv = vis.gid_V.shape[0]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(k_pad // tk, n_pad // tn, nv),
        in_specs=[pl.BlockSpec((tm, tk), lambda k_, n_, v, gid, mt, *_: (mt[v], k_)),
                  pl.BlockSpec((tm, tn), lambda k_, n_, v, gid, mt, *_: (mt[v], n_)),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((None, tk, tn),
                               lambda k_, n_, v, gid, *_: (jnp.minimum(gid[v], g - 1), k_, n_)),
        scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)],
    )
    out = pl.pallas_call(
        functools.partial(_tgmm_kernel, tm=tm, num_groups=g),
        grid_spec=grid_spec,
        out_shape=out_struct((g, k_pad, n_pad), preferred_element_type, lhs, dy, vis),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=VMEM_LIMIT_BYTES),
        cost_estimate=tgmm_cost(m, k, n, g, lhs_MK.dtype, dy_MN.dtype, preferred_element_type, tiling=(tm, tk, tn)),
        input_output_aliases={7: 0},
        interpret=interpret,
    )(vis.gid_V, vis.mtile_V, vis.first_V, vis.starts_G1, vis.ends_G1, lhs, dy,
      varying_zeros((g, k_pad, n_pad), preferred_element_type, lhs, dy, vis))  # aliased: typed as the output
    return out[:, :k, :n]


def _qgmm_kernel(gid_ref, mt_ref, first_ref, st_ref, en_ref, lhs_ref, ls_ref, rhs_ref, rs_ref, out_ref,
                 acc_ref, *, tm, nk, blk, code_scale):
    v = pl.program_id(1)
    k = pl.program_id(2)
    g = gid_ref[v]

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(st_ref[g] < en_ref[g])
    def _():
        x = lhs_ref[...].astype(jnp.float32)
        w = rhs_ref[...].astype(jnp.float32)
        if blk > 1:  # dequantize in VMEM: values x block scales, exact in bf16
            x = x * (expand_cols_t(ls_ref[...], blk) * code_scale)
            w = w * (expand_rows(rs_ref[...], blk) * code_scale)
        acc_ref[...] += jnp.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                                preferred_element_type=jnp.float32)

    @pl.when(k == nk - 1)
    def _():
        _store_group_rows(out_ref, acc_ref, mt_ref[v] * tm, st_ref[g], en_ref[g], first_ref[v])


def gmm_quantized_tpu(lhs_vals_MK, lhs_scales_KBM, rhs_vals_GKN, rhs_scales_GKBN, group_sizes_G, *, blk,
                      code_scale=1.0, preferred_element_type=jnp.float32, tiling=DEFAULT_TILING,
                      interpret=False):
    """gmm on 1-byte quantized operands (int8, E4M3, or E2M1 as int8 codes) dequantized in VMEM.

    lhs_scales_KBM: block scales of lhs along K, transposed ([K/blk, M]); rhs_scales_GKBN: [G, K/blk, N].
    Both None (blk=1) for int8. Per-token / per-channel FP32 scales are applied by the caller.
    """
    m, k = lhs_vals_MK.shape
    g, _, n = rhs_vals_GKN.shape
    tm, tk, tn = quantized_tiles(m, k, n, tiling, blk)
    m_pad, k_pad, n_pad = round_up(m, tm), round_up(k, tk), round_up(n, tn)
    kb = max(blk, 1)
    lhs = pad_axis(pad_axis(lhs_vals_MK, 0, m_pad), 1, k_pad)
    rhs = pad_axis(pad_axis(rhs_vals_GKN, 1, k_pad), 2, n_pad)
    if blk > 1:
        # E4M3 scales go in as they are (Mosaic loads fp8); E8M0 is widened to bf16 (exact).
        sdt = lambda x: x if x.dtype == jnp.float8_e4m3fn else x.astype(jnp.bfloat16)
        ls = pad_axis(pad_axis(sdt(lhs_scales_KBM), 0, k_pad // kb), 1, m_pad)
        rs = pad_axis(pad_axis(sdt(rhs_scales_GKBN), 1, k_pad // kb), 2, n_pad)
        ls_spec = pl.BlockSpec((tk // kb, tm), lambda n_, v, k_, gid, mt, *_: (k_, mt[v]))
        rs_spec = pl.BlockSpec((None, tk // kb, tn),
                               lambda n_, v, k_, gid, *_: (jnp.minimum(gid[v], g - 1), k_, n_))
    else:  # int8: no block scales; pass tiny dummies
        ls = jnp.zeros((8, 128), jnp.bfloat16)
        rs = jnp.zeros((8, 128), jnp.bfloat16)
        ls_spec = pl.BlockSpec((8, 128), lambda *_: (0, 0))
        rs_spec = pl.BlockSpec((8, 128), lambda *_: (0, 0))
    vis = make_visits(group_sizes_G, m, m_pad, tm)
    nk = k_pad // tk
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(n_pad // tn, vis.gid_V.shape[0], nk),
        in_specs=[pl.BlockSpec((tm, tk), lambda n_, v, k_, gid, mt, *_: (mt[v], k_)), ls_spec,
                  pl.BlockSpec((None, tk, tn), lambda n_, v, k_, gid, *_: (jnp.minimum(gid[v], g - 1), k_, n_)),
                  rs_spec],
        out_specs=pl.BlockSpec((tm, tn), lambda n_, v, k_, gid, mt, *_: (mt[v], n_)),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
    )
    out = pl.pallas_call(
        functools.partial(_qgmm_kernel, tm=tm, nk=nk, blk=blk, code_scale=code_scale),
        grid_spec=grid_spec,
        out_shape=out_struct((m_pad, n_pad), preferred_element_type, lhs, ls, rhs, rs, vis),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=VMEM_LIMIT_BYTES),
        cost_estimate=gmm_cost(m, k, n, g, lhs_vals_MK.dtype, rhs_vals_GKN.dtype, preferred_element_type,
                               tiling=(tm, tk, tn)),
        interpret=interpret,
    )(vis.gid_V, vis.mtile_V, vis.first_V, vis.starts_G1, vis.ends_G1, lhs, ls, rhs, rs)
    return out[:m, :n]


def _qtgmm_kernel(gid_ref, mt_ref, first_ref, st_ref, en_ref, lhs_ref, ls_ref, dy_ref, ds_ref, zeros_ref,
                  out_ref, acc_ref, *, tm, num_groups, blk):
    del zeros_ref  # aliased to out: empty groups keep its zeros
    v = pl.program_id(2)
    g = gid_ref[v]
    first_of_group, last_of_group = _group_run_bounds(gid_ref, v, pl.num_programs(2), num_groups)

    @pl.when(first_of_group)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(st_ref[g] < en_ref[g])
    def _():
        row0 = mt_ref[v] * tm
        x = lhs_ref[...].astype(jnp.float32) * expand_rows(ls_ref[...], blk)
        d = dy_ref[...].astype(jnp.float32) * expand_rows(ds_ref[...], blk)
        rx = row0 + jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
        ry = row0 + jax.lax.broadcasted_iota(jnp.int32, d.shape, 0)
        x = jnp.where((rx >= st_ref[g]) & (rx < en_ref[g]), x, 0.0).astype(jnp.bfloat16)
        d = jnp.where((ry >= st_ref[g]) & (ry < en_ref[g]), d, 0.0).astype(jnp.bfloat16)
        acc_ref[...] += jax.lax.dot_general(x, d, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    @pl.when(last_of_group)
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def tgmm_mxfp8_tpu(lhs_vals_MK, lhs_scales_MBK, dy_vals_MN, dy_scales_MBN, group_sizes_G, *,
                   preferred_element_type=jnp.float32, tiling=DEFAULT_TILING, interpret=False):
    """Weight gradient from MXFP8 operands quantized along M (the contraction), dequantized in VMEM.

    lhs_scales_MBK: [M/32, K]; dy_scales_MBN: [M/32, N]; M must be a multiple of 32.
    """
    blk = 32
    m, k = lhs_vals_MK.shape
    n = dy_vals_MN.shape[1]
    g = group_sizes_G.shape[0]
    if m % blk:
        raise ValueError(f"lhs_vals_MK: M={m} must be a multiple of {blk}")
    tm, tk, tn = tiling
    tm = max(blk * 8, min(round_up(tm, blk * 8), round_up(m, blk * 8)))  # f32 scale block needs tm/32 % 8 == 0
    tk = pick_tile(k, tk, 128)
    tn = pick_tile(n, tn, 128)
    m_pad, k_pad, n_pad = round_up(m, tm), round_up(k, tk), round_up(n, tn)
    lhs = pad_axis(pad_axis(lhs_vals_MK, 0, m_pad), 1, k_pad)
    dy = pad_axis(pad_axis(dy_vals_MN, 0, m_pad), 1, n_pad)
    ls = pad_axis(pad_axis(lhs_scales_MBK.astype(jnp.float32), 0, m_pad // blk), 1, k_pad)
    ds = pad_axis(pad_axis(dy_scales_MBN.astype(jnp.float32), 0, m_pad // blk), 1, n_pad)
    vis = make_visits(group_sizes_G, m, m_pad, tm)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(k_pad // tk, n_pad // tn, vis.gid_V.shape[0]),
        in_specs=[pl.BlockSpec((tm, tk), lambda k_, n_, v, gid, mt, *_: (mt[v], k_)),
                  pl.BlockSpec((tm // blk, tk), lambda k_, n_, v, gid, mt, *_: (mt[v], k_)),
                  pl.BlockSpec((tm, tn), lambda k_, n_, v, gid, mt, *_: (mt[v], n_)),
                  pl.BlockSpec((tm // blk, tn), lambda k_, n_, v, gid, mt, *_: (mt[v], n_)),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((None, tk, tn),
                               lambda k_, n_, v, gid, *_: (jnp.minimum(gid[v], g - 1), k_, n_)),
        scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)],
    )
    out = pl.pallas_call(
        functools.partial(_qtgmm_kernel, tm=tm, num_groups=g, blk=blk),
        grid_spec=grid_spec,
        out_shape=out_struct((g, k_pad, n_pad), preferred_element_type, lhs, ls, dy, ds, vis),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=VMEM_LIMIT_BYTES),
        cost_estimate=tgmm_cost(m, k, n, g, lhs_vals_MK.dtype, dy_vals_MN.dtype, preferred_element_type,
                                tiling=(tm, tk, tn)),
        input_output_aliases={9: 0},
        interpret=interpret,
    )(vis.gid_V, vis.mtile_V, vis.first_V, vis.starts_G1, vis.ends_G1, lhs, ls, dy, ds,
      varying_zeros((g, k_pad, n_pad), preferred_element_type, lhs, ls, dy, ds, vis))
    return out[:, :k, :n]
