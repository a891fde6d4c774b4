"""Pure-jnp quantizers: int8, MXFP8 (E4M3 + E8M0 per 32), NVFP4 per-token and per-tensor.

These are the reference and also the XLA path (XLA fuses them into one elementwise pass);
the quantized matmul / gmm kernels consume their outputs. NaN/Inf policy:
- amax ignores non-finite values; +-Inf saturates to the largest finite code;
- NaN -> NaN in MXFP8 (E4M3 has a NaN code), NaN -> 0 in NVFP4 and int8 (no NaN code).
"""
# Dim letters: ... leading dims, K the blocked (quantized) axis, NB number of blocks (K / block).
from __future__ import annotations

import jax
import jax.numpy as jnp

E4M3_MAX = 448.0
E2M1_MAX = 6.0
INT8_MAX = 127.0
MX_BLOCK = 32
NV_BLOCK = 16
E8M0_MIN_EXP = -126  # E8M0 reaches 2^-127, but that is an f32 subnormal (flushed by XLA)
E8M0_MAX_EXP = 127


def exact_div(a, b):
    """IEEE a / b, elementwise. XLA rewrites a / broadcast(b) into a * broadcast(1 / b), which is
    off by an ulp for ~20-25% of inputs (measured on CPU); the barrier hides the broadcast."""
    b = jnp.broadcast_to(b, jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b))).astype(jnp.float32)
    a, b = jax.lax.optimization_barrier((jnp.asarray(a, jnp.float32), b))
    return a / b


def _finite_abs(x):
    return jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0)


