"""Cost estimates handed to XLA with each Mosaic kernel (pl.CostEstimate), and the one analytic
model of a Mosaic call's work and HBM traffic that experiments/bench/tpu_aot.py applies to every
kernel call of both sides of its comparison (c2jax's kernels and MaxText's megablox / splash).

XLA's cost analysis counts nothing for a custom call without an estimate, and counts exactly the
estimate it is handed for one with it (its roofline: max(flops / rate, bytes / bandwidth)), so a
program's FLOPs, bytes and `optimal_seconds` carry each kernel's work only as its author states it.
The figures here:

- FLOPs: the kernel's matmul work (what the MXU executes for the rows / pairs it computes: the
  flash backward recomputes the scores). Grouped matmuls: every row-tile visit multiplies whole
  tiles, so a tile that straddles groups is computed once per group in it (tiles_m + G - 1 visits
  of tm rows over the padded K and N; the rows outside the group are masked at the store);
  causal attention at the (query, key) pairs the mask keeps: L(L+1)/2 per row by index, by
  positions (context parallelism: local queries against all-gathered keys) half of Lq x Lk, exact
  for the load-balanced zigzag layout on average over devices.
- HBM bytes: by the kernel's tiling, counting a block each time the pipeline fetches it (Pallas
  re-fetches an input block whenever its block index changes between consecutive grid steps):
    grouped matmul [M, K] x G x [K, N] (grid: n-tiles, row-tile visits, k-tiles):
        lhs once per n-tile; rhs once when K is one tile (a group's block stays put across its
        visits), else its [K, N] block once per visit (tiles_m + G - 1 visits); out once.
        (megablox's gmm states lhs x tiles_n + K x N x visits + out.)
    transposed grouped matmul [M, K]^T x [M, N] -> [G, K, N]: lhs once per n-tile, dy once per
        k-tile, out once (megablox's tgmm states the same).
    flash attention: q, o (and lse / delta rows) once, k / v re-read once per query block over the
        key blocks the causal mask keeps (per query head: GQA re-reads a kv head per q head) in the
        forward and dQ kernels; in the dK / dV kernel k, v, dk, dv once and q, dO, lse, delta
        re-read once per key block over the query blocks it keeps.
  Segment masks (packing) are data: not counted. Decode kernels count the whole cache (rows'
  lengths are data).
"""
# Dim letters: B batch, H q heads, Hk kv heads, L query length, S key length, D q/k head dim,
# E v head dim; M rows, K contraction, N output, G groups; tm/tk/tn and bq/bk tile sizes.
from __future__ import annotations

import math


# HLO / MLIR element type names (as the compiled program prints them) -> bytes
_HLO_ITEMSIZE = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "s8": 1, "u8": 1, "i8": 1, "s16": 2, "i16": 2, "s32": 4,
                 "i32": 4, "u32": 4, "s64": 8, "i64": 8, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}


def _itemsize(dtype) -> int:
    if isinstance(dtype, int):
        return dtype
    if isinstance(dtype, str) and dtype in _HLO_ITEMSIZE:
        return _HLO_ITEMSIZE[dtype]
    import numpy as np
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        import jax.numpy as jnp
        return jnp.dtype(dtype).itemsize


def _size(shape, dtype) -> int:
    return math.prod(int(s) for s in shape) * _itemsize(dtype)


# How XLA's cost analysis times a Mosaic call on a chip: max(flops / flops_per_s, bytes / bytes_per_s),
# with these rates (written by `experiments/bench/tpu_aot.py --xla-roofline v5p:2x2x1`: one Pallas
# call's optimal_seconds against the estimate it carries; experiments/results/tpu_aot/xla_roofline_v5p.json)
XLA_ROOFLINE = {"v5p": {"flops_per_s": 394e12, "bytes_per_s": 2.3504e12}}


def roofline_seconds(flops: float, nbytes: float, chip: str = "v5p") -> float:
    """XLA's time for a call of this work on `chip` (XLA_ROOFLINE; v5p's rates for other chips)."""
    r = XLA_ROOFLINE.get(chip, XLA_ROOFLINE["v5p"])
    return max(flops / r["flops_per_s"], nbytes / r["bytes_per_s"])


def _estimate(flops, transcendentals, bytes_accessed):
    from jax.experimental import pallas as pl
    return pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals), bytes_accessed=int(bytes_accessed))


def attention_pairs(b: int, h: int, lq: int, lk: int, *, causal: bool, by_position: bool) -> int:
    """(query, key) pairs a kernel computes over B x H heads: all of them, or the causal ones."""
    if not causal:
        per_head = lq * lk
    elif by_position:
        per_head = lq * lk // 2
    else:
        per_head = lq * (lq + 1) // 2
    return b * h * per_head


