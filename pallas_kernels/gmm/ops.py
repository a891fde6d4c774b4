"""Differentiable grouped matmul (custom_vjp) with quantized variants; dispatches reference/xla/pallas."""
# Dim letters: M rows (grouped tokens), K contraction, N output, G groups (experts).
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import quant as Q
from pallas_kernels._common import (
    check_ndim,
    cotangent_like,
    check_quant,
    interpret_params,
    is_concrete,
    pad_axis,
    round_up,
)
from pallas_kernels.gmm import reference, tpu, xla


def _gmm_raw(lhs_MK, rhs, group_sizes_G, impl, tiling, transpose_rhs=False, out_dtype=jnp.float32):
    """Grouped matmul accumulated in f32 on the chosen path, returned in out_dtype (the Mosaic
    kernel writes out_dtype itself: no f32 [M, N] copy); rhs is [G,N,K] when transpose_rhs."""
    if impl == "reference":
        r = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
        return reference.gmm_reference(lhs_MK, r, group_sizes_G, jnp.float32).astype(out_dtype)
    if impl == "xla":
        return xla.gmm_xla(lhs_MK, rhs, group_sizes_G, transpose_rhs=transpose_rhs).astype(out_dtype)
    if impl == "ragged":   # XLA's own grouped matmul (a grouped GEMM on GPU; a masked dense product on CPU)
        r = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
        return jax.lax.ragged_dot(lhs_MK, r.astype(lhs_MK.dtype), group_sizes_G,
                                  preferred_element_type=jnp.float32).astype(out_dtype)
    return tpu.gmm_tpu(lhs_MK, rhs, group_sizes_G, transpose_rhs=transpose_rhs, preferred_element_type=out_dtype,
                       tiling=tiling,
                       interpret=interpret_params(impl, lhs_MK, rhs, group_sizes_G))


def _tgmm_raw(lhs_MK, dy_MN, group_sizes_G, impl, tiling, out_dtype=jnp.float32):
    """Per-group lhs^T dy accumulated in f32, returned in out_dtype (written by the kernel itself)."""
    if impl == "reference":
        return reference.tgmm_reference(lhs_MK, dy_MN, group_sizes_G, jnp.float32).astype(out_dtype)
    if impl == "xla":
        return xla.tgmm_xla(lhs_MK, dy_MN, group_sizes_G).astype(out_dtype)
    if impl == "ragged":   # ragged contraction over the rows: one [K, N] product per group
        dn = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                               lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
        return jax.lax.ragged_dot_general(lhs_MK, dy_MN.astype(lhs_MK.dtype), group_sizes_G, dn,
                                          preferred_element_type=jnp.float32).astype(out_dtype)
    return tpu.tgmm_tpu(lhs_MK, dy_MN, group_sizes_G, preferred_element_type=out_dtype,
                        tiling=tiling,
                        interpret=interpret_params(impl, lhs_MK, dy_MN, group_sizes_G))


def _mx8(x, axis):
    """MXFP8 quantize-dequantize; exact in bf16 (E4M3 times a power of two)."""
    return Q.fake_quant(x, "mxfp8", axis).astype(jnp.bfloat16)


def _row_group_scale(col_scale_GN, group_sizes_G, m):
    gid_M = jnp.minimum(reference.group_ids_M(group_sizes_G, m), col_scale_GN.shape[0] - 1)
    return col_scale_GN[gid_M]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantizedExperts:
    """Expert weights quantized along K: values [G,K,N], block scales [G,K/B,N], FP32 channel scale [G,N]."""
    values_GKN: jax.Array
    block_scales_GKBN: jax.Array | None
    channel_scale_GN: jax.Array | None
    quant: str = dataclasses.field(metadata={"static": True}, default="none")


def quantize_experts(rhs_GKN, quant: str) -> QuantizedExperts:
    """Quantize [G,K,N] expert weights once (for inference); gmm accepts the result as rhs."""
    if quant == "mxfp8":
        v, s = Q.quantize_mxfp8(rhs_GKN, 1)
        return QuantizedExperts(v, s, None, quant)
    if quant == "int8":
        q, s = Q.quantize_int8(rhs_GKN, axis=1)               # per expert, per output channel
        return QuantizedExperts(q, None, s[:, 0, :], quant)
    if quant == "nvfp4":
        v, b, t = Q.quantize_nvfp4(jnp.swapaxes(rhs_GKN, 1, 2))  # per expert, per output channel
        return QuantizedExperts(jnp.swapaxes(v, 1, 2), jnp.swapaxes(b, 1, 2), t, quant)
    raise ValueError(f"quant must be one of int8|mxfp8|nvfp4, got quant={quant!r}")


def _quantize_lhs(lhs_MK, quant):
    """Per-token lhs quantization: (values [M,K], block scales [M,K/B] or None, row scale [M] or None)."""
    if quant == "mxfp8":
        v, s = Q.quantize_mxfp8(lhs_MK, -1)
        return v, s, None
    if quant == "int8":
        q, s = Q.quantize_int8(lhs_MK, axis=-1)
        return q, None, s[:, 0]
    return Q.quantize_nvfp4(lhs_MK)