def _to_blocks(x, axis: int, block: int, name: str):
    """Move `axis` last and split it into [NB, block]; returns (blocks, moved_shape)."""
    if x.ndim == 0:
        raise ValueError(f"{name} must have at least one dim")
    axis = axis % x.ndim
    xm = jnp.moveaxis(x, axis, -1)
    k = xm.shape[-1]
    if k % block:
        raise ValueError(f"{name}: size {k} of axis {axis} must be a multiple of the block size {block}")
    return xm.reshape(*xm.shape[:-1], k // block, block), xm.shape, axis


def _from_blocks(xb, moved_shape, axis):
    return jnp.moveaxis(xb.reshape(moved_shape), -1, axis)


def e8m0_scale_for(amax):
    """Power-of-two scale 2^ceil(log2(amax/448)) clamped to [2^-126, 2^127]; all-zero blocks get 1."""
    ratio = exact_div(amax, E4M3_MAX)
    mant, exp = jnp.frexp(ratio)  # ratio = mant * 2^exp, mant in [0.5, 1)
    e = jnp.where(mant == 0.5, exp - 1, exp)
    e = jnp.where(amax > 0, e, 0)
    e = jnp.clip(e, E8M0_MIN_EXP, E8M0_MAX_EXP)
    return jnp.ldexp(jnp.ones_like(ratio), e)


def quantize_mxfp8(x, axis: int = -1):
    """MXFP8: E4M3 values, one E8M0 power-of-two scale per 32 values along `axis`."""
    xb, moved, ax = _to_blocks(jnp.asarray(x).astype(jnp.float32), axis, MX_BLOCK, "x")
    amax = jnp.max(_finite_abs(xb), axis=-1, keepdims=True)
    scale = e8m0_scale_for(amax)
    v = jnp.clip(exact_div(xb, scale), -E4M3_MAX, E4M3_MAX)  # saturating; NaN stays NaN
    values = _from_blocks(v.astype(jnp.float8_e4m3fn), moved, ax)
    scales = jnp.moveaxis(scale[..., 0].astype(jnp.float8_e8m0fnu), -1, ax)
    return values, scales


def dequantize_mxfp8(values, scales, axis: int = -1, dtype=jnp.float32):
    """Inverse of quantize_mxfp8: values * scale broadcast over each 32-block of `axis`."""
    s = jnp.repeat(scales.astype(jnp.float32), MX_BLOCK, axis=axis)
    if s.shape != values.shape:
        raise ValueError(f"scales shape {scales.shape} does not match values shape {values.shape} "
                         f"with blocks of {MX_BLOCK} along axis {axis}")
    return (values.astype(jnp.float32) * s).astype(dtype)


def _nvfp4_core(x, token_amax):
    """Shared NVFP4 math; x is [..., K] f32, token_amax broadcastable to [..., 1]."""
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // NV_BLOCK, NV_BLOCK)
    token_scale = jnp.where(token_amax > 0, exact_div(token_amax, E4M3_MAX * E2M1_MAX), 1.0)
    token_scale = token_scale.astype(jnp.float32)
    bamax = jnp.max(_finite_abs(xb), axis=-1, keepdims=True)
    ts_b = token_scale[..., None]  # [..., 1, 1]
    bs = jnp.clip(exact_div(exact_div(bamax, E2M1_MAX), ts_b), 0.0, E4M3_MAX).astype(jnp.float8_e4m3fn)
    denom = bs.astype(jnp.float32) * ts_b
    # Exact IEEE division (no reciprocal approximation): the report saw RL diverge without it.
    v = jnp.where(denom > 0, exact_div(xb, jnp.where(denom > 0, denom, 1.0)), 0.0)
    v = jnp.where(jnp.isnan(v), 0.0, jnp.clip(v, -E2M1_MAX, E2M1_MAX))
    values = v.astype(jnp.float4_e2m1fn).reshape(x.shape)  # round-to-nearest-even
    return values, bs[..., 0], token_scale


def quantize_nvfp4(x, per_token: bool = True):
    """NVFP4: E2M1 values, E4M3 scale per 16 along the last axis, FP32 scale per row (per_token) or per tensor."""
    x = jnp.asarray(x).astype(jnp.float32)
    if x.ndim == 0 or x.shape[-1] % NV_BLOCK:
        raise ValueError(f"x: last axis size must be a multiple of {NV_BLOCK}, got shape {x.shape}")
    fa = _finite_abs(x)
    if per_token:
        amax = jnp.max(fa, axis=-1, keepdims=True)
    else:
        amax = jnp.max(fa).reshape((1,) * x.ndim)
    values, bs, ts = _nvfp4_core(x, amax)
    ts = ts[..., 0] if per_token else ts.reshape(())
    return values, bs, ts


def dequantize_nvfp4(values, block_scales, token_scale, dtype=jnp.float32):
    """Inverse of quantize_nvfp4: (value * block_scale) * token_scale; the first product is exact."""
    bs = jnp.repeat(block_scales.astype(jnp.float32), NV_BLOCK, axis=-1)
    if bs.shape != values.shape:
        raise ValueError(f"block_scales shape {block_scales.shape} does not match values {values.shape}")
    ts = jnp.asarray(token_scale, jnp.float32)[..., None]
    return ((values.astype(jnp.float32) * bs) * ts).astype(dtype)


def nvfp4_codes(values):
    """E2M1 values as int8 codes (2 * value, exact): Mosaic has no f4 vectors."""
    return (values.astype(jnp.float32) * 2.0).astype(jnp.int8)


def quantize_int8(x, axis=-1):
    """Symmetric int8 with one f32 scale per slice reduced over `axis` (axis=-1: per token; 0: per channel)."""
    x = jnp.asarray(x).astype(jnp.float32)
    amax = jnp.max(_finite_abs(x), axis=axis, keepdims=True)
    scale = jnp.where(amax > 0, exact_div(amax, INT8_MAX), 1.0).astype(jnp.float32)
    q = jnp.clip(jnp.round(exact_div(x, scale)), -INT8_MAX, INT8_MAX)
    q = jnp.where(jnp.isnan(q), 0.0, q).astype(jnp.int8)
    return q, scale


def dequantize_int8(q, scale, dtype=jnp.float32):
    """Inverse of quantize_int8."""
    return (q.astype(jnp.float32) * scale).astype(dtype)


def fake_quant(x, quant: str, axis: int = -1):
    """Quantize-dequantize x (f32 out) with blocks/scales along `axis`; quant in none|int8|mxfp8|nvfp4."""
    if quant == "none":
        return x
    if quant == "mxfp8":
        return dequantize_mxfp8(*quantize_mxfp8(x, axis), axis=axis)
    if quant == "int8":
        return dequantize_int8(*quantize_int8(x, axis))
    if quant == "nvfp4":
        xm = jnp.moveaxis(x, axis, -1)
        return jnp.moveaxis(dequantize_nvfp4(*quantize_nvfp4(xm)), -1, axis)
    raise ValueError(f"quant must be one of none|int8|mxfp8|nvfp4, got quant={quant!r}")