def attention_block_visits(lq: int, lk: int, bq: int, bk: int, *, causal: bool, by_position: bool) -> int:
    """(query block, key block) pairs a flash kernel visits per head: all nq x nk, or the causal
    ones (by index: key blocks up to the one holding a query block's last row; by positions: half,
    the zigzag layout's average)."""
    nq, nk = -(-lq // bq), -(-lk // bk)
    if not causal:
        return nq * nk
    if by_position:
        return -(-nq * nk // 2)
    return sum(min(nk, (min((i + 1) * bq, lq) - 1) // bk + 1) for i in range(nq))


def flash_traffic(kind: str, b: int, h: int, kh: int, lq: int, lk: int, d: int, e: int, *, causal: bool,
                  by_position: bool, bq: int, bk: int, dtype, fused_dq: bool = False) -> dict:
    """{flops, transcendentals, bytes} of one flash-attention kernel: kind "fwd" (scores, softmax,
    P V), "dkv" (scores again, dV, dP, dK; with fused_dq also dQ, as splash's fused backward) or
    "dq" (scores again, dP, dQ); dtype is q's; bq / bk the kernel's query / key block sizes."""
    isz = _itemsize(dtype)
    p = attention_pairs(b, h, lq, lk, causal=causal, by_position=by_position)
    v_ = attention_block_visits(lq, lk, bq, bk, causal=causal, by_position=by_position)
    q, o = b * h * lq * d * isz, b * h * lq * e * isz
    k, v = b * kh * lk * d * isz, b * kh * lk * e * isz
    rows = b * h * lq * 4                       # lse (and delta in the backward), f32
    kv_reread = b * h * v_ * min(bk, lk) * (d + e) * isz          # per q head, each visited key block
    q_reread = b * h * v_ * min(bq, lq) * ((d + e) * isz + 8)     # q, dO blocks and their lse / delta rows
    if kind == "fwd":
        return {"flops": 2 * p * (d + e), "transcendentals": p, "bytes": q + o + rows + kv_reread}
    if kind == "dkv":
        flops = 4 * p * (d + e) + (2 * p * d if fused_dq else 0)
        return {"flops": flops, "transcendentals": p,
                "bytes": 2 * (k + v) + q_reread + (q if fused_dq else 0)}
    if kind == "dq":
        return {"flops": p * (4 * d + 2 * e), "transcendentals": p, "bytes": 2 * q + o + 2 * rows + kv_reread}
    raise ValueError(f"kind must be 'fwd', 'dkv' or 'dq', got {kind!r}")


def gmm_visits(m: int, g: int, tm: int) -> int:
    """Row-tile visits of a grouped matmul's grid: every row tile once, plus one per group boundary
    inside a tile (the static bound tiles_m + G - 1, which balanced routing reaches)."""
    return -(-m // tm) + g - 1


def gmm_traffic(m: int, k: int, n: int, g: int, tiling, lhs_dtype, rhs_dtype, out_dtype) -> dict:
    """{flops, transcendentals, bytes} of a grouped matmul [M, K] x G x [K, N] -> [M, N]
    with tiles (tm, tk, tn) (the kernel's, after clamping to the operand)."""
    tm, tk, tn = tiling
    tiles_k, tiles_n = -(-k // tk), -(-n // tn)
    visits = gmm_visits(m, g, tm)
    rhs_reads = g if tiles_k == 1 else visits
    return {"flops": 2 * visits * tm * tiles_k * tk * tiles_n * tn, "transcendentals": 0,
            "bytes": _size((m, k), lhs_dtype) * tiles_n + rhs_reads * _size((k, n), rhs_dtype)
            + _size((m, n), out_dtype)}


def tgmm_traffic(m: int, k: int, n: int, g: int, tiling, lhs_dtype, dy_dtype, out_dtype) -> dict:
    """{flops, transcendentals, bytes} of the per-group weight gradient
    [M, K]^T x [M, N] -> [G, K, N] (each visit multiplies whole [tm, tk]^T x [tm, tn] tiles)."""
    tm, tk, tn = tiling
    tiles_k, tiles_n = -(-k // tk), -(-n // tn)
    visits = gmm_visits(m, g, tm)
    return {"flops": 2 * visits * tm * tiles_k * tk * tiles_n * tn, "transcendentals": 0,
            "bytes": _size((m, k), lhs_dtype) * tiles_n + _size((m, n), dy_dtype) * tiles_k
            + _size((g, k, n), out_dtype)}


def flash_cost(kind: str, b: int, h: int, kh: int, lq: int, lk: int, d: int, e: int, *, causal: bool,
               by_position: bool, dtype, bq: int, bk: int):
    """pl.CostEstimate of one flash-attention kernel (flash_traffic)."""
    t = flash_traffic(kind, b, h, kh, lq, lk, d, e, causal=causal, by_position=by_position, bq=bq, bk=bk,
                      dtype=dtype)
    return _estimate(t["flops"], t["transcendentals"], t["bytes"])


def gmm_cost(m: int, k: int, n: int, g: int, lhs_dtype, rhs_dtype, out_dtype, *, tiling):
    """pl.CostEstimate of a grouped matmul (gmm_traffic; g = 1 is a plain tiled matmul)."""
    t = gmm_traffic(m, k, n, g, tiling, lhs_dtype, rhs_dtype, out_dtype)
    return _estimate(t["flops"], 0, t["bytes"])


def tgmm_cost(m: int, k: int, n: int, g: int, lhs_dtype, dy_dtype, out_dtype, *, tiling):
    """pl.CostEstimate of a per-group weight gradient (tgmm_traffic)."""
    t = tgmm_traffic(m, k, n, g, tiling, lhs_dtype, dy_dtype, out_dtype)
    return _estimate(t["flops"], 0, t["bytes"])


def decode_cost(b: int, h: int, kh: int, s: int, d: int, e: int, dtype, cache_dtype):
    """GQA decode: one query per head against a cache of S positions (the whole cache: rows'
    lengths are data, so blocks the kernel skips past a row's length are counted)."""
    p = b * h * s
    return _estimate(2 * p * (d + e), p, _size((b, kh, s, d + e), cache_dtype) + _size((b, h, d + e), dtype))


def mla_decode_cost(b: int, h: int, s: int, c: int, r: int, dtype, cache_dtype):
    """MLA decode in the latent space: scores over latent + rope parts, then the latents as values."""
    p = b * h * s
    return _estimate(2 * p * (2 * c + r), p, _size((b, s, c + r), cache_dtype) + _size((b, h, 2 * c + r), dtype))
