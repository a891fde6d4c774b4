"""Cost estimates handed to XLA with each Mosaic kernel (pl.CostEstimate).

XLA's cost analysis counts nothing for a custom call without one, so a program's FLOPs, bytes and
`optimal_seconds` would leave the kernels out, and the scheduler would see them as free. The
figures are the kernels' matmul work (what the MXU executes, recomputation included: the flash
backward recomputes the scores) and each operand read or written once (a lower bound on HBM
traffic: blocks re-fetched across the grid are not counted), the accounting MaxText's megablox
uses, so the two sides of a comparison count alike.

Causal attention counts the pairs a causal mask keeps: L(L+1)/2 per row block by index; by
positions (context parallelism: local queries against all-gathered keys) half of Lq x Lk, which
is exact for the load-balanced zigzag layout on average over devices. Segment masks (packing) are
data: not counted. Decode kernels count the whole cache (rows' lengths are data).
"""
# Dim letters: B batch, H q heads, Hk kv heads, L query length, S key length, D q/k head dim,
# E v head dim; M rows, K contraction, N output, G groups.
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl


def _size(shape, dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * jnp.dtype(dtype).itemsize


def attention_pairs(b: int, h: int, lq: int, lk: int, *, causal: bool, by_position: bool) -> int:
    """(query, key) pairs a kernel computes over B x H heads: all of them, or the causal ones."""
    if not causal:
        per_head = lq * lk
    elif by_position:
        per_head = lq * lk // 2
    else:
        per_head = lq * (lq + 1) // 2
    return b * h * per_head


def flash_cost(kind: str, b: int, h: int, kh: int, lq: int, lk: int, d: int, e: int, *, causal: bool,
               by_position: bool, dtype) -> pl.CostEstimate:
    """Estimate for one flash-attention kernel: kind "fwd" (scores, softmax, P V), "dkv" (scores
    again, dV, dP, dK) or "dq" (scores again, dP, dQ); dtype is q's."""
    p = attention_pairs(b, h, lq, lk, causal=causal, by_position=by_position)
    q, o = _size((b, h, lq, d), dtype), _size((b, h, lq, e), dtype)
    k, v = _size((b, kh, lk, d), dtype), _size((b, kh, lk, e), dtype)
    rows = _size((b, h, lq), jnp.float32)    # lse, and delta in the backward
    if kind == "fwd":
        return pl.CostEstimate(flops=2 * p * (d + e), transcendentals=p, bytes_accessed=q + k + v + o + rows)
    if kind == "dkv":   # reads q, k, v, dO, lse, delta; writes dK, dV
        return pl.CostEstimate(flops=4 * p * (d + e), transcendentals=p,
                               bytes_accessed=q + 2 * k + 2 * v + o + 2 * rows)
    if kind == "dq":    # reads q, k, v, dO, lse, delta; writes dQ
        return pl.CostEstimate(flops=p * (4 * d + 2 * e), transcendentals=p,
                               bytes_accessed=2 * q + k + v + o + 2 * rows)
    raise ValueError(f"kind must be 'fwd', 'dkv' or 'dq', got {kind!r}")


def gmm_cost(m: int, k: int, n: int, g: int, lhs_dtype, rhs_dtype, out_dtype) -> pl.CostEstimate:
    """Grouped matmul [M, K] x G x [K, N] -> [M, N]: each row through one group's weights."""
    return pl.CostEstimate(flops=2 * m * k * n, transcendentals=0,
                           bytes_accessed=_size((m, k), lhs_dtype) + _size((g, k, n), rhs_dtype)
                           + _size((m, n), out_dtype))


def tgmm_cost(m: int, k: int, n: int, g: int, lhs_dtype, dy_dtype, out_dtype) -> pl.CostEstimate:
    """Per-group weight gradient [M, K]^T x [M, N] -> [G, K, N]."""
    return pl.CostEstimate(flops=2 * m * k * n, transcendentals=0,
                           bytes_accessed=_size((m, k), lhs_dtype) + _size((m, n), dy_dtype)
                           + _size((g, k, n), out_dtype))


def decode_cost(b: int, h: int, kh: int, s: int, d: int, e: int, dtype, cache_dtype) -> pl.CostEstimate:
    """GQA decode: one query per head against a cache of S positions (the whole cache: rows'
    lengths are data, so blocks the kernel skips past a row's length are counted)."""
    p = b * h * s
    return pl.CostEstimate(flops=2 * p * (d + e), transcendentals=p,
                           bytes_accessed=_size((b, kh, s, d + e), cache_dtype) + _size((b, h, d + e), dtype))


def mla_decode_cost(b: int, h: int, s: int, c: int, r: int, dtype, cache_dtype) -> pl.CostEstimate:
    """MLA decode in the latent space: scores over latent + rope parts, then the latents as values."""
    p = b * h * s
    return pl.CostEstimate(flops=2 * p * (2 * c + r), transcendentals=p,
                           bytes_accessed=_size((b, s, c + r), cache_dtype) + _size((b, h, 2 * c + r), dtype))