def _partial_dequant(values, block_scales, axis, blk):
    """values x block scale (no FP32 per-token scale): exact in bf16."""
    v = values.astype(jnp.float32)
    if block_scales is not None:
        v = v * jnp.repeat(block_scales.astype(jnp.float32), blk, axis=axis)
    return v.astype(jnp.bfloat16)


def _codes(values, quant):
    return Q.nvfp4_codes(values) if quant == "nvfp4" else values


def _quantized_forward(lhs_MK, qe: QuantizedExperts, group_sizes_G, impl, tiling):
    """Quantized forward in f32: exact bf16 operands (dequantized in VMEM on TPU), FP32 scales after."""
    quant = qe.quant
    blk = _QUANT_BLOCK[quant]
    lv, ls, row = _quantize_lhs(lhs_MK, quant)
    if impl in ("pallas", "interpret"):
        y = tpu.gmm_quantized_tpu(_codes(lv, quant), None if ls is None else ls.T, _codes(qe.values_GKN, quant),
                                  qe.block_scales_GKBN, group_sizes_G, blk=blk,
                                  code_scale=0.5 if quant == "nvfp4" else 1.0,
                                  tiling=tiling or tpu.DEFAULT_TILING,
                                  interpret=interpret_params(impl, lhs_MK, qe, group_sizes_G))
    else:
        y = _gmm_raw(_partial_dequant(lv, ls, 1, blk), _partial_dequant(qe.values_GKN, qe.block_scales_GKBN, 1, blk),
                     group_sizes_G, impl, tiling)
    if row is not None:
        y = y * row[:, None]
    if qe.channel_scale_GN is not None:
        y = y * _row_group_scale(qe.channel_scale_GN, group_sizes_G, lhs_MK.shape[0])
    return y


def _forward(lhs_MK, rhs_GKN, group_sizes_G, quant, impl, tiling, out_dtype):
    """Plain or quantized forward, accumulated in f32, in out_dtype."""
    if quant == "none":
        return _gmm_raw(lhs_MK, rhs_GKN, group_sizes_G, impl, tiling, out_dtype=out_dtype)
    return _quantized_forward(lhs_MK, quantize_experts(rhs_GKN, quant), group_sizes_G, impl, tiling).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _gmm_vjp(lhs_MK, rhs_GKN, group_sizes_G, quant, impl, tiling, out_dtype):
    return _forward(lhs_MK, rhs_GKN, group_sizes_G, quant, impl, tiling, out_dtype)


def _gmm_fwd(lhs_MK, rhs_GKN, group_sizes_G, quant, impl, tiling, out_dtype):
    out = _forward(lhs_MK, rhs_GKN, group_sizes_G, quant, impl, tiling, out_dtype)
    return out, (lhs_MK, rhs_GKN, group_sizes_G)


def _gmm_bwd(quant, impl, tiling, out_dtype, res, dy_MN):
    lhs_MK, rhs_GKN, group_sizes_G = res
    m = lhs_MK.shape[0]
    if quant == "none":
        # each gradient leaves its kernel in its primal's dtype (no f32 [M, K] / [G, K, N] copies)
        dlhs = _gmm_raw(dy_MN.astype(rhs_GKN.dtype), rhs_GKN, group_sizes_G, impl, tiling, transpose_rhs=True,
                        out_dtype=lhs_MK.dtype)
        drhs = _tgmm_raw(lhs_MK, dy_MN.astype(lhs_MK.dtype), group_sizes_G, impl, tiling, out_dtype=rhs_GKN.dtype)
    else:
        # Backward in MXFP8 (straight-through), blocks of 32 along each matmul's contraction dim.
        if impl in ("pallas", "interpret"):
            # fused dequant on a transposed MXFP8 copy of the weights ([G,N,K], blocks along N)
            dv, ds = Q.quantize_mxfp8(dy_MN, -1)
            wv, ws = Q.quantize_mxfp8(jnp.swapaxes(rhs_GKN, 1, 2), 1)
            dlhs = tpu.gmm_quantized_tpu(dv, ds.T, wv, ws, group_sizes_G, blk=Q.MX_BLOCK,
                                         tiling=tiling or tpu.DEFAULT_TILING,
                                         interpret=interpret_params(impl, dy_MN, rhs_GKN, group_sizes_G))
        else:
            dlhs = _gmm_raw(_mx8(dy_MN, -1), _mx8(rhs_GKN, 2), group_sizes_G, impl, tiling, transpose_rhs=True)
        mp = round_up(m, Q.MX_BLOCK)
        if impl in ("pallas", "interpret"):
            lv, ls = Q.quantize_mxfp8(pad_axis(lhs_MK, 0, mp), 0)
            dv, ds = Q.quantize_mxfp8(pad_axis(dy_MN, 0, mp), 0)
            drhs = tpu.tgmm_mxfp8_tpu(lv, ls, dv, ds, group_sizes_G, tiling=tiling or tpu.DEFAULT_TILING,
                                      interpret=interpret_params(impl, lhs_MK, dy_MN, group_sizes_G))
        else:
            lhs_q = _mx8(pad_axis(lhs_MK, 0, mp), 0)[:m]
            dy_q = _mx8(pad_axis(dy_MN, 0, mp), 0)[:m]
            drhs = _tgmm_raw(lhs_q, dy_q, group_sizes_G, impl, tiling)
    dgs = np.zeros(group_sizes_G.shape, dtype=jax.dtypes.float0)
    # inside shard_map: rows vary over the token axes, expert weights only over the EP axes
    return (cotangent_like(dlhs.astype(lhs_MK.dtype), lhs_MK), cotangent_like(drhs.astype(rhs_GKN.dtype), rhs_GKN),
            dgs)


