"""Quantized matmul: weight containers, operand preparation and the pure-jnp reference.

Numerics (shared by every path): operands are dequantized to values exact in bf16
(E4M3 x 2^k, E2M1 x E4M3, int8), multiplied with f32 accumulation, and per-token / per-channel
FP32 scales (int8, NVFP4) are applied to the f32 result.
"""
# Dim letters: M rows (tokens), K contraction, N output channels, KB = K / block.
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import quant as Q

MODES = ("weight_only", "weight_act")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantizedWeight:
    """A [K,N] weight quantized along K: values [K,N], block scales [KB,N], per-channel f32 scale [N]."""
    values_KN: jax.Array
    block_scales_KBN: jax.Array | None
    channel_scale_N: jax.Array | None
    quant: str = dataclasses.field(metadata={"static": True}, default="none")


def quantize_weight(w_KN, quant: str) -> QuantizedWeight:
    """Quantize a [K,N] weight for qmatmul (blocks / scales along the contraction dim K)."""
    if quant == "int8":
        q, s = Q.quantize_int8(w_KN, axis=0)
        return QuantizedWeight(q, None, s[0], "int8")
    if quant == "mxfp8":
        v, s = Q.quantize_mxfp8(w_KN, axis=0)
        return QuantizedWeight(v, s, None, "mxfp8")
    if quant == "nvfp4":
        v, bs, ts = Q.quantize_nvfp4(jnp.swapaxes(w_KN, 0, 1))  # per output channel
        return QuantizedWeight(v.T, bs.T, ts, "nvfp4")
    raise ValueError(f"quant must be one of int8|mxfp8|nvfp4 for a QuantizedWeight, got quant={quant!r}")


def quantize_activation(x_MK, quant: str):
    """Per-token activation quantization: (values [M,K], block scales [M,KB] or None, row scale [M] or None)."""
    if quant == "int8":
        q, s = Q.quantize_int8(x_MK, axis=-1)
        return q, None, s[:, 0]
    if quant == "mxfp8":
        v, s = Q.quantize_mxfp8(x_MK, axis=-1)
        return v, s, None
    if quant == "nvfp4":
        return Q.quantize_nvfp4(x_MK, per_token=True)
    raise ValueError(f"bad quant={quant!r}")


def block_of(quant: str) -> int:
    """Block size along K of a quant format (1 for int8)."""
    return {"int8": 1, "mxfp8": Q.MX_BLOCK, "nvfp4": Q.NV_BLOCK}[quant]


def partial_dequant(values, block_scales, quant: str, axis: int):
    """values times their block scale (no per-token scale): exact in bf16; returns f32."""
    v = values.astype(jnp.float32)
    if block_scales is None:
        return v
    return v * jnp.repeat(block_scales.astype(jnp.float32), block_of(quant), axis=axis)


def qmatmul_reference(x_MK, w: QuantizedWeight, mode: str, preferred_element_type=jnp.float32):
    """Reference quantized matmul (f32 math, HIGHEST precision)."""
    hp = jax.lax.Precision.HIGHEST
    w_op = partial_dequant(w.values_KN, w.block_scales_KBN, w.quant, 0)
    if mode == "weight_only":
        x_op = x_MK.astype(jnp.bfloat16).astype(jnp.float32)
        row = None
    else:
        xv, xs, row = quantize_activation(x_MK, w.quant)
        x_op = partial_dequant(xv, xs, w.quant, 1)
    out = jnp.dot(x_op, w_op, precision=hp)
    if row is not None:
        out = out * row[:, None]
    if w.channel_scale_N is not None:
        out = out * w.channel_scale_N[None, :]
    return out.astype(preferred_element_type)