_gmm_vjp.defvjp(_gmm_fwd, _gmm_bwd)

_QUANT_BLOCK = {"none": 1, "int8": 1, "mxfp8": Q.MX_BLOCK, "nvfp4": Q.NV_BLOCK}


def validate_gmm(lhs_MK, rhs_GKN, group_sizes_G, quant):
    """Raise ValueError naming the bad argument."""
    check_quant(quant)
    check_ndim("lhs_MK", lhs_MK, 2, "M, K")
    check_ndim("rhs_GKN", rhs_GKN, 3, "G, K, N")
    check_ndim("group_sizes_G", group_sizes_G, 1, "G")
    if lhs_MK.shape[1] != rhs_GKN.shape[1]:
        raise ValueError(f"lhs_MK K={lhs_MK.shape[1]} does not match rhs_GKN K={rhs_GKN.shape[1]}")
    if group_sizes_G.shape[0] != rhs_GKN.shape[0]:
        raise ValueError(f"group_sizes_G has {group_sizes_G.shape[0]} groups, rhs_GKN has {rhs_GKN.shape[0]}")
    if not jnp.issubdtype(group_sizes_G.dtype, jnp.integer):
        raise ValueError(f"group_sizes_G must be integer, got {group_sizes_G.dtype}")
    b = _QUANT_BLOCK[quant]
    if lhs_MK.shape[1] % b:
        raise ValueError(f"quant={quant!r} needs K divisible by {b}; lhs_MK has K={lhs_MK.shape[1]}")
    if quant != "none" and rhs_GKN.shape[2] % Q.MX_BLOCK:
        raise ValueError(f"quant={quant!r} (MXFP8 backward) needs N divisible by {Q.MX_BLOCK}; "
                         f"rhs_GKN has N={rhs_GKN.shape[2]}")
    if is_concrete(group_sizes_G):
        gs = np.asarray(group_sizes_G)
        if (gs < 0).any():
            raise ValueError(f"group_sizes_G must be >= 0, got {gs}")
        if gs.sum() > lhs_MK.shape[0]:
            raise ValueError(f"group_sizes_G sums to {gs.sum()} > M={lhs_MK.shape[0]} rows of lhs_MK")


def gmm(lhs_MK, rhs_GKN, group_sizes_G, *, quant="none", preferred_element_type=jnp.float32,
        impl="xla", tiling=None):
    """Grouped matmul out[m] = lhs[m] @ rhs[group(m)], differentiable in lhs and rhs (rhs may be QuantizedExperts)."""
    if isinstance(rhs_GKN, QuantizedExperts):  # pre-quantized weights: inference, forward only
        validate_gmm(lhs_MK, rhs_GKN.values_GKN, group_sizes_G, rhs_GKN.quant)
        out = _quantized_forward(lhs_MK, rhs_GKN, group_sizes_G.astype(jnp.int32), impl, tiling)
        return out.astype(preferred_element_type)
    validate_gmm(lhs_MK, rhs_GKN, group_sizes_G, quant)
    group_sizes_G = group_sizes_G.astype(jnp.int32)
    if impl == "reference" and quant == "none":
        return reference.gmm_reference(lhs_MK, rhs_GKN, group_sizes_G, preferred_element_type)
    return _gmm_vjp(lhs_MK, rhs_GKN, group_sizes_G, quant, impl,
                    tuple(tiling) if tiling else None, jnp.dtype(preferred_element_type))


def tgmm(lhs_MK, dy_MN, group_sizes_G, *, preferred_element_type=jnp.float32, impl="xla", tiling=None):
    """Per-group weight gradient out[g] = lhs[rows of g]^T @ dy[rows of g] -> [G,K,N]."""
    check_ndim("lhs_MK", lhs_MK, 2, "M, K")
    check_ndim("dy_MN", dy_MN, 2, "M, N")
    check_ndim("group_sizes_G", group_sizes_G, 1, "G")
    if lhs_MK.shape[0] != dy_MN.shape[0]:
        raise ValueError(f"lhs_MK has M={lhs_MK.shape[0]} rows, dy_MN has {dy_MN.shape[0]}")
    if is_concrete(group_sizes_G) and np.asarray(group_sizes_G).sum() > lhs_MK.shape[0]:
        raise ValueError(f"group_sizes_G sums past M={lhs_MK.shape[0]}")
    return _tgmm_raw(lhs_MK, dy_MN, group_sizes_G.astype(jnp.int32), impl, tiling,
                     out_dtype=jnp.dtype(preferred_element_type))
